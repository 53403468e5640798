"""Dictionaries that travel between lockstep and the reference LZ78 tokenizer. An independent
reader written here from the reference's documented rules (not from lockstep's code) reads
lockstep's exports, and lockstep reads files written the reference's way: the ids of a text agree
both ways. The reference's own file shapes (raw backslashes, character-level codes, its compressed
root row, a parent listed with a larger code) keep their ids, and the round trip is measured on
tiny Shakespeare when the shared fixtures are present."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lockstep.tokenizer.lz78 import LZ78Tokenizer
from lockstep.tokenizer.lz78.train import from_dictionary, train_lz78
from lockstep.tokenizer.lz78.train import train as train_lz78_tokenizer
from lockstep.tokenizer.lz78.tsv import (
    CompressedDictionary,
    LZ78ExportError,
    read_lz78_tsv,
    write_compressed_tsv,
    write_lz78_tsv,
)

# The documented comment line below which byte fields use escapes (docs/tokenizers.md, "LZ78").
ESCAPED_MARKER = "# escaped:"

# --- the reference's rules -------------------------------------------------------------------
# As its documentation and `from_tsv` describe them: the file is UTF-8 text read line by line
# (Python's text mode, so \n, \r\n and a lone \r all end a line); `#` lines and empty lines are
# skipped; fields split on tabs. lz78: the code is the first field and the token is the last
# field's UTF-8 bytes; codes listed as 1..N in file order are the ids, any other set of codes is
# ranked in ascending order. compressed: the token code is the fourth field (empty: none), only
# codes above 0 are tokens, and the codes are the ids. Ids past the largest code: byte b falls back
# to max + 1 + b. Encoding: from each position, the longest token that matches, else the fallback
# of one byte.


def reference_tokens(path: Path, layout: str) -> dict[int, bytes]:
    """id -> token bytes, as the reference's rules read `path`."""
    rows: list[tuple[int, bytes]] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line or line.startswith("#"):
                continue
            fields = line.split("\t")
            if layout == "lz78":
                rows.append((int(fields[0]), fields[-1].encode("utf-8")))
            elif fields[3] and int(fields[3]) > 0:
                rows.append((int(fields[3]), fields[-1].encode("utf-8")))
    codes = [code for code, _ in rows]
    if layout == "compressed" or codes == list(range(1, len(codes) + 1)):
        return dict(rows)
    rank = {code: i for i, code in enumerate(sorted(set(codes)), 1)}
    return {rank[code]: token for code, token in rows}


def reference_encode(tokens: dict[int, bytes], data: bytes) -> list[int]:
    """Greedy longest match among `tokens`, a byte no token starts with as max id + 1 + byte."""
    fallback = max(tokens) + 1
    id_of = {token: i for i, token in tokens.items()}
    stems = {token[:k] for token in tokens.values() for k in range(1, len(token) + 1)}
    out, i = [], 0
    while i < len(data):
        best, end, j = fallback + data[i], i + 1, i + 1
        while j <= len(data) and data[i:j] in stems:
            if data[i:j] in id_of:
                best, end = id_of[data[i:j]], j
            j += 1
        out.append(best)
        i = end
    return out


TEXTS = [
    "The cat sat on the mat.\tThe hat sat back\\n there: été, ©, naïve; 🙂 and 漢字.\r\nagain\n",
    "ab aab abab \\\\ \\n \\x41 a\x0bb\x00c # not a comment",
    "",
]


def write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode("utf-8"))
    return path


def assert_same_ids(tok: LZ78Tokenizer, tokens: dict[int, bytes], texts: list[str] = TEXTS) -> None:
    for text in texts:
        assert tok.encode(text) == reference_encode(tokens, text.encode("utf-8")), text


# --- lockstep's export, read by the reference's rules ---------------------------------------------

# Backslashes, quotes, a vertical tab and a NUL but no tab, line break or non-ASCII byte: every
# token can be written raw, so the reference reads the whole file exactly.
PRINTABLE_DOCS = [
    b"a\\b\\\\c \\n \\x41 'q' \"r\" a\x0bb\x00c " * 3,
    b"the cat sat on the mat; the hat sat back \\t" * 4,
]


def test_export_is_read_by_the_reference_rules(tmp_path: Path) -> None:
    trie = train_lz78(PRINTABLE_DOCS, 120).trie
    write_lz78_tsv(tmp_path / "d.tsv", trie)
    lines = (tmp_path / "d.tsv").read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("#") and "raw UTF-8" in lines[0]
    assert not any(line.startswith(ESCAPED_MARKER) for line in lines)  # nothing needed escapes
    tokens = reference_tokens(tmp_path / "d.tsv", "lz78")  # no header line stops it
    assert tokens == {c: trie.token_bytes(c) for c in range(1, trie.n_codes + 1)}
    assert sum(b"\\" in t for t in tokens.values()) >= 5 and any(b"\x0b" in t for t in tokens.values())
    assert_same_ids(LZ78Tokenizer(trie), tokens)


def test_only_unwritable_tokens_are_escaped_and_they_come_last(tmp_path: Path) -> None:
    # Trained on bytes, the trie has tokens with a newline, a tab, a CR and the first byte of é.
    docs = ["a\\b\tc\nd\re é è ü \x0b".encode() * 4, b"plain words with a \\ backslash " * 3]
    trie = train_lz78(docs, 200).trie
    write_lz78_tsv(tmp_path / "d.tsv", trie)
    lines = (tmp_path / "d.tsv").read_bytes().split(b"\n")
    marker = next(i for i, line in enumerate(lines) if line.startswith(ESCAPED_MARKER.encode()))
    assert b"below `# escaped:`" in lines[1]  # the header says where and why

    def unwritable(token: bytes) -> bool:
        try:
            token.decode("utf-8")
        except UnicodeDecodeError:
            return True
        return any(c in token for c in b"\t\n\r")

    def fields(c: int) -> tuple[bytes, bytes]:  # (char, pattern): a byte-level code adds one byte
        return trie.token_bytes(c)[-1:], trie.token_bytes(c)

    above = {int(line.split(b"\t")[0]) for line in lines[:marker] if line and not line.startswith(b"#")}
    below = {int(line.split(b"\t")[0]) for line in lines[marker + 1:] if line}
    codes = range(1, trie.n_codes + 1)
    assert below == {c for c in codes if any(map(unwritable, fields(c)))} and below and above | below == set(codes)
    # The reference's rules read every line above the marker exactly; lockstep reads all of it.
    tokens = reference_tokens(tmp_path / "d.tsv", "lz78")
    assert all(tokens[c] == trie.token_bytes(c) for c in above)
    for fast in (False, True):
        again = read_lz78_tsv(tmp_path / "d.tsv", fast=fast).trie
        assert np.array_equal(again.parent, trie.parent) and np.array_equal(again.last_byte, trie.last_byte)


def test_compressed_export_is_read_by_the_reference_rules(tmp_path: Path) -> None:
    trie = train_lz78(PRINTABLE_DOCS, 120).trie
    write_compressed_tsv(tmp_path / "c.tsv", CompressedDictionary.from_trie(trie))
    tokens = reference_tokens(tmp_path / "c.tsv", "compressed")
    assert tokens == {c: trie.token_bytes(c) for c in range(1, trie.n_codes + 1)}
    assert_same_ids(from_dictionary(tmp_path / "c.tsv"), tokens)


# --- files written the reference's way, read by lockstep ------------------------------------------

REFERENCE_FILES = {
    # A backslash is a backslash: `\n` here is two bytes, not a newline.
    "raw backslash": ("lz78", "1\t0\t\\\t\\\n2\t1\tn\t\\n\n3\t0\tn\tn\n4\t0\ta\ta\n5\t4\t\\\ta\\\n6\t1\t\\\t\\\\\n"),
    # Codes that add one character, é being two bytes; the file has no code for é's first byte.
    "character level": ("lz78", "# code\tparent_code\tchar\tpattern\n1\t0\té\té\n2\t0\tt\tt\n3\t1\tt\tét\n"
                                "4\t3\té\tété\n5\t0\t©\t©\n6\t0\t🙂\t🙂\n7\t0\ta\ta\n8\t7\tï\taï\n"),
    # The root row of the reference's own compressed fixtures: parent_idx 0, output_code empty.
    "compressed root row": ("compressed", "# node_idx\tedge_label\tparent_idx\toutput_code\tpattern\n0\t\t0\t\t\n"
                                          "1\th\t0\t1\th\n2\te\t0\t2\te\n3\te\t1\t3\the\n4\tl\t0\t4\tl\n"
                                          "5\tl\t4\t5\tll\n6\to\t0\t6\to\n7\t \t0\t7\t \n8\tr\t6\t8\tor\n"
                                          "9\to\t5\t9\tllo\n"),
    # ab's parent a has the larger code: ab keeps id 1.
    "parent after child": ("lz78", "1\t2\tb\tab\n2\t0\ta\ta\n3\t0\tb\tb\n4\t1\tc\tabc\n"),
}


@pytest.mark.parametrize("name", list(REFERENCE_FILES))
def test_reference_files_keep_their_ids(tmp_path: Path, name: str) -> None:
    layout, text = REFERENCE_FILES[name]
    path = write(tmp_path / "d.tsv", text)
    tokens = reference_tokens(path, layout)
    tok = from_dictionary(path)
    assert tok.n_codes == len(tokens)
    assert [tok.id_to_token(i).encode() for i in range(1, tok.n_codes + 1)] == [
        tokens[i] for i in range(1, len(tokens) + 1)
    ]
    assert_same_ids(tok, tokens, TEXTS + ["hello world, ll llo or", "abcab ba abc", "étéété ét aïa ©🙂"])


# --- both ways on one text ---------------------------------------------------------------------


def test_both_ways_on_a_text(tmp_path: Path) -> None:
    # A file written the reference's way: character-level codes, sparse and out of order, a parent
    # after its child, raw backslashes. Lockstep reads it with the reference's ids.
    path = write(tmp_path / "theirs.tsv", "# a character-level dictionary\n40\t0\tt\tt\n10\t40\th\tth\n"
                                          "30\t10\te\tthe\n20\t0\t \t \n50\t20\tç\t ç\n60\t0\t\\\t\\\n"
                                          "70\t60\tn\t\\n\n80\t0\tç\tç\n90\t80\ta\tça\n")
    theirs = reference_tokens(path, "lz78")
    text = "the thé ça \\n\\t ç a\n" * 3
    tok = from_dictionary(path)
    assert tok.encode(text) == reference_encode(theirs, text.encode())
    # Lockstep's export of that tokenizer, and of one it trained, read by the reference's rules.
    for trie, name in ((tok.trie, "ours_read.tsv"), (train_lz78(PRINTABLE_DOCS, 90).trie, "ours_trained.tsv")):
        write_lz78_tsv(tmp_path / name, trie)
        ours = reference_tokens(tmp_path / name, "lz78")
        assert LZ78Tokenizer(trie).encode(text) == reference_encode(ours, text.encode())


# --- measured on a real text ---------------------------------------------------------------------


def test_round_trip_on_tiny_shakespeare(tmp_path: Path, shared_fixtures: Path) -> None:
    """vocab 4096 (3,830 codes) trained on tiny Shakespeare. One document per line: no token holds
    a newline, the export has no escaped line, and the reference's rules give lockstep's ids on the
    whole text. The whole text as one document: only the codes with a newline go below the marker,
    and every other code reads back exactly."""
    text = (shared_fixtures / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    data = text.encode()
    by_line = train_lz78_tokenizer(text.split("\n"), vocab_size=4096)
    write_lz78_tsv(tmp_path / "lines.tsv", by_line.trie)
    assert ESCAPED_MARKER not in (tmp_path / "lines.tsv").read_text(encoding="utf-8")
    tokens = reference_tokens(tmp_path / "lines.tsv", "lz78")
    ids = by_line.encode(text)
    assert len(tokens) == 3830 and len(ids) == 441_150  # the figures docs/tokenizers.md gives
    assert ids == reference_encode(tokens, data)

    whole = train_lz78_tokenizer([text], vocab_size=4096)
    write_lz78_tsv(tmp_path / "whole.tsv", whole.trie)
    tokens = reference_tokens(tmp_path / "whole.tsv", "lz78")
    with_newline = {c for c in range(1, 3831) if b"\n" in whole.trie.token_bytes(c)}
    assert len(with_newline) == 437 and {c for c in tokens if tokens[c] != whole.trie.token_bytes(c)} == with_newline
    # The share of lockstep's tokens that the reference's rules also emit, at the same offset.
    ours, theirs = whole.encode(text), reference_encode(tokens, data)

    def placed(ids: list[int], spell) -> set[tuple[int, int]]:
        out, at = set(), 0
        for i in ids:
            out.add((at, i))
            at += len(spell(i))
        return out

    fallback = {3831 + b: bytes([b]) for b in range(256)}
    same = placed(ours, lambda i: whole.trie.token_bytes(i) if i <= 3830 else fallback[i]) & placed(
        theirs, lambda i: tokens.get(i) or fallback[i])
    assert len(ours) == 409_598 and round(100 * len(same) / len(ours), 1) == 86.3


# --- portable dictionaries: every code travels, both ways ------------------------------------------

# Training text: prose in several scripts, code indented with tabs, CRLF lines. Held-out text of
# the same kinds, with characters the training text lacks.
PORTABLE_TRAIN = [
    "The quick brown fox jumps over the lazy dog; the dog sleeps on.\r\nAnd then the fox runs home.\n",
    "Le cœur a ses raisons que la raison ne connaît point. Été, hiver, café crème à côté.\n",
    "Über allen Gipfeln ist Ruh, in allen Wipfeln spürest du kaum einen Hauch.\n",
    "Мороз и солнце; день чудесный! Ещё ты дремлешь, друг прелестный.\n",
    "春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。吾輩は猫である。名前はまだ無い。\n",
    "def main(argv):\n\tfor arg in argv:\n\t\tif arg:\n\t\t\tprint(arg)\t# echo\n\treturn 0\n",
    "name\tvalue\tnote\r\nalpha\t1\t©\r\nbeta\t2\t🙂\r\n",
] * 6
HELD_OUT = [
    "The lazy fox sleeps; the quick dog runs over the brown hill.\r\nThen home again.\r\n",
    "La raison du cœur, un café à côté de l'été; naïve façade.\n",
    "Kaum ein Hauch über den Gipfeln; spürest du Ruh?\n",
    "Солнце и мороз, чудесный день, друг.\n",
    "夜来风雨声，春眠不觉晓。猫である。한국어 텍스트.\n",
    "class Fox:\n\tdef run(self):\n\t\treturn 'home'\t# 🦊\n",
    "gamma\t3\t®\r\ndelta\t4\t🙂🙂\r\n\tlead tab\\t and a backslash\\n\n",
]
PORTABLE_VOCAB = 266 + 400


def reference_write_lz78(path: Path, tokens: dict[int, bytes]) -> Path:
    """A dictionary written the reference's way: one raw line per code, `code, parent_code, char,
    pattern`, the parent being the longest proper prefix that is a code and `char` the rest."""
    code_of = {token: code for code, token in tokens.items()}
    lines = []
    for code, token in tokens.items():
        text = token.decode("utf-8")
        parent = next((code_of[p.encode()] for k in range(len(text) - 1, 0, -1) if (p := text[:k]).encode() in code_of),
                      0)
        char = text[len(tokens[parent].decode("utf-8")):] if parent else text
        lines.append(f"{code}\t{parent}\t{char}\t{text}\n")
    path.write_text("# written the reference's way\n" + "".join(lines), encoding="utf-8")
    return path


def test_a_portable_dictionary_travels_exactly_both_ways(tmp_path: Path) -> None:
    tok = train_lz78_tokenizer(PORTABLE_TRAIN, vocab_size=PORTABLE_VOCAB, portable=True)
    ours = {c: tok.trie.token_bytes(c) for c in range(1, tok.n_codes + 1)}
    assert any(len(t.decode()) < len(t) for t in ours.values())  # multi-byte characters in codes
    texts = HELD_OUT + PORTABLE_TRAIN[:7]
    pieces = tok.token_pieces()
    for text in texts:  # tabs and line breaks only ever come as their fallback byte ids
        spelled = [pieces[i] for i in tok.encode(text)]
        assert sum(p in (b"\t", b"\n", b"\r") for p in spelled) == sum(text.count(c) for c in "\t\n\r")
    # lockstep's exports, exact: the reference's rules read every code's bytes and give lockstep's ids.
    write_lz78_tsv(tmp_path / "d.tsv", tok.trie, exact=True)
    write_compressed_tsv(tmp_path / "c.tsv", CompressedDictionary.from_trie(tok.trie, whole_characters=True),
                         exact=True)
    for name, layout in (("d.tsv", "lz78"), ("c.tsv", "compressed")):
        assert ESCAPED_MARKER not in (tmp_path / name).read_text(encoding="utf-8")
        theirs = reference_tokens(tmp_path / name, layout)
        assert theirs == ours, name
        for fast in (False, True):
            again = from_dictionary(tmp_path / name, fast=fast)
            for text in texts:
                want = reference_encode(theirs, text.encode("utf-8"))
                assert tok.encode(text) == want and again.encode(text) == want, (name, text)
    # A file written the reference's way from those codes: lockstep's importer reads the same ids.
    path = reference_write_lz78(tmp_path / "theirs.tsv", ours)
    assert reference_tokens(path, "lz78") == ours
    for fast in (False, True):
        imported = from_dictionary(path, fast=fast)
        assert all(imported.encode(text) == tok.encode(text) for text in texts)


def test_inexact_exports_are_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Byte-level on the same text, the dictionary holds tabs, line breaks and cut characters.
    byte_level = train_lz78_tokenizer(PORTABLE_TRAIN, vocab_size=PORTABLE_VOCAB)
    with pytest.raises(LZ78ExportError, match=r"line\(s\) go below .*a tab.*tokenizer.options.portable: true"):
        write_lz78_tsv(tmp_path / "d.tsv", byte_level.trie, exact=True)
    assert not (tmp_path / "d.tsv").exists()
    with caplog.at_level("WARNING", logger="lockstep.tokenizer"):
        write_lz78_tsv(tmp_path / "d.tsv", byte_level.trie)
    lines = (tmp_path / "d.tsv").read_text(encoding="utf-8").split("\n")
    below = lines[lines.index(next(x for x in lines if x.startswith(ESCAPED_MARKER))) + 1:]
    theirs = reference_tokens(tmp_path / "d.tsv", "lz78")
    misread = sum(theirs[c] != byte_level.trie.token_bytes(c) for c in theirs)
    assert f"{len([x for x in below if x])} lz78 line(s) go below `{ESCAPED_MARKER}`" in caplog.text
    assert f"the reference reads {misread} token(s) with other bytes" in caplog.text and misread > 0
    # A portable dictionary in a tree over bytes: the tokens travel, an edge label splits a character.
    portable = train_lz78_tokenizer(PORTABLE_TRAIN, vocab_size=PORTABLE_VOCAB, portable=True)
    with pytest.raises(LZ78ExportError, match=r"edge label splits a character.*whole_characters=True"):
        write_compressed_tsv(tmp_path / "c.tsv", CompressedDictionary.from_trie(portable.trie), exact=True)
    with pytest.raises(LZ78ExportError, match="tokenizer.options.portable"):
        write_compressed_tsv(tmp_path / "c.tsv", CompressedDictionary.from_trie(byte_level.trie), exact=True)
    with pytest.raises(ValueError, match="not whole UTF-8 characters.*portable"):
        CompressedDictionary.from_trie(byte_level.trie, whole_characters=True)
