"""Benchmark of one AdamW step over the parameters AdamW holds in training (the token embedding and
the lm_head of a d4 model with a 32k vocabulary, fp32 on CPU): lockstep.optim.AdamW against two
baselines measured in the same process, torch.optim.AdamW with fused=True and with foreach=True.
The three alternate round by round, so a change in the machine's load hits all of them. Prints
median ms per step and each baseline's time over ours. Not a test.

    .venv/bin/python bench/bench_optim.py [--vocab 32768 --width 256 --steps 20 --rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from lockstep.optim import AdamW

# The tiny presets' AdamW settings (lockstep.optim.OptimConfig defaults, width-scaled at 256).
SETTINGS = {"betas": (0.8, 0.95), "eps": 1e-10, "weight_decay": 0.0}


def make_params(vocab: int, width: int, seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(vocab, width, generator=g)) for _ in range(2)]  # wte, lm_head
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params


def step_ms(opt: torch.optim.Optimizer, steps: int) -> float:
    """Median wall time of one step, after one untimed step (state allocation)."""
    opt.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of the three optimizers")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = 2 * args.vocab * args.width
    print(f"AdamW over wte + lm_head: 2 x ({args.vocab}, {args.width}) fp32 = {n / 1e6:.1f}M params, "
          f"{torch.get_num_threads()} threads, median of {args.steps} steps x {args.rounds} rounds")
    # Other processes on a small machine skew every figure here; print the load so a reader can tell.
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    sides = {
        "ours": lambda ps: AdamW([{"params": ps, "lr": 0.01}], **SETTINGS),
        "torch fused": lambda ps: torch.optim.AdamW([{"params": ps, "lr": 0.01}], fused=True, **SETTINGS),
        "torch foreach": lambda ps: torch.optim.AdamW([{"params": ps, "lr": 0.01}], foreach=True, **SETTINGS),
    }
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        for name, make in sides.items():
            times[name].append(step_ms(make(make_params(args.vocab, args.width, seed=r)), args.steps))
    ours = times["ours"]
    for name, ts in times.items():
        paired = statistics.median(t / o for t, o in zip(ts, ours, strict=True))
        print(f"{name:>14}: {statistics.median(ts):7.2f} ms/step | {paired:5.2f}x ours (paired median)")


if __name__ == "__main__":
    main()
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")
