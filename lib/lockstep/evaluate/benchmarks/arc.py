"""ARC (AI2 Reasoning Challenge), ChatCORE's ARC-Easy and ARC-Challenge: grade-school science
questions from an `ai2_arc` snapshot (one per config), answered with the preferred choice label,
ARC's own (A-D, or 1-4 on some items), as nanochat prompts them. ARC counts as a four-choice task
(baseline 0.25) whatever an item's number of choices, as nanochat counts it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lockstep.evaluate.chat import Benchmark, CategoricalItem, benchmark_categorical_items, letter_is_answer


def read_items(records: Iterable[dict[str, Any]]) -> list[CategoricalItem]:
    """An ARC snapshot's items with their choices' own labels. A snapshot fetched before the
    source kept the labels (no `labels` field) is refused: lettered by position, its items with
    1-4 labels would be prompted otherwise than nanochat prompts them."""
    records = list(records)
    if any(not r.get("labels") for r in records):
        raise ValueError(
            "this ARC snapshot has no `labels` field (fetched before the ai2_arc source kept ARC's own choice "
            "labels); fetch it again (`dvc repro fetch@<its name>`, e.g. fetch@arc_easy)"
        )
    return benchmark_categorical_items(records)


EASY = Benchmark(kind="categorical", baseline=0.25, column="ARC-Easy", read=read_items, check=letter_is_answer)
CHALLENGE = Benchmark(
    kind="categorical", baseline=0.25, column="ARC-Challenge", read=read_items, check=letter_is_answer
)
