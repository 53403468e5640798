"""Evaluation: bits per byte (`bpb`), CORE-style base-model tasks (`core`), chat tasks and
ChatCORE (`chat`), and the code sandbox (`sandbox`). No stage wiring or file layout lives here."""
