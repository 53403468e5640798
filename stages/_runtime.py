"""The runtime half of the stage preamble, for the stages that run a model (pretrain, midtrain,
sft, rl, eval): the `runtime` params section applied once, the same way everywhere. Kept apart
from stages._common because it imports torch, which the data stages (fetch, tokenizer, cache)
and the report must not load."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from lockstep.core import lifeline
from lockstep.core.runtime import (
    Runtime,
    RuntimeConfig,
    configure_determinism,
    configure_threads,
    init_runtime,
    local_processes,
    torchrun_argv,
    under_torchrun,
    writer_host,
)
from stages._common import Preamble


def start_runtime(pre: Preamble, rt_cfg: RuntimeConfig, *, module: str | None,
                  argv: list[str] | None) -> Runtime | int:
    """Apply `rt_cfg` to this process and return its Runtime, or, for a stage that runs as
    several processes (`module` names it, e.g. `stages.pretrain`) asked for `nproc` > 1 or
    `nnodes` > 1 outside torchrun, re-run it under torchrun with the same arguments and return
    that run's exit status: an int the stage returns as its own. Under torchrun already (started
    by hand, or by a scheduler), the ranks and rendezvous in the environment are used as they
    are and nothing is re-launched. A stage without `module` runs in one process whatever
    `nproc` says (logged).

    In the process that runs: torch threads (the cores shared among this node's processes),
    deterministic kernels as `rt_cfg.deterministic` says, the process group joined under
    torchrun, device and dtype chosen; ranks other than 0 log warnings only; one line says what
    was chosen and why, and on a multi-node job every node's first process says which host holds
    rank 0, the one that writes the outputs."""
    nproc = rt_cfg.nproc
    if module is None:
        if rt_cfg.multi_process:
            pre.log.info("this stage runs in one process; runtime.nproc=%d and runtime.nnodes=%d apply to the "
                         "training and eval stages", nproc, rt_cfg.nnodes)
        nproc = 1
    elif rt_cfg.multi_process and not under_torchrun():
        cmd = torchrun_argv(nproc, module, sys.argv[1:] if argv is None else argv, nnodes=rt_cfg.nnodes,
                            rdzv_endpoint=rt_cfg.rdzv_endpoint, rdzv_id=rt_cfg.rdzv_id)
        pre.log.info("re-running under torchrun: %s", " ".join(cmd))
        proc = subprocess.Popen(cmd)
        lifeline.tie(proc)  # if DVC dies, torchrun is told to stop its ranks before this process ends
        try:
            return proc.wait()
        except KeyboardInterrupt:
            # Ctrl-C reached the workers too (one process group): let torchrun wind them down,
            # and leave the line on where to resume to rank 0.
            proc.wait()
            return 130
    else:
        nproc = local_processes(rt_cfg)
    threads = configure_threads(rt_cfg.threads, nproc)
    configure_determinism(rt_cfg.deterministic)
    rt = init_runtime(rt_cfg)
    if module is not None and rt.world_size != rt_cfg.nproc * rt_cfg.nnodes:
        pre.log.warning("torchrun started %d rank(s) on %d node(s); params say runtime.nproc=%d x runtime.nnodes=%d: "
                        "the environment wins", rt.world_size, rt.nodes, rt_cfg.nproc, rt_cfg.nnodes)
    host = writer_host(rt, launched_by_dvc="DVC_STAGE" in os.environ) if rt.nodes > 1 else None
    if not rt.is_main:
        logging.getLogger("lockstep").setLevel(logging.WARNING)
    pre.log.info("runtime: %s; %d thread(s); rank %d of %d", rt.reason, threads, rt.rank, rt.world_size)
    if host is not None and rt.local_rank == 0:
        # Logged as a warning so that every node prints it: only that host's disk gets the outputs.
        pre.log.warning("node %d of %d: rank 0 runs on host %s, which writes this stage's outputs",
                        int(os.environ.get("GROUP_RANK", "0")), rt.nodes, host)
    return rt
