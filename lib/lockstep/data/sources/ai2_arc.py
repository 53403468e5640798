"""ARC (`allenai/ai2_arc`, config `ARC-Easy` or `ARC-Challenge`): the test split's multiple-choice
science questions as eval items (snapshot documents: the question, its choices as a JSON list, the
answer's letter by position, A first, and the choices' own labels as a JSON list: ARC labels most
items A-D and some 1-4, and ChatCORE prompts with those labels, as nanochat does). Does not score:
see lockstep.evaluate.chat."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lockstep.core.config import FieldError
from lockstep.data.snapshot import SnapshotWriter
from lockstep.data.sources.benchmarks import choice_record, read_eval_split
from lockstep.data.sources.hub import HubFields
from lockstep.data.sources.size import SourceSize, eval_split_examples

KIND = "document"
EXTRA_FIELDS: tuple[str, ...] = ("choices", "answer", "labels", "id")
EXPECTED = (
    "ARC rows: `question` (string), `choices` {`text`: [strings], `label`: [strings]} and `answerKey` "
    "(one of the labels), as allenai/ai2_arc's <config>/test-*.parquet"
)
SPLIT = "test"
CONFIGS = ("ARC-Easy", "ARC-Challenge")


@dataclass(frozen=True)
class Ai2ArcConfig(HubFields):
    source: Literal["ai2_arc"] = "ai2_arc"
    dataset: str = "allenai/ai2_arc"
    config: str = "ARC-Easy"  # ARC-Easy or ARC-Challenge

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.config not in CONFIGS:
            raise FieldError("config", self.config, f"must be one of {list(CONFIGS)}, the two ARC sets")


def convert_row(row: dict[str, Any]) -> dict[str, Any] | str:
    """An ARC row as an eval item, or why it is not one."""
    choices = row.get("choices")
    if (
        not isinstance(choices, dict)
        or not isinstance(choices.get("text"), list)
        or not isinstance(choices.get("label"), list)
    ):
        return "`choices` must be {text: [...], label: [...]}"
    texts, labels = list(choices["text"]), [str(x) for x in choices["label"]]
    if len(texts) != len(labels):
        return f"{len(texts)} choice texts but {len(labels)} labels"
    key = row.get("answerKey")
    if str(key) not in labels:
        return f"answerKey {key!r} is none of the labels {labels}"
    return choice_record(row.get("question"), texts, labels.index(str(key)), labels=labels,
                         id=str(row.get("id") or ""))


def produce(cfg: Ai2ArcConfig, sink: SnapshotWriter, *, seed: int) -> dict[str, Any]:
    return read_eval_split(cfg, sink, dataset=cfg.dataset, config=cfg.config, split=SPLIT, convert_row=convert_row,
                           expected=EXPECTED)


def size(cfg: Ai2ArcConfig, *, name: str, root: Path) -> SourceSize | None:
    """The published test size of its config (eval only: val alone); ~50 tokens an item, from a
    few hundred items' characters at ~4.5 chars/token."""
    return eval_split_examples("ai2_arc", cfg.config, by_config={"ARC-Easy": 2_376, "ARC-Challenge": 1_172},
                               tokens_per_example=50)
