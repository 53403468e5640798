"""The `rl` stage's work around lockstep.rl.trainer.RLTrainer: load the SFT checkpoint and the tokenizer,
read the problem snapshot's train and held-out splits, train, then publish the RL checkpoint, the
per-step series, the metrics (held-out pass@1 and pass@k before and after, each with the problems
it is over) and the run facts. Typed configs, paths and the code revision come from the caller
(stages/rl.py); nothing here reads params.yaml or argv."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lockstep.core.config import ConfigError, config_to_dict
from lockstep.core.io import NoRoomError, no_room_is, sha256_file, write_json_atomic
from lockstep.core.runinfo import write_runinfo
from lockstep.core.runtime import Runtime
from lockstep.core.series import SeriesWriter
from lockstep.data.cache import find_cache
from lockstep.data.loaders import Mixture, open_sft_dataset
from lockstep.data.snapshot import SnapshotError, iter_records, read_meta
from lockstep.infer.engine import decode_settings
from lockstep.model import checkpoint as ckpt
from lockstep.pipeline.live import FLUSH_EVERY_S, LiveMetrics, each
from lockstep.rl.config import RLConfig
from lockstep.rl.trainer import RLResult, RLTrainer, series_columns
from lockstep.tokenizer import TokenizerFileError, load_tokenizer
from lockstep.train.trainer import NonFiniteError
# The rl stage (stages/rl.py) imports from this module alone: with the work come its params
# sections' classes and the code revision it names.
from lockstep.core.codeid import code_revision  # noqa: F401
from lockstep.core.runtime import RuntimeConfig  # noqa: F401

# Errors whose message says what to fix: the stage's entry point prints them as one `error:` line.
ERRORS = (ConfigError, ckpt.CheckpointError, NonFiniteError, TokenizerFileError, SnapshotError, FileNotFoundError,
          NoRoomError)


@dataclass(frozen=True)
class RLStagePaths:
    """Where the rl stage reads and writes (dvc.yaml names each)."""

    init: Path  # the checkpoint to start from (data/ckpt/sft)
    raw: Path  # raw snapshots root; `rl.problems` names the folder under it
    tokenizer: Path
    out: Path  # the final checkpoint folder
    metrics: Path  # the metrics JSON: results
    runinfo: Path  # the run facts JSON: timings, device, commit, what decides the numerics
    plots: Path  # per-step series
    cache: Path | None = None  # token caches root (data/cache): rl.anchor's SFT caches are under sft/
    live: Path | None = None  # the latest step's values for DVC's tools while the stage runs (data/live/<stage>.json)


def rl_metrics(result: RLResult, cfg: RLConfig, n_problems: int) -> dict[str, Any]:
    """The stage's metrics JSON: held-out rates before and after, each with the number of problems
    it is over (`<name>.n`), and the run's reward and length figures; equal for equal runs."""
    k = cfg.pass_k
    rates = {
        "pass@1_before": result.before["pass@1"], "pass@1": result.after["pass@1"],
        f"pass@{k}_before": result.before[f"pass@{k}"], f"pass@{k}": result.after[f"pass@{k}"],
        "greedy_acc_before": result.before["greedy"], "greedy_acc": result.after["greedy"],
    }
    return {
        **rates, **{f"{name}.n": n_problems for name in rates},
        "completion_len": result.after["completion_len"], "reward_first_step": result.mean_reward_first,
        "reward_last_step": result.mean_reward_last, "steps": result.steps, "rollout_tokens": result.rollout_tokens,
    }


def rl_setup(cfg: RLConfig, n_scored: int) -> dict[str, Any]:
    """What the stage's series were measured on, for the report card's charts: the problem
    snapshot, the rollouts per step and their temperature, the held-out problems scored, and the
    anchor's caches, rows and target when it has one."""
    anchor = ({"anchor": dict(cfg.anchor), "anchor_rows": cfg.anchor_rows, "anchor_target": cfg.anchor_target}
              if cfg.anchor else {})
    return {"problems": cfg.problems, "mixture": dict(cfg.mixture), "problems_per_step": cfg.problems_per_step,
            "group_size": cfg.group_size,
            "temperature": cfg.temperature, "pass_k": cfg.pass_k, "eval_problems": n_scored, **anchor}


def problem_snapshot(raw: Path, name: str, key: str) -> Path:
    """The raw snapshot `name` under `raw`, checked to hold problem records; `key` is the params
    key that named it, for the error."""
    snapshot = raw / name
    try:
        kind = read_meta(snapshot).get("kind")
    except SnapshotError as e:
        raise ConfigError(f"{key}={name!r}: {e}") from None
    if kind != "problem":
        raise ConfigError(f"{key}={name!r}: {snapshot} does not hold problem records; name a GSM8K-format source "
                          "that a fetch stage writes under data/raw")
    return snapshot


def anchor_loader(cfg: RLConfig, cache: Path | None, *, seq_len: int, device: torch.device, pad_id: int,
                  tokenizer_sha256: str) -> Mixture | None:
    """The train conversations of `rl.anchor`'s SFT caches, weighted as it says; None when it is
    empty."""
    if not cfg.anchor:
        return None
    if cache is None:
        raise ConfigError(f"rl.anchor names {sorted(cfg.anchor)}: pass the token caches folder (--cache data/cache)")
    parts = []
    for name in sorted(cfg.anchor):
        _, folder = find_cache(cache, f"sft/{name}", key=f"rl.anchor.{name}")
        parts.append((open_sft_dataset(folder, "train", T=seq_len, device=device, pad_id=pad_id,
                                       tokenizer_sha256=tokenizer_sha256), cfg.anchor[name]))
    return Mixture(parts, names=sorted(cfg.anchor))


def run_rl_stage(*, cfg: RLConfig, paths: RLStagePaths, rt: Runtime, seed: int,
                 code_revision: str,  # noqa: F811 - shadows the stage's re-export above, on purpose
                 started_s: float) -> dict[str, Any]:
    """Run the rl stage end to end in this process and return its metrics. `seed` draws the
    rollouts; `code_revision` goes into the checkpoint; `started_s` (time.perf_counter) is when
    the stage began. The policy is the init checkpoint's, refused if it was trained with another
    tokenizer. RL keeps no intermediate checkpoints: Ctrl-C raises KeyboardInterrupt carrying the
    line that says a rerun starts over, and nothing is written."""
    log = logging.getLogger("lockstep.rl")
    tok = load_tokenizer(paths.tokenizer)
    model, _ = ckpt.load_model(paths.init, rt.device, tokenizer_sha256=tok.sha256)
    model.use_kernels(rt.kernels)
    snapshot = problem_snapshot(paths.raw, cfg.problems, "rl.problems")
    train_problems = list(iter_records(snapshot, "train"))
    val_problems = list(iter_records(snapshot, "val"))
    n_scored = min(cfg.eval_problems, len(val_problems))
    log.info("problems: %d train, %d held out (%d scored)", len(train_problems), len(val_problems), n_scored)
    mixture_problems = {name: list(iter_records(problem_snapshot(paths.raw, name, f"rl.mixture.{name}"), "train"))
                        for name in sorted(cfg.mixture)}
    for name, n in cfg.draws().items():
        log.info("mixture: %d of each update's %d problems from %s (%d train problems)", n, cfg.problems_per_step, name,
                 len(mixture_problems[name]))

    anchor = anchor_loader(cfg, paths.cache, seq_len=model.config.sequence_len, device=rt.device,
                           pad_id=tok.get_bos_token_id(), tokenizer_sha256=tok.sha256)
    series = SeriesWriter(paths.plots, series_columns(cfg), flush_every_s=FLUSH_EVERY_S)
    live = LiveMetrics(paths.live) if paths.live is not None else None
    t0 = time.perf_counter()
    try:
        trainer = RLTrainer(model, tok, cfg, train_problems=train_problems, val_problems=val_problems, device=rt.device,
                            seed=seed, autocast=rt.autocast(), on_step=each(series.add, live.add if live else None),
                            decode=decode_settings(rt.device, rt.dtype, rt.kernels, rt.compile),
                            mixture_problems=mixture_problems, anchor=anchor)
        result = trainer.fit()
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"rl keeps no intermediate checkpoints, so nothing was saved; `dvc repro` runs it "
                                f"again from {paths.init}") from None
    wall_s = time.perf_counter() - t0

    meta = {"stage": "rl", "model_config": model.config.to_dict(), "stage_config": config_to_dict(cfg),
            "tokenizer_sha256": tok.sha256, "seed": seed, "step": result.steps,
            "init_manifest_sha256": sha256_file(paths.init / ckpt.MANIFEST_FILE), "runtime": rt.settings(),
            "code_revision": code_revision}
    state = {k: v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu()
             for k, v in model.state_dict().items()}
    with no_room_is(NoRoomError, doing=f"publish {paths.out}", folder=paths.out.parent,
                    outcome="no output was half written (RL keeps no intermediate checkpoints)",
                    rerun=f"run the stage again: it trains from {paths.init}"):
        ckpt.save_checkpoint(paths.out, state, {0: result.optimizer_state}, meta)
        series.write()
        metrics = rl_metrics(result, cfg, n_scored)
        write_runinfo(paths.runinfo, {"train_time_s": result.train_time_s, "wall_time_s": wall_s,
                                      "stage_wall_time_s": time.perf_counter() - started_s, "device": rt.describe(),
                                      "setup": rl_setup(cfg, n_scored)},
                      device=rt.device)
        write_json_atomic(paths.metrics, metrics)
    k = cfg.pass_k
    log.info("done: held-out pass@1 %.3f -> %.3f, pass@%d %.3f -> %.3f", result.before["pass@1"],
             result.after["pass@1"], k, result.before[f"pass@{k}"], result.after[f"pass@{k}"])
    return metrics
