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

With `--nanochat PATH` (a nanochat checkout at bench_gpu.NANOCHAT_COMMIT) it compares instead:
nanochat's Engine.generate against lockstep's engine paths (the reference engine, with its CPU
decode step, `cpu_step`, the static path and the compiled one) at one shape and sampling setting
(default d4-32k, temperature 1, top-k 50), each dtype of --dtypes in a subprocess of its own
(nanochat fixes its compute dtype when nanochat.common is imported, from NANOCHAT_DTYPE), the
sides alternating within it, and prints each path's tok/s and its paired-median ratio to
nanochat's per batch size and dtype. Both models are random-weight models of the same shape, built
by each project's own init (the architectures differ: nanochat's has value embeddings and more),
nanochat's cast once to its compute dtype (--nanochat-weights compute; `fp32` keeps the fp32
weights its checkpoint loader leaves on a CPU, which its layers cast at every matmul);
the stand-in tokenizer puts the special ids past the vocabulary, so no row stops early and every
run decodes --new tokens per row.

    .venv/bin/python bench/bench_decode.py                      # CPU: tiny and d4-32k, fp32 and bf16
    .venv/bin/python bench/bench_decode.py --device cuda --shapes d12 --dtype bf16
    .venv/bin/python bench/bench_decode.py --nanochat ../nanochat --threads 2   # against nanochat, CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

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


class NanochatIds(IdsOnly):
    """IdsOnly with nanochat's tokenizer methods (it asks for <|bos|> by name of its own)."""

    def get_bos_token_id(self) -> int:
        return self.encode_special("<|bos|>")


def unreachable_ids(vocab_size: int) -> NanochatIds:
    """A stand-in tokenizer whose special ids lie past the vocabulary: no model ever samples a stop
    token or a tool call from it, so every run is --new tokens long on both engines."""
    return NanochatIds(vocab_size + len(SPECIAL_TOKENS))


def timed(steps, batch: int) -> tuple[float, float, int]:
    """(time to first column s, tok/s after it, columns) of a generator of token columns."""
    t0 = time.perf_counter()
    next(steps)
    t1 = time.perf_counter()
    n = 1
    for _ in steps:
        n += 1
    t2 = time.perf_counter()
    return t1 - t0, (n - 1) * batch / max(t2 - t1, 1e-9), n


def compare_child(args: argparse.Namespace) -> None:
    """One dtype of the nanochat comparison, in a process whose NANOCHAT_DTYPE the parent set."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_gpu import import_nanochat, nanochat_model

    import_nanochat("bench_decode.py --nanochat", compile_on=False)
    from nanochat.common import COMPUTE_DTYPE
    from nanochat.engine import Engine as NanochatEngine

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if COMPUTE_DTYPE != dtype:
        raise SystemExit(f"nanochat computes in {COMPUTE_DTYPE}, not {dtype}: NANOCHAT_DTYPE was not passed down")
    depth, vocab, seq = SHAPES[args.shapes]
    config = GPTConfig.from_depth(depth, vocab_size=vocab, sequence_len=seq)
    torch.manual_seed(0)
    # fp32 weights, cast per matmul, as its CPU load has them; the same heads as lockstep's model
    nc_model = nanochat_model(depth, vocab, seq, "L", config.n_head).eval()
    if args.nanochat_weights == "compute":  # cast once instead: its Linear's per-matmul cast becomes a no-op
        nc_model.to(dtype=COMPUTE_DTYPE)
    ls_model = GPT.build(config, torch.device("cpu"), dtype=dtype).use_kernels(True).eval()
    tok = unreachable_ids(vocab)
    nanochat = NanochatEngine(nc_model, tok)
    engines: dict[str, Engine] = {"engine": Engine(ls_model, tok), "cpu_step": Engine(ls_model, tok, cpu_step=True),
                                  "static": Engine(ls_model, tok, fast=True)}
    if args.compiled:
        engines["compiled"] = Engine(ls_model, tok, fast=True, compile_step=True)
    top_k = args.top_k or None
    prompt = torch.randint(0, 256, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    print(
        f"{args.dtype}: nanochat {sum(p.numel() for p in nc_model.parameters()) / 1e6:.1f}M params "
        f"({args.nanochat_weights} weights), lockstep "
        f"{sum(p.numel() for p in ls_model.parameters()) / 1e6:.1f}M; load (1 min) {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    for batch in (int(b) for b in args.batches.split(",")):

        def nanochat_side(n: int = args.new) -> tuple[float, float, int]:
            return timed(
                nanochat.generate(
                    prompt, num_samples=batch, max_tokens=n, temperature=args.temperature, top_k=top_k, seed=0
                ),
                batch,
            )

        def lockstep_side(engine: Engine) -> Callable[..., tuple[float, float, int]]:
            def side(n: int = args.new) -> tuple[float, float, int]:
                return timed(
                    engine.generate(
                        prompt,
                        num_samples=batch,
                        max_tokens=n,
                        temperature=args.temperature,
                        top_k=top_k,
                        seed=0,
                        use_tools=False,
                    ),
                    batch,
                )

            return side

        sides = {"nanochat": nanochat_side, **{name: lockstep_side(e) for name, e in engines.items()}}
        for side in sides.values():  # warm-up at the measured length (the compiled step compiles here)
            side()
        runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in sides}
        for _ in range(args.reps):  # alternating, so a change in the machine's load hits every side
            for name, side in sides.items():
                runs[name].append(side())
        for name, rs in runs.items():
            if any(r[2] != args.new for r in rs):
                raise SystemExit(f"{name} decoded {[r[2] for r in rs]} columns, not {args.new}: a row stopped early")
        nc = runs["nanochat"]
        parts = [f"nanochat {statistics.median(r[1] for r in nc):6.0f} tok/s"]
        for name, rs in runs.items():
            if name != "nanochat":
                ratio = statistics.median(s[1] / b[1] for s, b in zip(rs, nc, strict=True))
                parts.append(f"{name} {statistics.median(r[1] for r in rs):6.0f} ({ratio:4.2f}x)")
        print(f"{args.shapes} {args.dtype} batch {batch}: " + " | ".join(parts), flush=True)


def compare(args: argparse.Namespace) -> None:
    """The nanochat comparison: one subprocess per dtype (see the module docstring)."""
    root = Path(args.nanochat).expanduser().resolve()
    if not (root / "nanochat" / "engine.py").is_file():
        raise SystemExit(
            f"--nanochat {args.nanochat} holds no nanochat/engine.py: pass a nanochat checkout "
            "(git clone https://github.com/karpathy/nanochat)"
        )
    if args.device != "cpu" or "," in args.shapes or args.shapes not in SHAPES:
        raise SystemExit(
            f"--nanochat compares on the CPU at one shape of {', '.join(SHAPES)} "
            f"(got --device {args.device} --shapes {args.shapes})"
        )
    print(
        f"nanochat {root} against lockstep, {args.shapes}, prompt {args.prompt} + {args.new} new tokens, "
        f"temperature {args.temperature}, top-k {args.top_k}, median of {args.reps}; ratios are paired medians "
        f"against nanochat; load average (1 min) at start {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    passed = list(sys.argv[1:])
    for dt in args.dtypes.split(","):
        env = dict(os.environ, NANOCHAT_ROOT=str(root), NANOCHAT_DTYPE={"bf16": "bfloat16", "fp32": "float32"}[dt])
        cmd = [sys.executable, __file__, *passed, "--compare-child", "--dtype", dt]
        if subprocess.run(cmd, env=env).returncode:
            raise SystemExit(f"the {dt} comparison failed (its error is above)")


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
    ap.add_argument("--nanochat", metavar="PATH", help="a nanochat checkout: compare against its Engine (CPU)")
    ap.add_argument("--dtypes", default="bf16,fp32", help="with --nanochat: the dtypes compared, one process each")
    ap.add_argument("--temperature", type=float, default=1.0, help="with --nanochat: the sampling temperature")
    ap.add_argument("--top-k", type=int, default=50, help="with --nanochat: the top-k cut (0: none)")
    ap.add_argument(
        "--nanochat-weights",
        choices=["fp32", "compute"],
        default="compute",
        help="with --nanochat: nanochat's weights in fp32, cast to its compute dtype at every matmul (as its "
        "checkpoint loader leaves them on a CPU), or cast once to that dtype (no per-matmul cast; the default)",
    )
    ap.add_argument("--compare-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.nanochat and args.shapes == ap.get_default("shapes"):
        args.shapes = "d4-32k"
    if args.compare_child:
        return compare_child(args)
    if args.nanochat:
        return compare(args)
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
