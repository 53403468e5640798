"""Source loaders behind the `fetch@<source>` stages: each source becomes a raw snapshot,
`data/raw/<name>/{train,val}/part_NNNNN.parquet` + meta.json, published atomically, in the format
lockstep.snapshot defines (and re-exports here). Knows nothing of tokenizers or caches; later
stages read the snapshots through lockstep.snapshot, without loading any source loader."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

from lockstep.config import config_to_dict
from lockstep.io import atomic_dir
from lockstep.sources.common import SourceFormatError, SplitLayoutError
from lockstep.sources.dolly15k import Dolly15kConfig
from lockstep.sources.fineweb_edu import FinewebEduConfig
from lockstep.sources.gsm8k import Gsm8kConfig
from lockstep.sources.gutenberg import GutenbergConfig
from lockstep.sources.oasst1 import Oasst1Config
from lockstep.sources.roam import RoamConfig
from lockstep.sources.shakespeare import ShakespeareConfig
from lockstep.snapshot import (
    DEFAULT_PART_BYTES,
    BadRecordError,
    SnapshotError,
    SnapshotWriter,
    iter_records,
    read_meta,
    verify_split,
)
from lockstep.sources.synth_chat import SynthChatConfig
from lockstep.sources.synth_math import SynthMathConfig
from lockstep.sources.wikitext import WikitextConfig

# `source:` value in params -> its config class; the loader lives in lockstep.sources.<source>,
# which defines KIND, EXTRA_FIELDS, EXPECTED (its input format, for errors) and produce().
SOURCE_CONFIGS: dict[str, type] = {
    "fineweb_edu": FinewebEduConfig,
    "wikitext": WikitextConfig,
    "roam": RoamConfig,
    "gutenberg": GutenbergConfig,
    "dolly15k": Dolly15kConfig,
    "oasst1": Oasst1Config,
    "gsm8k": Gsm8kConfig,
    "shakespeare": ShakespeareConfig,
    "synth_math": SynthMathConfig,
    "synth_chat": SynthChatConfig,
}

__all__ = [
    "SOURCE_CONFIGS",
    "BadRecordError",
    "SnapshotError",
    "SourceFormatError",
    "SplitLayoutError",
    "fetch_source",
    "iter_records",
    "read_meta",
    "source_kind",
    "verify_split",
]


def _module(source: str) -> Any:
    if source not in SOURCE_CONFIGS:
        raise ValueError(f"unknown source {source!r}; choose one of {', '.join(sorted(SOURCE_CONFIGS))}")
    return importlib.import_module(f"lockstep.sources.{source}")


def source_kind(source: str) -> str:
    """The record kind (document / conversation / problem) a source yields."""
    return _module(source).KIND


def fetch_source(name: str, cfg: Any, out_dir: str | Path, *, seed: int, part_bytes: int = DEFAULT_PART_BYTES) -> dict[str, Any]:
    """Read the source described by `cfg` (one of SOURCE_CONFIGS' classes) and publish its
    snapshot, parity artifact dataset_snapshot.json included, at `out_dir` atomically: on any
    error the previous snapshot, if any, is untouched and nothing half-written appears. A source
    that keeps no record at all fails with SourceFormatError rather than publish an empty
    snapshot. Returns the meta dict also written to meta.json."""
    if not dataclasses.is_dataclass(cfg) or type(cfg) not in SOURCE_CONFIGS.values():
        raise TypeError(f"cfg must be one of the source configs ({', '.join(c.__name__ for c in SOURCE_CONFIGS.values())}), got {type(cfg).__name__}")
    source = cfg.source
    mod = _module(source)
    with atomic_dir(out_dir) as tmp:
        sink = SnapshotWriter(
            tmp, kind=mod.KIND, extra_fields=mod.EXTRA_FIELDS, strict=cfg.strict, part_bytes=part_bytes,
            artifact_records=cfg.artifact_records,
        )  # fmt: skip
        try:
            extra = mod.produce(cfg, sink, seed=seed)
            if sink.count("train") + sink.count("val") == 0:
                raise _nothing_usable(name, source, mod.EXPECTED, sink, extra)
        except BaseException:
            sink.abort()
            raise
        fields = {"shuffle_seed": None, "shuffle_buffer": None, **extra}
        meta = sink.close(name=name, source=source, config=config_to_dict(cfg), seed=seed, **fields)
    return meta


def _nothing_usable(name: str, source: str, expected: str, sink: SnapshotWriter, extra: dict[str, Any]) -> SourceFormatError:
    """The error for a source that read its input and kept no record: an empty snapshot would
    pass for data downstream, so the fetch fails instead, saying what it found."""
    inputs = sorted(extra.get("input_sha256") or [])
    where = str(extra.get("source_id", source))
    if inputs:
        where = ", ".join(inputs[:5]) + (f" and {len(inputs) - 5} more" if len(inputs) > 5 else "")
    why = [f"{sink.skipped} bad"]
    if extra.get("filtered_trees"):
        why.append(f"{extra['filtered_trees']} tree(s) filtered out (no usable reply in the chosen `lang`)")
    if extra.get("rows_below_min_int_score"):
        why.append(f"{extra['rows_below_min_int_score']} row(s) below `min_int_score`")
    problems = f"; first problems: {' | '.join(sink.bad_examples[:3])}" if sink.bad_examples else ""
    return SourceFormatError(
        f"fetch {name} ({source}): no usable record in {where} ({', '.join(why)}){problems}; expected {expected}"
    )
