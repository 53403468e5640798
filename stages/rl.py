"""Stage `rl`: GRPO-style policy gradient from the SFT checkpoint on GSM8K-format problems; writes
the RL checkpoint, its metrics and per-step series (reward, held-out pass@k, completion length)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from lockstep import checkpoint as ckpt
from lockstep.config import ConfigError, config_to_dict
from lockstep.io import atomic_open, sha256_file, write_json_atomic
from lockstep.model import GPT, GPTConfig
from lockstep.rl import RLConfig, train_rl
from lockstep.runtime import RuntimeConfig, configure_determinism, configure_threads, init_runtime
from lockstep.sources import iter_records, read_meta
from lockstep.tokenizer import load_tokenizer
from lockstep.train import NonFiniteError
from stages._common import entry, load_params, section, seed_of, setup

# Errors whose message says what to fix: the entry point prints them as one `error: ...` line.
STAGE_ERRORS = (ConfigError, ckpt.CheckpointError, NonFiniteError)


def write_series(path: Path, rows: list[dict[str, float]]) -> None:
    """Rows with a `step` column as a TSV plot file (columns: step, then sorted keys)."""
    cols = ["step", *sorted({k for r in rows for k in r} - {"step"})]
    with atomic_open(path, "w") as f:
        f.write("\t".join(cols) + "\n")
        for r in rows:
            f.write("\t".join("" if r.get(c) is None else (str(int(r[c])) if c == "step" else f"{r[c]:.6g}") for c in cols) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stages.rl", description=__doc__)
    ap.add_argument("--init", type=Path, required=True, help="checkpoint to start from (data/ckpt/sft)")
    ap.add_argument("--raw", type=Path, required=True, help="raw snapshots folder (data/raw)")
    ap.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder (data/tokenizer)")
    ap.add_argument("--out", type=Path, required=True, help="final checkpoint folder (data/ckpt/rl)")
    ap.add_argument("--metrics", type=Path, required=True, help="metrics JSON (data/metrics/rl.json)")
    ap.add_argument("--plots", type=Path, required=True, help="per-step series folder (data/plots/rl)")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = ap.parse_args(argv)
    log = setup("rl")
    params = load_params(args.params)
    seed = seed_of(params)
    cfg = section(params, "rl", RLConfig)
    rt_cfg = section(params, "runtime", RuntimeConfig)
    if rt_cfg.nproc > 1:
        log.info("rl runs in one process; runtime.nproc=%d applies to the training stages only", rt_cfg.nproc)
    threads = configure_threads(rt_cfg.threads, 1)
    configure_determinism(rt_cfg.deterministic)
    rt = init_runtime(rt_cfg)
    log.info("runtime: %s; %d thread(s)", rt.reason, threads)

    tok = load_tokenizer(args.tokenizer)
    init = ckpt.load_checkpoint(args.init)
    if init.meta.get("tokenizer_sha256") != tok.sha256:
        raise ckpt.CheckpointError(f"{args.init} was trained with another tokenizer than {args.tokenizer}; "
                                   "re-run the earlier stages (dvc repro)")
    gcfg = GPTConfig.from_dict(init.meta["model_config"])
    model = GPT.build(gcfg, rt.device, seed=seed)
    model.load_state_dict({k: v.to(rt.device) for k, v in init.model_state.items()})
    model.use_kernels(rt.kernels)

    snapshot = args.raw / cfg.problems
    if read_meta(snapshot).get("kind") != "problem":
        raise ConfigError(f"rl.problems={cfg.problems!r}: {snapshot} does not hold problem records; name a GSM8K-format source")
    train_problems = list(iter_records(snapshot, "train"))
    val_problems = list(iter_records(snapshot, "val"))
    log.info("problems: %d train, %d held out (%d scored)", len(train_problems), len(val_problems),
             min(cfg.eval_problems, len(val_problems)))

    train_rows: list[dict[str, float]] = []
    eval_rows: list[dict[str, float]] = []

    def on_step(row: dict[str, float]) -> None:
        (eval_rows if any(k.startswith("val_") for k in row) else train_rows).append(row)

    t0 = time.perf_counter()
    try:
        result = train_rl(model, tok, train_problems=train_problems, val_problems=val_problems, cfg=cfg,
                          device=rt.device, seed=seed, autocast=rt.autocast(), log=log.info, on_step=on_step)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"rl keeps no intermediate checkpoints, so nothing was saved; `dvc repro` runs it "
                                f"again from {args.init}") from None
    wall_s = time.perf_counter() - t0

    meta = {"stage": "rl", "model_config": gcfg.to_dict(), "stage_config": config_to_dict(cfg),
            "tokenizer_sha256": tok.sha256, "seed": seed, "step": result.steps,
            "init_manifest_sha256": sha256_file(args.init / ckpt.MANIFEST_FILE)}
    state = {k: v.detach().to("cpu", torch.float32) if v.is_floating_point() else v.detach().cpu()
             for k, v in model.state_dict().items()}
    ckpt.save_checkpoint(args.out, state, {0: result.optimizer_state}, meta)
    write_series(args.plots / "train.tsv", train_rows)
    write_series(args.plots / "eval.tsv", eval_rows)
    k = cfg.pass_k
    metrics = {
        "pass@1_before": result.before["pass@1"], "pass@1": result.after["pass@1"],
        f"pass@{k}_before": result.before[f"pass@{k}"], f"pass@{k}": result.after[f"pass@{k}"],
        "greedy_acc_before": result.before["greedy"], "greedy_acc": result.after["greedy"],
        "completion_len": result.after["completion_len"], "reward_first_step": result.mean_reward_first,
        "reward_last_step": result.mean_reward_last, "steps": result.steps, "rollout_tokens": result.rollout_tokens,
        "eval_problems": min(cfg.eval_problems, len(val_problems)), "train_time_s": result.train_time_s,
        "wall_time_s": wall_s, "device": rt.describe(),
    }
    write_json_atomic(args.metrics, metrics)
    log.info("done: held-out pass@1 %.3f -> %.3f, pass@%d %.3f -> %.3f", result.before["pass@1"],
             result.after["pass@1"], k, result.before[f"pass@{k}"], result.after[f"pass@{k}"])
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
