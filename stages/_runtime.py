"""The runtime half of the stage preamble, for the stages that run a model (pretrain, midtrain,
sft, rl, eval): the `runtime` params section applied once, the same way everywhere. Kept apart
from stages._common because it imports torch, which the data stages (fetch, tokenizer, cache)
and the report must not load."""

from __future__ import annotations

import logging
import subprocess
import sys

from lockstep.runtime import (
    Runtime,
    RuntimeConfig,
    configure_determinism,
    configure_threads,
    init_runtime,
    torchrun_argv,
    under_torchrun,
)
from stages._common import Preamble


def start_runtime(pre: Preamble, rt_cfg: RuntimeConfig, *, module: str | None,
                  argv: list[str] | None) -> Runtime | int:
    """Apply `rt_cfg` to this process and return its Runtime, or, for a stage that runs as
    several processes (`module` names it, e.g. `stages.pretrain`) asked for `nproc` > 1 outside
    torchrun, re-run it under torchrun with the same arguments and return that run's exit
    status: an int the stage returns as its own. A stage without `module` runs in one process
    whatever `nproc` says (logged).

    In the process that runs: torch threads (the cores shared among this node's processes),
    deterministic kernels as `rt_cfg.deterministic` says, the process group joined under
    torchrun, device and dtype chosen; ranks other than 0 log warnings only; one line says what
    was chosen and why."""
    nproc = rt_cfg.nproc
    if module is None:
        if nproc > 1:
            pre.log.info("this stage runs in one process; runtime.nproc=%d applies to the training and eval stages", nproc)
        nproc = 1
    elif nproc > 1 and not under_torchrun():
        cmd = torchrun_argv(nproc, module, sys.argv[1:] if argv is None else argv)
        pre.log.info("re-running under torchrun: %s", " ".join(cmd))
        proc = subprocess.Popen(cmd)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            # Ctrl-C reached the workers too (one process group): let torchrun wind them down,
            # and leave the line on where to resume to rank 0.
            proc.wait()
            return 130
    threads = configure_threads(rt_cfg.threads, nproc)
    configure_determinism(rt_cfg.deterministic)
    rt = init_runtime(rt_cfg)
    if not rt.is_main:
        logging.getLogger("lockstep").setLevel(logging.WARNING)
    pre.log.info("runtime: %s; %d thread(s); rank %d of %d", rt.reason, threads, rt.rank, rt.world_size)
    return rt
