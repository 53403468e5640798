"""A training stage's progress as DVC's tools read it while the stage runs: the latest value of
each series column (loss, learning-rate multiplier, validation bits per byte, RL's rewards and
pass rates) and its step, rewritten atomically after every row to one JSON file that dvc.yaml
declares as one of the stage's metrics (data/live/<stage>.json). `dvc exp show` or `dvc metrics
show` in another terminal then show a running `dvc exp run`'s step and loss. The file is flat
{"step": n, column: value}, the summary layout dvclive writes, so tools that read dvclive's
metrics read it too. It holds results only, like the series it mirrors (lockstep.core.series):
its last write is the stage's last values, the same bytes for equal runs. The per-step curves
are the series files, which the stage flushes as it goes for `dvc plots show`.

dvclive itself is not used here: its logger opens the DVC repository from inside the stage (the
one `dvc repro` already holds), writing DVC's state databases, which failed under a file size
limit, and outside a DVC project it initialises one in the enclosing git repository."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from lockstep.core.io import write_json_atomic

Row = Mapping[str, float | int | None]
FLUSH_EVERY_S = 10.0  # how often a running stage rewrites its series files for `dvc plots show`


class LiveMetrics:
    """`add` takes a series row, {"step": n, column: value, ...}, and rewrites `path` with every
    column's latest value and the row's `step`."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.latest: dict[str, float | int] = {}

    def add(self, row: Row) -> None:
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"a live metrics row needs an integer `step`, got {step!r}")
        self.latest.update({k: float(v) for k, v in row.items() if k != "step" and v is not None})
        self.latest["step"] = step
        write_json_atomic(self.path, self.latest)


def each(*calls: Callable[[Row], None] | None) -> Callable[[Row], None]:
    """One `on_step` callback that hands each row to every call given (None ones skipped)."""
    chosen = [c for c in calls if c is not None]

    def on_step(row: Row) -> None:
        for call in chosen:
            call(row)

    return on_step
