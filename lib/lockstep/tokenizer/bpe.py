"""The `bpe` tokenizer: byte-level BPE learned with rustbpe over a GPT-4-style split pattern, encoded
with tiktoken. Saved as plain files (a tiktoken ranks file and a JSON config); never pickled. Does
not read corpora from disk."""

from __future__ import annotations

import base64
import binascii
import json
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lockstep.tokenizer.base import SPECIAL_TOKENS, Tokenizer, TokenizerFileError, register_kind

RANKS_FILE = "ranks.tiktoken"
CONFIG_FILE = "bpe.json"
N_BYTES = 256
# GPT-4's split pattern with digit runs cut at 2 instead of 3: a small vocabulary spends fewer
# ranks on 3-digit numbers, and arithmetic sees a more regular digit grouping.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)


def ranks_to_bytes(ranks: dict[bytes, int]) -> bytes:
    """tiktoken's ranks format: `base64(token) rank` per line, in rank order."""
    b64 = binascii.b2a_base64
    return b"".join(
        [b64(token, newline=False) + b" %d\n" % rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    )


def ranks_from_bytes(data: bytes, where: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        try:
            token_b64, rank = line.split(b" ")
            ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
        except ValueError:
            raise TokenizerFileError(f"{where}:{lineno} is not `base64 rank`; re-run the tokenizer stage") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerFileError(f"{where} ranks are not 0..{len(ranks) - 1} without gaps; re-run the tokenizer stage")
    return ranks


@register_kind
class BPETokenizer(Tokenizer):
    kind = "bpe"

    def __init__(self, ranks: dict[bytes, int], pattern: str = SPLIT_PATTERN) -> None:
        missing = [b for b in range(N_BYTES) if bytes([b]) not in ranks]
        if missing:
            raise TokenizerFileError(f"BPE ranks lack single-byte token(s) {missing[:5]}; text could not be encoded")
        n_ranks = len(ranks)
        super().__init__({name: n_ranks + i for i, name in enumerate(SPECIAL_TOKENS)})
        self.pattern = pattern
        self._ranks = dict(ranks)
        self._enc = self._new_encoding()
        self._enc_thread = threading.get_ident()
        self._per_thread = threading.local()

    def _new_encoding(self) -> Any:
        """A tiktoken Encoding of these ranks, owned by the calling thread.

        tiktoken's split regexes keep their match state in a pool that favours the first thread
        to use them; any other thread takes its state from a locked shared stack on every match
        (a lone such thread encoded 1.4x slower). Two encoder threads sharing one Encoding built
        a 64 MB cache in 4.0 s when one of them was its first user, 2.95 s when the main thread
        was, and 2.3 s with an Encoding each (bench/bench_cache.py). Encoding once here makes
        the calling thread the favoured one."""
        import tiktoken  # imported here so that `import lockstep.tokenizer` stays light

        enc = tiktoken.Encoding(
            name=f"lockstep_bpe_{len(self._ranks)}",
            pat_str=self.pattern,
            mergeable_ranks=self._ranks,
            special_tokens=self.get_special_tokens(),
        )
        enc.encode("\n", allowed_special="all")
        return enc

    def _bulk_encoding(self) -> Any:
        """The Encoding for bulk work on the calling thread: the shared one on the thread that
        built the tokenizer, else the thread's own, made on its first bulk call there (a few ms
        for a 4k vocabulary, about 30 ms for 65k). `encode` of a single text always uses the
        shared one, so a thread that encodes one prompt never pays for an Encoding."""
        if threading.get_ident() == self._enc_thread:
            return self._enc
        enc = getattr(self._per_thread, "enc", None)
        if enc is None:
            enc = self._per_thread.enc = self._new_encoding()
        return enc

    @classmethod
    def _from_files(cls, directory: Path, meta: dict[str, Any]) -> BPETokenizer:
        config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
        if not isinstance(config, dict) or not isinstance(config.get("pattern"), str):
            raise TokenizerFileError(f"{directory / CONFIG_FILE} has no split pattern; re-run the tokenizer stage")
        tok = cls(ranks_from_bytes((directory / RANKS_FILE).read_bytes(), directory / RANKS_FILE), config["pattern"])
        if config.get("special_token_ids") != tok.get_special_tokens():
            raise TokenizerFileError(
                f"{directory / CONFIG_FILE} special ids disagree with {RANKS_FILE}; re-run the tokenizer stage"
            )
        return tok

    def _files(self) -> dict[str, bytes]:
        config = {
            "kind": self.kind,
            "pattern": self.pattern,
            "n_ranks": len(self._ranks),
            "special_token_ids": self.get_special_tokens(),
        }
        return {
            RANKS_FILE: ranks_to_bytes(self._ranks),
            CONFIG_FILE: (json.dumps(config, ensure_ascii=False, sort_keys=True, separators=(",", ":")) + "\n").encode(
                "utf-8"
            ),
        }

    def get_vocab_size(self) -> int:
        return len(self._ranks) + len(SPECIAL_TOKENS)

    def _encode_ordinary(self, text: str) -> list[int]:
        # encode_ordinary treats special-token strings as plain text: they can never become special ids.
        return self._enc.encode_ordinary(text)

    def _encode_ordinary_batch(self, texts: Sequence[str], num_threads: int) -> list[list[int]]:
        # tiktoken's batch call hands each text to its thread pool as its own task, so a thread
        # slowed by other work on a busy machine never holds back a fixed share of the batch.
        # encode_ordinary (batch or not) reads special-token strings as plain text.
        texts = list(texts)
        if num_threads <= 1 or len(texts) < 2:
            encode = (self._bulk_encoding() if len(texts) > 1 else self._enc).encode_ordinary
            return [encode(t) for t in texts]
        return self._enc.encode_ordinary_batch(texts, num_threads=num_threads)

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        # tiktoken's buffer path: ids stay in Rust until one uint32 array per text, with the GIL
        # released while encoding. allowed_special=set() makes it encode_ordinary (special-token
        # strings are plain text), and disallowed_special=() stops it raising on them.
        encode = self._bulk_encoding().encode_to_numpy
        return [encode(t, allowed_special=set(), disallowed_special=()) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        ids = self._checked_ids(ids)
        return self._enc.decode(ids, errors="replace")

    def id_to_token(self, token_id: int) -> str:
        if token_id in self._id_to_special:
            return self._id_to_special[token_id]
        self._checked_ids([token_id])
        return self._enc.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")

    def token_pieces(self) -> list[bytes | None]:
        pieces: list[bytes | None] = [None] * self.get_vocab_size()
        for token, rank in self._ranks.items():
            pieces[rank] = token
        return pieces

    def _compute_token_bytes(self) -> np.ndarray:
        tb = np.zeros(self.get_vocab_size(), dtype=np.int32)
        for token, rank in self._ranks.items():
            tb[rank] = len(token)
        return tb
