"""The prefix tree hidden in a byte-level vocabulary: for every token, the chain of its proper
byte-prefixes that are themselves tokens (its ancestors, longest first), its parent (the longest
of them) and its last byte. The prefix-smoothed loss (lockstep.train.objectives) reads the chains; the
structured embeddings read parent and last byte. Built from the tokens' byte strings (an LZ78
vocabulary, a trie already, builds its own); `Tokenizer.prefix_tree` is how a tokenizer gives it.
Does not train, encode or save tokenizers.

Conventions. NO_TOKEN (-1) stands where there is no id: padding in an ancestor row past the
token's depth, the parent of a token with no ancestor, and the last byte of a token without
bytes (a special token). Unlike an LZ78 vocabulary, whose id 0 is a reserved root, every bpe id
is a real token (id 0 is the byte 0x00), so "no parent" cannot be 0; a consumer that needs a
table row for it (an embedding) maps NO_TOKEN to a row of its own, see `PrefixTree.parent_rows`.
For bpe every single byte is a token, so each multi-byte token's chain ends at its first byte and
only single bytes and specials have no parent."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

NO_TOKEN = -1


@dataclass(frozen=True)
class PrefixTree:
    """Per-id prefix metadata of a vocabulary of V ids, all int64 numpy arrays:
    `ancestors` (V, max_depth) with row i the ids of i's proper byte-prefixes that are tokens,
    longest first, NO_TOKEN past `depths[i]`; `depths` (V,); `parent` (V,), the first ancestor or
    NO_TOKEN; `last_byte` (V,), the token's final byte 0..255 or NO_TOKEN. max_depth is at least 1
    so the table always has a column."""

    ancestors: np.ndarray
    depths: np.ndarray
    parent: np.ndarray
    last_byte: np.ndarray

    @property
    def vocab_size(self) -> int:
        return int(self.depths.shape[0])

    def parent_rows(self, root_row: int) -> np.ndarray:
        """`parent` with NO_TOKEN replaced by `root_row`: indices into a parent-embedding table
        that has one extra row for "no parent" (e.g. root_row = vocab_size)."""
        return np.where(self.parent == NO_TOKEN, root_row, self.parent)


def prefix_tree(pieces: Sequence[bytes | None]) -> PrefixTree:
    """The PrefixTree of a vocabulary given each id's byte string (`pieces[i]`), None for ids that
    stand for no bytes (special tokens). Two ids with the same bytes, or an empty byte string,
    raise ValueError: the prefix relation would not say which id is meant."""
    ids: dict[bytes, int] = {}
    for i, piece in enumerate(pieces):
        if piece is None:
            continue
        if not piece:
            raise ValueError(f"token {i} has an empty byte string; give None for ids that stand for no bytes")
        if piece in ids:
            raise ValueError(
                f"tokens {ids[piece]} and {i} have the same bytes {piece!r}; a vocabulary maps bytes to one id"
            )
        ids[piece] = i
    V = len(pieces)
    chains: list[list[int]] = []
    last_byte = np.full(V, NO_TOKEN, dtype=np.int64)
    for i, piece in enumerate(pieces):
        if piece is None:
            chains.append([])
            continue
        last_byte[i] = piece[-1]
        chains.append([ids[piece[:k]] for k in range(len(piece) - 1, 0, -1) if piece[:k] in ids])
    depths = np.array([len(c) for c in chains], dtype=np.int64)
    ancestors = np.full((V, max(1, int(depths.max(initial=0)))), NO_TOKEN, dtype=np.int64)
    for i, chain in enumerate(chains):
        ancestors[i, : len(chain)] = chain
    parent = np.where(depths > 0, ancestors[:, 0], NO_TOKEN)
    return PrefixTree(ancestors=ancestors, depths=depths, parent=parent, last_byte=last_byte)
