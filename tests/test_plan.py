"""`lockstep plan` (lockstep.plan): parameter counts, FLOPs per token, memory and time against
hand computations for a small config; epochs from a built cache equal to the training stage's
own count; the flags; the --json schema through the command line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from lockstep.cache_build import build_pretrain_cache
from lockstep.cli import app
from lockstep.loaders import PretrainTokenStreamDataset
from lockstep.model import GPTConfig
from lockstep.optim import OptimConfig
from lockstep.plan import (
    DEVICES,
    FLAG,
    calibrate_tok_per_s,
    chars_per_token,
    make_plan,
    memory_per_device,
    model_figures,
    render_text,
)
from lockstep.runtime import RuntimeConfig
from lockstep.train_stage import holding_of

ROOT = Path(__file__).resolve().parents[1]


def _params(**pretrain) -> dict:
    """depth 1, width 64, 2 heads of 32, T=64, 256 ids: small enough to count by hand."""
    return {
        "preset": "hand",
        "fetch": {"prose": {"source": "shakespeare", "val_frac": 0.05}},
        "tokenizer": {"kind": "bpe", "vocab_size": 256},
        "cache": {"prose": {"kind": "pretrain"}},
        "runtime": {"device": "cpu", "dtype": "fp32"},
        "model": {"depth": 1, "sequence_len": 64, "head_dim": 32},
        "pretrain": {"mixture": {"prose": 1.0}, "batch_tokens": 256, "device_batch_rows": 2, "num_steps": 10, **pretrain},
    }


def test_params_and_flops_per_token_by_hand() -> None:
    m = make_plan(_params(), device="h100")["model"]
    wte = lm_head = 256 * 64
    block = 4 * 64 * 64 + 2 * 64 * 256  # q, k, v, proj; MLP in and out
    assert (m["params_total"], m["params_embedding"], m["params_non_embedding"]) == (wte + lm_head + block, wte,
                                                                                     lm_head + block)
    assert (m["params_muon"], m["params_adamw"]) == (block, wte + lm_head)
    # 6N over the matmul params + 12 * layers * heads * head_dim * T
    assert m["flops_per_token"] == 6 * (lm_head + block) + 12 * 1 * 2 * 32 * 64


def test_memory_by_hand() -> None:
    m = model_figures(GPTConfig.from_depth(1, 256, 64, 32))
    mem = memory_per_device(m, rows=2, gpus=2, bf16=True)
    P, muon, adamw = 81920, 49152, 32768
    assert mem == {"weights": 4.0 * P, "grads": 4.0 * P, "adamw": 8.0 * adamw / 2, "muon": 4.0 * muon / 2,
                   "activations": 1 * 34 * 2 * 64 * 64, "logits": 8.0 * 2 * 64 * 256,
                   "total": 8.0 * P + 4.0 * adamw + 2.0 * muon + 34 * 2 * 64 * 64 + 8.0 * 2 * 64 * 256}
    assert memory_per_device(m, rows=2, gpus=2, bf16=False)["activations"] == 2 * 34 * 2 * 64 * 64


def test_time_from_datasheet_peak_and_from_measured_throughput() -> None:
    plan = make_plan(_params(), device="a100", gpus=4, mfu=0.5)
    fpt = plan["model"]["flops_per_token"]
    tok_s = DEVICES["a100"].peak_flops * 0.5 / fpt
    assert plan["throughput"]["tok_per_s_per_device"] == pytest.approx(tok_s)
    assert plan["stages"][0]["tokens"] == 10 * 256
    assert plan["stages"][0]["time_s"] == pytest.approx(2560 / (4 * tok_s))
    plan = make_plan(_params(), device="cpu", tok_per_s=1000.0)
    assert plan["stages"][0]["time_s"] == pytest.approx(2.56) and plan["throughput"]["basis"].startswith("calibrated")


def test_epochs_from_a_built_cache_equal_the_training_stages_count(tmp_path: Path, tok) -> None:
    docs = ["to be or not to be, that is the question " * 4 for _ in range(30)]
    build_pretrain_cache({"train": docs, "val": docs[:3]}, tmp_path / "cache/pretrain/prose", tokenizer=tok,
                         max_train_tokens=None, max_val_tokens=None, shard_bytes=1 << 20, seed=1, shuffle_buffer=8)
    params = _params()
    params["tokenizer"]["vocab_size"] = tok.get_vocab_size()
    params["data_seed"] = 1
    raw_meta = tmp_path / "raw/prose/meta.json"
    raw_meta.parent.mkdir(parents=True)
    raw_meta.write_text(json.dumps({"seed": 1, "config": {"source": "shakespeare", "val_frac": 0.05, "strict": False}}))
    plan = make_plan(params, device="h100", cache_root=tmp_path / "cache", raw_root=tmp_path / "raw")
    (c,) = plan["stages"][0]["epochs"]
    held = holding_of(PretrainTokenStreamDataset(tmp_path / "cache/pretrain/prose/train", T=64))
    assert c["origin"].startswith("cache ") and c["train_tokens"] == held.tokens
    assert c["epochs"] == pytest.approx(2560 / held.tokens)
    # Without the cache the same component is estimated from the fetch params, and says so.
    (est,) = make_plan(_params(), device="h100")["stages"][0]["epochs"]
    assert est["origin"].startswith("estimate") and est["train_tokens"] > 1_000_000
    # Folders built from other params (another preset's workspace) are not read as this plan's data.
    for changed in ({"fetch": {"prose": {"source": "shakespeare", "val_frac": 0.1}}}, {"data_seed": 2},
                    {"tokenizer": {"kind": "bpe", "vocab_size": tok.get_vocab_size() + 1}}):
        other = make_plan({**params, **changed}, device="h100", cache_root=tmp_path / "cache", raw_root=tmp_path / "raw")
        (est,) = other["stages"][0]["epochs"]
        assert est["origin"].startswith("estimate"), changed


def test_flags_epochs_over_the_limit_and_memory_over_the_device() -> None:
    plan = make_plan(_params(num_steps=10, max_epochs=1e-6), device="h100")
    assert plan["stages"][0]["epochs"][0]["over_limit"] and "prose read" in plan["flags"][0]
    assert not plan["stages"][0]["memory_over"]
    big = _params(device_batch_rows=2 ** 20, batch_tokens=64 * 2 ** 20)  # 137 GB of logits alone
    plan = make_plan(big, device="a100")
    assert plan["stages"][0]["memory_over"] and any("device_batch_rows" in f for f in plan["flags"])
    text = render_text(plan)
    assert f"{FLAG} pretrain:" in text


def test_json_schema_through_the_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    r = CliRunner().invoke(app, ["plan", "--preset", "d20", "--gpus", "8", "--device", "h100", "--json",
                                 "--cache", str(tmp_path / "none"), "--raw", str(tmp_path / "none")])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)
    assert set(plan) == {"preset", "model", "throughput", "stages", "rl", "eval", "disk", "assumptions", "flags"}
    assert plan["preset"] == "d20" and plan["flags"] == []
    assert [s["stage"] for s in plan["stages"]] == ["pretrain", "midtrain", "sft"]
    for s in plan["stages"]:
        assert {"steps", "horizon", "tokens", "flops", "time_s", "max_epochs", "epochs", "memory_bytes",
                "memory_over"} <= set(s)
        for c in s["epochs"]:
            assert set(c) == {"name", "weight", "epochs", "drawn_tokens", "drawn_rows", "train_tokens",
                              "train_examples", "origin", "over_limit"}
    assert {"generated_tokens", "trained_tokens", "time_s_lower_bound"} <= set(plan["rl"])
    assert {"raw_bytes", "cache_bytes", "checkpoint_bytes", "sources"} <= set(plan["disk"])
    assert plan["throughput"]["gpus"] == 8 and plan["throughput"]["peak_flops_per_device"] == DEVICES["h100"].peak_flops
    text = CliRunner().invoke(app, ["plan", "--preset", "d20", "--device", "h100", "--cache", str(tmp_path)]).output
    assert "pretrain" in text and "fineweb_edu" in text and FLAG not in text


def test_bad_device_is_refused_with_the_choices(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(_params()))
    r = CliRunner().invoke(app, ["plan", "--params", str(params), "--device", "tpu"])
    assert r.exit_code == 2 and "h100, h200, a100, cpu" in r.output


def test_calibration_times_real_steps() -> None:
    gcfg = GPTConfig.from_depth(1, 256, 32, 32)
    before = torch.get_num_threads()
    tok_s = calibrate_tok_per_s(gcfg, rows=2, batch_tokens=128, optim=OptimConfig(),
                                runtime=RuntimeConfig(device="cpu", dtype="fp32"), steps=2)
    assert 0 < tok_s < float("inf") and torch.get_num_threads() == before


def _eval_params(tmp_path: Path, **eval_section) -> dict:
    """_params with an eval section and the CORE tasks of a hand-made bundle folder: 2 multiple
    choice items of 3 and 2 choices (2 shots) and one language-modelling item (no shots)."""
    bundle = tmp_path / "evalsets" / "mine"
    (bundle / "eval_data" / "x").mkdir(parents=True)
    (bundle / "core.yaml").write_text(
        "icl_tasks:\n- {label: mc, dataset_uri: x/mc.jsonl, num_fewshot: [2], icl_task_type: multiple_choice}\n"
        "- {label: lm, dataset_uri: x/lm.jsonl, num_fewshot: [0], icl_task_type: language_modeling}\n")
    (bundle / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nmc,40\nlm,0\n")
    (bundle / "eval_data" / "x" / "mc.jsonl").write_text(
        json.dumps({"query": "a" * 10, "choices": ["b" * 5, "c" * 5, "d" * 5], "gold": 0}) + "\n"
        + json.dumps({"query": "e" * 20, "choices": ["f" * 3, "g" * 3], "gold": 1}) + "\n")
    (bundle / "eval_data" / "x" / "lm.jsonl").write_text(json.dumps({"context": "h" * 30, "continuation": "i" * 5}) + "\n")
    params = _params()
    params["eval"] = {"core_tasks": "evalsets:mine", "core_stages": ["pretrain"], "chat_stages": ["sft"],
                      "math_sources": [], "conversation_sources": [], "code_files": [], **eval_section}
    return params


def test_eval_forward_passes_by_hand(tmp_path: Path) -> None:
    params = _eval_params(tmp_path, max_new_tokens=10, generate_batch=4)
    params["tokenizer"]["vocab_size"] = 4096  # 3.39 chars/token
    (tmp_path / "evalsets" / "chat").mkdir()
    (tmp_path / "evalsets" / "chat" / "c.jsonl").write_text("{}\n" * 5)  # 5 code items: generated replies
    params["eval"]["code_files"] = ["chat/c.jsonl"]
    plan = make_plan(params, device="h100", tok_per_s=1000.0, root=tmp_path)
    by_stage = {e["stage"]: e for e in plan["eval"]}
    assert list(by_stage) == ["pretrain", "midtrain", "sft", "rl"]
    core = by_stage["pretrain"]["core"]
    # rows: "aaaaaaaaaa bbbbb" (16 chars) x3, "eeee...e fff" (24) x2 with 3 prompts each (2 shots), and
    # "hhh...h iiiii" (36) once: ceil(3*16/3.39)=15 x3, ceil(3*24/3.39)=22 x2, ceil(36/3.39)=11
    assert (core["tasks"], core["items"], core["rows"], core["tokens"]) == (2, 3, 6, 15 * 3 + 22 * 2 + 11)
    assert by_stage["pretrain"]["forward_passes"] == 3 and by_stage["pretrain"]["replies"] == 0
    # 5 replies, 4 at a time: 2 rounds of 10 decoding steps; 50 generated tokens
    assert by_stage["sft"]["core"] is None and by_stage["sft"]["replies"] == 5
    assert by_stage["sft"]["forward_passes"] == 20 and by_stage["sft"]["forward_tokens"] == 50
    assert by_stage["pretrain"]["time_s_lower_bound"] == pytest.approx(100 / 3000)  # forward = 1/3 of a step
    capped = make_plan(_eval_params(tmp_path / "b", core_max_items=1), device="h100", root=tmp_path / "b")
    assert capped["eval"][0]["core"]["items"] == 2  # one per task
    text = render_text(plan)
    assert "eval@pretrain" in text and "CORE 2 tasks x 3 items = 6 rows" in text and "chat 5 replies" in text


def test_eval_of_the_dclm_bundle_before_it_is_fetched(tmp_path: Path) -> None:
    params = _params()
    params["fetch"] = {"dclm_core": {"source": "dclm_core"}}
    params["eval"] = {"core_tasks": "raw:dclm_core", "core_max_items": 500}
    core = make_plan(params, device="h100", root=tmp_path, raw_root=tmp_path / "raw")["eval"][0]["core"]
    assert (core["tasks"], core["items"]) == (22, 22 * 500) and core["tokens"] == core["rows"] * params["model"].get(
        "sequence_len", 2048) and "published size" in core["basis"]


def test_eval_counts_the_chatcore_tasks_and_the_choice_prompts(tmp_path: Path) -> None:
    """ARC and MMLU are one forward per item (the letter preferred), GSM8K, HumanEval and
    SpellingBee are generated replies; each capped by eval.chat_max_items."""
    params = _eval_params(tmp_path, max_new_tokens=10, generate_batch=4, chat_max_items=100, categorical_files=["chat/a.jsonl"],
                          chat_tasks={"arc_easy": "arc_easy", "mmlu": "mmlu", "gsm8k": "gsm8k", "humaneval": "humaneval"})
    params["fetch"] = {"arc_easy": {"source": "ai2_arc", "config": "ARC-Easy"}, "mmlu": {"source": "mmlu"},
                       "gsm8k": {"source": "gsm8k"}, "humaneval": {"source": "humaneval"}}
    (tmp_path / "evalsets" / "chat").mkdir()
    (tmp_path / "evalsets" / "chat" / "a.jsonl").write_text(("x" * 47 + "\n") * 3)  # 3 own choice items of 47 chars
    sft = {e["stage"]: e for e in make_plan(params, device="h100", tok_per_s=1000.0, root=tmp_path)["eval"]}["sft"]
    assert sft["choice_prompts"] == 3 + 100 + 100  # own set, ARC-Easy (2,376 capped), MMLU (14,042 capped)
    assert sft["replies"] == 100 + 100  # GSM8K (1,319 capped), HumanEval (164 capped)
    cpt = chars_per_token(params["tokenizer"]["vocab_size"])
    own = 3 * math.ceil(47 / cpt)
    T = params["model"]["sequence_len"]  # a prompt is cut to the context
    assert sft["forward_tokens"] == 200 * 10 + own + 100 * min(T, 50) + 100 * min(T, 130)  # replies x max_new_tokens + prompts
    assert sft["forward_passes"] == math.ceil(200 / 4) * 10 + 203
    assert "203 choice prompts" in render_text(make_plan(params, device="h100", root=tmp_path))
