"""Data budgets: how many epochs a training stage makes over each mixture component, and the
refusal when that exceeds the stage's `max_epochs`. Pure arithmetic over what a component holds
(a cache's token count, or an estimate from fetch budgets that lockstep.tools.plan makes); it opens no
files and trains nothing.

What a step draws: `batch_tokens` tokens, i.e. `batch_tokens / sequence_len` rows, each row's
source drawn with the mixture's normalised weight (lockstep.data.loaders.Mixture). A pretraining row
is a random window of T tokens, so a component weighted w draws `total_tokens * w` tokens. An
SFT row is one whole example cut to T+1 tokens and padded (lockstep.data.loaders.SFTExampleDataset),
so it consumes one example: epochs = rows drawn / examples, and the tokens drawn are the rows
times the mean example length as the loader cuts it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from lockstep.core.config import ConfigError

# Characters per token of the 65,536-id BPE on FineWeb-Edu English prose: nanochat's tokenizer
# evaluation reports ~4.8 for its 65,536-id tokenizer on FineWeb-Edu and GPT-4's cl100k ~4.6;
# 4.7 sits between them. Used only to turn a token shortfall into a fetch budget in characters.
ASSUMED_CHARS_PER_TOKEN = 4.7


class EpochBudgetError(ConfigError):
    """A training stage would repeat a mixture component more often than its `max_epochs`."""


@dataclass(frozen=True)
class Holding:
    """What one mixture component holds for training: its train split as the loader reads it."""

    kind: Literal["pretrain", "sft"]
    tokens: int  # train tokens one pass reads (SFT: each example cut to sequence_len + 1 tokens)
    examples: int | None  # SFT: examples the loader draws from; None for a pretraining stream
    origin: str  # where the figures come from: "cache", or the estimate's basis


@dataclass(frozen=True)
class ComponentEpochs:
    """One mixture component's share of a stage's training."""

    name: str
    weight: float  # normalised sampling weight (the weights sum to 1)
    drawn_tokens: float  # tokens the stage takes from this component
    drawn_rows: float | None  # SFT: rows (= examples) drawn; None for pretraining
    holding: Holding
    epochs: float  # drawn / held: 1.0 = every token (or example) seen once on average


def sft_holding(lengths: Any, *, seq_len: int, origin: str = "cache") -> Holding:
    """The Holding of SFT examples whose token lengths are `lengths` (a sequence of ints): each
    is cut to seq_len + 1 tokens, as SFTExampleDataset reads it."""
    used = [min(int(n), seq_len + 1) for n in lengths]
    return Holding("sft", tokens=sum(used), examples=len(used), origin=origin)


def mixture_epochs(mixture: dict[str, float], holdings: dict[str, Holding], *, total_tokens: int,
                   seq_len: int) -> list[ComponentEpochs]:
    """Epochs per component for a stage that trains on `total_tokens` tokens (steps x
    batch_tokens) of `mixture` (name -> weight, normalised here), in sorted name order."""
    total_w = sum(mixture.values())
    rows = total_tokens / seq_len
    out = []
    for name in sorted(mixture):
        h = holdings[name]
        w = mixture[name] / total_w
        if h.kind == "pretrain":
            drawn = total_tokens * w
            epochs = drawn / h.tokens if h.tokens else math.inf
            out.append(ComponentEpochs(name, w, drawn, None, h, epochs))
        else:
            n = h.examples or 0
            drawn_rows = rows * w
            drawn = drawn_rows * (h.tokens / n) if n else 0.0
            out.append(ComponentEpochs(name, w, drawn, drawn_rows, h, drawn_rows / n if n else math.inf))
    return out


def _count(x: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.0f}"


def epoch_line(c: ComponentEpochs, max_epochs: float | None) -> str:
    """One log line: `fineweb_edu: 0.95 epochs (9.0B of 9.5B train tokens, weight 0.99, limit 1)`."""
    limit = "no limit" if max_epochs is None else f"limit {max_epochs:g}"
    if c.drawn_rows is None:
        what = f"{_count(c.drawn_tokens)} of {_count(c.holding.tokens)} train tokens"
    else:
        what = f"{_count(c.drawn_rows)} rows of {_count(c.holding.examples or 0)} examples"
    return f"{c.name}: {c.epochs:.3g} epochs ({what}, weight {c.weight:.3g}, {limit}; {c.holding.origin})"


def epochs_facts(components: list[ComponentEpochs], max_epochs: float | None) -> dict[str, Any]:
    """The run-facts record: the limit, and per component its epochs, weight, tokens drawn and
    what it holds (train tokens; for SFT also examples)."""
    def one(c: ComponentEpochs) -> dict[str, Any]:
        out = {"epochs": c.epochs if math.isfinite(c.epochs) else None, "weight": c.weight,
               "drawn_tokens": c.drawn_tokens, "train_tokens": c.holding.tokens}
        return out if c.holding.examples is None else {**out, "train_examples": c.holding.examples}

    return {"max_epochs": max_epochs, "components": {c.name: one(c) for c in components}}


def over_limit(components: list[ComponentEpochs], max_epochs: float | None) -> list[ComponentEpochs]:
    return [] if max_epochs is None else [c for c in components if c.epochs > max_epochs]


def check_epochs(components: list[ComponentEpochs], *, stage: str, max_epochs: float | None, num_steps: int,
                 horizon: str, chars_per_token: float = ASSUMED_CHARS_PER_TOKEN) -> None:
    """Raise EpochBudgetError naming every component above `max_epochs` (None: no limit) and,
    for each, what to fetch or lower so that it fits. `num_steps` is the stage's horizon and
    `horizon` the params key that set it (`num_steps`, `tokens_params_ratio`, ...)."""
    bad = over_limit(components, max_epochs)
    if not bad:
        return
    assert max_epochs is not None
    problems = []
    for c in bad:
        source = c.name.split("/")[-1]  # `sft/x` names cache x, built from fetch.x
        fit_steps = math.floor(num_steps * max_epochs / c.epochs)
        fit_weight = c.weight * max_epochs / c.epochs
        lower = (f"or lower {stage}.{horizon} to <= {max_epochs / c.epochs:.3g}x its value (<= {fit_steps} steps), "
                 f"or {stage}.mixture.{c.name} to a normalised weight <= {fit_weight:.3g}")
        if c.drawn_rows is None:
            need = c.drawn_tokens / max_epochs
            problems.append(
                f"{c.name} would be read {c.epochs:.3g} times ({_count(c.drawn_tokens)} tokens drawn from "
                f"{_count(c.holding.tokens)} train tokens, {c.holding.origin}): fetch >= {_count(need)} train tokens "
                f"(~{_count(need * chars_per_token)} characters at ~{chars_per_token:g} chars/token: "
                f"fetch.{source}.max_train_chars where the source has that budget), {lower}")
        else:
            need = (c.drawn_rows or 0.0) / max_epochs
            problems.append(
                f"{c.name} would be read {c.epochs:.3g} times ({_count(c.drawn_rows or 0)} rows drawn from "
                f"{_count(c.holding.examples or 0)} examples, {c.holding.origin}): fetch >= {math.ceil(need)} train "
                f"examples (for a generated source raise fetch.{source}.n_train), {lower}")
    raise EpochBudgetError(f"{stage}: {len(bad)} mixture component(s) above {stage}.max_epochs={max_epochs:g}: "
                           + "; ".join(problems) + f" (or raise {stage}.max_epochs, or set it to null for no limit)")
