"""The reader shared by the chat benchmarks' fetch sources (ARC, MMLU, HumanEval): a benchmark is
read from one hub split, its eval split (`test`), which becomes the snapshot's val split; the
snapshot has no train split, so no benchmark item can reach training through a mixture. Local
files in the hub's layout (`<config>/test-00000-of-00001.parquet`) are read through the same
`datasets` calls as a download. Knows nothing of any one benchmark's columns: each source passes
its own `convert`."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lockstep.data.snapshot import SnapshotWriter
from lockstep.data.sources.common import SplitLayoutError, files_revision, hub_revision, local_files, local_root
from lockstep.data.sources.hub import HubFields, hub_rows, split_of, usable_rows

SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz")
LETTERS = "ABCDEFGHIJ"  # answer letters, as lockstep.evaluate.chat scores them


def eval_split_files(cfg: HubFields, *, dataset: str, config: str | None, split: str) -> tuple[list[Path], list[Path]]:
    """(files of `split`, files left out) at `cfg.path`. Inside a folder holding the hub's config
    folders only `config`'s files are read, as the hub path reads one config."""
    assert cfg.path is not None
    root = local_root(cfg.path)
    files = local_files(cfg.path, SUFFIXES, what=dataset)
    if config is not None and Path(cfg.path).is_dir() and (root / config).is_dir():
        root = root / config
    mine = [f for f in files if f.is_relative_to(root) and split_of(f, root, dataset=dataset) == split]
    if not mine:
        found = ", ".join(f.relative_to(local_root(cfg.path)).as_posix() for f in files[:8])
        raise SplitLayoutError(
            f"{dataset}: no file of the `{split}` split at {cfg.path} (found {found}); name the file or its folder "
            f"after the split as the hub does ({config + '/' if config else ''}{split}-00000-of-00001.parquet), "
            "or point `path` at the folder that holds it"
        )
    return mine, [f for f in files if f not in mine]


def read_eval_split(
    cfg: HubFields,
    sink: SnapshotWriter,
    *,
    dataset: str,
    config: str | None,
    split: str,
    convert_row: Callable[[dict[str, Any]], dict[str, Any] | str],
    expected: str,
) -> dict[str, Any]:
    """Write the rows of `dataset`'s `split` (config `config`), each converted by `convert_row`
    (a record, or why the row is not one: reported to `sink` as a bad row), to val. Returns the
    meta fields that say what was read."""

    def convert(where: str, row: dict[str, Any]) -> dict[str, Any] | None:
        rec = convert_row(row)
        if isinstance(rec, str):
            sink.bad(where, rec)
            return None
        return rec

    if cfg.path is not None:
        files, unused = eval_split_files(cfg, dataset=dataset, config=config, split=split)
        for f in files:
            for where, clean in usable_rows(f, cfg, sink, convert, expected=expected):
                sink.add("val", clean, where)
        revision, per_file = files_revision(files)
        root = local_root(cfg.path)
        return {"source_id": f"local:{Path(cfg.path).as_posix()}", "source_format": dataset, "revision": revision,
                "input_sha256": per_file, "split_rule": f"the `{split}` split is val",
                "unused_files": [f.relative_to(root).as_posix() for f in unused],
                "streamed": any(f.suffix == ".parquet" for f in files)}
    sha = hub_revision(dataset, cfg.revision, max_retries=cfg.max_retries, backoff_s=cfg.backoff_s)
    for where, row in hub_rows(cfg, dataset, config, split, sha):
        rec = convert(where, row)
        if rec is not None:
            sink.add("val", rec, where)
    return {"source_id": dataset, "hub_config": config, "hub_splits": {"val": split}, "revision": sha, "streamed": True}


def choice_record(
    question: Any, choices: Any, answer: int, *, labels: Sequence[str] | None = None, **extra: str
) -> dict[str, Any] | str:
    """A multiple-choice item as a snapshot document (`text` the question, `choices` a JSON list,
    `answer` the right choice's letter by position and, when given, `labels` the choices' own
    labels as a JSON list), or why it is not one."""
    if not isinstance(question, str) or not question.strip():
        return "missing or empty `question`"
    if not isinstance(choices, (list, tuple)) or not 2 <= len(choices) <= len(LETTERS):
        return f"`choices` must hold 2..{len(LETTERS)} options"
    if not all(isinstance(c, str) and c.strip() for c in choices):
        return "a choice is empty or not a string"
    if not 0 <= answer < len(choices):
        return f"answer index {answer} outside the {len(choices)} choices"
    record = {"text": question, "choices": json.dumps(list(choices), ensure_ascii=False), "answer": LETTERS[answer]}
    if labels is not None:
        if len(labels) != len(choices) or len(set(labels)) != len(labels):
            return f"labels {list(labels)} must be {len(choices)} distinct labels, one per choice"
        if not all(isinstance(x, str) and x and x.strip() == x for x in labels):
            return f"labels {list(labels)} must be non-empty strings without surrounding spaces"
        record["labels"] = json.dumps(list(labels), ensure_ascii=False)
    return {**record, **extra}
