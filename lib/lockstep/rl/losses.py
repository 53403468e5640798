"""The gradients of an RL update: the policy loss over a step's completions (with `rl.prompt_once`,
a group's prompt run once for all of them) and the anchor's loss on SFT conversations (their
cross-entropy, or the KL from the starting policy). Backward passes only: no optimizer step, no
sampling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from lockstep.model.gpt import IGNORE_INDEX
from lockstep.rl.config import RLConfig
from lockstep.rl.rollouts import Completion, Rollouts


def policy_loss_backward(model: nn.Module, ro: Rollouts, *, device: torch.device, rows_per_pass: int,
                         autocast: Any = None, prompt_once: bool = False) -> tuple[float, int]:
    """Accumulate gradients of -sum((A_i + c_t) * log p(token)) / N over sampled tokens, c_t a
    token's credit (Completion.credit, else 0), N the number of sampled tokens of the completions
    that count in the step. Returns (loss value, N). Completions with zero advantage and no
    credit contribute nothing and are skipped.

    Each pass runs up to `rows_per_pass` whole sequences (prompt and completion). With
    `prompt_once`, a pass holds consecutive completions of one prompt instead (a problem's
    group), and the prompt runs through the model once for all of them (`_SharedPrompt`): the
    same loss and gradients to rounding, about a third fewer tokens for RL's prompts."""
    rows = [c for c in ro.completions if c.trained]
    n_tokens = sum(sum(c.sampled) for c in rows)
    if not rows or n_tokens == 0:
        return 0.0, 0
    passes = _same_prompt_runs(rows, rows_per_pass) if prompt_once else [
        rows[start:start + rows_per_pass] for start in range(0, len(rows), rows_per_pass)]
    total = 0.0
    for chunk in passes:
        if prompt_once:
            # the completions read after the prompt's last token: input and targets start there
            prompt = chunk[0].prompt
            starts = [0] * len(chunk)
            seqs = [prompt[-1:] + c.ids for c in chunk]
        else:
            starts = [len(c.prompt) - 1 for c in chunk]
            seqs = [c.prompt + c.ids for c in chunk]
        x, y, adv = _policy_rows(chunk, seqs, starts)
        x, y, adv = x.to(device), y.to(device), adv.to(device)
        with _precision(autocast, device):
            if prompt_once:
                shared = _SharedPrompt(len(prompt) - 1)
                if shared.length:
                    model.final_hidden(torch.tensor([prompt[:-1]], dtype=torch.long, device=device), shared)  # (1, P)
                nll = model(x, targets=y, kv_cache=shared.for_rows(len(chunk)), loss_reduction="none")  # (B, T)
            else:
                nll = model(x, targets=y, loss_reduction="none")  # (B, T), 0 at ignored targets
        loss = (nll.float() * adv).sum() / n_tokens
        loss.backward()
        total += float(loss.detach())
    return total, n_tokens


def _same_prompt_runs(rows: Sequence[Completion], size: int) -> list[list[Completion]]:
    """`rows` cut into runs of consecutive completions of one prompt, at most `size` each."""
    runs: list[list[Completion]] = []
    for c in rows:
        if runs and len(runs[-1]) < size and runs[-1][0].prompt == c.prompt:
            runs[-1].append(c)
        else:
            runs.append([c])
    return runs


def _policy_rows(chunk: Sequence[Completion], seqs: Sequence[list[int]],
                 starts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs x, targets y and per-token advantages (each (B, T)) of the completions `chunk`,
    row r reading seqs[r] and predicting its completion from position starts[r] on; padding
    and forced tokens get no target."""
    T = max(len(s) for s in seqs) - 1
    x = torch.zeros(len(chunk), T, dtype=torch.long)  # (B, T)
    y = torch.full((len(chunk), T), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    adv = torch.tensor([c.advantage for c in chunk], dtype=torch.float32)[:, None].repeat(1, T)  # (B, T)
    for r, (c, s, p) in enumerate(zip(chunk, seqs, starts)):
        x[r, : len(s) - 1] = torch.tensor(s[:-1])
        targets = torch.tensor(c.ids)
        keep = torch.tensor(c.sampled, dtype=torch.bool)
        y[r, p : p + len(targets)] = torch.where(keep, targets, torch.full_like(targets, IGNORE_INDEX))
        if c.credit is not None:
            adv[r, p : p + len(targets)] += torch.tensor(c.credit)
    return x, y, adv


class _SharedPrompt:
    """The model's KV-cache interface (lockstep.model.gpt.KVCacheLike) for training on completions
    of one prompt: run over the prompt (less its last token) from position 0, it keeps each
    layer's keys and values, autograd history included; `for_rows(B)` then gives the pass over
    B completions, which continue from the prompt's length and attend over those keys (one set,
    computed once, for every row) and causally over their own. The prompt's gradient is the sum
    over the rows that read it, as when each row runs the prompt itself."""

    def __init__(self, length: int) -> None:
        self.length = length  # prompt tokens before the completions' first input
        self.keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.rows = 0  # 0 while the prompt runs
        self.mask: torch.Tensor | None = None  # the completions' (1, 1, T, P + T), made at the first layer

    def for_rows(self, rows: int) -> _SharedPrompt:
        self.rows = rows
        return self

    def positions(self) -> int:
        return self.length if self.rows else 0

    def update(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if not self.rows:
            self.keys.append((k, v))  # (1, Hkv, P, D) each
            return k, v, None
        if not self.length:
            return k, v, None
        pk, pv = self.keys[layer_idx]
        B, H, T, D = k.shape
        if self.mask is None:
            own = torch.ones(T, T, dtype=torch.bool, device=k.device).tril()  # (T, T)
            self.mask = torch.cat((torch.ones(T, self.length, dtype=torch.bool, device=k.device), own), dim=1)[
                None, None
            ]
        return (torch.cat((pk.expand(B, H, self.length, D), k), dim=2),
                torch.cat((pv.expand(B, H, self.length, D), v), dim=2), self.mask)

    def advance(self, num_tokens: int) -> None:
        pass


def anchor_loss_backward(
    model: nn.Module,
    anchor: Any,
    cfg: RLConfig,
    *,
    device: torch.device,
    generator: torch.Generator,
    autocast: Any = None,
    reference: nn.Module | None = None,
) -> float:
    """Accumulate gradients of anchor_weight x the anchor's loss on `cfg.anchor_rows` SFT
    conversations drawn from `anchor` (a loader whose get_batch gives x, y, y_masked), mean over
    the assistant's tokens, `device_batch_rows` conversations at a time. The loss is their
    cross-entropy, or with `reference` (the frozen starting policy, `anchor_target: sft`)
    KL(reference || model) of the next-token distributions at those tokens. Returns the
    unweighted mean loss."""
    x, _y, y = anchor.get_batch(B=cfg.anchor_rows, generator=generator)  # (B, T) each
    # Rows come padded to the context; past the last supervised target they change no loss.
    width = int((y != IGNORE_INDEX).any(dim=0).nonzero().max()) + 1
    x, y = x[:, :width].to(device), y[:, :width].to(device)
    n_targets = int((y != IGNORE_INDEX).sum())
    total = 0.0
    for start in range(0, cfg.anchor_rows, cfg.device_batch_rows):
        rows = slice(start, start + cfg.device_batch_rows)
        if reference is None:
            with _precision(autocast, device):
                nll = model(x[rows], targets=y[rows], loss_reduction="none")  # (b, T), 0 at ignored targets
            loss = nll.float().sum() / n_targets
        else:
            loss = _kl_to_reference(model, reference, x[rows], y[rows] != IGNORE_INDEX,
                                    _precision(autocast, device)) / n_targets
        (cfg.anchor_weight * loss).backward()
        total += float(loss.detach())
    return total


def _kl_to_reference(
    model: nn.Module, reference: nn.Module, x: torch.Tensor, keep: torch.Tensor, ctx: Any
) -> torch.Tensor:
    """Sum over the positions `keep` (b, T) of KL(reference || model) between the next-token
    distributions the two models give after x (b, T); the head reads only those positions."""
    with torch.no_grad(), ctx:
        ref = _kept_logits(reference, x, keep).log_softmax(-1)  # (1, N, V)
    with ctx:
        logp = _kept_logits(model, x, keep).log_softmax(-1)  # (1, N, V)
    return (ref.exp() * (ref - logp)).sum()


def _kept_logits(model: nn.Module, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The model's soft-capped fp32 logits (1, N, V) at the N positions `keep` of x (b, T),
    the head applied to those positions only."""
    return model.head_logits(model.final_hidden(x)[keep][None])


def _precision(autocast: Any, device: torch.device) -> Any:
    """The caller's autocast context for a forward pass, or autocast switched off (fp32)."""
    return autocast if autocast is not None else torch.autocast(device.type, enabled=False)

