"""The `hf` kind's trainer: Hugging Face `tokenizers`' BPE trainer over the byte values of the
split chunks, written back in the ByteLevel alphabet (why: lockstep.tokenizer.hf). Only the
tokenizer stage's path imports this module."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from lockstep.tokenizer.base import SPECIAL_TOKENS
from lockstep.tokenizer.bpe import N_BYTES, SPLIT_PATTERN
from lockstep.tokenizer.hf import HFTokenizer, _hf
from lockstep.tokenizer.options import KindOptions

# Joins a text's chunks for the trainer. Byte 0xFF never occurs in UTF-8, so as a Latin-1
# character it cannot be part of a chunk; U+DCFF is what encodes to it under surrogateescape.
_CHUNK_JOIN = "\udcff"
_CHUNK_SEP = "\xff"


@dataclass(frozen=True)
class HFOptions(KindOptions):
    """`tokenizer.options:` of kind hf: none (bpe's split pattern, see docs/tokenizers.md)."""

    MIN_VOCAB: ClassVar[int | None] = N_BYTES + len(SPECIAL_TOKENS)


def train(
    texts: Iterable[str], *, vocab_size: int | None = None, pattern: str = SPLIT_PATTERN, **options: Any
) -> HFTokenizer:
    """Learn byte-level BPE with `tokenizers`' trainer, each chunk handed over as its bytes read as
    Latin-1 characters (see lockstep.tokenizer.hf); `vocab_size` counts the 9 special tokens."""
    if options:
        raise ValueError(f"unknown hf tokenizer option(s) {sorted(options)}; the only option is pattern")
    min_vocab = N_BYTES + len(SPECIAL_TOKENS)
    if vocab_size is None or vocab_size < min_vocab:
        raise ValueError(
            f"hf vocab_size={vocab_size} must be at least {min_vocab} (256 byte tokens + 9 special tokens)"
        )
    hf = _hf()
    splitter = hf.pre_tokenizers.Split(hf.Regex(pattern), behavior="isolated")
    alphabet = [chr(b) for b in range(N_BYTES)]
    trainer_tok = hf.Tokenizer(hf.models.BPE())
    trainer_tok.pre_tokenizer = hf.pre_tokenizers.Split(_CHUNK_SEP, behavior="removed")
    trainer = hf.trainers.BpeTrainer(
        # The special tokens are added after the learned ranks, so learn vocab_size - 9.
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=0,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=alphabet,
    )
    trainer_tok.train_from_iterator(_latin1_chunks(texts, splitter), trainer=trainer)
    learned = json.loads(trainer_tok.to_str())["model"]
    # The trainer numbered its alphabet by code point, which is byte order here.
    assert all(learned["vocab"][c] == b for b, c in enumerate(alphabet)), (
        "tokenizers numbered the alphabet out of byte order"
    )
    ranks = {t.encode("latin-1"): i for t, i in learned["vocab"].items()}
    merges = [(a.encode("latin-1"), b.encode("latin-1")) for a, b in learned["merges"]]
    return HFTokenizer(ranks, merges, pattern)


def _latin1_chunks(texts: Iterable[str], splitter: Any) -> Iterator[str]:
    """Each text as its split chunks, every chunk's UTF-8 bytes read as Latin-1 characters, the
    chunks joined by the 0xFF character (which the trainer's pre-tokenizer splits on)."""
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"hf training texts must be str, got {type(text).__name__}")
        chunks = [piece for piece, _ in splitter.pre_tokenize_str(text)]
        yield _CHUNK_JOIN.join(chunks).encode("utf-8", "surrogateescape").decode("latin-1")
