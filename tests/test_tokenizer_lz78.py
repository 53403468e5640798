"""The `lz78` tokenizer kind: vocab layout ids, round trips (unseen bytes, emoji, lone
surrogates), special strings in text, compiled encoder equal to the reference, chunking, per-id
tree metadata, save/load identity, determinism across processes, chat rendering."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _text_corpus import CORPUS
from lockstep.tokenizer.base import SPECIAL_TOKENS, TokenizerFileError, load_tokenizer
from lockstep.tokenizer.lz78 import N_RESERVED, LZ78Tokenizer, LZ78VocabError
from lockstep.tokenizer.lz78.train import from_dictionary
from lockstep.tokenizer.lz78.train import train as train_lz78_tokenizer

VOCAB = 320
_TOKS: dict[tuple[bool, str], LZ78Tokenizer] = {}


def tiny(chunking: bool = False, strategy: str = "standard") -> LZ78Tokenizer:
    key = (chunking, strategy)
    if key not in _TOKS:
        _TOKS[key] = train_lz78_tokenizer(CORPUS, vocab_size=VOCAB, chunking=chunking, strategy=strategy)
    return _TOKS[key]


KINDS = [(False, "standard"), (True, "standard"), (False, "frequency_gated"), (True, "multi_round")]


def test_vocab_layout_ids() -> None:
    tok = tiny()
    n = VOCAB - 257 - len(SPECIAL_TOKENS)
    assert tok.n_codes == n and tok.get_vocab_size() == VOCAB
    assert tok.get_special_tokens() == {name: n + 257 + i for i, name in enumerate(SPECIAL_TOKENS)}
    assert tok.get_bos_token_id() == n + 257
    assert [tok.fallback_id(b) for b in (0, 255)] == [n + 1, n + 256]
    # A byte no code starts with (DEL is not in the corpus) falls back to its own id; text never
    # yields the root id 0.
    assert tok.encode("\x7f") == [tok.fallback_id(0x7F)]
    ids = tok.encode("".join(CORPUS))
    assert 0 not in ids and max(ids) <= n + 256
    # Codes spell the trie's bytes; the fallback ids spell one byte each.
    for code in range(1, n + 1):
        assert tok.id_to_token(code) == tok.trie.token_bytes(code).decode("utf-8", "replace")
        assert tok.token_bytes()[code] == len(tok.trie.token_bytes(code))
    assert tok.decode([tok.fallback_id(ord("A"))]) == "A" and tok.decode([0]) == ""


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=60, deadline=None)
@given(
    text=st.text(max_size=200)
    | st.lists(st.sampled_from(["🙂", "漢字", "\x00", "\x7f", "é", " the", "\n"])).map("".join)
)
def test_roundtrip(kind: tuple[bool, str], text: str) -> None:
    tok = tiny(*kind)
    ids = tok.encode(text)
    assert all(0 < i < tok.get_vocab_size() and not tok.is_special(i) for i in ids)
    assert tok.decode(ids) == text
    assert int(tok.token_bytes()[ids].sum()) == len(text.encode("utf-8"))


def test_lone_surrogate_encodes_as_replacement_char_like_bpe() -> None:
    tok = tiny()
    assert tok.encode("ab\ud800cd") == tok.encode("ab\ufffdcd")
    assert tok.decode(tok.encode("ab\ud800cd")) == "ab\ufffdcd"
    texts = ["ab\ud800cd", "12 34", ""]
    assert tok.encode(texts, num_threads=2) == [tok.encode(t) for t in texts]


def test_decode_replaces_invalid_utf8_and_rejects_unknown_ids() -> None:
    tok = tiny()
    assert tok.decode([tok.fallback_id(0xE6), tok.fallback_id(ord("a"))]) == "\ufffda"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([VOCAB])


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=40, deadline=None)
@given(prefix=st.text(max_size=8), suffix=st.text(max_size=8), order=st.permutations(SPECIAL_TOKENS),
       sep=st.sampled_from(["", " ", "\n", "<", "|"]))
def test_special_strings_in_text_never_become_special_ids(
    kind: tuple[bool, str], prefix: str, suffix: str, order, sep: str
) -> None:
    tok = tiny(*kind)
    text = prefix + sep.join(order) + suffix
    ids = tok.encode(text)
    assert not set(tok.get_special_tokens().values()) & set(ids)
    (arr,) = tok.encode_arrays([text])
    assert arr.dtype == np.uint32 and arr.tolist() == ids
    assert tok.decode(ids) == text


@pytest.mark.parametrize("chunking", [False, True])
@settings(max_examples=40, deadline=None)
@given(texts=st.lists(st.text(max_size=60), max_size=6))
def test_fast_encoder_and_threads_equal_the_reference(chunking: bool, texts: list[str]) -> None:
    fast = tiny(chunking)
    ref = LZ78Tokenizer(fast.trie, chunking=chunking, fast=False)
    want = [ref.encode(t) for t in texts]
    assert fast.encode(texts, num_threads=2) == want
    assert [a.tolist() for a in fast.encode_arrays(texts)] == want


def test_reference_training_gives_the_same_files() -> None:
    for chunking, strategy in KINDS:
        ref = train_lz78_tokenizer(CORPUS, vocab_size=VOCAB, chunking=chunking, strategy=strategy, fast=False)
        assert ref.sha256 == tiny(chunking, strategy).sha256, (chunking, strategy)


def test_chunking_keeps_tokens_inside_chunks() -> None:
    tok = tiny(chunking=True)
    text = "".join(CORPUS)
    chunks = tok._split.findall(text)
    assert "".join(chunks) == text
    assert tok.encode(text) == [i for c in chunks for i in tok.encode(c)]
    # The dictionary was learned per chunk too, so no code spans a split boundary ("x y" etc.).
    for code in range(1, tok.n_codes + 1):
        piece = tok.trie.token_bytes(code).decode("utf-8", "ignore")
        assert len(tok._split.findall(piece)) <= 1, piece


def test_tree_metadata_over_the_whole_vocab() -> None:
    tok = tiny()
    n, v = tok.n_codes, tok.get_vocab_size()
    parents, last = tok.token_parents(), tok.token_last_bytes()
    assert parents.shape == last.shape == (v,) and parents.dtype == last.dtype == np.int32
    assert np.array_equal(parents[: n + 1], tok.trie.parent) and np.array_equal(last[1 : n + 1], tok.trie.last_byte[1:])
    assert not parents[n + 1 :].any() and last[0] == -1
    assert last[n + 1 : n + 257].tolist() == list(range(256)) and (last[n + 257 :] == -1).all()
    chains, depths = tok.ancestor_chains()
    assert chains.shape == (v, int(depths.max())) and not chains[0].any() and depths[0] == 0
    tb = tok.token_bytes()
    for i in range(1, v):
        chain = chains[i, : depths[i]].tolist()
        assert chain[0] == i and (chains[i, depths[i] :] == 0).all()
        assert all(parents[a] == b for a, b in zip(chain, chain[1:])) and parents[chain[-1]] == 0
        if i <= n + 256:  # codes and fallback bytes: chain length is byte length
            assert depths[i] == tb[i]
            assert bytes(last[chain[::-1]].tolist()) == tok.token_pieces()[i]
        else:
            assert depths[i] == 1 and tb[i] == 0
    with pytest.raises(ValueError):
        chains[1, 0] = 5  # read-only


def test_save_load_roundtrip_is_byte_identical(tmp_path) -> None:
    for chunking, strategy in KINDS:
        tok = tiny(chunking, strategy)
        a, b = tmp_path / f"{chunking}{strategy}a", tmp_path / f"{chunking}{strategy}b"
        meta = tok.save(a)
        assert sorted(meta["files"]) == ["lz78.json", "lz78_last_byte.npy", "lz78_parent.npy", "token_ancestors.npy",
                                       "token_bytes.npy", "token_depths.npy"]
        loaded = load_tokenizer(a)
        assert isinstance(loaded, LZ78Tokenizer) and loaded.sha256 == tok.sha256 == meta["sha256"]
        assert loaded.chunking == chunking and loaded.training == {"strategy": strategy}
        loaded.save(b)
        for p in a.iterdir():
            assert p.read_bytes() == (b / p.name).read_bytes(), p.name
        assert loaded.encode(CORPUS[4]) == tok.encode(CORPUS[4])
        assert np.array_equal(loaded.ancestor_chains()[0], tok.ancestor_chains()[0])


def test_inconsistent_files_are_refused(tmp_path) -> None:
    tok = tiny()
    n = tok.n_codes
    bad_parent = tok.token_parents().copy()
    bad_parent[3] = 5  # a parent after its child
    bad_last = tok.token_last_bytes().copy()
    bad_last[n + 1] = 7  # fallback id for byte 0 claims byte 7
    for parents, last, match in ((bad_parent, tok.token_last_bytes(), "smaller code"),
                                 (tok.token_parents(), bad_last, "lz78 layout")):
        forged = LZ78Tokenizer(tok.trie)
        forged._parents, forged._last_bytes = parents, last
        forged._prefix_tree = tok.prefix_tree()  # so that saving does not trip over the forged parents
        # Written with a consistent meta.json, so only the layout checks can catch it.
        forged.save(tmp_path / match)
        with pytest.raises(TokenizerFileError, match=match):
            load_tokenizer(tmp_path / match)


def test_bad_vocab_and_options() -> None:
    with pytest.raises(LZ78VocabError, match=f"at least {N_RESERVED + 1}"):
        train_lz78_tokenizer(CORPUS, vocab_size=N_RESERVED)
    with pytest.raises(LZ78VocabError, match="lower vocab_size"):
        train_lz78_tokenizer(["abc"], vocab_size=N_RESERVED + 50)
    with pytest.raises(ValueError, match="unknown lz78 tokenizer option"):
        train_lz78_tokenizer(CORPUS, vocab_size=VOCAB, max_codes=5)
    with pytest.raises(ValueError, match="strategy"):
        train_lz78_tokenizer(CORPUS, vocab_size=VOCAB, strategy="greedy")


def test_chat_rendering() -> None:
    tok = tiny()
    sp = tok.get_special_tokens()
    conv = {"messages": [{"role": "user", "content": "What is 2+3? 🙂"},
                         {"role": "assistant", "content": [{"type": "text", "text": "It is "},
                                                           {"type": "python", "text": "2+3"},
                                                           {"type": "python_output", "text": "5"}]}]}
    ids, mask = tok.render_conversation(conv)
    want = [
        sp["<|bos|>"],
        sp["<|user_start|>"],
        *tok.encode("What is 2+3? 🙂"),
        sp["<|user_end|>"],
        sp["<|assistant_start|>"],
        *tok.encode("It is "),
        sp["<|python_start|>"],
        *tok.encode("2+3"),
        sp["<|python_end|>"],
        sp["<|output_start|>"],
        *tok.encode("5"),
        sp["<|output_end|>"],
        sp["<|assistant_end|>"],
    ]
    assert ids == want and len(mask) == len(ids)
    assert tok.decode(ids).startswith("<|bos|><|user_start|>What is 2+3? 🙂<|user_end|>")
    prompt = tok.render_for_completion(conv)
    assert prompt[-1] == sp["<|assistant_start|>"] and prompt[0] == tok.get_bos_token_id()


_TRAIN_AND_SAVE = textwrap.dedent("""
    import sys
    from lockstep.tokenizer.lz78.train import train as train_lz78_tokenizer
    texts = [f"doc {i}: " + " ".join(f"w{(i * 7 + j) % 23} x{j % 5}" for j in range(40)) + " 🙂 é\\n"
             for i in range(60)]
    train_lz78_tokenizer(texts, vocab_size=370, strategy="frequency_gated",
                         gate_period_phrases=16).save(f"{sys.argv[1]}/frequency_gated")
    train_lz78_tokenizer(texts, vocab_size=340, chunking=True,
                         strategy="multi_round").save(f"{sys.argv[1]}/multi_round")
""")


@pytest.mark.skipif(sys.platform == "win32", reason="PYTHONHASHSEED subprocesses")
def test_two_processes_with_different_hash_seeds_write_identical_files(tmp_path) -> None:
    outs = []
    procs = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        out.mkdir()
        env = {**os.environ, "PYTHONHASHSEED": seed}
        procs.append(subprocess.Popen([sys.executable, "-c", _TRAIN_AND_SAVE, str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        outs.append(out)
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    for strategy in ("frequency_gated", "multi_round"):
        a, b = outs[0] / strategy, outs[1] / strategy
        names = sorted(p.name for p in a.iterdir())
        assert names == sorted(p.name for p in b.iterdir()) and len(names) == 7
        for name in names:
            assert (a / name).read_bytes() == (b / name).read_bytes(), (strategy, name)


def test_prefix_tree_is_the_trie_without_the_root(tmp_path) -> None:
    tok = tiny()
    tree = tok.prefix_tree()
    chains, depths = tok.ancestor_chains()
    n, pieces = tok.n_codes, tok.token_pieces()
    for i in range(tok.get_vocab_size()):
        d = int(tree.depths[i])
        if 1 <= i <= n:
            # a code's ancestors are its trie chain past itself: every proper prefix, nearest first
            assert d == depths[i] - 1 and tree.ancestors[i, :d].tolist() == chains[i, 1 : d + 1].tolist()
            assert [pieces[a] for a in tree.ancestors[i, :d]] == [
                pieces[i][:k] for k in range(len(pieces[i]) - 1, 0, -1)
            ]
        else:  # root, fallback and special ids have no token ancestor
            assert d == 0 and tree.parent[i] == -1
    tok.save(tmp_path / "t")
    assert np.array_equal(np.load(tmp_path / "t" / "token_ancestors.npy"), tree.ancestors)


def test_a_dictionary_in_the_lz78_layout_gives_the_same_tokenizer(tmp_path) -> None:
    from lockstep.tokenizer.lz78.tsv import write_lz78_tsv

    tok = tiny()
    write_lz78_tsv(tmp_path / "d.tsv", tok.trie)
    brought = from_dictionary(tmp_path / "d.tsv")
    assert np.array_equal(brought.token_parents(), tok.token_parents()) and not brought.has_hierarchical_parents
    assert brought.encode(CORPUS[:5]) == tok.encode(CORPUS[:5])
    with pytest.raises(LZ78VocabError, match="compressed"):
        brought.hierarchical_parents()
    (tmp_path / "bad.tsv").write_text("# three columns\n1\t0\ta\n")
    with pytest.raises(ValueError, match="3 tab-separated columns"):
        from_dictionary(tmp_path / "bad.tsv")


# --- dictionaries that lack prefixes of their tokens ------------------------------------------------

# A compressed dictionary without "t", "th", "an", "n": the reference matches the longest of these
# tokens; with the prefixes closed, they become codes 7.. after the file's six.
OPEN_TOKENS = [b"the", b"a", b"them", b"and", b"then", b"e"]


def longest_match(tokens: list[bytes], data: bytes, fallback: int) -> list[int]:
    """Greedy longest match among `tokens` (id = index + 1) by trying every length, longest first."""
    out, i = [], 0
    while i < len(data):
        for n in range(len(data) - i, 0, -1):
            if data[i : i + n] in tokens:
                out.append(tokens.index(data[i : i + n]) + 1)
                i += n
                break
        else:
            out.append(fallback + data[i])
            i += 1
    return out


def test_a_dictionary_file_keeps_its_tokens_or_closes_them(tmp_path) -> None:
    from lockstep.tokenizer.lz78.tsv import CompressedDictionary, write_compressed_tsv

    write_compressed_tsv(tmp_path / "d.tsv", CompressedDictionary.from_tokens(OPEN_TOKENS))
    text = "then the theme: a band and them, tea at ten"
    data = text.encode()
    # Default: the file's six tokens are the codes, matched longest first as the reference does.
    tok = from_dictionary(tmp_path / "d.tsv")
    assert tok.n_codes == 6 and tok.training == {"dictionary": "d.tsv", "layout": "compressed", "prefixes": "file"}
    assert [tok.id_to_token(i).encode() for i in range(1, 7)] == OPEN_TOKENS
    assert tok.encode(text) == longest_match(OPEN_TOKENS, data, 7)
    assert LZ78Tokenizer(tok.trie, fast=False).encode(text) == tok.encode(text)
    # Parents are the longest token prefixes; chains and the prefix tree follow them.
    assert tok.token_parents()[1:7].tolist() == [0, 0, 1, 2, 1, 0]
    assert tok.prefix_tree().ancestors[3, :1].tolist() == [1] and tok.prefix_tree().depths[3] == 1
    # Closed: the six keep their ids, t, th, an follow shortest first, and every code is its
    # parent plus one byte.
    closed = from_dictionary(tmp_path / "d.tsv", prefixes="closed")
    pieces = [closed.id_to_token(i).encode() for i in range(1, closed.n_codes + 1)]
    assert pieces == OPEN_TOKENS + [b"t", b"th", b"an"]
    assert closed.encode(text) == longest_match(pieces, data, closed.n_codes + 1)
    parents = closed.token_parents()
    assert all(pieces[c - 1][:-1] == (pieces[parents[c] - 1] if parents[c] else b"") for c in range(1, 10))
    assert closed.has_hierarchical_parents and tok.has_hierarchical_parents
    # Saved and loaded, each reads back the same (the file mode keeps its whole trie).
    for t, name in ((tok, "file"), (closed, "closed")):
        meta = t.save(tmp_path / name)
        assert ("lz78_trie_parent.npy" in meta["files"]) == (name == "file")
        loaded = load_tokenizer(tmp_path / name)
        assert loaded.sha256 == t.sha256 and loaded.encode(text) == t.encode(text)
        assert loaded.decode(loaded.encode(text)) == text


def test_structured_embeddings_refuse_codes_they_cannot_tell_apart(tmp_path) -> None:
    from lockstep.core.config import ConfigError
    from lockstep.pipeline.train import token_structure

    # é and © (0xc3 0xa9, 0xc2 0xa9) add two bytes to no parent and end in the same byte.
    (tmp_path / "d.tsv").write_text("1\t0\té\té\n2\t0\t©\t©\n3\t0\ta\ta\n", encoding="utf-8")
    tok = from_dictionary(tmp_path / "d.tsv")
    assert "codes 1 (b'\\xc3\\xa9') and 2 (b'\\xc2\\xa9')" in tok.structure_clash()
    for embedding in ("structured", "tuple"):
        with pytest.raises(ConfigError, match=f"model.embedding={embedding}: .*tokenizer.options.prefixes: closed"):
            token_structure(tok, embedding)
    closed = from_dictionary(tmp_path / "d.tsv", prefixes="closed")
    assert closed.structure_clash() is None and closed.n_codes == 5
    parents, last = token_structure(closed, "structured")
    assert parents[1] != parents[2] and last[1] == last[2] == 0xA9
    with pytest.raises(ValueError, match="prefixes='open'"):
        from_dictionary(tmp_path / "d.tsv", prefixes="open")


@pytest.mark.parametrize("kind", KINDS[:2])
@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, VOCAB - 1), max_size=80))
def test_fast_decoder_equals_the_reference(kind: tuple[bool, str], ids: list[int]) -> None:
    fast = tiny(*kind)
    ref = LZ78Tokenizer(fast.trie, chunking=kind[0], fast=False)
    want = ref.decode(ids)
    assert fast.decode(ids) == want
    assert fast.decode(np.array(ids, np.uint32)) == fast.decode(tuple(ids)) == fast.decode(iter(ids)) == want


def test_fast_decoder_edges() -> None:
    tok = tiny()
    bos = tok.get_bos_token_id()
    ids = tok.encode("héllo 🙂")
    assert tok.decode([bos, *ids, bos]) == "<|bos|>héllo 🙂<|bos|>"
    # A character cut by a special id is replaced on each side, as decode_with_specials does.
    cut = [tok.fallback_id(0xC3), bos, tok.fallback_id(0xA9)]
    assert tok.decode(cut) == LZ78Tokenizer(tok.trie, fast=False).decode(cut) == "\ufffd<|bos|>\ufffd"
    assert tok.decode([]) == tok.decode(np.zeros(0, np.int64)) == ""
    for bad in ([VOCAB], np.array([3, -1]), [2**70]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            tok.decode(bad)


def test_portable_option_trains_whole_characters_and_saves(tmp_path) -> None:
    from pathlib import Path

    from lockstep.core.config import FieldError
    from lockstep.tokenizer.lz78.train import LZ78Options

    # Off by default and then absent from the trainer's arguments, so a dictionary trained before
    # the option existed is trained and recorded as it was.
    assert "portable" not in LZ78Options().train_kwargs(seed=0, root=Path("."))
    assert LZ78Options(portable=True).train_kwargs(seed=0, root=Path("."))["portable"] is True
    with pytest.raises(FieldError, match="portable.*applies to training"):
        LZ78Options(dictionary="corpus/dictionaries/d.tsv", portable=True)
    text = "naïve café\tété\r\ncœur 漢字 🙂 " * 30
    tok = train_lz78_tokenizer([text] + CORPUS, vocab_size=VOCAB, portable=True)
    byte_level = train_lz78_tokenizer([text] + CORPUS, vocab_size=VOCAB)
    assert tok.training == {"strategy": "standard", "portable": True}
    codes = tok.token_pieces()[1 : tok.n_codes + 1]
    assert all(p.decode("utf-8") and not any(b in p for b in b"\t\n\r") for p in codes)
    assert any(b"\n" in p for p in byte_level.token_pieces()[1 : byte_level.n_codes + 1])  # what portable avoids
    for fast in (False, True):
        again = train_lz78_tokenizer([text] + CORPUS, vocab_size=VOCAB, portable=True, fast=fast)
        assert again.encode(text) == tok.encode(text) and np.array_equal(again.trie.parent, tok.trie.parent)
    tok.save(tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok")
    assert loaded.sha256 == tok.sha256 and loaded.encode(text) == tok.encode(text)
    assert loaded.decode(tok.encode(text)) == text


def test_structured_embeddings_refuse_portable_codes_they_cannot_tell_apart() -> None:
    from lockstep.core.config import ConfigError
    from lockstep.pipeline.train import token_structure

    # é and © both become codes under the root, ending in byte 0xa9: their rows would be the same.
    tok = train_lz78_tokenizer(["é © a b " * 40] + CORPUS, vocab_size=VOCAB, portable=True)
    assert "tokenizer.options.portable" in tok.structure_clash()
    for embedding in ("structured", "tuple"):
        with pytest.raises(ConfigError, match=f"model.embedding={embedding}: .*portable.*model.embedding: flat"):
            token_structure(tok, embedding)
    # Without such a pair a portable dictionary feeds them: every code reads its own rows.
    ascii_only = train_lz78_tokenizer(CORPUS, vocab_size=VOCAB, portable=True)
    assert ascii_only.structure_clash() is None
    parents, last = token_structure(ascii_only, "structured")
    n = ascii_only.n_codes
    assert len({(int(p), int(b)) for p, b in zip(parents[1 : n + 1], last[1 : n + 1])}) == n
