"""The `char` tokenizer: one id per byte value kept from the training corpus, for byte-level parity
runs (e.g. tiny Shakespeare's 65 symbols). Not a subword tokenizer.

The alphabet is drawn from the distinct bytes of the corpus, at most `max_alphabet` (default 65)
of them, by one of two rules (`order`):

- "frequency" (the default): the most frequent bytes, ties going to the lower byte value;
- "sorted": the first bytes in ascending byte order. This is the reference rule of character-level
  parity runs ("sorted unique bytes, capped, unknown -> 0"): built with `specials=False` as well,
  the vocabulary is exactly the alphabet and the ids are those of any implementation of that rule.

Either way ids 0..n-1 follow ascending byte order, and the 9 special tokens come after unless the
tokenizer is built without them; it then has no `<|bos|>` and no chat template, so the caches,
training and chat refuse it (NoSpecialTokensError).

A byte outside the alphabet encodes to id 0 (UNKNOWN_BYTE_ID): encoding never fails, but such
text does not round-trip. Id 0 decodes to the smallest byte of the alphabet (the newline in
English text), so a decoded id 0 cannot tell that byte from an unknown one; `count_unknown_bytes`
counts the bytes lost this way, and the tokenizer stage reports them per metric source.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from lockstep.tokenizer.base import SPECIAL_TOKENS, Tokenizer, TokenizerFileError, decode_with_specials, register_kind

CHAR_FILE = "char.json"
DEFAULT_MAX_ALPHABET = 65
UNKNOWN_BYTE_ID = 0
CharOrder = Literal["frequency", "sorted"]
CHAR_ORDERS: tuple[str, ...] = ("frequency", "sorted")


@register_kind
class CharTokenizer(Tokenizer):
    kind = "char"

    def __init__(self, alphabet: Sequence[int], *, order: CharOrder = "frequency", specials: bool = True) -> None:
        """`alphabet`: the kept byte values, ascending (id i is alphabet[i]). `order` records the
        rule that chose them (saved with the tokenizer; encoding depends on the alphabet only).
        `specials`: whether the 9 special tokens follow the alphabet."""
        alphabet = [int(b) for b in alphabet]
        if not alphabet or alphabet != sorted(set(alphabet)) or not all(0 <= b < 256 for b in alphabet):
            raise TokenizerFileError(f"char alphabet must be distinct sorted byte values, got {alphabet[:10]}...")
        if order not in CHAR_ORDERS:
            raise ValueError(f"char order={order!r} must be one of {list(CHAR_ORDERS)}")
        self.alphabet: tuple[int, ...] = tuple(alphabet)
        self.order: CharOrder = order
        super().__init__({name: len(alphabet) + i for i, name in enumerate(SPECIAL_TOKENS)} if specials else {})
        self._byte_to_id = np.full(256, UNKNOWN_BYTE_ID, dtype=np.int64)
        self._byte_to_id[list(alphabet)] = np.arange(len(alphabet))
        self._known = np.zeros(256, dtype=bool)
        self._known[list(alphabet)] = True
        self._id_to_byte = bytes(alphabet)

    @classmethod
    def _from_files(cls, directory: Path, meta: dict[str, Any]) -> CharTokenizer:
        path = directory / CHAR_FILE
        stored = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(stored, dict) or not isinstance(stored.get("alphabet"), list):
            raise TokenizerFileError(f"{path} has no alphabet list; re-run the tokenizer stage")
        if stored.get("order") not in CHAR_ORDERS:
            raise TokenizerFileError(
                f"{path} has order={stored.get('order')!r}, not one of {list(CHAR_ORDERS)} (files written before the "
                "order was saved have none); re-run the tokenizer stage"
            )
        special_ids = stored.get("special_token_ids")
        if not isinstance(special_ids, dict):
            raise TokenizerFileError(f"{path} has no special_token_ids mapping; re-run the tokenizer stage")
        tok = cls(stored["alphabet"], order=stored["order"], specials=bool(special_ids))
        if tok.get_special_tokens() != special_ids:
            raise TokenizerFileError(
                f"{path} lists special ids that do not follow its alphabet; re-run the tokenizer stage"
            )
        return tok

    def _files(self) -> dict[str, bytes]:
        config = {
            "kind": self.kind,
            "alphabet": list(self.alphabet),
            "order": self.order,
            "special_token_ids": self.get_special_tokens(),
        }
        return {CHAR_FILE: (json.dumps(config, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")}

    def get_vocab_size(self) -> int:
        return len(self.alphabet) + len(self._special_ids)

    def _encode_ordinary(self, text: str) -> list[int]:
        return self._byte_to_id[np.frombuffer(text.encode("utf-8"), dtype=np.uint8)].tolist()

    def count_unknown_bytes(self, texts: Sequence[str]) -> int:
        return sum(int(np.count_nonzero(~self._known[np.frombuffer(t.encode("utf-8"), dtype=np.uint8)])) for t in texts)

    def decode(self, ids: Iterable[int]) -> str:
        ids = self._checked_ids(ids)
        return decode_with_specials(ids, self._id_to_special, lambda run: bytes(self._id_to_byte[i] for i in run))

    def id_to_token(self, token_id: int) -> str:
        if token_id in self._id_to_special:
            return self._id_to_special[token_id]
        self._checked_ids([token_id])
        return bytes([self.alphabet[token_id]]).decode("utf-8", errors="replace")

    def token_pieces(self) -> list[bytes | None]:
        return [bytes([b]) for b in self.alphabet] + [None] * (self.get_vocab_size() - len(self.alphabet))

    def _compute_token_bytes(self) -> np.ndarray:
        tb = np.ones(self.get_vocab_size(), dtype=np.int32)
        tb[len(self.alphabet):] = 0
        return tb
