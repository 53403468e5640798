"""A full disk or a file size limit during a cache build, through the stage's entry point: one
`error:` line naming the folder and the fix, status 1, and nothing a reader would take (no
meta.json, no half shard, no work folder; a previous cache stays byte for byte). The disk is
simulated at the builders' file writes, which write what fits and then fail with ENOSPC as the
kernel does, and at fsync; the size limit is a real RLIMIT_FSIZE on the stage's process."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from pathlib import Path

import pytest

import lockstep.data.cache_build as cache_build
from _cache_stage import make_workdir, one_error_line, run_stage, tree, write_params
from _procs import run_with_file_size_limit, stage_env
from lockstep.data.cache import CacheError, open_pretrain_split


@pytest.fixture
def workdir(tmp_path, monkeypatch, repo_root):
    return make_workdir(tmp_path, monkeypatch, repo_root)


class _Disk:
    """A disk with `room` bytes left: a write that does not fit writes what fits (a short write,
    as the kernel does) and then fails with ENOSPC, as every later write does."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.failures = 0

    def file(self, f):
        disk = self

        class Full:
            def write(self, data) -> int:
                data = memoryview(data).cast("B")
                take = min(len(data), disk.room)
                f.write(data[:take])
                disk.room -= take
                if take < len(data):
                    disk.failures += 1
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return take

            def __getattr__(self, name):
                return getattr(f, name)

        return Full()


def _fill_pretrain_disk(monkeypatch, room: int) -> _Disk:
    """Shard files opened by the pretrain builder write to a disk with `room` bytes left."""
    disk = _Disk(room)
    real_open = open
    monkeypatch.setattr(cache_build, "open", lambda *a, **k: disk.file(real_open(*a, **k)), raising=False)
    return disk


def _fill_sft_disk(monkeypatch, room: int) -> _Disk:
    """Files written by the SFT builder (through atomic_open) go to a disk with `room` bytes left."""
    disk = _Disk(room)
    real_atomic_open = cache_build.atomic_open

    @contextlib.contextmanager
    def atomic_open(path, mode="wb"):
        with real_atomic_open(path, mode) as f:
            yield disk.file(f)

    monkeypatch.setattr(cache_build, "atomic_open", atomic_open)
    return disk


def _assert_nothing_left(folder: Path, expected: dict[str, dict[str, str]]) -> None:
    """`folder` (data/cache/<kind>) holds exactly the caches in `expected`, byte for byte: no work
    folder, no meta.json, no shard of the failed build."""
    assert sorted(p.name for p in folder.iterdir()) == sorted(expected)
    for name, files in expected.items():
        assert tree(folder / name) == files


def test_full_disk_during_a_pretrain_build_ends_in_one_error_line(workdir, monkeypatch, capsys):
    disk = _fill_pretrain_disk(monkeypatch, room=1500)  # the third 512-byte shard fails half-written
    status, err = run_stage(monkeypatch, capsys, "notes", "pretrain")
    assert status == 1 and disk.failures == 1
    line = one_error_line(err)
    assert "no space left to build cache/pretrain/notes" in line
    assert "Free space on the disk holding cache/pretrain" in line and "a disk with room" in line
    _assert_nothing_left(workdir / "cache" / "pretrain", {})


def test_full_disk_during_a_rebuild_keeps_the_previous_cache(workdir, monkeypatch, capsys):
    assert run_stage(monkeypatch, capsys, "notes", "pretrain")[0] == 0
    before = tree(workdir / "cache/pretrain/notes")
    write_params(workdir, {"shuffle_buffer": 2})  # another cache, so the rebuild writes other bytes
    _fill_pretrain_disk(monkeypatch, room=700)
    status, err = run_stage(monkeypatch, capsys, "notes", "pretrain")
    assert status == 1 and "no space left" in one_error_line(err)
    _assert_nothing_left(workdir / "cache" / "pretrain", {"notes": before})
    open_pretrain_split(workdir / "cache/pretrain/notes/train")  # the old cache still reads


def test_full_disk_reported_at_fsync_ends_in_one_error_line(workdir, monkeypatch, capsys):
    """Some file systems report the full disk only when the data is flushed."""

    def fsync(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", fsync)
        status, err = run_stage(monkeypatch, capsys, "notes", "pretrain")
    assert status == 1 and "no space left to build cache/pretrain/notes" in one_error_line(err)
    assert not any((workdir / "cache" / "pretrain").iterdir())


def test_full_disk_during_an_sft_build_ends_in_one_error_line(workdir, monkeypatch, capsys):
    disk = _fill_sft_disk(monkeypatch, room=2000)
    status, err = run_stage(monkeypatch, capsys, "math", "sft")
    assert status == 1 and disk.failures == 1
    assert "no space left to build cache/sft/math" in one_error_line(err)
    _assert_nothing_left(workdir / "cache" / "sft", {})


def test_other_os_errors_are_not_reported_as_a_full_disk(workdir, monkeypatch):
    """Only ENOSPC/EDQUOT get the free-space advice; a different failure keeps its own error."""
    from stages.cache import main

    def broken(*a, **k):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(cache_build, "open", broken, raising=False)
    with pytest.raises(OSError) as e:
        main(["notes", "--raw", "raw/notes", "--tokenizer", "tok", "--out", "cache/pretrain/notes"])
    assert e.value.errno == errno.EIO and not isinstance(e.value, CacheError)
    assert not (workdir / "cache/pretrain/notes").exists()


def test_a_file_size_limit_during_a_rebuild_ends_in_one_error_line_and_keeps_the_previous_cache(
        workdir, monkeypatch, capsys, repo_root):
    """RLIMIT_FSIZE (`ulimit -f`) below a shard's size, in the stage's own process run as
    `python -m stages.cache`: EFBIG, not a traceback and not a SIGXFSZ death."""
    assert run_stage(monkeypatch, capsys, "notes", "pretrain")[0] == 0
    before = tree(workdir / "cache/pretrain/notes")
    write_params(workdir, {"shuffle_buffer": 2})
    proc = run_with_file_size_limit([sys.executable, "-m", "stages.cache", "notes", "--raw", "raw/notes", "--tokenizer",
                                     "tok", "--out", "cache/pretrain/notes"], cwd=workdir, env=stage_env(repo_root),
                                    limit_bytes=300)  # below the 512-byte shards
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = one_error_line(proc.stderr)
    assert line.startswith(
        "error: a file reached this process's size limit of 300 bytes (RLIMIT_FSIZE) trying to build "
        "cache/pretrain/notes (File too large); nothing was written there."
    ), line
    assert "Raise the limit (`ulimit -f unlimited`" in line and line.endswith("and run the cache stage again")
    _assert_nothing_left(workdir / "cache" / "pretrain", {"notes": before})


def test_a_file_larger_than_the_file_system_holds_ends_in_one_error_line(workdir, monkeypatch, capsys):
    """EFBIG with no size limit on the process: the file system's largest file (FAT's 4 GiB)."""
    import resource

    def too_large(*a, **k):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(cache_build, "open", too_large, raising=False)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,) * 2)
    status, err = run_stage(monkeypatch, capsys, "notes", "pretrain")
    line = one_error_line(err)
    assert status == 1 and "a file grew past what the file system holding cache/pretrain allows" in line, line
    assert "Point cache/pretrain at a file system that holds larger files" in line
    _assert_nothing_left(workdir / "cache" / "pretrain", {})
