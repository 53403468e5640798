"""GPT model tests on tiny CPU configs: shapes, config round-trip, loss reductions and masking,
the kernels' fused head against the reference logits path, grouped-query attention against
multi-head, and overfitting one batch."""

from __future__ import annotations

import math

import pytest
import torch

from _tiny_model import randomize, tiny_config
from lockstep.core.config import ConfigError
from lockstep.model import kernels, ops
from lockstep.model.gpt import GPT, IGNORE_INDEX, GPTConfig, attend, cross_entropy


def tiny(**kw) -> GPTConfig:
    return tiny_config(**{"sequence_len": 32, "vocab_size": 100, "n_layer": 2, "n_head": 4, **kw})


def tokens(B: int, T: int, V: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_from_depth_dims_and_padding():
    c = GPTConfig.from_depth(4, vocab_size=265, sequence_len=256)
    assert (c.n_layer, c.n_embd, c.n_head, c.n_kv_head, c.head_dim) == (4, 256, 4, 4, 64)
    assert c.padded_vocab_size == 320
    c2 = GPTConfig.from_depth(2, vocab_size=4096, sequence_len=64, head_dim=32, n_kv_head=2, softcap=0.0)
    assert (c2.n_head, c2.n_kv_head, c2.softcap, c2.padded_vocab_size) == (4, 2, 0.0, 4096)


def test_config_dict_round_trip_and_validation():
    c = tiny(rope_theta=500.0)
    assert GPTConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ConfigError, match="bogus"):
        GPTConfig.from_dict({**c.to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match="n_kv_head=3 must divide n_head=4"):
        tiny(n_kv_head=3)
    with pytest.raises(ValueError, match="must divide by n_head"):
        tiny(n_embd=30)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"n_head": 0}, "model.n_head=0 must be a positive integer"),
        ({"sequence_len": -1}, "model.sequence_len=-1 must be a positive integer"),
        ({"n_embd": 0}, "model.n_embd=0 must be a positive integer"),
        ({"n_kv_head": 0}, "model.n_kv_head=0 must be a positive integer"),
        ({"n_embd": 12, "n_head": 4}, "model.n_head=4 gives the odd head dim n_embd/n_head=3"),
        ({"rope_theta": float("nan")}, "model.rope_theta=nan must be a finite number > 0"),
        ({"softcap": -1.0}, "model.softcap=-1.0 must be a finite number >= 0"),
    ],
)
def test_config_from_a_checkpoint_names_the_bad_key(fields, match):
    # A checkpoint's meta.json model_config goes through from_dict: the error names its key.
    with pytest.raises(ConfigError, match=match):
        GPTConfig.from_dict({**tiny().to_dict(), **fields})


@pytest.mark.parametrize(
    "head_dim, match",
    [(0, "head_dim=0 must be a positive even integer"), (-64, "head_dim=-64 must be a positive even integer"),
     (5, "head_dim=5 must be a positive even integer"), (48, "head_dim=48 must divide the width 64 \\* depth = 256")],
)
def test_from_depth_refuses_a_head_dim_that_cannot_shape_the_model(head_dim, match):
    with pytest.raises(ConfigError, match=match):
        GPTConfig.from_depth(4, vocab_size=100, sequence_len=64, head_dim=head_dim)
    with pytest.raises(ConfigError, match="depth=0 must be a positive integer"):
        GPTConfig.from_depth(0, vocab_size=100, sequence_len=64)


def test_build_is_a_pure_function_of_the_seed_and_zero_inits_projections():
    c = tiny()
    a, b, other = GPT.build(c, "cpu", seed=3), GPT.build(c, "cpu", seed=3), GPT.build(c, "cpu", seed=4)
    for (name, pa), pb, po in zip(a.named_parameters(), b.parameters(), other.parameters()):
        assert torch.equal(pa, pb), name
        if "c_proj" in name:
            assert not pa.any(), name
        else:
            assert not torch.equal(pa, po), name
    assert not any(p.is_meta for p in a.parameters())


def test_param_groups_and_counts():
    c = tiny()
    m = GPT.build(c, "cpu")
    groups = m.param_groups()
    ids = [id(p) for g in groups.values() for p in g]
    assert sorted(ids) == sorted(id(p) for p in m.parameters())
    assert all(p.ndim == 2 for p in groups["matrix"])
    V, C, L = c.padded_vocab_size, c.n_embd, c.n_layer
    D = c.head_dim
    per_block = C * C + 2 * C * c.n_kv_head * D + C * C + 2 * 4 * C * C
    assert m.num_params() == 2 * V * C + L * per_block
    assert m.num_params(exclude_embedding=True) == V * C + L * per_block
    assert m.flops_per_token() == 6 * (V * C + L * per_block) + 12 * L * c.n_head * D * c.sequence_len


def test_forward_shapes_and_padded_vocab_sliced():
    c = tiny(vocab_size=70)  # padded to 128
    m = randomize(GPT.build(c, "cpu"))
    idx = tokens(3, 10, 70)
    logits = m(idx)
    assert logits.shape == (3, 10, 70) and logits.dtype == torch.float32
    assert logits.abs().max() <= c.softcap
    assert m(idx, idx).shape == ()
    assert m(idx, idx, loss_reduction="none").shape == (3, 10)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        m(tokens(1, 33, 70))
    with pytest.raises(ValueError, match="loss_reduction"):
        m(idx, idx, loss_reduction="avg")


@pytest.mark.parametrize("softcap", [15.0, 0.0])
def test_kernel_head_loss_equals_reference_cross_entropy(softcap, monkeypatch):
    monkeypatch.setattr(kernels, "HEAD_TILE_ROWS", 16)
    monkeypatch.setattr(kernels, "HEAD_TILE_COLS", 32)
    c = tiny(vocab_size=70, softcap=softcap)
    m = randomize(GPT.build(c, "cpu"))
    idx = tokens(3, 20, 70)  # 60 rows x 70 ids: 4 x 3 tiles of the fused head, the last ones short
    y = tokens(3, 20, 70, seed=1)
    y[0, :5] = IGNORE_INDEX
    for reduction in ("mean", "sum", "none"):
        m.use_kernels(False).zero_grad()
        ref = m(idx, y, loss_reduction=reduction)
        torch.testing.assert_close(ref, cross_entropy(m(idx), y, reduction))  # the reference is the plain head
        ref.sum().backward()
        ref_grads = [p.grad.clone() for p in m.parameters()]
        assert not m.lm_head.weight.grad[70:].any()  # padded rows never learn
        m.use_kernels(True).zero_grad()
        got = m(idx, y, loss_reduction=reduction)
        got.sum().backward()
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        for (name, p), g in zip(m.named_parameters(), ref_grads):
            # summation order differs (tiles, the kernel norm): compare against the gradient's scale
            assert (p.grad - g).abs().max() <= 1e-5 * g.abs().max(), name
        assert not m.lm_head.weight.grad[70:].any()


def test_kernels_are_off_by_default_and_leave_the_state_dict_alone():
    c = tiny()
    m = GPT.build(c, "cpu", seed=1)
    assert m.ops is ops.REFERENCE_OPS
    names = list(m.state_dict())
    assert m.use_kernels() is m and m.ops is ops.KERNEL_OPS
    assert list(m.state_dict()) == names
    assert m.use_kernels(False).ops is ops.REFERENCE_OPS


def test_masked_targets_are_ignored():
    c = tiny()
    m = randomize(GPT.build(c, "cpu"))
    idx = tokens(2, 16, 100)
    y = tokens(2, 16, 100, seed=1)
    y2 = y.clone()
    y[:, ::2] = IGNORE_INDEX
    y2[:, ::2] = (y2[:, ::2] + 1) % 100  # different values at the positions masked in y
    none = m(idx, y, loss_reduction="none")
    assert (none[:, ::2] == 0).all() and (none[:, 1::2] > 0).all()
    keep = y != IGNORE_INDEX
    torch.testing.assert_close(m(idx, y), m(idx, y2, loss_reduction="none")[keep].mean())
    torch.testing.assert_close(m(idx, y, loss_reduction="sum"), none.sum())


@pytest.mark.parametrize("use_kernels", [False, True])
def test_all_ignored_batch_gives_zero_loss_and_finite_grads(use_kernels):
    m = randomize(GPT.build(tiny(), "cpu")).use_kernels(use_kernels)
    idx = tokens(2, 8, 100)
    y = torch.full_like(idx, IGNORE_INDEX)
    loss = m(idx, y)
    loss.backward()
    assert loss.item() == 0.0
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and not p.grad.any(), name


def test_gqa_attention_equals_mha_with_repeated_heads():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g)
    k, v = torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    got = attend(q, k, v, None, is_causal=True)
    ref = attend(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), None, is_causal=True)
    torch.testing.assert_close(got, ref)


def test_gqa_model_equals_mha_model_with_duplicated_kv_weights():
    cg = tiny(n_head=4, n_kv_head=2)
    gqa = randomize(GPT.build(cg, "cpu"))
    mha = GPT.build(tiny(n_head=4, n_kv_head=4), "cpu")
    D = cg.head_dim
    state = {}
    for name, p in gqa.state_dict().items():
        if name.endswith(("c_k.weight", "c_v.weight")):
            # kv head j serves query heads 2j and 2j+1: duplicate its rows in that order
            p = p.view(cg.n_kv_head, D, -1).repeat_interleave(2, dim=0).reshape(cg.n_head * D, -1)
        state[name] = p
    mha.load_state_dict(state)
    idx = tokens(2, 12, 100)
    torch.testing.assert_close(gqa(idx), mha(idx), rtol=1e-5, atol=1e-5)


def test_gqa_path_with_equal_heads_equals_plain_multi_head():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=g) for _ in range(3))
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    forced = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(attend(q, k, v, None, is_causal=True), plain)
    torch.testing.assert_close(forced, plain)


def test_causality_future_tokens_do_not_change_past_logits():
    m = randomize(GPT.build(tiny(), "cpu"))
    idx = tokens(1, 12, 100)
    idx2 = idx.clone()
    idx2[0, 8:] = (idx2[0, 8:] + 7) % 100
    torch.testing.assert_close(m(idx)[:, :8], m(idx2)[:, :8])


def test_initial_loss_near_uniform_and_overfits_a_batch():
    torch.manual_seed(0)  # AdamW itself draws nothing; kept for hermeticity
    c = tiny(vocab_size=64)
    m = GPT.build(c, "cpu", seed=0)
    idx = tokens(2, 16, 64)
    y = tokens(2, 16, 64, seed=1)
    first = m(idx, y).item()
    assert abs(first - math.log(64)) < 0.05
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        loss = m(idx, y)
        loss.backward()
        opt.step()
    assert loss.item() < 0.3 * first


def test_bf16_autocast_loss_close_to_fp32():
    m = randomize(GPT.build(tiny(), "cpu"), seed=2)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(0.3)
    idx, y = tokens(2, 16, 100), tokens(2, 16, 100, seed=1)
    ref = m(idx, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = m(idx, y)
    assert got.dtype == torch.float32
    assert abs(got.item() - ref.item()) < 0.05 * ref.item()
    got.backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize("norm", [ops.REFERENCE_OPS.norm, ops.KERNEL_OPS.norm], ids=["reference", "kernel"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm_matches_reference_and_gradcheck(norm, dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 16, generator=g) * 3).to(dtype).requires_grad_()
    grad = torch.randn(3, 5, 16, generator=g).to(dtype)
    y = norm(x)
    y.backward(grad)
    xr = x.detach().double().requires_grad_()
    yr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + ops.RMS_EPS)
    yr.backward(grad.double())
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), yr, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=tol, atol=tol)
    with torch.no_grad():
        torch.testing.assert_close(norm(x), y)
    xd = torch.randn(2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(norm, (xd,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_head_under_low_precision_autocast_close_to_fp32(dtype):
    m = randomize(GPT.build(tiny(), "cpu"), seed=5)
    idx, y = tokens(2, 16, 100), tokens(2, 16, 100, seed=1)
    ref = cross_entropy(m(idx), y, "mean")
    ref.backward()
    ref_grad = m.lm_head.weight.grad.clone()
    m.zero_grad()
    m.use_kernels(True)
    with torch.autocast("cpu", dtype=dtype):
        got = m(idx, y)
    got.backward()
    assert abs(got.item() - ref.item()) < 0.02 * ref.item()
    assert torch.isfinite(m.lm_head.weight.grad).all()
    cos = torch.nn.functional.cosine_similarity(m.lm_head.weight.grad.flatten(), ref_grad.flatten(), dim=0)
    assert cos > 0.99
