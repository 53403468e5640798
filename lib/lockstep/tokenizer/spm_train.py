"""The `sentencepiece` kind's trainer: SentencePiece's own, with normalization off and byte
fallback on. Only the tokenizer stage's path imports this module."""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from lockstep.tokenizer.base import SPECIAL_TOKENS
from lockstep.tokenizer.options import KindOptions
from lockstep.tokenizer.spm import SentencePieceTokenizer

# SentencePiece drops training sentences longer than max_sentence_length bytes; chunks stay below.
TRAIN_CHUNK_CHARS = 4096
MAX_SENTENCE_BYTES = 4 * TRAIN_CHUNK_CHARS


def _training_chunks(texts: Iterable[str]) -> Iterator[str]:
    """Lines with their newline kept (so the model learns newline pieces), long lines cut."""
    for text in texts:
        for line in text.splitlines(keepends=True):
            for start in range(0, len(line), TRAIN_CHUNK_CHARS):
                yield line[start : start + TRAIN_CHUNK_CHARS]


class SentencePieceTrainingError(ValueError):
    """SentencePiece's trainer refused the corpus with these settings, most often a vocab_size
    below the byte pieces, specials and distinct characters it must keep."""


@dataclass(frozen=True)
class SentencePieceOptions(KindOptions):
    """`tokenizer.options:` of kind sentencepiece."""

    MIN_VOCAB: ClassVar[int | None] = (
        1 + len(SPECIAL_TOKENS) + 256 + 1
    )  # <unk>, specials, byte pieces, one learned piece
    FORMER_KEYS: ClassVar[dict[str, str]] = {"spm_model_type": "model_type"}

    model_type: Literal["bpe", "unigram"] = "bpe"  # SentencePiece's model: bpe or unigram

    def train_kwargs(self, *, seed: int, root: Path) -> dict[str, Any]:
        return {"model_type": self.model_type, "seed": seed}


def train(
    texts: Iterable[str],
    *,
    vocab_size: int | None = None,
    model_type: Literal["bpe", "unigram"] = "bpe",
    character_coverage: float = 0.9995,
    num_threads: int = 1,
    seed: int | None = None,
    **options: Any,
) -> SentencePieceTokenizer:
    """Train a SentencePiece model (`model_type` bpe or unigram) with byte fallback and the special
    tokens as control symbols; `vocab_size` counts them all."""
    import sentencepiece

    if options:
        raise ValueError(
            f"unknown sentencepiece option(s) {sorted(options)}; "
            "valid: model_type, character_coverage, num_threads, seed"
        )
    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"sentencepiece model_type={model_type!r} must be 'bpe' or 'unigram'")
    min_vocab = 1 + len(SPECIAL_TOKENS) + 256 + 1
    if vocab_size is None or vocab_size < min_vocab:
        raise ValueError(
            f"sentencepiece vocab_size={vocab_size} must be at least {min_vocab} "
            "(<unk>, 9 special tokens, 256 byte pieces and one learned piece)"
        )
    buf = io.BytesIO()
    # SentencePiece's trainer has no seed flag in this version; shuffling and sampling are
    # turned off instead, which makes training a function of the corpus. `seed` is accepted
    # so callers can pass the params seed uniformly.
    del seed
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=_training_chunks(texts),
            model_writer=buf,
            model_type=model_type,
            vocab_size=vocab_size,
            hard_vocab_limit=False,
            control_symbols=list(SPECIAL_TOKENS),
            byte_fallback=True,
            unk_id=0,
            bos_id=-1,
            eos_id=-1,
            pad_id=-1,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            character_coverage=character_coverage,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=MAX_SENTENCE_BYTES,
            num_threads=num_threads,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise SentencePieceTrainingError(
            f"sentencepiece training failed: {e} (check vocab_size and character_coverage against the corpus)"
        ) from None
    return SentencePieceTokenizer(buf.getvalue())
