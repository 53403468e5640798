"""Token caches on disk: the format (dtypes, shard names, meta.json and what it must list) and
checked, memory-mapped readers. Writing caches is lockstep.data.cache_build's job; turning them into
(x, y) batches is lockstep.data.loaders'. Kept apart from the builder so that the stages that only read
caches (training, eval) do not depend on how caches are built."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lockstep.core.config import ConfigError
from lockstep.core.io import read_json, sha256_file

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
# ~128 MB per shard: big enough that a 10B-token corpus is a few hundred files, small enough to
# hash and copy one at a time.
DEFAULT_SHARD_BYTES = 128 * 2**20
SPLITS = ("train", "val")
# A vocabulary of 65,536 ids uses ids 0..65,535, all of which fit uint16; uint32 only above that.
_UINT16_MAX_VOCAB = 65_536


class CacheError(ValueError):
    """A cache on disk is missing, damaged, or does not fit the tokenizer in use."""


class CacheTooSmallError(CacheError):
    """A sound cache split that holds too little for what was asked of it (fewer tokens than one
    window or step, no usable example). Callers that may skip a small split catch this one and
    let every other CacheError, damage included, through."""


# ---------------------------------------------------------------------------------------------
# dtypes and checks


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian uint16 for vocabularies of up to 65,536 ids (ids 0..65,535), uint32 above."""
    if vocab_size <= 0:
        raise CacheError(f"vocab_size={vocab_size} must be positive")
    if vocab_size <= _UINT16_MAX_VOCAB:
        return np.dtype("<u2")
    if vocab_size <= 2**32:
        return np.dtype("<u4")
    raise CacheError(f"vocab_size={vocab_size} does not fit uint32 token files")


def dtype_name(dtype: np.dtype) -> str:
    return {np.dtype("<u2"): "uint16", np.dtype("<u4"): "uint32"}[np.dtype(dtype)]


def dtype_from_name(name: str, where: Path) -> np.dtype:
    try:
        return {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}[name]
    except KeyError:
        raise CacheError(f"{where}: token_dtype {name!r} is not uint16 or uint32; rebuild the cache") from None


# ---------------------------------------------------------------------------------------------
# shard files


def _shard_name(i: int) -> str:
    """The file name of a split's i-th shard, as written and as meta.json must list it."""
    return f"shard_{i:05d}.bin"


# ---------------------------------------------------------------------------------------------
# readers

# The counts each kind of meta.json must carry besides its file list (`shards` or `files`).
_KIND_COUNTS = {
    "pretrain": ("train_tokens", "val_tokens"),
    "sft": ("train_tokens", "val_tokens", "train_examples", "val_examples"),
}
_SFT_SUFFIXES = ("tokens.bin", "mask.bin", "idx.npy")


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_sha256(x: Any) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


def _check_pretrain_listing(meta: dict[str, Any], path: Path) -> None:
    """Every split lists its shards in writing order, and the listed counts add up to the split's
    total, so a shard entry deleted from or added to meta.json is caught here."""
    shards = meta["shards"]
    if not isinstance(shards, dict) or any(not isinstance(shards.get(s), list) for s in SPLITS):
        raise CacheError(f"{path}: `shards` must map train and val to lists of shards; rebuild the cache")
    for split in SPLITS:
        for i, e in enumerate(shards[split]):
            if not (isinstance(e, dict) and e.get("name") == _shard_name(i) and _is_count(e.get("tokens"))
                    and _is_sha256(e.get("sha256"))):
                raise CacheError(f"{path}: shards.{split}[{i}] is not {{name: {_shard_name(i)}, tokens: <count>, "
                                 "sha256: <hex digest>}; the shard list was edited or damaged, rebuild the cache")
        listed = sum(e["tokens"] for e in shards[split])
        if listed != meta[f"{split}_tokens"]:
            raise CacheError(
                f"{path}: the {len(shards[split])} {split} shards listed hold {listed} tokens, but "
                f"{split}_tokens is {meta[f'{split}_tokens']}; the shard list was edited, rebuild the cache"
            )


def _check_sft_listing(meta: dict[str, Any], path: Path) -> None:
    files = meta["files"]
    for name in (f"{split}_{suffix}" for split in SPLITS for suffix in _SFT_SUFFIXES):
        e = files.get(name) if isinstance(files, dict) else None
        if not (isinstance(e, dict) and _is_count(e.get("bytes")) and _is_sha256(e.get("sha256"))):
            raise CacheError(f"{path}: files.{name} is missing or lacks its bytes/sha256; rebuild the cache")


def read_cache_meta(cache_dir: str | os.PathLike[str], *, kind: str | None = None) -> dict[str, Any]:
    """meta.json of a cache, checked for the fields readers rely on: the identity fields, the
    per-split counts of its kind, and a well-formed file list whose counts add up."""
    path = Path(cache_dir) / "meta.json"
    if not path.is_file():
        raise CacheError(f"{path} is missing: the cache is absent or its build did not finish; re-run its cache stage")
    try:
        meta = read_json(path, what="cache meta")
    except (ValueError, OSError) as e:
        raise CacheError(f"{path} is unreadable ({e}); delete {Path(cache_dir)} and re-run its cache stage") from None
    need = ["format_version", "kind", "token_dtype", "tokenizer_sha256", "vocab_size"]
    missing = [k for k in need if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise CacheError(f"{path} lacks {', '.join(missing)}; rebuild the cache with this version")
    if meta["format_version"] != FORMAT_VERSION:
        raise CacheError(f"{path}: format_version {meta['format_version']} != {FORMAT_VERSION}; rebuild the cache")
    if kind is not None and meta["kind"] != kind:
        raise CacheError(f"{path}: a {meta['kind']} cache, expected a {kind} cache; check the path")
    if meta["kind"] not in _KIND_COUNTS:
        raise CacheError(f"{path}: kind {meta['kind']!r} is neither pretrain nor sft; rebuild the cache")
    listing = "shards" if meta["kind"] == "pretrain" else "files"
    missing = [k for k in (listing, *_KIND_COUNTS[meta["kind"]]) if k not in meta]
    if missing:
        raise CacheError(f"{path} lacks {', '.join(missing)} for a {meta['kind']} cache; rebuild the cache")
    for k in _KIND_COUNTS[meta["kind"]]:
        if not _is_count(meta[k]):
            raise CacheError(f"{path}: {k}={meta[k]!r} is not a count; rebuild the cache")
    # The id bound the readers check token files against: it must be the one the dtype was chosen for.
    vocab = meta["vocab_size"]
    if not _is_count(vocab) or vocab == 0 or vocab > 2**32 or meta["token_dtype"] != dtype_name(token_dtype(vocab)):
        raise CacheError(
            f"{path}: vocab_size={vocab!r} does not fit token_dtype={meta['token_dtype']!r} (uint16 up to "
            f"{_UINT16_MAX_VOCAB} ids, uint32 above); meta.json was edited, {rebuild_hint(Path(cache_dir))}"
        )
    if meta["kind"] == "pretrain":
        _check_pretrain_listing(meta, path)
    else:
        _check_sft_listing(meta, path)
    return meta


def rebuild_hint(cache_dir: Path) -> str:
    """How to rebuild the cache at `cache_dir` (data/cache/<kind>/<name> is stage cache@<name>)."""
    return f"rebuild it with `dvc repro --force cache@{cache_dir.name}`"


def _check_values(path: Path, arr: np.ndarray, bound: int, cache_dir: Path, *, ids: bool) -> None:
    """Refuse a token file (`ids`: values < the vocabulary size `bound`) or a loss-mask file
    (`bound` 2: bytes 0 and 1) holding a value out of range. The sha256 in meta.json proves only
    that a file is the one meta.json lists, and the two can be edited together; an id beyond the
    vocabulary crashes the embedding lookup (a device-side assert on CUDA), a mask byte of 2
    weighs its token twice. Cost: one vectorised max over the memory map, i.e. one more read of
    the file, from the page cache right after the sha256 pass: about 5 ms on a 128 MB shard whose
    open takes 83 ms without it, 1.06x (bench/bench_cache.py --open-check)."""
    if arr.size == 0:
        return
    top = int(arr.max())
    if top < bound:
        return
    at = int(np.argmax(arr >= bound))  # the first bad position (a full scan, on this failure path only)
    if ids:
        found, rule = f"token id {int(arr[at])}", f"outside the vocabulary of {bound} ids (0..{bound - 1}) in meta.json"
    else:
        found, rule = f"mask byte {int(arr[at])}", "where a loss mask holds only 0 and 1"
    raise CacheError(
        f"{path} holds {found} at position {at}, {rule} (largest value: {top}); the file was altered though its "
        f"sha256 matches meta.json, so both were edited: {rebuild_hint(cache_dir)}"
    )


def check_tokenizer(meta: Mapping[str, Any], tokenizer_sha256: str | None, where: Path) -> None:
    if tokenizer_sha256 is not None and meta["tokenizer_sha256"] != tokenizer_sha256:
        raise CacheError(
            f"{where} was built with tokenizer {meta['tokenizer_sha256'][:12]}…, but the tokenizer in use is "
            f"{tokenizer_sha256[:12]}…; re-run the cache stage after the tokenizer stage (dvc repro)"
        )


def open_token_file(path: Path, dtype: np.dtype, tokens: int, sha256: str | None, *, verify: bool) -> np.ndarray:
    """Memory-map one token file after checking its size (and sha256 when `verify`)."""
    if not path.is_file():
        raise CacheError(f"{path} is missing; the cache is incomplete, re-run its cache stage")
    size_bytes = path.stat().st_size
    if size_bytes % dtype.itemsize:
        raise CacheError(
            f"{path} has an odd byte count ({size_bytes}) for {dtype_name(dtype)} tokens; it is damaged, "
            "rebuild the cache"
        )
    if size_bytes // dtype.itemsize != tokens:
        state = "truncated" if size_bytes // dtype.itemsize < tokens else "longer than recorded"
        raise CacheError(
            f"{path} is {state}: {size_bytes // dtype.itemsize} tokens on disk, meta.json says {tokens}; "
            "rebuild the cache"
        )
    if verify and sha256 is not None and sha256_file(path) != sha256:
        raise CacheError(
            f"{path} fails its sha256 check against meta.json; it was modified or damaged, rebuild the cache"
        )
    if tokens == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(tokens,))


@dataclass(frozen=True)
class PretrainSplit:
    """The shards of one split, memory-mapped."""

    directory: Path
    meta: dict[str, Any]
    shards: tuple[np.ndarray, ...]
    shard_names: tuple[str, ...]

    @property
    def tokens(self) -> int:
        return sum(s.size for s in self.shards)


def open_pretrain_split(
    shards_dir: str | os.PathLike[str], *, tokenizer_sha256: str | None = None, verify: bool = True
) -> PretrainSplit:
    """Open `<cache>/<split>/` (meta.json is in `<cache>/`), checking every shard."""
    shards_dir = Path(shards_dir)
    split = shards_dir.name
    meta = read_cache_meta(shards_dir.parent, kind="pretrain")
    meta_path = shards_dir.parent / "meta.json"
    check_tokenizer(meta, tokenizer_sha256, meta_path)
    if split not in meta["shards"]:
        raise CacheError(f"{meta_path} lists no split {split!r}; pass <cache>/train or <cache>/val")
    dtype = dtype_from_name(meta["token_dtype"], meta_path)
    entries = meta["shards"][split]
    listed = {e["name"] for e in entries}
    # Dot-names are work files of an interrupted write, never part of a published split.
    on_disk = [p.name for p in shards_dir.iterdir() if not p.name.startswith(".")] if shards_dir.is_dir() else []
    extra = sorted(set(on_disk) - listed)
    if extra:
        raise CacheError(f"{shards_dir / extra[0]} is not listed in {meta_path} ({len(extra)} unlisted file(s) in "
                         f"{shards_dir}); the folder and its meta.json disagree, rebuild the cache")
    shards = []
    for e in entries:
        shard = open_token_file(shards_dir / e["name"], dtype, int(e["tokens"]), e["sha256"], verify=verify)
        if verify:  # right after its sha256 pass, while the shard's pages are in the page cache
            _check_values(shards_dir / e["name"], shard, meta["vocab_size"], shards_dir.parent, ids=True)
        shards.append(shard)
    return PretrainSplit(shards_dir, meta, tuple(shards), tuple(e["name"] for e in entries))


@dataclass(frozen=True)
class SFTSplit:
    """One SFT split: tokens and loss mask memory-mapped, offsets in memory."""

    tokens: np.ndarray  # (N,) uint16/uint32
    mask: np.ndarray  # (N,) uint8, 1 = supervised
    offsets: np.ndarray  # (E,) int64 start of each example
    meta: dict[str, Any]

    def __len__(self) -> int:
        return int(self.offsets.size)

    def bounds(self, i: int) -> tuple[int, int]:
        end = int(self.offsets[i + 1]) if i + 1 < self.offsets.size else int(self.tokens.size)
        return int(self.offsets[i]), end


def open_sft_split(
    tokens_path: str | os.PathLike[str],
    idx_path: str | os.PathLike[str],
    *,
    tokenizer_sha256: str | None = None,
    verify: bool = True,
) -> SFTSplit:
    """Open `<cache>/<split>_tokens.bin` with its `_idx.npy` and `_mask.bin`, checking all three."""
    tokens_path, idx_path = Path(tokens_path), Path(idx_path)
    cache_dir = tokens_path.parent
    meta_path = cache_dir / "meta.json"
    meta = read_cache_meta(cache_dir, kind="sft")
    check_tokenizer(meta, tokenizer_sha256, meta_path)
    split = tokens_path.name.removesuffix("_tokens.bin")
    if split not in SPLITS:
        raise CacheError(f"{tokens_path}: expected train_tokens.bin or val_tokens.bin")
    if idx_path.name != f"{split}_idx.npy":
        raise CacheError(f"{idx_path} is not the index of {tokens_path.name}; pass {split}_idx.npy")
    files = meta["files"]
    for p in (tokens_path, idx_path, cache_dir / f"{split}_mask.bin"):
        if p.name not in files:
            raise CacheError(f"{meta_path} does not list {p.name}; rebuild the cache")
    dtype = dtype_from_name(meta["token_dtype"], meta_path)
    n_tokens = int(meta[f"{split}_tokens"])
    tokens = open_token_file(tokens_path, dtype, n_tokens, files[tokens_path.name]["sha256"], verify=verify)
    mask_path = cache_dir / f"{split}_mask.bin"
    mask = open_token_file(mask_path, np.dtype("u1"), n_tokens, files[mask_path.name]["sha256"], verify=verify)
    if verify:
        _check_values(tokens_path, tokens, meta["vocab_size"], cache_dir, ids=True)
        _check_values(mask_path, mask, 2, cache_dir, ids=False)
    if not idx_path.is_file():
        raise CacheError(f"{idx_path} is missing; re-run the cache stage")
    if verify and sha256_file(idx_path) != files[idx_path.name]["sha256"]:
        raise CacheError(f"{idx_path} fails its sha256 check against meta.json; rebuild the cache")
    try:
        offsets = np.load(idx_path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise CacheError(f"{idx_path} is unreadable ({e}); rebuild the cache") from None
    n_ex = int(meta[f"{split}_examples"])
    if offsets.dtype != np.int64 or offsets.shape != (n_ex,):
        raise CacheError(
            f"{idx_path} holds {offsets.dtype} {offsets.shape}, expected int64 ({n_ex},); rebuild the cache"
        )
    if n_ex and (offsets[0] != 0 or (np.diff(offsets) <= 0).any() or offsets[-1] >= n_tokens):
        raise CacheError(f"{idx_path}: offsets are not strictly increasing from 0 within {n_tokens} tokens; rebuild")
    return SFTSplit(tokens, mask, offsets, meta)


def list_caches(root: str | os.PathLike[str]) -> list[Path]:
    """The cache folders directly under `root` (e.g. data/cache/pretrain), sorted by name. Names
    starting with a dot are left out: they are the work folders of a write in progress or of one
    that was killed (lockstep.core.io.atomic_dir), never a published cache. A missing root holds none."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def find_cache(root: Path, name: str, *, key: str) -> tuple[str, Path]:
    """(kind, folder) of the cache that config entry `key` names under the caches folder `root`:
    `pretrain/x` or `sft/x` explicitly, or a bare name looked up under pretrain/ then sft/. Only
    a folder with a meta.json counts; reading it is the opener's job."""
    if "/" in name:
        kind, _, bare = name.partition("/")
        if kind not in ("pretrain", "sft"):
            raise ConfigError(f"{key}: cache {name!r} must be pretrain/NAME, sft/NAME or a bare NAME")
        candidates = [(kind, root / kind / bare)]
    else:
        candidates = [("pretrain", root / "pretrain" / name), ("sft", root / "sft" / name)]
    for kind, path in candidates:
        if (path / "meta.json").is_file():
            return kind, path
    raise ConfigError(f"{key}: none of {[str(p) for _, p in candidates]} holds a cache (a meta.json); add the "
                      "cache stage that writes it or fix the name")


def cache_summary(cache_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Stats of a cache for people: kind, dtype, tokenizer, tokens/docs/shards per split."""
    meta = read_cache_meta(cache_dir)
    out: dict[str, Any] = {
        k: meta.get(k) for k in ("kind", "dataset_name", "token_dtype", "vocab_size", "tokenizer_sha256", "seed")
    }
    for split in SPLITS:
        s: dict[str, Any] = {"tokens": meta.get(f"{split}_tokens")}
        if meta["kind"] == "pretrain":
            s["docs"] = meta.get(f"{split}_docs")
            s["shards"] = len(meta.get("shards", {}).get(split, []))
        else:
            s["examples"] = meta.get(f"{split}_examples")
            s["supervised_tokens"] = meta.get(f"{split}_supervised_tokens")
        out[split] = s
    return out


__all__ = [
    "CacheError",
    "CacheTooSmallError",
    "DEFAULT_SHARD_BYTES",
    "PretrainSplit",
    "SFTSplit",
    "cache_summary",
    "check_tokenizer",
    "list_caches",
    "open_pretrain_split",
    "open_sft_split",
    "read_cache_meta",
    "token_dtype",
]
