"""Helpers shared by the source loaders: their error types, seeded splits, JSON-lines reading
with line numbers, local-file fingerprints, parquet streams as rows (through `datasets`) or as
Arrow tables (through pyarrow), and bounded retries for network reads. No loader logic lives here."""

from __future__ import annotations

import gzip
import json
import logging
import re
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from lockstep.core.io import sha256_file, sha256_of_manifest
from lockstep.core.seeds import stream_generator
from lockstep.data.snapshot import SnapshotWriter, split_sizes

T = TypeVar("T")
log = logging.getLogger("lockstep.sources")
STREAM_BATCH_ROWS = 1000  # rows per batch of a stream (converted to Python at a time by dataset_rows)


class SourceUnavailableError(RuntimeError):
    """A remote source could not be read after the allowed retries."""


class SourceFormatError(ValueError):
    """Source input is not in the source's format: a file none of whose rows is usable, or a
    source that gives no records at all. The message names the file and what was expected."""


class SplitLayoutError(ValueError):
    """Local files whose train/val split cannot be told from their names and folders, with no
    `val_frac` to pool them; the message lists the files found and both fixes."""


def generator(seed: int, stream: int = 0) -> torch.Generator:
    """A torch.Generator for one purpose of one source; `stream` keeps purposes independent."""
    return stream_generator(seed, stream)


class Draw:
    """Seeded choices from one torch.Generator."""

    def __init__(self, g: torch.Generator):
        self.g = g

    def int(self, lo: int, hi: int) -> int:
        """Uniform in [lo, hi]."""
        return lo + int(torch.randint(hi - lo + 1, (1,), generator=self.g).item())

    def pick(self, seq: Sequence[T]) -> T:
        return seq[self.int(0, len(seq) - 1)]

    def uniform(self) -> float:
        """Uniform in [0, 1)."""
        return float(torch.rand((), generator=self.g).item())


def val_indices(n: int, val_frac: float, seed: int) -> set[int]:
    """Which of `n` examples (by position) form the val split: a seeded random subset."""
    n_val = split_sizes(n, val_frac)
    if n_val == 0:
        return set()
    perm = torch.randperm(n, generator=generator(seed, stream=1))
    return set(perm[:n_val].tolist())


def write_split(sink: SnapshotWriter, items: Sequence[tuple[str, dict[str, Any]]], val_frac: float, seed: int) -> None:
    """Write already-validated (where, record) pairs, val chosen by a seeded split by example;
    each split keeps the source order."""
    val = val_indices(len(items), val_frac, seed)
    for i, (where, record) in enumerate(items):
        sink.add("val" if i in val else "train", record, where)


def local_files(path: str | Path, suffixes: Sequence[str], *, what: str) -> list[Path]:
    """`path` itself when it is a file, else the files under it with one of `suffixes`, sorted.
    Dot-named files and folders (a download tool's `.cache/`, an editor's swap files) are left out."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(
            f"{what}: {p} does not exist; point `path` at a file or a folder of {'/'.join(suffixes)} files"
        )
    files = sorted(
        f
        for f in p.rglob("*")
        if f.is_file()
        and f.name.endswith(tuple(suffixes))
        and not any(part.startswith(".") for part in f.relative_to(p).parts)
    )
    if not files:
        raise FileNotFoundError(f"{what}: no {'/'.join(suffixes)} files under {p}")
    return files


def local_root(path: str | Path) -> Path:
    """The folder that names of `local_files(path, ...)` are taken relative to: `path` itself, or
    the folder of a single file."""
    p = Path(path)
    return p if p.is_dir() else p.parent


def files_revision(files: Iterable[Path]) -> tuple[str, dict[str, str]]:
    """(one sha256 for the set, sha256 per file) of local input files."""
    per_file = {f.as_posix(): sha256_file(f) for f in files}
    return "sha256:" + sha256_of_manifest(per_file), per_file


def read_jsonl(path: Path, sink: SnapshotWriter) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`file:line`, object) for each line of a JSON-lines file, gzipped when its name ends in
    `.gz` (as OpenAssistant's exports ship); lines that are not UTF-8, not JSON or not an object
    are reported to `sink` as bad records."""
    gzipped = path.name.endswith(".gz")
    with gzip.open(path, "rb") if gzipped else open(path, "rb") as f:
        for lineno, raw in enumerate(_gzip_checked(f, path) if gzipped else f, start=1):
            where = f"{path}:{lineno}"
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                sink.bad(where, f"invalid UTF-8 ({e.reason} at byte {e.start})")
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                sink.bad(where, f"invalid JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(obj, dict):
                sink.bad(where, f"expected a JSON object, got {type(obj).__name__}")
                continue
            yield where, obj


def _gzip_checked(lines: Iterable[bytes], path: Path) -> Iterator[bytes]:
    """The lines of a gzip stream; a damaged or truncated one fails naming the file."""
    try:
        yield from lines
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise SourceFormatError(
            f"{path}: not a readable gzip file ({e}); download it again or unpack it to .jsonl"
        ) from None


def read_text(path: Path, sink: SnapshotWriter) -> str | None:
    """A file's text (UTF-8 BOM removed, newlines normalised to LF), or None after reporting it."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        sink.bad(str(path), f"invalid UTF-8 ({e.reason} at byte {e.start})")
        return None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _retryable() -> tuple[type[BaseException], ...]:
    kinds: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        import requests

        kinds += [
            requests.exceptions.ConnectionError,
            requests.exceptions.Timeout,
            requests.exceptions.ChunkedEncodingError,
        ]
    except ImportError:
        pass
    try:
        import httpx

        kinds.append(httpx.TransportError)
    except ImportError:
        pass
    try:
        import aiohttp

        kinds.append(aiohttp.ClientError)
    except ImportError:
        pass
    return tuple(kinds)


def with_retries(
    fn: Callable[[], T], *, what: str, max_retries: int, backoff_s: float, sleep: Callable[[float], None] = time.sleep
) -> T:
    """fn() with up to `max_retries` retries on network errors, waiting backoff_s * 2**k between."""
    kinds = _retryable()
    for attempt in range(max_retries + 1):
        try:
            return fn()
        except kinds as e:
            if attempt == max_retries:
                raise SourceUnavailableError(
                    f"{what}: network error after {max_retries} retries ({type(e).__name__}: {e}); "
                    "check the connection, or set `path` to local files in the same format"
                ) from e
            wait_s = backoff_s * 2**attempt
            log.warning("%s: %s: %s; retry %d/%d in %.1fs", what, type(e).__name__, e, attempt + 1, max_retries, wait_s)
            sleep(wait_s)
    raise AssertionError("unreachable")


def retrying_stream(
    make_iter: Callable[[], Iterable[T]],
    *,
    what: str,
    max_retries: int,
    backoff_s: float,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[T]:
    """Items of a deterministic stream, reopening it after a network error and skipping the items
    already yielded, so the result is the same as an uninterrupted read. Up to `max_retries`
    consecutive failures (the count resets once new items arrive), then SourceUnavailableError."""
    kinds = _retryable()
    yielded = 0
    failures = 0
    while True:
        position = 0
        try:
            for item in make_iter():
                position += 1
                if position <= yielded:
                    continue
                yielded += 1
                failures = 0
                yield item
            return
        except kinds as e:
            if failures == max_retries:
                raise SourceUnavailableError(
                    f"{what}: stream failed {failures + 1} times in a row at item {yielded} "
                    f"({type(e).__name__}: {e}); check the connection, or set `path` to local files in the same format"
                ) from e
            wait_s = backoff_s * 2**failures
            failures += 1
            log.warning(
                "%s: %s at item %d; reopening (retry %d/%d) in %.1fs", what, e, yielded, failures, max_retries, wait_s
            )
            sleep(wait_s)


def resolve_hub_revision(repo_id: str, revision: str, *, max_retries: int, backoff_s: float) -> str:
    """The commit sha of a hub dataset revision, so the snapshot records (and loads) a fixed one."""
    from huggingface_hub import HfApi  # heavy, and only the hub path needs it

    info = with_retries(
        lambda: HfApi().dataset_info(repo_id, revision=revision),
        what=f"hub dataset {repo_id}@{revision}",
        max_retries=max_retries,
        backoff_s=backoff_s,
    )
    return str(info.sha)


def dataset_rows(
    *,
    hub_id: str,
    hub_config: str | None,
    hub_split: str,
    revision: str,
    files: Sequence[Path | str] | None,
    max_retries: int,
    backoff_s: float,
) -> Iterator[dict[str, Any]]:
    """Rows of a hub dataset split, or of local parquet `files` in the same layout (or `hf://`
    addresses of a hub dataset's parquet files), always through `datasets.load_dataset(...,
    streaming=True)`: nothing is materialised and nothing is written to a hidden cache."""

    def open_stream() -> Iterable[dict[str, Any]]:
        from datasets import load_dataset  # heavy (about 2 s): loaded only when a stream opens

        if files is not None:
            ds = load_dataset("parquet", data_files=[str(f) for f in files], split="train", streaming=True)
        else:
            ds = load_dataset(hub_id, hub_config, split=hub_split, revision=revision, streaming=True)
        return _rows_by_batch(ds)

    what = (
        f"{'/'.join(str(f) for f in files[:1]) + ('...' if len(files) > 1 else '')}"
        if files
        else f"hub {hub_id}@{revision} {hub_split}"
    )
    return retrying_stream(open_stream, what=what, max_retries=max_retries, backoff_s=backoff_s)


def parquet_tables(files: Sequence[Path | str], *, max_retries: int, backoff_s: float) -> Iterator[pa.Table]:
    """The rows of parquet `files` (local paths, or `hf://` addresses of a hub dataset's files) as
    Arrow tables of up to STREAM_BATCH_ROWS rows, read by pyarrow alone: the rows `dataset_rows`
    gives for the same files (tested), for readers that validate and write whole batches, without
    `datasets`' start-up (about 1 s to import, 20 ms per file opened). Same retries."""

    def open_stream() -> Iterator[pa.Table]:
        for f in files:
            with _open_binary(str(f)) as fh:
                for batch in pq.ParquetFile(fh).iter_batches(batch_size=STREAM_BATCH_ROWS, use_threads=False):
                    yield pa.Table.from_batches([batch])

    return retrying_stream(open_stream, what="/".join(str(f) for f in files[:1]) + ("..." if len(files) > 1 else ""),
                           max_retries=max_retries, backoff_s=backoff_s)


def _open_binary(ref: str) -> Any:
    if ref.startswith("hf://"):
        from huggingface_hub import HfFileSystem  # heavy, and only the hub path needs it

        return HfFileSystem().open(ref, "rb")
    return open(ref, "rb")


def _rows_by_batch(ds: Any) -> Iterator[dict[str, Any]]:
    """The rows of a `datasets` IterableDataset, converted a batch at a time: its row iterator
    formats each row on its own (0.68 s of a 1.7 s fetch of 20 MB of local parquet under
    cProfile, against 0.33 s by batches)."""
    for batch in ds.iter(batch_size=STREAM_BATCH_ROWS):
        names = list(batch)
        yield from (dict(zip(names, values)) for values in zip(*batch.values()))


def hub_revision(hub_id: str, revision: str, *, max_retries: int, backoff_s: float) -> str:
    """`revision` itself when it already is a commit sha, else the sha it resolves to now."""
    if re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    return resolve_hub_revision(hub_id, revision, max_retries=max_retries, backoff_s=backoff_s)
