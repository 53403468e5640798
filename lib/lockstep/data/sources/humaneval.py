"""HumanEval (`openai/openai_humaneval`): its 164 test problems as eval items (snapshot documents:
the prompt, i.e. signature and docstring, as text; the tests, entry point, task id and canonical
solution beside it). Does not run code: lockstep.evaluate.chat judges replies in the sandbox."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lockstep.data.snapshot import SnapshotWriter
from lockstep.data.sources.benchmarks import read_eval_split
from lockstep.data.sources.hub import HubFields
from lockstep.data.sources.size import SourceSize, eval_split_examples

KIND = "document"
EXTRA_FIELDS: tuple[str, ...] = ("task_id", "test", "entry_point", "canonical_solution")
EXPECTED = (
    "HumanEval rows: string fields `task_id`, `prompt`, `canonical_solution`, `test` (defining "
    "check(candidate)) and `entry_point`, as openai/openai_humaneval's openai_humaneval/test-*.parquet"
)
SPLIT = "test"


@dataclass(frozen=True)
class HumanevalConfig(HubFields):
    source: Literal["humaneval"] = "humaneval"
    dataset: str = "openai/openai_humaneval"
    config: str = "openai_humaneval"


def convert_row(row: dict[str, Any]) -> dict[str, Any] | str:
    """A HumanEval row as an eval item, or why it is not one."""
    for key in ("task_id", "prompt", "test", "entry_point"):
        if not isinstance(row.get(key), str) or not row[key].strip():
            return f"missing or empty {key!r}"
    if "def check(" not in row["test"]:
        return "`test` defines no check(candidate)"
    return {
        "text": row["prompt"],
        "task_id": row["task_id"],
        "test": row["test"],
        "entry_point": row["entry_point"],
        "canonical_solution": row.get("canonical_solution") if isinstance(row.get("canonical_solution"), str) else None,
    }


def produce(cfg: HumanevalConfig, sink: SnapshotWriter, *, seed: int) -> dict[str, Any]:
    return read_eval_split(cfg, sink, dataset=cfg.dataset, config=cfg.config, split=SPLIT, convert_row=convert_row,
                           expected=EXPECTED)


def size(cfg: HumanevalConfig, *, name: str, root: Path) -> SourceSize | None:
    """The published test size (eval only: val alone); ~400 tokens an item, from its items'
    characters at ~4.5 chars/token."""
    return eval_split_examples("humaneval", cfg.config, by_config={"openai_humaneval": 164}, tokens_per_example=400)
