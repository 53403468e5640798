"""Resumable FineWeb-Edu fetch: a fetch killed (SIGKILL, Ctrl-C, network failure after the retries)
and run again resumes from its last finished part and publishes the same bytes as an
uninterrupted fetch; resume state made for other params is never reused; the hub path reads its
data files through the same calls as local parquet; progress lines appear."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from _fineweb_shards import no_thread_shutdown_sleep, write_shards
import lockstep.data.sources.common as common
import lockstep.data.sources.fineweb_edu as fineweb_edu
from lockstep.core.config import build_config
from lockstep.data.snapshot import SnapshotError
from lockstep.data.sources import SOURCE_CONFIGS, fetch_source, iter_records
from lockstep.data.sources.common import SourceUnavailableError
from lockstep.data.sources.shards import STATE_FILE, WORK_DIR, window_shuffle

ROOT = Path(__file__).resolve().parents[1]
PART_BYTES = 2_000  # many small parts, so a kill lands between and inside them
N_SHARDS, DOCS_PER_SHARD = 4, 50


@pytest.fixture(autouse=True)
def _no_thread_shutdown_sleep(monkeypatch):
    no_thread_shutdown_sleep(monkeypatch)


def _one_bad_record(s: int, rows: list) -> None:
    rows[7]["text"] = ""  # one bad record per shard: the skipped count and reasons must survive a resume


def _shards(d: Path) -> Path:
    return write_shards(d, shards=N_SHARDS, docs=DOCS_PER_SHARD, edit=_one_bad_record)


def _params(src: Path, **over) -> dict:
    return {"source": "fineweb_edu", "path": str(src), "shuffle_buffer": 16, "max_train_chars": 30_000,
            "max_val_chars": 5_000, "max_retries": 0, "backoff_s": 0.0, **over}


def _fetch(params: dict, out: Path, resume: Path | None, *, seed: int = 3) -> dict:
    cfg = build_config(SOURCE_CONFIGS["fineweb_edu"], params, where="fetch.fw")
    return fetch_source("fw", cfg, out, seed=seed, part_bytes=PART_BYTES, resume_dir=resume)


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def reference(tmp_path):
    """Source shards and the snapshot of an uninterrupted fetch of them (seed 3)."""
    src = _shards(tmp_path / "src")
    out = tmp_path / "reference"
    meta = _fetch(_params(src), out, tmp_path / "partial_ref")
    assert not (tmp_path / "partial_ref").exists()  # removed once published
    assert len(meta["files"]) >= 6 and meta["counts"]["skipped"] >= 1 and not meta["stream_exhausted"]
    return src, out


def test_resume_dir_changes_nothing_in_the_snapshot(tmp_path, reference):
    src, ref = reference
    _fetch(_params(src), tmp_path / "plain", None)
    assert _files(tmp_path / "plain") == _files(ref)


def test_sigkill_mid_part_then_resume_gives_the_same_bytes(tmp_path, reference, caplog):
    src, ref = reference
    partial, out = tmp_path / "partial", tmp_path / "out"
    # Kill the fetching process outright (no cleanup runs) at the 70th record, inside a part.
    script = textwrap.dedent(f"""
        import os, signal, sys
        import lockstep.data.snapshot as snapshot
        from lockstep.core.config import build_config
        from lockstep.data.sources import SOURCE_CONFIGS, fetch_source
        real_add, calls = snapshot.SnapshotWriter.add, [0]
        def add(self, *a, **k):
            calls[0] += 1
            if calls[0] == 70:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_add(self, *a, **k)
        snapshot.SnapshotWriter.add = add
        cfg = build_config(SOURCE_CONFIGS["fineweb_edu"], {_params(src)!r}, where="fetch.fw")
        fetch_source("fw", cfg, {str(out)!r}, seed=3, part_bytes={PART_BYTES}, resume_dir={str(partial)!r})
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "lib"), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not out.exists() and (partial / STATE_FILE).is_file()
    work = partial / WORK_DIR
    kept = {p.relative_to(work).as_posix(): p.stat().st_ino for p in work.rglob("*.parquet")}
    assert len(kept) >= 3  # finished parts, plus the one being written when killed
    with caplog.at_level(logging.INFO, logger="lockstep.sources"):
        _fetch(_params(src), out, partial)
    assert "resuming from" in caplog.text
    assert _files(out) == _files(ref)
    assert not partial.exists()
    # Finished parts were kept, not rewritten: the published file is the same inode.
    survived = [name for name, ino in kept.items() if (out / name).stat().st_ino == ino]
    assert "val/part_00000.parquet" in survived and "train/part_00000.parquet" in survived


@pytest.mark.parametrize("failure", ["network", "ctrl-c"])
def test_failure_keeps_state_and_rerun_resumes(tmp_path, reference, monkeypatch, caplog, failure):
    src, ref = reference
    partial, out = tmp_path / "partial", tmp_path / "out"
    real = common.retrying_stream
    opened = {"n": 0}

    def dying_stream(make_iter, **kw):
        opened["n"] += 1
        if opened["n"] == 3:  # the third shard: earlier shards' parts are finished by then
            if failure == "ctrl-c":
                raise KeyboardInterrupt
            kw = {**kw, "max_retries": 0}

            def broken():
                raise ConnectionError("connection reset")
                yield  # pragma: no cover (makes this a generator)

            return real(broken, **kw)
        return real(make_iter, **kw)

    monkeypatch.setattr(common, "retrying_stream", dying_stream)
    with pytest.raises(KeyboardInterrupt if failure == "ctrl-c" else SourceUnavailableError):
        _fetch(_params(src), out, partial)
    assert not out.exists() and (partial / STATE_FILE).is_file()
    monkeypatch.setattr(common, "retrying_stream", real)
    # More retries for the rerun: they decide nothing in the output, so the state is still valid.
    with caplog.at_level(logging.INFO, logger="lockstep.sources"):
        _fetch(_params(src, max_retries=3), out, partial)
    assert "resuming from" in caplog.text and "not reusing" not in caplog.text
    got, want = _files(out), _files(ref)
    meta, ref_meta = json.loads(got.pop("meta.json")), json.loads(want.pop("meta.json"))
    assert got == want
    assert meta["config"].pop("max_retries") == 3  # meta.json records the params it ran with
    ref_meta["config"].pop("max_retries")
    assert meta == ref_meta


def _interrupt_after_60_records(src, out, partial, monkeypatch) -> None:
    """A fetch of `src` that Ctrl-C stops at its 60th record, leaving its resume state in `partial`."""
    real_add, calls = fineweb_edu.SnapshotWriter.add, {"n": 0}

    def add(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 60:
            raise KeyboardInterrupt
        return real_add(self, *a, **k)

    monkeypatch.setattr(fineweb_edu.SnapshotWriter, "add", add)
    with pytest.raises(KeyboardInterrupt):
        _fetch(_params(src), out, partial)
    monkeypatch.setattr(fineweb_edu.SnapshotWriter, "add", real_add)


@pytest.mark.parametrize("change", ["seed", "max_train_chars", "files"])
def test_stale_state_is_not_reused(tmp_path, reference, monkeypatch, caplog, change):
    src, _ = reference
    partial = tmp_path / "partial"
    _interrupt_after_60_records(src, tmp_path / "out", partial, monkeypatch)
    assert (partial / STATE_FILE).is_file()
    seed, params = 3, _params(src)
    if change == "seed":
        seed = 4
    elif change == "max_train_chars":
        params = _params(src, max_train_chars=25_000)
    else:
        (src / "000_00003.parquet").unlink()  # another revision of the input
    with caplog.at_level(logging.INFO, logger="lockstep.sources"):
        _fetch(params, tmp_path / "out", partial, seed=seed)
    expected_field = {"seed": "seed", "max_train_chars": "config", "files": "revision"}[change]
    assert "not reusing it" in caplog.text and expected_field in caplog.text and "resuming from" not in caplog.text
    _fetch(params, tmp_path / "fresh", None, seed=seed)
    assert _files(tmp_path / "out") == _files(tmp_path / "fresh")


def test_damaged_kept_part_is_refused(tmp_path, reference, monkeypatch):
    src, _ = reference
    partial = tmp_path / "partial"
    _interrupt_after_60_records(src, tmp_path / "out", partial, monkeypatch)
    part = partial / WORK_DIR / "train" / "part_00000.parquet"
    part.write_bytes(part.read_bytes()[:-10])
    with pytest.raises(SnapshotError, match="delete the resume folder"):
        _fetch(_params(src), tmp_path / "out", partial)


def test_hub_path_streams_its_data_files_like_local_parquet(tmp_path, reference, monkeypatch):
    """The hub branch (file list from the dataset builder, one `load_dataset("parquet", ...)`
    stream per file) on local files standing in for the `hf://` addresses."""
    src, ref = reference
    import datasets

    class Builder:
        class config:
            data_files = {"train": [str(p) for p in sorted(src.glob("*.parquet"), reverse=True)]}

    seen = []
    monkeypatch.setattr(datasets, "load_dataset_builder", lambda *a, **k: seen.append((a, k)) or Builder())
    params = {**_params(src), "path": None, "revision": "0123456789abcdef0123456789abcdef01234567"}
    meta = _fetch(params, tmp_path / "hub", tmp_path / "partial")
    assert seen == [(("HuggingFaceFW/fineweb-edu", "CC-MAIN-2024-10"), {"revision": params["revision"]})]
    assert meta["source_id"] == "HuggingFaceFW/fineweb-edu" and meta["revision"] == params["revision"]
    for split in ("train", "val"):
        assert list(iter_records(tmp_path / "hub", split)) == list(iter_records(ref, split))


def test_progress_lines_during_fetch(tmp_path, reference, monkeypatch, caplog):
    src, _ = reference
    monkeypatch.setattr(fineweb_edu, "PROGRESS_INTERVAL_S", 0.0)
    with caplog.at_level(logging.INFO, logger="lockstep.sources.fineweb_edu"):
        _fetch(_params(src), tmp_path / "out", None)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fetch fineweb_edu:")]
    assert len(lines) > 50
    for field in ("docs/s", "MB/s", "/35.0k chars", "elapsed", "eta"):
        assert field in lines[-1]


def test_window_shuffle_is_windowed_and_resumable():
    rows = list(range(50))
    out = list(window_shuffle(rows, 16, torch.Generator().manual_seed(0)))
    assert [i for i, _ in out] == [r for _, r in out]  # index travels with its row
    for w in range(0, 50, 16):
        assert sorted(r for _, r in out[w : w + 16]) == rows[w : w + 16]  # each window stays together
    assert [r for _, r in out] != rows
    again = list(window_shuffle(rows, 16, torch.Generator().manual_seed(0)))
    assert again == out
    with pytest.raises(ValueError, match="window=0"):
        list(window_shuffle(rows, 0, torch.Generator()))


def test_fetch_stage_with_resume_dir_publishes_and_cleans_up(tmp_path):
    src = _shards(tmp_path / "src")
    params = yaml.safe_load((ROOT / "presets" / "tiny.yaml").read_text())
    params["fetch"] = {"fw": _params(src)}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "lib"), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "stages.fetch", "fw", f"--out={tmp_path / 'raw'}",
                           f"--resume-dir={tmp_path / 'partial' / 'fw'}", f"--params={tmp_path / 'params.yaml'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "raw" / "meta.json").is_file() and not (tmp_path / "partial" / "fw").exists()
    assert "fetch fineweb_edu:" in proc.stderr  # the final progress line
