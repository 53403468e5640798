"""The pretrain -> midtrain -> sft stages end to end on tiny caches built here: outputs,
metrics and per-step series, byte-identical reruns, resume from the run folder, a NaN run
publishing nothing, and the one line Ctrl-C leaves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from _cache_stage import one_error_line, tree
from lockstep.data.cache_build import build_pretrain_cache, build_sft_cache
from lockstep.model.checkpoint import load_checkpoint
from lockstep.tokenizer.kinds import train_tokenizer
from lockstep.train.resume import LOCK_FILE

_WORDS = "the king said to the queen that the castle was cold and the night was long".split()


def _docs(n: int, offset: int) -> list[str]:
    return [" ".join(_WORDS[(i * 3 + j + offset) % len(_WORDS)] for j in range(40)) + "." for i in range(n)]


def _chat(i: int) -> dict:
    a, b = i % 7, (i * 3) % 5
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": f"What is {a} plus {b}?"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": f"It is {a + b}."}]}]}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stages")
    tok = train_tokenizer("byte", [])
    tok.save(root / "tokenizer")
    build_pretrain_cache({"train": _docs(40, 0), "val": _docs(8, 5)}, root / "cache/pretrain/prose", tokenizer=tok,
                         max_train_tokens=None, max_val_tokens=None, shard_bytes=1 << 20, seed=1, shuffle_buffer=16)
    build_sft_cache({"train": [_chat(i) for i in range(40)], "val": [_chat(i) for i in range(40, 48)]},
                    root / "cache/sft/chat", tokenizer=tok, val_frac=None, seed=1)
    common = dict(batch_tokens=256, device_batch_rows=2, eval_every_steps=2, eval_tokens=256, sample_tokens=4,
                  checkpoint_every_steps=2, peak_flops=1e12)
    params = {
        "seed": 7,
        "data_seed": 8,
        "runtime": {"device": "cpu", "dtype": "fp32", "nproc": 1, "threads": 1},
        "model": {"depth": 1, "sequence_len": 64, "head_dim": 32},
        "pretrain": {**common, "mixture": {"prose": 1.0}, "num_steps": 4},
        "midtrain": {**common, "mixture": {"prose": 1.0, "chat": 1.0}, "num_steps": 2},
        "sft": {**common, "mixture": {"sft/chat": 1.0}, "num_steps": 2, "loss": "assistant"},
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return root


def _args(root: Path, stage: str, out: str, runs: str = "runs") -> list[str]:
    args = ["--cache", str(root / "cache"), "--tokenizer", str(root / "tokenizer"), "--out", str(root / out),
            "--metrics", str(root / f"metrics/{out}.json"), "--runinfo", str(root / f"runinfo/{out}.json"),
            "--plots", str(root / f"plots/{out}"), "--live", str(root / f"live/{out}.json"),
            "--runs", str(root / runs), "--params", str(root / "params.yaml")]
    if stage == "midtrain":
        args += ["--init", str(root / "pretrain")]
    if stage == "sft":
        args += ["--init", str(root / "midtrain")]
    return args


def test_stage_chain(workspace: Path, repo_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(repo_root))  # stages/ is run as `python -m stages.X` from the root
    from stages import midtrain, pretrain, sft

    # Others may edit the package between two runs in a shared checkout; pin its identity.
    monkeypatch.setattr("stages.pretrain.code_revision", lambda entry: "sha256:pinned")
    root = workspace
    assert pretrain.main(_args(root, "pretrain", "pretrain")) == 0
    assert midtrain.main(_args(root, "midtrain", "midtrain")) == 0
    assert sft.main(_args(root, "sft", "sft")) == 0
    for stage in ("pretrain", "midtrain", "sft"):
        ck = load_checkpoint(root / stage)
        assert ck.meta["stage"] == stage
        m = json.loads((root / f"metrics/{stage}.json").read_text())
        assert m["val_bpb"] > 0 and m["steps"] == ck.step
        # Results apart from run facts: no timing, device or commit in the metrics DVC diffs.
        assert set(m) == {"val_bpb", "unigram_bpb", "steps", "tokens", "params"}
        info = json.loads((root / f"runinfo/{stage}.json").read_text())
        assert info["tok_per_s"] > 0 and info["device"]["device"] == "cpu" and len(info["samples"]) == 3
        # The targets its losses count, which the report card's charts name.
        assert info["setup"]["loss"] == ("assistant" if stage == "sft" else "all"), info["setup"]
        first = json.loads((root / f"plots/{stage}/first_batch.json").read_text())
        assert first["shape"] == [2, 64] and len(first["rows"]) == 2
        # Per-step series of results only (no throughput), one row per step and evaluation.
        train_rows = (root / f"plots/{stage}/train.tsv").read_text().splitlines()
        assert train_rows[0] == "step\ttrain_loss\tlr_mult" and len(train_rows) == 1 + ck.step
        assert (root / f"plots/{stage}/val.tsv").read_text().splitlines()[0] == "step\tval_bpb"
        # What DVC's tools read while it ran: the latest step's values, the series' last ones.
        live = json.loads((root / f"live/{stage}.json").read_text())
        last = dict(zip(train_rows[0].split("\t"), train_rows[-1].split("\t")))
        assert live["step"] == ck.step and live["train_loss"] == float(last["train_loss"])
        assert live["val_bpb"] == m["val_bpb"] and set(live) == {"step", "train_loss", "lr_mult", "val_bpb"}
    assert (
        load_checkpoint(root / "pretrain").meta["tokenizer_sha256"]
        == load_checkpoint(root / "sft").meta["tokenizer_sha256"]
    )
    # A second, independent run with the same params writes the same bytes, even with the global
    # generator moved in between.
    torch.rand(7)
    assert pretrain.main(_args(root, "pretrain", "pretrain_again", runs="runs2")) == 0
    for name in ("model.safetensors", "optim_rank0.pt", "rng.safetensors", "meta.json", "manifest.json"):
        assert (root / "pretrain" / name).read_bytes() == (root / "pretrain_again" / name).read_bytes(), name
    for name in ("train.tsv", "val.tsv"):
        assert (root / "plots/pretrain" / name).read_bytes() == (root / "plots/pretrain_again" / name).read_bytes(), (
            name
        )
    assert (root / "metrics/pretrain.json").read_bytes() == (root / "metrics/pretrain_again.json").read_bytes()
    assert (root / "live/pretrain.json").read_bytes() == (root / "live/pretrain_again.json").read_bytes()
    # Re-running a finished run resumes at its last step: nothing retrained, same output.
    assert pretrain.main(_args(root, "pretrain", "pretrain_third", runs="runs2")) == 0
    third = json.loads((root / "runinfo/pretrain_third.json").read_text())
    assert third["resumed_from_step"] == 4 and third["tok_per_s"] > 0
    assert (root / "pretrain/model.safetensors").read_bytes() == (
        root / "pretrain_third/model.safetensors"
    ).read_bytes()
    # Changed code never resumes (or re-publishes) what the old code trained.
    monkeypatch.setattr("stages.pretrain.code_revision", lambda entry: "sha256:changed")
    assert pretrain.main(_args(root, "pretrain", "pretrain_new_code", runs="runs2")) == 0
    assert json.loads((root / "runinfo/pretrain_new_code.json").read_text())["resumed_from_step"] == 0


def test_sigkilled_stage_resumes_to_the_same_bytes(
    workspace: Path, repo_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pretrain process SIGKILLed after its first checkpoint, then re-run, publishes the same
    checkpoint as an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    monkeypatch.syspath_prepend(str(repo_root))
    from stages import pretrain

    from lockstep.core.codeid import code_revision

    # The run folder is keyed by the code, and the killed run is a separate process: pin this
    # process to the revision that process computes (the stage's code as it is now).
    revision = code_revision("stages.pretrain")
    monkeypatch.setattr("stages.pretrain.code_revision", lambda entry: revision)
    root = workspace
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["pretrain"].update(num_steps=12, checkpoint_every_steps=2, eval_every_steps=0)
    (root / "params_kill.yaml").write_text(yaml.safe_dump(params))

    def args(out: str, runs: str) -> list[str]:
        a = _args(root, "pretrain", out, runs=runs)
        a[a.index("--params") + 1] = str(root / "params_kill.yaml")
        return a

    proc = subprocess.Popen(
        [sys.executable, "-m", "stages.pretrain", *args("killed", "runs_kill")],
        cwd=repo_root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 120
    while not list((root / "runs_kill").glob("pretrain-*/step_*/manifest.json")):
        assert proc.poll() is None and time.monotonic() < deadline, "stage ended before its first checkpoint"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (root / "killed").exists()
    assert pretrain.main(args("killed", "runs_kill")) == 0
    resumed = json.loads((root / "runinfo/killed.json").read_text())["resumed_from_step"]
    assert 2 <= resumed < 12
    assert pretrain.main(args("straight", "runs_straight")) == 0
    for name in ("model.safetensors", "optim_rank0.pt", "meta.json", "manifest.json"):
        assert (root / "killed" / name).read_bytes() == (root / "straight" / name).read_bytes(), name
    # The resumed run replays the series up to its checkpoint: its plots cover the whole run.
    assert (root / "plots/killed/train.tsv").read_bytes() == (root / "plots/straight/train.tsv").read_bytes()


def _params_file(root: Path, name: str, **pretrain) -> Path:
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["pretrain"].update(pretrain)
    (root / name).write_text(yaml.safe_dump(params))
    return root / name


def _args_with(root: Path, out: str, runs: str, params: Path) -> list[str]:
    a = _args(root, "pretrain", out, runs=runs)
    a[a.index("--params") + 1] = str(params)
    return a


def test_nan_loss_publishes_nothing_and_ends_with_one_error_line(workspace: Path, repo_root: Path,
                                                                 monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.syspath_prepend(str(repo_root))
    from stages import pretrain

    from lockstep.model.checkpoint import list_checkpoints
    from lockstep.model.gpt import GPT

    real_forward = GPT.forward
    training_passes = [0]

    def nan_from_step_3(self, idx, targets=None, *args, **kwargs):
        out = real_forward(self, idx, targets, *args, **kwargs)
        if self.training and targets is not None:
            training_passes[0] += 1
            if training_passes[0] > 2 * 2:  # 2 micro-batches per step: steps 1 and 2 stay finite
                return out * float("nan")
        return out

    monkeypatch.setattr(GPT, "forward", nan_from_step_3)
    root = workspace
    params = _params_file(root, "params_nan.yaml", num_steps=4, checkpoint_every_steps=2, eval_every_steps=0)
    args = _args_with(root, "nan", "runs_nan", params)
    with pytest.raises(RuntimeError, match=r"step 3/4: loss nan") as e:
        pretrain.main(args)
    assert e.typename == "NonFiniteError"
    assert not (root / "nan").exists(), "a non-finite run must not publish a checkpoint"
    assert not (root / "metrics/nan.json").exists(), "a non-finite run must not write its metrics"
    (run,) = (root / "runs_nan").iterdir()
    assert [step for step, _ in list_checkpoints(run)] == [2]  # none after the NaN step
    # Run as a process entry point (here: the rerun, resuming from step 2), it ends with one line.
    from stages._common import entry

    assert entry(lambda: pretrain.main(args), errors=pretrain.STAGE_ERRORS) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.endswith("\n") and err.splitlines()[-1].startswith("error: step 3/4: loss nan")
    assert "pretrain.nonfinite_patience=0" in err and "pretrain.optim.*_lr" in err
    assert not (root / "nan").exists() and [step for step, _ in list_checkpoints(run)] == [2]


def test_ctrl_c_ends_with_one_line_naming_the_checkpoint_to_resume_from(workspace: Path, repo_root: Path) -> None:
    """SIGINT to a pretrain process after its first checkpoint: exit status 130, no traceback,
    one last line naming the newest complete checkpoint, the one a rerun resumes from."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    from lockstep.model.checkpoint import latest_checkpoint, load_checkpoint

    root = workspace
    # Far more steps than run before the signal lands: the process is still training when it does
    # (a horizon that would read the small cache hundreds of times, so without an epoch limit).
    params = _params_file(root, "params_int.yaml", num_steps=5000, checkpoint_every_steps=2, eval_every_steps=0,
                          max_epochs=None)
    stderr_path = root / "interrupted_stderr.txt"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stages.pretrain", *_args_with(root, "interrupted", "runs_int", params)],
            cwd=repo_root,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            # A shell starts background jobs with SIGINT ignored, and Python then
            # leaves it ignored: give the stage the default a terminal gives it.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            deadline = time.monotonic() + 120
            while not list((root / "runs_int").glob("pretrain-*/step_*/manifest.json")):
                assert proc.poll() is None and time.monotonic() < deadline, "stage ended before its first checkpoint"
                time.sleep(0.01)
            proc.send_signal(signal.SIGINT)
            try:
                returncode = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running 60 s after SIGINT:\n{stderr_path.read_text()[-3000:]}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = stderr_path.read_text()
    assert returncode == 130, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert sum(line.startswith("interrupted:") for line in text.splitlines()) == 1
    m = re.fullmatch(r"interrupted: pretrain stopped; last complete checkpoint (\S+) \(step (\d+)\); "
                     r"`dvc repro` resumes from it", text.splitlines()[-1])
    assert m, text.splitlines()[-1]
    named = Path(m.group(1))
    assert latest_checkpoint(named.parent) == named  # what a rerun resumes from (it verifies the files)
    assert load_checkpoint(named).step == int(m.group(2)) >= 2
    assert not (root / "interrupted").exists() and not (root / "metrics/interrupted.json").exists()


def test_entry_point_prints_one_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from stages._common import entry

    from lockstep.core.config import ConfigError

    def interrupted_with_note() -> int:
        raise KeyboardInterrupt("pretrain stopped; last complete checkpoint runs/x/step_00000004 (step 4)")

    def interrupted() -> int:
        raise KeyboardInterrupt

    def bad_config() -> int:
        raise ConfigError("pretrain.optim.matrix_lr=nan must be a finite number >= 0")

    def bug() -> int:
        raise ZeroDivisionError("a bug keeps its traceback")

    assert entry(interrupted_with_note) == 130
    assert (
        capsys.readouterr().err
        == "interrupted: pretrain stopped; last complete checkpoint runs/x/step_00000004 (step 4)\n"
    )
    assert entry(interrupted) == 130
    assert capsys.readouterr().err == "interrupted: the stage did not finish; `dvc repro` runs it again\n"
    assert entry(bad_config, errors=(ConfigError,)) == 1
    assert capsys.readouterr().err == "error: pretrain.optim.matrix_lr=nan must be a finite number >= 0\n"
    with pytest.raises(ZeroDivisionError):
        entry(bug, errors=(ConfigError,))
    # Under torchrun every rank gets the signal; only rank 0 speaks.
    monkeypatch.setenv("RANK", "1")
    assert entry(interrupted) == 130 and entry(bad_config, errors=(ConfigError,)) == 1
    assert capsys.readouterr().err == ""


def test_a_compile_that_fails_falls_back_and_the_stage_finishes(workspace: Path, repo_root: Path,
                                                                   monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """runtime.compile: on with a torch.compile whose compiler raises (as inductor did on the first
    GPU run): the stage does not end; its model, metrics and series equal the eager run's, and its
    run facts say the compiled loss fell back, why, and that the results are the reference's."""
    import functools
    import logging

    monkeypatch.syspath_prepend(str(repo_root))
    from stages import pretrain

    monkeypatch.setattr("stages.pretrain.code_revision", lambda entry: "sha256:pinned")
    root = workspace
    params = yaml.safe_load((root / "params.yaml").read_text())
    for mode in ("off", "on"):
        params["runtime"]["compile"] = mode
        (root / f"params_compile_{mode}.yaml").write_text(yaml.safe_dump(params))

    def broken_compiler(gm, example_inputs):
        raise RuntimeError("inductor: an illegal memory access was encountered")

    def run(mode: str) -> None:
        args = _args(root, "pretrain", f"pretrain_compile_{mode}", runs=f"runs_compile_{mode}")
        args[args.index("--params") + 1] = str(root / f"params_compile_{mode}.yaml")
        assert pretrain.main(args) == 0

    run("off")
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=broken_compiler))
    with caplog.at_level(logging.WARNING, logger="lockstep.core.fastpath"):
        run("on")
    eager, fell_back = root / "pretrain_compile_off", root / "pretrain_compile_on"
    assert (eager / "model.safetensors").read_bytes() == (fell_back / "model.safetensors").read_bytes()
    assert (root / "metrics/pretrain_compile_off.json").read_bytes() == \
           (root / "metrics/pretrain_compile_on.json").read_bytes()
    assert (root / "plots/pretrain_compile_off/train.tsv").read_bytes() == \
           (root / "plots/pretrain_compile_on/train.tsv").read_bytes()
    facts = json.loads((root / "runinfo/pretrain_compile_on.json").read_text())
    part = facts["fast_paths"]["compiled_loss"]
    assert part["path"] == "reference" and part["results"] == "reference" and part["fast_calls"] == 0
    assert "illegal memory access" in part["fell_back"] and facts["device"]["compile"] is True
    assert facts["numerics"]["fast_paths"] == "compiled_loss=reference"
    assert json.loads((root / "runinfo/pretrain_compile_off.json").read_text())["fast_paths"] == {}
    assert sum("fast path compiled_loss" in r.getMessage() for r in caplog.records) == 1


def test_a_second_process_in_the_run_folder_stops_and_touches_nothing(workspace: Path, repo_root: Path,
                                                                      monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A pretrain process holds its run folder (SIGSTOPped once it has taken the lock, so it writes
    nothing more), as an orphan of a killed `dvc repro` would: the same stage started again, as the
    next `dvc repro` starts it, ends in one `error:` line naming the holder's pid, status 1, with
    the run folder as it was and none of its own outputs written. Once the holder is SIGKILLed its
    lock is gone and the stage runs to the end."""
    import os
    import signal
    import subprocess
    import sys
    import time

    monkeypatch.syspath_prepend(str(repo_root))
    from stages import pretrain
    from stages._common import entry

    from lockstep.core.codeid import code_revision

    # Both processes must name the same run folder: pin this one to the revision the other computes.
    revision = code_revision("stages.pretrain")
    monkeypatch.setattr("stages.pretrain.code_revision", lambda entry: revision)
    root = workspace
    params = _params_file(root, "params_lock.yaml", num_steps=6, checkpoint_every_steps=2, eval_every_steps=0)
    holder = subprocess.Popen([sys.executable, "-m", "stages.pretrain", *_args_with(root, "held", "runs_lock", params)],
                              cwd=repo_root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 180
        while not any(f"{holder.pid}" in p.read_text() for p in (root / "runs_lock").glob(f"pretrain-*/{LOCK_FILE}")):
            assert holder.poll() is None and time.monotonic() < deadline, (
                "the stage ended before it took its run folder"
            )
            time.sleep(0.01)
        holder.send_signal(signal.SIGSTOP)
        before = tree(root / "runs_lock")
        status = entry(
            lambda: pretrain.main(_args_with(root, "second", "runs_lock", params)), errors=pretrain.STAGE_ERRORS
        )
        line = one_error_line(capsys.readouterr().err)
        assert status == 1
        assert f"is in use by process {holder.pid} on host" in line and f"`kill {holder.pid}`" in line, line
        assert tree(root / "runs_lock") == before
        assert not any(
            (root / p).exists() for p in ("second", "metrics/second.json", "runinfo/second.json", "plots/second")
        )
    finally:
        holder.kill()  # SIGKILL reaches a stopped process
        holder.wait()
    assert pretrain.main(_args_with(root, "second", "runs_lock", params)) == 0
    assert json.loads((root / "metrics/second.json").read_text())["steps"] == 6


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc to see who is alive")
def test_a_stage_ends_when_the_dvc_that_started_it_is_killed(workspace: Path, repo_root: Path) -> None:
    """`dvc repro` with SHELL=/bin/sh runs pretrain through dash, which waits for it and outlives
    dvc; dvc SIGKILLed mid-training: the stage is gone within seconds, its run folder released,
    and nothing published. (bash, where dvc is the stage's parent, is in tests/test_lifeline.py.)"""
    import os
    import shlex
    import signal
    import subprocess
    import time

    from _procs import BIN, gone_within, stage_env

    root = workspace
    project = root / "dvc_project"
    project.mkdir()
    params = _params_file(root, "params_dvc.yaml", num_steps=5000, checkpoint_every_steps=2, eval_every_steps=0,
                          max_epochs=None)
    cmd = shlex.join(["python", "-m", "stages.pretrain", *_args_with(root, "orphan", "runs_dvc", params)])
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"pretrain": {"cmd": cmd}}}))
    env = stage_env(repo_root, SHELL="/bin/sh", OMP_NUM_THREADS="1")
    subprocess.run([BIN / "dvc", "init", "--no-scm", "-q"], cwd=project, env=env, check=True)
    dvc = subprocess.Popen([BIN / "dvc", "repro"], cwd=project, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    stage = None
    try:
        deadline = time.monotonic() + 180
        while not list((root / "runs_dvc").glob("pretrain-*/step_*/manifest.json")):
            assert dvc.poll() is None and time.monotonic() < deadline, "stage ended before its first checkpoint"
            time.sleep(0.01)
        (lock,) = (root / "runs_dvc").glob(f"pretrain-*/{LOCK_FILE}")
        stage = json.loads(lock.read_text())["pid"]
        shell = int(Path(f"/proc/{stage}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert Path(f"/proc/{shell}/comm").read_text() == "sh\n"  # the case this test is for
        dvc.kill()
        dvc.wait()
        assert gone_within(stage, 10), "the stage outlived dvc"
    finally:
        dvc.kill()
        dvc.wait()
        if stage is not None and not gone_within(stage, 0):
            os.kill(stage, signal.SIGKILL)
    assert not any((root / p).exists() for p in ("orphan", "metrics/orphan.json", "runinfo/orphan.json"))


def test_a_file_size_limit_at_a_checkpoint_ends_in_one_error_line(workspace: Path, repo_root: Path) -> None:
    """RLIMIT_FSIZE (`ulimit -f`) below the checkpoint's optimizer state (529 kB here) but above the
    first-batch artifact (1 kB), on `python -m stages.pretrain`: one line, status 1, nothing
    published and no checkpoint left looking complete."""
    import sys

    from _procs import run_with_file_size_limit, stage_env

    from lockstep.model.checkpoint import list_checkpoints

    root = workspace
    params = _params_file(root, "params_fsize.yaml", num_steps=4, checkpoint_every_steps=2, eval_every_steps=0)
    proc = run_with_file_size_limit(
        [sys.executable, "-m", "stages.pretrain", *_args_with(root, "fsize", "runs_fsize", params)],
        cwd=repo_root,
        env=stage_env(repo_root, OMP_NUM_THREADS="1"),
        limit_bytes=100_000,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = one_error_line(proc.stderr)
    assert line.startswith("error: a file reached this process's size limit of 100000 bytes (RLIMIT_FSIZE) trying to "
                           "train pretrain in "), line
    assert "the run keeps its last complete checkpoint, if any, and nothing was published" in line
    assert "Raise the limit (`ulimit -f unlimited`" in line and line.endswith("it resumes from that checkpoint")
    assert not any((root / p).exists() for p in ("fsize", "metrics/fsize.json", "runinfo/fsize.json"))
    (run,) = (root / "runs_fsize").iterdir()
    assert list_checkpoints(run) == []
