"""numba kernels of LZ78 training: the dictionary parse, with frequency-gated eviction. Arrays in,
arrays out; the plain Python reference and the public API live in `lockstep.tokenizer.lz78.train`,
the only caller. Shares the child hash table of `lz78.kernels`. `nogil`, like every kernel here."""

from __future__ import annotations

import numpy as np
from numba import njit

from lockstep.tokenizer.lz78.kernels import EMPTY_KEY, _fill_table, _slot, table_bits


@njit(nogil=True)
def _evict(parent: np.ndarray, last_byte: np.ndarray, count: np.ndarray, n: int, min_count: int,
           keys: np.ndarray, vals: np.ndarray, bits: int, radix: int) -> int:
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
    _fill_table(parent, last_byte, m, keys, vals, bits, radix)
    return m


@njit(nogil=True)
def parse(buf: np.ndarray, offsets: np.ndarray, max_codes: int, gated: bool, period: int,
          min_count: int, radix: int) -> tuple[np.ndarray, np.ndarray]:
    """The LZ78 parse of documents buf[offsets[d]:offsets[d+1]], restarting at each document.
    Without `gated` it stops when `max_codes` codes exist; with it, it reads every symbol and, each
    `period` phrases while the dictionary is full, evicts leaves visited fewer than `min_count`
    times. Symbols are below `radix`: bytes (uint8, radix 256) or code points (int32, radix
    0x110000, the parse by characters). Returns (parent, last symbol, of buf's dtype) over codes
    0..N, code 0 being the root."""
    cap = max_codes + 1
    parent = np.zeros(cap, np.int32)
    last_byte = np.zeros(cap, buf.dtype)
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
            key = np.int64(node) * radix + b
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
                n = _evict(parent, last_byte, count, n, min_count, keys, vals, bits, radix)
    return parent[:n].copy(), last_byte[:n].copy()
