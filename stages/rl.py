"""Stage `rl`: GRPO-style policy gradient from the SFT checkpoint on GSM8K-format problems; writes
the RL checkpoint, its metrics and per-step series (reward, held-out pass@k, completion length).
Parses paths, reads the `runtime` and `rl` params sections, calls lockstep.rl."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from lockstep import checkpoint as ckpt
from lockstep.codeid import code_revision
from lockstep.config import ConfigError, config_to_dict
from lockstep.io import sha256_file, write_json_atomic
from lockstep.rl import RLConfig, series_columns, train_rl
from lockstep.runinfo import git_commit
from lockstep.runtime import RuntimeConfig
from lockstep.series import SeriesWriter
from lockstep.snapshot import iter_records, read_meta
from lockstep.tokenizer import TokenizerFileError, load_tokenizer
from lockstep.train import NonFiniteError
from stages._common import entry, preamble
from stages._runtime import start_runtime

# Errors whose message says what to fix: the entry point prints them as one `error: ...` line.
STAGE_ERRORS = (ConfigError, ckpt.CheckpointError, NonFiniteError, TokenizerFileError)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stages.rl", description=__doc__)
    ap.add_argument("--init", type=Path, required=True, help="checkpoint to start from (data/ckpt/sft)")
    ap.add_argument("--raw", type=Path, required=True, help="raw snapshots folder (data/raw)")
    ap.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder (data/tokenizer)")
    ap.add_argument("--out", type=Path, required=True, help="final checkpoint folder (data/ckpt/rl)")
    ap.add_argument("--metrics", type=Path, required=True, help="metrics JSON, results only (data/metrics/rl.json)")
    ap.add_argument("--runinfo", type=Path, required=True, help="run facts JSON: timings, device (data/runinfo/rl.json)")
    ap.add_argument("--plots", type=Path, required=True, help="per-step series folder (data/plots/rl)")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = ap.parse_args(argv)
    pre = preamble("rl", args.params)
    cfg = pre.section("rl", RLConfig)
    rt = start_runtime(pre, pre.section("runtime", RuntimeConfig), module=None, argv=argv)
    assert not isinstance(rt, int)  # a single-process stage is never re-run under torchrun
    log, seed = pre.log, pre.seed

    tok = load_tokenizer(args.tokenizer)
    model, _ = ckpt.load_model(args.init, rt.device, tokenizer_sha256=tok.sha256)
    model.use_kernels(rt.kernels)
    snapshot = args.raw / cfg.problems
    if read_meta(snapshot).get("kind") != "problem":
        raise ConfigError(f"rl.problems={cfg.problems!r}: {snapshot} does not hold problem records; name a GSM8K-format source")
    train_problems = list(iter_records(snapshot, "train"))
    val_problems = list(iter_records(snapshot, "val"))
    log.info("problems: %d train, %d held out (%d scored)", len(train_problems), len(val_problems),
             min(cfg.eval_problems, len(val_problems)))

    series = SeriesWriter(args.plots, series_columns(cfg))
    t0 = time.perf_counter()
    try:
        result = train_rl(model, tok, train_problems=train_problems, val_problems=val_problems, cfg=cfg,
                          device=rt.device, seed=seed, autocast=rt.autocast(), log=log.info, on_step=series.add)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"rl keeps no intermediate checkpoints, so nothing was saved; `dvc repro` runs it "
                                f"again from {args.init}") from None
    wall_s = time.perf_counter() - t0

    meta = {"stage": "rl", "model_config": model.config.to_dict(), "stage_config": config_to_dict(cfg),
            "tokenizer_sha256": tok.sha256, "seed": seed, "step": result.steps,
            "init_manifest_sha256": sha256_file(args.init / ckpt.MANIFEST_FILE), "runtime": rt.settings(),
            "code_revision": code_revision("stages.rl")}
    state = {k: v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu()
             for k, v in model.state_dict().items()}
    ckpt.save_checkpoint(args.out, state, {0: result.optimizer_state}, meta)
    series.write()
    k = cfg.pass_k
    results = {
        "pass@1_before": result.before["pass@1"], "pass@1": result.after["pass@1"],
        f"pass@{k}_before": result.before[f"pass@{k}"], f"pass@{k}": result.after[f"pass@{k}"],
        "greedy_acc_before": result.before["greedy"], "greedy_acc": result.after["greedy"],
    }
    n_problems = min(cfg.eval_problems, len(val_problems))
    metrics = {
        **results, **{f"{name}.n": n_problems for name in results},  # each rate with the problems it is over
        "completion_len": result.after["completion_len"], "reward_first_step": result.mean_reward_first,
        "reward_last_step": result.mean_reward_last, "steps": result.steps, "rollout_tokens": result.rollout_tokens,
    }
    runinfo = {"train_time_s": result.train_time_s, "wall_time_s": wall_s, "device": rt.describe(),
               "git_commit": git_commit()}
    write_json_atomic(args.runinfo, runinfo)
    write_json_atomic(args.metrics, metrics)
    log.info("done: held-out pass@1 %.3f -> %.3f, pass@%d %.3f -> %.3f", result.before["pass@1"],
             result.after["pass@1"], k, result.before[f"pass@{k}"], result.after[f"pass@{k}"])
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
