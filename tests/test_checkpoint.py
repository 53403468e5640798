"""Checkpoint format: round trip, byte-stable saves, tamper refusal, SIGKILL during save, pruning,
and load_model: the model back, a wrong tokenizer, format or model config refused."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from _tiny_model import randomize, tiny_gpt
from lockstep.core.io import sha256_file
from lockstep.model.checkpoint import (
    CheckpointError,
    clean_incomplete,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_model,
    prune_checkpoints,
    save_checkpoint,
    step_dir,
    verify_checkpoint,
)
from lockstep.model.gpt import GPT
from lockstep.train.optim import AdamW


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


# ---- load_model ---------------------------------------------------------------------------------

TOKENIZER_SHA = "a" * 64


def _model_checkpoint(path, **meta_overrides) -> GPT:
    """A random 1-layer GPT saved as a training stage would save it."""
    # not the init: zero-initialised projections would hide a bad load
    model = randomize(tiny_gpt(seed=4, sequence_len=32, vocab_size=64), seed=5, scale=0.1)
    config = model.config
    meta = {
        "stage": "sft",
        "step": 3,
        "model_config": config.to_dict(),
        "tokenizer_sha256": TOKENIZER_SHA,
        **meta_overrides,
    }
    save_checkpoint(path, model.state_dict(), {0: {}}, {k: v for k, v in meta.items() if v is not None})
    return model


def _rewrite_meta(path, edit) -> None:
    """Edit meta.json and re-hash it in the manifest, so only load_model's own checks can refuse it."""
    meta = json.loads((path / "meta.json").read_text())
    edit(meta)
    (path / "meta.json").write_text(json.dumps(meta))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["meta.json"] = sha256_file(path / "meta.json")
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_load_model_gives_back_the_saved_model(tmp_path) -> None:
    saved = _model_checkpoint(tmp_path / "ck")
    model, meta = load_model(tmp_path / "ck", "cpu", tokenizer_sha256=TOKENIZER_SHA)
    assert meta["step"] == 3 and meta["stage"] == "sft" and not model.training
    assert model.config == saved.config
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x), saved(x))
    # Without a hash to check against, any tokenizer's checkpoint loads (inspection, tests).
    assert load_model(tmp_path / "ck", "cpu")[1]["tokenizer_sha256"] == TOKENIZER_SHA


@pytest.mark.parametrize("embedding", ["flat", "tuple"])
def test_load_model_draws_nothing_and_equals_a_built_model(tmp_path, embedding) -> None:
    """load_model builds no initial weights: it leaves the global generator where it was, and gives
    what GPT.build's model gives once the checkpoint's state dict is loaded into it, every
    parameter and buffer (the rotary tables, outside the state dict, and the tuple embedding's
    token rows, inside it) and so the same logits."""
    model = randomize(tiny_gpt(seed=4, sequence_len=32, vocab_size=64, embedding=embedding), seed=5, scale=0.1)
    if embedding == "tuple":  # rows other than the defaults the init would leave
        model.embed.set_token_structure(torch.arange(-1, 63), torch.arange(64) * 3 % 256)
    save_checkpoint(tmp_path / "ck", model.state_dict(), {0: {}},
                    {"stage": "sft", "step": 3, "model_config": model.config.to_dict()})
    built = GPT.build(model.config, "cpu", seed=0)
    built.load_state_dict(load_checkpoint(tmp_path / "ck").model_state)
    built.eval()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    loaded, _ = load_model(tmp_path / "ck", "cpu")
    assert torch.equal(torch.get_rng_state(), before), "load_model drew from the global generator"
    want = dict(built.named_buffers()) | dict(built.named_parameters())
    got = dict(loaded.named_buffers()) | dict(loaded.named_parameters())
    assert list(got) == list(want) and "rotary_cos" in got
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(x), built(x)) and torch.equal(loaded(x), model.eval()(x))


def test_load_model_casts_the_weights_to_a_dtype(tmp_path) -> None:
    saved = _model_checkpoint(tmp_path / "ck")
    model, _ = load_model(tmp_path / "ck", "cpu", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()) and not model.training
    assert model.rotary_cos.dtype == torch.float32  # derived tables stay fp32, as GPT.build leaves them
    for (name, p), q in zip(model.named_parameters(), saved.parameters(), strict=True):
        assert torch.equal(p, q.to(torch.bfloat16)), name


def test_load_model_refuses_another_tokenizer(tmp_path) -> None:
    _model_checkpoint(tmp_path / "ck")
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint {tmp_path / 'ck'} was trained with tokenizer aaaaaaaaaaaa\.\.\., "
        r"not the tokenizer in use \(bbbbbbbbbbbb\.\.\.\); re-run the earlier stages",
    ):
        load_model(tmp_path / "ck", "cpu", tokenizer_sha256="b" * 64)
    _model_checkpoint(tmp_path / "unrecorded", tokenizer_sha256=None)
    with pytest.raises(CheckpointError, match="trained with no recorded tokenizer.*re-run the earlier stages"):
        load_model(tmp_path / "unrecorded", "cpu", tokenizer_sha256=TOKENIZER_SHA)


def test_load_model_refuses_a_checkpoint_without_manifest(tmp_path) -> None:
    _model_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"has no manifest.json: it is incomplete"):
        load_model(tmp_path / "ck", "cpu", tokenizer_sha256=TOKENIZER_SHA)
    with pytest.raises(CheckpointError, match="does not exist; run the stage that writes it"):
        load_model(tmp_path / "missing", "cpu")


def test_load_model_refuses_another_format(tmp_path) -> None:
    _model_checkpoint(tmp_path / "ck")
    _rewrite_meta(tmp_path / "ck", lambda m: m.update(format="lockstep-checkpoint-v0"))
    with pytest.raises(CheckpointError, match="has format 'lockstep-checkpoint-v0', expected 'lockstep-checkpoint-v1'"):
        load_model(tmp_path / "ck", "cpu", tokenizer_sha256=TOKENIZER_SHA)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("model_config"), "has no model_config"),
    (lambda m: m["model_config"].update(n_layers=2), "holds a model_config this code cannot build"),
    (lambda m: m["model_config"].update(n_embd=64), "model.safetensors does not fit its model_config"),
], ids=["missing", "unknown_key", "wrong_shape"])
def test_load_model_refuses_a_model_config_it_cannot_use(tmp_path, edit, message) -> None:
    _model_checkpoint(tmp_path / "ck")
    _rewrite_meta(tmp_path / "ck", edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path / "ck", "cpu", tokenizer_sha256=TOKENIZER_SHA)
