"""CORE-style in-context evaluation of base models (the DCLM paper's metric): tasks in the DCLM
eval-bundle layout, few-shot prompts, the three task types scored from a model's logits, and
accuracy centred on each task's random baseline. Does not generate text; see evaluate.chat.

Item order, few-shot draws, scored spans and the choice between options follow the reference
implementation (nanochat's core_eval), so one item's result can be compared with its result there;
the rules are stated in docs/evaluation.md ("Scoring rules")."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml

TaskType = Literal["multiple_choice", "schema", "language_modeling"]
TASK_TYPES: tuple[str, ...] = ("multiple_choice", "schema", "language_modeling")
FEWSHOT_SEP = "\n\n"
# The reference's fixed seeds: a task file's items are shuffled with random.Random(ORDER_SEED)
# before any per-task cap, and item i's shots are random.Random(FEWSHOT_SEED_BASE + i).sample(...)
# of the other items. Matching them is what makes per-item results comparable with the reference.
ORDER_SEED = 1337
FEWSHOT_SEED_BASE = 1234


class CoreItemError(RuntimeError):
    """A failure while rendering or scoring one item, naming its task and item index."""


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
    """One item's rendering: token rows (one per option) and the [start, end) span scored in each.
    A span may be empty (a choice whose row is a token-prefix of another's); see choose_option."""

    rows: list[list[int]]
    spans: list[tuple[int, int]]

    def scorable(self) -> bool:
        """Whether any option has a token to score."""
        return any(e > s for s, e in self.spans)


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
    `eval_data/<dataset_uri>` JSON-lines files. Items are put in the reference's order (the file's
    items shuffled by `random.Random(ORDER_SEED)`), and `max_items_per_task` takes the first N of
    that order: a spread over the whole file, since many task files are sorted."""
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
            raise ValueError(
                f"{spec_path}: task {label!r} has icl_task_type={task_type!r}; use one of {list(TASK_TYPES)}"
            )
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
        random.Random(ORDER_SEED).shuffle(items)
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


def fewshot_indices(n_items: int, index: int, k: int) -> list[int]:
    """The reference's shots for item `index`: `random.Random(FEWSHOT_SEED_BASE + index)` samples k
    of the other items (all of them when there are fewer than k). Depends only on the item's
    position, not on which other items are evaluated or on which rank."""
    if k <= 0:
        return []
    others = [i for i in range(n_items) if i != index]
    return random.Random(FEWSHOT_SEED_BASE + index).sample(others, min(k, len(others)))


def _lm_context(item: dict[str, Any]) -> str:
    # The reference trims a language-modelling context (some files carry trailing whitespace that
    # would merge into the continuation's first token).
    return str(item["context"]).strip()


def _shot_text(task: CoreTask, item: dict[str, Any]) -> str:
    d = task.continuation_delimiter
    if task.task_type == "multiple_choice":
        return item["query"] + d + item["choices"][item["gold"]]
    if task.task_type == "schema":
        return item["context_options"][item["gold"]] + d + item["continuation"]
    return _lm_context(item) + d + item["continuation"]


def _diverge(context: Sequence[int], full: Sequence[int]) -> int:
    """Where `full` stops repeating `context`: the first token that is not the context's own."""
    n = min(len(context), len(full))
    return next((i for i in range(n) if context[i] != full[i]), n)


def common_prefix(rows: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every row shares."""
    n = min(len(r) for r in rows)
    return next((i for i in range(n) if any(r[i] != rows[0][i] for r in rows)), n)


def common_suffix(rows: Sequence[Sequence[int]]) -> int:
    """How many trailing tokens every row shares."""
    n = min(len(r) for r in rows)
    return next((i for i in range(n) if any(r[-1 - i] != rows[0][-1 - i] for r in rows)), n)


def render_item(task: CoreTask, index: int, encode: Callable[[str], list[int]], bos_id: int) -> Scored:
    """Token rows for item `index` with its few-shot prefix, and the span of each row that is
    scored, by the reference's rules. Each option is one string, `BOS + prefix + context +
    delimiter + answer`, tokenized whole (as the model read text in training).

    - Multiple choice: every row's span starts after the tokens all the rows share, so a token
      every choice begins with (` the` of `the cat` / `the dog`) is not scored, and a choice whose
      row is a token-prefix of another's has an empty span.
    - Schema: every row's span is the tokens all the rows end with: the continuation, and any
      ending the contexts share (empty when the rows are identical, or end on different tokens).
    - Language modelling: the span starts where the row stops repeating `BOS + (prefix + context
      + delimiter).strip()`, so a delimiter space that stands as a token of its own is scored
      with the continuation."""
    item = task.items[index]
    shots = fewshot_indices(len(task.items), index, task.num_fewshot)
    prefix = "".join(_shot_text(task, task.items[i]) + FEWSHOT_SEP for i in shots)
    d = task.continuation_delimiter

    def tok(text: str) -> list[int]:
        return [bos_id, *encode(text)]

    if task.task_type == "multiple_choice":
        rows = [tok(prefix + item["query"] + d + c) for c in item["choices"]]
        start = common_prefix(rows)
        return Scored(rows, [(start, len(r)) for r in rows])
    if task.task_type == "schema":
        rows = [tok(prefix + ctx + d + item["continuation"]) for ctx in item["context_options"]]
        shared = common_suffix(rows)
        # All of a row shared means identical rows: nothing tells the options apart, and the
        # reference's span, from position 0, reads no loss there. Empty spans: the first option.
        return Scored(rows, [(len(r) - shared, len(r)) if shared < len(r) else (len(r), len(r)) for r in rows])
    context = prefix + _lm_context(item) + d
    full = tok(context + item["continuation"])
    # The reference asserts that the stripped context's tokens are a prefix of the row; where a
    # tokenizer merges across that boundary, the span starts at the first token that differs.
    return Scored([full], [(_diverge(tok(context.strip()), full), len(full))])


def crop(scored: Scored, max_seq_len: int) -> Scored | None:
    """Each row cut to its last `max_seq_len` tokens (the reference's cropping: the oldest few-shot
    text goes first, the scored span stays whole), or None when some span does not fit: its tokens
    plus the one before them (which predicts the first) exceed `max_seq_len`."""
    rows, spans = [], []
    for r, (s, e) in zip(scored.rows, scored.spans):
        cut = max(0, len(r) - max_seq_len)
        if e > s and s - cut < 1:
            return None
        rows.append(r[cut:])
        spans.append((s - cut, e - cut))
    return Scored(rows, spans)


def option_losses(logits: torch.Tensor, ids: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[float]:
    """Mean cross-entropy (nats per token) of each option over its span; NaN for an empty span
    (the mean of nothing, as the reference computes it)."""
    out = []
    for i, (s, e) in enumerate(spans):
        if e <= s:
            out.append(math.nan)
            continue
        out.append(F.cross_entropy(logits[i, s - 1 : e - 1], ids[i, s:e], reduction="mean").item())
    return out


def choose_option(losses: Sequence[float]) -> int:
    """The reference's choice: scanning in order, an option replaces the current pick only when its
    loss is strictly lower. So ties go to the lower index, a NaN (an empty span) after the first
    place never wins, and a NaN in the first place always does (nothing compares below it)."""
    best = 0
    for j in range(1, len(losses)):
        if losses[j] < losses[best]:
            best = j
    return best


@torch.no_grad()
def score_item(
    model: Callable[[torch.Tensor], torch.Tensor],
    task: CoreTask,
    scored: Scored,
    gold: int,
    *,
    device: torch.device,
    pad_id: int,
) -> bool:
    """Whether the model gets the item right. Multiple choice / schema: the option with the
    lowest mean loss over its span is the answer (choose_option); language modelling: every
    continuation token is the argmax prediction (exact greedy match)."""
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
    return choose_option(option_losses(logits, ids, scored.spans)) == gold


def evaluate_task(
    model: Callable[[torch.Tensor], torch.Tensor],
    task: CoreTask,
    *,
    encode: Callable[[str], list[int]],
    bos_id: int,
    max_seq_len: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    on_item: Callable[[int, Scored, bool | None, str | None], None] | None = None,
) -> dict[str, float | int]:
    """Accuracy of `model` on `task` over the items it could score, items split round-robin
    across ranks and summed with all_reduce when a process group is up. An item is skipped, and
    counted, when its answer does not fit `max_seq_len` even with the context cropped away, or when
    a language-modelling item has no token to score (the reference stops there; a multiple-choice
    or schema item with nothing scored goes to its first option, as in the reference).
    `on_item(index, scored, correct, skip_reason)` sees each item this rank handled (`correct` None
    for a skipped item). A failure names the task and item (CoreItemError). The accuracy is NaN
    when every item was skipped."""
    if not task.items:
        raise ValueError(f"task {task.label!r} has no items; check its data file")
    counts = torch.zeros(3, dtype=torch.float64)  # (n_correct, n_scored, n_skipped)
    for index in range(rank, len(task.items), world_size):
        try:
            rendered = render_item(task, index, encode, bos_id)
            scored = crop(rendered, max_seq_len)
            skip = None
            if task.task_type == "language_modeling" and not rendered.scorable():
                skip = "no continuation tokens: the continuation adds nothing to its context after tokenizing"
            elif scored is None:
                longest = max(e - s for s, e in rendered.spans)
                skip = f"answer of {longest} tokens does not fit max_seq_len={max_seq_len} with a token of context"
            ok = None
            if skip is None:
                assert scored is not None
                ok = score_item(model, task, scored, task.items[index].get("gold", 0), device=device, pad_id=bos_id)
        except Exception as e:  # name the item; the cause stays chained
            raise CoreItemError(f"CORE task {task.label!r} item {index}: {type(e).__name__}: {e}") from e
        counts += torch.tensor([float(bool(ok)), float(ok is not None), float(ok is None)], dtype=torch.float64)
        if on_item is not None:
            on_item(index, scored if scored is not None else rendered, ok, skip)
    if dist.is_available() and dist.is_initialized():
        packed = counts.to(device) if device.type == "cuda" else counts
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        counts = packed.cpu()
    n_correct, n_scored, n_skipped = (int(c) for c in counts)
    accuracy = n_correct / n_scored if n_scored else math.nan
    return {
        "accuracy": accuracy,
        "centered": centered(accuracy, task.random_baseline),
        "items": n_scored,
        "skipped": n_skipped,
    }


def centered(accuracy: float, random_baseline: float) -> float:
    """Accuracy rescaled so that guessing scores 0 and a perfect score 1 (the DCLM CORE metric)."""
    return (accuracy - random_baseline) / (1.0 - random_baseline)


def core_score(centered_by_task: dict[str, float]) -> float:
    """CORE: the mean of the tasks' centred accuracies."""
    if not centered_by_task:
        raise ValueError("no CORE tasks were evaluated; check evalsets/core/core.yaml")
    return sum(centered_by_task.values()) / len(centered_by_task)
