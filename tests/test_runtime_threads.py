"""OpenMP's wait policy: chosen before torch loads, by the stages and the command line, unless
the environment sets it; the run's device reason says which is in force."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from lockstep.core.openmp import WAIT_POLICY, choose_wait_policy
from lockstep.core.runtime import RuntimeConfig, init_runtime

ROOT = Path(__file__).resolve().parents[1]


def test_passive_unless_the_environment_says_otherwise() -> None:
    env: dict[str, str] = {}
    assert "idle threads sleep" in choose_wait_policy(env) and env == {"OMP_WAIT_POLICY": WAIT_POLICY}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert (
        choose_wait_policy(env) == "OMP_WAIT_POLICY=ACTIVE (from the environment)"
        and env["OMP_WAIT_POLICY"] == "ACTIVE"
    )


def _policy_seen_by(code: str, **env: str) -> str:
    """OMP_WAIT_POLICY as a fresh interpreter sees it when torch has loaded after `code`."""
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport os, torch\nprint(os.environ.get('OMP_WAIT_POLICY'))"],
                         cwd=ROOT, env={**base, "PYTHONPATH": f"{ROOT / 'lib'}:{ROOT}", **env}, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_stage_entry_and_command_line_set_it_before_torch_loads() -> None:
    assert _policy_seen_by("import stages") == "PASSIVE"
    assert _policy_seen_by("import lockstep.cli") == "PASSIVE"
    assert _policy_seen_by("import stages", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"


def test_cpu_runtime_reason_names_the_policy(monkeypatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    rt = init_runtime(RuntimeConfig(device="cpu", dtype="fp32"))
    assert rt.device == torch.device("cpu") and "OpenMP wait policy PASSIVE" in rt.reason
