"""Benchmark of the optimizer step, fp32 on CPU. Not a test.

AdamW: one step over the parameters AdamW holds in training (the token embedding and the lm_head
of a d4 model with a 32k vocabulary): lockstep.train.optim.AdamW against two baselines measured in the
same process, torch.optim.AdamW with fused=True and with foreach=True.

Muon: one step over a model's block matrices (the shapes of GPT at `--depth`), the eager step (the
reference, what CPU presets run) against the compiled one (Muon(compiled=True), what CUDA runs
with runtime.compile and runtime.kernels on); the compile itself is left out and printed apart.

The sides alternate round by round, so a change in the machine's load hits all of them. Prints
median ms per step and each side's time over the first's (paired median over rounds).

    .venv/bin/python bench/bench_optim.py [--vocab 32768 --width 256 --depth 4 --steps 20 --rounds 5]
                                          [--only adamw|muon]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from lockstep.model.gpt import GPT
from lockstep.train.optim import AdamW, Muon, split_params
from lockstep.train.trainer import ModelParams

# The tiny presets' AdamW settings (lockstep.train.optim.OptimConfig defaults, width-scaled at 256).
SETTINGS = {"betas": (0.8, 0.95), "eps": 1e-10, "weight_decay": 0.0}


def make_params(vocab: int, width: int, seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(vocab, width, generator=g)) for _ in range(2)]  # wte, lm_head
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params


def make_matrices(depth: int, seed: int) -> list[nn.Parameter]:
    """Random fp32 matrices (with gradients) of the block-matrix shapes of GPT at `depth`."""
    with torch.device("meta"):
        shapes = [tuple(p.shape) for _, p in split_params(GPT(ModelParams(depth=depth).gpt_config(256)))["matrix"]]
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(shape, generator=g) * 0.02) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params


def step_ms(opt: torch.optim.Optimizer, steps: int) -> float:
    """Median wall time of one step, after one untimed step (state allocation, compilation)."""
    opt.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def compare(sides: dict, make_params, steps: int, rounds: int) -> dict[str, list[float]]:
    """Median ms per step of each side, `rounds` times, the sides alternating within a round."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        for name, make in sides.items():
            times[name].append(step_ms(make(make_params(r)), steps))
    return times


def report(times: dict[str, list[float]], base: str) -> None:
    for name, ts in times.items():
        paired = statistics.median(t / b for t, b in zip(ts, times[base], strict=True))
        print(f"{name:>14}: {statistics.median(ts):7.2f} ms/step | {paired:5.2f}x {base} (paired median)")


def bench_adamw(args: argparse.Namespace) -> None:
    n = 2 * args.vocab * args.width
    print(f"AdamW over wte + lm_head: 2 x ({args.vocab}, {args.width}) fp32 = {n / 1e6:.1f}M params, "
          f"{torch.get_num_threads()} threads, median of {args.steps} steps x {args.rounds} rounds")
    sides = {
        "ours": lambda ps: AdamW([{"params": ps, "lr": 0.01}], **SETTINGS),
        "torch fused": lambda ps: torch.optim.AdamW([{"params": ps, "lr": 0.01}], fused=True, **SETTINGS),
        "torch foreach": lambda ps: torch.optim.AdamW([{"params": ps, "lr": 0.01}], foreach=True, **SETTINGS),
    }
    report(compare(sides, lambda r: make_params(args.vocab, args.width, seed=r), args.steps, args.rounds), "ours")


def bench_muon(args: argparse.Namespace) -> None:
    params = make_matrices(args.depth, 0)
    shapes = sorted({tuple(p.shape) for p in params})
    print(f"Muon over d{args.depth}'s {len(params)} block matrices {shapes} fp32 = "
          f"{sum(p.numel() for p in params) / 1e6:.1f}M params, {torch.get_num_threads()} threads, "
          f"median of {args.steps} steps x {args.rounds} rounds")
    t0 = time.perf_counter()
    Muon(params, compiled=True).step()  # compiles one graph per shape; later rounds reuse them
    print(f"compile (first compiled step): {time.perf_counter() - t0:.1f} s, left out of the timings below")
    sides = {"eager": lambda ps: Muon(ps), "compiled": lambda ps: Muon(ps, compiled=True)}
    report(compare(sides, lambda r: make_matrices(args.depth, seed=r), args.steps, args.rounds), "eager")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4, help="Muon: the block matrices of GPT at this depth")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of the sides")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--only", choices=["adamw", "muon"], help="one of the two benchmarks")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # Other processes on a small machine skew every figure here; print the load so a reader can tell.
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    if args.only in (None, "adamw"):
        bench_adamw(args)
    if args.only in (None, "muon"):
        bench_muon(args)


if __name__ == "__main__":
    main()
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")
