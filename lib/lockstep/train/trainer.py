"""The shared training loop for pretrain, midtrain and SFT, as a Trainer with named steps
(`step`, `evaluate`, `sample`, `state_dict`/`load_state_dict`, `fit`), and the pieces only it
uses: its config, horizon, LR schedule, gradient accumulation, clipping, the stop on NaN/inf and
val bits per byte (lockstep.train.bpb). It does not know where batches come from (any object with
`get_batch(*, B, generator)`), how text is encoded or which objective it minimises (a loss
function from lockstep.train.objectives.build); saving and resuming the run folder over ranks is
lockstep.train.resume; finding caches, building the model and publishing a stage's outputs is
lockstep.pipeline.train."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn

from lockstep.core import fastpath
from lockstep.core.config import ConfigError, FieldError, check_range
from lockstep.core.runtime import Runtime, measure_matmul_peak_flops, peak_flops
from lockstep.core.seeds import derived_generator
from lockstep.model.gpt import GPT, IGNORE_INDEX, GPTConfig
from lockstep.train import resume
from lockstep.train.bpb import measure_bpb
from lockstep.train.objectives import Objective, cross_entropy_objective
from lockstep.train.optim import (
    OptimConfig,
    build_optimizers,
    compiled_step,
    global_grad_norm,
    muon_momentum,
    reduce_grads,
    set_lr,
)

log = logging.getLogger("lockstep.train")
_ETA_STEPS = 8  # the progress line's ETA is the mean of this many recent step times
# The per-step series `train` reports, by file: columns besides `step`, results only.
SERIES_COLUMNS: dict[str, tuple[str, ...]] = {"train": ("train_loss", "lr_mult"), "val": ("val_bpb",)}
# (x, y) -> the objective summed over a micro-batch's targets
LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# One rank's micro-batches of a step: (inputs x, targets y) pairs, each (B, T), on the device
MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ModelParams:
    """The `model` params section: one depth dial plus a few shape knobs."""

    depth: int = 4  # layers; width n_embd = 64 * depth
    sequence_len: int = 256  # context length in tokens
    head_dim: int = 64  # channels per attention head
    n_kv_head: int = 0  # key/value heads; 0 = as many as query heads
    softcap: float = 15.0  # logit soft cap; 0 disables
    rope_theta: float = 10000.0
    # flat | structured | tuple | hierarchical: how ids become vectors (lockstep.model.gpt.GPT.embed);
    # the non-flat modes read the tokenizer's prefix tree, hierarchical an lz78 tokenizer read
    # from a `compressed` dictionary
    embedding: str = "flat"
    # lockstep | nanochat: the distributions init_weights draws from (lockstep.model.gpt.INITS)
    init: str = "lockstep"

    def __post_init__(self) -> None:
        if self.n_kv_head < 0:
            raise FieldError("n_kv_head", self.n_kv_head, "must be >= 0 (0 = as many as query heads)")
        # The shape rules (positive sizes, head_dim dividing the width, ...) checked when the section
        # is read, so their FieldError comes out as `model.<key>`; the vocabulary does not matter here.
        self.gpt_config(vocab_size=1)

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        return GPTConfig.from_depth(self.depth, vocab_size, self.sequence_len, self.head_dim,
                                    n_kv_head=self.n_kv_head or None, softcap=self.softcap, rope_theta=self.rope_theta,
                                    embedding=self.embedding, init=self.init)


@dataclass(frozen=True)
class LRSchedule:
    """The learning-rate schedule's fields and their checks, in every section that trains (the
    training stages' TrainConfig and `rl`'s RLConfig): warmup, constant, then a linear warmdown
    (lr_multiplier)."""

    warmup_steps: int = 0  # steps rising linearly from 1/warmup_steps of the peak LR
    warmdown_frac: float = 0.4  # last fraction of steps decays linearly ...
    final_lr_frac: float = 0.0  # ... to this fraction of the peak LR

    def __post_init__(self) -> None:
        check_range("warmup_steps", self.warmup_steps, ge=0)
        check_range(
            "warmdown_frac", self.warmdown_frac, ge=0, le=1, why="the fraction of steps that decay the learning rate"
        )
        check_range(
            "final_lr_frac", self.final_lr_frac, ge=0, le=1, why="the end of the decay, as a fraction of the peak"
        )

    def lr_multiplier(self, step: int, total_steps: int) -> float:
        """The peak-LR multiplier of step `step` (0-based) of `total_steps`."""
        return lr_multiplier(step, total_steps, warmup_steps=self.warmup_steps, warmdown_frac=self.warmdown_frac,
                             final_lr_frac=self.final_lr_frac)


@dataclass(frozen=True)
class TrainConfig(LRSchedule):
    """A training stage's params section: `pretrain`'s, and the base of MidtrainConfig and
    SFTConfig, which differ only in their default `max_epochs`. The schedule's fields come from
    LRSchedule."""

    mixture: dict[str, float] = field(default_factory=dict)  # cache name -> sampling weight
    batch_tokens: int = 8192  # tokens per optimizer step, all ranks and micro-batches together
    device_batch_rows: int = 8  # sequences per forward pass per rank
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Horizon, first that is set wins: explicit steps, a FLOP budget, a tokens:params ratio.
    num_steps: int = 0
    target_flops: float = 0.0
    tokens_params_ratio: float = 0.0  # 20 = Chinchilla-optimal
    loss: Literal["all", "assistant"] = "all"  # SFT trains on assistant tokens only
    # ce: cross-entropy. prefix_smooth: the target also puts prefix_weight on each ancestor of
    # the true token in the vocabulary's prefix tree (lockstep.train.objectives); validation bpb is
    # plain cross-entropy either way, so runs with either objective compare directly.
    objective: Literal["ce", "prefix_smooth"] = "ce"
    prefix_weight: float = 0.1
    eval_every_steps: int = 100  # val bpb; 0 = only at the end
    eval_tokens: int = 65536  # val tokens per evaluation (all ranks)
    sample_every_steps: int = 0  # greedy samples on rank 0; 0 = only at the end
    sample_tokens: int = 48  # new tokens per sample
    checkpoint_every_steps: int = 100  # intermediate checkpoints under the run folder; 0 = only the last
    keep_last: int = 2  # intermediate checkpoints kept (>= 2)
    peak_flops: float = 0.0  # FLOP/s per device for MFU; 0 = datasheet (CUDA) or measured matmul peak
    # Consecutive steps with a NaN/inf loss or gradient norm whose update is skipped before the
    # run stops with NonFiniteError; 0 = stop at the first.
    nonfinite_patience: int = 0
    # The most times the stage may read any mixture component's train data (lockstep.data.budget),
    # checked before the first step; null = no limit. One pass is the default for pretraining:
    # repeated tokens are worth less than fresh ones (Muennighoff et al. 2023, "Scaling
    # Data-Constrained Language Models": up to ~4 epochs cost little, beyond that value decays).
    max_epochs: float | None = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("batch_tokens", self.batch_tokens, ge=1, why="tokens per optimizer step")
        check_range("device_batch_rows", self.device_batch_rows, ge=1, why="sequences per forward pass per rank")
        for name, w in self.mixture.items():
            check_range(f"mixture.{name}", w, gt=0, why="a sampling weight (drop the entry to exclude the cache)")
        for name in ("num_steps", "eval_every_steps", "sample_every_steps", "sample_tokens",
                     "checkpoint_every_steps", "nonfinite_patience"):
            check_range(name, getattr(self, name), ge=0)
        for name in ("target_flops", "tokens_params_ratio"):
            check_range(name, getattr(self, name), ge=0, why="0 leaves this horizon unset")
        check_range(
            "peak_flops", self.peak_flops, ge=0, why="FLOP/s per device; 0 takes the datasheet or a measured peak"
        )
        check_range("eval_tokens", self.eval_tokens, ge=1, why="val tokens per evaluation; the final one always runs")
        check_range(
            "prefix_weight", self.prefix_weight, ge=0, why="weight of each ancestor in the target (0 = cross-entropy)"
        )
        check_range("keep_last", self.keep_last, ge=2, why="so a crash mid-save still leaves a complete checkpoint")
        if self.max_epochs is not None:
            check_range(
                "max_epochs", self.max_epochs, gt=0, why="passes over a component's train data; null = no limit"
            )


@dataclass(frozen=True)
class MidtrainConfig(TrainConfig):
    """The `midtrain` section. Its chat and math sets are small next to the pretraining text it
    mixes in, and midtraining exists to teach their formats, so two passes are allowed by default;
    more would start memorising the few thousand conversations SFT still has to generalise from."""

    max_epochs: float | None = 2.0


@dataclass(frozen=True)
class SFTConfig(TrainConfig):
    """The `sft` section. Small instruction sets are normally trained for a few epochs (Alpaca 3,
    LIMA 15, InstructGPT 16, whose paper notes validation loss rising after the first); 4 allows
    the usual practice and stops a horizon that silently loops a set dozens of times."""

    max_epochs: float | None = 4.0


# Each training stage's params section and the dataclass it builds into.
STAGE_CONFIGS: dict[str, type[TrainConfig]] = {"pretrain": TrainConfig, "midtrain": MidtrainConfig, "sft": SFTConfig}


class NonFiniteError(RuntimeError):
    """Training went NaN or inf: the loss or gradient norm for more consecutive steps than the
    patience allows, or the weights about to be checkpointed. Raised before the bad update or
    checkpoint is written, so nothing of it is saved or published."""


class NonFiniteGuard:
    """Watches each step's loss and gradient norm (host floats). A non-finite step's update is to
    be skipped while the consecutive count stays within `patience`; the next one raises
    NonFiniteError. `keys` prefixes the config keys the error names (`pretrain.`); `announce`:
    whether this process logs skipped steps (rank 0 only)."""

    def __init__(self, patience: int, *, keys: str = "", announce: bool = True) -> None:
        self.patience, self.keys, self.announce, self.streak = patience, keys, announce, 0

    def hint(self) -> str:
        k = self.keys
        return (f"lower the learning rates ({k}optim.*_lr), keep {k}optim.grad_clip > 0, or raise "
                f"{k}nonfinite_patience to skip isolated bad steps")

    def check(self, step: int, total_steps: int, loss: float, grad_norm: float) -> bool:
        """True: apply this step's update. False: skip it (logged). Raises past the patience."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.streak = 0
            return True
        self.streak += 1
        what = f"step {step}/{total_steps}: loss {loss:.4g}, gradient norm {grad_norm:.4g}"
        if self.streak > self.patience:
            raise NonFiniteError(
                f"{what}; {self.streak} non-finite step(s) in a row, more than {self.keys}nonfinite_patience="
                f"{self.patience}: stopped before applying the update, so no checkpoint holds it; {self.hint()}"
            )
        if self.announce:
            log.warning("%s: update skipped (%d of %d tolerated in a row)", what, self.streak, self.patience)
        return False

    def check_weights(self, model: nn.Module, step: int) -> None:
        """Raise NonFiniteError if any weight is NaN or inf (before a checkpoint is written). One
        host transfer for all parameters; called only at checkpoints."""
        named = list(model.named_parameters())
        finite = torch.stack([torch.isfinite(p).all() for _, p in named]).tolist()
        bad = [name for (name, _), ok in zip(named, finite, strict=True) if not ok]
        if bad:
            raise NonFiniteError(
                f"step {step}: weights {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} are not finite "
                f"after the update; no checkpoint written; {self.hint()}"
            )


class BatchSource(Protocol):
    def get_batch(self, *, B: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]: ...


def horizon_steps(cfg: TrainConfig, *, flops_per_token: int, num_params: int) -> tuple[int, str]:
    """Optimizer steps to run and why: explicit steps, else a FLOP budget, else a tokens:params
    ratio (in that order)."""
    if cfg.num_steps > 0:
        return cfg.num_steps, f"num_steps={cfg.num_steps}"
    if cfg.target_flops > 0:
        steps = max(1, round(cfg.target_flops / (flops_per_token * cfg.batch_tokens)))
        return steps, f"target_flops={cfg.target_flops:.3g} at {flops_per_token} FLOPs/token"
    if cfg.tokens_params_ratio > 0:
        steps = max(1, round(cfg.tokens_params_ratio * num_params / cfg.batch_tokens))
        return steps, f"tokens_params_ratio={cfg.tokens_params_ratio} x {num_params} params"
    raise ConfigError("no training horizon: set one of num_steps, target_flops or tokens_params_ratio (> 0)")


def horizon_key(cfg: TrainConfig) -> str:
    """The params key that sets the horizon, in horizon_steps' order."""
    for key in ("num_steps", "target_flops", "tokens_params_ratio"):
        if getattr(cfg, key) > 0:
            return key
    return "num_steps"


def lr_multiplier(
    step: int, total_steps: int, *, warmup_steps: int, warmdown_frac: float, final_lr_frac: float
) -> float:
    """Warmup (linear from 1/warmup), constant, then linear warmdown to `final_lr_frac`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    warmdown_steps = round(warmdown_frac * total_steps)
    start = total_steps - warmdown_steps
    if step < start or warmdown_steps == 0:
        return 1.0
    progress = (total_steps - step) / warmdown_steps  # 1 at the start of warmdown -> 1/n at the end
    return progress + (1 - progress) * final_lr_frac


def grad_accum_steps(cfg: TrainConfig, *, seq_len: int, world_size: int) -> int:
    per_pass = world_size * cfg.device_batch_rows * seq_len
    if cfg.batch_tokens % per_pass:
        raise ConfigError(f"batch_tokens={cfg.batch_tokens} must divide by world*rows*seq_len={world_size}*"
                          f"{cfg.device_batch_rows}*{seq_len}={per_pass}; change batch_tokens or device_batch_rows")
    return cfg.batch_tokens // per_pass


def batch_generator(seed: int, step: int, micro: int) -> torch.Generator:
    """The generator for one micro-batch, from (seed, step, global micro-batch index) alone: data
    order needs no saved state, a resumed run draws exactly the batches an uninterrupted one
    would, and the same global batch splits over any number of ranks."""
    return derived_generator("lockstep-batch", seed, step, micro)




def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Batch tensor `t` on `device`, its copy queued without waiting for the device. On CUDA a
    host tensor is pinned first: a copy from pageable memory can wait for the work queued on the
    stream before it (the CUDA runtime's API synchronization notes: to stage pageable memory the
    driver may synchronize with the stream), which in the loop is the previous step's optimizer
    update; one from pinned memory with non_blocking=True is queued behind that work instead.
    Otherwise `t.to(device)`: `t` itself on the CPU, where pinning needs an accelerator, and for a
    batch a loader already put on the device (lockstep.data.loaders pins and copies its own)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _targets(batch: Sequence[torch.Tensor], loss: str) -> torch.Tensor:
    if loss == "assistant":
        if len(batch) < 3:
            raise ValueError("loss='assistant' needs batches of (x, y, y_masked): use SFT caches in the mixture")
        return batch[2]
    return batch[1]


def validation_bpb(model: nn.Module, data: BatchSource, token_bytes: torch.Tensor, rt: Runtime, *, rows: int,
                   seq_len: int, eval_tokens: int, seed: int, loss: str = "all") -> dict[str, float]:
    """Validation bits per byte (lockstep.train.bpb.measure_bpb, the measure eval uses too) on the
    targets the stage trains on (`loss`): the same windows every call (fixed generators), the
    batches split over ranks. Also `unigram_bpb`, the floor of a context-free model on the same
    targets, and `val_bytes`."""
    was_training = model.training
    model.eval()
    n_batches = max(1, eval_tokens // (rows * seq_len))

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for j in range(rt.rank, n_batches, rt.world_size):
            batch = data.get_batch(B=rows, generator=batch_generator(seed, -1, j))
            yield batch[0], _targets(batch, loss)

    sums = measure_bpb(model, batches(), token_bytes, device=rt.device, autocast=rt.autocast)
    model.train(was_training)
    return {"val_bpb": sums.bpb, "unigram_bpb": sums.unigram_bpb, "val_bytes": float(sums.bytes)}


@torch.no_grad()
def greedy_sample(model: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int, rt: Runtime) -> list[int]:
    """Greedy continuation by repeated full forwards (no KV cache): slow, simple, exact."""
    seq_len = model.config.sequence_len
    ids = list(prompt_ids)
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-seq_len:]], dtype=torch.long, device=rt.device)  # (1, T)
        with rt.autocast():
            logits = model(window)  # (1, T, V)
        ids.append(int(logits[0, -1].argmax()))
    model.train(was_training)
    return ids[len(prompt_ids):]


@dataclass
class TrainResult:
    step: int  # steps completed in total (including resumed ones)
    total_steps: int
    losses: list[tuple[int, float]]  # (step, train loss) for steps run in this process, skipped ones left out
    final_eval: dict[str, float]
    samples: list[str]
    checkpoint: Path  # the last checkpoint in the run folder
    resumed_from: int  # 0 when started fresh
    tokens: int  # tokens trained on in total
    flops: float  # training FLOPs in total (flops_per_token x tokens)
    tok_per_s: float  # timed tokens / their steps' wall time (all ranks together; warm-up step left out)
    mfu: float
    train_time_s: float  # wall time spent in steps, all sessions of the run
    peak: dict[str, Any]


_PEAK_TOO_LOW_WHY = {
    "measured": " (other work held the cores while it was measured; the stage's end measures it again)",
    "declared": " (raise the peak_flops setting to this device's real peak, or set it to 0 to measure it)",
}


def _fmt_count(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def _fmt_eta(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f}h"
    if s >= 60:
        return f"{s / 60:.0f}m"
    return f"{s:.0f}s"


def eta_text(step_times: Sequence[float], steps_left: int) -> str:
    """The progress line's ETA: the mean of the last few step times (`step_times`, not empty)
    x the steps left, so that it follows a machine that got busy (or quiet) mid-run."""
    recent = step_times[-_ETA_STEPS:]
    return _fmt_eta(sum(recent) / len(recent) * steps_left)


def progress_line(step: int, total_steps: int, fields: Sequence[str], *, eta: str) -> str:
    """The one progress line of a training loop (Trainer's, lockstep.rl.trainer.RLTrainer's):
    `step 3/10 | <fields> | eta 2m`, its fields fixed by the loop."""
    return " | ".join([f"step {step}/{total_steps}", *fields, f"eta {eta}"])



@dataclass(frozen=True)
class Validation:
    """What `Trainer.evaluate` measures on: val batches, bytes per token id (lockstep.train.bpb), and the
    seed that picks the windows (the stages pass the data seed, so that runs with different
    training seeds are measured on the same text; None: the training seed)."""

    data: BatchSource
    token_bytes: torch.Tensor
    seed: int | None = None


@dataclass(frozen=True)
class Samples:
    """Prompts `Trainer.sample` continues greedily on rank 0, and how their ids become text."""

    prompts: Sequence[Sequence[int]]
    decode: Callable[[list[int]], str]


@dataclass(frozen=True)
class StepStats:
    """What one `Trainer.step` did."""

    step: int  # steps completed after it
    train_loss: float  # loss per counted target of the global batch
    lr_mult: float
    applied: bool  # False: the loss or gradient norm was NaN/inf and the update skipped
    dt_s: float


class Trainer:
    """Trains `model` (already on rt.device, fp32 master weights) in place with `cfg`'s horizon,
    schedule and optimizers. `step()` runs one optimizer step, `evaluate()` measures val bits per
    byte, `sample()` writes greedy samples, `state_dict()`/`load_state_dict()` hold this rank's
    whole state, and `fit(run_dir, meta)` runs to the horizon with checkpoints in `run_dir`,
    resuming from its latest complete one. Only rank 0 logs and writes.

    `loss` is the objective (lockstep.train.objectives.build; by default the model's cross-entropy).
    A step whose loss or gradient norm is NaN or inf is not applied; more of them in a row than
    `cfg.nonfinite_patience` raise NonFiniteError, as do non-finite weights at a checkpoint.
    `params_section` names where `cfg` came from (`pretrain`), for the keys that error names.
    `shard_optimizer`: optimizer state sharded over ranks (ShardedAdamW, ShardedMuon) or
    replicated (AdamW, Muon); None, the default, shards under torch.distributed. Muon steps
    through torch.compile where lockstep.train.optim.compiled_step says so (CUDA, compile and kernels on).

    `on_step` gets each result row on rank 0, as SERIES_COLUMNS names them: `{step, train_loss,
    lr_mult}` after an applied step, `{step, val_bpb}` after an evaluation. A resumed run replays
    the rows up to its checkpoint first, so the callback sees the whole run. Timings stay out of
    the rows (they go to the log and the TrainResult): the series are equal for equal runs."""

    _prefetched: tuple[int, MicroBatches] | None = None  # (step, its batches), drawn during the step before

    def __init__(self, model: GPT, cfg: TrainConfig, rt: Runtime, *, data: BatchSource, seed: int,
                 loss: Objective | None = None, validation: Validation | None = None, samples: Samples | None = None,
                 on_step: Callable[[dict[str, float]], None] | None = None, params_section: str = "",
                 shard_optimizer: bool | None = None) -> None:
        # Training draws from its own generators; the global one is seeded anyway, so that its state
        # saved in every checkpoint is a function of the seed, not of what the process did before.
        torch.manual_seed(seed)
        self.model, self.cfg, self.rt, self.data, self.seed = model, cfg, rt, data, seed
        self.validation, self.samples, self.on_step = validation, samples, on_step
        self.seq_len = model.config.sequence_len
        self.accum = grad_accum_steps(cfg, seq_len=self.seq_len, world_size=rt.world_size)
        self.flops_per_token = model.flops_per_token()
        self.num_params = model.num_params(exclude_embedding=True)
        self.total_steps, self.horizon_why = horizon_steps(cfg, flops_per_token=self.flops_per_token,
                                                           num_params=self.num_params)
        self.optimizers = build_optimizers(model, cfg.optim, model_dim=model.config.n_embd, rank=rt.rank,
                                           world_size=rt.world_size, ns_dtype=rt.dtype, sharded=shard_optimizer,
                                           compiled=compiled_step(rt))
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.guard = NonFiniteGuard(cfg.nonfinite_patience, keys=f"{params_section}." if params_section else "",
                                    announce=rt.is_main)
        self.peak, self.peak_why = peak_flops(rt, declared=cfg.peak_flops)
        self.mfu_withheld = False  # a step ran above the peak: the peak is wrong, MFU is not shown
        self._eager_loss, self._compiled_loss = self._loss_sum(loss)
        model.train()
        self.step_count = 0  # optimizer steps completed, resumed ones included
        self.start_step = 0  # where this process started (a resumed checkpoint's step)
        self.train_time_s = 0.0  # wall time in steps, all sessions of the run
        self.series: list[dict[str, float]] = []  # results only: what `on_step` sees and the plots hold
        self.rates: list[tuple[int, float]] = []  # (step, tokens/s): timings stay out of the series
        self.losses: list[tuple[int, float]] = []  # (step, loss) of the updates applied in this process
        self.dts: list[float] = []  # this process's step times, the warm-up step left out
        self.last_eval: dict[str, float] = {}

    def _loss_sum(self, loss: Objective | None) -> tuple[LossSum, LossSum | None]:
        """The objective summed over a micro-batch's targets, eager, and the same through
        torch.compile when the runtime compiles (else None)."""
        if loss is None:
            if self.cfg.objective != "ce":
                raise ValueError(f"objective {self.cfg.objective} needs the vocabulary's ancestor table: pass "
                                 "loss=lockstep.train.objectives.build(cfg, tokenizer)")
            loss = cross_entropy_objective
        model = self.model

        def loss_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return loss(model, x, y, "sum")

        return loss_sum, (torch.compile(loss_sum) if self.rt.compile else None)

    def step(self) -> StepStats:
        """One optimizer step: the scheduled LR, the global batch of this step (its micro-batches
        split over ranks), gradients, clipping and the update, unless the loss or gradient norm
        is not finite (then the update is skipped, or NonFiniteError raised past the patience)."""
        cfg, rt, step = self.cfg, self.rt, self.step_count
        # One host sync per step (in _gradients), which the NaN guard needs before any update; the
        # previous update's queued work is waited for inside it: in steady state a step's time is its own.
        t0 = time.perf_counter()
        mult = cfg.lr_multiplier(step, self.total_steps)
        set_lr(self.optimizers, mult, momentum=muon_momentum(step, cfg.optim))
        train_loss, norm = self._gradients(step)
        applied = self.guard.check(step + 1, self.total_steps, train_loss, norm)
        if step + 1 < self.total_steps:  # applied or skipped, step + 1 runs next
            # Right after the sync the device's queue is empty: drawing the next step's batches
            # waits for nothing (a source's own blocking copy included); their copies go ahead of the update.
            self._prefetched = (step + 1, self._device_batches(step + 1))
        if applied:
            for opt in self.optimizers:
                opt.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        self.step_count = step = step + 1
        self.train_time_s += dt
        if applied:
            self.losses.append((step, train_loss))
            # The first step of a process carries compile and allocator warm-up: left out of throughput.
            if len(self.losses) > 1 or self.total_steps - self.start_step == 1:
                self.dts.append(dt)
            if rt.is_main:
                self._report(step, train_loss, mult, dt)
        return StepStats(step=step, train_loss=train_loss, lr_mult=mult, applied=applied, dt_s=dt)

    def _gradients(self, step: int) -> tuple[float, float]:
        """Accumulate the gradients of step `step`'s global batch; (loss per target, gradient norm)
        on the host, the same on every rank."""
        cfg, rt = self.cfg, self.rt
        micro = self._batches(step)
        # Normalise by the target count of the whole global batch, so an SFT batch with few
        # assistant tokens weighs each token the same, and 1 or N ranks give the same gradient.
        n_targets = sum((y != IGNORE_INDEX).sum() for _, y in micro).to(torch.float64)
        if rt.distributed:
            dist.all_reduce(n_targets)
        # kept on the device (no sync); a count is exact in fp32 up to 2^24 targets per step
        denom = n_targets.clamp(min=1.0).float()
        loss_sum = self._backward(micro, denom)
        reduce_grads(self.optimizers, self.params)
        if rt.distributed:
            dist.all_reduce(loss_sum)
        grad_norm = global_grad_norm(self.params, cfg.optim.grad_clip, optimizers=self.optimizers)
        # Loss and gradient norm reach the host in one transfer, the one the loop always made to
        # log the loss, now before the optimizer step so a bad step is never applied. After the
        # all-reduces every rank holds the same loss and gradient norm, so all ranks decide alike.
        loss_total, norm, count = torch.stack([loss_sum, grad_norm.to(loss_sum), denom.to(loss_sum)]).tolist()
        return loss_total / count, norm

    def _batches(self, step: int) -> MicroBatches:
        """This rank's micro-batches (x, y) of step `step` on the device: those drawn for it during
        the step before, else drawn now (a process's first step; the first after load_state_dict,
        when the batches drawn before were another step's)."""
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[0] == step:
            return prefetched[1]
        return self._device_batches(step)

    def _device_batches(self, step: int) -> MicroBatches:
        """Draw this rank's micro-batches (x, y) of step `step` (batch_generator: a pure function of
        the seed, the step and the global micro-batch index) and queue their copies to the device."""
        rt, rows = self.rt, self.cfg.device_batch_rows
        micro = []
        for i in range(self.accum):
            batch = self.data.get_batch(B=rows, generator=batch_generator(self.seed, step, rt.rank * self.accum + i))
            micro.append(
                (host_to_device(batch[0], rt.device), host_to_device(_targets(batch, self.cfg.loss), rt.device))
            )
        return micro

    def _backward(self, micro: MicroBatches, denom: torch.Tensor) -> torch.Tensor:
        """Accumulate this rank's gradients of `micro` ((x, y) pairs), each loss divided by `denom`;
        returns their summed loss (fp64, on the device). With runtime.compile, through the compiled
        loss while fastpath part "compiled_loss" is on its fast path. Any of that may fail: the
        forward's compile, or the backward's, which AOT autograd makes lazily at the first
        `.backward()`, after the eager part of the backward (the chunked head loss's, behind its
        graph break) has accumulated the head's gradients. The part then falls back, and `redo`
        clears the gradients and computes the step's again on the eager loss: batches are a pure
        function of (seed, step, micro), so the step equals a reference step. (On later steps
        `redo` is the reference path; its clearing finds no gradients, zero_grad having freed them.)"""
        if self._compiled_loss is None:
            return self._accumulate(micro, denom, self._eager_loss)
        compiled = self._compiled_loss

        def redo() -> torch.Tensor:
            for p in self.params:
                p.grad = None
            return self._accumulate(micro, denom, self._eager_loss)

        # Under torch.distributed the redo is local to the rank: _accumulate holds no collective
        # (the model is not wrapped in DDP; the target count was summed before it; reduce_grads
        # and the norm's all_reduce come after it), so a rank that redoes its step still meets
        # the other ranks' collectives in the same order, with gradients of the same step.
        return fastpath.call("compiled_loss", lambda: self._accumulate(micro, denom, compiled), redo)

    def _accumulate(self, micro: MicroBatches, denom: torch.Tensor, loss_sum_fn: LossSum) -> torch.Tensor:
        """Backward of each micro-batch's `loss_sum_fn` / `denom`; the losses' sum (fp64, on the device)."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.rt.device)
        for x, y in micro:
            with self.rt.autocast():
                loss = loss_sum_fn(x, y)
            (loss / denom).backward()
            loss_sum += loss.detach().double()
        return loss_sum

    def _report(self, step: int, train_loss: float, mult: float, dt: float) -> None:
        """Rank 0, after an applied step: the progress line, the series row and the throughput."""
        tok_s = self.cfg.batch_tokens / dt
        mfu = self.flops_per_token * tok_s / (self.peak * self.rt.world_size)
        lr_now = self.optimizers[-1].param_groups[0]["lr"]
        fields = [f"loss {train_loss:.4f}", f"lr {lr_now:.3g}", f"dt {dt * 1e3:.0f}ms", f"tok/s {_fmt_count(tok_s)}",
                  self._mfu_field(step, mfu)]
        log.info(
            "%s", progress_line(step, self.total_steps, fields, eta=eta_text(self.dts or [dt], self.total_steps - step))
        )
        self._record({"step": step, "train_loss": train_loss, "lr_mult": mult})
        self.rates.append((step, tok_s))

    def _mfu_field(self, step: int, mfu: float) -> str:
        """The progress line's MFU, or `mfu n/a` once a step has run above 100% of the peak: the
        peak is then wrong (measured while other work held the cores, or declared too low), and
        so is every figure divided by it. One warning says so."""
        if mfu > 1.0 and not self.mfu_withheld:
            self.mfu_withheld = True
            log.warning("MFU not shown from step %d: it ran at %.3g FLOP/s per device, above the %.3g FLOP/s peak "
                        "(%s) MFU divides by, so that peak is too low%s", step, mfu * self.peak, self.peak,
                        self.peak_why, _PEAK_TOO_LOW_WHY.get(self.peak_why.split(" ", 1)[0], ""))
        return "mfu n/a" if self.mfu_withheld else f"mfu {100 * mfu:.1f}%"

    def _record(self, row: dict[str, float]) -> None:
        self.series.append(row)
        if self.on_step:
            self.on_step(row)

    def evaluate(self) -> dict[str, float]:
        """Val bits per byte now (validation_bpb; every rank takes part), logged and recorded on
        rank 0; {} without `validation`."""
        v, cfg = self.validation, self.cfg
        if v is None:
            return {}
        r = validation_bpb(self.model, v.data, v.token_bytes, self.rt, rows=cfg.device_batch_rows, seq_len=self.seq_len,
                           eval_tokens=cfg.eval_tokens, seed=self.seed if v.seed is None else v.seed, loss=cfg.loss)
        if self.rt.is_main:
            log.info("step %d/%d | val bpb %.4f | unigram bpb %.4f", self.step_count, self.total_steps, r["val_bpb"],
                     r["unigram_bpb"])
            self._record({"step": self.step_count, "val_bpb": r["val_bpb"]})
        return r

    def sample(self) -> list[str]:
        """Greedy continuations of the sample prompts, logged (rank 0 only; [] elsewhere)."""
        if not (self.rt.is_main and self.samples and self.samples.prompts):
            return []
        out = []
        for prompt in self.samples.prompts:
            text = self.samples.decode(
                list(prompt) + greedy_sample(self.model, prompt, self.cfg.sample_tokens, self.rt)
            )
            log.info("sample: %r", text)
            out.append(text)
        return out

    def progress(self) -> dict[str, Any]:
        """The run's progress so far, as PROGRESS_FILE holds it: the series and throughput rows
        and the wall time in steps."""
        return {"step": self.step_count, "train_time_s": self.train_time_s, "series": self.series,
                "tok_per_s": self.rates}

    def state_dict(self) -> dict[str, Any]:
        """This rank's whole training state: the step, weights, its optimizers' state (sharded over
        ranks by default under torch.distributed), the global RNG and the progress. Like torch's
        state dicts it holds the live tensors: copy it to keep it past the next step."""
        return {"step": self.step_count, "model": self.model.state_dict(),
                "optimizers": [o.state_dict() for o in self.optimizers],
                "rng_states": {"torch_cpu": torch.get_rng_state()}, "progress": self.progress()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a `state_dict()` of a Trainer with the same model, config and rank)."""
        self.model.load_state_dict(state["model"])
        for opt, sd in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(sd)
        self._restore(state["step"], state["rng_states"], state["progress"])

    def _restore(self, step: int, rng_states: dict[str, torch.Tensor], progress: dict[str, Any]) -> None:
        self.step_count = self.start_step = step
        if "torch_cpu" in rng_states:
            torch.set_rng_state(rng_states["torch_cpu"])
        if progress:
            self.train_time_s = float(progress.get("train_time_s", 0.0))
            # Replay the series up to the checkpoint so per-step plots cover the whole run.
            self.series = [row for row in progress.get("series", []) if row["step"] <= step]
            self.rates = [(s, rate) for s, rate in progress.get("tok_per_s", []) if s <= step]

    def fit(self, run_dir: Path, meta: dict[str, Any], *, stop_at_step: int | None = None) -> TrainResult:
        """Train to the horizon, resuming from the latest complete checkpoint in `run_dir` if there
        is one, with evaluations, samples and checkpoints as `cfg` schedules them. `meta` (model
        config, stage config, tokenizer sha256, code revision, ...) goes into every checkpoint.
        `stop_at_step` ends early after that step, as a kill would (tests)."""
        if not meta.get("code_revision"):
            raise ValueError(
                "meta must carry the stage's code_revision (lockstep.core.codeid.code_revision of its entry module)"
            )
        run_dir, cfg, total = Path(run_dir), self.cfg, self.total_steps
        meta = {**meta, "total_steps": total}
        checkpoint = self._open(run_dir)
        while self.step_count < total:
            self.step()
            step = self.step_count
            last = step == total
            if cfg.eval_every_steps and step % cfg.eval_every_steps == 0 and not last:
                self.last_eval = self.evaluate()
            if cfg.sample_every_steps and step % cfg.sample_every_steps == 0 and not last:
                self.sample()
            if last or (cfg.checkpoint_every_steps and step % cfg.checkpoint_every_steps == 0):
                self.guard.check_weights(self.model, step)
                checkpoint = resume.save(self.model, self.optimizers, self.rt, run_dir, step, meta, cfg.keep_last,
                                         progress=self.progress())
            if stop_at_step is not None and step >= stop_at_step:
                break
        samples: list[str] = []
        if self.step_count == total:
            self.last_eval = self.evaluate()
            samples = self.sample()
        assert checkpoint is not None
        return self._result(checkpoint, samples)

    def _open(self, run_dir: Path) -> Path | None:
        """Prepare the run folder and resume from its latest checkpoint (collectives); log the
        plan; replay the resumed series to `on_step`. Returns the checkpoint resumed from."""
        rt, cfg = self.rt, self.cfg
        removed = resume.open_run_dir(run_dir, rt)
        if removed:
            log.info("removed %d incomplete checkpoint(s) in %s", len(removed), run_dir)
        found = resume.find(run_dir, rt)
        if found is not None:
            resume.load(found, self.model, self.optimizers, rt)
            self._restore(found.step, found.rng_states, found.progress)
            if rt.is_main:
                log.info("resuming from %s (step %d/%d)", found.path, found.step, self.total_steps)
        if rt.is_main:
            log.info("horizon %d steps (%s); %d micro-batches x %d rows x %d tokens x %d ranks = %d tokens/step",
                     self.total_steps, self.horizon_why, self.accum, cfg.device_batch_rows, self.seq_len, rt.world_size,
                     cfg.batch_tokens)
            log.info("MFU peak %.3g FLOP/s per device (%s); %d params, %d FLOPs/token", self.peak, self.peak_why,
                     self.num_params, self.flops_per_token)
            if self.on_step:
                for row in self.series:
                    self.on_step(row)
        return None if found is None else found.path

    def _result(self, checkpoint: Path, samples: list[str]) -> TrainResult:
        cfg, step = self.cfg, self.step_count
        tokens = step * cfg.batch_tokens
        if self.dts:
            tok_per_s = cfg.batch_tokens * len(self.dts) / sum(self.dts)
        else:  # nothing timed in this process (a finished run re-run): the same mean over the recorded steps
            recorded = [rate for _, rate in self.rates]
            tok_per_s = len(recorded) / sum(1 / rate for rate in recorded) if recorded else float("nan")
        if self.peak_why.startswith("measured"):
            # A machine busy when the stage started under-measures its peak (MFU read 0.90 for a
            # stage started beside another job): the better of the stage's first and last measurement.
            self.peak = max(self.peak, measure_matmul_peak_flops(self.rt.device, self.rt.dtype))
            self.peak_why += ", best of stage start and end"
        mfu = self.flops_per_token * tok_per_s / (self.peak * self.rt.world_size)
        if mfu > 1.0:  # still above the peak: no trustworthy figure to give
            mfu = float("nan")
            self.peak_why += "; MFU withheld: the run's mean rate is above this peak"
        return TrainResult(step=step, total_steps=self.total_steps, losses=self.losses, final_eval=self.last_eval,
                           samples=samples, checkpoint=checkpoint, resumed_from=self.start_step, tokens=tokens,
                           flops=float(self.flops_per_token) * tokens, tok_per_s=tok_per_s, mfu=mfu,
                           train_time_s=self.train_time_s, peak={"flops_per_s": self.peak, "source": self.peak_why})
