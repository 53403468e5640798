"""The tokenizer interface shared by every kind, the special tokens, the on-disk layout (meta.json
with per-file sha256) and chat rendering. Knows nothing about how any kind splits text. It runs
past 400 lines because the chat template and the checks on the conversation records it renders
belong with the special tokens they place; each kind's module stays small.

Special tokens: every kind has the nine below, except a char tokenizer built without them (for id
parity with plain character-level references). Such a tokenizer encodes, decodes and is measured
like any other, but it has no `<|bos|>` and no chat template: asking it for either raises
NoSpecialTokensError, which is how the token caches (hence training) and chat refuse it before
doing any work.

System messages: the chat format has no system role token. A leading system message is folded
into the first user message, its text first, then a blank line (`"\\n\\n"`), then the user's text;
a conversation that starts with a system message must therefore have a user message next.
"""

from __future__ import annotations

import io
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from lockstep.core.io import atomic_dir, sha256_bytes, sha256_file, sha256_of_manifest, write_json
from lockstep.tokenizer.prefix_tree import PrefixTree, prefix_tree

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|bos|>",
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
)
BOS = "<|bos|>"
META_FILE = "meta.json"
TOKEN_BYTES_FILE = "token_bytes.npy"
# The prefix tree of the vocabulary (lockstep.tokenizer.prefix_tree), saved with every kind that
# has one: each id's proper byte-prefixes that are tokens, nearest first, -1 past its depth.
ANCESTORS_FILE = "token_ancestors.npy"
DEPTHS_FILE = "token_depths.npy"
FORMAT_VERSION = 1
DEFAULT_ENCODE_THREADS = 8
# What a tokenizer can provide a model beyond its ids, by the name a token embedding `needs`
# (lockstep.model.embeddings): each a pair of int64 arrays over the ids, (parents, last_bytes),
# -1 for no parent and for an id that spells no byte. name -> what it is, in words.
TOKEN_STRUCTURES = {
    "prefix": "prefix-tree parents",  # each id's longest proper byte-prefix that is an id
    "hierarchical": "hierarchical parents",  # the parents a dictionary file gives its tokens
}


class TokenizerFileError(ValueError):
    """A tokenizer directory is missing a file, or a file does not match its recorded sha256."""


class ConversationError(ValueError):
    """A conversation does not follow the record format (see docs/internals.md, "Records")."""


class NotProvidedError(ValueError):
    """The tokenizer does not provide what was asked of it (a token structure); the message says
    which kinds and options do."""


class NoPrefixTreeError(NotProvidedError):
    """The tokenizer's ids do not stand for distinct byte strings (sentencepiece), so it has no
    prefix tree for structured embeddings or the prefix-smoothed loss."""


class NoSpecialTokensError(ValueError):
    """The tokenizer was built without special tokens, and the caller needs `<|bos|>` or the chat
    template (a token cache, training, chat)."""


def int32_npy(array: np.ndarray) -> bytes:
    """The exact bytes of an int32 .npy file, no pickle; the same array gives the same bytes."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array, dtype=np.int32), allow_pickle=False)
    return buf.getvalue()


def token_bytes_npy(token_bytes: np.ndarray) -> bytes:
    """The exact bytes of `token_bytes.npy`."""
    return int32_npy(token_bytes)


class Tokenizer(ABC):
    """Text <-> token ids for one tokenizer kind, plus the chat template.

    Subclasses provide the kind-specific pieces (ordinary encoding, decoding, their plain files,
    loading them); this class owns the special tokens, the saved layout and identity, and
    rendering. A kind's trainer lives apart, in lockstep.tokenizer.kinds' table. Ordinary
    encoding never yields a special id, whatever the text contains: special tokens enter a
    sequence only through `prepend`/`append`, `encode_special` and the renderers.
    """

    kind: ClassVar[str]
    # False for a kind whose ids are not distinct byte strings (sentencepiece): no prefix tree.
    has_prefix_tree: ClassVar[bool] = True
    # How a kind's tokenizer comes with hierarchical parents (its options), for the message of
    # one that has none; "" for a kind that never has them.
    hierarchical_parents_from: ClassVar[str] = ""

    def __init__(self, special_ids: Mapping[str, int]) -> None:
        """`special_ids` gives an id to every name in SPECIAL_TOKENS, or is empty for a tokenizer
        without special tokens (see the module docstring)."""
        missing = [name for name in SPECIAL_TOKENS if name not in special_ids]
        if missing and len(missing) < len(SPECIAL_TOKENS):
            raise TokenizerFileError(f"special token(s) {missing} have no id; retrain the tokenizer")
        self._special_ids: dict[str, int] = {
            name: int(special_ids[name]) for name in SPECIAL_TOKENS if name in special_ids
        }
        self._id_to_special: dict[int, str] = {i: name for name, i in self._special_ids.items()}
        self._sha256: str | None = None
        self._token_bytes: np.ndarray | None = None
        self._files_cache: dict[str, bytes] | None = None
        self._prefix_tree: PrefixTree | None = None

    # ---- kind-specific pieces -------------------------------------------------------------

    @classmethod
    @abstractmethod
    def _from_files(cls, directory: Path, meta: dict[str, Any]) -> Tokenizer:
        """Build from a directory whose files were already verified against meta.json."""

    @abstractmethod
    def _files(self) -> dict[str, bytes]:
        """The kind's own plain files (name -> exact bytes), without token_bytes.npy and meta.json."""

    @abstractmethod
    def _encode_ordinary(self, text: str) -> list[int]:
        """Ids of `text` with no special ids, whatever the text contains."""

    def _encode_ordinary_batch(self, texts: Sequence[str], num_threads: int) -> list[list[int]]:
        return [self._encode_ordinary(t) for t in texts]

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special ids appear as their names (e.g. `<|bos|>`)."""

    @abstractmethod
    def id_to_token(self, token_id: int) -> str:
        """A readable form of one id: its text (invalid UTF-8 replaced) or the special name."""

    @abstractmethod
    def get_vocab_size(self) -> int:
        """Number of ids, special tokens included."""

    @abstractmethod
    def _compute_token_bytes(self) -> np.ndarray:
        """int32 (vocab,): UTF-8 bytes each id stands for, 0 for special (and control) ids."""

    def token_pieces(self) -> list[bytes | None]:
        """Each id's byte string, None for ids that spell no bytes (the specials). Kinds with
        `has_prefix_tree` provide it; the prefix tree is built from it unless a kind knows its
        own (lz78)."""
        raise NoPrefixTreeError(f"{self._no_prefix_tree()}: use model.embedding: flat and objective: ce with it, or "
                                f"{_prefix_tree_kinds()}")

    def _no_prefix_tree(self) -> str:
        return f"a {self.kind} tokenizer's ids are not distinct byte strings, so it has no prefix tree"

    def prefix_tree(self) -> PrefixTree:
        """The vocabulary's prefix tree: per id its ancestors (proper byte-prefixes that are
        tokens, nearest first), parent and last byte. What structured embeddings and the
        prefix-smoothed loss read; saved as token_ancestors.npy and token_depths.npy."""
        if self._prefix_tree is None:
            self._prefix_tree = prefix_tree(self.token_pieces())  # NoPrefixTreeError for a kind without one
        return self._prefix_tree

    # ---- what the tokenizer provides a model beyond its ids (TOKEN_STRUCTURES) ------------

    def structure_clash(self) -> str | None:
        """Why two ids have the same prefix-tree parent and last byte (so that a model reading
        those two cannot tell them apart), with the fix; None when none do. None unless a kind
        checks (lz78, whose dictionary file may leave a code several bytes past its parent)."""
        return None

    @property
    def has_hierarchical_parents(self) -> bool:
        """Whether `hierarchical_parents` has parents to give; none unless a kind provides them."""
        return False

    def hierarchical_parents(self) -> np.ndarray:
        """int64 (V,): each id's hierarchical parent, -1 where it has none, for a kind that
        provides them (`has_hierarchical_parents`); NotProvidedError otherwise."""
        raise NotProvidedError(f"no {TOKEN_STRUCTURES['hierarchical']}: {self.missing_structure('hierarchical')}")

    def missing_structure(self, structure: str) -> str | None:
        """Why this tokenizer cannot provide `structure` (a TOKEN_STRUCTURES name), saying which
        kinds and options do; None when it can."""
        if structure not in TOKEN_STRUCTURES:
            raise ValueError(f"unknown token structure {structure!r}; one of {list(TOKEN_STRUCTURES)}")
        if structure == "hierarchical" and not self.has_hierarchical_parents:
            ways = " or ".join(c.hierarchical_parents_from for c in _KINDS.values() if c.hierarchical_parents_from)
            return f"this {self.kind} tokenizer has none; {ways or 'no tokenizer kind'} provides them"
        if not self.has_prefix_tree:  # the last bytes come from the prefix tree, whatever the parents
            return f"{self._no_prefix_tree()}; {_prefix_tree_kinds()} has one"
        return self.structure_clash() if structure == "prefix" else None

    def token_structure(self, structure: str) -> tuple[np.ndarray, np.ndarray]:
        """(parents, last_bytes) per id for `structure` (a TOKEN_STRUCTURES name), as a token
        embedding reads them; NotProvidedError saying why not and what does."""
        missing = self.missing_structure(structure)
        if missing is not None:
            raise NotProvidedError(f"no {TOKEN_STRUCTURES[structure]}: {missing}")
        tree = self.prefix_tree()
        return (tree.parent if structure == "prefix" else self.hierarchical_parents()), tree.last_byte

    def _checked_ids(self, ids: Iterable[int]) -> list[int]:
        """`ids` as ints, ValueError naming the first one outside [0, vocab)."""
        ids = [int(i) for i in ids]
        v = self.get_vocab_size()
        for i in ids:
            if not 0 <= i < v:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {v})")
        return ids

    # ---- identity and files ---------------------------------------------------------------

    def token_bytes(self) -> np.ndarray:
        """int32 (vocab,): bytes each id stands for, 0 for specials; bits-per-byte divides by it."""
        if self._token_bytes is None:
            tb = np.ascontiguousarray(self._compute_token_bytes(), dtype=np.int32)
            assert tb.shape == (self.get_vocab_size(),), (tb.shape, self.get_vocab_size())
            tb[list(self._special_ids.values())] = 0
            tb.setflags(write=False)
            self._token_bytes = tb
        return self._token_bytes

    def _all_files(self) -> dict[str, bytes]:
        # A tokenizer never changes after construction, so its serialization is computed once.
        if self._files_cache is None:
            files = dict(self._files())
            files[TOKEN_BYTES_FILE] = token_bytes_npy(self.token_bytes())
            if self.has_prefix_tree:
                tree = self.prefix_tree()
                files[ANCESTORS_FILE] = int32_npy(tree.ancestors)
                files[DEPTHS_FILE] = int32_npy(tree.depths)
            self._files_cache = files
        return dict(self._files_cache)

    @property
    def sha256(self) -> str:
        """Identity of the tokenizer: sha256_of_manifest over its saved files (meta.json excluded),
        the same value `save` records and `load_tokenizer` checks."""
        if self._sha256 is None:
            self._sha256 = sha256_of_manifest({name: sha256_bytes(data) for name, data in self._all_files().items()})
        return self._sha256

    def meta(self) -> dict[str, Any]:
        files = self._all_files()
        digests = {name: sha256_bytes(data) for name, data in files.items()}
        return {
            "format_version": FORMAT_VERSION,
            "kind": self.kind,
            "vocab_size": self.get_vocab_size(),
            "special_token_ids": dict(self._special_ids),
            "bos_token_id": self._special_ids.get(BOS),
            "files": digests,
            "sha256": sha256_of_manifest(digests),
        }

    def save(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Write the tokenizer to `directory`, replacing it whole and atomically; meta.json is
        written last. Returns the meta dict."""
        with atomic_dir(directory) as tmp:
            return self.write_files(tmp)

    def write_files(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Write the tokenizer's files into `directory`, an existing folder that the caller
        publishes whole (an `atomic_dir` temp folder, which fsyncs every file before it is
        renamed into place); meta.json last. Returns the meta dict. `save` is the atomic form."""
        directory = Path(directory)
        meta = self.meta()
        for name, data in sorted(self._all_files().items()):
            (directory / name).write_bytes(data)
        write_json(directory / META_FILE, meta)
        return meta

    @classmethod
    def from_directory(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        """Load a saved tokenizer, verifying every file against meta.json."""
        tok = load_tokenizer(directory)
        if cls is not Tokenizer and not isinstance(tok, cls):
            raise TokenizerFileError(f"{directory} holds a {tok.kind!r} tokenizer, not {cls.kind!r}")
        return tok

    # ---- specials -------------------------------------------------------------------------

    @property
    def has_special_tokens(self) -> bool:
        """False only for a char tokenizer built without special tokens: no `<|bos|>`, no chat."""
        return bool(self._special_ids)

    def _require_specials(self, needed: str) -> None:
        if not self._special_ids:
            raise NoSpecialTokensError(
                f"this {self.kind} tokenizer ({self.get_vocab_size()} ids) was built without special tokens, "
                f"so it has no {needed}: it encodes plain text only, while token caches, training and chat need "
                "<|bos|> and the chat template. Rebuild it with them (tokenizer.options.specials: true, the "
                "default) to use it past the tokenizer stage"
            )

    def get_special_tokens(self) -> dict[str, int]:
        """Name -> id of each special token; empty for a tokenizer built without them."""
        return dict(self._special_ids)

    def get_bos_token_id(self) -> int:
        self._require_specials("<|bos|>")
        return self._special_ids[BOS]

    def encode_special(self, name: str) -> int:
        self._require_specials(repr(name))
        try:
            return self._special_ids[name]
        except KeyError:
            raise ValueError(f"{name!r} is not a special token; use one of {', '.join(SPECIAL_TOKENS)}") from None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._id_to_special

    def _special_arg(self, value: int | str | None) -> int | None:
        if value is None:
            return None
        if isinstance(value, str):
            return self.encode_special(value)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"prepend/append must be a special token name or id, got {value!r}")
        return self._checked_ids([value])[0]

    # ---- encoding -------------------------------------------------------------------------

    def encode(
        self,
        text: str | Sequence[str],
        prepend: int | str | None = None,
        append: int | str | None = None,
        num_threads: int = DEFAULT_ENCODE_THREADS,
    ) -> list[int] | list[list[int]]:
        """Ids of `text` (a str) or of each text in a list. `prepend`/`append` take a special
        token name or id and wrap each sequence; the text itself never becomes a special id."""
        first = self._special_arg(prepend)
        last = self._special_arg(append)
        if isinstance(text, str):
            ids = self._encode_ordinary(text)
            return ([first] if first is not None else []) + ids + ([last] if last is not None else [])
        if not isinstance(text, Sequence) or not all(isinstance(t, str) for t in text):
            raise TypeError(f"encode takes a str or a list of str, got {type(text).__name__}")
        out = self._encode_ordinary_batch(list(text), num_threads)
        if first is not None:
            out = [[first, *ids] for ids in out]
        if last is not None:
            for ids in out:
                ids.append(last)
        return out

    def count_unknown_bytes(self, texts: Sequence[str]) -> int:
        """UTF-8 bytes of `texts` that this tokenizer cannot spell and encodes to its unknown-byte
        id instead (char: every byte outside the alphabet becomes id 0), so decode does not give
        them back. 0 for the kinds that spell every byte (bpe, byte, sentencepiece with byte
        fallback), which is this default."""
        return 0

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Ids of each text as an unsigned-integer array, no special ids whatever the text
        contains: `encode(texts)` without Python int lists, for bulk tokenization (the caches).
        Runs on the calling thread; kinds whose encoder releases the GIL override it."""
        return [np.asarray(ids, dtype=np.uint32) for ids in self._encode_ordinary_batch(list(texts), 1)]

    # ---- chat rendering -------------------------------------------------------------------

    def render_conversation(
        self, conversation: Mapping[str, Any], max_tokens: int | None = None
    ) -> tuple[list[int], list[int]]:
        """(ids, mask) of a conversation record: one `<|bos|>`, then each turn. The mask is 1 on
        assistant text, python calls with their delimiters and `<|assistant_end|>`; 0 elsewhere,
        tool outputs included. Truncated to `max_tokens` when given."""
        self._require_specials("chat template")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be at least 1 (or None for no limit)")
        ids: list[int] = []
        mask: list[int] = []

        def add(chunk: list[int], m: int) -> None:
            ids.extend(chunk)
            mask.extend([m] * len(chunk))

        sp = self._special_ids
        add([sp[BOS]], 0)
        for role, parts in _turns(conversation):
            if role == "user":
                text = "".join(p["text"] for p in parts)
                add([sp["<|user_start|>"]], 0)
                add(self._encode_ordinary(text), 0)
                add([sp["<|user_end|>"]], 0)
            else:
                add([sp["<|assistant_start|>"]], 0)
                for p in parts:
                    if p["type"] == "text":
                        add(self._encode_ordinary(p["text"]), 1)
                    elif p["type"] == "python":
                        add([sp["<|python_start|>"], *self._encode_ordinary(p["text"]), sp["<|python_end|>"]], 1)
                    else:  # python_output: produced by the tool, never trained on
                        add([sp["<|output_start|>"], *self._encode_ordinary(p["text"]), sp["<|output_end|>"]], 0)
                add([sp["<|assistant_end|>"]], 1)
            if max_tokens is not None and len(ids) >= max_tokens:
                break
        if max_tokens is not None:
            del ids[max_tokens:], mask[max_tokens:]
        return ids, mask

    def render_for_completion(self, conversation: Mapping[str, Any]) -> list[int]:
        """Prompt ids for sampling the next assistant turn: the conversation without its last
        assistant message (if it ends with one), followed by `<|assistant_start|>`."""
        self._require_specials("chat template")
        messages = list(_messages(conversation))
        if messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]
        if not any(m.get("role") == "user" for m in messages):
            raise ConversationError("render_for_completion needs at least one user message before the reply")
        ids, _ = self.render_conversation({"messages": messages})
        ids.append(self._special_ids["<|assistant_start|>"])
        return ids


# ---- conversation records --------------------------------------------------------------------

_PART_TYPES = {"user": ("text",), "assistant": ("text", "python", "python_output"), "system": ("text",)}


# Plain dicts and lists first: records read from parquet are plain, and an isinstance check
# against the Mapping / Sequence ABCs costs several times a type test (every part of every
# conversation is checked when a tokenizer is measured or a cache is built).
def _is_mapping(x: object) -> bool:
    return type(x) is dict or isinstance(x, Mapping)


def _is_sequence(x: object) -> bool:
    return type(x) is list or (isinstance(x, Sequence) and not isinstance(x, str))


def _messages(conversation: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    if not _is_mapping(conversation) or "messages" not in conversation:
        raise ConversationError('a conversation is a dict {"messages": [...]}; got ' + type(conversation).__name__)
    messages = conversation["messages"]
    if not _is_sequence(messages):
        raise ConversationError('conversation["messages"] must be a list of {"role", "content"} dicts')
    return list(messages)


def _parts(message: Mapping[str, Any], index: int) -> list[dict[str, str]]:
    """A message's content as typed parts. A plain string is accepted as one text part."""
    role = message.get("role")
    if role not in _PART_TYPES:
        raise ConversationError(f"message {index} has role {role!r}; use 'system', 'user' or 'assistant'")
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not _is_sequence(content):
        raise ConversationError(
            f"message {index} content must be a string or a list of parts, got {type(content).__name__}"
        )
    parts = []
    for j, part in enumerate(content):
        if not _is_mapping(part) or not isinstance(part.get("text"), str):
            raise ConversationError(f'message {index} part {j} must be {{"type", "text": str}}, got {part!r}')
        kind = part.get("type", "text")
        if kind not in _PART_TYPES[role]:
            raise ConversationError(
                f"message {index} ({role}) part {j} has type {kind!r}; "
                f"a {role} message allows {list(_PART_TYPES[role])}"
            )
        parts.append({"type": kind, "text": part["text"]})
    return parts


def _turns(conversation: Mapping[str, Any]) -> list[tuple[str, list[dict[str, str]]]]:
    """(role, parts) per user/assistant turn, the system message folded into the first user turn,
    after checking that roles alternate user/assistant."""
    messages = _messages(conversation)
    system_text: str | None = None
    start = 0
    if messages and _is_mapping(messages[0]) and messages[0].get("role") == "system":
        system_text = "".join(p["text"] for p in _parts(messages[0], 0))
        start = 1
    turns = []
    for i in range(start, len(messages)):
        message = messages[i]
        if not _is_mapping(message):
            raise ConversationError(f"message {i} must be a dict with role and content, got {message!r}")
        parts = _parts(message, i)
        expected = "user" if (i - start) % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise ConversationError(
                f"message {i} has role {message['role']!r} but {expected!r} was expected: after an optional leading "
                "system message, roles must alternate user, assistant, user, ..."
            )
        turns.append((message["role"], parts))
    if system_text is not None:
        if not turns:
            raise ConversationError("a system message must be followed by a user message")
        user_text = "".join(p["text"] for p in turns[0][1])
        turns[0] = ("user", [{"type": "text", "text": system_text + "\n\n" + user_text}])
    return turns


def conversation_texts(conversation: Mapping[str, Any]) -> list[str]:
    """The text content of a conversation, one string per part (system text included), in order:
    what a tokenizer learns from and is measured on."""
    return [p["text"] for i, m in enumerate(_messages(conversation)) for p in _parts(m, i)]


# ---- loading ---------------------------------------------------------------------------------

# kind name -> the class that loads its folders; filled by `register_kind` as each kind's encoder
# module is imported (lockstep.tokenizer imports them all). Training goes through
# lockstep.tokenizer.kinds.
_KINDS: dict[str, type[Tokenizer]] = {}


def register_kind(cls: type[Tokenizer]) -> type[Tokenizer]:
    """Class decorator: `load_tokenizer` builds folders whose meta.json names `cls.kind` with `cls`."""
    _KINDS[cls.kind] = cls
    return cls


def unregister_kind(kind: str) -> None:
    """Undo `register_kind` (for a kind registered only for a while, e.g. in a test)."""
    _KINDS.pop(kind, None)


def _prefix_tree_kinds() -> str:
    """The kinds whose tokenizers have a prefix tree, in words."""
    without = ", ".join(sorted(k for k, c in _KINDS.items() if not c.has_prefix_tree))
    return f"a kind whose ids are byte strings (any but {without})"


def tokenizer_class(kind: str) -> type[Tokenizer]:
    try:
        return _KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown tokenizer kind {kind!r}; use one of {sorted(_KINDS)}") from None


# What every refusal to load a tokenizer folder ends with: the folder is the tokenizer stage's
# output, so rebuilding it is the fix whatever is wrong with it.
REBUILD = "re-run the tokenizer stage (`dvc repro tokenizer`)"


def load_tokenizer(directory: str | os.PathLike[str]) -> Tokenizer:
    """Load the tokenizer saved in `directory`, refusing it unless every file matches the sha256
    recorded in its meta.json and the manifest hash matches. Whatever is wrong with the folder
    (missing, not a folder, meta.json missing, truncated or of the wrong shape, a listed file
    missing or changed, files that match their hashes yet do not load) raises TokenizerFileError
    naming the folder or file and the fix, never a bare OSError or JSON error."""
    directory = Path(directory)
    meta = _read_meta(directory)
    files: dict[str, str] = meta["files"]
    for name, digest in sorted(files.items()):
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise TokenizerFileError(
                f"{directory / META_FILE} lists {name!r}, which is not a plain file name; {REBUILD}"
            )
        path = directory / name
        if not path.is_file():
            state = "is not a regular file" if path.exists() else "is missing"
            raise TokenizerFileError(f"tokenizer file {path} {state}; {REBUILD}")
        try:
            actual = sha256_file(path)
        except OSError as e:
            raise TokenizerFileError(f"tokenizer file {path} cannot be read ({e.strerror}); {REBUILD}") from None
        if actual != digest:
            raise TokenizerFileError(
                f"tokenizer file {path} has sha256 {actual[:12]}..., meta.json records {str(digest)[:12]}...: "
                f"the file was modified or corrupted; {REBUILD}"
            )
    if sha256_of_manifest(files) != meta["sha256"]:
        raise TokenizerFileError(f"{directory / META_FILE} sha256 does not match its file list; {REBUILD}")
    cls = _KINDS[meta["kind"]]
    try:
        tok = cls._from_files(directory, meta)
        if tok.get_special_tokens() != meta["special_token_ids"] or tok.get_vocab_size() != meta["vocab_size"]:
            raise TokenizerFileError(
                f"{directory / META_FILE} special ids or vocab size disagree with the tokenizer files; {REBUILD}"
            )
        if TOKEN_BYTES_FILE in files:
            saved = np.load(directory / TOKEN_BYTES_FILE, allow_pickle=False)
            if saved.dtype != np.int32 or not np.array_equal(saved, tok.token_bytes()):
                raise TokenizerFileError(f"{directory / TOKEN_BYTES_FILE} disagrees with the tokenizer; {REBUILD}")
        identity = tok.sha256
    except TokenizerFileError as e:
        # A kind's own refusal: name the folder and the command when its message does not.
        message = str(e)
        if "dvc repro tokenizer" in message:
            raise
        where = "" if str(directory) in message else f"{directory}: "
        fix = " (`dvc repro tokenizer`)" if message.endswith("re-run the tokenizer stage") else f"; {REBUILD}"
        raise TokenizerFileError(f"{where}{message}{fix}") from e
    except Exception as e:
        # The files match the hashes meta.json records, yet the kind's reader (json, numpy,
        # tiktoken, tokenizers, sentencepiece) refuses them: meta.json was rewritten to fit files
        # the tokenizer stage did not write. Any reader's error means the same thing here.
        raise TokenizerFileError(
            f"{directory} holds files that match meta.json but do not load as a {meta['kind']} tokenizer "
            f"({type(e).__name__}: {str(e)[:200]}); {REBUILD}"
        ) from e
    if identity != meta["sha256"]:
        raise TokenizerFileError(f"{directory} re-serializes to a different sha256 than meta.json records; {REBUILD}")
    return tok


def _read_meta(directory: Path) -> dict[str, Any]:
    """meta.json of a tokenizer folder, its fields checked for the types load_tokenizer reads."""
    path = directory / META_FILE
    if not directory.is_dir():
        raise TokenizerFileError(f"no tokenizer folder at {directory}: pass the folder the tokenizer stage writes "
                                 f"(data/tokenizer), or build it with `dvc repro tokenizer`")
    if not path.is_file():
        raise TokenizerFileError(f"{directory} has no {META_FILE}, so it is no finished tokenizer folder; {REBUILD}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TokenizerFileError(f"{path} cannot be read ({e.strerror}); {REBUILD}") from None
    except UnicodeDecodeError:
        raise TokenizerFileError(
            f"{path} is not UTF-8 text, so no meta.json the tokenizer stage wrote; {REBUILD}"
        ) from None
    except json.JSONDecodeError as e:  # a write cut short leaves a truncated file
        raise TokenizerFileError(
            f"{path} is not valid JSON ({e.msg} at character {e.pos}): truncated or overwritten; {REBUILD}"
        ) from None
    if not isinstance(meta, dict):
        raise TokenizerFileError(f"{path} holds {type(meta).__name__}, not a tokenizer meta object; {REBUILD}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise TokenizerFileError(
            f"{directory} has tokenizer format {meta.get('format_version')!r}, this code reads {FORMAT_VERSION}; "
            f"{REBUILD}"
        )
    kind = meta.get("kind")
    if kind not in _KINDS:
        raise TokenizerFileError(f"{path} names tokenizer kind {kind!r}, not one of {sorted(_KINDS)}; {REBUILD}")
    files = meta.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise TokenizerFileError(f"{path} has no `files` map of file name -> sha256; {REBUILD}")
    specials = meta.get("special_token_ids")
    if not isinstance(specials, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in specials.values()
    ):
        raise TokenizerFileError(f"{path} has no `special_token_ids` map of name -> id; {REBUILD}")
    for key in ("vocab_size", "sha256"):
        if not isinstance(meta.get(key), int if key == "vocab_size" else str):
            raise TokenizerFileError(f"{path} lacks a well-formed `{key}`; {REBUILD}")
    return meta


def decode_with_specials(ids: Iterable[int], id_to_special: Mapping[int, str], piece_bytes: Any) -> str:
    """Decode ids through `piece_bytes(run_of_ids) -> bytes`, writing special ids as their names.
    Invalid UTF-8 (e.g. a multi-byte character cut by truncation) becomes U+FFFD."""
    out: list[str] = []
    run: list[int] = []
    for i in ids:
        i = int(i)
        name = id_to_special.get(i)
        if name is None:
            run.append(i)
            continue
        if run:
            out.append(piece_bytes(run).decode("utf-8", errors="replace"))
            run = []
        out.append(name)
    if run:
        out.append(piece_bytes(run).decode("utf-8", errors="replace"))
    return "".join(out)
