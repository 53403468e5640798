"""What the d12/d20 recipe's differences from nanochat's move, measured small on this CPU: the same
small GPT trained through the real training loop on real text, once per variant, one setting changed at
a time against the recipe the d12/d20 presets had before they took nanochat's (heads of 64, the
last 40% of steps decaying, rotary base 10,000, Normal init), printing each variant's validation
bits per byte after the same tokens. Not a test; docs/recipe.md quotes its figures.

Variants (`--variants`, comma-separated; `--seeds` runs each under several training seeds):

  before        head_dim 64, warmdown_frac 0.4, rope_theta 10,000, Normal init
  heads128      before, with heads of 128
  warmdown0.2   before, with the last 20% of steps decaying
  preset        heads of 128, warmdown 0.2, rope_theta 100,000: the d12/d20 presets' recipe now
  uniform       preset, with nanochat's init (model.init: nanochat): Uniform with the same std for q,
                k, v and MLP-in, the MLP-in at 0.4x that std, the token embedding at std 0.8

    PYTHONPATH=lib .venv/bin/python bench/bench_recipe.py [--steps 150] [--seeds 0,1] [--threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench_train import DEFAULT_TEXT, ROOT, WindowSource
from lockstep.core.runtime import Runtime
from lockstep.model.gpt import GPT, GPTConfig
from lockstep.tokenizer.kinds import train_tokenizer
from lockstep.train.trainer import TrainConfig, Trainer, Validation


@dataclasses.dataclass(frozen=True)
class Variant:
    head_dim: int = 64
    warmdown_frac: float = 0.4
    rope_theta: float = 10_000.0
    init: str = "lockstep"  # model.init: lockstep (Normal) or nanochat (lockstep.model.gpt.INITS)


VARIANTS = {
    "before": Variant(),
    "heads128": Variant(head_dim=128),
    "warmdown0.2": Variant(warmdown_frac=0.2),
    "preset": Variant(head_dim=128, warmdown_frac=0.2, rope_theta=100_000.0),
    "uniform": Variant(head_dim=128, warmdown_frac=0.2, rope_theta=100_000.0, init="nanochat"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seeds", default="0", help="training seeds (init and batch order), comma-separated")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--depth", type=int, default=2, help="layers; width 64 x depth, an even depth for heads of 128")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rows", type=int, default=8, help="sequences per step")
    p.add_argument("--vocab", type=int, default=2048, help="the bpe tokenizer trained on --text")
    p.add_argument(
        "--eval-batches",
        type=int,
        default=16,
        help="validation: batches of --rows windows, the same windows in every run",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT if DEFAULT_TEXT.is_file() else ROOT / "README.md")
    args = p.parse_args()
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if (64 * args.depth) % 128:
        raise SystemExit(
            f"--depth={args.depth} gives width {64 * args.depth}, which heads of 128 do not divide; pass an even depth"
        )
    torch.set_num_threads(args.threads)

    text = args.text.read_text(encoding="utf-8")
    tok = train_tokenizer("bpe", [text], vocab_size=args.vocab)
    ids = torch.tensor(tok.encode(text), dtype=torch.long)
    split = int(0.9 * ids.numel())
    T, B = args.seq, args.rows
    train_src, val_src = WindowSource(ids[:split], T), WindowSource(ids[split:], T)
    token_bytes = torch.from_numpy(tok.token_bytes().astype("int64"))
    rt = Runtime(device=torch.device("cpu"), dtype=torch.float32, reason="bench fp32", kernels=True)
    print(
        f"d{args.depth} x {T} tokens x {B} rows, {args.steps} steps ({args.steps * B * T:,} tokens), "
        f"bpe vocab {tok.get_vocab_size()}, text {args.text.name} ({ids.numel():,} tokens, last 10% val), "
        f"{args.threads} threads, fp32",
        flush=True,
    )
    results: dict[str, list[float]] = {}
    for name in args.variants.split(","):
        v = VARIANTS[name]
        for seed in (int(s) for s in args.seeds.split(",")):
            gcfg = GPTConfig.from_depth(args.depth, tok.get_vocab_size(), T, v.head_dim, rope_theta=v.rope_theta,
                                        init=v.init)
            model = GPT.build(gcfg, "cpu", seed=seed)
            model.use_kernels(True)
            cfg = TrainConfig(
                batch_tokens=B * T,
                device_batch_rows=B,
                num_steps=args.steps,
                warmdown_frac=v.warmdown_frac,
                eval_every_steps=0,
                eval_tokens=args.eval_batches * B * T,
                checkpoint_every_steps=0,
                max_epochs=None,
            )
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                trainer = Trainer(
                    model, cfg, rt, data=train_src, seed=seed, validation=Validation(val_src, token_bytes, seed=0)
                )
                res = trainer.fit(Path(tmp) / "run", {"stage": "bench", "code_revision": "bench"})
            bpb = res.final_eval["val_bpb"]
            results.setdefault(name, []).append(bpb)
            print(
                f"{name:12s} seed {seed}: {gcfg.n_head} heads of {gcfg.head_dim}, warmdown {v.warmdown_frac}, "
                f"rope {v.rope_theta:g}, init {v.init}: val bpb {bpb:.4f}, train loss {res.losses[-1][1]:.4f}, "
                f"{time.perf_counter() - t0:.0f} s",
                flush=True,
            )
    base = statistics.mean(results["before"]) if "before" in results else None
    for name, bpbs in results.items():
        mean = statistics.mean(bpbs)
        spread = f" (seeds {min(bpbs):.4f}-{max(bpbs):.4f})" if len(bpbs) > 1 else ""
        delta = f", {mean - base:+.4f} against before" if base is not None and name != "before" else ""
        print(f"{name:12s} val bpb {mean:.4f}{spread}{delta}")


if __name__ == "__main__":
    main()
