"""A sandbox lives no longer than its harness: a harness killed mid-run (SIGKILL: an OOM kill, a
cancelled job; SIGTERM: `timeout`, torchrun ending a rank) takes every process of its sandboxes
with it, and the next harness removes the working folders it left."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from lockstep.evaluate import sandbox

LIB = Path(sandbox.__file__).resolve().parents[2]

# A harness whose sandboxes would outlive it: the solution sleeps while loading, and the tests wait
# for it. Without namespaces (the fallback), each program is the harness's own child.
_HARNESS = textwrap.dedent("""
    import sys
    from lockstep.evaluate import sandbox

    if sys.argv[1] == "without_namespaces":
        found = sandbox.os_containment()
        sandbox.os_containment = lambda: sandbox.Containment(False, "off for the test", found.syscall_filter,
                                                             found.filter_reason)
    sandbox.run_tests("import time\\ntime.sleep(600)\\ndef f():\\n    pass\\n", "f()\\n", entry_point="f",
                      limits=sandbox.SandboxLimits(timeout_s=600))
""")


@pytest.fixture
def temp_dir(monkeypatch: pytest.MonkeyPatch):
    # The harnesses' TMPDIR: a folder of this test's own, that the sandbox's uid can reach.
    d = Path(tempfile.mkdtemp(prefix="lockstep-lifetime-"))
    d.chmod(0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _started_programs(harness: psutil.Process, count: int, timeout_s: float) -> list[psutil.Process]:
    """The harness's descendants once `count` of them run a sandboxed program past its uid drop (a
    root harness's programs drop root in their bootstrap, which also clears what tied them to
    the harness until then)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        family = harness.children(recursive=True)
        running = [p for p in family if any("bootstrap.py" in c for c in _cmdline(p)) and _uid(p) != 0]
        if len(running) == count:
            time.sleep(0.2)  # past the bootstrap, into the program's sleep
            return family
        time.sleep(0.05)
    raise AssertionError(f"the harness did not start {count} sandboxed programs in {timeout_s} s")


def _uid(p: psutil.Process) -> int | None:
    try:
        return p.uids().real
    except psutil.Error:
        return None


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("mode", ["as_found", "without_namespaces"])
def test_a_killed_harness_leaves_no_process_and_no_folder(temp_dir: Path, mode: str, sig: int) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("the sandbox's tie to its harness is Linux's PR_SET_PDEATHSIG")
    env = {**os.environ, "PYTHONPATH": str(LIB), "TMPDIR": str(temp_dir)}
    proc = subprocess.Popen([sys.executable, "-c", _HARNESS, mode], env=env)
    try:
        family = _started_programs(psutil.Process(proc.pid), 2, timeout_s=30)
        proc.send_signal(sig)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(_gone(p) for p in family):
            time.sleep(0.05)
        left = [p for p in family if not _gone(p)]
        for p in left:
            p.kill()
        assert not left, f"{len(left)} of the {len(family)} sandbox processes outlived their harness"
    finally:
        proc.kill()
        proc.wait()
    assert len(list(temp_dir.glob("lockstep-sandbox-*"))) == 2  # one per sandboxed process
    sandbox.run_python("pass", sandbox.SandboxLimits(timeout_s=10))  # the next harness
    assert list(temp_dir.iterdir()) == []


def test_only_the_folders_of_harnesses_that_are_gone_are_removed(temp_dir: Path) -> None:
    if sandbox._owner_tag() == "":
        pytest.skip("/proc cannot tell who made a folder here")
    ns = sandbox._pid_namespace()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.1)  # its /proc entry is there
        mine = temp_dir / f"lockstep-sandbox-{sandbox._owner_tag()}live"
        alive = temp_dir / f"lockstep-sandbox-{ns}-{bystander.pid}-{sandbox._process_start(bystander.pid)}-live"
        reused = temp_dir / f"lockstep-sandbox-{ns}-{bystander.pid}-1-reused"  # its pid, another start time
        elsewhere = temp_dir / f"lockstep-sandbox-{ns + 1}-1-1-other-pid-namespace"
        untagged = temp_dir / "lockstep-sandbox-k2j4h5g6"  # an older name: its maker is unknown
        for d in (mine, alive, reused, elsewhere, untagged):
            d.mkdir()
            (d / "left.txt").write_text("x")
        sandbox._remove_stale_workdirs(str(temp_dir))
        assert sorted(p.name for p in temp_dir.iterdir()) == sorted(p.name for p in (mine, alive, elsewhere, untagged))
    finally:
        bystander.kill()
        bystander.wait()
