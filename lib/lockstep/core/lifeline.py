"""A stage's tie to the process that launched it: DVC, or the torchrun agent of its rank. When
that process dies (`dvc repro` killed with SIGKILL), the stage ends within POLL_S instead of
training on as an orphan that publishes its outputs after the next `dvc repro` committed them.
A stage started by hand is tied to nothing: it outlives the shell it was started from. Knows
nothing about stages or training; imports no torch.

Who the launcher is. DVC 3 runs a stage's command as `$SHELL -c CMD` (`/bin/sh` without $SHELL;
dvc/stage/run.py) and marks it with DVC_STAGE. bash and zsh exec a lone command, so the stage's
parent is dvc itself; dash (Debian's /bin/sh) forks it and waits, so the parent is the shell and
dvc is its parent, while the shell outlives dvc. So the launcher is the nearest ancestor that is
not a shell running `-c`, and every process between it and the stage is watched too. Under
torchrun (RANK, WORLD_SIZE and LOCAL_RANK set, as lockstep.core.runtime.under_torchrun reads them) the
launcher is the torchrun agent, the ranks' parent; torchrun itself forwards SIGTERM to them, but a
torchrun killed with SIGKILL leaves them orphaned, so each rank watches it.

How it is watched. The ancestry is read when the stage's process starts (`ancestry`, called by
stages/__init__.py before the heavy imports), then checked every POLL_S by a daemon thread: our
parent must still be the first link and each shell's parent the next. A dead process breaks its
link whether or not its pid is reused (its child is re-parented), and getppid() and /proc reads
cost microseconds, so polling needs neither pidfds nor PR_SET_PDEATHSIG (which fires when the
parent *thread* exits, and never fires for a shell that outlives dvc)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

POLL_S = 0.5  # how often the ancestry is checked: a stage stops within about this long of its launcher
STATUS = 129  # 128 + SIGHUP: what a process whose launcher hung up on it ends with
# Shells that run `-c CMD` without exec'ing a lone command (dash), or may not (the rest, for a
# command line with more than one command).
SHELLS = frozenset({"sh", "dash", "bash", "zsh", "ksh", "mksh", "ash", "busybox", "fish"})
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_children: list[subprocess.Popen] = []  # children to stop with this process (tie)


def _proc(pid: int, name: str) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:  # gone, or no /proc (macOS): only the parent is watched there
        return None


def _parent_of(pid: int) -> int | None:
    """`pid`'s parent as /proc says now, None when it is gone."""
    stat = _proc(pid, "stat")
    if stat is None:
        return None
    # `pid (comm) state ppid ...`: comm may hold spaces and parentheses, so split after the last ')'.
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def _is_shell_wrapper(pid: int) -> bool:
    """Whether `pid` is a shell running `-c CMD`, such as the one DVC runs a stage's command in."""
    cmdline = _proc(pid, "cmdline")
    if not cmdline:
        return False
    argv = cmdline.rstrip(b"\0").split(b"\0")
    return os.path.basename(argv[0].decode(errors="replace")).lstrip("-") in SHELLS and b"-c" in argv[1:]


def ancestry() -> tuple[int, ...]:
    """This process's parent, then the parents of each shell wrapper above it, up to the first
    ancestor that is not one (the launcher), as they are now."""
    links = [os.getppid()]
    while links[-1] > 1 and _is_shell_wrapper(links[-1]):
        parent = _parent_of(links[-1])
        if parent is None:
            break
        links.append(parent)
    return tuple(links)


def _intact(links: tuple[int, ...]) -> bool:
    """Whether every process in `links` is still alive and the parent of the one before."""
    if os.getppid() != links[0]:
        return False
    return all(_parent_of(child) == parent for child, parent in zip(links, links[1:]))


@dataclass(frozen=True)
class Launcher:
    """The process a stage ends with: `links` from the stage's parent up to it (see `ancestry`),
    and `by` what launched the stage (`dvc`, `torchrun`), for the line it stops with."""

    links: tuple[int, ...]
    by: str

    @property
    def pid(self) -> int:
        return self.links[-1]


def find_launcher(links: tuple[int, ...], environ: Mapping[str, str] = os.environ) -> Launcher | None:
    """The launcher to tie a stage to, given its `ancestry()`: its torchrun agent under torchrun,
    DVC when DVC_STAGE is set, else None (started by hand: tied to nothing)."""
    if all(v in environ for v in _TORCHRUN_VARS):
        return Launcher(links, "torchrun")
    if "DVC_STAGE" in environ:
        return Launcher(links, "dvc")
    return None


def tie(proc: subprocess.Popen) -> None:
    """Stop child `proc` with this process when its launcher dies: it is sent SIGTERM first
    (torchrun forwards that to its ranks and waits for them)."""
    _children.append(proc)


def _stop(launcher: Launcher, *, speak: bool) -> None:
    if speak:
        rerun = ("`dvc repro` runs it again" if launcher.by == "dvc"
                 else "the other ranks of the job are gone with it; run the stage again")
        line = (f"stopped: {launcher.by} (pid {launcher.pid}), which started this stage, has ended, so the stage ends "
                f"too, publishing nothing; {rerun} (a training stage resumes from its last complete checkpoint)\n")
        with contextlib.suppress(OSError):  # stderr may have been a pipe to the process that died
            os.write(2, line.encode())
    for proc in _children:
        with contextlib.suppress(OSError):
            proc.terminate()
    # No unwinding: the main thread may be inside a collective that never returns, and a stage's
    # writes are atomic, so stopping here leaves what a SIGKILL of the stage would.
    os._exit(STATUS)


def arm(launcher: Launcher | None, *, poll_s: float = POLL_S) -> None:
    """End this process, with one line on stderr (from rank 0 only under torchrun) and status
    STATUS, as soon as `launcher` dies: at once when it already has (while the stage was
    starting), else from a daemon thread polling every `poll_s`. Nothing for None."""
    if launcher is None:
        return
    speak = os.environ.get("RANK", "0") == "0"
    if not _intact(launcher.links):
        _stop(launcher, speak=speak)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if not _intact(launcher.links):
                _stop(launcher, speak=speak)

    threading.Thread(target=watch, name="lockstep-lifeline", daemon=True).start()
