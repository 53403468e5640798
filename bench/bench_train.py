"""Training throughput benchmark on this CPU: a d4 model, seq 256, 8 sequences, vocab 32768, fp32
and bf16, through the real training loop. Prints tok/s, MFU against the matmul peak of the same
dtype measured in this run, val bpb after the same tokens, and peak RSS. Not a test.

    .venv/bin/python bench/bench_train.py [--steps 40] [--threads 2]
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import torch

from lockstep.core.runtime import Runtime, keep_heap_memory, measure_matmul_peak_flops
from lockstep.model.gpt import GPT, GPTConfig
from lockstep.tokenizer.kinds import train_tokenizer
from lockstep.train.optim import OptimConfig
from lockstep.train.trainer import TrainConfig, Trainer, Validation

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = ROOT.parent / "shared" / "fixtures" / "tinyshakespeare" / "input.txt"


class WindowSource:
    """Random windows of a token tensor: the benchmark's data, independent of the cache stages."""

    def __init__(self, tokens: torch.Tensor, T: int) -> None:
        self.tokens, self.T = tokens, T

    def get_batch(self, *, B: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.tokens.numel() - self.T - 1, (B,), generator=generator)
        idx = starts[:, None] + torch.arange(self.T + 1)  # (B, T+1)
        rows = self.tokens[idx]
        return rows[:, :-1], rows[:, 1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per dtype (first one untimed)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT if DEFAULT_TEXT.is_file() else ROOT / "README.md")
    p.add_argument(
        "--kernels",
        choices=("on", "off"),
        default="on",
        help="run the model on lockstep.model.kernels (the tiny presets' runtime.kernels) or on its reference path",
    )
    p.add_argument("--malloc", choices=("keep", "default"), default="keep",
                   help="keep: reuse freed heap memory as the training stages do (runtime.keep_heap_memory); "
                        "default: glibc's defaults, for comparison")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    heap = keep_heap_memory() if args.malloc == "keep" else False

    T, B, V, depth = 256, 8, 32768, 4
    tok = train_tokenizer("byte", [])
    ids = torch.tensor(tok.encode(args.text.read_text(encoding="utf-8")), dtype=torch.long)
    split = int(0.9 * ids.numel())
    train_src, val_src = WindowSource(ids[:split], T), WindowSource(ids[split:], T)
    token_bytes = torch.zeros(V, dtype=torch.int64)
    token_bytes[: tok.get_vocab_size()] = torch.from_numpy(tok.token_bytes().astype("int64"))

    print(f"d{depth} model, seq {T}, batch {B} sequences, vocab {V}, {args.threads} threads, {args.steps} steps, "
          f"text {args.text.name} ({ids.numel()} byte tokens), heap reuse {'on' if heap else 'off'}, "
          f"kernels {args.kernels}")
    rows = []
    for name in args.dtypes.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        peak = measure_matmul_peak_flops(torch.device("cpu"), dtype, n=2048, min_time_s=1.0)
        rt = Runtime(device=torch.device("cpu"), dtype=dtype, reason=f"bench {name}")
        model = GPT.build(GPTConfig.from_depth(depth, V, T), "cpu", seed=0).use_kernels(args.kernels == "on")
        cfg = TrainConfig(batch_tokens=B * T, device_batch_rows=B, num_steps=args.steps, warmup_steps=0,
                          eval_every_steps=0, eval_tokens=16 * B * T, checkpoint_every_steps=0, peak_flops=peak,
                          optim=OptimConfig(muon_momentum_warmup_steps=args.steps))
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            trainer = Trainer(model, cfg, rt, data=train_src, seed=0, validation=Validation(val_src, token_bytes))
            res = trainer.fit(Path(tmp) / "run", {"stage": "bench", "code_revision": "bench"})
            wall_s = time.perf_counter() - t0
        rows.append((name, res.tok_per_s, res.mfu, peak, res.final_eval["val_bpb"], res.losses[-1][1], wall_s))
        print(f"{name}: {res.tok_per_s:,.0f} tok/s (timed tokens over their steps' time) | MFU {100 * res.mfu:.1f}% "
              f"of measured {name} matmul peak {peak / 1e9:.0f} GFLOP/s | val bpb {res.final_eval['val_bpb']:.4f} "
              f"after {res.tokens:,} tokens | train loss {res.losses[-1][1]:.4f} | wall {wall_s:.1f}s", flush=True)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {rss_mb:,.0f} MB")
    if len(rows) == 2:
        (_, t32, _, _, b32, _, _), (_, t16, _, _, b16, _, _) = rows
        print(f"bf16 vs fp32: x{t16 / t32:.2f} tok/s, val bpb {b16:.4f} vs {b32:.4f} ({100 * (b16 - b32) / b32:+.2f}%)")


if __name__ == "__main__":
    main()
