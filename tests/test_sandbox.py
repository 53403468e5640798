"""The code sandbox against hostile programs: each must end contained, with the host untouched."""

from __future__ import annotations

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


@pytest.mark.parametrize(
    "code",
    [
        "import os\nwhile True:\n    os.fork()\n",
        "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])\n",
        # past the Python-level guard, straight to the syscall: the process rlimit stops it
        "import posix\nwhile True:\n    posix.fork()\n",
        "import threading\nwhile True:\n    threading.Thread(target=lambda: None).start()\n",
    ],
)
def test_fork_bomb_is_contained(code: str) -> None:
    r = run_python(code, FAST)
    assert r.status == "error"
    assert r.duration_s < FAST.timeout_s
    assert not _procs_running_program()


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
