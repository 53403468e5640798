"""Temperature, top_p and top_k at their extremes (0, tiny, subnormal, exactly the boundaries, 1,
huge) through the engine, `lockstep chat` and the HTTP server, streamed and not: every setting in
range samples (a top_p under sampling.TOP_P_FLOOR, like a temperature under GREEDY_TEMPERATURE,
gives the greedy reply), every stream ends with [DONE], none is a 500, and every setting out of
range is refused with one clear error naming it."""

from __future__ import annotations

import io
import itertools
import json
import math

import pytest
import torch
from fastapi.testclient import TestClient
from test_chat import RecordingBackend
from test_engine import CAPPED_LOGITS, random_model
from test_front_door import chat, random_ckpt, the_error_line  # noqa: F401  (random_ckpt: a fixture)
from test_server import parse_sse, user

from lockstep.infer.chat import Delta, EngineBackend, SamplingSettings, run_chat
from lockstep.infer.engine import Engine, sample_next
from lockstep.infer.sampling import GREEDY_TEMPERATURE, TOP_P_FLOOR, nucleus_top_p
from lockstep.infer.server import ServerConfig, create_app
from lockstep.tokenizer.kinds import train_tokenizer

SUBNORMAL = 5e-324  # the smallest positive float64
# fp32 rounds anything under about 7e-46 (half its smallest subnormal, 1.4e-45) to 0: the value
# that used to mask even the top id.
FP32_ZERO = 1e-46

# ---- the rule itself --------------------------------------------------------------------------


def test_the_floor_is_exact_for_any_vocabulary_the_project_builds():
    # The most likely of V ids has probability >= 1/V; the tokenizer config caps V at 1e9.
    assert TOP_P_FLOOR <= 1 / 1e9
    assert torch.tensor(TOP_P_FLOOR, dtype=torch.float32).item() > 0  # a normal fp32 number
    for tiny in (SUBNORMAL, FP32_ZERO, 7e-46, 1e-30, TOP_P_FLOOR / 2):
        assert torch.tensor(tiny, dtype=torch.float32).item() < TOP_P_FLOOR
        assert nucleus_top_p(tiny) == TOP_P_FLOOR
    assert nucleus_top_p(TOP_P_FLOOR) == TOP_P_FLOOR
    assert nucleus_top_p(0.5) == 0.5
    assert nucleus_top_p(1.0) is None and nucleus_top_p(None) is None
    for bad in (0.0, -1e-300, 1.0000001, math.nan, math.inf):
        with pytest.raises(ValueError, match="top_p=.* must be a finite number in \\(0, 1\\]"):
            nucleus_top_p(bad)


# ---- the engine -------------------------------------------------------------------------------


@pytest.mark.parametrize("top_p", [SUBNORMAL, FP32_ZERO, 7e-46, 1e-40, TOP_P_FLOOR / 2, TOP_P_FLOOR, 1e-3])
@pytest.mark.parametrize("top_k", [None, 2, 4, 10**9])
def test_a_tiny_top_p_keeps_the_top_id_alone(top_p, top_k):
    g = torch.Generator().manual_seed(0)
    for temperature in (GREEDY_TEMPERATURE, 0.5, 1.0, 2.0, 1e30):
        for _ in range(10):
            ids = sample_next(CAPPED_LOGITS, temperature=temperature, top_k=top_k, top_p=top_p, generator=g)
            assert ids.tolist() == [0, 3], (temperature, top_p, top_k)


def test_top_p_one_is_no_cut_and_just_below_it_still_samples():
    logits = torch.tensor([[1.0, 0.9, 0.8, 0.7]])
    draws = {}
    for top_p in (None, 1.0):
        g = torch.Generator().manual_seed(3)
        draws[top_p] = [
            sample_next(logits, temperature=1.0, top_k=None, top_p=top_p, generator=g).item() for _ in range(64)
        ]
    assert draws[None] == draws[1.0] and set(draws[1.0]) == {0, 1, 2, 3}
    g = torch.Generator().manual_seed(3)
    assert {sample_next(logits, temperature=1.0, top_k=None, top_p=0.3, generator=g).item() for _ in range(64)} == {
        0,
        1,
    }


# Every extreme of each setting the engine takes, and the combinations of them.
TEMPERATURES = [0.0, SUBNORMAL, 1e-40, GREEDY_TEMPERATURE, 1.0, 2.0, 1e30]
TOP_PS = [None, SUBNORMAL, FP32_ZERO, TOP_P_FLOOR, 0.5, 1.0]
TOP_KS = [None, 1, 265, 10**9]


def test_every_combination_of_extremes_decodes_and_the_greedy_ones_agree(tok):
    engine = Engine(random_model(5), tok)  # weights of scale 0.5: logits at the soft cap
    prompt = tok.encode("extremes")
    greedy, _ = engine.generate_batch(prompt, max_tokens=6, temperature=0.0, use_tools=False)
    for temperature, top_p, top_k in itertools.product(TEMPERATURES, TOP_PS, TOP_KS):
        seqs, _ = engine.generate_batch(prompt, num_samples=2, max_tokens=6, temperature=temperature, top_p=top_p,
                                        top_k=top_k, seed=1, use_tools=False)
        assert all(0 <= t < 265 for s in seqs for t in s)
        narrowest = temperature < GREEDY_TEMPERATURE or top_k == 1 or (top_p is not None and top_p <= TOP_P_FLOOR)
        if narrowest:
            assert seqs == greedy * 2, (temperature, top_p, top_k)


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.5, math.nan, math.inf])
def test_the_engine_refuses_a_top_p_out_of_range_before_any_work(tok, top_p):
    with pytest.raises(ValueError, match="top_p=.* must be a finite number in \\(0, 1\\]"):
        Engine(random_model(5), tok).generate([1, 2], max_tokens=2, top_p=top_p)


# ---- lockstep chat ----------------------------------------------------------------------------


@pytest.mark.parametrize("args", [
    ["--top-p", "1e-46"], ["--top-p", "5e-324"], ["--top-p", "1e-9"], ["--top-k", "1"],
    ["--temperature", "1e-320"], ["--temperature", "0"],
])
def test_chat_at_the_narrow_extremes_answers_greedily(random_ckpt, args):  # noqa: F811
    greedy = chat(*random_ckpt, "-p", "hello", "--max-tokens", "8", "--temperature", "0")
    r = chat(*random_ckpt, "-p", "hello", "--max-tokens", "8", *args)
    assert r.exit_code == 0, r.output
    assert r.output == greedy.output


@pytest.mark.parametrize("args", [
    ["--temperature", "2"], ["--top-k", "0"], ["--top-k", "200"], ["--top-p", "1"], ["--top-p", "0.5"],
    ["--seed", str(2**63 - 1)], ["--temperature", "2", "--top-k", "0", "--top-p", "1"],
])
def test_chat_at_the_wide_extremes_answers(random_ckpt, args):  # noqa: F811
    r = chat(*random_ckpt, "-p", "hello", "--max-tokens", "8", *args)
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("args, named", [
    (["--temperature", "2.5"], "--temperature must be from 0 to 2"),
    (["--temperature", "-1e-300"], "--temperature must be from 0 to 2"),
    (["--temperature", "nan"], "--temperature must be from 0 to 2"),
    (["--temperature", "inf"], "--temperature must be from 0 to 2"),
    (["--top-k", "-1"], "--top-k must be from 0 to 200"),
    (["--top-k", "201"], "--top-k must be from 0 to 200"),
    (["--top-p", "0"], "--top-p must be above 0 and at most 1"),
    (["--top-p", "1.0000001"], "--top-p must be above 0 and at most 1"),
    (["--top-p", "nan"], "--top-p must be above 0 and at most 1"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--seed", "-1"], "--seed must be from 0 to 9223372036854775807"),
    (["--seed", str(2**63)], "--seed must be from 0 to 9223372036854775807"),
])
def test_chat_refuses_a_setting_out_of_range_in_one_line(random_ckpt, args, named):  # noqa: F811
    r = chat(*random_ckpt, "-p", "hello", *args)
    assert r.exit_code == 2, r.output
    assert named in the_error_line(r.output)


def test_chat_topp_command_sets_and_refuses(tok):
    backend = RecordingBackend(EngineBackend(Engine(random_model(5), tok), tok, model_id="random", context_tokens=64))
    out = io.StringIO()
    lines = ["/topp 1e-46", "hello", "/topp 0", "/topp x", "/topp", "/temperature 1e-320", "/topp 1", "hi"]
    run_chat(backend, SamplingSettings(max_tokens=6), lines=lines, out=out)
    text = out.getvalue()
    assert "/topp must be above 0 and at most 1 (1 = no nucleus cut), got 0" in text
    assert "/topp needs a number from 0 to 1, got 'x'" in text and "\ntopp = 1e-46\n" in text
    (_, first), (_, second) = backend.seen
    assert (first.top_p, second.top_p, second.temperature) == (1e-46, 1.0, 1e-320)


# ---- the server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_client():
    tok = train_tokenizer("byte", [])
    backend = EngineBackend(Engine(random_model(5), tok), tok, model_id="random", context_tokens=64)
    with TestClient(create_app(backend, ServerConfig(max_reply_tokens=16, default_max_tokens=8))) as c:
        yield c


def _reply(client, stream: bool, **settings) -> str:
    r = client.post("/v1/chat/completions", json={"messages": [user("hello")], "max_tokens": 8, "seed": 1,
                                                  "stream": stream, **settings})
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["message"]["content"]
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]", events
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    return "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch.get("choices"))


@pytest.mark.parametrize("stream", [False, True])
def test_server_at_every_extreme_answers_and_the_narrow_ones_are_greedy(engine_client, stream):
    greedy = _reply(engine_client, stream, temperature=0.0)
    # JSON numbers as a client sends them: the subnormal and the fp32-zero top_p included.
    for settings in ({"top_p": SUBNORMAL}, {"top_p": FP32_ZERO}, {"top_p": 1e-300, "temperature": 2.0},
                     {"top_p": TOP_P_FLOOR}, {"top_k": 1, "temperature": 2.0}, {"temperature": SUBNORMAL},
                     {"temperature": 1e-40, "top_p": FP32_ZERO, "top_k": 0}):
        assert _reply(engine_client, stream, **settings) == greedy, settings
    for settings in ({"temperature": 2.0}, {"temperature": GREEDY_TEMPERATURE}, {"top_k": 0}, {"top_k": 200},
                     {"top_p": 1.0}, {"top_p": 0.5}, {"temperature": 2.0, "top_k": 0, "top_p": 1.0},
                     {"seed": 2**63 - 1}):
        _reply(engine_client, stream, **settings)


@pytest.mark.parametrize("field, value", [
    ("temperature", -SUBNORMAL), ("temperature", 2.0000001), ("temperature", 1e308),
    ("top_p", 0.0), ("top_p", -SUBNORMAL), ("top_p", 1.0000001),
    ("top_k", -1), ("top_k", 201), ("seed", -1), ("seed", 2**63),
])
@pytest.mark.parametrize("stream", [False, True])
def test_server_refuses_a_setting_out_of_range_with_a_422_naming_it(engine_client, field, value, stream):
    r = engine_client.post("/v1/chat/completions", json={"messages": [user("hello")], "stream": stream, field: value})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == field


class FailingBackend:
    """A backend whose reply breaks after its first delta, as a fault in the engine would."""

    model_id, context_tokens = "failing", 64

    def count_tokens(self, text):
        return len(text)

    def prompt_tokens(self, messages):
        return 4

    def stream(self, messages, settings):
        yield Delta("par")
        raise RuntimeError("the engine broke")


def test_a_stream_that_fails_still_ends_with_done():
    with TestClient(create_app(FailingBackend())) as c:
        r = c.post("/v1/chat/completions", json={"messages": [user("hello")], "stream": True})
        events = parse_sse(r.text)
        assert events[-1] == "[DONE]", events
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and error["message"] == "generation failed"
        r = c.post("/v1/chat/completions", json={"messages": [user("hello")]})
        assert r.status_code == 500 and r.json()["error"]["message"] == "generation failed"
