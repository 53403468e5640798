"""A training stage's work around lockstep.train.trainer.Trainer, shared by pretrain, midtrain and SFT:
find the caches a mixture names and build the train/val mixtures, build the model (fresh, or from
the checkpoint the stage starts from) and the objective (lockstep.train.objectives.build), name the run
folder, write the first-batch parity artifact, check that no mixture component is read more than
`max_epochs` times (lockstep.data.budget), train, then publish the final checkpoint, the per-step
series and the metrics. Typed configs, paths and the code revision come from the caller
(stages/pretrain.py, midtrain.py, sft.py); nothing here reads params.yaml or argv."""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lockstep.core.config import ConfigError, config_to_dict
from lockstep.core.io import NoRoomError, atomic_dir, canonical_json, no_room_is, sha256_file, write_json_atomic
from lockstep.core.runinfo import nan_to_null, write_runinfo
from lockstep.core.runtime import Runtime, RuntimeConfig, barrier
from lockstep.core.series import SeriesWriter
from lockstep.data.budget import (ComponentEpochs, Holding, check_epochs, epoch_line, epochs_facts, mixture_epochs,
                                  sft_holding)
from lockstep.data.cache import find_cache
from lockstep.data.loaders import Mixture, PretrainTokenStreamDataset, SFTExampleDataset, open_sft_dataset
from lockstep.data.parity import FIRST_BATCH_FILE, dump_first_batch
from lockstep.data.records import user_prompt
from lockstep.model import checkpoint as ckpt
from lockstep.model.embeddings import EMBEDDINGS
from lockstep.model.gpt import GPT, GPTConfig
from lockstep.pipeline.live import FLUSH_EVERY_S, LiveMetrics, each
from lockstep.tokenizer import NoPrefixTreeError, Tokenizer, TokenizerFileError, load_tokenizer
from lockstep.tokenizer.base import TOKEN_STRUCTURES
from lockstep.train import objectives, resume
from lockstep.train.trainer import (
    SERIES_COLUMNS,
    BatchSource,
    ModelParams,
    NonFiniteError,
    Samples,
    TrainConfig,
    Trainer,
    TrainResult,
    Validation,
    batch_generator,
    horizon_key,
    horizon_steps,
)
# The training stages (stages/pretrain.py, midtrain.py, sft.py) import from this module alone: with
# the work come their params sections' classes, the code revision they name and the runtime's end.
from lockstep.core.codeid import code_revision  # noqa: F401
from lockstep.core.runtime import shutdown  # noqa: F401
from lockstep.train.trainer import MidtrainConfig, SFTConfig  # noqa: F401

# Errors whose message says what to fix: a training stage's entry point prints them as one line.
ERRORS = (
    ConfigError,
    ckpt.CheckpointError,
    NonFiniteError,
    TokenizerFileError,
    resume.RunFolderInUseError,
    NoRoomError,
)

# Short prompts whose greedy continuations show, in the log and the metrics, what the model learnt.
TEXT_PROMPTS = ("The", "To be, or not", "First Citizen:")
CHAT_PROMPTS = ("What is 12 plus 7?", "How many r's are in the word strawberry?", "Who are you?")


@dataclass(frozen=True)
class TrainStagePaths:
    """Where a training stage reads and writes (dvc.yaml names each)."""

    cache: Path  # token caches root: pretrain/<name>/, sft/<name>/
    tokenizer: Path
    out: Path  # the final checkpoint folder
    metrics: Path  # the metrics JSON: results
    runinfo: Path  # the run facts JSON: timings, throughput, device, commit
    plots: Path  # per-step series and the first-batch parity artifact
    runs: Path  # git-ignored run folders holding the intermediate checkpoints
    init: Path | None = None  # the checkpoint to start from; None for a fresh model (pretrain)
    live: Path | None = None  # the latest step's values for DVC's tools while the stage runs (data/live/<stage>.json)


class AllTargets:
    """Wraps a pretraining source (x, y) so it yields (x, y, y): every target counts, and it mixes
    with SFT sources (x, y, y_masked) in one lockstep.data.loaders.Mixture (midtraining)."""

    def __init__(self, source: BatchSource) -> None:
        self.source = source

    def get_batch(self, *, B: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        x, y = self.source.get_batch(B=B, generator=generator)[:2]
        return x, y, y

    @property
    def last_rows(self) -> list[dict[str, Any]]:
        return getattr(self.source, "last_rows", [])


def build_mixture(root: Path, cfg: TrainConfig, *, split: str, seq_len: int, device: torch.device, tok: Tokenizer,
                  stage: str) -> tuple[Mixture, dict[str, str]]:
    """The weighted mixture for `split` and the sha256 of each cache's meta.json (its identity)."""
    if not cfg.mixture:
        raise ConfigError(f"{stage}.mixture is empty; name at least one cache with a weight")
    found = {name: find_cache(root, name, key=f"{stage}.mixture.{name}") for name in sorted(cfg.mixture)}
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


def holding_of(ds: Any) -> Holding:
    """What a mixture part built by build_mixture holds, read from the open dataset: a
    pretraining stream's train tokens, or the SFT examples the loader draws and their lengths as
    it cuts them."""
    if isinstance(ds, AllTargets):
        ds = ds.source
    if isinstance(ds, PretrainTokenStreamDataset):
        return Holding("pretrain", tokens=ds.split.tokens, examples=None, origin="cache")
    if isinstance(ds, SFTExampleDataset):
        return sft_holding(ds.example_lengths().tolist(), seq_len=ds.T)
    raise TypeError(f"no data budget for a mixture part of type {type(ds).__name__}")


def stage_epochs(stage: str, cfg: TrainConfig, train_data: Mixture, *, total_steps: int,
                 seq_len: int) -> list[ComponentEpochs]:
    """Epochs per component of the train mixture over the whole horizon, logged one line each;
    raises lockstep.data.budget.EpochBudgetError, before any step, when one is above cfg.max_epochs."""
    holdings = {name: holding_of(ds) for name, ds in zip(train_data.names, train_data.datasets, strict=True)}
    components = mixture_epochs(cfg.mixture, holdings, total_tokens=total_steps * cfg.batch_tokens, seq_len=seq_len)
    log = logging.getLogger(f"lockstep.{stage}")
    for c in components:
        log.info("%s", epoch_line(c, cfg.max_epochs))
    check_epochs(components, stage=stage, max_epochs=cfg.max_epochs, num_steps=total_steps, horizon=horizon_key(cfg))
    return components


def sample_prompts(stage: str, tok: Tokenizer) -> list[list[int]]:
    """The prompts sampled at the end of training: text openings for pretraining, chat questions
    for the stages that train on conversations."""
    if stage == "pretrain":
        bos = tok.get_bos_token_id()
        return [[bos, *tok.encode(p)] for p in TEXT_PROMPTS]
    return [tok.render_for_completion(user_prompt(p)) for p in CHAT_PROMPTS]


def resume_note(stage: str, run_dir: Path) -> str:
    """The line Ctrl-C leaves: the run's newest complete checkpoint (its manifest is written last),
    which a rerun with the same params and code resumes from."""
    found = ckpt.list_checkpoints(run_dir)
    if not found:
        return f"{stage} stopped before its first checkpoint in {run_dir}; `dvc repro` starts it over"
    step, path = found[-1]
    return f"{stage} stopped; last complete checkpoint {path} (step {step}); `dvc repro` resumes from it"


def run_key(stage: str, payload: dict[str, Any]) -> str:
    """A short hash naming a run folder: the stage name, its params and its inputs' identities.
    A params or input change gets a new folder, so a run never resumes someone else's state."""
    return hashlib.sha256(canonical_json({"stage": stage, **payload}).encode("utf-8")).hexdigest()[:16]


def stage_meta(*, model_config: GPTConfig, cfg: TrainConfig, stage: str, tokenizer_sha256: str, seed: int,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The meta.json fields every training checkpoint carries (no times or hosts: the final
    checkpoint must be byte-identical across identical runs)."""
    return {"stage": stage, "model_config": model_config.to_dict(), "stage_config": config_to_dict(cfg),
            "tokenizer_sha256": tokenizer_sha256, "seed": seed, **(extra or {})}


def publish_checkpoint(source: Path, out: Path) -> None:
    """Copy the run's last checkpoint to the stage output, verified before and after: a
    byte-identical copy for identical runs, replaced whole or not at all."""
    ckpt.verify_checkpoint(source)
    with atomic_dir(out) as tmp:
        for f in sorted(source.iterdir()):
            shutil.copyfile(f, tmp / f.name)
    ckpt.verify_checkpoint(out)


def stage_metrics(result: TrainResult, model: GPT) -> dict[str, Any]:
    """The stage's metrics JSON: results only (final bits per byte, horizon, size), the same for
    equal runs, so `dvc metrics diff` of two runs shows what changed in what they learned. NaN (a
    figure with nothing to measure) becomes null."""
    metrics = {
        "val_bpb": result.final_eval.get("val_bpb"), "unigram_bpb": result.final_eval.get("unigram_bpb"),
        "steps": result.step, "tokens": result.tokens, "params": model.num_params(),
    }
    return nan_to_null(metrics)


def stage_runinfo(result: TrainResult, rt: Runtime, *, started_s: float,
                  epochs: dict[str, Any] | None = None, setup: dict[str, Any] | None = None) -> dict[str, Any]:
    """The stage's run facts, kept apart from its metrics: throughput, compute, device, the commit,
    where it resumed, the samples it wrote, the epochs over each mixture component
    (lockstep.data.budget.epochs_facts), and `setup` (embedding, objective and loss targets: what the
    report card's header and charts name). They differ between equal runs on other hosts or
    loads; the report card shows them and DVC does not diff them."""
    info = {
        "flops": result.flops, "tok_per_s": result.tok_per_s, "mfu": result.mfu, "train_time_s": result.train_time_s,
        "stage_wall_time_s": time.perf_counter() - started_s, "peak_flops": result.peak, "device": rt.describe(),
        "resumed_from_step": result.resumed_from, "samples": result.samples,
        "epochs": epochs, "setup": setup,
    }
    return nan_to_null(info)


def stage_setup(gcfg: GPTConfig, cfg: TrainConfig) -> dict[str, Any]:
    """How the stage trained, for the report card: the embedding, the objective, and which targets
    its losses and val bpb count (`loss`: all, or assistant tokens only), which its charts name."""
    setup: dict[str, Any] = {"embedding": gcfg.embedding, "objective": cfg.objective, "loss": cfg.loss}
    if cfg.objective == "prefix_smooth":
        setup["prefix_weight"] = cfg.prefix_weight
    return setup


def token_structure(tok: Tokenizer, embedding: str) -> tuple[np.ndarray, np.ndarray]:
    """(parents, last_bytes) per id, as GPT.set_token_structure reads them, for a `model.embedding`
    that needs a token structure: the one its class `needs`, as the tokenizer provides it. A
    tokenizer that does not provide it is a ConfigError saying why, which tokenizer kinds and
    options do, and which embeddings this tokenizer can feed instead."""
    need = EMBEDDINGS[embedding].needs
    assert need is not None, f"model.embedding={embedding} reads no token structure"
    missing = tok.missing_structure(need)
    if missing is not None:
        # The embeddings this tokenizer can feed, those that read a structure first, flat last.
        fits = sorted((name for name, cls in EMBEDDINGS.items()
                       if name != embedding and (cls.needs is None or tok.missing_structure(cls.needs) is None)),
                      key=lambda name: EMBEDDINGS[name].needs is None)
        instead = ", ".join(fits[:-1]) + f" or {fits[-1]}" if len(fits) > 1 else fits[0]
        raise ConfigError(f"model.embedding={embedding}: needs the tokenizer's {TOKEN_STRUCTURES[need]}: {missing}; "
                          f"or use model.embedding: {instead}")
    return tok.token_structure(need)


def build_objective(cfg: TrainConfig, tok: Tokenizer, stage: str, device: torch.device) -> objectives.Objective:
    """The stage's loss function (lockstep.train.objectives.build); ConfigError naming
    `<stage>.objective` when the objective needs a prefix tree the tokenizer does not have."""
    try:
        return objectives.build(cfg, tok, device=device)
    except NoPrefixTreeError as e:
        raise ConfigError(f"{stage}.objective={cfg.objective}: {e}") from None


def run_training_stage(stage: str, *, cfg: TrainConfig, paths: TrainStagePaths, rt: Runtime, seed: int,
                       data_seed: int, runtime_config: RuntimeConfig,
                       code_revision: str,  # noqa: F811 - shadows the stages' re-export above, on purpose
                       started_s: float, model_params: ModelParams | None = None) -> dict[str, Any] | None:
    """Run the training stage `stage` (`cfg` is its params section) end to end and return its
    metrics on rank 0 (None on the other ranks). `seed` draws the initialisation and the batches;
    `data_seed` the validation windows, the same for every training seed. A fresh model is built
    from `model_params` when `paths.init` is None (pretrain); otherwise the model is the init
    checkpoint's, refused if it was trained with another tokenizer. `code_revision` names the run
    folder and goes into the checkpoints; `started_s` (time.perf_counter) is when the stage
    began, for its wall time.

    Resumes from the run folder's latest checkpoint; Ctrl-C raises KeyboardInterrupt carrying
    the line that says where a rerun resumes. Only rank 0 writes outputs, holding the run folder's
    lock from the first write to the last (lockstep.train.resume.hold_run_dir): a second process on the
    same run raises RunFolderInUseError before it writes anything."""
    log = logging.getLogger(f"lockstep.{stage}")
    if (paths.init is None) == (model_params is None):
        raise ValueError("pass model_params for a fresh model or paths.init for a checkpoint to start from, not both")
    tok = load_tokenizer(paths.tokenizer)
    init_identity = None
    if paths.init is None:
        assert model_params is not None
        gcfg = model_params.gpt_config(tok.get_vocab_size())
        structure = token_structure(tok, gcfg.embedding) if EMBEDDINGS[gcfg.embedding].needs else None
        model = GPT.build(gcfg, rt.device, seed=seed, token_structure=structure)
    else:
        model, _ = ckpt.load_model(paths.init, rt.device, tokenizer_sha256=tok.sha256)
        gcfg = model.config
        init_identity = sha256_file(paths.init / ckpt.MANIFEST_FILE)
    model.use_kernels(rt.kernels)
    if gcfg.vocab_size != tok.get_vocab_size():
        raise ConfigError(
            f"model vocab {gcfg.vocab_size} != tokenizer vocab {tok.get_vocab_size()}; re-run the earlier stages"
        )

    seq_len = gcfg.sequence_len
    train_data, train_ids = build_mixture(paths.cache, cfg, split="train", seq_len=seq_len, device=rt.device, tok=tok,
                                          stage=stage)
    total_steps, _ = horizon_steps(cfg, flops_per_token=model.flops_per_token(),
                                   num_params=model.num_params(exclude_embedding=True))
    epochs = stage_epochs(stage, cfg, train_data, total_steps=total_steps, seq_len=seq_len)
    val_data, _ = build_mixture(paths.cache, cfg, split="val", seq_len=seq_len, device=rt.device, tok=tok, stage=stage)
    token_bytes = torch.from_numpy(tok.token_bytes().astype("int64"))
    loss = build_objective(cfg, tok, stage, rt.device)

    identity = {"seed": seed, "data_seed": data_seed, "runtime": runtime_config.identity(), "model": gcfg.to_dict(),
                stage: config_to_dict(cfg), "tokenizer_sha256": tok.sha256, "caches": train_ids, "init": init_identity,
                "code": code_revision}
    run_dir = paths.runs / f"{stage}-{run_key(stage, identity)}"
    meta = stage_meta(model_config=gcfg, cfg=cfg, stage=stage, tokenizer_sha256=tok.sha256, seed=seed,
                      extra={"caches": train_ids, "init_manifest_sha256": init_identity, "runtime": rt.settings(),
                             "code_revision": code_revision})
    log.info("run folder %s", run_dir)
    # A full disk or file size limit ends in one line: while training (checkpoints), and while publishing.
    training_room = no_room_is(NoRoomError, doing=f"train {stage} in {run_dir}", folder=paths.runs,
                               outcome="the run keeps its last complete checkpoint, if any, and nothing was published",
                               rerun="run the stage again: it resumes from that checkpoint")
    with resume.hold_run_dir(run_dir, rt), training_room:
        series = SeriesWriter(paths.plots, SERIES_COLUMNS, flush_every_s=FLUSH_EVERY_S) if rt.is_main else None
        live = LiveMetrics(paths.live) if rt.is_main and paths.live is not None else None
        if rt.is_main:
            # Parity artifact: the first micro-batch exactly as step 0 draws it (data order is stateless).
            first = train_data.get_batch(B=cfg.device_batch_rows, generator=batch_generator(seed, 0, 0))
            dump_first_batch(paths.plots / FIRST_BATCH_FILE, first[0], first[1], first[2] if len(first) > 2 else None,
                             rows=train_data.last_rows, meta={"stage": stage, "step": 0, "micro_batch": 0})
        try:
            trainer = Trainer(model, cfg, rt, data=train_data, seed=seed, loss=loss,
                              validation=Validation(val_data, token_bytes, seed=data_seed),
                              samples=Samples(sample_prompts(stage, tok), tok.decode),
                              on_step=each(series.add if series else None, live.add if live else None),
                              params_section=stage)
            result = trainer.fit(run_dir, meta)
        except KeyboardInterrupt:
            raise KeyboardInterrupt(resume_note(stage, run_dir)) from None
        metrics = None
        if rt.is_main:
            assert series is not None
            with no_room_is(NoRoomError, doing=f"publish {paths.out}", folder=paths.out.parent,
                            outcome=f"no output was half written, and the finished run stays in {run_dir}",
                            rerun="run the stage again: it publishes that run without training"):
                publish_checkpoint(result.checkpoint, paths.out)
                series.write()
                metrics = stage_metrics(result, model)
                write_runinfo(paths.runinfo, stage_runinfo(result, rt, started_s=started_s,
                                                           epochs=epochs_facts(epochs, cfg.max_epochs),
                                                           setup=stage_setup(gcfg, cfg)), device=rt.device)
                write_json_atomic(paths.metrics, metrics)
            log.info("done: val bpb %.4f (unigram %.4f), %d steps, %s", metrics["val_bpb"] or float("nan"),
                     metrics["unigram_bpb"] or float("nan"), result.step, paths.out)
        barrier(rt)
    return metrics
