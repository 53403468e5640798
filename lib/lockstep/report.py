"""The run's report card: a markdown page and PNG charts rebuilt from metrics JSON and the per-step
series (lockstep.series) alone (seconds, no model). It does not run or evaluate anything itself."""

from __future__ import annotations

import math
import platform
import re
import subprocess
from collections.abc import Mapping
from importlib.metadata import version
from pathlib import Path
from typing import Any

from lockstep.io import atomic_dir, read_json
from lockstep.series import SUFFIX as SERIES_SUFFIX
from lockstep.series import read_series_file

# Report columns as nanochat's card names them, with the pipeline stage behind each.
STAGE_COLUMNS: tuple[tuple[str, str], ...] = (("BASE", "pretrain"), ("MID", "midtrain"), ("SFT", "sft"), ("RL", "rl"))
HEADLINE_KEYS = ("core", "chatcore")
_TRAIN_KEY_HINTS = ("time_s", "tokens", "steps", "step", "flops", "mfu", "tok_per_s", "params")


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
    """Every `*.json` in `metrics_dir` as {file stem: flat dict}."""
    metrics_dir = Path(metrics_dir)
    if not metrics_dir.is_dir():
        raise FileNotFoundError(f"metrics folder {metrics_dir} does not exist; run the pipeline (dvc repro) first")
    out = {}
    for path in sorted(metrics_dir.glob("*.json")):
        data = read_json(path, what="metrics file")
        if not isinstance(data, Mapping):
            raise ValueError(f"metrics file {path} must hold a JSON object; re-run the stage that writes it")
        out[path.stem] = flatten(data)
    return out


def read_series(plots_dir: Path) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """The per-step series the stages write with lockstep.series (`<plots_dir>/<stage>/<name>.tsv`,
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


def draw_charts(series: Mapping[str, Mapping[str, list[tuple[float, float]]]], out_dir: Path) -> list[Path]:
    """One PNG per quantity (loss, val_bpb, reward, pass@1, ...), one line per stage."""
    # matplotlib: heavy and needed for charts only, so importing the report stays cheap.
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    paths = []
    for col in sorted(series):
        fig, ax = plt.subplots(figsize=(6.0, 3.6), dpi=100)
        for stage in sorted(series[col]):
            pts = sorted(series[col][stage])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=stage, linewidth=1.4)
        ax.set_xlabel("step")
        ax.set_ylabel(col)
        ax.set_title(col)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
        fig.tight_layout()
        path = Path(out_dir) / f"{_slug(col)}.png"
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
    lines += ["| " + " | ".join(_fmt(c) if not isinstance(c, str) else c.replace("|", "\\|") for c in r) + " |" for r in rows]
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


def render_markdown(metrics: Mapping[str, Mapping[str, Any]], charts: list[Path], environment: Mapping[str, str]) -> str:
    """The report card text."""
    lines = ["# lockstep report card", ""]
    lines += ["Rebuilt from `data/metrics` and `data/plots` by the `report` stage.", ""]

    lines += ["## Environment", ""]
    env_rows = [[k, v] for k, v in environment.items()]
    for stem in sorted(metrics):
        for k, v in sorted(metrics[stem].items()):
            if isinstance(v, str):
                env_rows.append([f"{stem}: {k}", v])
    lines += _table(["", "value"], env_rows) + [""]

    train_stages = [(col, st) for col, st in STAGE_COLUMNS if st in metrics]
    if train_stages:
        keys = sorted({k for _, st in train_stages for k, v in metrics[st].items()
                       if not isinstance(v, str) and any(h in k for h in _TRAIN_KEY_HINTS)})
        lines += ["## Training: wall time and tokens", ""]
        lines += _table(["metric", *[c for c, _ in train_stages]],
                        [[k, *[metrics[st].get(k) for _, st in train_stages]] for k in keys]) + [""]

    if "tokenizer" in metrics:
        lines += ["## Tokenizer", ""]
        lines += _table(["metric", "value"], [[k, v] for k, v in sorted(metrics["tokenizer"].items()) if not isinstance(v, str)]) + [""]

    eval_cols = [(col, f"eval_{st}") for col, st in STAGE_COLUMNS]
    present = [(c, s) for c, s in eval_cols if s in metrics]
    if present:
        keys = sorted({k for _, s in present for k, v in metrics[s].items() if not isinstance(v, str)},
                      key=lambda k: (k not in HEADLINE_KEYS, k))
        lines += ["## Evaluation", ""]
        lines += _table(["metric", *[c for c, _ in eval_cols]],
                        [[k, *[metrics[s].get(k) if s in metrics else None for _, s in eval_cols]] for k in keys]) + [""]

    known = {"tokenizer"} | {st for _, st in STAGE_COLUMNS} | {s for _, s in eval_cols}
    others = sorted(set(metrics) - known)
    for stem in others:
        lines += [f"## {stem}", ""]
        lines += _table(["metric", "value"], [[k, v] for k, v in sorted(metrics[stem].items()) if not isinstance(v, str)]) + [""]

    if charts:
        lines += ["## Charts", ""]
        for path in charts:
            lines += [f"![{path.stem}]({path.name})", ""]
    return "\n".join(lines).rstrip() + "\n"


def build_report(metrics_dir: Path, plots_dir: Path, out_dir: Path, *, environment: Mapping[str, str]) -> Path:
    """Write `out_dir/report.md` and its charts atomically (the folder is replaced whole)."""
    metrics = load_metrics(metrics_dir)
    series = read_series(plots_dir)
    with atomic_dir(out_dir) as tmp:
        charts = draw_charts(series, tmp)
        (tmp / "report.md").write_text(render_markdown(metrics, charts, environment), encoding="utf-8")
    return Path(out_dir) / "report.md"
