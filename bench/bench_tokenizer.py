"""Benchmark: the whole tokenizer stage (read snapshots -> train -> save -> metrics) against a bare
rustbpe training call on the same text, in one process. Prints medians and their ratio (target
<= 1.2x). Not a test.

    .venv/bin/python bench/bench_tokenizer.py --raw data/raw --repeats 3

Snapshots missing under --raw are fetched first (untimed) into a temporary folder, from the
`fetch:` entries of --params.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for `stages._common` when run as a script

from lockstep.config import ConfigError  # noqa: E402
from lockstep.sources import SOURCE_CONFIGS, fetch_source  # noqa: E402
from lockstep.tokenizer.base import SPECIAL_TOKENS  # noqa: E402
from lockstep.tokenizer.bpe import SPLIT_PATTERN, TRAIN_BUFFER_TEXTS  # noqa: E402
from lockstep.tokenizer.pipeline import CappedTexts, TokenizerConfig, run_tokenizer_stage, snapshot_texts  # noqa: E402
from stages._common import load_params, section  # noqa: E402


def ensure_snapshots(params: dict, names: list[str], raw_dir: Path, tmp: Path) -> Path:
    if all((raw_dir / n / "meta.json").is_file() for n in names):
        return raw_dir
    fetched = tmp / "raw"
    for name in names:
        entry = (params.get("fetch") or {}).get(name)
        if not isinstance(entry, dict) or entry.get("source") not in SOURCE_CONFIGS:
            raise ConfigError(f"{name} is not under {raw_dir} and params has no usable fetch.{name} entry to build it")
        cfg = section(params, f"fetch.{name}", SOURCE_CONFIGS[entry["source"]])
        fetch_source(name, cfg, fetched / name, seed=params["seed"])
    return fetched


def scaled_snapshots(raw: Path, names: list[str], train_sources: list[str], copies: int, out: Path) -> Path:
    """A raw folder where each train source's train split holds its documents `copies` times over
    (val split unchanged) and other sources are copied as they are: the same stage on more text."""
    import shutil

    from lockstep.sources import iter_records, read_meta
    from lockstep.sources.snapshot import SnapshotWriter

    for name in names:
        if name not in train_sources:
            shutil.copytree(raw / name, out / name)
            continue
        meta = read_meta(raw / name)
        if meta["kind"] != "document":
            raise ConfigError(f"--copies scales document sources only; {name} holds {meta['kind']} records")
        sink = SnapshotWriter(out / name, kind="document")
        for c in range(copies):
            for i, r in enumerate(iter_records(raw / name, "train")):
                sink.add("train", {"text": r["text"]}, f"copy{c}/doc{i}")
        for i, r in enumerate(iter_records(raw / name, "val")):
            sink.add("val", {"text": r["text"]}, f"val{i}")
        sink.close(name=name, source=meta.get("source", name), config={}, seed=0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--raw", type=Path, default=ROOT / "data" / "raw")
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--verbose", action="store_true", help="log the stage phases")
    ap.add_argument("--copies", type=int, default=1,
                    help="train on each train source's documents this many times over (raise tokenizer.max_chars to match)")
    ap.add_argument("--freed", action="store_true",
                    help="also time the bare call on a list that only its iterator holds (freed inside the call)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("lockstep.tokenizer").setLevel(logging.INFO if args.verbose else logging.WARNING)
    logging.getLogger("rustbpe").setLevel(logging.WARNING)
    import rustbpe

    params = load_params(args.params)
    cfg = section(params, "tokenizer", TokenizerConfig)
    if cfg.kind != "bpe":
        raise ConfigError(f"the baseline is rustbpe training, so tokenizer.kind must be bpe (got {cfg.kind!r}); use -S-free params")
    names = list(dict.fromkeys(cfg.train_sources + cfg.metric_sources))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        raw = ensure_snapshots(params, names, args.raw, tmp)
        if args.copies > 1:
            raw = scaled_snapshots(raw, names, list(cfg.train_sources), args.copies, tmp / f"raw_x{args.copies}")
        def read_texts() -> CappedTexts:
            return CappedTexts((snapshot_texts(raw / n, "train") for n in cfg.train_sources), cfg.max_chars)

        capped = read_texts()
        list(capped)  # counts chars and texts for the summary line
        stage_s, bare_s = [], []

        def run_stage(r: int) -> dict:
            t0 = time.perf_counter()
            metrics = run_tokenizer_stage(cfg, raw, tmp / f"tok{r}", tmp / f"metrics{r}.json", seed=params["seed"])
            stage_s.append(time.perf_counter() - t0)
            return metrics

        freed_s: list[float] = []

        def train_bare(texts: Iterator[str], times: list[float]) -> rustbpe.Tokenizer:
            t0 = time.perf_counter()
            bare = rustbpe.Tokenizer()
            bare.train_from_iterator(
                texts, vocab_size=cfg.vocab_size - len(SPECIAL_TOKENS), buffer_size=TRAIN_BUFFER_TEXTS, pattern=SPLIT_PATTERN
            )
            times.append(time.perf_counter() - t0)
            return bare

        def run_freed() -> None:
            # The same call, the text list referenced only by the iterator handed to rustbpe, so
            # it is freed inside the call when the iterator runs out.
            train_bare(iter(list(read_texts())), freed_s)

        def run_bare() -> rustbpe.Tokenizer:
            # The baseline gets the stage's exact training text, read into memory afresh before
            # each run (untimed), as a script calling rustbpe has it and as the stage trains on
            # it. Training again and again on one list was sometimes faster here (390 against
            # 445 ms in one run), a warm effect no real run gets.
            texts = list(read_texts())  # held here through the call, as the stage holds its list
            return train_bare(iter(texts), bare_s)

        # One untimed run of each first: the stage's first call imports what it uses lazily
        # (parquet, the chat template), which a stage process pays at start-up, not here.
        run_stage(-1)
        run_bare()
        stage_s.clear()
        bare_s.clear()
        # Alternate which runs first so a drift in machine load hits both sides alike.
        for r in range(args.repeats):
            if r % 2 == 0:
                metrics = run_stage(r)
                bare = run_bare()
            else:
                bare = run_bare()
                metrics = run_stage(r)
            if args.freed:
                run_freed()
        assert bare.vocab_size + len(SPECIAL_TOKENS) == metrics["vocab_size"]
    stage_med, bare_med = statistics.median(stage_s), statistics.median(bare_s)
    print(f"corpus: {capped.chars:,} chars in {capped.texts:,} texts from {', '.join(cfg.train_sources)}; vocab {cfg.vocab_size}")
    print(f"tokenizer stage (read + train + save + metrics): median {stage_med:.3f}s  runs {[round(s, 3) for s in stage_s]}")
    print(f"bare rustbpe train_from_iterator:               median {bare_med:.3f}s  runs {[round(s, 3) for s in bare_s]}")
    if freed_s:
        freed_med = statistics.median(freed_s)
        print(f"bare call, text list freed inside the call:     median {freed_med:.3f}s  runs {[round(s, 3) for s in freed_s]} "
              f"({freed_med / bare_med:.2f}x of bare)")
    pair_ratio = statistics.median(s / b for s, b in zip(stage_s, bare_s, strict=True))
    print(f"ratio stage/bare: {stage_med / bare_med:.2f}x of medians, {pair_ratio:.2f}x median of paired runs (target <= 1.20x)")


if __name__ == "__main__":
    main()
