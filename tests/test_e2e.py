"""End to end: the whole DVC DAG on the `smoke` preset in a scratch copy of the checkout; a second
`dvc repro` that must do nothing; a comment edit that reruns only the stage importing the file and
a docs edit that reruns nothing; then a run from scratch that must rewrite every output byte for byte."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lockstep.report import read_series

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(cmd: list[str], cwd: Path, timeout_s: int) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "DVC_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(cwd / "lib")  # the copy's library runs, not the installed checkout's
    env.pop("OMP_NUM_THREADS", None)  # the stages set their own thread count from params
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


def _checkout_copy(dst: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if not src.is_file() or rel.startswith("data/"):
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / rel)


@pytest.mark.e2e
@pytest.mark.slow
def test_smoke_pipeline_end_to_end(tmp_path: Path) -> None:
    work = tmp_path / "repo"
    work.mkdir()
    _checkout_copy(work)
    (work / "dvc.lock").unlink(missing_ok=True)  # the committed lock is for the tiny preset
    _run([str(BIN / "lockstep"), "preset", "smoke"], work, 60)
    # A repository with a first commit, as a user's clone has (the training metrics record its commit).
    git = ["git", "-c", "user.name=lockstep-test", "-c", "user.email=test@lockstep.invalid"]
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    subprocess.run(["git", "add", "-A"], cwd=work, check=True, capture_output=True)
    subprocess.run([*git, "commit", "-qm", "scratch copy"], cwd=work, check=True)

    _run([str(BIN / "dvc"), "repro"], work, 1500)

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
    again = _run([dvc, "repro"], work, 300)
    assert "Running stage" not in again.stdout, f"second dvc repro re-ran stages:\n{again.stdout}"
    status = _run([dvc, "status"], work, 120)
    assert "up to date" in status.stdout, status.stdout

    # A comment in a module only the tokenizer stage imports reruns that stage alone, and the
    # DAG stops there: the tokenizer it writes is byte-identical, so nothing downstream changed.
    pipeline = work / "lib" / "lockstep" / "tokenizer" / "pipeline.py"
    pipeline.write_text(pipeline.read_text() + "\n# A comment changes no result.\n")
    assert set(json.loads(_run([dvc, "status", "--json"], work, 120).stdout)) == {"tokenizer"}
    edited = _run([dvc, "repro"], work, 600)
    assert re.findall(r"Running stage '([^']+)'", edited.stdout) == ["tokenizer"], edited.stdout
    # Docs are neither code nor data.
    doc = work / "docs" / "internals.md"
    doc.write_text(doc.read_text() + "\nA new paragraph.\n")
    assert "up to date" in _run([dvc, "status"], work, 120).stdout

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
    _run([dvc, "repro"], work, 1500)
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
    stale = set(json.loads(_run([dvc, "status", "--json"], work, 120).stdout))
    assert not {s for s in stale if s.startswith(("fetch", "tokenizer", "cache"))}, sorted(stale)
    reseeded = _run([dvc, "repro"], work, 1500)
    ran = re.findall(r"Running stage '([^']+)'", reseeded.stdout)
    assert ran[0] == "pretrain" and not [s for s in ran if s.startswith(("fetch", "tokenizer", "cache"))], ran
    assert before and val_bytes() == before
    assert results("pretrain") != first_results["pretrain"], "a new training seed left pretraining unchanged"
