"""numba kernels behind the fast `lz78` TSV reader (`lockstep.tokenizer.lz78.tsv`, the only
caller): the scan and checks of a file's lines and the trie insertion of its tokens. Each kernel
answers ok or not; where not, the caller runs the plain reader, whose error names the file, line
and fix. So these only have to tell a good file from a bad one. Shares the child hash table of
`lz78.kernels`. `nogil`, like every kernel here."""

from __future__ import annotations

import numpy as np
from numba import njit

from lockstep.tokenizer.lz78.kernels import EMPTY_KEY, _slot, table_bits


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
