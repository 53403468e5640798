"""Small FineWeb-Edu-schema parquet shards for the fetch tests, and the switch that keeps
`datasets` from sleeping after every stream a test closes early."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def fineweb_row(shard: int, i: int, n: int, *, int_score: Any = 3) -> dict[str, Any]:
    """Document `i` of shard `shard` (number `n` over all shards), in the fineweb-edu columns."""
    return {"text": f"Shard {shard} document {i}. " + "lorem ipsum dolor " * (n % 23 + 4), "id": f"d{n}",
            "dump": "CC-MAIN-2024-10", "url": f"https://e.x/{n}", "file_path": "s3://x.parquet",
            "language": "en", "language_score": 0.9, "token_count": 10, "score": 3.0, "int_score": int_score}


def write_shards(d: Path, *, shards: int, docs: int, edit: Callable[[int, list[dict[str, Any]]], None],
                 int_score: Callable[[int], Any] = lambda n: 3) -> Path:
    """`shards` files `000_0000s.parquet` of `docs` rows each in folder `d`; `edit(s, rows)` plants
    each shard's odd rows before it is written."""
    d.mkdir()
    for s in range(shards):
        rows = [fineweb_row(s, i, s * docs + i, int_score=int_score(s * docs + i)) for i in range(docs)]
        edit(s, rows)
        pq.write_table(pa.Table.from_pylist(rows), d / f"000_{s:05d}.parquet")
    return d


def no_thread_shutdown_sleep(monkeypatch) -> None:
    # `datasets` sleeps after each stream it closes early (an arrow thread-shutdown workaround).
    import datasets.config

    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)
