"""LZ78 TSV interchange: field escapes for every byte value, hand-written files in both layouts
parsed to the expected trie, metadata and ancestor chains, export -> import identity on trained
tries (hypothesis), and malformed files rejected with their line number."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.tokenizer.lz78_trie import ancestor_chains, train_lz78
from lockstep.tokenizer.lz78_tsv import (
    CompressedDictionary,
    LZ78DictionaryError,
    escape_bytes,
    read_compressed_tsv,
    read_lz78_tsv,
    unescape_field,
    write_compressed_tsv,
    write_lz78_tsv,
)


def write(tmp_path, text: str, name: str = "dict.tsv"):
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
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
    # Ascending codes, except 40 waits for its parent 50.
    assert d.source_codes.tolist() == [0, 10, 20, 30, 50, 40, 60]
    assert trie.parent.tolist() == [0, 0, 0, 1, 2, 4, 3]
    assert trie.last_byte.tolist() == [0, ord("a"), 9, ord("b"), 0xC3, 0xFF, ord("\\")]
    assert [trie.token_bytes(c) for c in range(1, 7)] == [b"a", b"\t", b"ab", b"\t\xc3", b"\t\xc3\xff", b"ab\\"]
    chains, depths = ancestor_chains(trie.parent)
    assert chains.tolist() == [[0, 0, 0], [1, 0, 0], [2, 0, 0], [3, 1, 0], [4, 2, 0], [5, 4, 2], [6, 3, 1]]
    assert depths.tolist() == [0, 1, 1, 2, 2, 3, 3]
    # Written back, codes are 1..N and the file reads as the same trie.
    write_lz78_tsv(tmp_path / "out.tsv", trie)
    again = read_lz78_tsv(tmp_path / "out.tsv")
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
    # The prefix closure adds a, ab before abxyz's chain; tokens keep their bytes.
    trie, code_map = d.closed_trie()
    assert [trie.token_bytes(c) for c in range(1, trie.n_codes + 1)] == [b"a", b"ab", b"abx", b"abxy", b"abxyz", b"q"]
    assert code_map.tolist() == [0, 5, 3, 4, 6]
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
    tmp = tmp_path_factory.mktemp("rt")
    write_lz78_tsv(tmp / "a.tsv", trie)
    d = read_lz78_tsv(tmp / "a.tsv")
    assert np.array_equal(d.trie.parent, trie.parent) and np.array_equal(d.trie.last_byte, trie.last_byte)
    compressed = CompressedDictionary.from_trie(trie)
    write_compressed_tsv(tmp / "b.tsv", compressed)
    c = read_compressed_tsv(tmp / "b.tsv")
    assert c.tokens == compressed.tokens
    assert np.array_equal(c.parent(), trie.parent) and np.array_equal(c.hier_parent(), trie.parent)
    assert np.array_equal(c.last_byte(), trie.last_byte)
    closed, code_map = c.closed_trie()
    assert np.array_equal(closed.parent, trie.parent) and np.array_equal(closed.last_byte, trie.last_byte)
    assert code_map.tolist() == list(range(trie.n_codes + 1))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=8).map(lambda b: bytes(x % 4 + 250 for x in b)), unique=True,
                max_size=30))
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
    trie, code_map = again.closed_trie()
    assert [trie.token_bytes(int(c)) for c in code_map[1:]] == list(tokens)
    brute = [max((j for j, u in enumerate(tokens, 1) if len(u) < len(t) and t.startswith(u)),
                 key=lambda j: len(tokens[j - 1]), default=0) for t in tokens]
    assert again.parent().tolist() == [0, *brute] == again.hier_parent().tolist()


@pytest.mark.parametrize("body, line, message", [
    ("1\t0\ta\n2\t1\tb\n", 1, "3 tab-separated columns"),
    ("1\t0\ta\ta\n2\t7\tb\tab\n", 2, "parent_code 7, which no line defines"),
    ("1\t0\ta\ta\n1\t0\tb\tb\n", 2, "duplicate code 1 \\(first on line 2\\)"),
    ("1\t0\ta\ta\n2\t3\tb\tab\n3\t2\tc\tabc\n", 2, "parent cycle \\(2 -> 3 -> 2\\)"),
    ("1\t0\ta\ta\n2\t0\ta\ta\n", 2, "same bytes as code 1"),
    ("1\t0\ta\ta\n2\t1\tb\tax\n", 2, "pattern of code 2"),
    ("1\t0\tab\tab\n", 1, "2 bytes"),
    ("1\t0\t\\z\tz\n", 1, "bad escape"),
    ("x\t0\ta\ta\n", 1, "code 'x' is not an integer"),
])
def test_lz78_layout_rejects(tmp_path, body, line, message):
    path = write(tmp_path, "# header comment\n" + body)
    with pytest.raises(LZ78DictionaryError, match=f"dict.tsv:{line + 1}: .*{message}"):
        read_lz78_tsv(path)


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
])
def test_compressed_layout_rejects(tmp_path, body, line, message):
    path = write(tmp_path, "# header comment\n" + body)
    with pytest.raises(LZ78DictionaryError, match=f"dict.tsv:{line + 1}: .*{message}"):
        read_compressed_tsv(path)


def test_compressed_layout_needs_a_root(tmp_path):
    with pytest.raises(LZ78DictionaryError, match="dict.tsv: no root row"):
        read_compressed_tsv(write(tmp_path, "1\ta\t0\t1\ta\n"))
