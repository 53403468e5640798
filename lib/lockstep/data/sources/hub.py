"""Config fields and row readers shared by the loaders of Hugging Face hub datasets that may also
be read from local files in the same format, and the rule that gives local files the hub's split
mapping (from their file and folder names). No record conversion lives here."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockstep.core.config import ConfigError
from lockstep.data.snapshot import SnapshotWriter
from lockstep.data.sources.common import (
    SourceFormatError,
    SplitLayoutError,
    dataset_rows,
    files_revision,
    hub_revision,
    local_files,
    local_root,
    read_jsonl,
    write_split,
)
from lockstep.data.sources.fields import CheckedFields, Rule

log = logging.getLogger("lockstep.sources")

# Split names as local copies of hub datasets carry them: the hub's own parquet layout
# (`<config>/<split>-00000-of-00001.parquet`, sometimes with a `-<hash>` after the shard
# count), the datasets' original files (`train.jsonl`, `test.jsonl`, WikiText's `wiki.valid.raw`)
# and split folders (`train/`, `validation/`). `valid`, `val` and `dev` spell `validation`.
_SPLIT_NAMES = {
    "train": "train",
    "test": "test",
    "validation": "validation",
    "valid": "validation",
    "val": "validation",
    "dev": "validation",
}
_SPLIT_STEM = re.compile(r"(?:wiki\.)?(train|test|validation|valid|val|dev)(?:-\d{5}-of-\d{5}(?:-[0-9a-f]+)?)?")
_LISTED_FILES = 8  # file names quoted in an error; the rest are counted


@dataclass(frozen=True)
class HubFields(CheckedFields):
    path: str | None = None  # local file or folder in the source's real format; null: the hub
    revision: str = "main"  # hub branch, tag or commit; recorded as the resolved commit sha
    # Val share, by example and seeded, carved from train when the data has no val split of its
    # own, or pooled from local files whose names give no split. Null (the default): such data is
    # refused, so a test split is never pooled into train without being asked for.
    val_frac: float | None = None
    strict: bool = False  # true: the first bad record fails the stage with its file and line
    artifact_records: int = 8  # records per split kept in dataset_snapshot.json, the parity artifact
    max_retries: int = 5  # network retries before giving up
    backoff_s: float = 2.0  # first retry wait; doubles each retry

    RULES = {
        "val_frac": Rule("the share of examples carved out as val; null refuses data without a val split", ge=0, lt=1),
        "artifact_records": Rule("records per split copied into dataset_snapshot.json", ge=0),
        # The wait doubles each retry: 20 retries at the default backoff already wait 24 days.
        "max_retries": Rule("network retries before giving up", ge=0, le=20),
        "backoff_s": Rule("seconds before the first retry, doubling each retry", ge=0, le=3600),
    }


def _listing(files: Sequence[Path], root: Path) -> str:
    names = [_rel(f, root) for f in files[:_LISTED_FILES]]
    more = len(files) - len(names)
    return ", ".join(names) + (f" and {more} more" if more else "")


def _rel(f: Path, root: Path) -> str:
    return f.relative_to(root).as_posix() if f.is_relative_to(root) else f.as_posix()


def split_of(f: Path, root: Path, *, dataset: str) -> str | None:
    """The hub split (`train`, `validation` or `test`) a local file holds, read from its file
    name and from its folders below `root`; None when neither names a split."""
    rel = Path(_rel(f, root))
    found = {_SPLIT_NAMES[p.lower()] for p in rel.parts[:-1] if p.lower() in _SPLIT_NAMES}
    m = _SPLIT_STEM.fullmatch(Path(rel.name.removesuffix(".gz")).stem.lower())
    if m is not None:
        found.add(_SPLIT_NAMES[m.group(1)])
    if len(found) > 1:
        raise SplitLayoutError(
            f"{dataset}: {f} is named for more than one split ({', '.join(sorted(found))}) by its folder and its "
            "file name; rename one of them so that each file belongs to one split"
        )
    return found.pop() if found else None


@dataclass(frozen=True)
class LocalSplits:
    """Which local files feed which of our splits. `files` has "train" and, when the files carry
    the hub's val split, "val"; without "val", val is carved from train by `val_frac`."""

    root: Path
    files: dict[str, list[Path]]
    val_frac: float | None
    unused: list[Path]  # files of a hub split the source does not read (as the hub path skips it)

    @property
    def carve(self) -> bool:
        return "val" not in self.files

    def write(self, sink: SnapshotWriter, split: str, records: list[tuple[str, dict[str, Any]]], seed: int) -> None:
        """Write the (where, record) pairs read from `self.files[split]`: to that split, or, when
        val is carved, split by `val_frac` (seeded)."""
        if self.carve:
            assert self.val_frac is not None
            write_split(sink, records, self.val_frac, seed)
            return
        for where, record in records:
            sink.add(split, record, where)

    def meta(self) -> dict[str, Any]:
        """meta.json fields: the revision and sha256 of the files read, and which split each fed."""
        read = [f for split in self.files.values() for f in split]
        revision, per_file = files_revision(read)
        return {
            "revision": revision,
            "input_sha256": per_file,
            "split_rule": "val_frac" if self.carve else "file names",
            "local_splits": {s: [_rel(f, self.root) for f in fs] for s, fs in self.files.items()},
            "unused_files": [_rel(f, self.root) for f in self.unused],
            "streamed": any(f.suffix == ".parquet" for f in read),
        }


def local_splits(
    cfg: HubFields,
    *,
    dataset: str,
    hub_splits: dict[str, str],
    suffixes: Sequence[str],
    unused_splits: Sequence[str] = (),
    config: str | None = None,
) -> LocalSplits:
    """Map the local files at `cfg.path` to our splits the way the hub path maps the hub's:
    `hub_splits` is {our split: hub split}; files of `unused_splits` are left out. Files that
    name no split are pooled only when `cfg.val_frac` is set; a mix of named and unnamed files,
    or a split the dataset does not have, is refused. When the folder holds one sub-folder per
    hub config (the hub's `<config>/<split>-*.parquet` layout) and `config` is one of them, only
    that config's files are read, as the hub path reads one config."""
    assert cfg.path is not None
    root = local_root(cfg.path)
    files = local_files(cfg.path, suffixes, what=dataset)
    other_configs: list[Path] = []
    if config is not None and Path(cfg.path).is_dir() and not (root / config).is_dir():
        # Folders that hold split-named files but are neither a split nor `data/` are other
        # configs of the dataset (`main/` beside a wanted `socratic/`): reading them would train
        # on the wrong config without a word.
        configs = sorted({f.relative_to(root).parts[0] for f in files if len(f.relative_to(root).parts) > 1
                          and f.relative_to(root).parts[0].lower() not in {*_SPLIT_NAMES, "data"}
                          and _SPLIT_STEM.fullmatch(f.stem.split(".")[0].lower()) is not None})
        if configs:
            raise FileNotFoundError(
                f"{dataset}: {root} holds the config folder(s) {', '.join(configs)} but not `{config}`; set "
                "`fetch.<name>.config` to one of them, or point `path` at the folder of the files to read"
            )
    if config is not None and Path(cfg.path).is_dir() and (root / config).is_dir():
        other_configs = [f for f in files if not f.is_relative_to(root / config)]
        files = [f for f in files if f.is_relative_to(root / config)]
        if not files:
            raise FileNotFoundError(f"{dataset}: no {'/'.join(suffixes)} files under {root / config}")
    named = {f: split_of(f, root, dataset=dataset) for f in files}
    ours_of = {theirs: ours for ours, theirs in hub_splits.items()}
    hub_names = " and ".join(f"`{s}`" for s in [*hub_splits.values(), *unused_splits])
    suffix = suffixes[0]
    unnamed = [f for f in files if named[f] is None]
    if len(unnamed) < len(files):
        if unnamed:
            raise SplitLayoutError(
                f"{dataset}: {root} mixes files named for a split ({_listing([f for f in files if named[f]], root)}) "
                f"with files that name none ({_listing(unnamed, root)}); name each file or its folder after the "
                f"hub split it holds ({hub_names}), or move the others out of {root}"
            )
        for f in files:
            if named[f] not in ours_of and named[f] not in unused_splits:
                raise SplitLayoutError(
                    f"{dataset}: {f} is named for the `{named[f]}` split, which {dataset} does not have "
                    f"(its splits: {hub_names}); rename it after the split it holds, or move it out of {root}"
                )
        by_split = {ours: [f for f in files if named[f] == theirs] for ours, theirs in hub_splits.items()}
        by_split = {ours: fs for ours, fs in by_split.items() if fs}
        unused = [f for f in files if named[f] in unused_splits]
        if "train" in by_split and "val" in by_split:
            if cfg.val_frac is not None:
                log.info("%s: val_frac=%s unused: the files carry %s's own val split (%s)",
                         dataset, cfg.val_frac, dataset, hub_splits["val"])
            return LocalSplits(root, by_split, cfg.val_frac, unused + other_configs)
        if "train" in by_split:
            if cfg.val_frac is None:
                if "val" not in hub_splits:
                    raise _no_val_split(dataset)
                raise SplitLayoutError(
                    f"{dataset}: {root} holds only the `train` split ({_listing(by_split['train'], root)}); add the "
                    f"`{hub_splits['val']}` split's files (e.g. {hub_splits['val']}{suffix} or a folder "
                    f"{hub_splits['val']}/) so that val is {dataset}'s own {hub_splits['val']} split as on the hub, "
                    "or set `fetch.<name>.val_frac` to hold out a seeded share of train as val"
                )
            return LocalSplits(root, by_split, cfg.val_frac, unused + other_configs)
        if cfg.val_frac is None:
            found = sorted({str(named[f]) for f in files})
            raise SplitLayoutError(
                f"{dataset}: {root} holds no `train` split, only {' and '.join(f'`{s}`' for s in found)} "
                f"({_listing(files, root)}); add the train split's files (e.g. train{suffix} or a folder train/), "
                "or set `fetch.<name>.val_frac` to pool these files and hold out that share as val "
                f"(training on the {'/'.join(found)} split)"
            )
        log.warning("%s: pooling files of the %s split(s) into train and val (val_frac=%s)",
                    dataset, "/".join(sorted({str(named[f]) for f in files})), cfg.val_frac)
        return LocalSplits(root, {"train": files}, cfg.val_frac, other_configs)
    if cfg.val_frac is None:
        if "val" not in hub_splits:
            raise _no_val_split(dataset)
        theirs = list(hub_splits.values())
        raise SplitLayoutError(
            f"{dataset}: cannot tell train from val among the files at {cfg.path} (found {_listing(files, root)}): "
            f"no file or folder is named after a split. Either name them after {dataset}'s hub splits "
            f"({' and '.join(f'{s}{suffix}' for s in theirs)}, or folders {' and '.join(f'{s}/' for s in theirs)}), "
            f"so that `{hub_splits['val']}` becomes val as when reading the hub, or set `fetch.<name>.val_frac` "
            "to pool them and hold out that share, seeded, as val"
        )
    return LocalSplits(root, {"train": files}, cfg.val_frac, other_configs)


def _no_val_split(dataset: str) -> ConfigError:
    return ConfigError(
        f"{dataset} has no val split of its own (on the hub it is one `train` split), so `val_frac` must say "
        "what share to hold out as val; set `fetch.<name>.val_frac` (e.g. 0.1)"
    )


def file_rows(f: Path, cfg: HubFields, sink: SnapshotWriter) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) for each row of one local .jsonl, .jsonl.gz or .parquet file; unreadable JSON
    lines are reported to `sink`."""
    if f.suffix == ".parquet":
        stream = dataset_rows(
            hub_id="", hub_config=None, hub_split="train", revision="", files=[f],
            max_retries=cfg.max_retries, backoff_s=cfg.backoff_s,
        )  # fmt: skip
        return ((f"{f} row {i}", row) for i, row in enumerate(stream))
    return read_jsonl(f, sink)


def require_usable(f: Path, *, rows: int, usable: int, bad_before: int, sink: SnapshotWriter, expected: str) -> None:
    """Refuse a file that had rows (or unreadable lines) but not one usable: it is in the wrong
    format, and skipping it row by row would publish a snapshot without it."""
    bad = sink.skipped - bad_before
    if usable == 0 and (rows > 0 or bad > 0):
        raise SourceFormatError(
            f"{f}: not one usable record in it ({rows} row(s) read, {bad} bad; last problem: "
            f"{sink.last_bad or 'none reported'}); expected {expected}"
        )


def usable_rows(
    f: Path,
    cfg: HubFields,
    sink: SnapshotWriter,
    convert: Callable[[str, dict[str, Any]], dict[str, Any] | None],
    *,
    expected: str,
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The rows of local file `f` that `convert` turns into records (None after reporting a bad
    row to `sink`) and `sink` accepts, as (where, record); once the file is read, require_usable
    refuses a file with rows but none usable (a wrong format), naming `expected`."""
    bad_before, rows, usable = sink.skipped, 0, 0
    for where, row in file_rows(f, cfg, sink):
        rows += 1
        rec = convert(where, row)
        if rec is None or (clean := sink.check(rec, where)) is None:
            continue
        usable += 1
        yield where, clean
    require_usable(f, rows=rows, usable=usable, bad_before=bad_before, sink=sink, expected=expected)


def hub_rows(
    cfg: HubFields, dataset: str, config: str | None, split: str, revision: str
) -> Iterator[tuple[str, dict[str, Any]]]:
    stream = dataset_rows(
        hub_id=dataset, hub_config=config, hub_split=split, revision=revision, files=None,
        max_retries=cfg.max_retries, backoff_s=cfg.backoff_s,
    )
    return ((f"{dataset}[{split}] row {i}", row) for i, row in enumerate(stream))


def rows_by_split(
    cfg: HubFields,
    sink: SnapshotWriter,
    *,
    dataset: str,
    config: str | None,
    hub_splits: dict[str, str],
    convert: Callable[[str, dict[str, Any]], dict[str, Any] | None],
    expected: str,
    seed: int,
) -> dict[str, Any]:
    """The common loader shape: rows from the hub's own splits (`hub_splits` maps our split to
    theirs) or from local files mapped the same way by their names (`local_splits`), each
    converted by `convert` (which returns None after reporting a bad row to `sink`), validated
    and written. Val is carved by `val_frac` (seeded) only where the data has no val split."""
    if "val" not in hub_splits and cfg.val_frac is None:
        raise _no_val_split(dataset)
    if cfg.path is not None:
        plan = local_splits(cfg, dataset=dataset, hub_splits=hub_splits, suffixes=(".jsonl", ".jsonl.gz", ".parquet"),
                            config=config)
        for split, files in plan.files.items():
            kept: list[tuple[str, dict[str, Any]]] = []
            for f in files:
                for where, clean in usable_rows(f, cfg, sink, convert, expected=expected):
                    if plan.carve:
                        kept.append((where, clean))
                    else:
                        sink.add(split, clean, where)
            if plan.carve:
                assert plan.val_frac is not None
                write_split(sink, kept, plan.val_frac, seed)
        return {"source_id": f"local:{Path(cfg.path).as_posix()}", "source_format": dataset, **plan.meta()}
    sha = hub_revision(dataset, cfg.revision, max_retries=cfg.max_retries, backoff_s=cfg.backoff_s)
    if "val" not in hub_splits:
        # No val split upstream: hold the (small) train split to choose val by example.
        good = []
        for where, row in hub_rows(cfg, dataset, config, hub_splits["train"], sha):
            rec = convert(where, row)
            if rec is not None and (clean := sink.check(rec, where)) is not None:
                good.append((where, clean))
        assert cfg.val_frac is not None
        write_split(sink, good, cfg.val_frac, seed)
    else:
        for ours, theirs in hub_splits.items():
            for where, row in hub_rows(cfg, dataset, config, theirs, sha):
                rec = convert(where, row)
                if rec is not None:
                    sink.add(ours, rec, where)
    return {"source_id": dataset, "hub_config": config, "hub_splits": hub_splits, "revision": sha, "streamed": True}
