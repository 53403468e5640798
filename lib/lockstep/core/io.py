"""Atomic file writes (and removal of what an interrupted one left behind), the one canonical
JSON serialization, sha256 helpers, and the one-line error for a write refused for want of room.
Knows nothing about what the files mean."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import resource
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

_HASH_CHUNK_BYTES = 1 << 20
log = logging.getLogger(__name__)


def canonical_json(obj: Any) -> str:
    """The one JSON serialization used for every artifact we write: UTF-8 text, non-ASCII kept,
    sorted keys, fixed separators, trailing newline. Two runs that produce equal objects produce
    equal bytes, so artifacts can be compared by sha256."""
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":"), indent=None) + "\n"


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[BinaryIO]:
    """Open a temp file beside `path`; on clean exit fsync it and `os.replace` it onto `path`.
    A crash leaves the old file or the new one, never half of one."""
    path = Path(path)
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open mode must be 'wb' or 'w', got {mode!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8", "newline": "\n"} if mode == "w" else {})) as f:
            yield f  # type: ignore[misc]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write `obj` with `canonical_json`, not atomically: for files inside an `atomic_dir` temp
    folder, which is fsynced and published whole."""
    Path(path).write_bytes(canonical_json(obj).encode("utf-8"))


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """Write `obj` with `canonical_json`, atomically."""
    write_bytes_atomic(path, canonical_json(obj).encode("utf-8"))


def read_json(path: str | os.PathLike[str], *, what: str = "JSON file") -> Any:
    """Read a JSON file, raising a ValueError that names the file when it is missing or broken."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} is missing; re-run the stage that writes it") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 ({e}); delete it and re-run the stage that writes it") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{what} {path} is not valid JSON ({e}); delete it and re-run the stage that writes it"
        ) from None


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def sha256_of_manifest(files: dict[str, str]) -> str:
    """One hash for a set of files, from their names and per-file sha256 (order-independent)."""
    return sha256_bytes("".join(f"{name}\t{digest}\n" for name, digest in sorted(files.items())).encode("utf-8"))


def _stale_work_pattern(name: str) -> re.Pattern[str]:
    # Exactly the names atomic_dir gives its own work folders for an output called `name`:
    # tempfile.mkdtemp's `.<name>.<8 random chars>.tmp` and the `.<name>.old-<pid>` that holds
    # the previous result during the swap. Another output's folders never match: after
    # `.<name>.` only the fixed-length random part and `.tmp` (or `old-<digits>`) may follow.
    return re.compile(rf"\.{re.escape(name)}\.(?:[a-z0-9_]{{8}}\.tmp|old-[0-9]+)")


def remove_stale_work(out_dir: str | os.PathLike[str]) -> list[Path]:
    """Remove the work folders that an earlier `atomic_dir(out_dir)` left beside `out_dir` when
    its process was killed before it could clean up; returns what was removed. Only folders named
    exactly as atomic_dir names them for this output are touched, so a stage may call this
    at start whatever else lives beside its output."""
    out_dir = Path(out_dir)
    if not out_dir.parent.is_dir():
        return []
    pattern = _stale_work_pattern(out_dir.name)
    removed = []
    for p in sorted(out_dir.parent.iterdir()):
        if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
            removed.append(p)
    return removed


@contextlib.contextmanager
def atomic_dir(out_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temp folder beside `out_dir`; on clean exit it replaces `out_dir` whole.
    On any error the temp folder is removed and `out_dir` is left as it was, so a half-written
    output is never published under the final name. Work folders that a killed earlier write of
    the same output left behind are removed first (`remove_stale_work`): one writer per output
    at a time, as DVC runs a stage."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for p in remove_stale_work(out_dir):
        log.info("removed %s, left by an interrupted earlier write of %s", p, out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        yield tmp
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        old = None
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        fsync_dir(out_dir.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class NoRoomError(RuntimeError):
    """A write refused for want of room (`no_room_is`), for writers without an error of their own
    (the training and RL stages); its message says what to free or raise."""


def _no_room(e: OSError, doing: str, folder: Path) -> tuple[str, str] | None:
    """(what happened, how to make room) when `e` refused a write for want of room, else None."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"no space left to {doing} ({os.strerror(e.errno)})",
                f"Free space on the disk holding {folder}, or point {folder} at a disk with room (a symlink will do)")
    if e.errno != errno.EFBIG:
        return None
    limit_bytes = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit_bytes != resource.RLIM_INFINITY:
        return (f"a file reached this process's size limit of {limit_bytes} bytes (RLIMIT_FSIZE) trying to {doing} "
                f"({os.strerror(e.errno)})", "Raise the limit (`ulimit -f unlimited` in the shell that runs the stage)")
    return (f"a file grew past what the file system holding {folder} allows trying to {doing} ({os.strerror(e.errno)})",
            f"Point {folder} at a file system that holds larger files (a symlink will do)")


@contextlib.contextmanager
def no_room_is(error: Callable[[str], Exception], *, doing: str, folder: Path, outcome: str,
               rerun: str) -> Iterator[None]:
    """A write in the block refused for want of room, as `error` with one line that says what
    happened, `outcome` (what is left), how to make room and `rerun`: a full disk or quota
    (ENOSPC, EDQUOT) names the disk holding `folder`; a file over this process's size limit
    (EFBIG under RLIMIT_FSIZE, `ulimit -f`) names the limit; a file over the largest the file
    system holds (EFBIG without a limit) names `folder` too. Any other OSError passes through.
    Entered outside the atomic writes, so by the time it speaks their work files are gone.

    Python starts with SIGXFSZ ignored, so a write past RLIMIT_FSIZE fails with EFBIG instead of
    killing the stage with no word of why; subprocess gives the programs it starts SIGXFSZ back
    (restore_signals), so the code sandbox's file limit still ends its program."""
    try:
        yield
    except OSError as e:
        room = _no_room(e, doing, folder)
        if room is None:
            raise
        raise error(f"{room[0]}; {outcome}. {room[1]}, and {rerun}") from None
