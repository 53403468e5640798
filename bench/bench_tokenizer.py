"""Benchmark: the whole tokenizer stage (read snapshots -> train -> save -> metrics) against a bare
rustbpe training call on the same text. Prints medians and their ratio (target <= 1.2x). Not a
test.

    .venv/bin/python bench/bench_tokenizer.py --raw data/raw --repeats 15

Each timed run is a fresh process, the two sides alternating, as the stage itself runs: how fast
rustbpe trains depends on the process's heap history (a text list freed inside the call made it
1.13x slower, see --freed), so runs that share one process time each other's leftovers (the
ratio drifted between 1.13x and 1.28x from one in-process run to the next). Fresh processes pay
first-touch costs on both sides and drift too, with the machine's state, and rustbpe's own time
moves by several percent with what the process allocated before the call (on --copies 4, 1.39 s
inside the stage's process against 1.28 s in the bare one, same text). Compare ratios from one
run only, or from runs interleaved in one window (two code versions: alternate their runs).
Modules that either side imports are imported before its clock starts; reading the bare call's
text is not timed.

Snapshots missing under --raw are fetched first (untimed) into a temporary folder, from the
`fetch:` entries of --params.
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
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for `stages._common` when run as a script

from lockstep.core.config import ConfigError  # noqa: E402
from lockstep.data.sources import SOURCE_CONFIGS, fetch_source  # noqa: E402
from lockstep.pipeline.tokenizer import CappedTexts, TokenizerConfig, capped_train_texts, run_tokenizer_stage  # noqa: E402
from lockstep.tokenizer.base import SPECIAL_TOKENS  # noqa: E402
from lockstep.tokenizer.bpe import SPLIT_PATTERN  # noqa: E402
from lockstep.tokenizer.bpe_train import TRAIN_BUFFER_TEXTS  # noqa: E402
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

    from lockstep.data.snapshot import SnapshotWriter
    from lockstep.data.sources import iter_records, read_meta

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


def read_texts(raw: Path, cfg: TokenizerConfig) -> CappedTexts:
    return capped_train_texts(cfg, [raw / n for n in cfg.train_sources])


def train_bare(texts: Iterator[str], cfg: TokenizerConfig) -> tuple[float, int]:
    import rustbpe

    t0 = time.perf_counter()
    bare = rustbpe.Tokenizer()
    bare.train_from_iterator(
        texts, vocab_size=cfg.vocab_size - len(SPECIAL_TOKENS), buffer_size=TRAIN_BUFFER_TEXTS, pattern=SPLIT_PATTERN
    )
    return time.perf_counter() - t0, bare.vocab_size + len(SPECIAL_TOKENS)


def child(side: str, params_path: Path, raw: Path, out: Path) -> dict:
    """One timed run of `side` in this fresh process."""
    import pyarrow.parquet  # noqa: F401  the modules the stage imports on first use
    import rustbpe  # noqa: F401
    import tiktoken  # noqa: F401

    import lockstep.data.sources.gsm8k  # noqa: F401

    params = load_params(params_path)
    cfg = section(params, "tokenizer", TokenizerConfig)
    if side == "stage":
        phases: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: phases.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("lockstep.tokenizer").addHandler(handler)
        logging.getLogger("lockstep.tokenizer").setLevel(logging.INFO)
        t0 = time.perf_counter()
        try:
            metrics = run_tokenizer_stage(cfg, raw, out / "tok", out / "metrics.json", seed=params["seed"])
            seconds = time.perf_counter() - t0
        finally:
            logging.getLogger("lockstep.tokenizer").removeHandler(handler)
        return {
            "seconds": seconds,
            "vocab_size": metrics["vocab_size"],
            "phases": [m for m in phases if m.startswith("tokenizer stage |")],
        }
    if side == "bare":
        # The stage's exact training text, read before the clock starts and held through the call.
        texts = list(read_texts(raw, cfg))
        seconds, vocab_size = train_bare(iter(texts), cfg)
    elif side == "freed":
        # The same call, the list referenced only by the iterator handed to rustbpe, so it is
        # freed inside the call when the iterator runs out.
        seconds, vocab_size = train_bare(iter(list(read_texts(raw, cfg))), cfg)
    else:
        raise ValueError(f"side {side!r} must be stage, bare or freed")
    return {"seconds": seconds, "vocab_size": vocab_size}


def run_child(side: str, params_path: Path, raw: Path, out: Path, *, in_process: bool = False) -> dict:
    if in_process:
        return child(side, params_path, raw, out)
    cmd = [sys.executable, __file__, "--child", side, str(params_path), str(raw), str(out)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--raw", type=Path, default=ROOT / "data" / "raw")
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--verbose", action="store_true", help="print the stage's phase times of every run")
    ap.add_argument(
        "--copies",
        type=int,
        default=1,
        help="train on each train source's documents this many times over (raise tokenizer.max_chars to match)",
    )
    ap.add_argument("--freed", action="store_true",
                    help="also time the bare call on a list that only its iterator holds (freed inside the call)")
    ap.add_argument("--in-process", action="store_true",
                    help="run every side in this process instead (after one untimed run of each): the ratio then "
                         "depends on what earlier runs left on the heap")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    params = load_params(args.params)
    cfg = section(params, "tokenizer", TokenizerConfig)
    if cfg.kind != "bpe":
        raise ConfigError(
            f"the baseline is rustbpe training, so tokenizer.kind must be bpe (got {cfg.kind!r}); use -S-free params"
        )
    names = list(dict.fromkeys(cfg.train_sources + cfg.metric_sources))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        raw = ensure_snapshots(params, names, args.raw, tmp)
        if args.copies > 1:
            raw = scaled_snapshots(raw, names, list(cfg.train_sources), args.copies, tmp / f"raw_x{args.copies}")
        capped = read_texts(raw, cfg)
        list(capped)  # counts chars and texts for the summary line
        times: dict[str, list[float]] = {"stage": [], "bare": [], "freed": []}
        phases: list[str] = []
        sides = ["stage", "bare"]
        if args.in_process:
            for side in sides:
                run_child(side, args.params, raw, tmp / f"{side}_untimed", in_process=True)
        for r in range(args.repeats):
            # Alternate which runs first so a drift in machine load hits both sides alike.
            for side in (sides if r % 2 == 0 else sides[::-1]) + (["freed"] if args.freed else []):
                result = run_child(side, args.params, raw, tmp / f"{side}{r}", in_process=args.in_process)
                times[side].append(result["seconds"])
                phases += result.get("phases", [])
                assert result["vocab_size"] == cfg.vocab_size, result
    if args.verbose:
        print("\n".join(phases))
    stage_s, bare_s, freed_s = times["stage"], times["bare"], times["freed"]
    stage_med, bare_med = statistics.median(stage_s), statistics.median(bare_s)
    print(f"corpus: {capped.chars:,} chars in {capped.texts:,} texts from {', '.join(cfg.train_sources)}; "
          f"vocab {cfg.vocab_size}; {args.repeats} runs a side, "
          f"{'all in this process' if args.in_process else 'each in a fresh process'}")  # fmt: skip
    print(f"tokenizer stage (read + train + save + metrics): median {stage_med:.3f}s  "
          f"runs {[round(s, 3) for s in stage_s]}")
    print(f"bare rustbpe train_from_iterator:               median {bare_med:.3f}s  "
          f"runs {[round(s, 3) for s in bare_s]}")
    if freed_s:
        freed_med = statistics.median(freed_s)
        print(f"bare call, text list freed inside the call:     median {freed_med:.3f}s  "
              f"runs {[round(s, 3) for s in freed_s]} ({freed_med / bare_med:.2f}x of bare)")
    pair_ratio = statistics.median(s / b for s, b in zip(stage_s, bare_s, strict=True))
    print(f"ratio stage/bare: {stage_med / bare_med:.2f}x of medians, {pair_ratio:.2f}x median of paired runs "
          "(target <= 1.20x)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))))
    else:
        main()
