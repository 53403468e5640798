"""Deterministic GSM8K-format arithmetic word problems generated from the seed: several templates,
names and objects, one to three operations (+, -, *, exact /), each step annotated `<<a*b=c>>`
and answered `#### N`. Small numbers, so a tiny model can learn them. Not a grader."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from lockstep.io import sha256_file
from lockstep.sources.common import Draw, generator
from lockstep.sources.fields import CheckedFields, Rule
from lockstep.snapshot import SnapshotWriter

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
    strict: bool = False  # unused (generated records are valid); kept for a uniform schema
    artifact_records: int = 8  # records per split kept in dataset_snapshot.json, the parity artifact

    RULES = {
        "n_train": Rule("problems generated for train", ge=0),
        "n_val": Rule("problems generated for val", ge=0),
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
    (name, he), (friend, _) = d.pick(NAMES), d.pick(NAMES)
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
    return (f"A {item} costs ${price}. {name} buys {n} {items} and pays with ${bill}. How much change does {he.lower()} get?",
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
    (name, he), (friend, _) = d.pick(NAMES), d.pick(NAMES)
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


def generate(n: int, seed: int, *, exclude: set[str] | None = None, stream: int = 0) -> list[dict[str, str]]:
    """`n` distinct problems from the seed (none whose question is in `exclude`)."""
    d = Draw(generator(seed, stream=10 + stream))
    seen = set(exclude or ())
    out: list[dict[str, str]] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"synth_math: could not draw {n} distinct problems; lower n_train/n_val")
        question, answer = d.pick(TEMPLATES)(d)
        if question in seen:
            continue
        seen.add(question)
        out.append({"question": question, "answer": answer})
    return out


def produce(cfg: SynthMathConfig, sink: SnapshotWriter, *, seed: int) -> dict[str, Any]:
    train = generate(cfg.n_train, seed, stream=0)
    val = generate(cfg.n_val, seed, exclude={p["question"] for p in train}, stream=1)
    for split, probs in (("train", train), ("val", val)):
        for i, p in enumerate(probs):
            sink.add(split, p, f"synth_math {split} {i}")
    return {"source_id": "lockstep:synth_math", "revision": "sha256:" + sha256_file(__file__), "streamed": False}
