"""Benchmark of the prefix-smoothed loss against plain cross-entropy in the bare training step
(forward + backward of the GPT, no optimizer) at the tiny preset's shape: tok/s of the two forms
in lockstep.train.objectives with the bpe ancestor chains, `prefix_smooth` (prefix_smooth_loss of the
model's logits) and `prefix_fused` (model_prefix_smooth_loss, which keeps the fused head), against
two baselines measured in the same run, interleaved: the model's own loss (`ce`, what training
runs: the fused head under lockstep.model.kernels) and cross-entropy of the same logits (`ce-logits`).
Target: prefix_fused >= 0.9x ce. Targets are real text encoded by a bpe tokenizer, so the chains have
their real depths.

Beside them, the GPU ops set (lockstep.model.ops.CUDA_OPS, its head loss in chunks of --chunk-rows rows)
run on this CPU: `ce-chunked` and `prefix_chunked` against the stock-PyTorch reference
(`ce-reference`, REFERENCE_OPS) in tok/s and in peak memory, the most bytes torch's CPU allocator
held above the step's start during one step (torch.profiler's memory events, one thread so that
every allocation is seen). CPU presets keep KERNEL_OPS; these rows say what the chunking costs and
saves, not what a GPU gains. Not a test.

    .venv/bin/python bench/bench_objective.py [--tokenizer data/tokenizer] [--steps 6 --rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lockstep.model import ops
from lockstep.model.gpt import GPT, GPTConfig, cross_entropy
from lockstep.tokenizer import load_tokenizer
from lockstep.tokenizer.kinds import train_tokenizer
from lockstep.train.objectives import model_prefix_smooth_loss, prefix_smooth_loss

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = ROOT.parent / "shared" / "fixtures" / "tinyshakespeare" / "input.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rows", type=int, default=16, help="sequences per step (the tiny preset's device_batch_rows)")
    ap.add_argument("--vocab", type=int, default=4096, help="vocab of the bpe trained when --tokenizer is not given")
    ap.add_argument("--tokenizer", type=Path, default=None, help="a saved bpe tokenizer (default: train one on --text)")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--weight", type=float, default=0.1, help="prefix_weight")
    ap.add_argument(
        "--kernels", choices=("on", "off"), default="on", help="lockstep.model.kernels (the tiny preset: on)"
    )
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the three losses")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument(
        "--chunk-rows", type=int, default=ops.CHUNK_ROWS, help="rows (tokens) per chunk of CUDA_OPS' head loss"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    text = args.text.read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.tokenizer
        if directory is None:
            directory = Path(tmp) / "tok"
            train_tokenizer("bpe", [text], vocab_size=args.vocab).save(directory)
        tok = load_tokenizer(directory)
        tree = tok.prefix_tree()
    V, T, B = tok.get_vocab_size(), args.seq, args.rows
    ids = torch.tensor(tok.encode(text[:2_000_000]), dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, ids.numel() - T - 1, (B,), generator=g)
    rows = ids[starts[:, None] + torch.arange(T + 1)]  # (B, T+1)
    x, y = rows[:, :-1], rows[:, 1:]
    ancestors, depths = torch.from_numpy(tree.ancestors), torch.from_numpy(tree.depths)
    print(f"d{args.depth} T={T} rows={B} vocab={V} kernels={args.kernels} threads={torch.get_num_threads()} "
          f"w={args.weight}; chains: max depth {ancestors.size(1)}, "
          f"mean depth of the targets {depths[y].float().mean():.2f}")

    model = GPT.build(GPTConfig.from_depth(args.depth, V, T), "cpu", seed=0)
    preset_ops = ops.KERNEL_OPS if args.kernels == "on" else ops.REFERENCE_OPS
    chunked_ops = dataclasses.replace(ops.CUDA_OPS, head_loss=_chunked(args.chunk_rows),
                                      smoothed_head_loss=_chunked(args.chunk_rows, smoothed=True))
    # name -> (the model's ops, the loss of one step)
    losses = {
        "ce": (preset_ops, lambda: model(x, y)),
        "ce-logits": (preset_ops, lambda: cross_entropy(model(x), y, "mean")),
        "prefix_smooth": (preset_ops, lambda: prefix_smooth_loss(model(x), y, ancestors, depths, args.weight)),
        "prefix_fused": (preset_ops, lambda: model_prefix_smooth_loss(model, x, y, ancestors, depths, args.weight)),
        "ce-reference": (ops.REFERENCE_OPS, lambda: model(x, y)),
        "ce-chunked": (chunked_ops, lambda: model(x, y)),
        "prefix_chunked": (chunked_ops, lambda: model_prefix_smooth_loss(model, x, y, ancestors, depths, args.weight)),
    }
    times: dict[str, list[float]] = {name: [] for name in losses}
    for _ in range(args.rounds):
        for name, (ops_set, loss_fn) in losses.items():
            model.ops = ops_set
            for i in range(args.warmup + args.steps):
                t0 = time.perf_counter()
                loss_fn().backward()
                model.zero_grad(set_to_none=True)
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
    peak: dict[str, int] = {}
    for name, (ops_set, loss_fn) in losses.items():
        model.ops = ops_set
        peak[name] = peak_bytes(lambda: loss_fn().backward())
        model.zero_grad(set_to_none=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, dt in med.items():
        print(f"{name:14s} {B * T / dt:9.0f} tok/s  (median step {dt * 1e3:.0f} ms over {len(times[name])})  "
              f"peak {peak[name] / 2**20:7.1f} MiB")
    print(f"prefix_smooth / ce        = {med['ce'] / med['prefix_smooth']:.2f}x tok/s")
    print(f"prefix_smooth / ce-logits = {med['ce-logits'] / med['prefix_smooth']:.2f}x tok/s")
    print(f"prefix_fused  / ce        = {med['ce'] / med['prefix_fused']:.2f}x tok/s (target >= 0.9x)")
    print(f"ce-chunked / ce-reference = {med['ce-reference'] / med['ce-chunked']:.2f}x tok/s, "
          f"{peak['ce-chunked'] / peak['ce-reference']:.2f}x peak memory ({args.chunk_rows}-row chunks)")
    print(f"ce-chunked / ce           = {med['ce'] / med['ce-chunked']:.2f}x tok/s, "
          f"{peak['ce-chunked'] / peak['ce']:.2f}x peak memory (ce: kernels {args.kernels}, what the CPU preset runs)")
    print(f"prefix_chunked / prefix_smooth = {med['prefix_smooth'] / med['prefix_chunked']:.2f}x tok/s, "
          f"{peak['prefix_chunked'] / peak['prefix_smooth']:.2f}x peak memory")
    print(f"prefix_chunked / prefix_fused  = {med['prefix_fused'] / med['prefix_chunked']:.2f}x tok/s, "
          f"{peak['prefix_chunked'] / peak['prefix_fused']:.2f}x peak memory")


def _chunked(chunk_rows: int, *, smoothed: bool = False):
    """CUDA_OPS' head loss (smoothed: its smoothed_head_loss) at `chunk_rows` rows per chunk."""
    if smoothed:
        def smoothed_loss(x, w, targets, cols, coefs, cap, vocab_size, reduction):
            return ops.chunked_head_loss(x, w, targets, cap, vocab_size, reduction, chunk_rows=chunk_rows,
                                         target_cols=cols, target_weights=coefs)
        return smoothed_loss

    def loss(x, w, targets, cap, vocab_size, reduction):
        return ops.chunked_head_loss(x, w, targets, cap, vocab_size, reduction, chunk_rows=chunk_rows)
    return loss


def peak_bytes(step) -> int:
    """The most bytes torch's CPU allocator held above the level at the start while `step` ran:
    torch.profiler's memory events summed in time order. One intra-op thread meanwhile, so that
    lockstep.model.kernels' row blocks run on this thread, whose allocations the profiler records."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        torch.set_num_threads(threads)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    held = top = 0
    for _, nbytes in events:
        held += nbytes
        top = max(top, held)
    return top

if __name__ == "__main__":
    main()
