"""The primitives the GPT is written in, and the one switch between their implementations
(`GPT.use_kernels`): REFERENCE_OPS, stock PyTorch; KERNEL_OPS, lockstep.model.kernels' CPU fast paths;
and CUDA_OPS, whose head loss runs in chunks of rows (`chunked_head_loss`) so that no fp32 logits
of the whole batch exist. Each is equal to the reference to rounding. Also the model's loss
convention (IGNORE_INDEX, cross_entropy) and its logit soft cap. Pure tensor functions: they know
nothing of the network's modules (lockstep.model.gpt)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch
import torch.nn.functional as F

from lockstep.core import fastpath
from lockstep.model import kernels

IGNORE_INDEX = -100  # a target without a loss
LossReduction = Literal["mean", "sum", "none"]
RMS_EPS = 1e-6  # added to the mean square; fixed rather than finfo(dtype).eps so bf16 and fp32 agree
T = TypeVar("T")  # what a chunk body returns


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dim: x / sqrt(mean(x^2) + 1e-6), in x's dtype."""
    return F.rms_norm(x, (x.size(-1),), eps=RMS_EPS)


def check_reduction(reduction: str) -> None:
    """Refuse a loss reduction other than the three every loss here takes."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"loss_reduction={reduction!r} must be 'mean', 'sum' or 'none'")


def reduce_total(total: torch.Tensor, counted: torch.Tensor, reduction: LossReduction) -> torch.Tensor:
    """A loss summed over positions, `total` (), reduced as `reduction` ("sum" or "mean") asks:
    itself, or over the number of `counted` positions, at least 1. F.cross_entropy's own mean is
    0/0 = NaN when every target is ignored (a fully masked SFT batch); this one gives loss 0 with
    all-zero, finite gradients. The one reduction of every loss in lockstep.model and
    lockstep.train.objectives ("none" returns the positions, in the caller's shape)."""
    return total if reduction == "sum" else total / counted.sum().clamp(min=1)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: LossReduction) -> torch.Tensor:
    """fp32 cross-entropy of logits (B, T, V) against targets (B, T), IGNORE_INDEX skipped: `mean`
    over counted targets (0 when none is: reduce_total), `sum`, or `none` (B, T) with 0 at ignored
    positions."""
    check_reduction(reduction)
    flat = logits.reshape(-1, logits.size(-1)).float()  # (B*T, V)
    y = targets.reshape(-1)  # (B*T,)
    if reduction == "none":
        return F.cross_entropy(flat, y, ignore_index=IGNORE_INDEX, reduction="none").view(targets.shape)
    total = F.cross_entropy(flat, y, ignore_index=IGNORE_INDEX, reduction="sum")
    return reduce_total(total, y != IGNORE_INDEX, reduction)


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
    """head_loss through kernels.head_loss_rows, which never holds the batch's (B, T, V) fp32
    logits; a cap it cannot exponentiate takes the plain logits of kernels.head_logits instead."""
    if not 0 < cap <= kernels.SAFE_EXP_CAP:
        return cross_entropy(capped_logits(kernels.head_logits, x, w, cap, vocab_size), targets, reduction)
    check_reduction(reduction)
    rows = kernels.head_loss_rows(x, w, targets, softcap=cap, vocab_size=vocab_size, ignore_index=IGNORE_INDEX)
    return rows if reduction == "none" else reduce_total(rows.sum(), targets != IGNORE_INDEX, reduction)


# ---- chunked head + cross-entropy (the GPU fast path) -----------------------------------------

# Rows (tokens) of the batch whose logits exist at once in chunked_head_loss. Run eagerly, a chunk
# holds at most two fp32 (rows, V) buffers and one in the matmul dtype, so the chunk loop needs at
# most ~2.5 x CHUNK_ROWS x V x 4 bytes beyond the weights: 1.25 GiB at V = 65,536, against 16 GiB
# for one fp32 copy of the logits of 32 x 2048 tokens (a compiled chunk body fuses the fp32 passes
# and needs less). For `sum` and `mean` the forward computes the gradients too (_ChunkedHeadLoss)
# and holds them until the backward: the hidden states' (N, C) in the matmul dtype, the size of one
# activation (96 MiB at d12's 32 x 2048 tokens and C = 768, in bf16), and the head's (V_padded, C)
# in fp32, the size of the head's gradient itself (192 MiB at d12). 2048 rows keep each chunk's
# (2048 x C) @ (C x V) matmul large enough to fill a GPU.
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


@functools.cache
def _addmm_writes_fp32(device_type: str) -> bool:
    """Whether this torch's addmm on `device_type` multiplies bf16 matrices into an fp32 tensor and
    adds there (`torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`): cuBLAS then
    accumulates the product straight onto the fp32 sum. Tried once per device type on 2 x 3 x 2
    ones (a wrong sum counts as missing), not read off torch's version: a kernel exists per backend
    and build. CUDA has it where torch's `_addmm_dtype_out_cuda` accepts an fp32 `self` (older
    builds require `self` in the operands' dtype and raise); the CPU of torch 2.13 has no kernel
    for `addmm.dtype_out` (NotImplementedError)."""
    try:
        acc = torch.ones(2, 2, dtype=torch.float32, device=device_type)
        ones = torch.ones(2, 3, dtype=torch.bfloat16, device=device_type)
        torch.addmm(acc, ones, ones.t(), out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):  # no kernel (NotImplementedError), a dtype check, no out_dtype keyword
        return False
    return acc.tolist() == [[4.0, 4.0], [4.0, 4.0]]  # 1 + 3 ones: the product added, not written over


def _accumulate_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (m, n) fp32 += a (m, k) @ b (k, n), a and b in the matmul dtype. fp32 operands: addmm_.
    bf16 ones where addmm writes fp32 (_addmm_writes_fp32: CUDA): the product accumulates in fp32
    onto acc, with no temporary. Elsewhere (the CPU, or an older CUDA build) the product is made in
    bf16, a (m, n) temporary rounded once (2^-8 relative) before the fp32 sum, which is what the
    chunked head did everywhere before; the CPU runs this loss only in tests."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif _addmm_writes_fp32(acc.device.type):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(torch.mm(a, b))


def _chunk_input_grads(dz: torch.Tensor, xc: torch.Tensor, w: torch.Tensor, dx_rows: torch.Tensor | None,
                       dw_v: torch.Tensor | None) -> None:
    """One chunk's share of the input gradients from its logit gradient dz (r, V): dx_rows (r, C)
    = dz @ w, written in place, and dz.T @ xc (V, C) added to the fp32 dw_v; None where that
    gradient is not wanted. The results are written only here, after the chunk's body returned."""
    if dx_rows is not None:
        torch.mm(dz, w, out=dx_rows)  # (r, C)
    if dw_v is not None:
        _accumulate_fp32(dw_v, dz.t(), xc)  # (V, C)


class _ChunkedHeadLoss(torch.autograd.Function):
    """Cross-entropy of the soft-capped logits l = cap * tanh(x @ W[:V].T / cap) against a target
    distribution q over K ids per row (weights `coefs` on ids `cols`, a one-hot for plain
    cross-entropy), lse(l) - sum_k q_k l[cols_k] per row, computed `chunk_rows` rows at a time so
    that neither pass holds more than one chunk's (rows, V) logits. A row's logit gradient is
    dz = g * (softmax(l) - q) * (1 - t^2) (t = tanh(z / cap), g the row's output gradient), and
    from it dx = dz @ W and dW = the sum over chunks of dz.T @ x.

    `reduction` "sum" or "mean" returns the reduced loss, through which every counted row gets the
    same g: the incoming scalar (divided by the count for mean). So the forward turns each chunk's
    logits into dz with g = 1 right after their log-sum-exp, and computes that chunk's dx rows and
    dW share from them; the backward only scales dx and dW by the scalar, on the device. That is
    three (rows x C x V) matmuls per chunk, where recomputing the logits in the backward takes
    four: 2 x C x V FLOPs more per token, +9.7% of d12's training FLOPs (V = 65,536, C = 768,
    against lockstep plan's 1.04 GFLOP per token) and +4.8% of d20's. The gradients are computed
    only where wanted (`need_x`, `need_w`); with neither the forward is the plain loss. "none"
    returns the rows, whose g differ: the forward keeps one log-sum-exp per row and the backward
    recomputes each chunk's logits (four matmuls per chunk).

    The matmuls run in `compute_dtype` (bf16 under autocast), everything between them in fp32, as
    the reference does; dW accumulates in fp32 (_accumulate_fp32). Rows not `counted`
    (IGNORE_INDEX) give 0 and send no gradient."""

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        cols,
        coefs,
        counted,
        cap,
        vocab_size,
        chunk_rows,
        compute_dtype,  # type: ignore[override]
        reduction,
        need_x,
        need_w,
        bodies,
    ):
        # x (N, C), weight (V_padded, C), cols (N, K) int64, coefs (N, K) fp32, counted (N,) bool
        N, C = x.shape
        grads_now = reduction != "none" and (need_x or need_w)
        dx = dw = None
        # autocast off: the dtypes are decided once, by the caller, and the backward, which
        # autograd may run inside the caller's autocast or outside it, computes in the same ones
        with torch.autocast(x.device.type, enabled=False):
            xc = x.to(compute_dtype)  # (N, C)
            w = weight[:vocab_size].to(compute_dtype)  # (V, C)
            lse = torch.empty(N, dtype=torch.float32, device=x.device)  # (N,)
            picked = torch.empty(N, dtype=torch.float32, device=x.device)  # (N,) sum_k q_k l[cols_k]
            if grads_now:
                g = counted.float()  # (N,): each counted row's gradient before the output's, ignored rows 0
                if need_x:
                    dx = torch.empty(N, C, dtype=compute_dtype, device=x.device)  # (N, C)
                if need_w:
                    # accumulated in fp32 across chunks; padded ids (rows V..V_padded) get zero
                    dw = torch.zeros(weight.size(0), C, dtype=torch.float32, device=x.device)  # (V_padded, C)
            for i in range(0, N, chunk_rows):
                i2 = min(i + chunk_rows, N)
                if grads_now:
                    lse[i:i2], picked[i:i2], dz = bodies.forward_with_grad(xc[i:i2], w, cols[i:i2], coefs[i:i2],
                                                                           g[i:i2], cap)  # dz (r, V)
                    _chunk_input_grads(dz, xc[i:i2], w, None if dx is None else dx[i:i2],
                                       None if dw is None else dw[:vocab_size])
                    del dz
                else:
                    lse[i:i2], picked[i:i2] = bodies.forward(xc[i:i2], w, cols[i:i2], coefs[i:i2], cap)
        rows = torch.where(counted, lse - picked, 0.0)  # (N,)
        ctx.meta = (reduction, cap, chunk_rows, x.dtype, weight.dtype, weight.size(0), bodies)
        if reduction == "none":
            ctx.save_for_backward(xc, w, lse, cols, coefs, counted)
            return rows
        # the backward scales dx and dW in place: a second backward (retain_graph) would find them
        # changed, and autograd refuses it when it unpacks them
        ctx.save_for_backward(dx, dw, counted)
        return reduce_total(rows.sum(), counted, reduction)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        reduction, cap, chunk_rows, x_dtype, w_dtype, v_padded, bodies = ctx.meta
        if reduction != "none":
            dx, dw, counted = ctx.saved_tensors
            # d reduce_total / d total, () on the device: no host sync
            scale = grad_out.float() if reduction == "sum" else grad_out.float() / counted.sum().clamp(min=1)
            gx = None if dx is None else dx.to(x_dtype).mul_(scale)
            gw = None if dw is None else dw.mul_(scale).to(w_dtype)
            return gx, gw, None, None, None, None, None, None, None, None, None, None, None
        xc, w, lse, cols, coefs, counted = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        N, C = xc.shape
        V = w.size(0)
        dx = dw = None
        with torch.autocast(xc.device.type, enabled=False):
            g = torch.where(counted, grad_out.float(), 0.0)  # (N,): ignored rows send nothing back
            if need_x:
                dx = torch.empty(N, C, dtype=xc.dtype, device=xc.device)  # (N, C)
            if need_w:
                # accumulated in fp32 across chunks; padded ids (rows V..V_padded) get zero
                dw = torch.zeros(v_padded, C, dtype=torch.float32, device=w.device)  # (V_padded, C)
            for i in range(0, N, chunk_rows):
                i2 = min(i + chunk_rows, N)
                dz = bodies.grad_logits(xc[i:i2], w, lse[i:i2], cols[i:i2], coefs[i:i2], g[i:i2], cap)  # (r, V)
                _chunk_input_grads(dz, xc[i:i2], w, None if dx is None else dx[i:i2], None if dw is None else dw[:V])
                del dz
        return (dx.to(x_dtype) if need_x else None, dw.to(w_dtype) if need_w else None,
                None, None, None, None, None, None, None, None, None, None, None)


def _logit_grad(logits: torch.Tensor, t: torch.Tensor | None, lse: torch.Tensor, cols: torch.Tensor,
                coefs: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dz = g * (softmax(l) - q) * (1 - t^2) (r, V) from a chunk's fp32 logits (r, V), computed
    over their buffer, and rounded to `dtype` (the matmul dtype) as autograd rounds the
    reference's logit gradient."""
    p = logits.sub_(lse[:, None]).exp_()  # softmax, over the logits' buffer
    p.scatter_add_(1, cols, coefs.neg())  # softmax - q
    p.mul_(g[:, None])
    if t is not None:
        p.mul_(t.square_().neg_().add_(1.0))  # through the cap: d(cap tanh(z/cap))/dz = 1 - t^2
    return p.to(dtype)


def _chunk_forward(xc: torch.Tensor, w: torch.Tensor, cols: torch.Tensor, coefs: torch.Tensor,
                   cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's forward: the log-sum-exp (r,) of its soft-capped logits and sum_k q_k l[cols_k] (r,)."""
    logits, _ = _chunk_logits(xc, w, cap, keep_tanh=False)  # (r, V)
    return torch.logsumexp(logits, dim=1), torch.linalg.vecdot(logits.gather(1, cols), coefs)


def _chunk_forward_with_grad(xc: torch.Tensor, w: torch.Tensor, cols: torch.Tensor, coefs: torch.Tensor,
                             g: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's forward and its logit gradient from the same logits: the log-sum-exp (r,),
    sum_k q_k l[cols_k] (r,), and dz (r, V) in the matmul dtype for row gradients g (r,)."""
    logits, t = _chunk_logits(xc, w, cap, keep_tanh=True)  # (r, V) fp32
    lse = torch.logsumexp(logits, dim=1)
    picked = torch.linalg.vecdot(logits.gather(1, cols), coefs)
    return lse, picked, _logit_grad(logits, t, lse, cols, coefs, g, xc.dtype)


def _chunk_grad_logits(xc: torch.Tensor, w: torch.Tensor, lse: torch.Tensor, cols: torch.Tensor, coefs: torch.Tensor,
                       g: torch.Tensor, cap: float) -> torch.Tensor:
    """One chunk's dz (r, V) in the matmul dtype, its logits recomputed from xc and the forward's lse."""
    logits, t = _chunk_logits(xc, w, cap, keep_tanh=True)  # (r, V) fp32
    return _logit_grad(logits, t, lse, cols, coefs, g, xc.dtype)


@dataclass(frozen=True)
class ChunkBodies:
    """What _ChunkedHeadLoss runs per chunk, eager or compiled: `forward` (_chunk_forward) where no
    gradient is computed in the forward, `forward_with_grad` (_chunk_forward_with_grad) for the sum
    and mean reductions, and `grad_logits` (_chunk_grad_logits) in the backward of "none". The
    loop over chunks stays in Python either way: compiled whole, inductor fused all chunks'
    reductions into one kernel, which kept every chunk's logits alive at once and, at 32 x 2048
    rows and 65,536 ids (2^32 elements), overran 32-bit indexing: an illegal memory access on an
    H100 (torch 2.11). A body sees one chunk only."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    forward_with_grad: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    grad_logits: Callable[..., torch.Tensor]


EAGER_CHUNK_BODIES = ChunkBodies(forward=_chunk_forward, forward_with_grad=_chunk_forward_with_grad,
                                 grad_logits=_chunk_grad_logits)


def _falling_back(compiled: Callable[..., T], eager: Callable[..., T]) -> Callable[..., T]:
    """A chunk body that calls `compiled` through the fast path "chunk_bodies" (lockstep.core.fastpath):
    where a compile or recompile raises, that call and every later one of any body are answered by
    `eager`, the same function uncompiled. A body is a pure function of its inputs that returns new
    tensors, and the chunk loop writes what it returns only after it returned
    (_chunk_input_grads), so a failed compiled call leaves nothing to undo."""
    def body(*args):
        return fastpath.call("chunk_bodies", lambda: compiled(*args), lambda: eager(*args))

    return body


@functools.cache
def compiled_chunk_bodies(backend: str | Callable) -> ChunkBodies:
    """The chunk bodies through torch.compile with `backend` (made once per backend), each falling
    back to its eager self (_falling_back): their elementwise passes over a chunk's (r, V) logits
    fuse. Shapes may vary (the last chunk, other batches): dynamo marks them dynamic after the
    first recompile."""
    return ChunkBodies(**{name: _falling_back(torch.compile(body, backend=backend, fullgraph=True), body)
                          for name, body in vars(EAGER_CHUNK_BODIES).items()})


@torch.compiler.disable
def _chunked_loss(x: torch.Tensor, w: torch.Tensor, cols: torch.Tensor, coefs: torch.Tensor, counted: torch.Tensor,
                  cap: float, vocab_size: int, chunk_rows: int, compute_dtype: torch.dtype, reduction: LossReduction,
                  compiled: bool) -> torch.Tensor:
    """_ChunkedHeadLoss outside any compiled graph the caller is in (a graph break): the chunk loop
    runs in Python, on compiled bodies where the caller was being compiled. The gradients a
    backward will want are decided here, where grad mode is the caller's (inside the Function's
    forward it is off)."""
    bodies = compiled_chunk_bodies(CHUNK_COMPILE_BACKEND) if compiled else EAGER_CHUNK_BODIES
    grad = torch.is_grad_enabled()
    return _ChunkedHeadLoss.apply(x, w, cols, coefs, counted, cap, vocab_size, chunk_rows, compute_dtype, reduction,
                                  grad and x.requires_grad, grad and w.requires_grad, bodies)


def chunked_head_loss(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, cap: float, vocab_size: int,
                      reduction: LossReduction, *, chunk_rows: int = CHUNK_ROWS,
                      target_cols: torch.Tensor | None = None,
                      target_weights: torch.Tensor | None = None) -> torch.Tensor:
    """`head_loss` computed `chunk_rows` rows (tokens) at a time, forward and backward
    (_ChunkedHeadLoss), so that the fp32 logits of the whole batch never exist: the extra memory
    is about 2.5 x chunk_rows x vocab_size x 4 bytes, and for `sum` and `mean`, whose gradients
    the forward computes, the hidden states' and the head's gradients held until the backward
    (CHUNK_ROWS). x (..., C), targets (...) with IGNORE_INDEX, reductions as `cross_entropy`
    (`mean` over counted targets, 0 when none is). Under autocast the matmuls run in its dtype and
    the softmax in fp32.

    With `target_cols` and `target_weights` (both (..., K)), a counted position's target is not
    its one id but the distribution putting target_weights[..., k] on id target_cols[..., k]
    (weights summing to 1; a repeated id adds up): lockstep.train.objectives' prefix smoothing. `targets`
    still says which positions count. Under torch.compile the loss is a graph break: the chunk
    loop runs in Python and each chunk's body is compiled on its own (compiled_chunk_bodies), so no
    compiled kernel spans more than one chunk; where a body's compile fails, the bodies run eagerly
    from then on (lockstep.core.fastpath's part "chunk_bodies"), with one warning."""
    check_reduction(reduction)
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
    loss = _chunked_loss(x.reshape(N, C), w, cols, coefs, counted, float(cap), vocab_size, chunk_rows, compute_dtype,
                         reduction, torch.compiler.is_compiling())  # (N,) for "none", else ()
    return loss.view(targets.shape) if reduction == "none" else loss


def chunked_smoothed_head_loss(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, target_cols: torch.Tensor,
                               target_weights: torch.Tensor, cap: float, vocab_size: int,
                               reduction: LossReduction) -> torch.Tensor:
    """`chunked_head_loss` against a target distribution per position (Ops.smoothed_head_loss)."""
    return chunked_head_loss(x, w, targets, cap, vocab_size, reduction, target_cols=target_cols,
                             target_weights=target_weights)


@dataclass(frozen=True)
class Ops:
    """The primitives the network is written in, so that one switch swaps them all (see
    GPT.use_kernels): REFERENCE_OPS is stock PyTorch; KERNEL_OPS lockstep.model.kernels' CPU fast paths;
    CUDA_OPS, for GPUs, the reference's norm and head with `chunked_head_loss`, which never holds
    the (B*T, V) fp32 logits. Each equals the reference to rounding (tests/test_speed_paths.py,
    tests/test_chunked_loss.py)."""

    norm: Callable[[torch.Tensor], torch.Tensor]  # parameter-free RMSNorm over the last dim
    head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # x @ w.T: the padded logits
    head_loss: Callable[..., torch.Tensor]  # (x, w, targets, cap, vocab_size, reduction): lm_head + cross-entropy
    # (x, w, targets, target_cols, target_weights, cap, vocab_size, reduction): head_loss against a
    # target distribution over a few ids per position; None where the set has none, and
    # lockstep.train.objectives then adds its smoothing to head_loss's rows itself
    smoothed_head_loss: Callable[..., torch.Tensor] | None = None


REFERENCE_OPS = Ops(norm=rms_norm, head=F.linear, head_loss=head_loss)
KERNEL_OPS = Ops(
    norm=functools.partial(kernels.rms_norm, eps=RMS_EPS), head=kernels.head_logits, head_loss=fused_head_loss
)
# The reference's norm and decode head (torch.compile fuses the norm on a GPU; lockstep.model.kernels'
# are tuned for CPU threads) with the chunked head loss.
CUDA_OPS = Ops(norm=rms_norm, head=F.linear, head_loss=chunked_head_loss, smoothed_head_loss=chunked_smoothed_head_loss)


def fast_ops(device: torch.device) -> Ops:
    """The fast paths for a model on `device`: CUDA_OPS on CUDA, KERNEL_OPS (CPU-tuned, and what
    other devices ran before CUDA_OPS existed) elsewhere."""
    return CUDA_OPS if device.type == "cuda" else KERNEL_OPS
