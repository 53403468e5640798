"""lockstep.model.ops.chunked_head_loss (CUDA_OPS' head loss) against the reference head_loss: losses and
gradients, reductions, ignored and all-ignored targets, with and without a soft cap, chunks that do
not divide the rows, bf16 autocast, torch.compile, the prefix-smoothed objective, and that no
tensor of the batch's rows times the vocabulary is ever made, forward or backward. Also what it
costs: three vocabulary-sized matmuls per chunk for sum and mean (the gradient taken in the
forward), four for none, fewer where no gradient is wanted; and the head's gradient summed in fp32
without a bf16 temporary where addmm can write fp32 (CUDA; a stand-in on this CPU). And that
compiled chunk bodies whose compile fails fall back to the eager ones (lockstep.core.fastpath), the
loss unchanged and the run facts saying so.

fp32 tolerance: 1e-6 of the largest |element| of the reference tensor (the chunks change only the
matmuls' blocking; measured differences are 0-4e-7). Under bf16 autocast both paths round the
logits and the logit gradient to bf16 at the same points, but the chunked head sums the lm_head
gradient in fp32 over chunks (on this CPU, whose addmm cannot write fp32, each chunk's product
rounded to bf16 first) where the reference rounds the whole product once: 1e-2 of the scale (a few
bf16 units in the last place, 2^-8 each), cosine > 0.9999.

torch.compile runs with the aot_eager backend: it is dynamo's and AOT autograd's tracing and graph
partitioning that decide what is saved between forward and backward, and inductor's C++ build
takes over a minute on a 2-core CPU; inductor itself gives the same numbers (checked by hand)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from _tiny_model import randomize, tiny_gpt
from lockstep.core import fastpath
from lockstep.model import ops
from lockstep.model.gpt import GPT, GPTConfig
from lockstep.model.ops import CUDA_OPS, IGNORE_INDEX, KERNEL_OPS, REFERENCE_OPS
from lockstep.train.objectives import model_prefix_smooth_loss, prefix_smooth_loss
from test_objectives import random_table

# 60 rows; 8 channels, fewer than a chunk's rows, so that no (V, C) weight reads as more rows of
# logits than a chunk in the memory checks below
B, T, C, V_PADDED, V = 4, 15, 8, 128, 120
N = B * T
CHUNK_ROWS = 16  # 60 rows: chunks of 16, 16, 16 and 12


def _inputs(seed: int = 0, *, ignored: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g).requires_grad_()
    w = (torch.randn(V_PADDED, C, generator=g) * 0.8).requires_grad_()  # spread-out logits: the cap matters
    y = torch.randint(0, V, (B, T), generator=g)
    if ignored:
        y[0, :6] = IGNORE_INDEX
        y[2, 3] = IGNORE_INDEX
    return x, w, y


def _loss_and_grads(fn, x, w, y, reduction: str):
    loss = fn(x, w, y, reduction)
    gx, gw = torch.autograd.grad(loss.sum(), (x, w))
    return loss.detach(), gx, gw


def _assert_close_to_scale(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} > {tol} x max |ref| {scale:.3g}"


def _reference(cap):
    return lambda x, w, y, reduction: ops.head_loss(x, w, y, cap, V, reduction)


def _chunked(cap, chunk_rows=CHUNK_ROWS):
    return lambda x, w, y, reduction: ops.chunked_head_loss(x, w, y, cap, V, reduction, chunk_rows=chunk_rows)


@pytest.mark.parametrize("chunk_rows", [CHUNK_ROWS, 7, N, 1000])
@pytest.mark.parametrize("cap", [0.0, 2.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_chunked_loss_equals_reference_loss_and_grads_fp32(reduction, cap, chunk_rows):
    x, w, y = _inputs()
    ref = _loss_and_grads(_reference(cap), x, w, y, reduction)
    got = _loss_and_grads(_chunked(cap, chunk_rows), x, w, y, reduction)
    for what, a, b in zip(("loss", "grad x", "grad w"), got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, what
        _assert_close_to_scale(a, b, 1e-6, what)
    if reduction == "none":
        assert (got[0][y == IGNORE_INDEX] == 0).all()
    assert not got[2][V:].any()  # padded ids never learn
    assert not got[1][y == IGNORE_INDEX].any()  # an ignored row's hidden state gets no gradient


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_loss_all_ignored_batch_is_zero_with_zero_grads(reduction):
    x, w, y = _inputs()
    y = torch.full_like(y, IGNORE_INDEX)
    loss, gx, gw = _loss_and_grads(_chunked(2.0), x, w, y, reduction)
    assert loss.item() == 0.0
    assert torch.isfinite(gx).all() and torch.isfinite(gw).all() and not gx.any() and not gw.any()
    assert loss.item() == ops.head_loss(x, w, y, 2.0, V, reduction).item()


def test_chunked_loss_weight_without_grad_and_bad_arguments():
    x, w, y = _inputs()
    w.requires_grad_(False)
    (gx,) = torch.autograd.grad(ops.chunked_head_loss(x, w, y, 2.0, V, "sum", chunk_rows=7), (x,))
    (ref,) = torch.autograd.grad(ops.head_loss(x, w, y, 2.0, V, "sum"), (x,))
    _assert_close_to_scale(gx, ref, 1e-6, "grad x")
    with pytest.raises(ValueError, match="chunk_rows=0"):
        ops.chunked_head_loss(x, w, y, 2.0, V, "sum", chunk_rows=0)
    with pytest.raises(ValueError, match="loss_reduction"):
        ops.chunked_head_loss(x, w, y, 2.0, V, "avg")
    with pytest.raises(ValueError, match="together"):
        ops.chunked_head_loss(x, w, y, 2.0, V, "sum", target_cols=y[..., None])


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_chunked_loss_under_bf16_autocast_is_close_to_the_reference(reduction):
    x, w, y = _inputs(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _loss_and_grads(_reference(2.0), x, w, y, reduction)
        got = _loss_and_grads(_chunked(2.0), x, w, y, reduction)
    assert got[0].dtype == torch.float32  # the softmax math stays in fp32
    _assert_close_to_scale(got[0], ref[0], 1e-5, "loss")  # same bf16 logits, fp32 from there on
    for what, a, b in zip(("grad x", "grad w"), got[1:], ref[1:]):
        assert a.dtype == b.dtype, what
        _assert_close_to_scale(a, b, 1e-2, what)
        assert F.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0) > 0.9999, what


def _compiled_with_graph_rows(fn, *, fullgraph: bool = True):
    """fn compiled (dynamo + AOT autograd, the graphs then run eagerly, as aot_eager does), and a
    dict filled on its first call with, for the forward and the backward graph, the most rows of
    any tensor in it that has a vocabulary-sized dim: what the compiled step holds at once."""
    rows: dict[str, int] = {}

    def capture(name):
        def compiler(gm, example_inputs):
            rows[name] = max([_vocab_rows(n.meta.get("val")) for n in gm.graph.nodes] + [0])
            return make_boxed_func(gm.forward)
        return compiler

    def backend(gm, example_inputs):
        return aot_module_simplified(
            gm, example_inputs, fw_compiler=capture("forward"), bw_compiler=capture("backward")
        )

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=fullgraph), rows


def _vocab_rows(t) -> int:
    """numel / V of a tensor with a dim of V or V_PADDED ids (0 for anything else): its rows of logits."""
    if not isinstance(t, torch.Tensor) or t.ndim < 2:
        return 0
    vocab_dims = [d for d in t.shape if d in (V, V_PADDED)]
    return t.numel() // vocab_dims[0] if vocab_dims else 0


@pytest.mark.parametrize("reduction, bodies", [("none", 2), ("mean", 1)])  # bodies: forward and backward, or one
def test_chunked_loss_under_torch_compile_equals_eager_and_keeps_chunks(monkeypatch, reduction, bodies):
    # Compiled, the loss is a graph break and each chunk's body compiles on its own: no compiled
    # graph holds more than one chunk's logits, in either pass. (Compiled whole, inductor fused all
    # chunks' reductions into one kernel: every chunk alive at once, and past 2^31 elements an
    # illegal memory access on an H100.)
    x, w, y = _inputs(2)
    body_rows: list[int] = []

    def body_backend(gm, example_inputs):
        body_rows.append(max([_vocab_rows(n.meta.get("example_value")) for n in gm.graph.nodes] + [0]))
        return gm.forward

    monkeypatch.setattr(ops, "CHUNK_COMPILE_BACKEND", body_backend)
    ops.compiled_chunk_bodies.cache_clear()
    try:
        def chunked(x, w, y, reduction):
            return ops.chunked_head_loss(x, w, y, 2.0, V, reduction, chunk_rows=CHUNK_ROWS)

        compiled, rows = _compiled_with_graph_rows(chunked, fullgraph=False)
        eager = _loss_and_grads(chunked, x, w, y, reduction)
        got = _loss_and_grads(compiled, x, w, y, reduction)
        for what, a, b in zip(("loss", "grad x", "grad w"), got, eager):
            _assert_close_to_scale(a, b, 1e-6, what)
        # the caller's graphs hold no logits; each body that ran (none: the forward and the
        # gradient; mean: the forward with its gradient) was compiled for the full chunks and the
        # last one (12 rows), and holds one chunk's logits at most
        assert rows.get("forward", 0) == 0 and rows.get("backward", 0) == 0, rows
        assert len(body_rows) >= 2 * bodies and max(body_rows) == CHUNK_ROWS, body_rows
        assert fastpath.facts()["chunk_bodies"]["path"] == "fast"
    finally:
        ops.compiled_chunk_bodies.cache_clear()
    # uncompiled, the eager bodies run (nothing new compiled)
    n = len(body_rows)
    _loss_and_grads(chunked, x, w, y, reduction)
    assert len(body_rows) == n
    # the reference's compiled graphs hold the batch's logits (so the row count can fail)
    reference, ref_rows = _compiled_with_graph_rows(_reference(2.0))
    _loss_and_grads(reference, x, w, y, reduction)
    assert ref_rows["forward"] >= N and ref_rows["backward"] >= N, ref_rows


def _compiled_loss_with_body_backend(monkeypatch, caplog, body_backend, reduction, calls=2):
    """Loss and gradients of the chunked loss under torch.compile of its caller, the bodies compiled
    by `body_backend`, `calls` times; the fastpath warnings logged meanwhile; and the eager loss."""
    x, w, y = _inputs(2)

    def chunked(x, w, y, reduction):
        return ops.chunked_head_loss(x, w, y, 2.0, V, reduction, chunk_rows=CHUNK_ROWS)

    monkeypatch.setattr(ops, "CHUNK_COMPILE_BACKEND", body_backend)
    ops.compiled_chunk_bodies.cache_clear()
    try:
        compiled, _ = _compiled_with_graph_rows(chunked, fullgraph=False)
        with caplog.at_level(logging.WARNING, logger="lockstep.core.fastpath"):
            got = [_loss_and_grads(compiled, x, w, y, reduction) for _ in range(calls)]
    finally:
        ops.compiled_chunk_bodies.cache_clear()
    warnings = [r.getMessage() for r in caplog.records if r.name == "lockstep.core.fastpath"]
    return got, warnings, _loss_and_grads(chunked, x, w, y, reduction)


@pytest.mark.parametrize("reduction, bodies_per_chunk", [("mean", 1), ("none", 2)])
def test_chunked_loss_bodies_that_fail_to_compile_fall_back_to_eager(monkeypatch, caplog, reduction, bodies_per_chunk):
    # a real torch.compile failure (the backend's compiler raises; dynamo raises
    # BackendCompilerFailed) on the first body: the run goes on with the eager bodies, and says so
    def broken(gm, example_inputs):
        raise RuntimeError("no kernel fits this chunk")

    got, warnings, eager = _compiled_loss_with_body_backend(monkeypatch, caplog, broken, reduction)
    for results in got:
        for what, a, b in zip(("loss", "grad x", "grad w"), results, eager):
            _assert_close_to_scale(a, b, 1e-6, what)
    assert len(warnings) == 1 and "fast path chunk_bodies" in warnings[0], warnings
    facts = fastpath.facts()["chunk_bodies"]
    assert facts["path"] == "reference" and facts["results"] == "reference" and facts["fast_calls"] == 0
    assert (
        facts["fell_back"]
        == "BackendCompilerFailed: backend='broken' raised <- RuntimeError: no kernel fits this chunk"
    )
    assert facts["reference_calls"] == 2 * bodies_per_chunk * -(-N // CHUNK_ROWS)  # two calls, 4 chunks


def test_chunked_loss_backward_body_failing_after_the_forward_compiled_is_mixed(monkeypatch, caplog):
    # "none": the forward bodies compile and answer; the backward's gradient body (the one with a
    # scatter_add) fails. The loss is still right, and the record says the run mixed both paths.
    compiled_graphs = []

    def grad_body_fails(gm, example_inputs):
        if "scatter_add" in gm.code:
            raise RuntimeError("the backward body does not compile")
        compiled_graphs.append(gm)
        return gm.forward

    got, warnings, eager = _compiled_loss_with_body_backend(monkeypatch, caplog, grad_body_fails, "none", calls=1)
    for what, a, b in zip(("loss", "grad x", "grad w"), got[0], eager):
        _assert_close_to_scale(a, b, 1e-6, what)
    assert compiled_graphs  # the forward body did compile
    assert len(warnings) == 1 and "answered 4 call(s) already" in warnings[0], warnings
    facts = fastpath.facts()["chunk_bodies"]
    assert facts["path"] == "reference" and facts["results"] == "mixed"
    assert (facts["fast_calls"], facts["reference_calls"]) == (4, 4)  # 4 chunks forward, 4 backward
    assert fastpath.paths_summary() == "chunk_bodies=fast>reference"


class _LargestVocabTensor(TorchDispatchMode):
    """Records the most rows of logits (numel / V of a tensor with a V-sized dim) that any op
    makes while active: the forward, and the backward when it runs inside."""

    def __init__(self, vocab_dims: tuple[int, ...]):
        super().__init__()
        self.vocab_dims = vocab_dims
        self.rows, self.shape = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.ndim >= 2:
                dims = [d for d in t.shape if d in self.vocab_dims]
                if dims and t.numel() // dims[0] > self.rows:
                    self.rows, self.shape = t.numel() // dims[0], tuple(t.shape)
        return out


def _rows_made(loss_fn, vocab_dims) -> tuple[int, tuple | None]:
    with _LargestVocabTensor(vocab_dims) as probe:
        loss_fn().sum().backward()
    return probe.rows, probe.shape


@pytest.mark.parametrize("cap", [0.0, 2.0])
def test_chunked_loss_makes_no_batch_by_vocab_tensor(cap):
    x, w, y = _inputs(3)
    rows, shape = _rows_made(
        lambda: ops.chunked_head_loss(x, w, y, cap, V, "mean", chunk_rows=CHUNK_ROWS), (V, V_PADDED)
    )
    assert rows == CHUNK_ROWS, shape  # (16, V) chunks, forward and backward
    ref_rows, ref_shape = _rows_made(lambda: ops.head_loss(x, w, y, cap, V, "mean"), (V, V_PADDED))
    assert ref_rows >= N, ref_shape  # the probe sees the reference's (N, V) logits


_MATMULS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_"}  # aten's, with their out= and dtype overloads


class _VocabMatmuls(TorchDispatchMode):
    """Counts the matmuls (aten mm, addmm, bmm) with an operand or output that has a
    vocabulary-sized dim: the (rows x C x V) GEMMs of the head, forward and backward."""

    def __init__(self, vocab_dims: tuple[int, ...]):
        super().__init__()
        self.vocab_dims = vocab_dims
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func.overloadpacket.__name__ in _MATMULS and any(d in self.vocab_dims for t in tensors for d in t.shape):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _vocab_matmuls(loss_fn, *, backward: bool = True) -> int:
    with _VocabMatmuls((V, V_PADDED)) as probe:
        loss = loss_fn()
        if backward:
            loss.sum().backward()
    return probe.count


@pytest.mark.parametrize("reduction, per_chunk", [("sum", 3), ("mean", 3), ("none", 4)])
def test_chunked_loss_matmuls_per_chunk(reduction, per_chunk):
    # sum and mean take the gradient from the forward's logits: logits, dx and dW, three GEMMs per
    # chunk; none recomputes the logits in the backward, four
    chunks = -(-N // CHUNK_ROWS)  # 4
    x, w, y = _inputs(4)
    loss = _chunked(2.0)
    assert _vocab_matmuls(lambda: loss(x, w, y, reduction)) == per_chunk * chunks
    # a gradient not wanted is not computed: without w's, dx alone; without grad mode, the plain loss
    w.requires_grad_(False)
    assert _vocab_matmuls(lambda: loss(x, w, y, reduction)) == (per_chunk - 1) * chunks
    with torch.no_grad():
        assert _vocab_matmuls(lambda: loss(x, w, y, reduction), backward=False) == chunks
    x.requires_grad_(False)
    assert _vocab_matmuls(lambda: loss(x, w, y, reduction), backward=False) == chunks


def test_chunked_loss_backward_twice_is_refused():
    # the backward of sum and mean scales the gradients the forward kept in place: a second one
    # through the same graph would be wrong, and autograd refuses it
    x, w, y = _inputs()
    loss = ops.chunked_head_loss(x, w, y, 2.0, V, "mean", chunk_rows=CHUNK_ROWS)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_chunked_loss_accumulates_the_head_gradient_in_fp32_where_addmm_can(monkeypatch):
    # CUDA's addmm writes a bf16 product into an fp32 out; the CPU has no such kernel, so here a
    # stand-in computes addmm.dtype_out exactly, and the head's gradient must come only from it
    x, w, y = _inputs(1)
    monkeypatch.setattr(ops, "_addmm_writes_fp32", lambda device_type: True)
    calls = []

    class Fp32Addmm(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten.addmm.dtype_out:
                acc, a, b, out_dtype = args
                calls.append((acc is kwargs["out"], acc.dtype, a.dtype, b.dtype, out_dtype, tuple(acc.shape)))
                return acc.add_(a.float() @ b.float())
            out = func(*args, **kwargs)
            if func.overloadpacket.__name__ in _MATMULS:  # no product of the head's shape rounded to bf16 first
                assert not (out.dtype == torch.bfloat16 and tuple(out.shape) == (V, C)), func
            return out

    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _loss_and_grads(_reference(2.0), x, w, y, "sum")
        with Fp32Addmm():
            got = _loss_and_grads(_chunked(2.0), x, w, y, "sum")
    bf16, fp32 = torch.bfloat16, torch.float32
    assert calls == [(True, fp32, bf16, bf16, fp32, (V, C))] * -(-N // CHUNK_ROWS)  # into the fp32 sum, per chunk
    for what, a, b in zip(("loss", "grad x", "grad w"), got, ref):
        _assert_close_to_scale(a, b, 1e-5 if what == "loss" else 1e-2, what)


def test_the_fp32_addmm_feature_test(monkeypatch):
    # a backend without the kernel, one that writes the product over the sum, and one that adds
    probe = ops._addmm_writes_fp32.__wrapped__

    def missing(*args, **kwargs):
        raise NotImplementedError("Could not run 'aten::addmm.dtype_out' with arguments from the 'CPU' backend")

    def overwrites(acc, a, b, *, out_dtype, out):
        return out.copy_(a.float() @ b.float())

    def adds(acc, a, b, *, out_dtype, out):
        return out.add_(a.float() @ b.float())

    for addmm, works in ((missing, False), (overwrites, False), (adds, True)):
        monkeypatch.setattr(torch, "addmm", addmm)
        assert probe("cpu") is works, addmm.__name__


def _prefix_model(ops_set, V_model: int, seq: int):
    model = GPT.build(GPTConfig.from_depth(1, V_model, seq, head_dim=32, softcap=2.0), "cpu", seed=0)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(5))
    return model.use_kernels(True, ops=ops_set) if ops_set is not REFERENCE_OPS else model


@pytest.mark.parametrize(
    "chunk_rows", [ops.CHUNK_ROWS, 7]
)  # CUDA_OPS itself (one chunk of 48 rows); 7 does not divide 48
@pytest.mark.parametrize("weight, reduction", [(0.3, "mean"), (2.0, "sum"), (0.3, "none")])
def test_chunked_loss_prefix_smoothed_equals_its_reference(weight, reduction, chunk_rows):
    g = torch.Generator().manual_seed(6)
    Vm = 90
    ancestors, depths = random_table(Vm, g)
    ops_set = CUDA_OPS if chunk_rows == ops.CHUNK_ROWS else dataclasses.replace(
        CUDA_OPS, smoothed_head_loss=_with_chunk_rows(chunk_rows))
    model = _prefix_model(ops_set, Vm, 16)
    idx = torch.randint(0, Vm, (3, 16), generator=g)
    targets = torch.randint(0, Vm, (3, 16), generator=g)
    targets[2, 5:] = IGNORE_INDEX
    got = model_prefix_smooth_loss(model, idx, targets, ancestors, depths, weight, reduction)
    got_grads = torch.autograd.grad(got.sum(), list(model.parameters()))
    model.use_kernels(False)  # the plain path: the reference's logits, then the dense loss
    ref = prefix_smooth_loss(model(idx), targets, ancestors, depths, weight, reduction=reduction)
    ref_grads = torch.autograd.grad(ref.sum(), list(model.parameters()))
    _assert_close_to_scale(got, ref, 1e-6, "loss")
    for (name, _), a, b in zip(model.named_parameters(), got_grads, ref_grads):
        _assert_close_to_scale(a, b, 1e-6, name)


def test_chunked_loss_prefix_smoothed_makes_no_batch_by_vocab_tensor():
    # the whole objective (model forward + backward included) under the probe; 128 rows > the
    # 64 channels, so the lm_head's (V, C) gradient is no batch-sized logits tensor
    Vm, seq = 300, 32
    g = torch.Generator().manual_seed(8)
    ancestors, depths = random_table(Vm, g)
    idx = torch.randint(0, Vm, (4, seq), generator=g)
    targets = torch.randint(0, Vm, (4, seq), generator=g)
    vocab_dims = (Vm, 320)
    chunked_32 = dataclasses.replace(CUDA_OPS, smoothed_head_loss=_with_chunk_rows(32))  # 4 chunks of 32 rows
    model = _prefix_model(chunked_32, Vm, seq)
    rows, shape = _rows_made(lambda: model_prefix_smooth_loss(model, idx, targets, ancestors, depths, 0.3), vocab_dims)
    assert rows < idx.numel(), shape
    assert rows <= 64, shape  # 32-row chunks of logits; the (V, C) weight gradient reads as 64 rows
    ref = _prefix_model(REFERENCE_OPS, Vm, seq)
    ref_rows, ref_shape = _rows_made(
        lambda: model_prefix_smooth_loss(ref, idx, targets, ancestors, depths, 0.3), vocab_dims
    )
    assert ref_rows >= idx.numel(), ref_shape


def _with_chunk_rows(chunk_rows: int):
    def smoothed(x, w, targets, cols, coefs, cap, vocab_size, reduction):
        return ops.chunked_head_loss(x, w, targets, cap, vocab_size, reduction, chunk_rows=chunk_rows,
                                     target_cols=cols, target_weights=coefs)
    return smoothed


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_chunked_loss_through_the_model_equals_the_reference(reduction):
    m = randomize(tiny_gpt(sequence_len=32, vocab_size=70, n_layer=2, n_head=4))
    g = torch.Generator().manual_seed(9)
    idx = torch.randint(0, 70, (3, 20), generator=g)
    y = torch.randint(0, 70, (3, 20), generator=g)
    y[0, :5] = IGNORE_INDEX
    results = []
    for model in (m.use_kernels(False), m.use_kernels(True, ops=CUDA_OPS)):
        loss = model(idx, y, loss_reduction=reduction)
        results.append((loss.detach(), torch.autograd.grad(loss.sum(), list(model.parameters()))))
    (ref, ref_grads), (got, got_grads) = results
    _assert_close_to_scale(got, ref, 1e-6, "loss")
    for (name, _), a, b in zip(m.named_parameters(), got_grads, ref_grads):
        _assert_close_to_scale(a, b, 1e-6, name)


def test_chunked_loss_is_what_use_kernels_picks_on_cuda():
    assert ops.fast_ops(torch.device("cuda")) is CUDA_OPS
    assert ops.fast_ops(torch.device("cuda", 1)) is CUDA_OPS
    assert ops.fast_ops(torch.device("cpu")) is KERNEL_OPS
    m = tiny_gpt()
    assert m.use_kernels(True).ops is KERNEL_OPS  # a CPU model: unchanged
    assert m.use_kernels(True, ops=CUDA_OPS).ops is CUDA_OPS  # chosen outright, for these tests
    assert m.use_kernels(False).ops is REFERENCE_OPS
    with pytest.raises(ValueError, match="only with on=True"):
        m.use_kernels(False, ops=CUDA_OPS)
    assert CUDA_OPS.head_loss is ops.chunked_head_loss
    assert KERNEL_OPS.smoothed_head_loss is None and REFERENCE_OPS.smoothed_head_loss is None
