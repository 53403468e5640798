"""Building token caches: a deterministic streaming shuffle, tokenizing documents into
BOS-prefixed shards (on threads of this process with one tiktoken encoder each, the reference
path, or in worker processes of lockstep.data.encode, which give the same bytes), SFT conversations
into tokens + loss mask + offsets, the parity artifacts, and meta.json last, all published
atomically in the format lockstep.data.cache defines and reads, with a progress line every few
seconds. Over 400 lines: the pretrain and SFT builders share the shuffle, the shard writer, the
parity artifacts and the meta.json rules, and each half alone would import most of the other."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from lockstep.core.config import FieldError, check_range
from lockstep.core.io import atomic_dir, atomic_open, no_room_is, sha256_file, write_json_atomic
from lockstep.core.progress import Progress
from lockstep.core.seeds import stream_generator
from lockstep.data.cache import (
    DEFAULT_SHARD_BYTES,
    FORMAT_VERSION,
    SPLITS,
    CacheError,
    _shard_name,
    dtype_name,
    token_dtype,
)
from lockstep.data.encode import EncodePool, available_cores, encode_join, to_token_array
from lockstep.data.parity import MAX_SAMPLE_TOKENS, RenderedSamples, SnapshotCollector
from lockstep.data.records import as_conversation

if TYPE_CHECKING:
    from lockstep.tokenizer.base import Tokenizer

log = logging.getLogger(__name__)

_RANDOM_BLOCK = 4096
PROGRESS_INTERVAL_S = 5.0  # seconds between progress lines
# No machine Linux runs on has more CPUs than its largest build schedules (NR_CPUS = 8192 with
# x86-64 MAXSMP), so more encoding processes or threads than that is a typo, not a machine:
# refused, where a count above this machine's cores is only capped (encode_workers).
MAX_ENCODE_PARALLELISM = 8192


@dataclass(frozen=True)
class CacheConfig:
    """One `cache.<name>` params section."""

    kind: Literal["pretrain", "sft"]
    # Cap on train/val tokens written (pretrain only); applied after the streaming shuffle, the
    # last document is cut at the cap and reading stops there. null = the whole split.
    max_train_tokens: int | None = None
    max_val_tokens: int | None = None
    shard_bytes: int = DEFAULT_SHARD_BYTES  # bytes per pretrain shard (the last one may be smaller)
    shuffle_buffer: int = 8192  # documents held by the streaming shuffle (pretrain); 1 = stored order
    # SFT only: null = keep the snapshot's train/val split; a number = read only the snapshot's
    # train split and carve this fraction of it out as val (gsm8k, whose val split is the eval set).
    val_frac: float | None = None
    artifact_records: int = 8  # records / samples kept in the parity artifacts
    encode_batch_docs: int = 512  # documents per tokenizer.encode call (pretrain)
    num_threads: int = 2  # tokenizer threads of the in-process path (num_workers: 1)
    # Pretrain only: tokenizer worker processes, each loading the tokenizer from its files; null =
    # every core this process may use, 1 = encode in this process on `num_threads` threads. Every
    # value gives the same bytes.
    num_workers: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_train_tokens", "max_val_tokens"):
            if getattr(self, name) is not None:
                check_range(name, getattr(self, name), ge=0, why="tokens written to the split; null writes it whole")
        check_range("shard_bytes", self.shard_bytes, ge=1, why="bytes per pretrain shard")
        check_range("shuffle_buffer", self.shuffle_buffer, ge=1,
                    why="documents held by the streaming shuffle; 1 keeps the stored order")
        if self.val_frac is not None:
            check_range("val_frac", self.val_frac, ge=0, lt=1,
                        why="the share of train examples carved out as val; null keeps the snapshot's split")
        check_range("artifact_records", self.artifact_records, ge=0, why="records kept in the parity artifacts")
        check_range("encode_batch_docs", self.encode_batch_docs, ge=1, why="documents per encode call")
        no_machine = f"more than {MAX_ENCODE_PARALLELISM}, the most CPUs Linux schedules, is no machine's core count"
        check_range("num_threads", self.num_threads, ge=1, le=MAX_ENCODE_PARALLELISM,
                    why=f"tokenizer threads of the in-process path; {no_machine}")
        if self.num_workers is not None:
            check_range("num_workers", self.num_workers, ge=1, le=MAX_ENCODE_PARALLELISM,
                        why=f"tokenizer processes; {no_machine}, and a count above this machine's cores is capped to "
                            "them; null uses every core, 1 encodes in the stage's process")
        # Settings of the other cache kind are refused, not ignored: FieldError names the key and
        # build_config prefixes `cache.<name>.`.
        if self.kind == "pretrain" and self.val_frac is not None:
            raise FieldError("val_frac", self.val_frac, "applies to SFT caches only; remove it (pretrain keeps the "
                                                        "snapshot's split)")
        if self.kind == "sft":
            for name in ("max_train_tokens", "max_val_tokens"):
                if getattr(self, name) is not None:
                    raise FieldError(name, getattr(self, name), "applies to pretrain caches only; remove it")
            if self.num_workers is not None:
                raise FieldError("num_workers", self.num_workers, "applies to pretrain caches only (SFT rendering "
                                                                  "runs in the stage's process); remove it")


def encode_workers(requested: int | None, *, key: str = "num_workers") -> int:
    """The worker processes a pretrain build encodes in: `requested` (None: every core this
    process may use) capped at the cores available, with one log line naming `key` when capped.
    Each worker holds a tokenizer and a batch of documents, and more of them than cores only adds
    memory and start-up time: 1,000,000 once forked 1,455 processes and 11 GB in 60 s."""
    cores = available_cores()
    if requested is None:
        return cores
    if requested > cores:
        log.info("%s=%d capped at %d: this process may run on %d core(s), and more encoding processes than "
                 "cores add memory, not speed", key, requested, cores, cores)
        return cores
    return requested


def _tokenizer_identity(tokenizer: Tokenizer) -> dict[str, Any]:
    specials = tokenizer.get_special_tokens() if hasattr(tokenizer, "get_special_tokens") else {}
    return {
        "tokenizer_sha256": str(tokenizer.sha256),
        "vocab_size": int(tokenizer.get_vocab_size()),
        "special_token_ids": {str(k): int(v) for k, v in sorted(specials.items())},
    }


# ---------------------------------------------------------------------------------------------
# deterministic streaming shuffle


def _random_ints(generator: torch.Generator) -> Iterator[int]:
    # Blocks amortise the per-call cost of torch's RNG; the stream is a pure function of the seed.
    while True:
        yield from torch.randint(0, 2**62, (_RANDOM_BLOCK,), generator=generator).tolist()


def buffer_shuffle(items: Iterable[Any], buffer_size: int, generator: torch.Generator) -> Iterator[Any]:
    """Shuffle a stream with a fixed-size buffer: each incoming item replaces a uniformly drawn
    buffered one, which is emitted. Memory is `buffer_size` items; buffer_size <= 1 keeps order."""
    if buffer_size <= 1:
        yield from items
        return
    rand = _random_ints(generator)
    buf: list[Any] = []
    for item in items:
        if len(buf) < buffer_size:
            buf.append(item)
            continue
        j = next(rand) % buffer_size
        yield buf[j]
        buf[j] = item
    # Drain in a random order: a Fisher-Yates pass over what is left.
    for i in range(len(buf) - 1, 0, -1):
        j = next(rand) % (i + 1)
        buf[i], buf[j] = buf[j], buf[i]
    yield from buf


# ---------------------------------------------------------------------------------------------
# writers


def _no_room_is_a_cache_error(out_dir: Path) -> contextlib.AbstractContextManager[None]:
    """A full disk, quota or file size limit while building `out_dir` as a CacheError that names
    the folder and the fix (lockstep.core.io.no_room_is). Entered outside atomic_dir, so by the time it
    speaks the work folder is gone and `out_dir` holds the previous cache, if any: nothing
    half-written is left for a reader."""
    return no_room_is(CacheError, doing=f"build {out_dir}", folder=out_dir.parent, outcome="nothing was written there",
                      rerun="run the cache stage again")


class _ShardWriter:
    """Appends token arrays to `shard_00000.bin, ...` in one folder. A shard is written under a
    temp name and renamed only when complete, so a complete-looking shard is a complete one."""

    def __init__(self, directory: Path, dtype: np.dtype, tokens_per_shard: int) -> None:
        self.directory = directory
        self.dtype = dtype
        self.tokens_per_shard = tokens_per_shard
        self.shards: list[dict[str, Any]] = []
        self._f: Any = None
        self._hash: Any = None
        self._count = 0
        directory.mkdir(parents=True, exist_ok=True)

    def _name(self) -> str:
        return _shard_name(len(self.shards))

    def _open(self) -> None:
        self._f = open(self.directory / f".{self._name()}.tmp", "wb")
        self._hash = hashlib.sha256()
        self._count = 0

    def _finish(self) -> None:
        name = self._name()
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.directory / f".{name}.tmp", self.directory / name)
        self.shards.append({"name": name, "tokens": self._count, "sha256": self._hash.hexdigest()})
        self._f = None

    def write(self, tokens: np.ndarray) -> None:
        pos = 0
        while pos < tokens.size:
            if self._f is None:
                self._open()
            take = min(self.tokens_per_shard - self._count, tokens.size - pos)
            data = memoryview(tokens[pos : pos + take]).cast("B")
            self._f.write(data)
            self._hash.update(data)
            self._count += take
            pos += take
            if self._count == self.tokens_per_shard:
                self._finish()

    def close(self) -> list[dict[str, Any]]:
        if self._f is not None:
            self._finish()
        return self.shards


def _batched(items: Iterable[Any], n: int) -> Iterator[list[Any]]:
    it = iter(items)
    while batch := list(itertools.islice(it, n)):
        yield batch


def _checked_batches(docs: Iterable[Any], n: int, split: str) -> Iterator[list[str]]:
    n_seen = 0
    for batch in _batched(docs, n):
        for t in batch:
            if not isinstance(t, str):
                raise TypeError(f"{split} document {n_seen} is {type(t).__name__}, expected str")
            n_seen += 1
        yield batch


# Documents per encoding task: small enough that the tasks of one batch spread evenly over the
# threads, large enough that submitting them costs nothing next to encoding them.
_TASK_DOCS = 16


def _joined(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _encode_ahead(
    batches: Iterable[list[str]],
    tokenizer: Tokenizer,
    num_threads: int,
    bos_id: int,
    vocab_size: int,
    dtype: np.dtype,
    where: str,
) -> Iterator[tuple[list[str], np.ndarray, np.ndarray]]:
    """(texts, BOS-joined tokens (N,) of `dtype`, document lengths counting BOS (D,)) per batch, in
    order. `num_threads` threads each encode small runs of documents and turn the id lists into
    tokens themselves: tokenizers release the GIL while encoding, so one thread's conversion
    overlaps another's encoding, and the next batch is queued while this one is hashed and
    written (measured in bench/bench_cache.py)."""
    pool = ThreadPoolExecutor(max_workers=max(1, num_threads))
    pending: collections.deque[tuple[list[str], list[Any]]] = collections.deque()
    try:
        for batch in batches:
            tasks = [
                pool.submit(encode_join, batch[i : i + _TASK_DOCS], tokenizer, bos_id, vocab_size, dtype, where)
                for i in range(0, len(batch), _TASK_DOCS)
            ]
            pending.append((batch, tasks))
            if len(pending) > 1:
                texts, done = pending.popleft()
                yield texts, *_joined([t.result() for t in done])
        while pending:
            texts, done = pending.popleft()
            yield texts, *_joined([t.result() for t in done])
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def build_pretrain_cache(
    texts: Iterable[str] | Mapping[str, Iterable[str]],
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer,
    max_train_tokens: int | None,
    max_val_tokens: int | None,
    shard_bytes: int,
    seed: int,
    shuffle_buffer: int,
    dataset_name: str = "",
    dataset_config: Any = None,
    artifact_records: int = 8,
    encode_batch_docs: int = 512,
    num_threads: int = 2,
    split: str = "train",
    num_workers: int = 1,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    text_bytes: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Tokenize documents into BOS-prefixed token shards, streaming. `texts` is either a mapping
    from split name to an iterable of documents ({"train": ..., "val": ...}; "val" may be left
    out), or one iterable of documents (a list, a generator), which all go to the split named by
    `split` while the other split stays empty. Every iterable is read once. Each split is
    shuffled with a `shuffle_buffer`-document buffer from its own generator (seed for train,
    seed + 1 for val), then written until its token cap; the document at the cap is cut. Writes
    `{train,val}/shard_NNNNN.bin`, the parity artifacts and `meta.json` (last), all into a temp
    folder that replaces `out_dir` only when everything is written.

    `num_workers` > 1 encodes in that many worker processes, each loading the tokenizer from
    `tokenizer_dir` (whose files must hash to `tokenizer.sha256`); 1 encodes here on
    `num_threads` threads. Both give the same bytes. `text_bytes` (split -> UTF-8 bytes of its
    documents, as a snapshot's meta.json has them) lets the progress line show an ETA for an
    uncapped split."""
    if isinstance(texts, Mapping):
        if not set(texts) <= set(SPLITS) or "train" not in texts:
            raise TypeError(
                f'texts must map "train" (and optionally "val") to iterables of documents, got keys {sorted(texts)}'
            )
        split_rule = "snapshot train split -> train shards, snapshot val split -> val shards"
    elif isinstance(texts, (str, bytes)) or not isinstance(texts, Iterable):
        raise TypeError(f"texts is a {type(texts).__name__}; pass an iterable of documents (e.g. a list of str) "
                        'or a mapping {"train": docs, "val": docs}')
    else:
        if split not in SPLITS:
            raise TypeError(f"split={split!r} must be one of {SPLITS}")
        texts = {split: texts}
        split_rule = f"all documents -> {split} shards"
    ident = _tokenizer_identity(tokenizer)
    dtype = token_dtype(ident["vocab_size"])
    tokens_per_shard = shard_bytes // dtype.itemsize
    if tokens_per_shard < 1:
        raise CacheError(f"shard_bytes={shard_bytes} holds no {dtype_name(dtype)} token; raise it")
    caps = {"train": max_train_tokens, "val": max_val_tokens}
    for split, cap in caps.items():
        if cap is not None and cap < 0:
            raise CacheError(f"max_{split}_tokens={cap} must be >= 0 or null (no cap)")
    not_int = isinstance(num_workers, bool) or not isinstance(num_workers, int)
    if not_int or not 1 <= num_workers <= MAX_ENCODE_PARALLELISM:
        raise CacheError(f"num_workers={num_workers!r} must be an integer >= 1 (1: encode in this process) and at most "
                         f"{MAX_ENCODE_PARALLELISM}, more CPUs than any machine has")
    if num_workers > 1 and tokenizer_dir is None:
        raise CacheError(
            f"num_workers={num_workers} needs tokenizer_dir: worker processes load the tokenizer from its files"
        )
    num_workers = encode_workers(num_workers)
    bos_id = int(tokenizer.get_bos_token_id())
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "kind": "pretrain",
        "dataset_name": dataset_name,
        "dataset_config": dataset_config,
        "split_rule": split_rule,
        "seed": seed,
        "shuffle_buffer": shuffle_buffer,
        "token_dtype": dtype_name(dtype),
        "shard_bytes": shard_bytes,
        "max_train_tokens": max_train_tokens,
        "max_val_tokens": max_val_tokens,
        "bos_id": bos_id,
        **ident,
        "shards": {},
    }
    snapshot = SnapshotCollector(artifact_records)
    rendered = RenderedSamples(tokenizer, artifact_records, bos_id=bos_id)
    with _no_room_is_a_cache_error(Path(out_dir)), atomic_dir(out_dir) as tmp, contextlib.ExitStack() as stack:
        pool = None
        if num_workers > 1:
            assert tokenizer_dir is not None
            pool = stack.enter_context(EncodePool(tokenizer_dir, tokenizer, num_workers=num_workers, bos_id=bos_id,
                                                  vocab_size=ident["vocab_size"], dtype=dtype))
        for offset, split_name in enumerate(SPLITS):
            gen = stream_generator(seed, offset, stride=1)
            writer = _ShardWriter(tmp / split_name, dtype, tokens_per_shard)
            cap = caps[split_name]
            n_tokens = n_docs = n_cut = 0
            docs = buffer_shuffle(texts.get(split_name, ()), shuffle_buffer, gen)
            batches = _checked_batches(docs, encode_batch_docs if cap != 0 else 1, split_name)
            where = f"{split_name} documents"
            if pool is not None:
                encoded = pool.encode(batches, where)
            else:
                encoded = _encode_ahead(batches, tokenizer, num_threads, bos_id, ident["vocab_size"], dtype, where)
            # ETA against the token cap when there is one, else against the split's text bytes.
            total_bytes = (text_bytes or {}).get(split_name)
            progress = Progress(
                f"cache {dataset_name or 'pretrain'} {split_name}", log, budget=cap if cap is not None else total_bytes,
                budget_unit="tokens" if cap is not None else "bytes", interval_s=PROGRESS_INTERVAL_S,
            )  # fmt: skip
            # closing: a loop left at the cap stops the encoding threads before the next split.
            with contextlib.closing(encoded):
                for batch, flat, lengths in encoded:
                    if cap is not None and n_tokens >= cap:
                        break
                    if cap is not None and n_tokens + flat.size > cap:
                        ends = np.cumsum(lengths)
                        keep_docs = int(np.searchsorted(ends, cap - n_tokens, side="left")) + 1
                        n_cut = int(ends[keep_docs - 1] > cap - n_tokens)
                        batch, lengths = batch[:keep_docs], lengths[:keep_docs]
                    if rendered.wants(split_name):
                        # Whole documents, also the one cut at the cap; `add` keeps the first ids.
                        doc_ends = np.cumsum(lengths[:artifact_records]).tolist()
                        for a, b in zip([0, *doc_ends], doc_ends):
                            rendered.add(split_name, flat[a : min(b, a + MAX_SAMPLE_TOKENS + 1)].tolist())
                    if cap is not None:
                        flat = flat[: cap - n_tokens]
                    snapshot.add_texts(split_name, batch)
                    writer.write(flat)
                    n_tokens += flat.size
                    n_docs += len(batch)
                    batch_bytes = len("".join(batch).encode("utf-8"))
                    progress.update(items=len(batch), text_bytes=batch_bytes,
                                    done=flat.size if cap is not None else batch_bytes, tokens=flat.size)
                    if cap is not None and n_tokens >= cap:
                        break  # stop reading: a capped split never streams the rest of a large source
            progress.finish()
            meta["shards"][split_name] = writer.close()
            meta[f"{split_name}_tokens"] = n_tokens
            meta[f"{split_name}_docs"] = n_docs
            meta[f"{split_name}_docs_cut_at_cap"] = n_cut
            n_shards = len(meta["shards"][split_name])
            log.info("cache %s: %s docs, %s tokens, %s shards", split_name, n_docs, n_tokens, n_shards)
        meta["artifacts"] = _write_artifacts(tmp, snapshot, rendered)
        write_json_atomic(tmp / "meta.json", meta)
    return meta


def _write_artifacts(tmp: Path, snapshot: Any, rendered: Any) -> dict[str, str]:
    write_json_atomic(tmp / "dataset_snapshot.json", snapshot.to_json())
    write_json_atomic(tmp / "rendered_samples.json", rendered.to_json())
    return {name: sha256_file(tmp / name) for name in ("dataset_snapshot.json", "rendered_samples.json")}


def _split_by_frac(examples: Iterable[Any], val_frac: float, seed: int) -> dict[str, list[Any]]:
    items = list(examples)
    n_val = int(round(val_frac * len(items)))
    if val_frac > 0 and len(items) >= 2:
        n_val = min(max(n_val, 1), len(items) - 1)
    perm = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed))
    is_val = torch.zeros(len(items), dtype=torch.bool)
    is_val[perm[:n_val]] = True
    # Each split keeps the stored order, so the artifacts read like the snapshot.
    return {
        "train": [x for x, v in zip(items, is_val.tolist()) if not v],
        "val": [x for x, v in zip(items, is_val.tolist()) if v],
    }


def build_sft_cache(
    examples: Iterable[Any] | Mapping[str, Iterable[Any]],
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer,
    val_frac: float | None,
    seed: int,
    dataset_name: str = "",
    dataset_config: Any = None,
    artifact_records: int = 8,
    split: str = "train",
) -> dict[str, Any]:
    """Render conversations (or GSM8K-format problems, converted to conversations) with the
    tokenizer's chat template and write `{train,val}_tokens.bin`, `{train,val}_mask.bin` (uint8
    loss mask, one byte per token), `{train,val}_idx.npy` (int64 start offsets), the parity
    artifacts and `meta.json` (last). An example is a conversation `{"messages": [...]}`, its bare
    list of messages `[{"role": ..., "content": ...}, ...]`, or a problem `{"question", "answer"}`.
    `examples` is either a mapping split -> examples (then val_frac must be None) or one iterable
    of examples: with a `val_frac` it is split by a seeded permutation, without one (None) every
    example goes to the split named by `split` and the other split stays empty."""
    if isinstance(examples, Mapping):
        if val_frac is not None:
            raise CacheError("val_frac must be null when examples already come split into train/val")
        if not set(examples) <= set(SPLITS):
            raise TypeError(f"example splits must be among {SPLITS}, got {sorted(examples)}")
        splits: Mapping[str, Iterable[Any]] = examples
        split_rule = "snapshot train split -> train, snapshot val split -> val"
    elif isinstance(examples, (str, bytes)) or not isinstance(examples, Iterable):
        raise TypeError(f"examples is a {type(examples).__name__}; pass an iterable of examples "
                        'or a mapping {"train": examples, "val": examples}')
    elif val_frac is None:
        if split not in SPLITS:
            raise TypeError(f"split={split!r} must be one of {SPLITS}")
        splits = {split: examples}
        split_rule = f"all examples -> {split}"
    else:
        if not 0.0 <= val_frac < 1.0:
            raise CacheError(f"val_frac={val_frac} must be in [0, 1) when examples come as one stream")
        if split != "train":
            raise TypeError(f"split={split!r} applies only without val_frac; val_frac={val_frac} makes both splits")
        splits = _split_by_frac(examples, val_frac, seed)
        split_rule = f"snapshot train split -> seeded permutation, val_frac={val_frac} -> val"
    ident = _tokenizer_identity(tokenizer)
    dtype = token_dtype(ident["vocab_size"])
    bos_id = int(tokenizer.get_bos_token_id())
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "kind": "sft",
        "dataset_name": dataset_name,
        "dataset_config": dataset_config,
        "split_rule": split_rule,
        "seed": seed,
        "val_frac": val_frac,
        "token_dtype": dtype_name(dtype),
        "shard_bytes": None,
        "bos_id": bos_id,
        **ident,
        "files": {},
    }
    snapshot = SnapshotCollector(artifact_records)
    rendered = RenderedSamples(tokenizer, artifact_records, bos_id=bos_id)
    with _no_room_is_a_cache_error(Path(out_dir)), atomic_dir(out_dir) as tmp:
        for split_name in SPLITS:
            offsets: list[int] = []
            n_tokens = n_supervised = 0
            tokens_file, mask_file = tmp / f"{split_name}_tokens.bin", tmp / f"{split_name}_mask.bin"
            with atomic_open(tokens_file) as ft, atomic_open(mask_file) as fm:
                for i, example in enumerate(splits.get(split_name, ())):
                    where = f"{split_name} example {i}"
                    conv = as_conversation(example, where)
                    ids, mask = tokenizer.render_conversation(conv)
                    ids_arr = to_token_array(np.asarray(ids, dtype=np.int64), ident["vocab_size"], dtype, where)
                    mask_arr = np.asarray(mask, dtype=np.int64)
                    if mask_arr.shape != ids_arr.shape or not np.isin(mask_arr, (0, 1)).all():
                        raise CacheError(f"{where}: render_conversation returned a mask that is not 0/1 per token")
                    if not mask_arr.any():
                        raise CacheError(
                            f"{where}: no supervised token; a conversation must end with an assistant turn"
                        )
                    offsets.append(n_tokens)
                    ft.write(ids_arr.tobytes())
                    fm.write(mask_arr.astype(np.uint8).tobytes())
                    n_tokens += ids_arr.size
                    n_supervised += int(mask_arr.sum())
                    snapshot.add(split_name, conv)
                    rendered.add(split_name, [int(t) for t in ids], [int(m) for m in mask])
            with atomic_open(tmp / f"{split_name}_idx.npy") as fi:
                np.save(fi, np.asarray(offsets, dtype=np.int64), allow_pickle=False)
            meta[f"{split_name}_examples"] = len(offsets)
            meta[f"{split_name}_tokens"] = n_tokens
            meta[f"{split_name}_supervised_tokens"] = n_supervised
            for suffix in ("tokens.bin", "mask.bin", "idx.npy"):
                name = f"{split_name}_{suffix}"
                meta["files"][name] = {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
            log.info("cache %s: %s examples, %s tokens", split_name, len(offsets), n_tokens)
        meta["artifacts"] = _write_artifacts(tmp, snapshot, rendered)
        write_json_atomic(tmp / "meta.json", meta)
    return meta
