"""The `rl` params section, `RLConfig`: its fields, their ranges, and the strategy table each name
field picks from (lockstep.rl.strategies). Builds nothing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lockstep.core.config import FieldError, check_range
from lockstep.infer.sampling import UNSCALED_TEMPERATURE
from lockstep.rl.strategies import ADVANTAGES, GREEDY_ROLLOUTS, REFERENCE_ROLLOUTS
from lockstep.train.optim import OptimConfig
from lockstep.train.trainer import LRSchedule


@dataclass(frozen=True)
class RLConfig(LRSchedule):
    """The `rl` params section. The schedule's fields come from lockstep.train.trainer.LRSchedule, with
    a longer warmdown by default."""

    problems: str = "synth_math"  # raw snapshot of problem records: train split trains, val split evaluates
    # Other problem snapshots and the share of each update's problems drawn from their train splits
    # (the rest come from `problems`); held-out scores stay on `problems`. {synth_math: 0.25} keeps
    # an easier family in the updates, so RL on a harder one does not unlearn it.
    mixture: dict[str, float] = field(default_factory=dict)
    num_steps: int = 30  # policy updates
    problems_per_step: int = 8  # distinct problems per update
    group_size: int = 8  # completions sampled per problem
    max_new_tokens: int = 64  # per completion, tool tokens included
    # Optimizer updates per step: the step's problems (with their groups) split into this many
    # consecutive updates, each on fresh gradients. Decoding dominates a step's time, so more
    # updates from the same rollouts cost little; later ones are slightly off-policy.
    updates_per_step: int = 1
    # The greedy completion of each problem, decoded beside its samples: "off"; "member": it joins
    # its group (in the group's mean, trained like a sample); "baseline": it is the baseline
    # (advantage = reward - greedy reward, self-critical), itself untrained. A key of GREEDY_ROLLOUTS.
    greedy_rollout: str = "off"
    # The problem's reference solution, rendered as a reply (its calculator results forced as
    # tool output), beside each group: "off"; "unsolved": in a group none of whose samples
    # reaches the reference's answer it is trained with advantage 1 (its reward, less the
    # samples' mean of 0), off-policy; beside a solved group, or where it is longer than the
    # completion budget, it is left out (advantage 0). It never enters the samples' baseline.
    # A key of REFERENCE_ROLLOUTS.
    reference_rollout: str = "off"
    # "mean": advantage = reward - the group's baseline; "group_std": that, divided by the std of
    # the group's rewards (a group of equal rewards is left unscaled). A key of ADVANTAGES.
    advantage: str = "mean"
    # Credit for each tool call on its own tokens: the tokens that write a call (from the end of
    # the previous call's output to its <|python_end|>) get step_advantage x (1 if the call's
    # result is one of the reference's, else 0, less the mean of that over the group's calls)
    # added to the completion's advantage (lockstep.rl.rollouts.tool_steps). 0 = the answer's advantage
    # only. CREDIT["calls"] when > 0, else CREDIT["answer"] (RLConfig.credit).
    step_advantage: float = 0.0
    temperature: float = UNSCALED_TEMPERATURE  # sampling temperature of the rollouts
    top_k: int | None = None  # rollouts' top-k (None = full distribution)
    device_batch_rows: int = 16  # completions per forward/backward pass
    # The policy loss's passes hold one prompt's completions, the prompt run once for all of them
    # rather than once per completion: the same gradients to rounding, fewer tokens through the
    # model (bench/bench_policy_loss.py). Off: each pass runs device_batch_rows whole sequences.
    prompt_once: bool = False
    generate_batch: int = 128  # completions decoded together (rollouts and held-out evaluation)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(matrix_lr=0.002, embed_lr=0.02, unembed_lr=0.0004,
                                                                    muon_momentum_warmup_steps=0))
    warmdown_frac: float = 0.5  # last fraction of steps decays linearly to final_lr_frac
    eval_every_steps: int = 10  # held-out pass@k; 0 = only before and after
    eval_problems: int = 100  # held-out problems scored (the first ones of the val split)
    pass_k: int = 8  # completions sampled per held-out problem at `temperature`: pass@1 and pass@k from them
    # SFT caches (data/cache/sft/<name>) and their weights: each update adds anchor_weight x the
    # mean cross-entropy of `anchor_rows` of their train conversations on the assistant's tokens,
    # so RL keeps what SFT taught beyond the reward's problems. {} = no anchor.
    anchor: dict[str, float] = field(default_factory=dict)
    anchor_rows: int = 16
    anchor_weight: float = 1.0
    # What the anchor holds the policy to on those conversations. "data": their own tokens (the
    # cross-entropy SFT trained on), whose gradient on 16 conversations is sampling noise as large
    # as the policy gradient even before the policy moves. "sft": the starting checkpoint's
    # next-token distributions (KL(start || policy) on the same tokens), zero, gradient included,
    # until the policy drifts from them; it keeps a frozen copy of the starting weights.
    anchor_target: Literal["data", "sft"] = "data"
    # Consecutive updates with a NaN/inf loss or gradient norm skipped before the run stops with
    # NonFiniteError; 0 = stop at the first.
    nonfinite_patience: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, table in (("greedy_rollout", GREEDY_ROLLOUTS), ("reference_rollout", REFERENCE_ROLLOUTS),
                            ("advantage", ADVANTAGES)):
            if getattr(self, name) not in table:
                raise FieldError(name, getattr(self, name), f"must be one of {list(table)}")
        for name in ("num_steps", "problems_per_step", "max_new_tokens", "updates_per_step", "device_batch_rows",
                     "generate_batch", "eval_problems", "pass_k", "anchor_rows"):
            check_range(name, getattr(self, name), ge=1)
        check_range("group_size", self.group_size, ge=2, why="the advantage compares completions of one problem")
        check_range("temperature", self.temperature, gt=0, why="rollouts must explore")
        check_range("step_advantage", self.step_advantage, ge=0, why="the weight of a tool call's own credit")
        if self.top_k is not None:
            check_range("top_k", self.top_k, ge=1, why="or null for the full distribution")
        for name in ("eval_every_steps", "nonfinite_patience"):
            check_range(name, getattr(self, name), ge=0)
        if self.updates_per_step > self.problems_per_step:
            raise FieldError("updates_per_step", self.updates_per_step,
                             f"splits {self.problems_per_step} problems per step: at most problems_per_step")
        if self.problems in self.mixture:
            raise FieldError(f"mixture.{self.problems}", self.mixture[self.problems],
                             "names rl.problems itself: list only the other sources "
                             "(the rest of each update is rl.problems)")
        for name, share in self.mixture.items():
            check_range(f"mixture.{name}", share, gt=0, lt=1, why="the share of each update's problems")
            if round(share * self.problems_per_step) < 1:
                raise FieldError(f"mixture.{name}", share,
                                 f"gives no problem of the {self.problems_per_step} per update: "
                                 f"raise it to >= {0.5 / self.problems_per_step:.3g} or drop the entry")
        for name, weight in self.anchor.items():
            check_range(f"anchor.{name}", weight, gt=0, why="the weight of the cache among the anchor's rows")
        check_range("anchor_weight", self.anchor_weight, gt=0, why="drop rl.anchor for no anchor")
        if self.problems_per_step - sum(self.draws().values()) < 1:
            raise FieldError("mixture", dict(self.mixture), f"leaves no problem of rl.problems in an update of "
                             f"{self.problems_per_step}: lower the shares")

    @property
    def group_rows(self) -> int:
        """Completions per problem in a step's rollouts: the group, its greedy completion when
        that is a member, and the reference solution when it is rolled out."""
        return (
            self.group_size
            + GREEDY_ROLLOUTS[self.greedy_rollout].rows
            + REFERENCE_ROLLOUTS[self.reference_rollout].rows
        )

    @property
    def credit(self) -> str:
        """The CREDIT key of `step_advantage`: "calls" when it weighs each tool call, else "answer"."""
        return "calls" if self.step_advantage else "answer"

    def draws(self) -> dict[str, int]:
        """Problems per update from each mixture source: round(share x problems_per_step)."""
        return {name: round(share * self.problems_per_step) for name, share in sorted(self.mixture.items())}

