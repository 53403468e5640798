"""Per-item analysis of the project's own eval tasks (`lockstep dev own-eval`): for a checkpoint
and one task, each item's gold and chosen option under each scoring rule, the options' token
lengths, where the choices fall by position, and the accuracy (Wilson 95%) of every rule, next to
the same for an untrained model of the checkpoint's config, the control. A developer tool: it
reads a checkpoint and eval files and prints; it scores nothing for the metrics (the eval stage's
rules are lockstep.evaluate.core and .chat, and the items are rendered by their code).

Rules per task type. Multiple choice and schema: `mean` (the lowest mean nats per scored token,
CORE's rule and the eval stage's) and `sum` (the lowest total nats). Language modelling: `exact`
(every continuation token the argmax, CORE's rule) and `first` (the first one is). Categorical
chat items (ARC-format files): `letter` (the preferred answer letter, the eval stage's rule) and,
with the question alone as the user turn and each choice's text as the reply, `cloze_mean` and
`cloze_sum`: whether the model prefers the right answer when it need not know the lettered
format. Ties go to the lower index, as in the eval stage.

The control is `GPT.build(config, seed=...)` with no training: its blocks start as the identity
(zero output projections), so its logits are a fixed random function of the current token alone.
Whatever it scores above chance comes from the items (option lengths, first tokens), not from
knowing anything."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

from lockstep.core.stats import wilson_interval
from lockstep.data.records import text_message
from lockstep.evaluate import chat, core

CHOICE_RULES = ("mean", "sum")
LM_RULES = ("exact", "first")
CATEGORICAL_RULES = ("letter", "cloze_mean", "cloze_sum")
Model = Callable[[torch.Tensor], torch.Tensor]


class OwnEvalError(ValueError):
    """A task that cannot be found or analysed; the message says what to pass instead."""


@dataclasses.dataclass(frozen=True)
class ItemResult:
    """One item scored by one model. `nats[j]` is option j's per-token losses over its scored span
    (multiple choice, schema, the cloze reading of a categorical item) or the continuation's
    (language modelling, one option); `picks` maps each rule to the option it chooses (for
    language modelling: 0 when the rule's match holds, else -1), None for a skipped item."""

    index: int
    gold: int
    options: tuple[str, ...]
    nats: tuple[tuple[float, ...], ...]
    picks: dict[str, int]

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(len(n) for n in self.nats)


def _pick(scores: Sequence[float]) -> int:
    """The lowest score's index, ties to the lower index (as lockstep.evaluate.core.score_item)."""
    return min(range(len(scores)), key=lambda j: (scores[j], j))


def choice_picks(nats: Sequence[Sequence[float]], *, prefix: str = "", core_rule: bool = False) -> dict[str, int]:
    """The option each rule chooses from per-token losses: `mean` (CORE's) and `sum`. An option
    with no scored token cannot win under either (its scores are +inf), except with `core_rule`,
    where `mean` is the CORE eval's own decision (core.choose_option: an empty option's mean is
    NaN, and wins in the first place)."""
    sums = [sum(n) if n else math.inf for n in nats]
    if core_rule:
        mean = core.choose_option([sum(n) / len(n) if n else math.nan for n in nats])
    else:
        mean = _pick([sum(n) / len(n) if n else math.inf for n in nats])
    return {f"{prefix}mean": mean, f"{prefix}sum": _pick(sums)}


def _span_nats(logits: torch.Tensor, ids: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[tuple[float, ...]]:
    """Per-token cross-entropy (nats) of row i's targets ids[i, s:e], predicted from logits[i, s-1:e-1]."""
    out = []
    for i, (s, e) in enumerate(spans):
        if e <= s:
            out.append(())
            continue
        out.append(tuple(F.cross_entropy(logits[i, s - 1 : e - 1].float(), ids[i, s:e], reduction="none").tolist()))
    return out


def _forward(
    model: Model, rows: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
    ids = ids.to(device)
    with torch.no_grad():
        return model(ids).float(), ids  # (N, T, V), (N, T)


def analyse_core_task(model: Model, task: core.CoreTask, *, encode: Callable[[str], list[int]], bos_id: int,
                      max_seq_len: int, device: torch.device, max_items: int | None = None) -> list[ItemResult]:
    """Every item of a CORE-style task rendered exactly as the eval stage renders it
    (core.render_item, core.crop: the same few-shot prompt and scored spans), scored by `model`
    under each rule of its type. Items the eval stage skips are left out."""
    results = []
    n = len(task.items) if max_items is None else min(max_items, len(task.items))
    for index in range(n):
        item = task.items[index]
        rendered = core.render_item(task, index, encode, bos_id)
        scored = core.crop(rendered, max_seq_len)
        if scored is None or (task.task_type == "language_modeling" and not rendered.scorable()):
            continue
        logits, ids = _forward(model, scored.rows, bos_id, device)
        nats = _span_nats(logits, ids, scored.spans)
        if task.task_type == "language_modeling":
            s, e = scored.spans[0]
            pred = logits[0, s - 1 : e - 1].argmax(dim=-1)  # (e - s,)
            hits = pred == ids[0, s:e]
            picks = {"exact": 0 if bool(hits.all()) else -1, "first": 0 if bool(hits[0]) else -1}
            options: tuple[str, ...] = (str(item["continuation"]),)
            gold = 0
        else:
            picks = choice_picks(nats, core_rule=True)
            options = tuple(
                map(str, item["choices"] if task.task_type == "multiple_choice" else item["context_options"])
            )
            gold = int(item["gold"])
        results.append(ItemResult(index, gold, options, tuple(nats), picks))
    return results


def analyse_categorical(model: Model, items: Sequence[chat.CategoricalItem], *, tokenizer: Any, device: torch.device,
                        max_seq_len: int, max_items: int | None = None,
                        prompt: chat.CategoricalPrompt = "nanochat") -> list[ItemResult]:
    """Categorical chat items scored by `letter` (the eval stage's rule: chat.evaluate_categorical's
    prompt in style `prompt` and argmax over the labels it shows) and by the cloze rules (the
    question alone as the user turn, each choice's text as the reply, its tokens scored). Items
    whose prompt does not fit `max_seq_len` are left out, as the eval stage skips them."""
    known: dict[str, int] = {}
    results = []
    for index, item in enumerate(items[:max_items] if max_items else items):
        labels = chat.prompt_labels(item, prompt)
        ids = tokenizer.render_for_completion(chat.categorical_prompt(item, prompt))
        if len(ids) > max_seq_len:
            continue
        logits, _ = _forward(model, [ids], 0, device)
        allowed = torch.tensor(chat.label_token_ids(tokenizer, labels, known), device=logits.device)
        letter = int(logits[0, -1, allowed].argmax().item())
        question = tokenizer.render_for_completion({"messages": [text_message("user", item.question),
                                                                 text_message("assistant", "")]})
        rows = [question + tokenizer.encode(c) for c in item.choices]
        if max(len(r) for r in rows) > max_seq_len:
            continue
        logits, ids = _forward(model, rows, 0, device)
        nats = _span_nats(logits, ids, [(len(question), len(r)) for r in rows])
        picks = {"letter": letter, **choice_picks(nats, prefix="cloze_")}
        results.append(ItemResult(index, item.answer, item.choices, tuple(nats), picks))
    return results


@dataclasses.dataclass(frozen=True)
class RuleSummary:
    correct: int
    n: int
    interval: tuple[float, float]  # Wilson 95%
    picks_by_position: tuple[int, ...]  # multiple choice, schema, categorical: how often each position was chosen
    picks_longest: int  # items where the chosen option has the most tokens of the item's options (ties count)
    picks_shortest: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else math.nan


def summarise(results: Sequence[ItemResult], rules: Sequence[str]) -> dict[str, RuleSummary]:
    """Accuracy with its Wilson interval, the choices by position, and how often the choice is
    (one of) the item's longest or shortest options in tokens, per rule."""
    out = {}
    width = max((len(r.options) for r in results), default=0)
    for rule in rules:
        correct = sum(r.picks[rule] == r.gold for r in results)
        positions = [0] * width
        longest = shortest = 0
        for r in results:
            p = r.picks[rule]
            if p < 0:
                continue
            positions[p] += 1
            longest += r.tokens[p] == max(r.tokens)
            shortest += r.tokens[p] == min(r.tokens)
        out[rule] = RuleSummary(correct, len(results), wilson_interval(correct, len(results)), tuple(positions),
                                longest, shortest)
    return out


def pair_agreement(task: core.CoreTask, results: Sequence[ItemResult], rule: str = "mean") -> collections.Counter[int]:
    """Schema items asked both ways (the same two contexts, each the gold once): how many pairs
    the rule gets 0, 1 or 2 of. A model that prefers one context whatever follows gets 1 of
    every pair, so 2s beyond the 0s are what it understood."""
    by_contexts: dict[tuple[str, ...], list[bool]] = collections.defaultdict(list)
    for r in results:
        by_contexts[tuple(sorted(task.items[r.index]["context_options"]))].append(r.picks[rule] == r.gold)
    return collections.Counter(sum(v) for v in by_contexts.values() if len(v) == 2)


def gold_and_other_tokens(results: Sequence[ItemResult]) -> tuple[float, float]:
    """Mean token length of the gold options and of the others."""
    gold = [r.tokens[r.gold] for r in results]
    other = [t for r in results for j, t in enumerate(r.tokens) if j != r.gold]
    return (sum(gold) / len(gold) if gold else math.nan, sum(other) / len(other) if other else math.nan)


@dataclasses.dataclass(frozen=True)
class Analysis:
    label: str
    kind: str  # multiple_choice, schema, language_modeling or categorical
    chance: float
    rules: tuple[str, ...]
    models: dict[str, list[ItemResult]]  # "trained", "untrained": per-item results
    pairs: dict[str, collections.Counter[int]]  # schema only: pair_agreement per model

    def summary(self) -> dict[str, dict[str, RuleSummary]]:
        return {name: summarise(res, self.rules) for name, res in self.models.items()}

    def to_json(self) -> dict[str, Any]:
        """The summary as plain data (for docs and scripts)."""
        return {"task": self.label, "kind": self.kind, "chance": self.chance,
                "models": {name: {rule: {**dataclasses.asdict(s), "accuracy": s.accuracy} for rule, s in rules.items()}
                           for name, rules in self.summary().items()},
                "pairs": {name: dict(sorted(c.items())) for name, c in self.pairs.items()}}


def _fmt_acc(s: RuleSummary) -> str:
    lo, hi = s.interval
    return f"{s.accuracy:.3f} [{lo:.3f}, {hi:.3f}]"


def render(analysis: Analysis, *, per_item: bool = False) -> str:
    """The analysis as text: optionally a line per item, then the summary table, trained beside
    untrained."""
    lines = []
    names = list(analysis.models)
    trained = analysis.models[names[0]]
    if per_item:
        lines.append("index gold | " + " | ".join(f"{name}: " + " ".join(analysis.rules) for name in names)
                     + " | tokens per option | gold text")
        others = {name: {r.index: r for r in res} for name, res in analysis.models.items()}
        for r in trained:
            picks = " | ".join(
                f"{name}: " + " ".join(str(others[name][r.index].picks[rule]) for rule in analysis.rules)
                for name in names if r.index in others[name])
            lines.append(
                f"{r.index:5d} {r.gold:4d} | {picks} | {'/'.join(map(str, r.tokens))} | {r.options[r.gold][:60]}"
            )
        lines.append("")
    summary = analysis.summary()
    n = len(trained)
    lines.append(f"{analysis.label} ({analysis.kind}, {n} items, chance {analysis.chance:.3f})")
    col = 28
    lines.append(f"{'':34s}" + "".join(f"{name:>{col}s}" for name in names))
    for rule in analysis.rules:
        official = {"mean": " (CORE)", "exact": " (CORE)", "letter": " (eval)"}.get(rule, "")
        lines.append(
            f"{'accuracy ' + rule + official:34s}" + "".join(f"{_fmt_acc(summary[m][rule]):>{col}s}" for m in names)
        )
    if analysis.kind != "language_modeling":
        for rule in analysis.rules:
            lines.append(f"{'picks by position, ' + rule:34s}"
                         + "".join(f"{' '.join(map(str, summary[m][rule].picks_by_position)):>{col}s}" for m in names))
        gold_positions = collections.Counter(r.gold for r in trained)
        width = max(len(r.options) for r in trained) if trained else 0
        lines.append(f"{'gold by position':34s}{' '.join(str(gold_positions[j]) for j in range(width)):>{col}s}")
        for rule in analysis.rules:
            lines.append(f"{'picks the longest option, ' + rule:34s}"
                         + "".join(f"{summary[m][rule].picks_longest / max(n, 1):>{col}.2f}" for m in names))
            lines.append(f"{'picks the shortest option, ' + rule:34s}"
                         + "".join(f"{summary[m][rule].picks_shortest / max(n, 1):>{col}.2f}" for m in names))
        gold_tokens, other_tokens = gold_and_other_tokens(trained)
        lines.append(f"{'tokens, gold / other options':34s}{f'{gold_tokens:.2f} / {other_tokens:.2f}':>{col}s}")
    for name, counts in analysis.pairs.items():
        lines.append(
            f"pairs asked both ways, {name}: " + ", ".join(f"{k} right: {counts.get(k, 0)}" for k in (0, 1, 2))
        )
    return "\n".join(lines) + "\n"


def find_task(evalsets: Path, label: str) -> tuple[str, Any]:
    """("core", CoreTask) for a label listed in the core.yaml of a folder under `evalsets`, or
    ("categorical", items) for a file `chat/<label>.jsonl` of ARC-format items."""
    known = []
    for spec in sorted(evalsets.glob("*/core.yaml")):
        entries = (yaml.safe_load(spec.read_text(encoding="utf-8")) or {}).get("icl_tasks") or []
        labels = [e.get("label") for e in entries]
        known += labels
        if label in labels:
            return "core", next(t for t in core.load_core_tasks(spec.parent) if t.label == label)
    path = evalsets / "chat" / f"{label}.jsonl"
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if rows and "choices" in rows[0]:
            return "categorical", chat.categorical_items(rows)
    known += sorted(p.stem for p in (evalsets / "chat").glob("*.jsonl"))
    raise OwnEvalError(f"no task {label!r} under {evalsets}: name a label of a core.yaml there or a categorical "
                       f"file's stem under chat/ ({', '.join(map(str, known))})")


def analyse(label: str, models: dict[str, Model], *, evalsets: Path, tokenizer: Any, max_seq_len: int,
            device: torch.device, max_items: int | None = None) -> Analysis:
    """The analysis of task `label` for each of `models` (name -> model; the first one's items
    head the per-item listing)."""
    kind, found = find_task(evalsets, label)
    bos = tokenizer.get_bos_token_id()
    results: dict[str, list[ItemResult]] = {}
    pairs: dict[str, collections.Counter[int]] = {}
    if kind == "core":
        task: core.CoreTask = found
        rules = LM_RULES if task.task_type == "language_modeling" else CHOICE_RULES
        for name, model in models.items():
            results[name] = analyse_core_task(model, task, encode=tokenizer.encode, bos_id=bos, max_seq_len=max_seq_len,
                                              device=device, max_items=max_items)
            if task.task_type == "schema":
                pairs[name] = pair_agreement(task, results[name])
        return Analysis(label, task.task_type, task.random_baseline, rules, results, pairs)
    for name, model in models.items():
        results[name] = analyse_categorical(model, found, tokenizer=tokenizer, device=device, max_seq_len=max_seq_len,
                                            max_items=max_items)
    return Analysis(label, "categorical", chat.random_baseline_categorical(found), CATEGORICAL_RULES, results, pairs)


def analyse_checkpoint(label: str, ckpt: Path, tokenizer_dir: Path, *, evalsets: Path, control_seed: int = 0,
                       max_items: int | None = None, device: str = "cpu") -> Analysis:
    """`analyse` for the checkpoint at `ckpt` ("trained") and an untrained model of its config
    built with `control_seed` ("untrained"), both in fp32 on `device`."""
    from lockstep.model.checkpoint import load_model
    from lockstep.model.gpt import GPT
    from lockstep.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    model, _meta = load_model(ckpt, device, tokenizer_sha256=tokenizer.sha256)
    control = GPT.build(model.config, device, seed=control_seed).eval()
    return analyse(label, {"trained": model, "untrained": control}, evalsets=evalsets, tokenizer=tokenizer,
                   max_seq_len=model.config.sequence_len, device=torch.device(device), max_items=max_items)
