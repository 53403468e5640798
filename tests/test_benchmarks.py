"""A ChatCORE benchmark is one module and one line in lockstep.evaluate.chatcore.BENCHMARKS: a toy
benchmark, one `Benchmark` registered by one line, is read by its own reader, judged by its own
answer check, centred on its own baseline by the eval stage, shown in its own column by the report
card and costed by its kind in the plan. And RL's reward is the GSM8K benchmark's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lockstep.core.runtime import RuntimeConfig, init_runtime
from lockstep.data.sources import fetch_source
from lockstep.data.sources.ai2_arc import Ai2ArcConfig
from lockstep.evaluate import chatcore
from lockstep.evaluate.benchmarks import gsm8k
from lockstep.evaluate.chat import Benchmark, CategoricalItem
from lockstep.pipeline.eval import EvalConfig, EvalPaths, check_inputs, run_eval_stage
from lockstep.pipeline.report import comparable_table, intervals
from lockstep.tools.plan import make_plan
from _tiny_model import save_untrained_chat_model

ROOT = Path(__file__).resolve().parents[1]
HUB = ROOT / "corpus" / "hub"


def read_two_choices(records) -> list[CategoricalItem]:
    """The toy's reader: ARC questions cut to their first two choices, the first one right."""
    return [CategoricalItem(r["text"], tuple(json.loads(r["choices"])[:2]), 0) for r in records]


CHECKED: list[tuple[str, str]] = []


def either_letter(item: CategoricalItem, letter: str) -> bool:
    """The toy's answer check: either letter is right, so every scored item is correct."""
    CHECKED.append((item.question, letter))
    return letter in "AB"


TOY = Benchmark(kind="categorical", baseline=0.5, column="Toy", read=read_two_choices, check=either_letter)


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy benchmark's one registry line."""
    monkeypatch.setitem(chatcore.BENCHMARKS, "toy", TOY)
    CHECKED.clear()


def test_a_toy_benchmark_is_scored_by_the_eval_stage_and_shown_by_the_report(tmp_path: Path, toy: None) -> None:
    raw = tmp_path / "raw"
    fetch_source("toy_arc", Ai2ArcConfig(path=str(HUB / "ai2_arc")), raw / "toy_arc", seed=1)
    save_untrained_chat_model(tmp_path)
    cfg = EvalConfig(core_stages=(), chat_stages=("sft",), chat_max_items=3, math_sources=(), conversation_sources=(),
                     categorical_files=(), code_files=(), chat_tasks={"toy": "toy_arc"})
    check_inputs("sft", cfg, raw, ROOT / "evalsets")
    paths = EvalPaths(ckpt=tmp_path / "ckpt", cache=tmp_path / "cache", tokenizer=tmp_path / "tokenizer", raw=raw,
                      evalsets=ROOT / "evalsets", out=tmp_path / "m.json", predictions=tmp_path / "pred",
                      runinfo=tmp_path / "ri.json")
    metrics = run_eval_stage("sft", cfg, paths, rt=init_runtime(RuntimeConfig(device="cpu", dtype="fp32")))
    assert len(CHECKED) == 3  # the toy's check judged every item, its reader gave two choices each
    records = [json.loads(line) for line in (paths.predictions / "chat_toy.jsonl").read_text().splitlines()]
    assert [len(r["choices"]) for r in records] == [2, 2, 2] and all(r["reference"] == "A" for r in records)
    assert (metrics["chat.toy.accuracy"], metrics["chat.toy.accuracy.n"]) == (1.0, 3)
    assert metrics["chat.toy.centered"] == 1.0 and metrics["chatcore"] == chatcore.chatcore_of({"toy": 1.0}) == 1.0

    lines = comparable_table({"eval_sft": metrics}, intervals({"eval_sft": metrics}, None))
    header = next(ln for ln in lines if ln.startswith("| stage"))
    assert header.endswith("| SpellingBee | Toy | ChatCORE |")
    sft = next(ln for ln in lines if ln.startswith("| sft |")).split(" | ")
    assert sft[header.split(" | ").index("Toy")].startswith("1.0000 [") and sft[-1].startswith("1.0000 [")


def test_a_toy_benchmark_is_costed_by_its_kind_in_the_plan(toy: None) -> None:
    params = {
        "preset": "hand",
        "fetch": {"toy_arc": {"source": "ai2_arc", "config": "ARC-Easy"}},
        "tokenizer": {"kind": "bpe", "vocab_size": 256},
        "runtime": {"device": "cpu", "dtype": "fp32"},
        "model": {"depth": 1, "sequence_len": 64, "head_dim": 32},
        "pretrain": {"mixture": {}, "num_steps": 1},
        "eval": {
            "core_stages": [],
            "chat_stages": ["sft"],
            "math_sources": [],
            "conversation_sources": [],
            "categorical_files": [],
            "code_files": [],
            "chat_tasks": {"toy": "toy_arc"},
            "chat_max_items": 7,
        },
    }
    sft = {e["stage"]: e for e in make_plan(params, device="h100", tok_per_s=1000.0, root=ROOT)["eval"]}["sft"]
    assert (sft["choice_prompts"], sft["replies"]) == (7, 0)  # categorical: one forward per item, no reply


def test_an_unregistered_task_is_refused_with_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"names unknown task\(s\) \['toy'\]; use some of \['arc_easy'"):
        EvalConfig(chat_tasks={"toy": "toy_arc"})
    with pytest.raises(ValueError, match="not ChatCORE tasks"):
        chatcore.chatcore_of({"toy": 1.0})


def test_rl_rewards_with_the_gsm8k_benchmarks_check() -> None:
    from lockstep.rl import strategies, trainer

    assert trainer.reward is strategies.reward is gsm8k.reward
    reference = "3+4=<<3+4=7>>7\n#### 7"
    assert gsm8k.reward("so #### 7", reference) == 1.0
    # The eval takes a reply's last number; RL asks for the `#### N` form too.
    assert gsm8k.GSM8K.check(gsm8k.GSM8K.read([{"question": "3+4?", "answer": reference}])[0], "it is 7")
    assert gsm8k.reward("it is 7", reference) == 0.0
