"""The `cache@<name>` stage's work around lockstep.data.cache_build: check that the raw snapshot holds
the records the cache kind needs, pick the encoding processes, and build the pretrain shards or
the SFT examples with their parity artifacts. The typed `cache.<name>` section, the paths and the
data seed come from the caller (stages/cache.py); nothing here reads params.yaml or argv."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lockstep.core.config import ConfigError
from lockstep.data.cache import CacheError
from lockstep.data.cache_build import CacheConfig, build_pretrain_cache, build_sft_cache, encode_workers
from lockstep.data.snapshot import SnapshotError, iter_records, read_meta
from lockstep.tokenizer import load_tokenizer
from lockstep.tokenizer.base import NoSpecialTokensError, TokenizerFileError

# Errors whose message says what to fix: the stage's entry point prints them as one `error:` line.
ERRORS = (ConfigError, CacheError, SnapshotError, TokenizerFileError, NoSpecialTokensError, FileNotFoundError)


def _texts(raw: Path, split: str) -> Iterator[str]:
    for record in iter_records(raw, split):
        yield record["text"]


def run_cache_stage(name: str, cfg: CacheConfig, *, raw: Path, tokenizer: Path, out: Path,
                    data_seed: int) -> dict[str, Any]:
    """Build the cache `cache.<name>` (`cfg`) from the snapshot `raw` with the tokenizer folder
    `tokenizer` into `out`, shuffled and split as `data_seed` draws; return its meta.json. A
    snapshot of the wrong record kind raises CacheError naming the key to change (CacheConfig
    itself refuses a setting of the other cache kind)."""
    log = logging.getLogger("lockstep.cache")
    tok = load_tokenizer(tokenizer)
    raw_meta = read_meta(raw)
    kind = raw_meta["kind"]
    common = dict(dataset_name=name, dataset_config=raw_meta.get("config"), artifact_records=cfg.artifact_records)
    if cfg.kind == "pretrain":
        if kind != "document":
            raise CacheError(
                f"cache.{name}: kind pretrain needs a document snapshot, {raw} holds {kind}s; set kind: sft"
            )
        # CacheConfig refused counts above any machine's; one above this machine's cores is capped.
        workers = encode_workers(cfg.num_workers, key=f"cache.{name}.num_workers")
        log.info("cache %s: encoding %s", name,
                 f"in {workers} worker processes" if workers > 1 else f"in this process on {cfg.num_threads} thread(s)")
        meta = build_pretrain_cache(
            {"train": _texts(raw, "train"), "val": _texts(raw, "val")},
            out,
            tokenizer=tok,
            max_train_tokens=cfg.max_train_tokens,
            max_val_tokens=cfg.max_val_tokens,
            shard_bytes=cfg.shard_bytes,
            seed=data_seed,
            shuffle_buffer=cfg.shuffle_buffer,
            encode_batch_docs=cfg.encode_batch_docs,
            num_threads=cfg.num_threads,
            num_workers=workers,
            tokenizer_dir=tokenizer,
            text_bytes=raw_meta.get("text_bytes"),
            **common,
        )
    else:
        if kind not in ("conversation", "problem"):
            raise CacheError(f"cache.{name}: kind sft needs a conversation or problem snapshot, {raw} holds {kind}s")
        if cfg.val_frac is None:
            examples: Any = {"train": iter_records(raw, "train"), "val": iter_records(raw, "val")}
        else:
            examples = iter_records(raw, "train")
        meta = build_sft_cache(examples, out, tokenizer=tok, val_frac=cfg.val_frac, seed=data_seed, **common)
    log.info("cache %s (%s): train %s tokens, val %s tokens -> %s", name, cfg.kind, meta["train_tokens"],
             meta["val_tokens"], out)
    return meta
