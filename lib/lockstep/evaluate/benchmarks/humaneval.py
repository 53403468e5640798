"""HumanEval, ChatCORE's code benchmark: a function to complete from its signature and docstring,
from a `humaneval` snapshot; a greedy reply passes when the item's tests, run in the sandbox,
reach their last line. No chance level (baseline 0)."""

from __future__ import annotations

from lockstep.evaluate.chat import Benchmark, benchmark_code_items, passes_tests

HUMANEVAL = Benchmark(kind="code", baseline=0.0, column="HumanEval", read=benchmark_code_items, check=passes_tests)
