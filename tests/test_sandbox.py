"""The code sandbox against hostile programs: each must end contained, with the host untouched, and no
solution may pass its tests without passing them."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import psutil
import pytest

from lockstep.evaluate.sandbox import SandboxLimits, run_python

FAST = SandboxLimits(timeout_s=2.0, memory_bytes=256 << 20, file_bytes=64 << 10, output_bytes=4 << 10)


def _procs_running_program() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if any("bootstrap.py" in c for c in cmd):
            found.append(p)
    return found


def test_ok_program_runs_with_output() -> None:
    r = run_python("print(sum(range(10)))", FAST)
    assert r.status == "ok" and r.stdout.strip() == "45"


def test_infinite_loop_times_out() -> None:
    t0 = time.monotonic()
    r = run_python("while True:\n    pass\n", FAST)
    assert r.status == "timeout"
    assert time.monotonic() - t0 < FAST.timeout_s + 3


def test_sleeping_program_is_killed_by_wall_clock() -> None:
    r = run_python("import time\ntime.sleep(60)\n", FAST)
    assert r.status == "timeout" and r.duration_s < FAST.timeout_s + 2


def test_memory_bomb_is_contained() -> None:
    r = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(32 << 20))\n", FAST)
    assert r.status == "error" and "MemoryError" in r.stderr


# A clock generous enough that no load on the machine reaches it: a contained bomb ends within a
# fraction of a second, so a "timeout" means it was not stopped by a process limit.
ROOMY = dataclasses.replace(FAST, timeout_s=60.0)


def _programs_started_between(t0: float, t1: float, grace_s: float) -> list[psutil.Process]:
    """Sandboxed programs that started in [t0, t1] (wall clock) and still run after grace_s: ones a
    concurrent test started also fall in the window, but they end at their own clock, far sooner."""
    deadline = time.monotonic() + grace_s
    while True:
        found = [p for p in _procs_running_program() if t0 - 1 <= _create_time(p) <= t1 + 1]
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.2)


def _create_time(p: psutil.Process) -> float:
    try:
        return p.create_time()
    except psutil.Error:
        return float("-inf")


@pytest.mark.parametrize(
    ("code", "stopped_by"),
    [
        ("import os\nwhile True:\n    os.fork()\n", "PermissionError: sandbox: os.fork is not allowed"),
        ("import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])\n",
         "PermissionError: sandbox: subprocess.Popen is not allowed"),
        # past the Python-level guard, straight to the syscall: the process rlimit stops it
        ("import posix\nwhile True:\n    posix.fork()\n",
         "BlockingIOError: [Errno 11] Resource temporarily unavailable"),
        ("import threading\nwhile True:\n    threading.Thread(target=lambda: None).start()\n",
         "RuntimeError: can't start new thread"),
    ],
)
def test_fork_bomb_is_contained(code: str, stopped_by: str) -> None:
    # The verdict is the reason it ended, not how long it took: the program exits 1 (not killed by
    # a signal or the clock, where returncode is negative or None) with the guard's or the process
    # limit's error as its last line, and leaves nothing running.
    t0 = time.time()
    r = run_python(code, ROOMY)
    t1 = time.time()
    assert (r.status, r.returncode) == ("error", 1), (r.status, r.returncode, r.stderr[-500:])
    assert r.stderr.strip().splitlines()[-1] == stopped_by
    assert not _programs_started_between(t0, t1, grace_s=ROOMY.timeout_s / 4)


def test_file_writes_outside_its_folder_fail(tmp_path: Path) -> None:
    target = tmp_path / "outside.txt"
    for code in (
        f"open({str(target)!r}, 'w').write('x')\n",
        f"import os\nfd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'x')\n",
        f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')\n",
    ):
        r = run_python(code, FAST)
        assert r.status == "error", r.stdout
        assert not target.exists()
    victim = tmp_path / "keep.txt"
    victim.write_text("keep")
    r = run_python(f"import os\nos.remove({str(victim)!r})\n", FAST)
    assert r.status == "error" and victim.read_text() == "keep"


def test_writes_inside_its_folder_are_allowed_and_size_capped() -> None:
    r = run_python("open('a.txt', 'w').write('hello')\nprint(open('a.txt').read())\n", FAST)
    assert r.status == "ok" and r.stdout.strip() == "hello"
    big = run_python("open('big.bin', 'wb').write(b'x' * (1 << 20))\n", FAST)
    assert big.status == "error"


def test_environment_is_scrubbed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCKSTEP_SECRET_TOKEN", "hunter2")
    code = (
        "import os\nprint(dict(os.environ))\n"
        "for p in ('/proc/self/environ', f'/proc/{os.getppid()}/environ'):\n"
        "    try:\n        print(open(p, 'rb').read())\n"
        "    except OSError:\n        print('denied', p)\n"
    )
    r = run_python(code, FAST)
    assert r.status == "ok"
    lines = r.stdout.splitlines()
    assert "LOCKSTEP_SECRET_TOKEN" not in lines[0] and "hunter2" not in lines[1]
    if os.geteuid() == 0:
        # Unprivileged, the program cannot read the harness's own environment through /proc either;
        # run as an ordinary user, the same uid could (see the sandbox module's limits).
        assert "hunter2" not in r.stdout


def test_no_stdin_and_output_is_capped() -> None:
    r = run_python("import sys\nprint(repr(sys.stdin.read()))\n", FAST)
    assert r.status == "ok" and r.stdout.strip() == "''"
    r = run_python("while True:\n    print('x' * 1000)\n", FAST)
    assert r.status in ("error", "timeout") and len(r.stdout) < 2 * FAST.output_bytes


def test_runs_unprivileged_when_started_as_root() -> None:
    r = run_python("import os\nprint(os.getuid())\n", FAST)
    if os.geteuid() == 0:
        assert r.stdout.strip() != "0"


def test_bad_limits_raise() -> None:
    with pytest.raises(ValueError, match="positive"):
        run_python("pass", SandboxLimits(timeout_s=0))


def test_output_names_the_sandbox_folder_the_same_way_every_run():
    from lockstep.evaluate.sandbox import SANDBOX_DIR_NAME

    code = "import os\nprint(os.getcwd())\nraise ValueError('boom')\n"
    first, second = run_python(code, FAST), run_python(code, FAST)
    assert first.status == "error" and "ValueError: boom" in first.stderr
    assert (first.stdout, first.stderr) == (second.stdout, second.stderr)
    assert "lockstep-sandbox-" not in first.stdout + first.stderr and SANDBOX_DIR_NAME in first.stdout + first.stderr


def _needs_namespaces() -> None:
    """Skips the calling test where the OS-level containment cannot be set up (not root, or the
    kernel or container refuses namespaces): there only Python-level guards stand."""
    from lockstep.evaluate.sandbox import os_containment

    found = os_containment()
    if not found.namespaces:
        pytest.skip(f"the sandbox has no mount/network namespaces here: {found.reason}")


def test_output_is_never_read_through_links_the_program_plants(tmp_path: Path) -> None:
    # A file only the harness's user may read; the program cannot read it, but swaps the names its
    # output might be read back by for links to it (posix.* skips the Python-level guards).
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-8c1f2a")
    secret.chmod(0o600)
    code = (
        "import posix, sys\n"
        "for name in ('stdout.txt', 'stderr.txt'):\n"
        "    try:\n        posix.unlink(name)\n    except OSError:\n        pass\n"
        f"    posix.symlink({str(secret)!r}, name)\n"
        "print('planted')\n"
        "sys.stderr.write('still here\\n')\n"
    )
    r = run_python(code, FAST)
    assert "TOPSECRET" not in r.stdout + r.stderr
    assert r.status == "ok" and r.stdout.strip() == "planted" and r.stderr.strip() == "still here"


@pytest.fixture
def host_world_writable_dir():
    # Where an unprivileged program could write on the host: a world-writable folder in the
    # system temp dir (tmp_path's parents are private to the test's user).
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="lockstep-sandbox-test-"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)
    for leaked in [*Path("/dev/shm").glob(d.name + "-*"), *Path(tempfile.gettempdir()).glob(d.name + "-*")]:
        leaked.unlink()


def test_low_level_writes_outside_the_folder_do_not_reach_the_host(host_world_writable_dir: Path) -> None:
    _needs_namespaces()
    tag = host_world_writable_dir.name
    shm = Path("/dev/shm")
    code = (
        "import io, _io, os, posix\n"
        f"targets = [{str(host_world_writable_dir)!r}, '/dev/shm', '/tmp']\n"
        "writers = {\n"
        "    'FileIO': lambda p: io.FileIO(p, 'w').write(b'x'),\n"
        "    '_io_open': lambda p: _io.open(p, 'w').write('x'),\n"
        "    'posix_open': lambda p: posix.write(posix.open(p, posix.O_WRONLY | posix.O_CREAT, 0o666), b'x'),\n"
        "}\n"
        "for folder in targets:\n"
        "    for name, write in writers.items():\n"
        "        try:\n"
        f"            write(os.path.join(folder, {tag!r} + '-' + name))\n"
        "            print('wrote', folder, name)\n"
        "        except OSError as e:\n"
        "            print('refused', folder, name, e.strerror)\n"
    )
    r = run_python(code, FAST)
    assert r.status == "ok", r.stderr
    assert len(r.stdout.splitlines()) == 9  # every attempt ran
    assert list(host_world_writable_dir.iterdir()) == []
    assert not list(shm.glob(tag + "-*")) and not list(Path("/tmp").glob(tag + "-*"))
    assert "wrote" not in r.stdout


def test_network_stays_closed_after_the_socket_block_is_undone() -> None:
    import socket

    _needs_namespaces()
    server = socket.socket()
    try:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.5)
        port = server.getsockname()[1]
        code = (
            "import sys\n"
            "for name in ('socket', '_socket'):\n"
            "    sys.modules.pop(name, None)\n"
            "import socket\n"
            "try:\n"
            f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    s.sendall(b'leak')\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print('blocked', e)\n"
        )
        # Run without the uid drop, so the program can import the stdlib wherever it lies (here it
        # may be in a folder only root reads): the network namespace holds whatever the uid.
        r = run_python(code, FAST, drop_privileges=False)
        assert r.status == "ok", r.stderr
        assert r.stdout.startswith("blocked")
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


@pytest.mark.parametrize("mode", ["as_found", "without_namespaces"])
def test_disk_filler_is_stopped_by_the_total_cap(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from lockstep.evaluate import sandbox
    from lockstep.evaluate.sandbox import Containment, os_containment

    if mode == "without_namespaces":
        # The fallback every non-root user gets: the total is checked after the run.
        monkeypatch.setattr(sandbox, "os_containment", lambda: Containment(False, "disabled by the test"))
    limits = SandboxLimits(timeout_s=5.0, memory_bytes=256 << 20, file_bytes=64 << 10, output_bytes=4 << 10,
                           disk_bytes=256 << 10)
    # Each file stays under the per-file limit; together they are ten times the total cap.
    code = ("for i in range(40):\n    with open(f'f{i}.bin', 'wb') as f:\n        f.write(b'x' * (60 << 10))\n"
            "print('filled')\n")
    r = run_python(code, limits)
    assert r.status == "error"
    if mode == "as_found" and os_containment().namespaces:
        # The tmpfs refuses the write itself: the program never gets past its cap.
        assert "No space left on device" in r.stderr and "filled" not in r.stdout
    else:
        assert "over disk_bytes=262144" in r.stderr


def test_run_tests_passes_a_correct_solution_and_shows_why_others_fail() -> None:
    from lockstep.evaluate.sandbox import run_tests

    tests = (
        "def check(candidate):\n"
        "    assert candidate(2, 3) == 5\n"
        "    assert candidate(0.5, b=0.25) == 0.75\n"
        "    assert helper() == 'from the setup'\n"
        "check(add)\n"
    )
    setup = "def helper():\n    return 'from the setup'\n\ndef add(a, b):\n    \"\"\"Stub from the prompt.\"\"\"\n"
    good = run_tests(
        "def add(a, b):\n    print('called')\n    return a + b\n", tests, entry_point="add", setup=setup, limits=FAST
    )
    assert good.passed and good.solution.stdout.count("called") == 2
    wrong = run_tests("def add(a, b):\n    return a - b\n", tests, entry_point="add", setup=setup, limits=FAST)
    assert wrong.status == "error" and "AssertionError" in wrong.tests.stderr
    broken = run_tests("def add(a, b)\n    return a + b\n", tests, entry_point="add", setup=setup, limits=FAST)
    assert broken.status == "error" and "did not load: SyntaxError" in broken.tests.stderr
    missing = run_tests("def plus(a, b):\n    return a + b\n", tests, entry_point="add", setup=setup, limits=FAST)
    assert missing.status == "error" and "defines no function add" in missing.tests.stderr
    slow = run_tests(
        "def add(a, b):\n    while True:\n        pass\n", tests, entry_point="add", setup=setup, limits=FAST
    )
    assert slow.status == "timeout"


def test_run_tests_round_trips_plain_data_and_exceptions() -> None:
    from lockstep.evaluate.sandbox import run_tests

    values = ("[None, True, 3, -0.0, float('inf'), 1j, 'é', b'\\x00', bytearray(b'a'), [1, (2, 3)], {'k': {4}}, "
              "frozenset({5}), 10**30]")
    solution = "def echo(x):\n    if x == 'raise':\n        raise KeyError('missing')\n    return x\n"
    tests = (
        f"for v in {values}:\n"
        "    back = echo(v)\n"
        "    assert back == v and type(back) is type(v), (v, back)\n"
        # An argument that cannot cross is the tests' own doing: a TypeError they may catch.
        "try:\n    echo(lambda: 0)\nexcept TypeError as e:\n    assert 'plain data' in str(e)\n"
        "else:\n    raise AssertionError('a function crossed over')\n"
    )
    r = run_tests(solution, tests, entry_point="echo", limits=FAST)
    assert r.passed, r.tests.stderr
    # A call that raises fails the run, with the solution's exception named, caught or not.
    caught = run_tests(
        solution, tests + "try:\n    echo('raise')\nexcept KeyError:\n    pass\n", entry_point="echo", limits=FAST
    )
    assert caught.status == "error" and "raised KeyError: 'missing'" in caught.tests.stderr


def test_solution_raising_stopiteration_fails_tests_that_map_it() -> None:
    from lockstep.evaluate.sandbox import run_tests

    solution = "def is_even(n):\n    raise StopIteration\n"
    for tests in (
        "assert all(map(is_even, [2, 4, 6]))\n",
        "assert list(map(is_even, [1])) == []\n",
        "assert not any(is_even(n) for n in [1, 3])\n",
    ):
        r = run_tests(solution, tests, entry_point="is_even", limits=FAST)
        assert r.status == "error", (tests, r.tests.stderr)
        assert "StopIteration" in r.tests.stderr


def test_a_call_that_raises_fails_even_when_the_tests_catch_it() -> None:
    from lockstep.evaluate.sandbox import run_tests

    solution = "def f(x):\n    raise ValueError('nope')\n"
    tests = "try:\n    f(1)\nexcept BaseException:\n    pass\n"
    r = run_tests(solution, tests, entry_point="f", limits=FAST)
    assert r.status == "error"
    assert "ValueError: nope" in r.tests.stderr


# Replies a solution can write on the reply channel itself (the bootstrap's `_replies` is reachable
# through `__main__`): each must fail the call, however the tests treat a failing call.
_FORGED_REPLIES = {
    "not an object": b"5\n",
    "null": b"null\n",
    "nested 100k deep": b"[" * 100_000 + b"]" * 100_000 + b"\n",
    "two kinds": b'{"value": 1, "raised": ["E", "m"]}\n',
    "raised not a pair": b'{"raised": 5}\n',
    "unsendable not text": b'{"unsendable": [1]}\n',
    "unknown kind": b'{"ready": true}\n',
    "value that does not decode": b'{"value": {"float": "x"}}\n',
}


@pytest.mark.parametrize("reply", list(_FORGED_REPLIES.values()), ids=list(_FORGED_REPLIES))
def test_a_forged_reply_fails_the_item_even_when_the_tests_catch_errors(reply: bytes) -> None:
    from lockstep.evaluate.sandbox import run_tests

    # Writing a reply and exiting, instead of raising: the tests tolerate an error on their last call.
    solution = f"import __main__, os\ndef f(x):\n    __main__._replies.write({reply!r})\n    os._exit(0)\n"
    tests = "try:\n    f(1)\nexcept Exception:\n    pass\n"
    r = run_tests(solution, tests, entry_point="f", limits=FAST)
    assert r.status == "error", (r.status, r.tests.stderr)
    assert "SolutionError: the solution process wrote a" in r.tests.stderr, r.tests.stderr


@pytest.mark.parametrize("reply", [b"5\n", b'{"ready": 1}\n', b'{"load_error": "x"}\n'])
def test_a_forged_reply_while_loading_fails_the_item_and_says_why(reply: bytes) -> None:
    from lockstep.evaluate.sandbox import run_tests

    solution = f"import __main__, os\n__main__._replies.write({reply!r})\nos._exit(0)\ndef f(x):\n    return x\n"
    r = run_tests(solution, "try:\n    f(1)\nexcept Exception:\n    pass\n", entry_point="f", limits=FAST)
    assert r.status == "error", (r.status, r.tests.stderr)
    assert "SolutionError: the solution process wrote a malformed reply while loading" in r.tests.stderr, r.tests.stderr


def test_solution_cannot_kill_the_process_judging_it() -> None:
    from lockstep.evaluate.sandbox import run_tests

    if os.geteuid() != 0:
        pytest.skip("the tests and the solution are apart (uids, PID namespaces) only when the harness is root")
    # The tests hand their own pid over; the solution strikes it, its group and every process it
    # may signal. The tests must live to reach their last line (and the solution to answer).
    solution = (
        "import posix, signal\n"
        "def strike(pid):\n"
        "    # the tests' pid may name the solution itself in its own PID namespace\n"
        "    for target in {pid, 0, -1} - {posix.getpid()}:\n"
        "        try:\n            posix.kill(target, signal.SIGKILL)\n"
        "        except OSError:\n            pass\n"
        "    return 'done'\n"
    )
    r = run_tests(solution, "import os\nassert strike(os.getpid()) == 'done'\n", entry_point="strike", limits=FAST)
    assert r.passed, (r.status, r.tests.stderr, r.solution.stderr)


def test_run_tests_refuses_a_bad_entry_point() -> None:
    from lockstep.evaluate.sandbox import run_tests

    with pytest.raises(ValueError, match="entry_point"):
        run_tests("pass", "pass", entry_point="not a name", limits=FAST)
