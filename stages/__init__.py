"""The DVC stages, one thin module each, run as `python -m stages.<name>` by dvc.yaml. This file
runs first, under whichever `python` is on PATH, and only checks that it is the project's
environment: without it a stage would die on its first import with a ModuleNotFoundError that
does not say why. It imports nothing heavy; find_spec locates a package without loading it.
It also chooses OpenMP's wait policy (lockstep.core.openmp), which must be in the environment before
torch loads, and reads which processes started this one (lockstep.core.lifeline.ancestry), before the
seconds of imports in which a launcher killed meanwhile would leave this process re-parented."""

import importlib.util
import sys

_missing = [name for name in ("lockstep", "torch") if importlib.util.find_spec(name) is None]
if _missing:
    sys.exit(
        f"error: {sys.executable} cannot import {' or '.join(_missing)}: the project's environment is not active; "
        "run `source .venv/bin/activate`, then the same command again (or `make repro`, which needs no activation)"
    )

from lockstep.core.lifeline import ancestry  # noqa: E402  (after the environment check)
from lockstep.core.openmp import choose_wait_policy  # noqa: E402

ANCESTRY = ancestry()  # what stages._common.entry ties the stage to when DVC or torchrun started it
choose_wait_policy()
