"""The `byte` kind's trainer: there is nothing to learn; it checks its arguments and builds the
tokenizer. Only the tokenizer stage's path imports this module."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from lockstep.tokenizer.base import SPECIAL_TOKENS
from lockstep.tokenizer.byte import N_BYTES, ByteTokenizer
from lockstep.tokenizer.options import KindOptions


@dataclass(frozen=True)
class ByteOptions(KindOptions):
    """`tokenizer.options:` of kind byte: none; it reads no text and fixes its own size."""

    def learns(self) -> bool:
        return False


def train(texts: Iterable[str], *, vocab_size: int | None = None, **options: Any) -> ByteTokenizer:
    """The byte tokenizer: nothing to learn, `texts` are not read."""
    if options:
        raise ValueError(f"the byte tokenizer takes no options, got {sorted(options)}")
    fixed = N_BYTES + len(SPECIAL_TOKENS)
    if vocab_size is not None and vocab_size != fixed:
        raise ValueError(f"the byte tokenizer has exactly {fixed} ids; pass vocab_size=None (got {vocab_size})")
    return ByteTokenizer()
