"""Benchmark: pretrain cache build end to end (read raw snapshot -> encode -> write shards) against
raw tiktoken `encode_ordinary_batch` over the same in-memory text with the same threads, and the
peak RSS of a build in a fresh process. Generated text; not a test."""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lockstep.cache import CacheConfig, build_pretrain_cache
from lockstep.sources import iter_records
from lockstep.sources.snapshot import SnapshotWriter
from lockstep.tokenizer import load_tokenizer, train_tokenizer

_LETTERS = "etaoinshrdlcumwfgypbvkjxqz"


def _doc_pool(n_docs: int, doc_chars: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 10, (4000,), generator=g).tolist()
    letters = torch.randint(0, 26, (sum(lens),), generator=g).tolist()
    words, pos = [], 0
    for n in lens:
        words.append("".join(_LETTERS[i] for i in letters[pos : pos + n]))
        pos += n
    n_words = doc_chars // 6
    idx = torch.randint(0, len(words), (n_docs, n_words), generator=g).tolist()
    return [" ".join(words[i] for i in row) + "." for row in idx]


def _write_snapshot(root: Path, total_bytes: int, pool: list[str]) -> int:
    sink = SnapshotWriter(root, kind="document")
    written = i = 0
    while written < total_bytes:
        text = f"Document {i}. {pool[i % len(pool)]}"
        sink.add("train", {"text": text}, f"doc{i}")
        written += len(text.encode("utf-8"))
        i += 1
    sink.close(name="bench", source="bench", config={}, seed=0)
    return i


class _RawTiktoken:
    """The lockstep tokenizer as a tokenizer that only gives id lists, its encode swapped for raw
    tiktoken batching: the build's list path, for comparison with its array path."""

    encode_arrays = None  # the cache build then takes the id-list path

    def __init__(self, tok) -> None:
        self.tok = tok

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, texts, num_threads=2):
        # One thread: no pool, as the bpe kind does; the cache build encodes from its own threads.
        if num_threads <= 1:
            return [self.tok._enc.encode_ordinary(t) for t in texts]
        return self.tok._enc.encode_ordinary_batch(texts, num_threads=num_threads)


def _build(snapshot: Path, out: Path, tok_dir: Path, threads: int, raw: bool = False) -> dict:
    cfg = CacheConfig(kind="pretrain")
    tok = load_tokenizer(tok_dir)
    return build_pretrain_cache(
        {"train": (r["text"] for r in iter_records(snapshot, "train")), "val": iter(())},
        out, tokenizer=_RawTiktoken(tok) if raw else tok, max_train_tokens=None, max_val_tokens=None,
        shard_bytes=cfg.shard_bytes, seed=0, shuffle_buffer=cfg.shuffle_buffer,
        encode_batch_docs=cfg.encode_batch_docs, num_threads=threads,
    )  # fmt: skip


def _child_peak_rss_mb(snapshot: Path, out: Path, tok_dir: Path, threads: int) -> tuple[float, float]:
    cmd = [sys.executable, __file__, "--child", str(snapshot), str(out), str(tok_dir), str(threads)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t0
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=64, help="MB of text for the throughput comparison")
    ap.add_argument("--rss-mb", type=int, default=0, help="MB of text for the peak-RSS build (0: skip)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    pool = _doc_pool(600, 4000, seed=0)
    with tempfile.TemporaryDirectory(prefix="bench_cache.") as tmp:
        tmp = Path(tmp)
        tok = train_tokenizer("bpe", pool[:300], vocab_size=4096)
        tok.save(tmp / "tok")
        enc = tok._enc  # the tiktoken Encoding behind the bpe kind: the same merges, no wrapper
        n_docs = _write_snapshot(tmp / "raw", args.mb * 10**6, pool)
        texts = [r["text"] for r in iter_records(tmp / "raw", "train")]
        n_bytes = sum(len(t.encode("utf-8")) for t in texts)
        batch = CacheConfig(kind="pretrain").encode_batch_docs
        base_s, ours_s, raw_s = [], [], []

        def run_base() -> None:
            t0 = time.perf_counter()
            for i in range(0, len(texts), batch):
                enc.encode_ordinary_batch(texts[i : i + batch], num_threads=args.threads)
            base_s.append(time.perf_counter() - t0)

        def run_ours(rep: int) -> dict:
            t0 = time.perf_counter()
            meta = _build(tmp / "raw", tmp / f"cache{rep}", tmp / "tok", args.threads)
            ours_s.append(time.perf_counter() - t0)
            return meta

        for rep in range(args.reps):
            # Alternate which runs first so a drift in machine load hits both sides alike.
            if rep % 2 == 0:
                run_base()
                meta = run_ours(rep)
            else:
                meta = run_ours(rep)
                run_base()
            t0 = time.perf_counter()
            _build(tmp / "raw", tmp / f"cache_raw{rep}", tmp / "tok", args.threads, raw=True)
            raw_s.append(time.perf_counter() - t0)
        del texts
        b, o, r = statistics.median(base_s), statistics.median(ours_s), statistics.median(raw_s)
        paired = statistics.median(x / y for x, y in zip(base_s, ours_s, strict=True))
        print(f"text: {n_bytes / 1e6:.1f} MB in {n_docs} docs; {meta['train_tokens']:,} tokens; threads={args.threads}; "
              f"median of {args.reps}")  # fmt: skip
        print(f"tiktoken encode_ordinary_batch (in memory): {b:7.2f} s  {n_bytes / b / 1e6:6.1f} MB/s  runs {[round(x, 2) for x in base_s]}")
        print(f"build_pretrain_cache (snapshot -> shards):  {o:7.2f} s  {n_bytes / o / 1e6:6.1f} MB/s  runs {[round(x, 2) for x in ours_s]}")
        print(f"ratio (tiktoken time / cache build time):   {b / o:.2f}x of medians, {paired:.2f}x median of paired runs "
              "(target >= 0.85x)")  # fmt: skip
        print(f"same build through Python id lists (raw tiktoken encode_ordinary): {r:7.2f} s  ratio {b / r:.2f}x "
              "(the path before ids came as arrays)")  # fmt: skip
        if args.rss_mb:
            for p in tmp.glob("cache*"):
                subprocess.run(["rm", "-rf", str(p)], check=True)
            _write_snapshot(tmp / "raw_rss", args.rss_mb * 10**6, pool)
            rss_mb, wall = _child_peak_rss_mb(tmp / "raw_rss", tmp / "cache_rss", tmp / "tok", args.threads)
            print(f"peak RSS building a cache of {args.rss_mb} MB of text in a fresh process: {rss_mb:.0f} MB "
                  f"(build {wall:.1f} s incl. interpreter start)")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        torch.set_num_threads(1)
        _build(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
