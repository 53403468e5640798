"""Chat and serving against a real tiny random model: a checkpoint on disk, the byte tokenizer, the
KV-cache engine, the `lockstep chat` / `lockstep serve` loading path."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from test_server import content_of, live_server, parse_sse, user, wait_for
from typer.testing import CliRunner

from _tiny_model import tiny_gpt
from lockstep.cli import app as cli_app
from lockstep.data.records import text_message
from lockstep.infer.chat import SamplingSettings, load_backend
from lockstep.infer.server import ServerConfig, create_app
from lockstep.model.checkpoint import CheckpointError, save_checkpoint
from lockstep.tokenizer.kinds import train_tokenizer


def write_tiny_checkpoint(root: Path, *, sequence_len: int = 256) -> tuple[Path, Path]:
    """A random 1-layer GPT over the byte tokenizer, saved as a checkpoint next to its tokenizer."""
    tok = train_tokenizer("byte", [])
    tok_dir = root / "tokenizer"
    tok.save(tok_dir)
    model = tiny_gpt(seed=3, sequence_len=sequence_len, vocab_size=tok.get_vocab_size(), n_kv_head=1)
    config = model.config
    ckpt_dir = root / "ckpt" / "sft"
    save_checkpoint(ckpt_dir, model.state_dict(), {}, {"model_config": config.to_dict(),
                                                       "tokenizer_sha256": tok.sha256})
    return ckpt_dir, tok_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


class StepCounter:
    """Wraps the real engine, counting the steps it was actually asked for."""

    def __init__(self, engine, step_s: float = 0.0):
        self.engine = engine
        self.step_s = step_s
        self.steps = 0
        self.finished = 0

    def generate(self, *args, **kwargs):
        try:
            for column in self.engine.generate(*args, **kwargs):
                self.steps += 1
                if self.step_s:
                    time.sleep(self.step_s)
                yield column
        finally:
            self.finished += 1


def test_real_model_streams_a_reproducible_reply(tiny):
    ckpt, tok_dir = tiny
    backend = load_backend(ckpt, tok_dir)
    assert backend.model_id == "lockstep-sft" and backend.context_tokens == 256
    messages = [text_message("user", "Hello ☃")]
    settings = SamplingSettings(temperature=1.0, top_k=0, max_tokens=24, seed=5)
    first = list(backend.stream(messages, settings))
    second = list(backend.stream(messages, settings))
    assert first == second, "same seed, same reply"
    assert 1 <= sum(d.tokens for d in first) <= 24
    assert first[-1].finish_reason in ("stop", "length")
    other = list(backend.stream(messages, SamplingSettings(temperature=1.0, top_k=0, max_tokens=24, seed=6)))
    assert other != first


def test_wrong_tokenizer_is_refused(tiny, tmp_path):
    ckpt, _ = tiny
    other = train_tokenizer("char", ["abc"])
    other.save(tmp_path / "tok")
    with pytest.raises(
        CheckpointError,
        match=f"checkpoint {re.escape(str(ckpt))} was trained with tokenizer .*re-run the earlier stages",
    ):
        load_backend(ckpt, tmp_path / "tok")
    with pytest.raises(FileNotFoundError, match="--ckpt"):
        load_backend(tmp_path / "missing", tmp_path / "tok")


def test_chat_command_one_shot_and_interactive(tiny, tmp_path):
    ckpt, tok_dir = tiny
    runner = CliRunner()
    r = runner.invoke(cli_app, ["chat", "--ckpt", str(ckpt), "--tokenizer", str(tok_dir), "-p", "hi",
                                "--max-tokens", "8", "--temperature", "0"])
    assert r.exit_code == 0, r.output
    assert r.output.endswith("\n")
    r = runner.invoke(cli_app, ["chat", "--ckpt", str(ckpt), "--tokenizer", str(tok_dir), "--max-tokens", "4"],
                      input="hello\n/topk 3\n/temperature 0\nagain\n/quit\n")
    assert r.exit_code == 0, r.output
    assert "temperature = 0.0, topk = 3" in r.output and r.output.count("assistant> ") == 2
    train_tokenizer("char", ["abc"]).save(tmp_path / "tok")
    r = runner.invoke(cli_app, ["chat", "--ckpt", str(ckpt), "--tokenizer", str(tmp_path / "tok"), "-p", "hi"])
    assert r.exit_code == 2 and "trained with" in r.output


def test_server_over_the_real_model(tiny):
    ckpt, tok_dir = tiny
    backend = load_backend(ckpt, tok_dir)
    with TestClient(create_app(backend)) as client:
        payload = {"messages": [user("What is 2+2?")], "max_tokens": 16, "temperature": 0.8, "seed": 11}
        whole = client.post("/v1/chat/completions", json=payload).json()
        streamed = client.post("/v1/chat/completions", json={**payload, "stream": True})
        events = parse_sse(streamed.text)
    assert events[-1] == "[DONE]"
    assert content_of(events) == whole["choices"][0]["message"]["content"]
    assert 1 <= whole["usage"]["completion_tokens"] <= 16


def test_real_engine_stops_within_a_couple_of_steps_of_a_disconnect(tmp_path):
    ckpt, tok_dir = write_tiny_checkpoint(tmp_path, sequence_len=4096)
    backend = load_backend(ckpt, tok_dir)
    # A step as slow as a real model's on a busy CPU, so that the bound below measures how fast the
    # server notices the disconnect, not how many microsecond steps fit into an event-loop turn.
    counter = StepCounter(backend.engine, step_s=0.05)
    backend.engine = counter
    # Never stop at a special token, so only the disconnect can end the reply early.
    backend._stop_ids = set()
    app = create_app(backend, ServerConfig(max_reply_tokens=4000, default_max_tokens=4000))
    with live_server(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            body = json.dumps({"messages": [user("go")], "stream": True, "temperature": 1.0}).encode()
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert b"200 OK" in conn.recv(65536)
            assert wait_for(lambda: counter.steps >= 20, timeout_s=20)
            conn.shutdown(socket.SHUT_RDWR)
        steps_at_disconnect = counter.steps
        assert wait_for(lambda: counter.finished == 1, timeout_s=10)
        assert counter.steps - steps_at_disconnect <= 2
        assert counter.steps < 4000


@pytest.mark.usefixtures("keep_fd_limit")
def test_serve_command_binds_loopback_by_default(tiny, monkeypatch):
    from lockstep.infer import serving

    ckpt, tok_dir = tiny
    seen = {}

    def fake_run(app, limits, plan, **kwargs):  # serve the app through the test client instead of a socket
        seen.update(kwargs)
        with TestClient(app) as c:
            seen["health"] = c.get("/health").json()
            seen["cors"] = c.options("/v1/models", headers={"Origin": "http://localhost:5173",
                                                            "Access-Control-Request-Method": "GET"}).headers

    monkeypatch.setattr(serving, "run_server", fake_run)
    r = CliRunner().invoke(cli_app, ["serve", "--ckpt", str(ckpt), "--tokenizer", str(tok_dir), "--port", "9",
                                     "--allow-origin", "http://localhost:5173"])
    assert r.exit_code == 0, r.output
    assert seen["host"] == "127.0.0.1" and seen["port"] == 9
    assert seen["health"]["model"] == "lockstep-sft"
    assert seen["cors"]["access-control-allow-origin"] == "http://localhost:5173"
    r = CliRunner().invoke(cli_app, ["serve", "--ckpt", str(ckpt), "--tokenizer", str(tok_dir), "--allow-origin", "*"])
    assert r.exit_code == 2 and "may not contain '*'" in r.output


def test_a_second_turn_carries_the_first_through_the_cli_and_the_api(tiny, monkeypatch):
    """The second question of a conversation is asked with the first exchange before it: by
    `lockstep chat` (interactive), whose second request to the model is [user, its own first
    reply, user] and whose replies are the backend's greedy ones for those, and by the API, whose
    reply to the same three messages is the same text."""
    from lockstep.infer.chat import EngineBackend

    ckpt, tok_dir = tiny
    backend = load_backend(ckpt, tok_dir)
    greedy = SamplingSettings(temperature=0.0, max_tokens=6)

    def reply(messages):
        return "".join(d.text for d in backend.stream(messages, greedy))

    first = reply([text_message("user", "Who are you?")])
    history = [text_message("user", "Who are you?"), text_message("assistant", first),
               text_message("user", "Count the r's in strawberry")]
    second = reply(history)
    asked: list[list[dict]] = []
    real_stream = EngineBackend.stream

    def recording_stream(self, messages, settings):
        asked.append(json.loads(json.dumps(messages)))
        return real_stream(self, messages, settings)

    monkeypatch.setattr(EngineBackend, "stream", recording_stream)
    r = CliRunner().invoke(cli_app, ["chat", "--ckpt", str(ckpt), "--tokenizer", str(tok_dir), "--max-tokens", "6",
                                     "--temperature", "0"],
                           input="Who are you?\nCount the r's in strawberry\n/quit\n")
    assert r.exit_code == 0, r.output
    assert [[(m["role"], m["content"]) for m in a] for a in asked] == [
        [(m["role"], m["content"]) for m in history[:1]], [(m["role"], m["content"]) for m in history]]
    replies = r.output.split("assistant> ")[1:]
    assert len(replies) == 2 and replies[0].startswith(first) and replies[1].startswith(second), r.output
    monkeypatch.undo()
    with TestClient(create_app(backend)) as client:
        api = [{"role": m["role"], "content": content_of_message(m)} for m in history]
        got = client.post("/v1/chat/completions", json={"messages": api, "max_tokens": 6, "temperature": 0})
    assert got.status_code == 200 and got.json()["choices"][0]["message"]["content"] == second


def content_of_message(message: dict) -> str:
    content = message["content"]
    return content if isinstance(content, str) else "".join(p["text"] for p in content)
