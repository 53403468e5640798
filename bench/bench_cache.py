"""Benchmark: pretrain cache build end to end (read raw snapshot -> encode -> write shards) against
raw tiktoken `encode_ordinary_batch` over the same text held in memory, with the same threads, and
the peak RSS of a build. Each timed side runs in a fresh process, alternating: a tiktoken Encoding's
speed depends on which threads used it before (its regex match state favours its first user), so
sides that share one process measure each other's history. Generated text; not a test.

`--open-check` measures instead what the readers' value-range check (ids < vocab_size, mask bytes
0/1) adds to opening a cache: open_pretrain_split on one shard of `--shard-mb` MB of random ids,
with the check against the same open with the check left out, alternating in one process."""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import lockstep.data.cache as cache
from lockstep.core.io import sha256_file, write_json
from lockstep.data.cache import DEFAULT_SHARD_BYTES, open_pretrain_split
from lockstep.data.cache_build import CacheConfig, build_pretrain_cache
from lockstep.data.snapshot import SnapshotWriter
from lockstep.data.sources import iter_records
from lockstep.tokenizer import load_tokenizer
from lockstep.tokenizer.kinds import train_tokenizer

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


def _write_shard_cache(root: Path, shard_mb: int, vocab_size: int) -> int:
    """A pretrain cache of one train shard of random uint16 ids below `vocab_size`, written
    directly (no tokenizer): what a reader opens. Returns its token count."""
    n_tokens = shard_mb * 2**20 // 2
    ids = np.random.default_rng(0).integers(0, vocab_size, n_tokens, dtype=np.uint16)
    (root / "train").mkdir(parents=True)
    (root / "val").mkdir()
    shard = root / "train" / "shard_00000.bin"
    ids.tofile(shard)
    write_json(root / "meta.json", {
        "format_version": cache.FORMAT_VERSION, "kind": "pretrain", "token_dtype": "uint16",
        "tokenizer_sha256": "0" * 64, "vocab_size": vocab_size, "train_tokens": n_tokens, "val_tokens": 0,
        "shards": {"train": [{"name": shard.name, "tokens": n_tokens, "sha256": sha256_file(shard)}], "val": []},
    })  # fmt: skip
    return n_tokens


@contextlib.contextmanager
def _without_value_check():
    saved = cache._check_values
    cache._check_values = lambda *a, **k: None
    try:
        yield
    finally:
        cache._check_values = saved


def open_check(shard_mb: int, reps: int) -> None:
    """Median time of open_pretrain_split (sha256 and value check) against the same open without
    the value check, alternating sides; the file is read once first, so both read the page cache."""
    with tempfile.TemporaryDirectory(prefix="bench_cache_open.") as tmp:
        root = Path(tmp) / "cache"
        n_tokens = _write_shard_cache(root, shard_mb, vocab_size=50_257)
        open_pretrain_split(root / "train")  # warm the page cache
        plain_s, checked_s = [], []
        for rep in range(reps):
            for side in ("plain", "checked") if rep % 2 == 0 else ("checked", "plain"):
                with _without_value_check() if side == "plain" else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    split = open_pretrain_split(root / "train")
                    (plain_s if side == "plain" else checked_s).append(time.perf_counter() - t0)
                assert split.tokens == n_tokens
        p, c = statistics.median(plain_s), statistics.median(checked_s)
        paired = statistics.median(y / x for x, y in zip(plain_s, checked_s, strict=True))
        print(
            f"one shard of {shard_mb} MB ({n_tokens:,} uint16 ids), open_pretrain_split(verify=True), median of {reps}:"
        )
        print(f"without the value check (sha256 only): {p * 1e3:7.1f} ms  runs {[round(x * 1e3) for x in plain_s]}")
        print(f"with the value check:                  {c * 1e3:7.1f} ms  runs {[round(x * 1e3) for x in checked_s]}")
        print(f"ratio (with / without): {c / p:.3f}x of medians, {paired:.3f}x median of paired runs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=64, help="MB of text for the throughput comparison")
    ap.add_argument("--rss-mb", type=int, default=0, help="MB of text for the peak-RSS build (0: skip)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lists", action="store_true", help="also time the build through Python id lists")
    ap.add_argument("--open-check", action="store_true", help="time the readers' value check instead (see above)")
    ap.add_argument("--shard-mb", type=int, default=DEFAULT_SHARD_BYTES // 2**20, help="shard size for --open-check")
    args = ap.parse_args()
    if args.open_check:
        open_check(args.shard_mb, args.reps)
        return
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
        print(f"tiktoken encode_ordinary_batch (in memory): {b:7.2f} s  {n_bytes / b / 1e6:6.1f} MB/s  "
              f"runs {[round(x, 2) for x in base_s]}")  # fmt: skip
        print(f"build_pretrain_cache (snapshot -> shards):  {o:7.2f} s  {n_bytes / o / 1e6:6.1f} MB/s  "
              f"runs {[round(x, 2) for x in ours_s]}")  # fmt: skip
        print(f"ratio (tiktoken time / cache build time):   {b / o:.2f}x of medians, {paired:.2f}x median of paired "
              "runs (target >= 0.85x)")  # fmt: skip
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
