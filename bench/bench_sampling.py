"""Benchmark of one sampled decode step's draw (logits in, ids out) on this machine: lockstep's
sampler (lockstep.infer.decode.sample_on_device, which both decoding paths use: the softmax in
vocabulary order when nothing is cut, one uniform number per row, an inverse-transform pick) as a
ratio against torch's own sampler measured in the same run (the vocabulary sorted, then
torch.multinomial, which draws one Exp(1) number per candidate). Shapes are RL's rollouts on the
tiny preset (128 rows of a 4k vocabulary) and a chat batch of a d12 model (8 rows of 64k), with no
cut and with a top-k cut; runs alternate the sides. Not a test.

    .venv/bin/python bench/bench_sampling.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lockstep.infer.decode import sample_on_device

SHAPES = {"rl-tiny": (128, 4096), "chat-d12": (8, 65536)}  # rows, vocabulary


def torch_sampler(logits: torch.Tensor, top_k: int | None, generator: torch.Generator) -> torch.Tensor:
    if top_k is not None:
        vals, idx = torch.topk(logits, top_k, dim=-1)
    else:
        vals, idx = torch.sort(logits, dim=-1, descending=True)
    choice = torch.multinomial(torch.softmax(vals, dim=-1), 1, generator=generator)
    return idx.gather(-1, choice).squeeze(-1)


def lockstep_sampler(logits: torch.Tensor, top_k: int | None, generator: torch.Generator) -> torch.Tensor:
    return sample_on_device(logits, top_k=top_k, temperature=1.0, top_p=None, generator=generator)


def seconds_per_call(fn, logits: torch.Tensor, top_k: int | None, calls: int) -> float:
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(logits, top_k, g)
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu {torch.backends.cpu.get_cpu_capability()}"
    )
    print(f"{'shape':<10} {'cut':<8} {'torch ms':>9} {'lockstep ms':>12} {'speedup':>8}")
    for name, (rows, vocab) in SHAPES.items():
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)) * 3
        for top_k in (None, 50):
            base, ours = [], []
            for _ in range(args.repeats):
                base.append(seconds_per_call(torch_sampler, logits, top_k, args.calls))
                ours.append(seconds_per_call(lockstep_sampler, logits, top_k, args.calls))
            b, o = statistics.median(base), statistics.median(ours)
            print(f"{name:<10} {('top_k 50' if top_k else 'none'):<8} {b * 1e3:>9.2f} {o * 1e3:>12.2f} {b / o:>7.1f}x")


if __name__ == "__main__":
    main()
