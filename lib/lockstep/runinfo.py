"""Run facts: what a stage records about how it ran (wall times, throughput, MFU, device, commit),
kept apart from its metrics. Metrics are results, equal for equal runs, and are what `dvc metrics
diff` compares; run facts differ with the host and its load, so each stage writes them to
`data/runinfo/<stage>.json`, which the report card reads and DVC does not diff. Every stage
writes them through `write_runinfo`, which adds the facts all stages share."""

from __future__ import annotations

import math
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lockstep.io import write_json_atomic

def git_commit(root: Path | None = None) -> str:
    """The git commit checked out, or "unknown"."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def nan_to_null(values: dict[str, Any]) -> dict[str, Any]:
    """NaN (a figure with nothing to measure) as None, which JSON writes as null."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in values.items()}


def write_runinfo(path: Path, facts: Mapping[str, Any], *, device: Any = "cpu") -> dict[str, Any]:
    """Write a stage's run facts to `path` (canonical JSON, atomically) and return them: `facts`,
    NaN as null, then the fact every stage shares, the commit (`git_commit`), unless `facts`
    already carries it. `device` is the one the stage computed on."""
    info = nan_to_null(dict(facts))
    info.setdefault("git_commit", git_commit())
    write_json_atomic(path, info)
    return info
