"""numba kernels of the LZ78 encoding path: the child hash table, greedy longest-match encoding,
spelling and gathering token bytes. Arrays in, arrays out; the plain Python references, argument
checking and the public API live in `lockstep.tokenizer.lz78.trie`, the only caller. The parse
(`lz78.train_kernels`) and the TSV reader's scan (`lz78.tsv_kernels`) sit in their own modules,
off the path of the stages that only encode. Every kernel is `nogil`, so callers may run several
on Python threads.

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
def _fill_table(
    parent: np.ndarray, last_byte: np.ndarray, n: int, keys: np.ndarray, vals: np.ndarray, bits: int, radix: int
) -> None:
    """Keys `parent * radix + symbol` of codes 1..n-1: `radix` is 256 over bytes (every caller
    but the parse by characters, which keys code points)."""
    keys[:] = EMPTY_KEY
    for c in range(1, n):
        key = np.int64(parent[c]) * radix + last_byte[c]
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
    _fill_table(parent, last_byte, n, keys, vals, bits, 256)
    root_child = np.zeros(256, np.int32)
    for c in range(1, n):
        if parent[c] == 0:
            root_child[last_byte[c]] = c
    return keys, vals, bits, root_child


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


@njit(nogil=True)
def gather_into(ids: np.ndarray, flat: np.ndarray, offsets: np.ndarray, out: np.ndarray) -> int:
    """flat[offsets[i]:offsets[i+1]] for each id i in `ids`, concatenated into `out` (large enough:
    see `gathered_length`): decoding without a Python object per token. Returns the bytes written."""
    t = 0
    for k in range(ids.shape[0]):
        a = offsets[ids[k]]
        b = offsets[ids[k] + 1]
        out[t:t + b - a] = flat[a:b]
        t += b - a
    return t


@njit(nogil=True)
def gathered_length(ids: np.ndarray, offsets: np.ndarray) -> int:
    """How many bytes `gather_into` writes for `ids`."""
    total = 0
    for k in range(ids.shape[0]):
        total += offsets[ids[k] + 1] - offsets[ids[k]]
    return total
