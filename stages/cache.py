"""Stage `cache@<name>`: one raw snapshot + the tokenizer -> a token cache (pretrain shards or SFT
examples) with its parity artifacts. Parses paths, reads the `cache.<name>` params section and
`data_seed`, calls lockstep.pipeline.cache."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lockstep.pipeline.cache import ERRORS, CacheConfig, run_cache_stage
from stages._common import add_params_option, entry, preamble

STAGE_ERRORS = ERRORS


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m stages.cache", description=__doc__)
    ap.add_argument("name", help="entry of the params `cache:` section")
    ap.add_argument("--raw", type=Path, required=True, help="raw snapshot folder, data/raw/<source>")
    ap.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder, data/tokenizer")
    ap.add_argument("--out", type=Path, required=True, help="cache folder to write, data/cache/<kind>/<name>")
    add_params_option(ap)
    args = ap.parse_args(argv)
    pre = preamble("cache", args.params)
    cfg = pre.section(f"cache.{args.name}", CacheConfig)
    return run_cache_stage(args.name, cfg, raw=args.raw, tokenizer=args.tokenizer, out=args.out,
                           data_seed=pre.data_seed)


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
