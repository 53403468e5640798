"""Token caches whose files were edited together with their sha256 in meta.json: readers refuse,
when a file is first opened, ids >= vocab_size and loss-mask bytes other than 0/1, naming the
file, the value, its position and the command that rebuilds the cache; the largest valid id is
still served, and a vocab_size raised past its dtype in meta.json is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lockstep.core.io import sha256_file
from lockstep.data.cache import CacheError, open_pretrain_split, open_sft_split
from lockstep.data.cache_build import build_pretrain_cache, build_sft_cache
from lockstep.data.loaders import PretrainTokenStreamDataset, SFTExampleDataset


def _conv(i: int) -> dict:
    return {
        "messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]
    }


@pytest.fixture
def caches(tok, tmp_path):
    """A pretrain cache named `notes` (3+ shards) and an SFT cache named `chat`, byte tokenizer."""
    docs = [f"document {i}: " + "lorem ipsum " * (i % 4) for i in range(20)]
    build_pretrain_cache({"train": docs, "val": docs[:3]}, tmp_path / "notes", tokenizer=tok, max_train_tokens=None,
                         max_val_tokens=None, shard_bytes=200, seed=1, shuffle_buffer=1)  # fmt: skip
    build_sft_cache({"train": [_conv(i) for i in range(4)], "val": [_conv(9)]}, tmp_path / "chat", tokenizer=tok,
                    val_frac=None, seed=0)  # fmt: skip
    return tmp_path


def _forge(cache: Path, rel: str, position: int, value: int) -> None:
    """Write `value` at `position` of the token or mask file `rel`, then rewrite its sha256 in
    meta.json so that the hash check passes: what an attacker who edits both does."""
    path = cache / rel
    meta = json.loads((cache / "meta.json").read_text())
    dtype = np.uint8 if rel.endswith("_mask.bin") else {"uint16": np.uint16, "uint32": np.uint32}[meta["token_dtype"]]
    arr = np.memmap(path, dtype=dtype, mode="r+")
    arr[position] = value
    arr.flush()
    del arr
    if meta["kind"] == "pretrain":
        split, name = rel.split("/")
        next(e for e in meta["shards"][split] if e["name"] == name)["sha256"] = sha256_file(path)
    else:
        meta["files"][rel]["sha256"] = sha256_file(path)
    (cache / "meta.json").write_text(json.dumps(meta))


def test_pretrain_id_at_vocab_size_is_refused_naming_file_value_and_command(caches, tok):
    vocab = tok.get_vocab_size()
    _forge(caches / "notes", "train/shard_00001.bin", 5, vocab)
    with pytest.raises(CacheError) as e:
        open_pretrain_split(caches / "notes" / "train")
    msg = str(e.value)
    assert str(caches / "notes" / "train" / "shard_00001.bin") in msg
    assert f"token id {vocab} at position 5" in msg and f"0..{vocab - 1}" in msg
    assert "dvc repro --force cache@notes" in msg
    with pytest.raises(CacheError, match=r"shard_00001\.bin holds token id"):  # the loaders open through it
        PretrainTokenStreamDataset(caches / "notes" / "train", T=8)


def test_pretrain_largest_valid_id_is_served(caches, tok):
    vocab = tok.get_vocab_size()
    _forge(caches / "notes", "train/shard_00000.bin", 0, vocab - 1)
    split = open_pretrain_split(caches / "notes" / "train")
    assert int(split.shards[0][0]) == vocab - 1


def test_pretrain_uint16_maximum_is_refused(caches):
    _forge(caches / "notes", "val/shard_00000.bin", 0, 65_535)
    with pytest.raises(CacheError, match=r"val/shard_00000\.bin holds token id 65535 at position 0"):
        open_pretrain_split(caches / "notes" / "val")


@pytest.mark.parametrize("value", [2, 255])
def test_sft_mask_byte_other_than_0_or_1_is_refused(caches, value):
    _forge(caches / "chat", "train_mask.bin", 3, value)
    with pytest.raises(CacheError) as e:
        SFTExampleDataset(caches / "chat" / "train_tokens.bin", caches / "chat" / "train_idx.npy", T=16, pad_id=0)
    msg = str(e.value)
    assert str(caches / "chat" / "train_mask.bin") in msg and f"mask byte {value} at position 3" in msg
    assert "only 0 and 1" in msg and "dvc repro --force cache@chat" in msg


def test_sft_id_beyond_vocab_is_refused(caches, tok):
    _forge(caches / "chat", "val_tokens.bin", 1, tok.get_vocab_size() + 7)
    with pytest.raises(CacheError, match=rf"val_tokens\.bin holds token id {tok.get_vocab_size() + 7} at position 1"):
        open_sft_split(caches / "chat" / "val_tokens.bin", caches / "chat" / "val_idx.npy")


def test_vocab_size_edited_past_its_dtype_is_refused(caches):
    """Raising vocab_size in meta.json would widen the id bound; it must still fit the dtype."""
    meta = json.loads((caches / "notes" / "meta.json").read_text())
    meta["vocab_size"] = 70_000  # uint16 files hold vocabularies of up to 65,536 ids
    (caches / "notes" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CacheError, match=r"vocab_size=70000 does not fit token_dtype='uint16'.*cache@notes"):
        open_pretrain_split(caches / "notes" / "train")
