"""A full disk or a file size limit during a fetch: the stage ends in one `error:` line naming the
folder and the fix, publishes nothing, and keeps a previous snapshot; a resumable fetch keeps its
finished parts, and once there is room again its rerun publishes the same bytes as an
uninterrupted fetch. The disk is /dev/full, which fails every write with ENOSPC: parquet parts are
written there from the chosen part on; the size limit is a real RLIMIT_FSIZE on the stage."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from _cache_stage import one_error_line, tree
from _fineweb_shards import no_thread_shutdown_sleep, write_shards
from _procs import run_with_file_size_limit, stage_env
from lockstep.core.config import build_config
from lockstep.data.snapshot import SnapshotError
from lockstep.data.sources import SOURCE_CONFIGS, fetch_source

DEV_FULL = Path("/dev/full")
pytestmark = pytest.mark.skipif(not DEV_FULL.exists(), reason="needs /dev/full (Linux) to fail writes with ENOSPC")


def _disk_full_from_part(first_full: int):
    """A stand-in for pq.ParquetWriter that writes parquet parts from the `first_full`-th on
    (0-based) to /dev/full; `.asked` counts the parts asked for."""
    real = pq.ParquetWriter

    def writer(where, *a, **k):
        writer.asked += 1
        return real(str(DEV_FULL) if writer.asked > first_full else where, *a, **k)

    writer.asked = 0
    return writer


@pytest.fixture
def workdir(tmp_path, monkeypatch, repo_root):
    monkeypatch.syspath_prepend(str(repo_root))  # `stages` is imported from the checkout, not installed
    monkeypatch.chdir(tmp_path)
    notes = tmp_path / "notes"
    notes.mkdir()
    for i in range(12):
        (notes / f"note{i:02d}.md").write_text(f"# Note {i}\n\nSome text about topic {i}. " * (i + 2), encoding="utf-8")
    params = {"seed": 1, "data_seed": 2, "fetch": {"notes": {"source": "roam", "path": "notes", "val_frac": 0.2}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    return tmp_path


def _run_stage(monkeypatch, capsys) -> tuple[int, str]:
    from stages._common import entry
    from stages.fetch import STAGE_ERRORS, main

    monkeypatch.setattr(sys, "argv", ["stages.fetch", "notes", "--out", "raw/notes"])
    capsys.readouterr()
    status = entry(main, errors=STAGE_ERRORS)
    return status, capsys.readouterr().err


def test_full_disk_during_a_fetch_ends_in_one_error_line(workdir, monkeypatch, capsys):
    monkeypatch.setattr(pq, "ParquetWriter", disk := _disk_full_from_part(0))
    status, err = _run_stage(monkeypatch, capsys)
    line = one_error_line(err)
    assert status == 1 and disk.asked == 1
    assert line.startswith("error: no space left to fetch raw/notes (No space left on device); nothing was published")
    assert "Free space on the disk holding raw" in line and "a disk with room" in line
    assert sorted(p.name for p in (workdir / "raw").iterdir()) == []  # no work folder, no meta.json


def test_full_disk_during_a_refetch_keeps_the_previous_snapshot(workdir, monkeypatch, capsys):
    assert _run_stage(monkeypatch, capsys)[0] == 0
    before = tree(workdir / "raw" / "notes")
    (workdir / "notes" / "note99.md").write_text("# New\n\nA note added since.\n", encoding="utf-8")
    monkeypatch.setattr(pq, "ParquetWriter", _disk_full_from_part(1))  # the train part is written, then full
    status, err = _run_stage(monkeypatch, capsys)
    assert status == 1 and "no space left to fetch raw/notes" in one_error_line(err)
    assert sorted(p.name for p in (workdir / "raw").iterdir()) == ["notes"]
    assert tree(workdir / "raw" / "notes") == before


def test_other_write_errors_keep_their_own_error(workdir, monkeypatch):
    from stages.fetch import main

    def writer(*a, **k):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(pq, "ParquetWriter", writer)
    with pytest.raises(OSError) as e:
        main(["notes", "--out", "raw/notes"])
    assert e.value.errno == errno.EIO and not isinstance(e.value, SnapshotError)


def test_resumable_fetch_keeps_its_parts_and_the_rerun_carries_on(tmp_path, monkeypatch):
    no_thread_shutdown_sleep(monkeypatch)
    src = write_shards(tmp_path / "src", shards=3, docs=40, edit=lambda s, rows: None)
    cfg = build_config(SOURCE_CONFIGS["fineweb_edu"], {"source": "fineweb_edu", "path": str(src), "shuffle_buffer": 8,
                       "max_train_chars": 20_000, "max_val_chars": 3_000}, where="fetch.fw")  # fmt: skip

    def fetch(out: Path, resume: Path) -> dict:
        return fetch_source("fw", cfg, out, seed=3, part_bytes=2_000, resume_dir=resume, arrow_batches=True)

    reference = fetch(tmp_path / "reference", tmp_path / "partial_ref")
    assert len(reference["files"]) >= 6
    disk = _disk_full_from_part(4)
    with monkeypatch.context() as m:
        m.setattr(pq, "ParquetWriter", disk)
        with pytest.raises(SnapshotError) as e:
            fetch(tmp_path / "out", tmp_path / "partial")
    msg = str(e.value)
    assert msg.startswith(f"no space left to fetch {tmp_path / 'out'} (No space left on device); nothing was published")
    assert f"the parts finished so far stay in {tmp_path / 'partial'}, and the rerun carries on from them" in msg
    assert not (tmp_path / "out").exists() and disk.asked == 5
    assert len(list((tmp_path / "partial").rglob("*.parquet"))) >= 4  # the finished parts, kept
    fetch(tmp_path / "out", tmp_path / "partial")
    assert tree(tmp_path / "out") == tree(tmp_path / "reference")


def test_a_file_size_limit_during_a_fetch_ends_in_one_error_line(workdir, repo_root):
    """RLIMIT_FSIZE (`ulimit -f`) below a parquet part's size, on `python -m stages.fetch` itself."""
    proc = run_with_file_size_limit([sys.executable, "-m", "stages.fetch", "notes", "--out", "raw/notes"], cwd=workdir,
                                    env=stage_env(repo_root), limit_bytes=500)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = one_error_line(proc.stderr)
    assert line.startswith(
        "error: a file reached this process's size limit of 500 bytes (RLIMIT_FSIZE) trying to fetch "
        "raw/notes (File too large); nothing was published."
    ), line
    assert not (workdir / "raw").exists() or sorted(p.name for p in (workdir / "raw").iterdir()) == []
