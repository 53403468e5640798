"""A training run folder shared over ranks: saving a checkpoint of the whole job, finding the one
to resume from and loading it into every rank. Under torch.distributed rank 0 alone reads and
writes the run folder (lockstep.model.checkpoint's files); the other ranks exchange their state with it
over the process group, so nodes need no shared disk. A checkpoint written on another number of
ranks, or with the optimizer state laid out otherwise (sharded or replicated), is resumed by
resharding that state on rank 0. A stage holds its run folder's lock (`hold_run_dir`) while it
trains and publishes, so two processes never write checkpoints into one folder. Not the training
loop (lockstep.train.trainer) and not the file format (lockstep.model.checkpoint)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.core.io import canonical_json, read_json, write_json_atomic
from lockstep.core.runtime import Runtime, barrier
from lockstep.model import checkpoint as ckpt
from lockstep.train.optim import optimizer_state_kind, state_layout

PROGRESS_FILE = "progress.json"  # per-step series, throughput and wall time so far, beside the checkpoints
LOCK_FILE = "stage.lock"  # flock()ed by the process training in the run folder; its pid and host inside
log = logging.getLogger("lockstep.resume")


class RunFolderInUseError(RuntimeError):
    """Another live process holds the run folder's lock: it is training there (`hold_run_dir`)."""


def _holder_record() -> dict[str, Any]:
    """What the lock file says about its holder, for the message another process prints."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())}


def _in_use_message(run_dir: Path, lock_file: Path) -> str:
    """The line a second process stops with: who holds `run_dir` (read from `lock_file`, which its
    holder may not have filled in yet) and how to stop it or wait."""
    try:
        holder = json.loads(lock_file.read_text(encoding="utf-8"))
        pid, host, since = int(holder["pid"]), str(holder["host"]), str(holder["since"])
    except (OSError, ValueError, KeyError, TypeError):
        return (f"{run_dir} is in use by another process (its lock {lock_file} is held); two runs in one folder would "
                "overwrite each other's checkpoints: wait for it to end, or stop it, then run the stage again")
    where = "" if host == socket.gethostname() else f" on {host}"
    return (f"{run_dir} is in use by process {pid} on host {host} (training there since {since}); two runs in one "
            f"folder would overwrite each other's checkpoints: wait for it to end, or stop it (`kill {pid}`{where}; "
            "a rerun resumes from its last complete checkpoint), then run the stage again")


def _lock(run_dir: Path) -> tuple[int | None, str | None]:
    """Rank 0: take `run_dir`'s lock without waiting. Returns (the lock file's descriptor, None),
    or (None, the line to stop with) when another process holds it. A file system without locks
    (some network and FUSE mounts) is logged and trained on unlocked: (None, None)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_file = run_dir / LOCK_FILE
    # Opened without O_TRUNC: the holder's record stays readable to whoever fails to lock. The
    # descriptor is not inherited by the programs a stage starts (PEP 446), so the lock ends with
    # this process: the kernel releases a flock when its last descriptor closes, a SIGKILL included.
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None, _in_use_message(run_dir, lock_file)
    except OSError as e:
        os.close(fd)
        log.warning("cannot lock %s (%s): a second process training in this run folder would go unnoticed",
                    lock_file, os.strerror(e.errno) if e.errno else e)
        return None, None
    os.ftruncate(fd, 0)
    os.pwrite(fd, canonical_json(_holder_record()).encode("utf-8"), 0)
    return fd, None


@contextlib.contextmanager
def hold_run_dir(run_dir: Path, rt: Runtime) -> Iterator[None]:
    """Hold `run_dir`'s lock (LOCK_FILE, created with the folder) for the block: what a stage does
    in its run folder, and the outputs it publishes from it, happen in one process at a time. A
    second process raises RunFolderInUseError naming the holder's pid and host before it touches
    anything. The kernel drops the lock when its holder dies, however it dies, so a crashed run
    leaves no stale lock and its rerun resumes as before.

    Under torch.distributed rank 0 alone takes it, as it alone reads and writes the run folder
    (the other ranks' nodes may not even see it); it tells every rank whether it got it, so that
    all of them stop together (a collective). Per-node locks would buy nothing and, on a file
    system shared between nodes, make the ranks of one job refuse each other."""
    fd, refused = _lock(run_dir) if rt.is_main else (None, None)
    if rt.distributed:
        told = [refused]
        dist.broadcast_object_list(told, src=0)
        refused = told[0]
    if refused is not None:
        raise RunFolderInUseError(refused)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock; the record stays, read only by someone who fails to lock


def open_run_dir(run_dir: Path, rt: Runtime) -> list[Path]:
    """Create `run_dir` on rank 0 and remove the leftovers of interrupted saves; every rank waits.
    Returns what was removed (empty on the other ranks)."""
    removed: list[Path] = []
    if rt.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        removed = ckpt.clean_incomplete(run_dir)
    barrier(rt)
    return removed


def _cpu(obj: Any) -> Any:
    """`obj` with every tensor in it moved to the CPU, for sending over the process group."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def save(model: nn.Module, optimizers: list[torch.optim.Optimizer], rt: Runtime, run_dir: Path, step: int,
         meta: dict[str, Any], keep_last: int, *, progress: dict[str, Any]) -> Path:
    """Checkpoint the run at `step`: rank 0 first writes `progress` (PROGRESS_FILE), so that every
    checkpoint a rerun may resume from has its series on disk, then the checkpoint. Rank 0 alone
    touches the run folder: the other ranks send it their optimizer state (each rank's own part
    when it is sharded) one rank at a time, so that a job spread over nodes with separate disks
    still leaves every file on rank 0's disk. meta.json records the world size and whether that
    state was sharded, which `load` needs to reshard it. A collective; returns the checkpoint
    folder."""
    if rt.is_main:
        write_json_atomic(run_dir / PROGRESS_FILE, progress)
    final = ckpt.step_dir(run_dir, step)
    state = {"optimizers": [o.state_dict() for o in optimizers]}
    if rt.is_main:
        ckpt.write_optim_state(ckpt.begin_checkpoint(final), 0, state)
    for sender in range(1, rt.world_size):
        if rt.rank == sender:
            dist.send_object_list([_cpu(state)], dst=0)
        elif rt.is_main:
            received: list[Any] = [None]
            dist.recv_object_list(received, src=sender)
            ckpt.write_optim_state(ckpt.partial_dir(final), sender, received[0])
    if rt.is_main:
        # The global RNG is unused by the loop (batches come from per-step generators) but is
        # stored so code that draws from it (dropout, say) resumes exactly too.
        ckpt.finish_checkpoint(
            ckpt.partial_dir(final),
            final,
            model_state=model.state_dict(),
            meta={
                **meta,
                "step": step,
                "world_size": rt.world_size,
                "optimizer_state": optimizer_state_kind(optimizers),
                # Data order is stateless (per-step generators): the next step is all a loader needs.
                "loader": {"kind": "per-step generators", "next_step": step},
            },
            rng_states={"torch_cpu": torch.get_rng_state()},
        )
        ckpt.prune_checkpoints(run_dir, keep_last)
    barrier(rt)
    return final


@dataclass
class Resume:
    """What a rank resumes from: rank 0 reads it from the run folder, the others receive it."""

    path: Path
    step: int
    world_size: int  # ranks that wrote the checkpoint
    rng_states: dict[str, torch.Tensor]
    progress: dict[str, Any]  # the run's progress.json ({} without one)
    stored: ckpt.Checkpoint | None = None  # rank 0 only: the others get weights and optimizer state from it
    # how the writing run laid out its optimizer state; checkpoints from before sharding were replicated
    optimizer_state: str = "replicated"


def find(run_dir: Path, rt: Runtime) -> Resume | None:
    """The latest complete checkpoint in `run_dir`, as rank 0 finds it on its disk, told to every
    rank (a collective under torch.distributed). The other ranks never look at the run folder:
    on a multi-node job it exists on rank 0's node only. The checkpoint may have been written by
    another number of ranks than this job has: `load` reshards the optimizer state."""
    found: Resume | None = None
    if rt.is_main:
        latest = ckpt.latest_checkpoint(run_dir)
        if latest is not None:
            state = ckpt.load_checkpoint(latest)
            progress_file = run_dir / PROGRESS_FILE
            progress = read_json(progress_file, what="run progress") if progress_file.is_file() else {}
            found = Resume(path=latest, step=state.step, world_size=int(state.meta.get("world_size", 1)),
                           rng_states=state.rng_states, progress=progress, stored=state,
                           optimizer_state=state.meta.get("optimizer_state", "replicated"))
    if rt.distributed:
        header = [None if found is None else {**vars(found), "stored": None}]
        dist.broadcast_object_list(header, src=0)
        if not rt.is_main:
            found = None if header[0] is None else Resume(**header[0])
    return found


def _rank_states(resume: Resume, optimizers: list[torch.optim.Optimizer], rt: Runtime) -> Callable[[int], Any]:
    """Rank 0: rank r -> its optimizer state as this run lays it out. The stored files as they
    are when the writing run had this run's layout; else all of them gathered into the
    single-process state and split again (lockstep.train.optim.StateLayout). Raises CheckpointError
    naming both runs when the stored state does not fit this run's optimizers."""
    stored = resume.stored
    assert stored is not None
    layouts = [state_layout(o, rt.world_size) for o in optimizers]
    written = [dataclasses.replace(lay, sharded=resume.optimizer_state == "sharded", world_size=resume.world_size)
               for lay in layouts]
    if written == layouts:
        return stored.optim_state
    old = [stored.optim_state(r)["optimizers"] for r in range(resume.world_size)]
    try:
        if len(old[0]) != len(layouts):
            raise ValueError(f"{len(old[0])} optimizers stored, {len(layouts)} in this run")
        full = [lay.full([states[k] for states in old]) for k, lay in enumerate(written)]
        by_rank = {r: {"optimizers": [lay.split(f, r) for lay, f in zip(layouts, full, strict=True)]}
                   for r in range(rt.world_size)}
    except (ValueError, KeyError, IndexError, RuntimeError) as e:
        raise ckpt.CheckpointError(
            f"{resume.path} holds optimizer state of {resume.world_size} rank(s) ({resume.optimizer_state}) that "
            f"does not fit this run's optimizers on {rt.world_size} rank(s) ({optimizer_state_kind(optimizers)}): "
            f"{e}; resume with the config and runtime.nproc x runtime.nnodes = {resume.world_size} that wrote it, "
            f"or delete {resume.path.parent} to start fresh") from None
    log.info("optimizer state of %d rank(s) (%s) resharded for %d rank(s) (%s)", resume.world_size,
             resume.optimizer_state, rt.world_size, optimizer_state_kind(optimizers))
    return by_rank.__getitem__


def load(resume: Resume, model: nn.Module, optimizers: list[torch.optim.Optimizer], rt: Runtime) -> None:
    """Load `resume` into `model` and this rank's `optimizers` (a collective under
    torch.distributed: rank 0 broadcasts the weights and sends each rank its optimizer state,
    resharded when the checkpoint was written on another number of ranks or layout). Raises
    CheckpointError on every rank when the stored optimizer state does not fit."""
    stored = resume.stored
    if rt.is_main:
        assert stored is not None
        model.load_state_dict({k: v.to(rt.device) for k, v in stored.model_state.items()})
    if rt.distributed:
        with torch.no_grad():
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)
    if rt.is_main:
        try:
            states = _rank_states(resume, optimizers, rt)
        except ckpt.CheckpointError as e:
            for receiver in range(1, rt.world_size):  # so that no rank waits for a state that never comes
                dist.send_object_list([{"error": str(e)}], dst=receiver)
            raise
        mine = states(0)
        for receiver in range(1, rt.world_size):
            dist.send_object_list([states(receiver)], dst=receiver)
    else:
        received: list[Any] = [None]
        dist.recv_object_list(received, src=0)
        mine = received[0]
        if "error" in mine:
            raise ckpt.CheckpointError(mine["error"])
    for opt, sd in zip(optimizers, mine["optimizers"], strict=True):
        opt.load_state_dict(sd)
