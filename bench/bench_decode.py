"""Benchmark of KV-cache decoding through lockstep.infer.engine on this machine: time to first token
(prefill of the prompt + first sample) and decode tok/s at batch 1 and 8, of the static-cache fast
path (`Engine(fast=True)`: lockstep.infer.decode's preallocated cache and device-side step, replayed
from a CUDA graph on a GPU, eager on the CPU) and of the same path with its step compiled
(`compile_step=True`: torch.compile's inductor, then the graph), each as a ratio against
baselines measured in the same run: the reference engine (the growing KVCache, host-side
sampling) on the same model, the reference engine with the model's lockstep.model.kernels off (CPU
only: they are CPU fast paths), and the model generating greedily without a cache (a full forward
over the whole sequence for every new token). Runs alternate the sides. Random weights; not a
test, not a quality measure. On a CPU other processes share, pass --threads 1: at 2 threads under
a load of 3 every op ran ~10x slower, the compiled step's OpenMP kernels worst.

    .venv/bin/python bench/bench_decode.py                      # CPU: tiny and d4-32k, fp32 and bf16
    .venv/bin/python bench/bench_decode.py --device cuda --shapes d12 --dtype bf16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from lockstep.infer.engine import Engine
from lockstep.model.gpt import GPT, GPTConfig
from lockstep.tokenizer.base import SPECIAL_TOKENS

SHAPES = {"tiny": (4, 4096, 512), "d4-32k": (4, 32768, 2048), "d12": (12, 65536, 2048)}  # depth, vocab, sequence_len


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(engine: Engine, prompt: list[int], batch: int, new_tokens: int) -> tuple[float, float, int]:
    """(time to first token s, decode tok/s after it, steps taken)."""
    device = engine.model.rotary_cos.device
    sync(device)
    t0 = time.perf_counter()
    steps = engine.generate(prompt, num_samples=batch, max_tokens=new_tokens, temperature=0.0, use_tools=False)
    first = next(steps)  # the engine reads the column back: the device has finished it
    t1 = time.perf_counter()
    n = 1
    for _ in steps:
        n += 1
    sync(device)
    t2 = time.perf_counter()
    del first
    return t1 - t0, (n - 1) * batch / max(t2 - t1, 1e-9), n


@torch.no_grad()
def run_once_no_cache(model: GPT, prompt: list[int], batch: int, new_tokens: int) -> tuple[float, float, int]:
    """The baseline: greedy generation re-reading the whole sequence every step. Same return."""
    device = model.rotary_cos.device
    idx = torch.tensor([prompt] * batch, dtype=torch.long, device=device)  # (B, T)
    sync(device)
    t0 = time.perf_counter()
    idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    sync(device)
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)  # (B, T + 1)
    sync(device)
    t2 = time.perf_counter()
    return t1 - t0, (new_tokens - 1) * batch / max(t2 - t1, 1e-9), new_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--shapes", default="tiny,d4-32k", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt", type=int, default=12, help="prompt length in tokens")
    ap.add_argument("--new", type=int, default=128, help="tokens to generate per row")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="weights dtype (no autocast)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--no-cache-baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="also time greedy decoding without a cache")
    ap.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the static path with its step compiled (compile_step)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    on_cpu = device.type == "cpu"
    where = f"{torch.get_num_threads()} threads" if on_cpu else torch.cuda.get_device_name(device)
    print(f"{device} ({where}), torch {torch.__version__}, {args.dtype} weights, prompt {args.prompt} + {args.new} new "
          f"tokens, median of {args.reps}")
    # Other processes on a small machine skew every figure here; print the load so a reader can tell.
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for shape in args.shapes.split(","):
        depth, vocab, seq = SHAPES[shape]
        config = GPTConfig.from_depth(depth, vocab_size=vocab, sequence_len=seq)
        # The model's lockstep.model.kernels are CPU fast paths: on, on the CPU; off (the reference) elsewhere.
        model = GPT.build(config, device, dtype=dtype).use_kernels(on_cpu).eval()
        tok = IdsOnly(vocab)
        with torch.no_grad():  # the stop tokens unreachable under greedy decoding: every run is full length
            for name in ("<|assistant_end|>", "<|bos|>"):
                model.lm_head.weight[tok.encode_special(name)] = 0
        fast, reference = Engine(model, tok, fast=True), Engine(model, tok)
        compiled = Engine(model, tok, fast=True, compile_step=True)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, 256, (args.prompt,), generator=g).tolist()
        for batch in (int(b) for b in args.batches.split(",")):
            sides = {"static": lambda: run_once(fast, prompt, batch, args.new),
                     "engine": lambda: run_once(reference, prompt, batch, args.new)}
            if args.compiled:
                sides["compiled"] = lambda: run_once(compiled, prompt, batch, args.new)
            if on_cpu:
                def kernels_off() -> tuple[float, float, int]:
                    model.use_kernels(False)
                    try:
                        return run_once(reference, prompt, batch, args.new)
                    finally:
                        model.use_kernels(True)
                sides["kernels off"] = kernels_off
            if args.no_cache_baseline:
                sides["no-cache"] = lambda: run_once_no_cache(model, prompt, batch, args.new)
            # Warm-up, every side, at the measured length: the static step's cache length and graph
            # capture are the measured runs' own, and stay out of the timings.
            run_once(fast, prompt, batch, args.new)
            run_once(reference, prompt, batch, 8)
            if args.compiled:  # the compile (per step shape) happens here, timed apart
                t0 = time.perf_counter()
                run_once(compiled, prompt, batch, args.new)
                compile_s = time.perf_counter() - t0
            if args.no_cache_baseline:
                run_once_no_cache(model, prompt, batch, 8)
            runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in sides}
            for _ in range(args.reps):  # alternating, so a change in the machine's load hits every side
                for name, side in sides.items():
                    runs[name].append(side())
            static = runs["static"]
            parts = [f"{shape:>7} batch {batch}: static {statistics.median(r[1] for r in static):7.0f} tok/s, ttft "
                     f"{statistics.median(r[0] for r in static) * 1e3:6.1f} ms, steps {static[0][2]}"]
            for name, rs in runs.items():
                if name in ("static", "compiled"):
                    continue
                ratio = statistics.median(s[1] / b[1] for s, b in zip(static, rs, strict=True))
                parts.append(f"{name} {statistics.median(r[1] for r in rs):7.0f} tok/s ({ratio:5.2f}x)")
            print(" | ".join(parts) + "  (static's paired-median ratio to each)")
            if args.compiled:
                cs = runs["compiled"]
                vs = {name: statistics.median(c[1] / b[1] for c, b in zip(cs, runs[name], strict=True))
                      for name in ("engine", "static")}
                print(f"{shape:>7} batch {batch}: compiled {statistics.median(r[1] for r in cs):7.0f} tok/s, ttft "
                      f"{statistics.median(r[0] for r in cs) * 1e3:6.1f} ms, {vs['engine']:5.2f}x engine, "
                      f"{vs['static']:5.2f}x static (paired medians); compile and first run {compile_s:5.1f} s")


if __name__ == "__main__":
    main()
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")
