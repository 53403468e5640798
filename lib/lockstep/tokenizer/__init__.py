"""Tokenizers behind one interface (bpe, sentencepiece, char, byte) and the chat template. Does not
read raw snapshots; `lockstep.tokenizer.pipeline` does that for the tokenizer stage."""

from lockstep.tokenizer import byte as _byte  # noqa: F401  (registers the kind)
from lockstep.tokenizer.base import (
    SPECIAL_TOKENS,
    ConversationError,
    Tokenizer,
    TokenizerFileError,
    conversation_texts,
    load_tokenizer,
    train_tokenizer,
)

__all__ = [
    "SPECIAL_TOKENS",
    "ConversationError",
    "Tokenizer",
    "TokenizerFileError",
    "conversation_texts",
    "load_tokenizer",
    "train_tokenizer",
]
