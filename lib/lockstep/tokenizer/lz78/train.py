"""The `lz78` kind's trainer: the LZ78 parse that learns a byte trie (strategies `standard`,
`frequency_gated`, `multi_round`), the kind's options (`tokenizer.options:` with `kind: lz78`) and
`train`, which learns a dictionary from text or reads one trained elsewhere (through `lz78.tsv`).
Only the tokenizer stage's path imports it: editing it reruns the tokenizer stage and nothing that
merely loads a tokenizer.

Every training function has a plain Python reference and a compiled path (`fast=True`, the numba
parse in `lockstep.tokenizer.lz78.train_kernels`) that gives identical results;
tests/test_lz78_trie.py checks the two against each other."""

from __future__ import annotations

import heapq
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, Literal

import numpy as np
import regex

from lockstep.core.config import FieldError, check_range
from lockstep.tokenizer.base import SPECIAL_TOKENS
from lockstep.tokenizer.bpe import N_BYTES, SPLIT_PATTERN
from lockstep.tokenizer.lz78 import DICTIONARY_DIR, N_RESERVED, PREFIX_MODES, LZ78Tokenizer, LZ78VocabError, _utf8
from lockstep.tokenizer.lz78.trie import LZ78Trie, LZ78TrieError, _check_docs, _pack, encode_batch
from lockstep.tokenizer.lz78.tsv import (
    LZ78DictionaryError,
    dictionary_layout,
    read_compressed_tsv,
    read_lz78_tsv,
    trie_from_tokens,
)
from lockstep.tokenizer.options import KindOptions

log = logging.getLogger("lockstep.tokenizer")

STRATEGIES = ("standard", "frequency_gated", "multi_round")
# frequency_gated defaults: an eviction pass every 4096 phrases while the dictionary is full,
# dropping leaves that fewer than 2 phrases walked through (a leaf seen once is the phrase that
# created it and nothing since).
GATE_PERIOD_PHRASES = 4096
GATE_MIN_COUNT = 2
# multi_round trains this many times the budget before pruning.
ROUND_FACTOR = 4
# Symbols of the parse: bytes, or code points for the parse by whole characters (`portable`).
BYTE_RADIX = 256
CHAR_RADIX = 0x110000
# Where the parse by characters cuts a document: at the bytes the reference's tab- and
# line-based format cannot hold inside a token, and (as surrogateescape decodes them) at every
# byte outside valid UTF-8.
_CUT = re.compile("[\t\n\r\udc80-\udcff]+")

@dataclass(frozen=True, eq=False)
class LZ78Training:
    """What training returns: the trie, and `uses[c]`, how many times greedy encoding of the
    training documents emits code c (uses[0]: bytes that fell back). For multi_round these are
    the counts re-taken after pruning."""

    trie: LZ78Trie
    uses: np.ndarray


def _parse_reference(docs: Sequence[Sequence[int]], max_codes: int, gated: bool, period: int, min_count: int,
                     radix: int) -> tuple[np.ndarray, np.ndarray]:
    """The LZ78 parse: walk the trie from the root along a document's symbols (bytes, or code
    points below `radix` for the parse by characters); at the first symbol with no child, add the
    code (current node, symbol), emit it and restart at the root on the next symbol. A document
    ends mid-walk without adding anything. Returns (parent, last symbol) over codes 0..N.

    `standard` (not gated) stops at max_codes codes. `frequency_gated` reads every symbol: count[c]
    is the number of phrases whose walk reached c (1 at creation), a phrase that finds the
    dictionary full adds nothing, and every `period` phrases, if the dictionary is full, the
    leaves with count < min_count are evicted (survivors keep their order and counts)."""
    parent, last_byte, count = [0], [0], [0]
    children: dict[int, int] = {}
    phrases = 0
    for doc in docs:
        node = 0
        for b in doc:
            nxt = children.get(node * radix + b)
            if nxt is not None:
                node = nxt
                count[node] += 1
                continue
            if len(parent) <= max_codes:
                children[node * radix + b] = len(parent)
                parent.append(node)
                last_byte.append(b)
                count.append(1)
                if len(parent) > max_codes and not gated:
                    return np.array(parent), np.array(last_byte)
            node = 0
            phrases += 1
            if gated and len(parent) > max_codes and phrases % period == 0:
                has_child = set(parent[1:])
                keep = [c for c in range(1, len(parent)) if c in has_child or count[c] >= min_count]
                new_code = {old: new for new, old in enumerate(keep, 1)}
                new_code[0] = 0
                parent = [0] + [new_code[parent[c]] for c in keep]
                last_byte = [0] + [last_byte[c] for c in keep]
                count = [0] + [count[c] for c in keep]
                children = {p * radix + b: c for c, (p, b) in enumerate(zip(parent, last_byte)) if c}
    return np.array(parent), np.array(last_byte)


def _parse(docs: list[bytes], max_codes: int, gated: bool, period: int, min_count: int, fast: bool) -> LZ78Trie:
    """The parse over bytes, as a trie."""
    if not fast:
        return LZ78Trie(*_parse_reference(docs, max_codes, gated, period, min_count, BYTE_RADIX))
    # numba: imported and compiled on first use, like the encoding kernels.
    from lockstep.tokenizer.lz78 import train_kernels

    buf, offsets = _pack(docs)
    return LZ78Trie(*train_kernels.parse(buf, offsets, max_codes, gated, period, min_count, BYTE_RADIX))


def portable_pieces(docs: Sequence[bytes]) -> list[np.ndarray]:
    """What the parse by characters reads of `docs`: each document cut at every tab, `\\n`, `\\r`
    and byte outside valid UTF-8 (those bytes left out, so no code holds one and encoding falls
    back to their single-byte ids), the pieces as int32 arrays of code points."""
    pieces = []
    for doc in docs:
        # surrogateescape turns each byte outside valid UTF-8 into one of U+DC80..U+DCFF, which _CUT cuts at.
        for piece in _CUT.split(doc.decode("utf-8", "surrogateescape")):
            if piece:
                pieces.append(np.frombuffer(piece.encode("utf-32-le"), np.int32))
    return pieces


def _parse_characters(pieces: list[np.ndarray], max_codes: int, gated: bool, period: int, min_count: int,
                      fast: bool) -> tuple[np.ndarray, np.ndarray]:
    """The parse over code points: (parent, code point) of codes 0..N, each code its parent plus
    one character."""
    if not fast:
        return _parse_reference([p.tolist() for p in pieces], max_codes, gated, period, min_count, CHAR_RADIX)
    from lockstep.tokenizer.lz78 import train_kernels

    offsets = np.zeros(len(pieces) + 1, np.int64)
    offsets[1:] = np.cumsum([p.shape[0] for p in pieces])
    buf = np.concatenate([np.zeros(0, np.int32), *pieces])
    return train_kernels.parse(buf, offsets, max_codes, gated, period, min_count, CHAR_RADIX)


def character_trie(parent: np.ndarray, code_points: np.ndarray) -> LZ78Trie:
    """The byte trie of codes 1..N that each add the character `code_points[c]` to code
    `parent[c]` (a smaller code): the codes keep their numbers, and the leading bytes of a
    character that are no code become nodes past them (see `lz78.tsv.trie_from_tokens`)."""
    tokens = [b""]
    for p, cp in zip(parent[1:].tolist(), code_points[1:].tolist()):
        tokens.append(tokens[p] + chr(cp).encode("utf-8"))
    return trie_from_tokens(tokens[1:])


def _prune_codes(parent: np.ndarray, uses: np.ndarray, max_codes: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept codes, root first; their parents renumbered) of a prefix-closed parent array cut to
    `max_codes` codes: repeatedly drop the leaf with the fewest uses (ties: the newest code
    first), so a code goes only after all its extensions. Survivors keep their relative order."""
    n = parent.shape[0] - 1
    n_children = np.bincount(parent[1:], minlength=n + 1)
    heap = [(int(uses[c]), -c) for c in range(1, n + 1) if n_children[c] == 0]
    heapq.heapify(heap)
    alive = np.ones(n + 1, np.bool_)
    for _ in range(n - max_codes):
        _, neg = heapq.heappop(heap)
        c = -neg
        alive[c] = False
        p = int(parent[c])
        n_children[p] -= 1
        if p and n_children[p] == 0:
            heapq.heappush(heap, (int(uses[p]), -p))
    keep = np.flatnonzero(alive)  # includes the root at 0
    new_code = np.zeros(n + 1, np.int32)
    new_code[keep] = np.arange(keep.size, dtype=np.int32)
    return keep, new_code[parent[keep]]


def prune(trie: LZ78Trie, uses: np.ndarray, max_codes: int) -> LZ78Trie:
    """The trie cut to `max_codes` codes, still prefix-closed (see `_prune_codes`). O(N log N)
    with a heap; no byte loop, so one version serves both paths."""
    if not trie.is_prefix_closed:
        raise LZ78TrieError(
            "prune keeps a trie prefix-closed and needs one to start from; close it first (LZ78Trie.closed)"
        )
    if trie.n_codes <= max_codes:
        return trie
    keep, parent = _prune_codes(trie.parent, uses, max_codes)
    return LZ78Trie(parent, trie.last_byte[keep])


def train_lz78(
    docs: Sequence[bytes],
    max_codes: int,
    *,
    strategy: str = "standard",
    gate_period_phrases: int = GATE_PERIOD_PHRASES,
    gate_min_count: int = GATE_MIN_COUNT,
    round_factor: int = ROUND_FACTOR,
    portable: bool = False,
    fast: bool = False,
) -> LZ78Training:
    """An LZ78 dictionary of at most `max_codes` codes learned from `docs` (the parse restarts at
    each document), and the use counts of its codes on `docs`.

    - `standard`: the LZ78 parse, which stops adding codes at max_codes.
    - `frequency_gated`: the parse over all of `docs`; every `gate_period_phrases` phrases while
      the dictionary is full, leaves that fewer than `gate_min_count` phrases reached are evicted,
      so the budget moves from one-off phrases to recurring ones.
    - `multi_round`: the standard parse to `round_factor` x max_codes codes, use counts by greedy
      encoding of `docs`, `prune` to max_codes, counts re-taken.

    `portable` parses by whole UTF-8 characters instead of bytes, over `portable_pieces(docs)`:
    every code is valid UTF-8 with no tab, `\\n` or `\\r`, so the reference's TSV format carries
    it exactly, and those bytes (and any byte outside valid UTF-8) encode as their fallback ids.
    The trie then has nodes past the codes for the leading bytes of multi-byte characters.

    Deterministic: the same docs and arguments give identical arrays, on either path."""
    if strategy not in STRATEGIES:
        raise ValueError(f"LZ78 strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    for name, value in (("max_codes", max_codes), ("gate_period_phrases", gate_period_phrases),
                        ("gate_min_count", gate_min_count), ("round_factor", round_factor)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"LZ78 {name}={value!r} must be a positive integer")
    docs = _check_docs(docs)
    gated = strategy == "frequency_gated"
    budget = max_codes * round_factor if strategy == "multi_round" else max_codes
    if not portable:
        trie = _parse(docs, budget, gated, gate_period_phrases, gate_min_count, fast)
        uses = count_uses(trie, docs, fast=fast)
        if strategy == "multi_round" and trie.n_codes > max_codes:
            trie = prune(trie, uses, max_codes)
            uses = count_uses(trie, docs, fast=fast)
        return LZ78Training(trie, uses)
    parent, code_points = _parse_characters(portable_pieces(docs), budget, gated, gate_period_phrases,
                                            gate_min_count, fast)
    trie = character_trie(parent, code_points)
    uses = count_uses(trie, docs, fast=fast)
    if strategy == "multi_round" and trie.n_codes > max_codes:
        keep, parent = _prune_codes(parent, uses, max_codes)
        trie = character_trie(parent, code_points[keep])
        uses = count_uses(trie, docs, fast=fast)
    return LZ78Training(trie, uses)


def count_uses(trie: LZ78Trie, docs: Sequence[bytes], *, fast: bool = False) -> np.ndarray:
    """int64 counts over codes 0..N of greedy encoding of `docs`; entry 0 counts fallback bytes."""
    ids = np.concatenate([np.zeros(0, np.int32), *encode_batch(trie, docs, fast=fast)])
    return np.bincount(np.maximum(ids, 0), minlength=trie.n_codes + 1).astype(np.int64)


# --- the kind: options and trainer --------------------------------------------------------------


@dataclass(frozen=True)
class LZ78Options(KindOptions):
    """`tokenizer.options:` of kind lz78."""

    MIN_VOCAB: ClassVar[int | None] = N_RESERVED + 1  # the root, 256 fallback bytes, 9 specials and one code
    FORMER_KEYS: ClassVar[dict[str, str]] = {
        "lz78_strategy": "strategy", "lz78_gate_period_phrases": "gate_period_phrases",
        "lz78_gate_min_count": "gate_min_count", "lz78_round_factor": "round_factor", "lz78_chunking": "chunking",
        "lz78_dictionary": "dictionary", "lz78_prefixes": "prefixes",
    }  # fmt: skip

    # how the dictionary is learned (train_lz78): standard (the plain parse, stops adding at the
    # budget), frequency_gated (evicts leaves that fewer than gate_min_count phrases reached, every
    # gate_period_phrases phrases), or multi_round (parse to round_factor x the budget, keep the
    # most used codes)
    strategy: Literal["standard", "frequency_gated", "multi_round"] = "standard"
    gate_period_phrases: int = GATE_PERIOD_PHRASES  # frequency_gated only: phrases between eviction passes
    gate_min_count: int = GATE_MIN_COUNT  # frequency_gated only: a leaf reached by fewer phrases is evicted
    round_factor: int = ROUND_FACTOR  # multi_round only: times the budget parsed before pruning
    chunking: bool = False  # split text with bpe's pattern first; no token spans two chunks
    # a dictionary trained elsewhere (TSV, `lz78` or `compressed` layout) instead of training one;
    # a path under corpus/dictionaries/, which the tokenizer stage depends on
    dictionary: str | None = None
    # dictionary only: the byte prefixes of its tokens that the file lacks stay out ("file": ids
    # and longest-match splits as the reference LZ78 tokenizer gives them) or become extra codes
    # after the file's ("closed": every code is its parent plus one byte)
    prefixes: Literal["file", "closed"] = "file"
    # train by whole UTF-8 characters, cutting documents at tabs and line breaks, so that every
    # code is one the reference's TSV format carries exactly (see lz78.train.train_lz78)
    portable: bool = False

    def __post_init__(self) -> None:
        for name in ("gate_period_phrases", "gate_min_count", "round_factor"):
            check_range(name, getattr(self, name), ge=1, why="lz78 training only")
        if self.dictionary is not None:
            path = PurePosixPath(self.dictionary)
            if path.is_absolute() or ".." in path.parts or path.parts[:2] != DICTIONARY_DIR.parts:
                raise FieldError(
                    "dictionary",
                    self.dictionary,
                    f"must be a relative path under {DICTIONARY_DIR}/ (the folder the tokenizer stage depends "
                    f"on, so a changed dictionary reruns it): copy the file there and name it as "
                    f"{DICTIONARY_DIR}/<file>",
                )
            if self.portable:
                raise FieldError("portable", self.portable,
                                 "applies to training (a dictionary file's codes are what the file holds): leave "
                                 "portable out, or drop dictionary to train one")
        elif self.prefixes != "file":
            raise FieldError("prefixes", self.prefixes,
                             "applies to a dictionary read from tokenizer.options.dictionary (a trained one has every "
                             "prefix already): set dictionary, or prefixes: file")

    def learns(self) -> bool:
        return self.dictionary is None

    def uses_vocab_size(self) -> bool:
        return self.dictionary is None  # a dictionary file decides the vocabulary

    def train_kwargs(self, *, seed: int, root: Path) -> dict[str, Any]:
        if self.dictionary is not None:
            return {"chunking": self.chunking, "dictionary": self.dictionary, "prefixes": self.prefixes, "root": root}
        kwargs: dict[str, Any] = {"chunking": self.chunking, "strategy": self.strategy}
        if self.strategy == "frequency_gated":
            kwargs.update(gate_period_phrases=self.gate_period_phrases, gate_min_count=self.gate_min_count)
        elif self.strategy == "multi_round":
            kwargs["round_factor"] = self.round_factor
        if self.portable:  # only when set, so that a dictionary trained without it records what it did before
            kwargs["portable"] = True
        return kwargs


TRAINING_OPTIONS = ("strategy", "gate_period_phrases", "gate_min_count", "round_factor", "portable")


def train(
    texts: Iterable[str],
    *,
    vocab_size: int | None = None,
    chunking: bool = False,
    fast: bool = True,
    dictionary: str | None = None,
    prefixes: str = "file",
    root: str | Path = ".",
    **options: Any,
) -> LZ78Tokenizer:
    """Learn the dictionary from the UTF-8 bytes of `texts` (each text, or each chunk when
    `chunking`, is one document: the parse restarts at its start). `vocab_size` is the total,
    so the dictionary gets vocab_size - 266 codes. Options: `strategy` ("standard",
    "frequency_gated", "multi_round") and its parameters, and `portable`, see `train_lz78`.

    With `dictionary` (the `tokenizer.options.dictionary` path, relative to the project `root`)
    the tokenizer is read from that file instead (`from_dictionary`, with `prefixes`); `texts` and
    `vocab_size` are not used, and LZ78DictionaryError names the key, the file, the line and the fix."""
    if dictionary is not None:
        try:
            tok = from_dictionary(project_dictionary(root, dictionary), chunking=chunking, fast=fast, prefixes=prefixes)
        except LZ78DictionaryError as e:
            raise LZ78DictionaryError(f"tokenizer.options.dictionary={dictionary!r}: {e}") from None
        log.info("lz78 dictionary %s: %d codes, vocab %d (tokenizer.vocab_size is not used)",
                 dictionary, tok.n_codes, tok.get_vocab_size())
        return tok
    unknown = sorted(set(options) - set(TRAINING_OPTIONS))
    if unknown:
        raise ValueError(f"unknown lz78 tokenizer option(s) {unknown}; the options are chunking, fast, "
                         f"{', '.join(TRAINING_OPTIONS)}")
    if not isinstance(vocab_size, int) or vocab_size <= N_RESERVED:
        raise LZ78VocabError(f"lz78 vocab_size={vocab_size} must be at least {N_RESERVED + 1}: the root, "
                             f"{N_BYTES} fallback bytes and {len(SPECIAL_TOKENS)} special tokens take {N_RESERVED} ids")
    split = regex.compile(SPLIT_PATTERN) if chunking else None
    docs: list[bytes] = []
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"lz78 trains on str texts, got {type(text).__name__}")
        if split is None:
            docs.append(_utf8(text))
        else:
            docs.extend(_utf8(chunk) for chunk in split.findall(text))
    max_codes = vocab_size - N_RESERVED
    trained = train_lz78(docs, max_codes, fast=fast, **options)
    if trained.trie.n_codes < max_codes:
        raise LZ78VocabError(
            f"the training text yields {trained.trie.n_codes} LZ78 codes, short of the {max_codes} that "
            f"vocab_size={vocab_size} needs; lower vocab_size to at most {trained.trie.n_codes + N_RESERVED} "
            "or train on more text"
        )
    training = {"strategy": "standard", **options}
    return LZ78Tokenizer(trained.trie, chunking=chunking, fast=fast, training=training)


def from_dictionary(
    path: str | Path, *, chunking: bool = False, fast: bool = True, prefixes: str = "file"
) -> LZ78Tokenizer:
    """A tokenizer over a dictionary trained elsewhere, in either TSV layout of
    lockstep.tokenizer.lz78.tsv (told apart by their column count): codes 1..N are the file's
    tokens, its codes in ascending order. `prefixes` says what becomes of the byte prefixes of
    tokens that the file lacks: `file` leaves them out, so encoding takes the longest of the
    file's tokens that matches, as the reference LZ78 tokenizer does; `closed` adds them as
    codes N+1..M (shortest first), so every code is its parent plus one byte. A `compressed`
    dictionary keeps its hierarchical parents: a file token's is its nearest coded ancestor
    node in the file's tree, an added prefix's its trie parent. LZ78DictionaryError names the
    file, line and fix of a malformed file."""
    if prefixes not in PREFIX_MODES:
        raise ValueError(f"prefixes={prefixes!r} must be one of {', '.join(PREFIX_MODES)}")
    path = Path(path)
    layout = dictionary_layout(path)
    source = {"dictionary": path.name, "layout": layout, "prefixes": prefixes}
    hier = None
    if layout == "lz78":
        trie = read_lz78_tsv(path, fast=fast).trie
    else:
        compressed = read_compressed_tsv(path)
        trie = compressed.trie()
        hier = compressed.hier_parent().astype(np.int64)
    if prefixes == "closed" and not trie.is_prefix_closed:
        n = trie.n_codes
        trie = trie.closed()
        if hier is not None:
            hier = np.concatenate([hier, trie.parent[n + 1 :]])  # an added prefix's: its trie parent
    return LZ78Tokenizer(trie, chunking=chunking, fast=fast, training=source, hier_parent=hier)


def project_dictionary(root: str | Path, name: str) -> Path:
    """The file that `tokenizer.options.dictionary: name` (a path relative to the project `root`,
    under DICTIONARY_DIR) stands for, symlinks resolved: LZ78DictionaryError, saying what to do,
    unless it is a file inside DICTIONARY_DIR. The tokenizer stage depends on that folder only, so
    a link inside it to a file elsewhere would let the file change without a rerun (and read
    whatever the link points at)."""
    root = Path(root)
    folder = (root / DICTIONARY_DIR).resolve()
    path = root / name
    try:
        real = path.resolve(strict=True)
    except FileNotFoundError:
        raise LZ78DictionaryError(f"{path}: no such file; copy the dictionary into {DICTIONARY_DIR}/ and name it "
                                  f"{DICTIONARY_DIR}/<file>") from None
    except (OSError, RuntimeError) as e:  # a symlink loop, or a folder on the way that cannot be searched
        raise LZ78DictionaryError(f"{path}: cannot resolve the path ({e}); copy the dictionary into {DICTIONARY_DIR}/ "
                                  "as a plain file") from None
    if not real.is_relative_to(folder):
        raise LZ78DictionaryError(
            f"{path} resolves to {real} (through a link), outside {DICTIONARY_DIR}/; copy the file "
            f"into {DICTIONARY_DIR}/ instead of linking to it (the tokenizer stage tracks that folder "
            "only)"
        )
    if not real.is_file():
        raise LZ78DictionaryError(f"{path} is {'a folder' if real.is_dir() else 'not a regular file'}; name a TSV "
                                  f"dictionary file in {DICTIONARY_DIR}/")
    return real
