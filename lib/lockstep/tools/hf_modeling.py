"""A lockstep GPT for Hugging Face `transformers`: the config and causal-LM classes that
`lockstep export --to hf` ships as `modeling_lockstep.py` in the folder it writes, for
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`. It imports torch and
transformers only, never lockstep, so that the folder loads where lockstep is not installed; it is
not lockstep's own model (lockstep.model.gpt), whose forward it reproduces: the same logits in fp32.

The network: token embedding (one of lockstep's kinds: `flat`, or `structured`, `hierarchical`
and `tuple`, which read a parent code's row and the last byte's row through two index buffers
saved with the weights), a parameter-free RMSNorm, pre-norm blocks of grouped-query attention
with rotary positions (half-split layout) and QK-norm after the rotation, and a ReLU^2 MLP, a
final norm, an untied head over the padded vocabulary, and logits soft-capped as
`cap * tanh(z / cap)` in fp32, the padded ids sliced off. Nothing in it has a bias or a norm
weight. Written against transformers 5.24 (its `cache` argument and DynamicCache)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

EMBEDDINGS = ("flat", "structured", "hierarchical", "tuple")
NO_BYTE_ROW = 256  # the byte-table row of ids that end in no byte (lockstep.model.embeddings)


class LockstepConfig(PreTrainedConfig):
    """The shape of a lockstep GPT under the names transformers' tools read. `vocab_size` is the
    tokenizer's (the logits' last dim); the embedding and head hold `padded_vocab_size` rows."""

    model_type = "lockstep"

    vocab_size: int = 265
    padded_vocab_size: int = 320
    hidden_size: int = 32  # lockstep's n_embd
    num_hidden_layers: int = 1  # n_layer
    num_attention_heads: int = 2  # n_head
    num_key_value_heads: int = 2  # n_kv_head
    intermediate_size: int = 128  # mlp_ratio * n_embd
    max_position_embeddings: int = 64  # sequence_len: rotary positions stop here
    rope_theta: float = 10000.0
    logit_softcap: float = 15.0  # 0 disables the cap
    rms_norm_eps: float = 1e-6
    embedding: str = "flat"  # lockstep's model.embedding
    tie_word_embeddings: bool = False
    use_cache: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self, **kwargs) -> None:
        if self.embedding not in EMBEDDINGS:
            raise ValueError(f"embedding={self.embedding!r} must be one of {', '.join(EMBEDDINGS)}")
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(
                f"hidden_size={self.hidden_size} must divide by num_attention_heads="
                f"{self.num_attention_heads} into an even head dim"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads={self.num_key_value_heads} must divide num_attention_heads="
                f"{self.num_attention_heads}"
            )
        super().__post_init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),), eps=eps)


def rotary(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (B, 1, T, D/2) fp32 of positions (B, T), computed in float64 as lockstep's
    rotary tables are, so that every angle is the same to the last bit."""
    device = position_ids.device if position_ids.device.type != "mps" else torch.device("cpu")  # mps has no fp64
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    freqs = position_ids.to(device, torch.float64)[..., None] * inv_freq  # (B, T, D/2)
    return (freqs.cos().float()[:, None].to(position_ids.device), freqs.sin().float()[:, None].to(position_ids.device))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + D/2) of x (B, H, T, D)."""
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


class Positions(NamedTuple):
    """Where the new tokens sit, as every layer reads it: rotary cos, sin (B, 1, T, D/2) in the
    activations' dtype, and the attention mask with SDPA's is_causal (attention_mask_for)."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None
    is_causal: bool


class LockstepEmbedding(nn.Module):
    """Ids (B, T) -> vectors (B, T, C), as the config's `embedding` kind does it."""

    def __init__(self, config: LockstepConfig) -> None:
        super().__init__()
        self.kind = config.embedding
        P, C = config.padded_vocab_size, config.hidden_size
        if self.kind == "flat":
            self.wte = nn.Embedding(P, C)
            return
        self.wte = nn.Embedding(P + 1, C)  # row P: "no parent"
        self.wbe = nn.Embedding(NO_BYTE_ROW + 1, C)
        self.register_buffer("token_parent_row", torch.arange(P))
        self.register_buffer("token_byte_row", torch.full((P,), NO_BYTE_ROW))
        if self.kind == "tuple":
            self.embed_proj = nn.Linear(2 * C, C, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.kind == "flat":
            return self.wte(idx)
        code, byte = self.wte(self.token_parent_row[idx]), self.wbe(self.token_byte_row[idx])
        if self.kind == "tuple":
            return self.embed_proj(torch.cat((code, byte), dim=-1))  # (B, T, 2C) -> (B, T, C)
        return code + byte


class LockstepAttention(nn.Module):
    def __init__(self, config: LockstepConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        C, D = config.hidden_size, config.head_dim
        self.c_q = nn.Linear(C, self.n_head * D, bias=False)
        self.c_k = nn.Linear(C, self.n_kv_head * D, bias=False)
        self.c_v = nn.Linear(C, self.n_kv_head * D, bias=False)
        self.c_proj = nn.Linear(self.n_head * D, C, bias=False)

    def forward(self, x: torch.Tensor, at: Positions, cache: Cache | None) -> torch.Tensor:
        B, T, C = x.shape
        D = self.head_dim
        q = self.c_q(x).view(B, T, self.n_head, D).transpose(1, 2)  # (B, H, T, D)
        k = self.c_k(x).view(B, T, self.n_kv_head, D).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.c_v(x).view(B, T, self.n_kv_head, D).transpose(1, 2)  # (B, Hkv, T, D)
        q = rms_norm(apply_rotary(q, at.cos, at.sin), self.eps)
        k = rms_norm(apply_rotary(k, at.cos, at.sin), self.eps)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, Hkv, Tk, D): every key so far
        gqa = {"enable_gqa": True} if self.n_head != self.n_kv_head else {}
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=at.mask, is_causal=at.is_causal, **gqa)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class LockstepMLP(nn.Module):
    def __init__(self, config: LockstepConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())


class LockstepBlock(nn.Module):
    def __init__(self, config: LockstepConfig, layer_idx: int) -> None:
        super().__init__()
        self.eps = config.rms_norm_eps
        self.attn = LockstepAttention(config, layer_idx)
        self.mlp = LockstepMLP(config)

    def forward(self, x: torch.Tensor, at: Positions, cache: Cache | None) -> torch.Tensor:
        x = x + self.attn(rms_norm(x, self.eps), at, cache)
        return x + self.mlp(rms_norm(x, self.eps))


class LockstepPreTrainedModel(PreTrainedModel):
    config_class = LockstepConfig
    base_model_prefix = "model"
    _no_split_modules = ["LockstepBlock"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # For a model built from a config alone; transformers' init functions leave loaded weights be.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, std=self.config.hidden_size**-0.5 if isinstance(module, nn.Linear) else 1.0)
        if isinstance(module, LockstepEmbedding) and module.kind != "flat":
            init.copy_(module.token_parent_row, torch.arange(module.token_parent_row.numel()))
            init.copy_(module.token_byte_row, torch.full_like(module.token_byte_row, NO_BYTE_ROW))


class LockstepModel(LockstepPreTrainedModel):
    """Embedding and blocks up to the final norm: hidden states (B, T, C)."""

    def __init__(self, config: LockstepConfig) -> None:
        super().__init__(config)
        self.embed = LockstepEmbedding(config)
        self.blocks = nn.ModuleList(LockstepBlock(config, i) for i in range(config.num_hidden_layers))
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed.wte

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed.wte = value

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, Cache | None]:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, C)
        B, T = x.shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = (past + torch.arange(T, device=x.device))[None].expand(B, T)  # (B, T)
        limit = self.config.max_position_embeddings
        if int(position_ids.max()) >= limit:
            raise ValueError(
                f"position {int(position_ids.max())} is past the model's context of {limit} tokens "
                "(max_position_embeddings); shorten the prompt or lower max_new_tokens"
            )
        cos, sin = rotary(position_ids, self.config.head_dim, self.config.rope_theta)
        at = Positions(cos.to(x.dtype), sin.to(x.dtype), *attention_mask_for(attention_mask, B, T, past, x.device))
        x = rms_norm(x, self.config.rms_norm_eps)
        for block in self.blocks:
            x = block(x, at, cache if use_cache else None)
        return rms_norm(x, self.config.rms_norm_eps), cache


def attention_mask_for(
    attention_mask: torch.Tensor | None, B: int, T: int, past: int, device: torch.device
) -> tuple[torch.Tensor | None, bool]:
    """(mask, is_causal) for T new queries after `past` cached keys. Without padding, lockstep's
    own cases: plain causal for a prefill, no mask for one new token. With a 2-D padding mask
    (B, past + T), a bool mask (B, 1, T, past + T): causal, padded keys hidden, and each query's
    own key always visible, so that a padded query's row is never empty (its output is unused)."""
    if attention_mask is not None and attention_mask.ndim == 4:
        return attention_mask, False  # already built by the caller
    if attention_mask is None or bool(attention_mask.all()):
        if past == 0:
            return None, T > 1
        if T == 1:
            return None, False
        attention_mask = None
    Tk = past + T
    q_pos = past + torch.arange(T, device=device)  # (T,)
    k_pos = torch.arange(Tk, device=device)  # (Tk,)
    mask = (k_pos[None, :] <= q_pos[:, None])[None, None]  # (1, 1, T, Tk)
    if attention_mask is not None:
        keep = attention_mask[:, None, None, -Tk:].bool()  # (B, 1, 1, Tk)
        mask = (mask & keep) | (k_pos[None, :] == q_pos[:, None])[None, None]  # (B, 1, T, Tk)
    return mask.expand(B, 1, T, Tk), False


class LockstepForCausalLM(LockstepPreTrainedModel, GenerationMixin):
    """LockstepModel and its untied head: soft-capped fp32 logits (B, T, vocab_size)."""

    def __init__(self, config: LockstepConfig) -> None:
        super().__init__(config)
        self.model = LockstepModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """`labels` (B, T), -100 where no loss: the mean cross-entropy of each position's logits
        against the next position's label, as transformers' causal LMs shift them."""
        hidden, cache = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)[..., : self.config.vocab_size].float()  # (B, T, V)
        cap = self.config.logit_softcap
        if cap:
            logits = cap * torch.tanh(logits / cap)
        loss = None
        if labels is not None:
            shifted = labels[:, 1:].to(logits.device)  # (B, T-1)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), shifted.reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)
