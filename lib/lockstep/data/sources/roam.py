"""A folder of markdown notes (e.g. a Roam Research export) as documents, one per file, split
train/val by file with the seed. Not a markdown renderer: the text is kept as written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lockstep.core.config import FieldError
from lockstep.data.snapshot import SnapshotWriter
from lockstep.data.sources.common import files_revision, read_text, write_split
from lockstep.data.sources.fields import CheckedFields, Rule
from lockstep.data.sources.size import SourceSize, text_files

KIND = "document"
EXTRA_FIELDS = ("id", "title")
EXPECTED = "markdown notes: UTF-8 files with some text"


@dataclass(frozen=True)
class RoamConfig(CheckedFields):
    source: Literal["roam"] = "roam"
    path: str = "corpus/notes"  # the notes folder (relative to the working directory)
    val_frac: float = 0.2  # share of files held out for val, chosen with the seed
    suffixes: tuple[str, ...] = (".md", ".markdown")  # which files are notes
    strict: bool = False  # true: an unreadable or empty note fails the stage
    artifact_records: int = 8  # records per split kept in dataset_snapshot.json, the parity artifact

    RULES = {
        "val_frac": Rule("the share of notes held out for val", ge=0, lt=1),
        "artifact_records": Rule("records per split copied into dataset_snapshot.json", ge=0),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        # A note is matched by Path.suffix, which always starts with its dot.
        if bad := [s for s in self.suffixes if not s.startswith(".")]:
            raise FieldError("suffixes", list(self.suffixes),
                             f"must be file suffixes with their dot (e.g. '.md'); {bad[0]!r} has none")


def note_files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    if not root.is_dir():
        raise FileNotFoundError(
            f"roam: notes folder {root} does not exist; set fetch.<name>.path to a folder of markdown notes"
        )
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file()
        and p.suffix.lower() in suffixes
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    if not files:
        raise FileNotFoundError(f"roam: no {'/'.join(suffixes)} notes under {root}")
    return files


def title_of(text: str, fallback: str) -> str:
    for line in text.split("\n"):
        if line.startswith("# "):
            return line[2:].strip()
    return fallback


def produce(cfg: RoamConfig, sink: SnapshotWriter, *, seed: int) -> dict[str, Any]:
    root = Path(cfg.path)
    files = note_files(root, tuple(s.lower() for s in cfg.suffixes))
    items = []
    for f in files:
        text = read_text(f, sink)
        if text is None:
            continue
        rel = f.relative_to(root).as_posix()
        doc = {"text": text.strip() + "\n" if text.strip() else "", "id": rel, "title": title_of(text, f.stem)}
        if (clean := sink.check(doc, str(f))) is not None:
            items.append((str(f), clean))
    write_split(sink, items, cfg.val_frac, seed)
    revision, per_file = files_revision(files)
    return {"source_id": f"local:{root.as_posix()}", "revision": revision, "input_sha256": per_file, "streamed": False}


def size(cfg: RoamConfig, *, name: str, root: Path) -> SourceSize | None:
    """The notes folder's size (None before it exists)."""
    return text_files(root / cfg.path, cfg.suffixes, val_frac=cfg.val_frac)
