"""Code sandbox: runs one untrusted Python program in a separate, resource-limited process and
reports what happened. It is a containment layer for model-written test programs, not a security
boundary against a determined attacker (no seccomp, no namespaces): run as an ordinary user, a
program still shares that user's uid, e.g. it can read /proc/<parent>/environ."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

Status = Literal["ok", "error", "timeout"]

# The unprivileged account used when the harness runs as root: the kernel exempts root from
# RLIMIT_NPROC, so a fork limit only holds once the program runs under another uid.
NOBODY_UID = 65534
NOBODY_GID = 65534
_CAPTURE_READ_BYTES = 1 << 20

# Runs inside the child before the program. It pre-imports the stdlib modules test programs use
# (after the uid drop the interpreter's own folder may be unreadable), drops root, caps process
# creation, and removes the Python-level doors to new processes, foreign files and native code.
_BOOTSTRAP = r'''
import builtins, os, resource, sys
import collections, functools, itertools, math, re, string, heapq, bisect, fractions, decimal
import statistics, typing, operator, copy, json, random, io, dataclasses, enum, hashlib, time
import subprocess, shutil, pathlib, traceback, types, textwrap, unicodedata

_root = os.path.realpath(os.getcwd())
_cfg = {cfg!r}
if os.geteuid() == 0 and _cfg["drop_uid"] is not None:
    os.setgroups([])
    os.setgid(_cfg["drop_gid"])
    os.setuid(_cfg["drop_uid"])
# Set after the uid drop: the kernel exempts root, and execve after setuid would trip the limit.
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))

def _forbidden(name):
    def deny(*args, **kwargs):
        raise PermissionError(f"sandbox: {{name}} is not allowed")
    return deny

for _name in ("fork", "forkpty", "vfork", "system", "popen", "execv", "execve", "execl", "execle",
              "execlp", "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnl", "spawnle",
              "spawnlp", "spawnlpe", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "kill",
              "killpg", "setsid", "setpgid", "putenv", "unsetenv", "chroot", "chown", "lchown",
              "setuid", "setgid", "setreuid", "setresuid"):
    if hasattr(os, _name):
        setattr(os, _name, _forbidden("os." + _name))
subprocess.Popen = _forbidden("subprocess.Popen")
import _posixsubprocess
_posixsubprocess.fork_exec = _forbidden("_posixsubprocess.fork_exec")
for _mod in ("ctypes", "_ctypes", "multiprocessing", "_multiprocessing", "socket", "_socket"):
    sys.modules[_mod] = None

def _inside(path):
    if isinstance(path, int):
        return True
    full = os.path.realpath(os.path.join(_root, os.fsdecode(path)))
    return full == _root or full.startswith(_root + os.sep)

_open = builtins.open
def _guarded_open(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+") and not _inside(file):
        raise PermissionError(f"sandbox: writing outside the working folder is not allowed: {{file!r}}")
    return _open(file, mode, *args, **kwargs)
builtins.open = _guarded_open
io.open = _guarded_open

_os_open = os.open
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
def _guarded_os_open(path, flags, *args, **kwargs):
    if flags & _WRITE_FLAGS and not _inside(path):
        raise PermissionError(f"sandbox: writing outside the working folder is not allowed: {{path!r}}")
    return _os_open(path, flags, *args, **kwargs)
os.open = _guarded_os_open
for _name in ("remove", "unlink", "rmdir", "rename", "replace", "mkdir", "makedirs", "symlink", "link", "truncate", "chmod"):
    _real = getattr(os, _name)
    def _guard(*args, _real=_real, _name=_name, **kwargs):
        if args and not _inside(args[0]) or len(args) > 1 and _name in ("rename", "replace", "symlink", "link") and not _inside(args[1]):
            raise PermissionError(f"sandbox: os.{{_name}} outside the working folder is not allowed")
        return _real(*args, **kwargs)
    setattr(os, _name, _guard)
shutil.rmtree = _forbidden("shutil.rmtree")

del _cfg, _name, _mod
with _open("program.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "program.py", "exec")
_globals = {{"__name__": "__main__", "__builtins__": builtins}}
exec(_code, _globals)
'''


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0        # wall clock; the whole process group is killed at this time
    memory_bytes: int = 512 << 20  # RLIMIT_AS (virtual address space)
    file_bytes: int = 1 << 20      # RLIMIT_FSIZE: largest file the program may write, stdout included
    output_bytes: int = 16 << 10   # stdout/stderr kept in the result (each)


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    status: Status        # ok: exit 0; error: nonzero exit or killed by a limit; timeout: wall clock
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float

    @property
    def passed(self) -> bool:
        return self.status == "ok"


def _scrubbed_env(workdir: Path) -> dict[str, str]:
    # Nothing of the parent's environment (tokens, paths, proxies) reaches the program.
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(workdir),
        "TMPDIR": str(workdir),
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
    }


def _limit_child(limits: SandboxLimits, running_as_root: bool) -> None:
    # Runs in the child between fork and exec.
    cpu_s = max(1, int(limits.timeout_s) + 1)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if not running_as_root:
        # No new processes or threads at all; the bootstrap sets it again after a uid drop.
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))


def _read_capped(path: Path, cap_bytes: int) -> str:
    with open(path, "rb") as f:
        data = f.read(min(cap_bytes, _CAPTURE_READ_BYTES) + 1)
    text = data[:cap_bytes].decode("utf-8", errors="replace")
    return text + ("\n[output truncated]" if len(data) > cap_bytes else "")


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


SANDBOX_DIR_NAME = "/sandbox"  # how the program's working folder appears in its output


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, drop_privileges: bool = True) -> SandboxResult:
    """Run `code` as `__main__` in a fresh interpreter: its own session and process group, a
    temporary working folder, a scrubbed environment, no stdin, rlimits on CPU, memory, file size
    and processes, and a hard wall-clock kill of the whole group. When the caller is root and
    `drop_privileges` is set, the program runs as `nobody` so that the process limit applies."""
    if limits.timeout_s <= 0 or limits.memory_bytes <= 0 or limits.file_bytes <= 0:
        raise ValueError(f"sandbox limits must be positive, got {limits}; fix evaluate.sandbox params")
    running_as_root = os.geteuid() == 0
    workdir = Path(tempfile.mkdtemp(prefix="lockstep-sandbox-"))
    try:
        drop = running_as_root and drop_privileges
        cfg = {"drop_uid": NOBODY_UID if drop else None, "drop_gid": NOBODY_GID}
        (workdir / "program.py").write_text(code, encoding="utf-8")
        (workdir / "bootstrap.py").write_text(_BOOTSTRAP.format(cfg=cfg), encoding="utf-8")
        out_path, err_path = workdir / "stdout.txt", workdir / "stderr.txt"
        if drop:
            for p in (workdir, *workdir.iterdir()):
                os.chown(p, NOBODY_UID, NOBODY_GID)
        # Output goes to files under RLIMIT_FSIZE, so a program printing forever cannot fill our memory.
        with open(out_path, "wb") as out_f, open(err_path, "wb") as err_f:
            t0 = time.monotonic()
            proc = subprocess.Popen(
                [os.path.realpath(sys.executable), "-I", "-B", "bootstrap.py"],
                cwd=workdir,
                env=_scrubbed_env(workdir),
                stdin=subprocess.DEVNULL,
                stdout=out_f,
                stderr=err_f,
                start_new_session=True,
                close_fds=True,
                preexec_fn=lambda: _limit_child(limits, running_as_root),
            )
            pgid = proc.pid  # start_new_session: the child leads its own group
            timed_out = False
            try:
                returncode: int | None = proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(pgid)
                returncode = proc.wait()
            finally:
                # Anything the program left behind in its group goes too.
                _kill_group(pgid)
            duration_s = time.monotonic() - t0
        # The folder's random name would make identical runs print different tracebacks (and
        # eval predictions differ run to run): it reads as a fixed name instead.
        stdout = _read_capped(out_path, limits.output_bytes).replace(str(workdir), SANDBOX_DIR_NAME)
        stderr = _read_capped(err_path, limits.output_bytes).replace(str(workdir), SANDBOX_DIR_NAME)
        # RLIMIT_CPU ends a busy loop with SIGXCPU before the wall clock: it is a timeout too.
        if timed_out or returncode == -signal.SIGXCPU:
            status: Status = "timeout"
        else:
            status = "ok" if returncode == 0 else "error"
        return SandboxResult(status, None if timed_out else returncode, stdout, stderr, duration_s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
