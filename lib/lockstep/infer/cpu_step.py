"""The reference engine's decode forward on the CPU in fewer, cheaper ops (`Engine(cpu_step=True)`):
one token per row through a lockstep GPT and the growing KVCache, the same function as
`model(ids, kv_cache=cache)[:, -1]` to rounding. What it changes, each measured on a 2-core CPU
at d4 (bench/bench_decode.py --nanochat):

- the query, key and value projections are one matmul, their rotary and QK norm one call each;
- matrices are multiplied in fp32 from fp32 copies, also for a bf16 model or under bf16 autocast
  (the copies hold the bf16-rounded weights, inputs are rounded to bf16 first and outputs back to
  it, so only the accumulation order differs from the bf16 product): at these sizes a bf16
  product's fixed cost in oneDNN was 40-70 us against 11-35 us for fp32;
- the head reads its weight prepacked once for the CPU's GEMM (`packed_head`): about half the
  time of F.linear, where this torch build has the ops.

The copies are rebuilt when a parameter changes (its storage or version counter moved: an
optimiser step, a load_state_dict, an assignment to `.data`; not a module replaced by another), so
a model being trained, as in RL, decodes with its latest weights; they cost the model's block and
head memory again in fp32."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lockstep.model.gpt import GPT, apply_rotary, attend
from lockstep.model.ops import rms_norm


@dataclass
class _Layer:
    qkv: torch.Tensor  # (Hq*D + 2*Hkv*D, C) fp32: c_q, c_k, c_v stacked
    proj: torch.Tensor  # (C, Hq*D) fp32
    fc: torch.Tensor  # (hidden, C) fp32
    fc_proj: torch.Tensor  # (C, hidden) fp32


def packed_head(weight: torch.Tensor, compute: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """x (N, C) -> x @ weight.T through the weight prepacked for the CPU's GEMM, in `compute`:
    oneDNN's blocked layout (fp32 or bf16, any N), and in fp32 also MKL's packed sgemm for N = 1
    (MKL packs for one row count and multiplies any other through the plain weight). None where
    this torch build lacks the ops (no oneDNN, no bf16 support) or packing fails. At d4's 32768 x
    256 head, 2 threads: fp32 1.6 ms at 1 row (F.linear 2.9), 4.0 ms at 8 (9.9); bf16 2.1 ms at 1
    and 2.3 at 8 (F.linear 4.2, 4.1)."""
    w = weight.detach().to(compute).contiguous()
    try:
        if compute == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return None
        if compute not in (torch.float32, torch.bfloat16):
            return None
        blocked = torch.ops.mkldnn._reorder_linear_weight(w)
        one_row = torch.ops.mkl._mkl_reorder_linear_weight(w, 1) if compute == torch.float32 else None
    except (AttributeError, RuntimeError, NotImplementedError):
        return None

    def head(x: torch.Tensor) -> torch.Tensor:
        if one_row is not None and x.size(0) == 1:
            return torch.ops.mkl._mkl_linear(x, one_row, w, None, 1)
        return torch.ops.mkldnn._linear_pointwise(x, blocked, None, "none", [], "")

    return head


class CpuStep:
    """`step(ids, cache)`: the soft-capped fp32 logits (B, V) of one new token per row, ids (B, 1),
    read at the cache's positions, whose keys and values it stores; the cache then advances by one.
    Computes in the model's dtype, or in the autocast dtype when CPU autocast is on (the engine's
    `dtype`, or a caller's autocast block); the cache keeps the dtype its prefill gave it. A step
    that raises has advanced nothing, so the model's forward can answer the same step instead."""

    def __init__(self, model: GPT):
        if not isinstance(model, GPT):
            raise TypeError(f"CpuStep runs a lockstep GPT, not {type(model).__name__}")
        self.model = model
        self._params = list(model.parameters())  # walked once: model.parameters() costs ~0.5 ms a step
        self._key: tuple | None = None
        self._layers: list[_Layer] = []
        self._head: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
        self.compute = torch.float32

    def _compute_dtype(self) -> torch.dtype:
        if torch.is_autocast_enabled("cpu"):
            return torch.get_autocast_dtype("cpu")
        return self.model.lm_head.weight.dtype

    def refresh(self) -> None:
        """Rebuild the fp32 copies and the packed head when a parameter or the compute dtype
        changed since the last step."""
        compute = self._compute_dtype()
        key = (compute, *((p.data_ptr(), p._version) for p in self._params))
        if key == self._key:
            return

        def copy(*weights: torch.Tensor) -> torch.Tensor:  # bf16-rounded where the model computes in bf16
            return torch.cat([w.detach().to(compute) for w in weights]).float().contiguous()

        with torch.inference_mode():
            self._layers = [_Layer(qkv=copy(b.attn.c_q.weight, b.attn.c_k.weight, b.attn.c_v.weight),
                                   proj=copy(b.attn.c_proj.weight), fc=copy(b.mlp.c_fc.weight),
                                   fc_proj=copy(b.mlp.c_proj.weight))
                            for b in self.model.blocks]
            head = packed_head(self.model.lm_head.weight, compute)
            if head is None:
                w = self.model.lm_head.weight.detach().to(compute)
                head = lambda x: F.linear(x, w)  # noqa: E731
            self._head = head
        self.compute = compute
        self._key = key

    def _mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x (N, in) @ w.T in fp32, x rounded to the compute dtype first and the product after."""
        return F.linear(x.to(self.compute).float(), w).to(self.compute)

    def __call__(self, ids: torch.Tensor, cache) -> torch.Tensor:
        self.refresh()
        model = self.model
        cos, sin = model._rotary_at(cache.positions(), ids.size(0), 1)  # (1 or B, 1, 1, D/2)
        cos, sin = cos.to(self.compute), sin.to(self.compute)
        x = rms_norm(model.embed(ids)[:, 0])  # (B, C), under the caller's autocast as in the model
        with torch.autocast("cpu", enabled=False):  # the products below choose their own precision
            return self._blocks_and_head(x, cos, sin, cache)

    def _blocks_and_head(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        c = self.model.config
        B = x.size(0)
        Hq, Hkv, D = c.n_head, c.n_kv_head, c.head_dim
        for i, layer in enumerate(self._layers):
            qkv = self._mm(rms_norm(x), layer.qkv)  # (B, (Hq + 2 Hkv) D)
            qk = rms_norm(apply_rotary(qkv[:, : (Hq + Hkv) * D].view(B, Hq + Hkv, 1, D), cos, sin))
            q, k = qk[:, :Hq], qk[:, Hq:]  # (B, Hq, 1, D), (B, Hkv, 1, D)
            v = qkv[:, (Hq + Hkv) * D :].view(B, Hkv, 1, D)
            if cache.kv is not None and cache.kv.dtype != k.dtype:
                k, v = k.to(cache.kv.dtype), v.to(cache.kv.dtype)
            keys, values, mask = cache.update(i, k, v)
            y = attend(q.to(keys.dtype), keys, values, mask, is_causal=False)  # (B, Hq, 1, D)
            x = x + self._mm(y.reshape(B, Hq * D), layer.proj)
            h = F.relu(self._mm(rms_norm(x), layer.fc))
            x = x + self._mm(h * h, layer.fc_proj)
        cache.advance(1)
        logits = self._head(rms_norm(x).to(self.compute))[:, : c.vocab_size].float()  # (B, V), this step's own
        if c.softcap:  # ops.softcap's arithmetic, in place: no second (B, V) buffer
            logits.div_(c.softcap).tanh_().mul_(c.softcap)
        return logits
