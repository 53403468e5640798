"""The `char` kind's trainer: count the bytes of the text and keep an alphabet of them. Only the
tokenizer stage's path imports this module."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from lockstep.core.config import check_range
from lockstep.tokenizer.char import CHAR_ORDERS, DEFAULT_MAX_ALPHABET, CharOrder, CharTokenizer
from lockstep.tokenizer.options import KindOptions


@dataclass(frozen=True)
class CharOptions(KindOptions):
    """`tokenizer.options:` of kind char."""

    FORMER_KEYS: ClassVar[dict[str, str]] = {"char_max_alphabet": "max_alphabet", "char_order": "order",
                                             "char_specials": "specials"}  # fmt: skip

    max_alphabet: int = DEFAULT_MAX_ALPHABET  # most distinct bytes kept
    # which distinct bytes the cap keeps, the most frequent ("frequency") or the lowest byte values
    # ("sorted", the reference rule of char-level parity runs); ids follow byte order either way
    order: CharOrder = "frequency"
    # append the 9 special tokens. false gives exactly one id per kept byte, for id parity with
    # references that have none; such a tokenizer has no <|bos|> or chat template, so the cache,
    # training and chat stages refuse it
    specials: bool = True

    def __post_init__(self) -> None:
        check_range("max_alphabet", self.max_alphabet, ge=1, le=256, why="distinct byte values a char tokenizer keeps")

    def train_kwargs(self, *, seed: int, root: Path) -> dict[str, Any]:
        return {"max_alphabet": self.max_alphabet, "order": self.order, "specials": self.specials}


def train(
    texts: Iterable[str],
    *,
    vocab_size: int | None = None,
    max_alphabet: int = DEFAULT_MAX_ALPHABET,
    order: CharOrder = "frequency",
    specials: bool = True,
    **options: Any,
) -> CharTokenizer:
    """The distinct bytes of `texts`, at most `max_alphabet` of them chosen by `order`, as ids in
    byte order; the special tokens after them unless `specials` is false."""
    if options:
        raise ValueError(f"unknown char tokenizer option(s) {sorted(options)}; valid: max_alphabet, order, specials")
    if order not in CHAR_ORDERS:
        raise ValueError(f"char order={order!r} must be one of {list(CHAR_ORDERS)}")
    if vocab_size is not None:
        raise ValueError(
            f"the char tokenizer's size comes from its corpus (capped by max_alphabet={max_alphabet}); "
            f"pass vocab_size=None (got {vocab_size})"
        )
    if not 1 <= max_alphabet <= 256:
        raise ValueError(f"max_alphabet={max_alphabet} must be between 1 and 256")
    counts = np.zeros(256, dtype=np.int64)
    for text in texts:
        counts += np.bincount(np.frombuffer(text.encode("utf-8"), dtype=np.uint8), minlength=256)
    seen = np.flatnonzero(counts)
    if seen.size == 0:
        raise ValueError("the char tokenizer needs a non-empty training corpus")
    if order == "sorted":
        keep = seen[:max_alphabet]  # flatnonzero is ascending: the lowest byte values
    else:
        # Stable sort on -count keeps the lower byte value first among equal counts.
        keep = np.argsort(-counts, kind="stable")[: min(max_alphabet, seen.size)]
    return CharTokenizer(sorted(int(b) for b in keep), order=order, specials=specials)
