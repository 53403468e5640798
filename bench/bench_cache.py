"""Benchmark: pretrain cache build end to end (read raw snapshot -> encode -> write shards) against
raw tiktoken `encode_ordinary_batch` over the same text held in memory, with the same threads, and
the peak RSS of a build. Each timed side runs in a fresh process, alternating: a tiktoken Encoding's
speed depends on which threads used it before (its regex match state favours its first user), so
sides that share one process measure each other's history. Generated text; not a test."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lockstep.cache_build import CacheConfig, build_pretrain_cache
from lockstep.sources import iter_records
from lockstep.snapshot import SnapshotWriter
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


class _ListsOnly:
    """The lockstep tokenizer with its array path hidden: the cache build then takes its id-list
    path (Python int lists), for comparison."""

    encode_arrays = None

    def __init__(self, tok) -> None:
        self.tok = tok

    def __getattr__(self, name):
        return getattr(self.tok, name)


def _child(side: str, snapshot: Path, out: Path, tok_dir: Path, threads: int) -> dict:
    """One timed side, in this (fresh) process. Loading the tokenizer and, for the tiktoken side,
    reading the text into memory are not timed."""
    tok = load_tokenizer(tok_dir)
    cfg = CacheConfig(kind="pretrain")
    if side == "tiktoken":
        texts = [r["text"] for r in iter_records(snapshot, "train")]
        enc, batch = tok._enc, cfg.encode_batch_docs  # the tiktoken Encoding behind the bpe kind
        t0 = time.perf_counter()
        n = 0
        for i in range(0, len(texts), batch):
            n += sum(map(len, enc.encode_ordinary_batch(texts[i : i + batch], num_threads=threads)))
        return {"seconds": time.perf_counter() - t0, "tokens": n, "bytes": sum(len(t.encode("utf-8")) for t in texts)}
    t0 = time.perf_counter()
    meta = build_pretrain_cache(
        {"train": (r["text"] for r in iter_records(snapshot, "train")), "val": iter(())},
        out, tokenizer=_ListsOnly(tok) if side == "lists" else tok, max_train_tokens=None, max_val_tokens=None,
        shard_bytes=cfg.shard_bytes, seed=0, shuffle_buffer=cfg.shuffle_buffer,
        encode_batch_docs=cfg.encode_batch_docs, num_threads=threads,
    )  # fmt: skip
    return {"seconds": time.perf_counter() - t0, "tokens": meta["train_tokens"] - meta["train_docs"]}


def _run_child(side: str, snapshot: Path, out: Path, tok_dir: Path, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--child", side, str(snapshot), str(out), str(tok_dir), str(threads)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=64, help="MB of text for the throughput comparison")
    ap.add_argument("--rss-mb", type=int, default=0, help="MB of text for the peak-RSS build (0: skip)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lists", action="store_true", help="also time the build through Python id lists")
    args = ap.parse_args()
    pool = _doc_pool(600, 4000, seed=0)
    with tempfile.TemporaryDirectory(prefix="bench_cache.") as tmp:
        tmp = Path(tmp)
        train_tokenizer("bpe", pool[:300], vocab_size=4096).save(tmp / "tok")
        n_docs = _write_snapshot(tmp / "raw", args.mb * 10**6, pool)
        side_args = (tmp / "raw", tmp / "cache", tmp / "tok", args.threads)
        base_s, ours_s, lists_s = [], [], []
        for rep in range(args.reps):
            # Alternate which runs first so a drift in machine load hits both sides alike.
            for side in ("tiktoken", "build") if rep % 2 == 0 else ("build", "tiktoken"):
                r = _run_child(side, *side_args)
                if side == "tiktoken":
                    base_s.append(r["seconds"])
                    n_bytes, base_tokens = r["bytes"], r["tokens"]
                else:
                    ours_s.append(r["seconds"])
                    assert r["tokens"] == base_tokens, (r["tokens"], base_tokens)  # the same ids, BOS aside
            if args.lists:
                lists_s.append(_run_child("lists", *side_args)["seconds"])
        b, o = statistics.median(base_s), statistics.median(ours_s)
        paired = statistics.median(x / y for x, y in zip(base_s, ours_s, strict=True))
        print(f"text: {n_bytes / 1e6:.1f} MB in {n_docs} docs; {base_tokens:,} tokens; threads={args.threads}; "
              f"median of {args.reps}, each side in a fresh process")  # fmt: skip
        print(f"tiktoken encode_ordinary_batch (in memory): {b:7.2f} s  {n_bytes / b / 1e6:6.1f} MB/s  runs {[round(x, 2) for x in base_s]}")
        print(f"build_pretrain_cache (snapshot -> shards):  {o:7.2f} s  {n_bytes / o / 1e6:6.1f} MB/s  runs {[round(x, 2) for x in ours_s]}")
        print(f"ratio (tiktoken time / cache build time):   {b / o:.2f}x of medians, {paired:.2f}x median of paired runs "
              "(target >= 0.85x)")  # fmt: skip
        if lists_s:
            r = statistics.median(lists_s)
            print(f"same build through Python id lists:          {r:7.2f} s  ratio {b / r:.2f}x "
                  "(ids as Python int lists instead of arrays)")  # fmt: skip
        if args.rss_mb:
            _write_snapshot(tmp / "raw_rss", args.rss_mb * 10**6, pool)
            t0 = time.perf_counter()
            _run_child("build", tmp / "raw_rss", tmp / "cache_rss", tmp / "tok", args.threads)
            wall = time.perf_counter() - t0
            rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
            print(f"peak RSS of a process building a cache of {args.rss_mb} MB of text: {rss_mb:.0f} MB "
                  f"(build {wall:.1f} s incl. interpreter start)")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        torch.set_num_threads(1)
        side, snapshot, out, tok_dir, threads = sys.argv[2:7]
        print(json.dumps(_child(side, Path(snapshot), Path(out), Path(tok_dir), int(threads))))
    else:
        main()
