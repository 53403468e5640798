"""The run folder's lock (lockstep.train.resume.hold_run_dir) over the ranks of a job: when another
process holds the folder, rank 0 finds out and every rank stops with the same line naming it,
none left waiting in a collective; once the holder is SIGKILLed the kernel has dropped its lock
and the job takes the folder. The stage-level behaviour (one line, nothing touched) is in
tests/test_train_stages.py."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
import torch.multiprocessing as mp

from _gloo import free_port, gloo_rank
from lockstep.core.runtime import Runtime
from lockstep.train.resume import LOCK_FILE, RunFolderInUseError, hold_run_dir


def _hold(run_dir: str, ready, release) -> None:
    rt = Runtime(device=torch.device("cpu"), dtype=torch.float32, reason="test")
    with hold_run_dir(Path(run_dir), rt):
        ready.set()
        release.wait(120)


def _rank(rank: int, world: int, port: int, run_dir: str, out: str) -> None:
    with gloo_rank(rank, world, port) as rt:
        try:
            with hold_run_dir(Path(run_dir), rt):
                outcome = "held"
        except RunFolderInUseError as e:
            outcome = str(e)
    Path(out, f"rank{rank}.txt").write_text(outcome)


def _job(run_dir: Path, out: Path) -> list[str]:
    mp.start_processes(_rank, args=(2, free_port(), str(run_dir), str(out)), nprocs=2, start_method="fork", join=True)
    return [(out / f"rank{r}.txt").read_text() for r in range(2)]


def test_every_rank_stops_when_another_process_holds_the_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "pretrain-0123456789abcdef"
    ctx = mp.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(run_dir), ready, release))
    holder.start()
    try:
        assert ready.wait(60), "the holder never took the lock"
        refused = _job(run_dir, tmp_path)
        assert refused[0] == refused[1], refused
        assert refused[0].startswith(f"{run_dir} is in use by process {holder.pid} on host "), refused[0]
        assert f"`kill {holder.pid}`" in refused[0] and "then run the stage again" in refused[0]
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # nothing else written
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # released by the kernel: the holder runs no cleanup
        holder.join(30)
    assert _job(run_dir, tmp_path) == ["held", "held"]
