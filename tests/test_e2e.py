"""End to end on the `smoke` preset: the whole DVC DAG in a scratch copy of the checkout, built
once per test run by the `smoke_run` fixture (tests/conftest.py). What the finished run holds; in
copies of it, a second `dvc repro` that must do nothing, a comment edit that reruns only the stage
importing the file and a docs edit that reruns nothing, another training seed that re-draws
training only, and the team workflow (commit, `dvc push` to a local remote, `git clone` +
`dvc pull` elsewhere, where `dvc status` is clean and `dvc repro` runs no stage); and a second
build from scratch that must write every output of the first byte for byte. Under pytest-xdist
this file runs on one worker (`--dist loadfile`), which builds the shared run first."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from _scratch_repo import BIN, build_pipeline, copy_run, run_in, stage_progress
from lockstep.pipeline.report import read_series

DVC = str(BIN / "dvc")
GIT = ["git", "-c", "user.name=lockstep-test", "-c", "user.email=test@lockstep.invalid"]
TRAINED = ("pretrain", "midtrain", "sft", "rl")
DATA_STAGES = ("fetch", "tokenizer", "cache")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _outputs(work: Path) -> dict[str, str]:
    """Every output's md5 as dvc.lock records it, but the run facts and the report card: they
    carry the run's timings, which is what they are for."""
    entries = yaml.safe_load((work / "dvc.lock").read_text())["stages"].values()
    return {
        o["path"]: o.get("md5", "")
        for e in entries
        for o in e.get("outs", [])
        if not o["path"].startswith(("data/runinfo", "data/report"))
    }


def _results(work: Path, name: str) -> dict:
    m = json.loads((work / "data" / "metrics" / f"{name}.json").read_text())
    return {k: m[k] for k in ("val_bpb", "pass@1", "greedy_acc") if k in m}


def _ran(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", proc.stdout)


def test_the_smoke_run_writes_every_output_metric_and_chart(smoke_run: Path) -> None:
    work = smoke_run
    lock = yaml.safe_load((work / "dvc.lock").read_text())
    for stage, entry in lock["stages"].items():
        for out in entry.get("outs", []):
            assert (work / out["path"]).exists(), f"{stage}: output {out['path']} missing"
    stages = set(lock["stages"])
    expected = {"tokenizer"} | {f"fetch@{k}" for k in yaml.safe_load((work / "params.yaml").read_text())["fetch"]}
    assert expected <= stages, f"stages that did not run: {sorted(expected - stages)}"

    metrics_dir = work / "data" / "metrics"
    expected_metrics = {"tokenizer", *TRAINED} | {f"eval_{s}" for s in TRAINED}
    assert {p.stem for p in metrics_dir.glob("*.json")} >= expected_metrics
    for name in expected_metrics:
        assert json.loads((metrics_dir / f"{name}.json").read_text()), name
    assert json.loads((metrics_dir / "pretrain.json").read_text())["val_bpb"] > 0

    # One line per training stage in the loss chart, read from the folders the stages wrote.
    assert set(read_series(work / "data" / "plots")["train_loss"]) == {"pretrain", "midtrain", "sft"}
    card = (work / "data" / "report" / "report.md").read_text()
    assert "| metric | BASE | MID | SFT | RL |" in card, "report.md lacks the per-stage metrics table"
    charts = sorted((work / "data" / "report").glob("*.png"))
    assert charts, "the report card has no charts"
    for png in charts:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"({png.name})" in card, f"{png.name} is not linked from report.md"


def test_a_second_repro_does_nothing_and_an_edit_reruns_only_its_stage(smoke_run: Path, tmp_path: Path) -> None:
    work = tmp_path / "repo"
    copy_run(smoke_run, work)
    again = run_in([DVC, "repro"], work, 300)
    assert "Running stage" not in again.stdout, f"second dvc repro re-ran stages:\n{again.stdout}"
    status = run_in([DVC, "status"], work, 120)
    assert "up to date" in status.stdout, status.stdout

    # A comment in a module only the tokenizer stage imports reruns that stage alone, and the
    # DAG stops there: the tokenizer it writes is byte-identical, so nothing downstream changed.
    pipeline = work / "lib" / "lockstep" / "pipeline" / "tokenizer.py"
    pipeline.write_text(pipeline.read_text() + "\n# A comment changes no result.\n")
    assert set(json.loads(run_in([DVC, "status", "--json"], work, 120).stdout)) == {"tokenizer"}
    assert _ran(run_in([DVC, "repro"], work, 600)) == ["tokenizer"]
    # Docs are neither code nor data.
    doc = work / "docs" / "internals.md"
    doc.write_text(doc.read_text() + "\nA new paragraph.\n")
    assert "up to date" in run_in([DVC, "status"], work, 120).stdout


def test_another_training_seed_redraws_training_only(smoke_run: Path, tmp_path: Path) -> None:
    """No data stage goes stale, and `dvc repro` starts at pretraining; pretraining and its eval
    are rerun and checked. The stages after them are not rerun here: they run on a new
    checkpoint as on any other (the run from scratch and tests/test_e2e_lz78.py run them all),
    and every eval stage picks its documents as eval@pretrain does, from `data_seed`."""
    work = tmp_path / "repo"
    copy_run(smoke_run, work)

    def val_bytes() -> dict[str, list[int]]:
        return {
            str(p.relative_to(work)): [json.loads(line)["bytes"] for line in p.read_text().splitlines()]
            for p in sorted((work / "data" / "eval" / "pretrain").glob("bpb_*.jsonl"))
        }

    before, first = val_bytes(), _results(work, "pretrain")
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["seed"] += 1
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    stale = set(json.loads(run_in([DVC, "status", "--json"], work, 120).stdout))
    assert "pretrain" in stale and not {s for s in stale if s.startswith(DATA_STAGES)}, sorted(stale)
    reseeded = run_in([DVC, "repro", "eval@pretrain"], work, 600)
    assert _ran(reseeded) == ["pretrain", "eval@pretrain"], reseeded.stdout
    # eval@pretrain measures the same documents (the same bytes per document) with the new checkpoint.
    assert before and val_bytes() == before
    assert _results(work, "pretrain") != first, "a new training seed left pretraining unchanged"


def test_a_clone_that_pulls_the_outputs_reruns_nothing(smoke_run: Path, tmp_path: Path) -> None:
    # A teammate's machine: what git shows is committed (dvc.lock, the remote in .dvc/config, the
    # uncached metrics, run facts, plots and report), the cached outputs go to the remote, and a
    # fresh clone that pulls them has every stage up to date: nothing is recomputed there.
    work = tmp_path / "repo"
    copy_run(smoke_run, work)
    run_in([DVC, "remote", "add", "-d", "store", str(tmp_path / "remote")], work, 60)
    subprocess.run(["git", "add", "-A"], cwd=work, check=True, capture_output=True)
    subprocess.run([*GIT, "commit", "-qm", "pipeline run"], cwd=work, check=True)
    assert (
        subprocess.run(["git", "status", "--porcelain"], cwd=work, capture_output=True, text=True, check=True).stdout
        == ""
    )
    run_in([DVC, "push"], work, 300)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(work), str(clone)], check=True, capture_output=True)
    run_in([DVC, "pull"], clone, 300)
    assert "up to date" in run_in([DVC, "status"], clone, 120).stdout
    lock = (clone / "dvc.lock").read_bytes()
    assert _ran(run_in([DVC, "repro"], clone, 600)) == []
    assert (clone / "dvc.lock").read_bytes() == lock


def test_a_run_from_scratch_rewrites_every_output_byte_for_byte(
    smoke_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A second project built from scratch (no run folders to resume, no DVC cache to restore
    # from) with identical params and code writes every output of the shared run byte for byte,
    # the metrics included.
    work = tmp_path / "repo"
    work.mkdir()
    build_pipeline(work, "smoke", stage_progress(capsys, "e2e from scratch"))
    mine, theirs = _outputs(work), _outputs(smoke_run)
    differ = sorted(p for p in mine.keys() | theirs.keys() if mine.get(p) != theirs.get(p))
    assert not differ, f"a run from scratch changed these outputs: {differ}"
    assert {n: _results(work, n) for n in TRAINED} == {n: _results(smoke_run, n) for n in TRAINED}
