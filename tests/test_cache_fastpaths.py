"""Tests of the cache build's batched paths against the per-record ones they replace: snapshot
lines and BOS joining. Not a test of the cache format (tests/test_cache.py)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.data.cache import CacheError
from lockstep.data.encode import _bos_join
from lockstep.data.parity import SnapshotCollector, _text_lines


def _one_by_one(texts: list[str]) -> bytes:
    return "".join('{"text":' + json.dumps(t, ensure_ascii=False) + "}\n" for t in texts).encode("utf-8")


_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.lists(_TEXT, max_size=6))
def test_text_lines_match_json_dumps(texts: list[str]) -> None:
    assert _text_lines(texts) == _one_by_one(texts)


@pytest.mark.parametrize(
    "texts",
    [[""], ["a\x00b"], ["\x00"], ["x", "\x01y"], ['q"\\\n\r\t\b\f\x1f\x7f\u2028é😀'], ["a", "", "b"]],
)
def test_text_lines_edge_cases(texts: list[str]) -> None:
    assert _text_lines(texts) == _one_by_one(texts)


def test_add_texts_equals_add() -> None:
    texts = [f"doc {i}\n\"quoted\" \\ é" for i in range(7)]
    a, b = SnapshotCollector(3), SnapshotCollector(3)
    for t in texts:
        a.add("train", {"text": t})
    a.add("train", {"text": "tail", "extra": 1})
    b.add_texts("train", texts[:2])
    b.add_texts("train", [])
    b.add_texts("train", texts[2:])
    b.add("train", {"text": "tail", "extra": 1})
    assert a.to_json() == b.to_json()
    expect = hashlib.sha256(_one_by_one(texts) + b'{"extra":1,"text":"tail"}\n').hexdigest()
    assert b.to_json()["splits"]["train"]["sha256"] == expect
    with pytest.raises(TypeError, match="sequence of str"):
        b.add_texts("train", ["ok", 3])  # type: ignore[list-item]


@pytest.mark.parametrize("dtype", [np.dtype("<u2"), np.dtype("<u4")])
def test_bos_join_prefixes_each_document(dtype: np.dtype) -> None:
    out = _bos_join([[5, 6], [], [7]], 1, 100, dtype, "train documents")
    assert out.dtype == dtype and out.tolist() == [1, 5, 6, 1, 1, 7]
    assert _bos_join([], 1, 100, dtype, "train documents").size == 0


@pytest.mark.parametrize("bad", [-1, 100, 70_000, 2**40])
def test_bos_join_names_an_id_outside_the_vocabulary(bad: int) -> None:
    with pytest.raises(CacheError, match=f"token id {bad} is outside the vocabulary"):
        _bos_join([[5], [bad, 6]], 1, 100, np.dtype("<u2"), "train documents")


class _ListsOnly:
    """A tokenizer that only gives id lists: the cache build's list path."""

    encode_arrays = None

    def __init__(self, tok) -> None:
        self.tok = tok

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("kind", ["bpe", "byte", "char"])
def test_array_and_list_paths_write_identical_caches(kind: str, tmp_path) -> None:
    from lockstep.data.cache_build import build_pretrain_cache
    from lockstep.tokenizer.kinds import train_tokenizer

    docs = [f"Document {i}: the quick brown fox <|bos|> jumps é {i * 7919}." * (1 + i % 5) for i in range(300)]
    tok = train_tokenizer(kind, docs, vocab_size=300 if kind == "bpe" else None)
    metas = []
    for name, t in (("arrays", tok), ("lists", _ListsOnly(tok))):
        metas.append(build_pretrain_cache({"train": iter(docs), "val": iter(docs[:20])}, tmp_path / name, tokenizer=t,
                                          max_train_tokens=5000, max_val_tokens=None, shard_bytes=4096, seed=3,
                                          shuffle_buffer=64, encode_batch_docs=32, num_threads=2))
    assert metas[0]["shards"] == metas[1]["shards"] and metas[0]["train_tokens"] == 5000
    for f in ("dataset_snapshot.json", "rendered_samples.json"):
        assert (tmp_path / "arrays" / f).read_bytes() == (tmp_path / "lists" / f).read_bytes()
