"""GPU benchmark of lockstep against the nanochat baseline, on one CUDA device (or on this CPU at
tiny sizes, to rehearse the script). Not a test. Each measuring subcommand prints one line
`RESULT {json}`; `compare` reads such lines back and prints ratios computed from them alone:
lockstep / nanochat (tok/s, peak memory, MFU), fast / reference within lockstep, and what every
check found (equality, recompiles while timed, fast paths that fell back).

  env                      torch, CUDA, the device, its datasheet bf16 peak and the measured bf16
                           matmul rate (8192^3 on CUDA, 512^3 on CPU)
  ls_train                 lockstep's Trainer, random token windows: `--kernels off` is the
                           reference path, `--kernels on` the fast paths (GPT.use_kernels(True)
                           and Runtime(kernels=True)); tok/s from the median of the Trainer's step
                           times (as for nanochat), the compile/warm-up step left out; peak memory
                           torch.cuda.max_memory_allocated; graphs compiled during the timed steps
  nc_train                 nanochat's GPT + MuonAdamW, the step of its base_train (compiled model,
                           backward, optimizer step), same shapes and the same MFU peak
  ls_head                  the lm_head loss alone at the training shape: reference against chunked,
                           time, memory each adds, relative errors
  ls_shard                 the sharded optimizers at world size 1 against the replicated ones on the
                           same gradients: bit-equal weights without clipping
  ls_decode_check          the fast engine against the reference engine on weights where attention
                           and positions decide the tokens (checkable_weights): fp32 greedy and
                           sampled equal on every token, bf16 greedy equal up to a near tie
  ls_decode / nc_decode    KV-cache decoding, batch 1 and 8, sampling (T=1, top-k 50), bf16 compute
                           on fp32 weights: lockstep's reference engine, fast engine (CUDA graphs on
                           CUDA) and fast engine compiled; nanochat's engine
  stages                   lockstep's training stages, eval and RL on a smoke workspace (--smoke)
  compare FILE             ratios from a results.jsonl (or a log holding RESULT lines)

`--warm` runs only what a phase compiles, filling torch.compile's on-disk caches, and prints a
`WARM` line: bench/gpu_check.py runs the warm phases side by side, then each timed phase alone.

The baseline is optional: NANOCHAT_ROOT names a nanochat checkout at commit 92d63d4 (the folder
holding nanochat/gpt.py); nc_* refuse with a message without it. It is measured, never imported
by lockstep. Sizes default to the GPU check's (d12, 32 rows of 2048, vocab 65536, heads of 128 as
the d12/d20 presets take them); on CPU the sequence defaults to 128. A CPU rehearsal:

    python bench/bench_gpu.py ls_train --depth 2 --rows 2 --steps 3 --compile off --kernels on
    bash bench/gpu_check.sh   # the whole check, see bench/gpu_check.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "lib") not in sys.path:
    sys.path.insert(0, str(ROOT / "lib"))  # run as a script from any folder

NANOCHAT_COMMIT = "92d63d4"
PROMPT = list(range(100, 116))  # 16 prompt ids, below any special id
DECODE_BATCHES = (1, 8)
# Steps a --warm training run takes: the first compiles the forward, the backward and the
# optimizers' updates; the second shows nothing is left (the schedule's new values are tensors).
WARM_STEPS = 2


# ---------------------------------------------------------------- shared
def result(phase: str, **fields: Any) -> None:
    """Print the phase's one RESULT line: its fields plus the software and the device."""
    import torch

    out: dict[str, Any] = {"phase": phase, **fields, "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        out["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 1e9, 2)
    else:
        out["gpu"] = None
        # Linux reports ru_maxrss in KiB: the whole process's high-water mark, not a tensor count
        out["host_peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)
    print("RESULT " + json.dumps(out), flush=True)


def warm_line(phase: str, t0: float) -> None:
    """What a `--warm` run prints instead of a RESULT: it ran only what compiles (filling the
    compile caches that the timed run of the same phase then reads), and how long that took."""
    print("WARM " + json.dumps({"phase": phase, "s": round(time.perf_counter() - t0, 1),
                                "graphs_compiled": graphs_compiled()}), flush=True)


def graphs_compiled() -> int:
    """Graphs torch.compile has made in this process so far."""
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def default_seq(a: argparse.Namespace) -> int:
    return a.seq or (2048 if device().type == "cuda" else 128)


def mfu_peak(dtype, declared_tflops: float) -> tuple[float, str]:
    """The FLOP/s MFU is quoted against, as lockstep's Trainer picks it (lockstep.core.runtime.peak_flops):
    --peak-tflops, else the datasheet bf16 peak of a known GPU, else a short matmul measurement."""
    from lockstep.core.runtime import Runtime, peak_flops

    rt = Runtime(device=device(), dtype=dtype, reason="bench")
    return peak_flops(rt, declared=declared_tflops * 1e12)


def compute_dtype(a: argparse.Namespace):
    """The compute dtype as a stage's `runtime.dtype` picks it (lockstep.core.runtime.choose_device_dtype):
    `auto` is bf16 autocast on CUDA sm80+ (the d12/d20 presets) and on CPUs with native bf16."""
    from lockstep.core.runtime import choose_device_dtype

    _, dtype, why = choose_device_dtype(device().type, a.dtype)
    return dtype, why


def cmd_env(a: argparse.Namespace) -> None:
    import torch

    from lockstep.core.runtime import declared_peak_flops

    d = device()
    n = 8192 if d.type == "cuda" else 512
    # Random operands: a GPU multiplies constant matrices faster than random ones (fewer bits
    # toggle, less power drawn), and training multiplies random-looking ones.
    g = torch.Generator(device=d).manual_seed(0)
    x = torch.randn(n, n, device=d, dtype=torch.bfloat16, generator=g)
    y = torch.randn(n, n, device=d, dtype=torch.bfloat16, generator=g)
    for _ in range(3):
        x @ y
    rates, reps = [], 10 if d.type == "cuda" else 2
    for _ in range(5):
        synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            x @ y
        synchronize()
        rates.append(2 * n**3 * reps / (time.perf_counter() - t0))
    rate = statistics.median(rates)
    declared = declared_peak_flops(d)
    memory = torch.cuda.get_device_properties(d).total_memory / 1e9 if d.type == "cuda" else None
    result("env", device=str(d), capability=list(torch.cuda.get_device_capability(d)) if d.type == "cuda" else None,
           device_memory_gb=None if memory is None else round(memory, 1), cpus=os.cpu_count(),
           matmul_n=n, bf16_matmul_tflops=round(rate / 1e12, 3),
           declared_bf16_tflops=None if declared is None else round(declared / 1e12, 1),
           cpu_threads=torch.get_num_threads())


# ---------------------------------------------------------------- lockstep training
class RandomWindows:
    """Random windows of a fixed random token tensor on the host: what a cache reader hands the
    Trainer, without a cache."""

    def __init__(self, n_tokens: int, vocab: int, seq: int, seed: int = 0) -> None:
        import torch

        self.tokens = torch.randint(0, vocab, (n_tokens,), generator=torch.Generator().manual_seed(seed))
        self.T = seq

    def get_batch(self, *, B: int, generator):
        import torch

        starts = torch.randint(0, self.tokens.numel() - self.T - 1, (B,), generator=generator)
        rows = self.tokens[starts[:, None] + torch.arange(self.T + 1)]  # (B, T+1)
        return rows[:, :-1], rows[:, 1:]


def cmd_ls_train(a: argparse.Namespace) -> None:
    import logging

    from lockstep.core import fastpath
    from lockstep.core.runtime import Runtime
    from lockstep.model.gpt import GPT
    from lockstep.train.optim import OptimConfig
    from lockstep.train.trainer import TrainConfig, Trainer

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    d, seq, kernels = device(), default_seq(a), a.kernels == "on"
    dtype, why = compute_dtype(a)
    rt = Runtime(device=d, dtype=dtype, reason=why, compile=a.compile == "on", kernels=kernels)
    gcfg = model_config(a, seq)
    model = GPT.build(gcfg, d, seed=0).use_kernels(kernels)
    cfg = TrainConfig(batch_tokens=a.rows * seq * a.accum, device_batch_rows=a.rows, num_steps=a.steps, warmup_steps=0,
                      eval_every_steps=0, checkpoint_every_steps=0, max_epochs=None, peak_flops=a.peak_tflops * 1e12,
                      optim=OptimConfig(muon_momentum_warmup_steps=0))
    data = RandomWindows(max(1 << 20, 8 * a.rows * (seq + 1)), a.vocab, seq)
    t0 = time.perf_counter()
    trainer = Trainer(model, cfg, rt, data=data, seed=0)
    # Steps alone (Trainer.step): fit() would also write a checkpoint, seconds of disk at d20.
    # The first step compiles; WARM_STEPS make sure nothing is left to compile for the timed run.
    stats = [trainer.step() for _ in range(WARM_STEPS if a.warm else 1)]
    if a.warm:
        return warm_line("ls_train", t0)
    after_first = graphs_compiled()
    stats += [trainer.step() for _ in range(a.steps - 1)]
    wall = time.perf_counter() - t0
    if not trainer.dts:
        raise SystemExit("no timed step: pass --steps >= 2 (the first step carries compile and warm-up)")
    step_s = statistics.median(trainer.dts)
    tok_s = cfg.batch_tokens / step_s
    result("ls_train", depth=a.depth, heads=gcfg.n_head, rows=a.rows, seq=seq, accum=a.accum, steps=a.steps,
           compile=a.compile, kernels=a.kernels, dtype=str(dtype).removeprefix("torch."), vocab=a.vocab,
           tok_per_s=round(tok_s),
           step_ms=round(1e3 * step_s, 2), mfu=round(100 * trainer.flops_per_token * tok_s / trainer.peak, 2),
           peak_flops=trainer.peak, peak_source=trainer.peak_why, flops_per_token=trainer.flops_per_token,
           params=model.num_params(), losses=[round(s.train_loss, 5) for s in stats],
           first_step_s=round(trainer.train_time_s - sum(trainer.dts), 2), wall_s=round(wall, 1),
           graphs_compiled=graphs_compiled(), recompiles=graphs_compiled() - after_first,
           fast_paths=fastpath.facts())


# ---------------------------------------------------------------- nanochat (the baseline)
def nanochat_root(cmd: str) -> Path:
    """NANOCHAT_ROOT, checked to hold nanochat's package, or SystemExit(2) saying how to get one."""
    raw = os.environ.get("NANOCHAT_ROOT", "")
    root = Path(raw).expanduser().resolve() if raw else None
    if root is None or not (root / "nanochat" / "gpt.py").is_file():
        where = f"NANOCHAT_ROOT={raw!r} holds no nanochat/gpt.py" if raw else "NANOCHAT_ROOT is not set"
        print(f"error: {cmd} measures the nanochat baseline, and {where}. Clone it and point at the checkout: "
              f"git clone https://github.com/karpathy/nanochat && git -C nanochat checkout {NANOCHAT_COMMIT} && "
              f"export NANOCHAT_ROOT=$PWD/nanochat. The lockstep subcommands (ls_train, ls_decode) need none of this.",
              file=sys.stderr)
        raise SystemExit(2)
    return root


def import_nanochat(cmd: str, compile_on: bool) -> None:
    root = nanochat_root(cmd)
    sys.path.insert(0, str(root))
    if importlib.util.find_spec("rustbpe") is None:
        # nanochat.engine imports its tokenizer module, which imports rustbpe (a Rust extension
        # needed only to train a tokenizer); the benchmark never tokenizes text.
        sys.modules["rustbpe"] = types.ModuleType("rustbpe")
    if not compile_on:
        # nanochat's optimizer steps are torch.compile'd by decorator; --compile off runs the
        # functions they wrap eagerly, as it runs lockstep's (a CPU rehearsal without compiling).
        import nanochat.optim as optim

        for name in ("adamw_step_fused", "muon_step_fused"):
            fn = getattr(optim, name)
            setattr(optim, name, getattr(fn, "_torchdynamo_orig_callable", getattr(fn, "__wrapped__", fn)))


def n_heads(a: argparse.Namespace) -> int:
    """Attention heads of the benchmarked width 64 x depth: ceil(width / --head-dim), nanochat's
    rule, which at the default 128 gives the d12 and d20 presets' 6 and 10 heads of 128, and a
    width under 128 (depth 1) one head of its whole width."""
    if a.head_dim < 1:
        raise SystemExit(f"--head-dim={a.head_dim} must be a positive number of channels per head, e.g. 128")
    return math.ceil(64 * a.depth / a.head_dim)


def model_config(a: argparse.Namespace, seq: int):
    """lockstep's GPTConfig of the benchmarked shape: depth, vocab, `seq` tokens, n_heads(a) heads,
    and the d12/d20 presets' rotary base and init (nanochat's: 100,000 and its recipe)."""
    from lockstep.model.gpt import GPTConfig

    return GPTConfig.from_depth(a.depth, a.vocab, seq, n_head=n_heads(a), rope_theta=100_000.0,
                                init="nanochat")


def nanochat_model(depth: int, vocab: int, seq: int, window: str, n_head: int):
    """nanochat's GPT of lockstep's shape at this depth: width 64 x depth, `n_head` heads, full
    attention in every layer (`window` "L"; nanochat's own default "SSSL" slides 3 of 4)."""
    import torch
    from nanochat.gpt import GPT, GPTConfig

    width = 64 * depth
    cfg = GPTConfig(sequence_len=seq, vocab_size=vocab, n_layer=depth, n_head=n_head, n_kv_head=n_head,
                    n_embd=width, window_pattern=window)
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device())
    model.init_weights()
    return model


def cmd_nc_train(a: argparse.Namespace) -> None:
    import torch

    import_nanochat("nc_train", a.compile == "on")
    from nanochat.common import COMPUTE_DTYPE

    seq = default_seq(a)
    model = nanochat_model(a.depth, a.vocab, seq, a.nc_window, n_heads(a))
    opt = model.setup_optimizer()
    step_model = torch.compile(model, dynamic=False) if a.compile == "on" else model
    flops_per_token = model.estimate_flops()
    g = torch.Generator().manual_seed(0)
    data = RandomWindows(max(1 << 20, 8 * a.rows * (seq + 1)), a.vocab, seq)
    times, losses = [], []
    t_start = time.perf_counter()
    after_first = 0
    for step in range(WARM_STEPS if a.warm else a.steps):
        if step == 1:
            after_first = graphs_compiled()
        batches = [data.get_batch(B=a.rows, generator=g) for _ in range(a.accum)]
        synchronize()
        t0 = time.perf_counter()
        for x, y in batches:
            # nanochat's loss views its targets flat: they must be contiguous, not a window slice
            loss = step_model(
                x.contiguous().to(device(), non_blocking=True), y.contiguous().to(device(), non_blocking=True)
            )
            (loss / a.accum).backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the host transfer nanochat's loop makes to log the loss
        synchronize()
        times.append(time.perf_counter() - t0)
    if a.warm:
        return warm_line("nc_train", t_start)
    wall = time.perf_counter() - t_start
    if len(times) < 2:
        raise SystemExit("no timed step: pass --steps >= 2 (the first step carries compile and warm-up)")
    step_s = statistics.median(times[1:])
    tok_s = a.rows * seq * a.accum / step_s
    # the same peak as lockstep's MFU, in the dtype nanochat computes in
    peak, source = mfu_peak(COMPUTE_DTYPE, a.peak_tflops)
    result("nc_train", depth=a.depth, heads=model.config.n_head, rows=a.rows, seq=seq, accum=a.accum, steps=a.steps,
           compile=a.compile, window=a.nc_window,
           dtype=str(COMPUTE_DTYPE).removeprefix("torch."), vocab=a.vocab, tok_per_s=round(tok_s),
           step_ms=round(1e3 * step_s, 2), mfu=round(100 * flops_per_token * tok_s / peak, 2), peak_flops=peak,
           peak_source=source, flops_per_token=flops_per_token, params=sum(p.numel() for p in model.parameters()),
           losses=[round(x, 5) for x in losses], first_step_s=round(times[0], 2), wall_s=round(wall, 1),
           graphs_compiled=graphs_compiled(), recompiles=graphs_compiled() - after_first,
           nanochat_commit=NANOCHAT_COMMIT)


# ---------------------------------------------------------------- the head loss alone
def cmd_ls_head(a: argparse.Namespace) -> None:
    """lm_head + soft cap + cross-entropy alone, at the training shape (rows x seq tokens of width
    64 x depth against --vocab ids, bf16 autocast, summed as the Trainer sums it), forward and
    backward: the reference (lockstep.model.ops.head_loss: the batch's logits) against the chunked loss
    (CUDA_OPS' chunked_head_loss), each under torch.compile with --compile on (as the Trainer runs
    them; the chunked loss's bodies then compile chunk by chunk). Median time over --reps calls
    after one untimed call, the memory each call adds on top of its inputs (peak minus what was
    allocated before it, CUDA only), and the chunked loss's relative errors against the reference."""
    import torch

    from lockstep.core import fastpath
    from lockstep.model import ops

    t0 = time.perf_counter()
    d, seq = device(), default_seq(a)
    dtype, _ = compute_dtype(a)
    gcfg = model_config(a, seq)
    N, C, V = a.rows * seq, gcfg.n_embd, a.vocab
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, N, C, generator=g).to(d)  # (1, N, C): the final normed hidden states
    w = torch.nn.Parameter(torch.randn(gcfg.padded_vocab_size, C, generator=g).mul_(C**-0.5).to(d))  # (V_padded, C)
    y = torch.randint(0, V, (1, N), generator=g).to(d)  # (1, N)
    losses = {"reference": ops.head_loss, "chunked": ops.chunked_head_loss}

    def run(fn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = x0.clone().requires_grad_()
        w.grad = None
        with torch.autocast(d.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = fn(x, w, y, gcfg.softcap, V, "sum")
        loss.backward()
        return loss.detach(), x.grad, w.grad

    fields: dict[str, Any] = {}
    outs = {}
    for name, fn in losses.items():
        fn = torch.compile(fn) if a.compile == "on" else fn
        run(fn)  # compiles
        if a.warm:
            continue
        times, extra = [], []
        for _ in range(a.reps):
            synchronize()
            if d.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t1 = time.perf_counter()
            outs[name] = run(fn)
            synchronize()
            times.append(time.perf_counter() - t1)
            if d.type == "cuda":
                extra.append((torch.cuda.max_memory_allocated() - base) / 1e9)
        fields[f"{name}_ms"] = round(1e3 * statistics.median(times), 2)
        fields[f"{name}_extra_gb"] = round(max(extra), 3) if extra else None
    if a.warm:
        return warm_line("ls_head", t0)

    def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
        return float((x.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))

    (l_ref, dx_ref, dw_ref), (l_ch, dx_ch, dw_ch) = outs["reference"], outs["chunked"]
    result("ls_head", depth=a.depth, rows=a.rows, seq=seq, vocab=V, compile=a.compile,
           dtype=str(dtype).removeprefix("torch."), **fields, loss_rel_err=rel(l_ch, l_ref),
           dx_rel_err=rel(dx_ch, dx_ref), dw_rel_err=rel(dw_ch, dw_ref), fast_paths=fastpath.facts(),
           graphs_compiled=graphs_compiled(), wall_s=round(time.perf_counter() - t0, 1))


# ---------------------------------------------------------------- the sharded optimizers
def cmd_ls_shard(a: argparse.Namespace) -> None:
    """ShardedAdamW + ShardedMuon at world size 1 against the replicated AdamW + Muon, each set on
    its own copy of one model, fed the same gradients for --steps steps (computed once per step on
    one copy, copied to the other: CUDA's embedding backward adds with atomics, so two backward
    passes may differ in their last bits, which is not the optimizers' doing), in the order the
    Trainer runs them (reduce_grads, global_grad_norm with clipping, step). Without clipping the
    weights must be bit for bit equal; with the default clip 1.0 the two norms are summed in a
    different order (fp64 squares against the norm of fp32 norms), so they differ by rounding."""
    import copy

    import torch

    from lockstep.core import fastpath
    from lockstep.model.gpt import GPT
    from lockstep.train.optim import OptimConfig, build_optimizers, global_grad_norm, reduce_grads

    t0 = time.perf_counter()
    d, seq, kernels = device(), default_seq(a), a.kernels == "on"
    dtype, _ = compute_dtype(a)
    compiled = d.type == "cuda" and a.compile == "on" and kernels  # lockstep.train.optim.compiled_step's rule
    gcfg = model_config(a, seq)
    data = RandomWindows(max(1 << 20, 8 * a.rows * (seq + 1)), a.vocab, seq)
    fields: dict[str, Any] = {}
    for clip in (0.0, 1.0):
        base = GPT.build(gcfg, d, seed=0).use_kernels(kernels)
        models = {"replicated": base, "sharded": copy.deepcopy(base)}
        opts = {name: build_optimizers(m, OptimConfig(grad_clip=clip), model_dim=gcfg.n_embd, ns_dtype=dtype,
                                       sharded=name == "sharded", compiled=compiled) for name, m in models.items()}
        g = torch.Generator().manual_seed(0)
        for _ in range(a.steps):
            x, y = (t.to(d) for t in data.get_batch(B=a.rows, generator=g))
            with torch.autocast(d.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                loss = base(x, y, loss_reduction="sum")
            (loss / y.numel()).backward()
            for p, q in zip(base.parameters(), models["sharded"].parameters(), strict=True):
                q.grad = p.grad.clone()
            for name, m in models.items():
                params = [p for p in m.parameters() if p.requires_grad]
                reduce_grads(opts[name], params)
                global_grad_norm(params, clip, optimizers=opts[name])
                for opt in opts[name]:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        if a.warm:
            continue
        pairs = [(p.detach(), q.detach()) for p, q in zip(base.parameters(), models["sharded"].parameters())]
        tag = "clip0" if clip == 0 else "clip1"
        fields[f"{tag}_max_abs_diff"] = max(float((p - q).abs().max()) for p, q in pairs)
        fields[f"{tag}_equal"] = all(torch.equal(p, q) for p, q in pairs)
        fields["kinds"] = [type(o).__name__ for o in opts["sharded"]]
    if a.warm:
        return warm_line("ls_shard", t0)
    result("ls_shard", depth=a.depth, rows=a.rows, seq=seq, steps=a.steps, compile=a.compile, kernels=a.kernels,
           muon_compiled=compiled, dtype=str(dtype).removeprefix("torch."), **fields, ok=fields["clip0_equal"],
           fast_paths=fastpath.facts(), graphs_compiled=graphs_compiled(), wall_s=round(time.perf_counter() - t0, 1))


# ---------------------------------------------------------------- decoding
class NoSpecials:
    """The tokenizer an engine needs for random weights: every special id is -1, which no row
    samples, so no row stops early and no tool call starts; text is bytes."""

    def encode_special(self, name: str) -> int:
        return -1

    def get_bos_token_id(self) -> int:
        return -1

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def checkable_weights(model, seed: int = 1):
    """`model` with the weights that init_weights leaves at zero or near it drawn afresh: the
    blocks' output projections (zero at init, which makes every block the identity on the
    residual stream) and the lm_head (std 1e-3, near-uniform logits). Only then do attention,
    positions and the KV cache decide the tokens: on the init weights a broken cache, mask or
    position decodes the same tokens, so an equality check there cannot fail. Projections get
    std 1/sqrt(fan_in), as the other block matrices; the head 2/sqrt(n_embd), so the top logits
    stand apart (their gap exceeds fp32 rounding by orders of magnitude). Returns the model."""
    import torch

    from lockstep.model.embeddings import draw_normal

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                draw_normal(proj.weight, proj.weight.size(1) ** -0.5, g)
        draw_normal(model.lm_head.weight, 2 * model.config.n_embd ** -0.5, g)
    return model


def decode_model(a: argparse.Namespace):
    """The decode benchmarks' model: fp32 master weights (what a checkpoint loads as) with
    `checkable_weights`; the engines decode it in bf16 or fp32 as each measure says."""
    from lockstep.model.gpt import GPT

    return checkable_weights(GPT.build(model_config(a, a.decode_seq), device(), seed=0)).eval()


def greedy_ids(engine, tokens: int) -> list[int]:
    """One row's greedy completion of PROMPT (each step yields (tokens, masks), a token per row)."""
    return [ids[0] for ids, _ in engine.generate(PROMPT, max_tokens=tokens, temperature=0.0, use_tools=False)]


def sampled_ids(engine, tokens: int, seed: int) -> list[int]:
    """One row sampled as the timed runs sample (temperature 1, top-k 50), from `seed`."""
    return [ids[0] for ids, _ in engine.generate(PROMPT, max_tokens=tokens, temperature=1.0, top_k=50, seed=seed,
                                                 use_tools=False)]


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two completions share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# A bf16 greedy completion may leave the reference's where the reference's two candidates are
# this close in logits (the soft-capped logits of a full forward in bf16 autocast): bf16 carries
# 8 bits of mantissa, and a 12-layer forward in it moves logits by a few hundredths.
BF16_TIE_LOGITS = 0.25
SAMPLE_SEED = 1


def decode_checks(model, tok, *, tokens: int, compile_step: bool) -> dict[str, Any]:
    """The fast engine (`Engine(fast=True)`: static KV cache, device-side sampling, CUDA graphs on
    CUDA, `compile_step` compiled) against the reference engine on `model` (fp32 weights, see
    `checkable_weights`), `tokens` new tokens after PROMPT:
    - fp32 greedy: every token equal;
    - fp32 sampled (temperature 1, top-k 50, seed SAMPLE_SEED): every token equal, both engines
      drawing one uniform per row per step from a generator seeded alike;
    - bf16 (the fast engine's bf16 copy of the weights, the reference under bf16 autocast):
      greedy tokens equal up to the first one that differs, and that one only where the
      reference's two candidates lie within BF16_TIE_LOGITS of each other (a near tie that bf16
      rounding may tip), measured on a full forward of the shared prefix.
    `ok` is all three."""
    import torch

    from lockstep.infer.engine import Engine

    out: dict[str, Any] = {"check_tokens": tokens, "tie_logits": BF16_TIE_LOGITS}
    ref, fast = Engine(model, tok), Engine(model, tok, fast=True, compile_step=compile_step)
    out["fp32_greedy_equal"] = leading_agreement(greedy_ids(ref, tokens), greedy_ids(fast, tokens))
    out["fp32_sampled_equal"] = leading_agreement(sampled_ids(ref, tokens, SAMPLE_SEED),
                                                  sampled_ids(fast, tokens, SAMPLE_SEED))
    ref16 = Engine(model, tok, dtype=torch.bfloat16)
    fast16 = Engine(model, tok, fast=True, dtype=torch.bfloat16, compile_step=compile_step)
    r16, f16 = greedy_ids(ref16, tokens), greedy_ids(fast16, tokens)
    n = out["bf16_greedy_equal"] = leading_agreement(r16, f16)
    gap = None
    if n < tokens:
        ids = torch.tensor([PROMPT + r16[:n]], device=model.lm_head.weight.device)  # (1, T)
        with torch.no_grad(), torch.autocast(ids.device.type, dtype=torch.bfloat16):
            logits = model(ids)[0, -1].float()  # (V,)
        gap = round(abs(float(logits[r16[n]] - logits[f16[n]])), 4)
    out["bf16_divergence_gap"] = gap
    out["ok"] = (out["fp32_greedy_equal"] == tokens and out["fp32_sampled_equal"] == tokens
                 and (gap is None or gap <= BF16_TIE_LOGITS))
    return out


def decode_rates(generate: Callable[[int, int], int], new_tokens: int, reps: int) -> dict[str, float]:
    """Median tokens/s over `reps` runs per batch size: rows x steps yielded / wall time, after an
    untimed run of the same length per batch (allocation, compile or graph capture, which may
    depend on the cache's length). `recompiles` counts the graphs compiled during the timed runs
    (0 when the untimed runs compiled everything)."""
    for b in DECODE_BATCHES:
        generate(b, new_tokens)
    out = {}
    before = graphs_compiled()
    for b in DECODE_BATCHES:
        rates = []
        for _ in range(reps):
            synchronize()
            t0 = time.perf_counter()
            steps = generate(b, new_tokens)
            synchronize()
            rates.append(b * steps / (time.perf_counter() - t0))
        out[f"b{b}_tok_s"] = round(statistics.median(rates), 1)
    out["recompiles"] = graphs_compiled() - before
    return out


def engine_runner(engine) -> Callable[[int, int], int]:
    """generate(batch, n) -> steps: one prompt sampled `batch` ways (temperature 1, top-k 50)."""
    import torch

    def generate(b: int, n: int) -> int:
        steps = 0
        with torch.no_grad():
            for _ in engine.generate(PROMPT, num_samples=b, max_tokens=n, temperature=1.0, top_k=50, use_tools=False):
                steps += 1
        return steps

    return generate


def cmd_ls_decode_check(a: argparse.Namespace) -> None:
    from lockstep.core import fastpath

    t0 = time.perf_counter()
    checks = decode_checks(decode_model(a), NoSpecials(), tokens=a.check_tokens, compile_step=a.compile == "on")
    if a.warm:
        return warm_line("ls_decode_check", t0)
    result("ls_decode_check", depth=a.depth, vocab=a.vocab, compile=a.compile, prompt_tokens=len(PROMPT), **checks,
           fast_paths=fastpath.facts(), graphs_compiled=graphs_compiled(), wall_s=round(time.perf_counter() - t0, 1))


def cmd_ls_decode(a: argparse.Namespace) -> None:
    """Decode rates at batch 1 and 8, bf16 compute on fp32 master weights (as the stages decode a
    checkpoint on CUDA): the reference engine (bf16 autocast), the fast engine with CUDA graphs
    (on CUDA) and the fast engine compiled (and graphed on CUDA; --compile on only)."""
    import torch

    from lockstep.core import fastpath
    from lockstep.infer.engine import Engine

    t0 = time.perf_counter()
    model, tok = decode_model(a), NoSpecials()
    engines = {"ref": Engine(model, tok, dtype=torch.bfloat16),
               "fast": Engine(model, tok, fast=True, dtype=torch.bfloat16)}
    skipped = {}
    if a.compile == "on":
        engines["compiled"] = Engine(model, tok, fast=True, dtype=torch.bfloat16, compile_step=True)
    else:
        skipped["compiled"] = "--compile off"
    if a.warm:
        for engine in engines.values():
            for b in DECODE_BATCHES:
                engine_runner(engine)(b, a.new_tokens)
        return warm_line("ls_decode", t0)
    fields: dict[str, Any] = {}
    for name, engine in engines.items():
        rates = decode_rates(engine_runner(engine), a.new_tokens, a.reps)
        fields.update({f"{name}_{k}": v for k, v in rates.items()})
    result("ls_decode", depth=a.depth, vocab=a.vocab, weights="fp32, decoded in bf16", new_tokens=a.new_tokens,
           reps=a.reps, prompt_tokens=len(PROMPT), compile=a.compile, cuda_graphs=device().type == "cuda",
           skipped=skipped, **fields, fast_paths=fastpath.facts(), graphs_compiled=graphs_compiled(),
           wall_s=round(time.perf_counter() - t0, 1))


def cmd_nc_decode(a: argparse.Namespace) -> None:
    import torch

    import_nanochat("nc_decode", compile_on=True)
    from nanochat.common import COMPUTE_DTYPE
    from nanochat.engine import Engine

    model = nanochat_model(a.depth, a.vocab, a.decode_seq, a.nc_window, n_heads(a)).eval()
    engine = Engine(model, NoSpecials())

    def generate(b: int, n: int) -> int:
        steps = 0
        with torch.no_grad():
            for _ in engine.generate(PROMPT, num_samples=b, max_tokens=n, temperature=1.0, top_k=50):
                steps += 1
        return steps

    # nanochat keeps fp32 master weights and casts them to its compute dtype in every matmul
    result(
        "nc_decode",
        depth=a.depth,
        vocab=a.vocab,
        weights="fp32 cast to " + str(COMPUTE_DTYPE).removeprefix("torch."),
        new_tokens=a.new_tokens,
        reps=a.reps,
        prompt_tokens=len(PROMPT),
        nanochat_commit=NANOCHAT_COMMIT,
        **{f"ref_{k}": v for k, v in decode_rates(generate, a.new_tokens, a.reps).items()},
    )


# ---------------------------------------------------------------- lockstep's stages
STAGE_ORDER = (("pretrain", None), ("midtrain", None), ("sft", None), ("rl", None), ("eval", "rl"))


def stage_command(dvc: dict[str, Any], name: str, item: str | None) -> list[str]:
    """The stage's command as dvc.yaml writes it (so paths stay dvc.yaml's), `${item}` filled in."""
    spec = dvc["stages"][name]
    cmd = (spec["do"] if "foreach" in spec else spec)["cmd"]
    if item is not None:
        cmd = cmd.replace("${item}", item)
    words = cmd.split()
    if words[0] not in ("python", "python3") or words[1:2] != ["-m"]:
        raise SystemExit(f"dvc.yaml stage {name}: expected `python3 -m ...`, got {cmd[:60]!r}")
    return [sys.executable, *words[1:]]


def cmd_stages(a: argparse.Namespace) -> None:
    """pretrain -> midtrain -> sft -> rl -> eval rl on the smoke workspace `--smoke` (params.yaml
    and data/{raw,tokenizer,cache} of the smoke preset) in a scratch copy of this checkout, on this
    device, with runtime.kernels from --kernels; each stage under --stage-timeout-s."""
    import yaml

    smoke = Path(a.smoke).resolve()
    need = [smoke / "params.yaml", *(smoke / "data" / p for p in ("raw", "tokenizer", "cache"))]
    if not all(p.exists() for p in need):
        raise SystemExit(
            f"error: --smoke {smoke} must hold params.yaml and data/raw, data/tokenizer, data/cache of the "
            "smoke preset (see docs/performance.md, 'Stages on smoke data')"
        )
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        w = Path(tmp)
        for sub in ("lib", "stages", "evalsets"):
            shutil.copytree(ROOT / sub, w / sub, ignore=shutil.ignore_patterns("__pycache__"))
        for sub in ("raw", "tokenizer", "cache"):
            shutil.copytree(smoke / "data" / sub, w / "data" / sub)
        params = yaml.safe_load((smoke / "params.yaml").read_text(encoding="utf-8"))
        params["runtime"] = {**(params.get("runtime") or {}), "device": device().type, "dtype": "auto",
                             "deterministic": False, "kernels": a.kernels == "on"}
        (w / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
        env = {**os.environ, "PYTHONPATH": f"{w / 'lib'}{os.pathsep}{w}", "PYTHONUNBUFFERED": "1"}
        for name, item in STAGE_ORDER:
            label = name if item is None else f"{name}@{item}"
            print(f"-- stage {label}", flush=True)
            t0 = time.perf_counter()
            try:
                rc = subprocess.run(
                    stage_command(dvc, name, item), cwd=w, env=env, timeout=a.stage_timeout_s
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            rows.append({"stage": label, "rc": rc, "s": round(time.perf_counter() - t0, 1)})
            print(f"-- stage {label}: rc {rc}", flush=True)
            if rc != 0:
                break
        facts = {}
        for name in ("pretrain", "rl"):
            f = w / "data" / "runinfo" / f"{name}.json"
            if f.is_file():
                info = json.loads(f.read_text(encoding="utf-8"))
                facts[name] = {k: info[k] for k in ("tok_per_s", "mfu", "train_time_s") if k in info}
                dev = info.get("device") or {}
                facts[name].update({k: dev[k] for k in ("device", "dtype", "compile", "kernels") if k in dev})
    result("stages", kernels=a.kernels, stages=rows, runinfo=facts, ok=all(r["rc"] == 0 for r in rows)
           and len(rows) == len(STAGE_ORDER))


# ---------------------------------------------------------------- compare
def read_results(path: Path) -> list[dict[str, Any]]:
    """RESULT records from a results.jsonl (one JSON object a line) or a log with `RESULT {...}` lines."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line.startswith("RESULT "):
            line = line[len("RESULT "):]
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def _ratio(x: float | None, y: float | None) -> str:
    return f"{x / y:.3f}x" if x is not None and y else "-"


def _last(records: list[dict[str, Any]], phase: str) -> dict[str, Any] | None:
    return next((r for r in reversed(records) if r["phase"] == phase), None)


def _record_name(r: dict[str, Any]) -> str:
    extra = f" kernels {r['kernels']}" if "kernels" in r else ""
    return f"{r['phase']} d{r.get('depth', '?')}{extra}"


def _mem(r: dict[str, Any] | None) -> float | None:
    return None if r is None else r.get("peak_mem_gb", r.get("host_peak_rss_gb"))


def compare(records: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """Lines of text and a JSON-ready dict of ratios, from the records alone (the last record of a
    kind wins when a phase ran twice)."""
    lines: list[str] = []
    ratios: dict[str, Any] = {}
    env = _last(records, "env")
    if env:
        lines.append(f"device {env.get('gpu') or env.get('device')}, torch {env['torch']}, CUDA {env['cuda']}")
        if env.get("declared_bf16_tflops"):
            frac = env["bf16_matmul_tflops"] / env["declared_bf16_tflops"]
            lines.append(f"bf16 matmul {env['matmul_n']}^3: {env['bf16_matmul_tflops']} TFLOP/s measured, "
                         f"{frac:.3f} of the datasheet's {env['declared_bf16_tflops']}")
            ratios["matmul_of_datasheet"] = round(frac, 4)
    shapes: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in records:
        if r["phase"] in ("ls_train", "nc_train"):
            key = (r["depth"], r["rows"], r["seq"], r["accum"])
            who = f"ls_{r['kernels']}" if r["phase"] == "ls_train" else "nc"
            shapes.setdefault(key, {})[who] = r
    for (depth, rows, seq, accum), by in sorted(shapes.items()):
        name = f"d{depth} {rows}x{seq}" + (f"x{accum}" if accum > 1 else "")
        lines.append(f"train {name}:")
        for who, label in (("ls_off", "lockstep reference"), ("ls_on", "lockstep fast"), ("nc", "nanochat")):
            r = by.get(who)
            if r:
                where = "GPU" if "peak_mem_gb" in r else "host RSS"
                lines.append(
                    f"  {label:18} {r['tok_per_s']:>10,} tok/s  MFU {r['mfu']:5.1f}%  peak {where} {_mem(r)} GB  "
                    f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}  (first step {r['first_step_s']} s)"
                )
        entry: dict[str, Any] = {}
        for a_, b_, tag in (("ls_off", "nc", "reference/nanochat"), ("ls_on", "nc", "fast/nanochat"),
                            ("ls_on", "ls_off", "fast/reference")):
            x, y = by.get(a_), by.get(b_)
            if x and y:
                tok = x["tok_per_s"] / y["tok_per_s"]
                mem = (_mem(x) / _mem(y)) if _mem(x) and _mem(y) else None
                mfu = x["mfu"] / y["mfu"] if y["mfu"] else None
                entry[tag] = {"tok_per_s": round(tok, 4), "peak_mem": None if mem is None else round(mem, 4),
                              "mfu": None if mfu is None else round(mfu, 4)}
                line = (
                    f"  {tag:19} tok/s {tok:.3f}x  memory {_ratio(_mem(x), _mem(y))}  MFU {_ratio(x['mfu'], y['mfu'])}"
                )
                if tag == "fast/reference":
                    diff = max(abs(p - q) for p, q in zip(x["losses"], y["losses"]))
                    entry[tag]["max_loss_diff"] = round(diff, 6)
                    line += f"  max |loss diff| {diff:.2e} over {min(len(x['losses']), len(y['losses']))} steps"
                lines.append(line)
        ratios[f"train_d{depth}_{rows}x{seq}x{accum}"] = entry
    ls = _last(records, "ls_decode")
    nc = _last(records, "nc_decode")
    if ls or nc:
        depth = (ls or nc)["depth"]
        lines.append(f"decode d{depth}, {(ls or nc)['new_tokens']} new tokens, bf16 compute:")
        entry = {}
        for b in DECODE_BATCHES:
            k = f"b{b}_tok_s"
            rates = {label: r.get(f"{key}_{k}") for label, key, r in (
                ("reference", "ref", ls or {}), ("fast", "fast", ls or {}), ("compiled", "compiled", ls or {}),
                ("nanochat", "ref", nc or {}))}
            parts = [f"{label} {v:,.1f}" for label, v in rates.items() if v is not None]
            row = {f"{x}/{y}": rates[x] / rates[y] for x, y in (
                ("reference", "nanochat"), ("fast", "nanochat"), ("compiled", "nanochat"), ("fast", "reference"),
                ("compiled", "reference"), ("compiled", "fast")) if rates[x] and rates[y]}
            entry[f"b{b}"] = {k2: round(v, 4) for k2, v in row.items()}
            ratio_text = ", ".join(f"{k2} {v:.2f}x" for k2, v in row.items())
            lines.append(f"  batch {b} tok/s: " + "; ".join(parts) + (f"  [{ratio_text}]" if ratio_text else ""))
        if ls and ls.get("skipped"):
            lines.append("  not run: " + ", ".join(f"{k} ({why})" for k, why in ls["skipped"].items()))
        ratios[f"decode_d{depth}"] = entry
    chk = _last(records, "ls_decode_check")
    if chk:
        gap = chk["bf16_divergence_gap"]
        bf16 = ("all equal" if gap is None else f"equal for {chk['bf16_greedy_equal']}, then a tie within "
                f"{gap} logits (allowed {chk['tie_logits']})")
        lines.append(f"decode checks ({'ok' if chk['ok'] else 'FAILED'}), fast engine against the reference over "
                     f"{chk['check_tokens']} tokens: fp32 greedy {chk['fp32_greedy_equal']} equal, fp32 sampled "
                     f"{chk['fp32_sampled_equal']} equal, bf16 greedy {bf16}")
        ratios["decode_checks_ok"] = chk["ok"]
    head = _last(records, "ls_head")
    if head:
        def extra(key: str) -> str:
            return "" if head[key] is None else f" +{head[key]} GB"

        memory = (f", memory {_ratio(head['chunked_extra_gb'], head['reference_extra_gb'])}"
                  if head["reference_extra_gb"] is not None else " (memory measured on CUDA only)")
        lines.append(f"head loss d{head['depth']} {head['rows']}x{head['seq']} x {head['vocab']} ids, fwd+bwd: "
                     f"reference {head['reference_ms']} ms{extra('reference_extra_gb')}, chunked "
                     f"{head['chunked_ms']} ms{extra('chunked_extra_gb')}; chunked/reference time "
                     f"{_ratio(head['chunked_ms'], head['reference_ms'])}{memory}; relative errors loss "
                     f"{head['loss_rel_err']:.1e}, dx {head['dx_rel_err']:.1e}, dW {head['dw_rel_err']:.1e}")
        ratios["head_loss"] = {"time": round(head["chunked_ms"] / head["reference_ms"], 4)}
        if head["reference_extra_gb"]:
            ratios["head_loss"]["extra_memory"] = round(head["chunked_extra_gb"] / head["reference_extra_gb"], 4)
    shard = _last(records, "ls_shard")
    if shard:
        lines.append(f"sharded optimizers at world size 1 ({'ok' if shard['ok'] else 'FAILED'}): weights after "
                     f"{shard['steps']} steps bit-equal to the replicated ones without clipping: "
                     f"{shard['clip0_equal']}; with clip 1.0 max |diff| {shard['clip1_max_abs_diff']:.2e}")
        ratios["sharded_equal"] = shard["clip0_equal"]
    for r in records:
        what = _record_name(r)
        if r.get("recompiles"):
            lines.append(f"RECOMPILED: {what} compiled {r['recompiles']} graph(s) during its timed steps (must be 0)")
        for k, v in r.items():
            if k.endswith("recompiles") and k != "recompiles" and v:
                lines.append(f"RECOMPILED: {what} {k.removesuffix('_recompiles')} compiled {v} graph(s) while timed")
        for part, f in (r.get("fast_paths") or {}).items():
            if f.get("path") == "reference":
                lines.append(f"FELL BACK: {what}: {part} ran its reference path ({f.get('fell_back')})")
    st = _last(records, "stages")
    if st:
        lines.append("stages (kernels " + st["kernels"] + "): "
                     + ", ".join(f"{s['stage']} rc {s['rc']} {s['s']} s" for s in st["stages"]))
    return lines, ratios


def cmd_compare(a: argparse.Namespace) -> None:
    path = Path(a.file)
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist; pass the results.jsonl the GPU check wrote")
    lines, ratios = compare(read_results(path))
    print("\n".join(lines))
    print("RATIOS " + json.dumps(ratios))


COMMANDS = {"env": cmd_env, "ls_train": cmd_ls_train, "nc_train": cmd_nc_train, "ls_head": cmd_ls_head,
            "ls_shard": cmd_ls_shard, "ls_decode_check": cmd_ls_decode_check, "ls_decode": cmd_ls_decode,
            "nc_decode": cmd_nc_decode, "stages": cmd_stages, "compare": cmd_compare}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cmd", choices=sorted(COMMANDS))
    p.add_argument("file", nargs="?", default="results.jsonl", help="compare: the results.jsonl to read")
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--rows", type=int, default=32, help="sequences per forward pass")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps, the first untimed")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence; 0 = 2048 on CUDA, 128 on CPU")
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--head-dim", type=int, default=128,
                   help="channels per head: ceil(64 x depth / this) heads, on both sides (128: the d12/d20 presets')")
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto", help="lockstep's compute dtype")
    p.add_argument("--compile", choices=("on", "off"), default="on")
    p.add_argument("--kernels", choices=("on", "off"), default="off",
                   help="ls_train, stages: lockstep's fast paths (on) or its reference path (off)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="MFU peak per device; 0 = datasheet or measured")
    p.add_argument("--nc-window", default="L", help="nanochat's window_pattern (L = full attention, as lockstep)")
    p.add_argument("--decode-seq", type=int, default=2048, help="decode: the model's context length")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--check-tokens", type=int, default=32, help="ls_decode_check: tokens compared fast vs reference")
    p.add_argument("--warm", action="store_true",
                   help="run only what compiles, filling the compile caches for a timed run of the same phase")
    p.add_argument("--smoke", default=str(ROOT / "bench" / "out" / "smoke"), help="stages: the smoke workspace")
    p.add_argument("--stage-timeout-s", type=int, default=100)
    a = p.parse_args(argv)
    COMMANDS[a.cmd](a)


if __name__ == "__main__":
    main()
