"""lockstep.runinfo, the one writer of every stage's run facts: what it adds to a stage's own
facts, NaN as null, and canonical JSON on disk."""

from __future__ import annotations

import json
from pathlib import Path

from lockstep.runinfo import write_runinfo


def test_write_runinfo_adds_the_shared_facts_and_writes_canonical_json(tmp_path: Path) -> None:
    path = tmp_path / "runinfo" / "stage.json"
    info = write_runinfo(path, {"train_time_s": 1.5, "mfu": float("nan")})
    on_disk = path.read_text(encoding="utf-8")
    assert json.loads(on_disk) == info
    assert on_disk == json.dumps(info, ensure_ascii=False, sort_keys=True, separators=(",", ":")) + "\n"
    assert info["train_time_s"] == 1.5 and info["mfu"] is None  # NaN: nothing to measure
    assert isinstance(info["git_commit"], str) and info["git_commit"]


def test_write_runinfo_keeps_a_fact_the_stage_gave(tmp_path: Path) -> None:
    info = write_runinfo(tmp_path / "r.json", {"git_commit": "feedbeef"})
    assert info["git_commit"] == "feedbeef"
