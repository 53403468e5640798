"""Run facts: what a stage records about how it ran (wall times, throughput, MFU, device, commit),
kept apart from its metrics. Metrics are results, equal for equal runs, and are what
`dvc metrics diff` compares; run facts differ with the host and its load, so each stage writes
them to `data/runinfo/<stage>.json`, which the report card reads and DVC does not diff."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path
from typing import Any


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
