"""What a step's rollouts are made of: the `Completion` record and `Rollouts` (a step's
completions, each problem's group consecutive), the reading of a completion's tool calls that
scores them (the reward itself is the GSM8K benchmark's, lockstep.evaluate.benchmarks.gsm8k), and
a problem's prompt and reference solution as ids. Samples nothing, and
knows no strategy or loss."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from lockstep.data.records import problem_to_conversation, user_prompt
from lockstep.infer.engine import Engine

if TYPE_CHECKING:
    from lockstep.tokenizer.base import Tokenizer


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


def reference_completion(
    tokenizer: Tokenizer, problem: Mapping[str, Any], prompt: Sequence[int]
) -> tuple[list[int], list[int]]:
    """The problem's reference solution as a completion of `prompt` (prompt_ids of its question):
    the assistant turn's ids after `<|assistant_start|>`, `<|assistant_end|>` included, and per
    id 1 where the model writes it, 0 on the calculator's output (forced, as in a rollout)."""
    ids, mask = tokenizer.render_conversation(problem_to_conversation(problem))
    if ids[: len(prompt)] != list(prompt):
        raise ValueError("the reference solution's conversation does not start with the problem's prompt: "
                         "the chat template renders a question differently alone and with its answer")
    return ids[len(prompt):], mask[len(prompt):]


def prompt_ids(tokenizer: Tokenizer, question: str) -> list[int]:
    return tokenizer.render_for_completion(user_prompt(question))

