"""FineWeb-Edu (`HuggingFaceFW/fineweb-edu`) as documents: its parquet shards streamed one at a
time in a seeded order, each shuffled in windows of `shuffle_buffer` documents, and consumed up to
a character budget (val first, then train), written as it streams. Resumable: the position is
saved after each finished part (lockstep.data.sources.shards). Local parquet files in the fineweb-edu
schema go through the same calls, one file per shard; in a copy of the hub's layout
(`data/<dump>/*.parquet`) only the configured dump is read. Two paths give the same bytes: one
dict per row (the reference), or whole Arrow windows (`arrow_batches`, about 1.6x faster)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lockstep.core.progress import Progress
from lockstep.data.records import BadRecord, validate_record
from lockstep.data.snapshot import SnapshotWriter, documents_ok
from lockstep.data.sources.common import (
    SourceFormatError,
    SplitLayoutError,
    dataset_rows,
    files_revision,
    generator,
    hub_revision,
    local_files,
    local_root,
    parquet_tables,
    with_retries,
)
from lockstep.data.sources.fields import Rule
from lockstep.data.sources.hub import HubFields, split_of
from lockstep.data.sources.shards import ResumeFolder, shard_order, window_shuffle, window_shuffle_tables
from lockstep.data.sources.size import SourceSize

KIND = "document"
EXTRA_FIELDS = ("id", "url", "dump")
SCHEMA = ("text", "id", "dump", "url", "file_path", "language", "language_score", "token_count", "score", "int_score")
EXPECTED = f"parquet rows in the fineweb-edu schema ({', '.join(SCHEMA)}) with a non-empty `text`"
log = logging.getLogger("lockstep.sources.fineweb_edu")
RESUMABLE = True
ARROW_BATCHES = True  # produce(..., arrow_batches=True): whole Arrow tables, same bytes as the record path
PROGRESS_INTERVAL_S = 5.0  # seconds between progress lines
# Generator streams (lockstep.data.sources.common.generator) of the shard order and of shard i's windows.
_ORDER_STREAM = 2
_SHARD_STREAM = 1000
_SHUFFLE_RULE = "shards in a seeded order, each shuffled in consecutive windows of shuffle_buffer documents"


class SchemaError(SourceFormatError):
    """Rows do not have the fineweb-edu columns."""


@dataclass(frozen=True)
class FinewebEduConfig(HubFields):
    source: Literal["fineweb_edu"] = "fineweb_edu"
    dataset: str = "HuggingFaceFW/fineweb-edu"
    config: str = "CC-MAIN-2024-10"  # one crawl dump of the dataset
    shuffle_buffer: int = 10_000  # documents per shuffle window within a shard (memory: one window)
    max_train_chars: int = 900_000_000  # train budget in characters (~200M tokens at ~4.5 chars/token)
    max_val_chars: int = 22_500_000  # val budget in characters, taken first from the stream
    min_int_score: int | None = None  # keep only documents with int_score >= this (null: all)

    RULES = {
        **HubFields.RULES,
        "shuffle_buffer": Rule("documents per shuffle window within a shard (memory: one window)", ge=1),
        "max_train_chars": Rule("the train budget in characters", ge=1),
        "max_val_chars": Rule("the val budget in characters, taken first from the stream (0: no val)", ge=0),
        "min_int_score": Rule("fineweb-edu's int_score runs 0..5; null keeps every document", ge=0, le=5),
    }


def _configured_dump(files: list[Path], root: Path, config: str) -> list[Path]:
    """The files of dump `config` when `root` is a copy of the hub's layout (`data/<dump>/`), as
    the hub path reads one config; all `files` when `root` has no per-dump folders."""
    dump_dir = next((d for d in (root / "data" / config, root / config) if d.is_dir()), None)
    if dump_dir is None:
        dumps = sorted(d.name for d in (root / "data").iterdir() if d.is_dir()) if (root / "data").is_dir() else []
        if dumps:
            raise FileNotFoundError(
                f"fineweb_edu: {root / 'data'} holds the dump(s) {', '.join(dumps)} but not `{config}`; set "
                "`fetch.<name>.config` to one of them, or point `path` at the folder of the files to read"
            )
        return files
    chosen = [f for f in files if f.is_relative_to(dump_dir)]
    if not chosen:
        raise FileNotFoundError(f"fineweb_edu: no .parquet files under {dump_dir} (the `{config}` dump)")
    return chosen


def hub_data_files(
    dataset: str, config: str, revision: str, *, max_retries: int, backoff_s: float
) -> list[tuple[str, str]]:
    """(name in the repo, `hf://` address) of each parquet data file of `config`'s train split at
    the commit `revision`, sorted by name: the shards that `load_dataset(dataset, config)` would
    stream, each then read through the same `load_dataset("parquet", data_files=[...])` call as a
    local file."""
    from datasets import load_dataset_builder  # heavy (about 2 s), and only the hub path needs it

    builder = with_retries(
        lambda: load_dataset_builder(dataset, config, revision=revision),
        what=f"hub dataset {dataset}@{revision} ({config}) file list", max_retries=max_retries, backoff_s=backoff_s,
    )
    files = [str(f) for f in (builder.config.data_files or {}).get("train", [])]
    if not files:
        raise SourceFormatError(f"{dataset}@{revision}: config {config!r} lists no train data files; check `config`")
    return sorted((f.split(f"@{revision}/", 1)[-1], f) for f in files)


@dataclass
class _Tally:
    """The stream counters that the resume position records, shared with the batch reader."""

    chars: dict[str, int]
    consumed: int
    below_score: int


def _check_columns(names: Sequence[str], shard: str) -> None:
    if missing := [c for c in SCHEMA if c not in names]:
        raise SchemaError(
            f"fineweb_edu: rows of {shard} lack column(s) {', '.join(missing)}; expected the fineweb-edu schema "
            f"({', '.join(SCHEMA)}); use a different source for other parquet text"
        )


def _read_shard_tables(
    cfg: FinewebEduConfig, sink: SnapshotWriter, resume: ResumeFolder | None, progress: Progress, tally: _Tally, *,
    budget: dict[str, int], name: str, ref: str, k: int, skip: int, revision: str, seed: int, shard_index: int,
) -> bool:
    """The `arrow_batches` path through shard `k` of the order: the same rows, decisions, parts,
    bad-record reports and resume saves as the record loop in `produce`, a window at a time.
    Returns True when the train budget was reached."""
    tables = parquet_tables([ref], max_retries=cfg.max_retries, backoff_s=cfg.backoff_s)
    emitted = 0
    for row_index, table in window_shuffle_tables(
        tables, cfg.shuffle_buffer, generator(seed, stream=_SHARD_STREAM + shard_index)
    ):
        if emitted + table.num_rows <= skip:
            emitted += table.num_rows
            continue
        if emitted < skip:
            row_index, table, emitted = row_index[skip - emitted :], table.slice(skip - emitted), skip
        if emitted == skip:
            _check_columns(table.schema.names, name)
        if _take_window(
            cfg, sink, resume, progress, tally, table, row_index, budget=budget, name=name, k=k, emitted=emitted
        ):
            return True
        emitted += table.num_rows
    return False


def _string_column(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """A column as the snapshot's strings: FineWeb-Edu's are strings already; another type is
    converted value by value with str(), as `validate_record` converts a document's extra fields
    (a text that is not a string never reaches the snapshot: the record rules refuse it)."""
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return col.cast(pa.string())
    return pa.chunked_array([pa.array([None if v is None else str(v) for v in col.to_pylist()], pa.string())])


def _take_window(
    cfg: FinewebEduConfig, sink: SnapshotWriter, resume: ResumeFolder | None, progress: Progress, tally: _Tally,
    table: pa.Table, row_index: np.ndarray, *, budget: dict[str, int], name: str, k: int, emitted: int,
) -> bool:
    """One shuffled window (rows `emitted`+1.. of shard `k`'s stream). Accepted rows go to the
    sink in runs of one split, cut where val fills, where train fills (the stop, returning True)
    and after each row that closes a part, where the resume state is saved as the record loop
    saves it; bad rows are reported, in order, before the state that counts them."""
    docs = pa.Table.from_arrays([_string_column(table.column(f)) for f in sink.schema.names], schema=sink.schema)
    n = docs.num_rows
    if cfg.min_int_score is None:
        scored = np.ones(n, dtype=bool)
    else:
        scored = pc.fill_null(pc.greater_equal(table.column("int_score"), cfg.min_int_score), False).to_numpy(
            zero_copy_only=False
        )
    good = scored & documents_ok(table)
    for j in np.flatnonzero(scored & ~good):  # blank, missing, non-ASCII or non-string text: the record rules decide
        try:
            validate_record(KIND, table.slice(int(j), 1).to_pylist()[0], EXTRA_FIELDS)
            good[j] = True
        except BadRecord:
            pass
    bad = iter(np.flatnonzero(scored & ~good).tolist())
    next_bad = next(bad, n)
    chars_of = pc.fill_null(pc.utf8_length(docs.column("text")), 0).to_numpy(zero_copy_only=False)
    consumed0, below0 = tally.consumed, tally.below_score
    rows = np.flatnonzero(good)
    while True:
        last = int(rows[0]) if rows.size else n  # report the bad rows before the next accepted one
        if rows.size:
            split = "val" if tally.chars["val"] < budget["val"] else "train"
            fill = int(np.searchsorted(np.cumsum(chars_of[rows]), budget[split] - tally.chars[split], side="left")) + 1
            parts_before, bytes_before = sink.parts_closed(), sink.text_bytes(split)
            taken = sink.add_documents(split, docs.take(pa.array(rows[: min(fill, rows.size)])))
            last = int(rows[taken - 1])
        while next_bad < last:
            record = table.slice(next_bad, 1).to_pylist()[0]
            sink.check(record, f"{name} row {row_index[next_bad]} id={record.get('id')}")
            next_bad = next(bad, n)
        if not rows.size:
            tally.consumed, tally.below_score = consumed0 + n, below0 + int(n - scored.sum())
            return False
        added = int(chars_of[rows[:taken]].sum())
        tally.chars[split] += added
        if split == "val" and tally.chars["val"] >= budget["val"]:
            sink.finish_split("val")  # val is complete: its last part is final before train starts
        progress.update(items=taken, text_bytes=sink.text_bytes(split) - bytes_before, done=added)
        tally.consumed, tally.below_score = consumed0 + last + 1, below0 + int(last + 1 - scored[: last + 1].sum())
        if resume is not None and sink.parts_closed() != parts_before:
            resume.save(sink, {"shard": k, "emitted": emitted + last + 1, "chars": tally.chars,
                               "consumed": tally.consumed, "below_score": tally.below_score})
        if tally.chars["train"] >= budget["train"]:
            return True
        rows = rows[taken:]


def produce(
    cfg: FinewebEduConfig,
    sink: SnapshotWriter,
    *,
    seed: int,
    resume: ResumeFolder | None = None,
    arrow_batches: bool = False,
) -> dict[str, Any]:
    """Fetch into `sink`. The record path (the reference) turns each row into a dict and adds it;
    `arrow_batches` validates and writes each shuffle window as Arrow tables instead, for the
    same bytes (tests/test_fetch_arrow.py) in about 1.6x less time, and without `datasets`."""
    if cfg.path is not None:
        files = local_files(cfg.path, (".parquet",), what="fineweb_edu")
        root = local_root(cfg.path)
        if Path(cfg.path).is_dir():
            files = _configured_dump(files, root, cfg.config)
        for f in files:
            # The hub has only `train` (val is the stream's first max_val_chars): a file of another
            # split would be pooled into train, so it is refused as the hub-split sources refuse it.
            if (split := split_of(f, root, dataset=cfg.dataset)) not in (None, "train"):
                raise SplitLayoutError(
                    f"{cfg.dataset}: {f} is named for the `{split}` split, but {cfg.dataset} has only `train` "
                    f"(val is the first max_val_chars of its shuffled stream); move it out of {root}"
                )
        revision, per_file = files_revision(files)
        # Named relative to the folder, so that the order and the snapshot do not depend on where it lies.
        shards = [(f.relative_to(root).as_posix(), str(f)) for f in files]
        meta: dict[str, Any] = {"source_id": f"local:{Path(cfg.path).as_posix()}", "source_format": cfg.dataset,
                                "revision": revision, "input_sha256": per_file}
    else:
        revision = hub_revision(cfg.dataset, cfg.revision, max_retries=cfg.max_retries, backoff_s=cfg.backoff_s)
        shards = hub_data_files(cfg.dataset, cfg.config, revision, max_retries=cfg.max_retries, backoff_s=cfg.backoff_s)
        meta = {"source_id": cfg.dataset, "hub_config": cfg.config, "revision": revision}
    order = shard_order(len(shards), generator(seed, stream=_ORDER_STREAM))
    saved = resume.begin({"revision": revision, "shards": [name for name, _ in shards]}, sink) if resume else None
    pos = saved or {"shard": 0, "emitted": 0, "chars": {"train": 0, "val": 0}, "consumed": 0, "below_score": 0}
    chars, consumed, below_score = dict(pos["chars"]), int(pos["consumed"]), int(pos["below_score"])
    budget = {"train": cfg.max_train_chars, "val": cfg.max_val_chars}
    progress = Progress(
        f"fetch fineweb_edu{' (resumed)' if saved else ''}",
        log,
        budget=budget["train"] + budget["val"],
        already_done=chars["train"] + chars["val"],
        interval_s=PROGRESS_INTERVAL_S,
    )
    text_bytes = sink.text_bytes("train") + sink.text_bytes("val")
    if budget["val"] == 0:
        sink.finish_split("val")
    exhausted = True
    k = pos["shard"]
    while k < len(order) and exhausted:
        name, ref = shards[order[k]]
        skip = pos["emitted"] if k == pos["shard"] else 0
        if arrow_batches:
            tally = _Tally(chars, consumed, below_score)
            exhausted = not _read_shard_tables(cfg, sink, resume, progress, tally, budget=budget, name=name, ref=ref,
                                               k=k, skip=skip, revision=revision, seed=seed, shard_index=order[k])
            consumed, below_score = tally.consumed, tally.below_score
            k += 1
            continue
        rows = dataset_rows(
            hub_id=cfg.dataset, hub_config=cfg.config, hub_split="train", revision=revision, files=[ref],
            max_retries=cfg.max_retries, backoff_s=cfg.backoff_s,
        )  # fmt: skip
        # One generator per shard, seeded by its place among the sorted shards, so each shard's
        # windows come out the same whichever shard a run starts from.
        stream = window_shuffle(rows, cfg.shuffle_buffer, generator(seed, stream=_SHARD_STREAM + order[k]))
        for emitted, (row_index, row) in enumerate(stream, start=1):
            if emitted <= skip:
                continue
            if emitted == skip + 1:
                _check_columns(list(row), name)
            consumed += 1
            if cfg.min_int_score is not None and (row.get("int_score") is None or row["int_score"] < cfg.min_int_score):
                below_score += 1
                continue
            split = "val" if chars["val"] < budget["val"] else "train"
            parts_before = sink.parts_closed()
            if sink.add(split, row, f"{name} row {row_index} id={row.get('id')}"):
                chars[split] += len(row["text"])
                if split == "val" and chars["val"] >= budget["val"]:
                    sink.finish_split("val")  # val is complete: its last part is final before train starts
                now_bytes = sink.text_bytes("train") + sink.text_bytes("val")
                progress.update(items=1, text_bytes=now_bytes - text_bytes, done=len(row["text"]))
                text_bytes = now_bytes
            if resume is not None and sink.parts_closed() != parts_before:
                resume.save(
                    sink,
                    {"shard": k, "emitted": emitted, "chars": chars, "consumed": consumed, "below_score": below_score},
                )
            if chars["train"] >= budget["train"]:
                exhausted = False
                break
        k += 1
    progress.finish()
    return {
        **meta,
        "streamed": True,
        "shuffle_seed": seed,
        "shuffle_buffer": cfg.shuffle_buffer,
        "shuffle": _SHUFFLE_RULE,
        "shards_total": len(shards),
        "shards_read": k,
        "chars": chars,
        "rows_consumed": consumed,
        "rows_below_min_int_score": below_score,
        "stream_exhausted": exhausted,
    }


def size(cfg: FinewebEduConfig, *, name: str, root: Path) -> SourceSize:
    """Its fetch budget: `max_train_chars` and `max_val_chars`."""
    return SourceSize(
        train_chars=cfg.max_train_chars, val_chars=cfg.max_val_chars, basis=f"fetch.{name}.max_train_chars"
    )
