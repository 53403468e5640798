"""OpenMP's wait policy for torch's CPU threads, chosen before torch is imported (libgomp reads it
once, when it loads). Imports nothing but `os` and `sys`, so a process entry point can call it
first: `import lockstep` does (lockstep/__init__.py), and so do the stages and the command line."""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

# Idle OpenMP threads sleep instead of spinning. On 2 cores beside one busy process, the d4
# training step slowed 2.31x with the default (spinning) policy against 1.50x expected from the
# CPU share, and 1.58x with PASSIVE; quiet, the two were within noise (757 and 790 ms/step, whose
# run-to-run spread here is 717-772). bench/bench_load.py measures it.
WAIT_POLICY = "PASSIVE"

class _Choice:
    """What choose_wait_policy found, so that a later call (a stage after `import lockstep`)
    reports the same source, and wait_policy() can tell a policy torch never read."""

    def __init__(self) -> None:
        self.said = ""  # the first call's answer; "" before it
        self.torch_first = False  # torch was imported before lockstep set the policy


_chosen = _Choice()


def choose_wait_policy(environ: MutableMapping[str, str] | None = None) -> str:
    """Set OMP_WAIT_POLICY to PASSIVE unless the environment already sets it, and return the
    policy in force with where it came from, for the run's log. In this process, from the second
    call on, the answer is the first call's (the environment then holds what the first call set)."""
    env = os.environ if environ is None else environ
    if environ is None and _chosen.said:
        return _chosen.said
    from_env = bool(env.get("OMP_WAIT_POLICY"))
    if from_env:
        said = f"OMP_WAIT_POLICY={env['OMP_WAIT_POLICY']} (from the environment)"
    else:
        env["OMP_WAIT_POLICY"] = WAIT_POLICY
        said = f"OMP_WAIT_POLICY={WAIT_POLICY} (idle threads sleep, so a busy machine slows training in proportion)"
    if environ is None:
        _chosen.said = said
        _chosen.torch_first = "torch" in sys.modules and not from_env
    return said


def torch_read_the_default() -> bool:
    """Whether torch was imported before lockstep chose the policy, so that OpenMP read its
    default (spinning) instead."""
    return _chosen.torch_first


def wait_policy() -> str:
    """The policy this process's OpenMP runtime read, as far as the environment says; where torch
    was imported before lockstep set it, the default it read instead, and what to do about it."""
    if torch_read_the_default():
        return (f"default (threads spin before they sleep): torch was imported before lockstep, so OpenMP never "
                f"read OMP_WAIT_POLICY={WAIT_POLICY}; beside other work training slows more than its share of the "
                f"cores. Import lockstep before torch, or set OMP_WAIT_POLICY={WAIT_POLICY} before starting Python")
    return os.environ.get("OMP_WAIT_POLICY", "") or "default (threads spin before they sleep)"
