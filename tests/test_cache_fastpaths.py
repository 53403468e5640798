"""Tests of the cache build's batched paths against the per-record ones they replace: snapshot
lines and BOS joining. Not a test of the cache format (tests/test_cache.py)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.cache import CacheError, _bos_join
from lockstep.parity import SnapshotCollector, _text_lines


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
