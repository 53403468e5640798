"""The `bpe` tokenizer: byte-level BPE learned with rustbpe over a GPT-4-style split pattern, encoded
with tiktoken. Saved as plain files (a tiktoken ranks file and a JSON config); never pickled. Does
not read corpora from disk."""

from __future__ import annotations

import base64
import binascii
import json
import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lockstep.tokenizer.base import BOS, SPECIAL_TOKENS, Tokenizer, TokenizerFileError, register_kind

RANKS_FILE = "ranks.tiktoken"
CONFIG_FILE = "bpe.json"
N_BYTES = 256
# GPT-4's split pattern with digit runs cut at 2 instead of 3: a small vocabulary spends fewer
# ranks on 3-digit numbers, and arithmetic sees a more regular digit grouping.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
TRAIN_BUFFER_TEXTS = 8192
# Under SPLIT_PATTERN (and GPT-4's own, which differs only in the digit run), a newline followed
# by a printable non-space ASCII character always ends a chunk, and the chunks before it do not
# depend on what follows. A whitespace run holding a newline is taken by `\s*[\r\n]`, tried
# before the other whitespace branches and ending at the run's last newline; the only other
# branch that takes in a newline is the `[\r\n]*` tail of a punctuation run. Both stop at that
# character exactly as they stop at the end of the text. Since BPE merges inside chunks only,
# the text up to such a newline encodes to a prefix of the whole text's ids (tested with
# hypothesis in tests/test_tokenizer.py).
_CHUNK_END = re.compile(r"\n(?=[!-~])")
_PREFIX_SAFE_PATTERNS = frozenset({SPLIT_PATTERN, SPLIT_PATTERN.replace(r"\p{N}{1,2}", r"\p{N}{1,3}")})


def ranks_to_bytes(ranks: dict[bytes, int]) -> bytes:
    """tiktoken's ranks format: `base64(token) rank` per line, in rank order."""
    b64 = binascii.b2a_base64
    return b"".join([b64(token, newline=False) + b" %d\n" % rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])])


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
    def train_from_iterator(
        cls, texts: Iterable[str], *, vocab_size: int | None = None, pattern: str = SPLIT_PATTERN, **options: Any
    ) -> BPETokenizer:
        import rustbpe

        if options:
            raise ValueError(f"unknown bpe tokenizer option(s) {sorted(options)}; the only option is pattern")
        min_vocab = N_BYTES + len(SPECIAL_TOKENS)
        if vocab_size is None or vocab_size < min_vocab:
            raise ValueError(f"bpe vocab_size={vocab_size} must be at least {min_vocab} (256 byte tokens + 9 special tokens)")
        trainer = rustbpe.Tokenizer()
        # The special tokens are appended after the learned ranks, so learn vocab_size - 9.
        trainer.train_from_iterator(
            iter(texts), vocab_size=vocab_size - len(SPECIAL_TOKENS), buffer_size=TRAIN_BUFFER_TEXTS, pattern=pattern
        )
        ranks = {bytes(token): int(rank) for token, rank in trainer.get_mergeable_ranks()}
        return cls(ranks, pattern)

    @classmethod
    def _from_files(cls, directory: Path, meta: dict[str, Any]) -> BPETokenizer:
        config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
        if not isinstance(config, dict) or not isinstance(config.get("pattern"), str):
            raise TokenizerFileError(f"{directory / CONFIG_FILE} has no split pattern; re-run the tokenizer stage")
        tok = cls(ranks_from_bytes((directory / RANKS_FILE).read_bytes(), directory / RANKS_FILE), config["pattern"])
        if config.get("special_token_ids") != tok.get_special_tokens():
            raise TokenizerFileError(f"{directory / CONFIG_FILE} special ids disagree with {RANKS_FILE}; re-run the tokenizer stage")
        return tok

    def _files(self) -> dict[str, bytes]:
        config = {"kind": self.kind, "pattern": self.pattern, "n_ranks": len(self._ranks), "special_token_ids": self.get_special_tokens()}
        return {
            RANKS_FILE: ranks_to_bytes(self._ranks),
            CONFIG_FILE: (json.dumps(config, ensure_ascii=False, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8"),
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

    def copy(self) -> BPETokenizer:
        # Threads encoding with one Encoding slow each other down, its owner too: in the
        # tokenizer stage on 2 cores, counting the 254 KB Shakespeare val split beside a thread
        # that rendered samples took 21-23 ms when both shared one Encoding, 15-16 ms (three
        # runs of four; 20 in the fourth) when the renderer had its own.
        return type(self)(self._ranks, self.pattern)

    def count_tokens(self, texts: Sequence[str]) -> int:
        # One tiktoken call for the lot, with the GIL released: the texts joined by the BOS
        # string, which only this call reads as the special token. tiktoken cuts its input at
        # each allowed special token and runs the split regex and the merges on each piece alone,
        # so each text gets the ids it gets encoded alone, and each separator adds one id. The
        # BOS string starts with "<" and ends with ">", so no occurrence can straddle a text and
        # a separator; a text that holds the string itself is encoded on its own.
        enc = self._bulk_encoding()
        joinable = [t for t in texts if BOS not in t]
        n = sum(len(enc.encode_ordinary(t)) for t in texts if BOS in t)
        if joinable:
            try:
                ids = enc.encode_to_numpy(BOS.join(joinable), allowed_special={BOS}, disallowed_special=())
            except UnicodeEncodeError:  # a lone surrogate: encode_ordinary replaces it, text by text
                return n + sum(len(enc.encode_ordinary(t)) for t in joinable)
            n += len(ids) - (len(joinable) - 1)
        return n

    def _encode_head(self, text: str, n: int) -> list[int]:
        if self.pattern in _PREFIX_SAFE_PATTERNS:
            # Prefixes ending at a chunk end (see _CHUNK_END), each about twice as long as the
            # last, until one holds n ids: a document sample of 256 ids costs a few KB of text,
            # not the whole document.
            start = 8 * n + 64
            while start < len(text):
                end = _CHUNK_END.search(text, start)
                if end is None:
                    break
                ids = self._enc.encode_ordinary(text[: end.end()])
                if len(ids) >= n:
                    return ids[:n]
                start = 2 * end.end()
        return self._enc.encode_ordinary(text)[:n]

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        # tiktoken's buffer path: ids stay in Rust until one uint32 array per text, with the GIL
        # released while encoding. allowed_special=set() makes it encode_ordinary (special-token
        # strings are plain text), and disallowed_special=() stops it raising on them.
        encode = self._bulk_encoding().encode_to_numpy
        return [encode(t, allowed_special=set(), disallowed_special=()) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.get_vocab_size()]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.get_vocab_size()})")
        return self._enc.decode(ids, errors="replace")

    def id_to_token(self, token_id: int) -> str:
        if token_id in self._id_to_special:
            return self._id_to_special[token_id]
        if not 0 <= token_id < len(self._ranks):
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.get_vocab_size()})")
        return self._enc.decode_single_token_bytes(token_id).decode("utf-8", errors="replace")

    def _compute_token_bytes(self) -> np.ndarray:
        tb = np.zeros(self.get_vocab_size(), dtype=np.int32)
        for token, rank in self._ranks.items():
            tb[rank] = len(token)
        return tb
