"""Processes started by the tests that kill a stage's launcher: the environment a stage runs in
from the checkout, and who is still alive by /proc (Linux)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def stage_env(repo_root: Path, **extra: str) -> dict[str, str]:
    """This environment without DVC's and pytest's variables, with the virtualenv's scripts on
    PATH and the checkout's library and stages importable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DVC_", "PYTEST"))}
    return {**env, "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
            "PYTHONPATH": f"{repo_root / 'lib'}{os.pathsep}{repo_root}", **extra}


def alive(pid: int) -> bool:
    """Whether `pid` runs: a zombie (dead, not yet reaped by whoever adopted it) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def gone_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_for_pid(path: Path, proc: subprocess.Popen, timeout_s: float = 120) -> int:
    """The pid written to `path`, once it is; AssertionError if `proc` ends or time runs out first."""
    deadline = time.monotonic() + timeout_s
    while not (path.is_file() and path.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, f"{path.name} never written"
        time.sleep(0.02)
    return int(path.read_text())


def run_with_file_size_limit(cmd: list[str], *, cwd: Path, env: dict[str, str], limit_bytes: int,
                             timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """`cmd` run to its end with RLIMIT_FSIZE at `limit_bytes`, output captured through pipes
    (which the limit does not cover). Python starts with SIGXFSZ ignored, so a Python program's
    write past the limit fails with EFBIG rather than killing it; no bytecode is written, so
    that its first write is the program's own."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return subprocess.run(cmd, cwd=cwd, env={**env, "PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True, text=True,
                          timeout=timeout_s, preexec_fn=limit)
