"""The `lz78` tokenizer kind's encoder and loader: an LZ78 dictionary (a trie of byte strings,
`lz78.trie`) with byte fallback and the special tokens, encoded by greedy longest match over UTF-8
bytes. Saved as plain .npy arrays and a JSON config; never pickled. Does not read corpora or
dictionary files and does not train: the kind's trainer (`lz78.train`, which also reads a
dictionary file through `lz78.tsv`) sits off the path of the stages that only load and encode.
Knows nothing about how a model embeds its ids (it only exposes the per-id tree metadata).

Vocab layout, with N dictionary codes and V = N + 257 + 9 ids in all:

    [0]                 the trie root; padding. Never emitted by encoding; decodes to nothing.
    [1 .. N]            dictionary codes: in creation order when trained here, the file's codes
                        in ascending order when read from a dictionary file
    [N+1 .. N+256]      byte fallback: id N+1+b stands for the single byte b
    [N+257 .. V-1]      special tokens in SPECIAL_TOKENS order, `<|bos|>` first

Per-id metadata over the whole vocab (`token_parents`, `token_last_bytes`, `ancestor_chains`):
a code's parent is its longest proper prefix that is a code (its trie parent when every prefix is
a code, as in a trained dictionary) and its last byte its final byte; a fallback id has parent 0
and its byte; the root and the special ids have parent 0 and last byte -1 (they spell no byte).
Every chain of parents ends at the root (a parent may be a larger id in a dictionary read from a
file).

A dictionary read from a file (`lz78.train.from_dictionary`) need not hold every prefix of its
tokens. With `prefixes="file"` (the default) its tokens are the codes, matched as the reference
LZ78 tokenizer matches them (the longest token that fits); with `prefixes="closed"` the missing
prefixes become extra codes N+1.. after the file's, so that every code is its parent plus one
byte.

Text with lone surrogates (not encodable as UTF-8) is encoded with each one replaced by U+FFFD,
as `bpe` does; decoding replaces invalid UTF-8 with U+FFFD, as `bpe` does.

- `trie`: the dictionary core on the encoding path: the byte trie, longest-match encoding, ancestor chains
- `kernels`: numba kernels of the encoding path (child hash table, longest match, token bytes)
- `train`: the kind's trainer and options: the LZ78 parse that learns a trie, or a dictionary file read
- `train_kernels`: numba kernels of training: the dictionary parse with frequency-gated eviction
- `tsv`: dictionary interchange: the `lz78` and `compressed` TSV layouts, read and written
- `tsv_kernels`: numba kernels behind the fast TSV reader
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import regex

from lockstep.tokenizer.base import (
    SPECIAL_TOKENS,
    Tokenizer,
    TokenizerFileError,
    decode_with_specials,
    int32_npy,
    register_kind,
)
from lockstep.tokenizer.bpe import N_BYTES, SPLIT_PATTERN
from lockstep.tokenizer.lz78 import trie as lz78_trie
from lockstep.tokenizer.lz78.trie import LZ78Trie, LZ78TrieError, node_depths
from lockstep.tokenizer.prefix_tree import NO_TOKEN, PrefixTree
from lockstep.tokenizer.unicode import without_lone_surrogates

CONFIG_FILE = "lz78.json"
PARENT_FILE = "lz78_parent.npy"
LAST_BYTE_FILE = "lz78_last_byte.npy"
# Where a user's own dictionaries live (tokenizer.options.dictionary): the tokenizer stage depends
# on the whole folder, so a changed dictionary reruns it.
DICTIONARY_DIR = PurePosixPath("corpus/dictionaries")
HIER_PARENT_FILE = "lz78_hier_parent.npy"  # only for a tokenizer read from a `compressed` dictionary
# Only for a dictionary that lacks some prefixes of its tokens: the whole trie, nodes 0..M, since
# the per-id parents (nearest code) no longer spell the codes.
TRIE_PARENT_FILE = "lz78_trie_parent.npy"
TRIE_LAST_BYTE_FILE = "lz78_trie_last_byte.npy"
# How a dictionary file's missing prefixes are treated (tokenizer.options.prefixes): `file` keeps the
# file's tokens as the codes, as the reference does; `closed` adds the missing prefixes as codes.
PREFIX_MODES = ("file", "closed")
# Ids that are not dictionary codes: the root, the 256 fallback bytes and the special tokens.
N_RESERVED = 1 + N_BYTES + len(SPECIAL_TOKENS)
NO_BYTE = -1


class LZ78VocabError(ValueError):
    """A vocab size the LZ78 layout cannot fill: too small for one code, or more codes than the
    training text yields."""


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return without_lone_surrogates(text).encode("utf-8")


@register_kind
class LZ78Tokenizer(Tokenizer):
    """Greedy longest-match LZ78 tokenizer. `fast` picks the compiled encoder and decoder (numba)
    over the plain reference; both give the same ids and text (tests/test_tokenizer_lz78.py).
    `chunking` splits text with bpe's split pattern first, so no token spans two chunks.
    `training` records the options the dictionary was learned with, or the file it was read from
    (saved in the config, for provenance only). `hier_parent` (int over codes 0..N) is the
    hierarchical parent of each code, known only for a dictionary read from the `compressed`
    layout (see `lz78.train.from_dictionary`)."""

    kind = "lz78"
    hierarchical_parents_from = (f"tokenizer.kind: lz78 with tokenizer.options.dictionary: {DICTIONARY_DIR}/<file>.tsv "
                                 "in the compressed layout")

    def __init__(self, trie: LZ78Trie, *, chunking: bool = False, fast: bool = True,
                 training: Mapping[str, Any] | None = None, hier_parent: np.ndarray | None = None) -> None:
        if trie.n_codes < 1:
            raise LZ78VocabError("an lz78 tokenizer needs at least one dictionary code; train on more text")
        self.trie = trie
        self.n_codes = trie.n_codes
        super().__init__({name: self.n_codes + 1 + N_BYTES + i for i, name in enumerate(SPECIAL_TOKENS)})
        self.chunking = bool(chunking)
        self.fast = bool(fast)
        self.training = dict(training) if training is not None else None
        self._split = regex.compile(SPLIT_PATTERN) if self.chunking else None
        v = self.get_vocab_size()
        n = self.n_codes
        parents = np.zeros(v, np.int32)
        parents[: n + 1] = trie.code_parents()
        last = np.full(v, NO_BYTE, np.int32)
        last[1 : n + 1] = trie.last_byte[1 : n + 1]
        last[n + 1 : n + 1 + N_BYTES] = np.arange(N_BYTES)
        parents.setflags(write=False)
        last.setflags(write=False)
        self._parents = parents
        self._last_bytes = last
        # The bytes of every id in one buffer: the codes, then the 256 fallback bytes; id i spells
        # flat[offsets[i]:offsets[i+1]] (the root and the specials nothing). One buffer, not a
        # bytes object per id, so a dictionary of millions of codes stays small.
        flat, code_offsets = trie.spell(fast=self.fast)
        end = int(code_offsets[-1])
        self._flat = np.concatenate([flat, np.arange(N_BYTES, dtype=np.uint8)])
        offsets = np.full(v + 1, end + N_BYTES, np.int64)
        offsets[: n + 2] = code_offsets
        offsets[n + 1 : n + 2 + N_BYTES] = end + np.arange(N_BYTES + 1)
        self._offsets = offsets
        self._plain: tuple[bytes, list[int]] | None = None  # the plain decoder's tables, made on first use
        self._chains: tuple[np.ndarray, np.ndarray] | None = None
        self._hier: np.ndarray | None = None
        if hier_parent is not None:
            hier_parent = np.asarray(hier_parent)
            codes = np.arange(n + 1)
            if (hier_parent.shape != (n + 1,) or hier_parent[0] != 0
                    or np.any((hier_parent[1:] < 0) | (hier_parent[1:] > n) | (hier_parent[1:] == codes[1:]))
                    or node_depths(hier_parent) is None):
                raise TokenizerFileError(
                    f"hierarchical parents must give each of the {n} codes another code (0 = none), "
                    "every chain ending at 0"
                )
            hier = np.zeros(v, np.int32)
            hier[: n + 1] = hier_parent
            hier.setflags(write=False)
            self._hier = hier

    # ---- files ----------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "n_codes": self.n_codes,
            "chunking": self.chunking,
            "pattern": SPLIT_PATTERN if self.chunking else None,
            "special_token_ids": self.get_special_tokens(),
            "training": self.training,
        }

    def _files(self) -> dict[str, bytes]:
        config = json.dumps(self._config(), ensure_ascii=False, sort_keys=True, separators=(",", ":")) + "\n"
        files = {
            CONFIG_FILE: config.encode("utf-8"),
            PARENT_FILE: int32_npy(self._parents),
            LAST_BYTE_FILE: int32_npy(self._last_bytes),
        }
        if self._hier is not None:
            files[HIER_PARENT_FILE] = int32_npy(self._hier)
        if not self.trie.is_prefix_closed:
            files[TRIE_PARENT_FILE] = int32_npy(self.trie.parent)
            files[TRIE_LAST_BYTE_FILE] = int32_npy(self.trie.last_byte.astype(np.int32))
        return files

    @classmethod
    def _from_files(cls, directory: Path, meta: dict[str, Any]) -> LZ78Tokenizer:
        where = directory / CONFIG_FILE
        config = json.loads(where.read_text(encoding="utf-8"))
        if (
            not isinstance(config, dict)
            or not isinstance(config.get("n_codes"), int)
            or not isinstance(config.get("chunking"), bool)
        ):
            raise TokenizerFileError(f"{where} lacks n_codes or chunking; re-run the tokenizer stage")
        if config["chunking"] and config.get("pattern") != SPLIT_PATTERN:
            raise TokenizerFileError(
                f"{where} was chunked with a split pattern this code does not use; re-run the tokenizer stage"
            )
        parents = _load_ids(directory / PARENT_FILE)
        last = _load_ids(directory / LAST_BYTE_FILE)
        n = config["n_codes"]
        v = n + N_RESERVED
        if parents.shape != (v,) or last.shape != (v,):
            raise TokenizerFileError(
                f"{directory}: {PARENT_FILE} {parents.shape} and {LAST_BYTE_FILE} {last.shape} must "
                f"both have {v} entries (n_codes={n} + {N_RESERVED}); re-run the tokenizer stage"
            )
        want_last = np.full(v - n - 1, NO_BYTE, np.int32)
        want_last[:N_BYTES] = np.arange(N_BYTES)
        if parents[n + 1 :].any() or not np.array_equal(last[n + 1 :], want_last) or last[0] != NO_BYTE:
            raise TokenizerFileError(
                f"{directory}: the fallback and special rows of {PARENT_FILE}/{LAST_BYTE_FILE} do not "
                "follow the lz78 layout; re-run the tokenizer stage"
            )
        if ((last[1 : n + 1] < 0) | (last[1 : n + 1] >= N_BYTES)).any():
            raise TokenizerFileError(f"{directory / LAST_BYTE_FILE}: a dictionary code's last byte is outside 0..255; "
                                     "re-run the tokenizer stage")
        try:
            if (directory / TRIE_PARENT_FILE).exists():
                trie_last = _load_ids(directory / TRIE_LAST_BYTE_FILE)
                if ((trie_last < 0) | (trie_last >= N_BYTES)).any():
                    raise LZ78TrieError(f"{TRIE_LAST_BYTE_FILE} holds a byte outside 0..255")
                trie = LZ78Trie(_load_ids(directory / TRIE_PARENT_FILE), trie_last, n)
            else:
                trie_last = last[: n + 1].copy()
                trie_last[0] = 0
                trie = LZ78Trie(parents[: n + 1], trie_last)
        except LZ78TrieError as e:
            raise TokenizerFileError(f"{directory}: {e}; re-run the tokenizer stage") from None
        same = np.array_equal(trie.code_parents(), parents[: n + 1]) and np.array_equal(
            trie.last_byte[1 : n + 1], last[1 : n + 1]
        )
        if not same:
            raise TokenizerFileError(f"{directory}: {PARENT_FILE}/{LAST_BYTE_FILE} disagree with the trie; re-run the "
                                     "tokenizer stage")
        hier = None
        if (directory / HIER_PARENT_FILE).exists():
            hier = _load_ids(directory / HIER_PARENT_FILE)
            if hier.shape != (v,) or hier[n + 1 :].any():
                raise TokenizerFileError(f"{directory / HIER_PARENT_FILE} must have {v} entries, 0 past the codes; "
                                         "re-run the tokenizer stage")
            hier = hier[: n + 1]
        return cls(trie, chunking=config["chunking"], training=config.get("training"), hier_parent=hier)

    # ---- encoding -------------------------------------------------------------------------

    def _codes_to_ids(self, codes: np.ndarray) -> np.ndarray:
        # A fallback marker -1 - b becomes N + 1 + b, which is N - marker.
        return np.where(codes > 0, codes, self.n_codes - codes).astype(np.uint32)

    def _encode_arrays(self, texts: Sequence[str], num_threads: int) -> list[np.ndarray]:
        if self._split is None:
            codes = lz78_trie.encode_batch(
                self.trie, [_utf8(t) for t in texts], num_threads=num_threads, fast=self.fast
            )
            return [self._codes_to_ids(c) for c in codes]
        # Chunks are matched as separate documents, then joined back per text.
        chunks = [self._split.findall(t) for t in texts]
        flat = lz78_trie.encode_batch(self.trie, [_utf8(c) for cs in chunks for c in cs],
                                      num_threads=num_threads, fast=self.fast)
        out, k = [], 0
        for cs in chunks:
            out.append(self._codes_to_ids(np.concatenate([np.zeros(0, np.int32), *flat[k : k + len(cs)]])))
            k += len(cs)
        return out

    def _encode_ordinary(self, text: str) -> list[int]:
        return self._encode_arrays([text], 1)[0].tolist()

    def _encode_ordinary_batch(self, texts: Sequence[str], num_threads: int) -> list[list[int]]:
        return [a.tolist() for a in self._encode_arrays(texts, max(1, num_threads))]

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        return self._encode_arrays(list(texts), 1)

    def decode(self, ids: Iterable[int]) -> str:
        if not isinstance(ids, (np.ndarray, list, tuple)):
            ids = list(ids)
        array = _id_array(ids) if self.fast else None
        if array is None:
            # The plain path: also what takes an empty list, and ids too large for any array.
            flat, offsets = self._plain_tables()
            return decode_with_specials(self._checked_ids(ids), self._id_to_special,
                                        lambda run: b"".join([flat[offsets[i] : offsets[i + 1]] for i in run]))
        v = self.get_vocab_size()
        if array.min() < 0 or array.max() >= v:
            bad = array[(array < 0) | (array >= v)][0]
            raise ValueError(f"token id {int(bad)} is outside the vocabulary [0, {v})")
        # Specials are written as their names, and the runs between them decoded on their own, as
        # decode_with_specials does; each run is gathered into one buffer by a compiled loop.
        text: list[str] = []
        start = 0
        for k in [*np.flatnonzero(array > self.n_codes + N_BYTES).tolist(), array.shape[0]]:
            if k > start:
                text.append(self._decode_run(array[start:k]))
            if k < array.shape[0]:
                text.append(self._id_to_special[int(array[k])])
            start = k + 1
        return "".join(text)

    def _decode_run(self, ids: np.ndarray) -> str:
        kernels = lz78_trie._kernels()
        out = np.empty(kernels.gathered_length(ids, self._offsets), np.uint8)
        kernels.gather_into(ids, self._flat, self._offsets, out)
        return str(out, "utf-8", "replace")

    def _plain_tables(self) -> tuple[bytes, list[int]]:
        if self._plain is None:
            self._plain = (self._flat.tobytes(), self._offsets.tolist())
        return self._plain

    def _piece(self, token_id: int) -> bytes:
        return self._flat[self._offsets[token_id] : self._offsets[token_id + 1]].tobytes()

    def id_to_token(self, token_id: int) -> str:
        if token_id in self._id_to_special:
            return self._id_to_special[token_id]
        self._checked_ids([token_id])
        return self._piece(token_id).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return self.n_codes + N_RESERVED

    def _compute_token_bytes(self) -> np.ndarray:
        return np.diff(self._offsets).astype(np.int32)

    # ---- per-id tree metadata -------------------------------------------------------------

    def fallback_id(self, byte: int) -> int:
        """The id that stands for the single byte `byte` when no code starts with it."""
        if not 0 <= byte < N_BYTES:
            raise ValueError(f"byte {byte} is outside 0..255")
        return self.n_codes + 1 + byte

    def token_parents(self) -> np.ndarray:
        """int32 (V,), read-only: each id's parent id (0 for the root, fallback and special ids)."""
        return self._parents

    def token_last_bytes(self) -> np.ndarray:
        """int32 (V,), read-only: the last byte each id spells; -1 for the root and special ids."""
        return self._last_bytes

    def token_pieces(self) -> list[bytes | None]:
        """The bytes of each id, None for the root and the specials. A one-byte code and that
        byte's fallback id spell the same byte."""
        return [None] + [self._piece(i) for i in range(1, self.n_codes + 1 + N_BYTES)] + [None] * len(SPECIAL_TOKENS)

    def prefix_tree(self) -> PrefixTree:
        """A code's ancestors are its chain of parents without the root: every proper prefix that
        is a code, nearest first (the whole trie chain when every prefix is a code); fallback and
        special ids have none (their parent, the root, is not a token)."""
        if self._prefix_tree is None:
            chains, depths = self.ancestor_chains()  # row i: i itself, then its ancestors, 0-padded
            ancestors = chains[:, 1:].astype(np.int64)
            if ancestors.shape[1] == 0:  # every code one byte long: keep one column
                ancestors = np.zeros((chains.shape[0], 1), np.int64)
            ancestors[ancestors == 0] = NO_TOKEN  # the root is padding, never an ancestor
            self._prefix_tree = PrefixTree(
                ancestors=ancestors,
                depths=np.maximum(depths.astype(np.int64) - 1, 0),
                parent=np.where(self._parents > 0, self._parents, NO_TOKEN).astype(np.int64),
                last_byte=self._last_bytes.astype(np.int64),
            )
        return self._prefix_tree

    @property
    def has_hierarchical_parents(self) -> bool:
        """Whether the tokenizer was read from a `compressed` dictionary, the layout that gives them."""
        return self._hier is not None

    def hierarchical_parents(self) -> np.ndarray:
        """int64 (V,): each id's hierarchical parent (NO_TOKEN where it has none). Only for a
        tokenizer read from a `compressed` dictionary; LZ78VocabError otherwise."""
        if self._hier is None:
            raise LZ78VocabError(
                "hierarchical parents exist only for a dictionary read from the `compressed` TSV layout "
                "(tokenizer.options.dictionary); use model.embedding: structured for this tokenizer"
            )
        return np.where(self._hier > 0, self._hier, NO_TOKEN).astype(np.int64)

    def structure_clash(self) -> str | None:
        """Why a structured embedding (a code's parent row plus its last byte's row) cannot tell
        two codes apart, or None when it can. Every code is its parent plus one byte when every
        prefix is a code, so (parent, last byte) names one code; with a dictionary file's prefixes
        left out (`prefixes="file"`), or in a dictionary trained `portable` (by whole characters),
        a code may add several bytes to its parent, and two codes (`é` and `©` under the root,
        both ending in byte 0xa9) may then read the same rows."""
        if self.trie.is_prefix_closed:
            return None
        n = self.n_codes
        keys = self._parents[1 : n + 1].astype(np.int64) * 256 + self._last_bytes[1 : n + 1]
        order = np.argsort(keys, kind="stable")
        same = np.flatnonzero(keys[order][1:] == keys[order][:-1])
        if not same.size:
            return None
        a, b = (int(order[same[0]]) + 1, int(order[same[0] + 1]) + 1)
        if self.training is not None and self.training.get("portable"):
            # A trained dictionary has no file to close: its codes add whole characters by design.
            fix = ("it was trained with tokenizer.options.portable, whose codes add a whole character to their "
                   "parent: use model.embedding: flat, or train without portable (every code is then its parent "
                   "plus one byte)")
        else:
            fix = ("read the dictionary with tokenizer.options.prefixes: closed (every code is then its parent plus "
                   "one byte)")
        return (
            f"codes {a} ({self._piece(a)!r}) and {b} ({self._piece(b)!r}) both have parent {int(self._parents[a])} and "
            f"last byte {int(self._last_bytes[a])}, so a structured embedding reads the same rows for both: {fix}"
        )

    def ancestor_chains(self) -> tuple[np.ndarray, np.ndarray]:
        """(chains, depths) over the whole vocab: row i of the int32 (V, D) matrix is i, its parent,
        grandparent, ... padded with 0; depths (V,) counts the non-padding entries (1 + the code's
        proper prefixes that are codes, which is its byte length when every prefix is a code; 1
        for fallback and special ids, 0 for the root). Read-only, computed once."""
        if self._chains is None:
            chains, depths = lz78_trie.ancestor_chains(self._parents)
            chains.setflags(write=False)
            depths.setflags(write=False)
            self._chains = (chains, depths)
        return self._chains


def _id_array(ids: np.ndarray | list[int] | tuple[int, ...]) -> np.ndarray | None:
    """`ids` as a 1-d int32 or int64 array for the compiled decoder (int32 from a list: 4 bytes an
    id), or None where only the plain path can say what is wrong (or there is nothing to do)."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or not ids.size:
            return None
        return ids if ids.dtype in (np.int32, np.int64) else ids.astype(np.int64)
    if not ids:
        return None
    try:
        return np.fromiter(ids, dtype=np.int32, count=len(ids))
    except (OverflowError, TypeError, ValueError):
        return None


def _load_ids(path: Path) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except ValueError as e:
        raise TokenizerFileError(f"{path} is not a plain .npy array ({e}); re-run the tokenizer stage") from None
    if array.dtype != np.int32 or array.ndim != 1:
        raise TokenizerFileError(
            f"{path} holds {array.dtype} {array.shape}, expected a 1-d int32 array; re-run the tokenizer stage"
        )
    return array
