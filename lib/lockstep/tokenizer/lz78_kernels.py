"""numba kernels for the LZ78 trie: the dictionary parse (with frequency-gated eviction), the
child hash table, greedy longest-match encoding and spelling codes as bytes. Arrays in, arrays
out; the plain Python reference, argument checking and the public API live in
`lockstep.tokenizer.lz78_trie`, which is the only caller. Every kernel is `nogil`, so callers may
run several on Python threads.

The trie's children live in one open-addressing hash table keyed by `parent * 256 + byte` (linear
probing, Fibonacci hashing, at most half full): a dense (nodes x 256) table would need 1 GiB for
the 4x-budget dictionary of a 65k vocabulary. Empty slots hold key -1. A trained trie is numbered
in creation order (`parent[c] < c`); a trie read from a file need not be, and may hold nodes past
its codes that are not tokens (prefixes the file lacks), so nothing here relies on the order."""

from __future__ import annotations

import numpy as np
from numba import njit

EMPTY_KEY = -1
_FIB = np.uint64(0x9E3779B97F4A7C15)


@njit(nogil=True)
def table_bits(n_codes: int) -> int:
    """log2 of the slot count that keeps `n_codes` keys at most half full."""
    bits = 4
    while (1 << bits) < 2 * n_codes:
        bits += 1
    return bits


@njit(nogil=True, inline="always")
def _slot(keys: np.ndarray, bits: int, key: int) -> int:
    """The slot holding `key`, or the empty slot where it would go."""
    mask = (1 << bits) - 1
    i = np.int64((np.uint64(key) * _FIB) >> np.uint64(64 - bits))
    while keys[i] != key and keys[i] != EMPTY_KEY:
        i = (i + 1) & mask
    return i


@njit(nogil=True)
def _fill_table(parent: np.ndarray, last_byte: np.ndarray, n: int, keys: np.ndarray, vals: np.ndarray, bits: int) -> None:
    keys[:] = EMPTY_KEY
    for c in range(1, n):
        key = np.int64(parent[c]) * 256 + last_byte[c]
        s = _slot(keys, bits, key)
        keys[s] = key
        vals[s] = c


@njit(nogil=True)
def build_table(parent: np.ndarray, last_byte: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
    """(keys, vals, bits, root_child) for a finished trie; root_child[b] is the code of the
    one-byte token b, or 0. Encoding starts every token at the root, so that lookup is dense."""
    n = parent.shape[0]
    bits = table_bits(n)
    keys = np.empty(1 << bits, np.int64)
    vals = np.zeros(1 << bits, np.int32)
    _fill_table(parent, last_byte, n, keys, vals, bits)
    root_child = np.zeros(256, np.int32)
    for c in range(1, n):
        if parent[c] == 0:
            root_child[last_byte[c]] = c
    return keys, vals, bits, root_child


@njit(nogil=True)
def _evict(parent: np.ndarray, last_byte: np.ndarray, count: np.ndarray, n: int, min_count: int,
           keys: np.ndarray, vals: np.ndarray, bits: int) -> int:
    """Drop the leaves whose count is below `min_count`, renumber the survivors in their old
    order (so parent < child still holds) and rebuild the table. Returns the new code count."""
    has_child = np.zeros(n, np.bool_)
    for c in range(1, n):
        has_child[parent[c]] = True
    remap = np.zeros(n, np.int32)
    m = 1
    for c in range(1, n):
        if has_child[c] or count[c] >= min_count:
            # A kept code's parent has a child, so it is kept too and already renumbered.
            remap[c] = m
            parent[m] = remap[parent[c]]
            last_byte[m] = last_byte[c]
            count[m] = count[c]
            m += 1
    _fill_table(parent, last_byte, m, keys, vals, bits)
    return m


@njit(nogil=True)
def parse(buf: np.ndarray, offsets: np.ndarray, max_codes: int, gated: bool, period: int,
          min_count: int) -> tuple[np.ndarray, np.ndarray]:
    """The LZ78 parse of documents buf[offsets[d]:offsets[d+1]], restarting at each document.
    Without `gated` it stops when `max_codes` codes exist; with it, it reads every byte and, each
    `period` phrases while the dictionary is full, evicts leaves visited fewer than `min_count`
    times. Returns (parent, last_byte) over codes 0..N, code 0 being the root."""
    cap = max_codes + 1
    parent = np.zeros(cap, np.int32)
    last_byte = np.zeros(cap, np.uint8)
    count = np.zeros(cap, np.int64)
    bits = table_bits(cap)
    keys = np.full(1 << bits, EMPTY_KEY, np.int64)
    vals = np.zeros(1 << bits, np.int32)
    n = 1
    phrases = 0
    for d in range(offsets.shape[0] - 1):
        node = 0
        for i in range(offsets[d], offsets[d + 1]):
            b = buf[i]
            key = np.int64(node) * 256 + b
            s = _slot(keys, bits, key)
            if keys[s] == key:
                node = vals[s]
                count[node] += 1
                continue
            if n < cap:
                parent[n] = node
                last_byte[n] = b
                count[n] = 1
                keys[s] = key
                vals[s] = n
                n += 1
                if n == cap and not gated:
                    return parent, last_byte
            node = 0
            phrases += 1
            if gated and n == cap and phrases % period == 0:
                n = _evict(parent, last_byte, count, n, min_count, keys, vals, bits)
    return parent[:n].copy(), last_byte[:n].copy()


@njit(nogil=True)
def encode_into(buf: np.ndarray, offsets: np.ndarray, keys: np.ndarray, vals: np.ndarray, bits: int,
                root_child: np.ndarray, n_codes: int, out: np.ndarray, token_offsets: np.ndarray) -> None:
    """Greedy longest-match codes of documents buf[offsets[d]:offsets[d+1]] written to `out`
    (which holds at least offsets[-1] - offsets[0] entries: one token per byte at worst);
    document d's tokens are out[token_offsets[d]:token_offsets[d+1]]. A byte b with no one-byte
    code is written as -1 - b. Nodes past `n_codes` are prefixes that are not tokens: the walk
    goes through them and emits the last code it passed (in a prefix-closed trie, the deepest
    node reached)."""
    t = 0
    for d in range(offsets.shape[0] - 1):
        token_offsets[d] = t
        i = offsets[d]
        end = offsets[d + 1]
        while i < end:
            b = buf[i]
            node = root_child[b]
            j = i + 1
            best = node if node <= n_codes else 0
            best_end = j
            if node != 0:
                while j < end:
                    key = np.int64(node) * 256 + buf[j]
                    s = _slot(keys, bits, key)
                    if keys[s] != key:
                        break
                    node = vals[s]
                    j += 1
                    if node <= n_codes:
                        best = node
                        best_end = j
            if best == 0:
                out[t] = -1 - np.int32(b)
                i += 1
            else:
                out[t] = best
                i = best_end
            t += 1
    token_offsets[offsets.shape[0] - 1] = t


@njit(nogil=True)
def spell_into(parent: np.ndarray, last_byte: np.ndarray, depth: np.ndarray, offsets: np.ndarray,
               out: np.ndarray) -> None:
    """The bytes of codes 1..N (N = offsets.shape[0] - 2) written to out[offsets[c]:offsets[c+1]],
    each filled from its last byte back to its first along the parent chain."""
    for c in range(1, offsets.shape[0] - 1):
        i = offsets[c] + depth[c]
        node = c
        while node != 0:
            i -= 1
            out[i] = last_byte[node]
            node = parent[node]
