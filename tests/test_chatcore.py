"""ChatCORE's benchmarks: each source reads its hub layout from local files (the committed samples
and hand-made rows), SpellingBee is deterministic, categorical items are scored by the preferred
answer letter, ChatCORE centres on fixed baselines, the plan knows the sources' sizes, and the
report card's comparable table carries n, intervals and nanochat's reference only where it fits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lockstep.core.config import ConfigError, build_config
from lockstep.core.stats import wilson_interval
from lockstep.data.sources import SOURCE_CONFIGS, SplitLayoutError, fetch_source, iter_records, read_meta
from lockstep.data.sources.ai2_arc import Ai2ArcConfig
from lockstep.data.sources.humaneval import HumanevalConfig
from lockstep.data.sources.mmlu import MmluConfig
from lockstep.data.sources.spelling_bee import SpellingBeeConfig
from lockstep.dev.hub_samples_chat import ARC_SCHEMA
from lockstep.evaluate.chat import (
    benchmark_categorical_items,
    benchmark_code_items,
    conversation_items,
    evaluate_categorical,
)
from lockstep.evaluate.chatcore import BENCHMARKS, chatcore_of
from lockstep.pipeline.eval import EvalConfig
from lockstep.pipeline.report import comparable_table, composite_interval, intervals
from lockstep.tools.plan import source_size
from _eval_helpers import ASSISTANT_START, BigramModel, CharTokenizer

ROOT = Path(__file__).resolve().parents[1]
HUB = ROOT / "corpus" / "hub"


def _val(out: Path) -> list[dict]:
    return list(iter_records(out, "val"))


def test_arc_reads_the_test_split_of_its_config_and_letters_choices_by_position(tmp_path: Path) -> None:
    meta = fetch_source("arc_easy", Ai2ArcConfig(path=str(HUB / "ai2_arc"), config="ARC-Easy"), tmp_path / "e", seed=1)
    rows = pq.read_table(HUB / "ai2_arc" / "ARC-Easy" / "test-00000-of-00001.parquet").to_pylist()
    got = _val(tmp_path / "e")
    assert meta["counts"]["train"] == 0 and len(got) == len(rows) == 24
    assert [g["text"] for g in got] == [r["question"] for r in rows]
    numeric = next(i for i, r in enumerate(rows) if r["choices"]["label"][0] == "1")  # labelled 1-4 on the hub
    key = rows[numeric]["answerKey"]
    assert got[numeric]["answer"] == "ABCD"[rows[numeric]["choices"]["label"].index(key)]
    assert json.loads(got[numeric]["choices"]) == rows[numeric]["choices"]["text"]
    assert [json.loads(g["labels"]) for g in got] == [r["choices"]["label"] for r in rows]  # ARC's own, 1-4 too
    assert all(u.startswith("ARC-") for u in read_meta(tmp_path / "e")["unused_files"])
    fetch_source("arc_c", Ai2ArcConfig(path=str(HUB / "ai2_arc"), config="ARC-Challenge"), tmp_path / "c", seed=1)
    assert {g["text"] for g in _val(tmp_path / "c")}.isdisjoint(g["text"] for g in got)


def test_arc_without_a_test_file_is_refused_and_a_bad_answer_key_is_reported(tmp_path: Path) -> None:
    folder = tmp_path / "ARC-Easy"
    folder.mkdir()
    rows = [{"id": "x", "question": "Q?", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "B"},
            {"id": "y", "question": "Q2?", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "E"}]
    pq.write_table(pa.Table.from_pylist(rows, schema=ARC_SCHEMA), folder / "train-00000-of-00001.parquet")
    with pytest.raises(SplitLayoutError, match="test"):
        fetch_source("a", Ai2ArcConfig(path=str(tmp_path)), tmp_path / "out", seed=1)
    pq.write_table(pa.Table.from_pylist(rows, schema=ARC_SCHEMA), folder / "test-00000-of-00001.parquet")
    meta = fetch_source("a", Ai2ArcConfig(path=str(tmp_path)), tmp_path / "out", seed=1)
    assert meta["counts"] == {"train": 0, "val": 1, "skipped": 1}


def test_mmlu_reads_all_test_with_int_answers_and_leaves_dev_and_validation(tmp_path: Path) -> None:
    fetch_source("mmlu", MmluConfig(path=str(HUB / "mmlu")), tmp_path / "m", seed=1)
    table = pq.read_table(HUB / "mmlu" / "all" / "test-00000-of-00001.parquet")
    assert table.schema.field("answer").type == pa.int64() and table.schema.field("choices").type == pa.list_(
        pa.string()
    )
    rows, got = table.to_pylist(), _val(tmp_path / "m")
    assert [g["answer"] for g in got] == ["ABCD"[r["answer"]] for r in rows]
    assert [g["subject"] for g in got] == [r["subject"] for r in rows]
    assert sorted(read_meta(tmp_path / "m")["unused_files"]) == ["all/dev-00000-of-00001.parquet",
                                                                  "all/validation-00000-of-00001.parquet"]
    items = benchmark_categorical_items(got)
    assert [it.answer for it in items] == [r["answer"] for r in rows]


def test_humaneval_reads_its_one_split_as_code_items(tmp_path: Path) -> None:
    fetch_source("he", HumanevalConfig(path=str(HUB / "openai_humaneval")), tmp_path / "h", seed=1)
    rows = pq.read_table(HUB / "openai_humaneval" / "openai_humaneval" / "test-00000-of-00001.parquet").to_pylist()
    assert sorted(rows[0]) == ["canonical_solution", "entry_point", "prompt", "task_id", "test"]
    items = benchmark_code_items(_val(tmp_path / "h"))
    assert [(i.task_id, i.prompt, i.test, i.entry_point) for i in items] == [
        (r["task_id"], r["prompt"], r["test"], r["entry_point"]) for r in rows]


def test_humaneval_jsonl_in_the_hub_folder_reads_the_same(tmp_path: Path) -> None:
    rows = pq.read_table(HUB / "openai_humaneval" / "openai_humaneval" / "test-00000-of-00001.parquet").to_pylist()
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]), encoding="utf-8")
    fetch_source("he", HumanevalConfig(path=str(tmp_path)), tmp_path / "h", seed=1)
    assert [r["task_id"] for r in _val(tmp_path / "h")] == [r["task_id"] for r in rows[:3]]


def test_spelling_bee_is_deterministic_and_its_answers_are_the_counts(tmp_path: Path) -> None:
    fetch_source("sb", SpellingBeeConfig(n_train=5, n_val=40), tmp_path / "a", seed=7)
    fetch_source("sb", SpellingBeeConfig(n_train=5, n_val=40), tmp_path / "b", seed=7)
    fetch_source("sb", SpellingBeeConfig(n_train=5, n_val=40), tmp_path / "c", seed=8)
    a, b, c = _val(tmp_path / "a"), _val(tmp_path / "b"), _val(tmp_path / "c")
    assert a == b and a != c
    assert list(iter_records(tmp_path / "a", "train")) != a[:5]  # train and val: separate streams
    items = conversation_items(a)
    assert len(items) == 40
    for conv in a:
        parts = conv["messages"][1]["content"]
        word, letter = parts[1]["text"].split(".count(")
        n = word.strip("'").count(letter.strip("')"))
        assert parts[2]["text"] == str(n) and parts[-1]["text"].endswith(f"#### {n}")
    assert any(it.reference.endswith("#### 0") for it in items)  # absent letters occur


def test_spelling_bee_word_list_file(tmp_path: Path) -> None:
    (tmp_path / "w.txt").write_text("Alpha\nbeta\n\nnot a word\nx-y\n", encoding="utf-8")
    fetch_source("sb", SpellingBeeConfig(n_val=10, words_path=str(tmp_path / "w.txt")), tmp_path / "o", seed=1)
    words = {conv["messages"][1]["content"][1]["text"].split(".count(")[0].strip("'") for conv in _val(tmp_path / "o")}
    assert words <= {"alpha", "beta"}


def test_categorical_scores_the_preferred_letter_among_the_choices_and_skips_long_items() -> None:
    tok = CharTokenizer()
    records = [{"text": "Four", "choices": json.dumps(["w", "x", "y", "z"]), "answer": "C"},
               {"text": "Three", "choices": json.dumps(["x", "y", "z"]), "answer": "B"},
               {"text": "Two", "choices": json.dumps(["x", "y"]), "answer": "B"},
               {"text": "long " * 200, "choices": json.dumps(["x", "y"]), "answer": "A"}]
    model = BigramModel()
    with torch.no_grad():  # prefers E (no item has five choices), then C, then B, then A
        for letter, logit in (("A", 1.0), ("B", 2.0), ("C", 3.0), ("E", 9.0)):
            model.table[ASSISTANT_START, tok.encode(letter)[0]] = logit
    res = evaluate_categorical(model, benchmark_categorical_items(records), tokenizer=tok, device=torch.device("cpu"),
                               max_seq_len=300)
    assert [r["predicted"] for r in res.records] == ["C", "C", "B"]
    assert (res.correct, res.total, res.skipped) == (2, 3, 1)


def test_chatcore_centres_on_the_fixed_baselines() -> None:
    acc = {"arc_easy": 0.40, "arc_challenge": 0.25, "mmlu": 0.31, "gsm8k": 0.05, "humaneval": 0.08, "spelling_bee": 0.5}
    want = ((0.40 - 0.25) / 0.75 + 0.0 + (0.31 - 0.25) / 0.75 + 0.05 + 0.08 + 0.5) / 6
    assert chatcore_of(acc) == pytest.approx(want)
    assert chatcore_of({"mmlu": 0.25}) == 0.0 and chatcore_of({"mmlu": 0.0}) == pytest.approx(-1 / 3)
    assert {t: b.baseline for t, b in BENCHMARKS.items()} == {
        "arc_easy": 0.25, "arc_challenge": 0.25, "mmlu": 0.25, "gsm8k": 0.0, "humaneval": 0.0, "spelling_bee": 0.0}
    with pytest.raises(ValueError, match="not ChatCORE tasks"):
        chatcore_of({"arc_own": 0.5})


def test_eval_chat_tasks_are_checked() -> None:
    cfg = build_config(EvalConfig, {"chat_tasks": {"mmlu": "mmlu"}, "categorical_files": []}, where="eval")
    assert cfg.chat_tasks == {"mmlu": "mmlu"}
    with pytest.raises(ConfigError, match="unknown task"):
        build_config(EvalConfig, {"chat_tasks": {"hellaswag": "x"}}, where="eval")
    with pytest.raises(ConfigError, match="repeats"):
        build_config(EvalConfig, {"chat_tasks": {"gsm8k": "gsm8k"}, "math_sources": ["gsm8k"]}, where="eval")
    with pytest.raises(ConfigError, match="folder name"):
        build_config(EvalConfig, {"chat_tasks": {"mmlu": "../mmlu"}}, where="eval")


def test_plan_sizes_the_benchmarks() -> None:
    easy = source_size("arc_easy", {"source": "ai2_arc", "config": "ARC-Easy"}, root=ROOT)
    hard = source_size("arc_challenge", {"source": "ai2_arc", "config": "ARC-Challenge"}, root=ROOT)
    assert (easy.train_examples, easy.val_examples, hard.val_examples) == (0, 2376, 1172)
    assert source_size("mmlu", {"source": "mmlu"}, root=ROOT).val_examples == 14042
    assert source_size("mmlu", {"source": "mmlu", "config": "anatomy"}, root=ROOT) is None
    assert source_size("humaneval", {"source": "humaneval"}, root=ROOT).val_examples == 164
    assert source_size("sb", {"source": "spelling_bee", "n_val": 99}, root=ROOT).val_examples == 99
    for src in ("ai2_arc", "mmlu", "humaneval", "spelling_bee"):
        assert src in SOURCE_CONFIGS


def _eval_metrics(tasks: tuple[str, ...]) -> dict:
    flat: dict = {"core": 0.2, "core.a.accuracy": 0.5, "core.a.accuracy.n": 100, "core.a.centered": 0.0,
                  "core.b.accuracy": 0.7, "core.b.accuracy.n": 50, "core.b.centered": 0.4}
    for t in tasks:
        b = BENCHMARKS[t].baseline
        flat |= {f"chat.{t}.accuracy": 0.4, f"chat.{t}.accuracy.n": 80, f"chat.{t}.centered": (0.4 - b) / (1 - b)}
    if tasks:
        flat["chatcore"] = chatcore_of({t: 0.4 for t in tasks})
    return flat


def test_comparable_table_rows_columns_intervals_and_reference() -> None:
    metrics = {
        "eval_pretrain": {
            "core": 0.2,
            **{k: v for k, v in _eval_metrics(()).items() if k.startswith("core")},
            "core_source": "dclm",
            "core_tasks": 2,
            "core_items": 150,
        },
        "eval_sft": {**_eval_metrics(tuple(BENCHMARKS)), "core_source": "dclm", "core_tasks": 2, "core_items": 150},
    }
    ivs = intervals(metrics, None)
    lines = comparable_table(metrics, ivs)
    header = next(ln for ln in lines if ln.startswith("| stage"))
    assert header == ("| stage | CORE (DCLM, 2 tasks) | ARC-Easy | ARC-Challenge | MMLU | GSM8K "
                      "| HumanEval | SpellingBee | ChatCORE |")
    body = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| stage")]
    assert [ln.split(" | ")[0][2:] for ln in body[:4]] == ["base", "mid", "sft", "rl"]
    lo, hi = wilson_interval(0.4 * 80, 80)
    assert f"0.4000 [{lo:.3f}, {hi:.3f}] n=80" in body[2]
    # CORE: normal approximation, var = .25/100 * (1/.5)^2 + .21/50 * (.6/.3)^2, over K=2 tasks
    half = 1.959963984540054 * math.sqrt(0.25 / 100 * 4 + 0.21 / 50 * 4) / 2
    assert f"0.2000 [{0.2 - half:.3f}, {0.2 + half:.3f}] n=150" in body[0]
    assert body[1].count(" - ") == 8  # mid: nothing evaluated
    refs = [ln for ln in body if "reference: nanochat d20" in ln]
    assert len(refs) == 4 and "0.2219" in refs[0] and "0.0884" in refs[2] and "0.0758" in refs[3]
    # CORE on other tasks than DCLM's: the column says so, and nanochat's CORE is not set beside it.
    for stem in ("eval_pretrain", "eval_sft"):
        metrics[stem] = {**metrics[stem], "core_source": "own"}
    lines = comparable_table(metrics, intervals(metrics, None))
    assert next(ln for ln in lines if ln.startswith("| stage")).startswith(
        "| stage | CORE-style (own tasks, 150 items) |"
    )
    refs = [ln for ln in lines if "reference: nanochat d20" in ln]
    assert len(refs) == 3 and not any("0.2219" in ln for ln in refs) and "0.0884" in refs[1]  # base had only CORE
    # Without all six benchmarks (the tiny preset's own sets), no reference line.
    metrics["eval_sft"] = _eval_metrics(("gsm8k", "humaneval"))
    assert not any("reference" in ln for ln in comparable_table(metrics, intervals(metrics, None)))
    assert comparable_table({"eval_sft": {"bpb.x": 1.0}}, {}) == []


def test_composite_interval_needs_every_tasks_counts() -> None:
    flat = _eval_metrics(("mmlu",))
    del flat["chat.mmlu.accuracy.n"]
    assert composite_interval(flat, "chat.", "chatcore") is None


def test_eval_stage_scores_the_six_benchmarks_from_their_hub_samples(tmp_path: Path) -> None:
    from _tiny_model import save_untrained_chat_model
    from lockstep.core.runtime import RuntimeConfig, init_runtime
    from lockstep.data.sources.gsm8k import Gsm8kConfig
    from lockstep.pipeline.eval import EvalPaths, check_inputs, run_eval_stage

    raw = tmp_path / "raw"
    for name, cfg in (("arc_easy", Ai2ArcConfig(path=str(HUB / "ai2_arc"))),
                      ("arc_challenge", Ai2ArcConfig(path=str(HUB / "ai2_arc"), config="ARC-Challenge")),
                      ("mmlu", MmluConfig(path=str(HUB / "mmlu"))), ("gsm8k", Gsm8kConfig(path=str(HUB / "gsm8k"))),
                      ("humaneval", HumanevalConfig(path=str(HUB / "openai_humaneval"))),
                      ("spelling_bee", SpellingBeeConfig(n_val=4))):
        fetch_source(name, cfg, raw / name, seed=1)
    save_untrained_chat_model(tmp_path)
    cfg = EvalConfig(core_stages=(), chat_stages=("sft",), chat_max_items=2, math_sources=(), conversation_sources=(),
                     categorical_files=(), code_files=(), chat_tasks={t: t for t in BENCHMARKS}, max_new_tokens=4,
                     sandbox_timeout_s=3.0)
    check_inputs("sft", cfg, raw, ROOT / "evalsets")
    paths = EvalPaths(ckpt=tmp_path / "ckpt", cache=tmp_path / "cache", tokenizer=tmp_path / "tokenizer", raw=raw,
                      evalsets=ROOT / "evalsets", out=tmp_path / "m.json", predictions=tmp_path / "pred",
                      runinfo=tmp_path / "ri.json")
    metrics = run_eval_stage("sft", cfg, paths, rt=init_runtime(RuntimeConfig(device="cpu", dtype="fp32")))
    acc = {t: metrics[f"chat.{t}.accuracy"] for t in BENCHMARKS}
    assert all(metrics[f"chat.{t}.accuracy.n"] == 2 for t in BENCHMARKS)
    assert metrics["chatcore"] == pytest.approx(chatcore_of(acc))
    assert sorted(p.name for p in paths.predictions.iterdir()) == sorted(f"chat_{t}.jsonl" for t in BENCHMARKS)
    with pytest.raises(ConfigError, match="chat_tasks.mmlu"):
        check_inputs("sft", EvalConfig(chat_tasks={"mmlu": "nope"}, math_sources=(), conversation_sources=()), raw,
                     ROOT / "evalsets")
