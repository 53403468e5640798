"""The `sentencepiece` tokenizer: SentencePiece BPE or unigram with byte fallback and the special
tokens as control symbols (never matched in text). Saved as the .model protobuf. Does not read
corpora from disk.

Normalization is off (identity rule, no dummy prefix, whitespace kept) so that decode(encode(x))
gives x back. SentencePiece writes spaces as U+2581 internally; a literal U+2581 in the text is
therefore encoded through its byte-fallback pieces, which decode back to U+2581.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lockstep.tokenizer.base import SPECIAL_TOKENS, Tokenizer, TokenizerFileError, decode_with_specials, register_kind

MODEL_FILE = "spm.model"
SPACE_MARK = "\u2581"
@register_kind
class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"
    has_prefix_tree = False  # pieces are not distinct byte strings (byte fallback beside text pieces)

    def __init__(self, model_proto: bytes) -> None:
        import sentencepiece

        self._proto = bytes(model_proto)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=self._proto)
        except RuntimeError as e:
            raise TokenizerFileError(f"not a SentencePiece model ({e}); re-run the tokenizer stage") from None
        special_ids = {}
        for name in SPECIAL_TOKENS:
            i = self._sp.piece_to_id(name)
            if self._sp.id_to_piece(i) != name or not self._sp.is_control(i):
                raise TokenizerFileError(f"SentencePiece model lacks control symbol {name}; retrain the tokenizer")
            special_ids[name] = i
        super().__init__(special_ids)
        self._space_mark_ids = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in SPACE_MARK.encode("utf-8")]
        if not all(self._sp.is_byte(i) for i in self._space_mark_ids):
            raise TokenizerFileError("SentencePiece model has no byte-fallback pieces; retrain with byte_fallback")

    @classmethod
    def _from_files(cls, directory: Path, meta: dict[str, Any]) -> SentencePieceTokenizer:
        return cls((directory / MODEL_FILE).read_bytes())

    def _files(self) -> dict[str, bytes]:
        return {MODEL_FILE: self._proto}

    def get_vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def _encode_ordinary(self, text: str) -> list[int]:
        if SPACE_MARK not in text:
            return self._sp.encode(text)
        ids: list[int] = []
        for k, segment in enumerate(text.split(SPACE_MARK)):
            if k:
                ids.extend(self._space_mark_ids)
            ids.extend(self._sp.encode(segment))
        return ids

    def _encode_ordinary_batch(self, texts: Sequence[str], num_threads: int) -> list[list[int]]:
        if any(SPACE_MARK in t for t in texts):
            return [self._encode_ordinary(t) for t in texts]
        return self._sp.encode(list(texts), num_threads=max(1, num_threads))

    def decode(self, ids: Iterable[int]) -> str:
        ids = self._checked_ids(ids)
        return decode_with_specials(ids, self._id_to_special, lambda run: self._sp.decode(run).encode("utf-8"))

    def id_to_token(self, token_id: int) -> str:
        if token_id in self._id_to_special:
            return self._id_to_special[token_id]
        self._checked_ids([token_id])
        return self._sp.id_to_piece(token_id)

    def _compute_token_bytes(self) -> np.ndarray:
        sp = self._sp
        tb = np.zeros(self.get_vocab_size(), dtype=np.int32)
        for i in range(self.get_vocab_size()):
            if sp.is_byte(i):
                tb[i] = 1
            elif not (sp.is_control(i) or sp.is_unknown(i)):
                tb[i] = len(sp.id_to_piece(i).replace(SPACE_MARK, " ").encode("utf-8"))
        return tb
