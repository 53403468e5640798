"""A training run folder shared over ranks: saving a checkpoint of the whole job, finding the one
to resume from and loading it into every rank. Under torch.distributed rank 0 alone reads and
writes the run folder (lockstep.checkpoint's files); the other ranks exchange their state with it
over the process group, so nodes need no shared disk. Not the training loop (lockstep.train) and
not the file format (lockstep.checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep import checkpoint as ckpt
from lockstep.io import read_json, write_json_atomic
from lockstep.runtime import Runtime, barrier

PROGRESS_FILE = "progress.json"  # per-step series, throughput and wall time so far, beside the checkpoints


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
    touches the run folder: the other ranks send it their optimizer state (Muon's is sharded,
    one owner rank per matrix) one rank at a time, so that a job spread over nodes with separate
    disks still leaves every file on rank 0's disk. A collective; returns the checkpoint folder."""
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
        ckpt.finish_checkpoint(ckpt.partial_dir(final), final, model_state=model.state_dict(),
                               meta={**meta, "step": step, "world_size": rt.world_size,
                                     # Data order is stateless (per-step generators): the next step is all a loader needs.
                                     "loader": {"kind": "per-step generators", "next_step": step}},
                               rng_states={"torch_cpu": torch.get_rng_state()})
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


def find(run_dir: Path, rt: Runtime) -> Resume | None:
    """The latest complete checkpoint in `run_dir`, as rank 0 finds it on its disk, told to every
    rank (a collective under torch.distributed). The other ranks never look at the run folder:
    on a multi-node job it exists on rank 0's node only. Raises CheckpointError on every rank
    when the checkpoint was written by another number of ranks than this job has."""
    found: Resume | None = None
    if rt.is_main:
        latest = ckpt.latest_checkpoint(run_dir)
        if latest is not None:
            state = ckpt.load_checkpoint(latest)
            progress_file = run_dir / PROGRESS_FILE
            progress = read_json(progress_file, what="run progress") if progress_file.is_file() else {}
            found = Resume(path=latest, step=state.step, world_size=state.meta.get("world_size"),
                           rng_states=state.rng_states, progress=progress, stored=state)
    if rt.distributed:
        header = [None if found is None else {**vars(found), "stored": None}]
        dist.broadcast_object_list(header, src=0)
        if not rt.is_main:
            found = None if header[0] is None else Resume(**header[0])
    if found is not None and found.world_size != rt.world_size:
        raise ckpt.CheckpointError(f"{found.path} was written by {found.world_size} ranks, this run has "
                                   f"{rt.world_size}; set runtime.nproc and runtime.nnodes back or delete {run_dir}")
    return found


def load(resume: Resume, model: nn.Module, optimizers: list[torch.optim.Optimizer], rt: Runtime) -> None:
    """Load `resume` into `model` and this rank's `optimizers` (a collective under
    torch.distributed: rank 0 broadcasts the weights and sends each rank its optimizer state)."""
    stored = resume.stored
    if rt.is_main:
        assert stored is not None
        model.load_state_dict({k: v.to(rt.device) for k, v in stored.model_state.items()})
    if rt.distributed:
        with torch.no_grad():
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)
    if rt.is_main:
        assert stored is not None
        mine = stored.optim_state(0)
        for receiver in range(1, rt.world_size):
            dist.send_object_list([stored.optim_state(receiver)], dst=receiver)
    else:
        received: list[Any] = [None]
        dist.recv_object_list(received, src=0)
        mine = received[0]
    for opt, sd in zip(optimizers, mine["optimizers"], strict=True):
        opt.load_state_dict(sd)
