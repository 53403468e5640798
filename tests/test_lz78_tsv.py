"""LZ78 TSV interchange: field escapes for every byte value, hand-written files in both layouts
parsed to the expected trie, metadata and ancestor chains, export -> import identity on trained
tries (hypothesis), malformed files rejected with their line number and the fix, the fast reader
against the plain one on random and damaged files, and dictionary paths resolved before use."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lockstep.tokenizer.lz78.train import from_dictionary, train_lz78
from lockstep.tokenizer.lz78.trie import ancestor_chains
from lockstep.tokenizer.lz78.tsv import (
    CompressedDictionary,
    LZ78DictionaryError,
    dictionary_layout,
    escape_bytes,
    read_compressed_tsv,
    read_lz78_tsv,
    unescape_field,
    write_compressed_tsv,
    write_lz78_tsv,
)


def write(tmp_path, text: str | bytes, name: str = "dict.tsv"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return path


def test_escape_every_byte_and_known_forms():
    for b in range(256):
        field = escape_bytes(bytes([b]))
        assert not set(field) & {"\t", "\n", "\r"}
        assert unescape_field(field) == bytes([b])
    everything = bytes(range(256)) + "é€😀".encode()
    assert unescape_field(escape_bytes(everything)) == everything
    assert escape_bytes(b"a\tb\\c\n\r\x00\x7f") == "a\\tb\\\\c\\n\\r\\x00\\x7f"
    # Whole UTF-8 characters stay readable; a lone lead byte (a token cut mid-character) does not.
    assert escape_bytes("é".encode()) == "é"
    assert escape_bytes(b"\xc3") == "\\xc3"
    assert unescape_field("\\xC3\\xa9") == "é".encode()
    with pytest.raises(ValueError, match="bad escape"):
        unescape_field("a\\q")
    with pytest.raises(ValueError, match="bad escape"):
        unescape_field("\\x4")


# The column names as first record: the escaped form lockstep once wrote, still read with escapes.
LZ78_FILE = """# from some LZ78 tool
code\tparent_code\tchar\tpattern
0\t0\t\t
10\t0\ta\ta
20\t0\t\\t\t\\t
30\t10\tb\tab
# the parent of 40 comes later in the file and has a larger code
40\t50\t\\xff\t\\t\\xc3\\xff
50\t20\t\\xc3\t\\t\\xc3

60\t30\t\\\\\tab\\\\
"""


def test_lz78_layout_by_hand(tmp_path):
    d = read_lz78_tsv(write(tmp_path, LZ78_FILE))
    trie = d.trie
    # Ids are the codes in ascending order, whatever the parents' order.
    assert d.source_codes.tolist() == [0, 10, 20, 30, 40, 50, 60]
    assert trie.n_codes == trie.n_nodes == 6
    assert trie.parent.tolist() == [0, 0, 0, 1, 5, 2, 3]
    assert trie.last_byte.tolist() == [0, ord("a"), 9, ord("b"), 0xFF, 0xC3, ord("\\")]
    assert [trie.token_bytes(c) for c in range(1, 7)] == [b"a", b"\t", b"ab", b"\t\xc3\xff", b"\t\xc3", b"ab\\"]
    chains, depths = ancestor_chains(trie.parent)
    assert chains.tolist() == [[0, 0, 0], [1, 0, 0], [2, 0, 0], [3, 1, 0], [4, 5, 2], [5, 2, 0], [6, 3, 1]]
    assert depths.tolist() == [0, 1, 1, 2, 3, 2, 3]
    # Written back, codes are 1..N and the file reads as the same trie, on either path.
    write_lz78_tsv(tmp_path / "out.tsv", trie)
    for fast in (False, True):
        again = read_lz78_tsv(tmp_path / "out.tsv", fast=fast)
        assert again.trie.parent.tolist() == trie.parent.tolist()
        assert again.trie.last_byte.tolist() == trie.last_byte.tolist()
        assert again.source_codes.tolist() == list(range(7))


# Not prefix-closed ("a" and "ab" are no tokens; "ab" is a branch node without a code), and not
# canonical: the token "abxyz" hangs off the root instead of below "abxy".
COMPRESSED_FILE = """node_idx\tedge_label\tparent_idx\toutput_code\tpattern
0\t\t-1\t-1\t
# node 5 is listed before its parent 7
5\ty\t7\t9\tabxy
3\tab\t0\t-1\tab
7\tx\t3\t4\tabx
8\tabxyz\t0\t2\tabxyz
9\tq\t0\t11\tq
"""


def test_compressed_layout_by_hand(tmp_path):
    d = read_compressed_tsv(write(tmp_path, COMPRESSED_FILE))
    # Output codes 2, 4, 9, 11 -> 1..4 in ascending order.
    assert d.source_codes.tolist() == [0, 2, 4, 9, 11]
    assert d.tokens == (b"abxyz", b"abx", b"abxy", b"q")
    # Nodes: root, then the smallest node_idx whose parent is placed: 3, 7, 5, 8, 9.
    assert d.node_parent.tolist() == [-1, 0, 1, 2, 0, 0]
    assert d.node_label == (b"", b"ab", b"x", b"y", b"abxyz", b"q")
    assert d.node_code.tolist() == [0, 0, 2, 3, 1, 4]
    # abxyz: longest token prefix is abxy (3), but in this tree its nearest coded ancestor is none.
    assert d.parent().tolist() == [0, 3, 0, 2, 0]
    assert d.hier_parent().tolist() == [0, 0, 0, 2, 0]
    assert d.last_byte().tolist() == [0, ord("z"), ord("x"), ord("y"), ord("q")]
    chains, depths = d.ancestor_chains()
    assert chains.tolist() == [[0, 0, 0], [1, 3, 2], [2, 0, 0], [3, 2, 0], [4, 0, 0]]
    assert depths.tolist() == [0, 3, 1, 2, 1]
    hchains, hdepths = d.ancestor_chains(hierarchical=True)
    assert hchains.tolist() == [[0, 0], [1, 0], [2, 0], [3, 2], [4, 0]]
    assert hdepths.tolist() == [0, 1, 1, 2, 1]
    # As a trie the tokens keep their codes; a and ab are nodes 5 and 6, prefixes but no codes.
    trie = d.trie()
    assert (trie.n_codes, trie.n_nodes) == (4, 6)
    assert [trie.token_bytes(c) for c in range(1, 5)] == list(d.tokens)
    assert trie.parent.tolist() == [0, 3, 6, 2, 0, 0, 5] and bytes(trie.last_byte[5:].tolist()) == b"ab"
    assert trie.code_parents().tolist() == d.parent().tolist()
    closed = trie.closed()
    assert closed.n_codes == 6 and [closed.token_bytes(c) for c in (5, 6)] == [b"a", b"ab"]
    # The canonical tree of the same tokens puts every token prefix on the path: parents agree.
    canonical = CompressedDictionary.from_tokens(d.tokens)
    assert canonical.hier_parent().tolist() == canonical.parent().tolist() == d.parent().tolist()
    write_compressed_tsv(tmp_path / "out.tsv", d)
    again = read_compressed_tsv(tmp_path / "out.tsv")
    assert again.tokens == d.tokens
    assert again.hier_parent().tolist() == d.hier_parent().tolist()
    assert again.node_parent.tolist() == d.node_parent.tolist() and again.node_label == d.node_label


small_alphabet = st.binary(max_size=80).map(lambda b: bytes(x % 3 + 97 for x in b))
documents = st.lists(st.one_of(small_alphabet, st.binary(max_size=60)), max_size=6)


@settings(max_examples=60, deadline=None)
@given(documents, st.integers(1, 200), st.sampled_from(["standard", "frequency_gated", "multi_round"]))
def test_export_import_identity(tmp_path_factory, docs, max_codes, strategy):
    trie = train_lz78(docs, max_codes, strategy=strategy, gate_period_phrases=8).trie
    assume(trie.n_codes > 0)  # an empty dictionary is refused on reading (test_edges_of_input)
    tmp = tmp_path_factory.mktemp("rt")
    write_lz78_tsv(tmp / "a.tsv", trie)
    for fast in (False, True):
        d = read_lz78_tsv(tmp / "a.tsv", fast=fast)
        assert np.array_equal(d.trie.parent, trie.parent) and np.array_equal(d.trie.last_byte, trie.last_byte)
    compressed = CompressedDictionary.from_trie(trie)
    write_compressed_tsv(tmp / "b.tsv", compressed)
    c = read_compressed_tsv(tmp / "b.tsv")
    assert c.tokens == compressed.tokens
    assert np.array_equal(c.parent(), trie.parent) and np.array_equal(c.hier_parent(), trie.parent)
    assert np.array_equal(c.last_byte(), trie.last_byte)
    again = c.trie()
    assert np.array_equal(again.parent, trie.parent) and np.array_equal(again.last_byte, trie.last_byte)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=8).map(lambda b: bytes(x % 4 + 250 for x in b)), unique=True,
                min_size=1, max_size=30))
def test_compressed_round_trip_any_token_set(tmp_path_factory, tokens):
    d = CompressedDictionary.from_tokens(tokens)
    # A canonical Patricia trie: no node without a code has fewer than two children.
    n_children = np.bincount(d.node_parent[1:], minlength=len(d.node_label))
    assert all(n_children[i] >= 2 for i in range(1, len(d.node_label)) if not d.node_code[i])
    path = tmp_path_factory.mktemp("rt") / "c.tsv"
    write_compressed_tsv(path, d)
    again = read_compressed_tsv(path)
    assert again.tokens == d.tokens and again.node_label == d.node_label
    assert np.array_equal(again.node_parent, d.node_parent) and np.array_equal(again.node_code, d.node_code)
    trie = again.trie()
    assert [trie.token_bytes(c) for c in range(1, trie.n_codes + 1)] == list(tokens)
    brute = [max((j for j, u in enumerate(tokens, 1) if len(u) < len(t) and t.startswith(u)),
                 key=lambda j: len(tokens[j - 1]), default=0) for t in tokens]
    assert again.parent().tolist() == [0, *brute] == again.hier_parent().tolist() == trie.code_parents().tolist()


@pytest.mark.parametrize("body, line, message", [
    ("1\t0\ta\n2\t1\tb\n", 1, "3 tab-separated columns"),
    ("1\t0\ta\ta\n2\t7\tb\tab\n", 2, "parent_code 7, which no line defines"),
    ("1\t0\ta\ta\n1\t0\tb\tb\n", 2, "duplicate code 1 \\(first on line 2\\)"),
    ("1\t0\ta\ta\n2\t3\tb\tab\n3\t2\tc\tabc\n", 2, "parent cycle \\(2 -> 3 -> 2\\)"),
    ("1\t0\ta\ta\n2\t0\ta\ta\n", 2, "same bytes as code 1"),
    ("1\t0\ta\ta\n2\t1\tb\tax\n", 2, "pattern of code 2"),
    ("1\t0\tab\tab\n", 1, "char of code 1 is 'ab'; an LZ78 code adds one character"),
    ("1\t0\t\t\n", 1, "char of code 1 is ''"),
    ("# escaped: from here\n1\t0\t\\z\tz\n", 2, "bad escape"),
    ("1\t0\ta\ta\r\n2\t1\tb\rc\tab\n", 2, "carriage return inside the line"),
    (b"1\t0\ta\ta\n2\t1\t\xe9\ta\xe9\n", 2, "not UTF-8 at byte 4"),
    ("x\t0\ta\ta\n", 1, "code 'x' is not an integer"),
    ("-3\t0\ta\ta\n", 1, "code '-3' is outside 0..2\\^63-1"),
    ("9223372036854775808\t0\ta\ta\n", 1, "code '9223372036854775808' is outside 0..2\\^63-1"),
    ("1\t" + "7" * 10_000 + "\ta\ta\n", 1, "parent_code '7777.*\\.\\.\\. \\(10000 bytes\\) is outside"),
    ("0\t0\ta\ta\n", 1, "code 0 is the root"),
])
def test_lz78_layout_rejects(tmp_path, body, line, message):
    path = write(tmp_path, b"# header comment\n" + (body if isinstance(body, bytes) else body.encode()))
    for fast in (False, True):
        with pytest.raises(LZ78DictionaryError, match=f"dict.tsv:{line + 1}: .*{message}"):
            read_lz78_tsv(path, fast=fast)


ROOT = "0\t\t-1\t-1\t\n"


@pytest.mark.parametrize("body, line, message", [
    (ROOT + "1\ta\t0\t1\n", 2, "4 tab-separated columns"),
    (ROOT + "1\ta\t5\t1\ta\n", 2, "parent_idx 5, which no line defines"),
    (ROOT + "1\ta\t0\t1\ta\n1\tb\t0\t2\tb\n", 3, "duplicate node_idx 1"),
    (ROOT + "1\ta\t2\t1\ta\n2\tb\t1\t2\tb\n", 2, "parent cycle \\(1 -> 2 -> 1\\)"),
    (ROOT + "1\ta\t0\t1\ta\n2\tb\t0\t1\tb\n", 3, "output_code 1 is also node 1's"),
    (ROOT + "1\ta\t0\t1\ta\n2\tb\t1\t2\tb\n", 3, "pattern of node 2"),
    (ROOT + "1\t\t0\t1\t\n", 2, "empty edge_label"),
    (ROOT + "1\t\t-1\t-1\t\n", 2, "second root"),
    (ROOT + "1\t\t1\t\t\n", 2, "second root"),
    (ROOT + "1\ta\t1\t1\ta\n", 2, "node 1 has parent_idx 1, which only the root may have"),
    (ROOT + "1\ta\t0\t0\ta\n", 2, "output_code 0: token codes start at 1"),
    (ROOT + "1\ta\t0\t" + "9" * 10_000 + "\ta\n", 2, "output_code '9999.* is outside -1..2\\^63-1"),
    ("0\t\t-1\t5\t\n", 1, "the root has output_code 5"),
])
def test_compressed_layout_rejects(tmp_path, body, line, message):
    path = write(tmp_path, "# header comment\n" + body)
    with pytest.raises(LZ78DictionaryError, match=f"dict.tsv:{line + 1}: .*{message}"):
        read_compressed_tsv(path)


def test_compressed_layout_needs_a_root(tmp_path):
    with pytest.raises(LZ78DictionaryError, match="dict.tsv: no root row"):
        read_compressed_tsv(write(tmp_path, "1\ta\t0\t1\ta\n"))


# --- the fast reader against the plain one -----------------------------------------------------------

SYMBOLS = [b"a", b"b", "é".encode(), b"\\", "🙂".encode(), b"\t", b"\n", b"\xff", b"\x0b"]


@st.composite
def lz78_files(draw) -> bytes:
    """An lz78-layout file, usually well formed (random codes and parents, raw and escaped lines,
    comments, CRLF, a root line), sometimes with one byte changed, deleted or a line repeated."""
    from lockstep.tokenizer.lz78.tsv import raw_writable

    n = draw(st.integers(1, 14))
    codes = draw(st.lists(st.integers(1, 10**18), min_size=n, max_size=n, unique=True))
    tokens: dict[int, bytes] = {0: b""}
    lines: list[tuple[bytes, ...]] = []
    for code in codes:
        parent = draw(st.sampled_from([0, *tokens]))
        char = draw(st.sampled_from(SYMBOLS))
        if any(tokens[parent] + char == t for t in tokens.values()):
            continue
        tokens[code] = tokens[parent] + char
        lines.append((str(code).encode(), str(parent).encode(), char, tokens[code]))
    legacy = draw(st.booleans())
    raw, escaped = [], []
    for line in draw(st.permutations(lines)):
        if not legacy and all(raw_writable(f) for f in line[2:]):
            raw.append(b"\t".join(line))
        else:
            escaped.append(b"\t".join([*line[:2], *(escape_bytes(f).encode() for f in line[2:])]))
    body = [b"# a comment", b"code\tparent_code\tchar\tpattern" if legacy else b"", b"0\t0\t\t"][
        : draw(st.integers(0, 3))
    ]
    body += raw + ([] if legacy else [b"# escaped: below"]) + escaped
    eol = draw(st.sampled_from([b"\n", b"\r\n"]))
    data = eol.join(body) + eol
    change = draw(st.sampled_from(["none", "none", "replace", "delete", "repeat"]))
    if change != "none" and data:
        at = draw(st.integers(0, len(data) - 1))
        if change == "replace":
            new = draw(st.sampled_from([b"\t", b"\r", b"\n", b"\\", b"0", b"9", b"-", b"\xc3", b"a", b"#"]))
            data = data[:at] + new + data[at + 1:]
        elif change == "delete":
            data = data[:at] + data[at + 1:]
        else:
            line = data.split(b"\n")[draw(st.integers(0, data.count(b"\n")))]
            data += line + b"\n"
    return data


@settings(max_examples=400, deadline=None)
@given(lz78_files())
def test_fast_reader_equals_the_plain_reader(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fast") / "d.tsv"
    path.write_bytes(data)
    outcomes = []
    for fast in (False, True):
        try:
            d = read_lz78_tsv(path, fast=fast)
            outcomes.append(
                (d.trie.parent.tolist(), d.trie.last_byte.tolist(), d.trie.n_codes, d.source_codes.tolist())
            )
        except LZ78DictionaryError as e:
            outcomes.append(str(e))
    assert outcomes[0] == outcomes[1]


def test_edges_of_input(tmp_path):
    # Header-only files, an empty one, a folder and a missing file: one error naming the file.
    lz78_readers = (read_lz78_tsv, lambda p: read_lz78_tsv(p, fast=True), from_dictionary)
    for name, text, readers in (("header.tsv", "# lz78\ncode\tparent_code\tchar\tpattern\n", lz78_readers),
                                ("empty.tsv", "", lz78_readers), ("root.tsv", "0\t0\t\t\n", lz78_readers),
                                ("branches.tsv", "0\t\t-1\t-1\t\n1\ta\t0\t-1\ta\n",
                                 (read_compressed_tsv, from_dictionary))):
        path = write(tmp_path, text, name)
        for read in readers:
            with pytest.raises(LZ78DictionaryError, match=f"{name}: no dictionary lines with a code"):
                read(path)
    for path, why in ((tmp_path / "missing.tsv", "No such file or directory"), (tmp_path, "Is a directory")):
        for read in (read_lz78_tsv, lambda p: read_lz78_tsv(p, fast=True), read_compressed_tsv, dictionary_layout):
            with pytest.raises(LZ78DictionaryError, match=f"{path.name}: cannot read the dictionary \\({why}\\)"):
                read(path)
    with pytest.raises(LZ78DictionaryError, match="first data line has 3 tab-separated columns"):
        dictionary_layout(write(tmp_path, "# c\n1\t0\ta\n"))


def test_project_dictionary_resolves_links_first(tmp_path):
    from lockstep.tokenizer.lz78.train import project_dictionary

    folder = tmp_path / "corpus" / "dictionaries"
    folder.mkdir(parents=True)
    (folder / "mine.tsv").write_text("1\t0\ta\ta\n")
    outside = tmp_path / "secret.tsv"
    outside.write_text("1\t0\tb\tb\n")
    outside.chmod(0)  # even a file the user cannot read is refused before it is opened
    (folder / "link.tsv").symlink_to(outside)
    (folder / "inner.tsv").symlink_to(folder / "mine.tsv")
    (folder / "sub").mkdir()
    assert project_dictionary(tmp_path, "corpus/dictionaries/mine.tsv") == (folder / "mine.tsv").resolve()
    assert project_dictionary(tmp_path, "corpus/dictionaries/inner.tsv") == (folder / "mine.tsv").resolve()
    for name, message in (
        ("link.tsv", "resolves to .*secret.tsv \\(through a link\\), outside corpus/dictionaries/; copy"),
        ("missing.tsv", "no such file; copy the dictionary into corpus/dictionaries/"),
        ("sub", "is a folder; name a TSV dictionary file"),
    ):
        with pytest.raises(LZ78DictionaryError, match=message):
            project_dictionary(tmp_path, f"corpus/dictionaries/{name}")


def test_the_lz78_layout_refuses_a_code_that_adds_several_characters(tmp_path):
    from lockstep.tokenizer.lz78.tsv import trie_from_tokens

    trie = trie_from_tokens([b"abc", b"a"])  # abc adds "bc" to a; ab is a prefix node, no code
    with pytest.raises(ValueError, match="code 1 adds 'bc' to its parent code 2: .*write_compressed_tsv, or close"):
        write_lz78_tsv(tmp_path / "d.tsv", trie)
    assert not (tmp_path / "d.tsv").exists()
    write_lz78_tsv(tmp_path / "d.tsv", trie.closed())
    again = read_lz78_tsv(tmp_path / "d.tsv", fast=True).trie
    assert [again.token_bytes(c) for c in (1, 2, 3)] == [b"abc", b"a", b"ab"]
