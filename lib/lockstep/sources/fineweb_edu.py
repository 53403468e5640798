"""FineWeb-Edu (`HuggingFaceFW/fineweb-edu`) as documents: streamed, shuffled with the seed in a
bounded buffer, and consumed in order up to a character budget (val first, then train), written
as it streams. Local parquet files in the fineweb-edu schema go through the same calls."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lockstep.sources.common import (
    SourceFormatError,
    SplitLayoutError,
    dataset_rows,
    files_revision,
    hub_revision,
    local_files,
    local_root,
)
from lockstep.sources.hub import HubFields, split_of
from lockstep.snapshot import SnapshotWriter

KIND = "document"
EXTRA_FIELDS = ("id", "url", "dump")
SCHEMA = ("text", "id", "dump", "url", "file_path", "language", "language_score", "token_count", "score", "int_score")
EXPECTED = f"parquet rows in the fineweb-edu schema ({', '.join(SCHEMA)}) with a non-empty `text`"
log = logging.getLogger("lockstep.sources.fineweb_edu")
_PROGRESS_EVERY_DOCS = 100_000


class SchemaError(SourceFormatError):
    """Rows do not have the fineweb-edu columns."""


@dataclass(frozen=True)
class FinewebEduConfig(HubFields):
    source: Literal["fineweb_edu"] = "fineweb_edu"
    dataset: str = "HuggingFaceFW/fineweb-edu"
    config: str = "CC-MAIN-2024-10"  # one crawl dump of the dataset
    shuffle_buffer: int = 10_000  # documents held by the streaming shuffle
    max_train_chars: int = 900_000_000  # train budget in characters (~200M tokens at ~4.5 chars/token)
    max_val_chars: int = 22_500_000  # val budget in characters, taken first from the stream
    min_int_score: int | None = None  # keep only documents with int_score >= this (null: all)


def produce(cfg: FinewebEduConfig, sink: SnapshotWriter, *, seed: int) -> dict[str, Any]:
    if cfg.shuffle_buffer < 1:
        raise ValueError(f"fineweb_edu: shuffle_buffer={cfg.shuffle_buffer} must be >= 1")
    if cfg.max_train_chars < 1 or cfg.max_val_chars < 0:
        raise ValueError("fineweb_edu: max_train_chars must be >= 1 and max_val_chars >= 0")
    files: list[Path] | None = None
    if cfg.path is not None:
        files = local_files(cfg.path, (".parquet",), what="fineweb_edu")
        root = local_root(cfg.path)
        for f in files:
            # The hub has only `train` (val is the stream's first max_val_chars): a file of another
            # split would be pooled into train, so it is refused as the hub-split sources refuse it.
            if (split := split_of(f, root, dataset=cfg.dataset)) not in (None, "train"):
                raise SplitLayoutError(
                    f"{cfg.dataset}: {f} is named for the `{split}` split, but {cfg.dataset} has only `train` "
                    f"(val is the first max_val_chars of its shuffled stream); move it out of {root}"
                )
        revision, per_file = files_revision(files)
        meta: dict[str, Any] = {"source_id": f"local:{Path(cfg.path).as_posix()}", "source_format": cfg.dataset,
                                "revision": revision, "input_sha256": per_file}
    else:
        revision = hub_revision(cfg.dataset, cfg.revision, max_retries=cfg.max_retries, backoff_s=cfg.backoff_s)
        meta = {"source_id": cfg.dataset, "hub_config": cfg.config, "revision": revision}
    rows = dataset_rows(
        hub_id=cfg.dataset, hub_config=cfg.config, hub_split="train", revision=revision, files=files,
        max_retries=cfg.max_retries, backoff_s=cfg.backoff_s, shuffle_seed=seed, shuffle_buffer=cfg.shuffle_buffer,
    )
    chars = {"train": 0, "val": 0}
    budget = {"train": cfg.max_train_chars, "val": cfg.max_val_chars}
    consumed = below_score = 0
    exhausted = True
    for i, row in enumerate(rows):
        if i == 0:
            missing = [c for c in SCHEMA if c not in row]
            if missing:
                raise SchemaError(
                    f"fineweb_edu: rows lack column(s) {', '.join(missing)}; expected the fineweb-edu schema "
                    f"({', '.join(SCHEMA)}); use a different source for other parquet text"
                )
        consumed += 1
        where = f"{'hub' if files is None else 'local'} stream row {i} id={row.get('id')}"
        if cfg.min_int_score is not None and (row.get("int_score") is None or row["int_score"] < cfg.min_int_score):
            below_score += 1
            continue
        split = "val" if chars["val"] < budget["val"] else "train"
        if sink.add(split, row, where):
            chars[split] += len(row["text"])
        if consumed % _PROGRESS_EVERY_DOCS == 0:
            log.info("fineweb_edu: %d docs | train %d/%d chars | val %d/%d chars",
                     consumed, chars["train"], budget["train"], chars["val"], budget["val"])
        if chars["train"] >= budget["train"]:
            exhausted = False
            break
    return {**meta, "streamed": True, "shuffle_seed": seed, "shuffle_buffer": cfg.shuffle_buffer,
            "chars": chars, "rows_consumed": consumed, "rows_below_min_int_score": below_score, "stream_exhausted": exhausted}
