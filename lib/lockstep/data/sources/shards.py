"""Shard-level reading of large sources, and the resume folder of a long fetch. A source made of
many data files (FineWeb-Edu's parquet shards) is read one shard at a time in a seeded order,
each shard shuffled in bounded windows (of rows, or of Arrow tables for batch readers), so the
stream is a pure function of (files, seed) that can be restarted at any shard and row. The
resume folder holds the snapshot being written and a state.json saved after each finished part;
it is keyed by everything that decides the output, so that state made for other params is never
reused. No source format lives here."""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import torch

from lockstep.core.io import atomic_dir, canonical_json, read_json, write_json_atomic
from lockstep.data.snapshot import SnapshotWriter

T = TypeVar("T")
log = logging.getLogger("lockstep.sources")

# Bump when the resume state's layout or the meaning of its position changes: state written by
# another version is then stale and never read.
RESUME_FORMAT = 1
STATE_FILE = "state.json"
WORK_DIR = "snapshot"


def shard_order(n_shards: int, generator: torch.Generator) -> list[int]:
    """A seeded permutation of shard indices (into the shards sorted by name)."""
    return torch.randperm(n_shards, generator=generator).tolist()


def window_shuffle(rows: Iterable[T], window: int, generator: torch.Generator) -> Iterator[tuple[int, T]]:
    """(index in `rows`, row) for each row, shuffled within consecutive windows of `window` rows:
    each window is read whole, permuted with `generator`, and emitted. Memory is one window. Unlike
    a replacement buffer, the position after k emitted rows depends only on k, so a reader can
    resume a shard by replaying it and skipping k rows."""
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    buf: list[tuple[int, T]] = []
    for i, row in enumerate(rows):
        buf.append((i, row))
        if len(buf) == window:
            yield from (buf[j] for j in torch.randperm(window, generator=generator).tolist())
            buf = []
    if buf:
        yield from (buf[j] for j in torch.randperm(len(buf), generator=generator).tolist())


def window_shuffle_tables(
    tables: Iterable[pa.Table], window: int, generator: torch.Generator
) -> Iterator[tuple[np.ndarray, pa.Table]]:
    """`window_shuffle` for a stream of Arrow tables: for each window, (index in the stream of
    each row, int64, in emitted order; the window's rows in that order as one table). The same
    generator draws give the same order as `window_shuffle` over the same rows (tested)."""
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    held: list[pa.Table] = []
    n_held = start = 0
    for table in tables:
        held.append(table)
        n_held += table.num_rows
        while n_held >= window:
            whole = pa.concat_tables(held)
            yield _permuted(whole.slice(0, window), start, torch.randperm(window, generator=generator))
            held, n_held, start = [whole.slice(window)], n_held - window, start + window
    if n_held:
        yield _permuted(pa.concat_tables(held), start, torch.randperm(n_held, generator=generator))


def _permuted(table: pa.Table, start: int, perm: torch.Tensor) -> tuple[np.ndarray, pa.Table]:
    order = perm.numpy().astype(np.int64)
    return start + order, table.take(pa.array(order))


class ResumeFolder:
    """The resume folder of one fetch (e.g. `data/partial/fetch/<name>/`, outside the DVC output,
    which `dvc repro` deletes before running the stage): `snapshot/` is the snapshot being
    written, `state.json` what a later run needs to carry on after its last finished part.

    `begin` is called once the source knows everything that decides its output (`key_fields`:
    config, seed, resolved revision, the shard list, format versions); it returns the saved
    position when the state was made for the same key, else wipes the folder and returns None,
    logging why. `save` stores a position with the writer's state; `publish` moves the finished
    snapshot to its output folder atomically and removes the resume folder."""

    def __init__(self, directory: str | Path, *, base_fields: dict[str, Any]) -> None:
        self.dir = Path(directory)
        self.work = self.dir / WORK_DIR
        self.base_fields = {"resume_format": RESUME_FORMAT, **base_fields}
        self.key: str | None = None
        self.key_fields: dict[str, Any] = {}
        self.saves = 0
        self.resumed = False
        self.work.mkdir(parents=True, exist_ok=True)

    def begin(self, key_fields: dict[str, Any], sink: SnapshotWriter) -> dict[str, Any] | None:
        self.key_fields = {**self.base_fields, **key_fields}
        self.key = "sha256:" + hashlib.sha256(canonical_json(self.key_fields).encode("utf-8")).hexdigest()
        path = self.dir / STATE_FILE
        state = read_json(path, what="fetch resume state") if path.is_file() else None
        if state is not None and state.get("key") == self.key:
            sink.restore(state["sink"])
            self.resumed = True
            parts = {s: len(v["parts"]) for s, v in state["sink"]["splits"].items()}
            log.info("resuming from %s: %d train and %d val part(s) kept, at shard %d row %d of the stream",
                     self.dir, parts["train"], parts["val"], state["position"]["shard"], state["position"]["emitted"])
            return dict(state["position"])
        if state is not None:
            old = state.get("key_fields") or {}
            changed = sorted(k for k in set(old) | set(self.key_fields) if old.get(k) != self.key_fields.get(k))
            log.warning("resume state in %s was made for a different %s; not reusing it, starting from zero",
                        self.dir, ", ".join(changed) or "key")
        elif any(self.work.rglob("*.parquet")):
            log.warning("%s holds parts but no resume state; starting from zero", self.work)
        for p in sorted(self.work.rglob("*.parquet")):
            p.unlink()
        path.unlink(missing_ok=True)
        return None

    def save(self, sink: SnapshotWriter, position: dict[str, Any]) -> None:
        """Store `position` (the source's own counters, JSON) with the writer's state, atomically:
        a kill at any moment leaves the previous state or this one."""
        assert self.key is not None, "begin() first"
        write_json_atomic(
            self.dir / STATE_FILE,
            {"key": self.key, "key_fields": self.key_fields, "sink": sink.state(), "position": position},
        )
        self.saves += 1

    def publish(self, out_dir: str | Path) -> None:
        """Move the finished snapshot to `out_dir` (replacing it whole) and remove this folder.
        The state goes first: a kill while the files move then leaves a folder without state,
        which the next fetch wipes, never a state that names parts already moved away."""
        (self.dir / STATE_FILE).unlink(missing_ok=True)
        with atomic_dir(out_dir) as tmp:
            for p in sorted(self.work.iterdir()):
                shutil.move(str(p), str(tmp / p.name))
        shutil.rmtree(self.dir)
