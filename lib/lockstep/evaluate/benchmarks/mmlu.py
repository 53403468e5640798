"""MMLU, ChatCORE's four-choice questions over 57 subjects, from an `mmlu` snapshot, answered with
the preferred choice letter (baseline 0.25, as nanochat counts it)."""

from __future__ import annotations

from lockstep.evaluate.chat import Benchmark, benchmark_categorical_items, letter_is_answer

MMLU = Benchmark(kind="categorical", baseline=0.25, column="MMLU", read=benchmark_categorical_items,
                 check=letter_is_answer)
