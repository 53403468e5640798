"""`lockstep plan`: what a params file will cost, before anything runs and without its data:
parameters and FLOPs per token from the model itself, tokens and wall time per training stage,
the forward passes of each eval stage, RL's rollouts and chat-eval replies at a per-device
decode rate (measured for the reference engine, a target for the fast one),
epochs per mixture component (lockstep.data.budget; from cache meta.json where caches exist, else
estimated from the fetch budgets), disk for raw snapshots, caches and checkpoints, and peak memory
per device (fitted to measured GPU peaks for the reference path, estimated for the fast paths).
Estimates only: it trains nothing and refuses nothing, but flags what will not fit.
`calibrate_training` times a few of the training loop's own steps of the planned shape on this
machine, as the stage compiles them, apart from their warm-up, with their peak memory.
Takes the params as a mapping; reading params.yaml or a preset is the CLI's job; each source
states its own expected size (lockstep.data.sources.size). Over 400 lines because the cost
formulas and the rendering of the one report they make read best side by side; each part is
short."""

from __future__ import annotations

import math
import dataclasses
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lockstep.core import fastpath
from lockstep.core.config import build_config
from lockstep.core.io import read_json
from lockstep.core.runtime import (
    Runtime,
    RuntimeConfig,
    choose_device_dtype,
    compile_enabled,
    configure_determinism,
    configure_threads,
    keep_heap_memory,
    measure_matmul_peak_flops,
)
from lockstep.data.budget import ASSUMED_CHARS_PER_TOKEN, Holding, mixture_epochs, over_limit
from lockstep.data.loaders import PretrainTokenStreamDataset, open_sft_dataset
from lockstep.data.sources import SOURCE_CONFIGS, source_module
from lockstep.data.sources.dclm_core import extract_zip
from lockstep.data.sources.size import SourceSize
from lockstep.evaluate.chatcore import BENCHMARKS
from lockstep.evaluate.core import load_core_tasks
from lockstep.model.gpt import GPT, GPTConfig
from lockstep.model.ops import CHUNK_ROWS
from lockstep.pipeline.eval import STAGES as EVAL_STAGES
from lockstep.pipeline.eval import EvalConfig
from lockstep.pipeline.train import holding_of
from lockstep.rl.config import RLConfig
from lockstep.train.optim import compiled_step, split_params
from lockstep.train.trainer import STAGE_CONFIGS, ModelParams, TrainConfig, Trainer, horizon_steps

FLAG = "!!"  # marks a figure over its limit in the text output


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator kind for wall-time and memory estimates."""

    name: str
    peak_flops: float | None  # dense bf16 FLOP/s per device from the datasheet; None = measure (CPU)
    mfu: float  # assumed model FLOPs utilisation
    memory_bytes: float | None  # per device; None = this host's RAM
    source: str  # where the peak comes from


# Datasheet dense (no sparsity) bf16 tensor-core peaks. The MFU is an assumption, not a
# measurement: ~40% is what compiled nanoGPT-style trainers report at this model size on these
# parts (override with --mfu). On CPU the peak is this machine's measured bf16/fp32 matmul rate
# (lockstep.core.runtime.measure_matmul_peak_flops) and --calibrate replaces the guess with timed steps.
DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("NVIDIA H100 SXM5 80GB", 989.4e12, 0.40, 80e9,
                       "NVIDIA H100 Tensor Core GPU datasheet: 989.4 TFLOPS BF16 dense (1,979 with sparsity)"),
    "h200": DeviceSpec("NVIDIA H200 SXM 141GB", 989.4e12, 0.40, 141e9,
                       "NVIDIA H200 Tensor Core GPU datasheet: 989 TFLOPS BF16 dense (1,979 with sparsity)"),
    "a100": DeviceSpec("NVIDIA A100 SXM4 80GB", 312e12, 0.40, 80e9,
                       "NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOPS BF16 dense (624 with sparsity)"),
    "cpu": DeviceSpec("this CPU", None, 0.5, None, "measured square-matmul rate on this machine"),
}


@dataclass(frozen=True)
class DecodeRate:
    """KV-cache decoding speed on one device kind, measured (or assumed) at one model at batch 1
    and batch 8: what RL rollouts and chat-eval replies take (decode_step_s scales it to the
    planned model and batch)."""

    n_layer: int  # the model it was taken at: its layers ...
    params_non_embedding: int  # ... and the weights a decoding step reads
    b1_tok_s: float
    b8_tok_s: float
    scale: str  # "layers": step time grows with n_layer (launch-bound); "params": with the weights read
    basis: str


# d12 at a 65,536-id vocabulary: 12 layers, 135,266,304 non-embedding parameters.
_D12 = dict(n_layer=12, params_non_embedding=135_266_304)
# Measured (the GPU check's decode phase, docs/performance.md: random weights, sampling at T=1,
# top-k 50, 16-token prompt): the reference engine at d12 read 151 tok/s at batch 1, ~2% of what an H100's memory
# bandwidth allows (0.37 GB of bf16 weights per token at ~3.35 TB/s is ~9,000 tok/s), and 1,018
# at batch 8 for 19% more time per step: the step is bound by kernel launches and the host, so it
# is scaled by layers. The fast path's rates are the project's targets, unmeasured; a CUDA-graph
# step is bound by reading the weights, so it is scaled by them.
_H100_REFERENCE = DecodeRate(**_D12, b1_tok_s=151.0, b8_tok_s=1018.0, scale="layers",
                             basis="measured at d12 on an H100, reference engine, fp32 weights (docs/performance.md)")
_FAST_TARGET = DecodeRate(**_D12, b1_tok_s=2000.0, b8_tok_s=10000.0, scale="params",
                          basis="target at d12 for the static-cache/CUDA-graph engine, bf16 weights: unmeasured")
DECODE_RATES: dict[tuple[str, str], DecodeRate] = {
    ("h100", "reference"): _H100_REFERENCE,
    ("h100", "fast"): _FAST_TARGET,
    ("h200", "reference"): dataclasses.replace(_H100_REFERENCE, basis="assumed equal to the H100's measured d12 rate "
                                               "(launch-bound: the same per-step work), unmeasured on an H200"),
    ("h200", "fast"): _FAST_TARGET,
    ("a100", "reference"): dataclasses.replace(_H100_REFERENCE, basis="assumed equal to the H100's measured d12 rate "
                                               "(launch-bound), unmeasured on an A100"),
}


# Bytes of a raw parquet snapshot per byte of text: 0.38 measured on the tiny preset's
# Shakespeare snapshot (1,856,254 parquet bytes for 4,863,432 text bytes).
RAW_BYTES_PER_TEXT_BYTE = 0.38
# Characters per token by tokenizer vocabulary: 3.39 measured (the 4,096-id BPE on the
# Shakespeare train split: 4,863,432 bytes in 1,436,242 tokens); the small-vocabulary figure
# is an assumption; large vocabularies take ASSUMED_CHARS_PER_TOKEN (FineWeb-Edu, 65,536 ids).
CHARS_PER_TOKEN_BY_VOCAB = ((1024, 2.4), (8192, 3.39), (math.inf, ASSUMED_CHARS_PER_TOKEN))
# Activations a block keeps for backward, per token per channel, under bf16 autocast. Measured:
# the peak CUDA memory of lockstep's reference training step (torch.compile, bf16 autocast, one
# H100, torch 2.11, 2026-11-26, lockstep 37d4ad1) was 45.2 GB at d12 x 32 rows x 2048 and 50.5 GB
# at d20 x 16 rows; less the optimizer state and HEAD_BYTES_PER_LOGIT["compiled"], that is 42.0
# and 41.1 B per token, channel and layer. A tally of the bf16 tensors backward needs (the fp32
# residual twice, the normed block inputs, q, k, v, the attention output, the MLP's two 4C-wide
# tensors) comes to ~40. Korthikanti et al. 2022's 34 (a GPT with dropout, no QK-norm) is below
# both measurements. Both ran heads of 64; the figure holds for any head split, as the tensors
# kept are C wide whatever it is, and what is kept per head (attention's log-sum-exp, QK-norm's
# scales: a few fp32 values per head and token) is under 0.3 B per token and channel at heads of 64
# (tests/test_plan.py counts autograd's saved bytes at heads of 64 and 128).
ACTIVATION_BYTES_PER_TOKEN_CHANNEL_16BIT = 42
# Bytes per logit (rows x T x V_padded) the loss head holds at the step's peak, by path
# (head_path). compiled: the bf16 logits kept for backward and their bf16 gradient, torch.compile
# fusing the fp32 soft cap and log-softmax away; with it the activation figure above puts both
# measured peaks within 1.5%. eager: an estimate, unmeasured:
# the fp32 tanh and log-softmax outputs kept, their fp32 gradients in backward. cpu_kernels:
# lockstep.model.kernels' fused head keeps only the dense part of the gradient, in the matmul dtype
# (2 B at bf16, x2 at fp32).
HEAD_BYTES_PER_LOGIT = {"compiled": 4.0, "eager": 16.0, "cpu_kernels": 2.0}
# The chunked head loss (GPU fast path, lockstep.model.ops.chunked_head_loss) holds no (B, T, V)
# tensor: at most ~2.5 fp32 copies of one chunk's logits (lockstep.model.ops.CHUNK_ROWS rows x V), 10 B
# per logit, plus the gradients its forward computes for the training loop's `sum` and holds
# until the backward: the hidden states' in the matmul dtype (2 B per token and channel at 16-bit,
# 4 at fp32) and the head's in fp32 (4 B per id and channel), and the fp32 gradient of the hidden
# states the backward returns (4 B per token and channel). An estimate, unmeasured.
CHUNKED_HEAD_BYTES_PER_LOGIT = 10.0
# Untimed calibration steps: the first carries compile, allocator and kernel warm-up, which the
# training loop leaves out of its throughput too (Trainer.step); a later step that still compiles
# a graph is warm-up as well, up to MAX_WARMUP_STEPS. A step still compiling after that points to
# a recompile on every step (dynamo gives up on a function only after
# torch._dynamo.config.recompile_limit, 8, recompiles), and waiting longer would only spend the
# time the plan is meant to save: the plan flags it instead.
WARMUP_STEPS = 1
MAX_WARMUP_STEPS = 4
ASSUMED_RL_PROMPT_TOKENS = 128  # a GSM8K problem rendered as a chat prompt, roughly

# The DCLM bundle before it is fetched: 22 tasks and 91,037 items, as published with its pinned
# digest (lockstep.data.sources.dclm_core). Choices per item are not published; 3 rows per item is an
# assumption (its multiple-choice tasks have 2 to 5 choices, its language-modelling tasks 1).
DCLM_CORE_FACTS = {"tasks": 22, "items": 91_037, "rows_per_item": 3}


def chars_per_token(vocab_size: int) -> float:
    return next(c for v, c in CHARS_PER_TOKEN_BY_VOCAB if vocab_size <= v)


def source_size(name: str, entry: dict[str, Any], *, root: Path) -> SourceSize | None:
    """The expected size of fetch entry `name` from its params (built into the source's config,
    so unset keys take the source's defaults), as its source module states it
    (lockstep.data.sources.size); None when the source states none."""
    src = entry.get("source", name)
    if src not in SOURCE_CONFIGS:
        return None
    cfg = build_config(SOURCE_CONFIGS[src], entry, where=f"fetch.{name}")
    size = getattr(source_module(src), "size", None)
    return None if size is None else size(cfg, name=name, root=root)


def estimated_holding(name: str, params: dict[str, Any], *, seq_len: int, root: Path) -> Holding | None:
    """A mixture component's Holding estimated from its fetch (and cache) params."""
    bare = name.split("/")[-1]
    entry = params.get("fetch", {}).get(bare)
    if entry is None:
        return None
    size = source_size(bare, entry, root=root)
    if size is None:
        return None
    cpt = chars_per_token(params["tokenizer"]["vocab_size"])
    kind = params.get("cache", {}).get(bare, {}).get("kind", "pretrain")
    if kind == "pretrain" and size.train_chars is not None:
        return Holding("pretrain", tokens=int(size.train_chars / cpt), examples=None,
                       origin=f"estimate: {size.basis} at {cpt:g} chars/token")
    if kind == "sft" and size.train_examples is not None:
        cache_val = params.get("cache", {}).get(bare, {}).get("val_frac")
        n = int(size.train_examples * (1 - (cache_val or 0.0)))
        per = min(size.tokens_per_example or seq_len, seq_len + 1)
        return Holding("sft", tokens=int(n * per), examples=n, origin=f"estimate: {size.basis}")
    return None


def cache_holding(name: str, cache_root: Path, *, seq_len: int) -> Holding | None:
    """A component's Holding from its built cache, opened as the training stage opens it and
    counted by the stage's own rule (lockstep.pipeline.train.holding_of), or None when not built.
    Shard hashes are not checked: only counts are read."""
    kinds = [name.split("/")[0]] if "/" in name else ["pretrain", "sft"]
    bare = name.split("/")[-1]
    for kind in kinds:
        folder = cache_root / kind / bare
        if not (folder / "meta.json").is_file():
            continue
        if kind == "pretrain":
            ds: Any = PretrainTokenStreamDataset(folder / "train", T=seq_len, verify=False)
        else:
            bos = read_json(folder / "meta.json", what="cache meta")["bos_id"]
            ds = open_sft_dataset(folder, "train", T=seq_len, pad_id=bos, verify=False)
        return dataclasses.replace(holding_of(ds), origin=f"cache {folder / 'meta.json'}")
    return None


def model_figures(gcfg: GPTConfig) -> dict[str, Any]:
    """Parameter counts and FLOPs per token from the model's own accounting (built on the meta
    device: no memory, no init)."""
    with torch.device("meta"):
        model = GPT(gcfg)
    groups = split_params(model)
    total = model.num_params()
    embedding = sum(p.numel() for p in model.embedding_weights())  # lookup tables; a tuple projection is a matmul
    return {
        "n_layer": gcfg.n_layer,
        "n_embd": gcfg.n_embd,
        "n_head": gcfg.n_head,
        "head_dim": gcfg.head_dim,
        "n_kv_head": gcfg.n_kv_head,
        "sequence_len": gcfg.sequence_len,
        "vocab_size": gcfg.vocab_size,
        "padded_vocab_size": gcfg.padded_vocab_size,
        "params_total": total,
        "params_embedding": embedding,
        "params_non_embedding": total - embedding,
        "params_muon": sum(p.numel() for _, p in groups["matrix"]),
        "params_adamw": sum(p.numel() for role in ("embed", "unembed", "scalar") for _, p in groups[role]),
        "flops_per_token": model.flops_per_token(),
    }


def head_path(device: str, runtime: RuntimeConfig) -> str:
    """Which loss head a training step on `device` (a DEVICES key) runs with `runtime`: chunked
    (runtime.kernels on a GPU: the chunked head + cross-entropy), cpu_kernels (runtime.kernels on
    CPU: lockstep.model.kernels' fused head), compiled (the reference under torch.compile, which
    `compile: auto` turns on for GPUs) or eager (the reference uncompiled)."""
    gpu = device != "cpu"
    return _head(gpu=gpu, compiled=compile_enabled(runtime.compile, "cuda" if gpu else "cpu"), kernels=runtime.kernels)


def _head(*, gpu: bool, compiled: bool, kernels: bool) -> str:
    """head_path from what a step runs: on a GPU or not, compiled or not, on the fast paths or not."""
    if kernels:
        return "chunked" if gpu else "cpu_kernels"
    return "compiled" if compiled else "eager"


HEAD_BASIS = {
    "compiled": "reference head, compiled: measured on an H100 (docs/performance.md)",
    "eager": "reference head, uncompiled: an estimate, unmeasured",
    "cpu_kernels": "lockstep.model.kernels' fused head: an estimate, unmeasured",
    "chunked": "chunked head loss (runtime.kernels on a GPU): an estimate, unmeasured",
}


def memory_per_device(
    m: dict[str, Any], *, rows: int, gpus: int, bf16: bool, head: str = "compiled"
) -> dict[str, float]:
    """Peak bytes per device while training, by part. fp32 master weights and gradients (4 + 4
    bytes per parameter); AdamW's two fp32 moments for the embedding and head (8 bytes / gpus)
    and Muon's fp32 momentum for the block matrices (4 bytes / gpus), sharded over the ranks
    (lockstep.train.optim.ShardedAdamW, ShardedMuon); activations of one micro-batch, n_layer x
    ACTIVATION_BYTES x rows x T x C bytes at 16-bit (x2 at fp32); and the loss head's logits as
    `head` (head_path) holds them: HEAD_BYTES_PER_LOGIT x rows x T x V_padded, or for the chunked
    head one chunk of lockstep.model.ops.CHUNK_ROWS rows plus the hidden states' and the head's
    gradients (CHUNKED_HEAD_BYTES_PER_LOGIT). Allocator
    slack, the CUDA context and compile workspaces are not counted."""
    P = m["params_total"]
    tokens = rows * m["sequence_len"]
    V = m["padded_vocab_size"]
    act = m["n_layer"] * ACTIVATION_BYTES_PER_TOKEN_CHANNEL_16BIT * tokens * m["n_embd"] * (1 if bf16 else 2)
    if head == "chunked":
        chunk = min(tokens, CHUNK_ROWS) * V
        held_dx = 2.0 if bf16 else 4.0  # bytes per token and channel
        logits = CHUNKED_HEAD_BYTES_PER_LOGIT * chunk + (4.0 + held_dx) * tokens * m["n_embd"] + 4.0 * V * m["n_embd"]
    elif head in HEAD_BYTES_PER_LOGIT:
        per = HEAD_BYTES_PER_LOGIT[head] * (2 if head == "cpu_kernels" and not bf16 else 1)
        logits = per * tokens * V
    else:
        raise ValueError(f"head={head!r} must be one of chunked, {', '.join(HEAD_BYTES_PER_LOGIT)}")
    parts = {"weights": 4.0 * P, "grads": 4.0 * P, "adamw": 8.0 * m["params_adamw"] / gpus,
             "muon": 4.0 * m["params_muon"] / gpus, "activations": float(act), "logits": float(logits)}
    return {**parts, "total": sum(parts.values())}


def host_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@dataclass(frozen=True)
class Throughput:
    """Per-device training speed the wall-time estimates use, and where it comes from."""

    device: str
    gpus: int
    peak_flops: float | None  # per device
    mfu: float | None
    tok_per_s: float  # per device
    basis: str
    memory_bytes: float
    bf16: bool


def throughput(device: str, *, gpus: int, flops_per_token: int, runtime: RuntimeConfig, mfu: float | None = None,
               peak_tflops: float | None = None, tok_per_s: float | None = None,
               calibration: Calibration | None = None) -> Throughput:
    """The per-device speed for `device` (a DEVICES key). A `calibration`'s rate, or a measured
    `tok_per_s` (a median of calibrations), wins; else peak x MFU / FLOPs per token, the peak
    from --peak-tflops, the datasheet, or on CPU a short matmul measurement in the runtime's
    compute dtype."""
    if tok_per_s is not None and calibration is not None:
        raise ValueError("pass a calibration or a measured tok_per_s, not both: the calibration carries its rate")
    if device not in DEVICES:
        raise ValueError(f"--device {device!r} is not one of {', '.join(DEVICES)}; pick one or pass --peak-tflops")
    spec = DEVICES[device]
    if device == "cpu":
        dev, dtype, _ = choose_device_dtype("cpu", runtime.dtype)
        bf16, memory = dtype == torch.bfloat16, host_memory_bytes()
    else:
        bf16, memory = True, float(spec.memory_bytes or 0)
    u = spec.mfu if mfu is None else mfu
    if calibration is not None:
        return Throughput(
            device,
            gpus,
            None,
            None,
            calibration.tok_per_s,
            f"calibrated: median of {len(calibration.timed_step_s)} timed training steps on this machine, "
            f"{calibration.ran()}",
            memory,
            bf16,
        )
    if tok_per_s is not None:
        return Throughput(device, gpus, None, None, tok_per_s, "calibrated: timed training steps on this machine",
                          memory, bf16)
    if peak_tflops is not None:
        peak, source = peak_tflops * 1e12, "--peak-tflops"
    elif spec.peak_flops is not None:
        peak, source = spec.peak_flops, spec.source
    else:
        peak = measure_matmul_peak_flops(dev, dtype, min_time_s=0.3)
        source = f"measured {str(dtype).removeprefix('torch.')} matmul on this CPU"
    return Throughput(device, gpus, peak, u, peak * u / flops_per_token, f"{source}, MFU {u:g} assumed", memory, bf16)


class RandomTokens:
    """A batch source (lockstep.train.trainer.BatchSource) of uniform random token ids, drawn from the
    generator the Trainer passes for each micro-batch: a training step costs what it does on real
    data, since the model's work depends on the batch's shape alone."""

    def __init__(self, vocab_size: int, seq_len: int) -> None:
        self.vocab_size, self.seq_len = vocab_size, seq_len

    def get_batch(self, *, B: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.randint(0, self.vocab_size, (B, self.seq_len + 1), generator=generator)  # (B, T+1)
        return rows[:, :-1], rows[:, 1:]


class DevicePeak:
    """The peak device memory of one step at a time: torch.cuda's allocator high-water mark, reset
    before the step and read after it. A CPU has no such counter: `read` gives None there."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> float | None:
        return float(torch.cuda.max_memory_allocated(self.device)) if self.cuda else None

    @property
    def basis(self) -> str:
        """What the figures a Calibration keeps beside this meter's are."""
        if self.cuda:
            return ("device: torch.cuda.max_memory_allocated of the timed steps (tensors only, not the allocator's "
                    "cache or the CUDA context); host: this process's peak resident set since it started")
        return ("device memory not measured on CPU; host: this process's peak resident set since it started "
                "(getrusage), more than the step holds")


def host_peak_rss_bytes() -> float | None:
    """This process's peak resident set since it started (getrusage), in bytes; None where the
    platform does not say. All the process ever held (Python, torch, the plan's own work): not a
    step's device memory."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


@dataclass(frozen=True)
class Calibration:
    """What `calibrate_training` measured on this machine: the training step a stage of the timed
    shape runs here (its compile, fast paths and optimizers), its median time and rate, the
    warm-up steps left out of them and what they cost, and the step's peak memory."""

    tok_per_s: float  # on this one device: tokens per step / step_s
    step_s: float  # the median of timed_step_s
    timed_step_s: tuple[float, ...]  # each timed step's wall time (Trainer.step's dt_s)
    warmup_steps: int  # untimed steps before them: the first, and each later one that compiled a graph
    warmup_s: float  # the warm-up steps' wall time: compiling, allocator and kernel warm-up
    warmup_graphs: int  # graphs torch.compile made in the warm-up
    timed_graphs: int  # graphs made in the timed steps: 0 unless still compiling after MAX_WARMUP_STEPS
    compiled: bool  # the model and loss through torch.compile (runtime.compile, as init_runtime decides)
    compiled_optimizer: bool  # Muon's update through torch.compile (lockstep.train.optim.compiled_step)
    kernels: bool  # the model's fast paths (runtime.kernels)
    device: str  # where it ran: "cpu", "cuda:0"
    dtype: str  # the matmuls' compute dtype: "float32", "bfloat16"
    rows: int  # sequences per micro-batch (the stage's device_batch_rows)
    micro_batches: int  # micro-batches per step (gradient accumulation on one device)
    device_peak_bytes: float | None  # the most any timed step held on the device; None on CPU (no counter)
    host_peak_rss_bytes: float | None  # this process's peak resident set since it started: not device memory
    memory_basis: str  # what the two memory figures are

    def ran(self) -> str:
        """What the timed step ran, in a few words."""
        return ", ".join([self.dtype, "compiled" if self.compiled else "eager",
                          "kernels" if self.kernels else "reference ops",
                          "Muon compiled" if self.compiled_optimizer else "Muon eager"])


def calibrate_training(gcfg: GPTConfig, cfg: TrainConfig, *, runtime: RuntimeConfig, steps: int = 3, seed: int = 0,
                       configure_process: bool = False) -> Calibration:
    """Time real training steps of the model `gcfg` under the training section `cfg` (its
    device_batch_rows, batch_tokens and optimizers) on this machine, in one process: a
    lockstep.train.trainer.Trainer on random tokens (RandomTokens), so the step timed is Trainer.step,
    the one the stage runs, with the runtime a stage decides from `runtime` (device, dtype,
    torch.compile per runtime.compile, the fast paths per runtime.kernels, Muon's compiled update
    where lockstep.train.optim.compiled_step says). The objective is cross-entropy over every target
    (the prefix-smoothed objective needs the tokenizer, which a plan does not read).

    Warm-up: the first step, and every later one that compiles a graph (up to
    MAX_WARMUP_STEPS), is left out of the timing and reported apart; then the median of `steps`
    timed steps. On CUDA, the peak allocated memory of the timed steps. The process's RNG is left
    as it was found. `configure_process` sets this process's threads, determinism and CPU heap
    reuse as a training stage does (lockstep.core.runtime), which changes CPU speed; the CLI and the
    bench set it, tests do not."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1: the timed steps, after the warm-up")
    if configure_process:
        configure_threads(runtime.threads, runtime.nproc)
        configure_determinism(runtime.deterministic)
        keep_heap_memory()
    dev, dtype, reason = choose_device_dtype(runtime.device, runtime.dtype)
    rt = Runtime(device=dev, dtype=dtype, reason=reason, compile=compile_enabled(runtime.compile, dev.type),
                 kernels=runtime.kernels)
    # The horizon only shapes the LR schedule, which costs nothing; no evaluation, sample or
    # checkpoint runs, since only Trainer.step is called.
    run_cfg = dataclasses.replace(cfg, num_steps=MAX_WARMUP_STEPS + steps, objective="ce", loss="all",
                                  eval_every_steps=0, sample_every_steps=0, checkpoint_every_steps=0)
    meter = DevicePeak(dev)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        model = GPT.build(gcfg, dev, seed=seed).use_kernels(rt.kernels)
        trainer = Trainer(model, run_cfg, rt, data=RandomTokens(gcfg.vocab_size, gcfg.sequence_len), seed=seed)
        dts: list[float] = []
        graphs: list[int] = []
        peaks: list[float | None] = []
        warm = WARMUP_STEPS
        while len(dts) < warm + steps:
            before = fastpath.graphs_compiled()
            meter.reset()
            dts.append(trainer.step().dt_s)
            peaks.append(meter.read())
            graphs.append(fastpath.graphs_compiled() - before)
            if graphs[-1] and len(dts) <= MAX_WARMUP_STEPS:
                warm = max(warm, len(dts))  # it compiled: warm-up, and the timed steps start after it
    timed = dts[warm:]
    step_s = statistics.median(timed)
    timed_peaks = [p for p in peaks[warm:] if p is not None]
    return Calibration(tok_per_s=run_cfg.batch_tokens / step_s, step_s=step_s, timed_step_s=tuple(timed),
                       warmup_steps=warm, warmup_s=sum(dts[:warm]), warmup_graphs=sum(graphs[:warm]),
                       timed_graphs=sum(graphs[warm:]), compiled=rt.compile, compiled_optimizer=compiled_step(rt),
                       kernels=rt.kernels, device=str(dev), dtype=str(dtype).removeprefix("torch."),
                       rows=cfg.device_batch_rows, micro_batches=trainer.accum,
                       device_peak_bytes=max(timed_peaks) if timed_peaks else None,
                       host_peak_rss_bytes=host_peak_rss_bytes(), memory_basis=meter.basis)


def plan_stage(stage: str, params: dict[str, Any], m: dict[str, Any], tp: Throughput, *, cache_root: Path | None,
               built: set[str], root: Path, head: str = "compiled") -> dict[str, Any]:
    """One training stage: horizon, tokens, FLOPs, wall time, epochs per component, memory."""
    cfg = build_config(STAGE_CONFIGS[stage], params.get(stage) or {}, where=stage)
    T = m["sequence_len"]
    steps, why = horizon_steps(cfg, flops_per_token=m["flops_per_token"], num_params=m["params_non_embedding"])
    tokens = steps * cfg.batch_tokens
    holdings: dict[str, Holding] = {}
    unknown = []
    for name in cfg.mixture:
        built_cache = cache_root is not None and name.split("/")[-1] in built
        h = cache_holding(name, cache_root, seq_len=T) if built_cache else None
        h = h or estimated_holding(name, params, seq_len=T, root=root)
        if h is None:
            unknown.append(name)
        else:
            holdings[name] = h
    known = {k: w for k, w in cfg.mixture.items() if k in holdings}
    # Weights normalise over the whole mixture, also when some component's size is unknown.
    scale = sum(known.values()) / sum(cfg.mixture.values()) if known else 0.0
    comps = mixture_epochs(known, holdings, total_tokens=round(tokens * scale), seq_len=T) if known else []
    bad = {c.name for c in over_limit(comps, cfg.max_epochs)}
    mem = memory_per_device(m, rows=cfg.device_batch_rows, gpus=tp.gpus, bf16=tp.bf16, head=head)
    return {
        "stage": stage,
        "steps": steps,
        "horizon": why,
        "batch_tokens": cfg.batch_tokens,
        "tokens": tokens,
        "flops": float(tokens) * m["flops_per_token"],
        "time_s": tokens / (tp.tok_per_s * tp.gpus),
        "max_epochs": cfg.max_epochs,
        "epochs": [
            {
                "name": c.name,
                "weight": c.weight,
                "epochs": c.epochs if math.isfinite(c.epochs) else None,
                "drawn_tokens": c.drawn_tokens,
                "drawn_rows": c.drawn_rows,
                "train_tokens": c.holding.tokens,
                "train_examples": c.holding.examples,
                "origin": c.holding.origin,
                "over_limit": c.name in bad,
            }
            for c in comps
        ]
        + [
            {
                "name": n,
                "weight": cfg.mixture[n] / sum(cfg.mixture.values()),
                "epochs": None,
                "drawn_tokens": None,
                "drawn_rows": None,
                "train_tokens": None,
                "train_examples": None,
                "origin": "unknown: no estimate for this source; build its cache",
                "over_limit": False,
            }
            for n in sorted(unknown)
        ],
        "device_batch_rows": cfg.device_batch_rows,
        "memory_bytes": mem,
        "memory_over": mem["total"] > tp.memory_bytes,
        "memory_head": head,
    }


def decode_path(runtime: RuntimeConfig) -> str:
    """The engine path RL and chat eval decode on: fast with runtime.kernels, else reference."""
    return "fast" if runtime.kernels else "reference"


def decode_step_s(rate: DecodeRate, m: dict[str, Any], batch: int) -> float:
    """Seconds of one decoding step of `batch` rows of the model `m` (model_figures) at `rate`:
    the step times at batch 1 and 8 joined linearly in the batch (extended past 8: an
    assumption), scaled from the rate's model by layers or by the weights read (rate.scale)."""
    if batch < 1:
        raise ValueError(f"batch={batch} must be >= 1")
    t1, t8 = 1.0 / rate.b1_tok_s, 8.0 / rate.b8_tok_s
    t = t1 + (t8 - t1) * (batch - 1) / 7
    if rate.scale == "layers":
        return t * m["n_layer"] / rate.n_layer
    return t * m["params_non_embedding"] / rate.params_non_embedding


def _decode(tp: Throughput, path: str) -> dict[str, Any]:
    rate = DECODE_RATES.get((tp.device, path))
    return {"path": path, "b1_tok_s": rate.b1_tok_s if rate else None, "b8_tok_s": rate.b8_tok_s if rate else None,
            "basis": rate.basis if rate else f"no decode rate for {tp.device} ({path} path): FLOP bound only"}


def plan_rl(
    params: dict[str, Any], m: dict[str, Any], tp: Throughput, *, decode: str = "reference"
) -> dict[str, Any] | None:
    """RL, which runs in one process on one device: tokens generated by the rollouts (an upper
    bound: every completion runs to max_new_tokens) and by the held-out evaluations (before the
    first update, every eval_every_steps and after the last: eval_problems x (one greedy reply +
    pass_k sampled)), tokens trained (prompt + completion of each of a group's rows, RLConfig.group_rows;
    with rl.prompt_once each prompt once for its group), and times: a FLOP bound (a lower
    bound, since decoding is bound by memory and launches, not FLOPs) and, where the device has a
    decode rate (DECODE_RATES for the `decode` path), the estimate: the decoding steps of each
    call as lockstep.rl.trainer makes them (rollouts: `generate_batch // group_size` problems' groups per
    call; held-out: `generate_batch // (pass_k + 1)` problems per call, greedy then sampled), each
    call max_new_tokens steps at its rows, plus the trained tokens at the training throughput."""
    if "rl" not in params:
        return None
    cfg = build_config(RLConfig, params["rl"] or {}, where="rl")
    completions = cfg.num_steps * cfg.problems_per_step * cfg.group_size
    generated = completions * cfg.max_new_tokens
    row = min(m["sequence_len"], ASSUMED_RL_PROMPT_TOKENS + cfg.max_new_tokens)  # a completion and its prompt
    prompt = min(ASSUMED_RL_PROMPT_TOKENS, row)
    # rl.prompt_once runs each problem's prompt once for its group; the group's rows count a
    # member greedy completion and the reference solution (at most every one trained)
    per_problem = prompt + cfg.group_rows * (row - prompt) if cfg.prompt_once else cfg.group_rows * row
    trained = cfg.num_steps * cfg.problems_per_step * per_problem
    evals = 2 + ((cfg.num_steps - 1) // cfg.eval_every_steps if cfg.eval_every_steps else 0)
    eval_generated = evals * cfg.eval_problems * (1 + cfg.pass_k) * cfg.max_new_tokens
    flops = (generated + eval_generated) * m["flops_per_token"] / 3 + trained * m[
        "flops_per_token"
    ]  # forward = 1/3 of fwd+bwd
    tok_equiv = flops / m["flops_per_token"]
    d = _decode(tp, decode)
    rate = DECODE_RATES.get((tp.device, decode))
    rollout_s = eval_s = time_s = None
    train_s = trained / tp.tok_per_s
    if rate is not None:
        def calls_s(problems: int, per_call: int, rows_per_problem: tuple[int, ...]) -> float:
            """max_new_tokens steps per call, each call `per_call` problems (the last fewer)."""
            sizes = [per_call] * (problems // per_call) + ([problems % per_call] if problems % per_call else [])
            return sum(cfg.max_new_tokens * decode_step_s(rate, m, n * r) for n in sizes for r in rows_per_problem)

        rollout_s = cfg.num_steps * calls_s(cfg.problems_per_step, max(1, cfg.generate_batch // cfg.group_size),
                                            (cfg.group_size,))
        eval_s = evals * calls_s(cfg.eval_problems, max(1, cfg.generate_batch // (cfg.pass_k + 1)), (1, cfg.pass_k))
        time_s = rollout_s + eval_s + train_s
    return {
        "steps": cfg.num_steps,
        "completions": completions,
        "generated_tokens": generated,
        "trained_tokens": trained,
        "evaluations": evals,
        "eval_generated_tokens": eval_generated,
        "flops": flops,
        "time_s_lower_bound": tok_equiv / tp.tok_per_s,
        "decode": d,
        "rollout_s": rollout_s,
        "eval_s": eval_s,
        "train_s": train_s,
        "time_s": time_s,
    }


def _core_folder(cfg: EvalConfig, params: dict[str, Any], *, root: Path, raw_root: Path | None,
                 work: Path) -> Path | None:
    """A folder holding the CORE tasks eval.core_tasks names, where one can be found before the
    eval runs: the own-task folder, a fetched bundle snapshot, or the fetch entry's local zip or
    folder (unpacked into `work`); None when only the download would tell."""
    kind, _, where = cfg.core_tasks.partition(":")
    if kind == "evalsets":
        folder = root / "evalsets" / where
        return folder if (folder / "core.yaml").is_file() else None
    if raw_root is not None and (raw_root / where / "eval_bundle" / "core.yaml").is_file():
        return raw_root / where / "eval_bundle"
    path = ((params.get("fetch") or {}).get(where) or {}).get("path")
    if path is None or not (root / path).exists():
        return None
    local = root / path
    if local.is_file():
        extract_zip(local, work)
        local = work
    return next((c.parent for c in sorted(local.glob("**/core.yaml"), key=lambda c: len(c.parts))), None)


def plan_core(cfg: EvalConfig, params: dict[str, Any], *, seq_len: int, cpt: float, root: Path,
              raw_root: Path | None) -> dict[str, Any]:
    """One CORE evaluation: items (eval.core_max_items per task), rows (one per choice, one forward
    batch per item) and tokens. From the task files where they can be read, a row taking
    (1 + shots) x its item's characters / chars-per-token, at most the context; else from
    DCLM_CORE_FACTS, every row at the full context (an upper bound)."""
    cap = cfg.core_max_items or None
    with tempfile.TemporaryDirectory() as tmp:
        folder = _core_folder(cfg, params, root=root, raw_root=raw_root, work=Path(tmp))
        tasks = load_core_tasks(folder, max_items_per_task=cap) if folder is not None else None
    if tasks is None:
        f = DCLM_CORE_FACTS
        items = min(f["items"], f["tasks"] * cap) if cap else f["items"]
        rows = items * f["rows_per_item"]
        return {"tasks": f["tasks"], "items": items, "rows": rows, "tokens": rows * seq_len,
                "basis": f"{cfg.core_tasks}: the DCLM bundle's published size, {f['rows_per_item']} rows/item assumed, "
                         "rows at the full context"}
    items = rows = tokens = 0
    for t in tasks:
        for it in t.items:
            if t.task_type == "multiple_choice":
                texts = [f"{it['query']} {c}" for c in it["choices"]]
            elif t.task_type == "schema":
                texts = [f"{c} {it['continuation']}" for c in it["context_options"]]
            else:
                texts = [f"{it['context']} {it['continuation']}"]
            items += 1
            rows += len(texts)
            tokens += sum(min(seq_len, math.ceil((1 + t.num_fewshot) * len(x) / cpt)) for x in texts)
    return {"tasks": len(tasks), "items": items, "rows": rows, "tokens": tokens,
            "basis": f"{cfg.core_tasks}: the task files, {cpt:g} chars/token"}


def plan_eval(params: dict[str, Any], m: dict[str, Any], tp: Throughput, *, root: Path,
              raw_root: Path | None, decode: str = "reference") -> list[dict[str, Any]]:
    """Each eval@<stage>: CORE forward passes (items, and rows = items x choices), chat
    generations (replies x max_new_tokens decoding steps, eval.generate_batch replies per step)
    and choice prompts (ARC, MMLU and the own categorical sets: one forward each, scored by the
    letter preferred), with a FLOP-bound time at the planned throughput (a forward is 1/3 of a
    training step's FLOPs): a lower bound, since decoding one token at a time is bound by memory
    and launches, not FLOPs. Where the device has a decode rate (DECODE_RATES, `decode` path),
    `generate_s` times the replies, each rank decoding its share generate_batch rows at a time,
    and `time_s` adds the rest at the FLOP bound; None without a rate."""
    if "eval" not in params:
        return []
    cfg = build_config(EvalConfig, params["eval"] or {}, where="eval")
    T = m["sequence_len"]
    cpt = chars_per_token(params["tokenizer"]["vocab_size"])
    core = plan_core(cfg, params, seq_len=T, cpt=cpt, root=root, raw_root=raw_root) \
        if set(cfg.core_stages) & set(EVAL_STAGES) else None
    replies = 0
    for src in (*cfg.math_sources, *cfg.conversation_sources):
        entry = (params.get("fetch") or {}).get(src) or {}
        size = source_size(src, entry, root=root) if entry else None
        n = int(size.val_examples or 0) if size is not None else 0
        replies += min(n, cfg.chat_max_items) if cfg.chat_max_items else n
    def capped(n: int) -> int:
        return min(n, cfg.chat_max_items) if cfg.chat_max_items else n

    for rel in cfg.code_files:
        replies += capped(len(_jsonl_lines(root / "evalsets" / rel)))
    # one forward per item, over its tokens: a lettered prompt, or (reply_choice_files) the
    # choices' rows, about the item's length in all
    choices, choice_tokens = 0, 0
    for rel in (*cfg.categorical_files, *cfg.reply_choice_files):
        lines = _jsonl_lines(root / "evalsets" / rel)
        lines = lines[: capped(len(lines))]
        choices += len(lines)
        choice_tokens += sum(min(T, math.ceil(len(line) / cpt)) for line in lines)
    for task, name in cfg.chat_tasks.items():
        entry = (params.get("fetch") or {}).get(name) or {}
        size = source_size(name, entry, root=root) if entry else None
        n = capped(int(size.val_examples or 0)) if size is not None else 0
        if BENCHMARKS[task].kind == "categorical":
            choices += n
            choice_tokens += n * min(T, size.tokens_per_example or T) if size is not None else 0
        else:
            replies += n
    decode_steps = math.ceil(replies / cfg.generate_batch) * cfg.max_new_tokens
    # Each rank decodes its share of the replies, generate_batch rows at a time (lockstep.evaluate.chat).
    per_rank = math.ceil(replies / tp.gpus)
    rate = DECODE_RATES.get((tp.device, decode))
    generate_s = None
    if rate is not None and per_rank:
        batch = min(cfg.generate_batch, per_rank)
        generate_s = math.ceil(per_rank / batch) * cfg.max_new_tokens * decode_step_s(rate, m, batch)
    out = []
    for stage in EVAL_STAGES:  # dvc.yaml runs eval@ for each
        c = core if stage in cfg.core_stages else None
        chat_stage = stage in cfg.chat_stages
        gen_tokens = replies * cfg.max_new_tokens + choice_tokens if chat_stage else 0
        tokens = (c["tokens"] if c else 0) + gen_tokens
        flop_s = tokens / (3 * tp.tok_per_s * tp.gpus)
        gen_s = generate_s if chat_stage and replies else 0.0
        # the replies at the decode rate, the rest (CORE rows, choice prompts) at the FLOP bound
        prompt_s = (tokens - (replies * cfg.max_new_tokens if chat_stage else 0)) / (3 * tp.tok_per_s * tp.gpus)
        out.append({"stage": stage, "core": c, "replies": replies if chat_stage else 0,
                    "choice_prompts": choices if chat_stage else 0,
                    "forward_passes": (c["items"] if c else 0) + (decode_steps + choices if chat_stage else 0),
                    "forward_tokens": tokens, "time_s_lower_bound": flop_s, "generate_s": gen_s,
                    "time_s": None if gen_s is None else gen_s + prompt_s})
    return out


def _jsonl_lines(path: Path) -> list[str]:
    """The non-blank lines of an eval set file; none when it is missing (check_inputs says so)."""
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()] if path.is_file() else []


def token_bytes(vocab_size: int) -> int:
    return 2 if vocab_size <= 65536 else 4


def _folder_bytes(folder: Path) -> float:
    return float(sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()))


def plan_disk(params: dict[str, Any], m: dict[str, Any], *, root: Path, raw_root: Path | None,
              cache_root: Path | None, built: set[str]) -> dict[str, Any]:
    """Raw snapshots (text bytes x RAW_BYTES_PER_TEXT_BYTE), token caches (tokens x 2 or 4
    bytes; SFT adds a mask byte per token and an 8-byte offset per example) and one checkpoint
    (fp32 weights, AdamW moments, Muon momentum: the ranks' optimizer files hold each once).
    Snapshots and caches that exist under `raw_root` / `cache_root` and `built` from these
    params are measured instead."""
    vocab = params["tokenizer"]["vocab_size"]
    cpt = chars_per_token(vocab)
    tb = token_bytes(vocab)
    rows = []
    for name, entry in (params.get("fetch") or {}).items():
        size = source_size(name, entry, root=root)
        folder = raw_root / name if raw_root is not None else None
        if folder is not None and name in built:
            raw = _folder_bytes(folder)
            raw_basis = f"measured {folder}"
        elif size is not None:
            text = ((size.train_chars or 0) + (size.val_chars or 0)
                    + ((size.train_examples or 0) + (size.val_examples or 0)) * (size.tokens_per_example or 0) * cpt)
            raw, raw_basis = text * RAW_BYTES_PER_TEXT_BYTE, f"estimate: {size.basis}"
        else:
            raw, raw_basis = None, "unknown"
        kind = (params.get("cache") or {}).get(name, {}).get("kind")
        cache = None
        if size is not None and kind == "pretrain":
            cache = ((size.train_chars or 0) + (size.val_chars or 0)) / cpt * tb
        elif size is not None and kind == "sft":
            n = (size.train_examples or 0) + (size.val_examples or 0)
            cache = n * (size.tokens_per_example or 0) * (tb + 1) + 8 * n
        cache_dir = cache_root / (kind or "pretrain") / name if cache_root is not None else None
        if cache_dir is not None and name in built and (cache_dir / "meta.json").is_file():
            cache = _folder_bytes(cache_dir)
        rows.append({"name": name, "raw_bytes": raw, "cache_bytes": cache, "basis": raw_basis})
    ckpt = 4.0 * m["params_total"] + 8.0 * m["params_adamw"] + 4.0 * m["params_muon"]
    return {"sources": rows, "raw_bytes": sum(r["raw_bytes"] or 0 for r in rows),
            "cache_bytes": sum(r["cache_bytes"] or 0 for r in rows), "checkpoint_bytes": ckpt}


def built_from(params: dict[str, Any], raw_root: Path | None, cache_root: Path | None) -> set[str]:
    """The sources whose snapshot under `raw_root` was fetched with these params (every key of
    `fetch.<name>` as recorded in its meta.json, and `data_seed`), and whose cache, where there is
    one, was encoded at these params' vocab size. Only these are measured: the folders of another
    preset (a tiny workspace planned for d12) describe other data."""
    if raw_root is None:
        return set()
    seed = params.get("data_seed", params.get("seed"))
    vocab = params["tokenizer"]["vocab_size"]
    built = set()
    for name, entry in (params.get("fetch") or {}).items():
        meta_path = raw_root / name / "meta.json"
        if not meta_path.is_file():
            continue
        meta = read_json(meta_path, what="snapshot meta")
        recorded = meta.get("config") or {}
        if meta.get("seed") != seed or any(recorded.get(k) != v for k, v in (entry or {}).items()):
            continue
        caches = [cache_root / kind / name / "meta.json" for kind in ("pretrain", "sft")] if cache_root else []
        if all(read_json(c, what="cache meta").get("vocab_size") == vocab for c in caches if c.is_file()):
            built.add(name)
    return built


def make_plan(params: dict[str, Any], *, device: str = "h100", gpus: int = 1, mfu: float | None = None,
              peak_tflops: float | None = None, tok_per_s: float | None = None, cache_root: Path | None = None,
              raw_root: Path | None = None, root: Path = Path("."), kernels: bool | None = None,
              calibration: Calibration | None = None) -> dict[str, Any]:
    """The plan of `params` (a params.yaml mapping) as a JSON-ready dict. `cache_root`/`raw_root`:
    where built caches and snapshots are looked up (None: estimate everything from the fetch
    params); `root`: what relative source paths (roam's notes folder) are relative to; `kernels`
    overrides runtime.kernels (the fast paths: the loss head's memory, the decode rate);
    `calibration` (calibrate_training of the pretrain section) gives the throughput, and its
    measured memory goes beside the plan's estimate for the shape it timed."""
    if gpus < 1:
        raise ValueError(f"--gpus {gpus} must be >= 1")
    model_params = build_config(ModelParams, params.get("model") or {}, where="model")
    gcfg = model_params.gpt_config(params["tokenizer"]["vocab_size"])
    m = model_figures(gcfg)
    runtime = build_config(RuntimeConfig, params.get("runtime") or {}, where="runtime")
    if kernels is not None:
        runtime = dataclasses.replace(runtime, kernels=kernels)
    head, decode = head_path(device, runtime), decode_path(runtime)
    tp = throughput(device, gpus=gpus, flops_per_token=m["flops_per_token"], runtime=runtime, mfu=mfu,
                    peak_tflops=peak_tflops, tok_per_s=tok_per_s, calibration=calibration)
    built = built_from(params, raw_root, cache_root)
    stages = [plan_stage(s, params, m, tp, cache_root=cache_root, built=built, root=root, head=head)
              for s in STAGE_CONFIGS if s in params]
    flags = [
        f"{s['stage']}: {c['name']} read {c['epochs']:.3g} times, above {s['stage']}.max_epochs={s['max_epochs']:g}"
        for s in stages
        for c in s["epochs"]
        if c["over_limit"]
    ]
    flags += [
        f"{s['stage']}: ~{s['memory_bytes']['total'] / 1e9:.1f} GB per device, above the device's "
        f"{tp.memory_bytes / 1e9:.0f} GB; lower {s['stage']}.device_batch_rows"
        for s in stages
        if s["memory_over"]
    ]
    if calibration is not None and calibration.timed_graphs:
        flags.append(f"calibration: the timed steps still compiled {calibration.timed_graphs} graph(s) after "
                     f"{calibration.warmup_steps} warm-up steps, so its rate includes compiling; something recompiles "
                     "every step (TORCH_LOGS=recompiles says what)")
    return {
        "preset": params.get("preset"),
        "model": m,
        "throughput": {"device": tp.device, "device_name": DEVICES[tp.device].name, "gpus": tp.gpus,
                       "peak_flops_per_device": tp.peak_flops, "mfu": tp.mfu, "tok_per_s_per_device": tp.tok_per_s,
                       "basis": tp.basis, "memory_bytes_per_device": tp.memory_bytes, "bf16": tp.bf16},
        "stages": stages,
        "calibration": None if calibration is None else _calibration(calibration, m),
        "rl": plan_rl(params, m, tp, decode=decode),
        "eval": plan_eval(params, m, tp, root=root, raw_root=raw_root, decode=decode),
        "disk": plan_disk(params, m, root=root, raw_root=raw_root, cache_root=cache_root, built=built),
        "assumptions": {
            "chars_per_token": chars_per_token(params["tokenizer"]["vocab_size"]),
            "raw_bytes_per_text_byte": RAW_BYTES_PER_TEXT_BYTE,
            "activation_bytes_per_token_channel_16bit": ACTIVATION_BYTES_PER_TOKEN_CHANNEL_16BIT,
            "rl_prompt_tokens": ASSUMED_RL_PROMPT_TOKENS,
            "kernels": runtime.kernels,
            "memory_head": f"{head}: {HEAD_BASIS[head]}",
            "decode": _decode(tp, decode),
            "time": "training stages: steps only (evaluations, checkpoints and start-up not included; ranks scale "
                    "linearly); rl and eval: decoding at the decode rate where the device has one, else a FLOP bound",
        },
        "flags": flags,
    }


def _calibration(cal: Calibration, m: dict[str, Any]) -> dict[str, Any]:
    """A calibration for the plan's JSON, with `estimated_memory_bytes`: what memory_per_device
    says the timed step holds (its rows, one device's optimizer state, its dtype and loss head),
    to read beside the measured `device_peak_bytes`."""
    head = _head(gpu=cal.device.startswith("cuda"), compiled=cal.compiled, kernels=cal.kernels)
    estimate = memory_per_device(m, rows=cal.rows, gpus=1, bf16=cal.dtype == "bfloat16", head=head)["total"]
    return {**dataclasses.asdict(cal), "estimated_memory_bytes": estimate, "estimated_memory_head": head}


def _size(x: float | None, unit: str = "") -> str:
    if x is None:
        return "?"
    for suffix, div in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}{unit}"
    return f"{x:.3g}{unit}"


def _duration(s: float | None) -> str:
    if s is None:
        return "?"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.0f} s"


def render_text(plan: dict[str, Any]) -> str:
    """The plan as plain text; figures over a limit carry FLAG."""
    m, tp = plan["model"], plan["throughput"]
    out = [f"plan for preset {plan['preset']!r}" if plan["preset"] else "plan",
           f"model   {m['n_layer']} layers x {m['n_embd']} channels, {m['n_head']} heads of {m['head_dim']}, "
           f"T={m['sequence_len']}, vocab {m['vocab_size']} (padded {m['padded_vocab_size']})",
           f"params  {_size(m['params_total'])} total = {_size(m['params_embedding'])} embedding + "
           f"{_size(m['params_non_embedding'])} non-embedding "
           f"(Muon {_size(m['params_muon'])}, AdamW {_size(m['params_adamw'])})",
           f"compute {_size(m['flops_per_token'])}FLOP/token (6N + attention, as the training loop's MFU)",
           f"device  {tp['gpus']} x {tp['device_name']}: {_size(tp['tok_per_s_per_device'])} tok/s per device "
           f"({tp['basis']}"
           + (f"; peak {_size(tp['peak_flops_per_device'])}FLOP/s" if tp["peak_flops_per_device"] else "") + ")"]
    cal = plan.get("calibration")
    if cal:
        steps_ms = [1e3 * t for t in cal["timed_step_s"]]
        out.append(f"timed   {cal['micro_batches']} x {cal['rows']} rows x T={m['sequence_len']} on {cal['device']}: "
                   f"median step {1e3 * cal['step_s']:.1f} ms of {len(steps_ms)} "
                   f"({min(steps_ms):.1f}-{max(steps_ms):.1f}); "
                   f"warm-up left out: {cal['warmup_steps']} step(s), {cal['warmup_s']:.1f} s, "
                   f"{cal['warmup_graphs']} graph(s) compiled")
    out.append("")
    out.append(f"{'stage':9} {'steps':>7} {'tokens':>8} {'FLOPs':>8} {'time':>10} {'memory/dev':>11}  horizon")
    for s in plan["stages"]:
        mem = f"{_size(s['memory_bytes']['total'], 'B')}{' ' + FLAG if s['memory_over'] else ''}"
        out.append(f"{s['stage']:9} {s['steps']:>7} {_size(s['tokens']):>8} {_size(s['flops']):>8} "
                   f"{_duration(s['time_s']):>10} {mem:>11}  {s['horizon']}")
    rl = plan["rl"]
    if rl:
        when = _duration(rl["time_s"]) if rl["time_s"] is not None else ">" + _duration(rl["time_s_lower_bound"])
        split = (f": rollouts {_duration(rl['rollout_s'])}, evaluations {_duration(rl['eval_s'])}, "
                 f"updates {_duration(rl['train_s'])}") if rl["time_s"] is not None else ""
        out.append(f"{'rl':9} {rl['steps']:>7} {_size(rl['generated_tokens'] + rl['trained_tokens']):>8} "
                   f"{_size(rl['flops']):>8} {when:>10} {'':>11}  "
                   f"{_size(rl['generated_tokens'])} generated (at most) + {_size(rl['eval_generated_tokens'])} in "
                   f"{rl['evaluations']} evaluations + {_size(rl['trained_tokens'])} trained tokens{split}")
    for e in plan.get("eval", []):
        what = []
        if e["core"]:
            c = e["core"]
            what.append(f"CORE {c['tasks']} tasks x {_size(c['items'])} items = {_size(c['rows'])} rows ({c['basis']})")
        if e["replies"]:
            what.append(f"chat {_size(e['replies'])} replies")
        if e.get("choice_prompts"):
            what.append(f"{_size(e['choice_prompts'])} choice prompts")
        when = _duration(e["time_s"]) if e.get("time_s") is not None else ">" + _duration(e["time_s_lower_bound"])
        if e.get("generate_s"):
            what.append(f"replies decoded in {_duration(e['generate_s'])}")
        out.append(f"{'eval@' + e['stage']:9} {_size(e['forward_passes']):>7} {_size(e['forward_tokens']):>8} "
                   f"{'':>8} {when:>10} {'':>11}  "
                   f"forward passes, tokens: {'; '.join(what) or 'bpb only'}")
    out += ["", "epochs per mixture component (limit: the stage's max_epochs)"]
    for s in plan["stages"]:
        limit = "no limit" if s["max_epochs"] is None else f"limit {s['max_epochs']:g}"
        out.append(f"  {s['stage']} ({limit})")
        for c in s["epochs"]:
            held = (f"{_size(c['train_tokens'])} tokens" if c["train_examples"] is None
                    else f"{_size(c['train_examples'])} examples") if c["epochs"] is not None else "?"
            ep = "?" if c["epochs"] is None else f"{c['epochs']:.3g}"
            out.append(f"    {c['name']:14} w={c['weight']:<5.3g} {ep:>7}{' ' + FLAG if c['over_limit'] else '   '} "
                       f"of {held} ({c['origin']})")
    d = plan["disk"]
    out += ["", f"disk    raw snapshots ~{_size(d['raw_bytes'], 'B')}, caches ~{_size(d['cache_bytes'], 'B')}, "
                f"one checkpoint ~{_size(d['checkpoint_bytes'], 'B')} (fp32 weights + optimizer state)"]
    for r in d["sources"]:
        out.append(f"    {r['name']:14} raw {_size(r['raw_bytes'], 'B'):>7}  "
                   f"cache {_size(r['cache_bytes'], 'B'):>7}  ({r['basis']})")
    worst = max(plan["stages"], key=lambda s: s["memory_bytes"]["total"], default=None)
    if worst:
        mb = worst["memory_bytes"]
        out.append(f"memory  {worst['stage']} per device: " + ", ".join(f"{k} {_size(v, 'B')}" for k, v in mb.items())
                   + f" (device has {_size(tp['memory_bytes_per_device'], 'B')})")
        out.append(f"        loss head {plan['assumptions']['memory_head']}")
    if cal:
        estimate = f"~{_size(cal['estimated_memory_bytes'], 'B')} estimated ({cal['estimated_memory_head']} head)"
        if cal["device_peak_bytes"] is not None:
            measured = f"peak {_size(cal['device_peak_bytes'], 'B')} allocated (torch.cuda.max_memory_allocated)"
        else:
            measured = (f"device memory not measured on CPU (host peak RSS {_size(cal['host_peak_rss_bytes'], 'B')}: "
                        "all this process held since it started)")
        out.append(f"        timed step, {cal['rows']} rows on 1 device: {measured} vs {estimate}")
    a = plan["assumptions"]
    d = a["decode"]
    rates = (f"{d['b1_tok_s']:,.0f} tok/s at batch 1, {d['b8_tok_s']:,.0f} at batch 8, "
             if d["b1_tok_s"] is not None else "")
    out.append(f"decode  {d['path']} engine: {rates}{d['basis']}")
    out += [
        "",
        f"assumes {a['chars_per_token']:g} chars/token, raw parquet {a['raw_bytes_per_text_byte']:g} B per text byte, "
        f"{a['activation_bytes_per_token_channel_16bit']} B/token/channel/layer of activations at 16-bit; "
        f"{a['time']}",
    ]
    for f in plan["flags"]:
        out.append(f"{FLAG} {f}")
    return "\n".join(out) + "\n"
