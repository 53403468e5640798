"""The static-cache decode path (lockstep.infer.decode, `Engine(fast=True)`) against the reference engine
on tiny CPU models: greedy tokens equal token for token in fp32 (one row and several, rows that
stop at different times, the calculator's forced tokens, many prompts sharing a batch); sampled
tokens equal for the same seed (the device-side draw is the exponential race torch.multinomial
runs, so a CPU generator gives the same ids); bf16 within a stated tolerance; the static cache
against full forwards; the CUDA-graph wrapper's logic on the CPU through a stand-in backend
(warm-up undone, buffers reused, replays in place, a capture that fails leaving the step
uncaptured), refusing a CPU device with the real one, and its generator registration against
stand-ins for torch's graph API of each era; and the compiled step (compile_step) against the
uncompiled one and the reference engine, compiled once per step and never again, its cache
written in place, and falling back to the eager step with the eager step's tokens when its
compile or a compiled part fails; and generate_many building a bounded set of steps (and
compiles) for any number of prompts."""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import re
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from _tiny_model import randomize, tiny_gpt
from lockstep.core import fastpath
from lockstep.infer import decode, engine as engine_module
from lockstep.infer.decode import (
    Sampling,
    StaticKVCache,
    StaticStep,
    cache_tokens,
    capture_graph,
    compile_step,
    isolated_recompiles,
    sample_on_device,
)
from lockstep.infer.engine import Engine, KVCache, decode_settings, sample_next
from lockstep.model.gpt import GPT
from test_engine import Planted, random_model


@pytest.fixture(params=[False, True], ids=["default", "deterministic"])
def determinism(request):
    """Both modes: deterministic mode fills uninitialised memory with NaN, so a step that reads a
    slot nobody wrote shows up as NaN."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(request.param)
    yield request.param
    torch.use_deterministic_algorithms(before)


def talkative_tool_model(tok, seed: int = 7) -> Planted:
    """A random GPT with planted bigrams: "?" opens a call to 7*6 (the engine must force "42"),
    and after any of a dozen common bytes the reply ends, so sampled rows stop at different
    times."""
    sp, o = tok.encode_special, ord
    plants = {o("?"): sp("<|python_start|>"), sp("<|python_start|>"): o("7"), o("7"): o("*"), o("*"): o("6"),
              o("6"): sp("<|python_end|>"), o("."): sp("<|assistant_end|>")}
    plants.update({o(c): sp("<|assistant_end|>") for c in "aeiounst!,;:"})
    return Planted(random_model(seed), plants).eval()


def fastpath_warnings(caplog) -> list[str]:
    """The warnings lockstep.core.fastpath logged: one per fast path that fell back."""
    return [r.getMessage() for r in caplog.records if r.name == "lockstep.core.fastpath"]


# -- greedy and sampled tokens against the reference engine --------------------------------------


@pytest.mark.parametrize("n_kv_head", [2, 4])
@pytest.mark.parametrize("num_samples", [1, 3])
def test_static_cache_greedy_equals_reference(tok, n_kv_head, num_samples):
    model = random_model(n_kv_head=n_kv_head)
    prompt = tok.encode("hello there")
    kw = dict(num_samples=num_samples, max_tokens=30, temperature=0.0, use_tools=False)
    ref = Engine(model, tok).generate_batch(prompt, **kw)
    fast = Engine(model, tok, fast=True).generate_batch(prompt, **kw)
    assert fast == ref
    assert len(ref[0][0]) == 30  # a long decode, not an early stop


@pytest.mark.parametrize("temperature,top_k,top_p",
                         [(1.0, None, None), (0.7, 20, None), (1.3, None, 0.8), (1.0, 5, 0.5)])
def test_static_cache_sampled_equals_reference_for_the_same_seed(tok, temperature, top_k, top_p):
    model = talkative_tool_model(tok)
    ref, fast = Engine(model, tok), Engine(model, tok, fast=True)
    prompt = tok.encode("how much?")
    for seed in (0, 1):
        want = ref.generate_batch(prompt, num_samples=4, max_tokens=40, temperature=temperature, top_k=top_k,
                                  top_p=top_p, seed=seed)
        assert fast.generate_batch(prompt, num_samples=4, max_tokens=40, temperature=temperature, top_k=top_k,
                                   top_p=top_p, seed=seed) == want
    assert len({tuple(r) for r in want[0]}) > 1  # the rows differ: the draws were compared


def test_static_cache_rows_stopping_at_different_times_with_the_calculator(tok, determinism):
    model = talkative_tool_model(tok)
    ref, fast = Engine(model, tok), Engine(model, tok, fast=True)
    sp = tok.encode_special
    forced = [sp("<|output_start|>"), *tok.encode("42"), sp("<|output_end|>")]
    seen_tool = seen_ragged = False
    for seed in range(4):
        want = ref.generate_batch(tok.encode("why?"), num_samples=5, max_tokens=40, temperature=1.0, seed=seed)
        assert fast.generate_batch(tok.encode("why?"), num_samples=5, max_tokens=40, temperature=1.0, seed=seed) == want
        # the same, step by step: columns and masks as generate yields them
        assert list(fast.generate(tok.encode("why?"), num_samples=5, max_tokens=40, temperature=1.0, seed=seed)) == \
            list(ref.generate(tok.encode("why?"), num_samples=5, max_tokens=40, temperature=1.0, seed=seed))
        seqs, masks = want
        seen_tool |= any(s[i : i + len(forced)] == forced for s in seqs for i in range(len(s)))
        seen_ragged |= len({len(s) for s in seqs}) > 1 and any(s[-1] in ref.stop_ids for s in seqs)
        assert all(0 in m for m, s in zip(masks, seqs) if any(s[i : i + len(forced)] == forced for i in range(len(s))))
    assert seen_tool and seen_ragged


def test_static_cache_generate_many_sampled(tok, determinism):
    """Sampled generate_many on the fast path: one prompt in one row draws what the reference
    draws from the same seed; many prompts together are seeded, and top_k=1 is greedy."""
    model = talkative_tool_model(tok)
    ref, fast = Engine(model, tok), Engine(model, tok, fast=True)
    for seed, text in enumerate(("how much?", "q", "why?", "tell me more")):
        prompt = tok.encode(text)
        assert fast.generate_many([prompt], max_tokens=30, batch_rows=1, temperature=1.0, seed=seed) == \
            ref.generate_many([prompt], max_tokens=30, batch_rows=1, temperature=1.0, seed=seed), text
    prompts = [tok.encode(t) for t in ("how much?", "q", "tell me more", "x")] * 3
    a = fast.generate_many(prompts, max_tokens=20, batch_rows=5, temperature=1.0, seed=3)
    assert fast.generate_many(prompts, max_tokens=20, batch_rows=5, temperature=1.0, seed=3) == a
    assert len({tuple(r) for r in a[0][::4]}) > 1
    assert fast.generate_many(prompts, max_tokens=20, batch_rows=5, temperature=1.0, top_k=1, seed=3)[0] == \
        ref.generate_greedy(prompts, max_tokens=20, batch_rows=5)


def test_static_cache_generate_greedy_equals_reference(tok, determinism):
    model = talkative_tool_model(tok)
    ref, fast = Engine(model, tok), Engine(model, tok, fast=True)
    texts = ["how much?", "q", "stop here.", "a longer prompt that runs on and on?", "x", "why?", "tell me more",
             "z" * 50]
    prompts = [tok.encode(t) for t in texts]
    budgets = [30, 12, 9, 20, 40, 3, 25, 14]  # the last prompt fills the 64-token context exactly
    want = ref.generate_greedy(prompts, max_tokens=budgets, batch_rows=3)
    for batch_rows in (1, 3, 8, 16):
        assert fast.generate_greedy(prompts, max_tokens=budgets, batch_rows=batch_rows) == want, batch_rows
    assert fast.generate_greedy(prompts, max_tokens=budgets, batch_rows=3, use_tools=False) == \
        ref.generate_greedy(prompts, max_tokens=budgets, batch_rows=3, use_tools=False)
    # What the comparison covered: a tool answered, a stop on the first token, replies cut by
    # their budgets and replies that stop before them.
    sp = tok.encode_special
    forced = [sp("<|output_start|>"), *tok.encode("42"), sp("<|output_end|>")]
    assert any(r[i : i + len(forced)] == forced for r in want for i in range(len(r)))
    assert want[2] == [sp("<|assistant_end|>")]
    assert any(len(r) == m for r, m in zip(want, budgets)) and any(len(r) < m for r, m in zip(want, budgets))


def test_static_cache_device_sampler_equals_sample_next():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 4  # (B, V)
    for temperature, top_k, top_p in [(1.0, None, None), (0.5, 7, None), (1.7, None, 0.3), (1.0, 299, 0.999)]:
        a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        for _ in range(20):
            want = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=a)
            got = sample_on_device(logits, top_k=top_k, temperature=torch.tensor(temperature), generator=b,
                                   top_p=None if top_p is None else torch.tensor(top_p))
            assert torch.equal(got, want)
        assert torch.equal(a.get_state(), b.get_state())  # the same numbers drawn, no more


# -- bf16 ------------------------------------------------------------------------------------------

# Largest |logit| difference allowed between the static path in bf16 and the fp32 reference, on
# these random models (scale-0.5 weights put logits near 9 of the cap's 15; bf16 keeps 8 bits, so
# one rounding is ~0.035 there): measured 0.15-0.20 over four seeds. Against the reference engine
# in bf16 the static path measured 0.000 (the same ops on the same values); allowed 0.02.
BF16_LOGIT_ATOL = 0.3
BF16_VS_BF16_ATOL = 0.02


def bf16_copy(model: GPT) -> GPT:
    twin = tiny_gpt(**{k: getattr(model.config, k) for k in ("n_layer", "n_head", "n_kv_head")})
    twin.load_state_dict(model.state_dict())
    for p in twin.parameters():
        p.data = p.data.to(torch.bfloat16)
    return twin.eval()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_static_cache_bf16_within_tolerance(tok, seed):
    m32 = random_model(seed)
    m16 = bf16_copy(m32)
    prompt = tok.encode("hello there")
    ref32 = Engine(m32, tok).generate_batch(prompt, max_tokens=40, temperature=0.0, use_tools=False)[0][0]
    seq = prompt + ref32
    with torch.no_grad():
        full32 = m32(torch.tensor([seq]))[0, :-1]  # (T - 1, V): logits after each prefix
        full16 = m16(torch.tensor([seq]))[0, :-1].float()
        cache = StaticKVCache.for_model(m16, 2, 64)  # two rows fed the same tokens, teacher-forced
        steps = torch.stack([m16(torch.tensor([[t], [t]]), kv_cache=cache)[0, -1] for t in seq[:-1]]).float()
    assert (steps - full32).abs().max() <= BF16_LOGIT_ATOL
    assert (steps - full16).abs().max() <= BF16_VS_BF16_ATOL
    # Tokens: equal to fp32's until a near tie, where rounding within the tolerance may pick the other.
    fast16 = Engine(m16, tok, fast=True).generate_batch(prompt, max_tokens=40, temperature=0.0, use_tools=False)[0][0]
    first = next((i for i, (a, b) in enumerate(zip(fast16, ref32)) if a != b), None)
    if first is not None:
        top2 = full32[len(prompt) - 1 + first].topk(2).values
        assert top2[0] - top2[1] <= 2 * BF16_LOGIT_ATOL, (first, top2)


def test_static_cache_decodes_an_fp32_model_in_bf16_with_its_latest_weights(tok):
    model = random_model(3)
    engine = Engine(model, tok, fast=True, dtype=torch.bfloat16)
    prompt = tok.encode("abc")
    first = engine.generate_batch(prompt, max_tokens=20, temperature=0.0, use_tools=False)
    assert first == Engine(bf16_copy(model), tok, fast=True).generate_batch(prompt, max_tokens=20, temperature=0.0,
                                                                           use_tools=False)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the model itself is left alone
    randomize(model, seed=77, scale=0.5)  # new weights in place, as an RL update leaves them
    again = engine.generate_batch(prompt, max_tokens=20, temperature=0.0, use_tools=False)
    assert again == Engine(bf16_copy(model), tok, fast=True).generate_batch(prompt, max_tokens=20, temperature=0.0,
                                                                           use_tools=False)
    assert again != first
    # the reference path honours the dtype too: autocast, the model's weights stay fp32
    ref = Engine(model, tok, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = Engine(model, tok).generate_batch(prompt, max_tokens=20, temperature=0.0, use_tools=False)
    assert ref.generate_batch(prompt, max_tokens=20, temperature=0.0, use_tools=False) == want


def test_static_cache_cpu_heads_follow_the_weights_and_give_the_reference_tokens(tok):
    model = random_model(4)
    assert isinstance(decode.cpu_decode_head(model, 1), decode.TransposedHead)  # fp32, one row
    assert decode.cpu_decode_head(model, 3) is None  # fp32 rows: the model's own head
    bf16 = bf16_copy(model)
    assert decode.cpu_decode_head(bf16, 3) is F.linear and decode.cpu_decode_head(bf16, 1) is None
    engine = Engine(model, tok, fast=True)
    prompt = tok.encode("hello")
    kw = dict(max_tokens=30, temperature=0.0, use_tools=False)
    first = engine.generate_batch(prompt, **kw)
    assert first == Engine(model, tok).generate_batch(prompt, **kw)
    randomize(model, seed=78, scale=0.5)  # new weights in place: the step's transposed head is copied again
    again = engine.generate_batch(prompt, **kw)
    assert again == Engine(model, tok).generate_batch(prompt, **kw) and again != first
    fast_bf16 = Engine(bf16, tok, fast=True).generate_batch(prompt, num_samples=3, **kw)  # F.linear's head
    ref_bf16 = Engine(bf16, tok).generate_batch(prompt, num_samples=3, **kw)
    assert sum(a == b for a, b in zip(fast_bf16[0][0], ref_bf16[0][0])) >= 20  # bf16: equal to rounding


# -- the static cache itself ------------------------------------------------------------------------


def test_static_cache_eager_cpu_step_attends_over_the_positions_reached():
    model = random_model(2)
    cache = StaticKVCache.for_model(model, 2, 64)
    k = torch.zeros(2, model.config.n_kv_head, 1, model.config.head_dim)
    cache.pos.copy_(torch.tensor([3, 6]))
    keys, values, mask = cache.update(0, k, k)
    assert keys.shape[2] == values.shape[2] == mask.shape[-1] == decode.ATTEND_STEP_TOKENS == 32
    assert mask[0, 0, 0, :4].eq(0).all() and mask[0, 0, 0, 4:].eq(float("-inf")).all()
    cache.pos.copy_(torch.tensor([3, 40]))  # one row past the first 32 positions: the whole buffer
    keys, values, mask = cache.update(0, k, k)
    assert keys is cache.keys[0] and values is cache.values[0] and mask.shape[-1] == 64


@pytest.mark.parametrize("max_len", [32, 64], ids=["whole-buffer", "first-positions"])
def test_static_cache_rows_at_their_own_positions_equal_full_forward(determinism, max_len):
    model = random_model(2)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [20]]
    cache = StaticKVCache.for_model(model, 3, max_len)
    with torch.no_grad():
        seqs = []
        for row, p in enumerate(prompts):
            head = KVCache.for_model(model, 1)
            if len(p) > 1:
                model(torch.tensor([p[:-1]]), kv_cache=head)
            cache.put_row(row, head)
            seqs.append(list(p))
        assert cache.pos.tolist() == [3, 6, 0]
        nxt = torch.tensor([[p[-1]] for p in prompts])  # (B, 1)
        for _ in range(6):
            logits = model(nxt, kv_cache=cache)[:, -1]  # (B, V)
            for row, s in enumerate(seqs):
                torch.testing.assert_close(logits[row], model(torch.tensor([s]))[0, -1], rtol=1e-4, atol=1e-4)
            nxt = logits.argmax(-1, keepdim=True)
            for s, t in zip(seqs, nxt[:, 0].tolist()):
                s.append(t)
    assert cache.pos.tolist() == [9, 12, 6]


def test_static_cache_positions_stop_at_the_end_of_the_buffer():
    model = random_model(2)
    cache = StaticKVCache.for_model(model, 2, 8)
    with torch.no_grad():
        for _ in range(12):  # past the buffer: a finished row decoding on must stay inside it
            logits = model(torch.tensor([[1], [2]]), kv_cache=cache)
    assert cache.pos.tolist() == [7, 7] and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="past the model's context of 64"):
        StaticKVCache.for_model(model, 1, 65)


def test_static_cache_lengths():
    assert cache_tokens(10, 2048) == 256 and cache_tokens(256, 2048) == 256 and cache_tokens(257, 2048) == 512
    assert cache_tokens(2000, 2048) == 2048 and cache_tokens(60, 64) == 64
    with pytest.raises(ValueError, match="does not fit the model's context of 64"):
        cache_tokens(65, 64)


# -- the CUDA-graph wrapper, on the CPU ------------------------------------------------------------


class StandInGraphs:
    """The GraphBackend of capture_graph without a GPU: warm-up runs the step eagerly, and a
    'replay' runs the step captured, counting both, so the wrapper's logic runs on the CPU."""

    def __init__(self):
        self.warmups = self.captures = self.replays = 0
        self.generators = []  # what each capture was given to register

    def check(self, device):
        pass

    def warm_up(self, fn, steps, device):
        for _ in range(steps):
            fn()
            self.warmups += 1

    def capture(self, fn, generator, device):
        self.captures += 1
        self.generators.append(generator)

        def replay():
            self.replays += 1
            fn()

        return replay


def test_static_cache_graph_runner_refuses_the_cpu(tok):
    model = random_model(0)
    step = StaticStep(model, StaticKVCache.for_model(model, 1, 16), Sampling(greedy=True))
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device, it is on cpu"):
        capture_graph(step)
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        Engine(model, tok, fast=True, cuda_graphs=True)
    for off_the_fast_path in ({"cuda_graphs": False}, {"compile_step": True}):
        with pytest.raises(ValueError, match="pass fast=True"):
            Engine(model, tok, **off_the_fast_path)
    assert not Engine(model, tok, fast=True).cuda_graphs  # auto: eager static steps on the CPU


def test_static_cache_graph_wrapper_undoes_warm_up_and_replays_in_place():
    model = random_model(4)
    twins = []
    for _ in range(2):
        cache = StaticKVCache.for_model(model, 2, 16)
        head = KVCache.for_model(model, 1)
        with torch.no_grad():
            model(torch.tensor([[3, 4, 5]]), kv_cache=head)
        cache.put_rows(range(2), head)
        step = StaticStep(model, cache, Sampling.of(1.0, 10, None))
        step.tokens.fill_(6)
        twins.append(step)
    eager, graphed = twins
    backend = StandInGraphs()
    with torch.inference_mode():
        capture_graph(graphed, backend=backend, warmup_steps=3)
    assert backend.warmups == 3 and backend.captures == 1
    assert graphed.cache.pos.tolist() == [3, 3] and graphed.tokens.tolist() == [[6], [6]]  # warm-up undone
    buffers = [graphed.tokens, graphed.next_ids, *graphed.cache.keys, *graphed.cache.values, graphed.cache.pos,
               graphed.temperature]
    ptrs = [b.data_ptr() for b in buffers]
    with torch.inference_mode():
        for s in twins:
            s.set_sampling(Sampling.of(1.0, 10, None), seed=3)
        for _ in range(5):
            eager()
            graphed()
            assert torch.equal(graphed.next_ids, eager.next_ids)
    assert backend.replays == 5
    assert [b.data_ptr() for b in buffers] == ptrs  # the same buffers, written in place
    assert graphed.cache.pos.tolist() == [8, 8]


def test_static_cache_engine_through_the_graph_wrapper_equals_reference(tok, monkeypatch):
    """The whole fast engine with every step 'captured' by the stand-in: warm-ups at capture
    time must leave no trace in any reply."""
    backend = StandInGraphs()
    monkeypatch.setattr(engine_module, "capture_graph", functools.partial(capture_graph, backend=backend))
    model = talkative_tool_model(tok)
    ref, fast = Engine(model, tok), Engine(model, tok, fast=True)
    fast.cuda_graphs = True  # what a CUDA model gets; the stand-in replays eagerly on the CPU
    prompts = [tok.encode(t) for t in ["how much?", "q", "why?", "tell me more"]]
    assert fast.generate_greedy(prompts, max_tokens=20, batch_rows=2) == \
        ref.generate_greedy(prompts, max_tokens=20, batch_rows=2)
    for seed in (0, 1):
        assert fast.generate_batch(prompts[0], num_samples=3, max_tokens=30, temperature=0.9, top_k=40, seed=seed) == \
            ref.generate_batch(prompts[0], num_samples=3, max_tokens=30, temperature=0.9, top_k=40, seed=seed)
    assert backend.captures == fast._pool.built == 2 and backend.replays > 40
    # the greedy step draws nothing, so it has no generator to register; the sampled one has its own
    sampled = fast._pool.acquire(3, 64, Sampling.of(0.9, 40, None))
    assert backend.generators == [None, sampled.generator]


class FailingGraphs(StandInGraphs):
    """A backend whose capture fails after its warm-up: by default as one would on an op that
    syncs with the host; given `error`, with that (a torch whose graph API moved raises
    AttributeError)."""

    def __init__(self, error: Exception | None = None):
        super().__init__()
        self.error = error or RuntimeError("operation not permitted when stream is capturing")

    def capture(self, fn, generator, device):
        raise self.error


CAPTURE_ERRORS = [RuntimeError("operation not permitted when stream is capturing"),
                  AttributeError("'CUDAGraph' object has no attribute 'register_generator_state'")]


@pytest.mark.parametrize("error", CAPTURE_ERRORS, ids=["op_not_capturable", "api_gone"])
def test_static_cache_decodes_uncaptured_when_capture_fails(tok, monkeypatch, caplog, error):
    graphs = FailingGraphs(error)
    monkeypatch.setattr(engine_module, "capture_graph", functools.partial(capture_graph, backend=graphs))
    model = talkative_tool_model(tok)
    ref, fast = Engine(model, tok), Engine(model, tok, fast=True)
    fast.cuda_graphs = True
    prompts = [tok.encode(t) for t in ["how much?", "q", "why?", "tell me more"]]
    with caplog.at_level("WARNING", logger="lockstep.core.fastpath"):
        assert fast.generate_greedy(prompts, max_tokens=20, batch_rows=2) == \
            ref.generate_greedy(prompts, max_tokens=20, batch_rows=2)
        kw = dict(num_samples=3, max_tokens=30, temperature=0.9, top_k=40, seed=1)
        assert fast.generate_batch(prompts[0], **kw) == ref.generate_batch(prompts[0], **kw)
    assert fastpath.facts()["cuda_graphs"] == {
        "path": "reference", "fast_calls": 0, "reference_calls": fast._pool.built, "compiles": 0, "compile_s": 0.0,
        "fell_back": f"{type(error).__name__}: {error}", "results": "reference"}
    assert fast._pool.built == 2 and graphs.warmups == decode.GRAPH_WARMUP_STEPS  # one capture tried, no more
    assert len(fastpath_warnings(caplog)) == 1 and "cuda_graphs" in fastpath_warnings(caplog)[0]


def test_static_cache_failed_capture_leaves_the_step_as_it_was():
    model = random_model(4)
    sampling = Sampling.of(1.0, 10, None)
    step, twin = prefilled_step(model, sampling, rows=2), prefilled_step(model, sampling, rows=2)
    with torch.inference_mode(), pytest.raises(AttributeError, match="register_generator_state"):
        capture_graph(step, backend=FailingGraphs(CAPTURE_ERRORS[1]), warmup_steps=3)
    assert step.replay is None and not decode._CAPTURE_LOCK.locked()
    assert step.cache.pos.tolist() == [3, 3] and step.tokens.tolist() == [[6], [6]]  # the warm-up undone
    run_beside(step, twin, 4, seed=4)


class GraphWithoutRegistration:
    """torch.cuda.CUDAGraph of a torch without register_generator_state (generators register with
    a capture at their first draw): what CudaGraphs.capture touches of it, on the CPU."""

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


class GraphWithRegistration(GraphWithoutRegistration):
    """torch 2.3 to 2.13: a capture draws only from the generators registered with it."""

    registered: list = []

    def register_generator_state(self, generator):
        self.registered.append(generator)


class GraphWithMarkedDeprecation(GraphWithRegistration):
    """A torch that marks the call deprecated the PEP 702 way (`__deprecated__`, as
    warnings.deprecated does)."""

    def register_generator_state(self, generator):
        super().register_generator_state(generator)

    register_generator_state.__deprecated__ = "generators register at their first use during capture"


class GraphWithDeprecatedRegistration(GraphWithRegistration):
    """torch 2.14: the call is a no-op that warns of its deprecation at every call."""

    def register_generator_state(self, generator):
        super().register_generator_state(generator)
        warnings.warn("CUDAGraph.register_generator_state is deprecated: generators register at their first use "
                      "during capture", FutureWarning, stacklevel=2)


@pytest.fixture
def cpu_cuda_graphs(monkeypatch):
    """torch.cuda's graph API stood in on the CPU for CudaGraphs.capture: `use(graph_class)` makes
    torch.cuda.CUDAGraph build that class; torch.cuda.graph runs the captured function as the
    capture does, once. Returns `use` and the graphs made."""
    made = []

    def use(graph_class):
        def make():
            made.append(graph_class())
            return made[-1]

        monkeypatch.setattr(graph_class, "registered", [], raising=False)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", make)

    monkeypatch.setattr(torch.cuda, "graph", lambda graph, **kw: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(decode.CudaGraphs, "registration_deprecated", False)  # restored after the test
    return use, made


def test_static_cache_capture_registers_the_generator_where_torch_has_the_call(cpu_cuda_graphs, caplog):
    use, made = cpu_cuda_graphs
    generator, runs = torch.Generator(), []
    graphs = decode.CudaGraphs()
    # a torch without the call: the capture proceeds
    use(GraphWithoutRegistration)
    replay = graphs.capture(lambda: runs.append(1), generator, torch.device("cpu"))
    assert runs == [1] and replay == made[-1].replay
    replay()
    assert made[-1].replays == 1
    # a torch that needs it: every sampled step's capture registers its generator; a greedy one has none
    use(GraphWithRegistration)
    graphs.capture(lambda: None, generator, torch.device("cpu"))
    graphs.capture(lambda: None, generator, torch.device("cpu"))
    graphs.capture(lambda: None, None, torch.device("cpu"))
    assert GraphWithRegistration.registered == [generator, generator]
    # a torch that marks it deprecated: not called
    use(GraphWithMarkedDeprecation)
    graphs.capture(lambda: None, generator, torch.device("cpu"))
    assert GraphWithMarkedDeprecation.registered == []
    # a torch where it warns of its deprecation: called once, its warning logged once, then no more calls
    use(GraphWithDeprecatedRegistration)
    with warnings.catch_warnings(record=True) as shown, caplog.at_level("INFO", logger="lockstep.infer.decode"):
        warnings.simplefilter("always")
        for _ in range(3):
            graphs.capture(lambda: None, generator, torch.device("cpu"))
    assert GraphWithDeprecatedRegistration.registered == [generator]
    assert not [w for w in shown if issubclass(w.category, FutureWarning)]
    assert [r.getMessage() for r in caplog.records if "register_generator_state is deprecated" in r.getMessage()] \
        and len(caplog.records) == 1
    assert len(made) == 8


def test_static_cache_steps_are_reused_across_calls_and_never_shared(tok):
    model = random_model(1)
    engine = Engine(model, tok, fast=True)
    prompt = tok.encode("abc")
    one = engine.generate_batch(prompt, num_samples=2, max_tokens=10, temperature=0.0, use_tools=False)
    step = engine._pool.acquire(2, 64, Sampling(greedy=True))
    kv_ptr = step.cache.keys[0].data_ptr()
    engine._pool.release(step)
    assert engine.generate_batch(prompt, num_samples=2, max_tokens=10, temperature=0.0, use_tools=False) == one
    assert engine._pool.built == 1  # the second call took the first call's step: nothing allocated
    again = engine._pool.acquire(2, 64, Sampling(greedy=True))
    assert again is step and again.cache.keys[0].data_ptr() == kv_ptr
    engine._pool.release(again)
    # two requests in flight at once (the server's workers) each get their own step
    a = engine.generate(prompt, num_samples=2, max_tokens=10, temperature=0.0, use_tools=False)
    b = engine.generate(tok.encode("xyz"), num_samples=2, max_tokens=10, temperature=0.0, use_tools=False)
    cols_a, cols_b = [], []
    for col_a, col_b in zip(a, b):
        cols_a.append(col_a[0])
        cols_b.append(col_b[0])
    assert engine._pool.built == 2
    ref = Engine(model, tok)
    kw = dict(num_samples=2, max_tokens=10, temperature=0.0, use_tools=False)
    assert cols_a == [c for c, _ in ref.generate(prompt, **kw)]
    assert cols_b == [c for c, _ in ref.generate(tok.encode("xyz"), **kw)]


def test_static_cache_is_on_for_cuda_with_kernels_only():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    off = {"compile_step": False, "cpu_step": False}
    assert decode_settings(cuda, torch.bfloat16, True) == {"fast": True, "dtype": torch.bfloat16, **off}
    assert decode_settings(cuda, torch.float32, True) == {"fast": True, "dtype": None, **off}
    assert decode_settings(cuda, torch.bfloat16, False) == {"fast": False, "dtype": torch.bfloat16, **off}
    # the step compiles where the runtime compiles (runtime.compile), on the fast path only
    assert decode_settings(cuda, torch.bfloat16, True, compile=True)["compile_step"]
    assert not decode_settings(cuda, torch.bfloat16, False, compile=True)["compile_step"]
    # the CPU keeps the reference path in the model's dtype, whatever the runtime says, its decode
    # step lockstep.infer.cpu_step's where kernels are on (tests/test_cpu_step.py)
    assert decode_settings(cpu, torch.bfloat16, True, compile=True) == {"fast": False, "dtype": None,
                                                                        "compile_step": False, "cpu_step": True}
    assert decode_settings(cpu, torch.bfloat16, False) == {"fast": False, "dtype": None, **off}
    assert decode.MIN_CACHE_TOKENS == 256


# -- the compiled step (compile_step), on the CPU --------------------------------------------------
# aot_eager: dynamo's tracing and AOT autograd's functionalized graph (what inductor compiles),
# run by eager kernels, so the numbers are the eager step's and the comparisons exact; inductor's
# own C++ build is the slow test below.


def counting_aot_eager() -> CompileCounterWithBackend:
    """A backend that compiles as aot_eager and counts the graphs it is handed (one per compile)."""
    return CompileCounterWithBackend("aot_eager")


def prefilled_step(model, sampling: Sampling, prompt=(3, 4, 5), rows: int = 3) -> StaticStep:
    cache = StaticKVCache.for_model(model, rows, 32)
    head = KVCache.for_model(model, 1)
    with torch.inference_mode():
        model(torch.tensor([list(prompt)]), kv_cache=head)
    cache.put_rows(range(rows), head)
    step = StaticStep(model, cache, sampling)
    step.tokens.fill_(6)
    return step


def run_beside(step: StaticStep, twin: StaticStep, steps: int, seed: int = 0) -> None:
    """Run `step` and its plain eager `twin` `steps` times from the same seed, asserting after each
    that their picks, inputs and positions are equal."""
    with torch.inference_mode():
        for s in (step, twin):
            s.set_sampling(twin.sampling, seed=seed)
        for i in range(steps):
            step()
            twin()
            assert torch.equal(step.next_ids, twin.next_ids) and torch.equal(step.tokens, twin.tokens), i
            assert torch.equal(step.cache.pos, twin.cache.pos), i


@pytest.mark.parametrize("sampling", [Sampling(greedy=True), Sampling.of(1.0, None, None), Sampling.of(0.8, 20, 0.9)],
                         ids=["greedy", "plain", "top_k_top_p"])
def test_static_cache_compiled_step_equals_eager_step(sampling):
    model = random_model(5)
    eager, compiled = prefilled_step(model, sampling), prefilled_step(model, sampling)
    backend = counting_aot_eager()
    compile_step(compiled, backend=backend)
    ptrs = [b.data_ptr() for b in (*compiled.cache.keys, *compiled.cache.values, compiled.cache.pos)]
    # two requests in turn on the step: a new temperature, top_p and seed are values, not shapes
    k, p = sampling.top_k, sampling.top_p
    requests = [sampling] * 2 if sampling.greedy else [Sampling.of(0.7, k, p), Sampling.of(1.3, k, p and p - 0.2)]
    picks = []
    with torch.inference_mode():
        for seed, request in enumerate(requests):
            for s in (eager, compiled):
                s.set_sampling(request, seed=seed)
            for i in range(10):
                eager()
                compiled()
                assert torch.equal(compiled.next_ids, eager.next_ids), (seed, i)
                picks.append(compiled.next_ids.tolist())
    assert all(torch.equal(a, b) for a, b in zip(compiled.cache.keys + compiled.cache.values,
                                                   eager.cache.keys + eager.cache.values))
    assert torch.equal(compiled.cache.pos, eager.cache.pos) and compiled.cache.pos.tolist() == [23] * 3
    assert [b.data_ptr() for b in (*compiled.cache.keys, *compiled.cache.values, compiled.cache.pos)] == ptrs
    assert sampling.greedy or any(len(set(row)) > 1 for row in picks)  # the rows drew differently: draws compared
    # one graph per compiled part the step runs, made once: nothing recompiled across 20 tokens and
    # two requests (greedy: the step is one part; sampled: candidates and race, around the draw)
    assert backend.frame_count == (1 if sampling.greedy else 2)


def test_static_cache_compiled_step_comes_before_the_graph():
    model = random_model(0)
    step = prefilled_step(model, Sampling(greedy=True))
    with torch.inference_mode():
        capture_graph(step, backend=StandInGraphs(), warmup_steps=1)
    with pytest.raises(ValueError, match="compile_step must come before capture_graph"):
        compile_step(step, backend="aot_eager")


def test_static_cache_compile_step_on_a_torch_without_isolate_recompiles(monkeypatch, caplog):
    # torch 2.11's torch.compile has no isolate_recompiles keyword: the step compiles without it
    # (and says so) rather than failing with a TypeError at the first fast decode
    real = torch.compile
    seen = []

    def compile_2_11(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                     disable=False):
        seen.append(backend)
        return real(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode, options=options,
                    disable=disable)

    monkeypatch.setattr(torch, "compile", compile_2_11)
    isolated_recompiles.cache_clear()
    try:
        assert isolated_recompiles() == {}
        assert "has no isolate_recompiles" in caplog.text
        model = random_model(5)
        eager, compiled = prefilled_step(model, Sampling(greedy=True)), prefilled_step(model, Sampling(greedy=True))
        compile_step(compiled, backend="aot_eager")
        with torch.inference_mode():
            for _ in range(3):
                eager()
                compiled()
                assert torch.equal(compiled.next_ids, eager.next_ids)
        assert seen == ["aot_eager"] * 3  # the step's three parts
    finally:
        monkeypatch.undo()
        isolated_recompiles.cache_clear()
    assert isolated_recompiles() == {"isolate_recompiles": True}  # this torch has it


@pytest.fixture
def compiled_engines(monkeypatch):
    """Engines whose compile_step compiles through one counting aot_eager backend (returned)."""
    backend = counting_aot_eager()
    monkeypatch.setattr(engine_module, "compile_step", functools.partial(compile_step, backend=backend))
    return backend


def test_static_cache_compiled_engine_equals_reference_with_the_calculator(tok, compiled_engines):
    model = talkative_tool_model(tok)
    ref, eager = Engine(model, tok), Engine(model, tok, fast=True)
    compiled = Engine(model, tok, fast=True, compile_step=True)
    sp = tok.encode_special
    forced = [sp("<|output_start|>"), *tok.encode("42"), sp("<|output_end|>")]
    prompt = tok.encode("how much?")
    for num_samples in (1, 3):
        kw = dict(num_samples=num_samples, max_tokens=30, temperature=0.0)
        want = ref.generate_batch(prompt, **kw)
        assert compiled.generate_batch(prompt, **kw) == eager.generate_batch(prompt, **kw) == want
        assert all(any(s[i : i + len(forced)] == forced for i in range(len(s))) for s in want[0])  # the tool answered
    graphs = compiled_engines.frame_count
    assert graphs == compiled._pool.built == 2  # a greedy step of 1 row and one of 3: one graph each
    # the same shapes again, then sampled rows (the same seed draws the same ids as the reference)
    for num_samples in (1, 3):
        assert compiled.generate_batch(prompt, num_samples=num_samples, max_tokens=30, temperature=0.0) == \
            ref.generate_batch(prompt, num_samples=num_samples, max_tokens=30, temperature=0.0)
    assert compiled_engines.frame_count == graphs and compiled._pool.built == 2  # reused, not recompiled
    for seed in (0, 1):
        kw = dict(num_samples=3, max_tokens=30, temperature=0.9, top_k=40, seed=seed)
        assert compiled.generate_batch(prompt, **kw) == ref.generate_batch(prompt, **kw)
    assert compiled_engines.frame_count == graphs + 2  # the sampled step's two parts, compiled once for both seeds


def test_static_cache_compiled_engine_generate_greedy_equals_reference(tok, compiled_engines):
    model = talkative_tool_model(tok)
    prompts = [tok.encode(t) for t in ["how much?", "q", "stop here.", "why?", "tell me more"]]
    budgets = [30, 12, 9, 20, 25]
    want = Engine(model, tok).generate_greedy(prompts, max_tokens=budgets, batch_rows=3)
    compiled = Engine(model, tok, fast=True, compile_step=True)
    assert compiled.generate_greedy(prompts, max_tokens=budgets, batch_rows=3) == want
    assert compiled.generate_greedy(prompts, max_tokens=budgets, batch_rows=3) == want
    assert compiled_engines.frame_count == compiled._pool.built == 1  # one step, compiled once, both calls


def test_static_cache_compiled_engine_builds_a_bounded_set_of_steps_for_any_number_of_prompts(tok, compiled_engines):
    """generate_many over 1, 2, ..., 16 prompts at batch_rows=8, one cache length: the step rows are
    powers of two up to 8 (step_rows), so the engine builds and compiles 4 steps (1, 2, 4 and 8
    rows), where exact row counts built 8, and every reply is the reference engine's."""
    model = talkative_tool_model(tok)
    ref, compiled = Engine(model, tok), Engine(model, tok, fast=True, compile_step=True)
    texts = ["how much?", "q", "stop here.", "why?", "tell me more", "x", "a longer prompt, then?", "z" * 20,
             "abc", "so?", "what now", "hm.", "7", "more?", "end", "yes"]
    prompts = [tok.encode(t) for t in texts]
    budgets = [12, 6, 9, 20, 15, 3, 10, 8, 14, 7, 11, 5, 16, 9, 4, 13]
    for n in range(1, 17):
        assert compiled.generate_greedy(prompts[:n], max_tokens=budgets[:n], batch_rows=8) == \
            ref.generate_greedy(prompts[:n], max_tokens=budgets[:n], batch_rows=8), n
    assert compiled._pool.built == compiled_engines.frame_count == fastpath.facts()["decode_compiled"]["compiles"] == 4
    assert sorted(step.batch_size for step in compiled._pool._idle.values()) == [1, 2, 4, 8]


def test_static_cache_step_rows():
    assert [decode.step_rows(n, 8) for n in range(1, 17)] == [1, 2, 4, 4] + [8] * 12
    assert {decode.step_rows(n, 6) for n in range(1, 40)} == {1, 2, 4, 6}  # floor(log2 6) + 2 shapes
    with pytest.raises(ValueError, match="must be >= 1"):
        decode.step_rows(0, 8)


def test_static_cache_compiled_engine_through_the_graph_wrapper(tok, compiled_engines, monkeypatch):
    """Compile, then capture (the CUDA order): the compile happens in capture_graph's warm-up,
    whose moves are undone, and leaves no trace in any reply."""
    graphs = StandInGraphs()
    monkeypatch.setattr(engine_module, "capture_graph", functools.partial(capture_graph, backend=graphs))
    model = talkative_tool_model(tok)
    fast = Engine(model, tok, fast=True, compile_step=True)
    fast.cuda_graphs = True
    prompts = [tok.encode(t) for t in ["how much?", "q", "why?", "tell me more"]]
    assert fast.generate_greedy(prompts, max_tokens=20, batch_rows=2) == \
        Engine(model, tok).generate_greedy(prompts, max_tokens=20, batch_rows=2)
    assert graphs.captures == compiled_engines.frame_count == 1


class FailingAtGraph(CompileCounterWithBackend):
    """A backend that compiles as aot_eager, except that its `fail_at`-th graph (1-based) raises,
    as a compiler that cannot build some part of the step would."""

    def __init__(self, fail_at: int):
        super().__init__("aot_eager")
        self.fail_at = fail_at
        self.__name__ = "failing_at_graph"  # what dynamo names the backend in its error

    def __call__(self, gm, example_inputs):
        if self.frame_count + 1 == self.fail_at:
            raise RuntimeError(f"no code for graph {self.fail_at}")
        return super().__call__(gm, example_inputs)


def test_static_cache_compile_that_fails_falls_back_to_the_eager_step(tok, monkeypatch, caplog):
    """A step whose compile raises (a real torch.compile failure, in the backend) does not end the
    call: generate and generate_many finish with the reference engine's tokens, and the fallback is
    recorded once."""
    monkeypatch.setattr(engine_module, "compile_step", functools.partial(compile_step, backend=FailingAtGraph(1)))
    model = talkative_tool_model(tok)
    ref, compiled = Engine(model, tok), Engine(model, tok, fast=True, compile_step=True)
    prompt = tok.encode("how much?")
    prompts = [tok.encode(t) for t in ["how much?", "q", "stop here.", "why?", "tell me more"]]
    with caplog.at_level("WARNING", logger="lockstep.core.fastpath"):
        kw = dict(num_samples=3, max_tokens=30, temperature=0.0)
        assert compiled.generate_batch(prompt, **kw) == ref.generate_batch(prompt, **kw)
        assert compiled.generate_greedy(prompts, max_tokens=20, batch_rows=3) == \
            ref.generate_greedy(prompts, max_tokens=20, batch_rows=3)
        kw = dict(num_samples=3, max_tokens=30, temperature=0.9, top_k=40, seed=1)
        assert compiled.generate_batch(prompt, **kw) == ref.generate_batch(prompt, **kw)
    facts = fastpath.facts()["decode_compiled"]
    assert facts["path"] == "reference" and facts["results"] == "reference" and facts["fast_calls"] == 0
    assert facts["fell_back"] == \
        "BackendCompilerFailed: backend='failing_at_graph' raised <- RuntimeError: no code for graph 1"
    assert facts["reference_calls"] > 50  # every step after the first: the compile was not tried again
    assert len(fastpath_warnings(caplog)) == 1 and "decode_compiled" in fastpath_warnings(caplog)[0]


@pytest.mark.parametrize("sampling", [Sampling.of(1.0, None, None), Sampling.of(0.8, 20, 0.9)],
                         ids=["plain", "top_k_top_p"])
def test_static_cache_compiled_step_failing_after_a_part_ran_repeats_the_step_eagerly(tok, monkeypatch, sampling):
    """The sampled step's candidates compile and run (forward: the cache written, the positions
    advanced; the uniforms drawn), then the draw's compile fails: the eager step that answers
    starts from the same positions and input and draws with the same uniforms, so every token and
    position is the eager step's, and the generator has drawn once per step."""
    model = random_model(5)
    eager, compiled = prefilled_step(model, sampling), prefilled_step(model, sampling)
    compile_step(compiled, backend=FailingAtGraph(2))
    run_beside(compiled, eager, 6, seed=3)
    assert compiled.cache.pos.tolist() == [3 + 6] * 3
    assert torch.equal(compiled.generator.get_state(), eager.generator.get_state())
    assert fastpath.facts()["decode_compiled"]["fell_back"].startswith(
        "BackendCompilerFailed: backend='failing_at_graph' raised <- RuntimeError: no code for graph")
    # the whole engine, sampled: the same seed draws the reference's tokens
    monkeypatch.setattr(engine_module, "compile_step", functools.partial(compile_step, backend=FailingAtGraph(2)))
    fastpath.reset()
    talky = talkative_tool_model(tok)
    kw = dict(num_samples=4, max_tokens=30, temperature=1.0, top_k=sampling.top_k, top_p=sampling.top_p, seed=2)
    assert Engine(talky, tok, fast=True, compile_step=True).generate_batch(tok.encode("why?"), **kw) == \
        Engine(talky, tok).generate_batch(tok.encode("why?"), **kw)
    assert fastpath.facts()["decode_compiled"]["path"] == "reference"


class FailingAfterRunning(CompileCounterWithBackend):
    """A backend that compiles as aot_eager, but whose compiled code raises after it has run (the
    cache written, the positions advanced, the picks written into `tokens` and `next_ids`), as an
    error that a device reports after the step's kernels ran would."""

    def __init__(self):
        super().__init__("aot_eager")

    def __call__(self, gm, example_inputs):
        compiled = super().__call__(gm, example_inputs)

        def run_then_fail(*args):
            compiled(*args)
            raise RuntimeError("the device reported an error after the step ran")

        return run_then_fail


def test_static_cache_compiled_step_failing_after_it_ran_repeats_the_step_from_its_inputs(tok, monkeypatch):
    model = random_model(5)
    eager, compiled = prefilled_step(model, Sampling(greedy=True)), prefilled_step(model, Sampling(greedy=True))
    compile_step(compiled, backend=FailingAfterRunning())
    run_beside(compiled, eager, 6)
    assert compiled.cache.pos.tolist() == [3 + 6] * 3
    facts = fastpath.facts()["decode_compiled"]
    assert facts["fell_back"] == "RuntimeError: the device reported an error after the step ran"
    assert facts["results"] == "reference"
    monkeypatch.setattr(engine_module, "compile_step", functools.partial(compile_step, backend=FailingAfterRunning()))
    fastpath.reset()
    talky = talkative_tool_model(tok)
    prompts = [tok.encode(t) for t in ["how much?", "q", "why?", "tell me more"]]
    assert Engine(talky, tok, fast=True, compile_step=True).generate_greedy(prompts, max_tokens=20, batch_rows=2) == \
        Engine(talky, tok).generate_greedy(prompts, max_tokens=20, batch_rows=2)


def test_static_cache_compiled_step_in_a_capture_copies_nothing_and_reruns_nothing(monkeypatch):
    """Inside a CUDA-graph capture the compiled step runs as it is: no undo copies (the graph would
    replay them with every token), and a compiled part that fails there fails the capture rather
    than being rerun eagerly after its recorded kernels."""
    under_capture = [False]
    monkeypatch.setattr(decode, "capturing", lambda device: under_capture[0])

    class RecordingGraphs(StandInGraphs):
        """A stand-in whose capture runs the step once while `capturing` says so, as torch's does."""

        def capture(self, fn, generator, device):
            step._pos_before.fill_(-1)  # an undo copy inside the capture would overwrite this
            under_capture[0] = True
            try:
                fn()
            finally:
                under_capture[0] = False
            return super().capture(fn, generator, device)

    model = random_model(0)
    step = compile_step(prefilled_step(model, Sampling(greedy=True)), backend="aot_eager")
    with torch.inference_mode():
        capture_graph(step, backend=RecordingGraphs(), warmup_steps=1)  # the warm-up compiles
    assert step._pos_before.tolist() == [-1] * 3
    step = compile_step(prefilled_step(model, Sampling.of(1.0, None, None)), backend=FailingAtGraph(2))
    with torch.inference_mode(), pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
        capture_graph(step, backend=RecordingGraphs(), warmup_steps=0)  # the draw compiles in the capture
    assert fastpath.enabled("decode_compiled")  # the capture failed; the compiled step did not fall back


@pytest.mark.slow  # inductor builds the step in C++: ~15 s on this 2-core CPU cold, ~6 s with its build cached
def test_static_cache_compiled_engine_with_inductor_equals_reference_and_writes_in_place(tok):
    from torch._inductor.utils import run_and_get_code

    model = talkative_tool_model(tok)
    prompt = tok.encode("how much?")
    kw = dict(num_samples=3, max_tokens=30, temperature=0.0)
    want = Engine(model, tok).generate_batch(prompt, **kw)
    compiled = Engine(model, tok, fast=True, compile_step=True)  # the default backend, inductor
    # Inductor's on-disk graph cache off: it once served code compiled for separate cache tensors to
    # a cache of views of one buffer, hiding the copies this test looks for (C++ builds stay cached).
    with torch._inductor.config.patch(fx_graph_cache=False):
        got, code = run_and_get_code(compiled.generate_batch, prompt, **kw)
    assert got == want
    forced = [tok.encode_special("<|output_start|>"), *tok.encode("42"), tok.encode_special("<|output_end|>")]
    assert all(any(s[i : i + len(forced)] == forced for i in range(len(s))) for s in want[0])
    # No buffer the size of a layer's cache allocated in the generated code: the writes go into the
    # cache itself (layers kept as views of one shared buffer made inductor copy whole layers, as
    # (B * Hkv * T_max, D) buffers, every step; see StaticKVCache).
    step = compiled._pool.acquire(3, 64, Sampling(greedy=True))
    assert step.compiled and len(code) == 1
    shapes = re.findall(r"empty_strided_cpu\(\(([\d, ]*)\)", code[0])
    assert len(shapes) > 5 and max(math.prod(int(n) for n in s.split(",") if n.strip()) for s in shapes) < \
        step.cache.keys[0].numel()


def test_static_cache_compiled_step_is_freed_with_its_step():
    """An evicted step (StepPool keeps a few) must free its cache: its compiled code may not hold it."""
    model = random_model(0)
    step = compile_step(prefilled_step(model, Sampling(greedy=True)), backend="aot_eager")
    with torch.inference_mode():
        step()
    refs = [weakref.ref(step), weakref.ref(step.cache.keys[0])]
    del step
    gc.collect()
    assert all(r() is None for r in refs)
