"""SpellingBee: synthetic letter-counting conversations, the rule of nanochat's task of that name
in the project's own words and draws. A word is drawn from a word list, a letter either from the
word (half the time) or from the alphabet (often absent: answer 0), the question from a handful of
phrasings; the reply spells the word letter by letter, counts as it goes, checks the count with a
python call (`'word'.count('l')`) and ends with `#### <count>`, the final answer the eval reads.
Train and val are drawn from separate seeded streams of the data seed (lockstep.core.seeds), so the
same params give the same bytes. Not an evaluator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lockstep.core.io import sha256_file
from lockstep.data.snapshot import SnapshotWriter
from lockstep.data.sources.common import Draw, SourceFormatError, generator
from lockstep.data.sources.fields import CheckedFields, Rule
from lockstep.data.sources.size import SourceSize, generated_examples

KIND = "conversation"
EXTRA_FIELDS: tuple[str, ...] = ()
EXPECTED = "n_train + n_val > 0 conversations, over a word list of lowercase a-z words"
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
_TRAIN_STREAM, _VAL_STREAM = 30, 31

# The built-in word list: everyday words, short and long, with repeated letters. `words_path`
# replaces it with a file of one word per line (e.g. a downloaded English word list).
WORDS = (
    "strawberry", "raspberry", "blueberry", "banana", "apple", "orange", "lemon", "cherry", "mango", "papaya",
    "mississippi", "tennessee", "massachusetts", "connecticut", "bookkeeper", "committee", "balloon", "coffee",
    "toffee", "pepper", "giraffe", "elephant", "hippopotamus", "kangaroo", "alligator", "crocodile", "penguin",
    "parallel", "necessary", "occurrence", "success", "address", "possess", "embarrass", "accommodate",
    "millennium", "umbrella", "vacuum", "cinnamon", "broccoli", "zucchini", "spaghetti", "macaroni", "pineapple",
    "assessment", "bubble", "puzzle", "jazz", "pizza", "rhythm", "queue", "avocado", "alphabet", "character",
    "language", "keyboard", "computer", "program", "teacher", "garden", "window", "mountain", "river", "summer",
    "winter", "autumn", "spring", "yellow", "purple", "violet", "cheese", "sheep", "needle", "referee", "grammar",
    "cucumber", "butterfly", "chocolate", "library", "calendar", "february", "wednesday", "definitely",
    "separate", "restaurant", "beautiful", "business", "conscience", "daughter", "environment",
    "foreign", "government", "guarantee", "harass", "independent", "knowledge", "lightning", "maintenance",
    "neighbour", "occasion", "parliament", "possession", "recommend", "rhubarb", "schedule", "scissors",
    "sentence", "sincerely", "tomorrow", "tongue", "truly", "twelfth", "vegetable", "weird", "whistle",
    "bottle", "kettle", "little", "letter", "better", "butter", "matter", "pattern", "lettuce", "carrot",
    "tomato", "potato", "onion", "garlic", "parsley", "rosemary", "thyme", "basil", "oregano", "mushroom",
    "volcano", "glacier", "tornado", "hurricane", "thunder", "blizzard", "drizzle", "rainbow", "horizon",
    "telescope", "microscope", "satellite", "astronaut", "galaxy", "universe", "planet", "comet", "asteroid",
    "pyramid", "cathedral", "lighthouse", "windmill", "bridge", "tunnel", "harbour", "village", "kingdom",
    "dragon", "wizard", "knight", "castle", "princess", "treasure", "pirate", "parrot", "squirrel", "rabbit",
    "hedgehog", "raccoon", "buffalo", "gorilla", "chimpanzee", "flamingo", "peacock", "mosquito", "caterpillar",
    "grasshopper", "dolphin", "octopus", "jellyfish", "seahorse", "lobster", "oyster", "mammoth", "dinosaur",
    "skeleton", "football", "basketball", "volleyball", "baseball", "marathon", "triathlon",
    "bicycle", "motorcycle", "airplane", "helicopter", "submarine", "locomotive", "carriage", "wheelbarrow",
    "typewriter", "notebook", "pencil", "eraser", "stapler", "envelope", "bookshelf", "cupboard",
)


@dataclass(frozen=True)
class SpellingBeeConfig(CheckedFields):
    source: Literal["spelling_bee"] = "spelling_bee"
    n_train: int = 0  # conversations in train (0: an eval set only)
    n_val: int = 256  # conversations in val, the eval items
    words_path: str | None = None  # a file of words, one a line; null: the built-in list
    strict: bool = False  # unused (generated records are valid); kept for a uniform schema
    artifact_records: int = 8  # records per split kept in dataset_snapshot.json, the parity artifact

    RULES = {
        "n_train": Rule("conversations generated for train", ge=0),
        "n_val": Rule("conversations generated for val (the eval items)", ge=0),
        "artifact_records": Rule("records per split copied into dataset_snapshot.json", ge=0),
    }


_QUESTIONS = (
    "How many {l} are in {w}?",
    "How many times does the letter '{l}' appear in the word '{w}'?",
    "Count the number of '{l}' letters in '{w}'.",
    "In the word \"{w}\", how many times does {l} occur?",
    "How many {l}'s does {w} have?",
    "What is the count of the letter {l} in the word {w}?",
)


def read_words(path: str | Path) -> tuple[str, ...]:
    """The words of a word list file (one a line), lowercased; lines that are not one a-z word are
    left out. Refuses a file with no word."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"spelling_bee: words_path {p} is not a file; point it at a word list (one word a line) "
            "or remove it for the built-in list"
        )
    words = tuple(sorted({w for line in p.read_text(encoding="utf-8", errors="replace").splitlines()
                          if (w := line.strip().lower()) and all(c in ALPHABET for c in w)}))
    if not words:
        raise SourceFormatError(f"spelling_bee: {p} holds no word of the letters a-z, one a line; expected {EXPECTED}")
    return words


def _text(t: str) -> dict[str, str]:
    return {"type": "text", "text": t}


def conversation(word: str, letter: str, question: str) -> dict[str, Any]:
    """The question about `letter` in `word` and its reply: spelled, counted, checked, answered."""
    running, steps = 0, []
    for i, c in enumerate(word, 1):
        if c == letter:
            running += 1
            steps.append(f"{i}:{c} ({running})")
        else:
            steps.append(f"{i}:{c}")
    n = word.count(letter)
    assert running == n
    return {"messages": [
        {"role": "user", "content": [_text(question)]},
        {"role": "assistant", "content": [
            _text(f"Spelling '{word}' letter by letter and counting '{letter}': {', '.join(steps)}. "
                  f"That makes {n}. Let me check with Python."),
            {"type": "python", "text": f"'{word}'.count('{letter}')"},
            {"type": "python_output", "text": str(n)},
            _text(f"Both agree: '{letter}' appears {n} time{'' if n == 1 else 's'} in '{word}'.\n\n#### {n}"),
        ]},
    ]}


def draw(d: Draw, words: tuple[str, ...]) -> dict[str, Any]:
    """One conversation drawn with `d`: the word, then the letter, then the phrasing."""
    word = d.pick(words)
    letter = d.pick(word) if d.uniform() < 0.5 else d.pick(ALPHABET)
    return conversation(word, letter, d.pick(_QUESTIONS).format(l=letter, w=word))


def produce(cfg: SpellingBeeConfig, sink: SnapshotWriter, *, seed: int) -> dict[str, Any]:
    words = read_words(cfg.words_path) if cfg.words_path is not None else WORDS
    for split, n, stream in (("train", cfg.n_train, _TRAIN_STREAM), ("val", cfg.n_val, _VAL_STREAM)):
        d = Draw(generator(seed, stream=stream))
        for i in range(n):
            sink.add(split, draw(d, words), f"spelling_bee {split} {i}")
    revision = "sha256:" + sha256_file(__file__)
    extra: dict[str, Any] = {"source_id": "lockstep:spelling_bee", "revision": revision, "streamed": False}
    if cfg.words_path is not None:
        extra["input_sha256"] = {Path(cfg.words_path).as_posix(): sha256_file(Path(cfg.words_path))}
    return extra


def size(cfg: SpellingBeeConfig, *, name: str, root: Path) -> SourceSize:
    """The conversations its params ask for: one question and its spelled-out reply, ~90 tokens."""
    return generated_examples(name, n_train=cfg.n_train, n_val=cfg.n_val, tokens_per_example=90)
