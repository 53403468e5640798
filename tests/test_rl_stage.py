"""The `rl` stage on a tiny policy and a small synthetic problem snapshot built here: a NaN loss
publishes nothing and ends with one `error:` line; Ctrl-C ends with one line and status 130."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from _tiny_model import tiny_gpt
from lockstep.data.sources import SOURCE_CONFIGS, fetch_source
from lockstep.model import checkpoint as ckpt
from lockstep.model.gpt import GPT
from lockstep.rl.rollouts import Completion, Rollouts
from lockstep.rl.trainer import RLTrainer
from lockstep.tokenizer.kinds import train_tokenizer


@pytest.fixture
def rl_workspace(tmp_path: Path) -> Path:
    tok = train_tokenizer("byte", [])
    tok.save(tmp_path / "tokenizer")
    model = tiny_gpt(sequence_len=512, vocab_size=tok.get_vocab_size())
    cfg = model.config
    ckpt.save_checkpoint(tmp_path / "sft", model.state_dict(), {0: {"optimizers": []}},
                         {"stage": "sft", "model_config": cfg.to_dict(), "tokenizer_sha256": tok.sha256, "step": 0})
    fetch_source("synth_math", SOURCE_CONFIGS["synth_math"](n_train=8, n_val=2), tmp_path / "raw/synth_math", seed=1)
    params = {
        "seed": 3,
        "data_seed": 4,
        "runtime": {"device": "cpu", "dtype": "fp32", "nproc": 1, "threads": 1},
        "rl": {"problems": "synth_math", "num_steps": 2, "problems_per_step": 1, "group_size": 2, "max_new_tokens": 4,
               "device_batch_rows": 2, "eval_every_steps": 0, "eval_problems": 1, "pass_k": 1},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    return tmp_path


def _args(root: Path) -> list[str]:
    return ["--init", str(root / "sft"), "--raw", str(root / "raw"), "--tokenizer", str(root / "tokenizer"),
            "--out", str(root / "rl"), "--metrics", str(root / "metrics/rl.json"),
            "--runinfo", str(root / "runinfo/rl.json"), "--plots", str(root / "plots/rl"),
            "--live", str(root / "live/rl.json"), "--params", str(root / "params.yaml")]


def test_nan_loss_publishes_nothing(
    rl_workspace: Path, repo_root: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.syspath_prepend(str(repo_root))
    from stages import rl

    root = rl_workspace
    tok = train_tokenizer("byte", [])
    prompt, good, bad = tok.encode("Q: 2+2? A:"), tok.encode("#### 4"), tok.encode("#### 5")
    # Disagreeing completions, so the step has an update whose loss can go NaN.
    monkeypatch.setattr(RLTrainer, "rollout", lambda *a, **k: Rollouts(
        [Completion(prompt, good, [1] * len(good), 1.0, 0.5), Completion(prompt, bad, [1] * len(bad), 0.0, -0.5)]))
    real_forward = GPT.forward

    def nan_when_training(self, idx, targets=None, *args, **kwargs):
        out = real_forward(self, idx, targets, *args, **kwargs)
        return out * float("nan") if self.training and targets is not None else out

    monkeypatch.setattr(GPT, "forward", nan_when_training)
    with pytest.raises(RuntimeError, match=r"step 1/2: loss nan") as e:
        rl.main(_args(root))
    assert e.typename == "NonFiniteError"
    assert not (root / "rl").exists() and not (root / "metrics/rl.json").exists()
    # As the process entry point: one `error:` line, status 1.
    from stages._common import entry

    assert entry(lambda: rl.main(_args(root)), errors=rl.STAGE_ERRORS) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1].startswith("error: step 1/2: loss nan")
    assert "rl.nonfinite_patience=0" in err
    assert not (root / "rl").exists() and not (root / "metrics/rl.json").exists()


def test_ctrl_c_says_a_rerun_starts_over(
    rl_workspace: Path, repo_root: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.syspath_prepend(str(repo_root))
    from stages import rl
    from stages._common import entry

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(RLTrainer, "fit", ctrl_c)
    assert entry(lambda: rl.main(_args(rl_workspace)), errors=rl.STAGE_ERRORS) == 130
    assert capsys.readouterr().err == ("interrupted: rl keeps no intermediate checkpoints, so nothing was saved; "
                                       f"`dvc repro` runs it again from {rl_workspace / 'sft'}\n")
    assert not (rl_workspace / "rl").exists()


def test_outputs_and_series_repeat_byte_for_byte(
    rl_workspace: Path, repo_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(repo_root))
    from stages import rl

    root = rl_workspace
    outs = {}
    for run in ("a", "b"):
        args = _args(root)
        for flag, value in (("--out", root / f"rl_{run}"), ("--plots", root / f"plots/rl_{run}"),
                            ("--metrics", root / f"metrics/rl_{run}.json"), ("--live", root / f"live/rl_{run}.json"),
                            ("--runinfo", root / f"runinfo/rl_{run}.json")):
            args[args.index(flag) + 1] = str(value)
        assert rl.main(args) == 0
        outs[run] = {
            p.name: p.read_bytes() for d in (root / f"rl_{run}", root / f"plots/rl_{run}") for p in d.iterdir()
        }
        outs[run]["live"] = (root / f"live/rl_{run}.json").read_bytes()
    assert outs["a"] == outs["b"]
    live = json.loads(outs["a"]["live"])  # the latest values DVC's tools showed as it ran
    assert live["step"] == 2 and {"reward", "loss", "val_pass@1", "val_greedy"} <= set(live)
    assert outs["a"]["train.tsv"].decode().splitlines()[0] == "step\treward\tcompletion_len\tloss"
    val = outs["a"]["val.tsv"].decode().splitlines()
    assert val[0] == "step\tval_pass@1\tval_greedy\tval_completion_len"  # pass_k=1: pass@1 once
    assert [line.split("\t")[0] for line in val[1:]] == ["0", "2"]  # before training and after the last step
    # What the series were measured on, for the report card's chart titles.
    assert json.loads((root / "runinfo/rl_a.json").read_text())["setup"] == {
        "problems": "synth_math", "mixture": {}, "problems_per_step": 1, "group_size": 2, "temperature": 1.0,
        "pass_k": 1, "eval_problems": 1}


def test_each_step_makes_updates_per_step_updates_of_whole_groups(rl_workspace: Path, repo_root: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(repo_root))
    from lockstep.rl import trainer as rl_trainer
    from stages import rl

    root = rl_workspace
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["rl"].update(problems_per_step=3, updates_per_step=2)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    seen: list[Rollouts] = []
    real = rl_trainer.policy_loss_backward

    def watch(model, ro, **kw):
        seen.append(ro)
        return real(model, ro, **kw)

    monkeypatch.setattr(rl_trainer, "policy_loss_backward", watch)
    assert rl.main(_args(root)) == 0
    assert [len(ro.completions) for ro in seen] == [4, 2] * 2  # 2 steps x 2 updates; groups of 2 kept whole
    for ro in seen:
        assert all(ro.completions[i].prompt == ro.completions[i + 1].prompt for i in range(0, len(ro.completions), 2))


def test_mixture_sources_join_the_updates(rl_workspace: Path, repo_root: Path, monkeypatch: pytest.MonkeyPatch,
                                          caplog) -> None:
    # rl.mixture: a second problem snapshot gives its share of each update; held-out scores stay
    # on rl.problems. A mixture name that is no problem snapshot is refused, naming the key.
    monkeypatch.syspath_prepend(str(repo_root))
    from stages import rl

    root = rl_workspace
    fetch_source(
        "multi", SOURCE_CONFIGS["synth_math"](family="multistep", n_train=8, n_val=2), root / "raw/multi", seed=2
    )
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["rl"].update(problems="multi", problems_per_step=4, mixture={"synth_math": 0.25})
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    caplog.set_level("INFO", logger="lockstep.rl")
    assert rl.main(_args(root)) == 0
    assert "mixture: 1 of each update's 4 problems from synth_math (8 train problems)" in caplog.text
    setup = json.loads((root / "runinfo/rl.json").read_text())["setup"]
    assert setup["problems"] == "multi" and setup["mixture"] == {"synth_math": 0.25}
    metrics = json.loads((root / "metrics/rl.json").read_text())
    assert metrics["greedy_acc.n"] == 1  # the held-out problem is multi's

    params["rl"]["mixture"] = {"tokenizer": 0.25}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(Exception, match=r"rl\.mixture\.tokenizer='tokenizer': .* has no meta.json"):
        rl.main(_args(root))


def test_anchor_conversations_join_every_update(rl_workspace: Path, repo_root: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog) -> None:
    # rl.anchor: an SFT cache's train conversations add their loss to each update, and the series
    # says how large it was. Without --cache, or naming no SFT cache, one error says what to fix.
    monkeypatch.syspath_prepend(str(repo_root))
    from lockstep.data.cache_build import build_sft_cache
    from lockstep.rl import trainer as rl_trainer
    from lockstep.tokenizer import load_tokenizer
    from stages import rl

    root = rl_workspace
    calls = iter(range(1000))
    monkeypatch.setattr(rl_trainer, "reward", lambda completion, answer: float(next(calls) % 2))  # groups disagree
    chats = [{"messages": [{"role": "user", "content": [{"type": "text", "text": f"hi {i}"}]},
                           {"role": "assistant", "content": [{"type": "text", "text": "I am a small model."}]}]}
             for i in range(6)]
    build_sft_cache({"train": chats}, root / "cache/sft/chat", tokenizer=load_tokenizer(root / "tokenizer"),
                    val_frac=None, seed=0)
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["rl"].update(anchor={"chat": 1.0}, anchor_rows=3)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    caplog.set_level("INFO", logger="lockstep.rl")
    assert rl.main(_args(root) + ["--cache", str(root / "cache")]) == 0
    header, *rows = (root / "plots/rl/train.tsv").read_text().splitlines()
    assert header.split("\t") == ["step", "reward", "completion_len", "loss", "anchor_loss"] and len(rows) == 2
    assert all(0 < float(row.split("\t")[4]) < 100 for row in rows)  # every update carried the anchor
    assert "| anchor " in caplog.text
    setup = json.loads((root / "runinfo/rl.json").read_text())["setup"]
    assert (setup["anchor"], setup["anchor_rows"], setup["anchor_target"]) == ({"chat": 1.0}, 3, "data")

    # KL to the starting checkpoint: nothing at the first update, which the policy starts at
    params["rl"]["anchor_target"] = "sft"
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    assert rl.main(_args(root) + ["--cache", str(root / "cache")]) == 0
    _, *rows = (root / "plots/rl/train.tsv").read_text().splitlines()
    first, second = (float(row.split("\t")[4]) for row in rows)
    assert abs(first) < 1e-6 < second < 100
    assert json.loads((root / "runinfo/rl.json").read_text())["setup"]["anchor_target"] == "sft"

    with pytest.raises(Exception, match=r"rl\.anchor names \['chat'\]: pass the token caches folder \(--cache"):
        rl.main(_args(root))
    params["rl"]["anchor"] = {"prose": 1.0}
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(Exception, match=r"rl\.anchor\.prose: none of \[.*sft/prose\'\] holds a cache"):
        rl.main(_args(root) + ["--cache", str(root / "cache")])


def test_a_full_disk_at_the_checkpoint_publishes_nothing_and_ends_with_one_error_line(
        rl_workspace: Path, repo_root: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The disk fills while the RL checkpoint is written (its optimizer state is in, its weights
    are not): one line naming the folder and the fix, status 1, and no half checkpoint beside
    the output, staging folder included."""
    import errno
    import os

    monkeypatch.syspath_prepend(str(repo_root))
    from stages import rl
    from stages._common import entry

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt, "finish_checkpoint", disk_full)
    root = rl_workspace
    assert entry(lambda: rl.main(_args(root)), errors=rl.STAGE_ERRORS) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    assert err.splitlines()[-1] == (
        f"error: no space left to publish {root / 'rl'} (No space left on device); no output was half written "
        f"(RL keeps no intermediate checkpoints). Free space on the disk holding {root}, or point {root} at a disk "
        f"with room (a symlink will do), and run the stage again: it trains from {root / 'sft'}")
    # No .rl.partial; the live progress stays as the stage left it (DVC clears it before a rerun).
    assert sorted(p.name for p in root.iterdir() if p.name != "live") == ["params.yaml", "raw", "sft", "tokenizer"]
