"""A stage ends with the process that launched it (lockstep.core.lifeline, armed by stages._common.entry):
a stage-like program run through the real entry point under a real `dvc repro`, or as the ranks of
a real torchrun, is gone within seconds of its launcher's SIGKILL and publishes nothing; started by
hand it outlives its parent; a launcher that died while the stage was starting stops it at once.
The real pretrain stage under `dvc repro` is in tests/test_train_stages.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from _procs import BIN, alive, gone_within, stage_env, wait_for_pid
from lockstep.core import lifeline

# The stage: entry() around a main that says it runs, then works far longer than any test waits,
# then "publishes".
STAGE = textwrap.dedent("""\
    import os, sys, time
    from pathlib import Path
    from stages._common import entry

    def main():
        Path(f"pid{os.environ.get('RANK', '')}").write_text(str(os.getpid()))
        time.sleep(120)
        Path("published").write_text("too late")
        return 0

    raise SystemExit(entry(main))
""")


@contextlib.contextmanager
def _cleanup(launcher: subprocess.Popen, folder: Path) -> Iterator[list[int]]:
    """Yields a list for the stage pids the test finds; afterwards `launcher` and every stage
    that wrote a pid file in `folder` are SIGKILLed, whatever the test found."""
    pids: list[int] = []
    try:
        yield pids
    finally:
        launcher.kill()
        launcher.wait()
        for f in folder.glob("pid*"):
            with contextlib.suppress(ValueError, ProcessLookupError):
                os.kill(int(f.read_text()), signal.SIGKILL)


pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to see who is alive")


def _dvc_repro(project: Path, cmd: str, repo_root: Path, *, shell: str) -> subprocess.Popen:
    """`dvc repro` of a one-stage project in `project` running `cmd`, started with SHELL=`shell`
    (what DVC runs the command with), its output in `project`/log."""
    (project / "dvc.yaml").write_text(f"stages:\n  s:\n    cmd: {cmd}\n")
    env = stage_env(repo_root, SHELL=shell, OMP_NUM_THREADS="1")
    subprocess.run([BIN / "dvc", "init", "--no-scm", "-q"], cwd=project, env=env, check=True)
    with open(project / "log", "w") as log:
        return subprocess.Popen([BIN / "dvc", "repro"], cwd=project, env=env, stdout=log, stderr=log)


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_stage_ends_when_dvc_is_killed(tmp_path: Path, repo_root: Path) -> None:
    """bash execs the lone command, so the stage's parent is dvc itself (the `sh -c` case, where a
    shell stands between them, runs the real pretrain stage in tests/test_train_stages.py)."""
    (tmp_path / "stage.py").write_text(STAGE)
    dvc = _dvc_repro(tmp_path, "python stage.py", repo_root, shell="/bin/bash")
    with _cleanup(dvc, tmp_path) as stages:
        stages.append(wait_for_pid(tmp_path / "pid", dvc))
        assert _parent_of(stages[0]) == dvc.pid  # the case this test is for
        dvc.kill()
        dvc.wait()
        assert gone_within(stages[0], 10), "the stage outlived dvc"
    assert not (tmp_path / "published").exists()
    line = (tmp_path / "log").read_text().splitlines()[-1]
    assert line.startswith(f"stopped: dvc (pid {dvc.pid}), which started this stage, has ended"), line


@pytest.mark.slow
def test_a_stage_that_re_ran_itself_under_torchrun_stops_torchrun_and_its_ranks(
    tmp_path: Path, repo_root: Path
) -> None:
    """A stage asked for 2 processes re-runs itself under torchrun (stages._runtime.start_runtime)
    and waits for it: when dvc dies it sends torchrun SIGTERM, which torchrun passes to its ranks,
    so that none of the three lives on."""
    (tmp_path / "rank.py").write_text(STAGE)
    (tmp_path / "stage.py").write_text(textwrap.dedent("""\
        import logging
        from lockstep.core.runtime import RuntimeConfig
        from stages._common import Preamble, entry
        from stages._runtime import start_runtime

        def main():
            pre = Preamble(log=logging.getLogger("stage"), params={}, seed=0, data_seed=0, started_s=0.0)
            return start_runtime(pre, RuntimeConfig(device="cpu", nproc=2), module="rank", argv=[])

        raise SystemExit(entry(main))
    """))
    dvc = _dvc_repro(tmp_path, "python stage.py", repo_root, shell="/bin/bash")
    with _cleanup(dvc, tmp_path) as ranks:
        ranks += [wait_for_pid(tmp_path / f"pid{r}", dvc) for r in range(2)]
        torchrun = _parent_of(ranks[0])
        stage = _parent_of(torchrun)
        assert _parent_of(stage) == dvc.pid
        dvc.kill()
        dvc.wait()
        assert all(gone_within(pid, 15) for pid in (stage, torchrun, *ranks)), "torchrun or a rank outlived dvc"
    assert not (tmp_path / "published").exists()


def test_a_stage_started_by_hand_outlives_its_parent(tmp_path: Path, repo_root: Path) -> None:
    (tmp_path / "stage.py").write_text(STAGE)
    # A parent that starts the stage through `sh -c`, as DVC does, but is not DVC: no DVC_STAGE.
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess; subprocess.run(['/bin/sh', '-c', 'python stage.py'])"],
        cwd=tmp_path,
        env=stage_env(repo_root),
    )
    with _cleanup(parent, tmp_path) as stages:
        stages.append(wait_for_pid(tmp_path / "pid", parent))
        parent.kill()
        parent.wait()
        time.sleep(4 * lifeline.POLL_S)
        assert alive(stages[0]), "a stage started by hand ended with its parent"


def test_a_launcher_gone_before_the_lifeline_is_armed_stops_the_stage_at_once(tmp_path: Path) -> None:
    """The stage reads its ancestry first thing (stages/__init__.py) and arms the lifeline after
    seconds of imports: a launcher that died in between stops it as soon as it is armed."""
    program = textwrap.dedent("""\
        import os, sys, time
        from lockstep.core import lifeline
        links = lifeline.ancestry()
        print("read", flush=True)
        while os.getppid() == links[0]:  # the imports, during which the launcher is killed
            time.sleep(0.01)
        lifeline.arm(lifeline.find_launcher(links, {"DVC_STAGE": "s"}))
        print("not stopped", flush=True)
    """)
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])", sys.executable, "-c", program],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert launcher.stdout.readline() == "read\n", launcher.communicate()
    launcher.kill()  # the stage keeps the pipes: read to their end, which comes when it exits
    out, err = launcher.communicate(timeout=30)
    assert out == "" and err.startswith(f"stopped: dvc (pid {launcher.pid}), which started this stage, has ended"), err


def test_the_ranks_end_when_torchrun_is_killed(tmp_path: Path, repo_root: Path) -> None:
    """torchrun forwards SIGTERM to its ranks, but a SIGKILL leaves them orphaned: each rank sees
    its parent, the torchrun agent, gone."""
    (tmp_path / "stage.py").write_text(STAGE)
    with open(tmp_path / "log", "w") as log:
        torchrun = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "stage.py"],
            cwd=tmp_path,
            env=stage_env(repo_root, OMP_NUM_THREADS="1"),
            stdout=log,
            stderr=log,
        )
    with _cleanup(torchrun, tmp_path) as ranks:
        ranks += [wait_for_pid(tmp_path / f"pid{r}", torchrun) for r in range(2)]
        torchrun.kill()
        torchrun.wait()
        assert all(gone_within(pid, 10) for pid in ranks), "a rank outlived torchrun"
    assert not (tmp_path / "published").exists()
    lines = (tmp_path / "log").read_text().splitlines()
    assert sum(line.startswith(f"stopped: torchrun (pid {torchrun.pid})") for line in lines) == 1, lines[-5:]
