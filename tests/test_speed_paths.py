"""The CPU fast paths give the same numbers as the plain ones: the fused head's threaded row blocks
against one thread, fused AdamW against the foreach formula. Not a benchmark."""

import pytest
import torch

from lockstep import model as M
from lockstep.optim import AdamW


def _head(x0, w0, y, dtype, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = M.head_loss(x, w, y, softcap=15.0, vocab_size=w.size(0) - 3, reduction="sum")
        loss.backward()
        return loss.detach(), x.grad, w.grad
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threaded_head_blocks_match_one_thread(dtype):
    g = torch.Generator().manual_seed(0)
    rows = 3 * M.HEAD_TILE_ROWS + 5  # several row blocks, the last one short
    x0 = torch.randn(1, rows, 16, generator=g)
    w0 = torch.randn(200, 16, generator=g) * 0.3
    y = torch.randint(0, 197, (1, rows), generator=g)
    y[0, 7] = M.IGNORE_INDEX
    one = _head(x0, w0, y, dtype, 1)
    two = _head(x0, w0, y, dtype, 2)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    assert torch.isfinite(one[0]) and one[1].abs().sum() > 0


def test_fused_adamw_matches_foreach_formula():
    g = torch.Generator().manual_seed(1)
    fused = torch.randn(64, 8, generator=g)
    plain = fused.clone().to(torch.float64)  # fp64 takes the foreach path
    grads = [torch.randn(64, 8, generator=g) for _ in range(3)]
    p1, p2 = torch.nn.Parameter(fused), torch.nn.Parameter(plain)
    o1 = AdamW([p1], lr=1e-2, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)
    o2 = AdamW([p2], lr=1e-2, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)
    for gr in grads:
        p1.grad, p2.grad = gr.clone(), gr.to(torch.float64)
        o1.step()
        o2.step()
    torch.testing.assert_close(p1.data, p2.data.float(), rtol=1e-5, atol=1e-6)


def test_small_bf16_linear_follows_weight_updates():
    g = torch.Generator().manual_seed(2)
    w = torch.nn.Parameter((torch.randn(32, 16, generator=g) * 0.2).bfloat16())
    x = torch.randn(2, 16, generator=g).bfloat16()
    with torch.no_grad():
        fast = M._linear(x, w)
        torch.testing.assert_close(fast, torch.nn.functional.linear(x, w), rtol=1e-2, atol=1e-2)
        w.add_(1.0)  # an optimizer step in place: the cached fp32 copy must not be reused
        torch.testing.assert_close(M._linear(x, w), torch.nn.functional.linear(x, w), rtol=1e-2, atol=1e-2)
        w.data = torch.zeros_like(w.data)  # new storage, as GPT.build's cast or a load does
        assert torch.equal(M._linear(x, w), torch.zeros(2, 32, dtype=torch.bfloat16))
