"""`lockstep plan` (lockstep.tools.plan): parameter counts, FLOPs per token, memory and time against
hand computations for a small config; epochs from a built cache equal to the training stage's
own count; the flags; the --json schema through the command line; the calibration's timed
Trainer steps, compiled as the stage compiles them, apart from their warm-up, with their memory."""

from __future__ import annotations

import functools
import json
import math
import statistics
from pathlib import Path

import pytest
import torch
import yaml
from torch._dynamo.testing import CompileCounterWithBackend
from typer.testing import CliRunner

from lockstep.cli import app
from lockstep.core import fastpath
from lockstep.core.runtime import RuntimeConfig
from lockstep.data.cache_build import build_pretrain_cache
from lockstep.data.loaders import PretrainTokenStreamDataset
from lockstep.model.gpt import GPT, GPTConfig
from lockstep.pipeline.train import holding_of
from lockstep.tools import plan as plan_module
from lockstep.tools.plan import (
    DECODE_RATES,
    DEVICES,
    FLAG,
    HEAD_BASIS,
    MAX_WARMUP_STEPS,
    DevicePeak,
    calibrate_training,
    chars_per_token,
    decode_step_s,
    head_path,
    make_plan,
    memory_per_device,
    model_figures,
    render_text,
)
from lockstep.train.trainer import TrainConfig

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
        "pretrain": {
            "mixture": {"prose": 1.0},
            "batch_tokens": 256,
            "device_batch_rows": 2,
            "num_steps": 10,
            **pretrain,
        },
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
                   "activations": 1 * 42 * 2 * 64 * 64, "logits": 4.0 * 2 * 64 * 256,
                   "total": 8.0 * P + 4.0 * adamw + 2.0 * muon + 42 * 2 * 64 * 64 + 4.0 * 2 * 64 * 256}
    assert memory_per_device(m, rows=2, gpus=2, bf16=False)["activations"] == 2 * 42 * 2 * 64 * 64
    # the loss head by path: bytes per logit, or one chunk plus the hidden states' gradient (the
    # returned fp32 one and the bf16 one the forward holds) and the head's fp32 gradient
    logits = {h: memory_per_device(m, rows=2, gpus=2, bf16=True, head=h)["logits"] for h in HEAD_BASIS}
    assert logits == {
        "compiled": 4.0 * 128 * 256,
        "eager": 16.0 * 128 * 256,
        "cpu_kernels": 2.0 * 128 * 256,
        "chunked": 10.0 * 128 * 256 + (4.0 + 2.0) * 128 * 64 + 4.0 * 256 * 64,
    }  # the batch is under a chunk
    assert memory_per_device(m, rows=2, gpus=2, bf16=False, head="chunked")["logits"] == (
        10.0 * 128 * 256 + (4.0 + 4.0) * 128 * 64 + 4.0 * 256 * 64)
    assert memory_per_device(m, rows=2, gpus=2, bf16=False, head="cpu_kernels")["logits"] == 4.0 * 128 * 256
    with pytest.raises(ValueError, match="head='fused'"):
        memory_per_device(m, rows=2, gpus=2, bf16=True, head="fused")


@pytest.mark.parametrize("depth,rows,measured_gb", [(12, 32, 45.2), (20, 16, 50.5)])
def test_memory_of_the_reference_path_matches_the_h100_peaks(depth: int, rows: int, measured_gb: float) -> None:
    """torch.cuda.max_memory_allocated of lockstep's compiled reference step on one H100
    (docs/performance.md) against the plan's estimate for the same shape; the chunked head
    drops the (B, T, V) logits, which the chunk estimate keeps under two gigabytes."""
    m = model_figures(GPTConfig.from_depth(depth, 65536, 2048))
    ref = memory_per_device(m, rows=rows, gpus=1, bf16=True, head="compiled")
    assert ref["total"] == pytest.approx(measured_gb * 1e9, rel=0.15)
    assert ref["total"] == pytest.approx(measured_gb * 1e9, rel=0.02)  # what the fitted figures give today
    fast = memory_per_device(m, rows=rows, gpus=1, bf16=True, head="chunked")
    assert fast["logits"] < 2e9 < ref["logits"] and fast["total"] == pytest.approx(
        ref["total"] - ref["logits"] + fast["logits"]
    )


def _saved_activation_bytes(gcfg: GPTConfig, rows: int) -> int:
    """Bytes of the tensors autograd keeps for backward through the blocks (weights left out),
    counted once per storage."""
    model = GPT.build(gcfg, "cpu", seed=0)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    idx = torch.randint(0, gcfg.vocab_size, (rows, gcfg.sequence_len), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.final_hidden(idx)
    return sum(kept.values())


def test_activations_do_not_depend_on_the_head_split() -> None:
    """The plan's activation term is per channel, so d12 at heads of 128 (the preset) plans what it
    planned at heads of 64; what autograd keeps agrees: the same to 0.5% at 4 heads of 64 and 2 of 128."""
    shapes = {hd: GPTConfig.from_depth(4, 512, 128, hd) for hd in (64, 128)}
    kept = {hd: _saved_activation_bytes(gcfg, rows=2) for hd, gcfg in shapes.items()}
    assert (shapes[64].n_head, shapes[128].n_head) == (4, 2)
    assert kept[128] == pytest.approx(kept[64], rel=5e-3)
    planned = {hd: memory_per_device(model_figures(GPTConfig.from_depth(12, 65536, 2048, hd)), rows=32, gpus=8,
                                     bf16=True)["activations"] for hd in (64, 128)}
    assert planned[128] == planned[64]


def test_head_path_follows_device_compile_and_kernels() -> None:
    assert head_path("h100", RuntimeConfig()) == "compiled"  # compile: auto is on for a GPU
    assert head_path("h100", RuntimeConfig(compile="off")) == "eager"
    assert head_path("h100", RuntimeConfig(kernels=True)) == "chunked"
    assert head_path("cpu", RuntimeConfig()) == "eager"
    assert head_path("cpu", RuntimeConfig(compile="on")) == "compiled"
    assert head_path("cpu", RuntimeConfig(kernels=True)) == "cpu_kernels"


def test_decode_step_from_the_measured_rates_by_hand() -> None:
    ref, fast = DECODE_RATES["h100", "reference"], DECODE_RATES["h100", "fast"]
    d12 = model_figures(GPTConfig.from_depth(12, 65536, 2048))
    assert d12["params_non_embedding"] == ref.params_non_embedding and d12["n_layer"] == ref.n_layer
    assert (ref.b1_tok_s, ref.b8_tok_s) == (151.0, 1018.0)  # measured, docs/performance.md
    assert decode_step_s(ref, d12, 1) == pytest.approx(1 / 151) and decode_step_s(ref, d12, 8) == pytest.approx(
        8 / 1018
    )
    # linear in the batch between the two measurements, and past them
    assert decode_step_s(ref, d12, 4) == pytest.approx(1 / 151 + (8 / 1018 - 1 / 151) * 3 / 7)
    assert decode_step_s(ref, d12, 15) == pytest.approx(1 / 151 + (8 / 1018 - 1 / 151) * 2)
    # the reference step grows with the layers (launch-bound), the fast one with the weights read
    d24 = model_figures(GPTConfig.from_depth(24, 65536, 2048))
    assert decode_step_s(ref, d24, 1) == pytest.approx(2 / 151)
    ratio = d24["params_non_embedding"] / d12["params_non_embedding"]
    assert decode_step_s(fast, d24, 8) == pytest.approx(ratio * 8 / 10000)
    with pytest.raises(ValueError, match="batch=0"):
        decode_step_s(ref, d12, 0)


def _rl_params() -> dict:
    params = _params()
    params["rl"] = {"num_steps": 10, "problems_per_step": 2, "group_size": 4, "max_new_tokens": 16,
                    "eval_every_steps": 4, "eval_problems": 3, "pass_k": 2, "generate_batch": 6}
    return params


def test_rl_time_from_the_decode_rate_by_hand() -> None:
    plan = make_plan(_rl_params(), device="h100", tok_per_s=1000.0)
    rl, m = plan["rl"], plan["model"]
    rate = DECODE_RATES["h100", "reference"]
    assert rl["evaluations"] == 4  # before, after steps 4 and 8, after the last
    assert rl["eval_generated_tokens"] == 4 * 3 * (1 + 2) * 16
    # rollouts: 6 rows a call hold one problem's group of 4, so each update makes 2 calls of 4 rows
    assert rl["rollout_s"] == pytest.approx(10 * 2 * 16 * decode_step_s(rate, m, 4))
    # held-out: 6 // (2 + 1) = 2 problems a call, so calls of 2 then 1: greedy at 2 and 1 rows,
    # sampled at 4 and 2
    per_eval = 16 * (decode_step_s(rate, m, 2) + decode_step_s(rate, m, 4) + decode_step_s(rate, m, 1)
                     + decode_step_s(rate, m, 2))
    assert rl["eval_s"] == pytest.approx(4 * per_eval)
    trained = 10 * 2 * 4 * min(64, 128 + 16)
    assert rl["train_s"] == pytest.approx(trained / 1000.0)
    assert rl["time_s"] == pytest.approx(rl["rollout_s"] + rl["eval_s"] + rl["train_s"])
    assert rl["decode"] == {"path": "reference", "b1_tok_s": 151.0, "b8_tok_s": 1018.0, "basis": rate.basis}
    # the fast path plans with its target rates; a CPU has no decode rate, only the FLOP bound
    fast = make_plan(_rl_params(), device="h100", tok_per_s=1000.0, kernels=True)["rl"]
    assert fast["decode"]["path"] == "fast" and "unmeasured" in fast["decode"]["basis"]
    assert fast["rollout_s"] < rl["rollout_s"]
    cpu = make_plan(_rl_params(), device="cpu", tok_per_s=1000.0)["rl"]
    assert cpu["time_s"] is None and cpu["time_s_lower_bound"] > 0 and cpu["decode"]["b1_tok_s"] is None
    text = render_text(plan)
    assert "rollouts" in text and "decode  reference engine: 151 tok/s at batch 1" in text


def test_rl_prompt_once_trains_each_prompt_once_per_group_and_counts_the_reference() -> None:
    params = _rl_params()
    params["model"]["sequence_len"] = 256  # room for the assumed prompt and the 16-token replies
    plain = make_plan(params, device="h100", tok_per_s=1000.0)["rl"]
    params["rl"]["prompt_once"] = True
    once = make_plan(params, device="h100", tok_per_s=1000.0)["rl"]
    assert plain["trained_tokens"] == 10 * 2 * 4 * (128 + 16)
    assert once["trained_tokens"] == 10 * 2 * (128 + 4 * 16)
    assert once["train_s"] == pytest.approx(once["trained_tokens"] / 1000.0)
    assert once["generated_tokens"] == plain["generated_tokens"]
    params["rl"]["reference_rollout"] = "unsolved"  # one more row a group, trained but not generated
    guided = make_plan(params, device="h100", tok_per_s=1000.0)["rl"]
    assert guided["trained_tokens"] == 10 * 2 * (128 + 5 * 16)
    assert guided["generated_tokens"] == plain["generated_tokens"]


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
        other = make_plan(
            {**params, **changed}, device="h100", cache_root=tmp_path / "cache", raw_root=tmp_path / "raw"
        )
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
    assert set(plan) == {"preset", "model", "throughput", "stages", "calibration", "rl", "eval", "disk", "assumptions",
                         "flags"}
    assert plan["preset"] == "d20" and plan["flags"] == [] and plan["calibration"] is None
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
    # the d20 preset runs the fast paths (runtime.kernels: true); --no-kernels plans the reference
    assert plan["assumptions"]["kernels"] is True and plan["assumptions"]["memory_head"].startswith("chunked")
    assert {"time_s", "rollout_s", "eval_s", "train_s", "decode"} <= set(plan["rl"])
    r = CliRunner().invoke(app, ["plan", "--preset", "d20", "--gpus", "8", "--device", "h100", "--no-kernels", "--json",
                                 "--cache", str(tmp_path / "none"), "--raw", str(tmp_path / "none")])
    reference = json.loads(r.output)
    assert reference["assumptions"]["kernels"] is False and reference["assumptions"]["memory_head"].startswith(
        "compiled"
    )
    assert plan["stages"][0]["memory_bytes"]["total"] < reference["stages"][0]["memory_bytes"]["total"]
    assert plan["rl"]["decode"]["path"] == "fast" and reference["rl"]["decode"]["path"] == "reference"
    text = CliRunner().invoke(app, ["plan", "--preset", "d20", "--device", "h100", "--cache", str(tmp_path)]).output
    assert "pretrain" in text and "fineweb_edu" in text and FLAG not in text


def test_bad_device_is_refused_with_the_choices(tmp_path: Path) -> None:
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(_params()))
    r = CliRunner().invoke(app, ["plan", "--params", str(params), "--device", "tpu"])
    assert r.exit_code == 2 and "h100, h200, a100, cpu" in r.output


# The calibration's shape: _params' model (depth 1, T=64, 256 ids) at 2 rows x 2 micro-batches.
_CAL_GPT = GPTConfig.from_depth(1, 256, 64, 32)
_CAL_TRAIN = TrainConfig(batch_tokens=256, device_batch_rows=2)


def _compile_with(monkeypatch: pytest.MonkeyPatch, backend) -> None:
    """torch.compile, wherever lockstep calls it, through `backend`: the compile the stage would
    make, in seconds on a CPU instead of inductor's minute."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))


def test_calibration_compiles_where_the_stage_compiles_and_times_apart_from_the_warm_up(monkeypatch) -> None:
    backend = CompileCounterWithBackend("aot_eager")
    _compile_with(monkeypatch, backend)
    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    cal = calibrate_training(_CAL_GPT, _CAL_TRAIN, runtime=RuntimeConfig(device="cpu", dtype="fp32", compile="on"),
                             steps=2)
    assert cal.compiled and not cal.compiled_optimizer and not cal.kernels  # Muon compiles on CUDA only
    # the graphs were compiled in the warm-up, and only there
    assert backend.frame_count >= 1 and cal.warmup_graphs == backend.frame_count and cal.timed_graphs == 0
    assert cal.warmup_steps >= 1 and len(cal.timed_step_s) == 2
    # the compile (seconds) stays out of the timed steps (milliseconds)
    assert max(cal.timed_step_s) < cal.warmup_s
    assert cal.step_s == statistics.median(cal.timed_step_s) and cal.tok_per_s == pytest.approx(256 / cal.step_s)
    assert (cal.rows, cal.micro_batches, cal.device, cal.dtype) == (2, 2, "cpu", "float32")
    # the caller's RNG and threads are as they were
    assert torch.equal(torch.get_rng_state(), rng) and torch.get_num_threads() == threads


@pytest.mark.parametrize("setting", ["off", "auto"])  # auto compiles on CUDA only, as init_runtime decides
def test_calibration_compiles_nothing_where_the_stage_compiles_nothing(monkeypatch, setting: str) -> None:
    backend = CompileCounterWithBackend("aot_eager")
    _compile_with(monkeypatch, backend)
    cal = calibrate_training(_CAL_GPT, _CAL_TRAIN, runtime=RuntimeConfig(device="cpu", dtype="fp32", compile=setting),
                             steps=2)
    assert not cal.compiled and backend.frame_count == 0 and cal.warmup_graphs == cal.timed_graphs == 0
    assert cal.warmup_steps == 1 and len(cal.timed_step_s) == 2  # the first step is warm-up all the same
    # on a CPU the device memory is said to be unmeasured; the process's RSS is labelled as what it is
    assert cal.device_peak_bytes is None and cal.host_peak_rss_bytes > 0
    assert "not measured on CPU" in cal.memory_basis and "resident set" in cal.memory_basis


class _CompilingSteps:
    """Stands in for fastpath.graphs_compiled, which calibrate_training reads before and after each
    step: one new graph after each step named in `compiling` (1-based)."""

    def __init__(self, compiling: set[int]) -> None:
        self.compiling, self.reads, self.graphs = compiling, 0, 0

    def __call__(self) -> int:
        self.reads += 1
        if self.reads % 2 == 0 and self.reads // 2 in self.compiling:
            self.graphs += 1
        return self.graphs


def test_a_later_step_that_compiles_is_warm_up_too(monkeypatch) -> None:
    cpu = RuntimeConfig(device="cpu", dtype="fp32")
    monkeypatch.setattr(fastpath, "graphs_compiled", _CompilingSteps({1, 3}))  # a recompile in the third step
    cal = calibrate_training(_CAL_GPT, _CAL_TRAIN, runtime=cpu, steps=2)
    assert (cal.warmup_steps, cal.warmup_graphs, cal.timed_graphs, len(cal.timed_step_s)) == (3, 2, 0, 2)
    assert "calibration" not in " ".join(make_plan(_params(), device="cpu", calibration=cal)["flags"])
    # a step that still compiles past MAX_WARMUP_STEPS is timed, and the plan flags it
    monkeypatch.setattr(fastpath, "graphs_compiled", _CompilingSteps(set(range(1, 20))))
    cal = calibrate_training(_CAL_GPT, _CAL_TRAIN, runtime=cpu, steps=2)
    assert (cal.warmup_steps, cal.timed_graphs, len(cal.timed_step_s)) == (MAX_WARMUP_STEPS, 2, 2)
    flags = make_plan(_params(), device="cpu", calibration=cal)["flags"]
    assert any("still compiled 2 graph(s)" in f for f in flags), flags


def test_calibration_keeps_the_peak_device_memory_of_the_timed_steps(monkeypatch) -> None:
    """torch.cuda's peak counter stood in for (CUDA-only): reset before each step, read after it,
    the most of the timed steps kept; the warm-up step's higher peak (its compile) is not."""
    peaks = iter([9e9, 2e9, 3e9])  # warm-up, then the two timed steps
    calls: list[str] = []

    class CudaPeak(DevicePeak):
        def __init__(self, device: torch.device) -> None:
            super().__init__(device)
            self.cuda = True

    def reset(device) -> None:
        calls.append("reset")
        reset.now = next(peaks)

    monkeypatch.setattr(plan_module, "DevicePeak", CudaPeak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: calls.append("read") or reset.now)
    cal = calibrate_training(_CAL_GPT, _CAL_TRAIN, runtime=RuntimeConfig(device="cpu", dtype="fp32"), steps=2)
    assert calls == ["reset", "read"] * 3
    assert cal.device_peak_bytes == 3e9 and "max_memory_allocated" in cal.memory_basis
    plan = make_plan(_params(), device="cpu", calibration=cal)
    assert "timed step, 2 rows on 1 device: peak 3GB allocated (torch.cuda.max_memory_allocated)" in render_text(plan)


def test_calibrate_through_the_command_line(tmp_path: Path, monkeypatch, restore_process_state) -> None:
    monkeypatch.setattr(plan_module, "keep_heap_memory", lambda: False)  # the heap policy is per process
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(_params()))
    args = ["plan", "--params", str(params), "--device", "cpu", "--calibrate", "--calibrate-steps", "2",
            "--cache", str(tmp_path / "none"), "--raw", str(tmp_path / "none")]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)
    cal = plan["calibration"]
    assert {"tok_per_s", "step_s", "timed_step_s", "warmup_steps", "warmup_s", "warmup_graphs", "compiled",
            "compiled_optimizer", "kernels", "device_peak_bytes", "host_peak_rss_bytes", "memory_basis",
            "estimated_memory_bytes"} <= set(cal)
    assert plan["throughput"]["tok_per_s_per_device"] == cal["tok_per_s"] and len(cal["timed_step_s"]) == 2
    assert plan["throughput"]["basis"].startswith("calibrated: median of 2 timed training steps")
    assert not cal["compiled"] and not cal["kernels"] and cal["device_peak_bytes"] is None
    # the estimate beside it is the plan's own for that step: pretrain's rows, one device, fp32, eager head
    assert cal["estimated_memory_bytes"] == plan["stages"][0]["memory_bytes"]["total"]
    # --kernels times the fast paths the plan is asked for, not the params' reference
    assert json.loads(CliRunner().invoke(app, [*args, "--json", "--kernels"]).output)["calibration"]["kernels"]
    text = CliRunner().invoke(app, args).output
    assert "timed   2 x 2 rows x T=64 on cpu: median step" in text
    assert "warm-up left out: 1 step(s)" in text and "0 graph(s) compiled" in text
    assert "device memory not measured on CPU (host peak RSS" in text and "estimated (eager head)" in text


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
    (bundle / "eval_data" / "x" / "lm.jsonl").write_text(
        json.dumps({"context": "h" * 30, "continuation": "i" * 5}) + "\n"
    )
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
    # the replies at the decode rate: 2 batches of up to 4 rows x 10 steps, the prompts at the FLOP bound
    step = decode_step_s(DECODE_RATES["h100", "reference"], plan["model"], 4)
    assert by_stage["sft"]["generate_s"] == pytest.approx(2 * 10 * step)
    assert by_stage["sft"]["time_s"] == pytest.approx(2 * 10 * step) and by_stage["pretrain"]["generate_s"] == 0
    assert by_stage["pretrain"]["time_s"] == pytest.approx(100 / 3000)
    two = {e["stage"]: e for e in make_plan(params, device="h100", gpus=2, tok_per_s=1000.0, root=tmp_path)["eval"]}
    assert two["sft"]["generate_s"] == pytest.approx(10 * decode_step_s(DECODE_RATES["h100", "reference"],
                                                                        plan["model"], 3))  # 3 of 5 on rank 0
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
    params = _eval_params(
        tmp_path,
        max_new_tokens=10,
        generate_batch=4,
        chat_max_items=100,
        categorical_files=["chat/a.jsonl"],
        chat_tasks={"arc_easy": "arc_easy", "mmlu": "mmlu", "gsm8k": "gsm8k", "humaneval": "humaneval"},
    )
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
    assert sft["forward_tokens"] == 200 * 10 + own + 100 * min(T, 50) + 100 * min(
        T, 130
    )  # replies x max_new_tokens + prompts
    assert sft["forward_passes"] == math.ceil(200 / 4) * 10 + 203
    assert "203 choice prompts" in render_text(make_plan(params, device="h100", root=tmp_path))
