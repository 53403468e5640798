"""Token cache writers and readers: roundtrip, determinism, caps, dtypes, corruption, crash safety."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockstep.cache import (
    CacheError,
    build_pretrain_cache,
    build_sft_cache,
    open_pretrain_split,
    open_sft_split,
    read_cache_meta,
)
from lockstep.io import sha256_file


class ListTokenizer:
    """Test double: document `str(i)` encodes to `docs[i]`, so any id array can be cached."""

    def __init__(self, docs: list[list[int]], vocab_size: int) -> None:
        self.docs = docs
        self.vocab_size = vocab_size
        self.sha256 = f"list-{vocab_size}"

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def get_bos_token_id(self) -> int:
        return self.vocab_size - 1

    def get_special_tokens(self) -> dict[str, int]:
        return {"<|bos|>": self.vocab_size - 1}

    def encode(self, texts, num_threads=1):
        return [list(self.docs[int(t)]) for t in texts]

    def decode(self, ids) -> str:
        return " ".join(str(i) for i in ids)


def _docs(n: int) -> list[str]:
    return [f"doc {i}: " + "lorem ipsum " * (i % 5) for i in range(n)]


def _stream(split) -> np.ndarray:
    return np.concatenate([np.asarray(s, dtype=np.int64) for s in split.shards]) if split.shards else np.zeros(0)


def _build(tok, out: Path, docs, **kw):
    args = dict(max_train_tokens=None, max_val_tokens=None, shard_bytes=1 << 20, seed=7, shuffle_buffer=1)
    args.update(kw)
    return build_pretrain_cache({"train": docs, "val": docs[:3]}, out, tokenizer=tok, **args)


def _file_hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def test_pretrain_roundtrip_equals_tokenization(tok, tmp_path):
    docs = _docs(40)
    meta = _build(tok, tmp_path / "c", docs, shard_bytes=300)
    bos = tok.get_bos_token_id()
    want = np.asarray([t for d in docs for t in [bos, *tok.encode(d)]], dtype=np.int64)
    raw = np.concatenate([np.fromfile(tmp_path / "c" / "train" / s["name"], dtype="<u2") for s in meta["shards"]["train"]])
    assert np.array_equal(raw.astype(np.int64), want)
    split = open_pretrain_split(tmp_path / "c" / "train", tokenizer_sha256=tok.sha256)
    assert np.array_equal(_stream(split), want)
    assert len(meta["shards"]["train"]) == -(-want.size // 150)  # 300 bytes = 150 uint16 tokens per shard
    assert all(s["tokens"] == 150 for s in meta["shards"]["train"][:-1])
    assert meta["train_tokens"] == want.size and meta["train_docs"] == 40
    for key in ("dataset_name", "dataset_config", "split_rule", "seed", "token_dtype", "tokenizer_sha256",
                "vocab_size", "special_token_ids", "train_tokens", "val_tokens", "shard_bytes"):  # fmt: skip
        assert key in meta
    assert read_cache_meta(tmp_path / "c") == json.loads((tmp_path / "c" / "meta.json").read_text())


def test_determinism_same_seed_same_bytes_other_seed_other_order(tok, tmp_path):
    docs = _docs(200)
    _build(tok, tmp_path / "a", docs, shuffle_buffer=64, shard_bytes=2000)
    _build(tok, tmp_path / "b", docs, shuffle_buffer=64, shard_bytes=2000)
    _build(tok, tmp_path / "c", docs, shuffle_buffer=64, shard_bytes=2000, seed=8)
    ha, hb, hc = _file_hashes(tmp_path / "a"), _file_hashes(tmp_path / "b"), _file_hashes(tmp_path / "c")
    assert ha == hb and len(ha) > 5
    assert ha["train/shard_00000.bin"] != hc["train/shard_00000.bin"]
    # Shuffled, but the same documents: a permutation of whole BOS-prefixed documents.
    split = open_pretrain_split(tmp_path / "a" / "train")
    stream = _stream(split)
    bos = tok.get_bos_token_id()
    pieces = np.split(stream, np.flatnonzero(stream == bos))[1:]
    got = sorted(tok.decode(p[1:].tolist()) for p in pieces)
    assert got == sorted(docs)
    assert [tok.decode(p[1:].tolist()) for p in pieces] != docs


def test_token_caps_cut_exactly_and_stop_reading(tok, tmp_path):
    read = []

    def docs():
        for i, d in enumerate(_docs(10_000)):
            read.append(i)
            yield d

    meta = build_pretrain_cache(
        {"train": docs(), "val": iter(_docs(5))}, tmp_path / "c", tokenizer=tok, max_train_tokens=1000,
        max_val_tokens=0, shard_bytes=1 << 20, seed=1, shuffle_buffer=1, encode_batch_docs=16,
    )  # fmt: skip
    assert meta["train_tokens"] == 1000 and meta["val_tokens"] == 0
    assert meta["shards"]["val"] == []
    assert len(read) < 100  # streaming stopped at the cap
    assert _stream(open_pretrain_split(tmp_path / "c" / "train")).size == 1000


def test_uint32_when_vocab_needs_it_and_out_of_range_is_an_error(tmp_path):
    big = ListTokenizer([[70_000, 5], [1]], vocab_size=70_001)
    meta = build_pretrain_cache({"train": ["0", "1"]}, tmp_path / "big", tokenizer=big, max_train_tokens=None,
                                max_val_tokens=None, shard_bytes=64, seed=0, shuffle_buffer=1)  # fmt: skip
    assert meta["token_dtype"] == "uint32"
    assert _stream(open_pretrain_split(tmp_path / "big" / "train")).tolist() == [70_000, 70_000, 5, 70_000, 1]
    liar = ListTokenizer([[65_536]], vocab_size=300)
    with pytest.raises(CacheError, match="65536 is outside the vocabulary"):
        build_pretrain_cache({"train": ["0"]}, tmp_path / "bad", tokenizer=liar, max_train_tokens=None,
                             max_val_tokens=None, shard_bytes=64, seed=0, shuffle_buffer=1)  # fmt: skip
    assert not (tmp_path / "bad").exists()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    vocab=st.sampled_from([2, 300, 65_535, 65_536, 1 << 20]),
    data=st.data(),
    shard_tokens=st.integers(1, 9),
)
def test_hypothesis_roundtrip_random_token_arrays(tmp_path_factory, vocab, data, shard_tokens):
    docs = data.draw(st.lists(st.lists(st.integers(0, vocab - 1), max_size=12), max_size=8))
    tok = ListTokenizer(docs, vocab)
    out = tmp_path_factory.mktemp("h") / "c"
    itemsize = 2 if vocab <= 65_535 else 4
    meta = build_pretrain_cache({"train": [str(i) for i in range(len(docs))]}, out, tokenizer=tok,
                                max_train_tokens=None, max_val_tokens=None, shard_bytes=shard_tokens * itemsize,
                                seed=3, shuffle_buffer=1)  # fmt: skip
    want = [t for d in docs for t in [vocab - 1, *d]]
    assert _stream(open_pretrain_split(out / "train")).tolist() == want
    assert meta["train_tokens"] == len(want) and meta["train_docs"] == len(docs)
    assert all(s["tokens"] == shard_tokens for s in meta["shards"]["train"][:-1])


def _conv(i: int, *, tool: bool = False) -> dict:
    parts = [{"type": "text", "text": f"answer {i}"}]
    if tool:
        parts += [{"type": "python", "text": "2+2"}, {"type": "python_output", "text": "4"}, {"type": "text", "text": "so 4"}]
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": f"question {i}?"}]},
                         {"role": "assistant", "content": parts}]}  # fmt: skip


def test_sft_roundtrip_offsets_and_mask(tok, tmp_path):
    convs = {"train": [_conv(i, tool=i % 2 == 0) for i in range(9)], "val": [_conv(100)]}
    meta = build_sft_cache(convs, tmp_path / "s", tokenizer=tok, val_frac=None, seed=0)
    assert meta["train_examples"] == 9 and meta["val_examples"] == 1
    for split, items in convs.items():
        s = open_sft_split(tmp_path / "s" / f"{split}_tokens.bin", tmp_path / "s" / f"{split}_idx.npy",
                           tokenizer_sha256=tok.sha256)  # fmt: skip
        raw = np.fromfile(tmp_path / "s" / f"{split}_tokens.bin", dtype="<u2")
        assert raw.size == s.tokens.size
        for i, conv in enumerate(items):
            lo, hi = s.bounds(i)
            ids, mask = tok.render_conversation(conv)
            assert s.tokens[lo:hi].tolist() == ids
            assert s.mask[lo:hi].tolist() == mask


def test_sft_val_frac_split_is_seeded_and_disjoint(tok, tmp_path):
    convs = [_conv(i) for i in range(40)]
    build_sft_cache(convs, tmp_path / "a", tokenizer=tok, val_frac=0.25, seed=5)
    build_sft_cache(convs, tmp_path / "b", tokenizer=tok, val_frac=0.25, seed=5)
    meta = build_sft_cache(convs, tmp_path / "c", tokenizer=tok, val_frac=0.25, seed=6)
    assert _file_hashes(tmp_path / "a") == _file_hashes(tmp_path / "b")
    assert (meta["train_examples"], meta["val_examples"]) == (30, 10)
    assert sha256_file(tmp_path / "a" / "val_tokens.bin") != sha256_file(tmp_path / "c" / "val_tokens.bin")
    with pytest.raises(CacheError, match="val_frac"):
        build_sft_cache({"train": convs}, tmp_path / "d", tokenizer=tok, val_frac=0.1, seed=0)


def test_sft_accepts_gsm8k_problems(tok, tmp_path):
    gsm8k = pytest.importorskip("lockstep.sources.gsm8k")
    problem = {"question": "Tom has 3 apples and buys 4. How many?", "answer": "He has <<3+4=7>>7.\n#### 7"}
    meta = build_sft_cache({"train": [problem]}, tmp_path / "g", tokenizer=tok, val_frac=None, seed=0)
    s = open_sft_split(tmp_path / "g" / "train_tokens.bin", tmp_path / "g" / "train_idx.npy")
    ids, mask = tok.render_conversation(gsm8k.problem_to_conversation(problem))
    assert s.tokens.tolist() == ids and s.mask.tolist() == mask and meta["train_examples"] == 1


# ---------------------------------------------------------------------------------------------
# corruption matrix: each damage is refused with an error naming the file


@pytest.fixture
def built(tok, tmp_path):
    _build(tok, tmp_path / "c", _docs(30), shard_bytes=200)
    build_sft_cache({"train": [_conv(i) for i in range(4)], "val": [_conv(9)]}, tmp_path / "s", tokenizer=tok,
                    val_frac=None, seed=0)  # fmt: skip
    return tmp_path


def _chop(path: Path, n_bytes: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-n_bytes])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[3] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, pattern",
    [
        (lambda c: _chop(c / "train" / "shard_00001.bin", 2), r"shard_00001\.bin is truncated"),
        (lambda c: _chop(c / "train" / "shard_00001.bin", 1), r"shard_00001\.bin has an odd byte count"),
        (lambda c: _flip(c / "train" / "shard_00000.bin"), r"shard_00000\.bin fails its sha256"),
        (lambda c: (c / "train" / "shard_00002.bin").unlink(), r"shard_00002\.bin is missing"),
        (lambda c: (c / "meta.json").unlink(), r"meta\.json is missing"),
        (lambda c: (c / "meta.json").write_text("{not json"), r"meta\.json is unreadable"),
        (lambda c: (c / "meta.json").write_bytes(b"\xff\xfe"), r"meta\.json is unreadable"),
    ],
    ids=["truncated", "odd-bytes", "sha", "missing-shard", "missing-meta", "bad-json", "not-utf8"],
)
def test_pretrain_corruption_is_refused(built, damage, pattern):
    damage(built / "c")
    with pytest.raises(CacheError, match=pattern):
        open_pretrain_split(built / "c" / "train")


@pytest.mark.parametrize(
    "damage, pattern",
    [
        (lambda s: _chop(s / "train_tokens.bin", 2), r"train_tokens\.bin is truncated"),
        (lambda s: _chop(s / "train_tokens.bin", 1), r"train_tokens\.bin has an odd byte count"),
        (lambda s: _flip(s / "train_mask.bin"), r"train_mask\.bin fails its sha256"),
        (lambda s: _flip(s / "train_idx.npy"), r"train_idx\.npy fails its sha256"),
        (lambda s: (s / "meta.json").unlink(), r"meta\.json is missing"),
    ],
    ids=["truncated", "odd-bytes", "mask-sha", "idx-sha", "missing-meta"],
)
def test_sft_corruption_is_refused(built, damage, pattern):
    damage(built / "s")
    with pytest.raises(CacheError, match=pattern):
        open_sft_split(built / "s" / "train_tokens.bin", built / "s" / "train_idx.npy")


def test_tokenizer_mismatch_is_refused(built):
    with pytest.raises(CacheError, match=r"meta\.json was built with tokenizer .* re-run the cache stage"):
        open_pretrain_split(built / "c" / "train", tokenizer_sha256="0" * 64)
    with pytest.raises(CacheError, match="tokenizer"):
        open_sft_split(built / "s" / "train_tokens.bin", built / "s" / "train_idx.npy", tokenizer_sha256="0" * 64)


_SLOW_BUILD = """
import sys, time
from lockstep.cache import build_pretrain_cache
from lockstep.tokenizer import train_tokenizer
def docs():
    for i in range(100000):
        if i == 40:
            print("started", flush=True)
        time.sleep(0.002)
        yield f"document {i} " * 20
build_pretrain_cache({"train": docs()}, sys.argv[1], tokenizer=train_tokenizer("byte", []), max_train_tokens=None,
                     max_val_tokens=None, shard_bytes=4096, seed=0, shuffle_buffer=1, encode_batch_docs=8)
"""


def test_sigkill_mid_build_leaves_no_complete_looking_output(tmp_path):
    out = tmp_path / "cache" / "c"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_BUILD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        time.sleep(0.3)  # long enough for several shards to be completed
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert not out.exists()
    tmp_dirs = list((tmp_path / "cache").iterdir())
    assert tmp_dirs and all(p.name.startswith(".") for p in tmp_dirs)  # only hidden temp work remains
    assert list(tmp_dirs[0].rglob("shard_*.bin"))  # shards were done: the kill was mid-build
    assert not list(tmp_dirs[0].rglob("meta.json"))
    with pytest.raises(CacheError, match="meta.json is missing"):
        open_pretrain_split(out / "train")
