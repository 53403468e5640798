"""The sandbox's OS-level containment against what a hostile program reached past read-only mounts
and a network namespace: host FIFOs and unix sockets, other processes, memory outside the rlimits,
the eval sets on disk, the deadline's group kill. Each test is an attack that worked before the
program got its own PID namespace, a minimal root and a syscall filter."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from lockstep.evaluate.sandbox import SandboxLimits, os_containment, run_python

FAST = SandboxLimits(timeout_s=3.0, memory_bytes=256 << 20, file_bytes=2 << 20, output_bytes=8 << 10)
ROOT = Path(__file__).resolve().parents[1]


def _needs_namespaces() -> None:
    found = os_containment()
    if not found.namespaces:
        pytest.skip(f"the sandbox has no namespaces or minimal root here: {found.reason}")


def _needs_filter() -> None:
    found = os_containment()
    if not found.syscall_filter:
        pytest.skip(f"the sandbox has no syscall filter here: {found.filter_reason}")


@pytest.fixture
def host_dir():
    # A folder any user can reach on the host: the system temp dir, not tmp_path (private to root).
    d = Path(tempfile.mkdtemp(prefix="lockstep-doors-"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_host_fifo_is_not_reachable(host_dir: Path) -> None:
    _needs_namespaces()
    fifo = host_dir / "pipe"
    os.mkfifo(fifo, 0o666)
    os.chmod(fifo, 0o666)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a listener, so an O_NONBLOCK writer could open it
    try:
        code = (
            "import posix\n"
            "try:\n"
            f"    fd = posix.open({str(fifo)!r}, posix.O_WRONLY | posix.O_NONBLOCK)\n"
            "    posix.write(fd, b'escaped')\n"
            "    print('wrote')\n"
            "except OSError as e:\n"
            "    print('refused', e.strerror)\n"
        )
        r = run_python(code, FAST)
        assert r.status == "ok", r.stderr
        assert r.stdout.startswith("refused"), r.stdout
        try:
            leaked = os.read(reader, 64)
        except BlockingIOError:
            leaked = b""
        assert leaked == b""
    finally:
        os.close(reader)


def _try_sockets(attempt: str) -> str:
    """What a program printed that runs `attempt` (lines using the socket module, its Python-level
    block undone) without the uid drop, so that the stdlib is readable whatever the host's
    permissions: 'done', or 'refused' and why."""
    body = "".join(f"    {line}\n" for line in attempt.splitlines())
    code = ("import sys\nfor m in ('socket', '_socket'):\n    sys.modules.pop(m, None)\nimport socket\n"
            f"try:\n{body}    print('done')\nexcept OSError as e:\n    print('refused', e.strerror)\n")
    r = run_python(code, FAST, drop_privileges=False)
    assert r.status == "ok", r.stderr
    return r.stdout


@pytest.mark.parametrize("address", ["path", "abstract"])
def test_host_unix_socket_is_not_reachable(host_dir: Path, address: str) -> None:
    _needs_namespaces()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = str(host_dir / "sock") if address == "path" else "\0" + host_dir.name
    try:
        server.bind(name)
        if address == "path":
            os.chmod(name, 0o777)
        server.listen(1)
        server.setblocking(False)
        # As root inside too: neither the uid nor the network namespace is what stops this.
        out = _try_sockets(
            f"s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\ns.connect({name!r})\ns.sendall(b'escaped')"
        )
        assert out.startswith("refused"), out
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()


@pytest.mark.parametrize("how", ["sendto", "connect"])
@pytest.mark.parametrize("mode", ["as_found", "filter_only"])
def test_host_datagram_socket_is_not_reachable(
    host_dir: Path, mode: str, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pathname datagram socket on the host, as /dev/log is. socket() is refused by the filter,
    # but a socketpair's datagram end reached it (2 of 2 datagrams) where there are no namespaces.
    _contain_as(mode, monkeypatch)
    found = os_containment()
    if mode == "as_found" and not (found.namespaces or found.syscall_filter):
        pytest.skip(f"neither namespaces nor the syscall filter here: {found.reason}; {found.filter_reason}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(host_dir / "log")
    try:
        listener.bind(path)
        os.chmod(path, 0o777)
        listener.setblocking(False)
        send = {"sendto": f"a.sendto(b'escaped', {path!r})", "connect": f"a.connect({path!r})\na.send(b'escaped')"}[how]
        # Without the uid drop, as a non-root harness runs it: the filter is what must stop it.
        out = _try_sockets(f"a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\n{send}")
        assert out.startswith("refused"), out
        with pytest.raises(BlockingIOError):
            listener.recv(64)
    finally:
        listener.close()


def test_program_cannot_see_or_signal_host_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_namespaces()
    if os.geteuid() != 0:
        pytest.skip("needs root to start a bystander under the sandbox's uid")
    # An unrelated process of the uid the program runs as (pinned here: each run has its own):
    # before PID namespaces, kill(-1, 9) took it.
    _pin_program_uid(65534, monkeypatch)
    bystander = subprocess.Popen(["sleep", "60"], user=65534, group=65534, start_new_session=True)
    try:
        code = (
            "import os, posix\n"
            "print('pid', os.getpid())\n"
            "for target in (-1, 0):\n"
            "    try:\n        posix.kill(target, 9)\n"
            "    except OSError as e:\n        print('kill', target, e.strerror)\n"
            f"try:\n    posix.kill({bystander.pid}, 9)\nexcept OSError as e:\n    print('kill bystander', e.strerror)\n"
            f"for path in ('/proc', '/proc/{os.getpid()}/cmdline'):\n"
            "    try:\n        print(path, os.listdir(path) if path == '/proc' else open(path, 'rb').read())\n"
            "    except OSError as e:\n        print(path, 'unreadable', e.strerror)\n"
        )
        r = run_python(code, FAST)
        time.sleep(0.2)
        assert bystander.poll() is None, "the sandboxed program killed a host process"
        assert r.status == "ok", r.stderr
        assert "pid 2\n" in r.stdout  # in its own namespace, beside the namespace's PID 1 only
        assert "/proc unreadable" in r.stdout and "cmdline unreadable" in r.stdout, r.stdout
    finally:
        bystander.kill()
        bystander.wait()


def test_concurrent_solution_survives_a_neighbour_killing_everything() -> None:
    _needs_namespaces()
    import threading

    slow = "import time\ntime.sleep(1.5)\nprint('alive')\n"
    killer = "import posix\nfor t in (-1, 0):\n    try:\n        posix.kill(t, 9)\n    except OSError:\n        pass\n"
    results = {}
    t = threading.Thread(target=lambda: results.setdefault("slow", run_python(slow, FAST)))
    t.start()
    time.sleep(0.5)
    run_python(killer, FAST)
    t.join()
    assert results["slow"].stdout.strip() == "alive", "a neighbouring program killed this one"
    assert results["slow"].status == "ok" and results["slow"].stdout.strip() == "alive"


@pytest.mark.parametrize("drop_privileges", [True, False])
def test_program_cannot_leave_the_group_killed_at_the_deadline(drop_privileges: bool) -> None:
    # The program is not its group's leader (the waiter is): setsid through ctypes (the
    # Python-level guard undone) would take it out of the group killed at the deadline. The
    # filter refuses the call, and without the filter the namespace's PID 1, which stays in the
    # group, takes the program with it when it is killed.
    # The program names itself (PR_SET_NAME) with a token of this run, so that what is looked for
    # afterwards is this program, not another sandbox's (an eval stage running beside the tests).
    token = f"leak{os.getpid() % 100000}{drop_privileges:d}"
    code = (
        "import sys, time\n"
        "for m in ('ctypes', '_ctypes'):\n"
        "    sys.modules.pop(m, None)\n"
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"print('named', libc.prctl(15, {token.encode()!r}, 0, 0, 0), flush=True)\n"
        "print('setsid', libc.setsid(), ctypes.get_errno(), flush=True)\n"
        "time.sleep(30)\n"
    )
    r = run_python(code, SandboxLimits(timeout_s=1.5, memory_bytes=256 << 20), drop_privileges=drop_privileges)
    assert r.status == "timeout" and "named 0\n" in r.stdout, r.stdout
    time.sleep(0.3)
    left = [p for p in psutil.process_iter(["name"]) if p.info["name"] == token]
    for p in left:
        p.kill()
    assert not left, "a sandboxed program outlived its deadline"


def _pin_program_uid(uid: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the program under `uid` instead of a fresh one, to put a bystander beside it."""
    from lockstep.evaluate import sandbox

    monkeypatch.setattr(sandbox, "_fresh_uids", lambda n: [uid - i for i in range(n)])


def _contain_as(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sandbox as this machine grants it (as_found), or one of the two fallbacks: no namespaces
    (not root, or a kernel that refuses them) with the syscall filter (filter_only) or without."""
    from lockstep.evaluate import sandbox
    from lockstep.evaluate.sandbox import Containment

    found = os_containment()
    if mode == "filter_only":
        if not found.syscall_filter:
            pytest.skip(f"no syscall filter here: {found.filter_reason}")
        monkeypatch.setattr(sandbox, "os_containment", lambda: Containment(False, "off for the test", True, ""))
    elif mode == "rlimits_only":
        monkeypatch.setattr(
            sandbox, "os_containment", lambda: Containment(False, "off for the test", False, "off for the test")
        )


@pytest.mark.parametrize("mode", ["as_found", "filter_only", "rlimits_only"])
def test_memfd_cannot_hold_memory_outside_the_limits(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _contain_as(mode, monkeypatch)
    # 600 one-MB anonymous files: none of it counts against RLIMIT_AS or the tmpfs cap.
    code = (
        "import os\n"
        "held = []\n"
        "try:\n"
        "    for i in range(600):\n"
        "        fd = os.memfd_create(f'm{i}')\n"
        "        os.write(fd, b'x' * (1 << 20))\n"
        "        held.append(fd)\n"
        "except OSError as e:\n"
        "    print('stopped', e.strerror)\n"
        "print('held', len(held))\n"
    )
    r = run_python(code, FAST)
    held_mb = int(r.stdout.split("held ")[-1])
    assert held_mb <= 64, (held_mb, r.stderr)  # at most RLIMIT_NOFILE files of file_bytes each
    if mode != "rlimits_only" and os_containment().syscall_filter:
        assert held_mb == 0 and "stopped Operation not permitted" in r.stdout


def test_without_namespaces_the_filter_still_stops_kill_all(monkeypatch: pytest.MonkeyPatch) -> None:
    _contain_as("filter_only", monkeypatch)
    if os.geteuid() != 0:
        pytest.skip("needs root to start a bystander under the sandbox's uid")
    _pin_program_uid(65534, monkeypatch)  # the bystander's: the filter, not the uid, must stop it
    bystander = subprocess.Popen(["sleep", "60"], user=65534, group=65534, start_new_session=True)
    try:
        r = run_python("import posix\ntry:\n    posix.kill(-1, 9)\nexcept OSError as e:\n    print(e.strerror)\n", FAST)
        time.sleep(0.2)
        assert bystander.poll() is None, "the sandboxed program killed a host process"
        assert r.status == "ok" and r.stdout.strip() == "Operation not permitted", (r.stdout, r.stderr)
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.parametrize(
    "call",
    [
        # SysV shared memory outlives its mapping: 64 MB per segment, none of it in RLIMIT_AS
        "libc.shmget(0, 64 << 20, 0o1600)",
        # a user namespace would let the program mount a tmpfs of its own, with no size cap
        "libc.unshare(0x10000000 | 0x00020000)",
        "libc.mknod(b'fifo', 0o10666, 0)",
        "libc.socket(1, 1, 0)",
        # a connected pair of its own, whose datagram end sendto/connect aims at any host socket path
        "libc.socketpair(1, 2, 0, (ctypes.c_int * 2)())",
        # clearing the parent-death signal that ends the program with its harness (no namespaces)
        "libc.prctl(1, 0, 0, 0, 0)",
    ],
)
@pytest.mark.parametrize("drop_privileges", [True, False])
def test_filtered_syscalls_are_refused(call: str, drop_privileges: bool) -> None:
    _needs_filter()
    code = (
        "import sys\n"
        "for m in ('ctypes', '_ctypes'):\n"
        "    sys.modules.pop(m, None)\n"
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"print('ret', {call}, ctypes.get_errno())\n"
    )
    r = run_python(code, FAST, drop_privileges=drop_privileges)
    assert r.status == "ok", r.stderr
    assert r.stdout.strip() == "ret -1 1", r.stdout  # EPERM


def test_eval_sets_and_host_files_are_not_visible(host_dir: Path) -> None:
    _needs_namespaces()
    answers = host_dir / "answers.jsonl"
    answers.write_text('{"canonical_solution": "return 42"}\n')
    answers.chmod(0o644)
    targets = [str(answers), str(ROOT / "evalsets" / "chat" / "code_own.jsonl"), "/etc/passwd", str(ROOT)]
    code = (
        "import os\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        print('read', path, len(open(path).read()) if os.path.isfile(path) else os.listdir(path))\n"
        "    except OSError as e:\n"
        "        print('hidden', path, e.strerror)\n"
        "print(sorted(os.listdir('/')))\n"
    )
    r = run_python(code, FAST)
    assert r.status == "ok", r.stderr
    assert "read" not in r.stdout and r.stdout.count("hidden") == len(targets), r.stdout
