"""Tokenizers behind one interface (bpe, hf, lz78, sentencepiece, char, byte) and the chat template. Does not
read raw snapshots; `lockstep.tokenizer.pipeline` does that for the tokenizer stage."""

# Importing the kind modules registers them with load_tokenizer/train_tokenizer; the heavy
# libraries (tiktoken, rustbpe, tokenizers, numba, sentencepiece) are imported only when a kind is used.
from lockstep.tokenizer import bpe as _bpe  # noqa: F401
from lockstep.tokenizer import byte as _byte  # noqa: F401
from lockstep.tokenizer import char as _char  # noqa: F401
from lockstep.tokenizer import hf as _hf  # noqa: F401
from lockstep.tokenizer import lz78 as _lz78  # noqa: F401
from lockstep.tokenizer import spm as _spm  # noqa: F401
from lockstep.tokenizer.base import (
    SPECIAL_TOKENS,
    ConversationError,
    NoPrefixTreeError,
    Tokenizer,
    TokenizerFileError,
    conversation_texts,
    load_tokenizer,
    train_tokenizer,
)

__all__ = [
    "SPECIAL_TOKENS",
    "ConversationError",
    "NoPrefixTreeError",
    "Tokenizer",
    "TokenizerFileError",
    "conversation_texts",
    "load_tokenizer",
    "train_tokenizer",
]
