"""Benchmark: the compiled LZ78 core against the BPE pair it competes with, and the dictionary
reader and decoder at scale, and what portable dictionaries cost. Not a test. Three modes:

    .venv/bin/python bench/bench_lz78.py train-encode --raw data/raw --tokenizer data/tokenizer --repeats 5
    .venv/bin/python bench/bench_lz78.py scale --lines 10000000 --baseline-lines 1000000 --decode-mb 50
    .venv/bin/python bench/bench_lz78.py portable --train A.txt B.txt --held-out C.txt D.txt

`train-encode` (the default), on the tiny preset's tokenizer training text (the train splits of
the shakespeare and roam snapshots, read only):
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

`scale` writes a generated `lz78`-layout dictionary of --lines lines to a temporary folder (a
random trie: each code a random earlier code plus one of 58 ASCII or 6 two-byte characters, so
the file lacks some byte prefixes, as character-level dictionaries do) and, each in a fresh
process after numba has compiled on a tiny file:
- loading: `from_dictionary` plus the first `encode` (which builds the encoder's
  table), wall time and peak resident size (targets: 10M lines under 60 s and 2 GB); the
  baseline is the plain reader (`fast=False`) on a --baseline-lines file, timed against the fast
  one on the same file.
- decoding: `decode` of the ids of --decode-mb MB of text (a list, as `encode` returns them) with
  a tokenizer trained on the text's first 4 MB at --vocab-size: MB/s of UTF-8 output and the peak
  resident size it adds per output byte (targets: >= 50 MB/s, O(output) memory); the baseline
  is the plain decoder (`fast=False`) on the same ids in the same process. The text is --text
  repeated (default: tiny Shakespeare beside the checkout, else generated words).

`portable` trains byte-level and portable (`portable=True`: whole characters, documents cut at
tabs and line breaks) dictionaries at --vocab-size on the --train files, each file split into
paragraphs (blank lines) as documents, for every strategy, and prints the tokens per byte of
greedy encoding on each --held-out file (read whole, as one document), and how many lines of
each dictionary's `lz78` export go below `# escaped:` and how many tokens the reference reads
with other bytes. Defaults: English prose beside the checkout (tiny Shakespeare and News from
Nowhere to train; Alice in Wonderland and the WikiText-2 test text held out).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import rustbpe

from lockstep.data.snapshot import iter_records
from lockstep.tokenizer import SPECIAL_TOKENS, load_tokenizer
from lockstep.tokenizer.bpe import SPLIT_PATTERN
from lockstep.tokenizer.bpe_train import TRAIN_BUFFER_TEXTS
from lockstep.tokenizer.lz78.train import STRATEGIES, train_lz78
from lockstep.tokenizer.lz78.trie import encode_batch
from lockstep.tokenizer.lz78.tsv import ESCAPED_MARKER, unescape_field, write_lz78_tsv

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


def train_encode(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="bench_lz78.py train-encode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--raw", type=Path, default=ROOT / "data" / "raw")
    ap.add_argument("--tokenizer", type=Path, default=ROOT / "data" / "tokenizer", help="a bpe tokenizer-stage output")
    ap.add_argument("--sources", nargs="+", default=["shakespeare", "roam"])
    ap.add_argument("--max-chars", type=int, default=20_000_000, help="the tiny preset's tokenizer.max_chars")
    ap.add_argument("--vocab-size", type=int, default=4096, help="total vocabulary, as tokenizer.vocab_size")
    ap.add_argument(
        "--strategy", choices=STRATEGIES, default="standard", help="the LZ78 strategy timed against rustbpe"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

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
    print(f"text: {n_bytes:,} UTF-8 bytes in {len(texts):,} texts from {', '.join(args.sources)}; "
          f"vocab {args.vocab_size} (LZ78: {max_codes} codes, {trie.n_codes} learnt, strategy {args.strategy}); "
          f"{args.repeats} runs a side")
    print(f"training  rustbpe {med['train_rustbpe']:.3f}s  lz78 {med['train_lz78']:.3f}s  "
          f"ratio lz78/rustbpe {med['train_lz78'] / med['train_rustbpe']:.2f}x (target <= 1.00x)")
    print(f"encoding  tiktoken {mb / med['enc_tiktoken']:.1f} MB/s  lz78 {mb / med['enc_lz78']:.1f} MB/s  "
          f"({args.threads} threads)  ratio lz78/tiktoken {med['enc_tiktoken'] / med['enc_lz78']:.2f}x "
          "(target >= 1.00x)")
    print(f"bytes/token on the training text: bpe {n_bytes / bpe_tokens:.2f}  lz78 {n_bytes / lz_tokens:.2f}")


# --- scale: the dictionary reader and the decoder ---------------------------------------------------

# 58 one-byte and 6 two-byte characters a generated code may add to its parent.
ALPHABET = [*"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456", *"éüñçøå"]


def generate_dictionary(path: Path, lines: int, seed: int = 0) -> None:
    """An lz78-layout file of `lines` codes 1..lines in creation order: code c a uniformly random
    earlier code (or the root) plus a character its parent has not used yet."""
    import numpy as np
    from numba import njit

    rng = np.random.default_rng(seed)
    codes = np.arange(1, lines + 1)
    parent = (rng.random(lines) * codes).astype(np.int64)  # uniform in 0..c-1
    while True:  # each child of a node gets the next unused character; more children than characters move on
        order = np.argsort(parent, kind="stable")
        starts = np.searchsorted(parent[order], parent[order])
        rank = np.empty(lines, np.int64)
        rank[order] = np.arange(lines) - starts
        over = np.flatnonzero(rank >= len(ALPHABET))
        if not over.size:
            break
        parent[over] = codes[over] - 1
    # A random rotation of the characters per parent, so the two-byte ones come up everywhere.
    rank = (rank + rng.integers(0, len(ALPHABET), lines + 1)[parent]) % len(ALPHABET)
    encoded = [ch.encode() for ch in ALPHABET]
    char_bytes = np.frombuffer(b"".join(encoded), np.uint8)
    char_start = np.concatenate([[0], np.cumsum([len(e) for e in encoded])]).astype(np.int64)

    @njit
    def write(parent, rank, char_bytes, char_start):  # each line: code, parent, char, pattern
        n = parent.shape[0]
        plen = np.zeros(n + 1, np.int64)
        for c in range(1, n + 1):
            plen[c] = plen[parent[c - 1]] + char_start[rank[c - 1] + 1] - char_start[rank[c - 1]]
        pstart = np.zeros(n + 2, np.int64)
        pstart[1:] = np.cumsum(plen)
        patterns = np.empty(pstart[-1], np.uint8)
        out = np.empty(pstart[-1] * 2 + n * 48, np.uint8)
        t = 0
        for c in range(1, n + 1):
            p = parent[c - 1]
            a, b = char_start[rank[c - 1]], char_start[rank[c - 1] + 1]
            patterns[pstart[c]:pstart[c] + plen[p]] = patterns[pstart[p]:pstart[p] + plen[p]]
            patterns[pstart[c] + plen[p]:pstart[c] + plen[c]] = char_bytes[a:b]
            for number in (c, p):
                digits = np.empty(20, np.uint8)
                k = 0
                while True:
                    digits[k] = 48 + number % 10
                    number //= 10
                    k += 1
                    if number == 0:
                        break
                for i in range(k):
                    out[t] = digits[k - 1 - i]
                    t += 1
                out[t] = 9
                t += 1
            out[t:t + b - a] = char_bytes[a:b]
            t += b - a
            out[t] = 9
            t += 1
            out[t:t + plen[c]] = patterns[pstart[c]:pstart[c] + plen[c]]
            t += plen[c]
            out[t] = 10
            t += 1
        return out[:t]

    write(parent, rank, char_bytes, char_start).tofile(path)


def default_text() -> str:
    shakespeare = ROOT.parent / "shared" / "fixtures" / "tinyshakespeare" / "input.txt"
    if shakespeare.is_file():
        return shakespeare.read_text(encoding="utf-8")
    import numpy as np

    words = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
    rng = np.random.default_rng(0)
    return " ".join(words[i] for i in rng.integers(0, len(words), 200_000)) + "\n"


def status(field: str) -> int:
    """A size from /proc/self/status (VmRSS now, VmHWM the peak), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak() -> int:
    """Set the peak resident size back to the current one (so numba's compilation, which peaks
    high, does not hide what follows); returns the current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


def child(kind: str, *args: str) -> dict:
    """Run one measurement in a fresh interpreter (this script, `_child`), return its JSON."""
    out = subprocess.run([sys.executable, __file__, "_child", kind, *args], capture_output=True, text=True, check=False)
    if out.returncode:
        sys.exit(f"the {kind} measurement failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_child(kind: str, args: list[str]) -> None:
    import numpy as np

    from lockstep.tokenizer import load_tokenizer
    from lockstep.tokenizer.lz78.train import from_dictionary

    facts: dict = {}
    if kind == "load":
        path, fast, warm = Path(args[0]), args[1] == "fast", Path(args[2])
        t0 = time.perf_counter()
        from_dictionary(warm, fast=fast).encode("warm up")
        facts["compile_s"] = time.perf_counter() - t0
        base = reset_peak()
        t0 = time.perf_counter()
        tok = from_dictionary(path, fast=fast)
        facts["load_s"] = time.perf_counter() - t0
        tok.encode("the first encode builds the encoder's table")
        facts["load_encode_s"] = time.perf_counter() - t0
        facts.update(n_codes=tok.n_codes, n_nodes=tok.trie.n_nodes, growth=status("VmHWM") - base,
                     process_peak=status("VmHWM"), interpreter=base)
    elif kind == "decode":
        tok = load_tokenizer(Path(args[0]))
        ids = np.load(args[1]).tolist()  # a list of ints, as encode returns it
        out_bytes = int(args[2])
        tok.decode(ids[:1000])  # compile
        for name, fast in (("fast", True), ("plain", False)):
            tok.fast = fast
            base = reset_peak()
            t0 = time.perf_counter()
            text = tok.decode(ids)
            facts[f"{name}_s"] = time.perf_counter() - t0
            facts[f"{name}_growth"] = status("VmHWM") - base
            assert len(text.encode()) == out_bytes
            del text
    print(json.dumps(facts))


def scale(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="bench_lz78.py scale", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=10_000_000, help="lines of the big generated dictionary")
    ap.add_argument("--baseline-lines", type=int, default=1_000_000, help="lines of the file both readers read")
    ap.add_argument("--decode-mb", type=float, default=50.0, help="MB of text decoded")
    ap.add_argument("--vocab-size", type=int, default=32768, help="vocabulary of the tokenizer that decodes")
    ap.add_argument("--text", type=Path, help="text repeated to --decode-mb (default: tiny Shakespeare or words)")
    args = ap.parse_args(argv)
    if not Path("/proc/self/clear_refs").exists():
        sys.exit("the scale benchmark reads peak memory from Linux /proc")
    import numpy as np

    from lockstep.tokenizer.lz78.train import train as train_lz78_tokenizer

    gb = 1024**3
    with tempfile.TemporaryDirectory(prefix="bench_lz78_") as tmp:
        tmp_dir = Path(tmp)
        warm = tmp_dir / "warm.tsv"
        warm.write_text("1\t0\ta\ta\n2\t1\té\taé\n", encoding="utf-8")
        t0 = time.perf_counter()
        for lines in sorted({args.lines, args.baseline_lines}):
            generate_dictionary(tmp_dir / f"{lines}.tsv", lines)
        print(
            f"generated {args.lines:,} and {args.baseline_lines:,}-line dictionaries in {time.perf_counter() - t0:.1f}s"
        )

        big = child("load", str(tmp_dir / f"{args.lines}.tsv"), "fast", str(warm))
        size = (tmp_dir / f"{args.lines}.tsv").stat().st_size
        print(
            f"load {args.lines:,} lines ({size / 1e6:.0f} MB; {big['n_codes']:,} codes, "
            f"{big['n_nodes'] - big['n_codes']:,} prefix nodes), fast: {big['load_s']:.1f}s, "
            f"{big['load_encode_s']:.1f}s with the first encode (target < 60s); peak {big['process_peak'] / gb:.2f} GB "
            f"(target < 2 GB), {big['growth'] / gb:.2f} GB above the {big['interpreter'] / gb:.2f} GB interpreter, "
            f"{big['growth'] / args.lines:.0f} bytes a line; numba compilation before it {big['compile_s']:.1f}s"
        )
        fast = child("load", str(tmp_dir / f"{args.baseline_lines}.tsv"), "fast", str(warm))
        plain = child("load", str(tmp_dir / f"{args.baseline_lines}.tsv"), "plain", str(warm))
        print(f"load {args.baseline_lines:,} lines: fast {fast['load_encode_s']:.2f}s "
              f"{fast['growth'] / args.baseline_lines:.0f} bytes a line, plain (baseline) "
              f"{plain['load_encode_s']:.2f}s {plain['growth'] / args.baseline_lines:.0f} bytes a line; "
              f"ratio plain/fast {plain['load_encode_s'] / fast['load_encode_s']:.1f}x time, "
              f"{plain['growth'] / fast['growth']:.1f}x memory")

        source = args.text.read_text(encoding="utf-8") if args.text else default_text()
        text = source * max(1, int(args.decode_mb * 1e6 / len(source.encode())))
        tok = train_lz78_tokenizer([source[:4_000_000]], vocab_size=args.vocab_size)
        tok.save(tmp_dir / "tok")
        ids = np.array(tok.encode(text), np.int32)
        np.save(tmp_dir / "ids.npy", ids)
        out_bytes = len(text.encode())
        del text
        dec = child("decode", str(tmp_dir / "tok"), str(tmp_dir / "ids.npy"), str(out_bytes))
        mb = out_bytes / 1e6
        print(f"decode {mb:.1f} MB from {ids.size:,} ids (a list; vocab {args.vocab_size}): "
              f"fast {mb / dec['fast_s']:.0f} MB/s (target >= 50), +{dec['fast_growth'] / 1e6:.0f} MB = "
              f"{dec['fast_growth'] / out_bytes:.1f} bytes per output byte; plain (baseline) "
              f"{mb / dec['plain_s']:.1f} MB/s, {dec['plain_growth'] / out_bytes:.1f} bytes per output byte; "
              f"ratio fast/plain {dec['plain_s'] / dec['fast_s']:.1f}x speed")


# --- portable: what whole-character dictionaries cost in compression ---------------------------------

FIXTURES = ROOT.parent / "shared" / "fixtures"


def export_misreads(trie: object, folder: Path) -> tuple[int, int]:
    """(lines of the trie's `lz78` export below `# escaped:`, tokens the reference reads with other
    bytes): it reads the escaped pattern field literally, so a pattern misreads when its escaped
    form is not its bytes."""
    path = folder / "export.tsv"
    write_lz78_tsv(path, trie)
    lines = path.read_bytes().split(b"\n")
    marker = next((i for i, line in enumerate(lines) if line.startswith(ESCAPED_MARKER.encode())), len(lines))
    below = [line.split(b"\t")[-1] for line in lines[marker + 1:] if line]
    return len(below), sum(unescape_field(field.decode("utf-8")) != field for field in below)


def portable(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="bench_lz78.py portable", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=Path, nargs="+", default=[
        FIXTURES / "tinyshakespeare" / "input.txt", FIXTURES / "gutenberg" / "pg3261_news_from_nowhere.txt"])
    ap.add_argument("--held-out", type=Path, nargs="+", default=[
        FIXTURES / "gutenberg" / "pg11_alice.txt", FIXTURES / "wikitext-2-raw" / "wiki.test.raw"])
    ap.add_argument("--vocab-size", type=int, default=4096, help="total vocabulary, as tokenizer.vocab_size")
    args = ap.parse_args(argv)

    docs = [p.encode("utf-8") for path in args.train for p in path.read_text(encoding="utf-8").split("\n\n") if p]
    held = {path.name: path.read_bytes() for path in args.held_out}
    max_codes = args.vocab_size - 1 - 256 - len(SPECIAL_TOKENS)
    print(f"train: {sum(map(len, docs)):,} bytes in {len(docs):,} paragraphs of "
          f"{', '.join(p.name for p in args.train)}; vocab {args.vocab_size} ({max_codes} codes)")
    print(f"held out: {', '.join(f'{name} ({len(data):,} bytes)' for name, data in held.items())}")
    print("strategy         dictionary  " + "  ".join(f"{name[:18]:>18}" for name in held)
          + "  escaped lines  misread tokens")
    logging.getLogger("lockstep.tokenizer").setLevel(logging.ERROR)  # the export's warning: counted below instead
    with tempfile.TemporaryDirectory(prefix="bench_lz78_") as tmp:
        for strategy in STRATEGIES:
            per = {}
            for is_portable in (False, True):
                trie = train_lz78(docs, max_codes, strategy=strategy, portable=is_portable, fast=True).trie
                tpb = {name: sum(map(len, encode_batch(trie, [data], fast=True))) / len(data)
                       for name, data in held.items()}
                per[is_portable] = tpb
                escaped, misread = export_misreads(trie, Path(tmp))
                print(f"{strategy:16} {'portable' if is_portable else 'bytes':10}  "
                      + "  ".join(f"{tpb[name]:18.4f}" for name in held) + f"  {escaped:13,}  {misread:14,}")
            print(f"{'':16} {'ratio':10}  " + "  ".join(f"{per[True][n] / per[False][n]:17.3f}x" for n in held))
    print(f"(tokens per byte of greedy encoding, lower is better; escaped: lines below `{ESCAPED_MARKER}`)")


def main() -> None:
    modes = {"train-encode": train_encode, "scale": scale, "portable": portable}
    argv = sys.argv[1:]
    if argv[:1] == ["_child"]:
        run_child(argv[1], argv[2:])
    elif argv[:1] and argv[0] in modes:
        modes[argv[0]](argv[1:])
    else:
        train_encode(argv)


if __name__ == "__main__":
    main()
