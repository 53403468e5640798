"""Batches from token caches: random pretraining windows, a rank-sharded sequential stream with
resumable state, SFT examples with loss masks, and weighted mixtures. Reads caches through
lockstep.data.cache; writes nothing."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lockstep.core.io import canonical_json
from lockstep.data.cache import (
    CacheTooSmallError,
    cache_summary,
    check_tokenizer,
    open_pretrain_split,
    open_sft_split,
    read_cache_meta,
)
from lockstep.model.gpt import IGNORE_INDEX

if TYPE_CHECKING:
    from lockstep.tokenizer import Tokenizer


def _to_device(arr: np.ndarray, device: torch.device | str) -> torch.Tensor:
    t = torch.from_numpy(arr)
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class PretrainTokenStreamDataset:
    """Random windows of T+1 tokens: a shard drawn with probability proportional to its number of
    window starts, then a uniform start within it. Memory-mapped; one batch is the only copy."""

    def __init__(
        self,
        shards_dir: str | os.PathLike[str],
        *,
        T: int,
        device: torch.device | str = "cpu",
        tokenizer_sha256: str | None = None,
        verify: bool = True,
    ) -> None:
        if T < 1:
            raise ValueError(f"T={T} must be >= 1")
        self.split = open_pretrain_split(shards_dir, tokenizer_sha256=tokenizer_sha256, verify=verify)
        self.T = T
        self.device = torch.device(device)
        n_starts = [max(s.size - T, 0) for s in self.split.shards]  # starts s with s+T+1 <= size
        self._shard_ids = [i for i, n in enumerate(n_starts) if n > 0]
        if not self._shard_ids:
            raise CacheTooSmallError(
                f"no shard in {shards_dir} holds T+1={T + 1} tokens; lower T (sequence_len) or build a bigger cache"
            )
        self._weights = torch.tensor([float(n_starts[i]) for i in self._shard_ids], dtype=torch.float64)
        self._n_starts = torch.tensor([n_starts[i] for i in self._shard_ids], dtype=torch.float64)
        self.last_rows: list[dict[str, int]] = []

    def get_batch(self, *, B: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: (B, T) int64 on the device, y[:, :-1] == x[:, 1:]."""
        pick = torch.multinomial(self._weights, B, replacement=True, generator=generator)  # (B,)
        starts = (torch.rand(B, generator=generator, dtype=torch.float64) * self._n_starts[pick]).long()  # (B,)
        shard_ids = [self._shard_ids[i] for i in pick.tolist()]
        starts_l = starts.tolist()
        buf = np.empty((B, self.T + 1), dtype=np.int64)  # (B, T+1)
        for row, (s, o) in enumerate(zip(shard_ids, starts_l)):
            buf[row] = self.split.shards[s][o : o + self.T + 1]
        self.last_rows = [{"shard": s, "start": o} for s, o in zip(shard_ids, starts_l)]
        t = _to_device(buf, self.device)
        return t[:, :-1], t[:, 1:]


class ShardedTokenLoader:
    """Sequential pretraining batches over all shards read as one stream, split across ranks.

    Step k takes the span [p, p + W*B*T + 1) of the stream; rank r gets the B*T (+1) tokens from
    p + r*B*T, so ranks are disjoint and together cover the span, with no padding (documents
    start wherever their BOS falls). When the rest of the stream is shorter than one span the
    epoch ends and the stream restarts at 0. `state_dict()` names the next span exactly."""

    def __init__(
        self,
        shards_dir: str | os.PathLike[str],
        *,
        B: int,
        T: int,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        tokenizer_sha256: str | None = None,
        verify: bool = True,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if B < 1 or T < 1:
            raise ValueError(f"B={B} and T={T} must be >= 1")
        self.split = open_pretrain_split(shards_dir, tokenizer_sha256=tokenizer_sha256, verify=verify)
        self.B, self.T, self.rank, self.world_size = B, T, rank, world_size
        self.device = torch.device(device)
        self._ends = np.cumsum([s.size for s in self.split.shards], dtype=np.int64)
        self.total_tokens = int(self._ends[-1]) if self._ends.size else 0
        self.span_tokens = world_size * B * T
        if self.total_tokens < self.span_tokens + 1:
            raise CacheTooSmallError(
                f"{shards_dir} holds {self.total_tokens} tokens, fewer than one step needs "
                f"(world_size*B*T+1 = {self.span_tokens + 1}); lower B or T or build a bigger cache"
            )
        self.steps_per_epoch = (self.total_tokens - 1) // self.span_tokens
        self.epoch = 0
        self.position_tokens = 0
        self.last_rows: list[dict[str, int]] = []

    def _read(self, start: int, length: int) -> np.ndarray:
        out = np.empty(length, dtype=np.int64)
        filled = 0
        i = int(np.searchsorted(self._ends, start, side="right"))
        while filled < length:
            shard_start = int(self._ends[i - 1]) if i else 0
            lo = start + filled - shard_start
            take = min(length - filled, self.split.shards[i].size - lo)
            out[filled : filled + take] = self.split.shards[i][lo : lo + take]
            filled += take
            i += 1
        return out

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: (B, T) int64 on the device for this rank; advances the stream by one step."""
        if self.position_tokens + self.span_tokens + 1 > self.total_tokens:
            self.epoch += 1
            self.position_tokens = 0
        start = self.position_tokens + self.rank * self.B * self.T
        chunk = self._read(start, self.B * self.T + 1)  # (B*T+1,)
        self.last_rows = [{"start": start + r * self.T} for r in range(self.B)]
        self.position_tokens += self.span_tokens
        t = _to_device(chunk, self.device)
        return t[:-1].view(self.B, self.T), t[1:].view(self.B, self.T)  # (B, T) each

    def __iter__(self) -> ShardedTokenLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def _identity(self) -> dict[str, Any]:
        return {
            "B": self.B,
            "T": self.T,
            "world_size": self.world_size,
            "shards": [[n, int(s.size)] for n, s in zip(self.split.shard_names, self.split.shards)],
            "tokenizer_sha256": self.split.meta["tokenizer_sha256"],
        }

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position_tokens": self.position_tokens, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ident = self._identity()
        for k, v in ident.items():
            if state.get(k) != v:
                raise ValueError(
                    f"loader state was saved with {k}={state.get(k)!r}, this loader has {v!r}; resume with the same "
                    "batch geometry and cache, or start the stage fresh"
                )
        pos = int(state["position_tokens"])
        if pos < 0 or pos % self.span_tokens:
            raise ValueError(
                f"loader state position_tokens={pos} is not a multiple of the step span {self.span_tokens}"
            )
        self.epoch, self.position_tokens = int(state["epoch"]), pos


class SFTExampleDataset:
    """One conversation per row, truncated or padded to T+1 tokens; targets outside assistant
    spans and at padding are IGNORE_INDEX in y_masked.

    No all-masked batch: at open, examples whose first supervised target lies beyond T (a long
    prompt truncated away) are left out of the draw, so every row, hence every batch, has at
    least one supervised target and a mean cross-entropy never divides by zero."""

    def __init__(
        self,
        tokens_path: str | os.PathLike[str],
        idx_path: str | os.PathLike[str],
        *,
        T: int,
        device: torch.device | str = "cpu",
        pad_id: int,
        tokenizer_sha256: str | None = None,
        verify: bool = True,
    ) -> None:
        if T < 1:
            raise ValueError(f"T={T} must be >= 1")
        self.split = open_sft_split(tokens_path, idx_path, tokenizer_sha256=tokenizer_sha256, verify=verify)
        self.T, self.pad_id = T, pad_id
        self.device = torch.device(device)
        offsets = self.split.offsets
        ends = np.append(offsets[1:], self.split.tokens.size).astype(np.int64)
        supervised = np.flatnonzero(self.split.mask)  # positions with mask 1
        first = np.searchsorted(supervised, offsets + 1)  # mask on position 0 is never a target
        first_pos = np.append(supervised, np.iinfo(np.int64).max)[first]  # (E,) first supervised position
        ok = (first_pos < ends) & (first_pos - offsets <= T)
        self.eligible = np.flatnonzero(ok)
        self.skipped_examples = int(len(offsets) - self.eligible.size)
        if self.eligible.size == 0:
            raise CacheTooSmallError(
                f"none of the {len(offsets)} examples in {tokens_path} has a supervised token within T={T}; "
                "raise T (sequence_len) or build a bigger cache"
            )
        self._ends = ends
        self.last_rows: list[dict[str, int]] = []

    def __len__(self) -> int:
        return int(self.eligible.size)

    def example_lengths(self) -> np.ndarray:
        """(E,) int64 token lengths of the examples the draw picks from, before the cut to T+1."""
        return self._ends[self.eligible] - self.split.offsets[self.eligible]

    def in_order(self, *, rows: int, max_tokens: int | None = None, rank: int = 0,
                 world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(x, y) of every example once, in the split's order, `rows` to a batch, each batch as wide
        as its longest example (cut to T + 1 tokens, the rest padded) and y holding the assistant's
        targets only (IGNORE_INDEX elsewhere): what evaluation reads, where `get_batch` draws.
        Rank `rank` of `world_size` reads every world_size-th example from its own on, and stops
        once its examples hold `max_tokens // world_size` tokens (None: the whole split)."""
        split = self.split
        starts = split.offsets[self.eligible][rank::world_size]  # (E,) where this rank's examples begin
        lengths = np.minimum(self.example_lengths()[rank::world_size], self.T + 1)  # (E,) tokens read of each
        if max_tokens is not None:
            reached = np.cumsum(lengths) >= max(1, max_tokens // world_size)
            n = int(reached.argmax()) + 1 if reached.any() else len(lengths)  # up to the example that reaches it
            starts, lengths = starts[:n], lengths[:n]
        for first in range(0, len(starts), rows):
            batch = range(first, min(first + rows, len(starts)))
            width = int(lengths[batch.start : batch.stop].max()) - 1
            x = np.full((len(batch), width), self.pad_id, dtype=np.int64)  # (B, T')
            y = np.full((len(batch), width), IGNORE_INDEX, dtype=np.int64)  # (B, T')
            for r, i in enumerate(batch):
                lo, n = int(starts[i]), int(lengths[i])
                ids = split.tokens[lo : lo + n].astype(np.int64)  # stored narrower: IGNORE_INDEX is negative
                x[r, : n - 1] = ids[:-1]
                y[r, : n - 1] = np.where(split.mask[lo + 1 : lo + n].astype(bool), ids[1:], IGNORE_INDEX)
            yield _to_device(x, self.device), _to_device(y, self.device)

    def get_batch(self, *, B: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x, y, y_masked: (B, T) int64 on the device."""
        draw = torch.randint(0, self.eligible.size, (B,), generator=generator).tolist()
        seq = np.full((B, self.T + 1), self.pad_id, dtype=np.int64)  # (B, T+1)
        keep = np.zeros((B, self.T + 1), dtype=bool)  # (B, T+1) True where a real token sits
        sup = np.zeros((B, self.T + 1), dtype=bool)  # (B, T+1) True where the mask supervises
        rows = []
        for r, k in enumerate(draw):
            ex = int(self.eligible[k])
            lo = int(self.split.offsets[ex])
            n = min(int(self._ends[ex]) - lo, self.T + 1)
            seq[r, :n] = self.split.tokens[lo : lo + n]
            keep[r, :n] = True
            sup[r, :n] = self.split.mask[lo : lo + n].astype(bool)
            rows.append({"example": ex})
        self.last_rows = rows
        y = np.where(keep[:, 1:], seq[:, 1:], IGNORE_INDEX)  # (B, T)
        y_masked = np.where(sup[:, 1:], seq[:, 1:], IGNORE_INDEX)  # (B, T)
        x = np.ascontiguousarray(seq[:, :-1])
        return _to_device(x, self.device), _to_device(y, self.device), _to_device(y_masked, self.device)


class Mixture:
    """A weighted set of datasets: each row's source is drawn from the generator, then each source
    fills its rows with one get_batch call (sources in list order, so draws are reproducible)."""

    def __init__(self, parts: Sequence[tuple[Any, float]], *, names: Sequence[str] | None = None) -> None:
        if not parts:
            raise ValueError("a mixture needs at least one (dataset, weight) pair")
        weights = [float(w) for _, w in parts]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(
                f"mixture weights {weights} must be >= 0 with a positive sum; fix the weights in params.yaml"
            )
        self.datasets = [d for d, _ in parts]
        self.weights = torch.tensor(weights, dtype=torch.float64)
        self.names = list(names) if names is not None else [str(i) for i in range(len(parts))]
        self.last_rows: list[dict[str, Any]] = []

    def get_batch(self, *, B: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        src = torch.multinomial(self.weights, B, replacement=True, generator=generator)  # (B,)
        out: list[torch.Tensor] | None = None
        rows: list[dict[str, Any]] = [{} for _ in range(B)]
        for k, ds in enumerate(self.datasets):
            where = (src == k).nonzero().flatten()  # (n_k,)
            if where.numel() == 0:
                continue
            part = ds.get_batch(B=int(where.numel()), generator=generator)
            if out is None:
                out = [torch.empty((B, *p.shape[1:]), dtype=p.dtype, device=p.device) for p in part]
            if len(part) != len(out) or part[0].shape[1:] != out[0].shape[1:]:
                raise ValueError(
                    f"mixture source {self.names[k]} yields {len(part)} tensors of shape {tuple(part[0].shape)}; "
                    "all sources need the same kind of batch and the same T"
                )
            for o, p in zip(out, part):
                o[where.to(o.device)] = p
            inner = getattr(ds, "last_rows", None) or [{} for _ in range(int(where.numel()))]
            for r, info in zip(where.tolist(), inner):
                rows[r] = {"source": self.names[k], **info}
        assert out is not None
        self.last_rows = rows
        return tuple(out)


def open_sft_dataset(cache_dir: str | os.PathLike[str], split: str, **kwargs: Any) -> SFTExampleDataset:
    """SFTExampleDataset over `<cache_dir>/<split>_tokens.bin` and its index."""
    d = Path(cache_dir)
    return SFTExampleDataset(d / f"{split}_tokens.bin", d / f"{split}_idx.npy", **kwargs)


def inspect_cache(
    cache_dir: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | None = None,
    split: str = "train",
    seed: int = 0,
    window_tokens: int = 64,
) -> str:
    """A human-readable report of a cache: its stats, then one random window (pretrain) or one
    random example (SFT) decoded, with supervised tokens inside [[ ]]. Without a tokenizer the
    ids are shown instead of text."""
    cache_dir = Path(cache_dir)
    meta = read_cache_meta(cache_dir)
    if tokenizer is not None:
        check_tokenizer(meta, tokenizer.sha256, cache_dir / "meta.json")
    summary = cache_summary(cache_dir)
    lines = [f"{k}: {canonical_json(v).strip()}" for k, v in summary.items()]
    g = torch.Generator().manual_seed(seed)
    if meta["kind"] == "pretrain":
        ds = PretrainTokenStreamDataset(cache_dir / split, T=window_tokens, device="cpu")
        x, y = ds.get_batch(B=1, generator=g)
        ids = x[0].tolist() + y[0, -1:].tolist()
        mask = [1] * len(ids)
        where = f"window: shard {ds.last_rows[0]['shard']} tokens {ds.last_rows[0]['start']}..+{len(ids)}"
    else:
        s = open_sft_split(cache_dir / f"{split}_tokens.bin", cache_dir / f"{split}_idx.npy")
        if len(s) == 0:
            return "\n".join([*lines, f"{split}: no examples"])
        ex = int(torch.randint(0, len(s), (1,), generator=g))
        lo, hi = s.bounds(ex)
        ids, mask = s.tokens[lo:hi].tolist(), s.mask[lo:hi].tolist()
        where = f"example {ex} ({hi - lo} tokens, {sum(mask)} supervised)"
    pieces = [tokenizer.decode([t]) for t in ids] if tokenizer is not None else [f"<{t}>" for t in ids]
    out, open_ = [], False
    for piece, m in zip(pieces, mask):
        if meta["kind"] == "sft" and bool(m) != open_:
            out.append("[[" if m else "]]")
            open_ = bool(m)
        out.append(piece)
    if open_:
        out.append("]]")
    return "\n".join([*lines, where, "".join(out)])
