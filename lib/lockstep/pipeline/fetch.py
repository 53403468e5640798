"""The `fetch@<name>` stage's work around lockstep.data.sources.fetch_source: find the source that
an entry of the `fetch:` params section names, check the entry with that source's own rules, write
the raw snapshot (through the resume folder, for a long fetch) and log what it holds. The entry,
the paths and the data seed come from the caller (stages/fetch.py); nothing here reads params.yaml
or argv."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lockstep.core.config import ConfigError
from lockstep.data.sources import ERRORS as SOURCE_ERRORS
from lockstep.data.sources import SOURCE_CONFIGS, fetch_source
from lockstep.data.sources.fields import source_config

# Errors whose message says what to fix (the sources'): the fetch stage's entry point prints them as one line.
ERRORS = SOURCE_ERRORS


def run_fetch_stage(name: str, entry: Any, out: Path, *, data_seed: int, resume_dir: Path | None) -> dict[str, Any]:
    """Fetch the source that `entry` (params `fetch.<name>`) names into the snapshot folder `out`;
    the snapshot's meta.json as a dict."""
    log = logging.getLogger("lockstep.fetch")
    if not isinstance(entry, dict) or "source" not in entry:
        raise ConfigError(
            f"params has no fetch.{name}.source; add an entry naming one of {', '.join(sorted(SOURCE_CONFIGS))}"
        )
    source = entry["source"]
    if source not in SOURCE_CONFIGS:
        raise ConfigError(f"fetch.{name}.source={source!r} must be one of {', '.join(sorted(SOURCE_CONFIGS))}")
    # Every value checked with the source's own rules: a null, a wrong type or a value out of range
    # ends in one error naming fetch.<name>.<key>, what it must be and its default.
    cfg = source_config(SOURCE_CONFIGS[source], entry, where=f"fetch.{name}")
    # Arrow batches where the source has them: the same bytes as the record path in about 1.6x less
    # time (docs/internals.md); the record path stays the library's default and reference.
    meta = fetch_source(name, cfg, out, seed=data_seed, resume_dir=resume_dir, arrow_batches=True)
    c = meta["counts"]
    if "tasks" in c:  # a file bundle (dclm_core): tasks and items, no splits
        log.info("fetch %s (%s, %s): %d tasks | %d items | %s -> %s", name, source, meta["kind"], c["tasks"],
                 c["items"], meta["identity"], out)
        return meta
    log.info("fetch %s (%s, %s): train %d | val %d | skipped %d -> %s",
             name, source, meta["kind"], c["train"], c["val"], c["skipped"], out)
    if "local_splits" in meta:  # which local file fed which split, so a misnamed file shows here
        log.info("local files (split by %s): %s%s", meta["split_rule"],
                 " | ".join(f"{s} <- {', '.join(fs)}" for s, fs in meta["local_splits"].items()),
                 f" | not read: {', '.join(meta['unused_files'])}" if meta["unused_files"] else "")
    for reason in meta["bad_examples"]:
        log.warning("skipped: %s", reason)
    return meta
