"""Engine tests against references: greedy decoding through the KV cache equals argmax decoding
by full forward passes; batched rows equal single-row runs; per-row positions and chunked
prefill equal full forwards; tool calls are answered by forced tokens; limits are refused."""

from __future__ import annotations

import pytest
import torch

from lockstep.engine import Engine, KVCache, sample_next
from lockstep.model import GPT, GPTConfig
from lockstep.sampling import GREEDY_TEMPERATURE, is_greedy


def random_model(seed: int = 0, **kw) -> GPT:
    cfg = dict(sequence_len=64, vocab_size=265, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    cfg.update(kw)
    model = GPT.build(GPTConfig(**cfg), "cpu", seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


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
