"""Code sandbox: runs model-written Python in separate, resource-limited processes and reports what
happened. `run_python` runs one program; `run_tests` judges a solution against trusted tests run in
a second process, the two exchanging only plain data, so the solution cannot fake a pass. The
OS-level half (namespaces, the minimal root, the syscall filter) is `lockstep.evaluate.containment`;
this module keeps the order of the steps (the tie to the harness's life, containment, files,
limits, filter, exec, uid drop) in one place, `_prepare_child` and `_COMMON`, where it is easiest
to audit.

It contains the mistakes and reward hacks of model-written code, and the attacks tried against it
(see tests/test_sandbox*.py); everything below holds only as far as Linux does (same kernel).

Threat model, by mode (`os_containment()` probes each part once and logs what is off, and why).

As root with namespaces (the harness runs as root on Linux; the kernel grants namespaces and
seccomp):
- identity: each sandboxed process runs under a uid of its own, fresh per run (from
  1879048192..2147483647, a range systemd documents as unused), so no unprivileged process on the
  machine may signal or trace it, nor it them; RLIMIT_NPROC 0, so no new process or thread;
- processes: its own PID namespace, where only our PID 1 (which reaps it and, when killed at the
  deadline, takes the whole namespace with it) is beside it: it sees no other process, cannot
  signal one (`kill(-1, 9)` reaches nothing), and no /proc is mounted;
- files: its own mount namespace with a minimal read-only root: the interpreter, its stdlib and
  shared libraries, /dev/null, zero, random and urandom, and at /sandbox a fresh tmpfs of
  `disk_bytes` (noexec), the only writable place. The host's root is unmounted, so host files,
  FIFOs, pathname unix sockets and the eval sets (with their reference solutions) do not exist
  for it; RLIMIT_FSIZE caps each file;
- network: a private network namespace with a loopback that is down (abstract unix sockets are
  per namespace too); a private IPC namespace;
- syscalls: a seccomp filter refuses memfd_create and SysV IPC (memory no rlimit counts), socket
  and socketpair, mknod, new namespaces and mounts, setsid/setpgid (leaving the group killed at
  the deadline), io_uring, bpf, ptrace and keyrings, signals to any process but itself, and
  PR_SET_PDEATHSIG with any signal but SIGKILL;
- time and memory: RLIMIT_CPU, RLIMIT_AS, RLIMIT_NOFILE 64 (which with file_bytes bounds what
  open files can hold if the filter is off), no core files, a wall-clock kill of the process group;
- lifetime: a sandbox ends with its harness (killed, terminated, or out of memory): the waiter
  gets SIGKILL when the harness thread that started it ends (PR_SET_PDEATHSIG), PID 1 when the
  waiter ends, the program with PID 1. Working folders are named by their maker's pid and start
  time; a harness's first run removes those whose maker is gone;
- the harness: a scrubbed environment, no stdin; output is read through handles opened before the
  program starts, never by a path the program can reach.
Without the filter (a kernel without seccomp), memfd and SysV memory are bounded only by
RLIMIT_NOFILE x file_bytes; the rest holds.

Without namespaces (a non-root harness, or a kernel or container that refuses them):
- identity, rlimits and the harness as above when the harness is root; a non-root harness's
  programs run under its own uid, and only the filter keeps them from signalling it;
- processes: other processes are visible (/proc); the program is the harness's own child and gets
  SIGKILL when its harness ends (set before exec, and again after the uid drop, which clears it);
- files: host files readable and host FIFOs writable as far as permissions allow; writes outside
  the folder held only by file permissions and Python-level guards a program can bypass
  (`posix.open`); disk by RLIMIT_FSIZE per file and a check of the folder's total after the run;
- syscalls: the filter needs no root and stays on where the kernel has seccomp (x86_64 and
  aarch64 tables): no memfd or SysV IPC, no new socket of any kind (socket and socketpair, so no
  host unix socket such as /dev/log and no network), no signal to another process (kill(-1)), no
  clearing of the death signal. Without the filter these are all open as far as permissions allow,
  and open files hold at most RLIMIT_NOFILE x file_bytes.
Not contained in any mode: side channels, kernel bugs, and a caller passing
`drop_privileges=False` as root where the filter is off (root can undo mounts).

What `run_tests` leaves open: the tests are trusted text and are not guarded against themselves;
arguments and return values are copied as plain data, so tests that pass the solution a function,
or rely on it mutating an argument, cannot be judged. A call of the solution that raises (or whose
process ends, or writes a reply that is not one of the protocol's) fails the item even where the
tests catch the error, and the tests' stderr says why: correct solutions do not raise,
and a StopIteration would otherwise read as the end of a `map` in `all(map(candidate, ...))`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Literal

from lockstep.evaluate import containment

log = logging.getLogger(__name__)

Status = Literal["ok", "error", "timeout"]

# When the harness runs as root, each sandboxed process runs under a uid of its own, drawn per run
# from 1879048192..2147483647, which systemd's UIDS-GIDS.md documents as used by no account,
# service or container range: the kernel exempts root from RLIMIT_NPROC, so a fork limit holds
# only under another uid; and a process may signal or trace only processes of its own uid, so the
# solution cannot reach the tests judging it, a program's kill(-1) reaches no other process, and
# nothing else on the machine can end a sandbox. Under the shared uid 65534 any process of
# `nobody` could, and a solution killed while loading read as "the solution process ended".
_SANDBOX_UIDS = range(1879048192, 2147483648)
NOBODY_GID = 65534  # the group of every sandboxed process: groups give no right to signal
_CAPTURE_READ_BYTES = 1 << 20
# Each open file may hold up to file_bytes that RLIMIT_AS does not count (a memfd, a pipe's buffer):
# with the syscall filter off, this is their bound. Passed pipes keep their numbers, whatever they are.
_MAX_OPEN_FILES = 64
_LINUX = sys.platform.startswith("linux")
SANDBOX_DIR_NAME = containment.WORKDIR  # how the program's working folder appears in its output


class SandboxError(RuntimeError):
    """The sandbox could not start a program (not: the program failed)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0        # wall clock; the whole process group is killed at this time
    memory_bytes: int = 512 << 20  # RLIMIT_AS (virtual address space)
    file_bytes: int = 1 << 20      # RLIMIT_FSIZE: largest file the program may write, stdout included
    output_bytes: int = 16 << 10   # stdout/stderr kept in the result (each)
    disk_bytes: int = 8 << 20      # all files in the working folder together


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    status: Status  # ok: exit 0; error: nonzero exit, killed by a limit or over disk_bytes; timeout: wall clock or CPU
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float

    @property
    def passed(self) -> bool:
        return self.status == "ok"


@dataclasses.dataclass(frozen=True)
class TestRunResult:
    status: Status           # ok: the tests ran to their last line; error: they did not; timeout: a clock ran out
    tests: SandboxResult     # the process that ran the tests (their assertion tracebacks are in its stderr)
    solution: SandboxResult  # the process that ran the solution (what the solution printed)

    @property
    def passed(self) -> bool:
        return self.status == "ok"


@dataclasses.dataclass(frozen=True)
class Containment:
    namespaces: bool  # own PID, mount, network and IPC namespaces; a minimal root with a tmpfs working folder
    reason: str                  # why not, when not
    syscall_filter: bool = False  # the seccomp filter of lockstep.evaluate.containment
    filter_reason: str = ""      # why not, when not


# ---------------------------------------------------------------------------------------------
# Programs run inside the sandbox. Each is prefixed with `_cfg = {...}` by the harness.

# The stdlib modules every sandboxed process imports before it drops root (without a minimal root,
# the interpreter's own folder may be unreadable after the uid drop); os_containment checks that
# the minimal root serves them.
_PRELOAD = ("import collections, functools, itertools, math, re, string, heapq, bisect, fractions, decimal, "
            "statistics, typing, operator, copy, json, random, io, dataclasses, enum, hashlib, time, "
            "subprocess, shutil, pathlib, traceback, types, textwrap, unicodedata, _posixsubprocess")


# Runs first in every sandboxed process. It pre-imports _PRELOAD, drops root, caps process creation,
# and removes the Python-level doors to new processes, foreign files and native code. Those doors
# give early, readable errors; the namespaces, the minimal root and the syscall filter hold whatever
# door is used.
_COMMON = "import builtins, os, resource, sys\n" + _PRELOAD + "\n" + r'''
_root = os.path.realpath(os.getcwd())
if os.geteuid() == 0 and _cfg["drop_uid"] is not None:
    if _cfg["harness_pid"] is not None:
        import ctypes  # before the uid drop, after which the stdlib may be unreadable
        _prctl = ctypes.CDLL(None).prctl
    os.setgroups([])
    os.setgid(_cfg["drop_gid"])
    os.setuid(_cfg["drop_uid"])
    if _cfg["harness_pid"] is not None:
        # The kernel clears the parent-death signal set before exec on any change of uid: set it
        # again (PR_SET_PDEATHSIG, SIGKILL), and end now if the harness has gone in between.
        _prctl(1, 9, 0, 0, 0)
        if os.getppid() != _cfg["harness_pid"]:
            os._exit(1)
        del ctypes, _prctl
# Set after the uid drop: the kernel exempts root, and execve after setuid would trip the limit.
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))

def _forbidden(name):
    def deny(*args, **kwargs):
        raise PermissionError(f"sandbox: {name} is not allowed")
    return deny

for _name in ("fork", "forkpty", "vfork", "system", "popen", "execv", "execve", "execl", "execle",
              "execlp", "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnl", "spawnle",
              "spawnlp", "spawnlpe", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "kill",
              "killpg", "setsid", "setpgid", "putenv", "unsetenv", "chroot", "chown", "lchown",
              "setuid", "setgid", "setreuid", "setresuid"):
    if hasattr(os, _name):
        setattr(os, _name, _forbidden("os." + _name))
subprocess.Popen = _forbidden("subprocess.Popen")
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
        raise PermissionError(f"sandbox: writing outside the working folder is not allowed: {file!r}")
    return _open(file, mode, *args, **kwargs)
builtins.open = _guarded_open
io.open = _guarded_open

_os_open = os.open
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
def _guarded_os_open(path, flags, *args, **kwargs):
    if flags & _WRITE_FLAGS and not _inside(path):
        raise PermissionError(f"sandbox: writing outside the working folder is not allowed: {path!r}")
    return _os_open(path, flags, *args, **kwargs)
os.open = _guarded_os_open
for _name in ("remove", "unlink", "rmdir", "rename", "replace", "mkdir", "makedirs", "symlink", "link", "truncate",
              "chmod"):
    _real = getattr(os, _name)
    def _guard(*args, _real=_real, _name=_name, **kwargs):
        if (args and not _inside(args[0])
                or len(args) > 1 and _name in ("rename", "replace", "symlink", "link") and not _inside(args[1])):
            raise PermissionError(f"sandbox: os.{_name} outside the working folder is not allowed")
        return _real(*args, **kwargs)
    setattr(os, _name, _guard)
shutil.rmtree = _forbidden("shutil.rmtree")
del _name, _mod
'''

_PROGRAM_MAIN = r'''
with _open("program.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "program.py", "exec")
del _cfg
_globals = {"__name__": "__main__", "__builtins__": builtins}
exec(_code, _globals)
'''

# What crosses between the tests and the solution: plain data only, rebuilt on the other side, so
# an object of the solution's (one whose __eq__ always says True, say) never reaches the tests.
_CODEC = r'''
class _Unsendable(TypeError):
    pass

def _enc(v, depth=0):
    if depth > 100:
        raise _Unsendable("data nested more than 100 deep")
    # Subclasses are read through the base type's own methods, so their overrides never run here.
    if v is None or type(v) is bool:
        return v
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, int):
        return int.__index__(v)
    if isinstance(v, float):
        return {"float": float.__repr__(v)}
    if isinstance(v, complex):
        c = complex.__complex__(v)
        return {"complex": [c.real, c.imag]}
    if isinstance(v, (bytes, bytearray)):
        return {"bytes" if isinstance(v, bytes) else "bytearray": bytes(v).hex()}
    if isinstance(v, list):
        return [_enc(x, depth + 1) for x in list.__iter__(v)]
    if isinstance(v, tuple):
        return {"tuple": [_enc(x, depth + 1) for x in tuple.__iter__(v)]}
    if isinstance(v, dict):
        return {"dict": [[_enc(k, depth + 1), _enc(x, depth + 1)] for k, x in dict.items(v)]}
    if isinstance(v, (set, frozenset)):
        return {"set" if isinstance(v, set) else "frozenset":
                [_enc(x, depth + 1) for x in frozenset.__iter__(frozenset(v))]}
    raise _Unsendable(f"a value of type {type(v).__name__} cannot pass between the tests and the solution; "
                      "only plain data (None, bool, int, float, complex, str, bytes, list, tuple, dict, set) crosses")

def _dec(v):
    if isinstance(v, list):
        return [_dec(x) for x in v]
    if not isinstance(v, dict):
        return v
    (tag, x), = v.items()
    if tag == "float":
        return float(x)
    if tag == "complex":
        return complex(x[0], x[1])
    if tag in ("bytes", "bytearray"):
        return (bytes if tag == "bytes" else bytearray).fromhex(x)
    if tag == "tuple":
        return tuple(_dec(y) for y in x)
    if tag == "dict":
        return {_dec(k): _dec(y) for k, y in x}
    if tag in ("set", "frozenset"):
        return (set if tag == "set" else frozenset)(_dec(y) for y in x)
    raise ValueError(f"unknown tag {tag!r}")

_MAX_LINE = 16 << 20
'''

# The solution process: defines the solution, then answers calls until the tests hang up.
_SOLUTION_MAIN = r'''
_calls = os.fdopen(_cfg["call_fd"], "rb")
_replies = os.fdopen(_cfg["reply_fd"], "wb", buffering=0)
_entry = _cfg["entry_point"]
del _cfg

def _send(obj):
    _replies.write(json.dumps(obj).encode() + b"\n")

def _describe(exc):
    try:
        return [type(exc).__name__, str(exc)[:2000]]
    except BaseException:
        return [type(exc).__name__, "(its message could not be read)"]

with _open("solution.py", encoding="utf-8") as _f:
    _source = _f.read()
_globals = {"__name__": "__main__", "__builtins__": builtins}
try:
    exec(compile(_source, "solution.py", "exec"), _globals)
except BaseException as _exc:  # SystemExit too: a solution that exits while loading has not loaded
    traceback.print_exc()
    _send({"load_error": _describe(_exc)})
    sys.stderr.flush()
    os._exit(1)
_fn = _globals.get(_entry)
if not callable(_fn):
    _send({"load_error": ["NameError", f"the solution defines no function {_entry}"]})
    os._exit(1)
_send({"ready": True})
while True:
    _line = _calls.readline(_MAX_LINE)
    if not _line:
        break
    _request = json.loads(_line)
    try:
        _value = _fn(*_dec(_request["args"]), **_dec(_request["kwargs"]))
    except BaseException as _exc:
        _reply = {"raised": _describe(_exc)}
    else:
        try:
            _reply = {"value": _enc(_value)}
        except _Unsendable as _exc:
            _reply = {"unsendable": str(_exc)}
    _send(_reply)
sys.stdout.flush()
os._exit(0)
'''

# The tests process: runs only trusted text (the item's context and tests); the entry point is a
# proxy that calls the solution in the other process. It proves it reached the tests' last line by
# writing a per-run token, which it read from a pipe at start, to a pipe only it holds.
_TESTS_MAIN = r'''
_token = os.read(_cfg["token_fd"], 64)
os.close(_cfg["token_fd"])
_marker_fd = _cfg["marker_fd"]
_calls = os.fdopen(_cfg["call_fd"], "wb", buffering=0)
_replies = os.fdopen(_cfg["reply_fd"], "rb")
_entry = _cfg["entry_point"]
del _cfg

class SolutionError(BaseException):
    """A call of the solution failed: it raised, its process ended or wrote a malformed reply, or it
    returned something that is not plain data. A BaseException, so that the tests' `except
    Exception` (or `map`/`all`/a generator, which take a StopIteration for the end of the data)
    never mistakes it for an answer; and remembered, so that the run fails even where the tests
    catch it."""

_failures = []

def _fail(message):
    error = SolutionError(message)
    _failures.append(error)
    raise error from None

def _two_strings(body):
    return type(body) is list and len(body) == 2 and all(type(x) is str for x in body)

# What each kind of reply carries; anything else the solution process writes fails the call.
_SHAPES = {
    "ready": lambda body: body is True,
    "load_error": _two_strings,  # [exception type, message]
    "raised": _two_strings,
    "unsendable": lambda body: type(body) is str,
    "value": lambda body: True,  # decoded by the proxy, where any error fails the call
}

def _receive(during, kinds):
    """The next reply as (kind, body), one of `kinds`; fails the call on anything else."""
    line = _replies.readline(_MAX_LINE)
    if not line.endswith(b"\n"):
        _fail(f"the solution process ended {during}" if len(line) < _MAX_LINE else "the solution's reply is too long")
    try:
        reply = json.loads(line)
    except Exception as exc:  # not only ValueError: a reply nested 100k deep raises RecursionError
        _fail(f"the solution process wrote a reply that does not decode {during} ({type(exc).__name__})")
    kind = next(iter(reply)) if type(reply) is dict and len(reply) == 1 else None
    if kind not in kinds or not _SHAPES[kind](reply[kind]):
        _fail(f"the solution process wrote a malformed reply {during}: {line[:100]!r}")
    return kind, reply[kind]

_kind, _body = _receive("while loading", ("ready", "load_error"))
if _kind == "load_error":
    _fail("the solution did not load: {}: {}".format(*_body))

def _candidate(*args, **kwargs):
    # Arguments the tests cannot send raise _Unsendable (a TypeError) here: the tests' own doing.
    request = json.dumps({"args": _enc(list(args)), "kwargs": _enc(kwargs)}).encode() + b"\n"
    try:
        _calls.write(request)
    except BrokenPipeError:
        _fail("the solution process has ended")
    kind, body = _receive("during a call", ("value", "raised", "unsendable"))
    if kind == "raised":
        _fail("the solution raised {}: {}".format(*body))
    if kind == "unsendable":
        _fail(body)
    try:
        return _dec(body)
    except Exception as exc:
        _fail(f"the solution process wrote a value that does not decode ({type(exc).__name__}: {exc})"[:300])
_candidate.__name__ = _entry

_globals = {"__name__": "__main__", "__builtins__": builtins}
for _name in ("setup.py", "tests.py"):
    with _open(_name, encoding="utf-8") as _f:
        _code = compile(_f.read(), _name, "exec")
    exec(_code, _globals)
    _globals[_entry] = _candidate
sys.stdout.flush()
if _failures:
    sys.stderr.write(f"sandbox: the tests caught a failed call of the solution and went on; it fails the item: "
                     f"{_failures[0]}\n")
    sys.stderr.flush()
    os._exit(1)
sys.stderr.flush()
os.write(_marker_fd, _token)
os._exit(0)
'''


# ---------------------------------------------------------------------------------------------
# What this machine grants (lockstep.evaluate.containment does the work).

def _interpreter() -> str:
    return os.path.realpath(sys.executable)


@functools.cache
def os_containment() -> Containment:
    """What of the OS-level containment this machine grants (checked once, each part in a throwaway
    child with the same steps a run takes), and why not where it does not; logged once."""
    if not sys.platform.startswith("linux"):
        reason = f"namespaces and seccomp are Linux-only (platform {sys.platform})"
        result = Containment(False, reason, False, reason)
    else:
        filter_reason = containment.probe_filter(_interpreter())
        reason = containment.probe_namespaces(_interpreter(), _PRELOAD, with_filter=not filter_reason,
                                              dir_prefix=_WORKDIR_PREFIX + _owner_tag())
        result = Containment(not reason, reason, not filter_reason, filter_reason)
    if result.namespaces:
        log.info(
            "sandbox: own PID, mount, network and IPC namespaces; a minimal read-only root with a tmpfs working folder"
        )
    else:
        log.warning("sandbox: no namespaces or minimal root, so host files and processes are reachable as far as "
                    "permissions allow, and only the uid drop, rlimits, Python-level guards and the syscall filter "
                    "(if on) hold: %s", result.reason)
    if result.syscall_filter:
        log.info("sandbox: syscall filter on (memfd, SysV IPC, socket, socketpair, mknod, namespaces, mounts, setsid, "
                 "signals to others)")
    else:
        log.warning("sandbox: no syscall filter, so memfd and SysV shared memory are bounded only by "
                    "RLIMIT_NOFILE x file_bytes (and without namespaces, host unix sockets are reachable): %s",
                    result.filter_reason)
    return result


# ---------------------------------------------------------------------------------------------
# Starting, waiting for and collecting sandboxed processes.

def _scrubbed_env(workdir: str) -> dict[str, str]:
    # Nothing of the parent's environment (tokens, paths, proxies) reaches the program.
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
    }


def _prepare_child(limits: SandboxLimits, host_dir: str, files: dict[str, bytes], owner: tuple[int, int] | None,
                   found: Containment, running_as_root: bool, harness_pid: int) -> None:
    # Runs in the child between fork and exec, in this order: the tie to the harness's life (this
    # process is the waiter with namespaces, the program without), containment (which forks: from
    # here on this is the program's process), its files, limits, and the filter last, since it
    # refuses the mounts and namespaces the first step needs.
    if _LINUX:
        containment.die_with_parent(harness_pid)
    if found.namespaces:
        containment.contain(host_dir, limits.disk_bytes, owner or (os.geteuid(), os.getegid()), _interpreter())
    # Written by the harness's side of the fork, into the working folder (Popen changed into
    # `host_dir`; with namespaces, containment changed into the program's tmpfs).
    for name, data in files.items():
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, data)
            if owner is not None:
                os.fchown(fd, *owner)
        finally:
            os.close(fd)
    cpu_s = max(1, int(limits.timeout_s) + 1)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (_MAX_OPEN_FILES, _MAX_OPEN_FILES))
    if not running_as_root:
        # No new processes or threads at all; the bootstrap sets it again after a uid drop.
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    if found.syscall_filter:
        containment.install_filter()


@dataclasses.dataclass
class _Child:
    proc: subprocess.Popen
    workdir: Path
    stdout: IO[bytes]
    stderr: IO[bytes]


def _start(main: str, cfg: dict, files: dict[str, str], limits: SandboxLimits, *, uid: int | None,
           pass_fds: tuple[int, ...], workdir: Path) -> _Child:
    running_as_root = os.geteuid() == 0
    found = os_containment()
    owner = (uid, NOBODY_GID) if uid is not None else None
    harness_pid = os.getpid()
    # Without namespaces the program is the harness's child, whose parent-death signal the uid drop
    # clears: the bootstrap sets it again. With them, PID 1 takes the program along.
    rearm = _LINUX and uid is not None and running_as_root and not found.namespaces
    cfg = {**cfg, "drop_uid": uid, "drop_gid": NOBODY_GID, "harness_pid": harness_pid if rearm else None}
    bootstrap = f"_cfg = {cfg!r}\n" + _COMMON + main
    payload = {name: text.encode("utf-8") for name, text in {"bootstrap.py": bootstrap, **files}.items()}
    if owner is not None and not found.namespaces:
        os.chown(workdir, *owner)
    # Output goes to unnamed files opened here, before the program runs, and is read back through
    # these same handles: the program cannot swap them for links to files it may not read.
    # RLIMIT_FSIZE holds their size, so a program printing forever cannot fill our memory.
    out_f, err_f = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen(
            [_interpreter(), "-I", "-B", "bootstrap.py"],
            cwd=workdir,
            env=_scrubbed_env(containment.WORKDIR if found.namespaces else str(workdir)),
            stdin=subprocess.DEVNULL,
            stdout=out_f,
            stderr=err_f,
            start_new_session=True,
            close_fds=True,
            pass_fds=pass_fds,
            preexec_fn=lambda: _prepare_child(
                limits, str(workdir), payload, owner, found, running_as_root, harness_pid
            ),
        )
    except subprocess.SubprocessError as e:
        out_f.close()
        err_f.close()
        raise SandboxError(f"could not start a sandboxed process in {workdir}: {e}; "
                           f"os_containment() reports {os_containment()}") from e
    except BaseException:
        out_f.close()
        err_f.close()
        raise
    return _Child(proc, workdir, out_f, err_f)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _wait(child: _Child, deadline: float) -> tuple[int | None, bool]:
    """(return code, timed out); the child's whole process group is gone afterwards."""
    pgid = child.proc.pid  # start_new_session: the child leads its own group
    timed_out = False
    try:
        returncode: int | None = child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(pgid)
        returncode = child.proc.wait()
    finally:
        # Anything the program left behind in its group goes too.
        _kill_group(pgid)
    return returncode, timed_out


def _read_capped(f: IO[bytes], cap_bytes: int) -> str:
    f.seek(0)
    data = f.read(min(cap_bytes, _CAPTURE_READ_BYTES) + 1)
    text = data[:cap_bytes].decode("utf-8", errors="replace")
    return text + ("\n[output truncated]" if len(data) > cap_bytes else "")


def _tree_bytes(root: Path) -> int:
    total = 0
    for folder, _, names in os.walk(root):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def _collect(
    child: _Child, returncode: int | None, timed_out: bool, limits: SandboxLimits, duration_s: float
) -> SandboxResult:
    # The folder's random name would make identical runs print different tracebacks (and eval
    # predictions differ run to run): it reads as a fixed name instead.
    stdout = _read_capped(child.stdout, limits.output_bytes).replace(str(child.workdir), SANDBOX_DIR_NAME)
    stderr = _read_capped(child.stderr, limits.output_bytes).replace(str(child.workdir), SANDBOX_DIR_NAME)
    # RLIMIT_CPU ends a busy loop with SIGXCPU before the wall clock: it is a timeout too.
    if timed_out or returncode == -signal.SIGXCPU:
        status: Status = "timeout"
    else:
        status = "ok" if returncode == 0 else "error"
    # With namespaces the tmpfs holds the total and the host's folder stays empty; without them,
    # this is the only total-size check (after the fact).
    used = _tree_bytes(child.workdir)
    if used > limits.disk_bytes:
        status = "error" if status == "ok" else status
        stderr += f"\nsandbox: the program left {used} bytes in its folder, over disk_bytes={limits.disk_bytes}"
    return SandboxResult(status, None if timed_out else returncode, stdout, stderr, duration_s)


def _fresh_uids(n: int) -> list[int]:
    """`n` distinct uids for this run's sandboxed processes (two runs at once share one with
    odds below 1e-8 per pair)."""
    return secrets.SystemRandom().sample(_SANDBOX_UIDS, n)


def _check_limits(limits: SandboxLimits) -> None:
    bad = [f.name for f in dataclasses.fields(limits) if not getattr(limits, f.name) > 0]
    if bad:
        raise ValueError(f"sandbox limits must be positive, got {', '.join(f'{n}={getattr(limits, n)}' for n in bad)}; "
                         "fix the eval stage's sandbox_* params")


# ---------------------------------------------------------------------------------------------
# Working folders, named by the harness process that made them, so that a later harness can
# remove those whose maker was killed before its own cleanup ran (SIGKILL, an OOM kill).

_WORKDIR_PREFIX = "lockstep-sandbox-"
_OWNED = re.compile(re.escape(_WORKDIR_PREFIX) + r"(\d+)-(\d+)-(\d+)-")  # PID namespace, pid, start time


def _process_start(pid: int) -> str | None:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat's 22nd field: a pid is
    reused, a pid with its start time is not); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()[19].decode()  # fields from the 3rd on, after the name


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _owner_tag() -> str:
    """`NS-PID-START-` for this process, or '' where /proc cannot say (such folders are never
    judged stale)."""
    ns, pid = _pid_namespace(), os.getpid()
    start = _process_start(pid)
    return f"{ns}-{pid}-{start}-" if ns is not None and start is not None else ""


def _owner_alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another uid
    now = _process_start(pid)
    return now is None or now == start  # unreadable (hidepid): taken as alive


@functools.cache
def _remove_stale_workdirs(parent: str) -> None:
    """Remove the sandbox folders in `parent` whose maker, in this PID namespace, is gone (once
    per folder per process: a harness killed mid-run leaves its folders behind)."""
    ns, removed = _pid_namespace(), 0
    with contextlib.suppress(OSError), os.scandir(parent) as entries:
        for entry in entries:
            owner = _OWNED.match(entry.name)
            if (owner is None or int(owner[1]) != ns or not entry.is_dir(follow_symlinks=False)
                    or _owner_alive(int(owner[2]), owner[3])):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += not os.path.lexists(entry.path)
    if removed:
        log.info("sandbox: removed %d working folders in %s left by harness processes that are gone", removed, parent)


@contextlib.contextmanager
def _workdirs(n: int):
    _remove_stale_workdirs(tempfile.gettempdir())
    dirs = [Path(tempfile.mkdtemp(prefix=_WORKDIR_PREFIX + _owner_tag())) for _ in range(n)]
    try:
        yield dirs
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, drop_privileges: bool = True) -> SandboxResult:
    """Run `code` as `__main__` in a fresh interpreter: its own session and process group, a
    private working folder, a scrubbed environment, no stdin, rlimits on CPU, memory, file size and
    processes, namespaces where `os_containment()` allows, and a hard wall-clock kill of the whole
    group. When the caller is root and `drop_privileges` is set, the program runs under a uid of its
    own (see `_SANDBOX_UIDS`).
    `status == "ok"` means only that the program exited 0; to judge code against tests, use
    `run_tests`, which a program cannot fool by exiting early."""
    _check_limits(limits)
    os_containment()  # probed once, before the clock starts: it is not the program's time
    uid = _fresh_uids(1)[0] if os.geteuid() == 0 and drop_privileges else None
    with _workdirs(1) as (workdir,):
        t0 = time.monotonic()
        child = _start(_PROGRAM_MAIN, {}, {"program.py": code}, limits, uid=uid, pass_fds=(), workdir=workdir)
        with child.stdout, child.stderr:
            returncode, timed_out = _wait(child, t0 + limits.timeout_s)
            return _collect(child, returncode, timed_out, limits, time.monotonic() - t0)


def run_tests(solution: str, tests: str, *, entry_point: str, setup: str = "",
              limits: SandboxLimits = SandboxLimits(), drop_privileges: bool = True) -> TestRunResult:
    """Judge `solution` (untrusted code defining `entry_point`) with `tests` (trusted code that
    calls `entry_point`, e.g. HumanEval's `check(candidate)` and the call `check(entry)`), after
    `setup` (trusted code the tests lean on, e.g. helpers from the item's prompt).

    The two run in separate sandboxed processes: the tests call `entry_point` through a proxy that
    sends the arguments to the solution process and gets back its return value or exception, as
    plain data. The run passes only when the tests process reaches the tests' last line and says
    so with a per-run token that never enters the solution process: exiting 0 early, `os._exit`,
    atexit hooks, printed fake markers and patched builtins or assert machinery in the solution
    count for nothing. Arguments and return values are copied, so a test relying on the solution
    mutating its argument, or passing it a function, cannot be judged this way."""
    _check_limits(limits)
    if not entry_point.isidentifier():
        raise ValueError(f"entry_point {entry_point!r} is not a Python name; fix the code item's `entry_point`")
    os_containment()  # probed once, before the clock starts: it is not the solution's time
    solution_uid, tests_uid = _fresh_uids(2) if os.geteuid() == 0 and drop_privileges else (None, None)
    token = secrets.token_hex(16).encode()
    call_r, call_w = os.pipe()      # tests -> solution
    reply_r, reply_w = os.pipe()    # solution -> tests
    token_r, token_w = os.pipe()    # harness -> tests, once, before they start
    marker_r, marker_w = os.pipe()  # tests -> harness, at their last line
    fds = [call_r, call_w, reply_r, reply_w, token_r, token_w, marker_r, marker_w]
    children: list[_Child] = []

    def close(*which: int) -> None:
        for fd in which:
            if fd in fds:
                fds.remove(fd)
                os.close(fd)

    try:
        os.write(token_w, token)
        close(token_w)
        with _workdirs(2) as (solution_dir, tests_dir):
            t0 = time.monotonic()
            children.append(
                _start(
                    _CODEC + _SOLUTION_MAIN,
                    {"call_fd": call_r, "reply_fd": reply_w, "entry_point": entry_point},
                    {"solution.py": solution},
                    limits,
                    uid=solution_uid,
                    pass_fds=(call_r, reply_w),
                    workdir=solution_dir,
                )
            )
            children.append(_start(_CODEC + _TESTS_MAIN,
                                   {"call_fd": call_w, "reply_fd": reply_r, "token_fd": token_r, "marker_fd": marker_w,
                                    "entry_point": entry_point},
                                   {"setup.py": setup, "tests.py": tests}, limits, uid=tests_uid,
                                   pass_fds=(call_w, reply_r, token_r, marker_w), workdir=tests_dir))
            # Only the children hold their ends now: each sees end-of-file when the other ends.
            close(call_r, call_w, reply_r, reply_w, token_r, marker_w)
            solution_proc, tests_proc = children
            deadline = t0 + limits.timeout_s
            tests_rc, tests_timed_out = _wait(tests_proc, deadline)
            # The tests are over: the solution reads end-of-file and exits; a second is its grace.
            solution_rc, solution_timed_out = _wait(solution_proc, min(deadline, time.monotonic() + 1.0))
            duration_s = time.monotonic() - t0
            with os.fdopen(marker_r, "rb") as f:
                fds.remove(marker_r)
                marker = f.read(len(token) + 1)
            tests_result = _collect(tests_proc, tests_rc, tests_timed_out, limits, duration_s)
            solution_result = _collect(solution_proc, solution_rc, solution_timed_out, limits, duration_s)
    finally:
        for child in children:
            _kill_group(child.proc.pid)
            child.stdout.close()
            child.stderr.close()
        close(*list(fds))
    finished = tests_result.status == "ok" and marker == token
    if finished:
        status: Status = "ok"
    elif tests_result.status == "timeout" or solution_result.returncode == -signal.SIGXCPU:
        status = "timeout"
    else:
        status = "error"
    return TestRunResult(status, tests_result, solution_result)
