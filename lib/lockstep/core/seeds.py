"""Seeds derived from the params seed: the one place that says how a purpose (a batch, a rollout,
a held-out draw, a source's split, an eval draw) gets its own seed, so a value drawn anywhere
is a function of the params seed and the purpose alone, never of what ran before it. Two forms:
`derive_seed` hashes (training, RL), `stream_seed` is arithmetic (data and eval draws, whose
values predate the hash and stay as they were). Not a random number generator itself: callers
seed their own `torch.Generator` from what these return."""

from __future__ import annotations

import hashlib

import torch

_SEED_BITS = 63  # torch.Generator.manual_seed takes any int, but a positive int64 is portable


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from `parts` (a namespace first, then the params seed and indices): the first
    8 bytes, little-endian, of the sha256 of their `str()` joined by `:`. Hash-derived rather than
    arithmetic, so neighbouring parts (step 3 and step 4, seed 1 and seed 2) give unrelated seeds."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << _SEED_BITS) - 1)


def derived_generator(*parts: object) -> torch.Generator:
    """A CPU torch.Generator seeded with `derive_seed(*parts)`."""
    return torch.Generator().manual_seed(derive_seed(*parts))


def stream_seed(seed: int, stream: int, *, stride: int = 1_000_003) -> int:
    """`seed * stride + stream`: stream `stream` of the params seed. Streams of one seed never
    meet while `0 <= stream < stride`; each caller's stride is part of the values it has drawn
    (sources 1_000_003, eval example draws per rank 7919, cache splits 1), so
    it stays as it is."""
    return int(seed) * stride + stream


def stream_generator(seed: int, stream: int, *, stride: int = 1_000_003) -> torch.Generator:
    """A CPU torch.Generator seeded with `stream_seed(seed, stream, stride=stride)`."""
    return torch.Generator().manual_seed(stream_seed(seed, stream, stride=stride))
