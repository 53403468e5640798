"""The DVC stages, one thin module each, run as `python3 -m stages.<name>` by dvc.yaml (`python3`,
not `python`: Debian, Ubuntu and macOS ship no `python` command). This file runs first, under
whichever `python3` is on PATH, and makes sure it is the project's environment: a `dvc` started as
`.venv/bin/dvc` from a shell without the venv active runs the system's `python3`, on which a stage
would die on its first import with a ModuleNotFoundError that does not say why. Such a stage is
run again, same arguments, by the project's `.venv/bin/python` (one `note:` line says so); with no
such interpreter it ends with an error that says what to activate.
It imports nothing heavy; find_spec locates a package without loading it.
It also chooses OpenMP's wait policy (lockstep.core.openmp, which `import lockstep` already did:
it must be in the environment before torch loads), and reads which processes started this one
(lockstep.core.lifeline.ancestry), before the seconds of imports in which a launcher killed
meanwhile would leave this process re-parented."""

import importlib.util
import os
import sys

_missing = [name for name in ("lockstep", "torch") if importlib.util.find_spec(name) is None]
_PROJECT_PYTHON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv", "bin", "python")
_RERUN = "LOCKSTEP_STAGE_RERUN"  # set on the rerun, so that a venv lacking the packages ends, not loops
if _missing and os.access(_PROJECT_PYTHON, os.X_OK) and not os.environ.get(_RERUN) and hasattr(sys, "orig_argv"):
    _command = os.path.basename(sys.orig_argv[0])  # python3, as dvc.yaml runs it, or python by hand
    print(f"note: {sys.executable} (first `{_command}` on PATH) cannot import {' or '.join(_missing)}; "
          f"running the stage with the project's {_PROJECT_PYTHON}", file=sys.stderr, flush=True)
    os.environ[_RERUN] = "1"
    os.execv(_PROJECT_PYTHON, [_PROJECT_PYTHON, *sys.orig_argv[1:]])
if _missing:
    sys.exit(
        f"error: {sys.executable} cannot import {' or '.join(_missing)}: the project's environment is not active; "
        "run `source .venv/bin/activate`, then the same command again (or `make repro`, which needs no activation)"
    )

from lockstep.core.lifeline import ancestry  # noqa: E402  (after the environment check)
from lockstep.core.openmp import choose_wait_policy  # noqa: E402

ANCESTRY = ancestry()  # what stages._common.entry ties the stage to when DVC or torchrun started it
choose_wait_policy()
