"""OpenAssistant oasst1 as conversation records: one conversation per message tree, following the
best-ranked non-deleted reply in the chosen language at each turn. Reads the hub's flat rows
(`parent_id` links) and the `*.trees.jsonl` export (gzipped as published, or not) alike; both give
the same conversations."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lockstep.data.snapshot import SnapshotWriter
from lockstep.data.sources.common import SourceFormatError, hub_revision
from lockstep.data.sources.hub import HubFields, file_rows, hub_rows, local_splits
from lockstep.data.sources.size import SourceSize, published_examples

KIND = "conversation"
EXTRA_FIELDS: tuple[str, ...] = ()
EXPECTED = (
    "OpenAssistant message trees: lines of the `*.trees.jsonl` export (`prompt`: a message object with "
    "`message_id, text, role, lang, rank, deleted, replies`), or the hub's flat message rows (one message per "
    "row, linked by `parent_id`)"
)
HUB_SPLITS = {"train": "train", "val": "validation"}  # our split <- the hub's
_ROLES = {"prompter": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class Oasst1Config(HubFields):
    source: Literal["oasst1"] = "oasst1"
    dataset: str = "OpenAssistant/oasst1"
    lang: str = "en"  # only messages in this language are followed


def _rank_key(msg: dict[str, Any]) -> tuple[bool, float, str]:
    # Unranked replies come after ranked ones; message_id breaks ties the same way in both layouts.
    rank = msg.get("rank")
    missing = rank is None or (isinstance(rank, float) and math.isnan(rank))
    return (missing, 0.0 if missing else float(rank), str(msg.get("message_id")))


def trees_from_flat(
    rows: Iterable[tuple[str, dict[str, Any]]], sink: SnapshotWriter
) -> list[tuple[str, dict[str, Any]]]:
    """Nested trees (the export layout: each message with `replies`) from flat rows linked by
    `parent_id`. Duplicate ids, missing parents and parent cycles are reported as bad records."""
    by_id: dict[str, dict[str, Any]] = {}
    where_of: dict[str, str] = {}
    order: list[str] = []
    for where, row in rows:
        mid = row.get("message_id")
        if not isinstance(mid, str) or not mid:
            sink.bad(where, "missing field 'message_id'")
            continue
        if mid in by_id:
            sink.bad(where, f"duplicate message_id {mid}")
            continue
        by_id[mid] = {**row, "replies": []}
        where_of[mid] = where
        order.append(mid)
    roots = []
    for mid in order:
        parent = by_id[mid].get("parent_id")
        if parent is None:
            roots.append(mid)
        elif parent in by_id:
            by_id[parent]["replies"].append(by_id[mid])
    reached: set[str] = set()
    stack = list(roots)
    while stack:
        mid = stack.pop()
        if mid in reached:
            continue
        reached.add(mid)
        stack.extend(r["message_id"] for r in by_id[mid]["replies"])
    handled: set[str] = set()
    for mid in order:
        if mid in reached or mid in handled:
            continue
        chain, cur = [], mid
        while cur in by_id and cur not in chain and cur not in handled:
            chain.append(cur)
            cur = by_id[cur].get("parent_id")
        handled.update(chain)
        if cur in chain:
            sink.bad(where_of[mid], f"message tree has a parent_id cycle through {cur}")
        elif cur not in handled:
            sink.bad(where_of[mid], f"parent_id {cur} not found")
    return [(where_of[r], by_id[r]) for r in roots]


def tree_to_conversation(root: dict[str, Any], lang: str) -> dict[str, Any] | str | None:
    """The conversation along the best-ranked replies; None when the tree has nothing usable in
    `lang` (filtered, not bad); a reason string when the tree is malformed."""

    def usable(m: dict[str, Any]) -> bool:
        return (
            not m.get("deleted")
            and m.get("lang") == lang
            and isinstance(m.get("text"), str)
            and bool(m["text"].strip())
        )

    if not usable(root):
        return None
    path, seen, node = [root], {root.get("message_id")}, root
    while True:
        replies = node.get("replies") or []
        if not isinstance(replies, list):
            return "field 'replies' must be a list"
        candidates = [r for r in replies if isinstance(r, dict) and usable(r)]
        if not candidates:
            break
        node = min(candidates, key=_rank_key)
        if node.get("message_id") in seen:
            return f"message tree has a cycle through {node.get('message_id')}"
        seen.add(node.get("message_id"))
        path.append(node)
    if path[-1].get("role") != "assistant":
        path.pop()
    if not path:
        return None
    messages = []
    for m in path:
        role = _ROLES.get(m.get("role"))  # type: ignore[arg-type]
        if role is None:
            return f"message {m.get('message_id')} has role {m.get('role')!r}, expected prompter or assistant"
        messages.append({"role": role, "content": [{"type": "text", "text": m["text"].strip()}]})
    if len(messages) < 2:
        return None
    return {"messages": messages}


def conversations(
    trees: Iterable[tuple[str, dict[str, Any]]], lang: str, sink: SnapshotWriter
) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """(validated conversations, number of trees filtered out for language or lack of replies)."""
    out, filtered = [], 0
    for where, root in trees:
        conv = tree_to_conversation(root, lang)
        if conv is None:
            filtered += 1
        elif isinstance(conv, str):
            sink.bad(where, conv)
        elif (clean := sink.check(conv, where)) is not None:
            out.append((where, clean))
    return out, filtered


def split_layouts(rows: list[tuple[str, dict[str, Any]]], sink: SnapshotWriter) -> list[tuple[str, dict[str, Any]]]:
    """Trees from a mix of export lines (`prompt`) and flat rows (`message_id`)."""
    trees, flat = [], []
    for where, row in rows:
        if "prompt" in row:
            if isinstance(row["prompt"], dict):
                trees.append((where, row["prompt"]))
            else:
                sink.bad(where, "field 'prompt' must be a message object")
        else:
            flat.append((where, row))
    return trees + trees_from_flat(flat, sink)


def _layout(row: dict[str, Any]) -> str | None:
    """Which layout a row is in: `tree` (an export line), `flat` (a hub message row) or None."""
    if isinstance(row.get("prompt"), dict):
        return "tree"
    if isinstance(row.get("message_id"), str) and row["message_id"]:
        return "flat"
    return None


def _fields(row: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {type(v).__name__}" for k, v in list(row.items())[:8]) or "none"


def _local_rows(f: Path, cfg: Oasst1Config, sink: SnapshotWriter) -> list[tuple[str, dict[str, Any]]]:
    """The rows of one local file; refused when not one of them is an export tree line or a flat
    message row (a file of another kind, e.g. a list of prompts, would otherwise give nothing)."""
    bad_before = sink.skipped
    rows = list(file_rows(f, cfg, sink))
    if (rows or sink.skipped > bad_before) and not any(_layout(row) for _, row in rows):
        first = f"first row {rows[0][0]} has fields {_fields(rows[0][1])}" if rows else f"last problem: {sink.last_bad}"
        raise SourceFormatError(
            f"{f}: not one row is an OpenAssistant message tree or message ({first}); expected {EXPECTED}"
        )
    return rows


def produce(cfg: Oasst1Config, sink: SnapshotWriter, *, seed: int) -> dict[str, Any]:
    filtered = 0
    if cfg.path is not None:
        plan = local_splits(
            cfg, dataset=cfg.dataset, hub_splits=HUB_SPLITS, suffixes=(".jsonl", ".jsonl.gz", ".parquet")
        )
        for split, files in plan.files.items():
            # Trees are built per split, as on the hub: a reply never links across splits.
            rows = [r for f in files for r in _local_rows(f, cfg, sink)]
            convs, n = conversations(split_layouts(rows, sink), cfg.lang, sink)
            filtered += n
            plan.write(sink, split, convs, seed)
        return {"source_id": f"local:{Path(cfg.path).as_posix()}", "source_format": cfg.dataset,
                "filtered_trees": filtered, **plan.meta()}
    sha = hub_revision(cfg.dataset, cfg.revision, max_retries=cfg.max_retries, backoff_s=cfg.backoff_s)
    for ours, theirs in HUB_SPLITS.items():
        convs, n = conversations(trees_from_flat(hub_rows(cfg, cfg.dataset, None, theirs, sha), sink), cfg.lang, sink)
        filtered += n
        for where, conv in convs:
            sink.add(ours, conv, where)
    return {"source_id": cfg.dataset, "revision": sha, "streamed": True, "filtered_trees": filtered,
            "hub_splits": HUB_SPLITS}


def size(cfg: Oasst1Config, *, name: str, root: Path) -> SourceSize:
    """One conversation per English message tree: ~9,800 train trees, ~40% English (an estimate)."""
    return published_examples("oasst1", examples=3_900, val_examples=200, tokens_per_example=600, val_frac=cfg.val_frac)
