"""The official `openai` Python client against the chat API, as users drive it: a tiny random
checkpoint served by a live uvicorn on 127.0.0.1, and the client's completions, streams, stop
strings, max_tokens, n, seeds, sampling extremes, the errors it raises with lockstep's message,
the fit headers through `with_raw_response`, and a stream the client closes after one chunk."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from _tiny_model import randomize, tiny_gpt
from test_server import live_server
from test_serving import wait_for

from lockstep.data.records import text_message
from lockstep.infer.chat import ChatError, EngineBackend, check_messages, check_person_setting, load_backend
from lockstep.infer.server import DROPPED_TURNS_HEADER, ServerConfig, create_app
from lockstep.model.checkpoint import save_checkpoint
from lockstep.tokenizer.kinds import train_tokenizer

CONTEXT_TOKENS = 128
MAX_REPLY_TOKENS = 64
HELLO = [{"role": "user", "content": "Hello"}]


class TracebackLog(logging.Handler):
    """Keeps every record that carries an exception, from any logger it is attached to."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "Traceback" in record.getMessage():
            self.records.append(record)


def write_random_checkpoint(root: Path) -> tuple[Path, Path]:
    """A random 1-layer GPT over the byte tokenizer (random weights, so greedy replies run on
    instead of stopping at once), saved as a checkpoint next to its tokenizer."""
    tok = train_tokenizer("byte", [])
    tok.save(root / "tokenizer")
    model = randomize(tiny_gpt(seed=0, sequence_len=CONTEXT_TOKENS, vocab_size=tok.get_vocab_size(), n_kv_head=1),
                      seed=100, scale=0.5)
    ckpt_dir = root / "ckpt" / "sft"
    save_checkpoint(ckpt_dir, model.state_dict(), {}, {"model_config": model.config.to_dict(),
                                                       "tokenizer_sha256": tok.sha256})
    return ckpt_dir, root / "tokenizer"


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, EngineBackend, TracebackLog]]:
    """(base URL, backend, the server's logged tracebacks) of `lockstep serve`'s app on a free port."""
    backend = load_backend(*write_random_checkpoint(tmp_path_factory.mktemp("openai")))
    app = create_app(backend, ServerConfig(max_reply_tokens=MAX_REPLY_TOKENS, default_max_tokens=32))
    tracebacks = TracebackLog()
    # uvicorn's loggers do not propagate to the root logger; the app's and asyncio's do.
    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]
    for logger in loggers:
        logger.addHandler(tracebacks)
    try:
        with live_server(app) as url:
            yield url, backend, tracebacks
    finally:
        for logger in loggers:
            logger.removeHandler(tracebacks)


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    # No retries: a 5xx must fail the test, not be retried into a pass.
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def greedy(client) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model="lockstep-sft", messages=HELLO, temperature=0, max_tokens=40)


def streamed_text(chunks: list) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_models_list_names_the_served_model(client):
    assert [m.id for m in client.models.list()] == ["lockstep-sft"]


def test_a_completion(served, greedy):
    backend = served[1]
    choice = greedy.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    usage = greedy.usage
    assert usage.prompt_tokens == backend.prompt_tokens([text_message("user", "Hello")])
    assert 1 <= usage.completion_tokens <= 40
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert greedy.model == "lockstep-sft" and greedy.object == "chat.completion"


def test_a_stream_concatenates_to_the_greedy_reply(client, greedy):
    chunks = list(client.chat.completions.create(model="lockstep-sft", messages=HELLO, temperature=0, max_tokens=40,
                                                 stream=True))
    assert streamed_text(chunks) == greedy.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == greedy.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    # With include_usage, one more chunk, without choices, carries the usage.
    chunks = list(client.chat.completions.create(model="lockstep-sft", messages=HELLO, temperature=0, max_tokens=40,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage == greedy.usage
    assert streamed_text(chunks) == greedy.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_stop_cuts_the_reply_before_the_stop_string(client, greedy, stream):
    text = greedy.choices[0].message.content
    stop = text[10:13]  # three characters: three tokens of the byte tokenizer, cut across them
    want = text[: text.index(stop)]
    for stops in (stop, [stop, "never in a random reply: ⌘⌘⌘"]):
        reply = client.chat.completions.create(model="lockstep-sft", messages=HELLO, temperature=0, max_tokens=40,
                                               stop=stops, stream=stream)
        if stream:
            chunks = list(reply)
            assert streamed_text(chunks) == want and chunks[-1].choices[0].finish_reason == "stop"
        else:
            assert reply.choices[0].message.content == want and reply.choices[0].finish_reason == "stop"
            assert reply.usage.completion_tokens < greedy.usage.completion_tokens


def test_max_tokens_ends_the_reply_at_length(client, greedy):
    reply = client.chat.completions.create(model="lockstep-sft", messages=HELLO, temperature=0, max_tokens=7)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 7
    assert greedy.choices[0].message.content.startswith(reply.choices[0].message.content)


def test_n_is_one_choice_and_more_is_refused_in_lockstep_words(client):
    reply = client.chat.completions.create(model="lockstep-sft", messages=HELLO, max_tokens=3, n=1)
    assert len(reply.choices) == 1
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model="lockstep-sft", messages=HELLO, max_tokens=3, n=2)
    assert e.value.param == "n" and "this server samples one choice per request" in e.value.message


def test_a_seed_reproduces_a_sampled_reply(client):
    def sample(seed: int) -> str:
        reply = client.chat.completions.create(model="lockstep-sft", messages=HELLO, temperature=1.0, max_tokens=20,
                                               seed=seed)
        return reply.choices[0].message.content

    first = sample(7)
    assert sample(7) == first and sample(8) != first


def test_sampling_extremes_are_served(client, greedy):
    # The nucleus of a top_p this small is the most likely id alone: greedy at any temperature.
    reply = client.chat.completions.create(model="lockstep-sft", messages=HELLO, temperature=2.0, top_p=1e-12,
                                           max_tokens=40)
    assert reply.choices[0].message.content == greedy.choices[0].message.content
    for temperature, top_p in ((2.0, 1.0), (0.0, 1.0), (1e-40, 1.0)):
        reply = client.chat.completions.create(model="lockstep-sft", messages=HELLO, temperature=temperature,
                                               top_p=top_p, max_tokens=5)
        assert reply.usage.completion_tokens >= 1


@pytest.mark.parametrize("setting, value", [("temperature", 2.01), ("temperature", -0.1), ("top_p", 0.0),
                                            ("top_p", 1.0001), ("top_k", 201)])
def test_settings_beyond_their_range_raise_with_lockstep_message(client, setting, value):
    with pytest.raises(ChatError) as reference:
        check_person_setting(setting, value, name=setting)
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model="lockstep-sft", messages=HELLO, max_tokens=3,
                                       **({"extra_body": {setting: value}} if setting == "top_k" else {setting: value}))
    assert e.value.status_code == 422 and e.value.param == setting
    assert e.value.body["message"] == str(reference.value) and str(reference.value) in e.value.message


def test_max_tokens_beyond_the_server_limit_raises_with_lockstep_message(client):
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model="lockstep-sft", messages=HELLO, max_tokens=MAX_REPLY_TOKENS + 1)
    assert e.value.param == "max_tokens"
    assert e.value.body["message"] == (f"max_tokens must be from 1 to {MAX_REPLY_TOKENS} (the longest reply this "
                                       f"server gives), got {MAX_REPLY_TOKENS + 1}")


def test_malformed_requests_raise_the_client_error_with_lockstep_message(client):
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model="lockstep-sft", messages=HELLO, extra_body={"messages": "Hello"})
    assert e.value.param == "messages" and e.value.type == "invalid_request_error"
    assert set(e.value.body) == {"message", "type", "param", "code"}
    two_users = [*HELLO, {"role": "user", "content": "again"}]
    with pytest.raises(ChatError) as reference:
        check_messages(two_users)
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model="lockstep-sft", messages=two_users)
    assert e.value.param == "messages" and e.value.body["message"] == f"messages: {reference.value}"
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model="lockstep-sft", messages=[{"role": "tool", "content": "x",
                                                                        "tool_call_id": "1"}])
    assert e.value.param == "messages.0.role"
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model="lockstep-sft", messages=HELLO, stop=[""])
    assert e.value.param == "stop.0"


def test_a_conversation_over_the_context(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="lockstep-sft", messages=[{"role": "user", "content": "x" * 200}],
                                       max_tokens=5)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert f"the model's {CONTEXT_TOKENS}-token context" in e.value.message
    long = []
    for i in range(10):
        long += [{"role": "user", "content": f"hello there {i}"}, {"role": "assistant", "content": "general kenobi"}]
    long.append({"role": "user", "content": "and now?"})
    raw = client.chat.completions.with_raw_response.create(model="lockstep-sft", messages=long, max_tokens=5)
    dropped = int(raw.headers[DROPPED_TURNS_HEADER])
    completion = raw.parse()
    assert 1 <= dropped < 10 and completion.usage.completion_tokens == 5
    assert completion.usage.prompt_tokens <= CONTEXT_TOKENS - 5


def test_a_stream_closed_after_one_chunk_leaves_the_server_healthy(served, client, greedy):
    url, _, tracebacks = served
    stream = client.chat.completions.create(model="lockstep-sft", messages=HELLO, max_tokens=MAX_REPLY_TOKENS,
                                            stream=True)
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    stream.close()
    with httpx.Client(base_url=url, timeout=10) as http:
        assert wait_for(lambda: http.get("/health").json()["running"] == 0)
    reply = client.chat.completions.create(model="lockstep-sft", messages=HELLO, temperature=0, max_tokens=40)
    assert reply.choices[0].message.content == greedy.choices[0].message.content
    assert not tracebacks.records, [r.getMessage() for r in tracebacks.records]
