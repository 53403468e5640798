"""The `hf` tokenizer: byte-level BPE learned and encoded with Hugging Face `tokenizers`, over the
`bpe` kind's split pattern, with the same special tokens and chat template. Saved as one plain file,
the library's own `tokenizer.json`; never pickled. Does not read corpora from disk.

Same merges as `bpe`. Both trainers count the split chunks, then repeatedly merge the most frequent
adjacent pair, breaking ties towards the smaller pair of ids. The ids of the 256 single bytes differ
between them, though: rustbpe numbers them by byte value, while `tokenizers` numbers its starting
alphabet by code point, and the GPT-2 byte-to-character map of its ByteLevel pre-tokenizer is not
monotonic (the space byte becomes U+0120, after every letter). Equal counts are common: trained
through ByteLevel on the Shakespeare train split at 4,096 ids, the two merge orders part at the
272nd merge and the vocabularies end one token apart. So training hands `tokenizers` each chunk as
its bytes read as Latin-1 characters, whose code points are the byte values, and the learned merges
are then written in the ByteLevel alphabet that every `tokenizers` user expects. The price is that
the chunks pass through Python on their way to the trainer (most of its time, see
bench/bench_tokenizer_kinds.py). Encoding runs the whole pipeline (split, ByteLevel, merges) inside
`tokenizers`, taking a chunk that is itself a token whole, as tiktoken does.

Special tokens are `tokenizer.json`'s added tokens, at the ids after the merges as for `bpe`. This
module sets `encode_special_tokens` on the instance it loads, so a special string in text encodes
as plain text; `tokenizers` does not save that switch, so other tools that load the file match
special strings in text unless they set it too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lockstep.tokenizer.base import SPECIAL_TOKENS, Tokenizer, TokenizerFileError, register_kind
from lockstep.tokenizer.bpe import N_BYTES, SPLIT_PATTERN
from lockstep.tokenizer.unicode import without_lone_surrogates

TOKENIZER_FILE = "tokenizer.json"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of the ByteLevel pre-tokenizer:
    printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {b: chr(b) for b in kept}
    for n, b in enumerate(b for b in range(N_BYTES) if b not in out):
        out[b] = chr(N_BYTES + n)
    return out


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}


def to_byte_level(token: bytes) -> str:
    return "".join(BYTE_TO_CHAR[b] for b in token)


def from_byte_level(token: str, where: Path) -> bytes:
    try:
        return bytes(CHAR_TO_BYTE[c] for c in token)
    except KeyError as e:
        raise TokenizerFileError(
            f"{where}: token {token!r} has {e.args[0]!r}, outside the ByteLevel alphabet; re-run the tokenizer stage"
        ) from None


def _hf() -> Any:
    # `tokenizers` is imported on first use so that importing lockstep.tokenizer stays light.
    import tokenizers

    return tokenizers


@register_kind
class HFTokenizer(Tokenizer):
    kind = "hf"

    def __init__(
        self, ranks: dict[bytes, int], merges: Sequence[tuple[bytes, bytes]], pattern: str = SPLIT_PATTERN
    ) -> None:
        """`ranks`: token bytes -> id, ids 0..n-1 with every single byte among them; `merges`: the
        learned pairs in the order they were learned, each part and its concatenation in `ranks`."""
        missing = [b for b in range(N_BYTES) if bytes([b]) not in ranks]
        if missing:
            raise TokenizerFileError(
                f"hf vocabulary lacks single-byte token(s) {missing[:5]}; text could not be encoded"
            )
        if sorted(ranks.values()) != list(range(len(ranks))):
            raise TokenizerFileError(
                f"hf vocabulary ids are not 0..{len(ranks) - 1} without gaps; re-run the tokenizer stage"
            )
        for a, b in merges:
            if a not in ranks or b not in ranks or a + b not in ranks:
                raise TokenizerFileError(
                    f"hf merge {a!r} + {b!r} uses or makes a token outside the vocabulary; re-run the tokenizer stage"
                )
        n_ranks = len(ranks)
        super().__init__({name: n_ranks + i for i, name in enumerate(SPECIAL_TOKENS)})
        self.pattern = pattern
        self._ranks = dict(ranks)
        self._merges = [(bytes(a), bytes(b)) for a, b in merges]
        # id -> bytes for decode, specials as their names (what tiktoken's decode gives for `bpe`).
        self._pieces = [b""] * self.get_vocab_size()
        for token, i in self._ranks.items():
            self._pieces[i] = token
        for name, i in self.get_special_tokens().items():
            self._pieces[i] = name.encode("utf-8")
        self._hf = self._build()

    def _build(self) -> Any:
        hf = _hf()
        pre = hf.pre_tokenizers
        model = hf.models.BPE(
            vocab={to_byte_level(t): i for t, i in self._ranks.items()},
            merges=[(to_byte_level(a), to_byte_level(b)) for a, b in self._merges],
            # tiktoken takes a chunk that is itself a token whole before merging; so does this.
            ignore_merges=True,
        )
        tok = hf.Tokenizer(model)
        tok.pre_tokenizer = pre.Sequence(
            [
                pre.Split(hf.Regex(self.pattern), behavior="isolated"),
                pre.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = hf.decoders.ByteLevel()
        tok.add_special_tokens([hf.AddedToken(name, special=True, normalized=False) for name in SPECIAL_TOKENS])
        # Special strings in text are plain text (see the module docstring).
        tok.encode_special_tokens = True
        added = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
        assert added == self.get_special_tokens(), (added, self.get_special_tokens())
        return tok

    # ---- files ----------------------------------------------------------------------------

    @classmethod
    def _from_files(cls, directory: Path, meta: dict[str, Any]) -> HFTokenizer:
        path = directory / TOKENIZER_FILE
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            model = doc["model"]
            split = doc["pre_tokenizer"]["pretokenizers"][0]
            pattern = split["pattern"]["Regex"]
            vocab, merges = model["vocab"], model["merges"]
            if (
                model["type"] != "BPE"
                or split["type"] != "Split"
                or not isinstance(vocab, dict)
                or not isinstance(merges, list)
            ):
                raise TypeError
        except (ValueError, KeyError, IndexError, TypeError):
            raise TokenizerFileError(
                f"{path} is not an hf BPE tokenizer with a Split pre-tokenizer (model.vocab, model.merges, "
                "pre_tokenizer.pretokenizers[0].pattern.Regex); re-run the tokenizer stage"
            ) from None
        if not all(isinstance(m, list) and len(m) == 2 for m in merges):
            raise TokenizerFileError(f"{path} model.merges must be [left, right] pairs; re-run the tokenizer stage")
        ranks = {from_byte_level(t, path): int(i) for t, i in vocab.items()}
        # The rebuilt tokenizer must serialize to this very file, which load_tokenizer checks
        # through the sha256: that pins everything not read here (added tokens, decoder, options).
        return cls(ranks, [(from_byte_level(a, path), from_byte_level(b, path)) for a, b in merges], pattern)

    def _files(self) -> dict[str, bytes]:
        return {TOKENIZER_FILE: (self._hf.to_str(pretty=False) + "\n").encode("utf-8")}

    # ---- encoding -------------------------------------------------------------------------

    def get_vocab_size(self) -> int:
        return len(self._ranks) + len(SPECIAL_TOKENS)

    def _encode_ordinary(self, text: str) -> list[int]:
        try:
            return self._hf.encode(text, add_special_tokens=False).ids
        except TypeError:  # tokenizers refuses str with lone surrogates
            return self._hf.encode(without_lone_surrogates(text), add_special_tokens=False).ids

    def _encode_ordinary_batch(self, texts: Sequence[str], num_threads: int) -> list[list[int]]:
        # encode_batch_fast spreads the texts over tokenizers' own thread pool (one thread per
        # core, or TOKENIZERS_PARALLELISM=false for none); it takes no thread count per call.
        texts = list(texts)
        if num_threads <= 1 or len(texts) < 2:
            return [self._encode_ordinary(t) for t in texts]
        try:
            encodings = self._hf.encode_batch_fast(texts, add_special_tokens=False)
        except TypeError:
            encodings = self._hf.encode_batch_fast(
                [without_lone_surrogates(t) for t in texts], add_special_tokens=False
            )
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        ids = self._checked_ids(ids)
        pieces = self._pieces
        return b"".join([pieces[i] for i in ids]).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str:
        if token_id in self._id_to_special:
            return self._id_to_special[token_id]
        self._checked_ids([token_id])
        return self._pieces[token_id].decode("utf-8", errors="replace")

    def token_pieces(self) -> list[bytes | None]:
        return [None if i in self._id_to_special else p for i, p in enumerate(self._pieces)]

    def _compute_token_bytes(self) -> np.ndarray:
        return np.array([len(p) for p in self._pieces], dtype=np.int32)

    def ranks(self) -> dict[bytes, int]:
        """Token bytes -> id of the learned tokens (specials excluded), the layout of `bpe`'s
        tiktoken ranks."""
        return dict(self._ranks)
