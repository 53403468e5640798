"""SpellingBee, ChatCORE's letter counting: conversations from a `spelling_bee` snapshot whose
last assistant turn ends `#### N`, judged by the final answer of a greedy reply (baseline 0)."""

from __future__ import annotations

from lockstep.evaluate.chat import Benchmark, conversation_items, reply_is_answer

SPELLING_BEE = Benchmark(kind="generative", baseline=0.0, column="SpellingBee", read=conversation_items,
                         check=reply_is_answer)
