"""A NaN or inf loss, gradient or weight stops training (pretrain/midtrain/SFT loop and RL)
before the bad update or checkpoint is written; `nonfinite_patience` skips isolated bad steps
without touching the weights."""

from __future__ import annotations

import math

import pytest
import torch

from _tiny_model import tiny_gpt
from lockstep.core.runtime import Runtime
from lockstep.model.checkpoint import list_checkpoints, load_checkpoint
from lockstep.model.gpt import GPT
from lockstep.rl.config import RLConfig
from lockstep.rl.rollouts import Completion, Rollouts
from lockstep.rl.trainer import RLTrainer
from lockstep.train.optim import OptimConfig
from lockstep.train.trainer import ModelParams, NonFiniteError, TrainConfig, Trainer, Validation

V, T = 64, 32
ACCUM = 2  # micro-batches per step in _cfg: batch_tokens / (device_batch_rows * T)
CPU = Runtime(device=torch.device("cpu"), dtype=torch.float32, reason="test")


class ToySource:
    """Random windows of a fixed periodic token stream."""

    def __init__(self) -> None:
        motif = torch.randint(1, V, (37,), generator=torch.Generator().manual_seed(0))
        self.stream = motif.repeat(4096 // 37 + 1)[:4096]

    def get_batch(self, *, B: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        starts = torch.randint(0, self.stream.numel() - T - 1, (B,), generator=generator)
        rows = torch.stack([self.stream[s: s + T + 1] for s in starts.tolist()])  # (B, T+1)
        return rows[:, :-1], rows[:, 1:]


def _model() -> GPT:
    return GPT.build(ModelParams(depth=1, sequence_len=T, head_dim=16).gpt_config(V), "cpu", seed=3)


def _cfg(**kw) -> TrainConfig:
    base = dict(
        batch_tokens=ACCUM * 2 * T,
        device_batch_rows=2,
        num_steps=6,
        eval_every_steps=0,
        eval_tokens=4 * T,
        checkpoint_every_steps=2,
        warmup_steps=1,
        peak_flops=1e12,
        optim=OptimConfig(muon_momentum_warmup_steps=4),
    )
    base.update(kw)
    return TrainConfig(**base)


def _run(model: GPT, run_dir, cfg: TrainConfig, *, stop_at_step: int | None = None, **kw):
    trainer = Trainer(
        model,
        cfg,
        CPU,
        data=ToySource(),
        seed=5,
        validation=Validation(ToySource(), torch.ones(V, dtype=torch.int32)),
        **kw,
    )
    return trainer.fit(run_dir, {"stage": "test", "code_revision": "test"}, stop_at_step=stop_at_step)


def _nan_loss_on(model: torch.nn.Module, steps: set[int], passes_per_step: int = ACCUM) -> None:
    """Make the training loss NaN on the given 1-based optimizer steps (eval passes untouched)."""
    calls = [0]

    def hook(module, args, out):
        if not module.training:
            return out
        step = calls[0] // passes_per_step + 1
        calls[0] += 1
        return out * math.nan if step in steps else out

    model.register_forward_hook(hook)


def _inf_grad_on(model: GPT, steps: set[int]) -> None:
    """Make one weight's gradient infinite on the given steps; the loss stays finite."""
    calls = [0]

    def hook(grad):
        step = calls[0] // ACCUM + 1
        calls[0] += 1
        return grad + math.inf if step in steps else grad

    model.lm_head.weight.register_hook(hook)


def _states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_nan_loss_stops_before_the_update_and_the_next_checkpoint(tmp_path) -> None:
    model = _model()
    _nan_loss_on(model, {3})
    with pytest.raises(NonFiniteError, match=r"step 3/6: loss nan.*pretrain\.nonfinite_patience=0") as e:
        _run(model, tmp_path / "run", _cfg(), params_section="pretrain")
    assert "pretrain.optim.*_lr" in str(e.value)
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [2]
    # The NaN step's update was never applied: the weights are still those of step 2.
    saved = load_checkpoint(tmp_path / "run" / "step_00000002").model_state
    assert _states_equal(saved, model.state_dict())


@pytest.mark.parametrize("grad_clip", [0.0, 1.0])
def test_non_finite_gradient_with_a_finite_loss_is_caught(tmp_path, grad_clip: float) -> None:
    model = _model()
    _inf_grad_on(model, {2})
    with pytest.raises(NonFiniteError, match=r"step 2/6: loss [0-9.]+, gradient norm (inf|nan)"):
        _run(model, tmp_path / "run", _cfg(optim=OptimConfig(muon_momentum_warmup_steps=4, grad_clip=grad_clip)))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert list_checkpoints(tmp_path / "run") == []


def test_patience_skips_an_isolated_step_without_touching_the_weights(tmp_path, caplog) -> None:
    clean = _model()
    _run(clean, tmp_path / "clean", _cfg(), stop_at_step=2)
    skipped = _model()
    _nan_loss_on(skipped, {3})
    res = _run(skipped, tmp_path / "skipped", _cfg(nonfinite_patience=1), stop_at_step=3)
    assert res.step == 3 and [s for s, _ in res.losses] == [1, 2]
    assert _states_equal(clean.state_dict(), skipped.state_dict())
    assert "step 3/6: loss nan" in caplog.text and "update skipped (1 of 1 tolerated in a row)" in caplog.text
    # and training goes on to the end after it
    model = _model()
    _nan_loss_on(model, {3})
    res = _run(model, tmp_path / "full", _cfg(nonfinite_patience=1))
    assert res.step == 6 and [s for s, _ in res.losses] == [1, 2, 4, 5, 6]
    assert all(math.isfinite(loss) for _, loss in res.losses)


def test_patience_counts_consecutive_steps(tmp_path) -> None:
    model = _model()
    _nan_loss_on(model, {3, 4})
    with pytest.raises(NonFiniteError, match=r"step 4/6: .*2 non-finite step\(s\) in a row"):
        _run(model, tmp_path / "run", _cfg(nonfinite_patience=1))


def test_non_finite_weights_are_never_checkpointed(tmp_path) -> None:
    model = _model()

    def poison(row: dict[str, float]) -> None:
        if row.get("step") == 4 and "train_loss" in row:  # step 4 is a checkpoint step
            with torch.no_grad():
                model.blocks[0].mlp.c_fc.weight[0, 0] = math.inf

    with pytest.raises(NonFiniteError, match=r"step 4: weights blocks\.0\.mlp\.c_fc\.weight are not finite"):
        _run(model, tmp_path / "run", _cfg(), on_step=poison)
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [2]


# --- RL ---

def _policy() -> GPT:
    return tiny_gpt()


def _rl(model: GPT, tok, monkeypatch: pytest.MonkeyPatch, on_step=None, **kw):
    """RLTrainer.fit on fixed rollouts (one rewarded, one not), so every step has an update."""
    prompt, good, bad = tok.encode("Q: 2+2? A:"), tok.encode("#### 4"), tok.encode("#### 5")
    fixed = Rollouts(
        [Completion(prompt, good, [1] * len(good), 1.0, 0.5), Completion(prompt, bad, [1] * len(bad), 0.0, -0.5)]
    )
    monkeypatch.setattr(RLTrainer, "rollout", lambda *a, **k: fixed)
    cfg = RLConfig(num_steps=3, problems_per_step=1, group_size=2, max_new_tokens=2, device_batch_rows=2,
                   eval_every_steps=0, eval_problems=1, pass_k=1, **kw)
    problems = [{"question": "2+2?", "answer": "#### 4"}]
    return RLTrainer(
        model,
        tok,
        cfg,
        train_problems=problems,
        val_problems=problems,
        device=torch.device("cpu"),
        seed=1,
        on_step=on_step,
    ).fit()


def test_rl_stops_on_a_nan_loss(tok, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _policy()
    _nan_loss_on(model, {2}, passes_per_step=1)
    with pytest.raises(NonFiniteError, match=r"step 2/3: loss nan.*rl\.nonfinite_patience=0.*rl\.optim\.\*_lr"):
        _rl(model, tok, monkeypatch)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_rl_patience_skips_the_update(tok, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _policy()
    _nan_loss_on(model, {2}, passes_per_step=1)
    after: dict[int, dict[str, torch.Tensor]] = {}

    def snapshot(row: dict[str, float]) -> None:
        if "reward" in row:
            after[int(row["step"])] = {k: v.clone() for k, v in model.state_dict().items()}

    result = _rl(model, tok, monkeypatch, on_step=snapshot, nonfinite_patience=1)
    assert result.steps == 3
    assert _states_equal(after[1], after[2])  # the NaN update was skipped ...
    assert not _states_equal(after[2], after[3])  # ... and the next one applied
    assert all(torch.isfinite(p).all() for p in model.parameters())
