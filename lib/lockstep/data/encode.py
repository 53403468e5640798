"""Documents to BOS-joined token arrays: the checked narrowing of ids to the token dtype, the join,
and a pool of worker processes that each load the tokenizer from its files (never a pickled
tokenizer object) and encode batches sent to them. Knows nothing of shards, shuffles or caches;
lockstep.data.cache_build drives it."""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from lockstep.data.cache import CacheError
from lockstep.tokenizer import Tokenizer, load_tokenizer


def to_token_array(ids: np.ndarray, vocab_size: int, dtype: np.dtype, where: str) -> np.ndarray:
    """Checked narrowing: an id outside [0, vocab_size) is an error, never a wrap-around."""
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise CacheError(
                f"{where}: token id {bad} is outside the vocabulary [0, {vocab_size}); "
                "the tokenizer and its reported vocab size disagree"
            )
    return ids.astype(dtype, copy=False)


def _bos_join(ids_lists: list[list[int]], bos_id: int, vocab_size: int, dtype: np.dtype, where: str) -> np.ndarray:
    """Concatenate documents, each prefixed with BOS, straight into the token dtype: one pass over
    the ids, no int64 copy and no insertion. Returns tokens (N,) of `dtype`."""
    bos = (bos_id,)
    n_tokens = len(ids_lists) + sum(map(len, ids_lists))
    parts = itertools.chain.from_iterable(zip(itertools.repeat(bos), ids_lists))
    try:
        # numpy refuses a Python int that does not fit the dtype, so negatives and ids past the
        # dtype fail here; ids that fit the dtype but not the vocabulary fail the max check.
        flat = np.fromiter(itertools.chain.from_iterable(parts), dtype=dtype, count=n_tokens)
    except OverflowError:
        wide = np.fromiter(itertools.chain.from_iterable(ids_lists), dtype=object)
        return to_token_array(wide, vocab_size, dtype, where)  # raises, naming the id
    if flat.size and int(flat.max()) >= vocab_size:
        return to_token_array(flat, vocab_size, dtype, where)  # raises, naming the id
    return flat


def encode_join(
    texts: list[str], tokenizer: Tokenizer, bos_id: int, vocab_size: int, dtype: np.dtype, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens (N,) of `dtype`: each text's ids after a BOS, document lengths counting BOS (D,))."""
    encode_arrays = getattr(tokenizer, "encode_arrays", None)
    arrays = None
    if encode_arrays is not None:
        try:
            arrays = encode_arrays(texts)
        except OverflowError:  # an id that fits no unsigned array: the list path names it
            arrays = None
    if arrays is None:  # a tokenizer that only gives id lists
        ids_lists = tokenizer.encode(texts, num_threads=1)
        lengths = np.fromiter(map(len, ids_lists), dtype=np.int64, count=len(ids_lists)) + 1
        return _bos_join(ids_lists, bos_id, vocab_size, dtype, where), lengths
    # Ids as arrays, never as Python ints: converting int lists holds the GIL that the other
    # encoder thread needs (bench/bench_cache.py --lists runs both paths: 2.9 s by lists, 2.3 s
    # by arrays for 64 MB on a 2-core CPU).
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays)) + 1
    if not arrays:
        return np.empty(0, dtype=dtype), lengths
    parts = [part for a in arrays for part in (np.array([bos_id], dtype=np.uint32), a)]
    top = max(int(a.max()) for a in parts if a.size)
    if top >= vocab_size:
        return to_token_array(
            np.concatenate(parts, dtype=np.int64), vocab_size, dtype, where
        ), lengths  # raises, naming the id
    # every id is checked to fit, so the narrowing cast straight into the token dtype is exact
    return np.concatenate(parts, dtype=dtype, casting="unsafe"), lengths


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS and Windows have no affinity call
        return max(1, os.cpu_count() or 1)


# The tokenizer a worker process loaded in _init_worker, and what it encodes into.
_WORKER: dict[str, Any] = {}
# Forked workers on Linux: a spawned one re-imports the parent's main module (a stage imports
# torch and more) before its first batch, 8.5 s for two workers on a busy 2-core machine against
# well under 1 s forked. A worker runs only tiktoken, numpy and pickle, none of which relies on
# the parent's other threads (PyTorch's DataLoader forks its workers likewise), and
# ProcessPoolExecutor forks all of them before it starts its own thread. Elsewhere: spawn.
_START_METHOD = "fork" if sys.platform == "linux" else "spawn"


def _ready() -> bool:
    return bool(_WORKER)


def _init_worker(tokenizer_dir: str, sha256: str, bos_id: int, vocab_size: int, dtype: str) -> None:
    tok = load_tokenizer(tokenizer_dir)
    # EncodePool checked the files before starting workers; a change since then is a bug or a race.
    assert str(tok.sha256) == sha256, f"{tokenizer_dir} changed while the cache was being built"
    _WORKER.update(tokenizer=tok, bos_id=bos_id, vocab_size=vocab_size, dtype=np.dtype(dtype))


def _encode_in_worker(texts: list[str], where: str) -> tuple[np.ndarray, np.ndarray]:
    w = _WORKER
    return encode_join(texts, w["tokenizer"], w["bos_id"], w["vocab_size"], w["dtype"], where)


class EncodePool:
    """`num_workers` processes, each with its own tokenizer loaded from `tokenizer_dir`: batches
    go out as lists of str and come back as (tokens (N,) of `dtype`, document lengths counting
    BOS (D,)) arrays, in submission order. Separate processes sidestep the GIL that the encoder
    threads share for everything outside tiktoken's core (splitting batches, joining ids). The
    workers load the tokenizer from its files, whatever they inherit. The files must hash to
    `tokenizer.sha256` (checked here, before any worker starts), so both paths encode with the
    same tokenizer."""

    def __init__(self, tokenizer_dir: str | os.PathLike[str], tokenizer: Tokenizer, *, num_workers: int, bos_id: int,
                 vocab_size: int, dtype: np.dtype) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise CacheError(f"num_workers={num_workers!r} must be an integer >= 1 (tokenizer worker processes)")
        if not Path(tokenizer_dir).is_dir():
            raise FileNotFoundError(
                f"tokenizer folder {tokenizer_dir} does not exist; pass the folder the tokenizer was loaded from"
            )
        on_disk = str(load_tokenizer(tokenizer_dir).sha256)
        if on_disk != str(tokenizer.sha256):
            raise CacheError(
                f"the tokenizer in {tokenizer_dir} (sha256 {on_disk[:12]}...) is not the one building this cache "
                f"({str(tokenizer.sha256)[:12]}...); pass the folder the tokenizer in use was loaded from"
            )
        self.num_workers = num_workers
        self.pool = ProcessPoolExecutor(
            max_workers=num_workers,
            mp_context=multiprocessing.get_context(_START_METHOD),
            initializer=_init_worker,
            initargs=(str(tokenizer_dir), str(tokenizer.sha256), bos_id, vocab_size, np.dtype(dtype).str),
        )
        # Start the workers now: before the caller's reading and hashing begin, and so that a
        # worker that cannot start fails here rather than at the first batch.
        self.pool.submit(_ready).result()

    def encode(self, batches: Iterable[list[str]], where: str) -> Iterator[tuple[list[str], np.ndarray, np.ndarray]]:
        """(texts, tokens, lengths) per batch, in order, keeping two batches per worker in flight
        so that no worker waits while the caller writes."""
        pending: collections.deque[tuple[list[str], Future[tuple[np.ndarray, np.ndarray]]]] = collections.deque()
        try:
            for batch in batches:
                pending.append((batch, self.pool.submit(_encode_in_worker, batch, where)))
                if len(pending) > 2 * self.num_workers:
                    texts, fut = pending.popleft()
                    yield texts, *fut.result()
            while pending:
                texts, fut = pending.popleft()
                yield texts, *fut.result()
        finally:
            for _, fut in pending:
                fut.cancel()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> EncodePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
