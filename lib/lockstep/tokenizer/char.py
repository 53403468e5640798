"""The `char` tokenizer: one id per byte value seen in the training corpus, for byte-level parity
runs (e.g. tiny Shakespeare's 65 symbols). Not a subword tokenizer.

The alphabet is the sorted set of distinct bytes of the corpus; when there are more than
`max_alphabet` (default 65) the most frequent are kept (ties go to the lower byte value). Ids
follow sorted byte order, the 9 special tokens come after. A byte outside the alphabet encodes to
id 0, the smallest byte of the alphabet: encoding never fails, but such text does not round-trip.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lockstep.tokenizer.base import SPECIAL_TOKENS, Tokenizer, TokenizerFileError, decode_with_specials, register_kind

CHAR_FILE = "char.json"
DEFAULT_MAX_ALPHABET = 65
UNKNOWN_BYTE_ID = 0


@register_kind
class CharTokenizer(Tokenizer):
    kind = "char"

    def __init__(self, alphabet: Sequence[int]) -> None:
        alphabet = [int(b) for b in alphabet]
        if not alphabet or alphabet != sorted(set(alphabet)) or not all(0 <= b < 256 for b in alphabet):
            raise TokenizerFileError(f"char alphabet must be distinct sorted byte values, got {alphabet[:10]}...")
        self.alphabet: tuple[int, ...] = tuple(alphabet)
        super().__init__({name: len(alphabet) + i for i, name in enumerate(SPECIAL_TOKENS)})
        self._byte_to_id = np.full(256, UNKNOWN_BYTE_ID, dtype=np.int64)
        self._byte_to_id[list(alphabet)] = np.arange(len(alphabet))
        self._id_to_byte = bytes(alphabet)

    @classmethod
    def train_from_iterator(
        cls, texts: Iterable[str], *, vocab_size: int | None = None, max_alphabet: int = DEFAULT_MAX_ALPHABET, **options: Any
    ) -> CharTokenizer:
        if options:
            raise ValueError(f"unknown char tokenizer option(s) {sorted(options)}; the only option is max_alphabet")
        if vocab_size is not None:
            raise ValueError(
                f"the char tokenizer's size comes from its corpus (capped by max_alphabet={max_alphabet}); "
                f"pass vocab_size=None (got {vocab_size})"
            )
        if not 1 <= max_alphabet <= 256:
            raise ValueError(f"max_alphabet={max_alphabet} must be between 1 and 256")
        counts = np.zeros(256, dtype=np.int64)
        for text in texts:
            counts += np.bincount(np.frombuffer(text.encode("utf-8"), dtype=np.uint8), minlength=256)
        seen = np.flatnonzero(counts)
        if seen.size == 0:
            raise ValueError("the char tokenizer needs a non-empty training corpus")
        # Stable sort on -count keeps the lower byte value first among equal counts.
        keep = np.argsort(-counts, kind="stable")[: min(max_alphabet, seen.size)]
        return cls(sorted(int(b) for b in keep))

    @classmethod
    def _from_files(cls, directory: Path, meta: dict[str, Any]) -> CharTokenizer:
        stored = json.loads((directory / CHAR_FILE).read_text(encoding="utf-8"))
        if not isinstance(stored, dict) or not isinstance(stored.get("alphabet"), list):
            raise TokenizerFileError(f"{directory / CHAR_FILE} has no alphabet list; re-run the tokenizer stage")
        return cls(stored["alphabet"])

    def _files(self) -> dict[str, bytes]:
        config = {"kind": self.kind, "alphabet": list(self.alphabet), "special_token_ids": self.get_special_tokens()}
        return {CHAR_FILE: (json.dumps(config, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")}

    def get_vocab_size(self) -> int:
        return len(self.alphabet) + len(SPECIAL_TOKENS)

    def _encode_ordinary(self, text: str) -> list[int]:
        return self._byte_to_id[np.frombuffer(text.encode("utf-8"), dtype=np.uint8)].tolist()

    def decode(self, ids: Iterable[int]) -> str:
        n = len(self.alphabet)

        def piece_bytes(run: list[int]) -> bytes:
            bad = [i for i in run if not 0 <= i < n]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.get_vocab_size()})")
            return bytes(self._id_to_byte[i] for i in run)

        return decode_with_specials(ids, self._id_to_special, piece_bytes)

    def id_to_token(self, token_id: int) -> str:
        if token_id in self._id_to_special:
            return self._id_to_special[token_id]
        if not 0 <= token_id < len(self.alphabet):
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.get_vocab_size()})")
        return bytes([self.alphabet[token_id]]).decode("utf-8", errors="replace")

    def _compute_token_bytes(self) -> np.ndarray:
        tb = np.ones(self.get_vocab_size(), dtype=np.int32)
        tb[len(self.alphabet):] = 0
        return tb
