"""Per-step series as TSV files: what `dvc plots` draws and the report charts. A stage writes one
folder (`data/plots/<stage>/`) holding one `<name>.tsv` per group of columns it declares, `step`
first. The files are DVC outputs, so they hold results only (losses, bits per byte, rewards,
pass@k, learning-rate multipliers), never timings, and identical rows give identical bytes.
Throughput and MFU go to the logs and the metrics JSON instead."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from lockstep.core.io import atomic_open

SUFFIX = ".tsv"
STEP = "step"
_NAME = re.compile(r"^[A-Za-z0-9_.@-]+$")


class SeriesError(ValueError):
    """A series declaration or row that the writer refuses; the message names the column."""


def is_timed(column: str) -> bool:
    """Whether a column holds a timing by the project's naming rule (names carry units): seconds
    (`*_s`), rates (`*_per_s`) and MFU, which is a rate. Such values differ run to run."""
    return column.endswith("_s") or column == "mfu"


def _cell(value: float | int | None) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        raise SeriesError(f"value {value!r} is a boolean, not a number")
    if isinstance(value, int):
        return str(value)
    # repr is the shortest text that reads back as the same float: exact, and the same every run.
    return repr(float(value))


class SeriesWriter:
    """Collects rows and writes `folder/<name>.tsv` for each entry of `columns` (name -> its
    columns besides `step`), header first, rows in the order added. A row is a mapping with an
    integer `step` and values for columns of one file; its file is the one declaring them.
    Undeclared or timed columns are refused, as is a step that does not increase within a file.
    `write` replaces each file atomically. With `flush_every_s`, `add` also writes the files when
    that long has passed since the last write, so that `dvc plots show` draws a running stage's
    progress; without it nothing is written before `write`. The files' final bytes are the same
    either way."""

    def __init__(self, folder: Path, columns: Mapping[str, Sequence[str]], *,
                 flush_every_s: float | None = None) -> None:
        self.folder = Path(folder)
        self.flush_every_s = flush_every_s
        self._flushed_at = time.monotonic()
        self.columns = {name: tuple(cols) for name, cols in columns.items()}
        self._file_of: dict[str, str] = {}
        for name, cols in self.columns.items():
            if not _NAME.match(name):
                raise SeriesError(f"series file name {name!r} must be letters, digits, `_`, `.`, `@` or `-`")
            for col in cols:
                if not _NAME.match(col) or col == STEP:
                    raise SeriesError(f"{name}{SUFFIX}: column {col!r} must be a plain name other than `step`")
                if is_timed(col):
                    raise SeriesError(f"{name}{SUFFIX}: column {col!r} is a timing; series hold results only (put "
                                      "timings in the metrics JSON), so identical runs write identical files")
                if col in self._file_of:
                    raise SeriesError(f"column {col!r} is declared for both {self._file_of[col]}{SUFFIX} and "
                                      f"{name}{SUFFIX}; give each file its own columns")
                self._file_of[col] = name
        self._rows: dict[str, list[tuple[int, Mapping[str, float | int | None]]]] = {n: [] for n in self.columns}

    def add(self, row: Mapping[str, float | int | None]) -> None:
        step = row.get(STEP)
        if isinstance(step, bool) or not isinstance(step, int):
            raise SeriesError(f"a series row needs an integer `step`, got {step!r}")
        keys = [k for k in row if k != STEP]
        unknown = [k for k in keys if k not in self._file_of]
        if unknown:
            hint = " (timings stay out of the series)" if any(is_timed(k) for k in unknown) else ""
            raise SeriesError(f"series columns {unknown} are not declared{hint}; declared: {dict(self.columns)}")
        files = sorted({self._file_of[k] for k in keys})
        if len(files) != 1:
            raise SeriesError(f"a row must hold the columns of exactly one file, got {keys} (files {files})")
        name = files[0]
        rows = self._rows[name]
        if rows and step <= rows[-1][0]:
            raise SeriesError(f"{name}{SUFFIX}: step {step} after step {rows[-1][0]}; steps must increase")
        rows.append((step, {k: row[k] for k in keys}))
        if self.flush_every_s is not None and time.monotonic() - self._flushed_at >= self.flush_every_s:
            self.write()

    def write(self) -> list[Path]:
        """Write every declared file (a file without rows gets its header) and return the paths."""
        self._flushed_at = time.monotonic()
        paths = []
        for name, cols in self.columns.items():
            path = self.folder / f"{name}{SUFFIX}"
            with atomic_open(path, "w") as f:
                f.write("\t".join((STEP, *cols)) + "\n")
                for step, values in self._rows[name]:
                    f.write("\t".join((str(step), *(_cell(values.get(c)) for c in cols))) + "\n")
            paths.append(path)
        return paths


def read_series_file(path: Path) -> dict[str, list[tuple[int, float]]]:
    """One TSV as {column: [(step, value), ...]}; an empty cell is a step without that value."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    if not lines:
        return {}
    header = lines[0].split("\t")
    if header[0] != STEP:
        raise ValueError(f"{path} does not start with a `step` column (columns: {header}); it is not a series file")
    out: dict[str, list[tuple[int, float]]] = {col: [] for col in header[1:]}
    for n, line in enumerate(lines[1:], start=2):
        cells = line.split("\t")
        if len(cells) != len(header):
            raise ValueError(
                f"{path}:{n} has {len(cells)} cells for {len(header)} columns; re-run the stage that wrote it"
            )
        try:
            step = int(cells[0])
            values = [(col, float(cell)) for col, cell in zip(header[1:], cells[1:]) if cell]
        except ValueError:
            raise ValueError(f"{path}:{n} holds a cell that is not a number; re-run the stage that wrote it") from None
        for col, value in values:
            out[col].append((step, value))
    return out
