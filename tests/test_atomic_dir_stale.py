"""atomic_dir's cleanup of what a killed earlier write of the same output left behind: exactly
its own work folders go, every other sibling stays."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from lockstep.core.io import atomic_dir


def _work_folder(parent: Path, name: str) -> Path:
    # Named by the same call atomic_dir makes, so the test follows tempfile's naming, not a copy of it.
    return Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent))


def test_atomic_dir_removes_stale_work_of_the_same_output_only(tmp_path):
    out = tmp_path / "notes"
    stale = [_work_folder(tmp_path, "notes"), _work_folder(tmp_path, "notes"), tmp_path / ".notes.old-4242"]
    stale[-1].mkdir()
    (stale[0] / "train").mkdir()
    (stale[0] / "train" / "shard_00000.bin").write_bytes(b"\1\0")
    kept = [
        _work_folder(tmp_path, "notes2"),  # another output whose name starts with ours
        _work_folder(tmp_path, "notes.v2"),  # another output whose name extends ours with a dot
        _work_folder(tmp_path, "other"),
        tmp_path / "notes.abcdefgh.tmp",  # not hidden: not a work folder
        tmp_path / ".notes.abcdefg.tmp",  # 7 random characters: not tempfile's name
        tmp_path / ".notes.old-",
    ]
    for p in kept:
        p.mkdir(exist_ok=True)
    gitignore = tmp_path / ".gitignore"  # DVC's, beside every output
    gitignore.write_text("/notes\n")
    file_twin = tmp_path / ".notes.abcdefgh.tmp"  # a file (atomic_open's temp), not a work folder
    file_twin.write_bytes(b"")
    with atomic_dir(out) as tmp:
        assert not any(p.exists() for p in stale)  # removed before the new write starts
        (tmp / "a.txt").write_text("new")
    assert (out / "a.txt").read_text() == "new"
    assert all(p.is_dir() for p in kept) and file_twin.is_file() and gitignore.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["notes", ".gitignore", file_twin.name, *(p.name for p in kept)]
    )


def test_remove_stale_work_reports_what_it_removed_and_tolerates_a_missing_parent(tmp_path):
    from lockstep.core.io import remove_stale_work

    assert remove_stale_work(tmp_path / "absent" / "out") == []
    stale = _work_folder(tmp_path, "out")
    assert remove_stale_work(tmp_path / "out") == [stale]
    assert remove_stale_work(tmp_path / "out") == []


def test_a_failed_write_still_leaves_the_previous_output(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        (tmp / "v").write_text("1")
    _work_folder(tmp_path, "out")
    with pytest.raises(RuntimeError), atomic_dir(out) as tmp:
        (tmp / "v").write_text("2")
        raise RuntimeError("boom")
    assert (out / "v").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
