"""`lockstep exp summary`: what a result is worth across training seeds. Reads `dvc exp show --json`
(run in the current repo, or a saved copy), groups the runs by their params with the seed left out
(a group is one configuration, its runs are its seeds) and gives every numeric metric per group as
mean ± sample standard deviation (n runs). Each further group shows its difference to the first,
marked `~` when it is smaller than the seed-to-seed spread (lockstep.core.stats.seed_difference) and
`?` when a group has fewer than 2 seeds, so the spread is unknown.

- Runs: the baseline commit(s) in the input and their experiments (plain `dvc exp show` lists HEAD
  only), oldest first, or the experiments and revisions named, in the order named. The first
  run's configuration (by default the baseline's) is the one the others are compared with, also
  when that run itself has no metrics. The workspace only when named `workspace`. Queued, running
  and failed experiments, runs without a readable metrics file and reruns of a configuration's
  seed are skipped with a note.
- Metrics: `<metrics file stem>.<key>`, nested keys joined with dots
  (`eval_sft.chat.synth_math.accuracy`; the file's path without its suffix where two files share
  a stem). A key ending in `.n` is the item count of the metric beside it
  (`eval_sft.chat.synth_math.accuracy.n` counts `eval_sft.chat.synth_math.accuracy`) and is shown
  in the metric's `items` column, not summarised: one count where every configuration has the
  same, else each configuration's in order (`3 / 238`).
- Configurations: each named by its `preset` param where runs have one, then only the params in
  which the configurations differ (long values cut), and how many params they share.
- Output: a plain-text table (one row per metric, split into several tables sharing the metric
  column when the groups do not fit the terminal; every line within the width), markdown, or JSON.

Knows nothing about lockstep's stages: any DVC project's experiments work. Not a significance
test: the spread rule is a screen for differences that seed noise alone produces. Over 400 lines
because reading DVC's JSON, grouping and the three renderings share the summary types and change
together; each part is a section below."""

from __future__ import annotations

import json
import math
import shutil
import string
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import Any

from lockstep.core.stats import mean_std, seed_difference

WORKSPACE = "workspace"
PARAMS_FILE = "params.yaml"  # DVC's default params file: its keys are named bare, others' FILE:KEY
COUNT_SUFFIX = ".n"
LIVE_METRICS = "data/live/"  # the training stages' live progress files (lockstep.pipeline.live): left out
PENDING_STATES = ("queued", "running")
UNSET = "(unset)"  # a param one configuration has and another lacks
WITHIN_SPREAD = "within seed noise: |difference| < seed-to-seed spread (the larger std of the two groups)"
SPREAD_UNKNOWN = "spread unknown: a group has fewer than 2 seeds"
ITEMS_APART = "items: each configuration's count, where they differ"
PRESET_KEY = "preset"  # lockstep's params.yaml names the preset it was written from: it names a configuration
VALUE_CHARS = 40  # a param value longer than this is cut in the text header (--json has it whole)
PARAM_LINES = 4  # lines of differing params per configuration in the text header; --json lists them all


class ExpSummaryError(ValueError):
    """Anything that stops `lockstep exp summary`; the message says what to fix."""


class DvcNotFoundError(ExpSummaryError):
    """No `dvc` executable to run."""


class NotADvcRepoError(ExpSummaryError):
    """The folder is not inside a DVC repository."""


class ExpShowError(ExpSummaryError):
    """`dvc exp show` failed, or the input is not the JSON it writes."""


class UnknownExperimentError(ExpSummaryError):
    """A name matches no experiment or revision, or more than one."""


class NoRunsError(ExpSummaryError):
    """None of the runs picked has finished with metrics."""


class NoMetricsError(ExpSummaryError):
    """The --metric globs match no metric."""


@dataclass(frozen=True)
class Run:
    name: str
    rev: str
    seed: Any  # the seed param's value; None where the run has no such param
    params: Mapping[str, Any]  # flattened, the seed left out: PARAMS_FILE keys bare, others FILE:KEY
    metrics: Mapping[str, float]
    items: Mapping[str, float]  # metric -> its item count, for metrics whose file has one


@dataclass(frozen=True)
class Skipped:
    name: str
    reason: str


@dataclass(frozen=True)
class Group:
    label: str  # "A", "B", ...: the first group is the one the others are compared with
    params: Mapping[str, Any]  # the params in which this group differs from some other group
    runs: tuple[Run, ...]


@dataclass(frozen=True)
class Cell:
    mean: float
    std: float  # nan below 2 runs
    n: int  # runs of the group that have the metric
    items: tuple[float, ...]  # the distinct item counts among those runs


@dataclass(frozen=True)
class Difference:
    difference: float  # mean of this group - mean of the first group
    spread: float  # the larger of the two standard deviations; nan when unknown
    within_spread: bool | None  # None: a group has fewer than 2 runs


@dataclass(frozen=True)
class Row:
    metric: str
    cells: tuple[Cell, ...]  # one per group
    differences: tuple[Difference, ...]  # one per group after the first


@dataclass(frozen=True)
class Summary:
    seed_key: str
    groups: tuple[Group, ...]
    rows: tuple[Row, ...]
    skipped: tuple[Skipped, ...]
    notes: tuple[str, ...]
    equal_params: int  # params (seed left out) that every configuration sets alike


# ---------------------------------------------------------------------------------------------
# Input: `dvc exp show --json`


def find_dvc() -> Path:
    """The `dvc` of this Python's environment (so `.venv/bin/lockstep` works without activating the
    environment), else the first on PATH."""
    beside = Path(sys.executable).parent / "dvc"
    if beside.is_file():
        return beside
    found = shutil.which("dvc")
    if found is None:
        raise DvcNotFoundError(f"no `dvc` beside {sys.executable} or on PATH: install it (pip install dvc) "
                               "or activate the environment that has it")
    return Path(found)


def run_exp_show(repo: Path, dvc: Path | None = None) -> list[dict[str, Any]]:
    """`dvc exp show --json` run in `repo`, parsed."""
    dvc = dvc or find_dvc()
    try:
        done = subprocess.run([str(dvc), "exp", "show", "--json"], cwd=repo, capture_output=True, text=True,
                              check=False)
    except OSError as e:
        raise DvcNotFoundError(f"cannot run {dvc}: {e}; install dvc (pip install dvc)") from None
    if done.returncode != 0:
        said = done.stderr.strip() or done.stdout.strip()
        if "not inside of a DVC repository" in said:
            raise NotADvcRepoError(f"{repo.resolve()} is not inside a DVC repository: run this in one (after "
                                   "`dvc init`), or pass --from FILE with saved `dvc exp show --json` output")
        raise ExpShowError(f"`{dvc} exp show --json` failed in {repo.resolve()} (exit {done.returncode}): "
                           f"{said[-600:]}")
    return parse_exp_show(done.stdout, source=f"`dvc exp show --json` in {repo.resolve()}")


def load_exp_show(path: Path) -> list[dict[str, Any]]:
    """A saved copy of `dvc exp show --json`, parsed."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ExpShowError(f"{path}: no such file; save one with `dvc exp show --json > {path}`") from None
    return parse_exp_show(text, source=str(path))


def parse_exp_show(text: str, *, source: str) -> list[dict[str, Any]]:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise ExpShowError(f"{source}: not JSON ({e}); save it with `dvc exp show --json`") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("rev"), str) for r in rows):
        raise ExpShowError(f"{source}: not `dvc exp show --json` output (a list of revisions, each with a "
                           "'rev'); save it with `dvc exp show --json` from DVC 3")
    return rows


@dataclass(frozen=True)
class _Entry:
    name: str
    rev: str
    state: str  # the executor's: success, queued, running, failed
    exp: Mapping[str, Any]  # DVC's ExpState: rev, name, data, error
    workspace: bool = False


def _entries(exp_show: Sequence[Mapping[str, Any]]) -> list[_Entry]:
    """Every revision in the input, each baseline followed by its experiments, oldest first."""
    out: list[_Entry] = []
    for base in exp_show:
        if base["rev"] == WORKSPACE:
            out.append(_Entry(WORKSPACE, WORKSPACE, "success", base, workspace=True))
            continue
        out.append(_Entry(base.get("name") or base["rev"][:7], base["rev"], "success", base))
        # DVC lists experiments newest first, and a range's commits too: the first is its result.
        exp_ranges = base.get("experiments") or ()
        for exp_range in sorted(exp_ranges, key=lambda r: (r["revs"][0].get("data") or {}).get("timestamp") or ""):
            tip = exp_range["revs"][0]
            state = (exp_range.get("executor") or {}).get("state") or "success"
            out.append(_Entry(exp_range.get("name") or tip.get("name") or tip["rev"][:7], tip["rev"], state, tip))
    return out


def _select(entries: Sequence[_Entry], names: Sequence[str], source: str) -> list[_Entry]:
    if not names:
        return [e for e in entries if not e.workspace]
    picked: dict[str, _Entry] = {}
    for name in names:
        hits = [e for e in entries if e.name == name]
        if not hits and len(name) >= 4 and all(c in string.hexdigits for c in name):
            hits = [e for e in entries if e.rev.startswith(name.lower())]
        if not hits:
            known = ", ".join(e.name for e in entries)
            raise UnknownExperimentError(f"no experiment or revision {name!r} in {source}; known there: {known} "
                                         "(see `dvc exp show`; older commits need `dvc exp show -A --json` "
                                         "saved and passed with --from)")
        if len({e.rev for e in hits}) > 1:
            which = ", ".join(f"{e.name} ({e.rev[:10]})" for e in hits)
            raise UnknownExperimentError(f"{name!r} names more than one run: {which}; name it by a longer rev")
        picked.setdefault(hits[0].rev, hits[0])
    return list(picked.values())


# ---------------------------------------------------------------------------------------------
# Runs and groups


def _flatten(data: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(data, Mapping):
        for key, value in data.items():
            yield from _flatten(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, data


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _metric_prefixes(paths: set[str]) -> dict[str, str]:
    """Each metrics file's name prefix: its stem, or its path without suffix where stems collide."""
    stems: dict[str, list[str]] = {}
    for path in paths:
        stems.setdefault(PurePosixPath(path).stem, []).append(path)
    return {p: stem if len(ps) == 1 else str(PurePosixPath(p).with_suffix(""))
            for stem, ps in stems.items() for p in ps}


def _metric_files(entry: _Entry) -> dict[str, Any]:
    """The entry's metrics files but the live progress ones (data/live/: the latest training step,
    which the stage's own metrics file summarises)."""
    metrics = (entry.exp.get("data") or {}).get("metrics") or {}
    return {path: result for path, result in metrics.items() if not path.startswith(LIVE_METRICS)}


def _readable_metric_files(entry: _Entry) -> dict[str, Any]:
    return {path: result["data"] for path, result in _metric_files(entry).items()
            if isinstance(result, Mapping) and "data" in result}


def _params_of(entry: _Entry) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for path, result in ((entry.exp.get("data") or {}).get("params") or {}).items():
        for key, value in _flatten((result or {}).get("data") or {}):
            params[key if path == PARAMS_FILE else f"{path}:{key}"] = value
    return params


def _run_of(entry: _Entry, seed_key: str, prefixes: Mapping[str, str]) -> tuple[Run | Skipped, list[str]]:
    """The entry as a run, or why it is skipped; plus notes on metrics files left out."""
    if entry.state in PENDING_STATES:
        return Skipped(entry.name, f"{entry.state}, no results yet"), []
    error = entry.exp.get("error")
    if entry.state == "failed" or error:
        # A failed queued experiment still carries metrics files: the ones it started from.
        why = error.get("msg") if isinstance(error, Mapping) else None
        return Skipped(entry.name, f"failed{f': {why}' if why else ''}"), []
    params = _params_of(entry)
    seed = params.pop(seed_key, None)
    metrics: dict[str, float] = {}
    items: dict[str, float] = {}
    for path, content in _readable_metric_files(entry).items():
        flat = dict(_flatten(content))
        for key, value in flat.items():
            if not _is_number(value) or key.endswith(COUNT_SUFFIX):
                continue
            name = f"{prefixes[path]}.{key}" if key else prefixes[path]
            metrics[name] = float(value)
            count = flat.get(key + COUNT_SUFFIX, flat.get(key.rpartition(".")[0] + COUNT_SUFFIX))
            if _is_number(count):
                items[name] = count
    unreadable = [f"{path} ({(result.get('error') or {}).get('type') or 'unreadable'})"
                  for path, result in _metric_files(entry).items()
                  if isinstance(result, Mapping) and "data" not in result]
    if not metrics:
        found = f": {', '.join(unreadable)}" if unreadable else ""
        return Skipped(entry.name, f"no numeric metrics{found}"), []
    notes = [f"{entry.name}: left out {', '.join(unreadable)}"] if unreadable else []
    return Run(entry.name, entry.rev, seed, params, metrics, items), notes


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _labels() -> Iterator[str]:
    yield from string.ascii_uppercase
    n = 27
    while True:
        yield f"G{n}"
        n += 1


def _group(runs: Sequence[Run], seed_key: str,
           reference: Mapping[str, Any]) -> tuple[list[Group], list[Skipped], int]:
    """Runs with equal params (seed left out) in groups: the `reference` params' group first, the
    others in order of first appearance; plus the number of params all groups set alike. A second
    run of a group's seed is skipped, since counting it twice would shrink the spread."""
    members: dict[str, list[Run]] = {_canonical(reference): []}
    skipped: list[Skipped] = []
    for run in runs:
        group = members.setdefault(_canonical(run.params), [])
        twin = next((r for r in group if run.seed is not None and r.seed == run.seed), None)
        if twin is not None:
            skipped.append(Skipped(run.name, f"same params and {seed_key} {run.seed} as {twin.name}"))
        else:
            group.append(run)
    members = {k: g for k, g in members.items() if g}
    firsts = [g[0].params for g in members.values()]
    keys = sorted({k for p in firsts for k in p})
    differing = [k for k in keys if len({_canonical(p[k]) if k in p else None for p in firsts}) > 1]
    groups = [Group(label, {k: g[0].params.get(k, UNSET) for k in differing}, tuple(g))
              for label, g in zip(_labels(), members.values())]
    return groups, skipped, len(keys) - len(differing)


def summarize(exp_show: Sequence[Mapping[str, Any]], names: Sequence[str] = (), metric_globs: Sequence[str] = (),
              *, seed_key: str = "seed", source: str = "dvc exp show") -> Summary:
    """The seed summary of the runs `names` picks out of parsed `dvc exp show --json` (default: the
    baselines and their experiments), for the metrics matching any of `metric_globs` (default: all)."""
    try:
        entries = _entries(exp_show)
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise ExpShowError(f"{source}: not in the shape `dvc exp show --json` (DVC 3) writes: missing or "
                           f"wrong {e}") from None
    selected = _select(entries, names, source)
    prefixes = _metric_prefixes({p for e in selected for p in _readable_metric_files(e)})
    runs: list[Run] = []
    skipped: list[Skipped] = []
    notes: list[str] = []
    for entry in selected:
        run, run_notes = _run_of(entry, seed_key, prefixes)
        (runs if isinstance(run, Run) else skipped).append(run)
        notes += run_notes
    if not runs:
        what = ", ".join(names) if names else f"the baseline and its experiments in {source}"
        why = "; ".join(f"{s.name}: {s.reason}" for s in skipped) or "none there"
        raise NoRunsError(f"no finished run with metrics among {what} ({why}); run seeds with `dvc exp run -S "
                          f"{seed_key}=N`, or start queued ones with `dvc queue start`")
    if all(r.seed is None for r in runs):
        notes.append(f"no param {seed_key!r} in any run: runs are grouped by all their params "
                     "(name the seed param with --seed-key)")
    reference = {k: v for k, v in _params_of(selected[0]).items() if k != seed_key}
    groups, twins, equal_params = _group(runs, seed_key, reference)
    if dict(groups[0].runs[0].params) != reference:
        notes.append(f"no run of {selected[0].name}'s configuration has metrics: differences are to the first "
                     "configuration found")
    skipped += twins
    every = sorted({m for r in runs for m in r.metrics})
    metrics = [m for m in every if not metric_globs or any(fnmatchcase(m, g) for g in metric_globs)]
    if not metrics:
        shown = ", ".join(every[:12]) + (f", ... ({len(every)} in all)" if len(every) > 12 else "")
        raise NoMetricsError(f"--metric {' '.join(map(repr, metric_globs))} matched none of the metrics: {shown}")
    notes += [f"--metric {g!r} matched no metric" for g in metric_globs if not any(fnmatchcase(m, g) for m in every)]
    rows = []
    for metric in metrics:
        values = [[r.metrics[metric] for r in g.runs if metric in r.metrics] for g in groups]
        cells = tuple(Cell(*mean_std(v), tuple(sorted({r.items[metric] for r in g.runs if metric in r.items})))
                      for g, v in zip(groups, values))
        differences = tuple(Difference(*seed_difference(values[0], v)) for v in values[1:])
        rows.append(Row(metric, cells, differences))
    return Summary(seed_key, tuple(groups), tuple(rows), tuple(skipped), tuple(notes), equal_params)


# ---------------------------------------------------------------------------------------------
# Output


def _count(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _counts(items: Sequence[float]) -> str:
    """One cell's item counts: its runs' one count, or their range where seeds differ."""
    if not items:
        return ""
    return _count(items[0]) if len(items) == 1 else f"{_count(min(items))}..{_count(max(items))}"


def _items(cells: Sequence[Cell]) -> str:
    """A row's `items`: one count where every configuration that has one has the same, else each
    configuration's in group order (`3 / 238`), `-` for one without."""
    if len({c.items for c in cells if c.items}) <= 1:
        return _counts(next((c.items for c in cells if c.items), ()))
    return " / ".join(_counts(c.items) or "-" for c in cells)


def _items_legend(summary: Summary) -> str:
    """The legend of per-configuration item counts (`A / B  items: ...`), empty where no row has them."""
    if not any(" / " in _items(r.cells) for r in summary.rows):
        return ""
    return f"{' / '.join(g.label for g in summary.groups)}  {ITEMS_APART}"


def _cell(c: Cell) -> str:
    if c.n == 0:
        return "-"
    if c.n == 1:
        return f"{c.mean:.4g} (1)"
    return f"{c.mean:.4g} ± {c.std:.2g} ({c.n})"


def _mark(d: Difference) -> str:
    return {True: "~", False: "", None: "?"}[d.within_spread]


def _difference(d: Difference, tilde: str = "~") -> str:
    if math.isnan(d.difference):
        return "-"
    number = "0" if d.difference == 0 else f"{d.difference:+.2g}"
    return f"{number} {_mark(d).replace('~', tilde)}".rstrip()


def _value(v: Any) -> str:
    return v if isinstance(v, str) else _canonical(v)


def _param_text(params: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={_value(v)}" for k, v in params.items())


def _short(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars - 1] + "…"


def _packed(pieces: Sequence[str], width: int, indent: str, max_lines: int) -> list[str]:
    """`pieces` two spaces apart on lines of at most `width` columns, each line after `indent`, a
    piece wider than a line cut; past `max_lines` lines, one line says how many pieces are left."""
    room = max(width - len(indent), 1)
    lines: list[str] = []
    placed = 0
    for piece in (_short(p, room) for p in pieces):
        if lines and len(lines[-1]) + 2 + len(piece) <= room:
            lines[-1] += "  " + piece
        elif len(lines) < max_lines:
            lines.append(piece)
        else:
            break
        placed += 1
    if placed < len(pieces):
        lines.append(_short(f"... and {len(pieces) - placed} more (--json lists them all)", room))
    return [indent + line for line in lines]


def _wrapped(text: str, width: int, indent: str = "", more: str = "    ") -> list[str]:
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=more, break_on_hyphens=False)


def _preset(group: Group) -> str:
    value = group.runs[0].params.get(PRESET_KEY)
    return "" if value is None else f"{PRESET_KEY} {_value(value)}, "


def _runs_text(group: Group, seed_key: str) -> str:
    runs = ", ".join(r.name if r.seed is None else f"{r.name} ({seed_key} {r.seed})" for r in group.runs)
    return f"{len(group.runs)} run{'s' if len(group.runs) != 1 else ''}: {runs}"


def _columns(summary: Summary, tilde: str = "~") -> tuple[list[list[str]], list[list[str]]]:
    """The table as columns: the shared ones (metric, items), then one block per group (its cell,
    and for every group but the first its difference to the first)."""
    first = summary.groups[0].label
    shared = [["metric", *(r.metric for r in summary.rows)], ["items", *(_items(r.cells) for r in summary.rows)]]
    blocks = []
    for i, g in enumerate(summary.groups):
        block = [[g.label, *(_cell(r.cells[i]) for r in summary.rows)]]
        if i:
            block.append([f"{g.label}-{first}", *(_difference(r.differences[i - 1], tilde) for r in summary.rows)])
        blocks.append(block)
    return shared, blocks


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _params_line(summary: Summary) -> str:
    differing = len(summary.groups[0].params)
    if not differing:
        return _plural(summary.equal_params, "param")
    return f"{_plural(differing, 'param')} differ{'s' if differing == 1 else ''}, {summary.equal_params} equal"


def _shown_params(group: Group) -> dict[str, Any]:
    """The params a group differs in, less the preset (named on the group's line)."""
    return {k: v for k, v in group.params.items() if k != PRESET_KEY}


def _header(summary: Summary, width: int) -> list[str]:
    """The configurations, each on its lines: preset and runs, then the params it differs in."""
    n_runs = sum(len(g.runs) for g in summary.groups)
    lines = _wrapped(f"{_plural(n_runs, 'run')} in {_plural(len(summary.groups), 'configuration')} "
                     f"({summary.seed_key} left out of the grouping); {_params_line(summary)}", width)
    for g in summary.groups:
        lines += _wrapped(f"{g.label}  {_preset(g)}{_runs_text(g, summary.seed_key)}", width, "  ", "     ")
        params = [f"{k}={_short(_value(v), VALUE_CHARS)}" for k, v in _shown_params(g).items()]
        lines += _packed(params, width, "     ", PARAM_LINES)
    if summary.skipped:
        lines += _wrapped("skipped: " + "; ".join(f"{s.name} ({s.reason})" for s in summary.skipped), width)
    for n in summary.notes:
        lines += _wrapped(f"note: {n}", width)
    return lines


def _widths(cols: Sequence[Sequence[str]]) -> list[int]:
    return [max(map(len, col)) for col in cols]


def render_text(summary: Summary, width: int = 100) -> str:
    """Plain text: the groups, then one row per metric; group blocks that do not fit in `width`
    columns go to further tables that repeat the metric column."""
    shared, blocks = _columns(summary)
    fixed = sum(_widths(shared)) + 2 * len(shared)
    chunks: list[list[list[str]]] = [[]]
    used = fixed
    for block in blocks:
        need = sum(_widths(block)) + 2 * len(block)
        if chunks[-1] and used + need > width:
            chunks.append([])
            used = fixed
        chunks[-1] += block
        used += need
    out = _header(summary, width)
    for chunk in chunks:
        cols = shared + chunk
        w = _widths(cols)
        out.append("")
        for i in range(len(cols[0])):
            cells = [cols[0][i].ljust(w[0])] + [col[i].rjust(wc) for col, wc in zip(cols[1:], w[1:])]
            out.append("  ".join(cells).rstrip())
    if len(summary.groups) > 1:
        out += ["", f"differences are to {summary.groups[0].label}"]
        out += [line for text in (f"~  {WITHIN_SPREAD}", f"?  {SPREAD_UNKNOWN}")
                for line in _wrapped(text, width, "  ", "     ")]
    out += _wrapped(_items_legend(summary), width, "  ", "     ")
    return "\n".join(out) + "\n"


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(summary: Summary) -> str:
    """A markdown section: the groups as a list, the metrics as one table."""
    # A single `~` pair in a row would read as strikethrough in GitHub markdown.
    shared, blocks = _columns(summary, tilde="\\~")
    cols = shared + [col for block in blocks for col in block]
    lines = [f"Runs by configuration ({summary.seed_key} left out of the grouping; {_params_line(summary)}):", ""]
    for g in summary.groups:
        params = f" `{_param_text(_shown_params(g))}`" if _shown_params(g) else ""
        lines.append(f"- **{g.label}**{params}: {_md(_preset(g) + _runs_text(g, summary.seed_key))}")
    lines += [f"- skipped: {_md(s.name)} ({_md(s.reason)})" for s in summary.skipped]
    lines += [f"- note: {_md(n)}" for n in summary.notes]
    lines += ["", "| " + " | ".join(_md(c[0]) for c in cols) + " |", "|---|" + "--:|" * (len(cols) - 1)]
    for i in range(1, len(cols[0])):
        lines.append(f"| `{_md(cols[0][i])}` | " + " | ".join(_md(c[i]) for c in cols[1:]) + " |")
    if len(summary.groups) > 1:
        lines += ["", f"Differences are to {summary.groups[0].label}; `~` {WITHIN_SPREAD}; `?` {SPREAD_UNKNOWN}."]
    if _items_legend(summary):
        lines += ["", f"{_md(_items_legend(summary))}."]
    return "\n".join(lines) + "\n"


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


def summary_json(summary: Summary) -> dict[str, Any]:
    """The summary as plain JSON values (nan as null), for scripts."""
    first = summary.groups[0].label
    return {
        "seed_key": summary.seed_key,
        "equal_params": summary.equal_params,
        "groups": [{"label": g.label, "params": dict(g.params),
                    "runs": [{"name": r.name, "rev": r.rev, "seed": r.seed} for r in g.runs]} for g in summary.groups],
        "metrics": [{
            "metric": row.metric,
            "groups": [{"label": g.label, "mean": _num(c.mean), "std": _num(c.std), "n": c.n, "items": list(c.items)}
                       for g, c in zip(summary.groups, row.cells)],
            "differences": [{"label": g.label, "to": first, "difference": _num(d.difference),
                             "spread": _num(d.spread), "within_spread": d.within_spread}
                            for g, d in zip(summary.groups[1:], row.differences)],
        } for row in summary.rows],
        "skipped": [{"name": s.name, "reason": s.reason} for s in summary.skipped],
        "notes": list(summary.notes),
    }
