"""Stage `cache@<name>`: one raw snapshot + the tokenizer -> a token cache (pretrain shards or SFT
examples) with its parity artifacts. Parses paths and params; the work is in lockstep.cache_build."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lockstep.cache import CacheError
from lockstep.cache_build import CacheConfig, build_pretrain_cache, build_sft_cache, encode_workers
from lockstep.config import ConfigError
from lockstep.snapshot import SnapshotError, iter_records, read_meta
from lockstep.tokenizer import load_tokenizer
from lockstep.tokenizer.base import NoSpecialTokensError, TokenizerFileError
from stages._common import entry, preamble

# Errors whose message says what to fix: the entry point prints them as one `error: ...` line.
STAGE_ERRORS = (ConfigError, CacheError, SnapshotError, TokenizerFileError, NoSpecialTokensError, FileNotFoundError)


def _texts(raw: Path, split: str) -> Iterator[str]:
    for record in iter_records(raw, split):
        yield record["text"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("name", help="entry of the params `cache:` section")
    ap.add_argument("--raw", type=Path, required=True, help="raw snapshot folder, data/raw/<source>")
    ap.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder, data/tokenizer")
    ap.add_argument("--out", type=Path, required=True, help="cache folder to write, data/cache/<kind>/<name>")
    args = ap.parse_args(argv)
    pre = preamble("cache")
    cfg = pre.section(f"cache.{args.name}", CacheConfig)
    seed = pre.data_seed
    tok = load_tokenizer(args.tokenizer)
    raw_meta = read_meta(args.raw)
    kind = raw_meta["kind"]
    common = dict(dataset_name=args.name, dataset_config=raw_meta.get("config"), artifact_records=cfg.artifact_records)
    if cfg.kind == "pretrain":
        if kind != "document":
            raise CacheError(f"cache.{args.name}: kind pretrain needs a document snapshot, {args.raw} holds {kind}s; set kind: sft")
        if cfg.val_frac is not None:
            raise CacheError(f"cache.{args.name}.val_frac applies to SFT caches only; remove it (pretrain keeps the snapshot's split)")
        # CacheConfig refused counts above any machine's; one above this machine's cores is capped.
        workers = encode_workers(cfg.num_workers, key=f"cache.{args.name}.num_workers")
        pre.log.info("cache %s: encoding %s", args.name,
                     f"in {workers} worker processes" if workers > 1 else f"in this process on {cfg.num_threads} thread(s)")
        meta = build_pretrain_cache(
            {"train": _texts(args.raw, "train"), "val": _texts(args.raw, "val")},
            args.out,
            tokenizer=tok,
            max_train_tokens=cfg.max_train_tokens,
            max_val_tokens=cfg.max_val_tokens,
            shard_bytes=cfg.shard_bytes,
            seed=seed,
            shuffle_buffer=cfg.shuffle_buffer,
            encode_batch_docs=cfg.encode_batch_docs,
            num_threads=cfg.num_threads,
            num_workers=workers,
            tokenizer_dir=args.tokenizer,
            text_bytes=raw_meta.get("text_bytes"),
            **common,
        )
    else:
        if kind not in ("conversation", "problem"):
            raise CacheError(f"cache.{args.name}: kind sft needs a conversation or problem snapshot, {args.raw} holds {kind}s")
        if cfg.max_train_tokens is not None or cfg.max_val_tokens is not None:
            raise CacheError(f"cache.{args.name}: max_train_tokens/max_val_tokens apply to pretrain caches only; remove them")
        if cfg.num_workers is not None:
            raise CacheError(f"cache.{args.name}.num_workers applies to pretrain caches only (SFT rendering runs in "
                             "the stage's process); remove it")
        if cfg.val_frac is None:
            examples: Any = {"train": iter_records(args.raw, "train"), "val": iter_records(args.raw, "val")}
        else:
            examples = iter_records(args.raw, "train")
        meta = build_sft_cache(examples, args.out, tokenizer=tok, val_frac=cfg.val_frac, seed=seed, **common)
    pre.log.info(
        "cache %s (%s): train %s tokens, val %s tokens -> %s",
        args.name, cfg.kind, meta["train_tokens"], meta["val_tokens"], args.out,
    )  # fmt: skip
    return meta


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
