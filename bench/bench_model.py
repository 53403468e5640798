"""Benchmark of the bare GPT's training step (forward + backward, no optimizer) on this machine:
tok/s and MFU in fp32, bf16 autocast and bf16 weights, against the matmul peak of each dtype
measured in the same run. Not a test and not the training loop's throughput.

    .venv/bin/python bench/bench_model.py --depth 4 --vocab 32768 --seq 256 --batch 8
"""

from __future__ import annotations

import argparse
import os
import contextlib
import statistics
import time

import torch

from lockstep.model import GPT, GPTConfig

# Reference figures for d4 / vocab 32768 / seq 256 / batch 8 on this 2-core CPU type.
REFERENCE_TOK_S = {"fp32": 1550.0, "bf16": 3400.0}
TARGET_TOK_S = 5000.0


def matmul_peak_flop_s(dtype: torch.dtype, sizes=(1024, 2048, 4096), reps: int = 5) -> float:
    """Best median FLOP/s of square matmuls of the given sizes: what this dtype can reach here."""
    best = 0.0
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        a = torch.randn(n, n, generator=g).to(dtype)
        b = torch.randn(n, n, generator=g).to(dtype)
        a @ b  # warm-up: first call pays for packing buffers and kernel selection
        times_s = []
        for _ in range(reps):
            t0 = time.perf_counter()
            a @ b
            times_s.append(time.perf_counter() - t0)
        best = max(best, 2 * n**3 / statistics.median(times_s))
    return best


def step_time_s(model: GPT, x: torch.Tensor, y: torch.Tensor, autocast: bool, steps: int, warmup: int) -> float:
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    times_s = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        with ctx:
            loss = model(x, y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if i >= warmup:
            times_s.append(time.perf_counter() - t0)
    return statistics.median(times_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--modes", default="fp32,bf16-autocast,bf16-weights")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    config = GPTConfig.from_depth(args.depth, vocab_size=args.vocab, sequence_len=args.seq)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    tokens = args.batch * args.seq
    probe = GPT.build(config, "cpu")
    flops_per_token = probe.flops_per_token()
    print(
        f"model d{args.depth}: {probe.num_params() / 1e6:.2f}M params, {flops_per_token / 1e6:.1f} MFLOP/token, "
        f"batch {args.batch}x{args.seq} = {tokens} tokens, {torch.get_num_threads()} threads"
    )
    del probe

    # Other processes on a small machine skew every figure here; print the load so a reader can tell.
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    peaks = {"fp32": matmul_peak_flop_s(torch.float32), "bf16": matmul_peak_flop_s(torch.bfloat16)}
    for name, peak in peaks.items():
        print(f"matmul peak {name}: {peak / 1e9:.0f} GFLOP/s")

    for mode in args.modes.split(","):
        dtype_name = "fp32" if mode == "fp32" else "bf16"
        weights_dtype = torch.bfloat16 if mode == "bf16-weights" else None
        model = GPT.build(config, "cpu", dtype=weights_dtype)
        dt_s = step_time_s(model, x, y, autocast=mode == "bf16-autocast", steps=args.steps, warmup=args.warmup)
        tok_s = tokens / dt_s
        mfu = tok_s * flops_per_token / peaks[dtype_name]
        ref = REFERENCE_TOK_S[dtype_name]
        print(
            f"{mode:>14}: {dt_s * 1e3:7.1f} ms/step | {tok_s:7.0f} tok/s | mfu {mfu:5.1%} of {dtype_name} peak | "
            f"{tok_s / ref:4.2f}x reference {ref:.0f} | {tok_s / TARGET_TOK_S:4.2f}x target {TARGET_TOK_S:.0f}"
        )
        del model


if __name__ == "__main__":
    main()
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")
