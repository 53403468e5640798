"""Bits per byte on a hand-computed example and each CORE task type on a planted bigram model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lockstep.evaluate.core import (
    CoreTask,
    centered,
    core_score,
    evaluate_task,
    fewshot_indices,
    load_core_tasks,
    render_item,
)
from lockstep.train.bpb import measure_bpb
from _eval_helpers import VOCAB, BigramModel, CharTokenizer

ROOT = Path(__file__).resolve().parents[1]


def test_bpb_hand_computed() -> None:
    model = BigramModel()  # all-zero logits: every target costs ln(V) nats
    token_bytes = torch.zeros(VOCAB, dtype=torch.int32)
    token_bytes[1], token_bytes[2], token_bytes[3] = 1, 2, 0  # id 3 is "special": not counted
    token_bytes[4] = 3
    x = torch.tensor([[0, 1, 2, 3], [0, 4, 4, 1]])
    y = torch.tensor([[1, 2, 3, -1], [4, 4, -1, 2]])
    out = measure_bpb(model, [(x, y)], token_bytes)
    # counted targets: 1, 2, 4, 4, 2 -> 5 targets, 1+2+3+3+2 = 11 bytes
    assert out.targets == 5 and out.bytes == 11
    assert out.bpb == pytest.approx(5 * math.log(VOCAB) / (math.log(2) * 11), rel=1e-6)  # float32 per-token losses


def test_bpb_weights_by_bytes_not_tokens() -> None:
    tok = CharTokenizer()
    model = BigramModel()
    model.plant(tok, "ab")  # a->b is cheap
    token_bytes = torch.ones(VOCAB, dtype=torch.int32)
    a, b = tok.encode("ab")
    cheap = measure_bpb(model, [(torch.tensor([[a]]), torch.tensor([[b]]))], token_bytes).bpb
    dear = measure_bpb(model, [(torch.tensor([[b]]), torch.tensor([[a]]))], token_bytes).bpb
    assert cheap < 0.01 < dear
    token_bytes[a] = 4  # the same loss spread over more bytes
    dear4 = measure_bpb(model, [(torch.tensor([[b]]), torch.tensor([[a]]))], token_bytes).bpb
    assert dear4 == pytest.approx(dear / 4)


def _task(task_type: str, items: list[dict], shots: int = 0, delim: str = " ", baseline: float = 0.5) -> CoreTask:
    return CoreTask("t", task_type, shots, delim, baseline, tuple(items))  # type: ignore[arg-type]


def _run(model: BigramModel, task: CoreTask) -> float:
    tok = CharTokenizer()
    return evaluate_task(model, task, encode=tok.encode, bos_id=0, max_seq_len=512, device=torch.device("cpu"))[
        "accuracy"
    ]


@pytest.mark.parametrize("shots", [0, 1])
def test_multiple_choice_planted(shots: int) -> None:
    tok = CharTokenizer()
    items = [
        {"query": "Q: sky?", "choices": ["blue", "red"], "gold": 0},
        {"query": "Q: grass?", "choices": ["pink", "green"], "gold": 1},
    ]
    right = BigramModel()
    right.plant(tok, " blue")
    right.plant(tok, " green")
    assert _run(right, _task("multiple_choice", items, shots)) == 1.0
    wrong = BigramModel()
    wrong.plant(tok, " red")
    wrong.plant(tok, " pink")
    assert _run(wrong, _task("multiple_choice", items, shots)) == 0.0


def test_schema_planted() -> None:
    # The span is the rows' common token suffix (the reference's rule): here " barked.", since the
    # rows differ at "t"/"g", so the bigram "g"/"t" -> " " is scored and decides.
    tok = CharTokenizer()
    items = [{"context_options": ["The cat", "The dog"], "continuation": " barked.", "gold": 1}]
    model = BigramModel()
    model.plant(tok, "g barked.")  # only the dog context makes the shared continuation likely
    assert _run(model, _task("schema", items, delim="")) == 1.0
    model2 = BigramModel()
    model2.plant(tok, "t barked.")
    assert _run(model2, _task("schema", items, delim="")) == 0.0


def test_language_modeling_planted() -> None:
    tok = CharTokenizer()
    items = [{"context": "abc", "continuation": "def"}, {"context": "xyz", "continuation": "uvw"}]
    model = BigramModel()
    model.plant(tok, "abc def")  # the first item's continuation is every argmax; the second is not
    acc = _run(model, _task("language_modeling", items, baseline=0.0))
    assert acc == 0.5


def test_render_spans_cover_only_the_continuation() -> None:
    tok = CharTokenizer()
    task = _task("multiple_choice", [{"query": "Is it", "choices": ["yes", "no"], "gold": 0}])
    scored = render_item(task, 0, tok.encode, 0)
    # After the choices' common prefix: the delimiter is a token of its own here (one id per
    # character) that every choice starts with, so it is not scored.
    assert [tok.decode(row[s:e]) for row, (s, e) in zip(scored.rows, scored.spans)] == ["yes", "no"]
    # Language modelling: the span starts after the stripped context, so that space is scored.
    lm = _task("language_modeling", [{"context": "Is it", "continuation": "yes"}])
    cloze = render_item(lm, 0, tok.encode, 0)
    ((s, e),) = cloze.spans
    assert tok.decode(cloze.rows[0][s:e]) == " yes"


def test_fewshot_follows_the_reference_seed_rule() -> None:
    # The reference samples item i's shots from the other items with random.Random(1234 + i); the
    # values below are that rule's draws under CPython's `random` (stable across versions).
    assert fewshot_indices(10, 3, 4) == [2, 7, 9, 1]
    assert fewshot_indices(5, 0, 3) == [4, 1, 3]
    assert sorted(fewshot_indices(3, 1, 5)) == [0, 2]  # fewer items than k: all the others
    assert fewshot_indices(10, 3, 0) == [] and fewshot_indices(1, 0, 2) == []


def test_centered_and_core_score() -> None:
    assert centered(0.25, 0.25) == 0.0 and centered(1.0, 0.25) == 1.0
    assert core_score({"a": 0.5, "b": 0.0}) == 0.25


def test_bundle_layout_loads(tmp_path: Path) -> None:
    (tmp_path / "eval_data" / "lu").mkdir(parents=True)
    (tmp_path / "core.yaml").write_text(
        "icl_tasks:\n- label: mc\n  dataset_uri: eval/local_data/lu/mc.jsonl\n  num_fewshot: [2]\n"
        "  icl_task_type: multiple_choice\n  continuation_delimiter: ' '\n"
    )
    (tmp_path / "eval_meta_data.csv").write_text(
        "Eval Task,Task Category,Task Type,#shots,Random baseline\nmc,lu,mc,2,25\n"
    )
    rows = [{"query": f"q{i}", "choices": ["a", "b", "c", "d"], "gold": i % 4} for i in range(5)]
    (tmp_path / "eval_data" / "lu" / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (task,) = load_core_tasks(tmp_path, max_items_per_task=3)
    assert task.num_fewshot == 2 and task.random_baseline == 0.25 and len(task.items) == 3


def test_bad_item_names_the_fix(tmp_path: Path) -> None:
    (tmp_path / "eval_data").mkdir()
    (tmp_path / "core.yaml").write_text("icl_tasks:\n- {label: s, dataset_uri: s.jsonl, icl_task_type: schema}\n")
    (tmp_path / "eval_meta_data.csv").write_text("Eval Task,Random baseline\ns,50\n")
    (tmp_path / "eval_data" / "s.jsonl").write_text('{"context_options": ["a", "b"], "continuation": "c", "gold": 2}\n')
    with pytest.raises(ValueError, match="gold=2"):
        load_core_tasks(tmp_path)


def test_shipped_evalsets_load() -> None:
    # The offline presets' tasks (core/) and the harder ones (core_hard/) cover the three types.
    tasks = load_core_tasks(ROOT / "evalsets" / "core") + load_core_tasks(ROOT / "evalsets" / "core_hard")
    assert {t.task_type for t in tasks} == {"multiple_choice", "schema", "language_modeling"}
    assert all(len(t.items) >= 5 for t in tasks)
