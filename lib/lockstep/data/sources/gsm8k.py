"""GSM8K (`openai/gsm8k`, config `main`) as problem records, and the reader of a solution's final
`####` answer that decides whether a row is a usable problem. Does not grade or sample; a
problem becomes a conversation through lockstep.data.records."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lockstep.data.snapshot import SnapshotWriter
from lockstep.data.sources.hub import HubFields, rows_by_split
from lockstep.data.sources.size import SourceSize, published_examples

KIND = "problem"
EXTRA_FIELDS: tuple[str, ...] = ()
EXPECTED = (
    "GSM8K problems: JSON lines or parquet rows with string fields `question` and `answer`, the answer "
    "ending in a `#### <number>` line"
)
# Our split <- the hub's: GSM8K's test split is the eval set, so it becomes val, never train.
HUB_SPLITS = {"train": "train", "val": "test"}

_FINAL = re.compile(r"####\s*(.+?)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Gsm8kConfig(HubFields):
    source: Literal["gsm8k"] = "gsm8k"
    dataset: str = "openai/gsm8k"
    config: str = "main"  # `main` (calculator annotations) or `socratic`


def final_answer(text: str) -> str | None:
    """The number after the last `####` in `text`, commas and a leading `$` removed; None when
    there is no `####` line or nothing numeric follows it."""
    matches = _FINAL.findall(text)
    if not matches:
        return None
    value = matches[-1].replace(",", "").replace("$", "").strip()
    m = re.fullmatch(r"-?\d+(?:\.\d+)?", value)
    if m is None:
        return None
    if "." in value:
        value = value.rstrip("0").rstrip(".")
    return value


def check_problem(row: dict[str, Any]) -> str | None:
    """Why `row` is not a usable problem, or None."""
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str):
            return f"missing field {key!r}"
        if not row[key].strip():
            return f"empty {key!r}"
    if final_answer(row["answer"]) is None:
        return "answer has no final `#### <number>` line"
    return None


def produce(cfg: Gsm8kConfig, sink: SnapshotWriter, *, seed: int) -> dict[str, Any]:
    def convert(where: str, row: dict[str, Any]) -> dict[str, Any] | None:
        reason = check_problem(row)
        if reason is not None:
            sink.bad(where, reason)
            return None
        return {"question": row["question"], "answer": row["answer"]}

    return rows_by_split(
        cfg, sink, dataset=cfg.dataset, config=cfg.config,
        hub_splits=HUB_SPLITS, convert=convert, expected=EXPECTED, seed=seed,
    )


def size(cfg: Gsm8kConfig, *, name: str, root: Path) -> SourceSize:
    """GSM8K's published train and test sizes."""
    return published_examples(
        "gsm8k", examples=7_473, val_examples=1_319, tokens_per_example=180, val_frac=cfg.val_frac
    )
