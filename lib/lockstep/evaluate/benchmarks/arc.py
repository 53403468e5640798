"""ARC (AI2 Reasoning Challenge), ChatCORE's ARC-Easy and ARC-Challenge: grade-school science
questions from an `ai2_arc` snapshot (one per config), answered with the preferred choice letter.
ARC counts as a four-choice task (baseline 0.25) whatever an item's number of choices, as nanochat
counts it."""

from __future__ import annotations

from lockstep.evaluate.chat import Benchmark, benchmark_categorical_items, letter_is_answer

EASY = Benchmark(kind="categorical", baseline=0.25, column="ARC-Easy", read=benchmark_categorical_items,
                 check=letter_is_answer)
CHALLENGE = Benchmark(kind="categorical", baseline=0.25, column="ARC-Challenge", read=benchmark_categorical_items,
                      check=letter_is_answer)
