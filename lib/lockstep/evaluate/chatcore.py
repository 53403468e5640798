"""ChatCORE's benchmarks, registered: `BENCHMARKS`, the one table the eval stage, the report card
and the plan read (each benchmark's facts live in its module under lockstep.evaluate.benchmarks),
and the ChatCORE score over them with their fixed baselines."""

from __future__ import annotations

from lockstep.evaluate.benchmarks import arc, gsm8k, humaneval, mmlu, spelling_bee
from lockstep.evaluate.chat import Benchmark, chatcore

# `eval.chat_tasks` key -> its benchmark, in the report card's column order. A new benchmark: its
# module under lockstep.evaluate.benchmarks and one line here.
BENCHMARKS: dict[str, Benchmark] = {
    "arc_easy": arc.EASY,
    "arc_challenge": arc.CHALLENGE,
    "mmlu": mmlu.MMLU,
    "gsm8k": gsm8k.GSM8K,
    "humaneval": humaneval.HUMANEVAL,
    "spelling_bee": spelling_bee.SPELLING_BEE,
}


def accuracy_key(task: str) -> str:
    """The metric a benchmark's accuracy is written under (lockstep.pipeline.eval)."""
    return f"chat.{task}.accuracy"


def report_columns() -> list[tuple[str, str]]:
    """(column, metric) of each benchmark, in BENCHMARKS' order: the report card's columns."""
    return [(bench.column, accuracy_key(task)) for task, bench in BENCHMARKS.items()]


def chatcore_of(accuracy_by_task: dict[str, float]) -> float:
    """ChatCORE over BENCHMARKS' tasks: the mean of each task's accuracy centred on its fixed
    baseline, `(acc - b) / (1 - b)`. Refuses a task that is not one of them."""
    unknown = sorted(set(accuracy_by_task) - set(BENCHMARKS))
    if unknown:
        raise ValueError(f"{unknown} are not ChatCORE tasks; use some of {list(BENCHMARKS)}")
    return chatcore({t: (acc, BENCHMARKS[t].baseline) for t, acc in accuracy_by_task.items()})
