"""Conversations longer than the model's context: the one policy (lockstep.infer.context) that keeps
the system message and the latest whole turns, and how the terminal chat and the API say what it
left out, refuse what cannot fit and mark a reply that was cut."""

from __future__ import annotations

import io
import json

import pytest
from fastapi.testclient import TestClient
from test_chat import RecordingBackend, ScriptedEngine, byte_tokenizer, make_backend, script_for
from test_chat_model import write_tiny_checkpoint
from test_server import parse_sse, user
from typer.testing import CliRunner

from lockstep.cli import app as cli_app
from lockstep.data.records import text_message
from lockstep.infer.chat import EngineBackend, SamplingSettings, run_chat
from lockstep.infer.context import ContextFullError, dropped_notice, fit_conversation, min_reply_tokens
from lockstep.infer.server import ServerConfig, create_app


def conversation(*texts: str, system: str | None = None) -> list[dict]:
    """user, assistant, user, ... from `texts`, after a system message when given."""
    head = [text_message("system", system)] if system is not None else []
    return head + [text_message("user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(texts)]


def tool_reply() -> dict:
    """An assistant message with a calculator call and its output, as the SFT data has them."""
    return {"role": "assistant", "content": [{"type": "text", "text": "half of 48 is "},
                                             {"type": "python", "text": "48/2"},
                                             {"type": "python_output", "text": "24"},
                                             {"type": "text", "text": ", so 24."}]}


def oldest_first_reference(messages: list[dict], count, budget_tokens: int) -> int:
    """Pairs to drop, found the other way round from the policy: drop the oldest pairs one by one
    until the rest (system message kept) fits."""
    head = messages[:1] if messages[0]["role"] == "system" else []
    body = messages[len(head):]
    for dropped in range(len(body) // 2 + 1):
        if count(head + body[2 * dropped:]) <= budget_tokens:
            return dropped
    raise AssertionError("the latest user message alone does not fit")


# ---- the policy -------------------------------------------------------------------------------


@pytest.mark.parametrize("context_tokens, max_tokens, room", [(256, 256, 128), (256, 50, 50), (2048, 256, 256),
                                                               (1, 5, 1), (3, 1, 1)])
def test_min_reply_tokens_is_max_tokens_but_at_most_half_the_context(context_tokens, max_tokens, room):
    assert min_reply_tokens(context_tokens, max_tokens) == room


def test_an_exact_fit_drops_nothing_and_one_token_more_drops_the_oldest_pair():
    backend = make_backend()[0]
    messages = conversation("first question", "first answer", "second question", "second answer", "third")
    full = backend.prompt_tokens(messages)
    fitted = fit_conversation(messages, prompt_tokens=backend.prompt_tokens, context_tokens=full + 10,
                              reply_tokens=10)
    assert (fitted.messages, fitted.dropped_turns, fitted.prompt_tokens, fitted.room_tokens) == (messages, 0, full, 10)
    fitted = fit_conversation(messages, prompt_tokens=backend.prompt_tokens, context_tokens=full + 9, reply_tokens=10)
    assert fitted.dropped_turns == 1 and fitted.messages == messages[2:]
    assert fitted.prompt_tokens == backend.prompt_tokens(messages[2:]) <= full - 1


def test_the_latest_user_message_is_kept_alone_when_nothing_else_fits():
    backend = make_backend()[0]
    messages = conversation("q1", "a1", "q2", "a2", "the latest question")
    alone = backend.prompt_tokens(messages[-1:])
    fitted = fit_conversation(messages, prompt_tokens=backend.prompt_tokens, context_tokens=alone + 3, reply_tokens=3)
    assert fitted.messages == messages[-1:] and fitted.dropped_turns == 2 and fitted.room_tokens == 3
    with pytest.raises(ContextFullError) as refused:
        fit_conversation(messages, prompt_tokens=backend.prompt_tokens, context_tokens=alone + 2, reply_tokens=3)
    e = refused.value
    assert (e.prompt_tokens, e.budget_tokens, e.reply_tokens, e.context_tokens) == (alone, alone - 1, 3, alone + 2)
    assert str(e) == (f"the latest user message is {alone} tokens with the chat template, over the {alone - 1} the "
                      f"model's {alone + 2}-token context leaves once 3 are kept for the reply")


def test_the_system_message_is_kept_and_counted():
    backend = make_backend()[0]
    messages = conversation("q1", "a1", "q2", "a2", "q3", system="You are lockstep. Be brief.")
    budget = backend.prompt_tokens([messages[0], *messages[-3:]])
    fitted = fit_conversation(messages, prompt_tokens=backend.prompt_tokens, context_tokens=budget + 20,
                              reply_tokens=20)
    assert fitted.messages == [messages[0], *messages[-3:]] and fitted.dropped_turns == 1
    assert fitted.prompt_tokens == budget
    alone = backend.prompt_tokens([messages[0], messages[-1]])
    with pytest.raises(ContextFullError, match=f"the system message and the latest user message are {alone} tokens"):
        fit_conversation(messages, prompt_tokens=backend.prompt_tokens, context_tokens=alone + 19, reply_tokens=20)


def test_a_turn_with_a_tool_call_is_counted_whole_and_dropped_whole():
    backend = make_backend()[0]
    messages = [text_message("user", "what is half of 48?"), tool_reply(), text_message("user", "and of 50?")]
    full = backend.prompt_tokens(messages)
    # The python and output parts count with their delimiters, as the model reads them.
    assert full == len(byte_tokenizer().render_for_completion({"messages": messages}))
    fitted = fit_conversation(messages, prompt_tokens=backend.prompt_tokens, context_tokens=full + 5, reply_tokens=5)
    assert fitted.messages == messages and fitted.messages[1]["content"] == tool_reply()["content"]
    fitted = fit_conversation(messages, prompt_tokens=backend.prompt_tokens, context_tokens=full + 4, reply_tokens=5)
    assert fitted.messages == messages[2:] and fitted.dropped_turns == 1


def test_the_policy_agrees_with_dropping_oldest_first_and_caps_the_prompt():
    backend = make_backend()[0]
    texts = [("q" * n, "a" * (3 * n % 17)) for n in range(1, 9)]
    messages = conversation(*[t for pair in texts for t in pair], "latest", system="sys")
    for budget in range(backend.prompt_tokens([messages[0], messages[-1]]), backend.prompt_tokens(messages) + 2):
        fitted = fit_conversation(messages, prompt_tokens=backend.prompt_tokens, context_tokens=budget + 7,
                                  reply_tokens=7)
        assert fitted.dropped_turns == oldest_first_reference(messages, backend.prompt_tokens, budget), budget
        capped = fit_conversation(messages, prompt_tokens=backend.prompt_tokens, context_tokens=10_000,
                                  reply_tokens=7, max_prompt_tokens=budget)
        assert capped == fitted.__class__(fitted.messages, fitted.dropped_turns, fitted.prompt_tokens, 10_000)


def test_a_conversation_that_does_not_end_with_the_user_is_not_fitted():
    with pytest.raises(ValueError, match="ends with a user message"):
        fit_conversation(conversation("q", "a"), prompt_tokens=len, context_tokens=100, reply_tokens=10)


def test_dropped_notice_counts_exchanges():
    assert dropped_notice(1, 256) == "the oldest exchange no longer fits the model's 256-token context and is left out"
    assert dropped_notice(2, 256) == ("the 2 oldest exchanges no longer fit the model's 256-token context and are "
                                      "left out")


# ---- the terminal chat ------------------------------------------------------------------------

QUESTION = "question {}: what is this about?"  # 31 bytes, 31 tokens with the byte tokenizer
ANSWER = "an answer of forty bytes, give or take.."  # 40 bytes


def test_a_chat_runs_past_the_context_and_says_once_per_drop_what_it_left_out():
    # Context 256 keeps 128 for the reply (half), so the prompt may take 128: the latest question
    # (35 tokens rendered) and one earlier exchange (75) fit, two (185) do not.
    inner, engine, tok = make_backend(ANSWER, context_tokens=256)
    backend = RecordingBackend(inner)
    out = io.StringIO()
    lines = [QUESTION.format(i) for i in range(1, 7)]
    final = run_chat(backend, SamplingSettings(max_tokens=256), lines=lines, out=out)
    text = out.getvalue()
    notice = "note: the oldest exchange no longer fits the model's 256-token context and is left out\n"
    assert text.count("assistant> " + ANSWER + "\n") == 6 and "error" not in text
    # Exchanges 1 to 4 are left out, one at each of turns 3 to 6, each said once, just before its reply.
    assert text.count("note:") == 4 and text.count(notice + "assistant> ") == 4
    assert text.split("\n")[1:4] == ["assistant> " + ANSWER, "assistant> " + ANSWER, notice.strip()]
    seen = [[m["content"][0]["text"] for m in messages] for messages, _ in backend.seen]
    assert seen[1] == [QUESTION.format(1), ANSWER, QUESTION.format(2)]
    assert seen[5] == [QUESTION.format(5), ANSWER, QUESTION.format(6)]
    assert [call["max_tokens"] for call in engine.calls] == [256 - 35] + [256 - 110] * 5
    assert final == conversation(QUESTION.format(5), ANSWER, QUESTION.format(6), ANSWER)


def test_a_message_too_long_to_answer_is_refused_naming_clear_and_the_chat_goes_on():
    backend = RecordingBackend(make_backend(ANSWER, context_tokens=256)[0])
    out = io.StringIO()
    lines = ["hello", "x" * 130, "again"]
    final = run_chat(backend, SamplingSettings(max_tokens=256), lines=lines, out=out)
    text = out.getvalue()
    assert ("error: the latest user message is 134 tokens with the chat template, over the 128 the model's "
            "256-token context leaves once 128 are kept for the reply: shorten your message (earlier exchanges "
            "are already left out, so /clear would not help)\n") in text
    assert text.count("assistant> " + ANSWER) == 2
    assert [m["content"][0]["text"] for m in final] == ["hello", ANSWER, "again", ANSWER]


def test_a_cut_reply_is_said_in_one_line():
    tok = byte_tokenizer()
    endless = ScriptedEngine(script_for(tok, "word ", end=False), repeat=True)
    backend = EngineBackend(endless, tok, model_id="endless", context_tokens=256)
    out = io.StringIO()
    run_chat(backend, SamplingSettings(max_tokens=256), lines=["hi"], out=out)
    room = 256 - backend.prompt_tokens([text_message("user", "hi")])
    assert out.getvalue().endswith(f"\nnote: the reply was cut off at {room} tokens, where it filled the model's "
                                   "256-token context\n")
    out = io.StringIO()
    run_chat(backend, SamplingSettings(max_tokens=6), lines=["hi"], out=out)
    assert out.getvalue().endswith("assistant> word w\n"
                                   "note: the reply was cut off at its 6-token limit (--max-tokens)\n")
    out = io.StringIO()
    run_chat(make_backend("done")[0], SamplingSettings(), lines=["hi"], out=out)
    assert "note" not in out.getvalue()


def test_the_chat_command_keeps_answering_past_a_real_models_context(tmp_path):
    ckpt, tok_dir = write_tiny_checkpoint(tmp_path)  # a random model with a 256-token context
    lines = "".join(QUESTION.format(i) + "\n" for i in range(1, 7))
    r = CliRunner().invoke(cli_app, ["chat", "--ckpt", str(ckpt), "--tokenizer", str(tok_dir), "--temperature", "0"],
                           input=lines + "/quit\n")
    assert r.exit_code == 0, r.output
    assert r.output.count("assistant> ") == 6 and "error" not in r.output
    assert "(256-token context)" in r.output and "no longer fit" in r.output
    r = CliRunner().invoke(cli_app, ["chat", "--ckpt", str(ckpt), "--tokenizer", str(tok_dir), "-p", "x" * 200])
    assert r.exit_code == 2 and r.output == ("error: the latest user message is 204 tokens with the chat template, "
                                             "over the 128 the model's 256-token context leaves once 128 are kept "
                                             "for the reply: shorten the prompt\n")


# ---- the API ----------------------------------------------------------------------------------

SYSTEM = "Be brief."


def test_the_api_runs_past_the_context_keeping_the_system_message():
    backend, engine, tok = make_backend(ANSWER, context_tokens=256)
    budget = 256 - min_reply_tokens(256, ServerConfig().default_max_tokens)
    messages = [{"role": "system", "content": SYSTEM}]
    dropped, streamed = [], []
    with TestClient(create_app(backend)) as c:
        for i in range(1, 7):
            messages.append(user(QUESTION.format(i)))
            r = c.post("/v1/chat/completions", json={"messages": messages, "stream": i % 2 == 0})
            assert r.status_code == 200, r.text
            assert r.headers["x-lockstep-context-tokens"] == "256"
            dropped.append(int(r.headers["x-lockstep-dropped-turns"]))
            if i % 2 == 0:
                streamed.append(json.loads(parse_sse(r.text)[-2])["choices"][0]["finish_reason"])
            else:
                body = r.json()
                assert body["choices"][0]["finish_reason"] == "stop"
                assert body["usage"]["prompt_tokens"] == len(engine.calls[-1]["prompt_ids"])
            # What the model was asked: the system message and the latest turns that fit.
            asked = [text_message(m["role"], m["content"]) for m in messages]
            expected = oldest_first_reference(asked, backend.prompt_tokens, budget)
            assert dropped[-1] == expected
            kept = [asked[0], *asked[1 + 2 * expected:]]
            assert engine.calls[-1]["prompt_ids"] == tok.render_for_completion({"messages": kept})
            messages.append({"role": "assistant", "content": ANSWER})
    # The client sends the whole history each time: the header counts what this request left out.
    assert dropped == [0, 0, 1, 2, 3, 4] and streamed == ["stop"] * 3


def test_the_api_refuses_what_cannot_fit_with_a_400_in_openai_shape():
    backend, engine, _ = make_backend(ANSWER, context_tokens=256)
    with TestClient(create_app(backend)) as c:
        for stream in (False, True):
            r = c.post("/v1/chat/completions", json={"messages": [user("hi"), {"role": "assistant", "content": "yo"},
                                                                  user("x" * 130)], "stream": stream})
            assert r.status_code == 400, r.text
            assert r.json() == {"error": {
                "message": "messages: the latest user message is 134 tokens with the chat template, over the 128 the "
                           "model's 256-token context leaves once 128 are kept for the reply: shorten it and start "
                           "a new conversation",
                "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}
        # An explicit max_tokens is room asked for: older turns are left out until the reply has it.
        messages = [user("a" * 60), {"role": "assistant", "content": "b" * 60}, user("c" * 60)]
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 150})
        assert r.status_code == 200 and r.headers["x-lockstep-dropped-turns"] == "1", r.text
        assert engine.calls[-1]["max_tokens"] == 150
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 60})
        assert r.status_code == 200 and r.headers["x-lockstep-dropped-turns"] == "0", r.text
    assert len(engine.calls) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_cut_at_the_context_or_max_tokens_finishes_with_length(stream):
    tok = byte_tokenizer()
    endless = ScriptedEngine(script_for(tok, "word ", end=False), repeat=True)
    backend = EngineBackend(endless, tok, model_id="endless", context_tokens=256)
    room = 256 - backend.prompt_tokens([text_message("user", "hi")])
    with TestClient(create_app(backend)) as c:
        for extra, tokens in (({}, room), ({"max_tokens": 7}, 7)):  # the server's default fitted to the room
            r = c.post("/v1/chat/completions", json={"messages": [user("hi")], "stream": stream,
                                                     "stream_options": {"include_usage": True}} | extra)
            assert r.status_code == 200, r.text
            if stream:
                chunks = [json.loads(e) for e in parse_sse(r.text)[:-1]]
                finish, usage = chunks[-2]["choices"][0]["finish_reason"], chunks[-1]["usage"]
            else:
                finish, usage = r.json()["choices"][0]["finish_reason"], r.json()["usage"]
            assert finish == "length" and usage["completion_tokens"] == tokens


def test_cross_origin_pages_may_read_the_context_headers():
    backend = make_backend("ok")[0]
    with TestClient(create_app(backend, ServerConfig(allowed_origins=("http://localhost:5173",)))) as c:
        r = c.post("/v1/chat/completions", json={"messages": [user("hi")]}, headers={"Origin": "http://localhost:5173"})
    exposed = r.headers["access-control-expose-headers"].lower()
    assert "x-lockstep-dropped-turns" in exposed and "x-lockstep-context-tokens" in exposed
