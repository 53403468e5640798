"""The `tokenizer` stage: parse paths, read the `tokenizer:` params section, call
lockstep.tokenizer.pipeline. No tokenizer logic lives here."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from lockstep.config import ConfigError
from lockstep.snapshot import SnapshotError
from lockstep.tokenizer.base import TokenizerFileError
from lockstep.tokenizer.kinds import training_errors
from lockstep.tokenizer.pipeline import TokenizerConfig, run_tokenizer_stage
from stages._common import add_params_option, entry, preamble

# Errors whose message says what to fix: the entry point prints them as one `error: ...` line.
STAGE_ERRORS = (ConfigError, SnapshotError, TokenizerFileError, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.tokenizer", description=__doc__)
    parser.add_argument("--raw", type=Path, required=True, help="folder of raw snapshots (data/raw)")
    parser.add_argument("--out", type=Path, required=True, help="tokenizer output folder (data/tokenizer)")
    parser.add_argument("--metrics", type=Path, required=True, help="metrics JSON (data/metrics/tokenizer.json)")
    add_params_option(parser)
    args = parser.parse_args(argv)
    pre = preamble("tokenizer", args.params)
    # rustbpe logs one INFO line per percent of merges; the stage logs its own summary instead.
    logging.getLogger("rustbpe").setLevel(max(logging.WARNING, pre.log.getEffectiveLevel()))
    cfg = pre.section("tokenizer", TokenizerConfig)
    if not cfg.kind_options.uses_vocab_size():
        pre.log.info("tokenizer.kind=%s fixes its own vocabulary here; tokenizer.vocab_size=%d is not used", cfg.kind, cfg.vocab_size)
    try:
        run_tokenizer_stage(cfg, args.raw, args.out, args.metrics, seed=pre.data_seed)
    except training_errors() as e:
        # Known only once the text (or a dictionary file) is read: the message says what does not
        # fit; the key is what to change. A message that names its key already is kept as it is.
        if str(e).startswith("tokenizer."):
            raise ConfigError(str(e)) from None
        key = f"tokenizer.vocab_size={cfg.vocab_size}" if cfg.kind_options.uses_vocab_size() else f"tokenizer.options ({cfg.kind})"
        raise ConfigError(f"{key} does not fit: {e}") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
