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
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from lockstep.config import ConfigError, FieldError, check_range
from lockstep.io import atomic_dir, write_json, write_json_atomic
from lockstep.parity import RENDERED_FILE, RenderedSamples
from lockstep.records import problem_to_conversation
from lockstep.snapshot import first_records, iter_records, read_meta, verify_split
from lockstep.tokenizer.base import Tokenizer, conversation_texts, train_tokenizer
from lockstep.tokenizer.char import CharOrder
from lockstep.tokenizer.lz78 import DICTIONARY_DIR, LZ78Tokenizer, project_dictionary
from lockstep.tokenizer.lz78_tsv import LZ78DictionaryError

log = logging.getLogger("lockstep.tokenizer")

# Texts encoded per batch call while measuring: large enough to use the encoder's threads, small
# enough that a big val split is never held whole as token lists.
METRIC_BATCH_TEXTS = 8192
# A document sample keeps this many ids (BOS included): enough to see how prose splits, small
# enough that the artifact stays readable.
DOC_SAMPLE_TOKENS = 256


@dataclass(frozen=True)
class TokenizerConfig:
    """The `tokenizer:` params section."""

    kind: Literal["bpe", "hf", "lz78", "sentencepiece", "char", "byte"] = "bpe"
    # ids in all, the 9 special tokens included (bpe, hf, lz78, sentencepiece); char and byte fix
    # their own, and so does an lz78 tokenizer read from lz78_dictionary
    vocab_size: int = 4096
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
    # lz78 only: how the dictionary is learned (lockstep.tokenizer.lz78_trie.train_lz78):
    # standard (the plain parse, stops adding at the budget), frequency_gated (evicts leaves that
    # fewer than lz78_gate_min_count phrases reached, every lz78_gate_period_phrases phrases), or
    # multi_round (parse to lz78_round_factor x the budget, keep the most used codes)
    lz78_strategy: Literal["standard", "frequency_gated", "multi_round"] = "standard"
    lz78_gate_period_phrases: int = 4096
    lz78_gate_min_count: int = 2
    lz78_round_factor: int = 4
    lz78_chunking: bool = False  # lz78 only: split text with bpe's pattern first; no token spans two chunks
    # lz78 only: a dictionary trained elsewhere (TSV, `lz78` or `compressed` layout) instead of
    # training one; a path under corpus/dictionaries/, which the tokenizer stage depends on
    lz78_dictionary: str | None = None
    # lz78_dictionary only: the byte prefixes of its tokens that the file lacks stay out ("file":
    # ids and longest-match splits as the reference LZ78 tokenizer gives them) or become extra
    # codes after the file's ("closed": every code is its parent plus one byte)
    lz78_prefixes: Literal["file", "closed"] = "file"
    encode_threads: int = 1  # the encoder's threads for counting val tokens (bpe, sentencepiece)
    artifact_records: int = 8  # records per source rendered into rendered_samples.json (parity artifact)

    def __post_init__(self) -> None:
        # FieldError names the key within the section; build_config adds the `tokenizer.` prefix,
        # and the stage's entry prints the one `error:` line.
        learns = self.kind in ("bpe", "hf", "sentencepiece", "char") or (self.kind == "lz78" and self.lz78_dictionary is None)
        if learns and not self.train_sources:
            raise FieldError("train_sources", list(self.train_sources),
                             f"names no raw source; a {self.kind} tokenizer learns from the train split of at least one: "
                             "list them, e.g. [wikitext]")
        # The smallest vocabulary each learning kind can build (its trainer refuses less): every
        # byte value and the 9 special tokens, plus sentencepiece's <unk> and one learned piece,
        # or lz78's root and one learned code. A billion ids is past any embedding table worth
        # training and well inside the uint32 ids of the token files.
        least = {"bpe": 265, "hf": 265, "sentencepiece": 267, "lz78": 267}.get(self.kind)
        if least is not None and self.lz78_dictionary is None:
            check_range("vocab_size", self.vocab_size, ge=least, le=10**9,
                        why=f"ids in all for a {self.kind} tokenizer, 256 bytes and 9 special tokens included")
        check_range("max_chars", self.max_chars, ge=1, why="characters of train text the tokenizer learns from")
        # More threads than any machine's cores only costs memory; a huge count fails to start them.
        check_range("encode_threads", self.encode_threads, ge=1, le=1024, why="threads counting val tokens")
        check_range("artifact_records", self.artifact_records, ge=0, why="records per source in rendered_samples.json; 0 keeps none")
        check_range("char_max_alphabet", self.char_max_alphabet, ge=1, le=256, why="distinct byte values a char tokenizer keeps")
        if self.lz78_dictionary is not None:
            if self.kind != "lz78":
                raise ConfigError(f"tokenizer.lz78_dictionary applies to kind lz78 only; set kind: lz78, or "
                                  f"lz78_dictionary: null to train a {self.kind} tokenizer")
            path = PurePosixPath(self.lz78_dictionary)
            if path.is_absolute() or ".." in path.parts or path.parts[:2] != DICTIONARY_DIR.parts:
                raise ConfigError(f"tokenizer.lz78_dictionary={self.lz78_dictionary!r} must be a relative path under "
                                  f"{DICTIONARY_DIR}/ (the folder the tokenizer stage depends on, so a changed "
                                  f"dictionary reruns it): copy the file there and name it as {DICTIONARY_DIR}/<file>")
        if self.lz78_prefixes != "file" and self.lz78_dictionary is None:
            raise FieldError("lz78_prefixes", self.lz78_prefixes,
                             "applies to a dictionary read from tokenizer.lz78_dictionary (a trained one has every "
                             "prefix already): set lz78_dictionary, or lz78_prefixes: file")
        for name in ("lz78_gate_period_phrases", "lz78_gate_min_count", "lz78_round_factor"):
            check_range(name, getattr(self, name), ge=1, why="lz78 training only")
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
        if self.kind == "lz78":
            options: dict[str, Any] = {"vocab_size": self.vocab_size, "chunking": self.lz78_chunking, "strategy": self.lz78_strategy}
            if self.lz78_strategy == "frequency_gated":
                options.update(gate_period_phrases=self.lz78_gate_period_phrases, gate_min_count=self.lz78_gate_min_count)
            elif self.lz78_strategy == "multi_round":
                options["round_factor"] = self.lz78_round_factor
            return options
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
        return [*bos, *tokenizer.encode(record["text"])[:DOC_SAMPLE_TOKENS]], None, DOC_SAMPLE_TOKENS
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
    `rendered_samples` renders. Read without a tokenizer, so the stage reads (and checks) them
    before it trains."""

    split: str
    records: dict[str, tuple[str, list[dict[str, Any]]]]  # source name -> (record kind, records)

    @classmethod
    def read(cls, snapshots: Mapping[str, Path], n: int, *, split: str = "train") -> SampleRecords:
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
            f"raw snapshot {path} not found: add `{name}` under `fetch:` in params.yaml and run `dvc repro fetch@{name}`, "
            "or remove it from tokenizer.train_sources / tokenizer.metric_sources"
        )
    return path


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
    `cfg.lz78_dictionary`, when set, is read relative to `root` (the project) instead of training."""
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
    if cfg.lz78_dictionary is not None:
        try:
            tok: Tokenizer = LZ78Tokenizer.from_dictionary(project_dictionary(root, cfg.lz78_dictionary),
                                                           chunking=cfg.lz78_chunking, prefixes=cfg.lz78_prefixes)
        except LZ78DictionaryError as e:
            raise ConfigError(f"tokenizer.lz78_dictionary={cfg.lz78_dictionary!r}: {e}") from None
        log.info("lz78 dictionary %s: %d codes, vocab %d (tokenizer.vocab_size is not used)",
                 cfg.lz78_dictionary, tok.n_codes, tok.get_vocab_size())
    else:
        tok = train_tokenizer(cfg.kind, train_texts, **cfg.train_options(seed))
    t_train = time.perf_counter()
    log.info("trained %s tokenizer | vocab %d | %d texts | %d chars | %.2fs",
             cfg.kind, tok.get_vocab_size(), train_texts.texts, train_texts.chars, t_train - t_read)  # fmt: skip
    if not tok.has_special_tokens:
        log.warning("the tokenizer has no special tokens (tokenizer.char_specials: false): it is for ids and metrics; "
                    "the cache, training and chat stages will refuse it (no <|bos|>, no chat template)")  # fmt: skip

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
    log.info("tokenizer stage | check+read %.3fs | train %.3fs | render+save %.3fs | metrics %.3fs",
             t_read - t0, t_train - t_read, t_save - t_train, time.perf_counter() - t_save)  # fmt: skip
    return metrics
