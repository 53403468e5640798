"""Deterministic GSM8K-format arithmetic word problems generated from the seed, in two families.

- `basic`: one to three operations (+, -, *, exact /) on small numbers, every number in the question
  used once and in the order it is read. A tiny model learns it within one stage: a format check.
- `multistep`: three or four operations over three to five facts given in a random order, some as
  words ("three times as many", "a quarter of"), steps that combine earlier results, and in half
  the problems a fact the solution does not use. Harder to get right than to format: headroom
  for RL.

Each step is annotated `<<a*b=c>>` (the calculator call) and the answer is `#### N`. Not a grader."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from lockstep.core.io import sha256_file
from lockstep.data.snapshot import SnapshotWriter
from lockstep.data.sources.common import Draw, generator
from lockstep.data.sources.fields import CheckedFields, Rule
from lockstep.data.sources.size import SourceSize, generated_examples

KIND = "problem"
EXTRA_FIELDS: tuple[str, ...] = ()
EXPECTED = "n_train + n_val > 0 problems to generate"

NAMES = (
    ("Ava", "She"), ("Ben", "He"), ("Chloe", "She"), ("Diego", "He"), ("Emma", "She"), ("Farid", "He"),
    ("Grace", "She"), ("Hiro", "He"), ("Isla", "She"), ("Jamal", "He"), ("Kira", "She"), ("Liam", "He"),
    ("Maya", "She"), ("Noah", "He"), ("Olga", "She"), ("Pedro", "He"), ("Quinn", "She"), ("Ravi", "He"),
    ("Sofia", "She"), ("Tomas", "He"), ("Uma", "She"), ("Victor", "He"), ("Wen", "She"), ("Yusuf", "He"),
)
OBJECTS = (
    "apples", "marbles", "stickers", "pencils", "cookies", "books", "shells", "stamps", "cards", "eggs",
    "balloons", "crayons", "oranges", "beads", "coins", "muffins", "toy cars", "flowers", "buttons", "plums",
)
ITEMS = (("notebook", "notebooks"), ("sandwich", "sandwiches"), ("ticket", "tickets"), ("toy", "toys"),
         ("plant", "plants"), ("scarf", "scarves"), ("ball", "balls"), ("kite", "kites"))


@dataclass(frozen=True)
class SynthMathConfig(CheckedFields):
    source: Literal["synth_math"] = "synth_math"
    n_train: int = 4000  # problems in train
    n_val: int = 200  # problems in val (none repeats a train question)
    family: Literal["basic", "multistep"] = "basic"  # which problem templates (module docstring)
    strict: bool = False  # unused (generated records are valid); kept for a uniform schema
    artifact_records: int = 8  # records per split kept in dataset_snapshot.json, the parity artifact

    RULES = {
        "n_train": Rule("problems generated for train", ge=0),
        "n_val": Rule("problems generated for val", ge=0),
        "family": Rule("problem family: basic (a format check) or multistep (headroom for RL)"),
        "artifact_records": Rule("records per split copied into dataset_snapshot.json", ge=0),
    }


def _step(a: int, op: str, b: int) -> tuple[str, int]:
    """The annotated step text `a op b = <<a op b=c>>c` and its value c."""
    c = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
    assert op != "/" or a % b == 0, "division must be exact"
    return f"{a} {op} {b} = <<{a}{op}{b}={c}>>{c}", c


def _add(d: Draw) -> tuple[str, str]:
    name, he = d.pick(NAMES)
    obj = d.pick(OBJECTS)
    a, b = d.int(2, 60), d.int(2, 40)
    s, c = _step(a, "+", b)
    return (f"{name} has {a} {obj}. {he} gets {b} more. How many {obj} does {name} have now?",
            f"{name} has {s} {obj} now.\n#### {c}")


def _sub(d: Draw) -> tuple[str, str]:
    (name, _), (friend, _) = d.pick(NAMES), d.pick(NAMES)
    obj = d.pick(OBJECTS)
    a = d.int(10, 90)
    b = d.int(1, a - 1)
    s, c = _step(a, "-", b)
    return (f"{name} had {a} {obj} and gave {b} of them to {friend}. How many {obj} does {name} have left?",
            f"{name} has {s} {obj} left.\n#### {c}")


def _mul(d: Draw) -> tuple[str, str]:
    name, he = d.pick(NAMES)
    obj = d.pick(OBJECTS)
    a, b = d.int(2, 12), d.int(2, 12)
    s, c = _step(a, "*", b)
    return (f"{name} buys {a} boxes of {obj}. Each box holds {b} {obj}. How many {obj} does {name} buy?",
            f"{name} buys {s} {obj}.\n#### {c}")


def _div(d: Draw) -> tuple[str, str]:
    name, he = d.pick(NAMES)
    obj = d.pick(OBJECTS)
    k, q = d.int(2, 10), d.int(2, 12)
    s, c = _step(k * q, "/", k)
    return (f"{name} shares {k * q} {obj} equally among {k} friends. How many {obj} does each friend get?",
            f"Each friend gets {s} {obj}.\n#### {c}")


def _mul_add(d: Draw) -> tuple[str, str]:
    name, he = d.pick(NAMES)
    obj = d.pick(OBJECTS)
    a, b, e = d.int(2, 9), d.int(2, 12), d.int(1, 30)
    s1, c1 = _step(a, "*", b)
    s2, c2 = _step(c1, "+", e)
    return (f"{name} has {a} bags with {b} {obj} in each bag, and {e} more {obj} on the table. "
            f"How many {obj} does {name} have in all?",
            f"The bags hold {s1} {obj}.\nIn all {name} has {s2} {obj}.\n#### {c2}")


def _add_sub(d: Draw) -> tuple[str, str]:
    name, he = d.pick(NAMES)
    obj = d.pick(OBJECTS)
    a, b = d.int(5, 50), d.int(5, 50)
    e = d.int(1, a + b - 1)
    s1, c1 = _step(a, "+", b)
    s2, c2 = _step(c1, "-", e)
    return (f"{name} picks {a} {obj} in the morning and {b} {obj} in the afternoon. "
            f"{he} gives away {e} {obj}. How many {obj} are left?",
            f"{name} picks {s1} {obj} in total.\nAfter giving some away, {s2} {obj} are left.\n#### {c2}")


def _div_add(d: Draw) -> tuple[str, str]:
    name, he = d.pick(NAMES)
    obj = d.pick(OBJECTS)
    k, q, e = d.int(2, 8), d.int(2, 10), d.int(1, 15)
    s1, c1 = _step(k * q, "/", k)
    s2, c2 = _step(c1, "+", e)
    return (f"{name} puts {k * q} {obj} equally into {k} jars. Then {he.lower()} adds {e} more {obj} to one jar. "
            f"How many {obj} are in that jar now?",
            f"Each jar gets {s1} {obj}.\nThat jar now has {s2} {obj}.\n#### {c2}")


def _change(d: Draw) -> tuple[str, str]:
    name, he = d.pick(NAMES)
    item, items = d.pick(ITEMS)
    price, n = d.int(2, 15), d.int(2, 6)
    cost = price * n
    bill = d.pick((20, 50, 100))
    while bill < cost:
        bill *= 2
    s1, c1 = _step(price, "*", n)
    s2, c2 = _step(bill, "-", c1)
    return (f"A {item} costs ${price}. {name} buys {n} {items} and pays with ${bill}. "
            f"How much change does {he.lower()} get?",
            f"The {items} cost {s1} dollars.\nThe change is {s2} dollars.\n#### {c2}")


def _wage(d: Draw) -> tuple[str, str]:
    name, he = d.pick(NAMES)
    rate, hours, days = d.int(5, 20), d.int(2, 8), d.int(2, 6)
    s1, c1 = _step(rate, "*", hours)
    s2, c2 = _step(c1, "*", days)
    spend = d.int(1, c2 - 1)
    s3, c3 = _step(c2, "-", spend)
    return (f"{name} earns ${rate} an hour and works {hours} hours a day for {days} days. "
            f"{he} then spends ${spend}. How many dollars does {he.lower()} have left?",
            f"Each day {name} earns {s1} dollars.\nOver {days} days that is {s2} dollars.\n"
            f"After spending, {s3} dollars are left.\n#### {c3}")


def _share_left(d: Draw) -> tuple[str, str]:
    (name, _), (friend, _) = d.pick(NAMES), d.pick(NAMES)
    obj = d.pick(OBJECTS)
    a, b = d.int(2, 8), d.int(3, 10)
    s1, c1 = _step(a, "*", b)
    k = d.pick([x for x in (2, 3, 4, 5, 6) if c1 % x == 0] or [1])
    if k == 1:
        s2, c2 = _step(c1, "-", b)
        return (f"{name} has {a} packs of {b} {obj} and gives one pack to {friend}. How many {obj} does {name} keep?",
                f"{name} has {s1} {obj}.\nAfter giving one pack away, {name} keeps {s2} {obj}.\n#### {c2}")
    s2, c2 = _step(c1, "/", k)
    s3, c3 = _step(c1, "-", c2)
    return (f"{name} has {a} packs of {b} {obj} and gives 1/{k} of all the {obj} to {friend}. "
            f"How many {obj} does {name} keep?",
            f"{name} has {s1} {obj}.\n{friend} gets {s2} {obj}.\n{name} keeps {s3} {obj}.\n#### {c3}")


TEMPLATES: tuple[Callable[[Draw], tuple[str, str]], ...] = (
    _add, _sub, _mul, _div, _mul_add, _add_sub, _div_add, _change, _wage, _share_left,
)


# --- multistep: facts in shuffled order, relations in words, a distractor -------------------------

RELATIVES = ("brother", "sister", "cousin", "neighbour", "teacher", "aunt", "uncle", "grandmother")
TIMES = {2: "twice", 3: "three times", 4: "four times", 5: "five times"}


def _problem(d: Draw, facts: list[str], question: str, steps: list[str], answer: int, name: str) -> tuple[str, str]:
    """Question: the facts in a random order, half the time with a fact the solution does not use,
    then the question. Solution: one line per step, then `#### answer`."""
    facts = list(facts)
    if d.uniform() < 0.5:
        facts.append(d.pick((
            f"{name}'s {d.pick(RELATIVES)} is {d.int(6, 70)} years old.",
            f"{name} lives {d.int(2, 30)} miles from the town.",
            f"{name} has {d.int(2, 9)} pets at home.",
            f"The shop opened {d.int(2, 25)} years ago.",
        )))
    order = torch.randperm(len(facts), generator=d.g).tolist()
    return " ".join([facts[i] for i in order] + [question]), "\n".join(steps) + f"\n#### {answer}"


def _people(d: Draw, k: int) -> list[str]:
    """`k` different first names."""
    out: list[str] = []
    while len(out) < k:
        name = d.pick(NAMES)[0]
        if name not in out:
            out.append(name)
    return out


def _shopping(d: Draw) -> tuple[str, str]:
    name, he = d.pick(NAMES)
    (i1, i1s), (i2, i2s) = d.pick(ITEMS[:4]), d.pick(ITEMS[4:])
    p1, n1, p2, n2 = d.int(3, 25), d.int(2, 9), d.int(2, 19), d.int(2, 9)
    cost = p1 * n1 + p2 * n2
    bill = 100 if cost < 100 else 200 if cost < 200 else 500
    s1, c1 = _step(n1, "*", p1)
    s2, c2 = _step(n2, "*", p2)
    s3, c3 = _step(c1, "+", c2)
    s4, c4 = _step(bill, "-", c3)
    facts = [f"{name} buys {n1} {i1s} and {n2} {i2s}.", f"A {i1} costs ${p1}.", f"A {i2} costs ${p2}.",
             f"{name} pays with a ${bill} bill."]
    return _problem(d, facts, f"How much change does {name} get?",
                    [f"The {i1s} cost {s1} dollars.", f"The {i2s} cost {s2} dollars.",
                     f"Together they cost {s3} dollars.", f"The change is {s4} dollars."], c4, name)


def _as_many(d: Draw) -> tuple[str, str]:
    """Three people; the second has k times the first, the third m fewer than the second."""
    a_name, b_name, c_name = _people(d, 3)
    obj = d.pick(OBJECTS)
    a, k = d.int(3, 30), d.pick(tuple(TIMES))
    m = d.int(1, a * k - 1)
    s1, c1 = _step(a, "*", k)
    s2, c2 = _step(c1, "-", m)
    s3, c3 = _step(a, "+", c1)
    s4, c4 = _step(c3, "+", c2)
    facts = [f"{a_name} has {a} {obj}.", f"{b_name} has {TIMES[k]} as many {obj} as {a_name}.",
             f"{c_name} has {m} fewer {obj} than {b_name}."]
    return _problem(d, facts, f"How many {obj} do {a_name}, {b_name} and {c_name} have together?",
                    [f"{b_name} has {s1} {obj}.", f"{c_name} has {s2} {obj}.",
                     f"{a_name} and {b_name} have {s3} {obj}.", f"All three have {s4} {obj}."],
                    c4, a_name)


def _garden(d: Draw) -> tuple[str, str]:
    name, _ = d.pick(NAMES)
    plant, plants = d.pick((("tree", "trees"), ("rose", "roses"), ("bush", "bushes"), ("plant", "plants")))
    rows, per = d.int(3, 12), d.int(4, 15)
    dead = d.int(1, rows * per // 2)
    more = d.int(5, 60)
    s1, c1 = _step(rows, "*", per)
    s2, c2 = _step(c1, "-", dead)
    s3, c3 = _step(c2, "+", more)
    facts = [f"{name} plants {rows} rows of {plants} with {per} {plants} in each row.",
             f"Later {dead} of those {plants} die.", f"{name} then plants {more} new {plants}."]
    return _problem(d, facts, f"How many {plants} does {name} have now?",
                    [f"{name} planted {s1} {plants}.", f"After some died, {s2} were left.",
                     f"With the new ones there are {s3} {plants}."], c3, name)


def _savings(d: Draw) -> tuple[str, str]:
    name, friend = _people(d, 2)
    w1, n1, w2, n2 = d.int(3, 30), d.int(2, 12), d.int(3, 30), d.int(2, 12)
    if w1 * n1 == w2 * n2:
        n2 += 1
    s1, c1 = _step(w1, "*", n1)
    s2, c2 = _step(w2, "*", n2)
    big, small = (name, friend) if c1 > c2 else (friend, name)
    s3, c3 = _step(max(c1, c2), "-", min(c1, c2))
    facts = [f"{name} saves ${w1} every week for {n1} weeks.", f"{friend} saves ${w2} every week for {n2} weeks."]
    return _problem(d, facts, "How many more dollars does the one who saved more have?",
                    [f"{name} saves {s1} dollars.", f"{friend} saves {s2} dollars.",
                     f"{big} has {s3} dollars more than {small}."], c3, name)


def _bags(d: Draw) -> tuple[str, str]:
    name, friend = _people(d, 2)
    obj = d.pick(OBJECTS)
    k, q = d.int(2, 9), d.int(3, 15)
    boxes, per = d.int(2, 9), d.int(4, 20)
    while boxes * per <= k * q:
        boxes += 1
    extra = boxes * per - k * q
    s1, c1 = _step(boxes, "*", per)
    s2, c2 = _step(c1, "-", extra)
    s3, c3 = _step(c2, "/", k)
    facts = [f"{name} has {boxes} boxes with {per} {obj} in each box.", f"{name} keeps {extra} {obj} for {friend}.",
             f"{name} puts all the other {obj} equally into {k} bags."]
    return _problem(d, facts, f"How many {obj} are in each bag?",
                    [f"{name} has {s1} {obj}.", f"Without {friend}'s, {s2} are left.",
                     f"Each bag gets {s3} {obj}."], c3, name)


def _bus(d: Draw) -> tuple[str, str]:
    name, _ = d.pick(NAMES)
    rows, seats = d.int(6, 15), d.int(2, 5)
    total = rows * seats
    a = d.int(3, total // 2)
    b = d.int(1, total - a - 1)
    off = d.int(1, a)
    s1, c1 = _step(rows, "*", seats)
    s2, c2 = _step(a, "+", b)
    s3, c3 = _step(c2, "-", off)
    s4, c4 = _step(c1, "-", c3)
    facts = [f"{name}'s bus has {rows} rows with {seats} seats in each row.",
             f"{a} people get on at the first stop.", f"At the second stop {off} people get off and {b} get on."]
    return _problem(d, facts, "How many seats are empty after the second stop?",
                    [f"The bus has {s1} seats.", f"{s2} people got on.", f"{s3} people are still on the bus.",
                     f"So {s4} seats are empty."], c4, name)


def _wages(d: Draw) -> tuple[str, str]:
    name, _ = d.pick(NAMES)
    r1, h1, r2, h2 = d.int(8, 25), d.int(2, 9), d.int(8, 25), d.int(2, 9)
    bike = d.int(5, r1 * h1 + r2 * h2 - 1)
    s1, c1 = _step(r1, "*", h1)
    s2, c2 = _step(r2, "*", h2)
    s3, c3 = _step(c1, "+", c2)
    s4, c4 = _step(c3, "-", bike)
    facts = [f"{name} earns ${r1} an hour at the cafe.", f"{name} earns ${r2} an hour at the library.",
             f"This week {name} works {h1} hours at the cafe and {h2} hours at the library.",
             f"{name} spends ${bike} on a bike."]
    return _problem(d, facts, "How many dollars are left?",
                    [f"The cafe pays {s1} dollars.", f"The library pays {s2} dollars.",
                     f"In all {name} earns {s3} dollars.", f"After the bike, {s4} dollars are left."], c4, name)


def _half_left(d: Draw) -> tuple[str, str]:
    name, friend = _people(d, 2)
    obj = d.pick(OBJECTS)
    k = d.pick((2, 3, 4))
    part = {2: "half", 3: "a third", 4: "a quarter"}[k]
    packs, per = d.int(2, 9), d.int(2, 10) * k
    more = d.int(2, 40)
    s1, c1 = _step(packs, "*", per)
    s2, c2 = _step(c1, "/", k)
    s3, c3 = _step(c1, "-", c2)
    s4, c4 = _step(c3, "+", more)
    facts = [f"{name} has {packs} packs of {obj} with {per} {obj} in each pack.",
             f"{name} gives {part} of all the {obj} to {friend}.", f"Later {name} finds {more} more {obj}."]
    return _problem(d, facts, f"How many {obj} does {name} have now?",
                    [f"{name} had {s1} {obj}.", f"{friend} got {s2} {obj}.", f"{name} kept {s3} {obj}.",
                     f"Now {name} has {s4} {obj}."], c4, name)


MULTISTEP: tuple[Callable[[Draw], tuple[str, str]], ...] = (
    _shopping, _as_many, _garden, _savings, _bags, _bus, _wages, _half_left,
)
FAMILIES = {"basic": TEMPLATES, "multistep": MULTISTEP}


def generate(n: int, seed: int, *, exclude: set[str] | None = None, stream: int = 0,
             family: str = "basic") -> list[dict[str, str]]:
    """`n` distinct problems of one family from the seed (none whose question is in `exclude`)."""
    templates = FAMILIES[family]
    d = Draw(generator(seed, stream=(10 if family == "basic" else 20) + stream))
    seen = set(exclude or ())
    out: list[dict[str, str]] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"synth_math: could not draw {n} distinct problems; lower n_train/n_val")
        question, answer = d.pick(templates)(d)
        if question in seen:
            continue
        seen.add(question)
        out.append({"question": question, "answer": answer})
    return out


def produce(cfg: SynthMathConfig, sink: SnapshotWriter, *, seed: int) -> dict[str, Any]:
    train = generate(cfg.n_train, seed, stream=0, family=cfg.family)
    val = generate(cfg.n_val, seed, exclude={p["question"] for p in train}, stream=1, family=cfg.family)
    for split, probs in (("train", train), ("val", val)):
        for i, p in enumerate(probs):
            sink.add(split, p, f"synth_math {split} {i}")
    return {"source_id": "lockstep:synth_math", "revision": "sha256:" + sha256_file(__file__), "streamed": False}


# Measured on the tiny preset's caches (4,096-id BPE): 419,045 tokens / 4,000 problems, and the
# multistep family's 784,003 / 4,000.
TOKENS_PER_EXAMPLE = {"basic": 105, "multistep": 196}


def size(cfg: SynthMathConfig, *, name: str, root: Path) -> SourceSize:
    """The problems its params ask for."""
    return generated_examples(
        name, n_train=cfg.n_train, n_val=cfg.n_val, tokens_per_example=TOKENS_PER_EXAMPLE[cfg.family]
    )
