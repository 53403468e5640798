"""Optimizers: Muon for the 2-D block matrices, AdamW for embeddings, lm_head and scalars, the
parameter grouping between them, and how their state and gradients are spread over ranks
(replicated, or sharded with reduce_scatter / all_gather). Knows nothing about schedules, data or
checkpoints on disk."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.core import fastpath
from lockstep.core.config import check_range

if TYPE_CHECKING:
    from lockstep.core.runtime import Runtime

# Quintic Newton-Schulz coefficients chosen to push singular values towards 1 as fast as possible
# in few steps (K. Jordan, "Muon: An optimizer for hidden layers", 2024); the result is only
# approximately orthogonal (singular values land in roughly [0.7, 1.2]), which trains as well.
_NS_COEFFS = (3.4445, -4.7750, 2.0315)
# AdamW learning rates were tuned at width 768; scale them by (n_embd / 768) ** -0.5 elsewhere.
_REFERENCE_WIDTH = 768
# Under sharded state every part of a parameter a rank owns starts at a multiple of this many
# elements (256 bytes in fp32), in the parameter and in the flat buffers: vector loads stay aligned,
# and the fused AdamW kernel walks a slice in the lanes it walks the whole tensor in, so a sharded
# AdamW step equals the single-process one bit for bit (tests/test_sharded_optim.py).
SHARD_ALIGN = 64


def orthogonalize(
    g: torch.Tensor, steps: int = 5, *, dtype: torch.dtype = torch.float32, eps: float = 1e-7
) -> torch.Tensor:
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
    foreach one on a 2-core CPU (bench/bench_optim.py). Its state, two fp32 moments per weight, is
    replicated: every rank holds all of it. ShardedAdamW splits it over ranks."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0):
        # `not x >= 0` rather than `x < 0`, so NaN is refused too
        if (not 0 <= lr < math.inf or not 0 <= eps < math.inf or not 0 <= weight_decay < math.inf
                or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1)):
            raise ValueError(
                f"AdamW needs finite lr >= 0, eps >= 0, weight_decay >= 0 and betas in [0, 1); got lr={lr}, "
                f"betas={betas}, eps={eps}, weight_decay={weight_decay}"
            )
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fused=True)


def _check_matrices(tensors: Iterable[torch.Tensor]) -> None:
    for p in tensors:
        if p.ndim != 2:
            raise ValueError(
                f"Muon only takes 2-D matrices, got a parameter of shape {tuple(p.shape)}; give it to AdamW"
            )


def _as_groups(params: Iterable) -> list[dict[str, Any]]:
    """torch's two ways of giving an optimizer its parameters (tensors, or dicts of groups) as groups."""
    params = list(params)
    if params and isinstance(params[0], dict):
        return [{**g, "params": list(g["params"])} for g in params]
    return [{"params": params}]


class Muon(torch.optim.Optimizer):
    """MomentUm Orthogonalized by Newton-schulz, for 2-D weight matrices only.

    Update: buf = mu * buf + g; u = g + mu * buf (Nesterov) or buf; W -= lr * sqrt(max(1, rows/cols))
    * orthogonalize(u). The aspect-ratio factor keeps the per-element update size comparable for
    tall matrices. Its state is one momentum matrix per weight matrix. Under torch.distributed
    (`world_size` > 1) this class keeps the replicated layout: gradients must already be
    summed on every rank (all_reduce_grads), each matrix has one owner rank (round robin) that
    holds its momentum and computes its update, then broadcasts the new weights; ShardedMuon
    instead receives only its own matrices' gradients and all-gathers the weights.

    `compiled`: run each same-shape stack's update (momentum, Newton-Schulz, decay and step)
    through torch.compile (_muon_group_update) instead of the eager ops (`_eager_update`), which
    stay the reference: equal to them to float rounding (tests/test_compiled_optim.py), and
    answering in their place, for the rest of the process, once a compile fails (lockstep.core.fastpath
    part "muon_compiled")."""

    def __init__(self, params: Iterable, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, weight_decay: float = 0.0, *, rank: int = 0, world_size: int = 1,
                 ns_dtype: torch.dtype = torch.float32, compiled: bool = False):
        groups = _as_groups(params)
        _check_matrices(p for g in groups for p in g["params"])
        if not 0 <= momentum < 1:
            raise ValueError(f"Muon momentum={momentum} must be in [0, 1)")
        if not 0 <= lr < math.inf or not 0 <= weight_decay < math.inf:
            raise ValueError(
                f"Muon needs finite lr >= 0 and weight_decay >= 0; got lr={lr}, weight_decay={weight_decay}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.rank, self.world_size, self.ns_dtype, self.compiled = rank, world_size, ns_dtype, compiled
        self._hyper: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # _hyperparameters()
        super().__init__(groups, {"lr": lr, "momentum": momentum, "nesterov": nesterov,
                                  "ns_steps": ns_steps, "weight_decay": weight_decay})

    def _owned(self) -> list[tuple[int, torch.Tensor, dict]]:
        flat = [(p, g) for g in self.param_groups for p in g["params"]]
        return [(i, p, g) for i, (p, g) in enumerate(flat)]

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        # Matrices of one shape, dtype and group are orthogonalised as one stack: a d4 model's 24
        # block matrices are 3 batched Newton-Schulz runs instead of 24 runs of small matmuls.
        batches: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        group_index = {id(g): k for k, g in enumerate(self.param_groups)}
        for i, p, group in self._owned():
            if i % self.world_size != self.rank or p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            key = (group_index[id(group)], tuple(p.shape), p.dtype, p.device)
            batches.setdefault(key, []).append((p, state["momentum_buffer"]))
        for key, items in batches.items():
            group, shape = self.param_groups[key[0]], key[1]
            params, bufs = [p for p, _ in items], [b for _, b in items]
            grads = [p.grad for p in params]
            scale = math.sqrt(max(1.0, shape[0] / shape[1]))
            eager = functools.partial(self._eager_update, group, params, grads, bufs, scale)
            if self.compiled:
                # A compile fails before its graph runs, so the eager update answering it is exact.
                fastpath.call("muon_compiled",
                              functools.partial(self._compiled_update, key, group, params, grads, bufs, scale), eager)
            else:
                eager()
        if self.world_size > 1:
            for i, p, _ in self._owned():
                dist.broadcast(p.data, src=i % self.world_size)
        return None

    def _eager_update(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor],
                      bufs: list[torch.Tensor], scale: float) -> None:
        """One same-shape stack's update in eager ops: what CPU runs step with, the reference the
        compiled update is held to, and what answers it when it fails (fastpath "muon_compiled")."""
        mu = group["momentum"]
        updates = []
        for grad, buf in zip(grads, bufs, strict=True):
            buf.mul_(mu).add_(grad)
            updates.append(grad.add(buf, alpha=mu) if group["nesterov"] else buf)
        ortho = orthogonalize(torch.stack(updates), group["ns_steps"], dtype=self.ns_dtype)
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
        torch._foreach_add_(params, list(ortho.unbind(0)), alpha=-group["lr"] * scale)

    def _compiled_update(self, key: tuple, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor],
                         bufs: list[torch.Tensor], scale: float) -> None:
        """One same-shape stack's update through the compiled _muon_group_update, its hyperparameters
        written into the stack's persistent 0-d tensors (`_hyperparameters`) first."""
        momentum, step_size, decay = self._hyperparameters(key, params[0])
        momentum.fill_(group["momentum"])
        step_size.fill_(group["lr"] * scale)
        decay.fill_(1 - group["lr"] * group["weight_decay"])
        _compiled_muon_group_update()(params, grads, bufs, momentum, step_size, decay, nesterov=group["nesterov"],
                                      ns_steps=group["ns_steps"], ns_dtype=self.ns_dtype)

    def _hyperparameters(self, key: tuple, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The compiled update's (momentum, lr x aspect factor, 1 - lr x weight_decay) for the stack
        `key` (group index, shape, dtype, device): 0-d tensors on the stack's device, made on its
        first step and filled in place every step after. Tensors, not floats: a float is baked into
        the compiled graph, and the schedule changes lr and momentum every step (a recompile each
        time). The same tensors every step: the graph's inputs keep their addresses, and no host
        tensor is made (nor copied to the device) per step. Their dtype is the weights' opmath type
        (float32 for fp32 and bf16 weights, float64 for fp64): the eager update multiplies by
        Python floats, which its kernels round to that type first, so the compiled update
        multiplies by exactly the same values. Not optimizer state: checkpoints leave them out."""
        if key not in self._hyper:
            dtype = torch.promote_types(like.dtype, torch.float32)
            self._hyper[key] = tuple(torch.zeros((), dtype=dtype, device=like.device) for _ in range(3))
        return self._hyper[key]


def _muon_group_update(params: list[torch.Tensor], grads: list[torch.Tensor], bufs: list[torch.Tensor],
                       momentum: torch.Tensor, step_size: torch.Tensor, decay: torch.Tensor, *, nesterov: bool,
                       ns_steps: int, ns_dtype: torch.dtype) -> None:
    """Muon's update of a stack of same-shape matrices, written for torch.compile: the arithmetic
    of Muon._eager_update with the hyperparameters as 0-d tensors (`step_size` = lr x the
    aspect factor, `decay` = 1 - lr x weight_decay), so that the momentum update, the Newton-Schulz
    pointwise work and the weight update fuse into few kernels around the batched matmuls."""
    updates = []
    for g, b in zip(grads, bufs, strict=True):
        b.mul_(momentum).add_(g)
        updates.append(g + momentum * b if nesterov else b)
    ortho = orthogonalize(torch.stack(updates), ns_steps, dtype=ns_dtype)  # (N, rows, cols)
    for p, o in zip(params, ortho.unbind(0), strict=True):
        p.mul_(decay).sub_(o * step_size)


@functools.cache
def _compiled_muon_group_update():  # -> the compiled _muon_group_update
    # One compiled graph per (shape, stack size, dtype): a GPT has three block-matrix shapes,
    # well inside dynamo's recompile limit of 8 per function.
    return torch.compile(_muon_group_update, dynamic=False, fullgraph=True)


def compiled_step(rt: Runtime) -> bool:
    """Whether a run's Muon steps through torch.compile: on CUDA only, and only when the runtime
    both compiles (runtime.compile) and takes the fast paths (runtime.kernels). CPU runs keep the
    eager step. There the compiled one is somewhat faster per step (d4's block matrices on a
    2-core CPU at load 6-8, bench/bench_optim.py: 0.68x and 0.93x the eager time in two runs),
    but its compile took 43 s cold (9 s from inductor's cache), which a CPU preset's few hundred
    steps barely win back, and CPU presets compile nothing else either."""
    return rt.device.type == "cuda" and rt.compile and rt.kernels


# ---- sharded state -------------------------------------------------------------------------------

def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def slice_ranges(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Each rank's flat range [lo, hi) of a tensor of `numel` elements under sharded AdamW state:
    equal chunks rounded up to SHARD_ALIGN elements, so the last ranks' may be short or empty."""
    chunk = _round_up(-(-numel // world_size), SHARD_ALIGN)
    return [(min(r * chunk, numel), min((r + 1) * chunk, numel)) for r in range(world_size)]


def matrix_owners(shapes: Sequence[tuple[int, ...]], world_size: int) -> list[int]:
    """The owner rank of each Muon matrix under sharded state: largest shapes first, each matrix
    to the rank holding the fewest elements so far (lowest rank on ties), so that per-rank
    momentum memory and Newton-Schulz work are as even as whole matrices allow."""
    load = [0] * world_size
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-math.prod(shapes[i]), tuple(shapes[i]), i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += math.prod(shapes[i])
    return owners


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor) -> None:
    # torch 2.13 names the flat-tensor collectives *_single and deprecates *_tensor; gloo and
    # NCCL both implement them, so CPU tests run the code path GPUs run.
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=dist.ReduceOp.SUM)


def _all_gather(out: torch.Tensor, inp: torch.Tensor) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp)


class _Shards:
    """The flat buffers behind sharded state. `parts[r]` lists the (parameter index, lo, hi) flat
    ranges rank r updates; each rank's parts are packed, each padded to SHARD_ALIGN, into a
    segment of `numel` elements, the same for every rank, so that one reduce_scatter brings each
    rank the sums over ranks of its parts' gradients (into `grad`, which persists so that the
    optimizers' `.grad` views stay valid) and one all_gather brings every rank every part's new
    weights. With world size 1 the collectives are copies (tests without a process group)."""

    def __init__(self, params: list[torch.Tensor], parts: list[list[tuple[int, int, int]]], rank: int) -> None:
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) > 1:
            raise ValueError(
                f"sharded optimizer state needs its parameters in one dtype on one device, got {kinds}; keep "
                "fp32 master weights on the run's device"
            )
        if not 0 <= rank < len(parts):
            raise ValueError(f"rank={rank} must be in [0, world_size={len(parts)})")
        assert all(p.is_contiguous() for p in params)
        self.params, self.parts, self.rank, self.world_size = params, parts, rank, len(parts)
        self.offsets: list[list[int]] = []
        sizes = []
        for rank_parts in parts:
            offsets, n = [], 0
            for _, lo, hi in rank_parts:
                offsets.append(n)
                n += _round_up(hi - lo, SHARD_ALIGN)
            self.offsets.append(offsets)
            sizes.append(n)
        self.numel = max(*sizes, SHARD_ALIGN)
        dtype, device = next(iter(kinds)) if kinds else (torch.float32, torch.device("cpu"))
        self.grad = torch.zeros(self.numel, dtype=dtype, device=device)  # (numel,) this rank's summed gradients

    def _flat(self, i: int, lo: int, hi: int) -> torch.Tensor:
        return self.params[i].detach().view(-1)[lo:hi]

    def weights(self) -> list[torch.Tensor]:
        """Views of this rank's parts of the weights (updating them updates the parameters)."""
        return [self._flat(*part) for part in self.parts[self.rank]]

    def grads(self) -> list[torch.Tensor]:
        """This rank's parts of the summed gradients (views into `grad`), in `weights()` order."""
        return [
            self.grad[o : o + hi - lo]
            for o, (_, lo, hi) in zip(self.offsets[self.rank], self.parts[self.rank], strict=True)
        ]

    def _segments(
        self, buf: torch.Tensor, ranks: Iterable[int]
    ) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
        views, parts = [], []
        for r in ranks:
            for o, (i, lo, hi) in zip(self.offsets[r], self.parts[r], strict=True):
                if hi > lo:
                    views.append(buf[r * self.numel + o:r * self.numel + o + hi - lo])
                    parts.append((i, lo, hi))
        return views, parts

    @torch.no_grad()
    def reduce(self) -> None:
        """Sum the local gradients over ranks into `grad`, then drop the local full gradients
        (ZeRO-2: only this rank's parts stay). A missing gradient counts as zeros."""
        send = torch.zeros(
            self.world_size * self.numel, dtype=self.grad.dtype, device=self.grad.device
        )  # (world * numel,)
        views, parts = self._segments(send, range(self.world_size))
        dst, src = [], []
        for view, (i, lo, hi) in zip(views, parts, strict=True):
            g = self.params[i].grad
            if g is not None:
                dst.append(view)
                src.append(g.reshape(-1)[lo:hi])
        if dst:
            torch._foreach_copy_(dst, src)
        for p in self.params:
            p.grad = None
        if self.world_size == 1:
            self.grad.copy_(send)
        else:
            _reduce_scatter(self.grad, send)

    @torch.no_grad()
    def gather(self) -> None:
        """Give every rank every part's weights (this rank's parts were updated in place)."""
        if self.world_size == 1:
            return
        mine = torch.zeros(self.numel, dtype=self.grad.dtype, device=self.grad.device)  # (numel,)
        dst = [
            mine[o : o + hi - lo]
            for o, (_, lo, hi) in zip(self.offsets[self.rank], self.parts[self.rank], strict=True)
            if hi > lo
        ]
        if dst:
            torch._foreach_copy_(dst, [self._flat(i, lo, hi) for i, lo, hi in self.parts[self.rank] if hi > lo])
        everyone = torch.empty(self.world_size * self.numel, dtype=mine.dtype, device=mine.device)  # (world * numel,)
        _all_gather(everyone, mine)
        views, parts = self._segments(everyone, (r for r in range(self.world_size) if r != self.rank))
        if views:
            torch._foreach_copy_([self._flat(*part) for part in parts], views)


class _ShardedStep:
    """What ShardedAdamW and ShardedMuon add to their base class: gradients come in through
    `reduce_grads()`, `step()` ends by all-gathering the weights, `zero_grad()` also clears the
    model's full gradients."""

    shards: _Shards
    full_group_sizes: tuple[int, ...]  # parameters per group before sharding (StateLayout)

    def local_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]  # type: ignore[attr-defined]

    def reduce_grads(self) -> None:
        """Sum the gradients over ranks into this rank's parts (one reduce_scatter) and point the
        optimizer's parameters' `.grad` at them."""
        self.shards.reduce()
        for p, g in zip(self.local_params(), self.shards.grads(), strict=True):
            p.grad = g.view_as(p)

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's summed gradients, for the global norm; [] before reduce_grads()."""
        return [p.grad for p in self.local_params() if p.grad is not None]

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        super().step(closure)  # type: ignore[misc]
        self.shards.gather()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # type: ignore[misc]
        for p in self.shards.params:
            p.grad = None


class ShardedAdamW(_ShardedStep, AdamW):
    """AdamW with sharded state (ZeRO-1/2): of every parameter, rank `rank` holds the moments of a
    flat slice of about 1/world_size (slice_ranges) and updates only that slice. reduce_grads()
    sums the gradients over ranks straight into those slices (one reduce_scatter; the local full
    gradients are freed), step() runs the fused kernel on the slices, in place in the
    parameters, then all-gathers the weights (one all_gather), so every rank ends with the same
    weights as with AdamW. The update is elementwise, so slicing changes no number: given equal
    summed gradients it equals AdamW bit for bit."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, rank: int, world_size: int):
        groups = _as_groups(params)
        full = [p for g in groups for p in g["params"]]
        ranges = [slice_ranges(p.numel(), world_size) for p in full]
        shards = _Shards(full, [[(i, *ranges[i][r]) for i in range(len(full))] for r in range(world_size)], rank)
        views = iter(shards.weights())
        super().__init__([{**g, "params": [next(views) for _ in g["params"]]} for g in groups], lr=lr, betas=betas,
                         eps=eps, weight_decay=weight_decay)
        self.shards, self.full_group_sizes = shards, tuple(len(g["params"]) for g in groups)


class ShardedMuon(_ShardedStep, Muon):
    """Muon with sharded state: each matrix has one owner rank (matrix_owners: balanced by size),
    the only one that holds its momentum, receives its summed gradient (reduce_grads: one
    reduce_scatter over all matrices, so no rank receives the others' gradients) and computes its
    update; step() then all-gathers the new weights. Newton-Schulz needs whole matrices, so the
    momentum memory per rank is 1/world_size of the total up to one matrix."""

    def __init__(self, params: Iterable, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, weight_decay: float = 0.0, *, rank: int, world_size: int,
                 ns_dtype: torch.dtype = torch.float32, compiled: bool = False):
        groups = _as_groups(params)
        full = [p for g in groups for p in g["params"]]
        _check_matrices(full)
        owners = matrix_owners([tuple(p.shape) for p in full], world_size)
        parts = [[(i, 0, p.numel()) for i, p in enumerate(full) if owners[i] == r] for r in range(world_size)]
        shards = _Shards(full, parts, rank)
        mine = {id(full[i]) for i, _, _ in parts[rank]}
        super().__init__([{**g, "params": [p for p in g["params"] if id(p) in mine]} for g in groups], lr=lr,
                         momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay,
                         ns_dtype=ns_dtype, compiled=compiled)
        self.shards, self.full_group_sizes = shards, tuple(len(g["params"]) for g in groups)


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
        check_range(
            "weight_decay", self.weight_decay, ge=0, why="decoupled decay per unit of learning rate; 0 disables"
        )
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
        return {
            role: [(names[id(p)], p) for p in own.get(key, [])]
            for role, key in (
                ("embed", "embedding"),
                ("unembed", "lm_head"),
                ("matrix", "matrix"),
                ("scalar", "scalar"),
            )
        }
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


def build_optimizers(model: nn.Module, cfg: OptimConfig, *, model_dim: int, rank: int = 0, world_size: int = 1,
                     ns_dtype: torch.dtype = torch.float32, sharded: bool | None = None,
                     compiled: bool = False) -> list[torch.optim.Optimizer]:
    """[AdamW, Muon] over the model's parameters. Every group records `initial_lr` so a schedule
    can scale it. `ns_dtype`: Muon's Newton-Schulz matmul dtype (the run's compute dtype).
    `sharded`: ShardedAdamW and ShardedMuon instead of the replicated AdamW and Muon; None (the
    default) shards whenever world_size > 1, so one process does not shard unless asked (True:
    the sharded classes at world size 1, whose collectives are copies, for checking them against
    the replicated ones). `compiled`: Muon's compiled step (compiled_step says when a run wants it)."""
    groups = split_params(model)
    width_scale = (model_dim / _REFERENCE_WIDTH) ** -0.5
    adam_groups = []
    for role, lr in (("embed", cfg.embed_lr * width_scale), ("unembed", cfg.unembed_lr * width_scale),
                     ("scalar", cfg.scalar_lr)):
        if groups[role]:
            adam_groups.append({"params": [p for _, p in groups[role]], "lr": lr, "role": role})
    if not groups["matrix"]:
        raise ValueError("model has no 2-D block matrices for Muon; check the parameter names")
    adam_kw: dict[str, Any] = {"betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps,
                               "weight_decay": cfg.weight_decay}
    matrix_groups = [{"params": [p for _, p in groups["matrix"]], "role": "matrix"}]
    muon_kw: dict[str, Any] = {"lr": cfg.matrix_lr, "momentum": cfg.muon_momentum_start, "ns_dtype": ns_dtype,
                               "compiled": compiled}
    if sharded or (sharded is None and world_size > 1):
        optimizers: list[torch.optim.Optimizer] = [
            ShardedAdamW(adam_groups, rank=rank, world_size=world_size, **adam_kw),
            ShardedMuon(matrix_groups, rank=rank, world_size=world_size, **muon_kw)]
    else:
        optimizers = [AdamW(adam_groups, **adam_kw), Muon(matrix_groups, rank=rank, world_size=world_size, **muon_kw)]
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


def _sharded(optimizers: Sequence[torch.optim.Optimizer]) -> list[_ShardedStep]:
    sharded = [o for o in optimizers if isinstance(o, _ShardedStep)]
    if sharded and len(sharded) != len(optimizers):
        raise ValueError("sharded and replicated optimizers cannot be mixed: gradients are either reduce-scattered "
                         "or all-reduced; build them all with build_optimizers")
    return sharded


def reduce_grads(optimizers: Sequence[torch.optim.Optimizer], params: list[nn.Parameter]) -> None:
    """Sum the gradients over ranks as the optimizers need them: sharded optimizers each
    reduce-scatter their parameters' gradients (every rank receives the sums of the parts it
    updates, and the full local gradients are freed); replicated ones get every gradient summed
    on every rank (all_reduce_grads). Sums, not means: the loss is already normalised by the
    global batch's target count. A no-op in one process."""
    sharded = _sharded(optimizers)
    for opt in sharded:
        opt.reduce_grads()
    if not sharded:
        all_reduce_grads(params, average=False)


def global_grad_norm(params: list[nn.Parameter], clip: float, *,
                     optimizers: Sequence[torch.optim.Optimizer] = ()) -> torch.Tensor:
    """The global L2 norm of the gradients before any clipping (a 0-d tensor on their device, not
    moved to the host); when `clip` > 0 the gradients are then scaled down to norm <= clip. Taken
    with or without clipping: a NaN or inf norm is how a bad step is noticed before its update.
    With sharded `optimizers` (after reduce_grads) each rank holds only its parts of the summed
    gradients: their squared norms are summed over ranks (one all_reduce of one fp64 scalar), so
    every rank gets the same norm, NaN included, and clips its parts by it."""
    sharded = _sharded(optimizers)
    if not sharded:
        if clip > 0:
            return torch.nn.utils.clip_grad_norm_(params, clip)
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    grads = [g for opt in sharded for g in opt.shard_grads()]
    shards = sharded[0].shards
    squares = torch.zeros((), dtype=torch.float64, device=shards.grad.device)
    if grads:
        squares = torch.stack(torch._foreach_norm(grads)).double().square().sum()
    if shards.world_size > 1:
        dist.all_reduce(squares)
    total = squares.sqrt()
    if clip > 0 and grads:
        # torch.nn.utils.clip_grad_norm_'s rule, on this rank's parts
        torch._foreach_mul_(grads, (clip / (total + 1e-6)).clamp(max=1.0).to(grads[0].dtype))
    return total


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


# ---- moving optimizer state between layouts --------------------------------------------------

def optimizer_state_kind(optimizers: Sequence[torch.optim.Optimizer]) -> str:
    """How `optimizers` spread their state over ranks (checkpoint meta): "sharded" or "replicated"."""
    return "sharded" if _sharded(optimizers) else "replicated"


@dataclass(frozen=True)
class StateLayout:
    """How one optimizer's state is spread over ranks, enough to turn the per-rank state dicts of
    one layout into those of another (resuming on another number of ranks): `optimizer` adamw or
    muon, `sharded`, `world_size`, the shapes of the optimizer's parameters in build order and how
    many of them each param group holds. The pivot is the single-process state dict (`full`):
    every parameter, whole tensors, indexed in build order."""

    optimizer: str
    sharded: bool
    world_size: int
    shapes: tuple[tuple[int, ...], ...]
    group_sizes: tuple[int, ...]

    def local_params(self, rank: int) -> list[int]:
        """The build-order indices of rank `rank`'s optimizer parameters, in its order."""
        if self.optimizer == "muon" and self.sharded:
            owners = matrix_owners(self.shapes, self.world_size)
            return [i for i in range(len(self.shapes)) if owners[i] == rank]
        return list(range(len(self.shapes)))

    def _holds(self, i: int, rank: int) -> bool:
        """Whether rank `rank` holds parameter i's state (a slice of it, for sharded AdamW)."""
        if self.optimizer == "muon":
            return (matrix_owners(self.shapes, self.world_size)[i] if self.sharded else i % self.world_size) == rank
        return True

    def _check(self, states: Sequence[dict[str, Any]]) -> None:
        if len(states) != self.world_size:
            raise ValueError(f"{len(states)} rank state(s) for a {self.world_size}-rank layout")
        for rank, sd in enumerate(states):
            sizes = [len(g["params"]) for g in sd["param_groups"]]
            expected = self.group_sizes if not (self.optimizer == "muon" and self.sharded) else None
            if len(sizes) != len(self.group_sizes) or (expected is not None and tuple(sizes) != expected) \
                    or sum(sizes) != len(self.local_params(rank)):
                raise ValueError(
                    f"the {self.optimizer} state of rank {rank} has param groups of {sizes} parameters, this "
                    f"run's optimizer {list(self.group_sizes)}"
                )

    def full(self, states: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The single-process state dict from every rank's state dict in this layout."""
        self._check(states)
        groups, start = [], 0
        for g, n in zip(states[0]["param_groups"], self.group_sizes, strict=True):
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + n))})
            start += n
        state: dict[int, dict[str, Any]] = {}
        if self.optimizer == "adamw" and self.sharded:
            for i, shape in enumerate(self.shapes):
                slices = [sd["state"].get(i) for sd in states]
                if slices[0] is None:
                    continue
                # moments are flat slices (1-D), concatenated in rank order; `step` is the same everywhere
                state[i] = {
                    k: torch.cat([s[k] for s in slices]).view(shape) if torch.is_tensor(v) and v.ndim == 1 else v
                    for k, v in slices[0].items()
                }
        else:
            for rank in range(self.world_size) if self.optimizer == "muon" else [0]:
                local = self.local_params(rank)
                for li, st in states[rank]["state"].items():
                    if self._holds(local[li], rank):
                        state[local[li]] = st
        return {"state": state, "param_groups": groups}

    def split(self, full: dict[str, Any], rank: int) -> dict[str, Any]:
        """Rank `rank`'s state dict in this layout from the single-process one."""
        local = self.local_params(rank)
        position = {i: li for li, i in enumerate(local)}
        groups = [{**g, "params": [position[i] for i in g["params"] if i in position]} for g in full["param_groups"]]
        state: dict[int, dict[str, Any]] = {}
        for i, st in full["state"].items():
            if i not in position or not self._holds(i, rank):
                continue
            if self.optimizer == "adamw" and self.sharded:
                lo, hi = slice_ranges(math.prod(self.shapes[i]), self.world_size)[rank]
                st = {
                    k: v.reshape(-1)[lo:hi].clone() if torch.is_tensor(v) and v.ndim > 0 else v for k, v in st.items()
                }
            state[position[i]] = st
        return {"state": state, "param_groups": groups}


def state_layout(opt: torch.optim.Optimizer, world_size: int) -> StateLayout:
    """The layout of `opt` (one of build_optimizers') in a run of `world_size` ranks."""
    name = "muon" if isinstance(opt, Muon) else "adamw" if isinstance(opt, AdamW) else None
    if name is None:
        raise ValueError(f"{type(opt).__name__} is not one of lockstep.train.optim's optimizers")
    if isinstance(opt, _ShardedStep):
        return StateLayout(name, True, opt.shards.world_size, tuple(tuple(p.shape) for p in opt.shards.params),
                           opt.full_group_sizes)
    return StateLayout(name, False, world_size, tuple(tuple(p.shape) for g in opt.param_groups for p in g["params"]),
                       tuple(len(g["params"]) for g in opt.param_groups))
