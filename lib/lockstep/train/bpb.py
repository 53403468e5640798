"""Bits per byte: a model's loss on held-out tokens per byte of the text they spell, comparable
across tokenizers. The one measure behind training's `val_bpb` (lockstep.train.trainer) and eval's
`bpb.<cache>` (lockstep.pipeline.eval); it knows nothing about where the batches come from."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class BpbSums:
    """Sums over every counted target of every batch (and every rank)."""

    nats: float  # the model's loss, natural log
    bytes: int  # UTF-8 bytes the targets decode to
    targets: int
    unigram_nats: float  # the loss of the targets' own unigram distribution: their entropy x count
    # (nats, bytes) per document, in reading order, when measure_bpb was given `doc_start_id`;
    # their sums are `nats` and `bytes`. The items a bootstrap interval resamples.
    documents: tuple[tuple[float, int], ...] = ()

    @property
    def bpb(self) -> float:
        """nats / (ln 2 * bytes); NaN when no target had a byte (nothing to measure)."""
        return self.nats / (math.log(2) * self.bytes) if self.bytes else float("nan")

    @property
    def unigram_bpb(self) -> float:
        """The same for the best unigram model of these very targets: a floor for any model that
        ignores context, the baseline learning must beat."""
        return self.unigram_nats / (math.log(2) * self.bytes) if self.bytes else float("nan")


@torch.no_grad()
def measure_bpb(model: nn.Module | Callable[..., torch.Tensor], batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                token_bytes: torch.Tensor, *, device: torch.device | str = "cpu",
                autocast: Callable[[], AbstractContextManager[object]] | None = None,
                doc_start_id: int | None = None) -> BpbSums:
    """Bits-per-byte sums of `model` on `batches` of (x, y), both (B, T) int64 ids.

    Which tokens count: a target counts when it is not ignored (y >= 0: IGNORE_INDEX and any
    negative id mark a position without a loss, e.g. user turns in SFT data when only the
    assistant's tokens are measured; the caller picks the targets) and it spells text, i.e.
    `token_bytes[y] > 0`. Special tokens (<|bos|>, chat markers) have 0 bytes, so they are left
    out of both sums: neither their loss nor any byte enters.

    How bytes are counted: `token_bytes` (V,) holds the UTF-8 byte length of each id's text, as
    the tokenizer writes it (`Tokenizer.token_bytes`); a target contributes its id's length.

    The loss of each counted target is `model(x, targets=y, loss_reduction="none")` at its
    position (under `autocast` when given), summed in float64. Sums accumulate on `device` with
    no host transfer per batch, and are added across ranks when a process group is up. The
    model runs in whatever mode the caller left it (both callers use eval mode).

    Per document (with `doc_start_id`, the id that opens every document: <|bos|>): targets are
    grouped by the document their input position lies in, a new one at each `doc_start_id` in
    `x`, read row after row, so a document a window boundary cuts continues in the next row read.
    Only this rank's documents are kept (the caller gathers them); documents with no counted byte
    are dropped."""
    if token_bytes.dim() != 1:
        raise ValueError(f"token_bytes must be 1-D (vocab,), got shape {tuple(token_bytes.shape)}")
    device = torch.device(device)
    tb = token_bytes.to(device)
    nats = torch.zeros((), dtype=torch.float64, device=device)
    n_bytes = torch.zeros((), dtype=torch.int64, device=device)
    counts = torch.zeros(tb.numel(), dtype=torch.int64, device=device)  # counted targets per id
    docs: dict[int, list[float]] = {}  # document index -> [nats, bytes]
    doc_offset = -1  # index of the document open before this batch (-1: none yet)
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast() if autocast is not None else contextlib.nullcontext():
            loss = model(x, targets=y, loss_reduction="none")  # (B, T) nats per target
        if loss.shape != y.shape:
            raise ValueError(f"model returned per-token loss of shape {tuple(loss.shape)} for targets {tuple(y.shape)}")
        valid = y >= 0  # (B, T)
        y_bytes = torch.where(valid, tb[y.clamp(min=0)], 0)  # (B, T) bytes per target, 0 when ignored
        counted = y_bytes > 0  # (B, T)
        nats += loss.double()[counted].sum()
        n_bytes += y_bytes[counted].sum()
        counts += torch.bincount(y[counted], minlength=tb.numel())
        if doc_start_id is not None:
            doc = (x == doc_start_id).flatten().long().cumsum(0).cpu() + doc_offset  # (B*T,) row after row
            doc_offset = int(doc[-1])
            first = int(doc[0])
            doc_nats = torch.bincount(doc - first, weights=torch.where(counted, loss.double(), 0.0).flatten().cpu())
            doc_bytes = torch.bincount(doc - first, weights=torch.where(counted, y_bytes, 0).flatten().double().cpu())
            for i, (dn, db) in enumerate(zip(doc_nats.tolist(), doc_bytes.tolist())):
                if db:
                    acc = docs.setdefault(first + i, [0.0, 0.0])
                    acc[0] += dn
                    acc[1] += db
    if dist.is_available() and dist.is_initialized():
        for t in (nats, n_bytes, counts):
            dist.all_reduce(t)
    seen = counts[counts > 0].double()
    unigram_nats = -(seen * (seen / seen.sum()).log()).sum()
    return BpbSums(nats=nats.item(), bytes=int(n_bytes.item()), targets=int(seen.sum().item()),
                   unigram_nats=unigram_nats.item(),
                   documents=tuple((dn, int(db)) for _, (dn, db) in sorted(docs.items())))
