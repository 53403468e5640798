"""Token embeddings: how token ids become the GPT's first hidden states, one nn.Module class per
`model.embedding` mode, chosen through the EMBEDDINGS table. Each class owns its weights, their
initialisation from the generator, its share of the optimizer groups and (structured kinds) which
rows each id reads, and declares what it `needs` of the tokenizer. It is not the network around it
(lockstep.model.gpt), nor where a tokenizer's parents come from (the tokenizer's
`token_structure`, asked by lockstep.pipeline.train.token_structure)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

NO_BYTE_ROW = 256  # the byte-table row of ids that end in no byte (special tokens, LZ78's root)


def draw_normal(p: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """Fill `p` from N(0, std^2), drawn in fp32 on the CPU from `generator` and copied to p's
    device: the weights are a pure function of the generator state whatever the device."""
    p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=generator))


def draw_uniform(p: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """Fill `p` from Uniform(-a, a) with a = sqrt(3) std (standard deviation `std`), drawn as
    draw_normal draws."""
    a = 3**0.5 * std
    p.copy_(torch.empty(p.shape, dtype=torch.float32).uniform_(-a, a, generator=generator))


class TokenEmbedding(nn.Module):
    """Ids (B, T) -> vectors (B, T, n_embd). A kind creates its weights in `__init__` (on whatever
    device is current: GPT.build uses the meta device), fills them in `init_weights`, and sorts
    them for the optimizers: `tables` are lookups (no FLOPs, AdamW), `matrices` matmul weights
    (counted in FLOPs, Muon). Every parameter is in exactly one of the two. `needs` names the
    token structure it reads (lockstep.tokenizer.base.TOKEN_STRUCTURES), None for none."""

    needs: ClassVar[str | None] = None

    def __init__(self, n_embd: int, vocab_size: int, padded_vocab_size: int) -> None:
        super().__init__()
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size

    def init_weights(self, generator: torch.Generator, table_std: float = 1.0) -> None:
        """Fill every parameter (and buffer) from `generator`, in a fixed order, the lookup tables
        from N(0, table_std^2)."""
        raise NotImplementedError

    def tables(self) -> list[nn.Parameter]:
        """The lookup tables."""
        raise NotImplementedError

    def matrices(self) -> list[nn.Parameter]:
        """Weights applied by a matmul; none unless the kind projects."""
        return []

    def set_token_structure(self, parents: Any, last_bytes: Any) -> None:
        """Which rows each id reads (StructuredEmbedding); a kind without structure refuses."""
        kind = type(self).__name__.removesuffix("Embedding").lower()
        structured = [
            k for k, v in EMBEDDINGS.items() if v.set_token_structure is not TokenEmbedding.set_token_structure
        ]
        raise ValueError(f"a {kind} embedding has no token structure; set model.embedding to {' or '.join(structured)} "
                         "to use one")


class FlatEmbedding(TokenEmbedding):
    """One row per id (`flat`)."""

    def __init__(self, n_embd: int, vocab_size: int, padded_vocab_size: int) -> None:
        super().__init__(n_embd, vocab_size, padded_vocab_size)
        self.wte = nn.Embedding(padded_vocab_size, n_embd)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator, table_std: float = 1.0) -> None:
        draw_normal(self.wte.weight, table_std, generator)

    def tables(self) -> list[nn.Parameter]:
        return [self.wte.weight]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx)


class StructuredEmbedding(TokenEmbedding):
    """The parent code's row plus the last byte's row, summed (`structured`, over the prefix
    tree's parents; HierarchicalEmbedding reads a dictionary's hierarchical parents instead).

    `wte` holds parent-code rows, row padded_vocab_size standing for "no parent"; `wbe` the 256
    byte rows and NO_BYTE_ROW. Which rows an id reads is data, not a weight: the two buffers,
    filled by set_token_structure and saved in the state dict, so a checkpoint embeds without its
    tokenizer folder. Until then each id reads its own code row and NO_BYTE_ROW."""

    needs = "prefix"

    def __init__(self, n_embd: int, vocab_size: int, padded_vocab_size: int) -> None:
        super().__init__(n_embd, vocab_size, padded_vocab_size)
        P = padded_vocab_size
        self.wte = nn.Embedding(P + 1, n_embd)
        self.wbe = nn.Embedding(NO_BYTE_ROW + 1, n_embd)
        self.register_buffer("token_parent_row", torch.empty(P, dtype=torch.long))
        self.register_buffer("token_byte_row", torch.empty(P, dtype=torch.long))

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator, table_std: float = 1.0) -> None:
        draw_normal(self.wte.weight, table_std, generator)
        draw_normal(self.wbe.weight, table_std, generator)
        self.token_parent_row.copy_(torch.arange(self.padded_vocab_size))
        self.token_byte_row.fill_(NO_BYTE_ROW)

    def tables(self) -> list[nn.Parameter]:
        return [self.wte.weight, self.wbe.weight]

    @torch.no_grad()
    def set_token_structure(self, parents: Any, last_bytes: Any) -> None:
        """Which rows each id reads, from per-id arrays over the vocabulary (numpy or torch, any
        integer dtype): `parents[i]` the id of i's parent, or -1 for none (its parent row is then
        the "no parent" row); `last_bytes[i]` its final byte 0..255, or -1 for an id that spells
        no byte (a special token), which instead reads its own code row and NO_BYTE_ROW so that
        every special stays distinct. Padded ids read "no parent" and NO_BYTE_ROW."""
        parents = torch.as_tensor(parents, dtype=torch.long).cpu()
        last = torch.as_tensor(last_bytes, dtype=torch.long).cpu()
        V, P = self.vocab_size, self.padded_vocab_size
        if parents.shape not in ((V,), (P,)) or last.shape != parents.shape:
            raise ValueError(
                f"token structure of shapes {tuple(parents.shape)} and {tuple(last.shape)} does not fit the "
                f"model's {V} ids; it must come from the tokenizer the model is trained with"
            )
        n = parents.numel()
        ids = torch.arange(n)
        if ((parents < -1) | (parents >= n) | (parents == ids)).any() or ((last < -1) | (last > 255)).any():
            raise ValueError("token structure: parents must be -1 or another id, last bytes -1 or 0..255")
        no_byte = last == -1
        parent_row = torch.full((P,), P, dtype=torch.long)
        byte_row = torch.full((P,), NO_BYTE_ROW, dtype=torch.long)
        parent_row[:n] = torch.where(no_byte, ids, torch.where(parents == -1, P, parents))
        byte_row[:n] = torch.where(no_byte, NO_BYTE_ROW, last)
        self.token_parent_row.copy_(parent_row)
        self.token_byte_row.copy_(byte_row)

    def rows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The parent code's row and the last byte's row of ids (B, T), each (B, T, C)."""
        return self.wte(self.token_parent_row[idx]), self.wbe(self.token_byte_row[idx])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        code, byte = self.rows(idx)
        return code + byte


class HierarchicalEmbedding(StructuredEmbedding):
    """StructuredEmbedding over the hierarchical parents a dictionary file gives (`hierarchical`:
    an LZ78 dictionary in the compressed layout), which may differ from the prefix tree's."""

    needs = "hierarchical"


class TupleEmbedding(StructuredEmbedding):
    """StructuredEmbedding's two rows side by side, then a bias-free linear map to n_embd
    (`tuple`): a matmul, so it trains with the block matrices and counts towards FLOPs."""

    def __init__(self, n_embd: int, vocab_size: int, padded_vocab_size: int) -> None:
        super().__init__(n_embd, vocab_size, padded_vocab_size)
        self.embed_proj = nn.Linear(2 * n_embd, n_embd, bias=False)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator, table_std: float = 1.0) -> None:
        super().init_weights(generator, table_std)
        draw_normal(self.embed_proj.weight, self.embed_proj.in_features**-0.5, generator)

    def matrices(self) -> list[nn.Parameter]:
        return [self.embed_proj.weight]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed_proj(torch.cat(self.rows(idx), dim=-1))  # (B, T, 2C) -> (B, T, C)


# model.embedding -> its class. A new kind: a TokenEmbedding subclass above and one line here.
EMBEDDINGS: dict[str, type[TokenEmbedding]] = {
    "flat": FlatEmbedding,
    "structured": StructuredEmbedding,
    "tuple": TupleEmbedding,
    "hierarchical": HierarchicalEmbedding,
}


def keep_top_level_keys(owner: nn.Module, name: str) -> None:
    """Make `owner` save the embedding it holds as `owner.<name>` under top-level state-dict keys
    (`wte.weight`, `token_parent_row`, ..., not `<name>.wte.weight`), in the same order, and load
    them back: the names these weights had before the embedding was a module of its own, so
    older checkpoints load and saved weights stay byte for byte the same."""
    nested = name + "."

    def lift(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        # post-hook: owner's keys are the tail of `state`; re-adding each keeps their order
        for key in [k for k in state if k.startswith(prefix)]:
            rest = key[len(prefix):]
            state[prefix + rest.removeprefix(nested)] = state.pop(key)

    def nest(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        own = {k.split(".", 1)[0] for k in getattr(module, name).state_dict(keep_vars=True)}
        for key in [k for k in state if k.startswith(prefix) and k[len(prefix):].split(".", 1)[0] in own]:
            state[prefix + nested + key[len(prefix):]] = state.pop(key)

    owner.register_state_dict_post_hook(lift)
    owner.register_load_state_dict_pre_hook(nest)
