"""Muon's compiled step (lockstep.train.optim._muon_group_update under torch.compile) against the eager
step it stands in for, on CPU in fp32: equal to rounding, the eager step exactly when the compile
fails (lockstep.core.fastpath), the same hyperparameter tensors every step; and the rule that picks it
(CUDA with compile and kernels on, never on CPU)."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch
from torch import nn

from lockstep.core import fastpath
from lockstep.core.runtime import Runtime
from lockstep.train import optim
from lockstep.train.optim import Muon, compiled_step, set_lr
from test_train import CPU, _cfg, _model, _trainer


def _matrices(seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    # two shapes: tall (transposed inside Newton-Schulz, aspect factor 2) and wide
    return [nn.Parameter(torch.randn(32, 16, generator=g)) for _ in range(3)] + \
           [nn.Parameter(torch.randn(16, 48, generator=g)) for _ in range(2)]


_KW = dict(lr=0.05, momentum=0.85, nesterov=True, weight_decay=0.1)


def _scheduled_steps(pairs: list[tuple[Muon, list[nn.Parameter]]], steps: int) -> None:
    """`steps` Muon steps of each (optimizer, its matrices), all given the same random gradients,
    under a momentum warm-up and a decaying LR: new hyperparameters every step."""
    for opt, _ in pairs:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        set_lr([opt for opt, _ in pairs], 1 - step / 8, momentum=0.85 + 0.02 * step)
        grads = [torch.randn(p.shape, generator=g) for p in pairs[0][1]]
        for opt, params in pairs:
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad.clone()
            opt.step()


def _compile_fails(gm: torch.fx.GraphModule, example_inputs: list) -> None:
    """A torch.compile backend that cannot compile anything."""
    raise RuntimeError("this backend compiles nothing")


def test_a_failed_compile_is_answered_by_the_eager_update_exactly(monkeypatch, caplog) -> None:
    monkeypatch.setattr(optim, "_compiled_muon_group_update", lambda: torch.compile(
        optim._muon_group_update, backend=_compile_fails, dynamic=False, fullgraph=True))
    torch._dynamo.reset()
    eager, compiled = _matrices(0), _matrices(0)
    opt_eager, opt_compiled = Muon(eager, **_KW), Muon(compiled, **_KW, compiled=True)
    with caplog.at_level(logging.WARNING, logger="lockstep.core.fastpath"):
        _scheduled_steps([(opt_eager, eager), (opt_compiled, compiled)], steps=4)
    for a, b, start in zip(eager, compiled, _matrices(0), strict=True):
        assert not torch.equal(b.data, start.data)
        assert torch.equal(b.data, a.data)
        assert torch.equal(opt_compiled.state[b]["momentum_buffer"], opt_eager.state[a]["momentum_buffer"])
    facts = fastpath.facts()["muon_compiled"]
    assert (facts["path"], facts["results"], facts["fast_calls"]) == ("reference", "reference", 0)
    assert facts["reference_calls"] == 2 * 4  # two shapes, four steps
    assert facts["fell_back"].startswith("BackendCompilerFailed"), facts["fell_back"]
    assert len([r for r in caplog.records if r.name == "lockstep.core.fastpath"]) == 1


def test_compiled_update_gets_the_same_hyperparameter_tensors_every_step(monkeypatch) -> None:
    """What the compiled graph receives: per same-shape stack three persistent 0-d fp32 tensors on
    the weights' device (the same objects and storage every step), holding this step's momentum,
    lr x aspect factor and 1 - lr x weight_decay as the eager update's fp32 kernels round them."""
    calls: list[tuple[tuple[int, ...], list[torch.Tensor], list[int], list[float]]] = []

    def recording_update(params, grads, bufs, *hyper, **kw):
        calls.append((tuple(params[0].shape), list(hyper), [t.data_ptr() for t in hyper], [t.item() for t in hyper]))
        optim._muon_group_update(params, grads, bufs, *hyper, **kw)

    monkeypatch.setattr(optim, "_compiled_muon_group_update", lambda: recording_update)
    params = _matrices(0)
    opt = Muon(params, **_KW, compiled=True)
    _scheduled_steps([(opt, params)], steps=3)
    assert [shape for shape, *_ in calls] == [(32, 16), (16, 48)] * 3
    for step in range(3):
        lr, mu = _KW["lr"] * (1 - step / 8), 0.85 + 0.02 * step
        for k, aspect in enumerate((2.0, 1.0)):
            shape, hyper, ptrs, values = calls[2 * step + k]
            first_hyper, first_ptrs = calls[k][1], calls[k][2]
            assert all(t is f for t, f in zip(hyper, first_hyper, strict=True)) and ptrs == first_ptrs, (step, shape)
            assert all(t.shape == () and t.dtype == torch.float32 and t.device == params[0].device for t in hyper)
            fp32 = [torch.tensor(x, dtype=torch.float32).item() for x in (mu, lr * math.sqrt(aspect), 1 - lr * 0.1)]
            assert values == fp32, (step, shape)
    assert not {id(t) for t in calls[0][1]} & {id(t) for t in calls[1][1]}  # one set per stack
    assert fastpath.facts()["muon_compiled"]["fast_calls"] == 6


@pytest.mark.slow  # compiles two graphs: ~25 s with inductor's on-disk cache warm, ~50 s cold (2-core CPU)
@pytest.mark.parametrize("nesterov", [True])
def test_compiled_optim_step_equals_the_eager_step(nesterov: bool) -> None:
    eager, compiled = _matrices(0), _matrices(0)
    kw = dict(lr=0.05, momentum=0.85, nesterov=nesterov, weight_decay=0.1)
    opt_eager = Muon(eager, **kw)
    opt_compiled = Muon(compiled, **kw, compiled=True)
    for opt in (opt_eager, opt_compiled):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    g = torch.Generator().manual_seed(1)
    torch._dynamo.reset()
    # dynamo's counters are per process, not per reset: count from here, as earlier tests compile too
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]
    graphs = []
    for step in range(6):
        # momentum warm-up 0.85 -> 0.95 and a decaying LR: new values every step, one graph each shape
        set_lr([opt_eager, opt_compiled], 1 - step / 8, momentum=0.85 + 0.02 * step)
        for a, b in zip(eager, compiled, strict=True):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt_eager.step()
        opt_compiled.step()
        graphs.append(stats["unique_graphs"] - before)
    assert graphs[0] == 2 and graphs[-1] == graphs[0], graphs  # compiled once per shape, never again
    diff = max((a - b).abs().max().item() for a, b in zip(eager, compiled, strict=True))
    print(f"6 steps: max |w_compiled - w_eager| = {diff:.3g}")  # measured 2.4e-7
    for a, b, start in zip(eager, compiled, _matrices(0), strict=True):
        assert not torch.equal(b.data, start.data)
        torch.testing.assert_close(b.data, a.data, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt_compiled.state[b]["momentum_buffer"], opt_eager.state[a]["momentum_buffer"],
                                   rtol=1e-5, atol=1e-6)


def test_compiled_optim_is_chosen_only_on_cuda_with_compile_and_kernels() -> None:
    cuda = dataclasses.replace(CPU, device=torch.device("cuda", 0), compile=True, kernels=True)
    assert compiled_step(cuda)
    assert not compiled_step(dataclasses.replace(cuda, kernels=False))  # kernels: false is the reference path
    assert not compiled_step(dataclasses.replace(cuda, compile=False))
    assert not compiled_step(dataclasses.replace(CPU, compile=True, kernels=True))  # CPU presets stay eager
    trainer = _trainer(_model(), _cfg(), Runtime(**{**vars(CPU), "compile": True, "kernels": True}))
    assert [getattr(o, "compiled", None) for o in trainer.optimizers] == [None, False]
