"""Optimizers: Muon for the 2-D block matrices, AdamW for embeddings, lm_head and scalars, and the
parameter grouping between them. Knows nothing about schedules, data or checkpoints on disk."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lockstep.config import check_range

# Quintic Newton-Schulz coefficients chosen to push singular values towards 1 as fast as possible
# in few steps (K. Jordan, "Muon: An optimizer for hidden layers", 2024); the result is only
# approximately orthogonal (singular values land in roughly [0.7, 1.2]), which trains as well.
_NS_COEFFS = (3.4445, -4.7750, 2.0315)
# AdamW learning rates were tuned at width 768; scale them by (n_embd / 768) ** -0.5 elsewhere.
_REFERENCE_WIDTH = 768


def orthogonalize(g: torch.Tensor, steps: int = 5, *, dtype: torch.dtype = torch.float32, eps: float = 1e-7) -> torch.Tensor:
    """Approximate U V^T of g = U S V^T by a quintic Newton-Schulz iteration. g: (rows, cols), or
    a stack (..., rows, cols) of same-shape matrices, each orthogonalised on its own in one batched
    pass. `dtype` is the iteration's matmul dtype: bf16 where matmuls are fast in bf16 (CUDA sm80+,
    CPUs with AMX/AVX-512 BF16), fp32 otherwise. The iteration is self-correcting, so bf16
    suffices."""
    if g.ndim < 2:
        raise ValueError(f"orthogonalize needs a 2-D matrix or a stack of them, got shape {tuple(g.shape)}")
    a, b, c = _NS_COEFFS
    x = g.to(dtype).reshape(-1, *g.shape[-2:])  # (N, rows, cols)
    transposed = x.size(1) > x.size(2)
    if transposed:
        x = x.mT  # (N, cols, rows): iterate on the short side so X X^T is the small Gram matrix
    # spectral norm <= Frobenius norm <= 1, inside the basin of convergence
    x = x / (torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT  # (N, short, short)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b * gram + c * gram @ gram
        x = torch.baddbmm(x, poly, x, beta=a)  # a * x + poly @ x
    if transposed:
        x = x.mT
    return x.reshape(g.shape).to(g.dtype)


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW (Loshchilov & Hutter 2019) on its fused kernel, refusing NaN settings and
    the infinite ones torch accepts (lr, eps or weight_decay = inf), which give NaN or frozen
    weights. The fused kernel steps the d4/32k embedding + lm_head 4.4x as fast as torch's
    foreach one on a 2-core CPU (bench/bench_optim.py). State is replicated on every rank."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        # `not x >= 0` rather than `x < 0`, so NaN is refused too
        if (not 0 <= lr < math.inf or not 0 <= eps < math.inf or not 0 <= weight_decay < math.inf
                or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1)):
            raise ValueError(f"AdamW needs finite lr >= 0, eps >= 0, weight_decay >= 0 and betas in [0, 1); got lr={lr}, "
                             f"betas={betas}, eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fused=True)


class Muon(torch.optim.Optimizer):
    """MomentUm Orthogonalized by Newton-schulz, for 2-D weight matrices only.

    Update: buf = mu * buf + g; u = g + mu * buf (Nesterov) or buf; W -= lr * sqrt(max(1, rows/cols))
    * orthogonalize(u). The aspect-ratio factor keeps the per-element update size comparable for
    tall matrices. Under torch.distributed each parameter has one owner rank (round robin) that
    holds its momentum and computes its update, then broadcasts the new weights: optimizer state
    and Newton-Schulz work are sharded, gradients must already be averaged across ranks."""

    def __init__(self, params: Iterable, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, weight_decay: float = 0.0, *, rank: int = 0, world_size: int = 1,
                 ns_dtype: torch.dtype = torch.float32):
        params = list(params)
        tensors = [t for item in params for t in (item["params"] if isinstance(item, dict) else [item])]
        for p in tensors:
            if p.ndim != 2:
                raise ValueError(f"Muon only takes 2-D matrices, got a parameter of shape {tuple(p.shape)}; give it to AdamW")
        if not 0 <= momentum < 1:
            raise ValueError(f"Muon momentum={momentum} must be in [0, 1)")
        if not 0 <= lr < math.inf or not 0 <= weight_decay < math.inf:
            raise ValueError(f"Muon needs finite lr >= 0 and weight_decay >= 0; got lr={lr}, weight_decay={weight_decay}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.rank, self.world_size, self.ns_dtype = rank, world_size, ns_dtype
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov,
                                  "ns_steps": ns_steps, "weight_decay": weight_decay})

    def _owned(self) -> list[tuple[int, torch.Tensor, dict]]:
        flat = [(p, g) for g in self.param_groups for p in g["params"]]
        return [(i, p, g) for i, (p, g) in enumerate(flat)]

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        # Matrices of one shape, dtype and group are orthogonalised as one stack: a d4 model's 24
        # block matrices are 2 batched Newton-Schulz runs instead of 24 runs of small matmuls.
        batches: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for i, p, group in self._owned():
            if i % self.world_size != self.rank or p.grad is None:
                continue
            grad = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buf = state["momentum_buffer"]
            mu = group["momentum"]
            buf.mul_(mu).add_(grad)
            update = grad.add(buf, alpha=mu) if group["nesterov"] else buf
            key = (id(group), tuple(p.shape), p.dtype, p.device)
            batches.setdefault(key, []).append((p, update))
        groups = {id(g): g for g in self.param_groups}
        for (group_id, shape, _, _), items in batches.items():
            group = groups[group_id]
            ortho = orthogonalize(torch.stack([u for _, u in items]), group["ns_steps"], dtype=self.ns_dtype)
            scale = math.sqrt(max(1.0, shape[0] / shape[1]))
            params = [p for p, _ in items]
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            torch._foreach_add_(params, list(ortho.unbind(0)), alpha=-group["lr"] * scale)
        if self.world_size > 1:
            for i, p, _ in self._owned():
                dist.broadcast(p.data, src=i % self.world_size)
        return None


@dataclass(frozen=True)
class OptimConfig:
    """Learning rates and optimizer settings (part of a training stage's params section)."""

    matrix_lr: float = 0.02  # Muon, block matrices
    embed_lr: float = 0.2  # AdamW, token embedding (before width scaling)
    unembed_lr: float = 0.004  # AdamW, lm_head (before width scaling)
    scalar_lr: float = 0.5  # AdamW, 1-D parameters (norm gains, gates), if the model has any
    weight_decay: float = 0.0  # decoupled, AdamW groups
    adam_beta1: float = 0.8
    adam_beta2: float = 0.95
    adam_eps: float = 1e-10
    muon_momentum_start: float = 0.85  # momentum warm-up from here ...
    muon_momentum_end: float = 0.95  # ... to here ...
    muon_momentum_warmup_steps: int = 300  # ... over this many steps
    grad_clip: float = 1.0  # max global grad norm; 0 disables

    def __post_init__(self) -> None:
        # A NaN, infinite or negative setting does not fail by itself: it trains to NaN weights.
        for name in ("matrix_lr", "embed_lr", "unembed_lr", "scalar_lr"):
            check_range(name, getattr(self, name), ge=0, why="a learning rate (0 freezes that group)")
        check_range("weight_decay", self.weight_decay, ge=0, why="decoupled decay per unit of learning rate; 0 disables")
        for name in ("adam_beta1", "adam_beta2", "muon_momentum_start", "muon_momentum_end"):
            check_range(name, getattr(self, name), ge=0, lt=1,
                        why="a moving-average decay; at 1 or above the average stops following the gradient")
        check_range("adam_eps", self.adam_eps, gt=0, why="it keeps AdamW's denominator off zero (1e-10 is usual)")
        check_range("muon_momentum_warmup_steps", self.muon_momentum_warmup_steps, ge=0)
        check_range("grad_clip", self.grad_clip, ge=0, why="the max global gradient norm; 0 disables clipping")


def split_params(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Group parameters by role: `embed` (token embedding), `unembed` (lm_head), `matrix` (2-D
    block weights, for Muon), `scalar` (everything else). Uses the model's own `param_groups()`
    when it has one, else names and shapes."""
    if hasattr(model, "param_groups"):
        names = {id(p): n for n, p in model.named_parameters()}
        own = model.param_groups()
        return {role: [(names[id(p)], p) for p in own.get(key, [])]
                for role, key in (("embed", "embedding"), ("unembed", "lm_head"), ("matrix", "matrix"), ("scalar", "scalar"))}
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {"embed": [], "unembed": [], "matrix": [], "scalar": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = name.lower()
        if "lm_head" in leaf:
            groups["unembed"].append((name, p))
        elif "wte" in leaf or "embed" in leaf:
            groups["embed"].append((name, p))
        elif p.ndim == 2:
            groups["matrix"].append((name, p))
        else:
            groups["scalar"].append((name, p))
    return groups


def build_optimizers(model: nn.Module, cfg: OptimConfig, *, model_dim: int, rank: int = 0,
                     world_size: int = 1, ns_dtype: torch.dtype = torch.float32) -> list[torch.optim.Optimizer]:
    """[AdamW, Muon] over the model's parameters. Every group records `initial_lr` so a schedule
    can scale it. `ns_dtype`: Muon's Newton-Schulz matmul dtype (the run's compute dtype)."""
    groups = split_params(model)
    width_scale = (model_dim / _REFERENCE_WIDTH) ** -0.5
    adam_groups = []
    for role, lr in (("embed", cfg.embed_lr * width_scale), ("unembed", cfg.unembed_lr * width_scale),
                     ("scalar", cfg.scalar_lr)):
        if groups[role]:
            adam_groups.append({"params": [p for _, p in groups[role]], "lr": lr, "role": role})
    if not groups["matrix"]:
        raise ValueError("model has no 2-D block matrices for Muon; check the parameter names")
    optimizers: list[torch.optim.Optimizer] = [
        AdamW(adam_groups, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay),
        Muon([{"params": [p for _, p in groups["matrix"]], "role": "matrix"}], lr=cfg.matrix_lr,
             momentum=cfg.muon_momentum_start, rank=rank, world_size=world_size, ns_dtype=ns_dtype),
    ]
    for opt in optimizers:
        for g in opt.param_groups:
            g["initial_lr"] = g["lr"]
    return optimizers


def muon_momentum(step: int, cfg: OptimConfig) -> float:
    """Linear momentum warm-up: low momentum early, when gradients change direction fast."""
    if cfg.muon_momentum_warmup_steps <= 0:
        return cfg.muon_momentum_end
    frac = min(1.0, step / cfg.muon_momentum_warmup_steps)
    return (1 - frac) * cfg.muon_momentum_start + frac * cfg.muon_momentum_end


def set_lr(optimizers: list[torch.optim.Optimizer], multiplier: float, *, momentum: float | None = None) -> None:
    for opt in optimizers:
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] * multiplier
            if momentum is not None and isinstance(opt, Muon):
                g["momentum"] = momentum


def global_grad_norm(params: list[nn.Parameter], clip: float) -> torch.Tensor:
    """The global L2 norm of the gradients before any clipping (a 0-d tensor on their device, not
    moved to the host); when `clip` > 0 the gradients are then scaled down to norm <= clip. Taken
    with or without clipping: a NaN or inf norm is how a bad step is noticed before its update."""
    if clip > 0:
        return torch.nn.utils.clip_grad_norm_(params, clip)
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])


def all_reduce_grads(params: list[nn.Parameter], *, average: bool = True) -> None:
    """Sum (or average) gradients across ranks in one flat buffer: one collective instead of one
    per tensor. A no-op without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    if average:
        flat.div_(dist.get_world_size())
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n
