"""The `cache@<name>` stage in a scratch folder for the cache tests: two raw snapshots (roam notes
and synth_math problems), a byte tokenizer, params with a `notes` pretrain and a `math` SFT cache,
and the stage run through its entry point the way `python -m stages.cache` runs it."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from lockstep.core.io import sha256_file
from lockstep.data.sources import fetch_source
from lockstep.data.sources.roam import RoamConfig
from lockstep.data.sources.synth_math import SynthMathConfig
from lockstep.tokenizer.kinds import train_tokenizer


def make_workdir(tmp_path: Path, monkeypatch, repo_root: Path) -> Path:
    """Fill `tmp_path` and make it the working directory; returns it."""
    monkeypatch.syspath_prepend(str(repo_root))  # `stages` is imported from the checkout, not installed
    notes = tmp_path / "notes"
    notes.mkdir()
    for i in range(12):
        (notes / f"note{i:02d}.md").write_text(f"# Note {i}\n\nSome text about topic {i}. " * (i + 2), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    fetch_source("notes", RoamConfig(path=str(notes), val_frac=0.2), tmp_path / "raw" / "notes", seed=1)
    fetch_source("math", SynthMathConfig(n_train=30, n_val=5), tmp_path / "raw" / "math", seed=1)
    train_tokenizer("byte", []).save(tmp_path / "tok")
    write_params(tmp_path, {})
    return tmp_path


def write_params(workdir: Path, notes: dict) -> None:
    """params.yaml with the `notes` cache's settings updated by `notes`."""
    params = {"seed": 3, "data_seed": 4, "cache": {
        "notes": {"kind": "pretrain", "shard_bytes": 512, "shuffle_buffer": 4, "num_workers": 1, **notes},
        "math": {"kind": "sft", "val_frac": 0.1},
    }}  # fmt: skip
    (workdir / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")


def run_stage(monkeypatch, capsys, name: str, kind: str) -> tuple[int, str]:
    """The stage run as `python -m stages.cache` runs it: its entry point, its errors, its argv."""
    from stages._common import entry
    from stages.cache import STAGE_ERRORS, main

    monkeypatch.setattr(sys, "argv", ["stages.cache", name, "--raw", f"raw/{name}", "--tokenizer", "tok",
                                      "--out", f"cache/{kind}/{name}"])  # fmt: skip
    capsys.readouterr()
    status = entry(main, errors=STAGE_ERRORS)
    return status, capsys.readouterr().err


def one_error_line(err: str) -> str:
    """The one `error: ` line of a stage's stderr, checked to be the only one and no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and sum(line.startswith("error: ") for line in lines) == 1, err
    return next(line for line in lines if line.startswith("error: "))


def tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): sha256_file(p) for p in sorted(root.rglob("*")) if p.is_file()}
