"""The tokenizer stage's work: read raw snapshots, train a tokenizer on capped train text, save it
with its parity artifact (rendered samples), and measure bytes/token, and the bytes lost to an
unknown-byte id, on each metric source's val text. Takes explicit paths and a config; does not
read params.yaml or parse argv (stages/tokenizer.py does)."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lockstep.config import ConfigError
from lockstep.io import atomic_dir, write_json, write_json_atomic
from lockstep.parity import RENDERED_FILE, RenderedSamples
from lockstep.records import problem_to_conversation
from lockstep.tokenizer.base import Tokenizer, conversation_texts, train_tokenizer
from lockstep.tokenizer.char import CharOrder

log = logging.getLogger("lockstep.tokenizer")

# Texts encoded per tiktoken batch call while measuring: large enough to use the threads,
# small enough that a big val split is never held whole as token lists.
METRIC_BATCH_TEXTS = 8192
# Train text read into memory before the trainer starts: the whole text of the offline presets,
# a bounded head of a large corpus (at most a few hundred MB of str).
READ_AHEAD_CHARS = 1 << 28
# A document sample keeps this many ids (BOS included): enough to see how prose splits, small
# enough that the artifact stays readable.
DOC_SAMPLE_TOKENS = 256
# A metric batch with fewer characters is counted on one thread (see TokenCounter).
PARALLEL_MIN_CHARS = 1 << 16


@dataclass(frozen=True)
class TokenizerConfig:
    """The `tokenizer:` params section."""

    kind: Literal["bpe", "sentencepiece", "char", "byte"] = "bpe"
    vocab_size: int = 4096  # ids including the 9 special tokens (bpe, sentencepiece); char and byte fix their own
    train_sources: tuple[str, ...] = ()  # raw snapshots whose train split is learned from, in this order
    max_chars: int = 20_000_000  # characters of train text read, across train_sources in order
    metric_sources: tuple[str, ...] = ()  # bytes/token is reported on each one's val split
    spm_model_type: Literal["bpe", "unigram"] = "bpe"  # sentencepiece only
    char_max_alphabet: int = 65  # char only: most distinct bytes kept
    # char only: which distinct bytes the cap keeps, the most frequent ("frequency") or the lowest
    # byte values ("sorted", the reference rule of char-level parity runs); ids follow byte order
    # either way.
    char_order: CharOrder = "frequency"
    # char only: append the 9 special tokens. false gives exactly one id per kept byte, for id
    # parity with references that have none; such a tokenizer has no <|bos|> or chat template,
    # so the cache, training and chat stages refuse it.
    char_specials: bool = True
    encode_threads: int = 1  # threads for batch encoding while measuring
    artifact_records: int = 8  # records per source rendered into rendered_samples.json (parity artifact)

    def __post_init__(self) -> None:
        if not self.train_sources and self.kind in ("bpe", "sentencepiece", "char"):
            raise ValueError(f"tokenizer.train_sources is empty; a {self.kind} tokenizer must learn from at least one raw source")
        if self.max_chars < 1:
            raise ValueError(f"tokenizer.max_chars={self.max_chars} must be positive")
        if self.encode_threads < 1:
            raise ValueError(f"tokenizer.encode_threads={self.encode_threads} must be at least 1")
        if self.artifact_records < 0:
            raise ValueError(f"tokenizer.artifact_records={self.artifact_records} must be >= 0 (0 keeps no rendered samples)")
        if not 1 <= self.char_max_alphabet <= 256:
            raise ConfigError(
                f"tokenizer.char_max_alphabet={self.char_max_alphabet} must be between 1 and 256 (distinct byte values)"
            )
        if not self.char_specials and self.kind != "char":
            raise ConfigError(
                f"tokenizer.char_specials=false applies to kind char only; a {self.kind} tokenizer always has the special "
                "tokens: set char_specials: true, or kind: char"
            )

    def train_options(self, seed: int) -> dict[str, Any]:
        """Arguments for train_tokenizer beyond kind and texts."""
        if self.kind == "sentencepiece":
            return {"vocab_size": self.vocab_size, "model_type": self.spm_model_type, "seed": seed}
        if self.kind == "char":
            return {"vocab_size": None, "max_alphabet": self.char_max_alphabet, "order": self.char_order,
                    "specials": self.char_specials}  # fmt: skip
        if self.kind == "byte":
            return {"vocab_size": None}
        return {"vocab_size": self.vocab_size}


def record_texts(kind: str, record: Mapping[str, Any]) -> list[str]:
    """The text content of one raw record, as the model will see it: a document's text; each part
    of a conversation; a problem rendered as its conversation (calculator annotations become
    python / output parts)."""
    if kind == "document":
        return [record["text"]]
    if kind == "conversation":
        return conversation_texts(record)
    if kind == "problem":
        return conversation_texts(problem_to_conversation(dict(record)))
    raise ValueError(f"record kind {kind!r} must be document, conversation or problem")


def render_record(tokenizer: Tokenizer, kind: str, record: Mapping[str, Any]) -> tuple[list[int], list[int] | None, int]:
    """(ids, loss mask or None, ids kept in the artifact) of one raw record as training sees it:
    a document is BOS + its text (its text alone for a tokenizer without special tokens); a
    conversation or problem goes through the chat template (NoSpecialTokensError without one).
    A document's ids stop one past what the artifact keeps: enough to tell it was cut."""
    if kind == "document":
        bos = [tokenizer.get_bos_token_id()] if tokenizer.has_special_tokens else []
        return [*bos, *tokenizer.encode_head(record["text"], DOC_SAMPLE_TOKENS)], None, DOC_SAMPLE_TOKENS
    if kind == "conversation":
        conversation = dict(record)
    elif kind == "problem":
        conversation = problem_to_conversation(dict(record))
    else:
        raise ValueError(f"record kind {kind!r} must be document, conversation or problem")
    ids, mask = tokenizer.render_conversation(conversation)
    return ids, mask, len(ids)


@dataclass(frozen=True)
class SampleRecords:
    """The first records of one split of each snapshot, with each snapshot's record kind: what
    `rendered_samples` renders. Read without a tokenizer, so the stage reads them while it trains."""

    split: str
    records: dict[str, tuple[str, list[dict[str, Any]]]]  # source name -> (record kind, records)

    @classmethod
    def read(cls, snapshots: Mapping[str, Path], n: int, *, split: str = "train") -> SampleRecords:
        from lockstep.sources import read_meta
        from lockstep.sources.snapshot import first_records

        return cls(split, {name: (read_meta(path)["kind"], first_records(path, split, n)) for name, path in snapshots.items()})


def rendered_samples(tokenizer: Tokenizer, samples: SampleRecords, n: int) -> dict[str, Any]:
    """The `rendered_samples.json` object: each source's first `n` sample records rendered with
    `tokenizer`, labelled `<source>/<split>`, so a tokenizer or chat-template change shows up as
    the first differing id. A tokenizer without special tokens has no chat template: it renders
    documents only (with no BOS, `bos_id` null) and leaves conversation and problem sources out."""
    bos_id = tokenizer.get_bos_token_id() if tokenizer.has_special_tokens else None
    rendered = RenderedSamples(tokenizer, n, bos_id=bos_id)
    for name, (kind, records) in samples.records.items():
        if bos_id is None and kind != "document":
            log.info("rendered_samples: %s (%s records) left out: the tokenizer has no chat template", name, kind)
            continue
        for record in records:
            ids, mask, keep = render_record(tokenizer, kind, record)
            rendered.add(f"{name}/{samples.split}", ids, mask, max_tokens=keep)
    return rendered.to_json()


def snapshot_texts(snapshot_dir: Path, split: str, *, verify: bool = True) -> Iterator[str]:
    """Texts of one split of a raw snapshot, in stored order; part files are checked against
    meta.json first unless verify=False (then the caller runs `verify_split` itself)."""
    from lockstep.sources import iter_records, read_meta

    kind = read_meta(snapshot_dir)["kind"]
    if kind == "document":
        for record in iter_records(snapshot_dir, split, verify=verify, columns=["text"]):
            yield record["text"]
        return
    for record in iter_records(snapshot_dir, split, verify=verify):
        yield from record_texts(kind, record)


class CappedTexts:
    """Texts from several sources in order, cut at `max_chars` characters in all (the last text is
    cropped so the total is exact). Counts what it yielded."""

    def __init__(self, sources: Iterable[Iterable[str]], max_chars: int) -> None:
        self.sources = sources
        self.max_chars = max_chars
        self.chars = 0
        self.texts = 0

    def __iter__(self) -> Iterator[str]:
        for texts in self.sources:
            for text in texts:
                room = self.max_chars - self.chars
                if room <= 0:
                    return
                text = text[:room]
                self.chars += len(text)
                self.texts += 1
                yield text


def capped_train_texts(cfg: TokenizerConfig, train_dirs: Iterable[Path], *, verify: bool = True) -> CappedTexts:
    """The text the stage trains on: the train splits of `train_dirs` (cfg.train_sources' snapshots,
    in that order), cut at cfg.max_chars."""
    return CappedTexts((snapshot_texts(d, "train", verify=verify) for d in train_dirs), cfg.max_chars)


def read_ahead(texts: Iterable[str], max_chars: int = READ_AHEAD_CHARS) -> Iterable[str]:
    """The same texts, the first `max_chars` characters' worth of them read now, the rest on
    demand: a list when everything was read. rustbpe's worker threads are already running while
    it pulls texts, and on 2 cores they slowed the snapshot reading down: the d4 offline
    tokenizer stage trained in 0.41 s fed lazily, 0.37 s from a list read beforehand (bare
    rustbpe on that list: 0.36 s).

    The caller should hold the result until training returns. A list that only the trainer's
    iterator references is freed inside the training call when the iterator runs out, and that
    call then took 1.13x as long on the offline corpus (bench/bench_tokenizer.py --in-process
    --freed: 0.418 s against 0.368 s)."""
    rest = iter(texts)
    head: list[str] = []
    n = 0
    for text in rest:
        head.append(text)
        n += len(text)
        if n >= max_chars:
            return itertools.chain(head, rest)
    return head


def _chunks_by_chars(texts: list[str], n_chunks: int) -> list[list[str]]:
    """`texts` cut into at most `n_chunks` consecutive runs of about equal character counts."""
    target = max(1, sum(map(len, texts)) // n_chunks)
    chunks: list[list[str]] = [[]]
    size = 0
    for text in texts:
        if size >= target and len(chunks) < n_chunks:
            chunks.append([])
            size = 0
        chunks[-1].append(text)
        size += len(text)
    return chunks


class TokenCounter:
    """Counts the tokens of text batches, each text encoded on its own without special tokens, on
    the calling thread and `num_threads - 1` worker threads kept for every batch it is given.

    A bpe worker builds its own tiktoken Encoding on its first batch (a few ms for a 4k
    vocabulary, about 30 ms for 65k, holding the GIL), so the workers outlive one batch and one
    source; the thread that built the tokenizer encodes with the tokenizer's own. Each thread
    counts a run of texts with one `count_tokens` call. Batches under `parallel_min_chars` stay
    on the calling thread: they take a few ms, less than handing them over costs."""

    def __init__(self, tokenizer: Tokenizer, num_threads: int = 1, *, parallel_min_chars: int = PARALLEL_MIN_CHARS) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads={num_threads} must be at least 1")
        self.tokenizer = tokenizer
        self.num_threads = num_threads
        self.parallel_min_chars = parallel_min_chars
        self._pool = ThreadPoolExecutor(num_threads - 1, thread_name_prefix="token-counter") if num_threads > 1 else None

    def count(self, texts: list[str]) -> int:
        if self._pool is None or len(texts) < 2 or sum(map(len, texts)) < self.parallel_min_chars:
            return self.tokenizer.count_tokens(texts)
        # Runs of about equal size, taken in order by whichever thread is free: a thread slowed
        # by other work on a busy machine never holds back a fixed share of the batch.
        runs = iter(_chunks_by_chars(texts, 4 * self.num_threads))
        lock = threading.Lock()

        def drain() -> int:
            total = 0
            while True:
                with lock:
                    run = next(runs, None)
                if run is None:
                    return total
                total += self.tokenizer.count_tokens(run)

        workers = [self._pool.submit(drain) for _ in range(self.num_threads - 1)]
        total = drain()
        return total + sum(w.result() for w in workers)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self) -> TokenCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bytes_per_token(
    tokenizer: Tokenizer, texts: Iterable[str], *, num_threads: int = 1, counter: TokenCounter | None = None
) -> dict[str, float | int]:
    """UTF-8 bytes per token over `texts`, each encoded on its own without special tokens, in
    batches of METRIC_BATCH_TEXTS texts. Counted by `counter` when given (to keep its threads for
    several calls), else by a TokenCounter of `num_threads` threads made for this call.

    `unknown_bytes` counts the bytes the tokenizer sent to its unknown-byte id (see
    Tokenizer.count_unknown_bytes); `kept_bytes_per_token` counts only the bytes that survive,
    so a char tokenizer that drops every digit does not look as good as one that keeps them."""
    if counter is None:
        with TokenCounter(tokenizer, num_threads) as own:
            return bytes_per_token(tokenizer, texts, counter=own)
    if counter.tokenizer is not tokenizer:
        raise ValueError("the counter counts with another tokenizer than the one given")
    n_bytes = 0
    n_tokens = 0
    n_unknown = 0
    texts = iter(texts)
    while batch := list(itertools.islice(texts, METRIC_BATCH_TEXTS)):
        n_tokens += counter.count(batch)
        n_bytes += sum(len(t.encode("utf-8")) for t in batch)
        n_unknown += tokenizer.count_unknown_bytes(batch)
    if n_tokens == 0:
        raise ValueError("no text to measure bytes/token on; check that the metric source's val split is not empty")
    return {
        "bytes": n_bytes,
        "tokens": n_tokens,
        "bytes_per_token": n_bytes / n_tokens,
        "unknown_bytes": n_unknown,
        "kept_bytes_per_token": (n_bytes - n_unknown) / n_tokens,
    }


def _snapshot_dir(raw_dir: Path, name: str) -> Path:
    path = raw_dir / name
    if not path.is_dir():
        raise FileNotFoundError(
            f"raw snapshot {path} not found: add `{name}` under `fetch:` in params.yaml and run `dvc repro fetch@{name}`, "
            "or remove it from tokenizer.train_sources / tokenizer.metric_sources"
        )
    return path


class ValTexts:
    """A metric source's val texts, in stored order, to be iterated once: the first
    METRIC_BATCH_TEXTS read ahead, the rest read on demand by whichever thread iterates."""

    def __init__(self, snapshot_dir: Path) -> None:
        """Read ahead now, after checking every val part against meta.json: a damaged one fails
        before a reader has acted on any of it."""
        from lockstep.sources import verify_split

        verify_split(snapshot_dir, "val")
        self._rest = snapshot_texts(snapshot_dir, "val", verify=False)
        self.head = list(itertools.islice(self._rest, METRIC_BATCH_TEXTS))
        self.complete = len(self.head) < METRIC_BATCH_TEXTS  # the head holds every text
        self.head_chars = sum(map(len, self.head))

    def __iter__(self) -> Iterator[str]:
        return itertools.chain(self.head, self._rest)

    @property
    def small(self) -> bool:
        """Few enough characters that a TokenCounter counts them on one thread anyway."""
        return self.complete and self.head_chars < PARALLEL_MIN_CHARS


class _MetricQueue:
    """The metric sources, largest first, for two threads to take from: the stage's thread from
    the front, with its TokenCounter; the helper thread, once it has saved, small sources from
    the back (counted on one thread anyway)."""

    def __init__(self, sources: Mapping[str, ValTexts]) -> None:
        self._names = sorted(sources, key=lambda n: (not sources[n].complete, sources[n].head_chars), reverse=True)
        self._sources = sources
        self._lock = threading.Lock()

    def take(self, *, small_only: bool = False) -> str | None:
        with self._lock:
            if not self._names or (small_only and not self._sources[self._names[-1]].small):
                return None
            return self._names.pop() if small_only else self._names.pop(0)


def _save(tok: Tokenizer, out_dir: Path, samples: SampleRecords, n: int) -> tuple[dict[str, Any], float]:
    """Render the parity artifact and publish the tokenizer with it; returns (meta, seconds)."""
    t0 = time.perf_counter()
    rendered = rendered_samples(tok, samples, n)
    # The artifact sits beside the tokenizer files but is not one of them: meta.json lists only
    # the tokenizer's own files, so the tokenizer's sha256 does not depend on it. atomic_dir
    # fsyncs them all and publishes them together.
    with atomic_dir(out_dir) as tmp:
        meta = tok.write_files(tmp)
        write_json(tmp / RENDERED_FILE, rendered)
    return meta, time.perf_counter() - t0


def _save_and_measure(
    tok: Tokenizer, helper: ThreadPoolExecutor, out_dir: Path, samples: SampleRecords, val_texts: Mapping[str, ValTexts],
    cfg: TokenizerConfig,
) -> tuple[dict[str, Any], dict[str, dict[str, float | int]], float]:
    """Save on the helper thread while this one counts val tokens; the helper, once saved, takes
    small sources too. Returns (tokenizer meta, bytes/token per source in `val_texts` order,
    seconds spent saving)."""
    queue = _MetricQueue(val_texts)
    counted: dict[str, dict[str, float | int]] = {}

    def save_then_count_small() -> tuple[dict[str, Any], float]:
        own = tok.copy()  # an encoder of this thread's own (see Tokenizer.copy)
        saved = _save(own, out_dir, samples, cfg.artifact_records)
        while (name := queue.take(small_only=True)) is not None:
            counted[name] = bytes_per_token(own, val_texts[name])
        return saved

    saving = helper.submit(save_then_count_small)
    with TokenCounter(tok, cfg.encode_threads) as counter:  # one set of encoder threads for every source
        while (name := queue.take()) is not None:
            counted[name] = bytes_per_token(tok, val_texts[name], counter=counter)
    meta, save_s = saving.result()
    return meta, {name: counted[name] for name in val_texts}, save_s


def run_tokenizer_stage(cfg: TokenizerConfig, raw_dir: Path, out_dir: Path, metrics_path: Path, *, seed: int) -> dict[str, Any]:
    """Train on the capped train text of cfg.train_sources, save to `out_dir` (replaced whole),
    write bytes/token of each metric source's val split to `metrics_path`. Returns the metrics.

    Per source, the metrics give `val_bytes`, `val_tokens`, `bytes_per_token` (all bytes over
    tokens), `val_unknown_bytes` (bytes encoded to the unknown-byte id and lost: only a char
    tokenizer has one, 0 for the other kinds) and `kept_bytes_per_token` (the bytes that survive
    over tokens).

    A helper thread hashes the train parts while this thread decodes them, and reads what needs
    no tokenizer (val texts, the records rendered into the artifact) while the train text is
    read and trained on; after training it saves while this thread counts val tokens. On the
    offline preset, in a fresh process, the stage's time beside rustbpe's training (about
    430 ms) went from about 80 ms with all of it on one thread to about 50 ms."""
    from lockstep.sources import verify_split

    raw_dir, out_dir = Path(raw_dir), Path(out_dir)
    train_dirs = [_snapshot_dir(raw_dir, name) for name in cfg.train_sources]
    metric_dirs = {name: _snapshot_dir(raw_dir, name) for name in cfg.metric_sources}
    # Train sources first, then metric sources: the order a reader meets them in params.
    sample_dirs = {**dict(zip(cfg.train_sources, train_dirs)), **metric_dirs}

    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer-stage") as helper:
        t0 = time.perf_counter()
        # The train parts are hashed there (hashlib lets go of the GIL) while they are decoded here.
        verified = [helper.submit(verify_split, d, "train") for d in train_dirs]
        samples_read = helper.submit(SampleRecords.read, sample_dirs, cfg.artifact_records)
        val_read = {name: helper.submit(ValTexts, path) for name, path in metric_dirs.items()}
        train_texts = capped_train_texts(cfg, train_dirs, verify=False)
        try:
            ahead = read_ahead(train_texts)
        except Exception:
            for check in verified:
                check.result()  # a damaged part says so, rather than how decoding it failed
            raise
        for check in verified:
            check.result()  # nothing is trained on before its part matched meta.json
        t_read = time.perf_counter()
        for read in (samples_read, *val_read.values()):
            if read.done():
                read.result()  # a bad snapshot fails now, not after a long training
        tok = train_tokenizer(cfg.kind, ahead, **cfg.train_options(seed))
        del ahead  # held through training (see read_ahead), freed before the measuring
        t_train = time.perf_counter()
        log.info("trained %s tokenizer | vocab %d | %d texts | %d chars | %.2fs",
                 cfg.kind, tok.get_vocab_size(), train_texts.texts, train_texts.chars, t_train - t0)  # fmt: skip
        if not tok.has_special_tokens:
            log.warning("the tokenizer has no special tokens (tokenizer.char_specials: false): it is for ids and metrics; "
                        "the cache, training and chat stages will refuse it (no <|bos|>, no chat template)")  # fmt: skip

        # Read (and every val part hashed) long before training ended: a bad snapshot fails here,
        # before anything is saved.
        samples = samples_read.result()
        val_texts = {name: read.result() for name, read in val_read.items()}
        meta, per_source, save_s = _save_and_measure(tok, helper, out_dir, samples, val_texts, cfg)
    for name, m in per_source.items():
        log.info("bytes/token %-14s %.3f (%d bytes, %d unknown)", name, m["bytes_per_token"], m["bytes"], m["unknown_bytes"])
        if m["unknown_bytes"]:
            log.warning("%s: %d of %d val bytes (%.2f%%) are outside the %s alphabet and encode to id 0, lost on decode; "
                        "raise tokenizer.char_max_alphabet or train on text that has them",
                        name, m["unknown_bytes"], m["bytes"], 100 * m["unknown_bytes"] / m["bytes"], cfg.kind)  # fmt: skip
    metrics = {
        "kind": cfg.kind,
        "vocab_size": tok.get_vocab_size(),
        "tokenizer_sha256": meta["sha256"],
        "train_chars": train_texts.chars,
        "train_texts": train_texts.texts,
        "bytes_per_token": {name: m["bytes_per_token"] for name, m in per_source.items()},
        "val_bytes": {name: m["bytes"] for name, m in per_source.items()},
        "val_tokens": {name: m["tokens"] for name, m in per_source.items()},
        "val_unknown_bytes": {name: m["unknown_bytes"] for name, m in per_source.items()},
        "kept_bytes_per_token": {name: m["kept_bytes_per_token"] for name, m in per_source.items()},
    }
    write_json_atomic(os.fspath(metrics_path), metrics)
    log.info("tokenizer stage | read %.3fs | train %.3fs | save+metrics %.3fs (render+save %.3fs alongside)",
             t_read - t0, t_train - t_read, time.perf_counter() - t_train, save_s)  # fmt: skip
    return metrics
