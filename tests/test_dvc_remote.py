"""The team workflow over a DVC remote, on a toy git + DVC project shaped like lockstep's DAG
(cached data, checkpoint folders and run facts; `cache: false` metrics and plots): `dvc push` from
one clone, `git clone` + `dvc pull` into another, and there `dvc status` is clean and `dvc repro`
runs nothing. Also: in this repository, git keeps exactly the outputs DVC does not cache."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from dvc.repo import Repo

from _exp_toy import DVC, sh, toy_env

ROOT = Path(__file__).resolve().parents[1]

# Each stage appends its name to $TOY_RAN, so a test sees which stages ran without parsing logs.
STAGE = '''\
import json, os, sys
from pathlib import Path

name, src, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
with open(os.environ["TOY_RAN"], "a") as f:
    f.write(name + "\\n")
text = "".join(p.read_text() for p in sorted(src.rglob("*")) if p.is_file())
out.mkdir(parents=True, exist_ok=True)
(out / "part_0.txt").write_text(f"{name}:{len(text)}\\n" + text.upper())
if name != "fetch":
    Path("data/metrics").mkdir(parents=True, exist_ok=True)
    Path(f"data/metrics/{name}.json").write_text(json.dumps({"chars": len(text)}))
if name == "pretrain":
    Path("data/plots/pretrain").mkdir(parents=True, exist_ok=True)
    Path("data/plots/pretrain/train.tsv").write_text("step\\ttrain_loss\\n1\\t3.5\\n2\\t3.1\\n")
    Path("data/runinfo").mkdir(parents=True, exist_ok=True)
    Path("data/runinfo/pretrain.json").write_text(json.dumps({"device": "cpu"}))
'''

DVC_YAML = """\
stages:
  fetch:
    cmd: {python} stage.py fetch corpus data/raw/notes
    deps: [stage.py, corpus]
    outs: [data/raw/notes]
  tokenizer:
    cmd: {python} stage.py tokenizer data/raw data/tokenizer
    deps: [stage.py, data/raw]
    outs: [data/tokenizer]
    metrics:
      - data/metrics/tokenizer.json:
          cache: false
  pretrain:
    cmd: {python} stage.py pretrain data/tokenizer data/ckpt/pretrain
    deps: [stage.py, data/tokenizer]
    outs:
      - data/ckpt/pretrain
      - data/plots/pretrain:
          cache: false
      - data/runinfo/pretrain.json
    metrics:
      - data/metrics/pretrain.json:
          cache: false
"""


def _ran(log: Path) -> list[str]:
    return log.read_text().split() if log.is_file() else []


@pytest.mark.slow
def test_push_clone_pull_reruns_nothing(tmp_path: Path) -> None:
    log = tmp_path / "ran.txt"
    env = dict(toy_env(tmp_path / "home"), TOY_RAN=str(log))
    first, second, remote = tmp_path / "first", tmp_path / "second", tmp_path / "remote"
    first.mkdir()
    (first / "corpus").mkdir()
    (first / "corpus" / "a.md").write_text("# notes\nsome text\n")
    (first / "stage.py").write_text(STAGE)
    (first / "dvc.yaml").write_text(DVC_YAML.format(python=sys.executable))
    sh(first, env, "git", "init", "-q", "-b", "main")
    sh(first, env, DVC, "init", "-q")
    sh(first, env, DVC, "repro")
    assert _ran(log) == ["fetch", "tokenizer", "pretrain"]
    sh(first, env, DVC, "remote", "add", "-d", "store", remote)
    # The user commits what git shows: code, dvc.lock, .dvc/config and the uncached outputs (results);
    # the run facts, which differ on every rerun, travel through the remote.
    sh(first, env, "git", "add", "-A")
    sh(first, env, "git", "commit", "-q", "-m", "pipeline run")
    committed = set(sh(first, env, "git", "ls-files").split())
    assert {"data/metrics/pretrain.json", "data/plots/pretrain/train.tsv"} <= committed
    assert "data/runinfo/pretrain.json" not in committed
    assert not {p for p in committed if p.startswith(("data/ckpt/pretrain/", "data/tokenizer/", "data/raw/notes/"))}
    sh(first, env, DVC, "push")

    sh(tmp_path, env, "git", "clone", "-q", first, second)
    # Before the pull the clone lacks every cached output, and `dvc status` says so.
    assert "deleted:" in sh(second, env, DVC, "status")
    sh(second, env, DVC, "pull")
    assert "Data and pipelines are up to date." in sh(second, env, DVC, "status")
    lock = (second / "dvc.lock").read_bytes()
    log.unlink()
    again = sh(second, env, DVC, "repro")
    assert not re.findall(r"Running stage '([^']+)'", again), again
    assert _ran(log) == [] and (second / "dvc.lock").read_bytes() == lock
    for out in ("data/raw/notes/part_0.txt", "data/tokenizer/part_0.txt", "data/ckpt/pretrain/part_0.txt",
                "data/runinfo/pretrain.json"):
        assert (second / out).read_bytes() == (first / out).read_bytes(), out
    assert sh(second, env, "git", "status", "--porcelain") == ""

    # The control: a changed input in the clone does rerun what depends on it, and only that.
    (second / "corpus" / "a.md").write_text("# notes\nother text\n")
    rerun = sh(second, env, DVC, "repro")
    assert re.findall(r"Running stage '([^']+)'", rerun) == ["fetch", "tokenizer", "pretrain"], rerun


def _ignored(path: str) -> bool:
    done = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
    assert done.returncode in (0, 1), f"git check-ignore {path} failed"
    return done.returncode == 0


def test_git_keeps_exactly_the_uncached_outputs() -> None:
    """A second clone sees `cache: false` outputs through git alone: none may be git-ignored.
    Cached outputs reach it through the remote: each is git-ignored (DVC writes the .gitignore
    entries when it runs a stage; these are the committed ones), and so are the run folders."""
    outs = list(Repo(str(ROOT)).index.outs)
    uncached = sorted(str(o.def_path) for o in outs if not o.use_cache)
    cached = sorted(str(o.def_path) for o in outs if o.use_cache)
    assert uncached and cached
    assert [p for p in uncached if _ignored(p)] == [], "cache: false outputs that git ignores"
    assert [p for p in cached if not _ignored(p)] == [], "cached outputs git would commit"
    assert _ignored("runs/pretrain-0123/step_00000001/model.safetensors")


def test_git_tracks_no_run_facts_but_the_report_card() -> None:
    """Run facts carry timings, hosts and the commit, so every rerun rewrites them: a DVC-cached
    output, and git holds none of their files. The report card shows them too, but it is what a
    fresh clone with no DVC remote reads first, so it is an uncached output that git keeps."""
    tracked = subprocess.run(["git", "ls-files", "data/runinfo"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    assert tracked == ""
    outs = {str(o.def_path): o.use_cache for o in Repo(str(ROOT)).index.outs}
    assert outs["data/report"] is False and not _ignored("data/report/report.md")
