"""The GPT: one config, one module, weights initialised in one place, written in stock PyTorch. It
is not a trainer, a sampler or a checkpoint format; the KV cache it reads from lives in
lockstep.infer.engine, the token embedding kinds it holds one of in lockstep.model.embeddings, and the
primitives it is written in, with the switch to their fast paths (`GPT.use_kernels`:
lockstep.model.kernels' on a CPU, the chunked head loss on CUDA), in lockstep.model.ops."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.core.config import FieldError, build_config, check_range, config_to_dict
from lockstep.model.embeddings import EMBEDDINGS, draw_normal, draw_uniform, keep_top_level_keys
from lockstep.model.ops import REFERENCE_OPS, LossReduction, Ops, capped_logits, fast_ops

# IGNORE_INDEX and cross_entropy are the model's loss convention: its users import them from here too
from lockstep.model.ops import IGNORE_INDEX, cross_entropy  # noqa: F401


# How GPT.init_weights draws the weights that the two recipes draw differently, by `init`. The
# output projections start at zero and the lm_head at N(0, 0.001^2) in both.
INITS: dict[str, str] = {
    "lockstep": "q, k, v and the MLP's input matrix N(0, 1/n_embd), the token tables N(0, 1)",
    "nanochat": "q, k, v Uniform with std n_embd^-0.5, the MLP's input matrix Uniform at 0.4x that std, "
                "the token tables N(0, 0.8^2) (nanochat.gpt.GPT.init_weights)",
}


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
    embedding: str = "flat"  # how ids become vectors: a key of lockstep.model.embeddings.EMBEDDINGS
    init: str = "lockstep"  # how init_weights draws: a key of INITS

    def __post_init__(self) -> None:
        # FieldError names the field; from_dict prefixes `model.`, so a bad meta.json names its key.
        for name in (
            "sequence_len",
            "vocab_size",
            "n_layer",
            "n_head",
            "n_kv_head",
            "n_embd",
            "vocab_multiple",
            "mlp_ratio",
        ):
            value = getattr(self, name)
            if value < 1:
                raise FieldError(name, value, "must be a positive integer")
        if self.n_embd % self.n_head:
            raise FieldError(
                "n_embd", self.n_embd, f"must divide by n_head={self.n_head}; pick a head dim that divides n_embd"
            )
        if self.head_dim % 2:
            raise FieldError("n_head", self.n_head, f"gives the odd head dim n_embd/n_head={self.head_dim}; rotary "
                                                    "embeddings rotate channel pairs, so pick n_head for an even one")
        if self.n_kv_head > self.n_head or self.n_head % self.n_kv_head:
            raise FieldError("n_kv_head", self.n_kv_head,
                             f"must divide n_head={self.n_head} (and be <= it) for grouped-query attention")
        check_range("rope_theta", self.rope_theta, gt=0, why="the rotary base (10000 is usual)")
        check_range("softcap", self.softcap, ge=0, why="0 disables capping")
        if self.embedding not in EMBEDDINGS:
            raise FieldError("embedding", self.embedding, f"must be one of {', '.join(EMBEDDINGS)}")
        if self.init not in INITS:
            raise FieldError("init", self.init, f"must be one of {', '.join(INITS)}")

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
            raise FieldError(
                "head_dim", head_dim, f"must divide the width {width} = {n_embd}; choose a head_dim dividing {n_embd}"
            )
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
    """What attention needs from a KV cache (implemented by lockstep.infer.engine.KVCache and, with
    positions kept on the device, lockstep.infer.decode.StaticKVCache)."""

    def positions(self) -> torch.Tensor | int: ...

    def update(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...

    def advance(self, num_tokens: int) -> None: ...


def rotary_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
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

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCacheLike | None, ops: Ops
    ) -> torch.Tensor:
        B, T, C = x.shape
        D = self.head_dim
        q = self.c_q(x).view(B, T, self.n_head, D).transpose(1, 2)  # (B, H, T, D)
        k = self.c_k(x).view(B, T, self.n_kv_head, D).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.c_v(x).view(B, T, self.n_kv_head, D).transpose(1, 2)  # (B, Hkv, T, D)
        # QK-norm after rotary keeps attention logits bounded whatever the residual scale
        q = ops.norm(apply_rotary(q, cos, sin))
        k = ops.norm(apply_rotary(k, cos, sin))
        if kv_cache is None:
            y = attend(q, k, v, None, is_causal=True)
        else:
            k, v, mask = kv_cache.update(self.layer_idx, k, v)
            # mask None means every row sits at the same position: either a prefill from 0
            # (plain causal, Tk == Tq) or one new token that may see all cached keys.
            y = attend(q, k, v, mask, is_causal=mask is None and T > 1)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=False)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCacheLike | None, ops: Ops
    ) -> torch.Tensor:
        x = x + self.attn(ops.norm(x), cos, sin, kv_cache, ops)
        return x + self.mlp(ops.norm(x))


class GPT(nn.Module):
    """Token embedding -> n_layer pre-norm blocks -> norm -> untied lm_head -> soft-capped logits.

    Build with `GPT.build(config, device)`: parameters are created on the meta device (no
    memory, no init work), moved with `to_empty`, then `init_weights` fills every parameter and
    the rotary tables exactly once. It runs on REFERENCE_OPS until `use_kernels(True)`."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # token vectors (B, T, C) of ids (B, T): the config's kind of lockstep.model.embeddings.TokenEmbedding
        self.embed = EMBEDDINGS[config.embedding](config.n_embd, config.vocab_size, config.padded_vocab_size)
        keep_top_level_keys(self, "embed")  # its weights save as `wte.weight`, not `embed.wte.weight`
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        # Rotary tables are derived data, not weights: kept out of the state dict.
        self.register_buffer("rotary_cos", torch.empty(config.sequence_len, config.head_dim // 2), persistent=False)
        self.register_buffer("rotary_sin", torch.empty(config.sequence_len, config.head_dim // 2), persistent=False)
        self.ops = REFERENCE_OPS

    def use_kernels(self, on: bool = True, *, ops: Ops | None = None) -> GPT:
        """Run on fast paths (on) or on stock PyTorch, REFERENCE_OPS (off, the default): the same
        function to rounding, with the same parameters and state dict. Which fast paths follows
        the weights' device now (call it again after moving the model): on CUDA, CUDA_OPS, whose
        chunked head loss never holds the batch's (B*T, V) fp32 logits; elsewhere KERNEL_OPS,
        lockstep.model.kernels' CPU fast paths. `ops` picks a set outright instead (CUDA_OPS on a CPU,
        for its tests). Returns the model."""
        if ops is not None and not on:
            raise ValueError("use_kernels(False) runs REFERENCE_OPS; pass `ops` only with on=True")
        if not on:
            self.ops = REFERENCE_OPS
        elif ops is not None:
            self.ops = ops
        else:
            self.ops = fast_ops(self.lm_head.weight.device)
        return self

    @classmethod
    def build(
        cls, config: GPTConfig, device: torch.device | str, dtype: torch.dtype | None = None, *, seed: int = 0,
        token_structure: tuple[Any, Any] | None = None,
    ) -> GPT:
        """A ready model on `device`: weights drawn from `torch.Generator().manual_seed(seed)`,
        then cast to `dtype` if given (rotary tables stay fp32). An embedding with a token
        structure takes `token_structure`, (parents, last_bytes) as its set_token_structure reads
        them; without it each id reads its own code row and no byte (for a model about to load a
        checkpoint)."""
        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device=device)
        model.init_weights(torch.Generator().manual_seed(seed))
        if token_structure is not None:
            model.embed.set_token_structure(*token_structure)
        if dtype is not None:
            for p in model.parameters():
                p.data = p.data.to(dtype)
        return model

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Fill every parameter from `generator` (a CPU generator), in a fixed order, drawing on
        the CPU and copying to the parameter's device: the weights are a pure function of the
        generator state whatever the device. Output projections start at zero so every block
        begins as the identity on the residual stream. `config.init` picks the distributions of
        the rest (INITS)."""
        C = self.config.n_embd
        nanochat = self.config.init == "nanochat"
        self.embed.init_weights(generator, table_std=0.8 if nanochat else 1.0)
        for block in self.blocks:
            attn, mlp = block.attn, block.mlp
            for lin in (attn.c_q, attn.c_k, attn.c_v, mlp.c_fc):
                if nanochat:
                    draw_uniform(lin.weight, C**-0.5 * (0.4 if lin is mlp.c_fc else 1.0), generator)
                else:
                    draw_normal(lin.weight, C**-0.5, generator)
            attn.c_proj.weight.zero_()
            mlp.c_proj.weight.zero_()
        # A small lm_head makes the initial distribution near uniform (loss ~ ln V).
        draw_normal(self.lm_head.weight, 1e-3, generator)
        self.init_rotary()

    @torch.no_grad()
    def init_rotary(self) -> None:
        """(Re)compute the rotary tables on the model's device (they are not in the state dict)."""
        cos, sin = rotary_tables(self.config.sequence_len, self.config.head_dim, self.config.rope_theta)
        self.rotary_cos = cos.to(self.rotary_cos.device)
        self.rotary_sin = sin.to(self.rotary_sin.device)

    def embedding_weights(self) -> list[nn.Parameter]:
        """The embedding's lookup tables (no FLOPs)."""
        return self.embed.tables()

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by role for the optimizers: `matrix` holds the 2-D weights inside blocks
        and the embedding's matmul weights (for Muon), `embedding` its lookup tables and
        `lm_head` the output head (for AdamW). Every parameter appears in exactly one group."""
        matrix = [*self.blocks.parameters(), *self.embed.matrices()]
        groups = {"matrix": matrix, "embedding": self.embedding_weights(), "lm_head": [self.lm_head.weight]}
        assert sum(len(g) for g in groups.values()) == len(list(self.parameters()))
        assert all(p.ndim == 2 for p in matrix)
        return groups

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameter count (padded vocab rows included). With `exclude_embedding`, the lookup
        tables are left out: a lookup is not a matmul, so they add no FLOPs (a tuple
        embedding's projection is a matmul and stays in)."""
        n = sum(p.numel() for p in self.parameters())
        return n - sum(p.numel() for p in self.embedding_weights()) if exclude_embedding else n

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
        `cross_entropy` of those logits under `loss_reduction`. With a kv_cache, positions
        continue from the cache's."""
        x = self.final_hidden(idx, kv_cache)
        if targets is None:
            return self.head_logits(x)
        if targets.shape != idx.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
        return self.head_loss(x, targets, loss_reduction)

    def final_hidden(self, idx: torch.Tensor, kv_cache: KVCacheLike | None = None) -> torch.Tensor:
        """The final normed hidden states (B, T, C) of ids (B, T): what the head reads. Training
        objectives that need more than the cross-entropy (lockstep.train.objectives) start here."""
        B, T = idx.shape
        c, ops = self.config, self.ops
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
        x = ops.norm(self.embed(idx))  # (B, T, C)
        for block in self.blocks:
            x = block(x, cos, sin, kv_cache, ops)
        if kv_cache is not None:
            kv_cache.advance(T)
        return ops.norm(x)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor, loss_reduction: LossReduction = "mean") -> torch.Tensor:
        """`cross_entropy` of the logits of final hidden states x (B, T, C) against targets (B, T)."""
        c = self.config
        return self.ops.head_loss(x, self.lm_head.weight, targets, c.softcap, c.vocab_size, loss_reduction)

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Soft-capped fp32 logits (B, T, vocab_size) of the final normed x (B, T, C): the head
        alone, for callers that read only some positions of final_hidden."""
        return capped_logits(self.ops.head, x, self.lm_head.weight, self.config.softcap, self.config.vocab_size)

    def _rotary_at(self, pos: torch.Tensor | int, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary angles for tokens at positions pos..pos+T-1 (pos an int shared by all rows, or
        a (B,) tensor per row)."""
        limit = self.config.sequence_len
        if isinstance(pos, int):
            if pos + T > limit:
                raise ValueError(f"position {pos + T} exceeds the model's context sequence_len={limit}")
            return self.rotary_cos[None, None, pos : pos + T], self.rotary_sin[None, None, pos : pos + T]
        # Positions on an accelerator are the static cache's (lockstep.infer.decode), which keeps them
        # inside its buffer: reading them back here would cost a host sync per token, and cannot
        # happen at all inside a CUDA graph capture; nor is it traced into a compiled step
        # (lockstep.infer.decode.compile_step), whose cache clamps its positions itself.
        if pos.device.type == "cpu" and not torch.compiler.is_compiling() and int(pos.max()) + T > limit:
            raise ValueError(f"position {int(pos.max()) + T} exceeds the model's context sequence_len={limit}")
        at = pos.to(self.rotary_cos.device)[:, None] + torch.arange(T, device=self.rotary_cos.device)  # (B, T)
        return self.rotary_cos[at][:, None], self.rotary_sin[at][:, None]  # (B, 1, T, D/2)
