"""GRPO-style policy gradient on GSM8K-format problems: sample a group of tool-using completions
per problem with the engine, reward the correct `####` answer, push up the log-probability of
sampled tokens in proportion to (reward - group mean). Not a general RL library: no value
function, no KL penalty, single process.

Choices, and why:
- Advantage = reward - mean(group reward), without dividing by the group's std (which inflates
  the weight of near-unanimous groups; Dr. GRPO, Liu et al. 2025). `advantage: group_std`
  divides by it (GRPO, Shao et al. 2024): a lone right answer in a group of eight then gets 2.65
  rather than 0.875, the answers of an even group 1.0 rather than 0.5.
- The loss is normalised by the number of sampled tokens in the whole step (token-level, as in
  DAPO, Yu et al. 2025), so long completions are not down-weighted per token.
- `step_advantage` adds credit for each tool call on the tokens that write it: whether its
  result is one of the reference solution's calculator results, against the group's calls. A
  completion that binds its second step to the wrong number otherwise shares one advantage over
  all its tokens with the steps it got right (process supervision, as in Lightman et al. 2023
  and GRPO's process variant, here with the synthetic reference as the judge of each step).
- Only sampled tokens carry gradient: forced tool outputs (`<|output_start|> ... <|output_end|>`)
  are the calculator's words, not the policy's.
- No KL term on the rollouts: on-policy sampling with one update per batch keeps the policy
  close on the problems. Held-out pass@k is logged so a collapse is visible.
- What the reward never sees can still drift (a chat's identity reply turned into a math
  solution midway). `rl.anchor` adds a loss on SFT conversations to every update, scaled by
  `anchor_weight`: their cross-entropy (`anchor_target: data`, the pretraining mix of PPO-ptx,
  Ouyang et al. 2022), or the KL from the starting checkpoint's next-token distributions on them
  (`anchor_target: sft`), which, unlike the cross-entropy of a few conversations, has no gradient
  until the policy drifts, at the cost of a frozen copy of the weights.

How it is built: a completion is one `Completion` record, a step's rollouts a list of them
(`Rollouts`). How a group is scored is chosen once, by name, from four tables: GREEDY_ROLLOUTS
and REFERENCE_ROLLOUTS (`ExtraMember`s: what is completed beside the samples and how it joins
the group), ADVANTAGES and CREDIT. `RLTrainer` is the loop, in the shape of
lockstep.train.trainer.Trainer (rollout, update, evaluate, step, state_dict, fit), with its NaN
guard, LR schedule and progress line.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn as nn

from lockstep.core.config import FieldError, check_range
from lockstep.core.progress import Countdown
from lockstep.core.seeds import derive_seed
from lockstep.data.records import problem_to_conversation, user_prompt
from lockstep.evaluate.chat import extract_answer
from lockstep.infer.engine import Engine
from lockstep.infer.sampling import UNSCALED_TEMPERATURE
from lockstep.model.gpt import IGNORE_INDEX
from lockstep.train.optim import OptimConfig, build_optimizers, global_grad_norm, set_lr
from lockstep.train.trainer import LRSchedule, NonFiniteGuard, eta_text, progress_line

if TYPE_CHECKING:
    from lockstep.tokenizer.base import Tokenizer

log = logging.getLogger("lockstep.rl")


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
    # added to the completion's advantage (lockstep.rl.loop.tool_steps). 0 = the answer's advantage
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
        return self.group_size + GREEDY_ROLLOUTS[self.greedy_rollout].rows + REFERENCE_ROLLOUTS[self.reference_rollout].rows

    @property
    def credit(self) -> str:
        """The CREDIT key of `step_advantage`: "calls" when it weighs each tool call, else "answer"."""
        return "calls" if self.step_advantage else "answer"

    def draws(self) -> dict[str, int]:
        """Problems per update from each mixture source: round(share x problems_per_step)."""
        return {name: round(share * self.problems_per_step) for name, share in sorted(self.mixture.items())}


def reward(completion: str, reference_answer: str) -> float:
    """1.0 when the completion states the reference's final number in GSM8K form (`#### N`,
    commas and `$` ignored), else 0.0."""
    ref = extract_answer(reference_answer)
    if ref is None:
        raise ValueError(f"reference {reference_answer[-60:]!r} has no final number; drop the problem")
    if "####" not in completion:
        return 0.0
    return 1.0 if extract_answer(completion) == ref else 0.0


def reference_results(reference_answer: str) -> Counter[str]:
    """The calculator results a reference solution names (`<<12*8=96>>` gives "96"), counted."""
    solution = problem_to_conversation({"question": "", "answer": reference_answer})["messages"][1]
    return Counter(part["text"] for part in solution["content"] if part["type"] == "python_output")


def tool_steps(completion: Sequence[int], engine: Engine, results: Counter[str]) -> list[tuple[range, bool]]:
    """Each finished tool call of a completion: the positions of the tokens that write it (from
    the end of the previous call's output, or the start, to its <|python_end|>) and whether its
    result is one of the reference's `results` (reference_results), each of those matching one
    call at most."""
    left = Counter(results)
    steps: list[tuple[range, bool]] = []
    start, writes, output_start = 0, None, None
    for pos, tok in enumerate(completion):
        if tok == engine.python_end_id:
            writes = range(start, pos + 1)
        elif tok == engine.output_start_id:
            output_start = pos + 1
        elif tok == engine.output_end_id and writes is not None and output_start is not None:
            value = engine.tokenizer.decode(list(completion[output_start:pos])).strip()
            right = left[value] > 0
            left[value] -= right
            steps.append((writes, right))
            start, writes, output_start = pos + 1, None, None
    return steps


def _call_credit(completions: Sequence[Sequence[int]], engine: Engine, reference_answer: str,
                 weight: float) -> list[list[float]]:
    """Per completion of one group, per token: `weight` x (its call's 1 or 0, less the mean over
    the group's calls) on the tokens that write each call, 0 elsewhere."""
    results = reference_results(reference_answer)
    steps = [tool_steps(c, engine, results) for c in completions]
    flags = [right for group in steps for _, right in group]
    mean = sum(flags) / len(flags) if flags else 0.0
    credit = [[0.0] * len(c) for c in completions]
    for row, group in zip(credit, steps):
        for writes, right in group:
            row[writes.start:writes.stop] = [weight * (right - mean)] * len(writes)
    return credit


def reference_completion(tokenizer: Tokenizer, problem: Mapping[str, Any], prompt: Sequence[int]) -> tuple[list[int], list[int]]:
    """The problem's reference solution as a completion of `prompt` (prompt_ids of its question):
    the assistant turn's ids after `<|assistant_start|>`, `<|assistant_end|>` included, and per
    id 1 where the model writes it, 0 on the calculator's output (forced, as in a rollout)."""
    ids, mask = tokenizer.render_conversation(problem_to_conversation(problem))
    if ids[: len(prompt)] != list(prompt):
        raise ValueError("the reference solution's conversation does not start with the problem's prompt: "
                         "the chat template renders a question differently alone and with its answer")
    return ids[len(prompt):], mask[len(prompt):]


def _derived_seed(*parts: Any) -> int:
    """RL's seeds: lockstep.core.seeds.derive_seed in the `lockstep-rl` namespace."""
    return derive_seed("lockstep-rl", *parts)


def prompt_ids(tokenizer: Tokenizer, question: str) -> list[int]:
    return tokenizer.render_for_completion(user_prompt(question))


def series_columns(cfg: RLConfig) -> dict[str, tuple[str, ...]]:
    """The per-step series RLTrainer reports through `on_step`, by file: columns besides `step`.
    Every value is a result (rewards, lengths, losses, held-out scores); timings stay in the log."""
    held_out = dict.fromkeys(("pass@1", f"pass@{cfg.pass_k}", "greedy", "completion_len"))  # pass@1 once when k = 1
    train = ("reward", "completion_len", "loss") + (("anchor_loss",) if cfg.anchor else ())
    return {"train": train, "val": tuple(f"val_{k}" for k in held_out)}


Role = Literal["sample", "greedy", "reference"]


@dataclass
class Completion:
    """One completion of a step's rollouts: what the update trains on and what the step reports."""

    prompt: list[int]  # the problem's prompt ids
    ids: list[int]  # completion ids (stop token included when produced)
    sampled: list[int]  # per id: 1 sampled by the policy, 0 forced by the tool
    reward: float
    advantage: float = 0.0
    # "sample": drawn at the rollouts' temperature; "greedy": the problem's greedy completion
    # (rl.greedy_rollout: member); "reference": its reference solution (rl.reference_rollout)
    role: Role = "sample"
    credit: list[float] | None = None  # per id, added to the advantage (rl.step_advantage); None: nothing is

    @property
    def trained(self) -> bool:
        """Whether the policy loss reads it: a nonzero advantage, or credit on some token."""
        return self.advantage != 0.0 or (self.credit is not None and any(self.credit))


@dataclass
class Rollouts:
    """One step's completions, flattened over problems, each problem's group consecutive: its
    samples, then its greedy completion and reference solution where they join it."""

    completions: list[Completion]

    def select(self, rows: Sequence[int]) -> Rollouts:
        """The completions at `rows`, in that order."""
        return Rollouts([self.completions[i] for i in rows])

    def split(self, parts: int, group_rows: int) -> list[Rollouts]:
        """`parts` consecutive slices of whole groups of `group_rows` completions, as even as the
        group count allows."""
        groups = len(self.completions) // group_rows
        bounds = [round(i * groups / parts) * group_rows for i in range(parts + 1)]
        return [self.select(range(a, b)) for a, b in zip(bounds, bounds[1:])]

    def _samples(self) -> list[Completion]:
        return [c for c in self.completions if c.role == "sample"]

    @property
    def mean_reward(self) -> float:
        """Over the sampled completions (greedy and reference ones left out)."""
        samples = self._samples()
        return sum(c.reward for c in samples) / len(samples)

    @property
    def mean_length(self) -> float:
        samples = self._samples()
        return sum(len(c.ids) for c in samples) / len(samples)

    @property
    def decoded_tokens(self) -> int:
        """Tokens the engine decoded: every completion's but the reference solutions'."""
        return sum(len(c.ids) for c in self.completions if c.role != "reference")


def _precision(autocast: Any, device: torch.device) -> Any:
    """The caller's autocast context for a forward pass, or autocast switched off (fp32)."""
    return autocast if autocast is not None else torch.autocast(device.type, enabled=False)


def _chunks(n: int, size: int) -> list[range]:
    return [range(start, min(start + size, n)) for start in range(0, n, size)]


def _prompts_and_budgets(engine: Engine, tokenizer: Tokenizer, problems: Sequence[dict[str, Any]],
                         max_new_tokens: int) -> tuple[list[list[int]], list[int]]:
    prompts, budgets = [], []
    for problem in problems:
        prompt = prompt_ids(tokenizer, problem["question"])
        budget = min(max_new_tokens, engine.model.config.sequence_len - len(prompt))
        if budget < 1:
            raise ValueError(f"problem prompt of {len(prompt)} tokens leaves no room in the model's context")
        prompts.append(prompt)
        budgets.append(budget)
    return prompts, budgets


def _sample(engine: Engine, prompts: list[list[int]], budgets: list[int], *, k: int, batch_rows: int,
            temperature: float, top_k: int | None, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """k completions of each prompt (tools on), all decoded together `batch_rows` at a time;
    completions of prompt i are rows i*k .. i*k+k-1."""
    return engine.generate_many([p for p in prompts for _ in range(k)], max_tokens=[b for b in budgets for _ in range(k)],
                                batch_rows=batch_rows, temperature=temperature, top_k=top_k, seed=seed)


# --- Strategies: how a group's completions are scored, each chosen once from RLConfig's names ---


@dataclass
class Group:
    """One problem's completions while they are scored: its samples, then the members that join
    them. The advantages measure from `baseline`, or, None, from the members' mean reward."""

    problem: Mapping[str, Any]
    budget: int  # the problem's completion budget in tokens
    members: list[Completion]
    baseline: float | None = None


# (the group's rewards, its baseline) -> each member's advantage, in order
Advantage = Callable[[Sequence[float], float], list[float]]


def mean_advantage(rewards: Sequence[float], baseline: float) -> list[float]:
    """`mean`: reward - baseline (Dr. GRPO)."""
    return [r - baseline for r in rewards]


def group_std_advantage(rewards: Sequence[float], baseline: float) -> list[float]:
    """`group_std`: reward - baseline over the std of the group's rewards (GRPO); a group of
    equal rewards is left unscaled."""
    std = statistics.pstdev(rewards)
    scale = 1.0 / std if std > 0 else 1.0
    return [(r - baseline) * scale for r in rewards]


# rl.advantage -> its function. A new one: an Advantage above and one line here.
ADVANTAGES: dict[str, Advantage] = {"mean": mean_advantage, "group_std": group_std_advantage}


@dataclass(frozen=True)
class ExtraMember:
    """A completion beside each problem's samples (rl.greedy_rollout, rl.reference_rollout):
    `complete(engine, problems, prompts, budgets, batch_rows)` gives it for each problem of a
    chunk (None: there is none), `join(group, completion)` adds it to the problem's group or takes
    it as the baseline; `rows`: the completions it adds to a group."""

    complete: Callable[[Engine, Sequence[Mapping[str, Any]], list[list[int]], list[int], int], list[Completion | None]]
    join: Callable[[Group, Completion | None], None]
    rows: int


def no_completion(engine: Engine, problems: Sequence[Mapping[str, Any]], prompts: list[list[int]], budgets: list[int],
                  batch_rows: int) -> list[Completion | None]:
    return [None] * len(prompts)


def greedy_completion(engine: Engine, problems: Sequence[Mapping[str, Any]], prompts: list[list[int]],
                      budgets: list[int], batch_rows: int) -> list[Completion | None]:
    """Each problem's greedy completion, `batch_rows` decoding together, scored."""
    seqs, masks = engine.generate_many(prompts, max_tokens=budgets, batch_rows=batch_rows)
    return [Completion(prompt, ids, mask, reward(engine.tokenizer.decode(ids), problem["answer"]), role="greedy")
            for problem, prompt, ids, mask in zip(problems, prompts, seqs, masks)]


def reference_solution(engine: Engine, problems: Sequence[Mapping[str, Any]], prompts: list[list[int]],
                       budgets: list[int], batch_rows: int) -> list[Completion | None]:
    """Each problem's reference solution as a completion (reference_completion), reward 1."""
    return [Completion(prompt, *reference_completion(engine.tokenizer, problem, prompt), 1.0, role="reference")
            for problem, prompt in zip(problems, prompts)]


def join_nothing(group: Group, completion: Completion | None) -> None:
    pass


def join_member(group: Group, completion: Completion | None) -> None:
    """`greedy_rollout: member`: in the group's mean, trained like a sample."""
    assert completion is not None
    group.members.append(completion)


def join_baseline(group: Group, completion: Completion | None) -> None:
    """`greedy_rollout: baseline`: its reward is the group's baseline (self-critical); untrained."""
    assert completion is not None
    group.baseline = completion.reward


def join_unsolved(group: Group, completion: Completion | None) -> None:
    """`reference_rollout: unsolved`: after the group's advantages, trained with advantage 1
    where none of the samples is right and it fits the budget, else 0."""
    assert completion is not None
    unsolved = not any(m.reward for m in group.members if m.role == "sample")
    completion.advantage = 1.0 if unsolved and len(completion.ids) <= group.budget else 0.0
    group.members.append(completion)


NO_MEMBER = ExtraMember(no_completion, join_nothing, rows=0)
# rl.greedy_rollout -> how each problem's greedy completion joins its group, before the advantages.
GREEDY_ROLLOUTS: dict[str, ExtraMember] = {
    "off": NO_MEMBER,
    "member": ExtraMember(greedy_completion, join_member, rows=1),
    "baseline": ExtraMember(greedy_completion, join_baseline, rows=0),
}
# rl.reference_rollout -> how the reference solution joins each group, after the advantages and credit.
REFERENCE_ROLLOUTS: dict[str, ExtraMember] = {
    "off": NO_MEMBER,
    "unsolved": ExtraMember(reference_solution, join_unsolved, rows=1),
}

# (the group's members, the engine, the problem's reference answer, rl.step_advantage) -> sets
# each member's per-token credit
Credit = Callable[[Sequence[Completion], Engine, str, float], None]


def answer_credit(members: Sequence[Completion], engine: Engine, reference_answer: str, weight: float) -> None:
    """`answer`: the answer's advantage alone; no token has credit of its own."""


def call_credit(members: Sequence[Completion], engine: Engine, reference_answer: str, weight: float) -> None:
    """`calls`: each tool call's tokens get `weight` x (right or not, less the group's mean)."""
    for m, credit in zip(members, _call_credit([m.ids for m in members], engine, reference_answer, weight)):
        m.credit = credit


# RLConfig.credit -> its function. A new one: a Credit above, one line here, and its name in RLConfig.credit.
CREDIT: dict[str, Credit] = {"answer": answer_credit, "calls": call_credit}


def policy_loss_backward(model: nn.Module, ro: Rollouts, *, device: torch.device, rows_per_pass: int,
                         autocast: Any = None, prompt_once: bool = False) -> tuple[float, int]:
    """Accumulate gradients of -sum((A_i + c_t) * log p(token)) / N over sampled tokens, c_t a
    token's credit (Completion.credit, else 0), N the number of sampled tokens of the completions
    that count in the step. Returns (loss value, N). Completions with zero advantage and no
    credit contribute nothing and are skipped.

    Each pass runs up to `rows_per_pass` whole sequences (prompt and completion). With
    `prompt_once`, a pass holds consecutive completions of one prompt instead (a problem's
    group), and the prompt runs through the model once for all of them (`_SharedPrompt`): the
    same loss and gradients to rounding, about a third fewer tokens for RL's prompts."""
    rows = [c for c in ro.completions if c.trained]
    n_tokens = sum(sum(c.sampled) for c in rows)
    if not rows or n_tokens == 0:
        return 0.0, 0
    passes = _same_prompt_runs(rows, rows_per_pass) if prompt_once else [
        rows[start:start + rows_per_pass] for start in range(0, len(rows), rows_per_pass)]
    total = 0.0
    for chunk in passes:
        if prompt_once:
            # the completions read after the prompt's last token: input and targets start there
            prompt = chunk[0].prompt
            starts = [0] * len(chunk)
            seqs = [prompt[-1:] + c.ids for c in chunk]
        else:
            starts = [len(c.prompt) - 1 for c in chunk]
            seqs = [c.prompt + c.ids for c in chunk]
        x, y, adv = _policy_rows(chunk, seqs, starts)
        x, y, adv = x.to(device), y.to(device), adv.to(device)
        with _precision(autocast, device):
            if prompt_once:
                shared = _SharedPrompt(len(prompt) - 1)
                if shared.length:
                    model.final_hidden(torch.tensor([prompt[:-1]], dtype=torch.long, device=device), shared)  # (1, P)
                nll = model(x, targets=y, kv_cache=shared.for_rows(len(chunk)), loss_reduction="none")  # (B, T)
            else:
                nll = model(x, targets=y, loss_reduction="none")  # (B, T), 0 at ignored targets
        loss = (nll.float() * adv).sum() / n_tokens
        loss.backward()
        total += float(loss.detach())
    return total, n_tokens


def _same_prompt_runs(rows: Sequence[Completion], size: int) -> list[list[Completion]]:
    """`rows` cut into runs of consecutive completions of one prompt, at most `size` each."""
    runs: list[list[Completion]] = []
    for c in rows:
        if runs and len(runs[-1]) < size and runs[-1][0].prompt == c.prompt:
            runs[-1].append(c)
        else:
            runs.append([c])
    return runs


def _policy_rows(chunk: Sequence[Completion], seqs: Sequence[list[int]],
                 starts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs x, targets y and per-token advantages (each (B, T)) of the completions `chunk`,
    row r reading seqs[r] and predicting its completion from position starts[r] on; padding
    and forced tokens get no target."""
    T = max(len(s) for s in seqs) - 1
    x = torch.zeros(len(chunk), T, dtype=torch.long)  # (B, T)
    y = torch.full((len(chunk), T), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    adv = torch.tensor([c.advantage for c in chunk], dtype=torch.float32)[:, None].repeat(1, T)  # (B, T)
    for r, (c, s, p) in enumerate(zip(chunk, seqs, starts)):
        x[r, : len(s) - 1] = torch.tensor(s[:-1])
        targets = torch.tensor(c.ids)
        keep = torch.tensor(c.sampled, dtype=torch.bool)
        y[r, p : p + len(targets)] = torch.where(keep, targets, torch.full_like(targets, IGNORE_INDEX))
        if c.credit is not None:
            adv[r, p : p + len(targets)] += torch.tensor(c.credit)
    return x, y, adv


class _SharedPrompt:
    """The model's KV-cache interface (lockstep.model.gpt.KVCacheLike) for training on completions
    of one prompt: run over the prompt (less its last token) from position 0, it keeps each
    layer's keys and values, autograd history included; `for_rows(B)` then gives the pass over
    B completions, which continue from the prompt's length and attend over those keys (one set,
    computed once, for every row) and causally over their own. The prompt's gradient is the sum
    over the rows that read it, as when each row runs the prompt itself."""

    def __init__(self, length: int) -> None:
        self.length = length  # prompt tokens before the completions' first input
        self.keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.rows = 0  # 0 while the prompt runs
        self.mask: torch.Tensor | None = None  # the completions' (1, 1, T, P + T), made at the first layer

    def for_rows(self, rows: int) -> _SharedPrompt:
        self.rows = rows
        return self

    def positions(self) -> int:
        return self.length if self.rows else 0

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if not self.rows:
            self.keys.append((k, v))  # (1, Hkv, P, D) each
            return k, v, None
        if not self.length:
            return k, v, None
        pk, pv = self.keys[layer_idx]
        B, H, T, D = k.shape
        if self.mask is None:
            own = torch.ones(T, T, dtype=torch.bool, device=k.device).tril()  # (T, T)
            self.mask = torch.cat((torch.ones(T, self.length, dtype=torch.bool, device=k.device), own), dim=1)[None, None]
        return (torch.cat((pk.expand(B, H, self.length, D), k), dim=2),
                torch.cat((pv.expand(B, H, self.length, D), v), dim=2), self.mask)

    def advance(self, num_tokens: int) -> None:
        pass


def anchor_loss_backward(model: nn.Module, anchor: Any, cfg: RLConfig, *, device: torch.device, generator: torch.Generator,
                         autocast: Any = None, reference: nn.Module | None = None) -> float:
    """Accumulate gradients of anchor_weight x the anchor's loss on `cfg.anchor_rows` SFT
    conversations drawn from `anchor` (a loader whose get_batch gives x, y, y_masked), mean over
    the assistant's tokens, `device_batch_rows` conversations at a time. The loss is their
    cross-entropy, or with `reference` (the frozen starting policy, `anchor_target: sft`)
    KL(reference || model) of the next-token distributions at those tokens. Returns the
    unweighted mean loss."""
    x, _y, y = anchor.get_batch(B=cfg.anchor_rows, generator=generator)  # (B, T) each
    # Rows come padded to the context; past the last supervised target they change no loss.
    width = int((y != IGNORE_INDEX).any(dim=0).nonzero().max()) + 1
    x, y = x[:, :width].to(device), y[:, :width].to(device)
    n_targets = int((y != IGNORE_INDEX).sum())
    total = 0.0
    for start in range(0, cfg.anchor_rows, cfg.device_batch_rows):
        rows = slice(start, start + cfg.device_batch_rows)
        if reference is None:
            with _precision(autocast, device):
                nll = model(x[rows], targets=y[rows], loss_reduction="none")  # (b, T), 0 at ignored targets
            loss = nll.float().sum() / n_targets
        else:
            loss = _kl_to_reference(model, reference, x[rows], y[rows] != IGNORE_INDEX,
                                    _precision(autocast, device)) / n_targets
        (cfg.anchor_weight * loss).backward()
        total += float(loss.detach())
    return total


def _kl_to_reference(model: nn.Module, reference: nn.Module, x: torch.Tensor, keep: torch.Tensor, ctx: Any) -> torch.Tensor:
    """Sum over the positions `keep` (b, T) of KL(reference || model) between the next-token
    distributions the two models give after x (b, T); the head reads only those positions."""
    with torch.no_grad(), ctx:
        ref = _kept_logits(reference, x, keep).log_softmax(-1)  # (1, N, V)
    with ctx:
        logp = _kept_logits(model, x, keep).log_softmax(-1)  # (1, N, V)
    return (ref.exp() * (ref - logp)).sum()


def _kept_logits(model: nn.Module, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The model's soft-capped fp32 logits (1, N, V) at the N positions `keep` of x (b, T),
    the head applied to those positions only."""
    return model.head_logits(model.final_hidden(x)[keep][None])


@torch.no_grad()
def pass_at_k(engine: Engine, tokenizer: Tokenizer, problems: Sequence[dict[str, Any]], *, k: int, temperature: float,
              max_new_tokens: int, seed: int, batch_rows: int = 128) -> dict[str, float]:
    """Held-out scores on `problems` from k completions sampled at `temperature` per problem:
    pass@1 is the mean fraction correct (the unbiased pass@1 estimate from k samples), pass@k
    the fraction of problems with any correct completion. Also the greedy (temperature 0)
    accuracy and the mean greedy completion length. `batch_rows` completions decode together;
    progress lines to the `lockstep.rl` log while it takes longer than ~10 s."""
    prompts, budgets = _prompts_and_budgets(engine, tokenizer, problems, max_new_tokens)
    sampled_correct = any_correct = greedy_correct = 0.0
    lengths = []
    countdown = Countdown("held-out eval", len(problems), log.info, units="problems")
    per_call = max(1, batch_rows // (k + 1))
    for c, chunk in enumerate(_chunks(len(problems), per_call)):
        ps, bs = prompts[chunk.start:chunk.stop], budgets[chunk.start:chunk.stop]
        greedy = engine.generate_greedy(ps, max_tokens=bs, batch_rows=batch_rows)
        seqs, _ = _sample(engine, ps, bs, k=k, batch_rows=batch_rows, temperature=temperature, top_k=None,
                          seed=_derived_seed(seed, "eval", c))
        for j, i in enumerate(chunk):
            greedy_correct += reward(tokenizer.decode(greedy[j]), problems[i]["answer"])
            lengths.append(len(greedy[j]))
            hits = [reward(tokenizer.decode(seqs[j * k + g]), problems[i]["answer"]) for g in range(k)]
            sampled_correct += sum(hits) / k
            any_correct += max(hits)
        countdown.tick(len(chunk))
    n = len(problems)
    return {"pass@1": sampled_correct / n, f"pass@{k}": any_correct / n, "greedy": greedy_correct / n,
            "completion_len": sum(lengths) / n}


@dataclass
class RLResult:
    steps: int
    before: dict[str, float]  # held-out scores of the starting checkpoint
    after: dict[str, float]  # held-out scores after the last update
    mean_reward_first: float  # mean training reward of the first step ...
    mean_reward_last: float  # ... and of the last
    rollout_tokens: int
    train_time_s: float
    optimizer_state: dict[str, Any]  # {"optimizers": [state_dict, ...]}, for the checkpoint


def draw_problems(train_problems: Sequence[dict[str, Any]], mixture_problems: Mapping[str, Sequence[dict[str, Any]]],
                  cfg: RLConfig, *, seed: int, step: int) -> list[dict[str, Any]]:
    """One step's problems, drawn with replacement by a generator seeded from (seed, step): the
    rest from `train_problems`, then `cfg.draws()` from each mixture source (in name order), then
    all of them shuffled, so that the `cfg.updates_per_step` consecutive parts of a step mix the
    sources rather than the mixture's problems all landing in the last. Without a mixture there
    is nothing to shuffle and the draw is what it has always been, so earlier runs reproduce."""
    g = torch.Generator().manual_seed(_derived_seed(seed, "draw", step))
    draws = cfg.draws()
    n_main = cfg.problems_per_step - sum(draws.values())
    picked = [train_problems[i] for i in torch.randint(len(train_problems), (n_main,), generator=g).tolist()]
    for name, n in draws.items():
        source = mixture_problems[name]
        picked += [source[i] for i in torch.randint(len(source), (n,), generator=g).tolist()]
    if draws:
        picked = [picked[i] for i in torch.randperm(len(picked), generator=g).tolist()]
    return picked


@dataclass(frozen=True)
class UpdateStats:
    """What one `RLTrainer.update` did."""

    loss: float  # the policy loss per sampled token over the step's updates
    tokens: int  # sampled tokens trained on
    lr_mult: float
    anchor_loss: float | None  # mean over the updates that carried it (NaN: none did); None without an anchor


class RLTrainer:
    """The RL loop in the shape of lockstep.train.trainer.Trainer, sharing its NaN guard
    (NonFiniteGuard), LR schedule (LRSchedule) and progress line (progress_line, eta_text):
    `rollout()` samples and scores problems, `update()` trains on a step's rollouts,
    `evaluate()` scores the held-out problems, `step()` is one draw, rollout and update,
    `state_dict()` holds the weights and optimizer state, and `fit()` runs `cfg.num_steps` steps.

    The rollout's strategies are looked up once here from cfg's names: GREEDY_ROLLOUTS,
    ADVANTAGES, CREDIT and REFERENCE_ROLLOUTS. Problems per step are drawn with a generator seeded
    from (seed, step), so a run is a pure function of its inputs and seed. An update whose loss or
    gradient norm is NaN or inf is skipped; more in a row than `cfg.nonfinite_patience`, or
    non-finite weights at the end, raise lockstep.train.trainer.NonFiniteError. `on_step` gets each
    result row, as `series_columns(cfg)` names them: a held-out row (`val_*`) at each evaluation, a
    training row after every step. `decode` holds the Engine's keywords for the rollouts and
    held-out scores (lockstep.infer.engine.decode_settings: on CUDA, bf16 and the fast path); None
    is the reference. `mixture_problems` holds the train problems of each `cfg.mixture` source,
    which give `cfg.draws()` of each update's problems. `anchor` is the loader of `cfg.anchor`'s SFT
    conversations (lockstep.data.loaders.Mixture), required exactly when cfg.anchor names caches.
    Progress goes to the `lockstep.rl` log."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, cfg: RLConfig, *, train_problems: Sequence[dict[str, Any]],
                 val_problems: Sequence[dict[str, Any]], device: torch.device, seed: int, autocast: Any = None,
                 on_step: Callable[[dict[str, float]], None] | None = None, decode: Mapping[str, Any] | None = None,
                 mixture_problems: Mapping[str, Sequence[dict[str, Any]]] | None = None, anchor: Any = None) -> None:
        _check_inputs(cfg, train_problems, val_problems, dict(mixture_problems or {}), anchor)
        self.model, self.tokenizer, self.cfg, self.device, self.seed = model, tokenizer, cfg, device, seed
        self.autocast, self.on_step, self.anchor = autocast, on_step, anchor
        self.train_problems, self.mixture_problems = train_problems, dict(mixture_problems or {})
        self.engine = Engine(model, tokenizer, **(decode or {}))
        # The anchor's reference: the starting weights, frozen (KL(start || policy) on its conversations).
        self.start_policy = (copy.deepcopy(model).eval().requires_grad_(False)
                             if anchor is not None and cfg.anchor_target == "sft" else None)
        self.optimizers = build_optimizers(model, cfg.optim, model_dim=model.config.n_embd)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.held_out = list(val_problems[: cfg.eval_problems])
        self.guard = NonFiniteGuard(cfg.nonfinite_patience, keys="rl.")
        self.greedy, self.reference = GREEDY_ROLLOUTS[cfg.greedy_rollout], REFERENCE_ROLLOUTS[cfg.reference_rollout]
        self.advantage, self.credit = ADVANTAGES[cfg.advantage], CREDIT[cfg.credit]
        self.step_count = 0  # steps completed
        self.step_times: list[float] = []
        self.rewards: list[float] = []  # each step's mean training reward
        self.rollout_tokens = 0

    def rollout(self, problems: Sequence[dict[str, Any]], *, seed: int) -> Rollouts:
        """Sample `group_size` completions for each problem (tools on), `generate_batch` of them
        decoding together, and score them; progress lines while it takes longer than ~10 s. Each
        group's rows: its samples, then what the greedy and reference strategies add."""
        cfg, engine, k = self.cfg, self.engine, self.cfg.group_size
        self.model.eval()
        prompts, budgets = _prompts_and_budgets(engine, self.tokenizer, problems, cfg.max_new_tokens)
        countdown = Countdown("rollouts", len(problems), log.info, units="problems")
        out: list[Completion] = []
        for c, chunk in enumerate(_chunks(len(problems), max(1, cfg.generate_batch // k))):
            part, ps, bs = problems[chunk.start:chunk.stop], prompts[chunk.start:chunk.stop], budgets[chunk.start:chunk.stop]
            seqs, masks = _sample(engine, ps, bs, k=k, batch_rows=cfg.generate_batch, temperature=cfg.temperature,
                                  top_k=cfg.top_k, seed=_derived_seed(seed, c))
            greedy = self.greedy.complete(engine, part, ps, bs, cfg.generate_batch)
            references = self.reference.complete(engine, part, ps, bs, cfg.generate_batch)
            for j, problem in enumerate(part):
                samples = [Completion(ps[j], seqs[g], masks[g], reward(self.tokenizer.decode(seqs[g]), problem["answer"]))
                           for g in range(j * k, (j + 1) * k)]
                out += self._score(Group(problem, bs[j], samples), greedy[j], references[j])
            countdown.tick(len(chunk))
        return Rollouts(out)

    def _score(self, group: Group, greedy: Completion | None, reference: Completion | None) -> list[Completion]:
        """The group's completions, scored: the greedy completion joins (or is the baseline),
        then the advantages and credit, then the reference solution joins."""
        self.greedy.join(group, greedy)
        rewards = [m.reward for m in group.members]
        baseline = sum(rewards) / len(rewards) if group.baseline is None else group.baseline
        for m, advantage in zip(group.members, self.advantage(rewards, baseline)):
            m.advantage = advantage
        self.credit(group.members, self.engine, group.problem["answer"], self.cfg.step_advantage)
        self.reference.join(group, reference)
        return group.members

    def update(self, ro: Rollouts) -> UpdateStats:
        """Train on step `step_count`'s rollouts at its scheduled LR: `updates_per_step` optimizer
        updates, each on the gradients of its own consecutive whole groups (and of the anchor's
        conversations, when there is one). A part without trained tokens makes no update; one whose
        loss or gradient norm is not finite is skipped (or raises past the patience)."""
        cfg, step, model = self.cfg, self.step_count, self.model
        model.train()
        parts: list[tuple[float, int]] = []  # (loss, sampled tokens) per update
        anchor_losses: list[float] = []
        lrm = cfg.lr_multiplier(step, cfg.num_steps)
        for u, part in enumerate(ro.split(cfg.updates_per_step, cfg.group_rows)):
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            part_loss, part_tokens = policy_loss_backward(model, part, device=self.device, rows_per_pass=cfg.device_batch_rows,
                                                          autocast=self.autocast, prompt_once=cfg.prompt_once)
            if part_tokens and self.anchor is not None:
                g = torch.Generator().manual_seed(_derived_seed(self.seed, "anchor", step, u))
                anchor_losses.append(anchor_loss_backward(model, self.anchor, cfg, device=self.device, generator=g,
                                                          autocast=self.autocast, reference=self.start_policy))
            if part_tokens:
                # The loss is already a host float; the norm's transfer is one per update, against one
                # per sampled token in the rollouts.
                norm = float(global_grad_norm(self.params, cfg.optim.grad_clip))
                if self.guard.check(step + 1, cfg.num_steps, part_loss, norm):
                    set_lr(self.optimizers, lrm, momentum=cfg.optim.muon_momentum_end)
                    for opt in self.optimizers:
                        opt.step()
            parts.append((part_loss, part_tokens))
        n_tokens = sum(t for _, t in parts)
        loss = parts[0][0] if len(parts) == 1 else sum(v * t for v, t in parts) / max(n_tokens, 1)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        anchor_loss = None if self.anchor is None else (  # NaN when no update stepped (every group unanimous)
            sum(anchor_losses) / len(anchor_losses) if anchor_losses else math.nan)
        return UpdateStats(loss=loss, tokens=n_tokens, lr_mult=lrm, anchor_loss=anchor_loss)

    def step(self) -> dict[str, float]:
        """One step: its problems drawn, rolled out and trained on; the progress line logged and
        the training row recorded (and returned)."""
        t0 = time.perf_counter()
        step = self.step_count
        problems = draw_problems(self.train_problems, self.mixture_problems, self.cfg, seed=self.seed, step=step)
        ro = self.rollout(problems, seed=_derived_seed(self.seed, "roll", step))
        self.rollout_tokens += ro.decoded_tokens
        stats = self.update(ro)
        dt = time.perf_counter() - t0
        self.step_count = step + 1
        self.step_times.append(dt)
        self.rewards.append(ro.mean_reward)
        row = {"step": step + 1, "reward": ro.mean_reward, "completion_len": ro.mean_length, "loss": stats.loss}
        if stats.anchor_loss is not None:
            row["anchor_loss"] = stats.anchor_loss
        self._report(ro, stats, dt)
        self._record(row)
        return row

    def _report(self, ro: Rollouts, stats: UpdateStats, dt: float) -> None:
        fields = [f"reward {ro.mean_reward:.3f}", f"loss {stats.loss:+.4f}"]
        if stats.anchor_loss is not None:
            fields.append(f"anchor {stats.anchor_loss:.4f}")
        references = [c for c in ro.completions if c.role == "reference"]
        if references:
            fields.append(f"references {sum(1 for c in references if c.advantage)}")
        fields += [f"lr {stats.lr_mult:.2f}", f"tokens {stats.tokens}", f"len {ro.mean_length:.1f}", f"dt {dt:.1f}s"]
        total = self.cfg.num_steps
        log.info("%s", progress_line(self.step_count, total, fields, eta=eta_text(self.step_times, total - self.step_count)))

    def _record(self, row: dict[str, float]) -> None:
        if self.on_step is not None:
            self.on_step(row)

    def evaluate(self) -> dict[str, float]:
        """Held-out scores now (pass_at_k on the first `eval_problems` val problems), logged and
        recorded as a `val_*` row."""
        cfg, step = self.cfg, self.step_count
        self.model.eval()
        scores = pass_at_k(self.engine, self.tokenizer, self.held_out, k=cfg.pass_k, temperature=cfg.temperature,
                           max_new_tokens=cfg.max_new_tokens, seed=self.seed, batch_rows=cfg.generate_batch)
        log.info("eval step %d | pass@1 %.3f | pass@%d %.3f | greedy %.3f | len %.1f | %d problems", step, scores["pass@1"],
                 cfg.pass_k, scores[f"pass@{cfg.pass_k}"], scores["greedy"], scores["completion_len"], len(self.held_out))
        self._record({"step": step, **{f"val_{k}": v for k, v in scores.items()}})
        return scores

    def state_dict(self) -> dict[str, Any]:
        """The step, the weights and the optimizers' state (live tensors, as torch's state dicts)."""
        return {"step": self.step_count, "model": self.model.state_dict(),
                "optimizers": [o.state_dict() for o in self.optimizers]}

    def fit(self) -> RLResult:
        """Evaluate, run `cfg.num_steps` steps with an evaluation every `eval_every_steps`, check the
        weights are finite, and evaluate again."""
        cfg = self.cfg
        before = self.evaluate()
        t_start = time.perf_counter()
        while self.step_count < cfg.num_steps:
            step = self.step()["step"]
            if cfg.eval_every_steps and step % cfg.eval_every_steps == 0 and step < cfg.num_steps:
                self.evaluate()
        train_time_s = time.perf_counter() - t_start
        self.guard.check_weights(self.model, cfg.num_steps)  # the caller checkpoints these weights
        after = self.evaluate()
        self.model.eval()
        return RLResult(steps=cfg.num_steps, before=before, after=after, mean_reward_first=self.rewards[0],
                        mean_reward_last=self.rewards[-1], rollout_tokens=self.rollout_tokens, train_time_s=train_time_s,
                        optimizer_state={"optimizers": self.state_dict()["optimizers"]})


def _check_inputs(cfg: RLConfig, train_problems: Sequence[dict[str, Any]], val_problems: Sequence[dict[str, Any]],
                  mixture_problems: Mapping[str, Sequence[dict[str, Any]]], anchor: Any) -> None:
    """Refuse problems or an anchor that do not match cfg, saying which."""
    if not train_problems:
        raise ValueError("no training problems: the problems snapshot's train split is empty")
    if set(mixture_problems) != set(cfg.mixture):
        raise ValueError(f"rl.mixture names {sorted(cfg.mixture)} but train problems came for {sorted(mixture_problems)}")
    for name, problems in mixture_problems.items():
        if not problems:
            raise ValueError(f"no training problems for rl.mixture.{name}: its snapshot's train split is empty")
    if not val_problems:
        raise ValueError("no held-out problems: the problems snapshot's val split is empty")
    if (anchor is None) != (not cfg.anchor):
        raise ValueError(f"rl.anchor names {sorted(cfg.anchor)} but the anchor loader is "
                         f"{'missing' if anchor is None else 'given'}")
