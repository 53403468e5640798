"""The primitives the GPT is written in, and the one switch between their implementations
(`GPT.use_kernels`): REFERENCE_OPS, stock PyTorch; KERNEL_OPS, lockstep.kernels' CPU fast paths;
and CUDA_OPS, whose head loss runs in chunks of rows (`chunked_head_loss`) so that no fp32 logits
of the whole batch exist. Each is equal to the reference to rounding. Also the model's loss
convention (IGNORE_INDEX, cross_entropy) and its logit soft cap. Pure tensor functions: they know
nothing of the network's modules (lockstep.model)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from lockstep import kernels

IGNORE_INDEX = -100  # a target without a loss
LossReduction = Literal["mean", "sum", "none"]
RMS_EPS = 1e-6  # added to the mean square; fixed rather than finfo(dtype).eps so bf16 and fp32 agree


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dim: x / sqrt(mean(x^2) + 1e-6), in x's dtype."""
    return F.rms_norm(x, (x.size(-1),), eps=RMS_EPS)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: LossReduction) -> torch.Tensor:
    """fp32 cross-entropy of logits (B, T, V) against targets (B, T), IGNORE_INDEX skipped: `mean`
    over counted targets, `sum`, or `none` (B, T) with 0 at ignored positions. `mean` divides by
    max(1, counted targets) instead of F.cross_entropy's mean, which is 0/0 = NaN when every
    target is ignored (a fully masked SFT batch): such a batch gives loss 0 with all-zero, finite
    gradients."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"loss_reduction={reduction!r} must be 'mean', 'sum' or 'none'")
    flat = logits.reshape(-1, logits.size(-1)).float()  # (B*T, V)
    y = targets.reshape(-1)  # (B*T,)
    if reduction == "none":
        return F.cross_entropy(flat, y, ignore_index=IGNORE_INDEX, reduction="none").view(targets.shape)
    total = F.cross_entropy(flat, y, ignore_index=IGNORE_INDEX, reduction="sum")
    if reduction == "sum":
        return total
    return total / (y != IGNORE_INDEX).sum().clamp(min=1)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap): logits squashed smoothly into (-cap, cap); cap 0 leaves them."""
    return cap * torch.tanh(logits / cap) if cap else logits


def capped_logits(head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, w: torch.Tensor,
                  cap: float, vocab_size: int) -> torch.Tensor:
    """Soft-capped fp32 logits (B, T, vocab_size) of hidden states x (B, T, C) through `head`."""
    return softcap(head(x, w)[..., :vocab_size].float(), cap)  # (B, T, V)


def head_loss(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, cap: float, vocab_size: int,
              reduction: LossReduction) -> torch.Tensor:
    """`cross_entropy` of the soft-capped logits of x (B, T, C) through the head weight w."""
    return cross_entropy(capped_logits(F.linear, x, w, cap, vocab_size), targets, reduction)


def fused_head_loss(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, cap: float, vocab_size: int,
                    reduction: LossReduction) -> torch.Tensor:
    """head_loss through kernels.head_loss, which never holds the batch's (B, T, V) fp32 logits;
    a cap it cannot exponentiate takes the plain logits of kernels.head_logits instead."""
    if not 0 < cap <= kernels.SAFE_EXP_CAP:
        return cross_entropy(capped_logits(kernels.head_logits, x, w, cap, vocab_size), targets, reduction)
    return kernels.head_loss(x, w, targets, softcap=cap, vocab_size=vocab_size, reduction=reduction,
                             ignore_index=IGNORE_INDEX)


# ---- chunked head + cross-entropy (the GPU fast path) -----------------------------------------

# Rows (tokens) of the batch whose logits exist at once in chunked_head_loss. Run eagerly, a chunk
# holds at most two fp32 (rows, V) buffers and one in the matmul dtype, so the loss needs at most
# ~2.5 x CHUNK_ROWS x V x 4 bytes beyond the weights: 1.25 GiB at V = 65,536, against 16 GiB for
# one fp32 copy of the logits of 32 x 2048 tokens (a compiled chunk body fuses the fp32 passes and
# needs less). 2048 rows keep each chunk's (2048 x C) @ (C x V) matmul large enough to fill a GPU.
CHUNK_ROWS = 2048
# The backend that compiles the chunk bodies when the caller is being compiled (tests count and
# inspect the bodies' graphs through another).
CHUNK_COMPILE_BACKEND: str | Callable = "inductor"


def _chunk_logits(x: torch.Tensor, w: torch.Tensor, cap: float, *,
                  keep_tanh: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 soft-capped logits l (r, V) of x (r, C) through w (V, C), `softcap`'s formula op for
    op, and with `keep_tanh` t = tanh(z / cap) too (None without a cap). Without `keep_tanh` the
    cap is applied in place: one fp32 (r, V) buffer rather than two."""
    z = torch.mm(x, w.t()).float()  # (r, V): a new fp32 buffer, or the fp32 product itself
    if not cap:
        return z, None
    t = z.div_(cap).tanh_()
    if keep_tanh:
        return t * cap, t
    return t.mul_(cap), None


class _ChunkedHeadLoss(torch.autograd.Function):
    """Per-row cross-entropy of the soft-capped logits l = cap * tanh(x @ W[:V].T / cap) against a
    target distribution q over K ids per row (weights `coefs` on ids `cols`, a one-hot for plain
    cross-entropy): lse(l) - sum_k q_k l[cols_k], computed `chunk_rows` rows at a time. The forward
    keeps one log-sum-exp per row, not the logits; the backward recomputes a chunk's logits and
    turns them into dz = g * (softmax(l) - q) * (1 - t^2) (t = tanh(z / cap)), then dx = dz @ W
    and dW += dz.T @ x, so neither pass ever holds more than one chunk's (rows, V) logits. The
    matmuls run in `compute_dtype` (bf16 under autocast), everything between them in fp32, as the
    reference does. Rows not `counted` (IGNORE_INDEX) give 0 and send no gradient."""

    @staticmethod
    def forward(ctx, x, weight, cols, coefs, counted, cap, vocab_size, chunk_rows, compute_dtype,  # type: ignore[override]
                bodies):
        # x (N, C), weight (V_padded, C), cols (N, K) int64, coefs (N, K) fp32, counted (N,) bool
        N = x.size(0)
        # autocast off: the dtypes are decided once, by the caller, and the backward, which
        # autograd may run inside the caller's autocast or outside it, computes in the same ones
        with torch.autocast(x.device.type, enabled=False):
            xc = x.to(compute_dtype)  # (N, C)
            w = weight[:vocab_size].to(compute_dtype)  # (V, C)
            lse = torch.empty(N, dtype=torch.float32, device=x.device)  # (N,)
            picked = torch.empty(N, dtype=torch.float32, device=x.device)  # (N,) sum_k q_k l[cols_k]
            for i in range(0, N, chunk_rows):
                i2 = min(i + chunk_rows, N)
                lse[i:i2], picked[i:i2] = bodies.forward(xc[i:i2], w, cols[i:i2], coefs[i:i2], cap)
        ctx.save_for_backward(xc, w, lse, cols, coefs, counted)
        ctx.meta = (cap, chunk_rows, x.dtype, weight.dtype, weight.size(0), bodies)
        return torch.where(counted, lse - picked, 0.0)

    @staticmethod
    def backward(ctx, grad_rows):  # type: ignore[override]
        xc, w, lse, cols, coefs, counted = ctx.saved_tensors
        cap, chunk_rows, x_dtype, w_dtype, v_padded, bodies = ctx.meta
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        N, C = xc.shape
        V = w.size(0)
        dx = dw = None
        with torch.autocast(xc.device.type, enabled=False):
            g = torch.where(counted, grad_rows.float(), 0.0)  # (N,): ignored rows send nothing back
            if need_x:
                dx = torch.empty(N, C, dtype=xc.dtype, device=xc.device)  # (N, C)
            if need_w:
                # accumulated in fp32 across chunks; padded ids (rows V..V_padded) get zero
                dw = torch.zeros(v_padded, C, dtype=torch.float32, device=w.device)  # (V_padded, C)
            for i in range(0, N, chunk_rows):
                i2 = min(i + chunk_rows, N)
                dz = bodies.grad_logits(xc[i:i2], w, lse[i:i2], cols[i:i2], coefs[i:i2], g[i:i2], cap)  # (r, V)
                if need_x:
                    dx[i:i2] = torch.mm(dz, w)  # (r, C)
                if need_w:
                    if dz.dtype == torch.float32:
                        dw[:V].addmm_(dz.t(), xc[i:i2])
                    else:
                        dw[:V].add_(torch.mm(dz.t(), xc[i:i2]))  # (V, C) rounded once per chunk, summed in fp32
                del dz
        return (dx.to(x_dtype) if need_x else None, dw.to(w_dtype) if need_w else None,
                None, None, None, None, None, None, None, None)


def _chunk_forward(xc: torch.Tensor, w: torch.Tensor, cols: torch.Tensor, coefs: torch.Tensor,
                   cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's forward: the log-sum-exp (r,) of its soft-capped logits and sum_k q_k l[cols_k] (r,)."""
    logits, _ = _chunk_logits(xc, w, cap, keep_tanh=False)  # (r, V)
    return torch.logsumexp(logits, dim=1), torch.linalg.vecdot(logits.gather(1, cols), coefs)


def _chunk_grad_logits(xc: torch.Tensor, w: torch.Tensor, lse: torch.Tensor, cols: torch.Tensor, coefs: torch.Tensor,
                       g: torch.Tensor, cap: float) -> torch.Tensor:
    """One chunk's dz = g * (softmax(l) - q) * (1 - t^2), (r, V) in the matmul dtype, as autograd
    rounds the reference's logit gradient."""
    logits, t = _chunk_logits(xc, w, cap, keep_tanh=True)  # (r, V) fp32
    p = logits.sub_(lse[:, None]).exp_()  # softmax, over the logits' buffer
    p.scatter_add_(1, cols, coefs.neg())  # softmax - q
    p.mul_(g[:, None])
    if t is not None:
        p.mul_(t.square_().neg_().add_(1.0))  # through the cap: d(cap tanh(z/cap))/dz = 1 - t^2
    return p.to(xc.dtype)


@dataclass(frozen=True)
class ChunkBodies:
    """What _ChunkedHeadLoss runs per chunk: `forward` (_chunk_forward) and `grad_logits`
    (_chunk_grad_logits), eager or compiled. The loop over chunks stays in Python either way:
    compiled whole, inductor fused all chunks' reductions into one kernel, which kept every chunk's
    logits alive at once and, at 32 x 2048 rows and 65,536 ids (2^32 elements), overran 32-bit
    indexing: an illegal memory access on an H100 (torch 2.11). A body sees one chunk only."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    grad_logits: Callable[..., torch.Tensor]


EAGER_CHUNK_BODIES = ChunkBodies(forward=_chunk_forward, grad_logits=_chunk_grad_logits)


@functools.cache
def compiled_chunk_bodies(backend: str | Callable) -> ChunkBodies:
    """The chunk bodies through torch.compile with `backend` (made once per backend): their
    elementwise passes over a chunk's (r, V) logits fuse. Shapes may vary (the last chunk, other
    batches): dynamo marks them dynamic after the first recompile."""
    return ChunkBodies(forward=torch.compile(_chunk_forward, backend=backend, fullgraph=True),
                       grad_logits=torch.compile(_chunk_grad_logits, backend=backend, fullgraph=True))


@torch.compiler.disable
def _chunked_rows(x: torch.Tensor, w: torch.Tensor, cols: torch.Tensor, coefs: torch.Tensor, counted: torch.Tensor,
                  cap: float, vocab_size: int, chunk_rows: int, compute_dtype: torch.dtype,
                  compiled: bool) -> torch.Tensor:
    """_ChunkedHeadLoss outside any compiled graph the caller is in (a graph break): the chunk loop
    runs in Python, on compiled bodies where the caller was being compiled."""
    bodies = compiled_chunk_bodies(CHUNK_COMPILE_BACKEND) if compiled else EAGER_CHUNK_BODIES
    return _ChunkedHeadLoss.apply(x, w, cols, coefs, counted, cap, vocab_size, chunk_rows, compute_dtype, bodies)


def chunked_head_loss(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, cap: float, vocab_size: int,
                      reduction: LossReduction, *, chunk_rows: int = CHUNK_ROWS,
                      target_cols: torch.Tensor | None = None,
                      target_weights: torch.Tensor | None = None) -> torch.Tensor:
    """`head_loss` computed `chunk_rows` rows (tokens) at a time, forward and backward
    (_ChunkedHeadLoss), so that the fp32 logits of the whole batch never exist: the extra memory
    is about 2.5 x chunk_rows x vocab_size x 4 bytes (CHUNK_ROWS). x (..., C), targets (...) with
    IGNORE_INDEX, reductions as `cross_entropy` (`mean` over counted targets, 0 when none is).
    Under autocast the matmuls run in its dtype and the softmax in fp32.

    With `target_cols` and `target_weights` (both (..., K)), a counted position's target is not
    its one id but the distribution putting target_weights[..., k] on id target_cols[..., k]
    (weights summing to 1; a repeated id adds up): lockstep.objectives' prefix smoothing. `targets`
    still says which positions count. Under torch.compile the loss is a graph break: the chunk
    loop runs in Python and each chunk's body is compiled on its own (compiled_chunk_bodies), so no
    compiled kernel spans more than one chunk."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"loss_reduction={reduction!r} must be 'mean', 'sum' or 'none'")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows} must be >= 1 (rows of logits computed at once)")
    if (target_cols is None) != (target_weights is None):
        raise ValueError("pass target_cols and target_weights together (a target distribution), or neither")
    C = x.size(-1)
    y = targets.reshape(-1)  # (N,)
    N = y.numel()
    counted = y != IGNORE_INDEX  # (N,)
    if target_cols is None:
        cols = torch.where(counted, y, 0)[:, None]  # (N, 1): the target itself
        coefs = torch.ones(N, 1, dtype=torch.float32, device=x.device)  # (N, 1)
    else:
        if target_cols.shape != target_weights.shape or target_cols.shape[:-1] != targets.shape:
            raise ValueError(f"target_cols {tuple(target_cols.shape)} and target_weights {tuple(target_weights.shape)} "
                             f"must both be the targets' shape {tuple(targets.shape)} plus one dim of ids")
        cols = torch.where(counted[:, None], target_cols.reshape(N, -1), 0)  # (N, K)
        coefs = target_weights.reshape(N, -1).float()  # (N, K)
    if torch.is_autocast_enabled(x.device.type):
        compute_dtype = torch.get_autocast_dtype(x.device.type)
    else:
        compute_dtype = w.dtype
    # Being compiled (by the Trainer's torch.compile, say), the chunk bodies compile too; the loop
    # over them runs outside the caller's graph either way (ChunkBodies says why).
    rows = _chunked_rows(x.reshape(N, C), w, cols, coefs, counted, float(cap), vocab_size, chunk_rows, compute_dtype,
                         torch.compiler.is_compiling())  # (N,)
    if reduction == "none":
        return rows.view(targets.shape)
    total = rows.sum()
    if reduction == "sum":
        return total
    return total / counted.sum().clamp(min=1)


def chunked_smoothed_head_loss(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, target_cols: torch.Tensor,
                               target_weights: torch.Tensor, cap: float, vocab_size: int,
                               reduction: LossReduction) -> torch.Tensor:
    """`chunked_head_loss` against a target distribution per position (Ops.smoothed_head_loss)."""
    return chunked_head_loss(x, w, targets, cap, vocab_size, reduction, target_cols=target_cols,
                             target_weights=target_weights)


@dataclass(frozen=True)
class Ops:
    """The primitives the network is written in, so that one switch swaps them all (see
    GPT.use_kernels): REFERENCE_OPS is stock PyTorch; KERNEL_OPS lockstep.kernels' CPU fast paths;
    CUDA_OPS, for GPUs, the reference's norm and head with `chunked_head_loss`, which never holds
    the (B*T, V) fp32 logits. Each equals the reference to rounding (tests/test_speed_paths.py,
    tests/test_chunked_loss.py)."""

    norm: Callable[[torch.Tensor], torch.Tensor]  # parameter-free RMSNorm over the last dim
    head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # x @ w.T: the padded logits
    head_loss: Callable[..., torch.Tensor]  # (x, w, targets, cap, vocab_size, reduction): lm_head + cross-entropy
    # (x, w, targets, target_cols, target_weights, cap, vocab_size, reduction): head_loss against a
    # target distribution over a few ids per position; None where the set has none, and
    # lockstep.objectives then adds its smoothing to head_loss's rows itself
    smoothed_head_loss: Callable[..., torch.Tensor] | None = None


REFERENCE_OPS = Ops(norm=rms_norm, head=F.linear, head_loss=head_loss)
KERNEL_OPS = Ops(norm=functools.partial(kernels.rms_norm, eps=RMS_EPS), head=kernels.head_logits, head_loss=fused_head_loss)
# The reference's norm and decode head (torch.compile fuses the norm on a GPU; lockstep.kernels'
# are tuned for CPU threads) with the chunked head loss.
CUDA_OPS = Ops(norm=rms_norm, head=F.linear, head_loss=chunked_head_loss, smoothed_head_loss=chunked_smoothed_head_loss)


def fast_ops(device: torch.device) -> Ops:
    """The fast paths for a model on `device`: CUDA_OPS on CUDA, KERNEL_OPS (CPU-tuned, and what
    other devices ran before CUDA_OPS existed) elsewhere."""
    return CUDA_OPS if device.type == "cuda" else KERNEL_OPS
