"""The run's report card: a markdown page and PNG charts rebuilt from the metrics JSON (results),
the run facts JSON (lockstep.core.runinfo), the eval stages' per-item records and the per-step series
(lockstep.core.series) alone (seconds, no model). It does not run or evaluate anything itself.

Every result that has items behind it is shown with a 95% interval (lockstep.core.stats): a Wilson
interval for a rate written with its item count `<metric>.n`, a bootstrap over documents for an
eval's bits per byte (`bpb_<cache>.jsonl` in the predictions folder). A card whose every item count
is below MICRO_ITEMS opens with one line saying it is a micro run, a check and not a result."""

from __future__ import annotations

import json
import math
import platform
import re
import subprocess
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from lockstep.core.io import atomic_dir, read_json
from lockstep.core.series import SUFFIX as SERIES_SUFFIX
from lockstep.core.series import read_series_file
from lockstep.core.stats import Z95, bootstrap_ratio_interval, wilson_interval
from lockstep.evaluate.chatcore import report_columns

# Report columns as nanochat's card names them, with the pipeline stage behind each.
STAGE_COLUMNS: tuple[tuple[str, str], ...] = (("BASE", "pretrain"), ("MID", "midtrain"), ("SFT", "sft"), ("RL", "rl"))
HEADLINE_KEYS = ("core", "chatcore")
# Errors whose message says what to fix: the report stage's entry point prints them as one line.
ERRORS = (FileNotFoundError,)
COUNT_SUFFIX = ".n"  # `<metric>.n`: the number of items a rate is over
# What an eval's `core` is a mean over (written by lockstep.pipeline.eval): named in the row's
# label, not shown as rows of their own.
CORE_FACTS = ("core_source", "core_tasks", "core_items")
Interval = tuple[float, float, int]  # low, high, items
# A run whose every item count is below MICRO_ITEMS is a micro run (the smoke and rehearsal presets
# score 3 to 8 items per task): even at 30 items, 15 right reads [0.332, 0.668] as a 95% Wilson
# interval, so no number on such a card is a result. A real run with one small task is not one.
MICRO_ITEMS = 30
MICRO_RUN = "micro run: a check that the pipeline runs, not a result"


def flatten(obj: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys (`core.bard_cloze.accuracy`), the shape `dvc metrics` prints."""
    out: dict[str, Any] = {}
    for k, v in obj.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def load_metrics(metrics_dir: Path) -> dict[str, dict[str, Any]]:
    """Every `*.json` in `metrics_dir` as {file stem: flat dict} (the metrics or the run facts)."""
    metrics_dir = Path(metrics_dir)
    if not metrics_dir.is_dir():
        raise FileNotFoundError(f"folder {metrics_dir} does not exist; run the pipeline (dvc repro) first")
    out = {}
    for path in sorted(metrics_dir.glob("*.json")):
        data = read_json(path, what="metrics file")
        if not isinstance(data, Mapping):
            raise ValueError(f"metrics file {path} must hold a JSON object; re-run the stage that writes it")
        out[path.stem] = flatten(data)
    return out


def read_series(plots_dir: Path) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """The per-step series the stages write with lockstep.core.series (`<plots_dir>/<stage>/<name>.tsv`,
    e.g. `pretrain/train.tsv`, `rl/val.tsv`) as {column: {stage: [(step, value), ...]}}, so one
    chart overlays a quantity across stages. A series is named by its stage folder."""
    series: dict[str, dict[str, list[tuple[float, float]]]] = {}
    plots_dir = Path(plots_dir)
    if not plots_dir.is_dir():
        return series
    for stage_dir in sorted(p for p in plots_dir.iterdir() if p.is_dir()):
        for path in sorted(stage_dir.glob(f"*{SERIES_SUFFIX}")):
            for col, points in read_series_file(path).items():
                if points:
                    series.setdefault(col, {}).setdefault(stage_dir.name, []).extend(
                        (float(step), value) for step, value in points)
    return series


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "series"


# A series of this many points or fewer is drawn as marked values with its change printed: a line
# through two points on an auto-scaled axis drew RL's held-out length going 65.63 -> 65.62 tokens
# as a full-height diagonal (tiny run, data/plots/rl/val.tsv).
FEW_POINTS = 2


@dataclass(frozen=True)
class Quantity:
    """What one series column measures, so its chart says so. `data` names what the values were
    measured on: `train` / `val` (the stage's mixture split), `rollouts` (RL's sampled training
    completions), `held_out` (RL's scored val problems), or "" for a schedule measured on no data,
    the only kind whose stages share a chart. Columns of one stage with the same `group` share one
    chart (same unit, same data), each line named by `label`."""

    pattern: str  # the column name, a regular expression matched in full
    stages: tuple[str, ...]  # the stages whose column this is; () = any stage
    key: str  # the chart's file name (prefixed with its stage when per stage)
    question: str  # the chart's title: what was measured
    unit: str  # the y axis label
    data: str  # "train" | "val" | "rollouts" | "held_out" | ""
    group: str = ""
    label: str = ""
    rate: bool = False  # a fraction in [0, 1]: the axis spans [0, 1]


TRAIN_STAGES = ("pretrain", "midtrain", "sft")
# The series the stages write (lockstep.train.trainer.SERIES_COLUMNS, lockstep.rl.trainer.series_columns), in
# chart order. RL's `loss` is the policy-gradient objective, not a cross-entropy: it is labelled
# apart from the supervised stages' `train_loss`, whose name follows the stage's objective.
QUANTITIES: tuple[Quantity, ...] = (
    Quantity("lr_mult", (), "lr_mult", "learning-rate multiplier", "multiple of the base learning rate", ""),
    Quantity("train_loss", (), "train_loss", "train loss", "nats per target token", "train"),
    Quantity("val_bpb", (), "val_bpb", "validation bits per byte", "bits per byte", "val"),
    Quantity("reward", ("rl",), "reward", "mean reward per rollout", "reward (1 = correct answer)",
             "rollouts", rate=True),
    Quantity("loss", ("rl",), "objective", "RL objective (policy-gradient loss)",
             "-sum(advantage * log p) / sampled tokens", "rollouts"),
    Quantity("completion_len", ("rl",), "rollout_len", "mean completion length per rollout",
             "tokens per completion", "rollouts"),
    Quantity("anchor_loss", ("rl",), "anchor_loss", "anchor loss (SFT conversations in every update)",
             "nats per assistant token", "anchor"),
    Quantity("val_pass@1", ("rl",), "heldout_accuracy", "held-out accuracy", "fraction of problems solved",
             "held_out", group="accuracy", label="pass@1 (mean over the samples)", rate=True),
    Quantity(r"val_pass@(\d+)", ("rl",), "heldout_accuracy", "held-out accuracy", "fraction of problems solved",
             "held_out", group="accuracy", label="pass@{0} (any of {0} samples)", rate=True),
    Quantity("val_greedy", ("rl",), "heldout_accuracy", "held-out accuracy", "fraction of problems solved",
             "held_out", group="accuracy", label="greedy (temperature 0)", rate=True),
    Quantity("val_completion_len", ("rl",), "heldout_len", "mean greedy completion length",
             "tokens per completion", "held_out"),
)


@dataclass(frozen=True)
class Line:
    """One drawn series: `style` is "line", or "points" for FEW_POINTS or fewer (values marked,
    the change printed in `change`)."""

    label: str
    points: tuple[tuple[float, float], ...]
    style: str
    change: str = ""  # "0.6663 -> 0.715 (+0.04875)" for a points series


@dataclass(frozen=True)
class Chart:
    """One chart: one question, on one set of data. `stages` holds one stage unless the quantity
    is measured on no data (a schedule)."""

    key: str  # the file stem
    title: str  # first line what was measured, second line on what data
    xlabel: str
    ylabel: str
    stages: tuple[str, ...]
    data: str  # the data in words; "" for a schedule
    lines: tuple[Line, ...]
    ylim: tuple[float, float] | None = None  # None: matplotlib's, without an offset

    @property
    def file(self) -> str:
        return f"{self.key}.png"


def _quantity(stage: str, column: str) -> tuple[Quantity, str]:
    """The catalogue entry for `column` of `stage` and its line label; an unknown column gets an
    entry of its own, per stage, naming the column."""
    for q in QUANTITIES:
        m = re.fullmatch(q.pattern, column)
        if m and (not q.stages or stage in q.stages):
            return q, q.label.format(*m.groups()) if q.label else f"{stage}/{column}"
    return Quantity(re.escape(column), (stage,), _slug(column), column, column, "unrecorded"), f"{stage}/{column}"


def _mixture(flat: Mapping[str, Any], key: str = r"epochs\.components\.(.+)\.weight") -> str:
    """`shakespeare 0.9 + roam 0.1`, heaviest first, from the run facts whose keys match the
    pattern `key` (its group the source's name): by default a training stage's mixture
    (lockstep.data.budget.epochs_facts), else e.g. RL's anchor (`setup.anchor.<name>`)."""
    weights = {m.group(1): v for k, v in flat.items() if (m := re.fullmatch(key, k))}
    return " + ".join(f"{name} {w:g}" for name, w in sorted(weights.items(), key=lambda kv: (-kv[1], kv[0])))


def describe_data(stage: str, kind: str, facts: Mapping[str, Any]) -> str:
    """The data a `stage` series of `kind` (Quantity.data) was measured on, in words, from the
    stage's flattened run facts; without them, the stage's own split, named as such."""
    if kind in ("train", "val"):
        mix = _mixture(facts)
        tokens = {"assistant": ", assistant tokens only", "all": ", all tokens"}.get(facts.get("setup.loss"), "")
        return f"{kind} split of {mix}{tokens}" if mix else f"the {stage} mixture's {kind} split{tokens}"
    problems, temperature = facts.get("setup.problems"), facts.get("setup.temperature")
    if kind == "rollouts":
        if problems is None:
            return "sampled training rollouts"
        per_step = facts.get("setup.problems_per_step"), facts.get("setup.group_size")
        sources = " + ".join(filter(None, [problems, _mixture(facts, r"setup\.mixture\.(.+)")]))
        return (f"train split of {sources}: {per_step[0]} problems x {per_step[1]} samples per step, "
                f"temperature {temperature:g}")
    if kind == "anchor":
        mix = _mixture(facts, r"setup\.anchor\.(.+)")
        rows = facts.get("setup.anchor_rows")
        measure = " KL to the starting checkpoint," if facts.get("setup.anchor_target") == "sft" else ""
        if not mix or rows is None:
            return f"SFT train conversations,{measure} assistant tokens only"
        return f"train split of {mix}: {rows} conversations per update,{measure} assistant tokens only"
    if kind == "held_out":
        if problems is None:
            return "held-out problems"
        return (f"val split of {problems}: {facts.get('setup.eval_problems')} problems, "
                f"{facts.get('setup.pass_k')} samples at temperature {temperature:g} and one greedy")
    if kind == "unrecorded":
        return "data not recorded (a series lockstep.pipeline.report.QUANTITIES does not describe)"
    return ""


def _change(points: tuple[tuple[float, float], ...]) -> str:
    values = [v for _, v in points]
    if len(values) == 1:
        return f"{values[0]:.4g} at step {points[0][0]:g}"
    return f"{values[0]:.4g} -> {values[-1]:.4g} ({values[-1] - values[0]:+.4g})"


def _line(label: str, pts: list[tuple[float, float]]) -> Line:
    points = tuple(sorted(pts))
    few = len(points) <= FEW_POINTS
    return Line(label, points, "points" if few else "line", _change(points) if few else "")


def _ylim(lines: tuple[Line, ...], rate: bool) -> tuple[float, float] | None:
    """A rate spans [0, 1]; a chart of points only starts at 0, so a small change looks small."""
    if rate:
        return (0.0, 1.0)
    values = [v for ln in lines for _, v in ln.points]
    if all(ln.style == "points" for ln in lines) and values and min(values) >= 0:
        return (0.0, max(values) * 1.15 or 1.0)
    return None


def _train_loss_name(facts: Mapping[str, Any]) -> str:
    """What a supervised stage's `train_loss` is, by its objective (run facts `setup.objective`)."""
    objective, weight = facts.get("setup.objective"), facts.get("setup.prefix_weight")
    if objective == "ce":
        return "train cross-entropy"
    if objective == "prefix_smooth":
        w = f", w={weight:g}" if isinstance(weight, (int, float)) else ""
        return f"train loss (prefix-smoothed cross-entropy{w})"
    return "train loss (the stage's objective)"


def _xlabel(stage: str) -> str:
    return "RL step (policy updates; 0 = before the first)" if stage == "rl" else f"{stage} optimizer step"


def plan_charts(series: Mapping[str, Mapping[str, list[tuple[float, float]]]],
                runinfo: Mapping[str, Mapping[str, Any]] | None = None) -> list[Chart]:
    """The report's charts for `series` (read_series' shape), one per question: a quantity on the
    data it was measured on. Stages measured on different data never share a chart; a schedule
    (lr_mult) does, one line per stage in its own style, stages with identical values on one line
    named by both. `runinfo` (flattened run facts by stage) names the data and the objective."""
    runinfo = runinfo or {}
    order = {s: i for i, (_, s) in enumerate(STAGE_COLUMNS)}
    stages = sorted({s for by_stage in series.values() for s in by_stage}, key=lambda s: (order.get(s, len(order)), s))
    cat = {q.pattern: i for i, q in enumerate(QUANTITIES)}
    shared: dict[str, list[tuple[str, Quantity, list[tuple[float, float]]]]] = {}
    per_stage: dict[tuple[str, str], list[tuple[str, Quantity, list[tuple[float, float]]]]] = {}
    for stage in stages:
        for column in sorted(c for c in series if stage in series[c]):
            q, label = _quantity(stage, column)
            if q.data == "":
                shared.setdefault(q.key, []).append((stage, q, series[column][stage]))
            else:
                per_stage.setdefault((stage, q.key), []).append((label, q, series[column][stage]))

    charts = []
    for key, members in shared.items():
        q = members[0][1]
        merged: dict[tuple[tuple[float, float], ...], list[str]] = {}
        for stage, _, pts in members:
            merged.setdefault(tuple(sorted(pts)), []).append(stage)
        lines = tuple(_line(" = ".join(names), list(pts)) for pts, names in merged.items())
        names = tuple(s for s, _, _ in members)
        charts.append(Chart(key, f"{q.question}, by stage ({', '.join(names)})\na schedule: measured on no data",
                            "optimizer step of each stage", q.unit, names, "", lines, _ylim(lines, q.rate)))

    def rank(item: tuple[tuple[str, str], list[Any]]) -> tuple[int, int, str]:
        (stage, key), members = item
        return stages.index(stage), cat.get(members[0][1].pattern, len(cat)), key

    for (stage, key), members in sorted(per_stage.items(), key=rank):
        q = members[0][1]
        facts = runinfo.get(stage, {})
        question = _train_loss_name(facts) if q.key == "train_loss" else q.question
        members = sorted(members, key=lambda m: (cat.get(m[1].pattern, len(cat)), m[0]))
        lines = tuple(_line(label, pts) for label, _, pts in members)
        data = describe_data(stage, q.data, facts)
        where = data if q.data == "unrecorded" else f"on {data}"
        charts.append(Chart(f"{stage}_{key}", f"{stage}: {question}\n{where}", _xlabel(stage), q.unit, (stage,),
                            data, lines, _ylim(lines, q.rate)))
    return charts


# Line styles and markers in drawing order: a later line is thinner and dashed, so one lying on
# another still shows (midtrain's and SFT's lr_mult were one line in the tiny run's report).
STYLES = (("-", 2.8, "o"), ("--", 2.0, "s"), (":", 1.6, "^"), ("-.", 1.2, "D"))


def draw_charts(charts: Sequence[Chart], out_dir: Path) -> list[Path]:
    """One PNG per chart, `out_dir/<chart.file>`."""
    # matplotlib: heavy and needed for charts only, so importing the report stays cheap.
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    paths = []
    for chart in charts:
        fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
        steps = [p[0] for ln in chart.lines for p in ln.points]
        dodge = 0.02 * ((max(steps) - min(steps)) or 1.0)
        for i, line in enumerate(chart.lines):
            style, width, marker = STYLES[i % len(STYLES)]
            xs, ys = [p[0] for p in line.points], [p[1] for p in line.points]
            if line.style == "points":
                # Several point series side by side, so equal values (pass@8 and greedy at 0.99) both show.
                shift = (i - (len(chart.lines) - 1) / 2) * dodge
                xs = [x + shift for x in xs]
                ax.plot(xs, ys, linestyle="none", marker=marker, markersize=7, label=f"{line.label}: {line.change}")
                if len(chart.lines) == 1:  # with several, the legend carries the values
                    for x, y in zip(xs, ys):
                        ax.annotate(f"{y:.4g}", (x, y), textcoords="offset points", xytext=(6, 4), fontsize="small")
            else:
                ax.plot(xs, ys, linestyle=style, linewidth=width if len(chart.lines) > 1 else 1.4, label=line.label)
        ax.ticklabel_format(axis="y", useOffset=False)  # no "+6.562e1" offset: tick labels are the values
        if chart.ylim is not None:
            pad = (chart.ylim[1] - chart.ylim[0]) * 0.03
            ax.set_ylim(chart.ylim[0] - pad, chart.ylim[1] + pad)
        if all(ln.style == "points" for ln in chart.lines):
            span = (max(steps) - min(steps)) or 1.0
            ax.set_xlim(min(steps) - 0.1 * span, max(steps) + 0.2 * span)  # room for the value labels
        ax.set_xlabel(chart.xlabel)
        ax.set_ylabel(chart.ylabel, fontsize="small")
        head, _, tail = chart.title.partition("\n")
        ax.set_title(head + ("\n" + textwrap.fill(tail, 80) if tail else ""), fontsize="medium")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
        fig.tight_layout()
        path = Path(out_dir) / chart.file
        # No timestamp or software tag in the file, so equal series give equal bytes.
        fig.savefig(path, format="png", metadata={"Software": None})
        plt.close(fig)
        paths.append(path)
    return paths


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
            return f"{v:.3e}"
        return f"{v:.4f}"
    if isinstance(v, int) and abs(v) >= 10_000:
        return f"{v:,}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += [
        "| " + " | ".join(_fmt(c) if not isinstance(c, str) else c.replace("|", "\\|") for c in r) + " |" for r in rows
    ]
    return lines


def environment_info(repo_root: Path) -> dict[str, str]:
    """Where the report was drawn: code revision, Python and library versions, platform. The
    versions are read from the installed distributions, so drawing a report imports no torch."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo_root, capture_output=True,
                             text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo_root,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
        rev += "-dirty" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        rev = "unknown (not a git checkout)"
    return {
        "code revision": rev,
        "python": platform.python_version(),
        "torch": version("torch"),
        "numpy": version("numpy"),
        "matplotlib": version("matplotlib"),
        "platform": platform.platform(terse=True),
    }


def intervals(
    metrics: Mapping[str, Mapping[str, Any]], predictions_dir: Path | None
) -> dict[tuple[str, str], Interval]:
    """95% intervals by (file stem, metric). A rate with a count `<metric>.n` gets the Wilson
    interval; for a mean of per-item rates (pass@1 over k samples per problem) the same interval
    is conservative, since p(1-p)/n bounds the variance of any mean of n values in [0, 1]. An
    eval's `bpb.<cache>` gets a bootstrap over the documents in `<predictions>/<stage>/bpb_<cache>.jsonl`
    (2000 resamples, seed 0: the same records always give the same interval)."""
    out: dict[tuple[str, str], Interval] = {}
    for stem, flat in metrics.items():
        for key, value in flat.items():
            n = flat.get(key + COUNT_SUFFIX)
            if isinstance(n, int) and n > 0 and isinstance(value, (int, float)) and 0 <= value <= 1:
                lo, hi = wilson_interval(value * n, n)
                out[(stem, key)] = (lo, hi, n)
            elif stem.startswith("eval_") and key.startswith("bpb.") and predictions_dir is not None:
                path = Path(predictions_dir) / stem.removeprefix("eval_") / f"{key.replace('.', '_')}.jsonl"
                if path.is_file():
                    docs = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
                    lo, hi = bootstrap_ratio_interval(
                        [d["nats"] / math.log(2) for d in docs], [d["bytes"] for d in docs]
                    )
                    out[(stem, key)] = (lo, hi, len(docs))
    return out


def _with_interval(value: Any, iv: Interval | None) -> str:
    if iv is None or value is None or math.isnan(iv[0]):
        return _fmt(value)
    return f"{_fmt(value)} [{iv[0]:.3f}, {iv[1]:.3f}] n={iv[2]:,}"


def _numeric(flat: Mapping[str, Any]) -> list[str]:
    return [
        k for k, v in flat.items() if not isinstance(v, str) and not k.endswith(COUNT_SUFFIX) and k not in CORE_FACTS
    ]


def core_label(flat: Mapping[str, Any]) -> str:
    """The name an eval's `core` goes by: nanochat's "CORE" only for the DCLM bundle's tasks
    (its zip checked against the published sha256), "CORE-style" for any other tasks."""
    source, tasks, items = flat.get("core_source"), flat.get("core_tasks"), flat.get("core_items")
    if source == "dclm":
        return f"CORE (DCLM, {tasks} tasks)"
    if source == "own":
        return f"CORE-style (own tasks, {items:,} items)" if isinstance(items, int) else "CORE-style (own tasks)"
    if source == "bundle":
        return f"CORE-style (bundle not verified as DCLM's, {tasks} tasks, {items:,} items)"
    return "CORE-style (task source not recorded)"


def _core_row_name(stems: list[str], source: Mapping[str, Mapping[str, Any]]) -> str:
    labels = list(dict.fromkeys(core_label(source[s]) for s in stems if s in source and "core" in source[s]))
    return " / ".join(labels) or "core"


def _stage_table(title: str, stems: list[tuple[str, str]], source: Mapping[str, Mapping[str, Any]],
                 ivs: Mapping[tuple[str, str], Interval], first: tuple[str, ...] = ()) -> list[str]:
    present = [(c, s) for c, s in stems if s in source]
    if not present:
        return []
    keys = sorted({k for _, s in present for k in _numeric(source[s])}, key=lambda k: (k not in first, k))
    names = {"core": _core_row_name([s for _, s in present], source)}
    rows = [
        [
            names.get(k, k),
            *[_with_interval(source[s].get(k), ivs.get((s, k))) if s in source else "-" for _, s in stems],
        ]
        for k in keys
    ]
    return [f"## {title}", "", *_table(["metric", *[c for c, _ in stems]], rows), ""]


# The table comparable with nanochat's report card: rows by stage. A task's accuracy carries its
# Wilson interval; CORE and ChatCORE, means of centred accuracies, a normal approximation over their
# tasks (`composite_interval`).
COMPARABLE_ROWS: tuple[tuple[str, str], ...] = (("base", "pretrain"), ("mid", "midtrain"), ("sft", "sft"), ("rl", "rl"))
# The benchmarks nanochat's ChatCORE is over: its reference lines stand beside a run that evaluated
# all of them.
NANOCHAT_CHATCORE = ("arc_easy", "arc_challenge", "mmlu", "gsm8k", "humaneval", "spelling_bee")
# nanochat's published d20 speedrun (its README's report card table, 2025-10-13): {row: {column: value}}.
# SpellingBee is not in that table.
NANOCHAT_D20_SOURCE = "nanochat d20, README report card 2025-10-13"
NANOCHAT_D20: dict[str, dict[str, float]] = {
    "base": {"CORE": 0.2219},
    "mid": {"ARC-Easy": 0.3561, "ARC-Challenge": 0.2875, "MMLU": 0.3111, "GSM8K": 0.0250, "HumanEval": 0.0671,
            "ChatCORE": 0.0730},
    "sft": {"ARC-Easy": 0.3876, "ARC-Challenge": 0.2807, "MMLU": 0.3151, "GSM8K": 0.0455, "HumanEval": 0.0854,
            "ChatCORE": 0.0884},
    "rl": {"GSM8K": 0.0758},
}


def comparable_columns() -> list[tuple[str, str]]:
    """(column, the metric behind it): CORE, each registered ChatCORE benchmark
    (lockstep.evaluate.chatcore.BENCHMARKS, its column as its module names it) and ChatCORE."""
    return [("CORE", "core"), *report_columns(), ("ChatCORE", "chatcore")]


def composite_interval(flat: Mapping[str, Any], prefix: str, score: str) -> Interval | None:
    """95% normal-approximation interval of a mean of centred accuracies (CORE: `core.<task>`,
    ChatCORE: `chat.<task>`, each with `.accuracy`, `.accuracy.n` and `.centered`): a task's
    centred value is (acc - b) / (1 - b), so its variance is acc(1-acc)/n / (1-b)^2, with
    1/(1-b) = (1-centered)/(1-acc); the mean's variance is their sum over K^2. None without tasks."""
    value = flat.get(score)
    tasks = sorted(
        {k[len(prefix) : -len(".centered")] for k in flat if k.startswith(prefix) and k.endswith(".centered")}
    )
    if not tasks or not isinstance(value, (int, float)):
        return None
    var, n_total = 0.0, 0
    for t in tasks:
        acc, n, c = (
            flat.get(f"{prefix}{t}.accuracy"),
            flat.get(f"{prefix}{t}.accuracy.n"),
            flat.get(f"{prefix}{t}.centered"),
        )
        if not isinstance(acc, (int, float)) or not isinstance(n, int) or n <= 0 or not isinstance(c, (int, float)):
            return None
        scale = (1 - c) / (1 - acc) if acc < 1 else 0.0  # acc = 1 has no variance to scale
        var += acc * (1 - acc) / n * scale * scale
        n_total += n
    half = Z95 * math.sqrt(var) / len(tasks)
    return (value - half, value + half, n_total)


def comparable_table(metrics: Mapping[str, Mapping[str, Any]], ivs: Mapping[tuple[str, str], Interval]) -> list[str]:
    """The report card's table in nanochat's shape: rows base / mid / sft / rl, columns CORE, the
    ChatCORE benchmarks and ChatCORE, each value with its 95% interval and n. nanochat's published
    d20 rows follow as labelled reference lines only when the run evaluated nanochat's six
    benchmarks. Empty when no eval stage wrote any of the columns."""
    columns = comparable_columns()
    rows, seen = [], False
    for label, stage in COMPARABLE_ROWS:
        flat = metrics.get(f"eval_{stage}", {})
        cells = []
        for col, key in columns:
            value = flat.get(key)
            if value is None:
                cells.append("-")
                continue
            seen = True
            iv = (composite_interval(flat, "core.", key) if key == "core"
                  else composite_interval(flat, "chat.", key) if key == "chatcore" else ivs.get((f"eval_{stage}", key)))
            cells.append(_with_interval(value, iv))
        rows.append([label, *cells])
    if not seen:
        return []
    stems = [f"eval_{st}" for _, st in COMPARABLE_ROWS]
    same_tasks = any(all(f"chat.{t}.accuracy" in metrics.get(s, {}) for t in NANOCHAT_CHATCORE) for s in stems)
    # nanochat's CORE is the DCLM bundle's: its reference value stands beside ours only when every
    # stage's CORE was measured on that bundle too.
    dclm_core = all(metrics[s].get("core_source") == "dclm" for s in stems if "core" in metrics.get(s, {}))
    if same_tasks:
        for label, _ in COMPARABLE_ROWS:
            ref = {col: v for col, v in NANOCHAT_D20.get(label, {}).items() if col != "CORE" or dclm_core}
            if ref:
                rows.append([f"{label} (reference: {NANOCHAT_D20_SOURCE})",
                             *[f"{ref[col]:.4f}" if col in ref else "-" for col, _ in columns]])
    note = ("Each value: score [95% interval] n=items. Accuracies: Wilson interval; CORE and ChatCORE: normal "
            "approximation over their tasks' centred accuracies.")
    if same_tasks:
        note += f" Reference lines: {NANOCHAT_D20_SOURCE}, published without intervals."
    # The CORE column goes by the name of what it measured ("CORE-style (own tasks, ...)" unless DCLM's).
    header = ["stage", *[_core_row_name(stems, metrics) if key == "core" else c for c, key in columns]]
    return ["## Comparable with nanochat", "", note, "", *_table(header, rows), ""]


def setup_line(metrics: Mapping[str, Mapping[str, Any]], runinfo: Mapping[str, Mapping[str, Any]]) -> str:
    """One line naming what makes runs differ by design: the tokenizer kind and vocab, the
    embedding, and each training stage's loss. Read from the tokenizer metrics and the training
    stages' run facts; a part that was not run reads `-`."""
    tok = metrics.get("tokenizer", {})
    kind = f"{tok['kind']} ({tok['vocab_size']} ids)" if "kind" in tok and "vocab_size" in tok else "-"
    # run facts arrive flattened: {"setup.embedding": ..., "setup.objective": ...}
    setups = {stage: runinfo.get(stage) or {} for _, stage in STAGE_COLUMNS}
    embedding = next((s["setup.embedding"] for s in setups.values() if "setup.embedding" in s), "-")
    losses = []
    for stage, s in setups.items():
        if "setup.objective" in s:
            w = f" w={s['setup.prefix_weight']:g}" if "setup.prefix_weight" in s else ""
            losses.append(f"{stage} {s['setup.objective']}{w}")
    return f"**Tokenizer** {kind} · **embedding** {embedding} · **loss** {', '.join(losses) or '-'}"


def micro_run_line(metrics: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The card's warning line where every item count (`<metric>.n`) in the metrics is below
    MICRO_ITEMS; None where one reaches it, or where the metrics hold no counts to judge by."""
    counts = [v for flat in metrics.values() for k, v in flat.items()
              if k.endswith(COUNT_SUFFIX) and isinstance(v, int | float) and not isinstance(v, bool)]
    if not counts or max(counts) >= MICRO_ITEMS:
        return None
    return (f"**{MICRO_RUN}**: every task has fewer than {MICRO_ITEMS} items (at most {max(counts):g}), "
            "too few for any interval to mean something.")


def _per_part_path(key: str) -> bool:
    """A fast path's own `path` or `results` fact (fast_paths.<part>.path): `numerics.fast_paths`
    already names every part's path in one line, and `fast_paths.<part>.fell_back` the reason."""
    return key.startswith("fast_paths.") and key.rsplit(".", 1)[-1] in ("path", "results")


def render_markdown(metrics: Mapping[str, Mapping[str, Any]], charts: Sequence[Chart], environment: Mapping[str, str],
                    runinfo: Mapping[str, Mapping[str, Any]] | None = None,
                    ivs: Mapping[tuple[str, str], Interval] | None = None) -> str:
    """The report card text: results (with 95% intervals where items stand behind them), then
    the run facts, then the charts."""
    runinfo, ivs = runinfo or {}, ivs or {}
    lines = ["# lockstep report card", ""]
    micro = micro_run_line(metrics)
    if micro:
        lines += [micro, ""]
    lines += [setup_line(metrics, runinfo), ""]
    lines += ["Rebuilt from `data/metrics` (results), `data/runinfo` (run facts), the eval records in `data/eval` "
              "and `data/plots` by the `report` stage. Intervals are 95%: Wilson for rates over n items, a "
              "bootstrap over n documents for bits per byte.", ""]

    lines += comparable_table(metrics, ivs)

    lines += ["## Environment", ""]
    env_rows = [[k, v] for k, v in environment.items()]
    for source in (metrics, runinfo):
        for stem in sorted(source):
            for k, v in sorted(source[stem].items()):
                if isinstance(v, str) and v and k not in CORE_FACTS and not _per_part_path(k):
                    env_rows.append([f"{stem}: {k}", v])
    lines += _table(["", "value"], env_rows) + [""]

    lines += _stage_table("Training results", list(STAGE_COLUMNS), metrics, ivs, first=("val_bpb",))
    eval_cols = [(col, f"eval_{st}") for col, st in STAGE_COLUMNS]
    lines += _stage_table("Evaluation", eval_cols, metrics, ivs, first=HEADLINE_KEYS)

    if "tokenizer" in metrics:
        lines += ["## Tokenizer", ""]
        lines += _table(
            ["metric", "value"], [[k, metrics["tokenizer"][k]] for k in sorted(_numeric(metrics["tokenizer"]))]
        ) + [""]

    known = {"tokenizer"} | {st for _, st in STAGE_COLUMNS} | {s for _, s in eval_cols}
    for stem in sorted(set(metrics) - known):
        lines += [f"## {stem}", ""]
        lines += _table(["metric", "value"], [[k, _with_interval(metrics[stem][k], ivs.get((stem, k)))]
                                              for k in sorted(_numeric(metrics[stem]))]) + [""]

    facts = [(c, s) for c, s in STAGE_COLUMNS] + [(f"eval {c}", s) for c, s in eval_cols]
    lines += _stage_table("Run facts: time, throughput, compute", facts, runinfo, {})

    if charts:
        lines += ["## Charts", "",
                  "One chart per quantity and the data it was measured on (second line of each title); stages "
                  f"share a chart only for a schedule. A series of {FEW_POINTS} points or fewer is drawn as "
                  "points, its change printed.", ""]
        section = None
        for chart in charts:
            here = chart.stages[0] if len(chart.stages) == 1 else "all stages"
            if here != section:
                section = here
                lines += [f"### {here}", ""]
            lines += [f"![{chart.title.replace(chr(10), ' — ')}]({chart.file})", ""]
            changes = [f"{ln.label}: {ln.change}" for ln in chart.lines if ln.change]
            if changes:
                lines += ["*" + "; ".join(changes) + "*", ""]
    return "\n".join(lines).rstrip() + "\n"


def build_report(metrics_dir: Path, plots_dir: Path, out_dir: Path, *, environment: Mapping[str, str],
                 runinfo_dir: Path | None = None, predictions_dir: Path | None = None) -> Path:
    """Write `out_dir/report.md` and its charts atomically (the folder is replaced whole). The run
    facts and the eval records are optional: without them the card shows results without them."""
    metrics = load_metrics(metrics_dir)
    runinfo = load_metrics(runinfo_dir) if runinfo_dir is not None and Path(runinfo_dir).is_dir() else {}
    ivs = intervals(metrics, predictions_dir)
    series = read_series(plots_dir)
    charts = plan_charts(series, runinfo)
    with atomic_dir(out_dir) as tmp:
        draw_charts(charts, tmp)
        (tmp / "report.md").write_text(render_markdown(metrics, charts, environment, runinfo, ivs), encoding="utf-8")
    return Path(out_dir) / "report.md"
