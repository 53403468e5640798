"""CORE-style in-context evaluation of base models (the DCLM paper's metric): tasks in the DCLM
eval-bundle layout, few-shot prompts, the three task types scored from a model's logits, and
accuracy centred on each task's random baseline. Does not generate text; see evaluate.chat."""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml

from lockstep.seeds import stream_generator

TaskType = Literal["multiple_choice", "schema", "language_modeling"]
TASK_TYPES: tuple[str, ...] = ("multiple_choice", "schema", "language_modeling")
FEWSHOT_SEP = "\n\n"


@dataclasses.dataclass(frozen=True)
class CoreTask:
    label: str
    task_type: TaskType
    num_fewshot: int
    continuation_delimiter: str
    random_baseline: float  # fraction in [0, 1): accuracy of guessing
    items: tuple[dict[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class Scored:
    """One item's rendering: token rows (one per option) and the [start, end) span scored in each."""

    rows: list[list[int]]
    spans: list[tuple[int, int]]


def _relative_uri(uri: str) -> str:
    # The DCLM bundle's core.yaml names files as eval/local_data/<category>/<task>.jsonl; the
    # published eval_bundle keeps them under eval_data/<category>/<task>.jsonl.
    for prefix in ("eval/local_data/", "local_data/", "eval_data/"):
        if uri.startswith(prefix):
            return uri[len(prefix):]
    return uri


def _check_item(task_type: str, item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise ValueError(f"{where}: each line must be a JSON object, got {type(item).__name__}")
    need = {
        "multiple_choice": ("query", "choices", "gold"),
        "schema": ("context_options", "continuation", "gold"),
        "language_modeling": ("context", "continuation"),
    }[task_type]
    missing = [k for k in need if k not in item]
    if missing:
        raise ValueError(f"{where}: a {task_type} item needs keys {list(need)}; missing {missing}")
    options = item.get("choices") if task_type == "multiple_choice" else item.get("context_options")
    if options is not None:
        if not isinstance(options, list) or len(options) < 2:
            raise ValueError(f"{where}: a {task_type} item needs a list of at least two options")
        gold = item["gold"]
        if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(options):
            raise ValueError(f"{where}: gold={gold!r} must index one of the {len(options)} options")
    return item


def load_core_tasks(bundle_dir: Path, *, max_items_per_task: int | None = None) -> list[CoreTask]:
    """Tasks from a folder in the DCLM eval-bundle layout: `core.yaml` (`icl_tasks` entries with
    label, dataset_uri, num_fewshot, icl_task_type, continuation_delimiter),
    `eval_meta_data.csv` (columns `Eval Task` and `Random baseline`, in percent) and
    `eval_data/<dataset_uri>` JSON-lines files. Items keep file order; `max_items_per_task`
    takes the first N."""
    bundle_dir = Path(bundle_dir)
    spec_path = bundle_dir / "core.yaml"
    meta_path = bundle_dir / "eval_meta_data.csv"
    if not spec_path.is_file() or not meta_path.is_file():
        raise FileNotFoundError(
            f"{bundle_dir} is not an eval bundle: it needs core.yaml, eval_meta_data.csv and eval_data/ "
            "(the DCLM eval_bundle layout)"
        )
    spec = yaml.safe_load(spec_path.read_text(encoding="utf-8")) or {}
    entries = spec.get("icl_tasks")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{spec_path} must have a non-empty `icl_tasks` list")
    baselines: dict[str, float] = {}
    with open(meta_path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if "Eval Task" not in row or "Random baseline" not in row:
                raise ValueError(f"{meta_path} needs columns `Eval Task` and `Random baseline`")
            baselines[row["Eval Task"].strip()] = float(row["Random baseline"]) / 100.0
    tasks = []
    for entry in entries:
        label = entry.get("label")
        task_type = entry.get("icl_task_type")
        if task_type not in TASK_TYPES:
            raise ValueError(f"{spec_path}: task {label!r} has icl_task_type={task_type!r}; use one of {list(TASK_TYPES)}")
        if label not in baselines:
            raise ValueError(f"{meta_path} has no `Random baseline` row for task {label!r}; add one")
        shots = entry.get("num_fewshot", [0])
        shots = shots[0] if isinstance(shots, list) else shots
        data_path = bundle_dir / "eval_data" / _relative_uri(str(entry["dataset_uri"]))
        items = []
        with open(data_path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    items.append(_check_item(task_type, json.loads(line), f"{data_path}:{line_no}"))
        if max_items_per_task is not None:
            items = items[:max_items_per_task]
        tasks.append(
            CoreTask(
                label=label,
                task_type=task_type,
                num_fewshot=int(shots),
                continuation_delimiter=str(entry.get("continuation_delimiter", " ")),
                random_baseline=baselines[label],
                items=tuple(items),
            )
        )
    return tasks


def fewshot_indices(n_items: int, index: int, k: int, seed: int) -> list[int]:
    """k distinct items other than `index`, drawn from a generator seeded by (seed, index), so an
    item's prompt does not depend on which other items are evaluated or on which rank."""
    if k <= 0 or n_items <= 1:
        return []
    g = stream_generator(seed, index)
    order = [i for i in torch.randperm(n_items, generator=g).tolist() if i != index]
    return order[: min(k, n_items - 1)]


def _shot_text(task: CoreTask, item: dict[str, Any]) -> str:
    d = task.continuation_delimiter
    if task.task_type == "multiple_choice":
        return item["query"] + d + item["choices"][item["gold"]]
    if task.task_type == "schema":
        return item["context_options"][item["gold"]] + d + item["continuation"]
    return item["context"] + d + item["continuation"]


def _common_prefix_len(rows: Sequence[Sequence[int]]) -> int:
    n = min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != rows[0][i] for r in rows[1:]):
            return i
    return n


def _common_suffix_len(rows: Sequence[Sequence[int]]) -> int:
    return _common_prefix_len([list(reversed(r)) for r in rows])


def render_item(task: CoreTask, index: int, encode: Callable[[str], list[int]], bos_id: int, seed: int) -> Scored:
    """Token rows for item `index` with its few-shot prefix, and the span of each row that is
    scored: the continuation after the shared prefix (multiple choice, language modelling) or the
    shared continuation after each context (schema)."""
    item = task.items[index]
    shots = fewshot_indices(len(task.items), index, task.num_fewshot, seed)
    prefix = "".join(_shot_text(task, task.items[i]) + FEWSHOT_SEP for i in shots)
    d = task.continuation_delimiter

    def tok(text: str) -> list[int]:
        return [bos_id, *encode(text)]

    if task.task_type == "multiple_choice":
        rows = [tok(prefix + item["query"] + d + c) for c in item["choices"]]
        # Tokenize whole strings (as the model saw text in training) and score from where the options
        # diverge, backed off to the end of the question so a first word the answers share is scored too.
        start = min(_common_prefix_len(rows), len(tok(prefix + item["query"] + d)))
        spans = [(start, len(r)) for r in rows]
    elif task.task_type == "schema":
        rows = [tok(prefix + ctx + d + item["continuation"]) for ctx in item["context_options"]]
        n_cont = min(_common_suffix_len(rows), len(encode(d + item["continuation"])))
        n_cont = max(n_cont, 1)
        spans = [(len(r) - n_cont, len(r)) for r in rows]
    else:
        context = tok(prefix + item["context"] + d)
        full = tok(prefix + item["context"] + d + item["continuation"])
        start = _common_prefix_len([context, full])
        rows, spans = [full], [(start, len(full))]
    for r, (s, e) in zip(rows, spans):
        if not 1 <= s < e <= len(r):
            raise ValueError(f"task {task.label!r} item {index}: empty continuation after tokenizing; check the item text")
    return Scored(rows, spans)


def _crop(scored: Scored, max_seq_len: int) -> Scored:
    # Keep the end of each row (the scored continuation), dropping the oldest few-shot text.
    rows, spans = [], []
    for r, (s, e) in zip(scored.rows, scored.spans):
        cut = max(0, len(r) - max_seq_len)
        if s - cut < 1:
            raise ValueError(f"a continuation of {e - s} tokens does not fit max_seq_len={max_seq_len}; raise it or shorten the item")
        rows.append(r[cut:])
        spans.append((s - cut, e - cut))
    return Scored(rows, spans)


@torch.no_grad()
def score_item(model: Callable[[torch.Tensor], torch.Tensor], task: CoreTask, scored: Scored, gold: int, *, device: torch.device, pad_id: int) -> bool:
    """Whether the model gets the item right. Multiple choice / schema: the option with the
    lowest mean loss over its span is the answer; language modelling: every continuation token
    is the argmax prediction."""
    T = max(len(r) for r in scored.rows)
    ids = torch.full((len(scored.rows), T), pad_id, dtype=torch.long)
    for i, r in enumerate(scored.rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    ids = ids.to(device)
    logits = model(ids).float()  # (N, T, V)
    if task.task_type == "language_modeling":
        s, e = scored.spans[0]
        pred = logits[0, s - 1 : e - 1].argmax(dim=-1)  # (e - s,) predictions of targets s..e-1
        return bool(torch.equal(pred, ids[0, s:e]))
    mean_losses = []
    for i, (s, e) in enumerate(scored.spans):
        loss = F.cross_entropy(logits[i, s - 1 : e - 1], ids[i, s:e], reduction="mean")
        mean_losses.append(loss.item())
    best = min(range(len(mean_losses)), key=lambda j: (mean_losses[j], j))
    return best == gold


def evaluate_task(
    model: Callable[[torch.Tensor], torch.Tensor],
    task: CoreTask,
    *,
    encode: Callable[[str], list[int]],
    bos_id: int,
    max_seq_len: int,
    device: torch.device,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    on_item: Callable[[int, Scored, bool], None] | None = None,
) -> dict[str, float | int]:
    """Accuracy of `model` on `task`, items split round-robin across ranks and summed with
    all_reduce when a process group is up. `on_item(index, scored, correct)` sees each item this
    rank scored (for writing predictions)."""
    correct = torch.zeros(2, dtype=torch.float64)  # (n_correct, n_items)
    for index in range(rank, len(task.items), world_size):
        scored = _crop(render_item(task, index, encode, bos_id, seed), max_seq_len)
        ok = score_item(model, task, scored, task.items[index].get("gold", 0), device=device, pad_id=bos_id)
        correct += torch.tensor([float(ok), 1.0], dtype=torch.float64)
        if on_item is not None:
            on_item(index, scored, ok)
    if dist.is_available() and dist.is_initialized():
        packed = correct.to(device) if device.type == "cuda" else correct
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        correct = packed.cpu()
    n_correct, n_items = int(correct[0]), int(correct[1])
    if n_items == 0:
        raise ValueError(f"task {task.label!r} has no items; check its data file")
    accuracy = n_correct / n_items
    return {
        "accuracy": accuracy,
        "centered": centered(accuracy, task.random_baseline),
        "items": n_items,
    }


def centered(accuracy: float, random_baseline: float) -> float:
    """Accuracy rescaled so that guessing scores 0 and a perfect score 1 (the DCLM CORE metric)."""
    return (accuracy - random_baseline) / (1.0 - random_baseline)


def core_score(centered_by_task: dict[str, float]) -> float:
    """CORE: the mean of the tasks' centred accuracies."""
    if not centered_by_task:
        raise ValueError("no CORE tasks were evaluated; check evalsets/core/core.yaml")
    return sum(centered_by_task.values()) / len(centered_by_task)
