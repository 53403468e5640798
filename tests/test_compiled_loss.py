"""The Trainer's compiled loss (runtime.compile) on CPU in fp32: when torch.compile fails, at the
forward's compile or at the backward's (AOT autograd compiles it at the first .backward(), after
the head's gradients were accumulated eagerly), the run finishes on the eager loss with the losses
and weights of a run that never compiled, bit for bit, and the run facts say so (lockstep.core.fastpath
part "compiled_loss")."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from functorch.compile import aot_module_simplified, make_boxed_func

from lockstep.core import fastpath
from lockstep.core.runtime import Runtime
from lockstep.model.gpt import GPT
from test_train import CPU, _cfg, _fit, _model

COMPILING = Runtime(**{**vars(CPU), "compile": True})


@torch.compiler.disable
def _eager_head_loss(model: GPT, h: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
    return model.head_loss(h, y, reduction)


def _split_objective(model: GPT, x: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
    """The model's cross-entropy with its head behind a graph break, where the CUDA chunked head
    loss puts it (torch.compiler.disable in lockstep.model.ops): the head's backward runs eagerly, and
    accumulates lm_head's gradient, before the compiled trunk's backward is compiled."""
    return _eager_head_loss(model, model.final_hidden(x), y, reduction)


def _compile_fails(gm: torch.fx.GraphModule, example_inputs: list) -> None:
    """A torch.compile backend that cannot compile the forward."""
    raise RuntimeError("this backend compiles nothing")


class _BackwardCompileFails:
    """A torch.compile backend whose forward compiles (AOT autograd, run as traced) and whose
    backward compile raises; it notes whether lm_head already had a gradient when it did."""

    def __init__(self, model: GPT) -> None:
        self.model, self.head_had_grad = model, []

    def _bw_compiler(self, gm: torch.fx.GraphModule, example_inputs: list) -> None:
        self.head_had_grad.append(self.model.lm_head.weight.grad is not None)
        raise RuntimeError("this backend cannot compile a backward")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, _: make_boxed_func(g.forward),
                                     bw_compiler=self._bw_compiler)


@pytest.mark.parametrize("fails_at", ["forward", "backward"])
def test_a_failed_compile_finishes_the_run_on_the_eager_loss_exactly(fails_at, monkeypatch, caplog, tmp_path) -> None:
    cfg = _cfg(num_steps=3, checkpoint_every_steps=0)  # 2 micro-batches a step
    reference_model = _model()
    reference = _fit(reference_model, cfg, tmp_path / "reference", loss=_split_objective)
    assert fastpath.facts() == {}  # a run that does not compile takes no fast path

    model = _model()
    backend = _compile_fails if fails_at == "forward" else _BackwardCompileFails(model)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="lockstep.core.fastpath"):
        result = _fit(model, cfg, tmp_path / "compiled", COMPILING, loss=_split_objective)
    if fails_at == "backward":
        assert backend.head_had_grad == [True]  # the redo had gradients to clear
    assert result.losses == reference.losses
    for (name, a), b in zip(reference_model.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    facts = fastpath.facts()["compiled_loss"]
    assert (facts["path"], facts["results"], facts["fast_calls"], facts["reference_calls"]) == \
        ("reference", "reference", 0, 3)  # one call a step; the first step's compiled work was thrown away
    reason = (
        "BackendCompilerFailed" if fails_at == "forward" else "RuntimeError: this backend cannot compile a backward"
    )
    assert facts["fell_back"].startswith(reason), facts["fell_back"]
    assert len([r for r in caplog.records if r.name == "lockstep.core.fastpath"]) == 1


def test_a_compiled_loss_that_works_answers_every_step(monkeypatch, tmp_path) -> None:
    """The other side: a backend that compiles (aot_eager) takes the fast path on every step."""
    cfg = _cfg(num_steps=3, checkpoint_every_steps=0)
    reference = _fit(_model(), cfg, tmp_path / "reference", loss=_split_objective)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    result = _fit(_model(), cfg, tmp_path / "compiled", COMPILING, loss=_split_objective)
    facts = fastpath.facts()["compiled_loss"]
    assert (facts["path"], facts["fast_calls"], facts["reference_calls"]) == ("fast", 3, 0)
    assert facts["compiles"] >= 1
    for (_, a), (_, b) in zip(reference.losses, result.losses, strict=True):
        assert a == pytest.approx(b, rel=1e-5)
