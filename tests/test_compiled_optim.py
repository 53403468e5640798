"""Muon's compiled step (lockstep.optim._muon_group_update under torch.compile) against the eager
step it stands in for, on CPU in fp32; and the rule that picks it (CUDA with compile and kernels
on, never on CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lockstep.optim import Muon, compiled_step, set_lr
from lockstep.runtime import Runtime
from test_train import CPU, _cfg, _model, _trainer


def _matrices(seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    # two shapes: tall (transposed inside Newton-Schulz, aspect factor 2) and wide
    return [nn.Parameter(torch.randn(32, 16, generator=g)) for _ in range(3)] + \
           [nn.Parameter(torch.randn(16, 48, generator=g)) for _ in range(2)]


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
