"""What every tokenizer kind's options dataclass provides: the `tokenizer.options:` params of that
kind, checked like any params section, and how they become its trainer's arguments. On the
tokenizer stage's path only (each kind's trainer module derives its options from `KindOptions`);
the stages that load a tokenizer never read these params."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar


@dataclass(frozen=True)
class KindOptions:
    """Base of a kind's options: a frozen dataclass whose fields (with defaults) are the keys of
    `tokenizer.options:` when `tokenizer.kind` names that kind. Its `__post_init__` refuses bad
    values with `lockstep.core.config.FieldError` / `check_range`, naming the field; the tokenizer
    section prefixes `tokenizer.options.`. A kind without options uses this class as it is."""

    # The smallest `tokenizer.vocab_size` the kind's trainer can fill (its trainer refuses less);
    # None for a kind that fixes its own size and takes vocab_size=None.
    MIN_VOCAB: ClassVar[int | None] = None
    # Flat `tokenizer.<key>` params of this kind from before kinds had their own section, mapped
    # to the option that replaced each: such a key is refused with its new place.
    FORMER_KEYS: ClassVar[Mapping[str, str]] = {}

    def learns(self) -> bool:
        """Whether training reads train text (so `tokenizer.train_sources` must name a source)."""
        return True

    def uses_vocab_size(self) -> bool:
        """Whether `tokenizer.vocab_size` decides the size (else the trainer gets vocab_size=None)."""
        return self.MIN_VOCAB is not None

    def train_kwargs(self, *, seed: int, root: Path) -> dict[str, Any]:
        """Keyword arguments for the kind's trainer beyond texts and vocab_size. `seed` is the
        params' data seed; `root` the project folder, for options that name a file in it."""
        return {}
