"""LZ78 dictionary interchange: reading and writing the two TSV layouts that LZ78 tools emit, the
`lz78` layout (one line per code: `code, parent_code, char, pattern`) and the `compressed` layout
(a Patricia trie: `node_idx, edge_label, parent_idx, output_code, pattern`). Files in, tries and
per-token metadata out; does not train, encode or build a vocabulary (see
`lockstep.tokenizer.lz78.trie`).

The files are the ones the public reference LZ78 tokenizer reads (its `from_tsv`), and what
lockstep writes, it reads the same way. Both layouts: UTF-8 text, one record per line split on
`\\n` (a trailing `\\r` is dropped), columns separated by one tab, lines starting with `#` and
empty lines skipped. Byte fields (`char`, `pattern`, `edge_label`) are raw UTF-8 text, as the
reference writes and reads them: a backslash is a backslash. A byte string that cannot be written
so (it holds a tab, `\\n` or `\\r`, or bytes that are not UTF-8, such as a token that ends in the
middle of a character) goes on a line below a comment line starting with `# escaped:`; from that
line on, byte fields use these escapes: `\\\\` a backslash, `\\t` tab, `\\n` newline, `\\r`
carriage return, and `\\xHH` (two hex digits) for any byte. The reference reads such a line
literally (its bytes differ), which is the best a line-based UTF-8 reader allows. A first record
equal to the column names (the form lockstep wrote before; the reference cannot read it) also
turns the escapes on. Numbers are decimal, below 2^63.

`lz78`: `code` is a positive integer, unique; `parent_code` is 0 for a child of the root or the
`code` of another line (in any order, a parent may have the larger code); `char` is one byte or
one UTF-8 character, what the code adds to its parent (so a character-level dictionary, whose
codes add `é`, reads as it is); `pattern` is the bytes the code spells and must equal the parent's
pattern plus `char`. A line for code 0 (the root, parent 0, empty `char` and `pattern`) may be
present and is skipped. Ids: the codes in ascending order become 1..N, so a file numbered 1..N
keeps its numbers (what the reference does: it keeps codes 1..N and ranks any other set the same
way). `LZ78Dictionary.source_codes` keeps the file's code of each id.

`compressed`: node rows in any order; exactly one root row, `parent_idx` -1 or its own
`node_idx` (the reference's own files use 0 0), with empty label and pattern and no code; every
other node has a non-empty `edge_label` and `pattern` = parent's pattern + label. `output_code`
is the node's token code (a positive integer, unique), or -1 or empty for a node that is only a
branching point. Ids: the codes in ascending order become 1..N (the reference keeps the codes
themselves as ids, with unused ids between sparse codes, so the two agree when the codes are
1..N). Each token has two parents: `parent`, the longest proper prefix that is itself a token,
and `hier_parent` (hierarchical), the nearest ancestor node in the file's tree that has a code (0
= none). In a canonical Patricia trie, the one `write_compressed_tsv` writes, every token prefix
lies on the path to the token and the two coincide; a tool that inserts phrases without splitting
edges (`abc` a child of the root beside `ab`) makes them differ, and the file's tree is kept as
given.

Neither layout need be prefix-closed under bytes (`é` may be a code while its first byte is not;
a compressed token `abc` may lack `ab`). Reading gives an `LZ78Trie` whose codes 1..N are the
file's tokens with the ids above, plus nodes N+1..M for the byte prefixes that are no token (see
`lockstep.tokenizer.lz78.trie`): encoding then takes the longest token that matches, as the
reference does, and `LZ78Trie.closed()` turns those prefixes into codes N+1..M when every prefix
must be a token. Those nodes are numbered shortest first, ties in the order the tokens (by length,
then id) first need them.

`read_lz78_tsv(..., fast=True)` runs the numba scan, checks and trie insertion of
`lockstep.tokenizer.lz78.tsv_kernels` (a 10M-line file in seconds, in a few hundred bytes a line);
the plain reader is the specification, and wherever the fast path meets anything it does not
accept, the plain reader reads the file and raises its error, so the two agree on every file
(tests/test_lz78_tsv.py).

Long because each layout's reader checks every rule above and names the line that breaks it; the
two layouts share the line splitting, escapes and error reporting, so they stay in one module. Only
the tokenizer stage's path imports it (through `lz78.train`): stages that load a tokenizer never
read a dictionary file."""

from __future__ import annotations

import heapq
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lockstep.core.io import atomic_open
from lockstep.tokenizer.lz78.trie import LZ78Trie, chain_matrix

LZ78_COLUMNS = ("code", "parent_code", "char", "pattern")
COMPRESSED_COLUMNS = ("node_idx", "edge_label", "parent_idx", "output_code", "pattern")
NO_CODE = -1  # output_code of a compressed node that is not a token
ESCAPED_MARKER = "# escaped:"  # a comment line starting so turns the escapes on for the lines below
LARGEST = 2**63 - 1  # codes and node indices are int64 once read
# Lines written per write call: bounded memory for a dictionary of millions of codes.
WRITE_BATCH_LINES = 65536

_ESCAPE_CHAR = {"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"}
_UNESCAPE = {"\\": b"\\", "t": b"\t", "n": b"\n", "r": b"\r"}
_NUMBER = re.compile(rb"-?[0-9]+")
# What makes a byte-level dictionary's codes all travel: the option that trains them so.
PORTABLE_FIX = "train the dictionary with tokenizer.options.portable: true (lz78.train.train_lz78(portable=True))"

log = logging.getLogger("lockstep.tokenizer")


class LZ78DictionaryError(ValueError):
    """A malformed TSV dictionary; the message names the file (and line) and the fix."""


class LZ78ExportError(ValueError):
    """An `exact` export of a dictionary the reference's format cannot carry; the message names
    the first line that would be misread and the fix."""


def escape_bytes(data: bytes) -> str:
    """A byte string as one field of an escaped line: every byte value round-trips and no field
    holds a tab or a line break. Control bytes and bytes outside valid UTF-8 become `\\xHH`;
    whole UTF-8 characters stay readable."""
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
    """The bytes an escaped field spells; ValueError (without file and line) on a bad escape."""
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
            raise ValueError(
                f"bad escape {field[j : j + 4]!r} in {field!r}; below `{ESCAPED_MARKER}` use \\\\, \\t, \\n, "
                "\\r or \\xHH (a backslash is \\\\)"
            )
    return bytes(out)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def raw_writable(data: bytes) -> bool:
    """Whether `data` can be a raw field: UTF-8 without tab, newline or carriage return (a
    line-based UTF-8 reader, such as the reference, reads it back exactly)."""
    return not (b"\t" in data or b"\n" in data or b"\r" in data) and _is_utf8(data)


def _one_symbol(data: bytes) -> bool:
    """One byte, or one UTF-8 character: what an LZ78 code may add to its parent."""
    if len(data) == 1:
        return True
    try:
        return len(data.decode("utf-8")) == 1
    except UnicodeDecodeError:
        return False


def _show(data: bytes, limit: int = 24) -> str:
    """A field for an error message: escaped, and cut when long."""
    text = escape_bytes(data[:limit])
    return repr(text) + (f"... ({len(data)} bytes)" if len(data) > limit else "")


@dataclass(frozen=True)
class _Record:
    line: int
    fields: list[bytes]
    escaped: bool


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise LZ78DictionaryError(f"{path}: cannot read the dictionary ({e.strerror}); name an existing, readable "
                                  "TSV file") from None


def _records(path: Path, columns: tuple[str, ...]) -> Iterator[_Record]:
    """The data lines of a TSV dictionary, split into exactly len(columns) fields."""
    escaped = False
    first = True
    names = [c.encode() for c in columns]
    for n, raw in enumerate(_read(path).split(b"\n"), 1):
        raw = raw.removesuffix(b"\r")
        if not raw:
            continue
        if raw.startswith(b"#"):
            escaped = escaped or raw.startswith(ESCAPED_MARKER.encode())
            continue
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise LZ78DictionaryError(
                f"{path}:{n}: not UTF-8 at byte {e.start}; a line is UTF-8 text: write other bytes "
                f"as \\xHH on a line below `{ESCAPED_MARKER}`"
            ) from None
        if b"\r" in raw:
            at = raw.index(b"\r")
            raise LZ78DictionaryError(f"{path}:{n}: a carriage return inside the line (byte {at}), where readers "
                                      f"split lines; write it as \\r on a line below `{ESCAPED_MARKER}`")
        fields = raw.split(b"\t")
        if first and fields == names:
            escaped, first = True, False  # the column names: the escaped form lockstep once wrote
            continue
        first = False
        if len(fields) != len(columns):
            raise LZ78DictionaryError(f"{path}:{n}: {len(fields)} tab-separated columns, expected {len(columns)} "
                                      f"({', '.join(columns)}); a tab inside a field is written \\t on a line below "
                                      f"`{ESCAPED_MARKER}`")
        yield _Record(n, fields, escaped)


def _int(path: Path, rec: _Record, column: int, name: str, minimum: int) -> int:
    text = rec.fields[column]
    if not _NUMBER.fullmatch(text):
        raise LZ78DictionaryError(f"{path}:{rec.line}: {name} {_show(text)} is not an integer; write a decimal "
                                  f"integer >= {minimum}")
    if len(text.lstrip(b"-")) > 19 or not minimum <= int(text) <= LARGEST:
        raise LZ78DictionaryError(f"{path}:{rec.line}: {name} {_show(text)} is outside {minimum}..2^63-1; "
                                  f"write a decimal integer in that range")
    return int(text)


def _bytes(path: Path, rec: _Record, column: int, name: str) -> bytes:
    field = rec.fields[column]
    if not rec.escaped:
        return field
    try:
        return unescape_field(field.decode("utf-8"))
    except ValueError as e:
        raise LZ78DictionaryError(f"{path}:{rec.line}: {name}: {e}") from None


def _no_tokens(path: Path) -> LZ78DictionaryError:
    return LZ78DictionaryError(f"{path}: no dictionary lines with a code (only comments, blank lines, a header or a "
                               "root line); export the dictionary again, or name a file that holds one")


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


def _cycle_error(
    path: Path, kind: str, left_out: set[int], parent_of: dict[int, int], line_of: dict[int, int]
) -> LZ78DictionaryError:
    """The error for keys whose parent chain loops: walk up from the smallest until a key repeats."""
    seen: list[int] = []
    k = min(left_out)
    while k not in seen:
        seen.append(k)
        k = parent_of[k]
    loop = seen[seen.index(k):]
    return LZ78DictionaryError(f"{path}:{line_of[k]}: {kind} {k} is on a parent cycle "
                               f"({' -> '.join(map(str, loop + [k]))}); every parent chain must end at the root")


def trie_from_tokens(tokens: Sequence[bytes]) -> LZ78Trie:
    """The trie whose codes 1..N spell `tokens` (code c = tokens[c - 1], distinct and non-empty),
    with nodes N+1..M for the prefixes that are no token. Tokens are inserted by length, then
    code, each walking from the root and adding the prefix nodes it lacks; those are then
    numbered by depth, ties in the order they were added."""
    n = len(tokens)
    parent, last_byte, depth = [0] * (n + 1), [0] * (n + 1), [0] * (n + 1)
    children: dict[int, int] = {}  # node * 256 + byte -> node
    for c in sorted(range(1, n + 1), key=lambda c: (len(tokens[c - 1]), c)):
        token = tokens[c - 1]
        node = 0
        for i, b in enumerate(token):
            key = node * 256 + b
            if key in children:
                if i == len(token) - 1:
                    raise ValueError(f"tokens {children[key]} and {c} are both {token!r}")
                node = children[key]
                continue
            if i == len(token) - 1:
                new = c
                parent[c], last_byte[c], depth[c] = node, b, i + 1
            else:  # a prefix that is no token (yet: a token spelling it would have come first)
                new = len(parent)
                parent.append(node)
                last_byte.append(b)
                depth.append(i + 1)
            children[key] = new
            node = new
    return _prefixes_by_depth(np.array(parent, np.int32), np.array(last_byte, np.uint8), np.array(depth, np.int32), n)


def _prefixes_by_depth(parent: np.ndarray, last_byte: np.ndarray, depth: np.ndarray, n: int) -> LZ78Trie:
    """The trie with its nodes past the codes renumbered by depth, ties kept in order."""
    new_of = np.arange(parent.shape[0], dtype=np.int32)
    new_of[n + 1 + np.argsort(depth[n + 1:], kind="stable")] = np.arange(n + 1, parent.shape[0], dtype=np.int32)
    new_parent = np.empty_like(parent)
    new_last = np.empty_like(last_byte)
    new_parent[new_of] = new_of[parent]
    new_last[new_of] = last_byte
    return LZ78Trie(new_parent, new_last, n)


# --- the lz78 layout --------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class LZ78Dictionary:
    """A dictionary read from the `lz78` layout: the trie (codes 1..N the file's tokens, then any
    prefix nodes), and `source_codes` (int64 over codes 0..N), the code each had in the file (0
    for the root)."""

    trie: LZ78Trie
    source_codes: np.ndarray


def dictionary_layout(path: str | os.PathLike[str]) -> str:
    """`lz78` or `compressed`: which TSV layout `path` holds, by the column count of its first
    data line (4 or 5); LZ78DictionaryError for anything else."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            for n, raw in enumerate(f, 1):
                raw = raw.rstrip(b"\r\n")
                if raw and not raw.startswith(b"#"):
                    columns = raw.count(b"\t") + 1
                    if columns == len(LZ78_COLUMNS):
                        return "lz78"
                    if columns == len(COMPRESSED_COLUMNS):
                        return "compressed"
                    raise LZ78DictionaryError(
                        f"{path}:{n}: the first data line has {columns} tab-separated columns; an lz78 dictionary has "
                        f"{len(LZ78_COLUMNS)} ({', '.join(LZ78_COLUMNS)}) and a compressed one "
                        f"{len(COMPRESSED_COLUMNS)} ({', '.join(COMPRESSED_COLUMNS)}): "
                        "export the dictionary in one of those layouts")
    except OSError as e:
        raise LZ78DictionaryError(f"{path}: cannot read the dictionary ({e.strerror}); name an existing, readable "
                                  "TSV file") from None
    raise _no_tokens(path)


def read_lz78_tsv(path: str | os.PathLike[str], *, fast: bool = False) -> LZ78Dictionary:
    """The `lz78` layout (see the module docstring): codes in ascending order as ids 1..N.
    `fast` reads with the compiled kernels, with the same result and errors."""
    path = Path(path)
    if fast:
        read = _read_lz78_fast(path)
        if read is not None:
            return read
    rows: dict[int, tuple[_Record, int, bytes, bytes]] = {}  # code -> (record, parent, char, pattern)
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
        if not _one_symbol(char):
            raise LZ78DictionaryError(f"{path}:{rec.line}: char of code {code} is {_show(char)}; an LZ78 code adds "
                                      "one character (or one byte) to its parent: fix the char column")
        rows[code] = (rec, parent, char, pattern)
    if not rows:
        raise _no_tokens(path)
    for code, (rec, parent, _, _) in rows.items():
        if parent and parent not in rows:
            raise LZ78DictionaryError(f"{path}:{rec.line}: code {code} has parent_code {parent}, which no line "
                                      "defines; list the parent, or write 0 for a child of the root")
    parent_of = {c: row[1] for c, row in rows.items()}
    order = _topological(sorted(rows), parent_of, 0)
    if len(order) < len(rows):
        raise _cycle_error(path, "code", set(rows) - set(order), parent_of, {c: r[0].line for c, r in rows.items()})
    spelled: dict[bytes, int] = {}
    for code in order:
        rec, p, char, pattern = rows[code]
        want = (rows[p][3] if p else b"") + char
        if pattern != want:
            raise LZ78DictionaryError(f"{path}:{rec.line}: pattern of code {code} is {_show(pattern)} but its parent's "
                                      f"pattern + char is {_show(want)}; fix either column")
        if pattern in spelled:
            first = spelled[pattern]
            raise LZ78DictionaryError(f"{path}:{rec.line}: code {code} spells the same bytes as code {first} "
                                      f"(line {rows[first][0].line}); a dictionary lists each token once")
        spelled[pattern] = code
    codes = sorted(rows)
    return LZ78Dictionary(trie_from_tokens([rows[c][3] for c in codes]), np.array([0, *codes], np.int64))


def _read_lz78_fast(path: Path) -> LZ78Dictionary | None:
    """`read_lz78_tsv` on the compiled kernels; None where the file needs the plain reader's
    verdict (it raises the error, or reads what the scan does not take)."""
    from lockstep.tokenizer.lz78 import tsv_kernels as k

    try:
        buf = np.fromfile(path, np.uint8)
    except OSError:
        return None
    cap = int(np.count_nonzero(buf == 10)) + 1
    codes, parents, start = (np.empty(cap, np.int64) for _ in range(3))
    length, char_length = np.empty(cap, np.int32), np.empty(cap, np.int32)
    header = np.frombuffer("\t".join(LZ78_COLUMNS).encode(), np.uint8)
    r, ok = k.scan_lz78(buf, header, np.frombuffer(ESCAPED_MARKER.encode(), np.uint8), codes, parents, start, length,
                        char_length)
    if not ok or r == 0:
        return None
    codes, parents, start, length, char_length = codes[:r], parents[:r], start[:r], length[:r], char_length[:r]
    # Ids: the codes in ascending order. order[i] is the record of id i + 1.
    order = np.argsort(codes, kind="stable")
    source = codes[order]
    if (source[1:] == source[:-1]).any():
        return None  # a duplicate code
    at = np.searchsorted(source, parents)
    found = (parents == 0) | ((at < r) & (source[np.minimum(at, r - 1)] == parents))
    if not found.all():
        return None  # a parent no line defines
    parent_id = np.where(parents == 0, 0, at + 1).astype(np.int32)
    del codes, parents, at, found
    # Per id 0..N, the root first.
    parent = np.concatenate([[0], parent_id[order]]).astype(np.int32)
    start = np.concatenate([[0], start[order]])
    length = np.concatenate([[0], length[order]]).astype(np.int32)
    char_length = np.concatenate([[0], char_length[order]]).astype(np.int32)
    del parent_id, order
    if not k.patterns_follow_parents(buf, parent, start, length, char_length):
        return None  # a pattern that is not its parent's plus its char (this also rules out cycles)
    n = r
    ids = np.arange(n + 1, dtype=np.int64)
    insert_order = np.lexsort((ids[1:], length[1:])) + 1  # by length, then id
    skip = length[parent]  # a code's walk starts at its parent's node, past the parent's bytes
    max_nodes = n + int((char_length[1:].astype(np.int64) - 1).sum())
    trie_parent, last_byte, depth, ok = k.insert_tokens(buf, start, length, parent, skip, insert_order, max_nodes)
    if not ok:
        return None  # two codes spell the same bytes
    del buf, start, length, char_length, skip, insert_order
    return LZ78Dictionary(_prefixes_by_depth(trie_parent, last_byte, depth, n), np.concatenate([[0], source]))


class _LineWriter:
    """Dictionary lines written in batches: raw ones at once, escaped ones kept for the end of the
    file, below the marker."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.batch: list[bytes] = []
        self.escaped: list[bytes] = []

    def add(self, numbers: Sequence[int], fields: Sequence[bytes], positions: Sequence[int]) -> None:
        """One line: `numbers` and byte `fields`, the bytes going to columns `positions`."""
        columns: list[Any] = [str(x).encode() for x in numbers]
        if all(raw_writable(b) for b in fields):
            for pos, b in zip(positions, fields):
                columns.insert(pos, b)
            self.batch.append(b"\t".join(columns))
            if len(self.batch) >= WRITE_BATCH_LINES:
                self.flush()
        else:
            for pos, b in zip(positions, fields):
                columns.insert(pos, escape_bytes(b).encode("utf-8"))
            self.escaped.append(b"\t".join(columns))

    def flush(self) -> None:
        if self.batch:
            self.f.write(b"\n".join(self.batch) + b"\n")
            self.batch = []

    def close(self) -> None:
        self.flush()
        if self.escaped:
            self.f.write(f"{ESCAPED_MARKER} these lines write byte fields with \\\\ \\t \\n \\r \\xHH\n".encode())
            self.f.write(b"\n".join(self.escaped) + b"\n")


def _header(layout: str, columns: tuple[str, ...], n_codes: int, n_escaped: int) -> bytes:
    text = f"# LZ78 dictionary, {layout} layout, {n_codes} codes: {', '.join(columns)}; fields are raw UTF-8 text"
    if n_escaped:
        text += (f"\n# {n_escaped} lines hold a tab, a line break or bytes that are not UTF-8: they come last, below "
                 f"`{ESCAPED_MARKER}`, with escapes (a reader without them misreads only those)")
    return (text + "\n").encode()


def _needs_escape(fields: Sequence[bytes]) -> bool:
    return not all(raw_writable(b) for b in fields)


def _misread(pattern: bytes) -> bool:
    """Whether the reference, which reads escapes literally, gets other bytes for an escaped line's pattern."""
    return escape_bytes(pattern).encode("utf-8") != pattern


def _check_exact(path: str | os.PathLike[str], layout: str, n_escaped: int, n_misread: int, first: str,
                 exact: bool, fix: str) -> None:
    """Refuse (`exact`) or warn about an export with `n_escaped` lines that need escapes, the
    reference reading `n_misread` of their tokens with other bytes."""
    if not n_escaped:
        return
    what = (f"{n_escaped} {layout} line(s) go below `{ESCAPED_MARKER}`: their fields hold a tab, a line break or "
            f"bytes that are not whole UTF-8 characters (the first: {first}), which the reference's format cannot "
            "carry")
    if exact:
        raise LZ78ExportError(f"{path}: {what}, so the file would not interchange exactly; {fix}")
    log.warning("%s: %s, and the reference reads %d token(s) with other bytes; for a file that interchanges "
                "exactly, %s", path, what, n_misread, fix)


def write_lz78_tsv(path: str | os.PathLike[str], trie: LZ78Trie, *, exact: bool = False) -> None:
    """`trie`'s codes 1..N in the `lz78` layout, as they are numbered, each with its nearest
    ancestor code as parent; written atomically. Raw UTF-8 fields, except the lines that cannot be
    (see the module docstring), which go last below `# escaped:` with a warning that the
    reference misreads them; `exact` refuses those with LZ78ExportError instead (a portable
    dictionary has none). ValueError for a code that adds more than one character to its parent
    code (a prefix-open trie from a compressed dictionary): write that one with
    `write_compressed_tsv`, or close it first."""
    flat, offsets = trie.spell(fast=True)
    data = flat.tobytes()
    parents = trie.code_parents().tolist()
    bounds = offsets.tolist()

    def lines() -> Iterator[tuple[int, int, bytes, bytes]]:
        for c in range(1, trie.n_codes + 1):
            p = parents[c]
            pattern = data[bounds[c]:bounds[c + 1]]
            char = pattern[bounds[p + 1] - bounds[p]:] if p else pattern
            if not _one_symbol(char):
                raise ValueError(f"code {c} adds {_show(char)} to its parent code {p}: the lz78 layout holds one "
                                 "character (or byte) per code; write this dictionary with write_compressed_tsv, or "
                                 "close it first")
            yield c, p, char, pattern

    # Two passes, the first to count for the header, so that no line is held beyond a batch.
    escaped = [(c, pattern) for c, _, char, pattern in lines() if _needs_escape((char, pattern))]
    n_escaped = len(escaped)
    if escaped:
        _check_exact(path, "lz78", n_escaped, sum(_misread(pattern) for _, pattern in escaped),
                     f"code {escaped[0][0]}, {_show(escaped[0][1])}", exact, PORTABLE_FIX)
    with atomic_open(path) as f:
        f.write(_header("lz78", LZ78_COLUMNS, trie.n_codes, n_escaped))
        out = _LineWriter(f)
        for c, p, char, pattern in lines():
            out.add((c, p), (char, pattern), (2, 3))
        out.close()


# --- the compressed layout --------------------------------------------------------------------


def _common_prefix(a: bytes, b: bytes) -> bytes:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _common_character_prefix(a: bytes, b: bytes) -> bytes:
    """The longest common prefix of two UTF-8 strings that ends between characters."""
    n = len(_common_prefix(a, b))
    while 0 < n < len(a) and 0x80 <= a[n] < 0xC0:  # a[n] continues the character before it
        n -= 1
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
    def from_tokens(cls, tokens: Sequence[bytes], *, whole_characters: bool = False) -> CompressedDictionary:
        """The canonical Patricia trie of distinct non-empty byte strings, code c = tokens[c - 1].
        Its nodes are the root, the tokens, and the branching points, which are exactly the
        longest common prefixes of neighbours in sorted order; a node's parent is the longest
        other node that is a prefix of it. With `whole_characters` the tokens must be UTF-8 and
        the tree branches over characters instead of bytes (each common prefix cut back to a
        character boundary), so no label or pattern ends inside a character: the tree of a
        portable dictionary, which the reference's format carries exactly."""
        tokens = tuple(bytes(t) for t in tokens)
        if any(not t for t in tokens) or len(set(tokens)) != len(tokens):
            raise ValueError("a dictionary's tokens must be distinct and non-empty")
        if whole_characters:
            bad = next((c for c, t in enumerate(tokens, 1) if not _is_utf8(t)), None)
            if bad is not None:
                raise ValueError(f"token {bad} ({_show(tokens[bad - 1])}) is not whole UTF-8 characters, so no tree "
                                 f"over characters holds it; {PORTABLE_FIX}, or build the tree over bytes")
        ordered = sorted(tokens)
        common = _common_character_prefix if whole_characters else _common_prefix
        patterns = sorted({b"", *tokens, *(common(a, b) for a, b in zip(ordered, ordered[1:]))})
        node_of = {p: i for i, p in enumerate(patterns)}  # sorted, so a prefix comes before its extensions
        parent = [-1] + [next(node_of[p[:k]] for k in range(len(p) - 1, -1, -1) if p[:k] in node_of)
                         for p in patterns[1:]]
        code_of = {t: c for c, t in enumerate(tokens, 1)}
        return cls(tokens, np.array(parent, np.int32),
                   tuple(p[len(patterns[q]):] if q >= 0 else b"" for p, q in zip(patterns, parent)),
                   np.array([code_of.get(p, 0) for p in patterns], np.int32),
                   np.arange(len(tokens) + 1, dtype=np.int64))

    @classmethod
    def from_trie(cls, trie: LZ78Trie, *, whole_characters: bool = False) -> CompressedDictionary:
        """A trie's codes 1..N as tokens, codes unchanged, in their canonical Patricia trie (over
        characters with `whole_characters`, see `from_tokens`)."""
        flat, offsets = trie.spell(fast=True)
        data, bounds = flat.tobytes(), offsets.tolist()
        return cls.from_tokens([data[bounds[c]:bounds[c + 1]] for c in range(1, trie.n_codes + 1)],
                               whole_characters=whole_characters)

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

    def trie(self) -> LZ78Trie:
        """The tokens as an LZ78Trie, codes unchanged, with nodes past the codes for the byte
        prefixes that are no token (see `trie_from_tokens`)."""
        return trie_from_tokens(self.tokens)


def _output_code(path: Path, rec: _Record) -> int:
    """A compressed row's output_code: a positive integer, or NO_CODE for -1 or an empty field."""
    if rec.fields[3] == b"":
        return NO_CODE
    code = _int(path, rec, 3, "output_code", NO_CODE)
    if code == 0:
        raise LZ78DictionaryError(f"{path}:{rec.line}: output_code 0: token codes start at 1 (id 0 is the root); "
                                  f"renumber the codes from 1, or write {NO_CODE} for a node that is no token")
    return code


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
        code = _output_code(path, rec)
        pattern = _bytes(path, rec, 4, "pattern")
        if idx in rows:
            raise LZ78DictionaryError(f"{path}:{rec.line}: duplicate node_idx {idx} (first on line "
                                      f"{rows[idx][0].line}); each node appears on one line")
        if parent in (-1, idx):
            if label or pattern:
                raise LZ78DictionaryError(
                    f"{path}:{rec.line}: node {idx} has parent_idx {parent}, which only the root "
                    "may have, and it spells bytes; the root has an empty edge_label and pattern: "
                    "give this node its parent's node_idx"
                )
            if root is not None:
                raise LZ78DictionaryError(f"{path}:{rec.line}: a second root (parent_idx {parent}; the first is node "
                                          f"{root}); only the root has no parent: keep one root line")
            if code != NO_CODE:
                raise LZ78DictionaryError(f"{path}:{rec.line}: the root has output_code {code}; the root is no token: "
                                          f"write {NO_CODE} or leave it empty")
            root = idx
        elif not label:
            raise LZ78DictionaryError(f"{path}:{rec.line}: node {idx} has an empty edge_label; only the root may: "
                                      "give the node the bytes its edge adds")
        rows[idx] = (rec, label, parent, code, pattern)
    if not rows:
        raise _no_tokens(path)
    if root is None:
        raise LZ78DictionaryError(f"{path}: no root row; add a line with parent_idx -1, empty edge_label and "
                                  f"pattern, output_code {NO_CODE}")
    for idx, (rec, _, parent, _, _) in rows.items():
        if idx != root and parent not in rows:
            raise LZ78DictionaryError(f"{path}:{rec.line}: node {idx} has parent_idx {parent}, which no line defines; "
                                      "list the parent node, or give the root's node_idx")
    parent_of = {i: row[2] for i, row in rows.items() if i != root}
    order = _topological(sorted(parent_of), parent_of, root)
    if len(order) < len(parent_of):
        raise _cycle_error(
            path, "node", set(parent_of) - set(order), parent_of, {i: r[0].line for i, r in rows.items()}
        )

    codes: dict[int, int] = {}  # file output code -> node_idx
    node_of_pattern: dict[bytes, int] = {b"": root}
    spelled = {root: b""}
    for idx in order:
        rec, label, parent, code, pattern = rows[idx]
        want = spelled[parent] + label
        if pattern != want:
            raise LZ78DictionaryError(f"{path}:{rec.line}: pattern of node {idx} is {_show(pattern)} but its parent's "
                                      f"pattern + edge_label is {_show(want)}; fix either column")
        if want in node_of_pattern:
            raise LZ78DictionaryError(f"{path}:{rec.line}: node {idx} spells the same bytes as node "
                                      f"{node_of_pattern[want]} (line {rows[node_of_pattern[want]][0].line}); a trie "
                                      "lists each string once")
        node_of_pattern[want] = idx
        spelled[idx] = want
        if code != NO_CODE:
            if code in codes:
                raise LZ78DictionaryError(f"{path}:{rec.line}: output_code {code} is also node {codes[code]}'s "
                                          f"(line {rows[codes[code]][0].line}); each code names one token")
            codes[code] = idx
    if not codes:
        raise _no_tokens(path)
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


def write_compressed_tsv(path: str | os.PathLike[str], dictionary: CompressedDictionary, *,
                         exact: bool = False) -> None:
    """`dictionary` in the `compressed` layout: its nodes and codes as they are (-1 for no code);
    written atomically. Raw UTF-8 fields, except the lines that cannot be (a token or a label
    that splits a character, say), which go last below `# escaped:` with a warning; `exact`
    refuses those with LZ78ExportError instead. A portable dictionary in the tree
    `CompressedDictionary.from_trie(trie, whole_characters=True)` has none."""
    rows: list[tuple[int, int, int, bytes, bytes]] = []
    spelled: list[bytes] = []
    escaped: list[int] = []
    for i, (p, label, code) in enumerate(zip(dictionary.node_parent.tolist(), dictionary.node_label,
                                             dictionary.node_code.tolist())):
        spelled.append(spelled[p] + label if p >= 0 else b"")
        if _needs_escape((label, spelled[i])):
            escaped.append(i)
        rows.append((i, p, code or NO_CODE, label, spelled[i]))
    n_escaped = len(escaped)
    if escaped:
        # Tokens whose own bytes cannot be raw; other lines only have a label that splits a character.
        bad_tokens = [i for i in escaped if rows[i][2] != NO_CODE and not raw_writable(spelled[i])]
        first = bad_tokens[0] if bad_tokens else escaped[0]
        fix = PORTABLE_FIX if bad_tokens else (
            "every token can be written raw, but a node's edge label splits a character: build the tree with "
            "CompressedDictionary.from_trie(trie, whole_characters=True)")
        _check_exact(path, "compressed", n_escaped, sum(_misread(spelled[i]) for i in bad_tokens),
                     f"node {first}, {_show(spelled[first])}", exact, fix)
    with atomic_open(path) as f:
        f.write(_header("compressed", COMPRESSED_COLUMNS, dictionary.n_codes, n_escaped))
        out = _LineWriter(f)
        for i, p, code, label, pattern in rows:
            out.add((i, p, code), (label, pattern), (1, 4))
        out.close()
