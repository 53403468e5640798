"""Tokenizers behind one interface and the chat template: what every stage that loads a tokenizer
imports. Each kind's encoder and loader is imported here (bpe, hf, lz78, sentencepiece, char,
byte), so `load_tokenizer` reads any saved folder; the kinds' trainers and options are not: they
sit in `lockstep.tokenizer.kinds`' table, on the tokenizer stage's path only. Does not read raw
snapshots; `lockstep.tokenizer.pipeline` does that for the tokenizer stage."""

# Importing the encoder modules registers them with load_tokenizer; the heavy libraries (tiktoken,
# tokenizers, numba, sentencepiece) are imported only when a kind is used.
from lockstep.tokenizer import bpe, byte, char, hf, lz78, spm  # noqa: F401
from lockstep.tokenizer.base import (
    SPECIAL_TOKENS,
    ConversationError,
    NoPrefixTreeError,
    Tokenizer,
    TokenizerFileError,
    conversation_texts,
    load_tokenizer,
)

__all__ = [
    "SPECIAL_TOKENS",
    "ConversationError",
    "NoPrefixTreeError",
    "Tokenizer",
    "TokenizerFileError",
    "conversation_texts",
    "load_tokenizer",
]
