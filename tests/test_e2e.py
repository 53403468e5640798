"""End to end: the whole DVC DAG on the `smoke` preset in a scratch copy of the checkout; a second
`dvc repro` that must do nothing; a comment edit that reruns only the stage importing the file and
a docs edit that reruns nothing; then a run from scratch that must rewrite every output byte for
byte; last, the team workflow: commit, `dvc push` to a local remote, `git clone` + `dvc pull`
elsewhere, where `dvc status` is clean and `dvc repro` runs no stage."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from _scratch_repo import BIN, git_commit_all, preset_copy, run_in, stage_progress
from lockstep.pipeline.report import read_series


@pytest.mark.e2e
@pytest.mark.slow
def test_smoke_pipeline_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    progress = stage_progress(capsys, "e2e smoke")
    work = tmp_path / "repo"
    work.mkdir()
    preset_copy(work, "smoke")
    git_commit_all(work)  # a first commit, as a user's clone has (the training metrics record it)
    git = ["git", "-c", "user.name=lockstep-test", "-c", "user.email=test@lockstep.invalid"]

    run_in([str(BIN / "dvc"), "repro"], work, 1500, progress)

    lock = yaml.safe_load((work / "dvc.lock").read_text())
    for stage, entry in lock["stages"].items():
        for out in entry.get("outs", []):
            assert (work / out["path"]).exists(), f"{stage}: output {out['path']} missing"
    stages = set(lock["stages"])
    expected = {"tokenizer"} | {f"fetch@{k}" for k in yaml.safe_load((work / "params.yaml").read_text())["fetch"]}
    assert expected <= stages, f"stages that did not run: {sorted(expected - stages)}"

    metrics_dir = work / "data" / "metrics"
    expected_metrics = {"tokenizer", "pretrain", "midtrain", "sft", "rl"} | {
        f"eval_{s}" for s in ("pretrain", "midtrain", "sft", "rl")}
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

    dvc = str(BIN / "dvc")
    again = run_in([dvc, "repro"], work, 300)
    assert "Running stage" not in again.stdout, f"second dvc repro re-ran stages:\n{again.stdout}"
    status = run_in([dvc, "status"], work, 120)
    assert "up to date" in status.stdout, status.stdout

    # A comment in a module only the tokenizer stage imports reruns that stage alone, and the
    # DAG stops there: the tokenizer it writes is byte-identical, so nothing downstream changed.
    pipeline = work / "lib" / "lockstep" / "pipeline" / "tokenizer.py"
    pipeline.write_text(pipeline.read_text() + "\n# A comment changes no result.\n")
    assert set(json.loads(run_in([dvc, "status", "--json"], work, 120).stdout)) == {"tokenizer"}
    edited = run_in([dvc, "repro"], work, 600)
    assert re.findall(r"Running stage '([^']+)'", edited.stdout) == ["tokenizer"], edited.stdout
    # Docs are neither code nor data.
    doc = work / "docs" / "internals.md"
    doc.write_text(doc.read_text() + "\nA new paragraph.\n")
    assert "up to date" in run_in([dvc, "status"], work, 120).stdout

    # From scratch (no run folders to resume, no DVC cache to restore from), identical params and
    # code rewrite every output byte for byte, the metrics included. The run facts and the report
    # card are left out: they carry the run's timings, which is what they are for.
    def outputs() -> dict[str, str]:
        entries = yaml.safe_load((work / "dvc.lock").read_text())["stages"].values()
        return {o["path"]: o.get("md5", "") for e in entries for o in e.get("outs", [])
                if not o["path"].startswith(("data/runinfo", "data/report"))}

    def results(name: str) -> dict:
        m = json.loads((metrics_dir / f"{name}.json").read_text())
        return {k: m[k] for k in ("val_bpb", "pass@1", "greedy_acc") if k in m}

    first = outputs()
    first_results = {n: results(n) for n in ("pretrain", "midtrain", "sft", "rl")}
    for folder in ("data", "runs", ".dvc/cache", ".dvc/tmp"):
        shutil.rmtree(work / folder, ignore_errors=True)
    run_in([dvc, "repro"], work, 1500, progress)
    second = outputs()
    differ = sorted(p for p in first.keys() | second.keys() if first.get(p) != second.get(p))
    assert not differ, f"a rerun from scratch changed these outputs: {differ}"
    assert {n: results(n) for n in first_results} == first_results

    # Another training seed re-draws training only: no data stage reruns, and every eval measures
    # the same documents (the same bytes per document) with the new checkpoints.
    def val_bytes() -> dict[str, list[int]]:
        return {str(p.relative_to(work)): [json.loads(line)["bytes"] for line in p.read_text().splitlines()]
                for p in sorted((work / "data" / "eval").glob("*/bpb_*.jsonl"))}

    before = val_bytes()
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["seed"] += 1
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    stale = set(json.loads(run_in([dvc, "status", "--json"], work, 120).stdout))
    assert not {s for s in stale if s.startswith(("fetch", "tokenizer", "cache"))}, sorted(stale)
    reseeded = run_in([dvc, "repro"], work, 1500, progress)
    ran = re.findall(r"Running stage '([^']+)'", reseeded.stdout)
    assert ran[0] == "pretrain" and not [s for s in ran if s.startswith(("fetch", "tokenizer", "cache"))], ran
    assert before and val_bytes() == before
    assert results("pretrain") != first_results["pretrain"], "a new training seed left pretraining unchanged"

    # A teammate's machine: what git shows is committed (dvc.lock, the remote in .dvc/config, the
    # uncached metrics, run facts, plots and report), the cached outputs go to the remote, and a
    # fresh clone that pulls them has every stage up to date: nothing is recomputed there.
    run_in([dvc, "remote", "add", "-d", "store", str(tmp_path / "remote")], work, 60)
    subprocess.run(["git", "add", "-A"], cwd=work, check=True, capture_output=True)
    subprocess.run([*git, "commit", "-qm", "pipeline run"], cwd=work, check=True)
    assert subprocess.run(["git", "status", "--porcelain"], cwd=work, capture_output=True, text=True,
                          check=True).stdout == ""
    run_in([dvc, "push"], work, 300)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(work), str(clone)], check=True, capture_output=True)
    run_in([dvc, "pull"], clone, 300)
    assert "up to date" in run_in([dvc, "status"], clone, 120).stdout
    lock = (clone / "dvc.lock").read_bytes()
    pulled = run_in([dvc, "repro"], clone, 600)
    assert re.findall(r"Running stage '([^']+)'", pulled.stdout) == [], pulled.stdout
    assert (clone / "dvc.lock").read_bytes() == lock
