"""WikiText (`Salesforce/wikitext`, raw configs) as documents, one per Wikipedia article,
re-assembled from lines at the ` = Title = ` headings. Reads hub rows, the HF-row parquet, or the
raw `wiki.*.raw` text files; all give the same articles, and train/validation come from the
hub's splits or the local files' names. Not a detokenizer: ` @-@ ` stays."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lockstep.data.snapshot import SnapshotWriter
from lockstep.data.sources.common import SourceFormatError, dataset_rows, hub_revision
from lockstep.data.sources.hub import HubFields, hub_rows, local_splits
from lockstep.data.sources.size import SourceSize

KIND = "document"
EXTRA_FIELDS = ("title",)
EXPECTED = "WikiText lines: raw `wiki.*.raw` UTF-8 text, or parquet rows with a `text` column (the hub's layout)"
HUB_SPLITS = {"train": "train", "val": "validation"}  # our split <- the hub's; `test` is not read
# ` = Title = ` opens an article; ` = = Section = = ` (two or more `=`) does not.
_ARTICLE = re.compile(r"^= (?!=)(.*?[^=]) =$")


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
    try:
        with open(path, encoding="utf-8", newline="") as f:
            yield from f
    except UnicodeDecodeError as e:
        raise SourceFormatError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); expected {EXPECTED}") from None


def _parquet_lines(path: Path, cfg: WikitextConfig) -> Iterator[str]:
    rows = dataset_rows(hub_id="", hub_config=None, hub_split="train", revision="", files=[path],
                        max_retries=cfg.max_retries, backoff_s=cfg.backoff_s)
    for i, row in enumerate(rows):
        text = row.get("text")
        if not isinstance(text, str):
            raise SourceFormatError(
                f"{path} row {i}: no string `text` column (fields: {', '.join(row) or 'none'}); expected {EXPECTED}"
            )
        yield text


def _local_lines(path: Path, cfg: WikitextConfig) -> Iterator[str]:
    return _parquet_lines(path, cfg) if path.suffix == ".parquet" else _raw_lines(path)


def produce(cfg: WikitextConfig, sink: SnapshotWriter, *, seed: int) -> dict[str, Any]:
    if cfg.path is not None:
        # The test split is left out locally as on the hub: only train and validation are read.
        plan = local_splits(cfg, dataset=cfg.dataset, hub_splits=HUB_SPLITS, suffixes=(".raw", ".parquet"),
                            unused_splits=("test",), config=cfg.config)
        for split, files in plan.files.items():
            # One line stream per split, as the hub serves it: an article may cross a shard boundary.
            lines = (line for f in files for line in _local_lines(f, cfg))
            label = str(files[0]) if len(files) == 1 else f"{plan.root}[{split}]"
            plan.write(
                sink, split, [(f"{label} article {i}", a) for i, a in enumerate(articles_from_lines(lines))], seed
            )
        return {"source_id": f"local:{Path(cfg.path).as_posix()}", "source_format": cfg.dataset, **plan.meta()}
    sha = hub_revision(cfg.dataset, cfg.revision, max_retries=cfg.max_retries, backoff_s=cfg.backoff_s)
    for ours, theirs in HUB_SPLITS.items():
        rows = (row["text"] for _, row in hub_rows(cfg, cfg.dataset, cfg.config, theirs, sha))
        for i, art in enumerate(articles_from_lines(rows)):
            sink.add(ours, art, f"{cfg.dataset}[{theirs}] article {i}")
    return {
        "source_id": cfg.dataset,
        "hub_config": cfg.config,
        "hub_splits": HUB_SPLITS,
        "revision": sha,
        "streamed": True,
    }


# WikiText-103 raw: ~540 MB of train text (~120M tokens at 4.5 chars/token), ~1.1 MB val.
TRAIN_CHARS, VAL_CHARS = 540_000_000, 1_140_000


def size(cfg: WikitextConfig, *, name: str, root: Path) -> SourceSize:
    """WikiText-103's size, whatever the config."""
    return SourceSize(train_chars=TRAIN_CHARS, val_chars=VAL_CHARS, basis="WikiText-103 size")
