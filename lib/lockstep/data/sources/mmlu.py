"""MMLU (`cais/mmlu`, config `all`: the 57 subjects in one table): the test split's four-choice
questions as eval items (snapshot documents: the question, its choices as a JSON list, the answer
letter and the subject). Does not score: see lockstep.evaluate.chat."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lockstep.data.snapshot import SnapshotWriter
from lockstep.data.sources.benchmarks import choice_record, read_eval_split
from lockstep.data.sources.hub import HubFields
from lockstep.data.sources.size import SourceSize, eval_split_examples

KIND = "document"
EXTRA_FIELDS: tuple[str, ...] = ("choices", "answer", "subject")
EXPECTED = (
    "MMLU rows: `question` (string), `subject` (string), `choices` ([strings]) and `answer` (the right "
    "choice's index, an integer), as cais/mmlu's all/test-*.parquet"
)
SPLIT = "test"


@dataclass(frozen=True)
class MmluConfig(HubFields):
    source: Literal["mmlu"] = "mmlu"
    dataset: str = "cais/mmlu"
    config: str = "all"  # `all`, or one subject's config (e.g. `anatomy`)


def convert_row(row: dict[str, Any]) -> dict[str, Any] | str:
    """An MMLU row as an eval item, or why it is not one."""
    answer = row.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, int):
        return f"`answer` must be the right choice's index (an integer), got {answer!r}"
    return choice_record(row.get("question"), row.get("choices"), answer, subject=str(row.get("subject") or ""))


def produce(cfg: MmluConfig, sink: SnapshotWriter, *, seed: int) -> dict[str, Any]:
    return read_eval_split(cfg, sink, dataset=cfg.dataset, config=cfg.config, split=SPLIT, convert_row=convert_row,
                           expected=EXPECTED)


def size(cfg: MmluConfig, *, name: str, root: Path) -> SourceSize | None:
    """The published test size of `all` (eval only: val alone; a single subject's is not listed);
    ~130 tokens an item, from a few hundred items' characters at ~4.5 chars/token."""
    return eval_split_examples("mmlu", cfg.config, by_config={"all": 14_042}, tokens_per_example=130)
