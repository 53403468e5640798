"""OpenMP's wait policy: chosen before torch loads by `import lockstep` (so by the stages, the
command line and library use alike), unless the environment sets it; the run's device reason
says which is in force, and when torch loaded first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from lockstep.core import openmp
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
    monkeypatch.setattr(openmp, "_chosen", openmp._Choice())  # as if lockstep chose it before torch loaded
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    rt = init_runtime(RuntimeConfig(device="cpu", dtype="fp32"))
    assert rt.device == torch.device("cpu") and "OpenMP wait policy PASSIVE" in rt.reason


def test_importing_lockstep_sets_it_for_library_use() -> None:
    """A script or notebook that drives lockstep.train from Python, without the stages or the
    command line, gets the policy from `import lockstep` (any of its modules) before torch."""
    assert _policy_seen_by("import lockstep.train.trainer") == "PASSIVE"
    assert _policy_seen_by("import lockstep") == "PASSIVE"
    assert _policy_seen_by("import lockstep", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"


def _runtime_log(code: str, **env: str) -> tuple[str, str]:
    """(device reason, stderr) of init_runtime on the CPU in a fresh interpreter after `code`."""
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    script = (f"{code}\nimport logging\nlogging.basicConfig(level=logging.WARNING)\n"
              "from lockstep.core.runtime import RuntimeConfig, init_runtime\n"
              "print(init_runtime(RuntimeConfig(device='cpu', dtype='fp32')).reason)")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**base, "PYTHONPATH": str(ROOT / "lib"), **env},
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1], out.stderr


def test_torch_imported_first_is_said_with_what_to_do() -> None:
    """OpenMP reads the policy once, when torch loads: imported before lockstep, torch keeps the
    spinning default; the runtime's reason says so, and one warning says what to do first."""
    reason, stderr = _runtime_log("import torch")
    assert "torch was imported before lockstep" in reason and "Import lockstep before torch" in reason
    assert stderr.count("OpenMP wait policy default") == 1 and "OMP_WAIT_POLICY=PASSIVE before starting" in stderr
    reason, stderr = _runtime_log("import torch", OMP_WAIT_POLICY="PASSIVE")  # set before Python: torch read it
    assert reason.endswith("OpenMP wait policy PASSIVE") and "wait policy" not in stderr
    reason, stderr = _runtime_log("import lockstep\nimport torch")
    assert reason.endswith("OpenMP wait policy PASSIVE") and "wait policy" not in stderr


def test_a_second_choice_reports_the_first() -> None:
    """stages/__init__.py calls choose_wait_policy after `import lockstep` already did: the log
    still says the policy was lockstep's choice, not the environment's."""
    out = subprocess.run([sys.executable, "-c", "import stages\nfrom lockstep.core.openmp import choose_wait_policy\n"
                          "print(choose_wait_policy())"], cwd=ROOT,
                         env={**{k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"},
                              "PYTHONPATH": f"{ROOT / 'lib'}:{ROOT}"}, capture_output=True, text=True, check=True)
    assert "idle threads sleep" in out.stdout and "from the environment" not in out.stdout
