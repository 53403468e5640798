"""Live progress for DVC's tools (lockstep.pipeline.live, SeriesWriter's flush): a running
`dvc exp run` shows its latest step and loss in `dvc exp show`, the files hold results only and
end as the same bytes for equal runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _exp_toy import DVC, sh, toy_env

from lockstep.core.series import SeriesWriter, read_series_file
from lockstep.pipeline.live import LiveMetrics, each

ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"step": 1, "train_loss": 3.5, "lr_mult": 1.0}, {"step": 2, "train_loss": 3.25, "lr_mult": 1.0},
        {"step": 2, "val_bpb": 2.5}, {"step": 3, "train_loss": 3.0, "lr_mult": 0.5}]


def test_the_file_holds_each_columns_latest_value(tmp_path) -> None:
    bytes_of, seen = [], []
    for run in ("a", "b"):
        live = LiveMetrics(tmp_path / run / "pretrain.json")
        for row in ROWS:
            live.add(row)
            seen.append(json.loads((tmp_path / run / "pretrain.json").read_text()))
        bytes_of.append((tmp_path / run / "pretrain.json").read_bytes())
        assert [p.name for p in (tmp_path / run).iterdir()] == ["pretrain.json"]  # no temp file left
    assert seen[1] == {"step": 2, "train_loss": 3.25, "lr_mult": 1.0}  # on disk after each row
    assert json.loads(bytes_of[0]) == {"step": 3, "train_loss": 3.0, "lr_mult": 0.5, "val_bpb": 2.5}
    assert bytes_of[0] == bytes_of[1]


def test_a_row_without_an_integer_step_is_refused(tmp_path) -> None:
    with pytest.raises(TypeError, match="integer `step`"):
        LiveMetrics(tmp_path / "live.json").add({"step": 1.0, "train_loss": 2.0})


def test_each_hands_every_row_to_every_call() -> None:
    seen: list[tuple[str, dict]] = []
    on_step = each(lambda r: seen.append(("a", dict(r))), None, lambda r: seen.append(("b", dict(r))))
    on_step({"step": 1, "x": 2.0})
    assert seen == [("a", {"step": 1, "x": 2.0}), ("b", {"step": 1, "x": 2.0})]


def test_flushed_series_are_on_disk_while_running_and_end_as_the_same_bytes(tmp_path) -> None:
    columns = {"train": ["train_loss", "lr_mult"], "val": ["val_bpb"]}
    flushed = SeriesWriter(tmp_path / "flushed", columns, flush_every_s=0.0)
    flushed.add(ROWS[0])
    assert read_series_file(tmp_path / "flushed" / "train.tsv") == {"train_loss": [(1, 3.5)], "lr_mult": [(1, 1.0)]}
    plain = SeriesWriter(tmp_path / "plain", columns)
    plain.add(ROWS[0])
    assert not (tmp_path / "plain").exists()  # without flush_every_s nothing is written before write()
    for row in ROWS[1:]:
        flushed.add(row)
        plain.add(row)
    for a, b in zip(flushed.write(), plain.write()):
        assert a.read_bytes() == b.read_bytes()


STAGE = f'''\
import os, sys, time
sys.path.insert(0, {str(ROOT / "lib")!r})
from lockstep.pipeline.live import LiveMetrics
live = LiveMetrics("live/train.json")
for step in (1, 2, 3):
    live.add({{"step": step, "train_loss": 4.0 - step}})
    if step == 2:  # hold here until the test has looked
        open(os.environ["TOY_AT_STEP_2"], "w").close()
        while not os.path.exists(os.environ["TOY_GO"]):
            time.sleep(0.1)
os.makedirs("out", exist_ok=True)
open("out/done", "w").write("done")
'''

DVC_YAML = f"""\
stages:
  train:
    cmd: {sys.executable} stage.py
    deps: [stage.py]
    params: [seed]
    outs: [out]
    metrics:
      - live/train.json:
          cache: false
"""


def test_a_running_exp_shows_its_progress_in_dvc_exp_show(tmp_path) -> None:
    """The stage holds at step 2 of 3 while the test reads `dvc exp show --json`: the running
    experiment is listed with step 2's loss; after it ends, the workspace has step 3's."""
    repo, env = tmp_path / "repo", toy_env(tmp_path / "home")
    env.update(TOY_AT_STEP_2=str(tmp_path / "at2"), TOY_GO=str(tmp_path / "go"))
    repo.mkdir()
    (repo / "stage.py").write_text(STAGE)
    (repo / "params.yaml").write_text("seed: 1\n")
    (repo / "dvc.yaml").write_text(DVC_YAML)
    sh(repo, env, "git", "init", "-q")
    sh(repo, env, DVC, "init", "-q")
    sh(repo, env, "git", "add", "-A")
    sh(repo, env, "git", "commit", "-qm", "toy")
    run = subprocess.Popen([str(DVC), "exp", "run", "-S", "seed=7"], cwd=repo, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "at2").exists():
            assert run.poll() is None, run.stdout.read() if run.stdout else ""
            assert time.monotonic() < deadline, "the experiment never reached step 2"
            time.sleep(0.2)
        shown = json.loads(sh(repo, env, DVC, "exp", "show", "--json"))
        running = [exp for row in shown for group in (row.get("experiments") or []) for exp in group["revs"]]
        assert running, shown
        metrics = running[0]["data"]["metrics"]["live/train.json"]["data"]
        assert metrics == {"step": 2, "train_loss": 2.0}
        assert running[0]["data"]["params"]["params.yaml"]["data"] == {"seed": 7}
    finally:
        (tmp_path / "go").touch()
        out, _ = run.communicate(timeout=300)
    assert run.returncode == 0, out
    assert json.loads((repo / "live" / "train.json").read_text()) == {"step": 3, "train_loss": 1.0}
    assert os.path.exists(repo / "out" / "done")
