"""Stage `pretrain` (and the shared runner for `midtrain` and `sft`): read params, build data,
model and runtime, call lockstep.train.train, publish the final checkpoint and metrics."""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import lockstep.train
from lockstep import checkpoint as ckpt
from lockstep.config import ConfigError, config_to_dict
from lockstep.io import atomic_dir, sha256_file, write_json_atomic
from lockstep.loaders import Mixture, PretrainTokenStreamDataset, open_sft_dataset
from lockstep.model import GPT, GPTConfig
from lockstep.runtime import (
    RuntimeConfig,
    barrier,
    configure_determinism,
    configure_threads,
    init_runtime,
    shutdown,
    torchrun_argv,
    under_torchrun,
)
from lockstep.tokenizer import load_tokenizer
from lockstep.parity import FIRST_BATCH_FILE, dump_first_batch
from lockstep.train import (
    AllTargets,
    ModelParams,
    NonFiniteError,
    TrainConfig,
    batch_generator,
    git_commit,
    run_key,
    stage_meta,
    train,
)
from stages._common import entry, load_params, section, seed_of, setup

# Errors whose message says what to fix: the entry point prints them as one `error: ...` line.
STAGE_ERRORS = (ConfigError, ckpt.CheckpointError, NonFiniteError)

# Short prompts whose greedy continuations show, in the log and the metrics, what the model learnt.
_TEXT_PROMPTS = ("The", "To be, or not", "First Citizen:")
_CHAT_PROMPTS = ("What is 12 plus 7?", "How many r's are in the word strawberry?", "Who are you?")


def parse_args(stage: str, argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m stages.{stage}", description=f"The {stage} stage.")
    p.add_argument("--cache", type=Path, required=True, help="token caches root (pretrain/<name>/, sft/<name>/)")
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="final checkpoint folder")
    p.add_argument("--metrics", type=Path, required=True)
    p.add_argument("--plots", type=Path, required=True, help="dvclive folder for per-step series")
    p.add_argument("--runs", type=Path, required=True, help="git-ignored folder for intermediate checkpoints")
    p.add_argument("--params", type=Path, default=Path("params.yaml"))
    if stage != "pretrain":
        p.add_argument("--init", type=Path, required=True, help="checkpoint to start from")
    return p.parse_args(argv)


def find_cache(root: Path, name: str) -> tuple[str, Path]:
    """(kind, folder) of the cache a mixture names: `pretrain/x` or `sft/x` explicitly, or a bare
    name looked up under pretrain/ then sft/."""
    if "/" in name:
        kind, _, bare = name.partition("/")
        if kind not in ("pretrain", "sft"):
            raise ConfigError(f"mixture key {name!r}: the prefix must be pretrain/ or sft/")
        candidates = [(kind, root / kind / bare)]
    else:
        candidates = [("pretrain", root / "pretrain" / name), ("sft", root / "sft" / name)]
    for kind, path in candidates:
        if (path / "meta.json").is_file():
            return kind, path
    raise ConfigError(f"mixture names cache {name!r}, but none of {[str(p) for _, p in candidates]} holds a "
                      "meta.json; add its cache stage or fix the mixture key")


def build_mixture(root: Path, cfg: TrainConfig, *, split: str, seq_len: int, device: torch.device, tok: Any,
                  stage: str) -> tuple[Mixture, dict[str, str]]:
    """The weighted mixture for `split` and the sha256 of each cache's meta.json (its identity)."""
    if not cfg.mixture:
        raise ConfigError(f"{stage}.mixture is empty; name at least one cache with a weight")
    found = {name: find_cache(root, name) for name in sorted(cfg.mixture)}
    kinds = {kind for kind, _ in found.values()}
    if cfg.loss == "assistant" and "pretrain" in kinds:
        raise ConfigError(f"{stage}.loss=assistant needs SFT caches only; drop the pretraining caches from the mixture")
    parts, names, identities = [], [], {}
    for name, (kind, path) in found.items():
        identities[name] = sha256_file(path / "meta.json")
        if kind == "pretrain":
            ds: Any = PretrainTokenStreamDataset(path / split, T=seq_len, device=device, tokenizer_sha256=tok.sha256)
            if "sft" in kinds:
                ds = AllTargets(ds)
        else:
            ds = open_sft_dataset(path, split, T=seq_len, device=device, pad_id=tok.get_bos_token_id(),
                                  tokenizer_sha256=tok.sha256)
        parts.append((ds, cfg.mixture[name]))
        names.append(name)
    return Mixture(parts, names=names), identities


def _prompts(stage: str, tok: Any) -> list[list[int]]:
    bos = tok.get_bos_token_id()
    if stage == "pretrain":
        return [[bos, *tok.encode(p)] for p in _TEXT_PROMPTS]
    return [tok.render_for_completion({"messages": [{"role": "user", "content": [{"type": "text", "text": p}]}]})
            for p in _CHAT_PROMPTS]


def _resume_note(stage: str, run_dir: Path) -> str:
    """The line Ctrl-C leaves: the run's newest complete checkpoint (its manifest is written last),
    which a rerun with the same params and code resumes from."""
    found = ckpt.list_checkpoints(run_dir)
    if not found:
        return f"{stage} stopped before its first checkpoint in {run_dir}; `dvc repro` starts it over"
    step, path = found[-1]
    return f"{stage} stopped; last complete checkpoint {path} (step {step}); `dvc repro` resumes from it"


class _Plots:
    """Per-step series through dvclive on rank 0 (the plots are declared once in dvc.yaml)."""

    def __init__(self, folder: Path) -> None:
        from dvclive import Live

        self.live = Live(dir=str(folder), dvcyaml=False, save_dvc_exp=False, report=None)

    def __call__(self, row: dict[str, float]) -> None:
        step = int(row["step"])
        self.live.step = step
        for key, value in row.items():
            if key != "step":
                self.live.log_metric(key, value, plot=True)
        if "train_loss" in row:
            self.live.next_step()

    def close(self) -> None:
        self.live.end()


def run(stage: str, argv: list[str] | None = None) -> int:
    start_s = time.perf_counter()
    args = parse_args(stage, argv)
    log = setup(stage)
    params = load_params(args.params)
    seed = seed_of(params)
    rt_cfg = section(params, "runtime", RuntimeConfig)
    cfg = section(params, stage, TrainConfig)
    model_params = section(params, "model", ModelParams)
    if rt_cfg.nproc > 1 and not under_torchrun():
        cmd = torchrun_argv(rt_cfg.nproc, f"stages.{stage}", sys.argv[1:] if argv is None else argv)
        log.info("re-running under torchrun: %s", " ".join(cmd))
        proc = subprocess.Popen(cmd)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            # Ctrl-C reached the workers too (one process group): let torchrun wind them down,
            # and leave the line on where to resume to rank 0.
            proc.wait()
            return 130
    threads = configure_threads(rt_cfg.threads, rt_cfg.nproc)
    configure_determinism(rt_cfg.deterministic)
    rt = init_runtime(rt_cfg)
    if not rt.is_main:
        logging.getLogger("lockstep").setLevel(logging.WARNING)
    log.info("runtime: %s; %d thread(s); rank %d of %d", rt.reason, threads, rt.rank, rt.world_size)

    tok = load_tokenizer(args.tokenizer)
    init_identity = None
    if stage == "pretrain":
        gcfg = model_params.gpt_config(tok.get_vocab_size())
        model = GPT.build(gcfg, rt.device, seed=seed)
    else:
        init = ckpt.load_checkpoint(args.init)
        if init.meta.get("tokenizer_sha256") != tok.sha256:
            raise ckpt.CheckpointError(f"{args.init} was trained with tokenizer {str(init.meta.get('tokenizer_sha256'))[:12]}…, "
                                       f"not {tok.sha256[:12]}… in {args.tokenizer}; re-run the earlier stages (dvc repro)")
        gcfg = GPTConfig.from_dict(init.meta["model_config"])
        model = GPT.build(gcfg, rt.device, seed=seed)
        model.load_state_dict({k: v.to(rt.device) for k, v in init.model_state.items()})
        init_identity = sha256_file(Path(args.init) / ckpt.MANIFEST_FILE)
    model.use_kernels(rt.kernels)
    if gcfg.vocab_size != tok.get_vocab_size():
        raise ConfigError(f"model vocab {gcfg.vocab_size} != tokenizer vocab {tok.get_vocab_size()}; re-run the earlier stages")

    seq_len = gcfg.sequence_len
    train_data, train_ids = build_mixture(args.cache, cfg, split="train", seq_len=seq_len, device=rt.device, tok=tok, stage=stage)
    val_data, _ = build_mixture(args.cache, cfg, split="val", seq_len=seq_len, device=rt.device, tok=tok, stage=stage)
    token_bytes = torch.from_numpy(tok.token_bytes().astype("int64"))

    # One code revision names the run folder and goes into its checkpoints.
    revision = lockstep.train.code_revision()
    identity = {"seed": seed, "runtime": config_to_dict(rt_cfg), "model": gcfg.to_dict(), stage: config_to_dict(cfg),
                "tokenizer_sha256": tok.sha256, "caches": train_ids, "init": init_identity, "code": revision}
    run_dir = args.runs / f"{stage}-{run_key(stage, identity)}"
    meta = stage_meta(model_config=gcfg, cfg=cfg, stage=stage, tokenizer_sha256=tok.sha256, seed=seed,
                      extra={"caches": train_ids, "init_manifest_sha256": init_identity, "runtime": rt.describe(),
                             "code_revision": revision})
    log.info("run folder %s", run_dir)
    plots = _Plots(args.plots) if rt.is_main else None
    if rt.is_main:
        # Parity artifact: the first micro-batch exactly as step 0 draws it (data order is stateless).
        first = train_data.get_batch(B=cfg.device_batch_rows, generator=batch_generator(seed, 0, 0))
        dump_first_batch(args.plots / FIRST_BATCH_FILE, first[0], first[1], first[2] if len(first) > 2 else None,
                         rows=train_data.last_rows, meta={"stage": stage, "step": 0, "micro_batch": 0})
    try:
        result = train(model, cfg=cfg, rt=rt, train_data=train_data, val_data=val_data, token_bytes=token_bytes,
                       run_dir=run_dir, seed=seed, meta=meta, sample_prompts=_prompts(stage, tok), decode=tok.decode,
                       on_step=plots, params_section=stage)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_resume_note(stage, run_dir)) from None
    finally:
        if plots is not None:
            plots.close()
    if rt.is_main:
        # The output is a verified copy of the run's last checkpoint: byte-identical for identical runs.
        ckpt.verify_checkpoint(result.checkpoint)
        with atomic_dir(args.out) as tmp:
            for f in sorted(result.checkpoint.iterdir()):
                shutil.copyfile(f, tmp / f.name)
        ckpt.verify_checkpoint(args.out)
        metrics = {
            "val_bpb": result.final_eval.get("val_bpb"), "unigram_bpb": result.final_eval.get("unigram_bpb"),
            "steps": result.step, "tokens": result.tokens, "flops": result.flops, "tok_per_s": result.tok_per_s,
            "mfu": result.mfu, "train_time_s": result.train_time_s, "params": model.num_params(),
            "device": rt.describe(), "peak_flops": result.peak, "samples": result.samples,
            "resumed_from_step": result.resumed_from, "git_commit": git_commit(),
            "stage_wall_time_s": time.perf_counter() - start_s,
        }
        write_json_atomic(args.metrics, {k: (None if isinstance(v, float) and v != v else v) for k, v in metrics.items()})
        log.info("done: val bpb %.4f (unigram %.4f), %d steps, %s", metrics["val_bpb"] or float("nan"),
                 metrics["unigram_bpb"] or float("nan"), result.step, args.out)
    barrier(rt)
    shutdown(rt)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run("pretrain", argv)


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
