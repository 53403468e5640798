"""databricks-dolly-15k (instruction, context, response, category) as conversation records: the
user turn is the instruction (with its context after a blank line), the assistant turn the
response. Not a general instruction-format reader."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lockstep.data.snapshot import SnapshotWriter
from lockstep.data.sources.hub import HubFields, rows_by_split
from lockstep.data.sources.size import SourceSize, published_examples

KIND = "conversation"
EXTRA_FIELDS: tuple[str, ...] = ()
EXPECTED = (
    "databricks-dolly-15k rows: JSON lines or parquet rows with string fields `instruction` and `response` "
    "(and `context`, which may be empty)"
)


@dataclass(frozen=True)
class Dolly15kConfig(HubFields):
    source: Literal["dolly15k"] = "dolly15k"
    dataset: str = "databricks/databricks-dolly-15k"


def row_to_conversation(row: dict[str, Any]) -> dict[str, Any] | str:
    """The conversation for one dolly row, or the reason it is unusable."""
    for key in ("instruction", "response"):
        if not isinstance(row.get(key), str):
            return f"missing field {key!r}"
        if not row[key].strip():
            return f"empty {key!r}"
    context = row.get("context")
    if context is not None and not isinstance(context, str):
        return "field 'context' must be a string"
    user = row["instruction"].strip()
    if context and context.strip():
        user = f"{user}\n\n{context.strip()}"
    return {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": user}]},
            {"role": "assistant", "content": [{"type": "text", "text": row["response"].strip()}]},
        ]
    }


def produce(cfg: Dolly15kConfig, sink: SnapshotWriter, *, seed: int) -> dict[str, Any]:
    def convert(where: str, row: dict[str, Any]) -> dict[str, Any] | None:
        out = row_to_conversation(row)
        if isinstance(out, str):
            sink.bad(where, out)
            return None
        return out

    # The hub has one `train` split and no val: val is a seeded `val_frac` share of it, locally too.
    return rows_by_split(cfg, sink, dataset=cfg.dataset, config=None, hub_splits={"train": "train"}, convert=convert,
                         expected=EXPECTED, seed=seed)


def size(cfg: Dolly15kConfig, *, name: str, root: Path) -> SourceSize:
    """databricks-dolly-15k's published size."""
    return published_examples("dolly15k", examples=15_011, tokens_per_example=230, val_frac=cfg.val_frac)
