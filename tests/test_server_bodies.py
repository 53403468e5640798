"""Malformed request bodies get the API's own 422: `{"error": {"message", "type", "param",
"code"}}` with `param` naming where (the key at fault, or `body` for the body as a whole) and a
message that says what is wrong, never a 400 from the framework or a 500, and never the input
echoed back. Well-formed bodies next to each case are still answered."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from test_chat import make_backend

from lockstep.infer.server import MAX_INT_DIGITS, ServerConfig, create_app

JSON = {"content-type": "application/json"}
HELLO = b'{"role": "user", "content": "hello"}'
DEEP = 100_000  # far past the interpreter's recursion limit


@pytest.fixture(scope="module")
def client():
    backend, _, _ = make_backend("ok")
    with TestClient(create_app(backend, ServerConfig(max_body_bytes=1 << 20))) as c:
        yield c


def body(**fields: bytes) -> bytes:
    """A request body with one user message and the given raw JSON fields."""
    extra = b"".join(b', "' + name.encode() + b'": ' + raw for name, raw in fields.items())
    return b'{"messages": [' + HELLO + b"]" + extra + b"}"


def message(content: bytes) -> bytes:
    return b'{"messages": [{"role": "user", "content": ' + content + b"}]}"


CASES = [
    # (name, body, content type, param, words the message must hold)
    ("invalid UTF-8", message(b'"caf\xe9"'), JSON, "body", "not valid UTF-8: byte 0xe9 at offset 46"),
    ("UTF-16", '{"messages": []}'.encode("utf-16"), JSON, "body", "not valid UTF-8"),
    ("not JSON", b"{not json", JSON, "body", "not valid JSON: Expecting property name"),
    ("trailing garbage", body() + b" x", JSON, "body", "not valid JSON: Extra data"),
    ("empty", b"", JSON, "body", "the request body is empty"),
    ("an array", b"[1, 2]", JSON, "body", "must be a JSON object with a messages list, got an array"),
    ("null", b"null", JSON, "body", "got null"),
    ("a string", b'"hi"', JSON, "body", "got a string"),
    ("not declared JSON", body(), {"content-type": "text/plain"}, "body", "Content-Type: application/json"),
    ("5000-digit max_tokens", body(max_tokens=b"9" * 5000), JSON, "max_tokens", "a 5000-digit number is out of range"),
    ("5000-digit seed", body(seed=b"-" + b"1" * 5000), JSON, "seed", "a 5000-digit number is out of range"),
    ("5000-digit content", message(b"7" * 5000), JSON, "messages.0.content", "a 5000-digit number"),
    ("5000-digit float", body(temperature=b"1" * 5000 + b".5"), JSON, "temperature", "finite number"),
    ("deep messages", b'{"messages": ' + b"[" * DEEP + b"]" * DEEP + b"}", JSON, "messages", "nest too deeply"),
    ("deep extra key", body(x=b'{"a":' * DEEP + b"1" + b"}" * DEEP), JSON, "x", "nest too deeply"),
    ("deep body", b"[" * DEEP + b"]" * DEEP, JSON, "body", "nest too deeply"),
    ("lone high surrogate", message(b'"a\\ud800b"'), JSON, "messages.0.content",
     "unpaired surrogate \\ud800 at character 1"),
    ("lone low surrogate in a part", message(b'[{"type": "text", "text": "ok"}, {"type": "text", "text": "\\uDC01"}]'),
     JSON, "messages.0.content.1.text", "unpaired surrogate \\udc01 at character 0"),
    ("reversed pair", message(b'"\\ude00\\ud83d"'), JSON, "messages.0.content", "unpaired surrogate \\ude00"),
    ("surrogate in a key", message(b'"hi", "\\ud800": 1'), JSON, "messages.0", "a key holds an unpaired surrogate"),
    ("surrogate in model", body(model=b'"m\\ud800"'), JSON, "model", "unpaired surrogate"),
    ("a part of another type", message(b'[{"type": "image_url", "text": "x"}]'), JSON, "messages.0.content.0.type",
     "Input should be 'text'"),
    ("content a number", message(b"5"), JSON, "messages.0.content", "should be a string, or a list of text parts"),
]


@pytest.mark.parametrize("name, raw, headers, param, words", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_body_is_a_422_naming_where(client, name, raw, headers, param, words, stream):
    if stream and raw.startswith(b'{"messages": [' + HELLO):  # the body is readable: ask for a stream too
        raw = raw[:-1] + b', "stream": true}'
    r = client.post("/v1/chat/completions", content=raw, headers=headers)
    assert r.status_code == 422, r.text
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"message", "type", "param", "code"}
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert words in error["message"], error
    assert len(error["message"]) < 300 and "99999" not in error["message"] and "[[[[" not in error["message"]


@pytest.mark.parametrize("raw", [
    message(b'"smile \\ud83d\\ude00"'),  # a surrogate pair is one character
    message(b'"a backslash and \\\\ud800"'),  # an escaped backslash: the text says \ud800, no surrogate
    b"\xef\xbb\xbf" + body(),  # a UTF-8 byte order mark, which a reader may ignore (RFC 8259)
    body(seed=str(2**63 - 1).encode()),  # the largest seed: 19 digits
    body(unused=b"1" * (MAX_INT_DIGITS + 1)),  # an unknown key is ignored, long number or not
    body(unused=b"[" * 200 + b"]" * 200),  # nesting the parser can read, in an ignored key
])
def test_well_formed_bodies_next_to_each_case_are_answered(client, raw):
    r = client.post("/v1/chat/completions", content=raw, headers=JSON)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "ok"


def test_a_pair_reaches_the_backend_as_one_character():
    backend, engine, tok = make_backend("ok")
    with TestClient(create_app(backend)) as c:
        r = c.post("/v1/chat/completions", content=message(b'"\\ud83d\\ude00"'), headers=JSON)
        assert r.status_code == 200, r.text
    assert tok.decode(engine.calls[0]["prompt_ids"]).count("\U0001f600") == 1


def test_the_error_is_plain_json_a_client_can_read():
    backend, _, _ = make_backend("ok")
    with TestClient(create_app(backend)) as c:
        r = c.post("/v1/chat/completions", content=message(b'"\\ud800"'), headers=JSON)
    assert r.headers["content-type"] == "application/json"
    json.loads(r.content.decode("utf-8"))  # strict UTF-8: the surrogate is not written back raw
