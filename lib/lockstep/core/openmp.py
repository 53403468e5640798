"""OpenMP's wait policy for torch's CPU threads, chosen before torch is imported (libgomp reads it
once, when it loads). Imports nothing but `os`, so a process entry point can call it first."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# Idle OpenMP threads sleep instead of spinning. On 2 cores beside one busy process, the d4
# training step slowed 2.31x with the default (spinning) policy against 1.50x expected from the
# CPU share, and 1.58x with PASSIVE; quiet, the two were within noise (757 and 790 ms/step, whose
# run-to-run spread here is 717-772). bench/bench_load.py measures it.
WAIT_POLICY = "PASSIVE"


def choose_wait_policy(environ: MutableMapping[str, str] | None = None) -> str:
    """Set OMP_WAIT_POLICY to PASSIVE unless the environment already sets it, and return the
    policy in force with where it came from, for the run's log."""
    env = os.environ if environ is None else environ
    if env.get("OMP_WAIT_POLICY"):
        return f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']} (from the environment)"
    env["OMP_WAIT_POLICY"] = WAIT_POLICY
    return f"OMP_WAIT_POLICY={WAIT_POLICY} (idle threads sleep, so a busy machine slows training in proportion)"


def wait_policy() -> str:
    """The policy this process's OpenMP runtime read, as far as the environment says."""
    return os.environ.get("OMP_WAIT_POLICY", "") or "default (threads spin before they sleep)"
