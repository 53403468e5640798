"""CORE scoring rules checked by hand: a bundle in the DCLM layout with items of every task type,
an item longer than the context, choices sharing their first token and a choice that is a
token-prefix of another, scored by a lookup-table model whose logits the test sets, through a
tokenizer with a few multi-character tokens (so the delimiter's space merges into a word). Also:
the reference's item order and few-shot draws, errors that name the item, and an eval stage that
finishes, bpb included, when items do not fit its context."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from _eval_helpers import WordTokenizer as _Words
from _tiny_model import tiny_gpt
from lockstep.core.runtime import RuntimeConfig, init_runtime
from lockstep.data.cache_build import build_pretrain_cache
from lockstep.evaluate.core import (CoreItemError, CoreTask, Scored, evaluate_task, fewshot_indices, load_core_tasks,
                                    render_item)
from lockstep.model.checkpoint import save_checkpoint
from lockstep.pipeline.eval import EvalConfig, EvalPaths, run_eval_stage
from lockstep.tokenizer.kinds import train_tokenizer

WORDS = (" the", " cat", " dog", " sat")  # whole-word tokens: a leading space merges into them


class WordTokenizer(_Words):
    """Longest match over WORDS, else one id per printable character or newline; id 0 is BOS."""

    def __init__(self) -> None:
        super().__init__(WORDS)


class LookupModel:
    """Logits that depend only on the current token: row `prev` of a table, zero unless planted.
    A planted next token costs ~0 nats; any other token after a planted row costs ~the strength;
    any token after an unplanted row costs ln(V)."""

    def __init__(self, tok: WordTokenizer) -> None:
        self.tok = tok
        self.table = torch.zeros(len(tok.vocab), len(tok.vocab))

    def plant(self, prev: str, nxt: str, strength: float) -> None:
        self.table[self.tok.ids[prev], self.tok.ids[nxt]] = strength

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]  # (N, T, V)


LONG = " ".join(["cat"] * 8)  # eight " cat" tokens: with the one before them, 9 > MAX_SEQ_LEN
MAX_SEQ_LEN = 8

MC = [
    # Both choices start with " the" (the delimiter's space merged into it): that token is not scored.
    {"id": "shared", "query": "Q", "choices": ["the cat", "the dog sat"], "gold": 0},
    # " the" is a token-prefix of " the dog": its span is empty, its mean NaN, and in the first
    # place it wins (the reference's min); " the dog" is scored on " dog".
    {"id": "prefix", "query": "P", "choices": ["the", "the dog"], "gold": 0},
    {"id": "too_long", "query": "Q", "choices": [LONG, "dog"], "gold": 0},
    # 15 tokens: cropped from the left to 8, the answer kept whole.
    {"id": "cropped", "query": "zzzzzzzzzzQ", "choices": ["the dog sat", "the cat"], "gold": 0},
]
SCHEMA = [
    {"id": "dog", "context_options": ["A cat", "A dog"], "continuation": "sat", "gold": 1},
    # The contexts end alike (" the"): the span is the rows' common ending, " the dog".
    {"id": "tail", "context_options": ["Q the", "P the"], "continuation": "dog", "gold": 0},
]
LM = [
    {"id": "miss", "context": "Q", "continuation": "the cat"},
    {"id": "hit", "context": "A dog", "continuation": "sat"},
    {"id": "trimmed", "context": "A dog  ", "continuation": "sat"},  # trailing spaces trimmed, as the reference
    {"id": "too_long", "context": "L", "continuation": LONG},
    {"id": "empty", "context": "A dog", "continuation": ""},  # the delimiter's space alone is scored
]


def _write_bundle(root: Path) -> Path:
    tasks = [("mc", "multiple_choice", "language_understanding", MC, 25),
             ("schema", "schema", "commonsense_reasoning", SCHEMA, 50),
             ("lm", "language_modeling", "language_modeling", LM, 0)]
    spec = ["icl_tasks:"]
    meta = ["Eval Task,Task Category,Task Type,#shots,Random baseline"]
    for label, kind, category, items, baseline in tasks:
        spec += [f"- label: {label}", f"  dataset_uri: {category}/{label}.jsonl", "  num_fewshot: [0]",
                 f"  icl_task_type: {kind}", "  continuation_delimiter: ' '"]
        meta.append(f"{label},{category},{kind},0,{baseline}")
        (root / "eval_data" / category).mkdir(parents=True, exist_ok=True)
        (root / "eval_data" / category / f"{label}.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    (root / "core.yaml").write_text("\n".join(spec) + "\n")
    (root / "eval_meta_data.csv").write_text("\n".join(meta) + "\n")
    return root


def _model(tok: WordTokenizer) -> LookupModel:
    m = LookupModel(tok)
    m.plant("Q", "x", 50.0)  # " the" after Q: ~50 nats; Q's argmax is "x"
    m.plant(" the", " cat", 20.0)  # " cat" after " the": ~0; " dog" after " the": ~20
    m.plant(" dog", " sat", 20.0)  # " sat" after " dog": ~0
    return m  # rows P, z, " cat", " ": all zero, ln(102) = 4.62 nats for any token


# Decisions worked out by hand from the planted losses (a = 50, b = 20, u = ln 102 = 4.62, ~0 = 0):
EXPECTED = {
    "mc": {
        # after the shared " the": " cat" 0 vs (" dog" b + " sat" 0)/2 = 10: choice 0, right. (Scoring
        # " the" too, (a + 0)/2 = 25 vs (a + b + 0)/3 = 23.3, would have picked choice 1.)
        "shared": ([" cat", " dog sat"], True),
        # choice 0's span is empty: NaN, in the first place, wins: right.
        "prefix": (["", " dog"], True),
        # " dog sat" 10 vs " cat" 0: choice 1, wrong; z...z cropped away.
        "cropped": ([" dog sat", " cat"], False),
    },
    "schema": {
        "dog": ([" sat", " sat"], True),  # " sat" after " cat": u; after " dog": 0
        "tail": ([" the dog", " the dog"], False),  # (a + b)/2 = 35 after Q, (u + b)/2 = 12.3 after P
    },
    "lm": {
        "miss": ([" the cat"], False),  # Q's argmax is "x", not " the"
        "hit": ([" sat"], True),
        "trimmed": ([" sat"], True),
        "empty": ([" "], False),  # " dog"'s argmax is " sat"
    },
}
SKIPPED = {"mc": {"too_long"}, "schema": set(), "lm": {"too_long"}}


def test_bundle_decisions_by_hand(tmp_path: Path) -> None:
    tok = WordTokenizer()
    model = _model(tok)
    reasons: dict[str, str | None] = {}
    for task in load_core_tasks(_write_bundle(tmp_path)):
        seen: dict[str, tuple[list[str], bool | None, str | None]] = {}
        rows: dict[str, Scored] = {}

        def on_item(
            index: int, scored: Scored, ok: bool | None, skip: str | None, _task=task, _seen=seen, _rows=rows
        ) -> None:
            key = _task.items[index]["id"]
            _seen[key] = ([tok.decode(r[s:e]) for r, (s, e) in zip(scored.rows, scored.spans)], ok, skip)
            _rows[key] = scored

        res = evaluate_task(model, task, encode=tok.encode, bos_id=0, max_seq_len=MAX_SEQ_LEN,
                            device=torch.device("cpu"), on_item=on_item)
        expected = EXPECTED[task.label]
        assert {k: v[:2] for k, v in seen.items() if v[2] is None} == expected, task.label
        assert {k for k, v in seen.items() if v[2] is not None} == SKIPPED[task.label]
        assert all(v[1] is None for k, v in seen.items() if k in SKIPPED[task.label])
        assert res["skipped"] == len(SKIPPED[task.label]) and res["items"] == len(expected)
        assert res["accuracy"] == pytest.approx(sum(ok for _, ok in expected.values()) / len(expected))
        assert all(len(r) <= MAX_SEQ_LEN for k, s in rows.items() if k not in SKIPPED[task.label] for r in s.rows)
        reasons.update({f"{task.label}.{k}": v[2] for k, v in seen.items()})
    assert "answer of 8 tokens does not fit max_seq_len=8" in str(reasons["mc.too_long"])
    assert "does not fit" in str(reasons["lm.too_long"])


def test_a_shared_first_token_is_not_scored(tmp_path: Path) -> None:
    # The span starts after " the", the last token where the choices' rows agree (the reference's rule).
    tok = WordTokenizer()
    task = load_core_tasks(_write_bundle(tmp_path))[0]
    index = next(i for i, it in enumerate(task.items) if it["id"] == "shared")
    scored = render_item(task, index, tok.encode, 0)
    (s0, _), (s1, _) = scored.spans
    assert scored.rows[0][s0 - 1] == scored.rows[1][s1 - 1] == tok.ids[" the"]
    assert [scored.rows[0][s0], scored.rows[1][s1]] == [tok.ids[" cat"], tok.ids[" dog"]]


def test_a_nan_mean_wins_in_the_first_place_only(tmp_path: Path) -> None:
    # The reference's choice over NaN means: an empty span (a choice that is a token-prefix of
    # another) or a NaN loss wins in the first place and never later; all NaN: the first.
    tok = WordTokenizer()
    nan_row = _model(tok)
    nan_row.table[tok.ids["P"], tok.ids[" the"]] = math.nan  # every loss after P is NaN
    items = ({"id": "empty_first", "query": "Q", "choices": ["the", "the dog"], "gold": 1},
             {"id": "empty_later", "query": "Q", "choices": ["the dog", "the"], "gold": 0},
             {"id": "all_nan", "query": "P", "choices": ["cat", "dog"], "gold": 1},
             {"id": "delimiter_only", "query": "Q", "choices": ["", "dog"], "gold": 1})
    task = CoreTask("mc", "multiple_choice", 0, " ", 0.25, items)
    picks = {}
    res = evaluate_task(nan_row, task, encode=tok.encode, bos_id=0, max_seq_len=MAX_SEQ_LEN, device=torch.device("cpu"),
                        on_item=lambda i, s, ok, skip: picks.__setitem__(items[i]["id"], ok))
    # "delimiter_only": " " and " dog" both cost a after Q: a tie, the first wins.
    assert picks == {"empty_first": False, "empty_later": True, "all_nan": False, "delimiter_only": False}
    assert res["items"] == 4 and res["skipped"] == 0


def test_a_continuation_with_no_token_is_skipped() -> None:
    # Nothing to score (no delimiter, no continuation): the reference stops on its assertion.
    tok = WordTokenizer()
    task = CoreTask("lm", "language_modeling", 0, "", 0.0, ({"context": "A dog", "continuation": ""},))
    reasons = []
    res = evaluate_task(_model(tok), task, encode=tok.encode, bos_id=0, max_seq_len=MAX_SEQ_LEN,
                        device=torch.device("cpu"), on_item=lambda i, s, ok, skip: reasons.append(skip))
    assert res["skipped"] == 1 and res["items"] == 0 and "no continuation tokens" in str(reasons[0])


def test_items_and_shots_follow_the_reference_order(tmp_path: Path) -> None:
    root = tmp_path / "b"
    (root / "eval_data" / "lm").mkdir(parents=True)
    (root / "core.yaml").write_text("icl_tasks:\n- {label: t, dataset_uri: lm/t.jsonl, num_fewshot: [2], "
                                    "icl_task_type: language_modeling, continuation_delimiter: ' '}\n")
    (root / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nt,0\n")
    (root / "eval_data" / "lm" / "t.jsonl").write_text(
        "".join(json.dumps({"context": f"c{i}", "continuation": f"w{i}"}) + "\n" for i in range(5))
    )
    (task,) = load_core_tasks(root)
    # The reference shuffles a task's items with random.Random(1337) before taking any first N:
    # file lines [0..4] come out as [1, 0, 3, 2, 4] (CPython's `random`, stable across versions).
    assert [it["context"] for it in task.items] == ["c1", "c0", "c3", "c2", "c4"]
    order = list(range(5))
    random.Random(1337).shuffle(order)
    assert order == [1, 0, 3, 2, 4]
    (capped,) = load_core_tasks(root, max_items_per_task=2)
    assert [it["context"] for it in capped.items] == ["c1", "c0"]
    # Item i's shots: random.Random(1234 + i).sample(others, k) -> item 0: [4, 1], item 3: [1, 4].
    assert fewshot_indices(5, 0, 2) == [4, 1] and fewshot_indices(5, 3, 2) == [1, 4]
    tok = WordTokenizer()
    prompt = tok.decode(render_item(task, 0, tok.encode, 0).rows[0])
    assert prompt == "c4 w4\n\nc0 w0\n\nc1 w1"  # positions 4 and 1 are file lines 4 and 0


def test_an_error_names_task_and_item(tmp_path: Path) -> None:
    tok = WordTokenizer()
    task = next(t for t in load_core_tasks(_write_bundle(tmp_path)) if t.label == "schema")

    def broken(ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("device lost")

    with pytest.raises(CoreItemError, match=r"CORE task 'schema' item 0: RuntimeError: device lost"):
        evaluate_task(broken, task, encode=tok.encode, bos_id=0, max_seq_len=64, device=torch.device("cpu"))


def test_every_item_skipped_gives_nan_not_an_abort(tmp_path: Path) -> None:
    tok = WordTokenizer()
    task = next(t for t in load_core_tasks(_write_bundle(tmp_path)) if t.label == "mc")
    res = evaluate_task(_model(tok), task, encode=tok.encode, bos_id=0, max_seq_len=1, device=torch.device("cpu"))
    assert res["items"] == 0 and res["skipped"] == len(MC) and math.isnan(res["accuracy"])


TEXT = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. " * 20


def test_eval_stage_finishes_with_items_longer_than_the_context(tmp_path: Path) -> None:
    """A 64-token model and a CORE task with an answer of 100 bytes: the stage writes bpb, the
    task's accuracy over the items that fit, and the skip count; the prediction says why."""
    tok = train_tokenizer("byte", [TEXT])
    tok.save(tmp_path / "tokenizer")
    build_pretrain_cache({"train": [TEXT], "val": [TEXT] * 2}, tmp_path / "cache" / "pretrain" / "bard", tokenizer=tok,
                         max_train_tokens=None, max_val_tokens=None, shard_bytes=1 << 20, seed=0, shuffle_buffer=1,
                         num_threads=1)
    model = tiny_gpt(sequence_len=64, vocab_size=tok.get_vocab_size())
    save_checkpoint(tmp_path / "ckpt", model.state_dict(), {0: {}},
                    {"step": 0, "model_config": model.config.to_dict(), "tokenizer_sha256": tok.sha256})
    bundle = tmp_path / "evalsets" / "core"
    (bundle / "eval_data" / "lu").mkdir(parents=True)
    (bundle / "core.yaml").write_text("icl_tasks:\n- {label: mc, dataset_uri: lu/mc.jsonl, num_fewshot: [1], "
                                      "icl_task_type: multiple_choice, continuation_delimiter: ' '}\n")
    (bundle / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nmc,50\n")
    items = [{"query": f"Speak {i}", "choices": ["yes", "no"], "gold": i % 2} for i in range(4)]
    items.append({"query": "Speak", "choices": ["x" * 100, "no"], "gold": 0})
    (bundle / "eval_data" / "lu" / "mc.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    cfg = EvalConfig(bpb_max_tokens=512, bpb_batch_rows=2, core_stages=("pretrain",), chat_stages=())
    paths = EvalPaths(ckpt=tmp_path / "ckpt", cache=tmp_path / "cache", tokenizer=tmp_path / "tokenizer",
                      raw=tmp_path / "raw", evalsets=tmp_path / "evalsets", out=tmp_path / "metrics.json",
                      predictions=tmp_path / "pred", runinfo=tmp_path / "runinfo.json")
    run_eval_stage("pretrain", cfg, paths, rt=init_runtime(RuntimeConfig(device="cpu", dtype="fp32")))
    metrics = json.loads(paths.out.read_text())
    assert "bpb.bard" in metrics and math.isfinite(metrics["core"])
    assert metrics["core.mc.skipped"] == 1 and metrics["core.mc.accuracy.n"] == 4
    recs = [json.loads(line) for line in (paths.predictions / "core_mc.jsonl").read_text().splitlines()]
    (skipped,) = [r for r in recs if "skipped" in r]
    assert skipped["input"]["choices"][0] == "x" * 100 and skipped["correct"] is None
    assert "does not fit max_seq_len=64" in skipped["skipped"]
