"""Tokenizers behind one interface and the chat template: what every stage that loads a tokenizer
imports. Each kind's encoder and loader is imported here (bpe, hf, lz78, sentencepiece, char,
byte), so `load_tokenizer` reads any saved folder; the kinds' trainers and options are not: they
sit in `lockstep.tokenizer.kinds`' table, on the tokenizer stage's path only. Does not read raw
snapshots; `lockstep.pipeline.tokenizer` does that for the tokenizer stage.

- `base`: the interface every kind shares, the special tokens, the folder layout, chat rendering
- `bpe`: byte-level BPE learned with rustbpe, encoded with tiktoken
- `bpe_train`: the `bpe` kind's trainer and options
- `hf`: bpe's merges learned and encoded with Hugging Face tokenizers
- `hf_train`: the `hf` kind's trainer and options
- `lz78`: the LZ78 kind: a dictionary trie with byte fallback, its kernels, trainer and TSV files
- `spm`: SentencePiece BPE or unigram with byte fallback
- `spm_train`: the `sentencepiece` kind's trainer and options
- `char`: one id per byte value kept from the training corpus
- `char_train`: the `char` kind's trainer and options
- `byte`: id = byte value, nothing learnt
- `byte_train`: the `byte` kind's trainer and options
- `kinds`: the table of kinds (options, trainer, errors) and `train_tokenizer`; tokenizer stage only
- `options`: what every kind's options dataclass provides (`tokenizer.options:`)
- `prefix_tree`: every vocabulary's prefix chains, parents and last bytes
- `unicode`: text UTF-8 cannot hold, made encodable as tiktoken treats it
"""

# Importing the encoder modules registers them with load_tokenizer; the heavy libraries (tiktoken,
# tokenizers, numba, sentencepiece) are imported only when a kind is used.
from lockstep.tokenizer import bpe, byte, char, hf, lz78, spm  # noqa: F401
from lockstep.tokenizer.base import (
    SPECIAL_TOKENS,
    ConversationError,
    NoPrefixTreeError,
    NotProvidedError,
    Tokenizer,
    TokenizerFileError,
    conversation_texts,
    load_tokenizer,
)

__all__ = [
    "SPECIAL_TOKENS",
    "ConversationError",
    "NoPrefixTreeError",
    "NotProvidedError",
    "Tokenizer",
    "TokenizerFileError",
    "conversation_texts",
    "load_tokenizer",
]
