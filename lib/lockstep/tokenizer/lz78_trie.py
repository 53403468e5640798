"""The LZ78 dictionary core: training a byte trie by the LZ78 parse (strategies `standard`,
`frequency_gated`, `multi_round`), greedy longest-match encoding of bytes to codes, and ancestor
chains. Bytes in, code arrays out; knows nothing about text, vocab layout or special tokens (the
LZ78 tokenizer kind maps codes to ids).

Every function has a plain Python reference and a compiled path (`fast=True`, numba kernels in
`lockstep.tokenizer.lz78_kernels`) that gives identical results; tests/test_lz78_trie.py checks
the two against each other and against brute-force longest match. The reference is the
specification: read it first.

A trie with N codes is two arrays over codes 0..N: `parent[c]` and `last_byte[c]`; code 0 is the
root (parent 0, byte 0) and never emitted, and code c spells its parent's bytes followed by
`last_byte[c]`. Codes are numbered in creation order, so `parent[c] < c`, and every prefix of a
token is a token (the trie is prefix-closed). Encoding emits codes 1..N, and for a byte b that
no code starts with, the fallback marker `-1 - b` (see `fallback_byte`)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

STRATEGIES = ("standard", "frequency_gated", "multi_round")
# frequency_gated defaults: an eviction pass every 4096 phrases while the dictionary is full,
# dropping leaves that fewer than 2 phrases walked through (a leaf seen once is the phrase that
# created it and nothing since).
GATE_PERIOD_PHRASES = 4096
GATE_MIN_COUNT = 2
# multi_round trains this many times the budget before pruning.
ROUND_FACTOR = 4
# Encoding splits a batch into this many contiguous groups of documents per thread, so one slow
# thread on a busy machine holds back a small share of the batch.
GROUPS_PER_THREAD = 4


class LZ78TrieError(ValueError):
    """parent/last_byte arrays that do not describe a prefix-closed trie numbered in creation order."""


def fallback_byte(marker: int) -> int:
    """The byte b of a fallback marker -1 - b emitted by encoding."""
    return -1 - marker


@dataclass(frozen=True, eq=False)
class LZ78Trie:
    """A trained or loaded dictionary. `parent` (int32) and `last_byte` (uint8) have one entry per
    code 0..N, entry 0 being the root. Checked on construction."""

    parent: np.ndarray
    last_byte: np.ndarray
    _tables: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        parent = np.ascontiguousarray(self.parent, dtype=np.int32)
        last_byte = np.ascontiguousarray(self.last_byte, dtype=np.uint8)
        object.__setattr__(self, "parent", parent)
        object.__setattr__(self, "last_byte", last_byte)
        if parent.ndim != 1 or parent.shape != last_byte.shape or parent.shape[0] < 1:
            raise LZ78TrieError(f"parent {parent.shape} and last_byte {last_byte.shape} must be equal-length 1-d arrays "
                                "with the root at index 0")
        if parent[0] != 0 or last_byte[0] != 0:
            raise LZ78TrieError("code 0 is the root: parent[0] and last_byte[0] must be 0")
        codes = np.arange(1, parent.shape[0])
        bad = codes[(parent[1:] < 0) | (parent[1:] >= codes)]
        if bad.size:
            c = int(bad[0])
            raise LZ78TrieError(f"code {c} has parent {int(parent[c])}; every code's parent must be a smaller code "
                                "(renumber the dictionary in creation order)")
        keys = parent[1:].astype(np.int64) * 256 + last_byte[1:]
        uniq, n_same = np.unique(keys, return_counts=True)
        if uniq.size != keys.size:
            key = int(uniq[n_same > 1][0])
            twins = (codes[keys == key]).tolist()
            raise LZ78TrieError(f"codes {twins} both spell parent {key // 256} + byte {key % 256}; "
                                "a dictionary must not repeat a token")

    @property
    def n_codes(self) -> int:
        """N: codes 1..N, the root not counted."""
        return self.parent.shape[0] - 1

    def token_bytes(self, code: int) -> bytes:
        """The bytes that code 1..N spells."""
        if not 1 <= code <= self.n_codes:
            raise ValueError(f"code {code} is outside 1..{self.n_codes}")
        out = bytearray()
        while code:
            out.append(int(self.last_byte[code]))
            code = int(self.parent[code])
        return bytes(reversed(out))

    def children(self) -> dict[int, int]:
        """`parent * 256 + byte` -> code: the reference encoder's lookup (never iterated)."""
        if "children" not in self._tables:
            self._tables["children"] = {int(p) * 256 + int(b): c for c, (p, b) in
                                        enumerate(zip(self.parent.tolist(), self.last_byte.tolist())) if c}
        return self._tables["children"]

    def kernel_table(self) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
        """The compiled encoder's (keys, vals, bits, root_child), built once per trie."""
        if "kernel" not in self._tables:
            self._tables["kernel"] = _kernels().build_table(self.parent, self.last_byte)
        return self._tables["kernel"]


@dataclass(frozen=True, eq=False)
class LZ78Training:
    """What training returns: the trie, and `uses[c]`, how many times greedy encoding of the
    training documents emits code c (uses[0]: bytes that fell back). For multi_round these are
    the counts re-taken after pruning."""

    trie: LZ78Trie
    uses: np.ndarray


def _kernels() -> Any:
    # numba: about 0.5 s to import and a few seconds to compile on first call; the reference path
    # and code that only loads a trie need neither.
    from lockstep.tokenizer import lz78_kernels

    return lz78_kernels


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


# --- training ---------------------------------------------------------------------------------


def _parse_reference(docs: list[bytes], max_codes: int, gated: bool, period: int, min_count: int) -> LZ78Trie:
    """The LZ78 parse: walk the trie from the root along a document's bytes; at the first byte with
    no child, add the code (current node, byte), emit it and restart at the root on the next byte.
    A document ends mid-walk without adding anything.

    `standard` (not gated) stops at max_codes codes. `frequency_gated` reads every byte: count[c]
    is the number of phrases whose walk reached c (1 at creation), a phrase that finds the
    dictionary full adds nothing, and every `period` phrases, if the dictionary is full, the
    leaves with count < min_count are evicted (survivors keep their order and counts)."""
    parent, last_byte, count = [0], [0], [0]
    children: dict[int, int] = {}
    phrases = 0
    for doc in docs:
        node = 0
        for b in doc:
            nxt = children.get(node * 256 + b)
            if nxt is not None:
                node = nxt
                count[node] += 1
                continue
            if len(parent) <= max_codes:
                children[node * 256 + b] = len(parent)
                parent.append(node)
                last_byte.append(b)
                count.append(1)
                if len(parent) > max_codes and not gated:
                    return LZ78Trie(np.array(parent), np.array(last_byte))
            node = 0
            phrases += 1
            if gated and len(parent) > max_codes and phrases % period == 0:
                has_child = set(parent[1:])
                keep = [c for c in range(1, len(parent)) if c in has_child or count[c] >= min_count]
                new_code = {old: new for new, old in enumerate(keep, 1)}
                new_code[0] = 0
                parent = [0] + [new_code[parent[c]] for c in keep]
                last_byte = [0] + [last_byte[c] for c in keep]
                count = [0] + [count[c] for c in keep]
                children = {p * 256 + b: c for c, (p, b) in enumerate(zip(parent, last_byte)) if c}
    return LZ78Trie(np.array(parent), np.array(last_byte))


def _parse(docs: list[bytes], max_codes: int, gated: bool, period: int, min_count: int, fast: bool) -> LZ78Trie:
    if not fast:
        return _parse_reference(docs, max_codes, gated, period, min_count)
    buf, offsets = _pack(docs)
    return LZ78Trie(*_kernels().parse(buf, offsets, max_codes, gated, period, min_count))


def prune(trie: LZ78Trie, uses: np.ndarray, max_codes: int) -> LZ78Trie:
    """The trie cut to `max_codes` codes, still prefix-closed: repeatedly drop the leaf with the
    fewest uses (ties: the newest code first), so a code goes only after all its extensions.
    Survivors keep their relative order. O(N log N) with a heap; no byte loop, so one version
    serves both paths."""
    n = trie.n_codes
    if n <= max_codes:
        return trie
    parent = trie.parent
    n_children = np.bincount(parent[1:], minlength=n + 1)
    heap = [(int(uses[c]), -c) for c in range(1, n + 1) if n_children[c] == 0]
    heapq.heapify(heap)
    alive = np.ones(n + 1, np.bool_)
    for _ in range(n - max_codes):
        _, neg = heapq.heappop(heap)
        c = -neg
        alive[c] = False
        p = int(parent[c])
        n_children[p] -= 1
        if p and n_children[p] == 0:
            heapq.heappush(heap, (int(uses[p]), -p))
    keep = np.flatnonzero(alive)  # includes the root at 0
    new_code = np.zeros(n + 1, np.int32)
    new_code[keep] = np.arange(keep.size, dtype=np.int32)
    return LZ78Trie(new_code[parent[keep]], trie.last_byte[keep])


def train_lz78(
    docs: Sequence[bytes],
    max_codes: int,
    *,
    strategy: str = "standard",
    gate_period_phrases: int = GATE_PERIOD_PHRASES,
    gate_min_count: int = GATE_MIN_COUNT,
    round_factor: int = ROUND_FACTOR,
    fast: bool = False,
) -> LZ78Training:
    """An LZ78 dictionary of at most `max_codes` codes learned from `docs` (the parse restarts at
    each document), and the use counts of its codes on `docs`.

    - `standard`: the LZ78 parse, which stops adding codes at max_codes.
    - `frequency_gated`: the parse over all of `docs`; every `gate_period_phrases` phrases while
      the dictionary is full, leaves that fewer than `gate_min_count` phrases reached are evicted,
      so the budget moves from one-off phrases to recurring ones.
    - `multi_round`: the standard parse to `round_factor` x max_codes codes, use counts by greedy
      encoding of `docs`, `prune` to max_codes, counts re-taken.

    Deterministic: the same docs and arguments give identical arrays, on either path."""
    if strategy not in STRATEGIES:
        raise ValueError(f"LZ78 strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    for name, value in (("max_codes", max_codes), ("gate_period_phrases", gate_period_phrases),
                        ("gate_min_count", gate_min_count), ("round_factor", round_factor)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"LZ78 {name}={value!r} must be a positive integer")
    docs = _check_docs(docs)
    gated = strategy == "frequency_gated"
    budget = max_codes * round_factor if strategy == "multi_round" else max_codes
    trie = _parse(docs, budget, gated, gate_period_phrases, gate_min_count, fast)
    uses = count_uses(trie, docs, fast=fast)
    if strategy == "multi_round" and trie.n_codes > max_codes:
        trie = prune(trie, uses, max_codes)
        uses = count_uses(trie, docs, fast=fast)
    return LZ78Training(trie, uses)


# --- encoding ---------------------------------------------------------------------------------


def _encode_reference(trie: LZ78Trie, data: bytes) -> list[int]:
    """Greedy longest match: from each position, walk the trie as far as the bytes go and emit the
    node reached; a byte with no one-byte code emits -1 - byte. The trie is prefix-closed, so no
    longer match lies past the first byte the walk cannot take."""
    children = trie.children()
    out: list[int] = []
    i = 0
    while i < len(data):
        node, j = 0, i
        while j < len(data) and (nxt := children.get(node * 256 + data[j])) is not None:
            node, j = nxt, j + 1
        if node == 0:
            out.append(-1 - data[i])
            i += 1
        else:
            out.append(node)
            i = j
    return out


def _groups(offsets: np.ndarray, n_groups: int) -> list[tuple[int, int]]:
    """Contiguous document ranges [a, b) of about equal bytes, none empty."""
    n_docs = offsets.shape[0] - 1
    cuts = np.searchsorted(offsets, np.linspace(0, offsets[-1], n_groups + 1)[1:-1], side="right")
    bounds = sorted({0, n_docs, *np.clip(cuts, 0, n_docs).tolist()})
    return list(zip(bounds[:-1], bounds[1:]))


def encode_batch(trie: LZ78Trie, docs: Sequence[bytes], *, num_threads: int = 1, fast: bool = False) -> list[np.ndarray]:
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
        kernels.encode_into(buf, offsets[a:b + 1], keys, vals, bits, root_child, out, token_offsets)
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


def count_uses(trie: LZ78Trie, docs: Sequence[bytes], *, fast: bool = False) -> np.ndarray:
    """int64 counts over codes 0..N of greedy encoding of `docs`; entry 0 counts fallback bytes."""
    ids = np.concatenate([np.zeros(0, np.int32), *encode_batch(trie, docs, fast=fast)])
    return np.bincount(np.maximum(ids, 0), minlength=trie.n_codes + 1).astype(np.int64)


# --- ancestor chains --------------------------------------------------------------------------


def ancestor_chains(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(chains, depths) for a parent array over ids 0..V-1 with parent[c] < c (0 = root/padding).
    Row c of the int32 (V, D) matrix is c, its parent, grandparent, ... down to a child of the
    root, padded with 0; depths[c] counts the non-padding entries (for a trie code: its byte
    length). D is the largest depth. Row 0 is all padding."""
    parent = np.asarray(parent)
    if parent.ndim != 1 or parent.shape[0] < 1 or parent[0] != 0:
        raise LZ78TrieError("ancestor_chains needs a 1-d parent array with parent[0] == 0 (the root)")
    ids = np.arange(parent.shape[0])
    bad = ids[1:][(parent[1:] < 0) | (parent[1:] >= ids[1:])]
    if bad.size:
        raise LZ78TrieError(f"id {int(bad[0])} has parent {int(parent[bad[0]])}; parents must be smaller ids, "
                            "or the chain could loop")
    return chain_matrix(parent)


def chain_matrix(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`ancestor_chains` without its checks, for a caller that knows every chain reaches the root
    (0) in finitely many steps even where a parent is not a smaller id."""
    ids = np.arange(parent.shape[0])
    columns = [ids]
    while columns[-1].any():
        columns.append(parent[columns[-1]])
    chains = np.stack(columns[:-1] or [np.zeros_like(ids)], axis=1).astype(np.int32)  # (V, D)
    return chains, np.count_nonzero(chains, axis=1).astype(np.int32)
