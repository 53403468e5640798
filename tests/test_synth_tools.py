"""Every tool call the synthetic sources teach is one the engine can run: each `python` part,
evaluated by the calculator, gives exactly the `python_output` part that follows it."""

from __future__ import annotations

from pathlib import Path

import pytest

from lockstep.core.config import build_config
from lockstep.data.records import problem_to_conversation
from lockstep.data.sources import fetch_source, iter_records, SOURCE_CONFIGS
from lockstep.infer.calculator import evaluate


@pytest.mark.parametrize("source", ["synth_chat", "synth_math"])
def test_tool_calls_evaluate_to_their_outputs(tmp_path: Path, source: str) -> None:
    cfg = build_config(SOURCE_CONFIGS[source], {"source": source, "n_train": 300, "n_val": 10}, where="fetch")
    fetch_source(source, cfg, tmp_path / source, seed=3)
    calls = 0
    for split in ("train", "val"):
        for rec in iter_records(tmp_path / source, split):
            conv = rec if "messages" in rec else problem_to_conversation(rec)
            for msg in conv["messages"]:
                parts = msg["content"]
                for part, nxt in zip(parts, parts[1:]):
                    if part["type"] == "python":
                        calls += 1
                        assert nxt["type"] == "python_output", part
                        assert evaluate(part["text"]) == nxt["text"], (part["text"], nxt["text"])
    assert calls > 100
