"""Multi-node jobs: the runtime params that describe them (checked with messages that say what to
set), the torchrun command a stage re-runs itself under, no re-launch under an outer torchrun,
and a two-"node" CPU job joined through a c10d rendezvous on 127.0.0.1 whose training, stopped
and resumed, equals the one-process run, with every checkpoint file on rank 0's disk only; a job
whose rank 0 is not on the node DVC runs on is refused before it trains."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import stages._runtime as stage_runtime
from lockstep.core.config import ConfigError, build_config
from lockstep.core.runtime import Runtime, RuntimeConfig, split_endpoint, torchrun_argv
from stages._common import Preamble
from test_train import _cfg, _fit, _model

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@pytest.mark.parametrize(("section", "message"), [
    ({"nnodes": 0}, "runtime.nnodes=0 must be >= 1"),
    ({"nnodes": 2}, "runtime.rdzv_endpoint='' must be HOST:PORT when nnodes=2"),
    ({"nnodes": 2, "rdzv_endpoint": "node0"}, "must be HOST:PORT"),
    ({"nnodes": 2, "rdzv_endpoint": ":29400"}, "must be HOST:PORT"),
    ({"nnodes": 2, "rdzv_endpoint": "fe80::1:29400"}, r"IPv6 as \[ADDR\]:PORT"),
    ({"nnodes": 2, "rdzv_endpoint": "node0:http"}, "has port 'http'; give a TCP port in 1..65535"),
    ({"nnodes": 2, "rdzv_endpoint": "node0:70000"}, "has port '70000'"),
    ({"nnodes": 2, "rdzv_endpoint": "node0:29400", "rdzv_id": "my job"}, "runtime.rdzv_id='my job' must be 1-64"),
])
def test_bad_multi_node_params_are_refused_with_the_key(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(RuntimeConfig, section, where="runtime")


def test_endpoints_split_into_host_and_port() -> None:
    assert split_endpoint("node0.cluster:29400") == ("node0.cluster", 29400)
    assert split_endpoint("[fe80::1]:29400") == ("fe80::1", 29400)
    cfg = build_config(RuntimeConfig, {"nnodes": 2, "nproc": 8, "rdzv_endpoint": "10.0.0.1:29400"}, where="runtime")
    assert cfg.multi_process and not RuntimeConfig().multi_process
    # Where the nodes meet does not name the run folder: a restarted job resumes its run.
    assert "rdzv_endpoint" not in cfg.identity() and cfg.identity()["nnodes"] == 2


def test_torchrun_command_for_one_node_and_for_many() -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    assert torchrun_argv(8, "stages.pretrain", ["--out", "x"]) == [
        *launcher, "--standalone", "--nproc_per_node=8", "-m", "stages.pretrain", "--out", "x"]
    assert torchrun_argv(
        8, "stages.pretrain", ["--out", "x"], nnodes=2, rdzv_endpoint="node0:29400", rdzv_id="d20"
    ) == [
        *launcher,
        "--nnodes=2",
        "--nproc_per_node=8",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=node0:29400",
        "--rdzv_id=d20",
        "-m",
        "stages.pretrain",
        "--out",
        "x",
    ]
    with pytest.raises(ValueError, match="runtime.nnodes=2 needs runtime.rdzv_endpoint"):
        torchrun_argv(8, "stages.pretrain", [], nnodes=2)


def _preamble() -> Preamble:
    return Preamble(log=logging.getLogger("lockstep.test"), params={}, seed=0, data_seed=0, started_s=0.0)


def test_stage_relaunches_itself_to_join_the_rendezvous(monkeypatch) -> None:
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    launched = []

    class FakePopen:
        def __init__(self, cmd):
            launched.append(cmd)

        def wait(self):
            return 3

    monkeypatch.setattr(stage_runtime.subprocess, "Popen", FakePopen)
    cfg = RuntimeConfig(device="cpu", nproc=1, nnodes=2, rdzv_endpoint="127.0.0.1:29400", rdzv_id="job7")
    assert stage_runtime.start_runtime(_preamble(), cfg, module="stages.pretrain", argv=["--out", "o"]) == 3
    assert launched == [torchrun_argv(1, "stages.pretrain", ["--out", "o"], nnodes=2,
                                      rdzv_endpoint="127.0.0.1:29400", rdzv_id="job7")]


def test_under_an_outer_torchrun_the_environment_wins(monkeypatch, caplog) -> None:
    monkeypatch.setattr(stage_runtime.subprocess, "Popen", lambda cmd: pytest.fail(f"re-launched: {cmd}"))
    monkeypatch.setattr(stage_runtime, "configure_threads", lambda threads, nproc: nproc)
    monkeypatch.setattr(stage_runtime, "configure_determinism", lambda deterministic: None)
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cfg = RuntimeConfig(device="cpu", nproc=8, nnodes=2, rdzv_endpoint="node0:29400")
    with caplog.at_level(logging.INFO, logger="lockstep"):
        rt = stage_runtime.start_runtime(_preamble(), cfg, module="stages.pretrain", argv=[])
    assert isinstance(rt, Runtime) and rt.world_size == 1 and rt.rank == 0
    assert "torchrun started 1 rank(s) on 1 node(s); params say runtime.nproc=8 x runtime.nnodes=2" in caplog.text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_two_nodes(nodes: list[Path], stop_at_step: int, *, dvc_on: int | None = None) -> list[tuple[int, str]]:
    """The two torchrun commands that two machines would run, each in its own folder (its disk);
    `dvc_on` marks one node as DVC marks the node it runs a stage on. Returns each node's exit
    status and output. torchrun's c10d rendezvous numbers nodes by their sorted addresses:
    `--local_addr` gives the first folder the address that sorts first, so it holds rank 0."""
    endpoint = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items()
           if k not in TORCHRUN_VARS and k != "DVC_STAGE" and not k.startswith("PYTEST")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT / "lib"), str(ROOT / "tests"), str(ROOT)]), OMP_NUM_THREADS="1")
    procs = []
    for i, (node, addr) in enumerate(zip(nodes, ("127.0.0.1", "localhost"), strict=True)):
        cmd = torchrun_argv(1, "_c10d_worker", [str(stop_at_step)], nnodes=2, rdzv_endpoint=endpoint, rdzv_id="toy")
        cmd[3:3] = [f"--local_addr={addr}", "--monitor_interval=0.2"]
        node_env = dict(env, DVC_STAGE="pretrain") if i == dvc_on else env
        procs.append(subprocess.Popen(cmd, cwd=node, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    deadline = time.monotonic() + 120
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    return [(proc.returncode, out) for proc, out in zip(procs, outputs, strict=True)]


def _ok(results: list[tuple[int, str]]) -> None:
    for code, out in results:
        assert code == 0, f"a node failed ({code}):\n{out[-4000:]}"


@pytest.mark.slow
def test_two_nodes_through_c10d_match_one_process(tmp_path: Path) -> None:
    nodes = [tmp_path / "node_a", tmp_path / "node_b"]
    for node in nodes:
        node.mkdir()
    _ok(_launch_two_nodes(nodes, stop_at_step=2))  # stopped after the step-2 checkpoint, as a kill would
    # DVC on the node that does not hold rank 0 would never see the outputs: refused by every rank.
    refused = _launch_two_nodes(nodes, stop_at_step=4, dvc_on=1)
    assert all(code != 0 for code, _ in refused)
    assert "but DVC started the stage on" in refused[0][1] and "Run `dvc repro` on" in refused[0][1]
    _ok(_launch_two_nodes(nodes, stop_at_step=4, dvc_on=0))  # a second job: resumes from the checkpoint

    ranks = [json.loads((node / "rank0.json").read_text()) if (node / "rank0.json").is_file()
             else json.loads((node / "rank1.json").read_text()) for node in nodes]
    assert [r["rank"] for r in ranks] == [0, 1], "the node with the first-sorting address holds rank 0"
    assert all(r["local_rank"] == 0 and r["world_size"] == 2 and r["nodes"] == 2 for r in ranks), ranks
    # Rank 0's disk holds the whole run folder, both ranks' optimizer state included; the other
    # node's disk holds nothing of it, and the run resumed from it.
    assert not (nodes[1] / "run").exists()
    steps = sorted(p.name for p in (nodes[0] / "run").glob("step_*"))
    assert steps == ["step_00000002", "step_00000004"]
    for step in steps:
        assert {p.name for p in (nodes[0] / "run" / step).glob("optim_rank*.pt")} == {
            "optim_rank0.pt",
            "optim_rank1.pt",
        }
    two = torch.load(nodes[0] / "result.pt", weights_only=True)
    assert two["resumed_from"] == 2

    torch.set_num_threads(1)
    one_model = _model()
    one = _fit(one_model, _cfg(num_steps=4), tmp_path / "one")
    # Same batches, same normalisation; only the order of float sums differs across ranks.
    for (s1, l1), (s2, l2) in zip(one.losses[2:], two["losses"], strict=True):
        assert s1 == s2 and abs(l1 - l2) < 1e-5
    for k, v in one_model.state_dict().items():
        torch.testing.assert_close(two["state"][k], v, rtol=0, atol=2e-5, msg=k)
    assert abs(one.final_eval["val_bpb"] - two["bpb"]) < 1e-5
