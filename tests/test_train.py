"""Training loop: schedule and horizon, one Trainer step and its state, the order of a step's batch
draws, copies, host read and updates, learning on a toy source, bit-exact resume and
byte-identical outputs on CPU."""

from __future__ import annotations

import ast
import copy
import logging
import math
import re
from pathlib import Path
from unittest import mock

import pytest
import torch

import lockstep.train.trainer
from lockstep.core.config import ConfigError
from lockstep.core.io import sha256_file
from lockstep.core.runtime import Runtime
from lockstep.model.checkpoint import load_checkpoint
from lockstep.model.gpt import GPT, IGNORE_INDEX
from lockstep.rl.config import RLConfig
from lockstep.train import objectives
from lockstep.train.optim import OptimConfig
from lockstep.train.trainer import (
    ModelParams,
    TrainConfig,
    Trainer,
    TrainResult,
    Validation,
    batch_generator,
    grad_accum_steps,
    horizon_steps,
    host_to_device,
    lr_multiplier,
)

V, T = 64, 32
CPU = Runtime(device=torch.device("cpu"), dtype=torch.float32, reason="test")


class ToySource:
    """Random windows of a fixed periodic token stream (learnable), with a masked variant."""

    def __init__(self, n_tokens: int = 4096) -> None:
        g = torch.Generator().manual_seed(0)
        motif = torch.randint(1, V, (37,), generator=g)
        self.stream = motif.repeat(n_tokens // 37 + 1)[:n_tokens]

    def get_batch(self, *, B: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        starts = torch.randint(0, self.stream.numel() - T - 1, (B,), generator=generator)
        rows = torch.stack([self.stream[s : s + T + 1] for s in starts.tolist()])  # (B, T+1)
        x, y = rows[:, :-1], rows[:, 1:]
        y_masked = y.clone()
        y_masked[:, : T // 2] = IGNORE_INDEX
        return x, y, y_masked


def _model() -> GPT:
    return GPT.build(ModelParams(depth=1, sequence_len=T, head_dim=16).gpt_config(V), "cpu", seed=3)


def _cfg(**kw) -> TrainConfig:
    base = dict(batch_tokens=2 * 2 * T, device_batch_rows=2, num_steps=6, eval_every_steps=0, eval_tokens=4 * T,
                checkpoint_every_steps=2, warmup_steps=1, peak_flops=1e12,
                optim=OptimConfig(muon_momentum_warmup_steps=4))
    base.update(kw)
    return TrainConfig(**base)


def _trainer(model: GPT, cfg: TrainConfig, rt: Runtime = CPU, **kw) -> Trainer:
    """A Trainer on ToySource batches and validation windows, seed 5."""
    return Trainer(
        model,
        cfg,
        rt,
        data=ToySource(),
        seed=5,
        validation=Validation(ToySource(), torch.ones(V, dtype=torch.int32)),
        **kw,
    )


def _fit(
    model: GPT, cfg: TrainConfig, run_dir, rt: Runtime = CPU, *, stop_at_step: int | None = None, **kw
) -> TrainResult:
    return _trainer(model, cfg, rt, **kw).fit(Path(run_dir), {"stage": "test", "code_revision": "test"},
                                              stop_at_step=stop_at_step)


def _run(run_dir, cfg: TrainConfig, **kw):
    model = _model()
    return model, _fit(model, cfg, run_dir, **kw)


def test_lr_schedule_shape() -> None:
    kw = dict(warmup_steps=2, warmdown_frac=0.5, final_lr_frac=0.1)
    m = [lr_multiplier(s, 10, **kw) for s in range(10)]
    assert m[0] == 0.5 and m[1] == 1.0 and m[4] == 1.0
    assert m[5] == 1.0 and m[9] == pytest.approx(0.2 + 0.8 * 0.1)
    assert all(a >= b for a, b in zip(m[1:], m[2:]))


def test_schedule_fields_are_shared_with_rl() -> None:
    assert _cfg(warmup_steps=2).lr_multiplier(0, 10) == lr_multiplier(0, 10, warmup_steps=2, warmdown_frac=0.4,
                                                                       final_lr_frac=0.0)
    assert RLConfig().warmdown_frac == 0.5 and TrainConfig().warmdown_frac == 0.4  # the sections' own defaults
    for section in (TrainConfig, RLConfig):
        with pytest.raises(ConfigError, match="warmdown_frac"):
            section(warmdown_frac=1.5)
        with pytest.raises(ConfigError, match="warmup_steps"):
            section(warmup_steps=-1)


def test_one_step_changes_loss_counter_and_optimizer_state() -> None:
    model = _model()
    trainer = _trainer(model, _cfg())
    before = copy.deepcopy(model.state_dict())
    assert trainer.step_count == 0 and not any(o.state for o in trainer.optimizers)
    stats = trainer.step()
    assert stats.step == trainer.step_count == 1 and stats.applied
    assert stats.lr_mult == 1.0 and torch.isfinite(torch.tensor(stats.train_loss))  # warmup_steps=1: full LR at step 0
    assert all(o.state for o in trainer.optimizers)  # AdamW moments and Muon momentum now exist
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    second = trainer.step()
    assert second.step == 2 and second.train_loss != stats.train_loss
    assert [s for s, _ in trainer.losses] == [1, 2]


def test_state_dict_round_trip_continues_exactly() -> None:
    trainer = _trainer(_model(), _cfg())
    trainer.step()
    trainer.step()
    state = copy.deepcopy(trainer.state_dict())
    continued = [trainer.step().train_loss for _ in range(2)]
    fresh_model = GPT.build(ModelParams(depth=1, sequence_len=T, head_dim=16).gpt_config(V), "cpu", seed=99)
    fresh = _trainer(fresh_model, _cfg())
    fresh.load_state_dict(state)
    assert fresh.step_count == 2
    assert [fresh.step().train_loss for _ in range(2)] == continued
    for (k, a), b in zip(trainer.model.state_dict().items(), fresh_model.state_dict().values()):
        assert torch.equal(a, b), k


def test_no_function_in_train_module_over_80_lines() -> None:
    tree = ast.parse(Path(lockstep.train.trainer.__file__).read_text())
    lengths = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert max(lengths.values()) <= 80, sorted(lengths.items(), key=lambda kv: -kv[1])[:3]


def test_horizon_precedence() -> None:
    assert horizon_steps(_cfg(num_steps=7, target_flops=1e9), flops_per_token=100, num_params=10)[0] == 7
    cfg = _cfg(num_steps=0, target_flops=128 * 100 * 5.0, tokens_params_ratio=20)
    assert horizon_steps(cfg, flops_per_token=100, num_params=10)[0] == 5
    assert horizon_steps(_cfg(num_steps=0, tokens_params_ratio=20), flops_per_token=1, num_params=64)[0] == 10
    with pytest.raises(ConfigError, match="horizon"):
        horizon_steps(_cfg(num_steps=0), flops_per_token=1, num_params=1)


def test_batch_must_divide() -> None:
    with pytest.raises(ConfigError, match="device_batch_rows"):
        grad_accum_steps(_cfg(batch_tokens=100), seq_len=T, world_size=1)
    assert grad_accum_steps(_cfg(), seq_len=T, world_size=1) == 2


def test_learns_toy_stream(tmp_path) -> None:
    _, res = _run(tmp_path / "run", _cfg(num_steps=30, checkpoint_every_steps=0))
    assert res.losses[-1][1] < 0.5 * res.losses[0][1]
    assert res.final_eval["val_bpb"] < res.final_eval["unigram_bpb"]


def test_resume_is_bit_exact(tmp_path) -> None:
    full_model, full = _run(tmp_path / "a", _cfg())
    # Killed after step 3 (checkpoint at 2: step 3 is lost and redone), then after step 5.
    _, first = _run(tmp_path / "b", _cfg(), stop_at_step=3)
    assert first.step == 3
    _, second = _run(tmp_path / "b", _cfg(), stop_at_step=5)
    assert second.resumed_from == 2
    rows: list[dict] = []
    resumed_model, third = _run(tmp_path / "b", _cfg(), on_step=rows.append)
    assert third.resumed_from == 4
    # The per-step series replays the checkpointed steps, so plots cover the whole run.
    assert [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r] == full.losses
    losses = dict(first.losses[:2] + second.losses[:2] + third.losses)
    assert losses == dict(full.losses)
    for (k, a), b in zip(full_model.state_dict().items(), resumed_model.state_dict().values()):
        assert torch.equal(a, b), k
    assert sha256_file(full.checkpoint / "model.safetensors") == sha256_file(third.checkpoint / "model.safetensors")
    assert (full.checkpoint / "optim_rank0.pt").read_bytes() == (third.checkpoint / "optim_rank0.pt").read_bytes()


def test_identical_runs_identical_files(tmp_path) -> None:
    _, a = _run(tmp_path / "a", _cfg(num_steps=3, loss="assistant"))
    _, b = _run(tmp_path / "b", _cfg(num_steps=3, loss="assistant"))
    for name in ("model.safetensors", "optim_rank0.pt", "meta.json", "manifest.json"):
        assert (a.checkpoint / name).read_bytes() == (b.checkpoint / name).read_bytes(), name
    assert load_checkpoint(a.checkpoint).step == 3



def test_prefix_smooth_objective_trains_and_weight_zero_is_cross_entropy(tmp_path) -> None:
    # token i spells i in binary, so its parent is i // 2 (a binary tree; 0 and 1 have none)
    from lockstep.tokenizer.prefix_tree import prefix_tree

    class BinaryTokens:
        def prefix_tree(self):
            return prefix_tree([f"{i:b}".encode() for i in range(V)])

        def get_vocab_size(self) -> int:
            return V

    def smooth_cfg(weight: float) -> TrainConfig:
        return _cfg(objective="prefix_smooth", prefix_weight=weight)

    assert objectives.build(_cfg(), BinaryTokens()) is objectives.cross_entropy_objective
    _, ce = _run(tmp_path / "ce", _cfg())
    _, zero = _run(tmp_path / "zero", smooth_cfg(0.0), loss=objectives.build(smooth_cfg(0.0), BinaryTokens()))
    assert zero.losses == ce.losses  # w = 0 is the cross-entropy, bit for bit
    model, smooth = _run(tmp_path / "smooth", smooth_cfg(0.3), loss=objectives.build(smooth_cfg(0.3), BinaryTokens()))
    assert smooth.losses != ce.losses and all(torch.isfinite(torch.tensor(loss)) for _, loss in smooth.losses)
    with pytest.raises(ValueError, match="ancestor table"):
        _run(tmp_path / "none", _cfg(objective="prefix_smooth"))
    with pytest.raises(ConfigError, match="prefix_weight"):
        _cfg(prefix_weight=-1.0)


class _IndexSource(ToySource):
    """ToySource's windows gathered by tensor indexing, so drawing a batch reads nothing to the host."""

    def get_batch(self, *, B: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        starts = torch.randint(0, self.stream.numel() - T - 1, (B,), generator=generator)
        rows = self.stream[starts[:, None] + torch.arange(T + 1)]  # (B, T+1)
        return rows[:, :-1], rows[:, 1:]


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the reads of tensor values to the host: item(), bool(), float() go through
    aten._local_scalar_dense; tolist() and Runtime.synchronize are counted by the test's patches."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_one_host_sync_per_step(monkeypatch) -> None:
    """The loop's device work is queued without waiting: per optimizer step exactly one read to the
    host (loss, gradient norm and target count in one transfer, which the NaN guard needs before the
    update). On CUDA every such read, and every synchronize, stalls the queue."""
    for accum in (1, 2):
        trainer = Trainer(_model(), _cfg(batch_tokens=accum * 2 * T), CPU, data=_IndexSource(), seed=5)
        trainer.step()  # the first step builds optimizer state
        reads = _HostReads()
        tolist, syncs = torch.Tensor.tolist, []
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: (syncs.append("tolist"), tolist(t))[1])
        monkeypatch.setattr(Runtime, "synchronize", lambda self: syncs.append("synchronize"))
        with reads:
            for _ in range(3):
                trainer.step()
        monkeypatch.undo()
        assert (syncs, reads.count) == (["tolist"] * 3, 0), accum


class _RecordingSource(_IndexSource):
    """_IndexSource that knows which (step, micro-batch) each batch belongs to (from its generator's
    seed, for seed 5) and keeps, by the id of each batch's inputs, that tag and the tensor."""

    def __init__(self, events: list[tuple]) -> None:
        super().__init__()
        self.events, self.inputs = events, {}
        self.tags = {
            batch_generator(5, step, micro).initial_seed(): (step, micro) for step in range(8) for micro in range(4)
        }

    def get_batch(self, *, B: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        batch = super().get_batch(B=B, generator=generator)
        tag = self.tags[generator.initial_seed()]
        self.events.append(("draw", *tag))
        self.inputs[id(batch[0])] = (tag, batch[0])
        return batch


def _recorded(monkeypatch, trainer_kw: dict | None = None) -> tuple[Trainer, list[tuple]]:
    """A Trainer (3 steps of 2 micro-batches) whose steps leave events in order: ("draw", step,
    micro) as a micro-batch is drawn, ("copy", step, micro) as its inputs go to the device,
    ("forward", step, micro), ("read",) for each read to the host, ("update",) per optimizer step."""
    events: list[tuple] = []
    source = _RecordingSource(events)
    trainer = Trainer(_model(), _cfg(num_steps=3), CPU, data=source, seed=5, **(trainer_kw or {}))

    def copy_to(t, device):
        if id(t) in source.inputs:
            events.append(("copy", *source.inputs[id(t)][0]))
        return host_to_device(t, device)

    def forward(x, y, loss=trainer._eager_loss):
        events.append(("forward", *source.inputs[id(x)][0]))
        return loss(x, y)

    def update(opt_step):
        return lambda *a, **kw: (events.append(("update",)), opt_step(*a, **kw))[1]

    monkeypatch.setattr(lockstep.train.trainer, "host_to_device", copy_to)
    trainer._eager_loss = forward
    for opt in trainer.optimizers:
        opt.step = update(opt.step)
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: (events.append(("read",)), tolist(t))[1])
    return trainer, events


def _step_events(step: int, *, next_step: bool = True, applied: bool = True) -> list[tuple]:
    """What step `step` should record: its forwards (its batches drawn the step before), the one
    read, the next step's batches drawn and copied, then the two optimizer updates."""
    drawn = [e for m in range(2) for e in (("draw", step + 1, m), ("copy", step + 1, m))] if next_step else []
    return [("forward", step, 0), ("forward", step, 1), ("read",)] + drawn + [("update",)] * 2 * applied


def test_next_steps_batches_are_drawn_and_copied_before_this_steps_update(monkeypatch) -> None:
    trainer, events = _recorded(monkeypatch)
    for _ in range(3):
        trainer.step()
    first = [("draw", 0, 0), ("copy", 0, 0), ("draw", 0, 1), ("copy", 0, 1)]  # nothing was prefetched yet
    # the last step draws nothing: there is no step 3 to run
    assert events == first + _step_events(0) + _step_events(1) + _step_events(2, next_step=False)


def test_a_skipped_step_still_counts_so_the_batches_drawn_during_it_are_the_next_steps(monkeypatch) -> None:
    trainer, events = _recorded(monkeypatch)
    monkeypatch.setattr(trainer.guard, "check", lambda *a: False)  # every step non-finite, none applied
    trainer.step()
    trainer.step()
    assert events[4:] == _step_events(0, applied=False) + _step_events(1, applied=False)


def test_after_load_state_dict_a_step_draws_its_own_batches(monkeypatch) -> None:
    """The batches drawn during step 1 are step 2's: after loading the state of step 1 they are
    not used; step 1 draws its own, and its loss is step 1's again."""
    trainer, events = _recorded(monkeypatch)
    trainer.step()
    state = copy.deepcopy(trainer.state_dict())
    loss_1 = trainer.step().train_loss
    del events[:]
    trainer.load_state_dict(state)
    assert trainer.step().train_loss == loss_1
    assert events == [("draw", 1, 0), ("copy", 1, 0), ("draw", 1, 1), ("copy", 1, 1)] + _step_events(1)


def test_host_batches_are_pinned_and_copied_without_waiting_on_cuda() -> None:
    """The decision, with the CUDA calls stood in: a host tensor bound for CUDA is pinned, then
    copied with non_blocking=True (a copy from pageable memory could wait for the queued update);
    one already on the device is left to .to(); on the CPU the tensor itself comes back."""
    cuda = torch.device("cuda", 0)
    host = mock.MagicMock(spec=torch.Tensor, device=torch.device("cpu"))
    out = host_to_device(host, cuda)
    host.pin_memory.assert_called_once_with()
    host.pin_memory.return_value.to.assert_called_once_with(cuda, non_blocking=True)
    assert out is host.pin_memory.return_value.to.return_value
    host.to.assert_not_called()
    on_device = mock.MagicMock(spec=torch.Tensor, device=cuda)
    assert host_to_device(on_device, cuda) is on_device.to.return_value
    on_device.to.assert_called_once_with(cuda)
    on_device.pin_memory.assert_not_called()
    cpu_batch = torch.arange(6).view(2, 3)
    assert host_to_device(cpu_batch, torch.device("cpu")) is cpu_batch


class _ScriptedClock:
    """time.perf_counter for lockstep.train.trainer whose step times follow a script: each step() reads
    it twice (start, end), so every second call advances by the next scripted duration."""

    def __init__(self, step_s: list[float]) -> None:
        self.step_s, self.now, self.calls = list(step_s), 0.0, 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:
            self.now += self.step_s.pop(0)
        return self.now


def test_throughput_is_tokens_over_time_and_eta_follows_recent_steps(monkeypatch, caplog, tmp_path) -> None:
    """A machine that gets busy mid-run: three quiet 1 s steps, then 10 s steps. tok_per_s is the
    timed tokens over their time (not a median step, which hid the slowdown), and the progress
    line's ETA follows the recent steps."""
    cfg = _cfg(num_steps=8, checkpoint_every_steps=0)
    monkeypatch.setattr(lockstep.train.trainer.time, "perf_counter", _ScriptedClock([1, 1, 1, 1, 10, 10, 10, 10]))
    with caplog.at_level("INFO", logger="lockstep.train"):
        result = _fit(_model(), cfg, tmp_path / "run")
    timed = [1, 1, 1, 10, 10, 10, 10]  # the first step of a process is warm-up, left out
    assert result.tok_per_s == pytest.approx(cfg.batch_tokens * len(timed) / sum(timed))
    etas = [line.rsplit("eta ", 1)[1] for line in caplog.messages if "| eta " in line]
    assert etas[3] == lockstep.train.trainer._fmt_eta(4 * 1.0)  # after step 4 of 8: quiet so far
    assert etas[-2] == lockstep.train.trainer._fmt_eta(1 * sum([1, 1, 1, 10, 10, 10]) / 6)  # mean of recent steps
    assert result.train_time_s == pytest.approx(sum([1, 1, 1, 1, 10, 10, 10, 10]))


def test_measured_peak_is_the_better_of_stage_start_and_end(monkeypatch, tmp_path) -> None:
    """A peak measured while the machine was busy at the start is raised by the end's measurement
    (a busy start made MFU read 0.90); a declared peak is never re-measured."""
    monkeypatch.setattr(lockstep.train.trainer, "peak_flops", lambda rt, declared: (1e13, "measured float32 matmul"))
    monkeypatch.setattr(lockstep.train.trainer, "measure_matmul_peak_flops", lambda device, dtype: 3e13)
    result = _fit(_model(), _cfg(num_steps=2, checkpoint_every_steps=0), tmp_path / "a")
    assert result.peak == {"flops_per_s": 3e13, "source": "measured float32 matmul, best of stage start and end"}
    assert result.mfu == pytest.approx(result.tok_per_s * _model().flops_per_token() / 3e13)
    monkeypatch.undo()
    declared = _fit(_model(), _cfg(num_steps=2, checkpoint_every_steps=0, peak_flops=5e13), tmp_path / "b")
    assert declared.peak == {"flops_per_s": 5e13, "source": "declared in params"}


def test_mfu_over_100_percent_is_withheld_not_printed(monkeypatch, tmp_path, caplog) -> None:
    """A peak measured while other work held the cores can be below what the model then reaches
    (progress lines read `mfu 131.1%`): from the first such step the line says `mfu n/a`, one
    warning says why, and the result carries no MFU when even the end's measurement is too low."""
    monkeypatch.setattr(lockstep.train.trainer, "peak_flops", lambda rt, declared: (1.0, "measured float32 matmul"))
    monkeypatch.setattr(lockstep.train.trainer, "measure_matmul_peak_flops", lambda device, dtype: 2.0)
    caplog.set_level(logging.INFO, logger="lockstep.train")
    result = _fit(_model(), _cfg(num_steps=3, checkpoint_every_steps=0), tmp_path / "a")
    progress = [m for m in caplog.messages if "tok/s" in m and "| eta " in m]
    assert len(progress) == 3 and all("mfu n/a" in m for m in progress) and not any("%" in m for m in progress)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    warnings = [m for m in warnings if "MFU not shown" in m]
    assert len(warnings) == 1 and "other work held the cores" in warnings[0]
    assert math.isnan(result.mfu)
    assert result.peak["source"].endswith("MFU withheld: the run's mean rate is above this peak")


def test_mfu_under_the_peak_is_printed(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setattr(lockstep.train.trainer, "peak_flops", lambda rt, declared: (1e15, "measured float32 matmul"))
    monkeypatch.setattr(lockstep.train.trainer, "measure_matmul_peak_flops", lambda device, dtype: 1e15)
    caplog.set_level(logging.INFO, logger="lockstep.train")
    result = _fit(_model(), _cfg(num_steps=2, checkpoint_every_steps=0), tmp_path / "a")
    progress = [m for m in caplog.messages if "tok/s" in m and "| eta " in m]
    assert progress and all(re.search(r"mfu \d+\.\d%", m) for m in progress)
    assert 0 < result.mfu < 1 and not any("MFU not shown" in m for m in caplog.messages)
