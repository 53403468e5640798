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

from lockstep.core.config import ConfigError
from lockstep.core.io import sha256_file
from lockstep.data.cache import CacheError, find_cache, open_pretrain_split, open_sft_split, read_cache_meta
from lockstep.data.cache_build import build_pretrain_cache, build_sft_cache
from lockstep.data.records import problem_to_conversation


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
    raw = np.concatenate(
        [np.fromfile(tmp_path / "c" / "train" / s["name"], dtype="<u2") for s in meta["shards"]["train"]]
    )
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
    itemsize = 2 if vocab <= 65_536 else 4
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
        parts += [
            {"type": "python", "text": "2+2"},
            {"type": "python_output", "text": "4"},
            {"type": "text", "text": "so 4"},
        ]
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
    problem = {"question": "Tom has 3 apples and buys 4. How many?", "answer": "He has <<3+4=7>>7.\n#### 7"}
    meta = build_sft_cache({"train": [problem]}, tmp_path / "g", tokenizer=tok, val_frac=None, seed=0)
    s = open_sft_split(tmp_path / "g" / "train_tokens.bin", tmp_path / "g" / "train_idx.npy")
    ids, mask = tok.render_conversation(problem_to_conversation(problem))
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
from lockstep.data.cache_build import build_pretrain_cache
from lockstep.tokenizer.kinds import train_tokenizer
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


def test_killed_build_leaves_work_that_the_next_build_removes(tmp_path):
    out = tmp_path / "cache" / "c"
    neighbour = tmp_path / "cache" / ".cc.abcdefgh.tmp"  # work of another output: never touched
    neighbour.mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_BUILD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    stale = [p for p in (tmp_path / "cache").iterdir() if p != neighbour]
    assert stale and all(p.name.startswith(".c.") and p.name.endswith(".tmp") for p in stale)
    _build(ListTokenizer([[1, 2]], vocab_size=10), out, ["0"])
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".cc.abcdefgh.tmp", "c"]
    assert _stream(open_pretrain_split(out / "train")).tolist() == [9, 1, 2]


# ---------------------------------------------------------------------------------------------
# token dtype at the uint16 boundary: a vocabulary of 65,536 ids still fits uint16


class ArrayTokenizer(ListTokenizer):
    """ListTokenizer with the uint32-array encoding path that BPE tokenizers take."""

    def encode_arrays(self, texts):
        return [np.asarray(ids, dtype=np.uint32) for ids in self.encode(texts)]


@pytest.mark.parametrize("tokenizer_class", [ListTokenizer, ArrayTokenizer], ids=["lists", "arrays"])
@pytest.mark.parametrize("vocab, dtype", [(65_535, "<u2"), (65_536, "<u2"), (65_537, "<u4")])
def test_token_dtype_boundary_writes_the_narrowest_file(tmp_path, vocab, dtype, tokenizer_class):
    top = vocab - 1  # the largest id, also BOS for ListTokenizer
    tok = tokenizer_class([[0, top - 1, top]], vocab_size=vocab)
    meta = build_pretrain_cache({"train": ["0"]}, tmp_path / "c", tokenizer=tok, max_train_tokens=None,
                                max_val_tokens=None, shard_bytes=1 << 20, seed=0, shuffle_buffer=1)  # fmt: skip
    assert meta["token_dtype"] == {"<u2": "uint16", "<u4": "uint32"}[dtype]
    shard = tmp_path / "c" / "train" / "shard_00000.bin"
    assert shard.stat().st_size == 4 * np.dtype(dtype).itemsize  # BOS + 3 ids
    assert np.fromfile(shard, dtype=dtype).tolist() == [top, 0, top - 1, top]
    assert _stream(open_pretrain_split(tmp_path / "c" / "train")).tolist() == [top, 0, top - 1, top]


# ---------------------------------------------------------------------------------------------
# a folder and its meta.json must agree: unlisted files, edited shard lists and missing keys


def _edit_meta(cache: Path, edit) -> None:
    meta = json.loads((cache / "meta.json").read_text())
    edit(meta)
    (cache / "meta.json").write_text(json.dumps(meta))


def _drop_last_train_shard(c: Path, *, delete_file: bool) -> None:
    last = {}
    _edit_meta(c, lambda m: last.update(m["shards"]["train"].pop()))
    if delete_file:
        (c / "train" / last["name"]).unlink()


@pytest.mark.parametrize(
    "damage, pattern",
    [
        (
            lambda c: (c / "train" / "shard_00999.bin").write_bytes((c / "train" / "shard_00000.bin").read_bytes()),
            r"shard_00999\.bin is not listed in .*meta\.json",
        ),
        (lambda c: (c / "train" / "notes.txt").write_text("x"), r"notes\.txt is not listed in .*meta\.json"),
        (
            lambda c: _drop_last_train_shard(c, delete_file=False),
            r"meta\.json: the \d+ train shards listed hold \d+ tokens",
        ),
        (
            lambda c: _drop_last_train_shard(c, delete_file=True),
            r"meta\.json: the \d+ train shards listed hold \d+ tokens",
        ),
        (lambda c: _edit_meta(c, lambda m: m["shards"]["train"].pop(0)), r"meta\.json: shards\.train\[0\] is not"),
        (lambda c: _edit_meta(c, lambda m: m.pop("shards")), r"meta\.json lacks shards for a pretrain cache"),
        (lambda c: _edit_meta(c, lambda m: m.pop("train_tokens")), r"meta\.json lacks train_tokens"),
        (
            lambda c: _edit_meta(c, lambda m: m["shards"]["train"][1].pop("tokens")),
            r"meta\.json: shards\.train\[1\] is not",
        ),
        (lambda c: _edit_meta(c, lambda m: m["shards"].pop("val")), r"meta\.json: `shards` must map train and val"),
        (lambda c: _edit_meta(c, lambda m: m.update(val_tokens="12")), r"meta\.json: val_tokens='12' is not a count"),
    ],
    ids=[
        "extra-shard",
        "extra-file",
        "entry-removed",
        "entry-and-file-removed",
        "first-entry-removed",
        "no-shards",
        "no-train-tokens",
        "shard-without-tokens",
        "no-val-list",
        "count-not-int",
    ],
)
def test_pretrain_folder_and_meta_disagreeing_is_refused(built, damage, pattern):
    damage(built / "c")
    with pytest.raises(CacheError, match=pattern):
        open_pretrain_split(built / "c" / "train", verify=False)


def test_dot_named_work_files_in_a_split_are_not_extra_shards(built):
    (built / "c" / "train" / ".shard_00009.bin.tmp").write_bytes(b"\0\0")
    assert open_pretrain_split(built / "c" / "train").tokens > 0


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda m: m.pop("files"), r"meta\.json lacks files for a sft cache"),
        (lambda m: m.pop("val_examples"), r"meta\.json lacks val_examples"),
        (lambda m: m.pop("train_tokens"), r"meta\.json lacks train_tokens"),
        (lambda m: m["files"]["train_idx.npy"].pop("sha256"), r"meta\.json: files\.train_idx\.npy is missing or lacks"),
        (lambda m: m["files"].pop("val_mask.bin"), r"meta\.json: files\.val_mask\.bin is missing"),
    ],
    ids=["no-files", "no-val-examples", "no-train-tokens", "no-idx-sha", "no-val-mask"],
)
def test_sft_meta_missing_keys_is_a_cache_error(built, edit, pattern):
    _edit_meta(built / "s", edit)
    with pytest.raises(CacheError, match=pattern):
        open_sft_split(built / "s" / "val_tokens.bin", built / "s" / "val_idx.npy")


def test_sft_tokens_and_index_of_different_splits_are_refused(built):
    with pytest.raises(CacheError, match=r"val_idx\.npy is not the index of train_tokens\.bin"):
        open_sft_split(built / "s" / "train_tokens.bin", built / "s" / "val_idx.npy")


# ---------------------------------------------------------------------------------------------
# the input forms of the builders: split mappings, one iterable, bare message lists


def test_pretrain_from_one_iterable_fills_the_named_split(tok, tmp_path):
    docs = _docs(12)
    args = dict(tokenizer=tok, max_train_tokens=None, max_val_tokens=None, shard_bytes=300, seed=7, shuffle_buffer=4)
    mapped = build_pretrain_cache({"train": docs}, tmp_path / "m", **args)
    listed = build_pretrain_cache(docs, tmp_path / "l", **args)
    streamed = build_pretrain_cache((d for d in docs), tmp_path / "g", **args)
    for meta, root in ((listed, tmp_path / "l"), (streamed, tmp_path / "g")):
        assert meta["split_rule"] == "all documents -> train shards"
        assert (meta["train_docs"], meta["val_docs"], meta["val_tokens"]) == (12, 0, 0)
        assert meta["shards"] == mapped["shards"]  # same shards, same hashes as the mapping form
        assert np.array_equal(
            _stream(open_pretrain_split(root / "train")), _stream(open_pretrain_split(tmp_path / "m" / "train"))
        )
    val_only = build_pretrain_cache(docs, tmp_path / "v", split="val", **args)
    assert (val_only["train_tokens"], val_only["val_docs"]) == (0, 12)
    assert val_only["split_rule"] == "all documents -> val shards"
    assert _stream(open_pretrain_split(tmp_path / "v" / "val")).size == val_only["val_tokens"] > 0


@pytest.mark.parametrize(
    "texts, kw, pattern",
    [
        ("one long document", {}, r"texts is a str; pass an iterable of documents"),
        (b"bytes", {}, r"texts is a bytes"),
        (42, {}, r"texts is a int"),
        (["a"], {"split": "test"}, r"split='test' must be one of"),
        ({"test": ["a"]}, {}, r"texts must map \"train\".*got keys \['test'\]"),
    ],
    ids=["str", "bytes", "int", "bad-split", "bad-keys"],
)
def test_pretrain_input_of_the_wrong_shape_is_refused(tok, tmp_path, texts, kw, pattern):
    with pytest.raises(TypeError, match=pattern):
        build_pretrain_cache(texts, tmp_path / "c", tokenizer=tok, max_train_tokens=None, max_val_tokens=None,
                             shard_bytes=64, seed=0, shuffle_buffer=1, **kw)  # fmt: skip
    assert not (tmp_path / "c").exists()


def test_sft_from_a_list_of_message_lists(tok, tmp_path):
    message_lists = [_conv(i, tool=i % 2 == 1)["messages"] for i in range(6)]
    meta = build_sft_cache(message_lists, tmp_path / "s", tokenizer=tok, val_frac=None, seed=0)
    assert (meta["train_examples"], meta["val_examples"]) == (6, 0) and meta["split_rule"] == "all examples -> train"
    s = open_sft_split(tmp_path / "s" / "train_tokens.bin", tmp_path / "s" / "train_idx.npy")
    for i, messages in enumerate(message_lists):
        lo, hi = s.bounds(i)
        ids, mask = tok.render_conversation({"messages": messages})
        assert s.tokens[lo:hi].tolist() == ids and s.mask[lo:hi].tolist() == mask
    # the same conversations wrapped as {"messages": ...} give the same bytes
    build_sft_cache([{"messages": m} for m in message_lists], tmp_path / "w", tokenizer=tok, val_frac=None, seed=0)
    assert _file_hashes(tmp_path / "s") == _file_hashes(tmp_path / "w")
    split = build_sft_cache(message_lists, tmp_path / "f", tokenizer=tok, val_frac=0.5, seed=0)
    assert (split["train_examples"], split["val_examples"]) == (3, 3)
    val = build_sft_cache(message_lists, tmp_path / "v", tokenizer=tok, val_frac=None, seed=0, split="val")
    assert (val["train_examples"], val["val_examples"]) == (0, 6)


@pytest.mark.parametrize(
    "examples, kw, error, pattern",
    [
        ([[{"text": "no role"}]], {"val_frac": None}, TypeError, r"train example 0 is neither a conversation"),
        ([[]], {"val_frac": None}, TypeError, r"train example 0 is neither"),
        ("a str", {"val_frac": None}, TypeError, r"examples is a str"),
        ([_conv(0)], {"val_frac": 0.5, "split": "val"}, TypeError, r"split='val' applies only without val_frac"),
        ([_conv(0)], {"val_frac": None, "split": "dev"}, TypeError, r"split='dev' must be one of"),
        ([_conv(0)], {"val_frac": 1.0}, CacheError, r"val_frac=1.0 must be in \[0, 1\)"),
    ],
    ids=["message-without-role", "empty-list", "str", "split-with-val-frac", "bad-split", "val-frac-1"],
)
def test_sft_input_of_the_wrong_shape_is_refused(tok, tmp_path, examples, kw, error, pattern):
    with pytest.raises(error, match=pattern):
        build_sft_cache(examples, tmp_path / "s", tokenizer=tok, seed=0, **kw)
    assert not (tmp_path / "s").exists()


def test_find_cache_looks_under_pretrain_then_sft_and_names_the_key(tmp_path):
    for folder in ("pretrain/both", "sft/both", "sft/chat", "sft/empty"):
        (tmp_path / folder).mkdir(parents=True)
    for folder in ("pretrain/both", "sft/both", "sft/chat"):
        (tmp_path / folder / "meta.json").write_text("{}")
    assert find_cache(tmp_path, "both", key="k") == ("pretrain", tmp_path / "pretrain/both")
    assert find_cache(tmp_path, "sft/both", key="k") == ("sft", tmp_path / "sft/both")
    assert find_cache(tmp_path, "chat", key="k") == ("sft", tmp_path / "sft/chat")
    with pytest.raises(ConfigError, match=r"^sft\.mixture\.pretrain/chat: none of \[.*pretrain/chat'\] holds a cache"):
        find_cache(tmp_path, "pretrain/chat", key="sft.mixture.pretrain/chat")
    with pytest.raises(ConfigError, match=r"^rl\.anchor\.empty: none of .* holds a cache \(a meta\.json\)"):
        find_cache(tmp_path, "sft/empty", key="rl.anchor.empty")
    with pytest.raises(ConfigError, match=r"^m\.x: cache 'eval/x' must be pretrain/NAME, sft/NAME or a bare NAME"):
        find_cache(tmp_path, "eval/x", key="m.x")
