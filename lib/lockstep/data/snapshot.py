"""The raw snapshot format: a streaming parquet writer that validates each record against its
kind (lockstep.data.records) and writes meta.json last, and checked readers; and the file-bundle
snapshot (an eval bundle's files kept verbatim, `close_bundle` / `open_bundle`). Knows nothing about where
records come from. A writer can also stop at a finished part and carry on in a later process
(`state` / `restore`), which is how a long fetch resumes, and take documents as whole Arrow
tables (`add_documents`, validated with `documents_ok`) with the same bytes as record by record.
Over 400 lines: the batch path shares the part and row-group rules and the parity artifact with
the record path, and must stay beside it to keep their bytes equal."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lockstep.core.io import canonical_json, read_json, sha256_file, write_json_atomic
from lockstep.data.parity import SNAPSHOT_FILE, SnapshotCollector, json_string_literals
from lockstep.data.records import KINDS, BadRecord, validate_record

FORMAT_VERSION = 1
SPLITS = ("train", "val")
# Bad-record reasons kept in meta.json: enough to diagnose, small enough to read.
MAX_BAD_EXAMPLES = 5
# Records buffered per parquet row group; bounds memory while streaming.
ROW_GROUP_RECORDS = 1024
DEFAULT_PART_BYTES = 128 * 1024 * 1024
# A raw snapshot of files kept verbatim (the DCLM eval bundle) rather than parquet records: the
# files under BUNDLE_DIR, and meta.json (written last) with a sha256 per file.
BUNDLE_KIND = "eval_bundle"
BUNDLE_DIR = "eval_bundle"

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
        # Buffered rows of the current row group: whole tables from `add_table`, then the dicts
        # from `add` that came after them.
        self.tables: list[pa.Table] = []
        self.rows: list[dict[str, Any]] = []
        self.writer: pq.ParquetWriter | None = None
        self.part_index = -1
        self.part_text_bytes = 0
        self.count = 0
        self.text_bytes = 0
        self.closed: list[str] = []  # names of the finished part files, in order

    def _open_part(self) -> None:
        self.part_index += 1
        path = self.dir / f"part_{self.part_index:05d}.parquet"
        # Fixed writer options so that equal records give equal bytes on every run. No
        # dictionary pages: texts are nearly all distinct, and the offline snapshots read back
        # whole in 19 ms plain against 23-28 ms dictionary-encoded (and are 0.3% smaller).
        self.writer = pq.ParquetWriter(
            path, self.schema, compression="zstd", compression_level=3, write_statistics=False, use_dictionary=False
        )

    def buffered(self) -> int:
        return sum(t.num_rows for t in self.tables) + len(self.rows)

    def add(self, record: dict[str, Any], size_bytes: int) -> None:
        self.rows.append(record)
        self.count += 1
        self.text_bytes += size_bytes
        self.part_text_bytes += size_bytes
        if self.buffered() >= ROW_GROUP_RECORDS or self.part_text_bytes >= self.part_bytes:
            self.flush()

    def add_table(self, table: pa.Table, size_bytes: np.ndarray) -> int:
        """`add` for each row of `table` in order, cut into the same row groups and parts, but
        stopping right after a row that closes a part: returns the rows taken."""
        if self.rows:
            self.tables.append(pa.Table.from_pylist(self.rows, schema=self.schema))
            self.rows = []
        cum = np.cumsum(size_bytes, dtype=np.int64)
        taken, n = 0, table.num_rows
        while taken < n:
            before = int(cum[taken - 1]) if taken else 0
            # The first row at which the part reaches part_bytes, and the row that fills the group.
            full_part = int(np.searchsorted(cum, before + self.part_bytes - self.part_text_bytes, side="left"))
            end = min(n, full_part + 1, taken + ROW_GROUP_RECORDS - self.buffered())
            self.tables.append(table.slice(taken, end - taken))
            added = int(cum[end - 1]) - before
            self.count += end - taken
            self.text_bytes += added
            self.part_text_bytes += added
            taken = end
            if self.buffered() >= ROW_GROUP_RECORDS or self.part_text_bytes >= self.part_bytes:
                closed = len(self.closed)
                self.flush()
                if len(self.closed) > closed:
                    break
        return taken

    def flush(self) -> None:
        if self.tables or self.rows:
            if self.writer is None:
                self._open_part()
            assert self.writer is not None
            if self.rows:
                self.tables.append(pa.Table.from_pylist(self.rows, schema=self.schema))
            # One chunk per column, as from_pylist gives: the bytes then do not depend on how
            # the rows arrived.
            self.writer.write_table(pa.concat_tables(self.tables).combine_chunks())
            self.tables, self.rows = [], []
        if self.writer is not None and self.part_text_bytes >= self.part_bytes:
            self._close_part()

    def _close_part(self) -> None:
        assert self.writer is not None
        self.writer.close()
        self.writer = None
        self.closed.append(f"part_{self.part_index:05d}.parquet")
        # Reset on close, not on open: a part opens lazily at its first flush, after its first
        # rows were already counted towards it.
        self.part_text_bytes = 0

    def close(self) -> None:
        self.flush()
        if self.writer is None and self.part_index < 0:
            self._open_part()  # an empty split still gets one (empty) part, so readers need no special case
        if self.writer is not None:
            self._close_part()


def _record_bytes(record: dict[str, Any]) -> int:
    if "text" in record:
        return len(record["text"].encode("utf-8"))
    if "messages" in record:
        return sum(len(p["text"].encode("utf-8")) for m in record["messages"] for p in m["content"])
    return len(record["question"].encode("utf-8")) + len(record["answer"].encode("utf-8"))


def documents_ok(table: pa.Table) -> np.ndarray:
    """Per row of a document table, True when `validate_record` surely keeps it: a string `text`
    holding a printable ASCII character, so it is neither missing nor empty after `str.strip`.
    False rows (no text, blank, or non-ASCII text only) need `SnapshotWriter.check`, row by row."""
    text = table.column("text")
    if not (pa.types.is_string(text.type) or pa.types.is_large_string(text.type)):
        return np.zeros(table.num_rows, dtype=bool)
    return pc.fill_null(pc.match_substring_regex(text, "[!-~]"), False).to_numpy(zero_copy_only=False)


def document_lines(table: pa.Table) -> bytes:
    """The canonical JSON lines (lockstep.core.io.canonical_json) of the rows of a document table of
    string fields, concatenated. Each column is escaped in one buffer (parity.json_string_literals);
    a table holding a NUL or rarer control character takes json's own path, row by row."""
    n = table.num_rows
    if n == 0:
        return b""
    names = sorted(table.schema.names)
    literals = []
    for name in names:
        col = table.column(name).combine_chunks()
        joined = pc.binary_join(pa.ListArray.from_arrays(pa.array([0, n], pa.int32()), pc.fill_null(col, "")), "\x00")
        found = json_string_literals(joined[0].as_buffer().to_pybytes(), n)
        if found is None:
            return "".join(canonical_json(r) for r in table.to_pylist()).encode("utf-8")
        valid = col.is_valid().to_numpy(zero_copy_only=False)
        literals.append([v if ok else b"null" for v, ok in zip(found, valid.tolist(), strict=True)])
    keys = [("{" if i == 0 else ",").encode() + json.dumps(name).encode() + b":" for i, name in enumerate(names)]
    return b"".join(
        b"".join(k + v for k, v in zip(keys, row, strict=True)) + b"}\n" for row in zip(*literals, strict=True)
    )


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
            raise ValueError(f"artifact_records={artifact_records!r} must be an integer >= 0 (records per split kept "
                             f"in {SNAPSHOT_FILE})")
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
            raise BadRecordError(
                f"{where}: {reason} (fix the record, or set strict: false to skip and count bad records)"
            )
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

    def add_documents(self, split: str, table: pa.Table) -> int:
        """Append document rows that `documents_ok` or `check` passed, as a table in this
        snapshot's schema, to `split`: the same parts, row groups and parity artifact as `add`
        row by row, with no Python object per row. Stops right after a row that closes a part
        file (so that a resumable caller can save its state there) and returns the rows taken;
        the caller passes the rest again."""
        if split not in self.splits:
            raise ValueError(f"split {split!r} must be one of {SPLITS}")
        if self.kind != "document" or not table.schema.equals(self.schema):
            raise ValueError(f"add_documents takes a table in the document schema {self.schema}, got {table.schema} "
                             f"for a {self.kind} snapshot")
        taken = self.splits[split].add_table(
            table, pc.binary_length(table.column("text")).to_numpy(zero_copy_only=False)
        )
        done = table.slice(0, taken)
        self.snapshot.add_lines(
            split, document_lines(done), done.slice(0, self.snapshot.wanted(split)).to_pylist(), taken
        )
        return taken

    def count(self, split: str) -> int:
        return self.splits[split].count

    def text_bytes(self, split: str) -> int:
        return self.splits[split].text_bytes

    def parts_closed(self) -> int:
        """Finished part files over both splits: a caller that keeps resume state saves it when
        this grows, since only then is everything written so far in finished files."""
        return sum(len(w.closed) for w in self.splits.values())

    def finish_split(self, split: str) -> None:
        """Close `split`'s last part now (no record may follow), so that its data is in finished
        files before the other split is written. The files are the same as closing at the end."""
        self.splits[split].close()

    def state(self) -> dict[str, Any]:
        """Everything `restore` needs to carry on after the last finished part: per split the
        finished parts (name, sha256), counts and text bytes, and the bad-record tallies. Only
        valid between parts, when no split holds buffered rows or an open part file."""
        out: dict[str, Any] = {
            "splits": {},
            "skipped": self.skipped,
            "bad_examples": self.bad_examples,
            "last_bad": self.last_bad,
        }
        for split, w in self.splits.items():
            assert w.writer is None and not w.buffered(), f"state() taken with {split} part {w.part_index} still open"
            out["splits"][split] = {
                "parts": {name: sha256_file(w.dir / name) for name in w.closed},
                "count": w.count,
                "text_bytes": w.text_bytes,
            }
        return out

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state` (from `state()` of an earlier writer on the same folder): check
        the finished parts against their sha256, delete any other part file (the one being written
        when the earlier process stopped), and replay the finished parts' records into the parity
        artifact's running hash, so that the result equals one uninterrupted write."""
        for split, w in self.splits.items():
            saved = state["splits"][split]
            for name, digest in saved["parts"].items():
                if not (w.dir / name).is_file() or sha256_file(w.dir / name) != digest:
                    raise SnapshotError(f"{w.dir / name} is missing or does not match the resume state; "
                                        f"delete the resume folder {self.root.parent} to fetch from zero")
            for extra in sorted(set(p.name for p in w.dir.glob("*.parquet")) - set(saved["parts"])):
                (w.dir / extra).unlink()
            w.closed = list(saved["parts"])
            w.part_index = len(w.closed) - 1
            w.count, w.text_bytes = int(saved["count"]), int(saved["text_bytes"])
            for name in w.closed:
                pf = pq.ParquetFile(w.dir / name)
                for batch in pf.iter_batches(batch_size=ROW_GROUP_RECORDS, use_threads=False):
                    for record in batch.to_pylist():
                        self.snapshot.add(split, record)
        self.skipped = int(state["skipped"])
        self.bad_examples = list(state["bad_examples"])
        self.last_bad = state["last_bad"]

    def abort(self) -> None:
        """Close the open parquet files without finishing the snapshot (no dataset_snapshot.json,
        no meta.json), so the caller can delete the folder: no handle is left writing into it."""
        for w in self.splits.values():
            if w.writer is not None:
                w.writer.close()
                w.writer = None
            w.tables, w.rows = [], []

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
        raise SnapshotError(f"{snapshot_dir} has no meta.json, so it is not a finished snapshot; "
                            f"run `dvc repro fetch@{snapshot_dir.name}`")
    meta = read_json(path, what="snapshot meta")
    if meta.get("kind") == BUNDLE_KIND:
        raise SnapshotError(
            f"{snapshot_dir} is an eval bundle (CORE tasks kept as files), not a snapshot of records: it is read "
            f"by the eval stage through `eval.core_tasks: raw:{snapshot_dir.name}`; take it out of the tokenizer, "
            "cache or training params that name it"
        )
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


def close_bundle(root: str | Path, **meta_fields: Any) -> dict[str, Any]:
    """Finish a file-bundle snapshot whose files were written under `root/BUNDLE_DIR`: hash every
    file and write meta.json last (`kind` BUNDLE_KIND, `files`: relative path -> sha256, then
    `meta_fields`). `root` should be an `atomic_dir` work folder. Returns the meta dict."""
    root = Path(root)
    files = {p.relative_to(root).as_posix(): sha256_file(p)
             for p in sorted((root / BUNDLE_DIR).rglob("*")) if p.is_file()}
    if not files:
        raise SnapshotError(f"{root / BUNDLE_DIR} holds no file; nothing to publish")
    meta = {"format_version": FORMAT_VERSION, "kind": BUNDLE_KIND, "files": files, **meta_fields}
    write_json_atomic(root / "meta.json", meta)
    return meta


def open_bundle(snapshot_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    """The folder of a file-bundle snapshot's files and its meta.json, after checking every file
    listed there against its sha256: a damaged or half-written bundle fails here, naming the file
    and the stage to rerun, instead of feeding an evaluation."""
    snapshot_dir = Path(snapshot_dir)
    path = snapshot_dir / "meta.json"
    rerun = f"run `dvc repro --force fetch@{snapshot_dir.name}`"
    if not path.is_file():
        raise SnapshotError(f"{snapshot_dir} has no meta.json, so it is not a finished snapshot; {rerun}")
    meta = read_json(path, what="snapshot meta")
    if meta.get("kind") != BUNDLE_KIND or not isinstance(meta.get("files"), dict):
        raise SnapshotError(
            f"{snapshot_dir} is a snapshot of {meta.get('kind')!r} records, not an eval bundle; point "
            "`eval.core_tasks` at the fetch entry whose source is `dclm_core`"
        )
    for name, digest in sorted(meta["files"].items()):
        f = snapshot_dir / name
        if not f.is_file() or sha256_file(f) != digest:
            raise SnapshotError(f"{f} listed in {path} is missing or does not match its sha256; {rerun}")
    return snapshot_dir / BUNDLE_DIR, meta
