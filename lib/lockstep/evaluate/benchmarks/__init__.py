"""ChatCORE's benchmarks, one module each: what the benchmark is, in one `Benchmark`
(lockstep.evaluate.chat): its kind, its random-guess baseline, its report column, the reader that
turns its snapshot's val records into items and its answer check. Each is registered by one line in
lockstep.evaluate.chatcore.BENCHMARKS; nothing else names a benchmark.

- `arc`: ARC-Easy and ARC-Challenge, four-choice questions answered with a letter
- `mmlu`: MMLU, four-choice questions over 57 subjects answered with a letter
- `gsm8k`: GSM8K word problems judged by their final number; the reward RL trains on
- `humaneval`: HumanEval functions judged by their tests in the sandbox
- `spelling_bee`: SpellingBee letter counts judged by their final number
"""
