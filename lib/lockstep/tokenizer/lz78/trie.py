"""The LZ78 dictionary core on the encoding path: the byte trie, greedy longest-match encoding of
bytes to codes, spelling codes as bytes, and ancestor chains. Bytes in, code arrays out; knows
nothing about text, vocab layout or special tokens (the LZ78 tokenizer kind maps codes to ids),
nor about learning a trie (`lockstep.tokenizer.lz78.train`) or reading one from a file
(`lockstep.tokenizer.lz78.tsv`).

Every function has a plain Python reference and a compiled path (`fast=True`, numba kernels in
`lockstep.tokenizer.lz78.kernels`) that gives identical results; tests/test_lz78_trie.py checks
the two against each other and against brute-force longest match. The reference is the
specification: read it first.

A trie is two arrays over nodes 0..M, `parent[v]` and `last_byte[v]`: node 0 is the root (parent
0, byte 0) and never emitted, and node v spells its parent's bytes followed by `last_byte[v]`.
Nodes 1..N are the codes (the tokens); nodes N+1..M, if any, are prefixes of codes that are not
codes themselves, kept so that a walk can reach the codes below them. A trained trie has none (M =
N: every prefix of a token is a token, the trie is prefix-closed) and is numbered in creation
order, so `parent[c] < c`; a trie read from a dictionary file keeps the file's numbering, so a
parent may have the larger number, and may lack prefixes (a character-level dictionary has `é`,
two bytes, but not its first byte alone). Encoding emits codes 1..N, the longest code that
matches, and for a byte b that no code starts with, the fallback marker `-1 - b` (see
`fallback_byte`)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Encoding splits a batch into this many contiguous groups of documents per thread, so one slow
# thread on a busy machine holds back a small share of the batch.
GROUPS_PER_THREAD = 4


class LZ78TrieError(ValueError):
    """parent/last_byte arrays that do not describe a trie: a parent out of range, a parent
    cycle, two nodes spelling the same bytes, or a non-code node that leads to no code."""


def fallback_byte(marker: int) -> int:
    """The byte b of a fallback marker -1 - b emitted by encoding."""
    return -1 - marker


def _jump(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pointer jumping: (dist, up) after each node has looked up 2^33 steps, doubling the reach each
    round, whatever the numbering; up[v] is 0 where the chain reached the root, dist[v] then v's
    depth."""
    up = np.asarray(parent, dtype=np.int32).copy()
    dist = np.ones(up.shape[0], np.int32)  # dist[v]: how far up[v] is above v
    dist[0] = 0
    for _ in range(33):  # depth < 2^31, so 32 doublings reach the root
        if not up.any():
            break
        dist += dist[up]
        up = up[up]
    return dist, up


def node_depths(parent: np.ndarray) -> np.ndarray | None:
    """int32 depth of every node (the root 0, a child of the root 1, ...) for a parent array
    over nodes 0..M with parent[0] == 0, or None when some chain never reaches the root (a
    cycle). log2(depth) rounds of whole-array steps."""
    dist, up = _jump(parent)
    return None if up.any() else dist


def _cycle_node(parent: np.ndarray) -> int:
    """The smallest node whose chain never reaches the root (it is on a cycle, or below one)."""
    return int(np.flatnonzero(_jump(parent)[1])[0])


@dataclass(frozen=True, eq=False)
class LZ78Trie:
    """A trained or loaded dictionary. `parent` (int32) and `last_byte` (uint8) have one entry per
    node 0..M, entry 0 being the root; `n_codes` is N, the nodes 1..N that are codes (None: all of
    them, a prefix-closed trie). Checked on construction."""

    parent: np.ndarray
    last_byte: np.ndarray
    n_codes: int = None  # type: ignore[assignment]  # normalized to an int in __post_init__
    _tables: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        parent = np.ascontiguousarray(self.parent, dtype=np.int32)
        last_byte = np.ascontiguousarray(self.last_byte, dtype=np.uint8)
        object.__setattr__(self, "parent", parent)
        object.__setattr__(self, "last_byte", last_byte)
        if parent.ndim != 1 or parent.shape != last_byte.shape or parent.shape[0] < 1:
            raise LZ78TrieError(
                f"parent {parent.shape} and last_byte {last_byte.shape} must be equal-length 1-d arrays "
                "with the root at index 0"
            )
        m = parent.shape[0] - 1
        n = m if self.n_codes is None else int(self.n_codes)
        object.__setattr__(self, "n_codes", n)
        if not 0 <= n <= m:
            raise LZ78TrieError(f"n_codes={n} must be within 0..{m}, the nodes past the root")
        if parent[0] != 0 or last_byte[0] != 0:
            raise LZ78TrieError("node 0 is the root: parent[0] and last_byte[0] must be 0")
        nodes = np.arange(1, m + 1)
        bad = nodes[(parent[1:] < 0) | (parent[1:] > m) | (parent[1:] == nodes)]
        if bad.size:
            v = int(bad[0])
            raise LZ78TrieError(f"node {v} has parent {int(parent[v])}; a parent must be another node in 0..{m}")
        depth = node_depths(parent)
        if depth is None:
            v = _cycle_node(parent)
            raise LZ78TrieError(f"node {v} is on a parent cycle or below one; every parent chain must end at the root")
        keys = parent[1:].astype(np.int64) * 256 + last_byte[1:]
        uniq, n_same = np.unique(keys, return_counts=True)
        if uniq.size != keys.size:
            key = int(uniq[n_same > 1][0])
            twins = (nodes[keys == key]).tolist()
            raise LZ78TrieError(f"nodes {twins} both spell parent {key // 256} + byte {key % 256}; "
                                "a dictionary must not repeat a token")
        if n < m:
            n_children = np.bincount(parent[1:], minlength=m + 1)
            leaf = np.flatnonzero(n_children[n + 1:] == 0)
            if leaf.size:
                raise LZ78TrieError(
                    f"node {n + 1 + int(leaf[0])} is no code and has no children; a node past the codes "
                    "must be a prefix of some code"
                )
        depth.setflags(write=False)
        self._tables["depth"] = depth

    @property
    def n_nodes(self) -> int:
        """M: nodes 1..M, the root not counted; M == n_codes for a prefix-closed trie."""
        return self.parent.shape[0] - 1

    @property
    def is_prefix_closed(self) -> bool:
        """Whether every prefix of a code is a code (no nodes past the codes)."""
        return self.n_codes == self.n_nodes

    def closed(self) -> LZ78Trie:
        """The prefix closure: the same nodes, every one a code, so the prefixes this trie lacks
        become codes N+1..M and the codes 1..N keep their numbers."""
        return self if self.is_prefix_closed else LZ78Trie(self.parent, self.last_byte)

    def depths(self) -> np.ndarray:
        """int32 over nodes 0..M, read-only: each node's byte length (0 for the root)."""
        return self._tables["depth"]

    def token_bytes(self, code: int) -> bytes:
        """The bytes that code 1..N spells."""
        if not 1 <= code <= self.n_codes:
            raise ValueError(f"code {code} is outside 1..{self.n_codes}")
        out = bytearray()
        while code:
            out.append(int(self.last_byte[code]))
            code = int(self.parent[code])
        return bytes(reversed(out))

    def code_parents(self) -> np.ndarray:
        """int32 over codes 0..N: each code's nearest ancestor that is a code (its longest proper
        prefix that is a token), 0 for none. The trie parent itself in a prefix-closed trie."""
        n = self.n_codes
        up = self.parent[: n + 1].copy()
        todo = np.flatnonzero(up > n)
        while todo.size:  # climb through the nodes that are no codes, each round one step
            up[todo] = self.parent[up[todo]]
            todo = todo[up[todo] > n]
        return up

    def spell(self, *, fast: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(flat, offsets): the bytes of codes 1..N concatenated (uint8) and int64 offsets over
        codes 0..N+1, so code c spells flat[offsets[c]:offsets[c+1]] (code 0, the root, nothing)."""
        depth = self.depths()[: self.n_codes + 1]
        offsets = np.zeros(self.n_codes + 2, np.int64)
        np.cumsum(depth, out=offsets[1:])
        if fast:
            flat = np.empty(int(offsets[-1]), np.uint8)
            _kernels().spell_into(self.parent, self.last_byte, depth, offsets, flat)
            return flat, offsets
        return np.frombuffer(b"".join(self.token_bytes(c) for c in range(1, self.n_codes + 1)), np.uint8), offsets

    def children(self) -> dict[int, int]:
        """`parent * 256 + byte` -> node: the reference encoder's lookup (never iterated)."""
        if "children" not in self._tables:
            self._tables["children"] = {int(p) * 256 + int(b): c for c, (p, b) in
                                        enumerate(zip(self.parent.tolist(), self.last_byte.tolist())) if c}
        return self._tables["children"]

    def kernel_table(self) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
        """The compiled encoder's (keys, vals, bits, root_child), built once per trie."""
        if "kernel" not in self._tables:
            self._tables["kernel"] = _kernels().build_table(self.parent, self.last_byte)
        return self._tables["kernel"]


def _kernels() -> Any:
    # numba: about 0.5 s to import and a few seconds to compile on first call; the reference path
    # and code that only loads a trie need neither.
    from lockstep.tokenizer.lz78 import kernels

    return kernels


def _check_docs(docs: Sequence[bytes]) -> list[bytes]:
    docs = list(docs)
    for i, d in enumerate(docs):
        if not isinstance(d, (bytes, bytearray, memoryview)):
            raise TypeError(f"document {i} is {type(d).__name__}; LZ78 works on bytes (encode text as UTF-8 first)")
    return docs


def _pack(docs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """All documents in one uint8 buffer and their int64 start offsets (plus the end)."""
    offsets = np.zeros(len(docs) + 1, np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    return np.frombuffer(b"".join(docs), np.uint8), offsets


# --- encoding ---------------------------------------------------------------------------------


def _encode_reference(trie: LZ78Trie, data: bytes) -> list[int]:
    """Greedy longest match: from each position, walk the trie as far as the bytes go and emit the
    last code passed (nodes past the codes are prefixes the walk goes through but cannot emit); a
    byte with no one-byte code emits -1 - byte. Every longer token lies on the path the walk
    takes, so no longer match lies past the first byte the walk cannot take."""
    children = trie.children()
    n = trie.n_codes
    out: list[int] = []
    i = 0
    while i < len(data):
        node, j = 0, i
        best, best_end = 0, i
        while j < len(data) and (nxt := children.get(node * 256 + data[j])) is not None:
            node, j = nxt, j + 1
            if node <= n:
                best, best_end = node, j
        if best == 0:
            out.append(-1 - data[i])
            i += 1
        else:
            out.append(best)
            i = best_end
    return out


def _groups(offsets: np.ndarray, n_groups: int) -> list[tuple[int, int]]:
    """Contiguous document ranges [a, b) of about equal bytes, none empty."""
    n_docs = offsets.shape[0] - 1
    cuts = np.searchsorted(offsets, np.linspace(0, offsets[-1], n_groups + 1)[1:-1], side="right")
    bounds = sorted({0, n_docs, *np.clip(cuts, 0, n_docs).tolist()})
    return list(zip(bounds[:-1], bounds[1:]))


def encode_batch(
    trie: LZ78Trie, docs: Sequence[bytes], *, num_threads: int = 1, fast: bool = False
) -> list[np.ndarray]:
    """Each document's greedy longest-match codes as an int32 array (fallback bytes as -1 - b).
    The compiled path runs on `num_threads` threads (its kernels release the GIL)."""
    docs = _check_docs(docs)
    if num_threads < 1:
        raise ValueError(f"num_threads={num_threads} must be at least 1")
    if not fast:
        return [np.array(_encode_reference(trie, d), np.int32) for d in docs]
    if not docs:
        return []
    kernels = _kernels()
    keys, vals, bits, root_child = trie.kernel_table()
    buf, offsets = _pack(docs)

    def run(bounds: tuple[int, int]) -> list[np.ndarray]:
        a, b = bounds
        out = np.empty(int(offsets[b] - offsets[a]), np.int32)
        token_offsets = np.empty(b - a + 1, np.int64)
        kernels.encode_into(buf, offsets[a:b + 1], keys, vals, bits, root_child, trie.n_codes, out, token_offsets)
        return np.split(out[:token_offsets[-1]].copy(), token_offsets[1:-1])

    groups = _groups(offsets, num_threads * GROUPS_PER_THREAD if num_threads > 1 else 1)
    if num_threads == 1 or len(groups) == 1:
        parts = [run(g) for g in groups]
    else:
        with ThreadPoolExecutor(num_threads) as pool:
            parts = list(pool.map(run, groups))
    return [arr for part in parts for arr in part]


def encode(trie: LZ78Trie, data: bytes, *, fast: bool = False) -> np.ndarray:
    """One document's codes; see encode_batch."""
    return encode_batch(trie, [data], fast=fast)[0]


# --- ancestor chains --------------------------------------------------------------------------


def ancestor_chains(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(chains, depths) for a parent array over ids 0..V-1 (0 = root/padding) whose chains all end
    at the root; a parent may be a larger id. Row c of the int32 (V, D) matrix is c, its parent,
    grandparent, ... down to a child of the root, padded with 0; depths[c] counts the non-padding
    entries (for a code of a prefix-closed trie: its byte length). D is the largest depth. Row 0
    is all padding."""
    parent = np.asarray(parent)
    if parent.ndim != 1 or parent.shape[0] < 1 or parent[0] != 0:
        raise LZ78TrieError("ancestor_chains needs a 1-d parent array with parent[0] == 0 (the root)")
    ids = np.arange(parent.shape[0])
    bad = ids[1:][(parent[1:] < 0) | (parent[1:] >= parent.shape[0]) | (parent[1:] == ids[1:])]
    if bad.size:
        raise LZ78TrieError(f"id {int(bad[0])} has parent {int(parent[bad[0]])}; a parent must be another id")
    if node_depths(parent) is None:
        raise LZ78TrieError(
            f"id {_cycle_node(parent)} is on a parent cycle or below one; every chain must end at the root"
        )
    return chain_matrix(parent)


def chain_matrix(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`ancestor_chains` without its checks, for a caller that knows every chain reaches the root
    (0) in finitely many steps."""
    ids = np.arange(parent.shape[0])
    columns = [ids]
    while columns[-1].any():
        columns.append(parent[columns[-1]])
    chains = np.stack(columns[:-1] or [np.zeros_like(ids)], axis=1).astype(np.int32)  # (V, D)
    return chains, np.count_nonzero(chains, axis=1).astype(np.int32)
