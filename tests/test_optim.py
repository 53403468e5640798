"""Optimizers against references: our (fused) AdamW equals torch's plain loop and resumes from its
state dict; Muon's update is near-orthogonal."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lockstep.train.optim import AdamW, Muon, OptimConfig, build_optimizers, muon_momentum, orthogonalize, split_params


def test_adamw_matches_torch_plain_loop_and_resumes_from_its_state_dict() -> None:
    # Ours runs torch's fused kernel; the reference is torch's one-tensor-at-a-time loop.
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(7, 5, generator=g)
    ours, ref = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    settings = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)
    opt = AdamW([{"params": [ours], "role": "embed", "initial_lr": 3e-3}], **settings)
    opt_ref = torch.optim.AdamW([ref], foreach=False, fused=False, **settings)
    grads = [torch.randn(7, 5, generator=g) for _ in range(25)]
    for i, grad in enumerate(grads):
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        opt_ref.step()
        if i == 11:  # resume halfway from a fresh optimizer, as a checkpoint load does
            saved = opt.state_dict()
            opt = AdamW([{"params": [ours], "role": "embed", "initial_lr": 3e-3}], **settings)
            opt.load_state_dict(saved)
    torch.testing.assert_close(ours.data, ref.data, rtol=1e-6, atol=1e-7)
    assert not torch.equal(ours.data, w0)
    group = opt.param_groups[0]
    assert group["fused"] and group["role"] == "embed" and group["initial_lr"] == 3e-3
    assert sorted(opt.state_dict()["state"][0]) == ["exp_avg", "exp_avg_sq", "step"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(32, 32), (64, 16), (16, 64)])
def test_orthogonalize_is_near_orthogonal(shape: tuple[int, int], dtype: torch.dtype) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    o = orthogonalize(g, steps=5, dtype=dtype)
    assert o.dtype == torch.float32
    s = torch.linalg.svdvals(o)
    # The quintic iteration trades exactness for speed: singular values land near 1, not on it.
    assert s.min() > 0.5 and s.max() < 1.3, s
    # and it keeps the singular vectors: o ~ U V^T
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    cos = (o * (u @ vh)).sum() / (o.norm() * (u @ vh).norm())
    assert cos > 0.98


def test_muon_step_is_orthogonal_and_aspect_scaled() -> None:
    g = torch.Generator().manual_seed(2)
    p = nn.Parameter(torch.zeros(64, 16))
    opt = Muon([p], lr=0.1, momentum=0.0, nesterov=False)
    p.grad = torch.randn(64, 16, generator=g)
    opt.step()
    update = -p.data / (0.1 * math.sqrt(64 / 16))
    s = torch.linalg.svdvals(update)
    assert s.min() > 0.5 and s.max() < 1.3


def test_muon_refuses_vectors() -> None:
    with pytest.raises(ValueError, match="AdamW"):
        Muon([nn.Parameter(torch.zeros(4))])


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(10, 8)
        self.block = nn.Linear(8, 8, bias=False)
        self.gain = nn.Parameter(torch.ones(8))
        self.lm_head = nn.Linear(8, 10, bias=False)


def test_grouping_and_width_scaling() -> None:
    m = _Toy()
    groups = split_params(m)
    assert [n for n, _ in groups["embed"]] == ["wte.weight"]
    assert [n for n, _ in groups["unembed"]] == ["lm_head.weight"]
    assert [n for n, _ in groups["matrix"]] == ["block.weight"]
    assert [n for n, _ in groups["scalar"]] == ["gain"]
    cfg = OptimConfig(embed_lr=0.3)
    adam, muon = build_optimizers(m, cfg, model_dim=192)
    embed_group = next(g for g in adam.param_groups if g["role"] == "embed")
    assert embed_group["lr"] == pytest.approx(0.3 * 2.0)  # (192/768)^-0.5 = 2
    assert isinstance(muon, Muon)
    assert muon_momentum(0, cfg) == cfg.muon_momentum_start
    assert muon_momentum(10_000, cfg) == cfg.muon_momentum_end
