"""CPU fast paths for the GPT's primitives: a parameter-free RMSNorm with a hand-written backward,
a weight-on-the-left head for decoding, and a fused, tiled, threaded lm_head + cross-entropy. Pure
tensor functions: they know nothing of the model, which uses them only after
`GPT.use_kernels(True)` (the `runtime.kernels` setting).

Each one computes what its stock PyTorch counterpart in lockstep.model.ops computes, to rounding;
tests/test_speed_paths.py holds them to that. They exist because the tiny presets train and decode
on 2-core CPUs: the bare d4 training step runs 1.7-3x as fast with them as without
(bench/bench_model.py); the figure for each is next to it."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F



# ---- RMSNorm ---------------------------------------------------------------------------------


def _rms_scale(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, in fp32 (fp64 for fp64 x), shape (..., 1);
    the norm is accumulated in fp32 without materialising an fp32 copy of x."""
    acc = torch.promote_types(x.dtype, torch.float32)
    ss = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=acc)  # (..., 1)
    return torch.rsqrt(ss.square_().div_(x.size(-1)).add_(eps))


class _RMSNorm(torch.autograd.Function):
    """Parameter-free RMSNorm with a hand-written backward, dx = r * (g - y * mean(g * y)):
    on CPU, fwd+bwd measured 4.0x and 3.3x as fast as F.rms_norm's autograd for the
    (8, 256, 256) fp32 and (8, 4, 256, 64) bf16 activations of the d4 benchmark (torch 2.13, 2
    threads: 0.86 against 3.46 ms, 0.85 against 2.82 ms)."""

    @staticmethod
    def forward(ctx, x, eps):  # type: ignore[override]
        r = _rms_scale(x, eps)
        y = x * r.to(x.dtype)
        ctx.save_for_backward(y, r)
        return y

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        y, r = ctx.saved_tensors
        m = torch.linalg.vecdot(g, y, dim=-1).unsqueeze(-1).to(r.dtype).div_(y.size(-1))  # (..., 1)
        return torch.addcmul(g, y, m.to(g.dtype), value=-1.0).mul_(r.to(g.dtype)), None


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in x's dtype: F.rms_norm without a weight.
    Where a gradient is needed, _RMSNorm, which rounds the scale to x's dtype before the product
    (F.rms_norm multiplies in fp32), so bf16 outputs may differ by one unit in the last place.
    Without one, F.rms_norm itself: at decode sizes it measured 1.3x faster than _RMSNorm's
    forward on this CPU (12-17 us against 16-22 us per call, bf16, 2 threads)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _RMSNorm.apply(x, eps)
    return F.rms_norm(x, (x.size(-1),), eps=eps)


# ---- logits while decoding --------------------------------------------------------------------

# Up to this many rows (decoding), logits are computed as W @ x.T rather than F.linear's x @ W.T.
# Whole-engine decode on this CPU (bench/bench_decode.py's models, 2 threads, interleaved runs),
# fp32 weights: 1.16x (tiny) and 1.5-1.7x (d4, 32k vocab) the tokens/s at batch 8, even at batch
# 1; bf16 weights: even (0.94-1.01x).
SMALL_BATCH_ROWS = 16


def head_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (B, T, C) @ w.T: the lm_head's padded logits (B, T, V_padded), weight on the left for
    a decoding step's few rows."""
    B, T, C = x.shape
    if B * T <= SMALL_BATCH_ROWS:
        return torch.mm(w, x.reshape(B * T, C).t()).t().view(B, T, -1)  # (V, C) @ (C, B*T) -> (B, T, V)
    return F.linear(x, w)


# ---- fused head + cross-entropy --------------------------------------------------------------

# Fused-head tile: 128 rows x 1024 vocab columns is 128K elements, ~1.3 MB over its three
# buffers, so the elementwise passes over a tile run from cache. Measured on the d4/32768 head
# (fwd+bwd of 2048 rows, bf16 autocast, one thread, CPU time): 675 ms at 128x1024, 724 ms at
# 128x2048, 863 ms at 32x8192, 784 ms with whole-vocab chunks of 128 rows.
HEAD_TILE_ROWS = 128
HEAD_TILE_COLS = 1024
_ACCEL_CHUNK_ELEMENTS = 1 << 25  # 128 MB per fp32 tile buffer on a GPU: whole vocab rows
# exp(softcap * tanh(.)) stays finite in fp32 up to ~88, so below this cap the softmax needs no
# max-subtraction pass and the fused head applies.
SAFE_EXP_CAP = 80.0


class _HeadLoss(torch.autograd.Function):
    """Per-row cross-entropy of the soft-capped logits l = s * tanh(x @ W[:V].T / s), computed in
    tiles of rows x vocab columns small enough to stay in cache, without ever holding the fp32
    logits of the batch. Only the gradient's dense part is kept, in the matmul dtype.

    With e = exp(l), S = sum(e) per row and t = tanh(z/s), the row loss is log S - l_target and
    its gradient with respect to z is (e / S - onehot) * (1 - t^2). Both parts separate: the dense
    E = e * (1 - t^2) needs nothing beyond its own tile (so a row's tiles need not meet: no
    online softmax, no recompute), the row scale 1/S is applied in the backward, and the one-hot
    part is one dot product per row (x . W[target]), also used for l_target. Requires
    0 < softcap <= SAFE_EXP_CAP so that exp(l) cannot overflow without a max shift."""

    @staticmethod
    def forward(ctx, x, weight, targets, softcap, vocab_size, compute_dtype, keep_grad, ignore_index):  # type: ignore[override]
        N, C = x.shape
        dev = x.device
        s = float(softcap)
        xc = x.to(compute_dtype)  # (N, C)
        w = weight[:vocab_size].to(compute_dtype)  # (V, C)
        # fold 1/softcap into the weights (a (V, C) pass, not N*V): lockstep.model.ops.softcap's s * tanh(z / s)
        # becomes s * tanh(x @ (W / s).T), equal to rounding only, so it cannot call it (test_speed_paths)
        w_in = w / s
        valid = targets != ignore_index  # (N,)
        safe_t = torch.where(valid, targets, 0)  # (N,)
        # logit at the target, from its own dot product (fp32 accumulation)
        t_tgt = torch.linalg.vecdot(xc.float(), w_in[safe_t].float()).tanh_()  # (N,)
        # fp16 cannot hold e up to e^softcap * V: shift every exponent down by softcap there
        shift = s if torch.finfo(compute_dtype).max < 1e30 else 0.0
        S = torch.zeros(N, dtype=torch.float32, device=dev)
        E = torch.empty(N, vocab_size, dtype=compute_dtype, device=dev) if keep_grad else None
        R, Vc = _tile_shape(N, vocab_size, dev)

        # the weight's column tiles, sliced once and shared by every row block
        col_tiles = [(j, min(j + Vc, vocab_size), w_in[j : j + Vc].t()) for j in range(0, vocab_size, Vc)]

        def row_block(i: int) -> None:
            # each call owns its buffers and its rows of S and E, so blocks may run concurrently
            # and every row's result is the same whichever thread computes it
            i2 = min(i + R, N)
            x_blk, S_blk = xc[i:i2], S[i:i2]
            E_blk = E[i:i2] if keep_grad else None
            z_buf = torch.empty(i2 - i, Vc, dtype=compute_dtype, device=dev)
            t_buf = (
                z_buf if compute_dtype == torch.float32 else torch.empty(i2 - i, Vc, dtype=torch.float32, device=dev)
            )
            e_buf = torch.empty(i2 - i, Vc, dtype=torch.float32, device=dev)
            for j, j2, w_t in col_tiles:
                if j2 - j == Vc:
                    z, t, e = z_buf, t_buf, e_buf
                else:
                    z, t, e = z_buf[:, : j2 - j], t_buf[:, : j2 - j], e_buf[:, : j2 - j]
                torch.mm(x_blk, w_t, out=z)  # (r, v) logits / softcap
                if t is not z:
                    t.copy_(z)  # tanh of the bf16 values in fp32: torch.tanh(z, out=t) would round in bf16
                t.tanh_()
                torch.mul(t, s, out=e)
                if shift:
                    e.sub_(shift)
                e.exp_()
                S_blk.add_(e.sum(dim=1))
                if keep_grad:
                    # e * (1 - t^2) into E: computed in place in fp32 and then copied to a
                    # bf16 E, which measured 7% faster for the whole forward on this CPU than
                    # one addcmul writing bf16 (which makes an fp32 temporary and casts it anyway)
                    if E.dtype == e.dtype:
                        torch.addcmul(e, e, t.square_(), value=-1.0, out=E_blk[:, j:j2])
                    else:
                        E_blk[:, j:j2].copy_(e.addcmul_(e, t.square_(), value=-1.0))

        _run_row_blocks(row_block, range(0, N, R), dev)
        lse = S.log() + shift
        losses = torch.where(valid, lse - s * t_tgt, 0.0)
        if keep_grad:
            # per-row weights of the two gradient parts; ignored rows weigh nothing
            dense_scale = torch.where(valid, S.reciprocal(), 0.0)  # (N,)
            onehot_scale = torch.where(valid, 1.0 - t_tgt.square(), 0.0)  # (N,)
            ctx.save_for_backward(xc, w, E, dense_scale, onehot_scale, safe_t)
            ctx.meta = (x.dtype, weight.dtype, weight.size(0))
        return losses

    @staticmethod
    def backward(ctx, grad_losses):  # type: ignore[override]
        xc, w, E, dense_scale, onehot_scale, safe_t = ctx.saved_tensors
        x_dtype, w_dtype, v_padded = ctx.meta
        go = grad_losses.float()
        a = (go * dense_scale).to(E.dtype)[:, None]  # (N, 1)
        b = (go * onehot_scale)[:, None]  # (N, 1) fp32
        w_tgt = w[safe_t].float()  # (N, C)
        dx = torch.mm(E, w).float().mul_(a).sub_(b * w_tgt)  # (N, C)
        V, C = w.shape
        # (x a)^T E as a (C, V) product, then one transposing copy into the fp32 gradient: on this
        # CPU (bf16, d4/32k) 25 + 5 ms against 39 + 9 ms for E^T (x a) and a cast.
        dw = torch.empty(v_padded, C, dtype=torch.float32, device=w.device)
        dw[:V].copy_(torch.mm((xc * a).t().contiguous(), E).t())
        dw[V:].zero_()  # padded ids: zero gradient
        dw[:V].index_add_(0, safe_t, xc.float() * b, alpha=-1.0)
        return dx.to(x_dtype), dw.to(w_dtype), None, None, None, None, None, None


# keyed by (pid, workers): a forked child (data workers, test harnesses) must not reuse its parent's
# pool, whose threads did not survive the fork
_ROW_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}


def _single_thread_worker(fn: Callable[[int], None], i: int) -> None:
    torch.set_num_threads(1)  # per OS thread: the caller's intra-op setting is left alone
    # grad mode is per thread and on by default in a fresh one; the blocks are forward-only work
    with torch.no_grad():
        fn(i)


def _run_row_blocks(fn: Callable[[int], None], starts: range, dev: torch.device) -> None:
    """Call fn(i) for every row-block start. On a CPU with several intra-op threads the blocks go
    to that many worker threads, each running single-threaded ops, instead of splitting each small
    tile op across threads: a tile op takes ~0.1-1 ms, and when another process holds a core the
    intra-op barrier stalls on every one. Measured on this 2-core CPU under load (head fwd+bwd, d4
    32k vocab, bf16): 6-10 s with 2 intra-op threads, 1.15 s with 2 block workers, 0.9 s single-threaded."""
    workers = torch.get_num_threads() if dev.type == "cpu" else 1
    if workers <= 1 or len(starts) <= 1:
        for i in starts:
            fn(i)
        return
    key = (os.getpid(), workers)
    pool = _ROW_POOLS.get(key)
    if pool is None:
        pool = _ROW_POOLS[key] = ThreadPoolExecutor(workers, thread_name_prefix="lockstep-head")
    for f in [pool.submit(_single_thread_worker, fn, i) for i in starts]:
        f.result()


def _tile_shape(N: int, V: int, dev: torch.device) -> tuple[int, int]:
    """(rows, vocab columns) per tile of the fused head."""
    if dev.type == "cpu":
        return min(HEAD_TILE_ROWS, N), min(HEAD_TILE_COLS, V)
    return min(N, max(1, _ACCEL_CHUNK_ELEMENTS // V)), V


def head_loss_rows(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    softcap: float,
    vocab_size: int,
    ignore_index: int,
) -> torch.Tensor:
    """fp32 cross-entropy of the soft-capped logits `softcap * tanh(x @ weight[:vocab_size].T /
    softcap)` against targets, `ignore_index` skipped, computed fused and tiled (_HeadLoss): the loss of each
    position (B, T), 0 where the target is ignored. x (B, T, C), targets (B, T); ops.fused_head_loss
    reduces them. Needs 0 < softcap <= SAFE_EXP_CAP."""
    if not 0 < softcap <= SAFE_EXP_CAP:
        raise ValueError(f"the fused head needs 0 < softcap <= {SAFE_EXP_CAP}, got {softcap}; use the plain logits")
    B, T, C = x.shape
    if torch.is_autocast_enabled(x.device.type):
        compute_dtype = torch.get_autocast_dtype(x.device.type)
    else:
        compute_dtype = weight.dtype
    keep_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    losses = _HeadLoss.apply(x.reshape(B * T, C), weight, targets.reshape(B * T), float(softcap), vocab_size,
                             compute_dtype, keep_grad, ignore_index)
    return losses.view(B, T)
