"""CORE scoring against the reference's own code: nanochat's `core_eval.py` (at ../shared, a
checkout next to the repository; the tests skip without it) and lockstep.evaluate.core render,
span and decide every item alike. The items hold the awkward cases: a delimiter whose space is a
token of its own, choices that share leading tokens, a choice that is a token-prefix of another
(in the first place and later), identical choices, schema contexts that end alike, duplicate
contexts, a continuation with no token of its own; scored by a tiny seeded GPT."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path
from types import ModuleType

import pytest
import torch

from _eval_helpers import WordTokenizer
from _tiny_model import fit_rows
from lockstep.evaluate.core import CoreTask, choose_option, evaluate_task, render_item

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT.parent / "shared" / "nanochat" / "nanochat" / "core_eval.py"
WORDS = (" the", " cat", " dog", " sat", " on", " mat")  # a leading space merges into these; not into digits


def _reference() -> ModuleType:
    if not REFERENCE.is_file():
        pytest.skip(f"nanochat's core_eval.py is not at {REFERENCE} (a nanochat checkout beside the repository)")
    pytest.importorskip("jinja2", reason="nanochat's core_eval.py renders prompts with jinja2")
    spec = importlib.util.spec_from_file_location("nanochat_core_eval", REFERENCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ReferenceTokenizer(WordTokenizer):
    """The call the reference makes: a batch of strings, each with BOS in front."""

    def __call__(self, texts: list[str], prepend: int) -> list[list[int]]:
        return [[prepend, *self.encode(t)] for t in texts]


MC = [
    {"query": "The cat", "choices": ["sat on the mat", "sat on the dog", "the dog"], "gold": 0},  # shared " sat on"
    {"query": "Q:", "choices": ["1", "2", "12"], "gold": 2},  # " " a token of its own; "1" a prefix of "12"
    {"query": "Q: cat", "choices": ["the", "the mat", "the dog"], "gold": 1},  # a prefix in the first place
    {"query": "Q: dog", "choices": ["the mat", "the", "sat"], "gold": 0},  # a prefix in a later place
    {"query": "Same", "choices": ["cat", "cat"], "gold": 1},  # identical: nothing scored
    {"query": "Empty", "choices": ["", "dog", "2"], "gold": 0},  # an empty choice: the delimiter alone
    {"query": "A dog", "choices": ["sat", "on", "mat"], "gold": 2},
]
SCHEMA = [
    {"context_options": ["A cat on the", "A dog on the"], "continuation": "mat", "gold": 0},  # end alike
    {"context_options": ["1 the", "2 the", "3 cat"], "continuation": "sat on", "gold": 1},
    {"context_options": ["The cat", "The cat"], "continuation": "sat", "gold": 1},  # duplicates
    {"context_options": ["A cat", "A dog"], "continuation": "7", "gold": 1},  # " " alone before "7"
    {"context_options": ["on the", "the mat"], "continuation": "", "gold": 1},  # only the delimiter is shared
]
LM = [
    {"context": "Count: 1 2", "continuation": "3 4"},  # " " a token of its own: the reference scores it
    {"context": "The cat", "continuation": "sat on the mat"},  # " sat" takes the delimiter's space
    {"context": "The dog  ", "continuation": "sat"},  # trailing spaces trimmed
    {"context": "Next", "continuation": ""},  # the delimiter is the whole span
    {"context": "Q: 9", "continuation": "9 9"},
]
TASKS = [
    ("multiple_choice", MC, 0, " "),
    ("multiple_choice", MC, 2, " "),
    ("multiple_choice", MC, 1, "\nA: "),
    ("schema", SCHEMA, 0, " "),
    ("schema", SCHEMA, 1, " "),
    ("language_modeling", LM, 0, " "),
    ("language_modeling", LM, 2, " "),
    ("language_modeling", LM, 1, "\n"),
]
TASK_IDS = [f"{kind}-{shots}shot-{delim!r}" for kind, _, shots, delim in TASKS]


def _model(tok: WordTokenizer, steps: int = 40) -> torch.nn.Module:
    """The tiny GPT, seeded, trained for `steps` full-batch steps on every item's gold answer in
    place: far enough that some answers are right, so that decisions turn on the spans."""
    texts = [it["query"] + " " + it["choices"][it["gold"]] for it in MC]
    texts += [it["context_options"][it["gold"]] + " " + it["continuation"] for it in SCHEMA]
    texts += [it["context"].strip() + " " + it["continuation"] for it in LM]
    rows = [[0, *tok.encode(t)] for t in texts]
    return fit_rows(rows, steps=steps, lr=0.02, sequence_len=256, vocab_size=len(tok.vocab))


@pytest.mark.parametrize(("kind", "items", "shots", "delim"), TASKS, ids=TASK_IDS)
def test_rows_and_spans_are_the_references(kind: str, items: list[dict], shots: int, delim: str) -> None:
    ref = _reference()
    tok = ReferenceTokenizer(WORDS)
    task = CoreTask("t", kind, shots, delim, 0.0, tuple(items))  # type: ignore[arg-type]
    render = {"multiple_choice": (ref.render_prompts_mc, ref.batch_sequences_mc),
              "schema": (ref.render_prompts_schema, ref.batch_sequences_schema),
              "language_modeling": (ref.render_prompts_lm, ref.batch_sequences_lm)}[kind]
    lone_delimiters = 0  # spans that start with the delimiter as a token of its own
    for index, item in enumerate(items):
        others = [i for i in range(len(items)) if i != index]
        shot_items = [items[i] for i in random.Random(1234 + index).sample(others, shots)] if shots else []
        rows, starts, ends = render[1](tok, render[0](item, delim, shot_items))
        ours = render_item(task, index, tok.encode, 0)
        assert ours.rows == rows, index
        if kind == "schema" and _duplicates(rows):
            assert starts == [0] * len(rows) and ours.spans == [(e, e) for e in ends], index
        else:
            assert ours.spans == list(zip(starts, ends)), index
        lone_delimiters += any(s < e and tok.vocab[r[s]] in (" ", "\n") for r, s, e in zip(rows, starts, ends))
    assert kind != "language_modeling" or lone_delimiters  # the case where the old rule differed is here


def _duplicates(rows: list[list[int]]) -> bool:
    # Identical rows: the reference's span starts at the BOS, which its slice then reads as empty
    # (every mean NaN, the first option chosen); ours is empty.
    return all(r == rows[0] for r in rows)


@pytest.mark.parametrize(("kind", "items", "shots", "delim"), TASKS, ids=TASK_IDS)
def test_every_decision_is_the_references(kind: str, items: list[dict], shots: int, delim: str) -> None:
    ref = _reference()
    tok = ReferenceTokenizer(WORDS)
    model = _model(tok)
    task = CoreTask("t", kind, shots, delim, 0.0, tuple(items))  # type: ignore[arg-type]
    ours: dict[int, bool | None] = {}
    evaluate_task(model, task, encode=tok.encode, bos_id=0, max_seq_len=256, device=torch.device("cpu"),
                  on_item=lambda i, scored, ok, skip: ours.__setitem__(i, ok))
    meta = {"task_type": kind, "num_fewshot": shots, "continuation_delimiter": delim}
    theirs = {i: bool(ref.evaluate_example(i, model, tok, list(items), torch.device("cpu"), meta))
              for i in range(len(items))}
    assert ours == theirs


def test_the_choice_is_the_references_min_and_index() -> None:
    # The reference picks `means.index(min(means))`; an empty span's mean is NaN.
    nan = math.nan
    cases = [[1.0, 2.0], [2.0, 1.0], [1.0, 1.0], [nan, 0.5], [0.5, nan, 0.1], [3.0, nan], [nan, nan],
             [2.0, nan, 2.0, 1.0], [math.inf, 5.0], [nan, math.inf, 0.0]]
    for means in cases:
        assert choose_option(means) == means.index(min(means)), means
