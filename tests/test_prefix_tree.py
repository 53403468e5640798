"""Prefix trees: BPE ancestor chains, parents and last bytes: a hand-made vocabulary, then real bpe tokenizers
checked against a trie walk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lockstep.tokenizer import NoPrefixTreeError, load_tokenizer
from lockstep.tokenizer.base import TokenizerFileError
from lockstep.tokenizer.kinds import train_tokenizer
from lockstep.tokenizer.prefix_tree import NO_TOKEN, prefix_tree
from lockstep.train.objectives import check_ancestor_table

ROOT = Path(__file__).resolve().parents[1]


def test_hand_made_vocabulary():
    #          0     1     2      3       4        5     6       7 (special)
    pieces = [b"t", b"h", b"th", b"the", b"thee", b"e", b"tee", None]
    tree = prefix_tree(pieces)
    assert tree.depths.tolist() == [0, 0, 1, 2, 3, 0, 1, 0]
    assert tree.ancestors.tolist() == [
        [NO_TOKEN] * 3,
        [NO_TOKEN] * 3,
        [0, NO_TOKEN, NO_TOKEN],
        [2, 0, NO_TOKEN],
        [3, 2, 0],
        [NO_TOKEN] * 3,
        [0, NO_TOKEN, NO_TOKEN],  # "te" is not a token: the chain skips it
        [NO_TOKEN] * 3,
    ]
    assert tree.parent.tolist() == [NO_TOKEN, NO_TOKEN, 0, 2, 3, NO_TOKEN, 0, NO_TOKEN]
    assert tree.last_byte.tolist() == [ord("t"), ord("h"), ord("h"), ord("e"), ord("e"), ord("e"), ord("e"), NO_TOKEN]
    assert tree.parent_rows(8).tolist() == [8, 8, 0, 2, 3, 8, 0, 8]
    assert tree.vocab_size == 8
    for a in (tree.ancestors, tree.depths, tree.parent, tree.last_byte):
        assert a.dtype == np.int64


def test_vocabulary_without_any_prefix_keeps_one_column():
    tree = prefix_tree([b"a", b"b", None])
    assert tree.ancestors.shape == (3, 1) and (tree.ancestors == NO_TOKEN).all()


def test_ambiguous_vocabularies_are_refused():
    with pytest.raises(ValueError, match="tokens 0 and 2 have the same bytes"):
        prefix_tree([b"ab", b"a", b"ab"])
    with pytest.raises(ValueError, match="token 1 has an empty byte string"):
        prefix_tree([b"a", b""])


def trie_reference(pieces):
    """Ancestor chains by walking a trie of all pieces byte by byte: the tokens met on the way
    down to a token, nearest first."""
    trie: dict = {}
    for i, p in enumerate(pieces):
        if p is None:
            continue
        node = trie
        for b in p:
            node = node.setdefault(b, {})
        node["id"] = i
    chains = []
    for p in pieces:
        met, node = [], trie
        for b in (p or b"")[:-1]:
            node = node[b]
            if "id" in node:
                met.append(node["id"])
        chains.append(met[::-1])
    return chains


def check_bpe_tree(directory: Path) -> None:
    tok = load_tokenizer(directory)
    pieces = tok.token_pieces()
    tree = tok.prefix_tree()
    # the saved chains are the ones the tokenizer computes
    assert np.array_equal(np.load(directory / "token_ancestors.npy"), tree.ancestors)
    assert np.array_equal(np.load(directory / "token_depths.npy"), tree.depths)
    V = len(pieces)
    chains = trie_reference(pieces)
    for i, chain in enumerate(chains):
        assert tree.ancestors[i, : tree.depths[i]].tolist() == chain, i
        assert (tree.ancestors[i, tree.depths[i]:] == NO_TOKEN).all()
    specials = [i for i, p in enumerate(pieces) if p is None]
    assert len(specials) == 9 and specials == list(range(V - 9, V))
    for i, p in enumerate(pieces):
        if p is None:
            assert tree.parent[i] == NO_TOKEN and tree.last_byte[i] == NO_TOKEN
            continue
        assert tree.last_byte[i] == p[-1]
        # every single byte is a bpe token: only single bytes lack a parent, every chain ends at
        # the first byte, and the parent is the longest proper prefix that is a token
        if len(p) == 1:
            assert tree.parent[i] == NO_TOKEN
        else:
            chain = tree.ancestors[i, : tree.depths[i]]
            assert pieces[chain[-1]] == p[:1]
            assert tree.parent[i] == chain[0]
            assert all(p[:k] not in pieces for k in range(len(pieces[chain[0]]) + 1, len(p)))
            # a chain is the parent followed by the parent's own chain
            par = tree.parent[i]
            assert chain[1:].tolist() == tree.ancestors[par, : tree.depths[par]].tolist()
    assert tree.depths.max() >= 3  # a real vocabulary has deep chains
    check_ancestor_table(torch.from_numpy(tree.ancestors), torch.from_numpy(tree.depths), V)


def test_trained_bpe_tokenizer(tmp_path, shared_fixtures):
    text = (shared_fixtures / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:200_000]
    tok = train_tokenizer("bpe", [text], vocab_size=1024)
    tok.save(tmp_path / "tok")
    check_bpe_tree(tmp_path / "tok")


def test_pipeline_tokenizer():
    """The tokenizer stage's output in this checkout (data/tokenizer), when it has been built."""
    directory = ROOT / "data" / "tokenizer"
    if not (directory / "meta.json").is_file():
        pytest.skip(f"no tokenizer at {directory}: run the tokenizer stage first")
    kind = json.loads((directory / "meta.json").read_text())["kind"]
    if kind != "bpe":
        pytest.skip(f"{directory} holds a {kind!r} tokenizer")
    check_bpe_tree(directory)


def test_tampered_tree_files_and_sentencepiece_are_refused(tmp_path, shared_fixtures):
    text = (shared_fixtures / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:20_000]
    train_tokenizer("bpe", [text], vocab_size=300).save(tmp_path / "bpe")
    ancestors = np.load(tmp_path / "bpe" / "token_ancestors.npy")
    ancestors[-20, 0] = 3
    np.save(tmp_path / "bpe" / "token_ancestors.npy", ancestors)
    with pytest.raises(TokenizerFileError, match="token_ancestors.npy"):
        load_tokenizer(tmp_path / "bpe")
    spm = train_tokenizer("sentencepiece", [text] * 3, vocab_size=600, model_type="bpe", seed=0)
    with pytest.raises(NoPrefixTreeError, match="model.embedding: flat"):
        spm.prefix_tree()
    spm.save(tmp_path / "spm")
    assert not (tmp_path / "spm" / "token_ancestors.npy").exists()

