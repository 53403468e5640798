"""Benchmark: the compiled LZ78 core against the BPE pair it competes with, on the tiny preset's
tokenizer training text (the train splits of the shakespeare and roam snapshots, read only).
Not a test.

    .venv/bin/python bench/bench_lz78.py --raw data/raw --tokenizer data/tokenizer --repeats 5

- training: `train_lz78(..., fast=True)` to the dictionary budget of a --vocab-size LZ78
  vocabulary (vocab - root - 256 byte fallbacks - 9 specials), against a bare rustbpe
  `train_from_iterator` call at --vocab-size as the bpe kind makes it (target <= 1.0x). The LZ78
  side's time includes UTF-8 encoding the text and the final use count.
- encoding: MB/s of UTF-8 bytes, --threads threads, `encode_batch(..., fast=True)` with that
  dictionary (UTF-8 encoding included) against tiktoken's `encode_ordinary_batch` with the
  tokenizer-stage bpe vocabulary in --tokenizer (target >= 1.0x).

Both sides run in this process, alternating, medians over --repeats; numba's compilation runs
once before any clock starts and is printed on its own. Each ratio is a ratio of medians from
this one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import rustbpe

from lockstep.snapshot import iter_records
from lockstep.tokenizer import SPECIAL_TOKENS, load_tokenizer
from lockstep.tokenizer.bpe import SPLIT_PATTERN, TRAIN_BUFFER_TEXTS
from lockstep.tokenizer.lz78_trie import STRATEGIES, encode_batch, train_lz78

ROOT = Path(__file__).resolve().parents[1]


def read_texts(raw: Path, sources: list[str], max_chars: int) -> list[str]:
    """The train splits of `sources` in order, cut at max_chars as the tokenizer stage cuts them."""
    texts, chars = [], 0
    for name in sources:
        for record in iter_records(raw / name, "train", columns=["text"]):
            text = record["text"][: max_chars - chars]
            texts.append(text)
            chars += len(text)
            if chars >= max_chars:
                return texts
    return texts


def time_rustbpe(texts: list[str], vocab_size: int) -> float:
    t0 = time.perf_counter()
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(texts), vocab_size=vocab_size - len(SPECIAL_TOKENS),
                                buffer_size=TRAIN_BUFFER_TEXTS, pattern=SPLIT_PATTERN)
    return time.perf_counter() - t0


def time_lz78_train(texts: list[str], max_codes: int, strategy: str) -> tuple[float, object]:
    t0 = time.perf_counter()
    trained = train_lz78([t.encode("utf-8") for t in texts], max_codes, strategy=strategy, fast=True)
    return time.perf_counter() - t0, trained


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--raw", type=Path, default=ROOT / "data" / "raw")
    ap.add_argument("--tokenizer", type=Path, default=ROOT / "data" / "tokenizer", help="a bpe tokenizer-stage output")
    ap.add_argument("--sources", nargs="+", default=["shakespeare", "roam"])
    ap.add_argument("--max-chars", type=int, default=20_000_000, help="the tiny preset's tokenizer.max_chars")
    ap.add_argument("--vocab-size", type=int, default=4096, help="total vocabulary, as tokenizer.vocab_size")
    ap.add_argument("--strategy", choices=STRATEGIES, default="standard", help="the LZ78 strategy timed against rustbpe")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    texts = read_texts(args.raw, args.sources, args.max_chars)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    max_codes = args.vocab_size - 1 - 256 - len(SPECIAL_TOKENS)
    bpe = load_tokenizer(args.tokenizer)
    if bpe.kind != "bpe":
        sys.exit(f"{args.tokenizer} holds a {bpe.kind} tokenizer; the encoding baseline needs the bpe kind")
    enc = bpe._enc  # the tokenizer's own tiktoken Encoding: the baseline is tiktoken's call itself

    t0 = time.perf_counter()
    time_lz78_train(texts[:2], 8, args.strategy)
    train_lz78([b"ab"], 8, strategy="frequency_gated", fast=True)
    print(f"numba compilation (untimed below): {time.perf_counter() - t0:.2f}s")
    enc.encode_ordinary_batch(texts[:64], num_threads=args.threads)

    train_s: dict[str, list[float]] = {"rustbpe": [], "lz78": []}
    enc_s: dict[str, list[float]] = {"tiktoken": [], "lz78": []}
    trie = None
    for r in range(args.repeats):
        # Alternate which side goes first so drift in machine load hits both alike.
        for side in (["rustbpe", "lz78"] if r % 2 == 0 else ["lz78", "rustbpe"]):
            if side == "rustbpe":
                train_s[side].append(time_rustbpe(texts, args.vocab_size))
            else:
                seconds, trained = time_lz78_train(texts, max_codes, args.strategy)
                train_s[side].append(seconds)
                trie = trained.trie
        for side in (["tiktoken", "lz78"] if r % 2 == 0 else ["lz78", "tiktoken"]):
            t0 = time.perf_counter()
            if side == "tiktoken":
                enc.encode_ordinary_batch(texts, num_threads=args.threads)
            else:
                encode_batch(trie, [t.encode("utf-8") for t in texts], num_threads=args.threads, fast=True)
            enc_s[side].append(time.perf_counter() - t0)

    med = {k: statistics.median(v) for k, v in {**{f"train_{k}": v for k, v in train_s.items()},
                                                **{f"enc_{k}": v for k, v in enc_s.items()}}.items()}
    lz_tokens = sum(map(len, encode_batch(trie, [t.encode("utf-8") for t in texts], fast=True)))
    bpe_tokens = sum(map(len, enc.encode_ordinary_batch(texts, num_threads=args.threads)))
    mb = n_bytes / 1e6
    print(f"text: {n_bytes:,} UTF-8 bytes in {len(texts):,} texts from {', '.join(args.sources)}; vocab {args.vocab_size} "
          f"(LZ78: {max_codes} codes, {trie.n_codes} learnt, strategy {args.strategy}); {args.repeats} runs a side")
    print(f"training  rustbpe {med['train_rustbpe']:.3f}s  lz78 {med['train_lz78']:.3f}s  "
          f"ratio lz78/rustbpe {med['train_lz78'] / med['train_rustbpe']:.2f}x (target <= 1.00x)")
    print(f"encoding  tiktoken {mb / med['enc_tiktoken']:.1f} MB/s  lz78 {mb / med['enc_lz78']:.1f} MB/s  ({args.threads} threads)  "
          f"ratio lz78/tiktoken {med['enc_tiktoken'] / med['enc_lz78']:.2f}x (target >= 1.00x)")
    print(f"bytes/token on the training text: bpe {n_bytes / bpe_tokens:.2f}  lz78 {n_bytes / lz_tokens:.2f}")


if __name__ == "__main__":
    main()
