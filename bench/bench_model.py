"""Benchmark of the bare GPT's training step (forward + backward, no optimizer) on this machine:
tok/s and MFU in fp32, bf16 autocast and bf16 weights, with lockstep.model.kernels on, against three
baselines measured in the same run: the matmul peak of each dtype, the same model with kernels
off (its stock-PyTorch reference path), and `PlainGPT`, the same architecture written with stock
PyTorch modules only (nn.Linear, F.rms_norm, scaled_dot_product_attention, F.cross_entropy), so
the ratios are what the kernels buy over the reference and over the obvious implementation. Not
a test and not the training loop's throughput.

    .venv/bin/python bench/bench_model.py --depth 4 --vocab 32768 --seq 256 --batch 8
"""

from __future__ import annotations

import argparse
import os
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.model.gpt import GPT, GPTConfig


class PlainGPT(nn.Module):
    """The baseline: lockstep's architecture (rotary, QK-norm, grouped-query attention, ReLU^2
    MLP, untied soft-capped head) in stock PyTorch, with no hand-written kernels."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c, D = c, c.n_embd // c.n_head
        V = -(-c.vocab_size // c.vocab_multiple) * c.vocab_multiple
        self.wte = nn.Embedding(V, c.n_embd)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "q": nn.Linear(c.n_embd, c.n_head * D, bias=False), "k": nn.Linear(c.n_embd, c.n_kv_head * D, bias=False),
            "v": nn.Linear(c.n_embd, c.n_kv_head * D, bias=False), "o": nn.Linear(c.n_embd, c.n_embd, bias=False),
            "fc": nn.Linear(c.n_embd, c.mlp_ratio * c.n_embd, bias=False),
            "proj": nn.Linear(c.mlp_ratio * c.n_embd, c.n_embd, bias=False),
        }) for _ in range(c.n_layer))
        self.lm_head = nn.Linear(c.n_embd, V, bias=False)
        freqs = 1.0 / c.rope_theta ** (torch.arange(0, D, 2).float() / D)
        angles = torch.outer(torch.arange(c.sequence_len).float(), freqs)  # (T, D/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:  # (B, H, T, D)
        T = x.shape[2]
        x1, x2 = x.chunk(2, dim=-1)
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        c, (B, T) = self.c, idx.shape
        D = c.n_embd // c.n_head
        x = F.rms_norm(self.wte(idx), (c.n_embd,))
        for b in self.blocks:
            h = F.rms_norm(x, (c.n_embd,))
            q = b["q"](h).view(B, T, c.n_head, D).transpose(1, 2)  # (B, H, T, D)
            k = b["k"](h).view(B, T, c.n_kv_head, D).transpose(1, 2)  # (B, Hkv, T, D)
            v = b["v"](h).view(B, T, c.n_kv_head, D).transpose(1, 2)
            q, k = F.rms_norm(self._rotate(q), (D,)), F.rms_norm(self._rotate(k), (D,))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=c.n_kv_head != c.n_head)
            x = x + b["o"](y.transpose(1, 2).reshape(B, T, c.n_embd))
            x = x + b["proj"](F.relu(b["fc"](F.rms_norm(x, (c.n_embd,)))).square())
        logits = self.lm_head(F.rms_norm(x, (c.n_embd,))).float()
        if c.softcap:
            logits = c.softcap * torch.tanh(logits / c.softcap)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


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


def step_time_s(model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: bool, steps: int, warmup: int) -> float:
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
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of ours and the two baselines")
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
        autocast = mode == "bf16-autocast"
        model = GPT.build(config, "cpu", dtype=weights_dtype)
        plain = PlainGPT(config).to(weights_dtype or torch.float32)
        ours_s, ref_s, plain_s = [], [], []
        for _ in range(args.rounds):  # alternating, so a change in the machine's load hits every side
            ours_s.append(
                step_time_s(model.use_kernels(True), x, y, autocast=autocast, steps=args.steps, warmup=args.warmup)
            )
            ref_s.append(
                step_time_s(model.use_kernels(False), x, y, autocast=autocast, steps=args.steps, warmup=args.warmup)
            )
            plain_s.append(step_time_s(plain, x, y, autocast=autocast, steps=args.steps, warmup=args.warmup))
        dt_s, ref_dt_s, plain_dt_s = statistics.median(ours_s), statistics.median(ref_s), statistics.median(plain_s)
        tok_s = tokens / dt_s
        mfu = tok_s * flops_per_token / peaks[dtype_name]
        vs_ref = statistics.median(r / o for o, r in zip(ours_s, ref_s, strict=True))
        vs_plain = statistics.median(p / o for o, p in zip(ours_s, plain_s, strict=True))
        print(
            f"{mode:>14}: {dt_s * 1e3:7.1f} ms/step | {tok_s:7.0f} tok/s | mfu {mfu:5.1%} of {dtype_name} peak | "
            f"kernels off {tokens / ref_dt_s:7.0f} tok/s | plain {tokens / plain_dt_s:7.0f} tok/s | "
            f"{vs_ref:4.2f}x kernels off, {vs_plain:4.2f}x plain (paired medians)"
        )
        del model, plain


if __name__ == "__main__":
    main()
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")
