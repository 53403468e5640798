"""A toy tokenizer kind written the way docs/internals.md's recipe says ("Adding a stage, a source,
a tokenizer kind"): one module with its options dataclass, its trainer and its encoder, registered
by the test that uses it with one line in `lockstep.tokenizer.kinds.KINDS`. Bytes become ids in an
order learned from the training text: the most frequent byte gets id 0 (or byte value order, with
`order: value`); the special tokens follow."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from lockstep.core.config import FieldError
from lockstep.tokenizer.base import SPECIAL_TOKENS, Tokenizer, TokenizerFileError, decode_with_specials, register_kind
from lockstep.tokenizer.options import KindOptions

TOY_FILE = "toy.json"


@dataclass(frozen=True)
class ToyOptions(KindOptions):
    """`tokenizer.options:` of kind toy."""

    order: Literal["frequency", "value"] = "frequency"  # how byte values are numbered
    min_count: int = 0  # a byte seen fewer times than this is numbered after all the others

    def __post_init__(self) -> None:
        if self.min_count < 0:
            raise FieldError("min_count", self.min_count, "must be >= 0; 0 keeps every byte in frequency order")

    def train_kwargs(self, *, seed: int, root: Path) -> dict[str, Any]:
        return {"order": self.order, "min_count": self.min_count}


def train(
    texts: Iterable[str], *, vocab_size: int | None = None, order: str = "frequency", min_count: int = 0
) -> ToyTokenizer:
    """Count the bytes of `texts` and number them (the kind fixes its size: vocab_size is None)."""
    if vocab_size is not None:
        raise ValueError(f"the toy tokenizer has 265 ids; pass vocab_size=None (got {vocab_size})")
    counts = np.zeros(256, np.int64)
    for text in texts:
        counts += np.bincount(np.frombuffer(text.encode("utf-8"), np.uint8), minlength=256)
    if order == "value":
        return ToyTokenizer(list(range(256)))
    counts[counts < min_count] = -1
    return ToyTokenizer(np.argsort(-counts, kind="stable").tolist())


@register_kind
class ToyTokenizer(Tokenizer):
    kind = "toy"

    def __init__(self, byte_order: list[int]) -> None:
        if sorted(byte_order) != list(range(256)):
            raise TokenizerFileError(
                "a toy tokenizer numbers each of the 256 byte values once; re-run the tokenizer stage"
            )
        super().__init__({name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)})
        self.byte_order = list(byte_order)  # id -> byte
        self._id_of = np.argsort(np.array(self.byte_order))  # byte -> id

    @classmethod
    def _from_files(cls, directory: Path, meta: dict[str, Any]) -> ToyTokenizer:
        return cls(json.loads((directory / TOY_FILE).read_text(encoding="utf-8"))["byte_order"])

    def _files(self) -> dict[str, bytes]:
        return {TOY_FILE: json.dumps({"byte_order": self.byte_order}).encode("utf-8")}

    def _encode_ordinary(self, text: str) -> list[int]:
        return self._id_of[np.frombuffer(text.encode("utf-8"), np.uint8)].tolist()

    def decode(self, ids: Iterable[int]) -> str:
        return decode_with_specials(ids, self._id_to_special, lambda run: bytes(self.byte_order[i] for i in run))

    def id_to_token(self, token_id: int) -> str:
        if token_id in self._id_to_special:
            return self._id_to_special[token_id]
        return bytes([self.byte_order[self._checked_ids([token_id])[0]]]).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return 256 + len(SPECIAL_TOKENS)

    def token_pieces(self) -> list[bytes | None]:
        return [bytes([b]) for b in self.byte_order] + [None] * len(SPECIAL_TOKENS)

    def _compute_token_bytes(self) -> np.ndarray:
        return np.array([1] * 256 + [0] * len(SPECIAL_TOKENS), np.int32)
