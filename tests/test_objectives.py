"""The prefix-smoothed loss against hand-computed values, plain cross-entropy and a dense reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lockstep.model.gpt import GPT, IGNORE_INDEX, GPTConfig, cross_entropy
from lockstep.tokenizer.prefix_tree import prefix_tree
from lockstep.train.objectives import (PAD_ID, AncestorTableError, build, check_ancestor_table, cross_entropy_objective,
                                       model_prefix_smooth_loss, prefix_smooth_loss)

# "a", "ab", "abc": a chain of three tokens, each the parent of the next
CHAIN3 = [b"a", b"ab", b"abc"]


def table(pieces):
    tree = prefix_tree(pieces)
    return torch.from_numpy(tree.ancestors), torch.from_numpy(tree.depths)


def dense_reference(logits, targets, ancestors, depths, weight, ignore_index=IGNORE_INDEX):
    """-sum(q * log_softmax) averaged over counted positions, q written out in full (tokens x vocab)."""
    V = logits.size(-1)
    y = targets.reshape(-1).tolist()
    q = torch.zeros(len(y), V, dtype=logits.dtype)
    for n, t in enumerate(y):
        if t == ignore_index:
            continue
        q[n, t] = 1.0
        for a in ancestors[t, : int(depths[t])].tolist():
            q[n, a] += weight
        q[n] /= q[n].sum()
    rows = -(q * F.log_softmax(logits.reshape(len(y), V), dim=-1)).sum(-1)
    return rows.sum() / max(1, sum(t != ignore_index for t in y))


def random_table(V: int, g: torch.Generator):
    """Ancestor table of V random distinct byte strings, each an earlier one (or nothing) extended
    by one or two letters: deep chains, with gaps where a two-letter step skips a prefix."""
    pieces: list[bytes] = []
    while len(pieces) < V:
        base = pieces[int(torch.randint(0, len(pieces), (), generator=g))] if pieces else b""
        step = bytes(
            b"abc"[int(i)] for i in torch.randint(0, 3, (int(torch.randint(1, 3, (), generator=g)),), generator=g)
        )
        if base + step not in pieces:
            pieces.append(base + step)
    return table(pieces)


def test_hand_computed_three_token_example():
    # p = (1, 2, 3) / 6 at every position; w = 0.5
    logits = torch.log(torch.tensor([1.0, 2.0, 3.0])).expand(1, 4, 3).contiguous()
    targets = torch.tensor([[2, 1, 0, IGNORE_INDEX]])
    ancestors, depths = table(CHAIN3)
    assert ancestors.tolist() == [[PAD_ID, PAD_ID], [0, PAD_ID], [1, 0]]
    # target 2 ("abc"): q = (0.5, 0.5, 1) / 2; target 1 ("ab"): q = (0.5, 1, 0) / 1.5; target 0: q = (1, 0, 0)
    l2 = 0.25 * math.log(6) + 0.25 * math.log(3) + 0.5 * math.log(2)
    l1 = (1 / 3) * math.log(6) + (2 / 3) * math.log(3)
    l0 = math.log(6)
    rows = prefix_smooth_loss(logits, targets, ancestors, depths, 0.5, reduction="none")
    assert rows.dtype == torch.float32
    torch.testing.assert_close(rows, torch.tensor([[l2, l1, l0, 0.0]]))
    mean = prefix_smooth_loss(logits, targets, ancestors, depths, 0.5)
    assert mean.item() == pytest.approx((l0 + l1 + l2) / 3, rel=1e-6)
    total = prefix_smooth_loss(logits, targets, ancestors, depths, 0.5, reduction="sum")
    assert total.item() == pytest.approx(l0 + l1 + l2, rel=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_weight_zero_is_the_models_cross_entropy_exactly(reduction):
    g = torch.Generator().manual_seed(0)
    V = 40
    ancestors, depths = random_table(V, g)
    logits = (torch.randn(3, 7, V, generator=g) * 4).requires_grad_()
    targets = torch.randint(0, V, (3, 7), generator=g)
    targets[1, 2:5] = IGNORE_INDEX
    ours = prefix_smooth_loss(logits, targets, ancestors, depths, 0.0, reduction=reduction)
    theirs = cross_entropy(logits, targets, reduction)
    assert torch.equal(ours, theirs)
    (g_ours,) = torch.autograd.grad(ours.sum(), logits)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), logits)
    assert torch.equal(g_ours, g_theirs)
    if reduction == "mean":
        plain = F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=IGNORE_INDEX)
        assert torch.equal(ours, plain)
    # another ignore_index marks the same positions
    other = torch.where(targets == IGNORE_INDEX, -1, targets)
    assert torch.equal(
        prefix_smooth_loss(logits, other, ancestors, depths, 0.0, ignore_index=-1, reduction=reduction), theirs
    )


def test_tokens_without_ancestors_get_plain_cross_entropy():
    g = torch.Generator().manual_seed(1)
    ancestors, depths = table([b"x", b"y", b"z", b"xy"])
    logits = torch.randn(1, 5, 4, generator=g)
    targets = torch.tensor([[0, 1, 2, 1, 0]])  # none of these has an ancestor
    ours = prefix_smooth_loss(logits, targets, ancestors, depths, 0.7, reduction="none")
    torch.testing.assert_close(ours, cross_entropy(logits, targets, "none"), rtol=1e-6, atol=1e-6)


def test_ignored_positions_contribute_nothing_and_get_no_gradient():
    g = torch.Generator().manual_seed(2)
    V = 30
    ancestors, depths = random_table(V, g)
    logits = (torch.randn(2, 6, V, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, V, (2, 6), generator=g)
    targets[0, 1] = targets[1, 4] = targets[1, 5] = IGNORE_INDEX
    loss = prefix_smooth_loss(logits, targets, ancestors, depths, 0.4)
    loss.backward()
    counted = targets != IGNORE_INDEX
    rows = prefix_smooth_loss(logits.detach(), targets, ancestors, depths, 0.4, reduction="none")
    sub = prefix_smooth_loss(
        logits.detach()[counted][None], targets[counted][None], ancestors, depths, 0.4, reduction="none"
    )
    assert torch.equal(rows[counted], sub[0]) and torch.equal(rows[~counted], torch.zeros(3))
    torch.testing.assert_close(loss.detach(), sub.mean())
    assert torch.equal(logits.grad[~counted], torch.zeros(3, V))
    assert logits.grad[counted].abs().sum(-1).min() > 0
    # an all-ignored batch: loss 0 with finite, zero gradients (not 0/0)
    logits.grad = None
    none = prefix_smooth_loss(logits, torch.full_like(targets, IGNORE_INDEX), ancestors, depths, 0.4)
    none.backward()
    assert none.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.parametrize("weight", [0.1, 1.0, 3.0])
def test_matches_a_dense_reference_with_its_gradient(weight):
    g = torch.Generator().manual_seed(3)
    V = 24
    ancestors, depths = random_table(V, g)
    assert int(depths.max()) >= 3  # deep enough chains to exercise the padding and the normalisation
    logits = torch.randn(2, 9, V, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, V, (2, 9), generator=g)
    targets[0, 0] = IGNORE_INDEX
    ours = prefix_smooth_loss(logits, targets, ancestors, depths, weight)
    ref = dense_reference(logits, targets, ancestors, depths, weight)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    (g_ours,) = torch.autograd.grad(ours, logits)
    (g_ref,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-10, atol=1e-12)
    small = logits.detach()[:, :4].clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: prefix_smooth_loss(x, targets[:, :4], ancestors, depths, weight), (small,)
    )


def test_fp32_loss_from_bf16_logits():
    g = torch.Generator().manual_seed(4)
    ancestors, depths = random_table(16, g)
    logits = torch.randn(2, 5, 16, generator=g).bfloat16()
    targets = torch.randint(0, 16, (2, 5), generator=g)
    ours = prefix_smooth_loss(logits, targets, ancestors, depths, 0.5)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, dense_reference(logits.float(), targets, ancestors, depths, 0.5))


def test_ancestor_padding_never_leaks():
    g = torch.Generator().manual_seed(5)
    V = 20
    ancestors, depths = random_table(V, g)
    logits = (torch.randn(2, 8, V, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, V, (2, 8), generator=g)
    clean = prefix_smooth_loss(logits, targets, ancestors, depths, 0.8)
    (g_clean,) = torch.autograd.grad(clean, logits)
    pad = torch.arange(ancestors.size(1)) >= depths[:, None]
    assert pad.any()
    for garbage in (torch.randint(0, V, ancestors.shape, generator=g), torch.full(ancestors.shape, 10**6),
                    torch.full(ancestors.shape, -7), torch.arange(V)[:, None].expand_as(ancestors)):
        dirty = torch.where(pad, garbage, ancestors)
        loss = prefix_smooth_loss(logits, targets, dirty, depths, 0.8)
        (g_dirty,) = torch.autograd.grad(loss, logits)
        assert torch.equal(loss, clean) and torch.equal(g_dirty, g_clean)
    # and a wider table, all padding past the old width, changes nothing either
    wide = torch.cat([ancestors, torch.full((V, 3), PAD_ID)], 1)
    assert torch.equal(prefix_smooth_loss(logits, targets, wide, depths, 0.8), clean)


def test_gradient_goes_to_the_target_and_its_ancestors_only():
    ancestors, depths = table(CHAIN3 + [b"b", b"ba"])
    logits = torch.zeros(1, 1, 5, requires_grad=True)
    prefix_smooth_loss(logits, torch.tensor([[2]]), ancestors, depths, 1.0).backward()
    # uniform p = 0.2; q = (1/3, 1/3, 1/3, 0, 0); d loss / d logits = p - q
    torch.testing.assert_close(logits.grad[0, 0], torch.tensor([0.2 - 1 / 3] * 3 + [0.2, 0.2]))


def test_bad_arguments_name_the_problem():
    ancestors, depths = table(CHAIN3)
    logits, targets = torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="prefix_weight"):
        prefix_smooth_loss(logits, targets, ancestors, depths, -0.1)
    with pytest.raises(ValueError, match="prefix_weight"):
        prefix_smooth_loss(logits, targets, ancestors, depths, float("nan"))
    with pytest.raises(AncestorTableError, match="does not fit logits over 4 ids"):
        prefix_smooth_loss(torch.zeros(1, 2, 4), targets, ancestors, depths, 0.5)
    with pytest.raises(ValueError, match="targets shape"):
        prefix_smooth_loss(logits, targets[:, :1], ancestors, depths, 0.5)
    with pytest.raises(ValueError, match="loss_reduction"):
        prefix_smooth_loss(logits, targets, ancestors, depths, 0.5, reduction="avg")


def test_check_ancestor_table():
    ancestors, depths = table(CHAIN3)
    check_ancestor_table(ancestors, depths, 3)
    with pytest.raises(AncestorTableError, match="vocabulary of 4"):
        check_ancestor_table(ancestors, depths, 4)
    with pytest.raises(AncestorTableError, match="token 1 has depth 3"):
        check_ancestor_table(ancestors, torch.tensor([0, 3, 2]), 3)
    bad = ancestors.clone()
    bad[2, 1] = PAD_ID
    with pytest.raises(AncestorTableError, match="token 2's ancestor 1 is -1"):
        check_ancestor_table(bad, depths, 3)
    bad[2, 1] = 2
    with pytest.raises(AncestorTableError, match="token 2's ancestor 1 is 2"):
        check_ancestor_table(bad, depths, 3)
    with pytest.raises(AncestorTableError, match="integer"):
        check_ancestor_table(ancestors.float(), depths, 3)
    # padding may hold anything
    check_ancestor_table(torch.where(ancestors == PAD_ID, 99, ancestors), depths, 3)


@pytest.mark.parametrize("kernels", [True, False])
def test_model_fast_path_equals_the_loss_of_the_logits(kernels):
    g = torch.Generator().manual_seed(6)
    V = 90
    ancestors, depths = random_table(V, g)
    model = GPT.build(GPTConfig.from_depth(1, V, 16, head_dim=32, softcap=2.0), "cpu", seed=0).use_kernels(kernels)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5, generator=g)  # a spread-out head, so the cap is exercised
    idx = torch.randint(0, V, (3, 16), generator=g)
    targets = torch.randint(0, V, (3, 16), generator=g)
    targets[2, 5:] = IGNORE_INDEX
    for weight, reduction in [(0.3, "mean"), (2.0, "sum"), (0.3, "none")]:
        fast = model_prefix_smooth_loss(model, idx, targets, ancestors, depths, weight, reduction)
        fast_grads = torch.autograd.grad(fast.sum(), list(model.parameters()))
        plain = prefix_smooth_loss(model(idx), targets, ancestors, depths, weight, reduction=reduction)
        plain_grads = torch.autograd.grad(plain.sum(), list(model.parameters()))
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
        for a, b in zip(fast_grads, plain_grads):
            torch.testing.assert_close(
                a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max())
            )  # rounding, relative to the scale
    assert torch.equal(model_prefix_smooth_loss(model, idx, targets, ancestors, depths, 0.0), model(idx, targets))
    with pytest.raises(AncestorTableError, match="model's 90 ids"):
        model_prefix_smooth_loss(model, idx, targets, ancestors[:50], depths[:50], 0.3)


@pytest.mark.parametrize("kernels", [True, False])
def test_model_fast_path_under_bf16_autocast_is_fp32_and_close(kernels):
    # what a CPU with native bf16 trains under (runtime dtype bfloat16): the correction is still
    # computed in fp32, and the loss stays within bf16 rounding of the fp32 one
    g = torch.Generator().manual_seed(7)
    V = 90
    ancestors, depths = random_table(V, g)
    model = GPT.build(GPTConfig.from_depth(1, V, 16, head_dim=32), "cpu", seed=0).use_kernels(kernels)
    idx = torch.randint(0, V, (3, 16), generator=g)
    targets = torch.randint(0, V, (3, 16), generator=g)
    exact = model_prefix_smooth_loss(model, idx, targets, ancestors, depths, 0.3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model_prefix_smooth_loss(model, idx, targets, ancestors, depths, 0.3)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, exact, rtol=2e-2, atol=2e-2)
    low.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_build_picks_the_objective_once():
    from lockstep.core.config import ConfigError
    from lockstep.pipeline.train import build_objective
    from lockstep.tokenizer import NoPrefixTreeError
    from lockstep.train.trainer import TrainConfig

    class Tree:
        ancestors = np.array([[PAD_ID, PAD_ID], [0, PAD_ID], [1, 0]])  # 2 -> 1 -> 0
        depths = np.array([0, 1, 2])

    class Tokens:
        def prefix_tree(self):
            return Tree()

        def get_vocab_size(self):
            return 3

    class NoTree(Tokens):
        def prefix_tree(self):
            raise NoPrefixTreeError("sentencepiece ids are not byte strings")

    smooth = TrainConfig(objective="prefix_smooth", prefix_weight=0.5)
    assert build(TrainConfig(), NoTree()) is cross_entropy_objective  # ce never asks for a tree
    loss = build(smooth, Tokens())
    model = GPT.build(GPTConfig.from_depth(1, 3, 4, head_dim=32), "cpu", seed=0)
    x, y = torch.tensor([[0, 1, 2, 1]]), torch.tensor([[1, 2, 1, 0]])
    expected = model_prefix_smooth_loss(
        model, x, y, torch.from_numpy(Tree.ancestors), torch.from_numpy(Tree.depths), 0.5
    )
    assert torch.equal(loss(model, x, y, "mean"), expected)
    with pytest.raises(ConfigError, match=r"sft.objective=prefix_smooth: sentencepiece"):
        build_objective(smooth, NoTree(), "sft", torch.device("cpu"))
    with pytest.raises(AncestorTableError, match="vocabulary of 4"):
        build(smooth, type("Wider", (Tokens,), {"get_vocab_size": lambda self: 4})())
