"""numba kernels for the LZ78 family: the dictionary parse (with frequency-gated eviction), the
child hash table, greedy longest-match encoding, spelling and gathering token bytes, and the scan,
check and trie insertion behind the fast `lz78` TSV reader. Arrays in, arrays out; the plain
Python references, argument checking and the public API live in `lockstep.tokenizer.lz78_trie`
and `lockstep.tokenizer.lz78_tsv`, the only callers. Every kernel is `nogil`, so callers may run
several on Python threads.

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


# --- the fast `lz78` TSV reader ----------------------------------------------------------------
# Each kernel answers ok or not; where not, the caller runs the plain reader, whose error names
# the file, line and fix. So these only have to tell a good file from a bad one.


@njit(nogil=True, inline="always")
def _utf8_length(lead: int) -> int:
    """The byte count of a UTF-8 sequence starting with `lead`, 0 for a byte no sequence starts with."""
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


@njit(nogil=True)
def utf8_ok(buf: np.ndarray, a: int, b: int) -> bool:
    """Whether buf[a:b] is valid UTF-8 as Python's strict decoder sees it (no overlong forms,
    surrogates or code points past U+10FFFF)."""
    i = a
    while i < b:
        lead = buf[i]
        n = _utf8_length(lead)
        if n == 0 or i + n > b:
            return False
        lo, hi = 0x80, 0xBF  # the range of the second byte, narrowed for the special leads
        if lead == 0xE0:
            lo = 0xA0
        elif lead == 0xED:
            hi = 0x9F
        elif lead == 0xF0:
            lo = 0x90
        elif lead == 0xF4:
            hi = 0x8F
        for k in range(1, n):
            c = buf[i + k]
            if c < (lo if k == 1 else 0x80) or c > (hi if k == 1 else 0xBF):
                return False
        i += n
    return True


@njit(nogil=True)
def _unescape(buf: np.ndarray, a: int, b: int) -> int:
    """Undo the field escapes of buf[a:b] in place; the new length, or -1 for a bad escape."""
    w = a
    i = a
    while i < b:
        c = buf[i]
        if c != 92:  # backslash
            buf[w] = c
            w += 1
            i += 1
            continue
        if i + 1 >= b:
            return -1
        e = buf[i + 1]
        if e == 92:
            buf[w] = 92
        elif e == 116:  # t
            buf[w] = 9
        elif e == 110:  # n
            buf[w] = 10
        elif e == 114:  # r
            buf[w] = 13
        elif e == 120:  # x
            if i + 4 > b:
                return -1
            v = 0
            for k in range(2, 4):
                h = buf[i + k]
                if 48 <= h <= 57:
                    v = v * 16 + h - 48
                elif 97 <= h <= 102:
                    v = v * 16 + h - 87
                elif 65 <= h <= 70:
                    v = v * 16 + h - 55
                else:
                    return -1
            buf[w] = v
            w += 1
            i += 4
            continue
        else:
            return -1
        w += 1
        i += 2
    return w - a


@njit(nogil=True, inline="always")
def _digits(buf: np.ndarray, a: int, b: int) -> int:
    """The value of 1..18 ASCII digits buf[a:b], or -1 (a longer number is the plain reader's)."""
    if b - a < 1 or b - a > 18:
        return -1
    v = 0
    for i in range(a, b):
        c = buf[i]
        if c < 48 or c > 57:
            return -1
        v = v * 10 + c - 48
    return v


@njit(nogil=True, inline="always")
def _one_symbol(buf: np.ndarray, a: int, n: int) -> bool:
    """Whether buf[a:a+n] is one byte, or one UTF-8 character."""
    if n == 1:
        return True
    return 2 <= n <= 4 and _utf8_length(buf[a]) == n and utf8_ok(buf, a, a + n)


@njit(nogil=True)
def scan_lz78(buf: np.ndarray, header: np.ndarray, marker: np.ndarray, codes: np.ndarray, parents: np.ndarray,
              start: np.ndarray, length: np.ndarray, char_length: np.ndarray) -> tuple[int, bool]:
    """The data lines of an `lz78` TSV file in `buf` (which this rewrites: escaped fields are
    undone in place): per record its code, parent code, and pattern and char as spans of `buf`
    (the char is the pattern's tail, checked). Returns (records, ok); a root line (code 0) is
    checked and not recorded. Not ok on anything the plain reader might refuse."""
    n = buf.shape[0]
    pos = 0
    r = 0
    escaped = False
    first = True
    while pos < n:
        end = pos
        while end < n and buf[end] != 10:
            end += 1
        nxt = end + 1
        if end > pos and buf[end - 1] == 13:
            end -= 1
        if end == pos:
            pos = nxt
            continue
        if buf[pos] == 35:  # a comment; the marker switches escapes on for the rest of the file
            if end - pos >= marker.shape[0]:
                same = True
                for k in range(marker.shape[0]):
                    if buf[pos + k] != marker[k]:
                        same = False
                        break
                if same:
                    escaped = True
            pos = nxt
            continue
        if first:
            first = False
            if end - pos == header.shape[0]:
                same = True
                for k in range(header.shape[0]):
                    if buf[pos + k] != header[k]:
                        same = False
                        break
                if same:  # the column names: the escaped form lockstep once wrote
                    escaped = True
                    pos = nxt
                    continue
        if not utf8_ok(buf, pos, end):
            return r, False
        tabs = np.empty(3, np.int64)
        n_tabs = 0
        for i in range(pos, end):
            c = buf[i]
            if c == 13:
                return r, False
            if c == 9:
                if n_tabs == 3:
                    return r, False
                tabs[n_tabs] = i
                n_tabs += 1
        if n_tabs != 3:
            return r, False
        code = _digits(buf, pos, tabs[0])
        parent = _digits(buf, tabs[0] + 1, tabs[1])
        if code < 0 or parent < 0:
            return r, False
        c0, c1 = tabs[1] + 1, tabs[2]
        p0, p1 = tabs[2] + 1, end
        clen, plen = c1 - c0, p1 - p0
        if escaped:
            clen = _unescape(buf, c0, c1)
            plen = _unescape(buf, p0, p1)
            if clen < 0 or plen < 0:
                return r, False
        if code == 0:  # the root's line
            if parent != 0 or clen != 0 or plen != 0:
                return r, False
            pos = nxt
            continue
        if clen < 1 or plen < clen or plen > 2147483647 or not _one_symbol(buf, c0, clen):
            return r, False
        for k in range(clen):
            if buf[c0 + k] != buf[p0 + plen - clen + k]:
                return r, False
        codes[r] = code
        parents[r] = parent
        start[r] = p0
        length[r] = plen
        char_length[r] = clen
        r += 1
        pos = nxt
    return r, True


@njit(nogil=True)
def patterns_follow_parents(buf: np.ndarray, parent: np.ndarray, start: np.ndarray, length: np.ndarray,
                            char_length: np.ndarray) -> bool:
    """Whether each code c = 1..N spells its parent's pattern then its char: length[c] is the
    parent's plus char_length[c], and the two patterns agree over the parent's (the char is the
    pattern's tail, checked by the scan). Lengths then grow along every parent chain, so no chain
    loops."""
    for c in range(1, parent.shape[0]):
        p = parent[c]
        lp = length[p] if p != 0 else 0
        if length[c] != lp + char_length[c]:
            return False
        a, b = start[c], start[p]
        for k in range(lp):
            if buf[a + k] != buf[b + k]:
                return False
    return True


@njit(nogil=True)
def insert_tokens(buf: np.ndarray, start: np.ndarray, length: np.ndarray, anchor: np.ndarray, skip: np.ndarray,
                  order: np.ndarray, max_nodes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """The byte trie of codes c = 1..N spelling buf[start[c]:start[c]+length[c]], inserted in
    `order` (by length, then code). Code c becomes node c; a prefix that is no code becomes node
    N+1, N+2, ... as it is first needed. A code's walk starts at node anchor[c] (0 or an earlier
    code that spells its first skip[c] bytes), which spares re-walking a known prefix. Returns
    (parent, last_byte, depth, ok) over nodes 0..M; not ok when two codes spell the same bytes or
    the nodes would pass max_nodes."""
    n_codes = start.shape[0] - 1
    cap = max_nodes + 1
    parent = np.zeros(cap, np.int32)
    last = np.zeros(cap, np.uint8)
    depth = np.zeros(cap, np.int32)
    bits = table_bits(cap)
    keys = np.full(1 << bits, EMPTY_KEY, np.int64)
    vals = np.zeros(1 << bits, np.int32)
    m = n_codes
    for k in range(order.shape[0]):
        c = order[k]
        node = anchor[c]
        s = start[c]
        for i in range(skip[c], length[c]):
            b = buf[s + i]
            key = np.int64(node) * 256 + b
            slot = _slot(keys, bits, key)
            final = i == length[c] - 1
            if keys[slot] == key:
                if final:
                    return parent, last, depth, False
                node = vals[slot]
                continue
            if final:
                new = c
            else:
                m += 1
                if m >= cap:
                    return parent, last, depth, False
                new = m
            keys[slot] = key
            vals[slot] = new
            parent[new] = node
            last[new] = b
            depth[new] = i + 1
            node = new
    return parent[:m + 1].copy(), last[:m + 1].copy(), depth[:m + 1].copy(), True
