"""Parity artifacts written from plain lists, outside any stage: a `dataset_snapshot.json` from
records and a `rendered_samples.json` from (ids, mask) pairs, in the same serialization the stages
write through lockstep.data.parity's collectors. For tests and for making a reference artifact by hand
to hold against a run's with `lockstep parity`; no stage imports it."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lockstep.core.io import write_json_atomic
from lockstep.data.parity import RenderedSamples, SnapshotCollector

if TYPE_CHECKING:
    from lockstep.tokenizer import Tokenizer


def write_dataset_snapshot(
    records: Iterable[Any] | Mapping[str, Iterable[Any]], path: str | os.PathLike[str], n: int = 8
) -> dict[str, Any]:
    """`dataset_snapshot.json`: the first `n` records (per split when given a split mapping) and
    a sha256 of all of them. Reads `records` once."""
    col = SnapshotCollector(n)
    splits = records if isinstance(records, Mapping) else {"all": records}
    for split, recs in splits.items():
        for r in recs:
            col.add(split, r)
    obj = col.to_json()
    write_json_atomic(path, obj)
    return obj


def write_rendered_samples(
    samples: Iterable[tuple[Sequence[int], Sequence[int] | None]],
    path: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer,
    n: int = 8,
    split: str = "train",
) -> dict[str, Any]:
    """`rendered_samples.json` from (ids, mask or None) pairs: the first `n`, decoded per id."""
    rs = RenderedSamples(tokenizer, n, bos_id=int(tokenizer.get_bos_token_id()))
    for ids, mask in samples:
        if not rs.wants(split):
            break
        rs.add(split, ids, mask)
    obj = rs.to_json()
    write_json_atomic(path, obj)
    return obj
