"""Training objectives on a model's logits: the prefix-smoothed loss, whose target spreads weight
from the true next token to its ancestors in the vocabulary's prefix tree, beside the plain
cross-entropy it reduces to at weight 0, and `build`, which picks a stage's loss function once
from its `objective` setting. The losses are pure tensor functions: they know nothing of params,
stages, or which tokenizer kind produced the ancestor table (lockstep.tokenizer.prefix_tree builds
it for bpe); `build` asks the tokenizer for it.

The ancestor table is two tensors: `ancestors` (V, max_depth) int64, row i the ids of token i's
proper ancestors, nearest first, and `depths` (V,) int64, how many entries of row i are real.
Entries past a row's depth are padding (PAD_ID by convention) and are never read as ids: the loss
masks them by depth, whatever they hold. A token is not its own ancestor, and a reserved root that
is never a target (LZ78's id 0) is not listed either."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from lockstep.model.gpt import GPT, IGNORE_INDEX, LossReduction, cross_entropy
from lockstep.model.ops import check_reduction, reduce_total, softcap

PAD_ID = -1  # ancestor-table padding past a row's depth


class AncestorTableError(ValueError):
    """An ancestor table does not fit the vocabulary or breaks the layout in the module docstring."""


def check_ancestor_table(
    ancestors: torch.Tensor, depths: torch.Tensor, vocab_size: int, *, where: str = "ancestor table"
) -> None:
    """Raise AncestorTableError unless `ancestors` (vocab_size, D) and `depths` (vocab_size,) are
    integer tensors, every depth lies in [0, D], and every entry within a row's depth is an id in
    [0, vocab_size) other than the row's own. Reads every entry (a host sync on a GPU), so call it
    once when the table is loaded, not per step."""
    if ancestors.dtype.is_floating_point or ancestors.dtype == torch.bool or ancestors.ndim != 2:
        raise AncestorTableError(f"{where}: ancestors must be a 2-D integer tensor (vocab, max_depth), got "
                                 f"{ancestors.dtype} of shape {tuple(ancestors.shape)}")
    if depths.dtype.is_floating_point or depths.dtype == torch.bool or depths.ndim != 1:
        raise AncestorTableError(f"{where}: depths must be a 1-D integer tensor (vocab,), got {depths.dtype} of "
                                 f"shape {tuple(depths.shape)}")
    V, D = ancestors.shape
    if V != vocab_size or depths.numel() != vocab_size:
        raise AncestorTableError(f"{where}: has {V} ancestor rows and {depths.numel()} depths for a vocabulary of "
                                 f"{vocab_size}; rebuild it from the tokenizer the model was trained with")
    bad = ((depths < 0) | (depths > D)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise AncestorTableError(f"{where}: token {i} has depth {int(depths[i])}, outside [0, {D}] (the table's width)")
    real = torch.arange(D, device=depths.device) < depths[:, None]  # (V, D)
    own = torch.arange(V, device=ancestors.device)[:, None]
    bad = (real & ((ancestors < 0) | (ancestors >= V) | (ancestors == own))).nonzero()
    if bad.numel():
        i, k = int(bad[0, 0]), int(bad[0, 1])
        raise AncestorTableError(f"{where}: token {i}'s ancestor {k} is {int(ancestors[i, k])}, which is not "
                                 f"another id in [0, {V}); padding belongs past the depth {int(depths[i])} only")


# A training loss: (model, x (B, T), targets (B, T), reduction) -> the reduced loss, as
# lockstep.model.gpt.cross_entropy reduces (targets use IGNORE_INDEX).
Objective = Callable[[GPT, torch.Tensor, torch.Tensor, LossReduction], torch.Tensor]


class ObjectiveSettings(Protocol):
    """The params a stage picks its objective with (lockstep.train.trainer.TrainConfig has them)."""

    @property
    def objective(self) -> str: ...

    @property
    def prefix_weight(self) -> float: ...


class AncestorTables(Protocol):
    """A vocabulary's ancestor table as numpy arrays (lockstep.tokenizer.prefix_tree.PrefixTree)."""

    @property
    def ancestors(self) -> np.ndarray: ...

    @property
    def depths(self) -> np.ndarray: ...


class PrefixTreeSource(Protocol):
    """What `build` needs of a tokenizer (lockstep.tokenizer.Tokenizer is one)."""

    def prefix_tree(self) -> AncestorTables: ...

    def get_vocab_size(self) -> int: ...


def cross_entropy_objective(model: GPT, x: torch.Tensor, targets: torch.Tensor,
                            reduction: LossReduction = "mean") -> torch.Tensor:
    """The model's own cross-entropy (its fused head when it uses kernels)."""
    return model(x, targets, loss_reduction=reduction)


def prefix_smooth_objective(ancestors: torch.Tensor, depths: torch.Tensor, weight: float) -> Objective:
    """The prefix-smoothed loss (`model_prefix_smooth_loss`) with a fixed ancestor table and weight."""

    def loss(model: GPT, x: torch.Tensor, targets: torch.Tensor, reduction: LossReduction = "mean") -> torch.Tensor:
        return model_prefix_smooth_loss(model, x, targets, ancestors, depths, weight, reduction)

    return loss


def build(cfg: ObjectiveSettings, tokenizer: PrefixTreeSource, *, device: torch.device | str = "cpu") -> Objective:
    """The loss function `cfg.objective` names, built once per stage: `ce`, the model's
    cross-entropy; `prefix_smooth`, the prefix-smoothed loss at `cfg.prefix_weight` over the
    tokenizer's prefix tree, its ancestor table moved to `device` and checked against the
    tokenizer's vocabulary. A tokenizer without a prefix tree raises its NoPrefixTreeError."""
    if cfg.objective == "ce":
        return cross_entropy_objective
    if cfg.objective != "prefix_smooth":
        raise ValueError(f"objective={cfg.objective!r} is not one of 'ce', 'prefix_smooth'")
    tree = tokenizer.prefix_tree()
    ancestors = torch.from_numpy(tree.ancestors).to(device)
    depths = torch.from_numpy(tree.depths).to(device)
    check_ancestor_table(ancestors, depths, tokenizer.get_vocab_size(), where="the tokenizer's ancestor table")
    return prefix_smooth_objective(ancestors, depths, cfg.prefix_weight)


def prefix_smooth_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ancestors: torch.Tensor,
    depths: torch.Tensor,
    weight: float,
    ignore_index: int = IGNORE_INDEX,
    reduction: LossReduction = "mean",
) -> torch.Tensor:
    """Cross-entropy of logits (B, T, V) against a smoothed target per position, computed in fp32
    (fp64 for fp64 logits): weight 1 on the true next token y and `weight` (w) on each of its
    d = depths[y] ancestors, normalised to sum 1. With lse the log-sum-exp of a row and l its
    logits, a counted position's loss is

        lse - (l[y] + w * sum_k l[ancestors[y, k]]) / (1 + w * d)

    which is plain cross-entropy for a token without ancestors. Positions whose target is
    `ignore_index` give 0 and no gradient. Reductions as lockstep.model.gpt.cross_entropy: `mean`
    over counted targets (0 when none is counted), `sum`, or `none` (B, T).

    Memory: beyond the fp32 logits, one log-sum-exp per row and the (B*T, 1 + max_depth) gathered
    logits; never a (B*T, V) one-hot or log-softmax copy. w = 0 runs lockstep.model.gpt's
    cross-entropy itself, so it equals the model's loss bit for bit."""
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"prefix_weight={weight!r} must be a finite number >= 0 (0 is plain cross-entropy)")
    check_reduction(reduction)
    V = logits.size(-1)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal the logits' leading shape {tuple(logits.shape[:-1])}"
        )
    if ancestors.ndim != 2 or ancestors.size(0) != V or depths.shape != (V,):
        raise AncestorTableError(f"ancestor table of shape {tuple(ancestors.shape)} with depths {tuple(depths.shape)} "
                                 f"does not fit logits over {V} ids; it must be (V, max_depth) and (V,)")
    if weight == 0:
        if ignore_index != IGNORE_INDEX:
            targets = targets.masked_fill(targets == ignore_index, IGNORE_INDEX)
        return cross_entropy(logits, targets, reduction)
    # fp32 for fp32/bf16/fp16 logits (as the model's loss); fp64 logits stay fp64 for gradcheck
    flat = logits.reshape(-1, V).to(torch.promote_types(logits.dtype, torch.float32))  # (N, V)
    y = targets.reshape(-1)  # (N,)
    counted = y != ignore_index  # (N,)
    safe_y = torch.where(counted, y, 0)  # (N,)
    D = ancestors.size(1)
    chain = ancestors[safe_y]  # (N, D)
    d = depths[safe_y]  # (N,)
    real = torch.arange(D, device=flat.device) < d[:, None]  # (N, D)
    # padding is pointed at the target itself, a valid column with a finite logit whenever the
    # loss is finite, and then masked out of the sum: whatever the padding holds never reaches it
    cols = torch.where(real, chain, safe_y[:, None])  # (N, D)
    l_tgt = flat.gather(1, safe_y[:, None]).squeeze(1)  # (N,)
    l_anc = torch.where(real, flat.gather(1, cols), 0.0).sum(1)  # (N,)
    lse = torch.logsumexp(flat, dim=1)  # (N,)
    rows = lse - (l_tgt + weight * l_anc) / (1.0 + weight * d.to(flat.dtype))
    rows = torch.where(counted, rows, 0.0)  # ignored rows: 0, and where() sends them no gradient
    return rows.view(targets.shape) if reduction == "none" else reduce_total(rows.sum(), counted, reduction)



def smoothed_targets(targets: torch.Tensor, ancestors: torch.Tensor, depths: torch.Tensor,
                     weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix-smoothed target of each position as ids and weights, both (..., 1 + max_depth)
    for targets (...): the target y with 1 / (1 + w * d), then its d = depths[y] ancestors with
    w / (1 + w * d) each (summing to 1), padding pointed at y with weight 0. Ignored positions
    (IGNORE_INDEX) read as id 0's row; the loss skips them. For a head loss that takes a target
    distribution (lockstep.model.ops.chunked_head_loss)."""
    counted = targets != IGNORE_INDEX
    safe_y = torch.where(counted, targets, 0)  # (...)
    d = depths[safe_y]  # (...)
    real = torch.arange(ancestors.size(1), device=targets.device) < d[..., None]  # (..., D)
    chain = torch.where(real, ancestors[safe_y], safe_y[..., None])  # (..., D)
    norm = 1.0 + weight * d.float()  # (...)
    anc_w = torch.where(real, (weight / norm)[..., None], 0.0)  # (..., D)
    cols = torch.cat([safe_y[..., None], chain], dim=-1)  # (..., 1 + D)
    coefs = torch.cat([(1.0 / norm)[..., None], anc_w], dim=-1)  # (..., 1 + D)
    return cols, coefs


def model_prefix_smooth_loss(
    model: GPT,
    idx: torch.Tensor,
    targets: torch.Tensor,
    ancestors: torch.Tensor,
    depths: torch.Tensor,
    weight: float,
    reduction: LossReduction = "mean",
) -> torch.Tensor:
    """`prefix_smooth_loss(model(idx), targets, ...)` without the model's (B, T, V) logits where
    the model has a fused or chunked head: the fast path, for training. Targets use
    lockstep.model.gpt.IGNORE_INDEX. Equal to the plain path to rounding (tests/test_objectives.py,
    tests/test_chunked_loss.py); weight 0 returns the model's loss itself.

    Where the model's ops have a `smoothed_head_loss` (CUDA_OPS: lockstep.model.ops.chunked_head_loss),
    the whole loss is one chunked head loss against the smoothed targets (`smoothed_targets`): no
    tensor of the batch's size times the vocabulary exists, and nothing waits for the device.
    Otherwise the loss splits as

        lse - sum_k c_k l_k = (lse - l_y) + sum_{k>=1} c_k (l_y - l_{a_k})

    (c the normalised target weights, c_0 on y): the first part is the model's own cross-entropy,
    `model(idx, targets)` (lockstep.model.kernels' fused head when the model uses kernels), and the second
    needs only the logits of y and its ancestors, each one dot product of the final hidden state
    (GPT.final_hidden) with an lm_head row. Beyond the model's loss that holds the lm_head rows of
    the targets and of their real ancestors, in fp32; listing those pairs (`nonzero`) waits for
    the device once per call."""
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"prefix_weight={weight!r} must be a finite number >= 0 (0 is plain cross-entropy)")
    check_reduction(reduction)
    c = model.config
    if ancestors.ndim != 2 or ancestors.size(0) != c.vocab_size or depths.shape != (c.vocab_size,):
        raise AncestorTableError(f"ancestor table of shape {tuple(ancestors.shape)} with depths {tuple(depths.shape)} "
                                 f"does not fit the model's {c.vocab_size} ids; it must be (V, max_depth) and (V,)")
    if weight == 0:
        return model(idx, targets, loss_reduction=reduction)
    if targets.shape != idx.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
    x = model.final_hidden(idx)  # (B, T, C): what the head reads
    if model.ops.smoothed_head_loss is not None:
        cols, coefs = smoothed_targets(targets, ancestors, depths, weight)  # (B, T, 1 + D) each
        return model.ops.smoothed_head_loss(x, model.lm_head.weight, targets, cols, coefs, c.softcap, c.vocab_size,
                                            reduction)
    ce_rows = model.head_loss(x, targets, "none")  # (B, T), 0 at ignored targets
    hidden = x.reshape(-1, c.n_embd).float()  # (N, C)
    y = targets.reshape(-1)  # (N,)
    counted = y != IGNORE_INDEX
    safe_y = torch.where(counted, y, 0)
    d = depths[safe_y]  # (N,)
    real = counted[:, None] & (torch.arange(ancestors.size(1), device=idx.device) < d[:, None])  # (N, D)
    # only the real (position, ancestor) pairs: ~N * mean depth of them rather than N * max depth
    pos, k = real.nonzero(as_tuple=True)  # (P,), (P,)
    w_head = model.lm_head.weight
    # the correction in fp32 even under a bf16 autocast, which would otherwise run the dot products in bf16
    with torch.autocast(idx.device.type, enabled=False):
        z_tgt = torch.linalg.vecdot(w_head[safe_y].float(), hidden)  # (N,) logits before the cap
        z_anc = torch.linalg.vecdot(w_head[ancestors[safe_y[pos], k]].float(), hidden[pos])  # (P,)
        if c.softcap:
            z_tgt, z_anc = softcap(z_tgt, c.softcap), softcap(z_anc, c.softcap)
        coef = (weight / (1.0 + weight * d.float()))[pos]  # (P,): c_k of each pair
        correction = torch.zeros_like(z_tgt).index_add(0, pos, coef * (z_tgt[pos] - z_anc))  # (N,)
    rows = ce_rows.reshape(-1) + correction  # (N,), 0 at ignored targets
    return rows.view(targets.shape) if reduction == "none" else reduce_total(rows.sum(), counted, reduction)
