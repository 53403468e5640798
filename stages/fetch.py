"""Stage `fetch@<name>`: read params `fetch.<name>` and `data_seed`, write the raw snapshot of that
source to --out (resumable sources keep their progress in --resume-dir until done). Parsing and
params only; the work is lockstep.pipeline.fetch."""

from __future__ import annotations

import argparse
from pathlib import Path

from lockstep.pipeline.fetch import ERRORS, run_fetch_stage
from stages._common import add_params_option, entry, preamble

STAGE_ERRORS = ERRORS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("name", help="the entry under `fetch:` in params.yaml")
    ap.add_argument("--out", type=Path, required=True, help="snapshot folder, e.g. data/raw/<name>")
    add_params_option(ap)
    ap.add_argument("--resume-dir", type=Path, default=None,
                    help="resume folder of a long fetch, outside --out (e.g. data/partial/fetch/<name>); "
                         "an interrupted fetch run again with the same params carries on from it")
    args = ap.parse_args(argv)
    pre = preamble("fetch", args.params)
    run_fetch_stage(args.name, (pre.params.get("fetch") or {}).get(args.name), args.out, data_seed=pre.data_seed,
                    resume_dir=args.resume_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
