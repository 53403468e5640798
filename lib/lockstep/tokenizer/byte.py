"""The `byte` tokenizer: id = byte value (0..255) of the UTF-8 text, the 9 special tokens after
(256..264). Nothing to learn; not a subword tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lockstep.tokenizer.base import SPECIAL_TOKENS, Tokenizer, TokenizerFileError, decode_with_specials, register_kind

BYTE_FILE = "byte.json"
N_BYTES = 256


@register_kind
class ByteTokenizer(Tokenizer):
    kind = "byte"

    def __init__(self) -> None:
        super().__init__({name: N_BYTES + i for i, name in enumerate(SPECIAL_TOKENS)})

    @classmethod
    def _from_files(cls, directory: Path, meta: dict[str, Any]) -> ByteTokenizer:
        tok = cls()
        stored = json.loads((directory / BYTE_FILE).read_text(encoding="utf-8"))
        if stored != tok._config():
            raise TokenizerFileError(f"{directory / BYTE_FILE} does not describe this version's byte tokenizer")
        return tok

    def _config(self) -> dict[str, Any]:
        return {"kind": self.kind, "n_bytes": N_BYTES, "special_token_ids": self.get_special_tokens()}

    def _files(self) -> dict[str, bytes]:
        return {BYTE_FILE: (json.dumps(self._config(), sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")}

    def get_vocab_size(self) -> int:
        return N_BYTES + len(SPECIAL_TOKENS)

    def _encode_ordinary(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def _encode_ordinary_batch(self, texts: Sequence[str], num_threads: int) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return decode_with_specials(ids, self._id_to_special, bytes)

    def id_to_token(self, token_id: int) -> str:
        if token_id in self._id_to_special:
            return self._id_to_special[token_id]
        self._checked_ids([token_id])
        return bytes([token_id]).decode("utf-8", errors="replace")

    def token_pieces(self) -> list[bytes | None]:
        return [bytes([b]) for b in range(N_BYTES)] + [None] * len(SPECIAL_TOKENS)

    def _compute_token_bytes(self) -> np.ndarray:
        tb = np.ones(self.get_vocab_size(), dtype=np.int32)
        tb[N_BYTES:] = 0
        return tb
