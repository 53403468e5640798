"""Evaluation: the tasks a checkpoint is scored on and the sandbox that judges generated code. No
stage wiring or params reading (the eval stage's work is lockstep.pipeline.eval, which also reports
bits per byte through lockstep.train.bpb).

- `core`: CORE-style in-context tasks for base models, scored from logits
- `chat`: chat tasks (GSM8K-format, categorical choice, spelling, code) and ChatCORE
- `sandbox`: runs model-written code in limited processes; `run_tests` judges a solution
- `containment`: the sandbox's OS half: namespaces, minimal root, syscall filter
"""
