"""Bits per byte of a model on held-out token batches: tokenizer-independent loss. Knows nothing
about where the batches come from or how the model was trained."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

@torch.no_grad()
def sum_nats_and_bytes(
    model: torch.nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    token_bytes: torch.Tensor,
) -> tuple[float, int, int]:
    """(sum of nats, sum of bytes, number of counted targets) over `batches` of (x, y), both
    (B, T) int64. A target counts when it is >= 0 (ignored targets are negative, e.g. IGNORE_INDEX) and is not a special
    token (token_bytes 0); its loss is weighed by nothing but enters the sum once, so the ratio
    of the sums is the loss per byte of text whatever the vocabulary. Summed across ranks when a
    process group is up."""
    if token_bytes.dim() != 1:
        raise ValueError(f"token_bytes must be 1-D (vocab,), got shape {tuple(token_bytes.shape)}")
    nats = torch.zeros((), dtype=torch.float64)
    n_bytes = torch.zeros((), dtype=torch.int64)
    n_targets = torch.zeros((), dtype=torch.int64)
    device = None
    for x, y in batches:
        device = x.device
        tb = token_bytes.to(device)
        loss = model(x, targets=y, loss_reduction="none")  # (B, T) nats per target
        if loss.shape != y.shape:
            raise ValueError(f"model returned per-token loss of shape {tuple(loss.shape)} for targets {tuple(y.shape)}")
        valid = y >= 0  # (B, T)
        safe_y = torch.where(valid, y, torch.zeros_like(y))
        y_bytes = torch.where(valid, tb[safe_y], torch.zeros_like(safe_y))  # (B, T)
        counted = y_bytes > 0
        nats += loss.double()[counted].sum().cpu()
        n_bytes += y_bytes[counted].sum().cpu()
        n_targets += counted.sum().cpu()
    if dist.is_available() and dist.is_initialized():
        packed = torch.stack([nats, n_bytes.double(), n_targets.double()])
        if device is not None and device.type == "cuda":
            packed = packed.to(device)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
        packed = packed.cpu()
        nats, n_bytes, n_targets = packed[0], packed[1].long(), packed[2].long()
    return float(nats), int(n_bytes), int(n_targets)


def bits_per_byte(nats: float, n_bytes: int) -> float:
    """sum(nats) / (ln 2 * sum(bytes)); NaN when there were no bytes (an empty val split)."""
    if n_bytes <= 0:
        return float("nan")
    return nats / (math.log(2) * n_bytes)


def evaluate_bpb(
    model: torch.nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    token_bytes: torch.Tensor,
) -> dict[str, float | int]:
    """{"bpb", "nats", "bytes", "targets"} of `model` on `batches`."""
    nats, n_bytes, n_targets = sum_nats_and_bytes(model, batches, token_bytes)
    return {"bpb": bits_per_byte(nats, n_bytes), "nats": nats, "bytes": n_bytes, "targets": n_targets}
