"""The chat server: OpenAI-style API through FastAPI's test client (limits, 413, streaming SSE
framing) and through a live uvicorn on 127.0.0.1 (503 under load, stopping on disconnect)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from test_chat import ScriptedEngine, byte_tokenizer, make_backend, script_for
from test_engine import random_model
from test_serving import serve_in_thread, wait_for

from lockstep.data.records import text_message
from lockstep.infer.chat import EngineBackend
from lockstep.infer.engine import Engine
from lockstep.infer.server import ServerConfig, create_app, sse_event
from lockstep.infer.serving import ServingLimits


def parse_sse(raw: str) -> list[str]:
    """The data of each event, following the SSE rules: events end at a blank line, a field line
    is `name: value` with one optional space after the colon, data lines join with newlines."""
    events, data = [], []
    for line in raw.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if line == "":
            if data:
                events.append("\n".join(data))
            data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    return events


def content_of(events: list[str]) -> str:
    text = []
    for e in events:
        if e == "[DONE]":
            continue
        for choice in json.loads(e).get("choices", []):
            text.append(choice["delta"].get("content", ""))
    return "".join(text)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


@pytest.fixture
def client() -> Iterator[TestClient]:
    backend, _, _ = make_backend("Hi there! ☃ 世界 🙂")
    with TestClient(create_app(backend, ServerConfig(max_body_bytes=4096, max_messages=4, max_message_tokens=100,
                                                     max_conversation_tokens=200, max_reply_tokens=64,
                                                     default_max_tokens=32))) as c:
        yield c


# ---- plain endpoints ------------------------------------------------------------------------


def test_health_and_models(client):
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["model"] == "scripted" and health["running"] == 0
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["scripted"]


def test_ui_is_served_locally_with_no_external_references(client):
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for path in ("/", "/static/app.js", "/static/style.css"):
        body = client.get(path).text
        assert "http://" not in body and "https://" not in body and "//cdn" not in body, path
    assert client.get("/static/app.js").status_code == 200


# ---- completions ------------------------------------------------------------------------------


def test_non_streaming_completion(client):
    r = client.post("/v1/chat/completions", json={"model": "anything", "messages": [user("hello")]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "scripted"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hi there! ☃ 世界 🙂"}
    assert choice["finish_reason"] == "stop"
    reply_tokens = len("Hi there! ☃ 世界 🙂".encode()) + 1
    prompt_tokens = byte_tokenizer().render_for_completion({"messages": [{"role": "user", "content": "hello"}]})
    assert body["usage"] == {"prompt_tokens": len(prompt_tokens), "completion_tokens": reply_tokens,
                             "total_tokens": len(prompt_tokens) + reply_tokens}


def test_content_parts_and_system_message(client):
    r = client.post("/v1/chat/completions", json={"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]},
        {"role": "assistant", "content": "hi"},
        user("again"),
    ], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "Hi "},
                                      "finish_reason": "length"}


def test_streaming_completion(client):
    r = client.post("/v1/chat/completions", json={"messages": [user("hello")], "stream": True,
                                                  "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert content_of(events) == "Hi there! ☃ 世界 🙂"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert (
        chunks[-1]["choices"] == []
        and chunks[-1]["usage"]["completion_tokens"] == len("Hi there! ☃ 世界 🙂".encode()) + 1
    )
    # Each multi-byte character reaches the client whole, never as replacement characters.
    assert "\ufffd" not in r.text


def test_sse_framing_survives_hostile_token_text():
    nasty = "data: [DONE]\n\nid: 3\r\nevent: x\n\n\ndata: {\"choices\": []}\n: comment\n🙂\u2028end"
    tok = byte_tokenizer()
    backend = EngineBackend(ScriptedEngine(script_for(tok, nasty)), tok, model_id="nasty", context_tokens=512)
    with TestClient(create_app(backend, ServerConfig(max_reply_tokens=512, default_max_tokens=512))) as c:
        r = c.post("/v1/chat/completions", json={"messages": [user("x")], "stream": True})
    events = parse_sse(r.text)
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    assert content_of(events) == nasty
    assert sse_event({"t": "a\n\nb"}) == 'data: {"t":"a\\n\\nb"}\n\n'


# ---- limits -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"messages": [user("a")] * 5}, "messages"),  # more than max_messages
        ({"messages": [user("x" * 101)]}, "messages.0.content"),  # over max_message_tokens
        ({"messages": [user("é" * 51)]}, "messages.0.content"),  # 102 tokens in 51 characters
        ({"messages": [user("a")], "max_tokens": 65}, "max_tokens"),
        ({"messages": [user("a")], "max_tokens": 0}, "max_tokens"),
        ({"messages": [user("a")], "temperature": 2.01}, "temperature"),
        ({"messages": [user("a")], "temperature": -0.1}, "temperature"),
        ({"messages": [user("a")], "top_k": 201}, "top_k"),
        ({"messages": [user("a")], "top_k": -1}, "top_k"),
        ({"messages": [user("a")], "n": 2}, "n"),
        ({"messages": []}, "messages"),
        ({"messages": [user("a"), user("b")]}, "messages"),
        ({"messages": [{"role": "assistant", "content": "a"}]}, "messages"),
        ({"messages": [{"role": "tool", "content": "a"}]}, "messages.0.role"),
    ],
)
def test_limits_are_enforced_with_a_clear_422(client, payload, param):
    r = client.post("/v1/chat/completions", json=payload)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith(param), error
    # The error explains itself without echoing the message text back.
    assert "xxxxxxxx" not in error["message"] and "éééé" not in error["message"]


def test_limits_accept_the_boundary_values(client):
    r = client.post("/v1/chat/completions", json={"messages": [user("x" * 100)], "max_tokens": 64,
                                                  "temperature": 2.0, "top_k": 200})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"messages": [user("x")] * 1, "temperature": 0, "top_k": 0})
    assert r.status_code == 200, r.text


def test_oversized_bodies_are_refused_with_413(client):
    r = client.post("/v1/chat/completions", json={"messages": [user("x" * 5000)]})
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "request_too_large"

    def chunks():  # no Content-Length: the limit must be counted as the body arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}]}'

    r = client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text


def test_bad_json_is_a_422_not_a_500(client):
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    error = r.json()["error"]
    # The decoder's character offset is where the body breaks, not a parameter: the body as a whole is.
    assert error["param"] == "body", error
    assert error["message"].startswith("the request body is not valid JSON: ") and "at character 1" in error["message"]


@pytest.mark.parametrize(
    "field, value",
    [("max_tokens", True), ("max_tokens", "5"), ("max_tokens", 5.0), ("max_completion_tokens", True),
     ("top_k", True), ("seed", False), ("n", True), ("temperature", True), ("temperature", "0.5"),
     ("top_p", True), ("stream", 1), ("stream", "yes")],
)
def test_json_true_and_strings_are_not_numbers(client, field, value):
    r = client.post("/v1/chat/completions", json={"messages": [user("a")], field: value})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_sampling_numbers_are_refused(client, literal):
    for field in (b"temperature", b"top_p"):
        body = b'{"messages": [{"role": "user", "content": "a"}], "' + field + b'": ' + literal + b"}"
        r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == field.decode()


def test_max_tokens_beyond_the_room_left_is_refused_not_clipped():
    backend, engine, _ = make_backend("ok", context_tokens=40)
    room = 40 - backend.prompt_tokens([text_message("user", "hi")])
    config = ServerConfig(max_reply_tokens=64, default_max_tokens=64)
    with TestClient(create_app(backend, config)) as c:
        for param in ("max_tokens", "max_completion_tokens"):
            r = c.post("/v1/chat/completions", json={"messages": [user("hi")], param: room + 1})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param and error["code"] == "context_length_exceeded"
            assert f"the model's 40-token context leaves once {room + 1} are kept for the reply" in error["message"]
            assert f"ask for at most {room}" in error["message"]
        r = c.post("/v1/chat/completions", json={"messages": [user("hi")], "max_tokens": room})
        assert r.status_code == 200, r.text
        assert engine.calls[-1]["max_tokens"] == room
        # The server's own default is fitted into the room: the request did not ask for more.
        r = c.post("/v1/chat/completions", json={"messages": [user("hi")]})
        assert r.status_code == 200, r.text
        assert engine.calls[-1]["max_tokens"] == room
    assert len(engine.calls) == 2


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class CountWatchingBackend:
    """Wraps a backend, recording for each token count whether it ran on the event loop's thread."""

    def __init__(self, inner):
        self.inner = inner
        self.model_id = inner.model_id
        self.context_tokens = inner.context_tokens
        self.counts: list[tuple[str, bool]] = []

    def count_tokens(self, text):
        self.counts.append(("count_tokens", _on_event_loop()))
        return self.inner.count_tokens(text)

    def prompt_tokens(self, messages):
        self.counts.append(("prompt_tokens", _on_event_loop()))
        return self.inner.prompt_tokens(messages)

    def stream(self, messages, settings):
        return self.inner.stream(messages, settings)


@pytest.mark.parametrize("stream", [False, True])
def test_tokens_are_counted_off_the_event_loop(stream):
    backend = CountWatchingBackend(make_backend("ok")[0])
    with TestClient(create_app(backend)) as c:
        messages = [{"role": "system", "content": "be brief"}, user("a" * 300), {"role": "assistant", "content": "b"},
                    user("c")]
        r = c.post("/v1/chat/completions", json={"messages": messages, "stream": stream})
        assert r.status_code == 200, r.text
        r = c.post("/v1/chat/completions", json={"messages": [user("x" * 3000)], "stream": stream})
        assert r.status_code == 422 and r.json()["error"]["param"] == "messages.0.content", r.text
    assert {name for name, _ in backend.counts} == {"count_tokens", "prompt_tokens"}
    assert not any(on_loop for _, on_loop in backend.counts), backend.counts


def test_a_message_over_the_character_cap_is_refused_before_it_is_tokenized():
    backend = CountWatchingBackend(make_backend("ok")[0])
    config = ServerConfig(max_message_tokens=100, max_message_chars=50)
    with TestClient(create_app(backend, config)) as c:
        for content in ("x" * 51, [{"type": "text", "text": "x" * 30}, {"type": "text", "text": "y" * 21}]):
            r = c.post("/v1/chat/completions", json={"messages": [user("hi"), {"role": "assistant", "content": "ok"},
                                                                  {"role": "user", "content": content}]})
            assert r.status_code == 422, r.text
            error = r.json()["error"]
            assert error["param"].startswith("messages.2.content") and "the limit is 50" in error["message"]
        assert backend.counts == []
        r = c.post("/v1/chat/completions", json={"messages": [user("x" * 50)]})
        assert r.status_code == 200, r.text
    # The default cap: 16 characters per token of the token limit; a 1 MB message never reaches
    # the tokenizer.
    assert ServerConfig(max_message_tokens=100).message_char_limit == 1600
    with TestClient(create_app(backend)) as c:
        r = c.post("/v1/chat/completions", json={"messages": [user("x" * 1_000_000)]})
        assert r.status_code == 422, r.text
        assert "message is 1000000 characters, the limit is 32768" in r.json()["error"]["message"]
    assert [name for name, _ in backend.counts] == ["count_tokens", "prompt_tokens"]  # the 50-character one only


@pytest.mark.parametrize("temperature", [1e-40, 1e-8])
def test_a_tiny_temperature_is_greedy_not_a_500(tok, temperature):
    backend = EngineBackend(Engine(random_model(5), tok), tok, model_id="random", context_tokens=64)
    with TestClient(create_app(backend)) as c:
        replies = []
        for t in (temperature, 0.0):
            r = c.post("/v1/chat/completions", json={"messages": [user("hello")], "max_tokens": 12, "temperature": t})
            assert r.status_code == 200, r.text
            replies.append(r.json()["choices"][0]["message"]["content"])
    assert replies[0] == replies[1]


def test_no_cors_by_default_and_never_with_credentials():
    backend, _, _ = make_backend()
    with TestClient(create_app(backend)) as c:
        r = c.options("/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                      "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in r.headers
    with TestClient(create_app(backend, ServerConfig(allowed_origins=("http://localhost:3000",)))) as c:
        r = c.options("/v1/chat/completions", headers={"Origin": "http://localhost:3000",
                                                      "Access-Control-Request-Method": "POST"})
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "access-control-allow-credentials" not in r.headers
        r = c.options("/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                      "Access-Control-Request-Method": "POST"})
        assert r.headers.get("access-control-allow-origin") != "https://evil.example"
    with pytest.raises(ValueError, match="may not contain"):
        ServerConfig(allowed_origins=("*",))


def test_message_text_never_reaches_the_log(client, caplog):
    secret = "my-secret-passphrase-42"
    with caplog.at_level(logging.DEBUG):
        client.post("/v1/chat/completions", json={"messages": [user(secret)]})
        client.post("/v1/chat/completions", json={"messages": [user(secret)], "stream": True})
        client.post("/v1/chat/completions", json={"messages": [user(secret)], "top_k": 999})
    assert caplog.records, "requests should be logged (sizes and timings)"
    assert all(secret not in r.getMessage() for r in caplog.records)
    assert all("Hi there" not in r.getMessage() for r in caplog.records)


# ---- a live server on 127.0.0.1 ----------------------------------------------------------------


@contextlib.contextmanager
def live_server(app, limits: ServingLimits | None = None) -> Iterator[str]:
    """Serve `app` as `lockstep serve` does (uvicorn under lockstep.infer.serving's guard) on a free
    127.0.0.1 port in a thread; yields the base URL."""
    with serve_in_thread(app, limits, lifespan="on", timeout_graceful_shutdown=2) as (port, _):
        yield f"http://127.0.0.1:{port}"


def test_busy_server_answers_503_instead_of_queueing():
    tok = byte_tokenizer()
    engine = ScriptedEngine(tok.encode("slow"), repeat=True, step_s=0.01)
    backend = EngineBackend(engine, tok, model_id="slow", context_tokens=4096)
    app = create_app(backend, ServerConfig(workers=1, max_queued=0, max_reply_tokens=4000, default_max_tokens=4000))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        with http.stream("POST", "/v1/chat/completions", json={"messages": [user("a")], "stream": True}) as first:
            assert first.status_code == 200
            chunks = first.iter_raw()  # held: dropping the iterator closes the response
            next(chunks)
            r = http.post("/v1/chat/completions", json={"messages": [user("b")]})
            assert r.status_code == 503
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "server_busy"
            assert http.get("/health").json()["running"] == 1
        # The first stream is gone: its worker comes free and the next request is served.
        assert wait_for(lambda: http.get("/health").json()["running"] == 0)
        r = http.post("/v1/chat/completions", json={"messages": [user("c")], "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "slow"


def test_queued_request_waits_for_a_worker_then_times_out():
    tok = byte_tokenizer()
    engine = ScriptedEngine(tok.encode("slow"), repeat=True, step_s=0.01)
    backend = EngineBackend(engine, tok, model_id="slow", context_tokens=4096)
    app = create_app(backend, ServerConfig(workers=1, max_queued=1, queue_timeout_s=0.3, max_reply_tokens=4000,
                                           default_max_tokens=4000))
    with live_server(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        with http.stream("POST", "/v1/chat/completions", json={"messages": [user("a")], "stream": True}) as first:
            chunks = first.iter_raw()
            next(chunks)
            start_s = time.monotonic()
            r = http.post("/v1/chat/completions", json={"messages": [user("b")]})
            assert r.status_code == 503 and time.monotonic() - start_s >= 0.25


@pytest.mark.parametrize("stream", [True, False])
def test_generation_stops_within_a_couple_of_tokens_of_a_disconnect(stream):
    tok = byte_tokenizer()
    engine = ScriptedEngine(tok.encode("abc"), repeat=True, step_s=0.02)
    backend = EngineBackend(engine, tok, model_id="endless", context_tokens=100_000)
    app = create_app(backend, ServerConfig(max_reply_tokens=50_000, default_max_tokens=50_000))
    with live_server(app) as url:
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=5) as conn:
            body = json.dumps({"messages": [user("go")], "stream": stream}).encode()
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            if stream:
                assert b"200 OK" in conn.recv(65536)
            assert wait_for(lambda: engine.steps >= 5)
            conn.shutdown(socket.SHUT_RDWR)
        steps_at_disconnect = engine.steps
        assert wait_for(engine.closed.is_set, timeout_s=5), "generation kept running after the client left"
        steps_after = engine.steps - steps_at_disconnect
        assert steps_after <= 2, f"{steps_after} engine steps ran after the client disconnected"
        with httpx.Client(base_url=url, timeout=5) as http:
            assert wait_for(lambda: http.get("/health").json()["running"] == 0)


def test_a_reply_streamed_for_longer_than_the_read_bounds_is_not_cut():
    tok = byte_tokenizer()
    engine = ScriptedEngine(tok.encode("abc"), repeat=True, step_s=0.01)
    backend = EngineBackend(engine, tok, model_id="long", context_tokens=4096)
    app = create_app(backend, ServerConfig(max_reply_tokens=200, default_max_tokens=200))
    limits = ServingLimits(header_timeout_s=0.3, body_timeout_s=0.3)
    with live_server(app, limits) as url, httpx.Client(base_url=url, timeout=10) as http:
        start_s = time.monotonic()
        r = http.post("/v1/chat/completions", json={"messages": [user("go")], "stream": True, "max_tokens": 100})
        took_s = time.monotonic() - start_s
        # The same kept-alive connection serves the next request.
        assert http.post("/v1/chat/completions", json={"messages": [user("go")], "max_tokens": 3}).status_code == 200
    events = parse_sse(r.text)
    assert took_s > 2 * limits.body_timeout_s, took_s
    assert events[-1] == "[DONE]" and content_of(events) == ("abc" * 34)[:100]


def test_app_keeps_serving_across_lifespan_cycles():
    backend, _, _ = make_backend("again")
    app = create_app(backend)
    for _ in range(2):
        with TestClient(app) as c:
            r = c.post("/v1/chat/completions", json={"messages": [user("hi")]})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "again"
    assert TestClient(app).post("/v1/chat/completions", json={"messages": [user("hi")]}).status_code == 200
