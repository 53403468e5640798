"""One rank of the two-node CPU job in tests/test_multinode.py, started by torchrun in the folder
that plays its node's disk: `python -m _c10d_worker STOP_AT_STEP`. It trains the toy model of
tests/test_train.py into the relative folder `run`, and writes `rank<R>.json` (what torchrun told
it) and, on rank 0, `result.pt` (final weights, losses, val bpb) into that same folder."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from lockstep.core.runtime import RuntimeConfig, init_runtime, shutdown, writer_host
from test_train import _cfg, _fit, _model


def main(stop_at_step: int) -> None:
    torch.set_num_threads(1)
    rt = init_runtime(RuntimeConfig(device="cpu", dtype="fp32"))
    try:
        Path(f"rank{rt.rank}.json").write_text(json.dumps({
            "rank": rt.rank, "local_rank": rt.local_rank, "world_size": rt.world_size, "nodes": rt.nodes,
            "node_rank": int(os.environ["GROUP_RANK"])}))
        # As the stage preamble does: DVC marks the node it runs on with DVC_STAGE.
        writer_host(rt, launched_by_dvc="DVC_STAGE" in os.environ)
        model = _model()
        res = _fit(model, _cfg(num_steps=4), Path("run"), rt, stop_at_step=stop_at_step)
        if rt.is_main:
            torch.save({"state": model.state_dict(), "losses": res.losses, "resumed_from": res.resumed_from,
                        "bpb": res.final_eval.get("val_bpb")}, "result.pt")
    finally:
        shutdown(rt)


if __name__ == "__main__":
    main(int(sys.argv[1]))
