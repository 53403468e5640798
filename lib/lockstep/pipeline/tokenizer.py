"""The tokenizer stage's work: read raw snapshots, train a tokenizer on capped train text, save it
with its parity artifact (rendered samples), and measure bytes/token, and the bytes lost to an
unknown-byte id, on each metric source's val text. Takes explicit paths and a config; does not
read params.yaml or parse argv (stages/tokenizer.py does)."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from lockstep.core.config import ConfigError, FieldError, build_config, check_range
from lockstep.core.io import atomic_dir, write_json, write_json_atomic
from lockstep.data.parity import RENDERED_FILE, RenderedSamples
from lockstep.data.records import as_conversation
from lockstep.data.snapshot import SnapshotError, first_records, iter_records, read_meta, verify_split
from lockstep.tokenizer.base import Tokenizer, TokenizerFileError, conversation_texts
from lockstep.tokenizer.kinds import KINDS, training_errors
from lockstep.tokenizer.options import KindOptions

log = logging.getLogger("lockstep.tokenizer")

# Errors whose message says what to fix: the stage's entry prints them as one `error: ...` line.
ERRORS = (ConfigError, SnapshotError, TokenizerFileError, FileNotFoundError)

# Texts encoded per batch call while measuring: large enough to use the encoder's threads, small
# enough that a big val split is never held whole as token lists.
METRIC_BATCH_TEXTS = 8192
# A document sample keeps this many ids (BOS included): enough to see how prose splits, small
# enough that the artifact stays readable.
DOC_SAMPLE_TOKENS = 256


@dataclass(frozen=True)
class TokenizerConfig:
    """The `tokenizer:` params section: what every kind shares, and the chosen kind's own
    `options` (a mapping in params, its kind's `KindOptions` dataclass once built)."""

    kind: str = "bpe"  # one of lockstep.tokenizer.kinds.KINDS
    # ids in all, the 9 special tokens included; a kind that fixes its own size (char, byte, an
    # lz78 dictionary file) does not use it
    vocab_size: int = 4096
    train_sources: tuple[str, ...] = ()  # raw snapshots whose train split is learned from, in this order
    max_chars: int = 20_000_000  # characters of train text read, across train_sources in order
    metric_sources: tuple[str, ...] = ()  # bytes/token is reported on each one's val split
    encode_threads: int = 1  # the encoder's threads for counting val tokens
    artifact_records: int = 8  # records per source rendered into rendered_samples.json (parity artifact)
    # the kind's own options, `tokenizer.options.<key>` (docs/tokenizers.md lists them per kind)
    options: Mapping[str, Any] = field(default_factory=dict)

    # Keys of this section before each kind had its own options: refused, naming the new key.
    MOVED_KEYS: ClassVar[dict[str, tuple[str, str]]] = {}

    def __post_init__(self) -> None:
        # FieldError names the key within the section; build_config adds the `tokenizer.` prefix,
        # and the stage's entry prints the one `error:` line.
        if self.kind not in KINDS:
            raise FieldError("kind", self.kind, f"must be one of {sorted(KINDS)}")
        options_class = KINDS[self.kind].options
        options = self.options
        if not isinstance(options, options_class):
            if not isinstance(options, Mapping):
                raise FieldError("options", options, f"must be a mapping of the {self.kind} kind's options")
            try:
                options = build_config(options_class, options, where="tokenizer.options")
            except FieldError as e:  # re-raised relative to this section, like this class's own
                raise FieldError(e.key.removeprefix("tokenizer."), e.value, e.requirement) from None
            object.__setattr__(self, "options", options)
        if options.learns() and not self.train_sources:
            raise FieldError(
                "train_sources",
                list(self.train_sources),
                f"names no raw source; a {self.kind} tokenizer learns from the train split of at least one: "
                "list them, e.g. [wikitext]",
            )
        # A billion ids is past any embedding table worth training and well inside the uint32 ids
        # of the token files.
        if options.MIN_VOCAB is not None and options.uses_vocab_size():
            check_range("vocab_size", self.vocab_size, ge=options.MIN_VOCAB, le=10**9,
                        why=f"ids in all for a {self.kind} tokenizer, 256 bytes and 9 special tokens included")
        check_range("max_chars", self.max_chars, ge=1, why="characters of train text the tokenizer learns from")
        # More threads than any machine's cores only costs memory; a huge count fails to start them.
        check_range("encode_threads", self.encode_threads, ge=1, le=1024, why="threads counting val tokens")
        check_range(
            "artifact_records",
            self.artifact_records,
            ge=0,
            why="records per source in rendered_samples.json; 0 keeps none",
        )

    @property
    def kind_options(self) -> KindOptions:
        """The chosen kind's options, built and checked."""
        return self.options  # type: ignore[return-value]  # built in __post_init__

    def train(self, texts: Iterable[str], *, seed: int, root: Path = Path(".")) -> Tokenizer:
        """Train the configured kind on `texts` with its options; `seed` is the data seed, `root`
        the project folder (for options that name a file in it)."""
        options = self.kind_options
        vocab_size = self.vocab_size if options.uses_vocab_size() else None
        return KINDS[self.kind].train(texts, vocab_size=vocab_size, **options.train_kwargs(seed=seed, root=Path(root)))


TokenizerConfig.MOVED_KEYS.update({old: (f"options.{new}", f"with kind: {name}")
                                   for name, kind in KINDS.items() for old, new in kind.options.FORMER_KEYS.items()})


def record_texts(kind: str, record: Mapping[str, Any]) -> list[str]:
    """The text content of one raw record, as the model will see it: a document's text; each part
    of a conversation; a problem rendered as its conversation (calculator annotations become
    python / output parts)."""
    if kind == "document":
        return [record["text"]]
    return conversation_texts(_conversation(kind, record))


def _conversation(kind: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """A conversation or problem record as the conversation the chat template renders."""
    if kind not in ("conversation", "problem"):
        raise ValueError(f"record kind {kind!r} must be document, conversation or problem")
    return as_conversation(record, f"a {kind} record")


def render_record(
    tokenizer: Tokenizer, kind: str, record: Mapping[str, Any]
) -> tuple[list[int], list[int] | None, int]:
    """(ids, loss mask or None, ids kept in the artifact) of one raw record as training sees it:
    a document is BOS + its text (its text alone for a tokenizer without special tokens); a
    conversation or problem goes through the chat template (NoSpecialTokensError without one).
    A document's ids stop one past what the artifact keeps: enough to tell it was cut."""
    if kind == "document":
        bos = [tokenizer.get_bos_token_id()] if tokenizer.has_special_tokens else []
        return [*bos, *tokenizer.encode(record["text"])[:DOC_SAMPLE_TOKENS]], None, DOC_SAMPLE_TOKENS
    ids, mask = tokenizer.render_conversation(_conversation(kind, record))
    return ids, mask, len(ids)


@dataclass(frozen=True)
class SampleRecords:
    """The first records of one split of each snapshot, with each snapshot's record kind: what
    `rendered_samples` renders. Read without a tokenizer, so the stage reads (and checks) them
    before it trains."""

    split: str
    records: dict[str, tuple[str, list[dict[str, Any]]]]  # source name -> (record kind, records)

    @classmethod
    def read(cls, snapshots: Mapping[str, Path], n: int, *, split: str = "train") -> SampleRecords:
        return cls(
            split, {name: (read_meta(path)["kind"], first_records(path, split, n)) for name, path in snapshots.items()}
        )


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


def bytes_per_token(tokenizer: Tokenizer, texts: Iterable[str], *, num_threads: int = 1) -> dict[str, float | int]:
    """UTF-8 bytes per token over `texts`, each encoded on its own without special tokens, in
    batches of METRIC_BATCH_TEXTS texts on `num_threads` of the encoder's threads.

    `unknown_bytes` counts the bytes the tokenizer sent to its unknown-byte id (see
    Tokenizer.count_unknown_bytes); `kept_bytes_per_token` counts only the bytes that survive,
    so a char tokenizer that drops every digit does not look as good as one that keeps them."""
    n_bytes = 0
    n_tokens = 0
    n_unknown = 0
    texts = iter(texts)
    while batch := list(itertools.islice(texts, METRIC_BATCH_TEXTS)):
        n_tokens += sum(map(len, tokenizer.encode(batch, num_threads=num_threads)))
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
            f"raw snapshot {path} not found: add `{name}` under `fetch:` in params.yaml and run "
            f"`dvc repro fetch@{name}`, or remove it from tokenizer.train_sources / tokenizer.metric_sources"
        )
    return path


def _train(cfg: TokenizerConfig, texts: Iterable[str], *, seed: int, root: Path) -> Tokenizer:
    """cfg.train, with a kind's training error (known only once the text or a dictionary file is
    read: it says what does not fit) raised as a ConfigError naming the key to change."""
    if not cfg.kind_options.uses_vocab_size():
        log.info(
            "tokenizer.kind=%s fixes its own vocabulary here; tokenizer.vocab_size=%d is not used",
            cfg.kind,
            cfg.vocab_size,
        )
    try:
        return cfg.train(texts, seed=seed, root=root)
    except training_errors() as e:
        if str(e).startswith("tokenizer."):  # the message names its key already
            raise ConfigError(str(e)) from None
        key = (
            f"tokenizer.vocab_size={cfg.vocab_size}"
            if cfg.kind_options.uses_vocab_size()
            else f"tokenizer.options ({cfg.kind})"
        )
        raise ConfigError(f"{key} does not fit: {e}") from None


def run_tokenizer_stage(cfg: TokenizerConfig, raw_dir: Path, out_dir: Path, metrics_path: Path, *, seed: int,
                        root: Path = Path(".")) -> dict[str, Any]:
    """Train on the capped train text of cfg.train_sources, save to `out_dir` (replaced whole),
    write bytes/token of each metric source's val split to `metrics_path`. Returns the metrics.

    Per source, the metrics give `val_bytes`, `val_tokens`, `bytes_per_token` (all bytes over
    tokens), `val_unknown_bytes` (bytes encoded to the unknown-byte id and lost: only a char
    tokenizer has one, 0 for the other kinds) and `kept_bytes_per_token` (the bytes that survive
    over tokens).

    Every snapshot part the stage reads is checked against its meta.json before training, so a
    damaged snapshot fails in seconds, before the long step, and nothing is published.
    Options that name a file (lz78's `dictionary`) are read relative to `root`, the project."""
    raw_dir, out_dir = Path(raw_dir), Path(out_dir)
    train_dirs = [_snapshot_dir(raw_dir, name) for name in cfg.train_sources]
    metric_dirs = {name: _snapshot_dir(raw_dir, name) for name in cfg.metric_sources}
    # Train sources first, then metric sources: the order a reader meets them in params.
    sample_dirs = {**dict(zip(cfg.train_sources, train_dirs)), **metric_dirs}

    t0 = time.perf_counter()
    for path in train_dirs:
        verify_split(path, "train")
    for path in metric_dirs.values():
        verify_split(path, "val")
    samples = SampleRecords.read(sample_dirs, cfg.artifact_records)
    t_read = time.perf_counter()
    train_texts = capped_train_texts(cfg, train_dirs, verify=False)
    tok = _train(cfg, train_texts, seed=seed, root=root)
    t_train = time.perf_counter()
    log.info("trained %s tokenizer | vocab %d | %d texts | %d chars | %.2fs",
             cfg.kind, tok.get_vocab_size(), train_texts.texts, train_texts.chars, t_train - t_read)  # fmt: skip
    if not tok.has_special_tokens:
        log.warning("the tokenizer has no special tokens (tokenizer.options.specials: false): it is for ids and "
                    "metrics; the cache, training and chat stages will refuse it "
                    "(no <|bos|>, no chat template)")  # fmt: skip

    rendered = rendered_samples(tok, samples, cfg.artifact_records)
    # The artifact sits beside the tokenizer files but is not one of them: meta.json lists only
    # the tokenizer's own files, so the tokenizer's sha256 does not depend on it. atomic_dir
    # fsyncs them all and publishes them together.
    with atomic_dir(out_dir) as tmp:
        meta = tok.write_files(tmp)
        write_json(tmp / RENDERED_FILE, rendered)
    t_save = time.perf_counter()
    per_source = {name: bytes_per_token(tok, snapshot_texts(path, "val", verify=False), num_threads=cfg.encode_threads)
                  for name, path in metric_dirs.items()}
    for name, m in per_source.items():
        log.info(
            "bytes/token %-14s %.3f (%d bytes, %d unknown)", name, m["bytes_per_token"], m["bytes"], m["unknown_bytes"]
        )
        if m["unknown_bytes"]:
            log.warning("%s: %d of %d val bytes (%.2f%%) are outside the %s alphabet and encode to id 0, lost on "
                        "decode; raise tokenizer.options.max_alphabet or train on text that has them",
                        name, m["unknown_bytes"], m["bytes"], 100 * m["unknown_bytes"] / m["bytes"],
                        cfg.kind)  # fmt: skip
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
    log.info("tokenizer stage | check+read %.3fs | train %.3fs | render+save %.3fs | metrics %.3fs",
             t_read - t0, t_train - t_read, t_save - t_train, time.perf_counter() - t_save)  # fmt: skip
    return metrics
