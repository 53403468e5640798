"""GSM8K, ChatCORE's grade-school word problems, from a `gsm8k` snapshot (GSM8K-format problems):
a greedy reply, calculator tool on, is judged by its final number (baseline 0). The reward RL
trains on against the same references lives here too."""

from __future__ import annotations

from lockstep.evaluate.chat import Benchmark, extract_answer, problem_items, reply_is_answer

GSM8K = Benchmark(kind="generative", baseline=0.0, column="GSM8K", read=problem_items, check=reply_is_answer)


def reward(completion: str, reference_answer: str) -> float:
    """1.0 when the completion states the reference's final number in GSM8K form (`#### N`,
    commas and `$` ignored), else 0.0. Stricter than the eval's check, which also takes a reply's
    last number: RL rewards the answer format as well as the answer."""
    ref = extract_answer(reference_answer)
    if ref is None:
        raise ValueError(f"reference {reference_answer[-60:]!r} has no final number; drop the problem")
    if "####" not in completion:
        return 0.0
    return 1.0 if extract_answer(completion) == ref else 0.0
