"""lockstep.infer.cpu_step against the model's own forward: the same logits to rounding at shared and
per-row positions, grouped-query heads included; the same greedy and sampled tokens through the
engine in fp32; bf16 weights and bf16 autocast over an fp32 model (the eval stage's case, where the
prefill's cache is bf16) close to the forward; weights changed in place followed; a step that
raises answered by the forward; the packed head equal to F.linear, and F.linear where the packing
ops are missing."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from _tiny_model import randomize, tiny_gpt
from lockstep.core import fastpath
from lockstep.infer import cpu_step as cpu_step_module
from lockstep.infer.cpu_step import CpuStep, packed_head
from lockstep.infer.engine import Engine, KVCache, decode_settings


def model_of(seed: int = 0, dtype: torch.dtype | None = None, **kw):
    model = randomize(tiny_gpt(seed=seed, **{"n_layer": 2, "n_head": 4, **kw}), seed=seed + 100, scale=0.5).eval()
    if dtype is not None:
        model.to(dtype=dtype)
        model.init_rotary()  # rotary tables stay fp32, as GPT.build leaves them
    return model


def caches(model, prompts: list[list[int]]) -> tuple[KVCache, KVCache]:
    """Two equal caches whose rows hold `prompts` prefilled (rows of different lengths keep their
    own positions)."""
    made = []
    for _ in range(2):
        rows = []
        for p in prompts:
            c = KVCache.for_model(model, 1, capacity_tokens=len(p))
            model(torch.tensor([p]), kv_cache=c)
            rows.append(c)
        made.append(KVCache.stack(rows, capacity_tokens=64))
    return made[0], made[1]


def step_against_forward(model, prompts, steps: int = 6) -> float:
    """The largest |logit difference| between CpuStep and the model's forward over `steps` greedy
    tokens from `prompts`, each path on its own cache."""
    step = CpuStep(model)
    worst = 0.0
    with torch.inference_mode():
        ref_cache, step_cache = caches(model, prompts)
        ids = torch.tensor([[p[-1]] for p in prompts])
        for _ in range(steps):
            want = model(ids, kv_cache=ref_cache)[:, -1]
            got = step(ids, step_cache)
            assert got.dtype == torch.float32 and got.shape == want.shape
            worst = max(worst, (got - want).abs().max().item())
            ids = want.argmax(-1, keepdim=True)
        assert step_cache.row_positions() == ref_cache.row_positions()
    return worst


@pytest.mark.parametrize("n_kv_head", [2, 4])
@pytest.mark.parametrize("lengths", [(5, 5, 5), (3, 9, 6)], ids=["shared-position", "per-row-positions"])
def test_fp32_logits_equal_the_forward(n_kv_head, lengths):
    model = model_of(n_kv_head=n_kv_head)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    assert step_against_forward(model, prompts) < 1e-4


def test_bf16_weights_and_bf16_autocast_are_close_to_the_forward():
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    assert step_against_forward(model_of(dtype=torch.bfloat16), prompts) < 0.1
    fp32 = model_of()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert step_against_forward(fp32, prompts) < 0.1
    # and outside autocast the same model's step is fp32 again (the copies follow the compute dtype)
    assert step_against_forward(fp32, prompts) < 1e-4


def test_engine_greedy_and_sampled_tokens_equal_the_reference(tok):
    model = model_of(seed=3)
    ref, fast = Engine(model, tok), Engine(model, tok, cpu_step=True)
    prompt = tok.encode("hello there")
    for kw in (dict(temperature=0.0), dict(temperature=1.0, top_k=20, seed=5), dict(temperature=0.8, top_p=0.9)):
        a, _ = ref.generate_batch(prompt, num_samples=3, max_tokens=24, use_tools=False, **kw)
        b, _ = fast.generate_batch(prompt, num_samples=3, max_tokens=24, use_tools=False, **kw)
        assert a == b, kw
    prompts = [tok.encode(t) for t in ("a", "bcd efg", "hi", "xyz uvw rst")]
    for kw in (dict(temperature=0.0), dict(temperature=1.0, top_k=20, seed=2)):
        a = ref.generate_many(prompts, max_tokens=[12, 5, 20, 9], batch_rows=2, use_tools=False, **kw)
        b = fast.generate_many(prompts, max_tokens=[12, 5, 20, 9], batch_rows=2, use_tools=False, **kw)
        assert a == b, kw
    assert fastpath.facts()["cpu_decode_step"]["path"] == "fast"


def test_engine_under_bf16_autocast_decodes_rows_of_different_lengths(tok):
    """The eval stage's case: an fp32 model under bf16 autocast, whose prefill leaves a bf16 cache,
    rows at their own positions (the per-row write is an index_put, which needs equal dtypes)."""
    model = model_of(seed=4)
    prompts = [tok.encode(t) for t in ("a", "bcd efg", "hi")]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ids, _ = Engine(model, tok, cpu_step=True).generate_many(prompts, max_tokens=10, batch_rows=3, use_tools=False)
    assert [len(r) for r in ids] == [10, 10, 10]
    assert fastpath.facts()["cpu_decode_step"] == {"path": "fast", "fast_calls": 10, "reference_calls": 0,
                                                   "compiles": 0, "compile_s": 0.0}


def test_weights_changed_in_place_are_followed():
    model = model_of(seed=5)
    step = CpuStep(model)
    prompts = [[1, 2, 3]]
    with torch.inference_mode():
        step(torch.tensor([[4]]), caches(model, prompts)[0])
    with torch.no_grad():  # an optimiser step's kind of change: in place, same storage
        for p in model.parameters():
            p.mul_(1.5)
    with torch.inference_mode():
        a, b = caches(model, prompts)
        want = model(torch.tensor([[4]]), kv_cache=a)[:, -1]
        assert (step(torch.tensor([[4]]), b) - want).abs().max().item() < 1e-4
    model.load_state_dict({k: v * 0.5 for k, v in model.state_dict().items()})
    with torch.inference_mode():
        a, b = caches(model, prompts)
        want = model(torch.tensor([[4]]), kv_cache=a)[:, -1]
        assert (step(torch.tensor([[4]]), b) - want).abs().max().item() < 1e-4


def test_a_step_that_raises_is_answered_by_the_forward(tok, monkeypatch, caplog):
    model = model_of(seed=6)
    prompt = tok.encode("hello")
    want, _ = Engine(model, tok).generate_batch(prompt, max_tokens=12, temperature=0.0, use_tools=False)

    def broken(self, x, cos, sin, cache):
        cache.update(0, *(torch.zeros(x.size(0), model.config.n_kv_head, 1, model.config.head_dim),) * 2)
        raise RuntimeError("a kernel this CPU lacks")

    monkeypatch.setattr(CpuStep, "_blocks_and_head", broken)
    with caplog.at_level(logging.WARNING, logger="lockstep.core.fastpath"):
        got, _ = Engine(model, tok, cpu_step=True).generate_batch(prompt, max_tokens=12, temperature=0.0,
                                                                  use_tools=False)
    assert got == want  # what the failed step wrote into the cache was overwritten, its position unchanged
    facts = fastpath.facts()["cpu_decode_step"]
    assert facts["path"] == "reference" and "a kernel this CPU lacks" in facts["fell_back"]
    assert facts["results"] == "reference"
    assert "cpu_decode_step" in caplog.text


def test_packed_head_equals_f_linear_and_is_skipped_without_its_ops(monkeypatch):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g)
    for rows in (1, 3, 8):
        x = torch.randn(rows, 64, generator=g)
        head = packed_head(w, torch.float32)
        if head is not None:  # a torch build with oneDNN (and MKL): x86 wheels
            assert torch.allclose(head(x), F.linear(x, w), atol=1e-5)
        head16 = packed_head(w, torch.bfloat16)
        if head16 is not None:
            assert torch.allclose(head16(x.bfloat16()).float(), F.linear(x.bfloat16(), w.bfloat16()).float(),
                                  atol=1e-2)

    def missing(*args):
        raise RuntimeError("mkldnn is not built into this torch")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", missing)
    assert packed_head(w, torch.float32) is None
    model = model_of(seed=7)
    assert step_against_forward(model, [[1, 2, 3]]) < 1e-4  # on F.linear's head instead
    assert cpu_step_module.packed_head(model.lm_head.weight, torch.float32) is None


def test_cpu_step_is_refused_where_it_cannot_run(tok):
    model = model_of()
    with pytest.raises(ValueError, match="cpu_step decodes on the reference path"):
        Engine(model, tok, fast=True, cpu_step=True)
    with pytest.raises(TypeError, match="lockstep GPT"):
        CpuStep(torch.nn.Linear(2, 2))
    # what the stages ask for: on the CPU with kernels on, and never on CUDA
    assert decode_settings(torch.device("cpu"), torch.float32, True)["cpu_step"]
    assert not decode_settings(torch.device("cpu"), torch.float32, False)["cpu_step"]
    assert not decode_settings(torch.device("cuda", 0), torch.bfloat16, True)["cpu_step"]
