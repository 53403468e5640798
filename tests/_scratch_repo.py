"""Scratch copies of the checkout for the end-to-end tests: the tracked and not-ignored files
(no `data/`), a runner for commands inside such a copy that imports the copy's library, the
progress lines a long pipeline test shows while it runs, and a build made once for all the
processes of a test run (the `smoke` DAG that tests/conftest.py's `smoke_run` fixture shares)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run_in(
    cmd: list[str], cwd: Path, timeout_s: int, progress: Callable[[str], None] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `cmd` in the copy at `cwd` with the virtualenv's scripts on PATH; AssertionError with
    the output's tails when it fails. `progress`, where given, sees each stdout line as it comes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "DVC_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(cwd / "lib")  # the copy's library runs, not the installed checkout's
    env.pop("OMP_NUM_THREADS", None)  # the stages set their own thread count from params
    if progress is None:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    else:
        proc = _streamed(cmd, cwd, env, timeout_s, progress)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def _streamed(
    cmd: list[str], cwd: Path, env: dict[str, str], timeout_s: int, progress: Callable[[str], None]
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run` with stdout read line by line as the command writes it (unbuffered, so a
    line arrives when it is printed); TimeoutExpired after `timeout_s`, as `run` raises."""
    killed: list[bool] = []
    with (
        tempfile.TemporaryFile("w+") as err,
        subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env | {"PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        ) as child,
    ):
        timer = threading.Timer(timeout_s, lambda: (killed.append(True), child.kill()))
        timer.start()
        lines = []
        try:
            for line in child.stdout:
                lines.append(line)
                progress(line)
            child.wait()
        finally:
            timer.cancel()
        if killed:
            raise subprocess.TimeoutExpired(cmd, timeout_s, output="".join(lines))
        err.seek(0)
        return subprocess.CompletedProcess(cmd, child.returncode, "".join(lines), err.read())


def stage_progress(capsys: pytest.CaptureFixture[str], label: str) -> Callable[[str], None]:
    """A `run_in` progress callback that puts each stage DVC starts on the terminal, past pytest's
    output capture (`-q` included): a pipeline test of many minutes shows it moves, and says
    nothing else."""
    return _show_stages(capsys.disabled, label)


def session_stage_progress(config: pytest.Config, label: str) -> Callable[[str], None]:
    """`stage_progress` for a session-scoped fixture, which has no `capsys`: the same lines, past
    the capture of the whole run."""
    capture = config.pluginmanager.getplugin("capturemanager")
    return _show_stages(capture.global_and_fixture_disabled if capture else contextlib.nullcontext, label)


def _show_stages(uncaptured: Callable[[], AbstractContextManager], label: str) -> Callable[[str], None]:
    def show(line: str) -> None:
        if line.startswith("Running stage"):
            with uncaptured():
                sys.stdout.write(f"\n  {label}: {line.strip()}")
                sys.stdout.flush()

    return show


def checkout_copy(dst: Path) -> None:
    """Copy the checkout's tracked and untracked-but-not-ignored files, except `data/`, to `dst`."""
    files = (
        subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, files):
        src = ROOT / rel
        if not src.is_file() or rel.startswith("data/"):
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / rel)


def preset_copy(dst: Path, preset: str) -> None:
    """`checkout_copy` into `dst` switched to `preset` (`lockstep preset`), without the committed
    dvc.lock, which is the tiny preset's: a fresh project on that preset."""
    checkout_copy(dst)
    (dst / "dvc.lock").unlink(missing_ok=True)
    run_in([str(BIN / "lockstep"), "preset", preset], dst, 60)


def git_commit_all(work: Path) -> None:
    """`git init` and a first commit of everything, as a user's clone has (training metrics
    record the commit)."""
    git = ["git", "-c", "user.name=lockstep-test", "-c", "user.email=test@lockstep.invalid"]
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    subprocess.run(["git", "add", "-A"], cwd=work, check=True, capture_output=True)
    subprocess.run([*git, "commit", "-qm", "scratch copy"], cwd=work, check=True)


def run_folder(factory: pytest.TempPathFactory) -> Path:
    """The temporary folder of this test run that all its processes share: under pytest-xdist,
    the parent of each worker's base folder (`pytest-N/` above `popen-gw0/`); without it, the
    base folder itself (its parent holds the folders of other runs)."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(root: Path, name: str, build: Callable[[Path], None]) -> Path:
    """`root / name`, made by `build(root / name)` once for every process that asks for it under
    `root`: the first to come builds while holding a file lock, the others wait for the lock and
    find it built. A build that failed is not tried again: every later caller fails with its
    error (seconds, not the minutes of a second failing build)."""
    work, done, failed = root / name, root / f"{name}.done", root / f"{name}.failed"
    with _locked(root / f"{name}.lock"):
        if failed.exists():
            pytest.fail(f"the shared build {work} failed in another test:\n{failed.read_text()}")
        if not done.exists():
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            try:
                build(work)
            except Exception as e:
                failed.write_text(f"{type(e).__name__}: {str(e)[-6000:]}")
                raise
            done.touch()
    return work


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, or its process ends
        yield


def build_pipeline(work: Path, preset: str, progress: Callable[[str], None] | None = None) -> None:
    """A fresh project on `preset` in the empty folder `work` (`preset_copy`, a first commit, as a
    user's clone has: the training metrics record it), and its whole DAG run by `dvc repro`."""
    preset_copy(work, preset)
    git_commit_all(work)
    run_in([str(BIN / "dvc"), "repro"], work, 1500, progress)


def copy_run(src: Path, dst: Path) -> None:
    """A copy at `dst` of the finished project at `src` (git, DVC cache, `data/` and the run
    folders included) for a test that changes it or runs DVC in it."""
    shutil.copytree(src, dst, symlinks=True)
