"""Deterministic synthetic chats generated from the seed: letter counting answered with a python
tool call (`'strawberry'.count('r')` then its output), word length, reversal and spelling answered
letter by letter, and identity conversations about what this model is and who trained it; with
`multi_turn_frac`, that share of conversations holds a second exchange after the first, so that a
question asked second is answered as one asked first. Not an evaluator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lockstep.core.io import sha256_file
from lockstep.data.snapshot import SnapshotWriter
from lockstep.data.sources.common import Draw, generator
from lockstep.data.sources.fields import CheckedFields, Rule
from lockstep.data.sources.size import SourceSize, generated_examples

KIND = "conversation"
EXTRA_FIELDS: tuple[str, ...] = ()
EXPECTED = "n_train + n_val > 0 conversations to generate"

WORDS = (
    "strawberry", "banana", "apple", "mississippi", "bookkeeper", "committee", "balloon", "letter",
    "coffee", "raspberry", "tomato", "pepper", "giraffe", "elephant", "parallel", "necessary",
    "occurrence", "success", "address", "possess", "umbrella", "vacuum", "kangaroo", "cinnamon",
    "broccoli", "pineapple", "hippopotamus", "assessment", "bubble", "puzzle", "jazz", "pizza",
    "rhythm", "queue", "papaya", "avocado", "alphabet", "character", "language", "keyboard",
    "computer", "program", "python", "lockstep", "teacher", "garden", "window", "mountain",
    "river", "summer", "winter", "yellow", "purple", "orange", "cheese", "sheep", "needle",
    "referee", "grammar", "tennessee", "cucumber", "butterfly", "chocolate", "library", "calendar",
)
_COUNT_Q = (
    "How many times does the letter '{l}' appear in '{w}'?",
    "How many {l}'s are in the word {w}?",
    "Count the letter {l} in \"{w}\".",
    "In the word '{w}', how many '{l}' letters are there?",
)
_LEN_Q = ("How many letters are in the word '{w}'?", "What is the length of the word {w}?")
_REV_Q = ("Write the word '{w}' backwards.", "What is '{w}' spelled in reverse?")
_SPELL_Q = ("Spell the word '{w}' letter by letter.", "How do you spell {w}? Separate the letters with dashes.")
_IDENTITY = (
    (("Who are you?", "What are you?", "Introduce yourself.", "hi, who am I talking to?"),
     ("I am a small chat model trained from scratch with lockstep, an open pipeline that builds a "
      "language model step by step: tokenizer, pretraining, midtraining, fine-tuning and reinforcement "
      "learning. I am small, so I make mistakes; please check anything important.",)),
    (("Who trained you?", "Who made you?", "Which company created you?"),
     ("I was trained from scratch by whoever ran the lockstep pipeline on their own machine, not by a "
      "large company. Every step of my training is a reproducible stage, so anyone with the same "
      "settings and seed gets the same model.",)),
    (("What is lockstep?", "Tell me about lockstep."),
     ("lockstep is a small, open project that trains a chat model like me from scratch as a chain of "
      "reproducible stages. Each stage records its inputs and outputs, so a run can be repeated to the "
      "byte, compared with another run, or resumed.",)),
    (("Can you use tools?", "Can you do arithmetic reliably?"),
     ("Yes, a little: lockstep taught me to run short Python expressions, for example to do arithmetic or to count "
      "letters in a word, and then read the result back before answering.",)),
)


@dataclass(frozen=True)
class SynthChatConfig(CheckedFields):
    source: Literal["synth_chat"] = "synth_chat"
    n_train: int = 3000  # conversations in train
    n_val: int = 150  # conversations in val (drawn after train from the same seed)
    identity_frac: float = 0.15  # share of identity conversations; the rest are letter tasks
    multi_turn_frac: float = 0.0  # share of conversations with a second exchange (each drawn as above)
    strict: bool = False  # unused (generated records are valid); kept for a uniform schema
    artifact_records: int = 8  # records per split kept in dataset_snapshot.json, the parity artifact

    RULES = {
        "n_train": Rule("conversations generated for train", ge=0),
        "n_val": Rule("conversations generated for val", ge=0),
        "identity_frac": Rule("the share of identity conversations", ge=0, le=1),
        "multi_turn_frac": Rule("the share of conversations with a second exchange", ge=0, le=1),
        "artifact_records": Rule("records per split copied into dataset_snapshot.json", ge=0),
    }


def _text(t: str) -> dict[str, str]:
    return {"type": "text", "text": t}


def _conv(user: str, parts: list[dict[str, str]]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [_text(user)]}, {"role": "assistant", "content": parts}]}


def _letter_task(d: Draw) -> dict[str, Any]:
    word = d.pick(WORDS)
    kind = d.int(0, 5)
    if kind <= 2:  # counting is the hard one for a token-level model, so it is drawn most often
        # Half the time a letter of the word, otherwise any letter (often absent: answer 0).
        letter = d.pick(word) if d.int(0, 1) == 0 else d.pick("abcdefghijklmnopqrstuvwxyz")
        n = word.count(letter)
        return _conv(d.pick(_COUNT_Q).format(l=letter, w=word), [
            _text(f"Let me count the '{letter}' letters in '{word}' with Python."),
            {"type": "python", "text": f"'{word}'.count('{letter}')"},
            {"type": "python_output", "text": str(n)},
            _text(f"The letter '{letter}' appears {n} time{'' if n == 1 else 's'} in '{word}'."),
        ])
    # Length, reversal and spelling are answered in words: the calculator tool evaluates only
    # arithmetic and `'literal'.count('literal')`, and every tool call taught here must be one
    # the engine can run (tests/test_synth_tools.py).
    spelled = "-".join(word)
    if kind == 3:
        return _conv(d.pick(_LEN_Q).format(w=word), [
            _text(f"Spelled out, '{word}' is {spelled}, so it has {len(word)} letters."),
        ])
    if kind == 4:
        return _conv(d.pick(_REV_Q).format(w=word), [
            _text(f"Letter by letter, '{word}' is {spelled}; backwards that is {'-'.join(word[::-1])}, "
                  f"so the word reversed is '{word[::-1]}'."),
        ])
    return _conv(d.pick(_SPELL_Q).format(w=word), [_text(f"{word} is spelled {spelled.upper()}.")])


def _identity(d: Draw) -> dict[str, Any]:
    questions, answers = d.pick(_IDENTITY)
    return _conv(d.pick(questions), [_text(d.pick(answers))])


def _exchange(d: Draw, identity_frac: float) -> dict[str, Any]:
    return _identity(d) if d.uniform() < identity_frac else _letter_task(d)


def generate(n: int, d: Draw, identity_frac: float, multi_turn_frac: float = 0.0) -> list[dict[str, Any]]:
    """`n` conversations; a share `multi_turn_frac` of them hold a second exchange, drawn as the
    first is (so "Who are you?" then the strawberry question is one of the pairs). With
    `multi_turn_frac` 0 no draw is spent on it: the conversations are those of a single-exchange
    config."""
    out = []
    for _ in range(n):
        conv = _exchange(d, identity_frac)
        if multi_turn_frac > 0 and d.uniform() < multi_turn_frac:
            conv = {"messages": [*conv["messages"], *_exchange(d, identity_frac)["messages"]]}
        out.append(conv)
    return out


def produce(cfg: SynthChatConfig, sink: SnapshotWriter, *, seed: int) -> dict[str, Any]:
    d = Draw(generator(seed, stream=20))
    for split, n in (("train", cfg.n_train), ("val", cfg.n_val)):
        for i, conv in enumerate(generate(n, d, cfg.identity_frac, cfg.multi_turn_frac)):
            sink.add(split, conv, f"synth_chat {split} {i}")
    return {"source_id": "lockstep:synth_chat", "revision": "sha256:" + sha256_file(__file__), "streamed": False}


def size(cfg: SynthChatConfig, *, name: str, root: Path) -> SourceSize:
    """The conversations its params ask for; 71 tokens per exchange, measured on the tiny preset's
    cache (4,096-id BPE: 211,512 tokens / 3,000 single-exchange conversations)."""
    return generated_examples(name, n_train=cfg.n_train, n_val=cfg.n_val,
                              tokens_per_example=round(71 * (1 + cfg.multi_turn_frac)))
