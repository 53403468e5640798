"""Distributed training on CPU with 2 gloo ranks: the final weights equal a 1-rank run with the
same total batch, to float rounding."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from _gloo import free_port, gloo_rank
from test_train import _cfg, _fit, _model


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world, port) as rt:
        model = _model()
        res = _fit(model, _cfg(num_steps=4), os.path.join(out_dir, "run"), rt)
        if rank == 0:
            torch.save({"state": model.state_dict(), "losses": res.losses, "bpb": res.final_eval["val_bpb"]},
                       os.path.join(out_dir, "rank0.pt"))


def test_two_gloo_ranks_match_one_rank(tmp_path) -> None:
    mp.start_processes(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="fork", join=True)
    two = torch.load(tmp_path / "rank0.pt", weights_only=True)
    one_model = _model()
    one = _fit(one_model, _cfg(num_steps=4), tmp_path / "one")
    # Same batches, same normalisation; only the order of float sums differs across ranks.
    for (s1, l1), (s2, l2) in zip(one.losses, two["losses"], strict=True):
        assert s1 == s2 and abs(l1 - l2) < 1e-5
    max_diff = max((two["state"][k] - v).abs().max().item() for k, v in one_model.state_dict().items())
    print(f"max |w_2rank - w_1rank| = {max_diff:.3g}")
    for k, v in one_model.state_dict().items():
        torch.testing.assert_close(two["state"][k], v, rtol=0, atol=2e-5, msg=k)
    assert abs(one.final_eval["val_bpb"] - two["bpb"]) < 1e-5
    # 2-rank checkpoints hold one optimizer-state file per rank (Muon state is sharded).
    last = sorted((tmp_path / "run").glob("step_*"))[-1]
    assert (last / "optim_rank0.pt").is_file() and (last / "optim_rank1.pt").is_file()


def test_device_dtype_choice_says_why(monkeypatch) -> None:
    from lockstep.core.runtime import RuntimeConfig, choose_device_dtype, init_runtime, torchrun_argv

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    import lockstep.core.runtime as runtime_mod

    monkeypatch.setattr(runtime_mod, "cpu_bf16_features", lambda: ["avx512_bf16"])
    dev, dt, why = choose_device_dtype("auto", "auto")
    assert dev.type == "cpu" and dt == torch.bfloat16 and "native" in why
    monkeypatch.setattr(runtime_mod, "cpu_bf16_features", lambda: [])
    dev, dt, why = choose_device_dtype("auto", "auto")
    assert dev.type == "cpu" and dt == torch.float32 and "no native bf16" in why
    dev, dt, why = choose_device_dtype("cpu", "fp32")
    assert dt == torch.float32 and "requested" in why
    dev, dt, why = choose_device_dtype("cpu", "bf16")
    assert dt == torch.bfloat16 and "bf16 autocast on CPU" in why


    with pytest.raises(ValueError, match="runtime.device=cuda but torch sees no CUDA device"):
        choose_device_dtype("cuda", "auto")
    with pytest.raises(ValueError, match="runtime.dtype"):
        choose_device_dtype("cpu", "fp16")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    rt = init_runtime(RuntimeConfig(device="cpu"))
    assert rt.world_size == 1 and rt.is_main and not rt.compile
    cmd = torchrun_argv(2, "stages.pretrain", ["--out", "x"])
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] and cmd[-2:] == [
        "--out",
        "x",
    ]


@pytest.mark.parametrize(("flags", "named"), [
    ("fpu sse avx512f avx512_bf16", "native avx512_bf16"),  # AMD Zen 4: no AMX
    ("fpu avx512_bf16 amx_bf16 amx_tile", "native amx_bf16 and avx512_bf16"),  # Sapphire Rapids
])
def test_the_reason_names_the_bf16_features_the_cpu_has(monkeypatch, tmp_path, flags: str, named: str) -> None:
    """The log says which native bf16 the CPU has, not "avx512_bf16/amx" on a CPU without AMX."""
    import lockstep.core.runtime as runtime_mod

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    features = runtime_mod.cpu_bf16_features(cpuinfo)
    monkeypatch.setattr(runtime_mod, "cpu_bf16_features", lambda: features)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, dtype, why = runtime_mod.choose_device_dtype("cpu", "auto")
    assert dtype == torch.bfloat16 and f"{named};" in why and "/amx" not in why
    assert runtime_mod.choose_device_dtype("cpu", "bf16")[2].endswith(f"(requested; {named})")
