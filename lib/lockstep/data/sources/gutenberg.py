"""Project Gutenberg plain-text books (one .txt file or a folder of them) as documents, one per
book: BOM, CRLF, the header before `*** START OF ...` and the license after `*** END OF ...`
removed. Does not fetch books."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lockstep.data.snapshot import SnapshotWriter
from lockstep.data.sources.common import files_revision, local_files, local_root, read_text, write_split
from lockstep.data.sources.fields import CheckedFields, Rule
from lockstep.data.sources.size import SourceSize, text_files

KIND = "document"
EXTRA_FIELDS = ("id", "title")
EXPECTED = (
    "Project Gutenberg plain-text books (.txt, UTF-8) with the book between `*** START OF ...` and "
    "`*** END OF ...` lines"
)

# Both spellings occur: `*** START OF THIS PROJECT GUTENBERG EBOOK X ***` and
# `***START OF THE PROJECT GUTENBERG EBOOK X***` (older and newer PG templates).
_START = re.compile(r"^\*{3}\s*START OF (?:THIS|THE) PROJECT GUTENBERG E-?BOOK\b.*$", re.IGNORECASE | re.MULTILINE)
_END = re.compile(r"^\*{3}\s*END OF (?:THIS|THE) PROJECT GUTENBERG E-?BOOK\b.*$", re.IGNORECASE | re.MULTILINE)
_TITLE = re.compile(r"^Title:\s*(.+?)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class GutenbergConfig(CheckedFields):
    source: Literal["gutenberg"] = "gutenberg"
    path: str = "books"  # one .txt book, or a folder of them (searched recursively)
    val_frac: float = 0.1  # share of books held out for val, chosen with the seed
    strict: bool = False  # true: a book without START/END markers fails the stage
    artifact_records: int = 8  # records per split kept in dataset_snapshot.json, the parity artifact

    RULES = {
        "val_frac": Rule("the share of books held out for val", ge=0, lt=1),
        "artifact_records": Rule("records per split copied into dataset_snapshot.json", ge=0),
    }


def strip_gutenberg(text: str) -> tuple[str, str]:
    """(header, body): the text before the START marker and the book between START and END;
    raises ValueError naming what is missing."""
    start = _START.search(text)
    if start is None:
        raise ValueError("no `*** START OF THE/THIS PROJECT GUTENBERG EBOOK` line")
    end = _END.search(text, start.end())
    if end is None:
        raise ValueError("no `*** END OF THE/THIS PROJECT GUTENBERG EBOOK` line after START")
    body = text[start.end() : end.start()].strip()
    if not body:
        raise ValueError("empty text between START and END")
    return text[: start.start()], body + "\n"


def produce(cfg: GutenbergConfig, sink: SnapshotWriter, *, seed: int) -> dict[str, Any]:
    files = local_files(cfg.path, (".txt",), what="gutenberg")
    root = local_root(cfg.path)
    items = []
    for f in files:
        text = read_text(f, sink)
        if text is None:
            continue
        try:
            header, body = strip_gutenberg(text)
        except ValueError as e:
            sink.bad(str(f), str(e))
            continue
        m = _TITLE.search(header)
        doc = {"text": body, "id": f.relative_to(root).as_posix(), "title": m.group(1) if m else f.stem}
        if (clean := sink.check(doc, str(f))) is not None:
            items.append((str(f), clean))
    write_split(sink, items, cfg.val_frac, seed)
    revision, per_file = files_revision(files)
    return {
        "source_id": f"local:{Path(cfg.path).as_posix()}",
        "revision": revision,
        "input_sha256": per_file,
        "streamed": False,
    }


def size(cfg: GutenbergConfig, *, name: str, root: Path) -> SourceSize | None:
    """The books' size (None before the folder exists)."""
    return text_files(root / cfg.path, (".txt",), val_frac=cfg.val_frac)
