"""The `tokenizer` stage: parse paths, read the `tokenizer:` params section, call
lockstep.pipeline.tokenizer. No tokenizer logic lives here."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from lockstep.pipeline.tokenizer import ERRORS, TokenizerConfig, run_tokenizer_stage
from stages._common import add_params_option, entry, preamble

STAGE_ERRORS = ERRORS


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
    run_tokenizer_stage(cfg, args.raw, args.out, args.metrics, seed=pre.data_seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
