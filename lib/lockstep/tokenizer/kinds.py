"""The table of tokenizer kinds: each kind's name, its options (the `tokenizer.options:` params of
that kind) and its trainer, and `train_tokenizer`, which trains any of them. A kind registers here
with one line. Only the tokenizer stage's path imports this module and the trainers it names; the
stages that load a tokenizer reach each kind's encoder through `lockstep.tokenizer` alone, so
editing a trainer reruns the tokenizer stage and nothing else."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from lockstep.tokenizer import bpe_train, byte_train, char_train, hf_train, spm_train
from lockstep.tokenizer.base import Tokenizer
from lockstep.tokenizer.lz78 import LZ78VocabError
from lockstep.tokenizer.lz78 import train as lz78_train
from lockstep.tokenizer.lz78.tsv import LZ78DictionaryError
from lockstep.tokenizer.options import KindOptions


@dataclass(frozen=True)
class TokenizerKind:
    """One kind: `options`, its `KindOptions` dataclass; `train(texts, *, vocab_size, **kwargs)`,
    its trainer, which returns the kind's Tokenizer (whose class, registered with
    `lockstep.tokenizer.base.register_kind`, loads the saved folder); `errors`, the exceptions
    its trainer raises for bad input, whose messages say what to fix (the stage prints them as one
    `error:` line)."""

    options: type[KindOptions]
    train: Callable[..., Tokenizer]
    errors: tuple[type[Exception], ...] = ()


KINDS: dict[str, TokenizerKind] = {
    "bpe": TokenizerKind(bpe_train.BPEOptions, bpe_train.train),
    "hf": TokenizerKind(hf_train.HFOptions, hf_train.train),
    "lz78": TokenizerKind(lz78_train.LZ78Options, lz78_train.train, (LZ78VocabError, LZ78DictionaryError)),
    "sentencepiece": TokenizerKind(
        spm_train.SentencePieceOptions, spm_train.train, (spm_train.SentencePieceTrainingError,)
    ),
    "char": TokenizerKind(char_train.CharOptions, char_train.train),
    "byte": TokenizerKind(byte_train.ByteOptions, byte_train.train),
}


def tokenizer_kind(name: str) -> TokenizerKind:
    """The registered kind `name`; ValueError naming the kinds there are."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown tokenizer kind {name!r}; use one of {sorted(KINDS)}") from None


def training_errors() -> tuple[type[Exception], ...]:
    """Every kind's user-facing training errors, for the tokenizer stage's entry."""
    return tuple(dict.fromkeys(e for kind in KINDS.values() for e in kind.errors))


def train_tokenizer(kind: str, texts: Iterable[str], *, vocab_size: int | None = None, **kwargs: Any) -> Tokenizer:
    """Train a tokenizer of `kind` on `texts`. `vocab_size` counts the special tokens; kinds that
    fix their own size (char, byte) take None. `kwargs` go to the kind's trainer (e.g. char's
    `max_alphabet`, lz78's `strategy`); the params path builds them from the kind's options."""
    return tokenizer_kind(kind).train(texts, vocab_size=vocab_size, **kwargs)
