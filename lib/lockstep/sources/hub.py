"""Config fields and row readers shared by the loaders of Hugging Face hub datasets that may also
be read from local files in the same format. No record conversion lives here."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockstep.sources.common import dataset_rows, files_revision, hub_revision, local_files, read_jsonl
from lockstep.sources.snapshot import SnapshotWriter


@dataclass(frozen=True)
class HubFields:
    path: str | None = None  # local file or folder in the source's real format; null: the hub
    revision: str = "main"  # hub branch, tag or commit; recorded as the resolved commit sha
    val_frac: float = 0.1  # val share, by example and seeded, when the data has no val split
    strict: bool = False  # true: the first bad record fails the stage with its file and line
    artifact_records: int = 8  # records per split kept in dataset_snapshot.json, the parity artifact
    max_retries: int = 5  # network retries before giving up
    backoff_s: float = 2.0  # first retry wait; doubles each retry


def local_rows(cfg: HubFields, sink: SnapshotWriter, *, what: str) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
    """(where, row) pairs from local .jsonl / .json-lines or .parquet files, plus meta fields."""
    assert cfg.path is not None
    files = local_files(cfg.path, (".jsonl", ".parquet"), what=what)
    revision, per_file = files_revision(files)
    rows: list[tuple[str, dict[str, Any]]] = []
    jsonl = [f for f in files if f.suffix == ".jsonl"]
    parquet = [f for f in files if f.suffix == ".parquet"]
    for f in jsonl:
        rows.extend(read_jsonl(f, sink))
    if parquet:
        stream = dataset_rows(
            hub_id="", hub_config=None, hub_split="train", revision="", files=parquet,
            max_retries=cfg.max_retries, backoff_s=cfg.backoff_s,
        )
        label = str(parquet[0]) if len(parquet) == 1 else f"{parquet[0].parent}/*.parquet"
        rows.extend((f"{label} row {i}", row) for i, row in enumerate(stream))
    return rows, {"revision": revision, "input_sha256": per_file, "streamed": bool(parquet)}


def hub_rows(
    cfg: HubFields, dataset: str, config: str | None, split: str, revision: str
) -> Iterator[tuple[str, dict[str, Any]]]:
    stream = dataset_rows(
        hub_id=dataset, hub_config=config, hub_split=split, revision=revision, files=None,
        max_retries=cfg.max_retries, backoff_s=cfg.backoff_s,
    )
    return ((f"{dataset}[{split}] row {i}", row) for i, row in enumerate(stream))


def rows_by_split(
    cfg: HubFields,
    sink: SnapshotWriter,
    *,
    dataset: str,
    config: str | None,
    hub_splits: dict[str, str],
    convert: Callable[[str, dict[str, Any]], dict[str, Any] | None],
    seed: int,
) -> dict[str, Any]:
    """The common loader shape: rows from local files (split by `val_frac`, seeded) or from the
    hub's own splits (`hub_splits` maps our split to theirs), each converted by `convert`
    (which returns None after reporting a bad row to `sink`), validated and written."""
    from lockstep.sources.common import write_split

    if cfg.path is not None:
        rows, meta = local_rows(cfg, sink, what=dataset)
        good = []
        for where, row in rows:
            rec = convert(where, row)
            if rec is not None and (clean := sink.check(rec, where)) is not None:
                good.append((where, clean))
        write_split(sink, good, cfg.val_frac, seed)
        return {"source_id": f"local:{Path(cfg.path).as_posix()}", "source_format": dataset, **meta}
    sha = hub_revision(dataset, cfg.revision, max_retries=cfg.max_retries, backoff_s=cfg.backoff_s)
    if "val" not in hub_splits:
        # No val split upstream: hold the (small) train split to choose val by example.
        good = []
        for where, row in hub_rows(cfg, dataset, config, hub_splits["train"], sha):
            rec = convert(where, row)
            if rec is not None and (clean := sink.check(rec, where)) is not None:
                good.append((where, clean))
        write_split(sink, good, cfg.val_frac, seed)
    else:
        for ours, theirs in hub_splits.items():
            for where, row in hub_rows(cfg, dataset, config, theirs, sha):
                rec = convert(where, row)
                if rec is not None:
                    sink.add(ours, rec, where)
    return {"source_id": dataset, "hub_config": config, "hub_splits": hub_splits, "revision": sha, "streamed": True}
