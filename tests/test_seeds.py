"""Derived seeds (lockstep.core.seeds): pinned values, so that moving a derivation behind the helper
can never change a batch, a rollout or a held-out draw of an existing run."""

from __future__ import annotations

import hashlib

import torch

from lockstep.core.seeds import derive_seed, derived_generator
from lockstep.rl.trainer import _derived_seed
from lockstep.train.trainer import batch_generator


def _sha_seed(text: str) -> int:
    """The formula train and rl wrote out before the helper existed."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def test_pinned_values() -> None:
    assert derive_seed("lockstep-batch", 5, 0, 0) == 5705822475937256155
    assert derive_seed("lockstep-batch", 5, -1, 3) == 3182660058102209072  # validation windows use step -1
    assert derive_seed("lockstep-rl", 5, "draw", 2) == 5047197747111742716
    assert derive_seed("lockstep-rl", 1, 0) == 417440534455450514


def test_training_and_rl_seeds_are_the_former_formulas() -> None:
    for seed, step, micro in [(5, 0, 0), (0, 12, 7), (1234, -1, 40)]:
        expected = torch.Generator().manual_seed(_sha_seed(f"lockstep-batch:{seed}:{step}:{micro}"))
        assert torch.equal(torch.randint(0, 1 << 30, (8,), generator=batch_generator(seed, step, micro)),
                           torch.randint(0, 1 << 30, (8,), generator=expected))
    for parts in [(5, 3), (5, "eval", 9), (7, "roll", 0), (7, "draw", 11)]:
        assert _derived_seed(*parts) == _sha_seed(":".join(str(p) for p in ("lockstep-rl", *parts)))


def test_seeds_fit_a_generator_and_differ_by_part() -> None:
    seeds = {derive_seed("ns", 0, i) for i in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 1 << 63 for s in seeds)
    assert torch.equal(
        torch.rand(4, generator=derived_generator("ns", 1)), torch.rand(4, generator=derived_generator("ns", 1))
    )


def test_stream_seeds_are_the_former_formulas() -> None:
    """Sources (seed * 1_000_003 + i), eval draws per rank (seed * 7919 + rank)
    and cache splits (seed + offset) draw exactly what they drew before the helper."""
    from lockstep.core.seeds import stream_generator, stream_seed

    assert stream_seed(42, 3) == 42 * 1_000_003 + 3
    assert stream_seed(42, 1, stride=7919) == 42 * 7919 + 1
    assert stream_seed(42, 1, stride=1) == 43
    for (seed, stream, stride), former in [
        ((7, 2, 1_000_003), 7 * 1_000_003 + 2),
        ((7, 1, 7919), 7 * 7919 + 1),
        ((7, 1, 1), 8),
    ]:
        assert torch.equal(torch.rand(4, generator=stream_generator(seed, stream, stride=stride)),
                           torch.rand(4, generator=torch.Generator().manual_seed(former)))
