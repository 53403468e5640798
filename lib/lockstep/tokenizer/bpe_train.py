"""The `bpe` kind's trainer: rustbpe learns the merges; the tokenizer (`lockstep.tokenizer.bpe`)
encodes with tiktoken. Only the tokenizer stage's path imports this module."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from lockstep.tokenizer.base import SPECIAL_TOKENS
from lockstep.tokenizer.bpe import N_BYTES, SPLIT_PATTERN, BPETokenizer
from lockstep.tokenizer.options import KindOptions

# Texts rustbpe reads per batch (its `buffer_size`).
TRAIN_BUFFER_TEXTS = 8192


@dataclass(frozen=True)
class BPEOptions(KindOptions):
    """`tokenizer.options:` of kind bpe: none (the split pattern is fixed, see docs/tokenizers.md)."""

    MIN_VOCAB: ClassVar[int | None] = N_BYTES + len(SPECIAL_TOKENS)


def train(
    texts: Iterable[str], *, vocab_size: int | None = None, pattern: str = SPLIT_PATTERN, **options: Any
) -> BPETokenizer:
    """Learn byte-level BPE ranks with rustbpe on the chunks `pattern` splits `texts` into;
    `vocab_size` counts the 9 special tokens, which take the ids after the ranks."""
    import rustbpe

    if options:
        raise ValueError(f"unknown bpe tokenizer option(s) {sorted(options)}; the only option is pattern")
    min_vocab = N_BYTES + len(SPECIAL_TOKENS)
    if vocab_size is None or vocab_size < min_vocab:
        raise ValueError(
            f"bpe vocab_size={vocab_size} must be at least {min_vocab} (256 byte tokens + 9 special tokens)"
        )
    trainer = rustbpe.Tokenizer()
    # The special tokens are appended after the learned ranks, so learn vocab_size - 9.
    trainer.train_from_iterator(
        iter(texts), vocab_size=vocab_size - len(SPECIAL_TOKENS), buffer_size=TRAIN_BUFFER_TEXTS, pattern=pattern
    )
    ranks = {bytes(token): int(rank) for token, rank in trainer.get_mergeable_ranks()}
    return BPETokenizer(ranks, pattern)
