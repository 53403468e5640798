"""WikiText (`Salesforce/wikitext`, raw configs) as documents, one per Wikipedia article,
re-assembled from lines at the ` = Title = ` headings. Reads hub rows, the HF-row parquet, or the
raw `wiki.*.raw` text files; all give the same articles. Not a detokenizer: ` @-@ ` stays."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lockstep.sources.common import dataset_rows, files_revision, hub_revision, write_split
from lockstep.sources.hub import HubFields, hub_rows
from lockstep.sources.snapshot import SnapshotWriter

KIND = "document"
EXTRA_FIELDS = ("title",)
# ` = Title = ` opens an article; ` = = Section = = ` (two or more `=`) does not.
_ARTICLE = re.compile(r"^= (?!=)(.*?[^=]) =$")
_SPLIT_FILES = {"train": "wiki.train.raw", "val": "wiki.valid.raw"}


@dataclass(frozen=True)
class WikitextConfig(HubFields):
    source: Literal["wikitext"] = "wikitext"
    dataset: str = "Salesforce/wikitext"
    config: str = "wikitext-103-raw-v1"  # or wikitext-2-raw-v1


def articles_from_lines(lines: Iterable[str]) -> Iterator[dict[str, str]]:
    """Articles from WikiText lines in either layout (HF rows with `\\n` and blank rows, or raw
    file lines with CRLF): blank lines dropped, each line stripped, joined by `\\n`."""
    title: str | None = None
    body: list[str] = []
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        m = _ARTICLE.match(line)
        if m is not None:
            if body:
                yield {"text": "\n".join(body) + "\n", "title": title or ""}
            title, body = m.group(1).strip(), [line]
        else:
            body.append(line)
    if body:
        yield {"text": "\n".join(body) + "\n", "title": title or ""}


def _raw_lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8", newline="") as f:
        yield from f


def _local_lines(path: Path, cfg: WikitextConfig) -> Iterator[str]:
    if path.suffix == ".parquet":
        rows = dataset_rows(hub_id="", hub_config=None, hub_split="train", revision="", files=[path],
                            max_retries=cfg.max_retries, backoff_s=cfg.backoff_s)
        return (r["text"] for r in rows)
    return _raw_lines(path)


def produce(cfg: WikitextConfig, sink: SnapshotWriter, *, seed: int) -> dict[str, Any]:
    if cfg.path is not None:
        p = Path(cfg.path)
        if p.is_dir() and all((p / f).is_file() for f in _SPLIT_FILES.values()):
            for split, fname in _SPLIT_FILES.items():
                for i, art in enumerate(articles_from_lines(_raw_lines(p / fname))):
                    sink.add(split, art, f"{p / fname} article {i}")
            files = [p / f for f in _SPLIT_FILES.values()]
        elif p.is_file():
            arts = [(f"{p} article {i}", a) for i, a in enumerate(articles_from_lines(_local_lines(p, cfg)))]
            write_split(sink, arts, cfg.val_frac, seed)
            files = [p]
        else:
            raise FileNotFoundError(
                f"wikitext: {p} must be a .raw/.parquet file or a folder holding {' and '.join(_SPLIT_FILES.values())}"
            )
        revision, per_file = files_revision(files)
        return {"source_id": f"local:{p.as_posix()}", "revision": revision, "input_sha256": per_file,
                "streamed": p.suffix == ".parquet"}
    sha = hub_revision(cfg.dataset, cfg.revision, max_retries=cfg.max_retries, backoff_s=cfg.backoff_s)
    hub_splits = {"train": "train", "val": "validation"}
    for ours, theirs in hub_splits.items():
        rows = (row["text"] for _, row in hub_rows(cfg, cfg.dataset, cfg.config, theirs, sha))
        for i, art in enumerate(articles_from_lines(rows)):
            sink.add(ours, art, f"{cfg.dataset}[{theirs}] article {i}")
    return {"source_id": cfg.dataset, "hub_config": cfg.config, "hub_splits": hub_splits, "revision": sha, "streamed": True}
