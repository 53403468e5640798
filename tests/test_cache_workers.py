"""Pretrain caches encoded in worker processes (lockstep.data.encode.EncodePool) against the in-process
reference path: the same bytes for every file, for each tokenizer kind, with and without caps;
the stage's default (every core) against `num_workers: 1` on the tiny preset's roam notes; clear
errors for bad settings; progress lines with token rates."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

import lockstep.data.cache_build as cache_build
from lockstep.core.config import ConfigError
from lockstep.core.io import sha256_file
from lockstep.data.cache import CacheError
from lockstep.data.cache_build import build_pretrain_cache
from lockstep.tokenizer.kinds import train_tokenizer

DOCS = [f"Document {i}: the quick brown fox <|bos|> jumps é {i * 7919}. " * (1 + i % 7) for i in range(400)]


def _hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}


def _build(out: Path, tok, tok_dir: Path | None, *, num_workers: int, cap: int | None = None, **kw) -> dict:
    return build_pretrain_cache(
        {"train": iter(DOCS), "val": iter(DOCS[:30])}, out, tokenizer=tok, max_train_tokens=cap, max_val_tokens=None,
        shard_bytes=4096, seed=3, shuffle_buffer=64, encode_batch_docs=32, num_threads=2,
        num_workers=num_workers, tokenizer_dir=tok_dir, **kw,
    )  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(tokenizer, its folder) per kind."""
    root = tmp_path_factory.mktemp("toks")
    out = {}
    for kind in ("bpe", "byte", "char"):
        tok = train_tokenizer(kind, DOCS, vocab_size=400 if kind == "bpe" else None)
        tok.save(root / kind)
        out[kind] = (tok, root / kind)
    return out


@pytest.mark.parametrize("kind", ["bpe", "byte", "char"])
@pytest.mark.parametrize("cap", [None, 7000])
def test_worker_processes_write_the_same_cache_as_the_plain_path(tmp_path, saved, kind, cap):
    tok, tok_dir = saved[kind]
    plain = _build(tmp_path / "plain", tok, None, num_workers=1, cap=cap)
    workers = _build(tmp_path / "workers", tok, tok_dir, num_workers=2, cap=cap)
    assert workers == plain
    assert _hashes(tmp_path / "workers") == _hashes(tmp_path / "plain")
    assert len(plain["shards"]["train"]) > 1 and (cap is None or plain["train_tokens"] == cap)


def test_bad_worker_settings_are_refused(tmp_path, saved):
    tok, tok_dir = saved["bpe"]
    with pytest.raises(CacheError, match=r"num_workers=0 must be an integer >= 1"):
        _build(tmp_path / "a", tok, tok_dir, num_workers=0)
    with pytest.raises(CacheError, match="needs tokenizer_dir"):
        _build(tmp_path / "b", tok, None, num_workers=2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _build(tmp_path / "c", tok, tmp_path / "nowhere", num_workers=2)
    with pytest.raises(CacheError, match=r"is not the one building this cache"):
        _build(tmp_path / "d", tok, saved["byte"][1], num_workers=2)
    assert not any((tmp_path / n).exists() for n in "abcd")


def test_progress_lines_while_caching(tmp_path, saved, monkeypatch, caplog):
    tok, tok_dir = saved["bpe"]
    monkeypatch.setattr(cache_build, "PROGRESS_INTERVAL_S", 0.0)
    with caplog.at_level(logging.INFO, logger="lockstep.data.cache_build"):
        _build(tmp_path / "c", tok, tok_dir, num_workers=2, cap=7000)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cache pretrain train:")]
    assert len(lines) >= 3
    for field in ("docs/s", "MB/s", "tokens/s", "/7.0k tokens", "elapsed", "eta"):
        assert field in lines[-2], lines[-2]


@pytest.fixture
def roam_workdir(tmp_path, monkeypatch, repo_root):
    """The tiny preset's roam snapshot (corpus/notes) and a small BPE tokenizer trained on it."""
    from lockstep.core.config import build_config
    from lockstep.data.sources import SOURCE_CONFIGS, fetch_source, iter_records

    monkeypatch.syspath_prepend(str(repo_root))  # `stages` is imported from the checkout, not installed
    monkeypatch.chdir(tmp_path)
    preset = yaml.safe_load((repo_root / "presets" / "tiny.yaml").read_text())
    fetch_cfg = build_config(
        SOURCE_CONFIGS["roam"], {**preset["fetch"]["roam"], "path": str(repo_root / "corpus/notes")}, where="fetch.roam"
    )
    fetch_source("roam", fetch_cfg, tmp_path / "raw/roam", seed=preset["data_seed"])
    texts = [r["text"] for r in iter_records(tmp_path / "raw/roam", "train")]
    train_tokenizer("bpe", texts, vocab_size=512).save(tmp_path / "tok")
    return tmp_path, preset


def test_stage_default_workers_equal_one_worker_on_the_tiny_roam_cache(roam_workdir):
    from stages.cache import main

    workdir, preset = roam_workdir
    outs = {}
    for label, workers in (("default", None), ("one", 1)):
        params = {"seed": preset["seed"], "data_seed": preset["data_seed"],
                  "cache": {"roam": {**preset["cache"]["roam"], "num_workers": workers}}}
        (workdir / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
        main(["roam", "--raw", "raw/roam", "--tokenizer", "tok", "--out", f"cache/{label}"])
        outs[label] = _hashes(workdir / "cache" / label)
    assert outs["default"] == outs["one"] and "train/shard_00000.bin" in outs["one"]
    params["cache"]["roam"]["num_workers"] = 0
    (workdir / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"cache.roam.num_workers=0 must be an integer in \[1, 8192\]"):
        main(["roam", "--raw", "raw/roam", "--tokenizer", "tok", "--out", "cache/zero"])
