"""How a group's completions are scored, each strategy chosen once by name from RLConfig's fields:
ADVANTAGES, GREEDY_ROLLOUTS and REFERENCE_ROLLOUTS (`ExtraMember`s: what is completed beside the
samples and how it joins the group) and CREDIT. The one place a new strategy is added; not the loop
that applies them (lockstep.rl.trainer)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lockstep.evaluate.benchmarks.gsm8k import reward
from lockstep.infer.engine import Engine
from lockstep.rl.rollouts import Completion, reference_completion, reference_results, tool_steps


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

