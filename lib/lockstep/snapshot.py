"""The raw snapshot format: a streaming parquet writer that validates each record against its
kind (lockstep.records) and writes meta.json last, and checked readers. Knows nothing about where
records come from."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from lockstep.io import read_json, sha256_file, write_json_atomic
from lockstep.parity import SNAPSHOT_FILE, SnapshotCollector
from lockstep.records import KINDS, BadRecord, validate_record

FORMAT_VERSION = 1
SPLITS = ("train", "val")
# Bad-record reasons kept in meta.json: enough to diagnose, small enough to read.
MAX_BAD_EXAMPLES = 5
# Records buffered per parquet row group; bounds memory while streaming.
ROW_GROUP_RECORDS = 1024
DEFAULT_PART_BYTES = 128 * 1024 * 1024

_PART = pa.struct([("type", pa.string()), ("text", pa.string())])
_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.list_(_PART))])


class BadRecordError(ValueError):
    """A bad record was met with `strict: true`; the message names the file and line."""


class SnapshotError(ValueError):
    """A snapshot on disk is missing, incomplete or does not match its meta.json."""


def schema_for(kind: str, extra_fields: Sequence[str] = ()) -> pa.Schema:
    if kind == "document":
        return pa.schema([("text", pa.string())] + [(f, pa.string()) for f in extra_fields])
    if kind == "conversation":
        return pa.schema([("messages", pa.list_(_MESSAGE))])
    if kind == "problem":
        return pa.schema([("question", pa.string()), ("answer", pa.string())])
    raise ValueError(f"record kind {kind!r} must be one of {KINDS}")


class _SplitWriter:
    def __init__(self, root: Path, split: str, schema: pa.Schema, part_bytes: int):
        self.dir = root / split
        self.dir.mkdir(parents=True, exist_ok=True)
        self.schema = schema
        self.part_bytes = part_bytes
        self.rows: list[dict[str, Any]] = []
        self.writer: pq.ParquetWriter | None = None
        self.part_index = -1
        self.part_text_bytes = 0
        self.count = 0
        self.text_bytes = 0

    def _open_part(self) -> None:
        self.part_index += 1
        path = self.dir / f"part_{self.part_index:05d}.parquet"
        # Fixed writer options so that equal records give equal bytes on every run. No
        # dictionary pages: texts are nearly all distinct, and the offline snapshots read back
        # whole in 19 ms plain against 23-28 ms dictionary-encoded (and are 0.3% smaller).
        self.writer = pq.ParquetWriter(
            path, self.schema, compression="zstd", compression_level=3, write_statistics=False, use_dictionary=False
        )
        self.part_text_bytes = 0

    def add(self, record: dict[str, Any], size_bytes: int) -> None:
        self.rows.append(record)
        self.count += 1
        self.text_bytes += size_bytes
        self.part_text_bytes += size_bytes
        if len(self.rows) >= ROW_GROUP_RECORDS or self.part_text_bytes >= self.part_bytes:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            if self.writer is None:
                self._open_part()
            assert self.writer is not None
            self.writer.write_table(pa.Table.from_pylist(self.rows, schema=self.schema))
            self.rows = []
        if self.writer is not None and self.part_text_bytes >= self.part_bytes:
            self.writer.close()
            self.writer = None

    def close(self) -> None:
        self.flush()
        if self.writer is None and self.part_index < 0:
            self._open_part()  # an empty split still gets one (empty) part, so readers need no special case
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _record_bytes(record: dict[str, Any]) -> int:
    if "text" in record:
        return len(record["text"].encode("utf-8"))
    if "messages" in record:
        return sum(len(p["text"].encode("utf-8")) for m in record["messages"] for p in m["content"])
    return len(record["question"].encode("utf-8")) + len(record["answer"].encode("utf-8"))


class SnapshotWriter:
    """Writes records into `root/{train,val}/part_NNNNN.parquet` as they arrive, counts bad ones,
    writes the parity artifact `dataset_snapshot.json` (the first `artifact_records` records of
    each split and a sha256 over all of them), and meta.json last. `root` should be an
    `atomic_dir` temp folder so that a failure never publishes a half snapshot."""

    def __init__(
        self,
        root: Path,
        *,
        kind: str,
        extra_fields: Sequence[str] = (),
        strict: bool = False,
        part_bytes: int = DEFAULT_PART_BYTES,
        artifact_records: int = 8,
    ):
        if isinstance(artifact_records, bool) or not isinstance(artifact_records, int) or artifact_records < 0:
            raise ValueError(f"artifact_records={artifact_records!r} must be an integer >= 0 (records per split kept in {SNAPSHOT_FILE})")
        self.root = Path(root)
        self.kind = kind
        self.extra_fields = tuple(extra_fields)
        self.strict = strict
        self.schema = schema_for(kind, extra_fields)
        self.splits = {s: _SplitWriter(self.root, s, self.schema, part_bytes) for s in SPLITS}
        self.skipped = 0
        self.bad_examples: list[str] = []
        self.last_bad: str | None = None  # the latest `where: reason`, for errors about a whole file
        self.snapshot = SnapshotCollector(artifact_records)
        for split in SPLITS:
            self.snapshot.begin(split)  # an empty split still appears in the artifact

    def bad(self, where: str, reason: str) -> None:
        """Count one unusable record at `where` (e.g. `file.jsonl:17`); raise in strict mode."""
        if self.strict:
            raise BadRecordError(f"{where}: {reason} (fix the record, or set strict: false to skip and count bad records)")
        self.skipped += 1
        self.last_bad = f"{where}: {reason}"
        if len(self.bad_examples) < MAX_BAD_EXAMPLES:
            self.bad_examples.append(f"{where}: {reason}")

    def check(self, record: dict[str, Any], where: str) -> dict[str, Any] | None:
        """The validated record, or None after counting it as bad."""
        try:
            return validate_record(self.kind, record, self.extra_fields)
        except BadRecord as e:
            self.bad(where, str(e))
            return None

    def add(self, split: str, record: dict[str, Any], where: str) -> bool:
        """Validate and append one record to `split`; returns False when it was bad (and counted)."""
        if split not in self.splits:
            raise ValueError(f"split {split!r} must be one of {SPLITS}")
        clean = self.check(record, where)
        if clean is None:
            return False
        self.splits[split].add(clean, _record_bytes(clean))
        self.snapshot.add(split, clean)
        return True

    def count(self, split: str) -> int:
        return self.splits[split].count

    def text_bytes(self, split: str) -> int:
        return self.splits[split].text_bytes

    def abort(self) -> None:
        """Close the open parquet files without finishing the snapshot (no dataset_snapshot.json,
        no meta.json), so the caller can delete the folder: no handle is left writing into it."""
        for w in self.splits.values():
            if w.writer is not None:
                w.writer.close()
                w.writer = None
            w.rows = []

    def close(self, **meta_fields: Any) -> dict[str, Any]:
        """Finish the parquet parts, write dataset_snapshot.json, then meta.json (last). Returns
        the meta dict. `files` lists the parquet parts that readers verify; `artifacts` lists
        the parity artifact apart, so it never counts as data."""
        for w in self.splits.values():
            w.close()
        files = {
            p.relative_to(self.root).as_posix(): sha256_file(p) for p in sorted(self.root.rglob("*.parquet"))
        }
        write_json_atomic(self.root / SNAPSHOT_FILE, self.snapshot.to_json())
        meta = {
            "format_version": FORMAT_VERSION,
            "kind": self.kind,
            "columns": list(self.schema.names),
            "counts": {"train": self.count("train"), "val": self.count("val"), "skipped": self.skipped},
            "text_bytes": {s: self.text_bytes(s) for s in SPLITS},
            "bad_examples": self.bad_examples,
            "files": files,
            "artifacts": {SNAPSHOT_FILE: sha256_file(self.root / SNAPSHOT_FILE)},
            **meta_fields,
        }
        write_json_atomic(self.root / "meta.json", meta)
        return meta


def read_meta(snapshot_dir: str | Path) -> dict[str, Any]:
    """meta.json of a snapshot; a folder without it is not a snapshot (a fetch did not finish)."""
    snapshot_dir = Path(snapshot_dir)
    path = snapshot_dir / "meta.json"
    if not path.is_file():
        raise SnapshotError(f"{snapshot_dir} has no meta.json, so it is not a finished snapshot; run `dvc repro fetch@{snapshot_dir.name}`")
    meta = read_json(path, what="snapshot meta")
    if meta.get("kind") not in KINDS or not isinstance(meta.get("files"), dict):
        raise SnapshotError(f"{path} lacks `kind` or `files`; delete {snapshot_dir} and re-run its fetch stage")
    return meta


def _split_parts(snapshot_dir: Path, split: str) -> list[tuple[Path, str]]:
    """(path, sha256 from meta.json) of each part file of `split`, in stored order."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} must be one of {SPLITS}")
    files = read_meta(snapshot_dir)["files"]
    parts = [(snapshot_dir / name, files[name]) for name in sorted(n for n in files if n.startswith(f"{split}/"))]
    for path, _ in parts:
        if not path.is_file():
            raise SnapshotError(f"{path} listed in meta.json is missing; re-run the fetch stage")
    return parts


def verify_split(snapshot_dir: str | Path, split: str) -> None:
    """Check each part file of `split` against its sha256 in meta.json. A reader that hashes on
    another thread while it decodes (`iter_records(..., verify=False)`) calls this before it
    uses what it read."""
    for path, digest in _split_parts(Path(snapshot_dir), split):
        _check_part(path, digest)


def _check_part(path: Path, digest: str) -> None:
    if sha256_file(path) != digest:
        raise SnapshotError(f"{path} does not match its sha256 in meta.json; re-run the fetch stage")


def iter_records(
    snapshot_dir: str | Path,
    split: str,
    *,
    verify: bool = True,
    batch_records: int = ROW_GROUP_RECORDS,
    columns: Sequence[str] | None = None,
) -> Iterator[dict[str, Any]]:
    """Records of `split` in stored order. Each part file is checked against its sha256 in
    meta.json first (unless verify=False), so a damaged snapshot fails instead of feeding bad data.
    `batch_records` rows are converted to dicts at a time; a reader that wants only the first few
    records passes a small value. `columns` keeps only those fields (all when None): a reader of
    document text skips decoding the other fields (fineweb-edu's url, id, dump, ...)."""
    if batch_records < 1:
        raise ValueError(f"batch_records={batch_records} must be at least 1")
    for path, digest in _split_parts(Path(snapshot_dir), split):
        if verify:
            _check_part(path, digest)
        pf = pq.ParquetFile(path)
        if columns is not None and (missing := sorted(set(columns) - set(pf.schema_arrow.names))):
            raise SnapshotError(f"{path} has no field(s) {missing}; re-run the fetch stage")
        # One thread: a part's bytes are nearly all one text column, decoded on one thread
        # anyway, and pyarrow's pool threads only contended with the caller's own (rustbpe's,
        # the encoders'): reading the offline tokenizer text right after a training took up to
        # 70 ms with them instead of 13.
        for batch in pf.iter_batches(batch_size=batch_records, columns=columns, use_threads=False):
            yield from batch.to_pylist()


def first_records(snapshot_dir: str | Path, split: str, n: int) -> list[dict[str, Any]]:
    """The first `n` records of `split` in stored order. Taken from the snapshot's
    dataset_snapshot.json when it holds them and matches its sha256 in meta.json (no parquet
    decoding), else read from the parts like `iter_records`."""
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    if split not in SPLITS:
        raise ValueError(f"split {split!r} must be one of {SPLITS}")
    snapshot_dir = Path(snapshot_dir)
    meta = read_meta(snapshot_dir)
    digest = (meta.get("artifacts") or {}).get(SNAPSHOT_FILE)
    path = snapshot_dir / SNAPSHOT_FILE
    if digest is not None and path.is_file() and sha256_file(path) == digest:
        kept = read_json(path, what="dataset snapshot").get("splits", {}).get(split)
        if kept is not None and len(kept["records"]) >= min(n, kept["count"]):
            return kept["records"][:n]
    out: list[dict[str, Any]] = []
    if n > 0:
        for record in iter_records(snapshot_dir, split, batch_records=n):
            out.append(record)
            if len(out) == n:
                break
    return out


def split_sizes(n: int, val_frac: float) -> int:
    """How many of `n` examples go to val: round(n * val_frac), at least 1 when val_frac > 0 and
    n >= 2, and never all of them."""
    if not 0.0 <= val_frac < 1.0:
        raise ValueError(f"val_frac={val_frac} must be in [0, 1)")
    if val_frac == 0.0 or n < 2:
        return 0
    return min(n - 1, max(1, int(math.floor(n * val_frac + 0.5))))
