"""Generator of the hub-layout samples under `corpus/hub/`: small local copies of FineWeb-Edu,
WikiText, OpenAssistant oasst1, GSM8K and databricks-dolly-15k (and, from lockstep.dev.hub_samples_chat,
the chat benchmarks ARC, MMLU and HumanEval) in each dataset's own file names, columns and dtypes,
and an eval bundle in the DCLM `eval_bundle.zip` layout, so that the loaders (lockstep.data.sources)
read them exactly as they read a real download. The text is our own, built here from templates and word
lists; none of it comes from the datasets themselves. The `rehearsal` preset trains on these files.

The committed files are exactly this module's output: `lockstep dev hub-samples` compares them
row by row (parquet bytes differ between pyarrow versions, rows do not) and `--write` regenerates
them. A dev tool: no stage imports it. Deterministic without a seeded library generator: every
choice is drawn from `random.Random(<text key>).random()`, whose sequence Python keeps fixed
across versions. Over 400 lines on purpose: the word lists are the data, each beside the
template that reads it."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import random
import uuid
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from lockstep.core.io import write_bytes_atomic
from lockstep.dev.hub_samples_chat import chat_sample_files

T = TypeVar("T")

# Where each dataset's files go under corpus/hub/, in the hub repository's own layout.
FINEWEB_EDU = "fineweb-edu"  # HuggingFaceFW/fineweb-edu: data/<dump>/train-NNNNN-of-NNNNN.parquet
WIKITEXT = "wikitext"  # Salesforce/wikitext: <config>/<split>-00000-of-00001.parquet
OASST1 = "oasst1"  # OpenAssistant/oasst1: data/<split>-00000-of-00001-<hash>.parquet (flat rows)
OASST1_TREES = "oasst1-trees"  # the same trees as the project's `*.trees.jsonl.gz` export, unsplit
GSM8K = "gsm8k"  # openai/gsm8k: main/{train,test}-00000-of-00001.parquet
DOLLY15K = "dolly15k"  # databricks/databricks-dolly-15k: databricks-dolly-15k.jsonl
DCLM_CORE = (
    "dclm-core"  # the DCLM eval bundle: eval_bundle.zip holding eval_bundle/{core.yaml, eval_meta_data.csv, eval_data/}
)
FINEWEB_DUMP = "CC-MAIN-2024-10"
WIKITEXT_CONFIG = "wikitext-103-raw-v1"

FINEWEB_PAGES = 320  # ~290 KB of text: enough to train a 1,024-token BPE vocabulary
WIKITEXT_ARTICLES = {"train": 40, "validation": 6, "test": 6}
OASST1_TREES_PER_SPLIT = {"train": 48, "validation": 8}
GSM8K_PROBLEMS = {"train": 160, "test": 40}
DOLLY_RECORDS = 120
BUNDLE_ITEMS = 40  # per task of the sample eval bundle


class HubSampleError(ValueError):
    """A template produced a bad sample (a duplicate, a GSM8K test problem also in train)."""


class _Draw:
    """Choices keyed by text: `random.Random(key).random()` is the one sequence Python promises
    not to change, so choices are built on it alone (not on `choice` or `randint`)."""

    def __init__(self, *key: object) -> None:
        self.r = random.Random("\x1f".join(map(str, key)))

    def int(self, lo: int, hi: int) -> int:
        """Uniform in [lo, hi]."""
        return lo + int(self.r.random() * (hi - lo + 1))

    def pick(self, seq: Sequence[T]) -> T:
        return seq[self.int(0, len(seq) - 1)]

    def chance(self, p: float) -> bool:
        return self.r.random() < p


def _uuid(*key: object) -> str:
    return str(uuid.UUID(bytes=hashlib.sha256("\x1f".join(map(str, key)).encode()).digest()[:16], version=4))


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


# ---------------------------------------------------------------------------------------------
# Prose: short explanatory pages. Each topic brings its own nouns; the sentence frames are shared.

TOPICS = (
    ("tides", "the sea", ("the moon", "the shoreline", "a harbour", "the water level", "a tide table")),
    ("bread dough", "the kitchen", ("yeast", "flour", "the crust", "a proofing basket", "warm water")),
    ("bicycle gears", "machines", ("the chain", "a sprocket", "the rear wheel", "a derailleur", "the pedals")),
    ("volcanoes", "the earth", ("magma", "the crater", "a lava flow", "ash clouds", "the mantle")),
    ("honey bees", "living things", ("the hive", "a worker bee", "nectar", "the queen", "pollen")),
    ("rainbows", "light", ("a raindrop", "sunlight", "the colour red", "an observer", "the horizon")),
    ("compost heaps", "the garden", ("leaf litter", "worms", "kitchen scraps", "the soil", "a wooden bin")),
    ("lighthouses", "the coast", ("the lamp", "a lens", "the keeper", "passing ships", "the tower")),
    ("clocks", "machines", ("a pendulum", "the escapement", "a gear train", "the hands", "a spring")),
    ("glaciers", "the earth", ("snowfall", "a valley", "meltwater", "the ice sheet", "boulders")),
    ("bird migration", "living things", ("a flock", "the stars", "feeding grounds", "the wind", "a nesting site")),
    ("the water cycle", "the sky", ("clouds", "evaporation", "a river", "the ocean", "rain")),
    ("fractions", "numbers", ("a numerator", "the denominator", "a pizza slice", "a number line", "halves")),
    ("maps", "places", ("a scale bar", "contour lines", "a compass rose", "the legend", "a grid")),
    ("libraries", "places", ("a catalogue", "the shelves", "a librarian", "a reading room", "old newspapers")),
    ("sundials", "light", ("the gnomon", "a shadow", "noon", "the dial plate", "the seasons")),
    ("earthworms", "living things", ("the soil", "tunnels", "dead leaves", "rain", "a garden bed")),
    ("windmills", "machines", ("the sails", "a millstone", "the wind", "grain", "the cap")),
    ("printing presses", "machines", ("movable type", "ink", "a sheet of paper", "the platen", "a printer")),
    ("coral reefs", "the sea", ("a polyp", "warm water", "algae", "small fish", "the reef crest")),
    ("thunderstorms", "the sky", ("lightning", "a cumulus cloud", "thunder", "warm air", "hail")),
    ("seeds", "the garden", ("a seed coat", "the root", "a first leaf", "water", "sunlight")),
    ("canals", "places", ("a lock gate", "a towpath", "narrow boats", "the water level", "a lock keeper")),
    ("telescopes", "light", ("a lens", "a mirror", "the eyepiece", "distant stars", "the tube")),
)

PEOPLE = ("a teacher", "a student", "a farmer", "an engineer", "a sailor", "a baker", "a gardener", "a scientist",
          "a child", "a visitor", "a builder", "a traveller")
ADJECTIVES = ("small", "steady", "simple", "careful", "slow", "bright", "heavy", "quiet", "narrow", "gentle", "useful",
              "clever", "old", "common", "patient")
VERBS = ("moves", "changes", "holds", "turns", "guides", "feeds", "shapes", "carries", "protects", "measures")

SENTENCES = (
    "{Topic} are easier to understand once you look at {n1} and {n2} together.",
    "Most people first notice {topic} when {n1} {verb} {n2}.",
    "A {adj} way to think about it is that {n1} {verb} {n2}, one step at a time.",
    "If you ask {person} about {topic}, they will probably start with {n1}.",
    "Over about {k} years, {n1} can change the way {n2} behaves.",
    "The important idea is that {n1} never works alone: {n2} matters just as much.",
    "In many places, {person} keeps a note of {n1} every {k} days.",
    "Scientists still argue about how much {n1} really {verb} {n2}.",
    "One {adj} experiment uses {n1}, a ruler and {k} minutes of patience.",
    "It helps to draw {n1} and {n2} on paper and label each part.",
    "Without {n1}, {topic} would look very different from what we see today.",
    "You can see this in {n1} on a {adj} morning, when {n2} is easy to watch.",
    "There are at least {k} kinds of {n1}, and each one {verb} {n2} a little differently.",
    "A common mistake is to think that {n1} and {n2} are the same thing.",
    "When {person} explains {topic} to a class, {n1} is usually the first example.",
)
HEADINGS = ("Why it matters", "A closer look", "Things to try", "A short history", "Common questions",
            "What to remember", "How it works")
SITES = (
    "learnwell",
    "classnotes",
    "openlessons",
    "fieldguide",
    "brightpages",
    "homestudy",
    "wonderwiki",
    "kidsexplain",
)


def _sentence(d: _Draw, topic: str, nouns: Sequence[str]) -> str:
    n1 = d.pick(nouns)
    n2 = d.pick([n for n in nouns if n != n1])
    frame = d.pick(SENTENCES)
    s = frame.format(topic=topic, Topic=_cap(topic), n1=n1, n2=n2, verb=d.pick(VERBS), adj=d.pick(ADJECTIVES),
                     person=d.pick(PEOPLE), k=d.int(2, 40))
    return _cap(s)


def _paragraph(d: _Draw, topic: str, nouns: Sequence[str], n: int) -> str:
    return " ".join(_sentence(d, topic, nouns) for _ in range(n))


def page_text(i: int) -> tuple[str, str]:
    """(text, topic) of explanatory page `i`: a title, paragraphs and sometimes headed sections."""
    d = _Draw("page", i)
    topic, _field, nouns = TOPICS[i % len(TOPICS)]
    title = d.pick(("How {t} work", "An introduction to {t}", "Understanding {t}", "{T}: the basics",
                    "What everyone should know about {t}")).format(t=topic, T=_cap(topic))
    parts = [title, _paragraph(d, topic, nouns, d.int(3, 5))]
    for _ in range(d.int(1, 3)):
        if d.chance(0.5):
            parts.append(d.pick(HEADINGS))
        parts.append(_paragraph(d, topic, nouns, d.int(2, 5)))
    return "\n\n".join(parts), topic


# ---------------------------------------------------------------------------------------------
# FineWeb-Edu: one parquet file of the dump, in the dataset's full schema and dtypes.

FINEWEB_SCHEMA = pa.schema([
    ("text", pa.string()), ("id", pa.string()), ("dump", pa.string()), ("url", pa.string()),
    ("file_path", pa.string()), ("language", pa.string()), ("language_score", pa.float64()),
    ("token_count", pa.int64()), ("score", pa.float64()), ("int_score", pa.int64()),
])


def fineweb_rows() -> list[dict[str, Any]]:
    rows = []
    for i in range(FINEWEB_PAGES):
        d = _Draw("fineweb", i)
        text, topic = page_text(i)
        score = round(2.5 + d.int(0, 180) / 100, 6)  # fineweb-edu keeps pages whose score rounds to >= 3
        segment = f"1707947{d.int(470000, 479999)}.{d.int(0, 9)}"
        rows.append({
            "text": text,
            "id": f"<urn:uuid:{_uuid('fineweb', i)}>",
            "dump": FINEWEB_DUMP,
            "url": f"https://{d.pick(SITES)}.example/{topic.replace(' ', '-')}/{i}",
            "file_path": f"s3://commoncrawl/crawl-data/{FINEWEB_DUMP}/segments/{segment}/warc/"
                         f"CC-MAIN-20240220211055-20240221001055-{d.int(0, 899):05d}.warc.gz",
            "language": "en",
            "language_score": round(0.9 + d.int(0, 99) / 1000, 6),
            "token_count": len(text.split()) * 4 // 3,
            "score": score,
            "int_score": int(score + 0.5),
        })
    return rows


# ---------------------------------------------------------------------------------------------
# WikiText: HF rows are lines with their `\n`, `""` blank rows, ` = Title = ` and ` = = Section = = `.

PLACE_PARTS = (("Harrow", "Elm", "Stone", "Marsh", "Ash", "Copper", "Willow", "Raven", "Thorn", "Oak", "Salt",
                "Hollow", "Bright", "Cold", "Fox", "Heron"),
               ("ford", "wick", "mere", "dale", "ton", "by", "stead", "moor", "field", "brook"))
KINDS = (
    ("Bridge", "bridge", ("span", "arches", "river crossing", "stone piers", "toll house")),
    ("Lighthouse", "lighthouse", ("lamp room", "keeper's cottage", "fog signal", "tower", "lantern")),
    ("Railway Station", "railway station", ("platforms", "goods yard", "signal box", "booking hall", "footbridge")),
    ("Mill", "watermill", ("mill race", "wheel", "grinding floor", "sluice", "granary")),
    ("Canal", "canal", ("locks", "towpath", "aqueduct", "basin", "tunnel")),
    ("Hall", "country house", ("east wing", "gardens", "library", "stables", "chapel")),
)
EVENTS = ("was rebuilt after a flood", "was extended", "changed owners", "was closed for repairs",
          "was surveyed", "was listed as a protected building", "reopened to the public", "was damaged by a storm")


def _place(d: _Draw) -> str:
    return d.pick(PLACE_PARTS[0]) + d.pick(PLACE_PARTS[1])


def _wiki_number(n: int) -> str:
    # WikiText's tokenisation: `1 @,@ 200` and `3 @.@ 5` for separators inside numbers.
    return f"{n:,}".replace(",", " @,@ ")


def wikitext_article(split: str, i: int) -> list[str]:
    """One article as HF rows (each line with its `\\n`, blank rows as "")."""
    d = _Draw("wikitext", split, i)
    kind, noun, parts = d.pick(KINDS)
    place = _place(d)
    title = f"{place} {kind}"
    year = d.int(1700, 1950)
    rows = ["", f" = {title} = \n", ""]
    rows.append(f" The {title} is a {noun} near {place} , built in {year} . It is known for its {d.pick(parts)} "
                f"and its {d.pick(parts)} , and it {d.pick(EVENTS)} in {year + d.int(5, 60)} . \n")
    rows.append("")
    for section in ("History", "Description", "Later years")[: d.int(2, 3)]:
        rows += [f" = = {section} = = \n", ""]
        for _ in range(d.int(1, 2)):
            y = year + d.int(1, 120)
            rows.append(f" In {y} the {noun} {d.pick(EVENTS)} . The {d.pick(parts)} was {d.int(3, 90)} @.@ "
                        f"{d.int(1, 9)} metres long , and about {_wiki_number(d.int(200, 9000))} people used it each "
                        f"year . Its {d.pick(parts)} {d.pick(EVENTS)} in {y + d.int(1, 30)} . \n")
            rows.append("")
    return rows


def wikitext_rows(split: str) -> list[dict[str, str]]:
    return [{"text": line} for i in range(WIKITEXT_ARTICLES[split]) for line in wikitext_article(split, i)]


# ---------------------------------------------------------------------------------------------
# OpenAssistant oasst1: message trees with ranked, deleted and non-English replies.

QUESTIONS = (
    "Can you explain {t} in simple words?",
    "What is the most important thing to know about {t}?",
    "I am teaching a class about {t}. Where should I start?",
    "Why do people say that {n} matters so much for {t}?",
    "How would you describe {t} to a ten year old?",
)
FOLLOW_UPS = ("Thanks! Can you give me an example with {n}?", "That helps. What is a common mistake people make?",
              "Could you make that shorter?", "How does {n} fit into this?")
OTHER_LANG_REPLIES = (("de", "Das ist eine gute Frage. Ich erkläre es gern Schritt für Schritt."),
                      ("es", "Buena pregunta. Te lo explico paso a paso con un ejemplo sencillo."),
                      ("fr", "Bonne question. Voici une explication courte et simple."))
OTHER_LANG_PROMPTS = (("de", "Wie funktioniert das genau? Bitte kurz erklären."),
                      ("es", "¿Me puedes explicar cómo funciona esto?"))


def _reply(d: _Draw, topic: str, nouns: Sequence[str]) -> str:
    return _paragraph(d, topic, nouns, d.int(2, 4))


def oasst1_tree(split: str, i: int) -> dict[str, Any]:
    """One message tree in the export layout (each message with its `replies`)."""
    d = _Draw("oasst1", split, i)
    topic, _field, nouns = TOPICS[(i * 7 + (split == "validation")) % len(TOPICS)]
    tree_id = _uuid("oasst1", split, i, "root")
    counter = iter(range(10_000))

    def message(role: str, text: str, parent: str | None, *, rank: int | None = None, lang: str = "en",
                deleted: bool = False) -> dict[str, Any]:
        mid = tree_id if parent is None else _uuid("oasst1", split, i, next(counter))
        return {"message_id": mid, "parent_id": parent, "user_id": _uuid("user", d.int(0, 60)),
                "created_date": f"2023-0{d.int(2, 4)}-{d.int(10, 28)}T{d.int(10, 23)}:{d.int(10, 59)}:00.000000+00:00",
                "text": text, "role": role, "lang": lang, "review_count": d.int(3, 5), "review_result": True,
                "deleted": deleted, "rank": rank, "synthetic": False, "model_name": None,
                "message_tree_id": tree_id, "tree_state": "ready_for_export", "replies": []}

    if i % 12 == 11:  # a prompt in another language: the whole tree is filtered out with lang: en
        lang, text = d.pick(OTHER_LANG_PROMPTS)
        root = message("prompter", text, None, lang=lang)
        root["replies"].append(
            message("assistant", d.pick(OTHER_LANG_REPLIES)[1], root["message_id"], rank=0, lang=lang)
        )
        return root
    root = message("prompter", d.pick(QUESTIONS).format(t=topic, n=d.pick(nouns)), None)
    node, turns = root, d.int(1, 3)  # assistant turns along the best path
    for turn in range(turns):
        n_ranked = d.int(1, 3)
        replies = [message("assistant", _reply(d, topic, nouns), node["message_id"], rank=r) for r in range(n_ranked)]
        if d.chance(0.3):  # the best-ranked reply was deleted by moderators: the next one is followed
            replies[0]["deleted"] = True
            if n_ranked == 1:
                replies.append(message("assistant", _reply(d, topic, nouns), node["message_id"], rank=1))
        if d.chance(0.3):  # a sibling in another language, ranked first: skipped with lang: en
            lang, text = d.pick(OTHER_LANG_REPLIES)
            replies.insert(0, message("assistant", text, node["message_id"], rank=0, lang=lang))
            for r in replies[1:]:
                r["rank"] += 1
        node["replies"] = replies
        best = next(r for r in replies if not r["deleted"] and r["lang"] == "en")
        if turn == turns - 1:
            break
        follow = message("prompter", d.pick(FOLLOW_UPS).format(n=d.pick(nouns)), best["message_id"])
        best["replies"].append(follow)
        node = follow
    if d.chance(0.25):  # a last prompt nobody answered: the conversation ends at the reply before it
        best["replies"].append(
            message("prompter", "One more question: is there a good book on this?", best["message_id"])
        )
    return root


def _flatten(root: dict[str, Any]) -> list[dict[str, Any]]:
    out, stack = [], [root]
    while stack:
        m = stack.pop(0)
        out.append({k: v for k, v in m.items() if k != "replies"})
        stack[:0] = m["replies"]
    return out


def _no_tree_fields(m: dict[str, Any]) -> dict[str, Any]:
    # The export keeps tree membership in the line, not in each message.
    return {**{k: v for k, v in m.items() if k not in ("message_tree_id", "tree_state", "replies")},
            "replies": [_no_tree_fields(r) for r in m["replies"]]}


OASST1_SCHEMA = pa.schema([
    ("message_id", pa.string()), ("parent_id", pa.string()), ("user_id", pa.string()), ("created_date", pa.string()),
    ("text", pa.string()), ("role", pa.string()), ("lang", pa.string()), ("review_count", pa.int32()),
    ("review_result", pa.bool_()), ("deleted", pa.bool_()), ("rank", pa.float64()), ("synthetic", pa.bool_()),
    ("model_name", pa.string()), ("message_tree_id", pa.string()), ("tree_state", pa.string()),
])


def oasst1_trees(split: str) -> list[dict[str, Any]]:
    return [oasst1_tree(split, i) for i in range(OASST1_TREES_PER_SPLIT[split])]


def oasst1_export_lines() -> list[dict[str, Any]]:
    """The trees of both splits as lines of the `*.trees.jsonl.gz` export (which has no split)."""
    return [{"message_tree_id": t["message_id"], "tree_state": "ready_for_export", "prompt": _no_tree_fields(t)}
            for split in OASST1_TREES_PER_SPLIT for t in oasst1_trees(split)]


# ---------------------------------------------------------------------------------------------
# GSM8K: word problems with calculator annotations `<<a*b=c>>` and a final `#### N`.

NAMES = ("Ada", "Bram", "Chloe", "Dev", "Esme", "Farid", "Greta", "Hugo", "Ines", "Jonah", "Kira", "Luca", "Mina",
         "Nils", "Olga", "Pavel", "Rosa", "Sami", "Tess", "Umar", "Vera", "Wren", "Yusuf", "Zora")
GOODS = (("crate", "apples"), ("box", "pencils"), ("bag", "marbles"), ("tray", "muffins"), ("pack", "stickers"),
         ("jar", "buttons"), ("sack", "potatoes"), ("carton", "eggs"), ("bundle", "sticks"), ("roll", "stamps"))


def _n(x: int) -> str:
    """A number as GSM8K's question text writes it: commas from 1,000 on."""
    return f"{x:,}"


def gsm8k_problem(split: str, i: int) -> dict[str, str]:
    d = _Draw("gsm8k", split, i)
    name, other = d.pick(NAMES), d.pick(NAMES)
    unit, goods = d.pick(GOODS)
    form = i % 5
    if form == 0:  # two steps: a product, then a sum
        a, b, c = d.int(3, 40), d.int(12, 60), d.int(5, 90)
        ab = a * b
        q = (f"{name} buys {a} {unit}s of {goods} with {b} {goods} in each {unit}. {other} gives {name} {c} more "
             f"{goods}. How many {goods} does {name} have now?")
        ans = (f"The {unit}s hold {a}*{b} = <<{a}*{b}={ab}>>{ab} {goods}.\n"
               f"With the gift {name} has {ab}+{c} = <<{ab}+{c}={ab + c}>>{ab + c} {goods}.\n#### {ab + c}")
    elif form == 1:  # three steps, large numbers: the final answer keeps its commas
        a, b, c = d.int(120, 480), d.int(11, 30), d.int(2, 9)
        ab = a * b
        total = ab * c
        q = (f"A shop sells {a} {goods} a day at ${b} each. How many dollars does it take in over {c} days, "
             f"and what is that in total?")
        ans = (f"One day brings {a}*{b} = <<{a}*{b}={ab}>>{_n(ab)} dollars.\n"
               f"Over {c} days that is {ab}*{c} = <<{ab}*{c}={total}>>{_n(total)} dollars.\n"
               f"So the shop takes in ${_n(total)}.\n#### {_n(total)}")
    elif form == 2:  # one step, division that comes out even
        b, k = d.int(2, 12), d.int(3, 25)
        a = b * k
        q = f"{name} shares {a} {goods} equally among {b} friends. How many {goods} does each friend get?"
        ans = f"Each friend gets {a}/{b} = <<{a}/{b}={k}>>{k} {goods}.\n#### {k}"
    elif form == 3:  # two steps with subtraction
        a, b, c = d.int(1500, 9000), d.int(100, 900), d.int(50, 400)
        left = a - b - c
        q = (f"A {unit} factory made {_n(a)} {goods}. It shipped {b} on Monday and {c} on Tuesday. How many "
             f"{goods} are left?")
        ans = (f"After Monday {a}-{b} = <<{a}-{b}={a - b}>>{_n(a - b)} are left.\n"
               f"After Tuesday {a - b}-{c} = <<{a - b}-{c}={left}>>{_n(left)} are left.\n#### {left}")
    else:  # three steps: product, product, sum
        a, b, c, e = d.int(2, 9), d.int(3, 15), d.int(2, 9), d.int(4, 20)
        ab, ce = a * b, c * e
        q = (f"{name} packs {a} {unit}s with {b} {goods} each, and {other} packs {c} {unit}s with {e} {goods} "
             f"each. How many {goods} did they pack together?")
        ans = (f"{name} packed {a}*{b} = <<{a}*{b}={ab}>>{ab} {goods}.\n"
               f"{other} packed {c}*{e} = <<{c}*{e}={ce}>>{ce} {goods}.\n"
               f"Together that is {ab}+{ce} = <<{ab}+{ce}={ab + ce}>>{ab + ce} {goods}.\n#### {ab + ce}")
    return {"question": q, "answer": ans}


def gsm8k_rows(split: str) -> list[dict[str, str]]:
    return [gsm8k_problem(split, i) for i in range(GSM8K_PROBLEMS[split])]


# ---------------------------------------------------------------------------------------------
# databricks-dolly-15k: instruction, context (for the context-reading categories), response, category.

CONTEXT_CATEGORIES = ("closed_qa", "information_extraction", "summarization")
OPEN_CATEGORIES = ("open_qa", "general_qa", "brainstorming", "classification", "creative_writing")


def dolly_record(i: int) -> dict[str, str]:
    d = _Draw("dolly", i)
    topic, _field, nouns = TOPICS[(i * 5) % len(TOPICS)]
    category = (CONTEXT_CATEGORIES + OPEN_CATEGORIES)[i % 8]
    context = ""
    if category in CONTEXT_CATEGORIES:
        context = _paragraph(d, topic, nouns, d.int(3, 5))
        instruction = {"closed_qa": f"Based on the passage, what is said about {d.pick(nouns)}?",
                       "information_extraction": f"List the things related to {topic} that the text mentions.",
                       "summarization": f"Summarize this text about {topic} in two sentences."}[category]
        response = _paragraph(d, topic, nouns, 2)
    elif category == "brainstorming":
        instruction = f"Give me some ideas for a school project about {topic}."
        response = "\n".join(f"- A model of {n}" for n in nouns[: d.int(3, 5)])
    elif category == "classification":
        instruction = f"Which of these belong to {topic}: {', '.join(nouns[:3])}, a teapot, a violin?"
        response = f"{_cap(', '.join(nouns[:3]))} belong to {topic}; a teapot and a violin do not."
    elif category == "creative_writing":
        instruction = f"Write a short story about {d.pick(PEOPLE)} who discovers {d.pick(nouns)}."
        response = _paragraph(d, topic, nouns, d.int(3, 5))
    else:
        instruction = f"What is {d.pick(nouns)} and why does it matter for {topic}?"
        response = _paragraph(d, topic, nouns, d.int(2, 3))
    return {"instruction": instruction, "context": context, "response": response, "category": category}


# ---------------------------------------------------------------------------------------------
# The DCLM eval bundle's layout, with three tasks of our own (one per CORE task type) written
# from the page topics above: core.yaml, eval_meta_data.csv and eval_data/<category>/<task>.jsonl,
# zipped under eval_bundle/ as the published zip is.

FIELDS = tuple(dict.fromkeys(field for _t, field, _n in TOPICS))
BUNDLE_TASKS = (  # label, category, type, shots, random baseline (percent)
    ("topic_field", "world_knowledge", "multiple_choice", 3, 25),
    ("topic_schema", "commonsense_reasoning", "schema", 2, 50),
    ("count_on", "symbolic_problem_solving", "language_modeling", 3, 0),
)


def bundle_items(label: str) -> list[dict[str, Any]]:
    """BUNDLE_ITEMS items of task `label`, gold positions spread evenly."""
    out: list[dict[str, Any]] = []
    for i in range(BUNDLE_ITEMS):
        d = _Draw("bundle", label, i)
        topic, field, nouns = TOPICS[i % len(TOPICS)]
        if label == "topic_field":
            wrong = [f for f in FIELDS if f != field]
            choices = [wrong.pop(d.int(0, len(wrong) - 1)) for _ in range(3)]
            gold = i % 4
            choices.insert(gold, field)
            out.append({"query": f"{_cap(d.pick(PEOPLE))} reading about {topic} is learning about",
                        "choices": choices, "gold": gold})
        elif label == "topic_schema":
            other = TOPICS[(i + 1 + d.int(0, len(TOPICS) - 3)) % len(TOPICS)][0]
            options = [f"The page about {topic} explains", f"The page about {other} explains"]
            gold = i % 2
            out.append({"context_options": options if gold == 0 else options[::-1],
                        "continuation": f"{d.pick(nouns)} and {d.pick(ADJECTIVES)} things.", "gold": gold})
        else:
            start, step = d.int(1, 30), d.int(2, 9)
            seq = [start + step * k for k in range(d.int(3, 5) + 1)]
            out.append({"context": ", ".join(map(str, seq[:-1])) + ",", "continuation": str(seq[-1])})
    return out


def bundle_members() -> list[tuple[str, bytes]]:
    """(name, bytes) of each member of the sample eval_bundle.zip, folders as names ending in /."""
    yaml_lines = ["icl_tasks:"]
    csv_lines = ["Eval Task,Task Category,Task Type,#shots,Random baseline"]
    data: list[tuple[str, bytes]] = []
    for label, category, kind, shots, baseline in BUNDLE_TASKS:
        yaml_lines += [
            "-",
            f"  label: {label}",
            f"  dataset_uri: {category}/{label}.jsonl",
            f"  num_fewshot: [{shots}]",
            f"  icl_task_type: {kind}",
            "  continuation_delimiter: ' '",
        ]
        csv_lines.append(f"{label},{category.replace('_', ' ')},{kind.replace('_', ' ')},{shots},{baseline}")
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in bundle_items(label))
        data.append((f"eval_bundle/eval_data/{category}/{label}.jsonl", text.encode("utf-8")))
    folders = ["eval_bundle/", "eval_bundle/eval_data/",
               *sorted({name.rsplit("/", 1)[0] + "/" for name, _ in data})]
    return ([(f, b"") for f in folders]
            + [("eval_bundle/core.yaml", ("\n".join(yaml_lines) + "\n").encode()),
               ("eval_bundle/eval_meta_data.csv", ("\n".join(csv_lines) + "\n").encode())] + data)


@dataclass(frozen=True)
class ZipFile:
    """One generated zip archive: stored (not deflated) members with a fixed date, so its bytes,
    and so the sha256 the rehearsal pins, do not depend on the zlib build."""

    rel: str
    members: list[tuple[str, bytes]]

    def encode(self) -> bytes:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
            for name, data in self.members:
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = ((0o40755 if name.endswith("/") else 0o100644) << 16) | (
                    0x10 if name.endswith("/") else 0
                )
                zf.writestr(info, data)
        return buf.getvalue()

    def matches(self, path: Path) -> bool:
        return path.is_file() and path.read_bytes() == self.encode()


def dclm_bundle_sha256() -> str:
    """sha256 of the sample eval_bundle.zip (the rehearsal's `fetch.dclm_core.sha256`)."""
    return hashlib.sha256(ZipFile(f"{DCLM_CORE}/eval_bundle.zip", bundle_members()).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# The files, and the check that the committed ones are this output.


@dataclass(frozen=True)
class SampleFile:
    """One generated file: `rel` under corpus/hub/, its rows, and its parquet schema (None: JSON lines)."""

    rel: str
    rows: list[dict[str, Any]]
    schema: pa.Schema | None

    def encode(self) -> bytes:
        if self.schema is None:
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.rows).encode("utf-8")
            return gzip.compress(text, mtime=0) if self.rel.endswith(".gz") else text
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(self.rows, schema=self.schema), buf)
        return buf.getvalue()

    def matches(self, path: Path) -> bool:
        """Whether the file at `path` holds these rows (and, for parquet, this schema)."""
        if not path.is_file():
            return False
        if self.schema is None:
            if self.rel.endswith(".gz"):  # compressed bytes depend on the zlib build; the lines do not
                return gzip.decompress(path.read_bytes()) == gzip.decompress(self.encode())
            return path.read_bytes() == self.encode()
        table = pq.read_table(path)
        return table.schema.remove_metadata() == self.schema and table.to_pylist() == self.rows


def _shard_hash(*key: object) -> str:
    return hashlib.sha256("\x1f".join(map(str, key)).encode()).hexdigest()[:16]


def build_samples() -> list[SampleFile | ZipFile]:
    """Every file under corpus/hub/, in order; raises HubSampleError when the templates repeat
    themselves where the real data does not (a GSM8K test question also in train)."""
    gsm = {s: gsm8k_rows(s) for s in GSM8K_PROBLEMS}
    shared = {r["question"] for r in gsm["train"]} & {r["question"] for r in gsm["test"]}
    if shared:
        raise HubSampleError(f"gsm8k: {len(shared)} test question(s) also in train, e.g. {sorted(shared)[0]!r}")
    oasst_flat = {s: [m for t in oasst1_trees(s) for m in _flatten(t)] for s in OASST1_TREES_PER_SPLIT}
    files = [
        SampleFile(f"{FINEWEB_EDU}/data/{FINEWEB_DUMP}/train-00000-of-00001.parquet", fineweb_rows(), FINEWEB_SCHEMA),
        *(SampleFile(f"{WIKITEXT}/{WIKITEXT_CONFIG}/{s}-00000-of-00001.parquet", wikitext_rows(s),
                     pa.schema([("text", pa.string())])) for s in WIKITEXT_ARTICLES),
        *(SampleFile(f"{OASST1}/data/{s}-00000-of-00001-{_shard_hash('oasst1', s)}.parquet", rows, OASST1_SCHEMA)
          for s, rows in oasst_flat.items()),
        SampleFile(f"{OASST1_TREES}/2023-04-12_oasst_ready.trees.jsonl.gz", oasst1_export_lines(), None),
        *(SampleFile(f"{GSM8K}/main/{s}-00000-of-00001.parquet", rows,
                     pa.schema([("question", pa.string()), ("answer", pa.string())])) for s, rows in gsm.items()),
        SampleFile(f"{DOLLY15K}/databricks-dolly-15k.jsonl", [dolly_record(i) for i in range(DOLLY_RECORDS)], None),
        ZipFile(f"{DCLM_CORE}/eval_bundle.zip", bundle_members()),
    ]
    files += [SampleFile(rel, rows, schema) for rel, rows, schema in chat_sample_files()]  # ARC, MMLU, HumanEval
    return files


def _on_disk(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} if root.is_dir() else set()


def drifted(root: Path) -> list[str]:
    """Files under `root` (corpus/hub) that are missing, differ from the generator's output, or
    are not the generator's at all."""
    root = Path(root)
    samples = build_samples()
    found = [s.rel for s in samples if not s.matches(root / s.rel)]
    return found + sorted(_on_disk(root) - {s.rel for s in samples})


def write_samples(root: Path) -> list[str]:
    """Rewrite the files that differ (atomically, one by one) and remove files the generator no
    longer makes; return the paths touched."""
    root = Path(root)
    samples = build_samples()
    changed = []
    for s in samples:
        path = root / s.rel
        if not s.matches(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(path, s.encode())
            changed.append(s.rel)
    for rel in sorted(_on_disk(root) - {s.rel for s in samples}):
        (root / rel).unlink()
        changed.append(rel)
    return changed
