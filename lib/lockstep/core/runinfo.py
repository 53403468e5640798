"""Run facts: what a stage records about how it ran (wall times, throughput, MFU, device, commit,
and what decides its floating-point results), kept apart from its metrics. Metrics are results,
equal for equal runs, and are what `dvc metrics diff` compares; run facts differ with the host and
its load, so each stage writes them to `data/runinfo/<stage>.json`, a DVC-cached output that the
report card reads, `lockstep parity` consults and git does not track.

Every stage writes its run facts through `write_runinfo`, which adds the facts all stages share:
the git commit, `numerics`, the facts that decide the bytes a model computes on this machine
(`numerics_facts`), and `fast_paths`, what each fast path did (lockstep.core.fastpath.facts). Two
runs with the same params and seed whose metrics differ are explained by how their `numerics`
differ. Imports torch only inside `numerics_facts`, so the report stays light."""

from __future__ import annotations

import math
import platform
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lockstep.core.io import write_json_atomic

# The key under which `write_runinfo` records `numerics_facts`.
NUMERICS_KEY = "numerics"


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


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def numerics_facts(device: Any = "cpu") -> dict[str, Any]:
    """What decides the floating-point bytes a model computes here, beyond params, seed and code:
    the CPU instruction-set path torch dispatches to (`cpu_capability`: e.g. AVX2, AVX512), the
    torch build (version, git revision, CUDA and cuDNN versions, null without them), the threads
    its CPU kernels split work over (a reduction split differently sums in another order), and the
    device's name, and the path each fast path took (`fast_paths`: lockstep.core.fastpath.paths_summary,
    a fast path that failed falls back to its reference). Two runs that agree on all of them and on
    params, seed and code compute the same bytes; a run that differs in one may differ in its last
    bits, and training amplifies them."""
    import torch

    from lockstep.core import fastpath

    dev = torch.device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    elif dev.type == "mps":
        name = f"mps ({platform.machine()})"
    else:
        name = cpu_name()
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "threads": torch.get_num_threads(),
        "device_type": dev.type,
        "device_name": name,
        "fast_paths": fastpath.paths_summary(),
    }


def write_runinfo(path: Path, facts: Mapping[str, Any], *, device: Any = "cpu") -> dict[str, Any]:
    """Write a stage's run facts to `path` (canonical JSON, atomically) and return them: `facts`,
    NaN as null, then the facts every stage shares, the commit (`git_commit`), `numerics`
    (`numerics_facts` of `device`) and `fast_paths` (lockstep.core.fastpath.facts), unless `facts`
    already carries them."""
    from lockstep.core import fastpath

    info = nan_to_null(dict(facts))
    info.setdefault("git_commit", git_commit())
    info.setdefault(NUMERICS_KEY, numerics_facts(device))
    info.setdefault("fast_paths", fastpath.facts())
    write_json_atomic(path, info)
    return info


def numerics_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The `numerics` facts on which two run-facts records differ, one `key A x, B y` each (in key
    order); [] when they agree or neither records them."""
    na, nb = a.get(NUMERICS_KEY) or {}, b.get(NUMERICS_KEY) or {}
    return [f"{k} A {na.get(k)!r}, B {nb.get(k)!r}" for k in sorted(set(na) | set(nb)) if na.get(k) != nb.get(k)]
