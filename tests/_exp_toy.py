"""A toy git + DVC project for the `lockstep exp summary` tests: one stage whose metrics depend on
`seed` (noise) and `train.lr` (signal), written both as flat dotted keys (as lockstep's metrics
files are) and as nested objects.

`python tests/_exp_toy.py OUT_DIR` rebuilds the saved `dvc exp show --json` captures in
tests/fixtures/exp_show/ (about a minute on 2 cores); the slow test builds the same project."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

DVC = Path(sys.executable).parent / "dvc"

STAGE = '''\
import json, os, random, sys
import yaml

params = yaml.safe_load(open("params.yaml"))
lr = params["train"]["lr"]
if lr < 0:
    sys.exit(f"train.lr={lr} must be >= 0")
rng = random.Random(params["seed"])
evaluation = {"chat.synth_math.accuracy": round(0.5 + 10 * lr + 0.1 * rng.random(), 4), "chat.synth_math.n": 50,
              "bpb.shakespeare": 3.0 - lr + 0.05 * rng.random(), "device": "cpu"}
training = {"loss": {"final": 2.0 - 20 * lr + rng.random()}, "runtime": {"world_size": 1, "compiled": False},
            "steps": params["train"]["steps"]}
os.makedirs("metrics", exist_ok=True)
for name, metrics in (("eval", evaluation), ("train", training)):
    with open(f"metrics/{name}.json", "w") as f:
        json.dump(metrics, f)
log = os.environ.get("TOY_METRICS_LOG")
if log:
    with open(log, "a") as f:
        f.write(json.dumps({"seed": params["seed"], "lr": lr, "eval": evaluation, "train": training}) + "\\n")
'''

PARAMS = "seed: 42\ntrain:\n  lr: 0.01\n  steps: 10\n"

DVC_YAML = """\
stages:
  train:
    cmd: {python} stage.py
    deps: [stage.py]
    params: [seed, train]
    metrics:
      - metrics/eval.json:
          cache: false
      - metrics/train.json:
          cache: false
"""


def toy_env(home: Path, metrics_log: Path | None = None) -> dict[str, str]:
    """An environment that keeps git and DVC away from the user's config, caches and the network."""
    # The queue's worker runs `dvc` from PATH: the one beside this Python, as in an activated venv.
    path = os.pathsep.join([str(DVC.parent), os.environ.get("PATH", "")])
    env = dict(os.environ, PATH=path, HOME=str(home), DVC_NO_ANALYTICS="1", DVC_SITE_CACHE_DIR=str(home / "dvc-site"),
               GIT_CONFIG_NOSYSTEM="1", GIT_AUTHOR_NAME="toy", GIT_AUTHOR_EMAIL="toy@example.com",
               GIT_COMMITTER_NAME="toy", GIT_COMMITTER_EMAIL="toy@example.com")
    if metrics_log is not None:
        env["TOY_METRICS_LOG"] = str(metrics_log)
    return env


def sh(repo: Path, env: dict[str, str], *cmd: str | Path) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=repo, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def make_project(repo: Path, env: dict[str, str], *, run_baseline: bool) -> None:
    """git + DVC project with the toy stage, committed; with `run_baseline`, its metrics too."""
    repo.mkdir(parents=True)
    (repo / "stage.py").write_text(STAGE)
    (repo / "params.yaml").write_text(PARAMS)
    (repo / "dvc.yaml").write_text(DVC_YAML.format(python=sys.executable))
    sh(repo, env, "git", "init", "-q", "-b", "main")
    sh(repo, env, DVC, "init", "-q")
    if run_baseline:
        sh(repo, env, DVC, "repro", "-q")
    sh(repo, env, "git", "add", "-A")
    sh(repo, env, "git", "commit", "-q", "-m", "toy project")


def exp_run(repo: Path, env: dict[str, str], name: str, *sets: str, queue: bool = False) -> None:
    args = [a for s in sets for a in ("-S", s)]
    sh(repo, env, DVC, "exp", "run", "-q", *(["--queue"] if queue else []), "-n", name, *args)


def capture_fixtures(out: Path) -> None:
    """The two captures in tests/fixtures/exp_show/: a sweep (baseline with metrics, seeds, another
    learning rate, a rerun seed, a queued and a failed experiment) and a baseline committed before
    any run, next to a workspace with a corrupted metrics file."""
    work = out / "work"
    env = toy_env(work)
    sweep = work / "sweep"
    make_project(sweep, env, run_baseline=True)
    for name, *sets in (("s43", "seed=43"), ("s44", "seed=44"), ("lr2-s42", "seed=42", "train.lr=0.02"),
                        ("lr2-s43", "seed=43", "train.lr=0.02"), ("rerun-s42", "seed=42", "train.lr=0.01")):
        exp_run(sweep, env, name, *sets)
    exp_run(sweep, env, "bad-lr", "train.lr=-1", queue=True)
    sh(sweep, env, DVC, "queue", "start", "-j", "1")
    deadline = time.monotonic() + 300
    while any(state in sh(sweep, env, DVC, "queue", "status") for state in ("Queued", "Running")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the queued experiment did not finish in 5 minutes: see `dvc queue logs` in {sweep}")
        time.sleep(1)
    exp_run(sweep, env, "q45", "seed=45", queue=True)
    (out / "sweep.json").write_text(sh(sweep, env, DVC, "exp", "show", "--json"))

    fresh = work / "fresh"
    make_project(fresh, env, run_baseline=False)
    exp_run(fresh, env, "s43", "seed=43")
    (fresh / "metrics" / "train.json").write_text('{"loss": ')
    (out / "no_baseline_metrics.json").write_text(sh(fresh, env, DVC, "exp", "show", "--json"))


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    capture_fixtures(target)
    for f in sorted(target.glob("*.json")):
        print(f, len(json.loads(f.read_text())), "revisions")
