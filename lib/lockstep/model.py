"""The GPT: one config, one module, weights initialised in one place. It is not a trainer, a
sampler or a checkpoint format; the KV cache it reads from lives in lockstep.engine."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.config import FieldError, build_config, check_range, config_to_dict

IGNORE_INDEX = -100
LossReduction = Literal["mean", "sum", "none"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the network. `vocab_size` is the tokenizer's; the embedding and lm_head are padded
    up to `padded_vocab_size` (a multiple of `vocab_multiple`) because matmuls with a round inner
    size run faster; padded ids are never returned as logits."""

    sequence_len: int  # context length in tokens; rotary tables and the engine stop here
    vocab_size: int  # real vocabulary size in ids, special tokens included
    n_layer: int
    n_head: int  # query heads
    n_kv_head: int  # key/value heads (grouped-query attention); divides n_head
    n_embd: int  # residual width in channels; n_embd / n_head is the head dim
    rope_theta: float = 10000.0  # rotary base
    softcap: float = 15.0  # logits become softcap * tanh(logits / softcap); 0 disables
    vocab_multiple: int = 64  # pad the vocab to a multiple of this many ids
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * n_embd

    def __post_init__(self) -> None:
        # FieldError names the field; from_dict prefixes `model.`, so a bad meta.json names its key.
        for name in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "vocab_multiple", "mlp_ratio"):
            value = getattr(self, name)
            if value < 1:
                raise FieldError(name, value, "must be a positive integer")
        if self.n_embd % self.n_head:
            raise FieldError("n_embd", self.n_embd, f"must divide by n_head={self.n_head}; pick a head dim that divides n_embd")
        if self.head_dim % 2:
            raise FieldError("n_head", self.n_head, f"gives the odd head dim n_embd/n_head={self.head_dim}; rotary "
                                                    "embeddings rotate channel pairs, so pick n_head for an even one")
        if self.n_kv_head > self.n_head or self.n_head % self.n_kv_head:
            raise FieldError("n_kv_head", self.n_kv_head,
                             f"must divide n_head={self.n_head} (and be <= it) for grouped-query attention")
        check_range("rope_theta", self.rope_theta, gt=0, why="the rotary base (10000 is usual)")
        check_range("softcap", self.softcap, ge=0, why="0 disables capping")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @classmethod
    def from_depth(
        cls,
        depth: int,
        vocab_size: int,
        sequence_len: int,
        head_dim: int = 64,
        *,
        n_kv_head: int | None = None,
        **overrides: Any,
    ) -> GPTConfig:
        """One dial: `n_layer = depth`, `n_embd = depth * 64`, `n_head = n_embd / head_dim`,
        `n_kv_head = n_head` unless given. Any field can be overridden by keyword."""
        if depth < 1:
            raise FieldError("depth", depth, "must be a positive integer (layers; the width is 64 * depth)")
        if head_dim < 1 or head_dim % 2:
            raise FieldError("head_dim", head_dim, "must be a positive even integer (channels per attention head; "
                                                   "rotary embeddings rotate channel pairs), e.g. 64")
        width = "n_embd" if "n_embd" in overrides else "64 * depth"
        n_embd = overrides.pop("n_embd", depth * 64)
        if n_embd % head_dim:
            raise FieldError("head_dim", head_dim, f"must divide the width {width} = {n_embd}; choose a head_dim dividing {n_embd}")
        n_head = overrides.pop("n_head", n_embd // head_dim)
        fields = dict(
            sequence_len=sequence_len,
            vocab_size=vocab_size,
            n_layer=overrides.pop("n_layer", depth),
            n_head=n_head,
            n_kv_head=n_head if n_kv_head is None else n_kv_head,
            n_embd=n_embd,
        )
        return cls(**fields, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return config_to_dict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GPTConfig:
        """Inverse of `to_dict`; unknown keys raise ConfigError (e.g. a checkpoint from a newer
        model version)."""
        return build_config(cls, d, where="model")


class KVCacheLike(Protocol):
    """What attention needs from a KV cache (implemented by lockstep.engine.KVCache)."""

    def positions(self) -> torch.Tensor | int: ...

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...

    def advance(self, num_tokens: int) -> None: ...


RMS_EPS = 1e-6  # added to the mean square; fixed rather than finfo(dtype).eps so bf16 and fp32 agree


def _rms_scale(x: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, in fp32 (fp64 for fp64 x), shape (..., 1);
    the norm is accumulated in fp32 without materialising an fp32 copy of x."""
    acc = torch.promote_types(x.dtype, torch.float32)
    ss = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=acc)  # (..., 1)
    return torch.rsqrt(ss.square_().div_(x.size(-1)).add_(RMS_EPS))


class _RMSNorm(torch.autograd.Function):
    """Parameter-free RMSNorm with a hand-written backward, dx = r * (g - y * mean(g * y)):
    on CPU, fwd+bwd measured 2.5-3.5x faster than F.rms_norm's decomposed autograd for the
    (8, 256, 256) fp32 and (8, 4, 256, 64) bf16 activations of the d4 benchmark."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        r = _rms_scale(x)
        y = x * r.to(x.dtype)
        ctx.save_for_backward(y, r)
        return y

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        y, r = ctx.saved_tensors
        m = torch.linalg.vecdot(g, y, dim=-1).unsqueeze(-1).to(r.dtype).div_(y.size(-1))  # (..., 1)
        return torch.addcmul(g, y, m.to(g.dtype), value=-1.0).mul_(r.to(g.dtype))


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dim: x / sqrt(mean(x^2) + 1e-6), in x's dtype."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _RMSNorm.apply(x)
    return x * _rms_scale(x).to(x.dtype)


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables, each (seq_len, head_dim // 2) fp32, for the half-split rotary layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    t = torch.arange(seq_len, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv_freq)  # (T, D/2)
    return freqs.cos().float(), freqs.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + D/2) of x (B, H, T, D) by the angles in cos/sin, which
    broadcast as (1 or B, 1, T, D/2)."""
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, *, is_causal: bool
) -> torch.Tensor:
    """Scaled dot-product attention, q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D) with Hkv dividing Hq:
    query head h reads kv head h // (Hq / Hkv). Returns (B, Hq, Tq, D)."""
    n_rep = q.size(1) // k.size(1)
    if n_rep > 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)


def _fp32_weight(w: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of bf16 weight w, kept on the tensor itself and remade when its storage or
    version counter changes, so an optimizer step or a state-dict load refreshes it."""
    key = (w.data_ptr(), w._version)
    hit = getattr(w, "_lockstep_fp32", None)
    if hit is None or hit[:2] != key:
        hit = (*key, w.detach().float())
        w._lockstep_fp32 = hit
    return hit[2]


# Up to this many multiply-adds (rows x weight elements), a bf16 linear on CPU outside autograd
# runs in fp32 instead: one-thread timings on this CPU, bf16 vs fp32 including the casts, were
# 47 vs 15 us (1 row, 256x256), 80 vs 40 (1 row, 256x1024), 47 vs 30 (8 rows, 256x256), 79 vs 73
# (4 rows, 256x1024) and 76 vs 98 (8 rows, 256x1024): bf16 small matmuls have a ~40 us floor.
_FP32_LINEAR_MACS = 1 << 20


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T in x's dtype. For a small bf16 product on CPU (decoding: no grad, no autocast) the
    product runs in fp32 on a cached fp32 copy of w and is rounded back to bf16; bf16 products are
    exact in fp32, so only the summation order differs."""
    if (w.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
            and (x.numel() // x.size(-1)) * w.numel() <= _FP32_LINEAR_MACS):
        return F.linear(x.float(), _fp32_weight(w)).to(torch.bfloat16)
    return F.linear(x, w)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        C, D = config.n_embd, config.head_dim
        self.c_q = nn.Linear(C, config.n_head * D, bias=False)
        self.c_k = nn.Linear(C, config.n_kv_head * D, bias=False)
        self.c_v = nn.Linear(C, config.n_kv_head * D, bias=False)
        self.c_proj = nn.Linear(config.n_head * D, C, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCacheLike | None) -> torch.Tensor:
        B, T, C = x.shape
        D = self.head_dim
        q = _linear(x, self.c_q.weight).view(B, T, self.n_head, D).transpose(1, 2)  # (B, H, T, D)
        k = _linear(x, self.c_k.weight).view(B, T, self.n_kv_head, D).transpose(1, 2)  # (B, Hkv, T, D)
        v = _linear(x, self.c_v.weight).view(B, T, self.n_kv_head, D).transpose(1, 2)  # (B, Hkv, T, D)
        # QK-norm after rotary keeps attention logits bounded whatever the residual scale
        q = rms_norm(apply_rotary(q, cos, sin))
        k = rms_norm(apply_rotary(k, cos, sin))
        if kv_cache is None:
            y = attend(q, k, v, None, is_causal=True)
        else:
            k, v, mask = kv_cache.update(self.layer_idx, k, v)
            # mask None means every row sits at the same position: either a prefill from 0
            # (plain causal, Tk == Tq) or one new token that may see all cached keys.
            y = attend(q, k, v, mask, is_causal=mask is None and T > 1)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return _linear(y, self.c_proj.weight)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=False)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(F.relu(_linear(x, self.c_fc.weight)).square(), self.c_proj.weight)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCacheLike | None) -> torch.Tensor:
        x = x + self.attn(rms_norm(x), cos, sin, kv_cache)
        return x + self.mlp(rms_norm(x))


class GPT(nn.Module):
    """Token embedding -> n_layer pre-norm blocks -> norm -> untied lm_head -> soft-capped logits.

    Build with `GPT.build(config, device)`: parameters are created on the meta device (no
    memory, no init work), moved with `to_empty`, then `init_weights` fills every parameter and
    the rotary tables exactly once."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        V = config.padded_vocab_size
        self.wte = nn.Embedding(V, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.lm_head = nn.Linear(config.n_embd, V, bias=False)
        # Rotary tables are derived data, not weights: kept out of the state dict.
        self.register_buffer("rotary_cos", torch.empty(config.sequence_len, config.head_dim // 2), persistent=False)
        self.register_buffer("rotary_sin", torch.empty(config.sequence_len, config.head_dim // 2), persistent=False)

    @classmethod
    def build(
        cls, config: GPTConfig, device: torch.device | str, dtype: torch.dtype | None = None, *, seed: int = 0
    ) -> GPT:
        """A ready model on `device`: weights drawn from `torch.Generator().manual_seed(seed)`,
        then cast to `dtype` if given (rotary tables stay fp32)."""
        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device=device)
        model.init_weights(torch.Generator().manual_seed(seed))
        if dtype is not None:
            for p in model.parameters():
                p.data = p.data.to(dtype)
        return model

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Fill every parameter from `generator` (a CPU generator), in a fixed order, drawing on
        the CPU and copying to the parameter's device: the weights are a pure function of the
        generator state whatever the device. Output projections start at zero so every block
        begins as the identity on the residual stream."""
        C = self.config.n_embd

        def draw(p: torch.Tensor, std: float) -> None:
            w = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
            p.copy_(w)

        draw(self.wte.weight, 1.0)
        for block in self.blocks:
            attn, mlp = block.attn, block.mlp
            for lin in (attn.c_q, attn.c_k, attn.c_v, mlp.c_fc):
                draw(lin.weight, C**-0.5)
            attn.c_proj.weight.zero_()
            mlp.c_proj.weight.zero_()
        # A small lm_head makes the initial distribution near uniform (loss ~ ln V).
        draw(self.lm_head.weight, 1e-3)
        self.init_rotary()

    @torch.no_grad()
    def init_rotary(self) -> None:
        """(Re)compute the rotary tables on the model's device (they are not in the state dict)."""
        cos, sin = rotary_tables(self.config.sequence_len, self.config.head_dim, self.config.rope_theta)
        self.rotary_cos = cos.to(self.rotary_cos.device)
        self.rotary_sin = sin.to(self.rotary_sin.device)

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by role for the optimizers: `matrix` holds the 2-D weights inside blocks
        (for Muon), `embedding` the token embedding and `lm_head` the output head (for AdamW).
        Every parameter appears in exactly one group."""
        matrix = [p for p in self.blocks.parameters()]
        groups = {"matrix": matrix, "embedding": [self.wte.weight], "lm_head": [self.lm_head.weight]}
        assert sum(len(g) for g in groups.values()) == len(list(self.parameters()))
        assert all(p.ndim == 2 for p in matrix)
        return groups

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameter count (padded vocab rows included). With `exclude_embedding`, the token
        embedding is left out: a lookup, not a matmul, so it adds no FLOPs."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() if exclude_embedding else n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward): `6 * N` over the matmul parameters
        (all but the embedding, lm_head included) plus attention scores and mixing,
        `12 * n_layer * n_head * head_dim * T` (2 matmuls of 2*D*T FLOPs per query, x3 for the
        backward). T defaults to sequence_len; the causal mask's savings are not subtracted, by
        the usual convention (Kaplan et al. 2020; PaLM appendix B), so MFU is comparable."""
        c = self.config
        T = c.sequence_len if seq_len is None else seq_len
        return 6 * self.num_params(exclude_embedding=True) + 12 * c.n_layer * c.n_head * c.head_dim * T

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        kv_cache: KVCacheLike | None = None,
        loss_reduction: LossReduction = "mean",
    ) -> torch.Tensor:
        """idx (B, T) int64. Without targets: logits (B, T, vocab_size), soft-capped, padded ids
        sliced off. With targets (B, T) (IGNORE_INDEX = -100 marks positions without a loss):
        the fp32 cross-entropy, `mean` over non-ignored targets, `sum`, or `none` (B, T) with 0
        at ignored positions; a batch whose every target is ignored gives 0 under `mean`, not NaN
        (see head_loss). With a kv_cache, positions continue from the cache's."""
        B, T = idx.shape
        c = self.config
        if kv_cache is None:
            if T > c.sequence_len:
                raise ValueError(f"sequence of {T} tokens exceeds the model's context sequence_len={c.sequence_len}")
            cos = self.rotary_cos[None, None, :T]  # (1, 1, T, D/2)
            sin = self.rotary_sin[None, None, :T]
        else:
            cos, sin = self._rotary_at(kv_cache.positions(), B, T)
        # rotary in the dtype the projections produce, cast once here rather than in every layer
        if torch.is_autocast_enabled(idx.device.type):
            act_dtype = torch.get_autocast_dtype(idx.device.type)
        else:
            act_dtype = self.lm_head.weight.dtype
        cos, sin = cos.to(act_dtype), sin.to(act_dtype)
        x = rms_norm(self.wte(idx))  # (B, T, C)
        for block in self.blocks:
            x = block(x, cos, sin, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(T)
        x = rms_norm(x)
        if targets is not None:
            if targets.shape != idx.shape:
                raise ValueError(f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
            return head_loss(x, self.lm_head.weight, targets, softcap=c.softcap, vocab_size=c.vocab_size, reduction=loss_reduction)
        if B * T <= _SMALL_BATCH_ROWS:
            # decode: weight-on-the-left matmul, (V, C) @ (C, B*T)
            logits = torch.mm(self.lm_head.weight, x.reshape(B * T, -1).t()).t().view(B, T, -1)  # (B, T, V_padded)
        else:
            logits = self.lm_head(x)  # (B, T, V_padded)
        if c.padded_vocab_size != c.vocab_size:
            logits = logits[..., : c.vocab_size]
        logits = logits.float()
        if c.softcap:
            logits = c.softcap * torch.tanh(logits / c.softcap)
        return logits

    def _rotary_at(self, pos: torch.Tensor | int, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary angles for tokens at positions pos..pos+T-1 (pos an int shared by all rows, or
        a (B,) tensor per row)."""
        limit = self.config.sequence_len
        if isinstance(pos, int):
            if pos + T > limit:
                raise ValueError(f"position {pos + T} exceeds the model's context sequence_len={limit}")
            return self.rotary_cos[None, None, pos : pos + T], self.rotary_sin[None, None, pos : pos + T]
        if int(pos.max()) + T > limit:
            raise ValueError(f"position {int(pos.max()) + T} exceeds the model's context sequence_len={limit}")
        at = pos.to(self.rotary_cos.device)[:, None] + torch.arange(T, device=self.rotary_cos.device)  # (B, T)
        return self.rotary_cos[at][:, None], self.rotary_sin[at][:, None]  # (B, 1, T, D/2)


# Up to this many rows (decoding), logits are computed as W @ x.T rather than F.linear's x @ W.T:
# with a bf16 32k-vocab head, whole-engine decode on this CPU measured 13% (batch 1) and 20%
# (batch 8) faster, same process, interleaved runs; fp32 was within noise.
_SMALL_BATCH_ROWS = 16
# Fused-head tile: 128 rows x 1024 vocab columns is 128K elements, ~1.3 MB over its three
# buffers, so the elementwise passes over a tile run from cache. Measured on the d4/32768 head
# (fwd+bwd of 2048 rows, bf16 autocast, one thread, CPU time): 675 ms at 128x1024, 724 ms at
# 128x2048, 863 ms at 32x8192, 784 ms with whole-vocab chunks of 128 rows.
HEAD_TILE_ROWS = 128
HEAD_TILE_COLS = 1024
_ACCEL_CHUNK_ELEMENTS = 1 << 25  # 128 MB per fp32 tile buffer on a GPU: whole vocab rows
# exp(softcap * tanh(.)) stays finite in fp32 up to ~88, so below this cap the softmax needs no
# max-subtraction pass and the fused head applies.
_SAFE_EXP_CAP = 80.0


class _HeadLoss(torch.autograd.Function):
    """Per-row cross-entropy of the soft-capped logits l = s * tanh(x @ W[:V].T / s), computed in
    tiles of rows x vocab columns small enough to stay in cache, without ever holding the fp32
    logits of the batch. Only the gradient's dense part is kept, in the matmul dtype.

    With e = exp(l), S = sum(e) per row and t = tanh(z/s), the row loss is log S - l_target and
    its gradient with respect to z is (e / S - onehot) * (1 - t^2). Both parts separate: the dense
    E = e * (1 - t^2) needs nothing beyond its own tile (so a row's tiles need not meet: no
    online softmax, no recompute), the row scale 1/S is applied in the backward, and the one-hot
    part is one dot product per row (x . W[target]), also used for l_target. Requires
    0 < softcap <= 80 so that exp(l) cannot overflow without a max shift."""

    @staticmethod
    def forward(ctx, x, weight, targets, softcap, vocab_size, compute_dtype, keep_grad):  # type: ignore[override]
        N, C = x.shape
        dev = x.device
        s = float(softcap)
        xc = x.to(compute_dtype)  # (N, C)
        w = weight[:vocab_size].to(compute_dtype)  # (V, C)
        w_in = w / s  # fold 1/softcap into the weights: a (V, C) pass, not N*V
        valid = targets != IGNORE_INDEX  # (N,)
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
            t_buf = z_buf if compute_dtype == torch.float32 else torch.empty(i2 - i, Vc, dtype=torch.float32, device=dev)
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
        return dx.to(x_dtype), dw.to(w_dtype), None, None, None, None, None


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


def head_loss(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    softcap: float,
    vocab_size: int,
    reduction: LossReduction,
) -> torch.Tensor:
    """fp32 cross-entropy of the soft-capped logits `x @ weight[:vocab_size].T` against targets,
    IGNORE_INDEX skipped. x (B, T, C), targets (B, T). Equal (to rounding) to `cross_entropy` on
    the logits `forward` returns; with 0 < softcap <= 80 it runs fused and tiled (_HeadLoss),
    otherwise through those plain logits.

    `mean` divides the summed loss by max(1, number of counted targets) instead of F.cross_entropy's
    mean, which is 0/0 = NaN when every target is ignored (a fully masked SFT batch): such a batch
    gives loss 0 with all-zero, finite gradients."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"loss_reduction={reduction!r} must be 'mean', 'sum' or 'none'")
    B, T, C = x.shape
    if torch.is_autocast_enabled(x.device.type):
        compute_dtype = torch.get_autocast_dtype(x.device.type)
    else:
        compute_dtype = weight.dtype
    keep_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if not 0 < softcap <= _SAFE_EXP_CAP:
        logits = F.linear(x, weight[:vocab_size]).float()  # (B, T, V)
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        return cross_entropy(logits, targets, reduction)
    losses = _HeadLoss.apply(x.reshape(B * T, C), weight, targets.reshape(B * T), float(softcap), vocab_size, compute_dtype, keep_grad)
    if reduction == "none":
        return losses.view(B, T)
    total = losses.sum()
    if reduction == "sum":
        return total
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: LossReduction) -> torch.Tensor:
    """Reference fp32 cross-entropy of logits (B, T, V) against targets (B, T), IGNORE_INDEX
    skipped, with the same reductions and all-ignored behaviour as `head_loss`. For callers that
    already hold logits (evaluation) and for tests."""
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
