"""Benchmark: windows/s of PretrainTokenStreamDataset.get_batch (and the sequential loader) on a
synthetic cache, against a single vectorised numpy gather of the same windows. Not a test."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lockstep.data.cache_build import build_pretrain_cache
from lockstep.data.loaders import PretrainTokenStreamDataset, ShardedTokenLoader


class _RangeTokenizer:
    """Documents are decimal strings n; each encodes to n tokens of cycling ids (no BPE cost)."""

    sha256 = "bench"

    def get_vocab_size(self) -> int:
        return 50_000

    def get_bos_token_id(self) -> int:
        return 49_999

    def get_special_tokens(self) -> dict[str, int]:
        return {"<|bos|>": 49_999}

    def encode(self, texts, num_threads=1):
        return [list(range(int(t) % 1000, int(t) % 1000 + int(t))) for t in texts]

    def decode(self, ids) -> str:
        return " ".join(map(str, ids))


def _median_rate(fn, n_iter: int, rows: int) -> float:
    times = []
    for _ in range(n_iter):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return rows / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=20_000_000, help="cache size in tokens")
    ap.add_argument("--B", type=int, default=32)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "c"
        doc_tokens = 2000
        docs = [str(doc_tokens)] * (args.tokens // (doc_tokens + 1))
        build_pretrain_cache({"train": docs}, out, tokenizer=_RangeTokenizer(), max_train_tokens=None,
                             max_val_tokens=None, shard_bytes=16 * 2**20, seed=0, shuffle_buffer=1)  # fmt: skip
        ds = PretrainTokenStreamDataset(out / "train", T=args.T, device="cpu")
        g = torch.Generator().manual_seed(0)
        ours = _median_rate(lambda: ds.get_batch(B=args.B, generator=g), args.iters, args.B)

        shard = np.asarray(ds.split.shards[0])
        offs = np.arange(args.T + 1)

        def gather() -> torch.Tensor:
            starts = torch.randint(0, shard.size - args.T - 1, (args.B,), generator=g).numpy()
            return torch.from_numpy(shard[starts[:, None] + offs].astype(np.int64))

        base = _median_rate(gather, args.iters, args.B)
        seq = ShardedTokenLoader(out / "train", B=args.B, T=args.T, device="cpu")
        sequential = _median_rate(seq.next_batch, args.iters, args.B)
    print(f"cache: {ds.split.tokens} tokens in {len(ds.split.shards)} shards; B={args.B} T={args.T}; "
          f"median of {args.iters}")
    print(f"random windows (get_batch):        {ours:12,.0f} windows/s")
    print(f"vectorised numpy gather baseline:  {base:12,.0f} windows/s")
    print(f"sequential rank loader:            {sequential:12,.0f} windows/s")
    print(f"ratio get_batch / gather:          {ours / base:.2f}x (target: >= 100k windows/s)")


if __name__ == "__main__":
    main()
