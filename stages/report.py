"""Stage `report`: parse paths, call lockstep.pipeline.report to rebuild the report card from metrics, run
facts, eval records and per-step series. Reads no params and runs no model."""

from __future__ import annotations

import argparse
from pathlib import Path

from lockstep.pipeline.report import ERRORS, build_report, environment_info
from stages._common import entry, setup

STAGE_ERRORS = ERRORS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.report", description=__doc__)
    parser.add_argument("--metrics", type=Path, required=True, help="metrics folder (data/metrics)")
    parser.add_argument("--runinfo", type=Path, required=True, help="run facts folder (data/runinfo)")
    parser.add_argument(
        "--predictions", type=Path, required=True, help="eval records folder (data/eval), for intervals"
    )
    parser.add_argument("--plots", type=Path, required=True, help="per-step TSV series (data/plots)")
    parser.add_argument("--out", type=Path, required=True, help="report folder (data/report)")
    args = parser.parse_args(argv)
    log = setup("report")
    path = build_report(args.metrics, args.plots, args.out, environment=environment_info(Path.cwd()),
                        runinfo_dir=args.runinfo, predictions_dir=args.predictions)
    log.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
