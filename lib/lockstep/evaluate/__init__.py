"""Evaluation: CORE-style base-model tasks (`core`), chat tasks and ChatCORE (`chat`), the code
sandbox (`sandbox`), and the `eval@<stage>` pipeline (`run`), which also reports bits per byte
through lockstep.bpb. No stage wiring or params reading lives here."""
