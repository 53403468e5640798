"""Checkpoint format: round trip, byte-stable saves, tamper refusal, SIGKILL during save, pruning."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from lockstep.checkpoint import (
    CheckpointError,
    clean_incomplete,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    step_dir,
    verify_checkpoint,
)
from lockstep.io import sha256_file
from lockstep.optim import AdamW


def _state(seed: int) -> tuple[dict, dict, dict, dict]:
    g = torch.Generator().manual_seed(seed)
    model = {"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}
    p = torch.nn.Parameter(model["w"].clone())
    opt = AdamW([p], lr=0.1)
    p.grad = torch.randn(16, 8, generator=g)
    opt.step()
    optim = {"optimizers": [opt.state_dict()]}
    meta = {"step": seed, "model_config": {"n_layer": 1}, "loader": {"pos": [1, 2]}}
    rng = {"rank0/data": g.get_state()}
    return model, optim, meta, rng


def test_round_trip(tmp_path) -> None:
    model, optim, meta, rng = _state(3)
    save_checkpoint(tmp_path / "ck", model, {0: optim, 1: optim}, meta, rng)
    ck = load_checkpoint(tmp_path / "ck")
    assert ck.step == 3
    assert ck.meta["loader"] == {"pos": [1, 2]}
    for k, v in model.items():
        assert torch.equal(ck.model_state[k], v)
    assert torch.equal(ck.rng_states["rank0/data"], rng["rank0/data"])
    loaded = ck.optim_state(1)["optimizers"][0]
    assert torch.equal(loaded["state"][0]["exp_avg"], optim["optimizers"][0]["state"][0]["exp_avg"])
    with pytest.raises(CheckpointError, match="2 rank"):
        ck.optim_state(2)


@pytest.mark.parametrize("meta, kind", [([1, 2], "an array"), ("step 3", "a string"), (None, "null"), (7, "a number")])
def test_meta_that_is_not_an_object_is_refused(tmp_path, meta, kind) -> None:
    model, optim, good_meta, rng = _state(3)
    save_checkpoint(tmp_path / "ck", model, {0: optim}, good_meta, rng)
    # Consistent with its manifest, so only the meta.json check can refuse it.
    (tmp_path / "ck/meta.json").write_text(json.dumps(meta))
    manifest = json.loads((tmp_path / "ck/manifest.json").read_text())
    manifest["files"]["meta.json"] = sha256_file(tmp_path / "ck/meta.json")
    (tmp_path / "ck/manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"meta.json holds {kind}, not a JSON object: .* delete the checkpoint"):
        load_checkpoint(tmp_path / "ck")
    (tmp_path / "ck/meta.json").write_text("{broken")
    manifest["files"]["meta.json"] = sha256_file(tmp_path / "ck/meta.json")
    (tmp_path / "ck/manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        load_checkpoint(tmp_path / "ck")


def test_same_state_same_bytes(tmp_path) -> None:
    for name in ("a", "b"):
        model, optim, meta, rng = _state(4)
        save_checkpoint(tmp_path / name, model, {0: optim}, meta, rng)
    assert (tmp_path / "a/manifest.json").read_bytes() == (tmp_path / "b/manifest.json").read_bytes()


@pytest.mark.parametrize("how", ["flip", "extra", "missing", "no_manifest"])
def test_tampered_checkpoint_is_refused(tmp_path, how: str) -> None:
    model, optim, meta, rng = _state(5)
    ck = tmp_path / "ck"
    save_checkpoint(ck, model, {0: optim}, meta, rng)
    if how == "flip":
        data = bytearray((ck / "model.safetensors").read_bytes())
        data[-1] ^= 1
        (ck / "model.safetensors").write_bytes(bytes(data))
    elif how == "extra":
        (ck / "notes.txt").write_text("x")
    elif how == "missing":
        (ck / "optim_rank0.pt").unlink()
    else:
        (ck / "manifest.json").unlink()
    with pytest.raises(CheckpointError):
        load_checkpoint(ck)


def test_meta_edit_is_refused(tmp_path) -> None:
    model, optim, meta, rng = _state(6)
    save_checkpoint(tmp_path / "ck", model, {0: optim}, meta, rng)
    m = json.loads((tmp_path / "ck/meta.json").read_text())
    m["step"] = 99
    (tmp_path / "ck/meta.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="meta.json"):
        verify_checkpoint(tmp_path / "ck")


def test_prune_keeps_last_k(tmp_path) -> None:
    model, optim, meta, rng = _state(7)
    for step in range(1, 6):
        save_checkpoint(step_dir(tmp_path, step), model, {0: optim}, {**meta, "step": step}, rng)
    prune_checkpoints(tmp_path, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    with pytest.raises(ValueError, match="keep_last"):
        prune_checkpoints(tmp_path, keep_last=1)


def test_sigkill_during_save_leaves_a_loadable_latest(tmp_path) -> None:
    """20 kills at random times while a child saves checkpoints in a loop: each time, the latest
    complete checkpoint loads and matches its manifest, and cleanup removes the debris."""
    g = torch.Generator().manual_seed(11)
    run = tmp_path / "run"
    # Big enough that a save takes a few ms, so kills land inside saves.
    big = {"w": torch.randn(512, 512, generator=g)}
    model, optim, meta, rng = _state(8)
    save_checkpoint(step_dir(run, 0), big, {0: optim}, {**meta, "step": 0}, rng)
    step = 1
    for _ in range(20):
        pid = os.fork()
        if pid == 0:  # child: save forever
            try:
                s = step
                while True:
                    save_checkpoint(step_dir(run, s), big, {0: optim}, {**meta, "step": s}, rng)
                    prune_checkpoints(run, keep_last=2)
                    s += 1
            finally:
                os._exit(0)
        delay_s = 0.002 + 0.05 * torch.rand((), generator=g).item()
        time.sleep(delay_s)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        latest = latest_checkpoint(run)
        assert latest is not None
        ck = load_checkpoint(latest)
        assert torch.equal(ck.model_state["w"], big["w"])
        clean_incomplete(run)
        step = max(s for s, _ in list_checkpoints(run)) + 1
    assert not [p for p in run.iterdir() if p.name.startswith(".")]
