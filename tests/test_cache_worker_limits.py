"""Cache settings: each one out of range is refused with its params key; an encoding worker count
above any machine's core count (8192) is refused, one above this machine's cores is capped with
one log line, one within them is kept. No test starts a worker process (EncodePool is replaced by
a stand-in that records the count asked for and refuses)."""

from __future__ import annotations

import logging

import pytest

import lockstep.data.cache_build as cache_build
from _cache_stage import make_workdir, one_error_line, run_stage, tree, write_params
from lockstep.data.cache import CacheError
from lockstep.data.cache_build import build_pretrain_cache


@pytest.fixture
def workdir(tmp_path, monkeypatch, repo_root):
    return make_workdir(tmp_path, monkeypatch, repo_root)


class _NoWorkers:
    """Stands in for EncodePool: records the count asked for and refuses to start anything."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def __call__(self, *a, num_workers: int, **k):
        self.asked.append(num_workers)
        raise RuntimeError(f"test: would start {num_workers} worker processes")


def test_absurd_worker_count_is_refused_with_its_key(workdir, monkeypatch, capsys):
    pool = _NoWorkers()
    monkeypatch.setattr(cache_build, "EncodePool", pool)
    write_params(workdir, {"num_workers": 1_000_000})
    status, err = run_stage(monkeypatch, capsys, "notes", "pretrain")
    line = one_error_line(err)
    assert status == 1 and pool.asked == []
    assert line.startswith("error: cache.notes.num_workers=1000000 must be an integer in [1, 8192]")
    assert "no machine's core count" in line and "null uses every core" in line
    assert not (workdir / "cache").exists()


def test_worker_count_above_the_cores_is_capped_and_logged(workdir, monkeypatch, capsys, caplog):
    pool = _NoWorkers()
    monkeypatch.setattr(cache_build, "EncodePool", pool)
    monkeypatch.setattr(cache_build, "available_cores", lambda: 1, raising=False)
    write_params(workdir, {"num_workers": 64})
    with caplog.at_level(logging.INFO):
        status, _ = run_stage(monkeypatch, capsys, "notes", "pretrain")
    assert status == 0 and pool.asked == []  # one core: encoded in the stage's process
    capped = [r.getMessage() for r in caplog.records if "capped" in r.getMessage()]
    assert len(capped) == 1 and capped[0].startswith("cache.notes.num_workers=64 capped at 1: ")
    one = tree(workdir / "cache/pretrain/notes")
    write_params(workdir, {"num_workers": 1})
    assert run_stage(monkeypatch, capsys, "notes", "pretrain")[0] == 0
    assert tree(workdir / "cache/pretrain/notes") == one


def test_library_caps_workers_at_the_cores_available(tok, tmp_path, monkeypatch, caplog):
    pool = _NoWorkers()
    monkeypatch.setattr(cache_build, "EncodePool", pool)
    monkeypatch.setattr(cache_build, "available_cores", lambda: 3, raising=False)
    with (
        caplog.at_level(logging.INFO, logger="lockstep.data.cache_build"),
        pytest.raises(RuntimeError, match="would start 3"),
    ):
        build_pretrain_cache(["a doc"], tmp_path / "c", tokenizer=tok, max_train_tokens=None, max_val_tokens=None,
                             shard_bytes=64, seed=0, shuffle_buffer=1, num_workers=500, tokenizer_dir=tmp_path)
    assert pool.asked == [3] and any("num_workers=500 capped at 3" in r.getMessage() for r in caplog.records)
    with pytest.raises(CacheError, match=r"num_workers=100000 must be an integer >= 1 .* at most 8192"):
        build_pretrain_cache(["a doc"], tmp_path / "d", tokenizer=tok, max_train_tokens=None, max_val_tokens=None,
                             shard_bytes=64, seed=0, shuffle_buffer=1, num_workers=100_000, tokenizer_dir=tmp_path)
    assert pool.asked == [3] and not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_worker_counts_within_the_cores_are_kept(monkeypatch, caplog):
    monkeypatch.setattr(cache_build, "available_cores", lambda: 4)
    with caplog.at_level(logging.INFO, logger="lockstep.data.cache_build"):
        assert [cache_build.encode_workers(n) for n in (None, 1, 4)] == [4, 1, 4]
    assert not caplog.records


@pytest.mark.parametrize("key, value, says", [
    ("num_threads", 100_000, "tokenizer threads of the in-process path; more than 8192"),
    ("num_workers", 0, "null uses every core"),
    ("shard_bytes", 0, "bytes per pretrain shard"),
    ("shuffle_buffer", 0, "1 keeps the stored order"),
    ("val_frac", 1.0, "the share of train examples carved out as val"),
    ("encode_batch_docs", 0, "documents per encode call"),
    ("artifact_records", -1, "parity artifacts"),
    ("max_train_tokens", -5, "null writes it whole"),
])
def test_cache_settings_out_of_range_are_refused_with_their_key(key, value, says):
    from lockstep.core.config import ConfigError, build_config

    with pytest.raises(ConfigError) as e:
        build_config(cache_build.CacheConfig, {"kind": "pretrain", key: value}, where="cache.notes")
    assert str(e.value).startswith(f"cache.notes.{key}={value!r} must be ") and says in str(e.value)
