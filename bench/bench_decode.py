"""Benchmark of KV-cache decoding through lockstep.engine on this machine: time to first token
(prefill of the prompt + first sample) and decode tok/s at batch 1 and 8, for the tiny preset's
model and for a d4 model with a 32k vocab, the model on lockstep.kernels, each as a ratio against
two baselines measured in the same run: the same engine with the model's kernels off (its
stock-PyTorch reference path), and the model generating greedily without a cache (a full forward
over the whole sequence for every new token). Runs alternate the three. Random weights; not a
test, not a quality measure.

    .venv/bin/python bench/bench_decode.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from lockstep.engine import Engine
from lockstep.model import GPT, GPTConfig
from lockstep.tokenizer.base import SPECIAL_TOKENS

SHAPES = {"tiny": (4, 4096, 512), "d4-32k": (4, 32768, 2048)}  # depth, vocab, sequence_len


class IdsOnly:
    """The little the engine asks of a tokenizer, for random-weight runs: special ids at the
    top of the vocabulary and a byte-level text codec for tool calls."""

    def __init__(self, vocab_size: int):
        self._special = {name: vocab_size - len(SPECIAL_TOKENS) + i for i, name in enumerate(SPECIAL_TOKENS)}

    def encode_special(self, name: str) -> int:
        return self._special[name]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def run_once(engine: Engine, prompt: list[int], batch: int, new_tokens: int) -> tuple[float, float, int]:
    """(time to first token s, decode tok/s after it, steps taken)."""
    t0 = time.perf_counter()
    steps = engine.generate(prompt, num_samples=batch, max_tokens=new_tokens, temperature=0.0, use_tools=False)
    first = next(steps)
    t1 = time.perf_counter()
    n = 1
    for _ in steps:
        n += 1
    t2 = time.perf_counter()
    del first
    return t1 - t0, (n - 1) * batch / max(t2 - t1, 1e-9), n


@torch.no_grad()
def run_once_no_cache(model: GPT, prompt: list[int], batch: int, new_tokens: int) -> tuple[float, float, int]:
    """The baseline: greedy generation re-reading the whole sequence every step. Same return."""
    idx = torch.tensor([prompt] * batch, dtype=torch.long)  # (B, T)
    t0 = time.perf_counter()
    idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)  # (B, T + 1)
    t2 = time.perf_counter()
    return t1 - t0, (new_tokens - 1) * batch / max(t2 - t1, 1e-9), new_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="tiny,d4-32k")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt", type=int, default=12, help="prompt length in tokens")
    ap.add_argument("--new", type=int, default=128, help="tokens to generate per row")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    print(f"{torch.get_num_threads()} threads, {args.dtype} weights, prompt {args.prompt} + {args.new} new tokens, median of {args.reps}")
    # Other processes on a small machine skew every figure here; print the load so a reader can tell.
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for shape in args.shapes.split(","):
        depth, vocab, seq = SHAPES[shape]
        config = GPTConfig.from_depth(depth, vocab_size=vocab, sequence_len=seq)
        # Make the stop tokens unreachable under greedy decoding so every run is full length.
        model = GPT.build(config, "cpu", dtype=dtype).use_kernels(True).eval()
        tok = IdsOnly(vocab)
        with torch.no_grad():
            for name in ("<|assistant_end|>", "<|bos|>"):
                model.lm_head.weight[tok.encode_special(name)] = 0
        engine = Engine(model, tok)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, 256, (args.prompt,), generator=g).tolist()
        for batch in (int(b) for b in args.batches.split(",")):
            for on in (True, False):  # warm-up, every side
                model.use_kernels(on)
                run_once(engine, prompt, batch, 8)
            run_once_no_cache(model.use_kernels(True), prompt, batch, 8)
            runs, ref, base = [], [], []
            for _ in range(args.reps):  # alternating, so a change in the machine's load hits every side
                runs.append(run_once(engine, prompt, batch, args.new))
                model.use_kernels(False)
                ref.append(run_once(engine, prompt, batch, args.new))
                model.use_kernels(True)
                base.append(run_once_no_cache(model, prompt, batch, args.new))
            ttft_s = statistics.median(r[0] for r in runs)
            tok_s = statistics.median(r[1] for r in runs)
            ref_tok_s = statistics.median(r[1] for r in ref)
            base_tok_s = statistics.median(r[1] for r in base)
            vs_ref = statistics.median(r[1] / b[1] for r, b in zip(runs, ref, strict=True))
            vs_base = statistics.median(r[1] / b[1] for r, b in zip(runs, base, strict=True))
            print(f"{shape:>7} batch {batch}: ttft {ttft_s * 1e3:6.1f} ms | decode {tok_s:7.0f} tok/s | steps {runs[0][2]}"
                  f" | kernels off {ref_tok_s:7.0f} tok/s | no-cache {base_tok_s:7.0f} tok/s"
                  f" | {vs_ref:4.2f}x kernels off, {vs_base:5.2f}x no-cache (paired medians)")


if __name__ == "__main__":
    main()
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")
