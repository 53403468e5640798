"""LZ78 dictionary interchange: reading and writing the two TSV layouts that LZ78 tools emit, the
`lz78` layout (one line per code: `code, parent_code, char, pattern`) and the `compressed` layout
(a Patricia trie: `node_idx, edge_label, parent_idx, output_code, pattern`). Files in, tries and
per-token metadata out; does not train, encode or build a vocabulary (see
`lockstep.tokenizer.lz78_trie`).

Both layouts: UTF-8 text, one record per line split on `\\n` only (a trailing `\\r` is dropped),
columns separated by one tab, lines starting with `#` and empty lines skipped, and a first record
equal to the column names taken as a header. Byte strings (`char`, `pattern`, `edge_label`) are
written as UTF-8 text with these escapes, so that every byte value round-trips and no field holds
a tab or a line break: `\\\\` a backslash, `\\t` tab, `\\n` newline, `\\r` carriage return, and
`\\xHH` (two lowercase hex digits) for any other byte below 0x20, 0x7f, and every byte that is not
part of a valid UTF-8 sequence within the field (a token may end in the middle of a character).
Any other backslash sequence is an error.

`lz78`: `code` is any non-negative integer, unique; `parent_code` is 0 for a child of the root or
the `code` of another line (in any order); `char` is the one byte the code adds; `pattern` is the
bytes the code spells and must equal the parent's pattern plus `char`. A line for code 0 (the
root, empty `char` and `pattern`) may be present. Codes are renumbered 1..N in ascending order,
except that a code whose parent has a larger code moves to just after it (a stable topological
order), so the result is an `LZ78Trie` with `parent[c] < c`; `LZ78Dictionary.source_codes` keeps
the file's code of each trie code.

`compressed`: node rows in any order; exactly one root row, `parent_idx` -1 with an empty label
and pattern; every other node has a non-empty `edge_label` and `pattern` = parent's pattern +
label. `output_code` is the node's token code (any non-negative integer, unique), or -1 for a
node that is only a branching point; codes are renumbered 1..N in ascending order. Each token
has two parents: `parent`, the longest proper prefix that is itself a token, and `hier_parent`
(hierarchical), the nearest ancestor node in the file's tree that has a code (0 = none). In a
canonical Patricia trie, the one `write_compressed_tsv` writes, every token prefix lies on the
path to the token and the two coincide; a tool that inserts phrases without splitting edges
(`abc` a child of the root beside `ab`) makes them differ, and the file's tree is kept as given.

A compressed dictionary need not be prefix-closed (`abc` may be a token while `ab` is not). It is
kept as it is, tokens with the prefix notion of parent above, and `CompressedDictionary.closed_trie`
converts it to an `LZ78Trie` by adding the missing prefixes as extra codes: the trie encoder's
greedy walk stops at the first byte it cannot take, which finds the longest match only in a
prefix-closed dictionary. The original tokens keep their bytes and relative order, each placed
after its prefixes; the returned code map says where each one went.

Over 400 lines because each layout's reader checks every rule above and names the line that
breaks it; the two layouts share the line splitting, escapes and error reporting, so they stay in
one module."""

from __future__ import annotations

import heapq
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lockstep.io import atomic_open
from lockstep.tokenizer.lz78_trie import LZ78Trie, chain_matrix

LZ78_COLUMNS = ("code", "parent_code", "char", "pattern")
COMPRESSED_COLUMNS = ("node_idx", "edge_label", "parent_idx", "output_code", "pattern")
NO_CODE = -1  # output_code of a compressed node that is not a token

_ESCAPE_CHAR = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}
_UNESCAPE = {"\\": b"\\", "t": b"\t", "n": b"\n", "r": b"\r"}


class LZ78DictionaryError(ValueError):
    """A malformed TSV dictionary; the message starts with `file:line:`."""


def escape_bytes(data: bytes) -> str:
    """A byte string as one TSV field (see the module docstring)."""
    out = []
    # surrogateescape maps each byte outside valid UTF-8 to U+DC80..U+DCFF, one char per byte.
    for ch in data.decode("utf-8", "surrogateescape"):
        o = ord(ch)
        if ch in _ESCAPE_CHAR:
            out.append(_ESCAPE_CHAR[ch])
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\x{o:02x}")
        elif 0xDC80 <= o <= 0xDCFF:
            out.append(f"\\x{o - 0xDC00:02x}")
        else:
            out.append(ch)
    return "".join(out)


def unescape_field(field: str) -> bytes:
    """The bytes a TSV field spells; ValueError (without file and line) on a bad escape."""
    out = bytearray()
    i = 0
    while i < len(field):
        j = field.find("\\", i)
        if j < 0:
            out += field[i:].encode("utf-8")
            break
        out += field[i:j].encode("utf-8")
        nxt = field[j + 1:j + 2]
        if nxt and nxt in _UNESCAPE:
            out += _UNESCAPE[nxt]
            i = j + 2
        elif nxt == "x" and len(field) >= j + 4 and all(c in "0123456789abcdefABCDEF" for c in field[j + 2:j + 4]):
            out.append(int(field[j + 2:j + 4], 16))
            i = j + 4
        else:
            raise ValueError(f"bad escape {field[j:j + 4]!r} in {field!r}; use \\\\, \\t, \\n, \\r or \\xHH")
    return bytes(out)


@dataclass(frozen=True)
class _Record:
    line: int
    fields: list[str]


def _records(path: Path, columns: tuple[str, ...]) -> list[_Record]:
    """The data lines of a TSV dictionary, split into exactly len(columns) fields."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise LZ78DictionaryError(f"{path}: cannot read the dictionary ({e.strerror})") from e
    records: list[_Record] = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        raw = raw.removesuffix(b"\r")
        if not raw or raw.startswith(b"#"):
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LZ78DictionaryError(f"{path}:{n}: not UTF-8 at byte {e.start}; write raw bytes as \\xHH") from e
        fields = text.split("\t")
        if not records and tuple(fields) == columns:
            continue
        if len(fields) != len(columns):
            raise LZ78DictionaryError(f"{path}:{n}: {len(fields)} tab-separated columns, expected {len(columns)} "
                                      f"({', '.join(columns)}); escape tabs inside a field as \\t")
        records.append(_Record(n, fields))
    return records


def _int(path: Path, rec: _Record, column: int, name: str, minimum: int) -> int:
    text = rec.fields[column]
    if not re.fullmatch(r"-?[0-9]+", text) or int(text) < minimum:
        raise LZ78DictionaryError(f"{path}:{rec.line}: {name} {text!r} is not an integer >= {minimum}")
    return int(text)


def _bytes(path: Path, rec: _Record, column: int, name: str) -> bytes:
    try:
        return unescape_field(rec.fields[column])
    except ValueError as e:
        raise LZ78DictionaryError(f"{path}:{rec.line}: {name}: {e}") from None


def _topological(keys: Sequence[int], parent_of: dict[int, int], root: int) -> list[int]:
    """`keys` in ascending order, except that each comes after its parent: the smallest key whose
    parent is placed goes next. Keys whose parent chain never reaches `root` are left out."""
    children: dict[int, list[int]] = {}
    for k in keys:
        children.setdefault(parent_of[k], []).append(k)
    order: list[int] = []
    ready = list(children.get(root, []))
    heapq.heapify(ready)
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for child in children.get(k, []):
            heapq.heappush(ready, child)
    return order


def _cycle_error(path: Path, kind: str, left_out: set[int], parent_of: dict[int, int], line_of: dict[int, int]) -> LZ78DictionaryError:
    """The error for keys whose parent chain loops: walk up from the smallest until a key repeats."""
    seen: list[int] = []
    k = min(left_out)
    while k not in seen:
        seen.append(k)
        k = parent_of[k]
    loop = seen[seen.index(k):]
    return LZ78DictionaryError(f"{path}:{line_of[k]}: {kind} {k} is on a parent cycle "
                               f"({' -> '.join(map(str, loop + [k]))}); every parent chain must end at the root")


# --- the lz78 layout --------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class LZ78Dictionary:
    """A dictionary read from the `lz78` layout: the trie, and `source_codes` (int64, one entry per
    trie code 0..N), the code each trie code had in the file (0 for the root)."""

    trie: LZ78Trie
    source_codes: np.ndarray


def dictionary_layout(path: str | os.PathLike[str]) -> str:
    """`lz78` or `compressed`: which TSV layout `path` holds, by the column count of its first
    data line (4 or 5); LZ78DictionaryError for anything else."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            for raw in f:
                raw = raw.rstrip(b"\r\n")
                if raw and not raw.startswith(b"#"):
                    n = raw.count(b"\t") + 1
                    if n == len(LZ78_COLUMNS):
                        return "lz78"
                    if n == len(COMPRESSED_COLUMNS):
                        return "compressed"
                    raise LZ78DictionaryError(f"{path}: the first line has {n} tab-separated columns; an lz78 dictionary has "
                                              f"{len(LZ78_COLUMNS)} ({', '.join(LZ78_COLUMNS)}) and a compressed one "
                                              f"{len(COMPRESSED_COLUMNS)} ({', '.join(COMPRESSED_COLUMNS)})")
    except OSError as e:
        raise LZ78DictionaryError(f"{path}: cannot read the dictionary ({e.strerror})") from e
    raise LZ78DictionaryError(f"{path}: no dictionary lines (only comments or blank lines)")


def read_lz78_tsv(path: str | os.PathLike[str]) -> LZ78Dictionary:
    """The `lz78` layout (see the module docstring) as a trie with codes 1..N."""
    path = Path(path)
    rows: dict[int, tuple[_Record, int, int, bytes]] = {}  # code -> (record, parent, byte, pattern)
    for rec in _records(path, LZ78_COLUMNS):
        code = _int(path, rec, 0, "code", 0)
        parent = _int(path, rec, 1, "parent_code", 0)
        char = _bytes(path, rec, 2, "char")
        pattern = _bytes(path, rec, 3, "pattern")
        if code == 0:
            if parent or char or pattern:
                raise LZ78DictionaryError(f"{path}:{rec.line}: code 0 is the root: its parent_code must be 0 and its "
                                          "char and pattern empty; number the dictionary's codes from 1")
            continue
        if code in rows:
            raise LZ78DictionaryError(f"{path}:{rec.line}: duplicate code {code} (first on line {rows[code][0].line}); "
                                      "each code appears on one line")
        if len(char) != 1:
            raise LZ78DictionaryError(f"{path}:{rec.line}: char of code {code} is {len(char)} bytes; an LZ78 code "
                                      "adds exactly one byte to its parent (escape raw bytes as \\xHH)")
        rows[code] = (rec, parent, char[0], pattern)
    for code, (rec, parent, _, _) in rows.items():
        if parent and parent not in rows:
            raise LZ78DictionaryError(f"{path}:{rec.line}: code {code} has parent_code {parent}, which no line "
                                      "defines; list the parent, or write 0 for a child of the root")
    parent_of = {c: row[1] for c, row in rows.items()}
    order = _topological(sorted(rows), parent_of, 0)
    if len(order) < len(rows):
        raise _cycle_error(path, "code", set(rows) - set(order), parent_of, {c: r[0].line for c, r in rows.items()})

    new_code = {0: 0}
    parent, last_byte, spelled = [0], [0], [b""]
    seen: dict[tuple[int, int], int] = {}  # (new parent, byte) -> file code
    for code in order:
        rec, p, byte, pattern = rows[code]
        key = (new_code[p], byte)
        if key in seen:
            raise LZ78DictionaryError(f"{path}:{rec.line}: code {code} spells the same bytes as code {seen[key]} "
                                      f"(line {rows[seen[key]][0].line}); a dictionary lists each token once")
        seen[key] = code
        want = spelled[new_code[p]] + bytes([byte])
        if pattern != want:
            raise LZ78DictionaryError(f"{path}:{rec.line}: pattern of code {code} is {escape_bytes(pattern)!r} but "
                                      f"its parent's pattern + char is {escape_bytes(want)!r}; fix either column")
        new_code[code] = len(parent)
        parent.append(new_code[p])
        last_byte.append(byte)
        spelled.append(want)
    return LZ78Dictionary(LZ78Trie(np.array(parent), np.array(last_byte)), np.array([0, *order], np.int64))


def write_lz78_tsv(path: str | os.PathLike[str], trie: LZ78Trie) -> None:
    """`trie` in the `lz78` layout, codes 1..N as they are; written atomically."""
    lines = [f"# LZ78 dictionary, lz78 layout, {trie.n_codes} codes", "\t".join(LZ78_COLUMNS)]
    spelled = [b""]
    for c in range(1, trie.n_codes + 1):
        p, b = int(trie.parent[c]), int(trie.last_byte[c])
        spelled.append(spelled[p] + bytes([b]))
        lines.append(f"{c}\t{p}\t{escape_bytes(bytes([b]))}\t{escape_bytes(spelled[c])}")
    with atomic_open(path) as f:
        f.write(("\n".join(lines) + "\n").encode("utf-8"))


# --- the compressed layout --------------------------------------------------------------------


def _common_prefix(a: bytes, b: bytes) -> bytes:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


@dataclass(frozen=True, eq=False)
class CompressedDictionary:
    """Tokens with codes 1..N (`tokens[c - 1]`) and the Patricia trie that holds them: nodes
    0..M-1, node 0 the root, `node_parent[i]` (int32) a smaller node (-1 for the root),
    `node_label[i]` the bytes on the edge into node i, `node_code[i]` (int32) its token code or 0.
    `source_codes` (int64, codes 0..N) are the output codes the file gave (0 for the root).
    Build one with `read_compressed_tsv`, `from_tokens` or `from_trie`."""

    tokens: tuple[bytes, ...]
    node_parent: np.ndarray
    node_label: tuple[bytes, ...]
    node_code: np.ndarray
    source_codes: np.ndarray

    @property
    def n_codes(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_tokens(cls, tokens: Sequence[bytes]) -> CompressedDictionary:
        """The canonical Patricia trie of distinct non-empty byte strings, code c = tokens[c - 1].
        Its nodes are the root, the tokens, and the branching points, which are exactly the
        longest common prefixes of neighbours in sorted order; a node's parent is the longest
        other node that is a prefix of it."""
        tokens = tuple(bytes(t) for t in tokens)
        if any(not t for t in tokens) or len(set(tokens)) != len(tokens):
            raise ValueError("a dictionary's tokens must be distinct and non-empty")
        ordered = sorted(tokens)
        patterns = sorted({b"", *tokens, *(_common_prefix(a, b) for a, b in zip(ordered, ordered[1:]))})
        node_of = {p: i for i, p in enumerate(patterns)}  # sorted, so a prefix comes before its extensions
        parent = [-1] + [next(node_of[p[:k]] for k in range(len(p) - 1, -1, -1) if p[:k] in node_of)
                         for p in patterns[1:]]
        code_of = {t: c for c, t in enumerate(tokens, 1)}
        return cls(tokens, np.array(parent, np.int32),
                   tuple(p[len(patterns[q]):] if q >= 0 else b"" for p, q in zip(patterns, parent)),
                   np.array([code_of.get(p, 0) for p in patterns], np.int32),
                   np.arange(len(tokens) + 1, dtype=np.int64))

    @classmethod
    def from_trie(cls, trie: LZ78Trie) -> CompressedDictionary:
        """A prefix-closed trie's tokens, codes unchanged; every node is a token, each label one byte."""
        return cls.from_tokens([trie.token_bytes(c) for c in range(1, trie.n_codes + 1)])

    def parent(self) -> np.ndarray:
        """int32 over codes 0..N: the code of each token's longest proper prefix that is a token, or 0."""
        code_of = {t: c for c, t in enumerate(self.tokens, 1)}
        out = np.zeros(self.n_codes + 1, np.int32)
        for c, t in enumerate(self.tokens, 1):
            out[c] = next((code_of[t[:k]] for k in range(len(t) - 1, 0, -1) if t[:k] in code_of), 0)
        return out

    def hier_parent(self) -> np.ndarray:
        """int32 over codes 0..N: the code of the nearest ancestor node, in this trie, that has a code, or 0."""
        out = np.zeros(self.n_codes + 1, np.int32)
        for node in np.flatnonzero(self.node_code).tolist():
            up = int(self.node_parent[node])
            while up > 0 and not self.node_code[up]:
                up = int(self.node_parent[up])
            out[self.node_code[node]] = self.node_code[up] if up > 0 else 0
        return out

    def last_byte(self) -> np.ndarray:
        """uint8 over codes 0..N: each token's final byte (0 for the root)."""
        return np.array([0, *(t[-1] for t in self.tokens)], np.uint8)

    def ancestor_chains(self, hierarchical: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(chains, depths) over codes 0..N following `parent`, or `hier_parent` if hierarchical:
        row c is c, its parent, grandparent, ... padded with 0."""
        # parents need not be smaller codes here, but each spells fewer bytes, so every chain ends
        return chain_matrix(self.hier_parent() if hierarchical else self.parent())

    def closed_trie(self) -> tuple[LZ78Trie, np.ndarray]:
        """(trie, code_map): the prefix closure as an LZ78Trie, and int32 code_map over codes 0..N
        giving each token's trie code. Tokens are taken in code order, each after the prefixes it
        lacks (shortest first), so a prefix-closed dictionary whose parents are smaller codes maps
        onto itself."""
        trie_code = {b"": 0}
        parent, last_byte = [0], [0]
        for t in self.tokens:
            for k in range(1, len(t) + 1):
                if t[:k] not in trie_code:
                    trie_code[t[:k]] = len(parent)
                    parent.append(trie_code[t[:k - 1]])
                    last_byte.append(t[k - 1])
        code_map = np.array([0, *(trie_code[t] for t in self.tokens)], np.int32)
        return LZ78Trie(np.array(parent), np.array(last_byte)), code_map


def read_compressed_tsv(path: str | os.PathLike[str]) -> CompressedDictionary:
    """The `compressed` layout (see the module docstring). Nodes are renumbered root first, each
    after its parent, otherwise by node_idx; output codes become 1..N in ascending order."""
    path = Path(path)
    rows: dict[int, tuple[_Record, bytes, int, int, bytes]] = {}  # idx -> (record, label, parent, code, pattern)
    root = None
    for rec in _records(path, COMPRESSED_COLUMNS):
        idx = _int(path, rec, 0, "node_idx", 0)
        label = _bytes(path, rec, 1, "edge_label")
        parent = _int(path, rec, 2, "parent_idx", -1)
        code = _int(path, rec, 3, "output_code", NO_CODE)
        pattern = _bytes(path, rec, 4, "pattern")
        if idx in rows:
            raise LZ78DictionaryError(f"{path}:{rec.line}: duplicate node_idx {idx} (first on line "
                                      f"{rows[idx][0].line}); each node appears on one line")
        if parent == -1:
            if root is not None:
                raise LZ78DictionaryError(f"{path}:{rec.line}: a second root (parent_idx -1; the first is node "
                                          f"{root}); only the root has no parent")
            if label or pattern or code != NO_CODE:
                raise LZ78DictionaryError(f"{path}:{rec.line}: the root (parent_idx -1) must have an empty "
                                          f"edge_label and pattern and output_code {NO_CODE}")
            root = idx
        elif not label:
            raise LZ78DictionaryError(f"{path}:{rec.line}: node {idx} has an empty edge_label; only the root may")
        rows[idx] = (rec, label, parent, code, pattern)
    if root is None:
        raise LZ78DictionaryError(f"{path}: no root row; add a line with parent_idx -1, empty edge_label and "
                                  f"pattern, output_code {NO_CODE}")
    for idx, (rec, _, parent, _, _) in rows.items():
        if parent != -1 and parent not in rows:
            raise LZ78DictionaryError(f"{path}:{rec.line}: node {idx} has parent_idx {parent}, which no line defines")
    parent_of = {i: row[2] for i, row in rows.items() if i != root}
    order = _topological(sorted(parent_of), parent_of, root)
    if len(order) < len(parent_of):
        raise _cycle_error(path, "node", set(parent_of) - set(order), parent_of, {i: r[0].line for i, r in rows.items()})

    codes: dict[int, int] = {}  # file output code -> node_idx
    node_of_pattern: dict[bytes, int] = {b"": root}
    spelled = {root: b""}
    for idx in order:
        rec, label, parent, code, pattern = rows[idx]
        want = spelled[parent] + label
        if pattern != want:
            raise LZ78DictionaryError(f"{path}:{rec.line}: pattern of node {idx} is {escape_bytes(pattern)!r} but its "
                                      f"parent's pattern + edge_label is {escape_bytes(want)!r}; fix either column")
        if want in node_of_pattern:
            raise LZ78DictionaryError(f"{path}:{rec.line}: node {idx} spells the same bytes as node "
                                      f"{node_of_pattern[want]} (line {rows[node_of_pattern[want]][0].line})")
        node_of_pattern[want] = idx
        spelled[idx] = want
        if code != NO_CODE:
            if code in codes:
                raise LZ78DictionaryError(f"{path}:{rec.line}: output_code {code} is also node {codes[code]}'s "
                                          f"(line {rows[codes[code]][0].line}); each code names one token")
            codes[code] = idx
    source_codes = sorted(codes)
    new_code = {codes[s]: c for c, s in enumerate(source_codes, 1)}
    nodes = [root, *order]
    new_node = {idx: i for i, idx in enumerate(nodes)}
    return CompressedDictionary(
        tokens=tuple(spelled[codes[s]] for s in source_codes),
        node_parent=np.array([-1, *(new_node[rows[i][2]] for i in order)], np.int32),
        node_label=tuple(rows[i][1] for i in nodes),
        node_code=np.array([new_code.get(i, 0) for i in nodes], np.int32),
        source_codes=np.array([0, *source_codes], np.int64),
    )


def write_compressed_tsv(path: str | os.PathLike[str], dictionary: CompressedDictionary) -> None:
    """`dictionary` in the `compressed` layout: its nodes and codes as they are (-1 for no code);
    written atomically."""
    lines = [f"# LZ78 dictionary, compressed layout, {dictionary.n_codes} codes", "\t".join(COMPRESSED_COLUMNS)]
    spelled: list[bytes] = []
    for i, (p, label, code) in enumerate(zip(dictionary.node_parent.tolist(), dictionary.node_label,
                                             dictionary.node_code.tolist())):
        spelled.append(spelled[p] + label if p >= 0 else b"")
        lines.append(f"{i}\t{escape_bytes(label)}\t{p}\t{code or NO_CODE}\t{escape_bytes(spelled[i])}")
    with atomic_open(path) as f:
        f.write(("\n".join(lines) + "\n").encode("utf-8"))
