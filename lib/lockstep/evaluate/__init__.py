"""Evaluation: the tasks a checkpoint is scored on and the sandbox that judges generated code. No
stage wiring or params reading (the eval stage's work is lockstep.pipeline.eval, which also reports
bits per byte through lockstep.train.bpb).

- `core`: CORE-style in-context tasks for base models, scored from logits
- `chat`: chat tasks (GSM8K-format, categorical choice, spelling, code), their answer checks and ChatCORE
- `benchmarks`: ChatCORE's benchmarks, one module each: kind, baseline, report column, reader, answer check
- `chatcore`: the one table of ChatCORE's benchmarks, and the ChatCORE score over them
- `sandbox`: runs model-written code in limited processes; `run_tests` judges a solution
- `containment`: the sandbox's OS half: namespaces, minimal root, syscall filter
"""
