"""The chat benchmarks' part of the hub-layout samples under `corpus/hub/` (lockstep.dev.hub_samples
writes and checks them with the rest): ARC (`allenai/ai2_arc`), MMLU (`cais/mmlu`) and HumanEval
(`openai/openai_humaneval`) in each dataset's own file names, columns and dtypes, filled with the
project's own items: the grade-school questions and HumanEval-format functions of the shipped eval
sets (lockstep.dev.evalsets_build), in disjoint slices so that no item sits in two samples. Every
split the hub has is written, so that a fetch reads the eval split (`test`) among the others as it
does a download; MMLU's `auxiliary_train` split (a 100k-row training set) is left out. SpellingBee
needs no sample: it is generated. A dev tool: no stage imports it."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from lockstep.dev.evalsets_build import arc_items, code_items

ARC = "ai2_arc"  # allenai/ai2_arc: <config>/{train,validation,test}-00000-of-00001.parquet
MMLU = "mmlu"  # cais/mmlu: all/{test,validation,dev}-00000-of-00001.parquet
HUMANEVAL = "openai_humaneval"  # openai/openai_humaneval: openai_humaneval/test-00000-of-00001.parquet

ARC_CONFIGS = ("ARC-Easy", "ARC-Challenge")
ARC_SPLITS = {"train": 6, "validation": 6, "test": 24}  # items per split of each config
MMLU_SPLITS = {"dev": 5, "validation": 8, "test": 40}
HUMANEVAL_PROBLEMS = 24

ARC_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("question", pa.string()),
    ("choices", pa.struct([("text", pa.list_(pa.string())), ("label", pa.list_(pa.string()))])),
    ("answerKey", pa.string()),
])
MMLU_SCHEMA = pa.schema([
    ("question", pa.string()), ("subject", pa.string()), ("choices", pa.list_(pa.string())), ("answer", pa.int64()),
])
HUMANEVAL_SCHEMA = pa.schema([
    ("task_id", pa.string()), ("prompt", pa.string()), ("canonical_solution", pa.string()), ("test", pa.string()),
    ("entry_point", pa.string()),
])


def _slices() -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The own four-choice items cut into the ARC and MMLU splits, in order, none reused."""
    items, at, out = arc_items(), 0, {}
    for key, n in [*(((c, s), n) for c in ARC_CONFIGS for s, n in ARC_SPLITS.items()),
                   *(((MMLU, s), n) for s, n in MMLU_SPLITS.items())]:
        out[key] = items[at: at + n]
        at += n
    if at > len(items):
        raise ValueError(f"the own eval set holds {len(items)} four-choice items, the samples need {at}")
    return out


def arc_rows(config: str, split: str) -> list[dict[str, Any]]:
    """ARC rows: every seventh item labels its choices 1-4, as some ARC items do."""
    rows = []
    for i, item in enumerate(_slices()[(config, split)]):
        labels = ["1", "2", "3", "4"] if i % 7 == 3 else ["A", "B", "C", "D"]
        rows.append({"id": f"Lockstep_{config}_{split}_{i}", "question": item["question"],
                     "choices": {"text": list(item["choices"]), "label": labels},
                     "answerKey": labels["ABCD".index(item["answer"])]})
    return rows


def mmlu_rows(split: str) -> list[dict[str, Any]]:
    """MMLU rows; the subject from the question (arithmetic or not), the answer an index."""
    return [
        {
            "question": item["question"],
            "subject": "elementary_mathematics" if any(c.isdigit() for c in item["question"]) else "conceptual_physics",
            "choices": list(item["choices"]),
            "answer": "ABCD".index(item["answer"]),
        }
        for item in _slices()[(MMLU, split)]
    ]


def humaneval_rows() -> list[dict[str, Any]]:
    return [{k: item[k] for k in HUMANEVAL_SCHEMA.names} for item in code_items()[:HUMANEVAL_PROBLEMS]]


def chat_sample_files() -> list[tuple[str, list[dict[str, Any]], pa.Schema]]:
    """(path under corpus/hub/, rows, parquet schema) of every chat benchmark sample."""
    return [
        *(
            (f"{ARC}/{c}/{s}-00000-of-00001.parquet", arc_rows(c, s), ARC_SCHEMA)
            for c in ARC_CONFIGS
            for s in ARC_SPLITS
        ),
        *((f"{MMLU}/all/{s}-00000-of-00001.parquet", mmlu_rows(s), MMLU_SCHEMA) for s in MMLU_SPLITS),
        (f"{HUMANEVAL}/openai_humaneval/test-00000-of-00001.parquet", humaneval_rows(), HUMANEVAL_SCHEMA),
    ]
