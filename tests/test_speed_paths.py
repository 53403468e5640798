"""lockstep.model.kernels against the reference: the same model with kernels on and off gives the same
logits, losses and gradients to the tolerances stated here, each fast path matches its stock
counterpart, and the threaded fused head is exact against one thread. Not a benchmark.

Tolerances are fractions of the largest |element| of the reference tensor, since rounding and
summation-order differences scale with the tensor, not with each element. fp32 differs only in
summation order (the fused head's tiles, the kernel norm's fp32 accumulation): 1e-5. Under bf16
the kernel norm rounds its scale to bf16 before the product while F.rms_norm multiplies in fp32,
one bf16 unit in the last place (2^-8) per norm, compounding over the layers: 2e-2 on logits,
5e-2 on gradients (whose direction must still agree to cosine 0.999)."""

import pytest
import torch
import torch.nn.functional as F
from test_chat_model import write_tiny_checkpoint

from _tiny_model import randomize, tiny_gpt
from lockstep.core.config import ConfigError, build_config
from lockstep.core.runtime import RuntimeConfig, init_runtime
from lockstep.infer.chat import load_backend
from lockstep.infer.engine import KVCache
from lockstep.model import kernels, ops
from lockstep.model.gpt import GPT
from lockstep.model.ops import IGNORE_INDEX, KERNEL_OPS, REFERENCE_OPS, RMS_EPS


def _model(vocab_size: int = 70, seed: int = 0, **kw) -> GPT:
    """A tiny model whose weights are all non-zero (the zero-initialised projections included),
    so every path through it matters."""
    return randomize(
        tiny_gpt(**{"sequence_len": 32, "vocab_size": vocab_size, "n_layer": 2, "n_head": 4, **kw}), seed=seed
    )


def _loss_and_grads(m: GPT, idx, y, reduction: str, autocast: bool):
    m.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = m(idx, y, loss_reduction=reduction)
    loss.sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def _assert_close_to_scale(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    """Every element within `tol` times the largest |ref|: summation-order and rounding
    differences scale with the tensor, not with each element."""
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} > {tol} x max |ref| {scale:.3g}"


@pytest.mark.parametrize("autocast, tol", [(False, 1e-5), (True, 5e-2)], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_kernels_on_and_off_give_the_same_loss_and_grads(autocast, tol, reduction):
    m = _model()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 70, (3, 20), generator=g)
    y = torch.randint(0, 70, (3, 20), generator=g)
    y[0, :5] = IGNORE_INDEX
    ref_loss, ref_grads = _loss_and_grads(m.use_kernels(False), idx, y, reduction, autocast)
    loss, grads = _loss_and_grads(m.use_kernels(True), idx, y, reduction, autocast)
    _assert_close_to_scale(loss, ref_loss, tol / 2, "loss")
    for name, g_ref in ref_grads.items():
        _assert_close_to_scale(grads[name], g_ref, tol, name)
        assert F.cosine_similarity(grads[name].flatten(), g_ref.flatten(), dim=0) > 0.999, name


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernels_on_and_off_give_the_same_logits_full_and_decoding(dtype, tol):
    m = _model(vocab_size=100).to(dtype)
    idx = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = m.use_kernels(False)(idx)
        _assert_close_to_scale(m.use_kernels(True)(idx), ref, tol, "logits")
        # KV-cache decoding: few rows per step, where the head computes W @ x.T
        for on in (False, True):
            m.use_kernels(on)
            cache = KVCache.for_model(m, batch_size=2)
            steps = [m(idx[:, :4], kv_cache=cache)] + [m(idx[:, t : t + 1], kv_cache=cache) for t in range(4, 12)]
            _assert_close_to_scale(torch.cat(steps, dim=1), ref, tol, f"decoded logits, kernels {on}")


def test_rms_norm_kernel_equals_reference_forward_and_backward():
    g = torch.Generator().manual_seed(3)
    x0, grad = torch.randn(4, 7, 64, generator=g) * 3, torch.randn(4, 7, 64, generator=g)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2**-7)):  # bf16: within one unit in the last place
        outs = []
        for norm in (lambda t: F.rms_norm(t, (64,), eps=RMS_EPS), lambda t: kernels.rms_norm(t, RMS_EPS)):
            x = x0.to(
                dtype, copy=True
            ).requires_grad_()  # the kernel's own backward runs only where a gradient is needed
            y = norm(x)
            y.backward(grad.to(dtype))
            outs.append((y.detach().float(), x.grad.float()))
        (y_ref, dx_ref), (y, dx) = outs
        assert ((y - y_ref).abs() <= tol * y_ref.abs() + 1e-6).all(), dtype
        _assert_close_to_scale(dx, dx_ref, 4 * tol, f"{dtype} input gradient")
    with torch.no_grad():  # without a gradient, the kernel is F.rms_norm itself
        assert torch.equal(kernels.rms_norm(x0, RMS_EPS), F.rms_norm(x0, (64,), eps=RMS_EPS))


def test_head_logits_kernel_equals_linear():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(200, 16, generator=g)
    for rows in (1, kernels.SMALL_BATCH_ROWS, kernels.SMALL_BATCH_ROWS + 1):
        x = torch.randn(1, rows, 16, generator=g)
        torch.testing.assert_close(kernels.head_logits(x, w), F.linear(x, w), rtol=1e-6, atol=1e-6)


def test_fused_head_refuses_a_softcap_it_cannot_exponentiate():
    x, w, y = torch.zeros(1, 2, 4), torch.zeros(8, 4), torch.zeros(1, 2, dtype=torch.long)
    for softcap in (0.0, kernels.SAFE_EXP_CAP + 1):
        with pytest.raises(ValueError, match="softcap"):
            kernels.head_loss_rows(x, w, y, softcap=softcap, vocab_size=8, ignore_index=IGNORE_INDEX)


def test_fused_head_equals_the_one_softcap_formula():
    """kernels.head_loss_rows folds 1/softcap into the weight rather than calling ops.softcap; held
    here, with ops.fused_head_loss's reductions, to the reference head loss, which does."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 9, 16, generator=g) * 3, torch.randn(40, 16, generator=g)
    y = torch.randint(0, 37, (2, 9), generator=g)
    y[0, 0] = IGNORE_INDEX
    for reduction in ("mean", "sum", "none"):
        got = ops.fused_head_loss(x, w, y, 15.0, 37, reduction)
        torch.testing.assert_close(got, ops.head_loss(x, w, y, 15.0, 37, reduction), rtol=1e-5, atol=1e-5)
    assert ops.softcap(torch.tensor([1e6, -1e6, 0.0]), 15.0).tolist() == [15.0, -15.0, 0.0]


def _head(x0, w0, y, dtype, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = ops.fused_head_loss(x, w, y, 15.0, w.size(0) - 3, "sum")
        loss.backward()
        return loss.detach(), x.grad, w.grad
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threaded_head_blocks_match_one_thread(dtype):
    g = torch.Generator().manual_seed(0)
    rows = 3 * kernels.HEAD_TILE_ROWS + 5  # several row blocks, the last one short
    x0 = torch.randn(1, rows, 16, generator=g)
    w0 = torch.randn(200, 16, generator=g) * 0.3
    y = torch.randint(0, 197, (1, rows), generator=g)
    y[0, 7] = IGNORE_INDEX
    one = _head(x0, w0, y, dtype, 1)
    two = _head(x0, w0, y, dtype, 2)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    assert torch.isfinite(one[0]) and one[1].abs().sum() > 0


def test_runtime_kernels_setting_is_checked_and_reaches_the_chat_model(tmp_path):
    with pytest.raises(ConfigError, match="runtime.kernels"):
        build_config(RuntimeConfig, {"kernels": "yes"}, where="runtime")
    assert not RuntimeConfig().kernels
    rt = init_runtime(RuntimeConfig(device="cpu", dtype="fp32", kernels=True))
    assert rt.kernels and rt.describe()["kernels"] is True
    ckpt, tok_dir = write_tiny_checkpoint(tmp_path)
    assert load_backend(ckpt, tok_dir).engine.model.ops is REFERENCE_OPS
    fast_on_cpu = load_backend(ckpt, tok_dir, kernels=True).engine
    assert fast_on_cpu.model.ops is KERNEL_OPS
    # On the CPU kernels leave decoding on the reference engine path, in fp32; on CUDA they also
    # switch on its static-cache path, in bf16 (lockstep.infer.engine.decode_settings).
    assert not fast_on_cpu.fast and fast_on_cpu.dtype is None
    assert all(p.dtype == torch.float32 for p in fast_on_cpu.model.parameters())
