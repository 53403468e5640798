"""The primitives the GPT is written in, and the one switch between their two implementations
(`GPT.use_kernels`): REFERENCE_OPS, stock PyTorch, and KERNEL_OPS, lockstep.kernels' CPU fast paths,
equal to it to rounding. Also the model's loss convention (IGNORE_INDEX, cross_entropy) and its
logit soft cap. Pure tensor functions: they know nothing of the network's modules (lockstep.model)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from lockstep import kernels

IGNORE_INDEX = -100  # a target without a loss
LossReduction = Literal["mean", "sum", "none"]
RMS_EPS = 1e-6  # added to the mean square; fixed rather than finfo(dtype).eps so bf16 and fp32 agree


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dim: x / sqrt(mean(x^2) + 1e-6), in x's dtype."""
    return F.rms_norm(x, (x.size(-1),), eps=RMS_EPS)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: LossReduction) -> torch.Tensor:
    """fp32 cross-entropy of logits (B, T, V) against targets (B, T), IGNORE_INDEX skipped: `mean`
    over counted targets, `sum`, or `none` (B, T) with 0 at ignored positions. `mean` divides by
    max(1, counted targets) instead of F.cross_entropy's mean, which is 0/0 = NaN when every
    target is ignored (a fully masked SFT batch): such a batch gives loss 0 with all-zero, finite
    gradients."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"loss_reduction={reduction!r} must be 'mean', 'sum' or 'none'")
    flat = logits.reshape(-1, logits.size(-1)).float()  # (B*T, V)
    y = targets.reshape(-1)  # (B*T,)
    if reduction == "none":
        return F.cross_entropy(flat, y, ignore_index=IGNORE_INDEX, reduction="none").view(targets.shape)
    total = F.cross_entropy(flat, y, ignore_index=IGNORE_INDEX, reduction="sum")
    if reduction == "sum":
        return total
    return total / (y != IGNORE_INDEX).sum().clamp(min=1)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap): logits squashed smoothly into (-cap, cap); cap 0 leaves them."""
    return cap * torch.tanh(logits / cap) if cap else logits


def capped_logits(head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, w: torch.Tensor,
                  cap: float, vocab_size: int) -> torch.Tensor:
    """Soft-capped fp32 logits (B, T, vocab_size) of hidden states x (B, T, C) through `head`."""
    return softcap(head(x, w)[..., :vocab_size].float(), cap)  # (B, T, V)


def head_loss(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, cap: float, vocab_size: int,
              reduction: LossReduction) -> torch.Tensor:
    """`cross_entropy` of the soft-capped logits of x (B, T, C) through the head weight w."""
    return cross_entropy(capped_logits(F.linear, x, w, cap, vocab_size), targets, reduction)


def fused_head_loss(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, cap: float, vocab_size: int,
                    reduction: LossReduction) -> torch.Tensor:
    """head_loss through kernels.head_loss, which never holds the batch's (B, T, V) fp32 logits;
    a cap it cannot exponentiate takes the plain logits of kernels.head_logits instead."""
    if not 0 < cap <= kernels.SAFE_EXP_CAP:
        return cross_entropy(capped_logits(kernels.head_logits, x, w, cap, vocab_size), targets, reduction)
    return kernels.head_loss(x, w, targets, softcap=cap, vocab_size=vocab_size, reduction=reduction,
                             ignore_index=IGNORE_INDEX)


@dataclass(frozen=True)
class Ops:
    """The primitives the network is written in, so that one switch swaps them all (see
    GPT.use_kernels): REFERENCE_OPS is stock PyTorch, KERNEL_OPS lockstep.kernels' CPU fast paths,
    equal to it to rounding."""

    norm: Callable[[torch.Tensor], torch.Tensor]  # parameter-free RMSNorm over the last dim
    head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # x @ w.T: the padded logits
    head_loss: Callable[..., torch.Tensor]  # (x, w, targets, cap, vocab_size, reduction): lm_head + cross-entropy


REFERENCE_OPS = Ops(norm=rms_norm, head=F.linear, head_loss=head_loss)
KERNEL_OPS = Ops(norm=functools.partial(kernels.rms_norm, eps=RMS_EPS), head=kernels.head_logits, head_loss=fused_head_loss)
