"""Parity artifacts: the dataset snapshot, rendered samples and first batch that the data and
training stages write, one fixed JSON serialization each, so that two runs can be diffed
(lockstep.tools.parity_diff names the first difference). Writes small JSON files; trains nothing. The
stages write through the collectors here while they stream; writing an artifact from a plain list
outside any stage is lockstep.dev.parity_files'."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from lockstep.core.io import canonical_json, write_json_atomic

if TYPE_CHECKING:
    import torch

SNAPSHOT_FILE = "dataset_snapshot.json"
RENDERED_FILE = "rendered_samples.json"
FIRST_BATCH_FILE = "first_batch.json"
MAX_SAMPLE_TOKENS = 1024  # rendered samples keep at most this many ids each
# Canonical JSON lines are hashed in chunks of about this many characters: one sha256 update per
# record released and re-took the GIL per record, which stalled beside encoding threads.
HASH_CHUNK_CHARS = 1 << 20

# The item separator closes one record's line and opens the next, so a list of texts encodes to
# their canonical lines between "[" and "]".
_TEXT_LINES = json.JSONEncoder(ensure_ascii=False, separators=('}\n{"text":', ":"))
# What json.dumps(ensure_ascii=False) escapes in a str: backslash first, since the rest add one.
_JSON_ESCAPES = (
    (b"\\", b"\\\\"),
    (b'"', b'\\"'),
    (b"\n", b"\\n"),
    (b"\r", b"\\r"),
    (b"\t", b"\\t"),
    (b"\b", b"\\b"),
    (b"\f", b"\\f"),
)
_OTHER_CONTROL_BYTES = bytes(c for c in range(32) if c not in b"\n\r\t\b\f")
_TEXT_SEP = "\x00"


def _text_lines(texts: Sequence[str]) -> bytes:
    """UTF-8 of the canonical lines `{"text":...}\\n` of `texts`, the same bytes that json.dumps
    gives, escaped with a few whole-batch byte replacements: json's per-character encoder was the
    largest cost of hashing a corpus. Texts holding NUL or rarer control characters take json's
    path."""
    if not texts:
        return b""
    joined = _TEXT_SEP.join(texts).encode("utf-8")
    n_sep = len(texts) - 1
    # NUL joins the texts, so it must occur only as the separator; other control characters would
    # need \\u00XX escapes, which the byte replacements do not make.
    if joined.count(b"\x00") != n_sep or len(joined.translate(None, _OTHER_CONTROL_BYTES)) != len(joined) - n_sep:
        body = _TEXT_LINES.encode(list(texts))
        return ('{"text":' + body[1:-1] + "}\n").encode("utf-8")
    for raw, escaped in _JSON_ESCAPES:
        joined = joined.replace(raw, escaped)
    return b'{"text":"' + joined.replace(b"\x00", b'"}\n{"text":"') + b'"}\n'


def json_string_literals(joined: bytes, n: int) -> list[bytes] | None:
    """The UTF-8 JSON literals (quotes included) that json.dumps(ensure_ascii=False) gives for `n`
    strings, from their UTF-8 joined by NUL, escaped with whole-buffer byte replacements as in
    `_text_lines`; None when a string holds NUL or a rarer control character (json's path then)."""
    if joined.count(b"\x00") != n - 1 or len(joined.translate(None, _OTHER_CONTROL_BYTES)) != len(joined) - (n - 1):
        return None
    for raw, escaped in _JSON_ESCAPES:
        joined = joined.replace(raw, escaped)
    return [b'"' + v + b'"' for v in joined.split(b"\x00")]


class SnapshotCollector:
    """Streams records per split: keeps the first `n` and a sha256 over the canonical JSON of all,
    so memory stays flat however many records pass."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._splits: dict[str, dict[str, Any]] = {}

    def begin(self, split: str) -> None:
        """Open `split` so that it is listed (count 0) even when no record arrives."""
        self._splits.setdefault(split, {"count": 0, "hash": hashlib.sha256(), "records": [], "pending": [], "chars": 0})

    def add(self, split: str, record: Any) -> None:
        self.begin(split)
        s = self._splits[split]
        if type(record) is dict and len(record) == 1 and type(record.get("text")) is str:
            # Same bytes as canonical_json for a lone text field, without the generic encoder's
            # per-call cost (it dominated hashing of a 1 GB corpus).
            line = '{"text":' + json.dumps(record["text"], ensure_ascii=False) + "}\n"
        else:
            line = canonical_json(record)
        s["pending"].append(line)
        s["chars"] += len(line)
        if s["chars"] >= HASH_CHUNK_CHARS:
            self._flush(s)
        if s["count"] < self.n:
            s["records"].append(record)
        s["count"] += 1

    def add_texts(self, split: str, texts: Sequence[str]) -> None:
        """`add(split, {"text": t})` for each of `texts`, in order, with one JSON encoder call for
        the whole list instead of one per record."""
        self.begin(split)
        s = self._splits[split]
        if not texts:
            return
        if not all(type(t) is str for t in texts):
            raise TypeError(f"{split}: add_texts takes a sequence of str; pass other records to add()")
        self._flush(s)
        s["hash"].update(_text_lines(texts))
        keep = self.n - len(s["records"])
        if keep > 0:
            s["records"].extend({"text": t} for t in texts[:keep])
        s["count"] += len(texts)

    def wanted(self, split: str) -> int:
        """How many more records `split` keeps whole (the first `n`)."""
        self.begin(split)
        return max(0, self.n - len(self._splits[split]["records"]))

    def add_lines(self, split: str, lines: bytes, head: Sequence[Any], count: int) -> None:
        """`add` for `count` records given already serialized: `lines` is the concatenation of
        their canonical JSON lines (lockstep.core.io.canonical_json), `head` at least their first
        `wanted(split)` records. For writers that serialize a whole batch at once."""
        self.begin(split)
        s = self._splits[split]
        self._flush(s)
        s["hash"].update(lines)
        s["records"].extend(head[: self.wanted(split)][:count])
        s["count"] += count

    @staticmethod
    def _flush(s: dict[str, Any]) -> None:
        # sha256 of the concatenation equals sha256 fed line by line.
        s["hash"].update("".join(s["pending"]).encode("utf-8"))
        s["pending"].clear()
        s["chars"] = 0

    def to_json(self) -> dict[str, Any]:
        for v in self._splits.values():
            self._flush(v)
        return {
            "artifact": "dataset_snapshot",
            "n": self.n,
            "splits": {
                k: {"count": v["count"], "sha256": v["hash"].hexdigest(), "records": v["records"]}
                for k, v in self._splits.items()
            },
        }


class Decoder(Protocol):
    """What rendered samples ask of a tokenizer (lockstep.tokenizer.Tokenizer has it). A protocol
    rather than that class: the fetch stages import this module (through lockstep.data.snapshot), and
    their code deps must not take in the tokenizer's files."""

    def decode(self, ids: Sequence[int]) -> str: ...


class RenderedSamples:
    """The first `n` rendered samples per split: ids, each id decoded alone, and the loss mask.
    Pieces are decoded in `to_json`, once per distinct id, so that `add` stays cheap while a
    cache build's encoding threads run."""

    def __init__(self, tokenizer: Decoder, n: int, *, bos_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.n = n
        self.bos_id = bos_id
        self._samples: list[dict[str, Any]] = []
        self._count: dict[str, int] = {}

    def wants(self, split: str) -> bool:
        return self._count.get(split, 0) < self.n

    def add(
        self, split: str, ids: Sequence[int], mask: Sequence[int] | None = None, *, max_tokens: int = MAX_SAMPLE_TOKENS
    ) -> None:
        """Keep (ids, mask) as the next sample of `split`, cut to `max_tokens` ids (at most
        MAX_SAMPLE_TOKENS); ignored once `split` holds `n` samples."""
        i = self._count.get(split, 0)
        self._count[split] = i + 1
        if i >= self.n:
            return
        n_ids = len(ids)
        max_tokens = min(max_tokens, MAX_SAMPLE_TOKENS)
        ids = [int(t) for t in ids[:max_tokens]]
        self._samples.append(
            {
                "split": split,
                "index": i,
                "ids": ids,
                "mask": None if mask is None else [int(m) for m in mask[:max_tokens]],
                "truncated": n_ids > max_tokens,
            }
        )

    def to_json(self) -> dict[str, Any]:
        piece: dict[int, str] = {}
        samples = []
        for sample in self._samples:
            for t in sample["ids"]:
                if t not in piece:
                    piece[t] = self.tokenizer.decode([t])
            samples.append({**sample, "pieces": [piece[t] for t in sample["ids"]]})
        return {"artifact": "rendered_samples", "bos_id": self.bos_id, "samples": samples}


def dump_first_batch(
    path: str | os.PathLike[str],
    x: torch.Tensor,
    y: torch.Tensor,
    y_masked: torch.Tensor | None = None,
    *,
    rows: Sequence[Mapping[str, Any]] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """`first_batch.json`: the batch tensors as id lists, and for each row what it drew (the
    loaders' `last_rows`, e.g. `{"example": 17}` or `{"shard": 0, "start": 512}`)."""
    obj = {
        "artifact": "first_batch",
        "shape": list(x.shape),
        "x": x.tolist(),
        "y": y.tolist(),
        "y_masked": None if y_masked is None else y_masked.tolist(),
        "rows": None if rows is None else [dict(r) for r in rows],
        "meta": dict(meta or {}),
    }
    write_json_atomic(path, obj)
    return obj
