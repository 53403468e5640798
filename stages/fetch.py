"""Stage `fetch@<name>`: read params `fetch.<name>` and `data_seed`, write the raw snapshot of that
source to --out (resumable sources keep their progress in --resume-dir until done). Parsing and
params only; the work is lockstep.sources.fetch_source."""

from __future__ import annotations

import argparse
from pathlib import Path

from lockstep.config import ConfigError
from lockstep.sources import ERRORS, SOURCE_CONFIGS, fetch_source
from lockstep.sources.fields import source_config
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
    entry = (pre.params.get("fetch") or {}).get(args.name)
    if not isinstance(entry, dict) or "source" not in entry:
        raise ConfigError(f"params has no fetch.{args.name}.source; add an entry naming one of {', '.join(sorted(SOURCE_CONFIGS))}")
    source = entry["source"]
    if source not in SOURCE_CONFIGS:
        raise ConfigError(f"fetch.{args.name}.source={source!r} must be one of {', '.join(sorted(SOURCE_CONFIGS))}")
    # Every value checked with the source's own rules: a null, a wrong type or a value out of range
    # ends in one error naming fetch.<name>.<key>, what it must be and its default.
    cfg = source_config(SOURCE_CONFIGS[source], entry, where=f"fetch.{args.name}")
    # Arrow batches where the source has them: the same bytes as the record path in about 1.6x less
    # time (docs/internals.md); the record path stays the library's default and reference.
    meta = fetch_source(args.name, cfg, args.out, seed=pre.data_seed, resume_dir=args.resume_dir, arrow_batches=True)
    c = meta["counts"]
    if "tasks" in c:  # a file bundle (dclm_core): tasks and items, no splits
        pre.log.info("fetch %s (%s, %s): %d tasks | %d items | %s -> %s", args.name, source, meta["kind"], c["tasks"],
                     c["items"], meta["identity"], args.out)
        return 0
    pre.log.info("fetch %s (%s, %s): train %d | val %d | skipped %d -> %s",
             args.name, source, meta["kind"], c["train"], c["val"], c["skipped"], args.out)
    if "local_splits" in meta:  # which local file fed which split, so a misnamed file shows here
        pre.log.info("local files (split by %s): %s%s", meta["split_rule"],
                 " | ".join(f"{s} <- {', '.join(fs)}" for s, fs in meta["local_splits"].items()),
                 f" | not read: {', '.join(meta['unused_files'])}" if meta["unused_files"] else "")
    for reason in meta["bad_examples"]:
        pre.log.warning("skipped: %s", reason)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
