"""A forked test worker's place in a gloo process group on this machine: a free local port for the
rendezvous and, for each rank, its CPU Runtime inside a joined (and afterwards destroyed) group."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from lockstep.core.runtime import Runtime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def gloo_rank(rank: int, world: int, port: int) -> Iterator[Runtime]:
    """Join the group on 127.0.0.1:`port` as `rank` of `world`, one thread each, fp32."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield Runtime(device=torch.device("cpu"), dtype=torch.float32, reason="test", rank=rank, world_size=world)
    finally:
        dist.destroy_process_group()
