"""Engine tests against references: greedy decoding through the KV cache equals argmax decoding
by full forward passes; batched rows equal single-row runs; many prompts decoded together equal
each decoded alone, tool calls included; per-row positions, rows swapped in and dropped, and
chunked prefill equal full forwards; tool calls are answered by forced tokens; limits are refused."""

from __future__ import annotations

import pytest
import torch

from _tiny_model import randomize, tiny_gpt
from lockstep.infer.decode import draw
from lockstep.infer.engine import Engine, KVCache, sample_next
from lockstep.infer.sampling import GREEDY_TEMPERATURE, is_greedy
from lockstep.model.gpt import GPT, GPTConfig


def random_model(seed: int = 0, **kw) -> GPT:
    model = tiny_gpt(seed=seed, **{"n_layer": 2, "n_head": 4, **kw})
    return randomize(model, seed=seed + 100, scale=0.5).eval()


def reference_greedy(model: GPT, prompt: list[int], max_tokens: int, stop_ids) -> list[int]:
    seq = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_tokens):
            nxt = int(model(torch.tensor([seq]))[0, -1].argmax())
            out.append(nxt)
            seq.append(nxt)
            if nxt in stop_ids:
                break
    return out


@pytest.mark.parametrize("n_kv_head", [2, 4])
def test_greedy_kv_cache_equals_full_forward_argmax(tok, n_kv_head):
    model = random_model(n_kv_head=n_kv_head)
    engine = Engine(model, tok)
    prompt = tok.encode("hello there")
    ref = reference_greedy(model, prompt, 30, engine.stop_ids)
    seqs, masks = engine.generate_batch(prompt, max_tokens=30, temperature=0.0, use_tools=False)
    assert seqs[0] == ref
    assert masks[0] == [1] * len(ref)
    assert len(ref) == 30  # the test exercises a long decode, not an early stop


def test_batched_rows_equal_single_row_runs(tok):
    model = random_model(1)
    engine = Engine(model, tok)
    prompt = tok.encode("abc")
    single, _ = engine.generate_batch(prompt, max_tokens=20, temperature=0.0, use_tools=False)
    batched, _ = engine.generate_batch(prompt, num_samples=4, max_tokens=20, temperature=0.0, use_tools=False)
    assert batched == single * 4
    # sampled rows: the same seed gives the same rows, and rows differ from each other
    a, _ = engine.generate_batch(prompt, num_samples=4, max_tokens=20, temperature=1.5, seed=7, use_tools=False)
    b, _ = engine.generate_batch(prompt, num_samples=4, max_tokens=20, temperature=1.5, seed=7, use_tools=False)
    c, _ = engine.generate_batch(prompt, num_samples=4, max_tokens=20, temperature=1.5, seed=8, use_tools=False)
    assert a == b and a != c and len({tuple(r) for r in a}) > 1


@pytest.fixture(params=[False, True], ids=["default", "deterministic"])
def determinism(request):
    """Run under both modes: deterministic mode fills uninitialised memory with NaN, so a cache
    that ever reads a slot it never wrote shows up as NaN logits."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(request.param)
    yield request.param
    torch.use_deterministic_algorithms(before)


def test_per_row_positions_and_cache_growth_equal_full_forward(determinism):
    model = random_model(2)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    caches = []
    with torch.no_grad():
        last = []
        for p in prompts:
            c = KVCache.for_model(model, 1, capacity_tokens=len(p))  # tight: decoding must grow it
            last.append(model(torch.tensor([p]), kv_cache=c)[:, -1])
            caches.append(c)
        cache = KVCache.stack(caches)
        assert cache.row_positions() == [4, 7]
        seqs = [list(p) for p in prompts]
        logits = torch.cat(last)  # (2, V)
        for _ in range(6):
            nxt = logits.argmax(-1)  # (2,)
            for s, t in zip(seqs, nxt.tolist()):
                s.append(t)
            logits = model(nxt[:, None], kv_cache=cache)[:, -1]
            for row, s in enumerate(seqs):
                torch.testing.assert_close(logits[row], model(torch.tensor([s]))[0, -1], rtol=1e-4, atol=1e-4)
    assert cache.row_positions() == [10, 13]


def test_chunked_prefill_equals_full_forward():
    model = random_model(3)
    seq = list(range(20, 40))
    with torch.no_grad():
        full = model(torch.tensor([seq]))
        cache = KVCache.for_model(model, 1)
        a = model(torch.tensor([seq[:7]]), kv_cache=cache)
        b = model(torch.tensor([seq[7:]]), kv_cache=cache)
    torch.testing.assert_close(torch.cat([a, b], dim=1), full, rtol=1e-4, atol=1e-4)


def test_sampling_filters():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.9]])
    greedy = logits.argmax(-1)
    assert torch.equal(sample_next(logits, temperature=1.0, top_k=1, top_p=None, generator=g), greedy)
    assert torch.equal(sample_next(logits, temperature=1.0, top_k=None, top_p=1e-6, generator=g), greedy)
    draws = torch.stack([sample_next(logits, temperature=1.0, top_k=2, top_p=None, generator=g) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {1, 3} and set(draws[:, 1].tolist()) == {0, 3}



@pytest.mark.parametrize(("top_k", "top_p", "allowed"), [(None, None, 5), (3, None, 3), (None, 0.8, 3)])
def test_sampled_frequencies_follow_the_cut_softmax(top_k, top_p, allowed):
    # 40,000 draws of one row: each id's share within 5 standard errors of its probability after
    # the cuts (softmax [0.45, 0.27, 0.13, 0.10, 0.05]: the nucleus of 0.8 is the top three).
    logits = torch.log(torch.tensor([0.45, 0.27, 0.13, 0.10, 0.05]))
    g = torch.Generator().manual_seed(3)
    draws = torch.cat([sample_next(logits.expand(8000, -1), temperature=1.0, top_k=top_k, top_p=top_p, generator=g)
                       for _ in range(5)])
    want = torch.softmax(logits[:allowed], dim=-1)
    got = torch.bincount(draws, minlength=5).double() / len(draws)
    assert got[allowed:].sum() == 0
    se = (want * (1 - want) / len(draws)).sqrt()
    assert ((got[:allowed] - want).abs() < 5 * se).all(), (got, want)


def test_draw_never_picks_a_candidate_of_probability_zero():
    # A nucleus cut leaves zeros at the end of the sorted candidates, the softmax of a far lower
    # logit underflows to zero anywhere: neither is picked at the ends of the uniform's range.
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    idx = torch.tensor([[4, 3, 2, 1, 0]])
    below_one = torch.tensor([[1.0]], dtype=torch.float64).nextafter(torch.zeros(1, 1, dtype=torch.float64))
    for u, place in [
        (torch.zeros(1, 1, dtype=torch.float64), 1),
        (below_one, 3),
        (torch.ones(1, 1, dtype=torch.float64), 3),
    ]:
        assert draw(probs, None, u).item() == place
        assert draw(probs, idx, u).item() == 4 - place

# Soft-capped logits reach +-15: at 1e-40 (a subnormal) they overflow fp32 once divided.
CAPPED_LOGITS = torch.tensor([[15.0, 3.0, 14.9, -15.0], [-15.0, 0.5, 0.0, 15.0]])


@pytest.mark.parametrize("temperature", [1e-40, 1e-8, GREEDY_TEMPERATURE * 0.999])
@pytest.mark.parametrize("top_k", [None, 2])
def test_temperatures_below_the_threshold_are_greedy(temperature, top_k):
    g = torch.Generator().manual_seed(0)
    assert is_greedy(temperature)
    for _ in range(20):
        ids = sample_next(CAPPED_LOGITS, temperature=temperature, top_k=top_k, top_p=0.9, generator=g)
        assert ids.tolist() == [0, 3]


def test_the_threshold_itself_samples_and_a_normal_temperature_spreads():
    g = torch.Generator().manual_seed(0)
    assert not is_greedy(GREEDY_TEMPERATURE) and not is_greedy(0.7)
    # At the threshold a gap of 0.1 already gets zero probability, while a tie is still a coin toss:
    # sampling, not argmax (which would always take the first of the tied ids).
    logits = torch.tensor([[15.0, 14.9, 15.0, -15.0]])
    draws = {sample_next(logits, temperature=GREEDY_TEMPERATURE, top_k=None, top_p=None, generator=g).item()
             for _ in range(64)}
    assert draws == {0, 2}
    draws = {sample_next(logits, temperature=0.7, top_k=None, top_p=None, generator=g).item() for _ in range(200)}
    assert draws == {0, 1, 2}


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -1e-9])
def test_non_finite_and_negative_temperatures_are_refused(tok, temperature):
    with pytest.raises(ValueError, match="temperature=.* must be a finite number >= 0"):
        sample_next(CAPPED_LOGITS, temperature=temperature, top_k=None, top_p=None, generator=torch.Generator())
    model = ScriptedModel([1] * 4, 4)
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        Engine(model, tok).generate([1, 2], max_tokens=2, temperature=temperature)
    assert model.calls == 0


def test_a_tiny_temperature_decodes_like_temperature_zero(tok):
    model = random_model(5)  # weights of scale 0.5: logits at the soft cap, where 1e-40 overflowed
    engine = Engine(model, tok)
    prompt = tok.encode("temperature")
    greedy, _ = engine.generate_batch(prompt, max_tokens=16, temperature=0.0, use_tools=False)
    tiny, _ = engine.generate_batch(prompt, num_samples=2, max_tokens=16, temperature=1e-40, top_k=50, seed=1,
                                    use_tools=False)
    assert tiny == greedy * 2


class ScriptedModel(torch.nn.Module):
    """Stands in for a GPT: predicts `script[k]` as the k-th completion token, whatever it was
    fed, and records what it was fed (to check forced tokens reach the model)."""

    def __init__(self, script: list[int], prompt_len: int, sequence_len: int = 64):
        super().__init__()
        self.config = GPTConfig(sequence_len=sequence_len, vocab_size=265, n_layer=1, n_head=1, n_kv_head=1, n_embd=8)
        self.register_buffer("rotary_cos", torch.zeros(1))
        self.script, self.prompt_len = script, prompt_len
        self.fed: list[list[int]] = []
        self.calls = 0

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        if not torch.compiler.is_compiling():  # a count read in a compiled step would recompile it per call
            self.calls += 1
        B, T = idx.shape
        pos = kv_cache.positions()
        assert isinstance(pos, int)
        self.fed.append(idx[0].tolist())
        kv_cache.advance(T)
        logits = torch.zeros(B, T, 265)
        k = pos + T - self.prompt_len  # index of the completion token predicted at the last position
        logits[:, -1, self.script[k] if k < len(self.script) else ord("z")] = 1.0
        return logits


def test_tool_call_output_is_forced(tok):
    sp = tok.encode_special
    call = [sp("<|python_start|>"), *tok.encode("12*(3+4)"), sp("<|python_end|>")]
    forced = [sp("<|output_start|>"), *tok.encode("84"), sp("<|output_end|>")]
    # during the forced stretch the model would say "X"; the engine must override it
    script = call + tok.encode("X" * len(forced)) + tok.encode("ok") + [sp("<|assistant_end|>")]
    prompt = tok.encode("q")
    model = ScriptedModel(script, len(prompt))
    seqs, masks = Engine(model, tok).generate_batch(prompt, num_samples=2, max_tokens=40, temperature=0.0)
    want = call + forced + tok.encode("ok") + [sp("<|assistant_end|>")]
    assert seqs == [want, want]
    assert masks[0] == [1] * len(call) + [0] * len(forced) + [1, 1, 1]
    fed = [t for step in model.fed for t in step]
    assert fed == prompt + want[:-1]  # forced tokens were fed back; nothing after the stop


def test_refused_tool_call_forces_no_result(tok):
    sp = tok.encode_special
    call = [sp("<|python_start|>"), *tok.encode("9**9**9"), sp("<|python_end|>")]
    script = call + [ord("X")] * 20 + [sp("<|assistant_end|>")]
    model = ScriptedModel(script, 1)
    seqs, masks = Engine(model, tok).generate_batch([1], max_tokens=40, temperature=0.0)
    out = seqs[0][len(call):]
    assert tok.decode(out[: out.index(sp("<|output_end|>")) + 1]) == "<|output_start|>no result<|output_end|>"
    # tools off: the call is plain text and nothing is forced
    model = ScriptedModel(script, 1)
    seqs, masks = Engine(model, tok).generate_batch([1], max_tokens=40, temperature=0.0, use_tools=False)
    assert seqs[0][: len(call) + 1] == call + [ord("X")] and all(masks[0])


def test_tool_tokens_count_toward_max_tokens(tok):
    sp = tok.encode_special
    script = [sp("<|python_start|>"), *tok.encode("1+1"), sp("<|python_end|>")] + [ord("X")] * 30
    model = ScriptedModel(script, 1)
    steps = list(Engine(model, tok).generate([1], max_tokens=7, temperature=0.0))
    assert len(steps) == 7
    assert [s[1][0] for s in steps] == [1, 1, 1, 1, 1, 0, 0]


def test_context_limit_refused_before_any_work(tok):
    model = ScriptedModel([1] * 10, 10, sequence_len=16)
    engine = Engine(model, tok)
    with pytest.raises(ValueError, match="exceeds the model's context of 16 tokens: lower max_tokens to 6"):
        engine.generate([1] * 10, max_tokens=7)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], max_tokens=1)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.generate([999], max_tokens=1)
    assert model.calls == 0
    assert len(list(engine.generate([1] * 10, max_tokens=6, temperature=0.0))) == 6


def test_stopping_iteration_stops_the_work(tok):
    model = ScriptedModel([ord("a")] * 50, 2)
    gen = Engine(model, tok).generate([1, 2], max_tokens=50, temperature=0.0)
    assert model.calls == 0  # nothing runs before the first step is asked for
    for i, _ in enumerate(gen):
        if i == 2:
            break
    gen.close()
    assert model.calls == 3  # prefill + two decode steps for the three columns taken


def test_cache_allocates_lazily_in_the_model_dtype():
    model = random_model(4)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    cache = KVCache.for_model(model, 1, capacity_tokens=4)
    assert cache.kv is None
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]]), kv_cache=cache)
        model(torch.tensor([[4, 5]]), kv_cache=cache)  # outruns capacity 4: grows
    assert cache.kv.dtype == torch.bfloat16 and cache.kv.size(4) >= 5
    assert cache.row_positions() == [5]
    assert torch.isfinite(logits).all()


# ---------------------------------------------------------------------------------------------
# many prompts decoded together (Engine.generate_greedy) against one prompt at a time


class Planted(torch.nn.Module):
    """A random GPT plus a bigram bias the test plants (after token a, say b), so greedy replies
    make tool calls and stop where the test wants; every other token is the GPT's own."""

    def __init__(self, gpt: GPT, plants: dict[int, int]):
        super().__init__()
        self.gpt, self.config, self.rotary_cos = gpt, gpt.config, gpt.rotary_cos
        bias = torch.zeros(gpt.config.vocab_size, gpt.config.vocab_size)
        for a, b in plants.items():
            bias[a, b] = 100.0  # past the soft cap of 15: the planted token always wins
        self.register_buffer("bias", bias)
        self.calls = 0

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        if not torch.compiler.is_compiling():  # a count read in a compiled step would recompile it per call
            self.calls += 1
        return self.gpt(idx, kv_cache=kv_cache) + self.bias[idx]  # (B, T, V)


def planted_tool_model(tok, seed: int = 7) -> Planted:
    sp = tok.encode_special
    o = ord
    # "?" opens a call to 7*6, "." ends the reply: the engine must force "42" into the row.
    plants = {o("?"): sp("<|python_start|>"), sp("<|python_start|>"): o("7"), o("7"): o("*"), o("*"): o("6"),
              o("6"): sp("<|python_end|>"), o("."): sp("<|assistant_end|>")}
    return Planted(random_model(seed), plants).eval()


def test_generate_greedy_equals_one_prompt_at_a_time(tok, determinism):
    model = planted_tool_model(tok)
    engine = Engine(model, tok)
    texts = [
        "how much?",
        "q",
        "stop here.",
        "a longer prompt that runs on and on?",
        "x",
        "why?",
        "tell me more",
        "z" * 50,
    ]
    prompts = [tok.encode(t) for t in texts]
    budgets = [30, 12, 9, 20, 40, 3, 25, 14]  # the last prompt fills the 64-token context exactly
    one_by_one = [engine.generate_batch(p, max_tokens=m, temperature=0.0)[0][0] for p, m in zip(prompts, budgets)]
    for batch_rows in (1, 3, 8, 16):
        assert engine.generate_greedy(prompts, max_tokens=budgets, batch_rows=batch_rows) == one_by_one, batch_rows
    # What the comparison covered: tool calls answered, a stop on the first token, replies cut by
    # their budgets and replies that stop before it.
    sp = tok.encode_special
    forced = [sp("<|output_start|>"), *tok.encode("42"), sp("<|output_end|>")]
    with_tool = [r for r in one_by_one if any(r[i : i + len(forced)] == forced for i in range(len(r)))]
    assert len(with_tool) >= 2  # "why?" has a budget of 3: its call is cut before the tool answers
    assert one_by_one[2] == [sp("<|assistant_end|>")]
    assert sum(len(r) == m for r, m in zip(one_by_one, budgets)) >= 2
    assert any(len(r) < m for r, m in zip(one_by_one, budgets))
    tools_off = [
        engine.generate_batch(p, max_tokens=m, temperature=0.0, use_tools=False)[0][0] for p, m in zip(prompts, budgets)
    ]
    assert engine.generate_greedy(prompts, max_tokens=budgets, batch_rows=3, use_tools=False) == tools_off != one_by_one


def test_generate_many_sampled_equals_generate_one_row(tok, determinism):
    """Sampled, one prompt at a time in one row, generate_many draws what generate draws for one
    row from the same seed: ids and masks (0 where the tool forced a token)."""
    model = planted_tool_model(tok)
    engine = Engine(model, tok)
    texts = ["how much?", "q", "why?", "tell me more", "stop here."]
    forced_seen = 0
    for seed, text in enumerate(texts * 2):
        prompt = tok.encode(text)
        want = engine.generate_batch(prompt, max_tokens=24, temperature=1.0, seed=seed)
        got = engine.generate_many([prompt], max_tokens=24, batch_rows=1, temperature=1.0, seed=seed)
        assert got == want, text
        forced_seen += 0 in want[1][0]
    assert forced_seen >= 2  # the comparison covered tool results


def test_generate_many_is_seeded_and_top_k_1_is_greedy(tok, determinism):
    model = planted_tool_model(tok)
    engine = Engine(model, tok)
    prompts = [tok.encode(t) for t in ("how much?", "q", "tell me more", "x")] * 3
    a = engine.generate_many(prompts, max_tokens=20, batch_rows=5, temperature=1.0, seed=3)
    assert engine.generate_many(prompts, max_tokens=20, batch_rows=5, temperature=1.0, seed=3) == a
    assert engine.generate_many(prompts, max_tokens=20, batch_rows=5, temperature=1.0, seed=4)[0] != a[0]
    assert len({tuple(r) for r in a[0][::4]}) > 1  # copies of one prompt drew different replies
    top1, masks = engine.generate_many(prompts, max_tokens=20, batch_rows=5, temperature=1.0, top_k=1, seed=3)
    assert top1 == engine.generate_greedy(prompts, max_tokens=20, batch_rows=5)
    assert [len(m) for m in masks] == [len(r) for r in top1]


def test_repeated_prompts_are_prefilled_once_and_draw_what_separate_prefills_draw(tok, determinism, monkeypatch):
    """A prompt repeated back to back (a problem's k samples) runs its prefill once and copies
    the cache; the draws equal those with every row prefilled on its own."""
    model = planted_tool_model(tok)
    engine = Engine(model, tok)
    prompts = [tok.encode(t) for t in ("how much?", "tell me more", "why?") for _ in range(4)] + [
        tok.encode("how much?")
    ]
    prefills = []
    forward = model.forward

    def counting_forward(x, *args, **kwargs):
        if x.size(1) > 1:
            prefills.append(x.size(1))
        return forward(x, *args, **kwargs)

    monkeypatch.setattr(model, "forward", counting_forward)
    shared = engine.generate_many(prompts, max_tokens=20, batch_rows=5, temperature=1.0, seed=3)
    assert len(prefills) == 4  # three runs of one prompt, and the first prompt again after another
    start = Engine._start_reply
    monkeypatch.setattr(Engine, "_start_reply", lambda self, *a, last=None, **kw: start(self, *a, **kw))
    prefills.clear()
    assert engine.generate_many(prompts, max_tokens=20, batch_rows=5, temperature=1.0, seed=3) == shared
    assert len(prefills) == len(prompts)


def test_generate_greedy_refuses_bad_requests_before_any_work(tok):
    model = planted_tool_model(tok)
    engine = Engine(model, tok)
    with pytest.raises(ValueError, match="2 budgets for 3 prompts"):
        engine.generate_greedy([[1], [2], [3]], max_tokens=[4, 4], batch_rows=2)
    with pytest.raises(ValueError, match="batch_rows=0 must be >= 1"):
        engine.generate_greedy([[1]], max_tokens=4, batch_rows=0)
    with pytest.raises(ValueError, match="exceeds the model's context of 64 tokens"):
        engine.generate_greedy([[1], [2] * 60], max_tokens=8, batch_rows=2)
    with pytest.raises(ValueError, match="empty"):
        engine.generate_greedy([[1], []], max_tokens=8, batch_rows=2)
    assert model.calls == 0
    assert engine.generate_greedy([], max_tokens=8, batch_rows=4) == []


def test_put_row_and_keep_rows_equal_full_forward(determinism):
    model = random_model(4)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21]]
    with torch.no_grad():
        heads, last = [], []
        for p in prompts:
            c = KVCache.for_model(model, 1, capacity_tokens=len(p))
            last.append(model(torch.tensor([p]), kv_cache=c)[:, -1])
            heads.append(c)
        cache = KVCache.for_model(model, 2, capacity_tokens=4)  # too small for prompt 1: put_row grows it
        cache.put_row(0, heads[0])
        cache.put_row(1, heads[1])
        seqs, logits = [list(prompts[0]), list(prompts[1])], torch.cat(last[:2])  # (2, V)
        for step in range(5):
            if step == 2:  # row 0 is done; prompt 2 takes its place, then row 1 leaves
                cache.put_row(0, heads[2])
                seqs[0], logits[0] = list(prompts[2]), last[2][0]
            if step == 4:
                cache.keep_rows([0])
                seqs, logits = seqs[:1], logits[:1]
            nxt = logits.argmax(-1)  # (B,)
            for s, t in zip(seqs, nxt.tolist()):
                s.append(t)
            logits = model(nxt[:, None], kv_cache=cache)[:, -1]
            for row, s in enumerate(seqs):
                torch.testing.assert_close(logits[row], model(torch.tensor([s]))[0, -1], rtol=1e-4, atol=1e-4)
    assert cache.row_positions() == [len(prompts[2]) + 3]
    with pytest.raises(ValueError, match="single-row source"):
        cache.put_row(0, KVCache.for_model(model, 2))
    with pytest.raises(ValueError, match="outside this cache of 1 rows"):
        cache.put_row(1, heads[0])


@pytest.mark.parametrize(
    "keep", [[0, 2], [2, 0], [1], [2, 1, 0]], ids=["moved-in-place", "reordered", "one", "reversed"]
)
def test_keep_rows_in_any_order_equals_full_forward(keep):
    model = random_model(6)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]
    with torch.no_grad():
        cache = KVCache.for_model(model, 3)
        for row, p in enumerate(prompts):
            head = KVCache.for_model(model, 1)
            model(torch.tensor([p]), kv_cache=head)
            cache.put_row(row, head)
        cache.keep_rows(keep)
        nxt = torch.tensor([[30 + r] for r in keep])  # (B, 1)
        logits = model(nxt, kv_cache=cache)[:, -1]
        for i, r in enumerate(keep):
            torch.testing.assert_close(
                logits[i], model(torch.tensor([prompts[r] + [30 + r]]))[0, -1], rtol=1e-4, atol=1e-4
            )
    assert cache.row_positions() == [len(prompts[r]) + 1 for r in keep]
    with pytest.raises(ValueError, match="distinct rows"):
        cache.keep_rows([0, 0])
