"""Terminal chat and the chat backend seam: incremental UTF-8 decoding, stop strings, the
engine-backed backend (with a scripted engine standing in for sampling) and the command loop."""

from __future__ import annotations

import io
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.data.records import text_message
from lockstep.infer.chat import (
    ChatError,
    Delta,
    EngineBackend,
    IncrementalDecoder,
    SamplingSettings,
    check_messages,
    cut_at_stop_strings,
    run_chat,
)
from lockstep.tokenizer.kinds import train_tokenizer


class ScriptedEngine:
    """Stands in for lockstep.infer.engine.Engine: yields a fixed token script one step at a time (or
    repeats it forever), recording each call and counting the steps it actually took."""

    def __init__(self, script: list[int], *, repeat: bool = False, step_s: float = 0.0):
        self.script = script
        self.repeat = repeat
        self.step_s = step_s
        self.calls: list[dict] = []
        self.steps = 0
        self.closed = threading.Event()

    def generate(self, prompt_ids, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, top_p=1.0,
                 seed=0, use_tools=True):
        self.calls.append({"prompt_ids": list(prompt_ids), "num_samples": num_samples, "max_tokens": max_tokens,
                           "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
                           "use_tools": use_tools})
        try:
            i = 0
            while i < len(self.script):
                if self.step_s:
                    time.sleep(self.step_s)
                self.steps += 1
                yield [self.script[i]], [1]
                i += 1
                if self.repeat and i == len(self.script):
                    i = 0
        finally:
            self.closed.set()


def byte_tokenizer():
    return train_tokenizer("byte", [])


def script_for(tok, text: str, *, end: bool = True) -> list[int]:
    ids = tok.encode(text)
    return ids + [tok.encode_special("<|assistant_end|>")] if end else ids


def make_backend(text: str = "Hi there! ☃ 世界 🙂", *, context_tokens: int = 512, **engine_kw):
    tok = byte_tokenizer()
    engine = ScriptedEngine(script_for(tok, text), **engine_kw)
    return EngineBackend(engine, tok, model_id="scripted", context_tokens=context_tokens), engine, tok


# ---- incremental decoding -------------------------------------------------------------------


def test_decoder_emits_only_whole_characters():
    tok = byte_tokenizer()
    text = "é 世界 🙂!"
    decoder = IncrementalDecoder(tok.decode)
    pieces = [decoder.push(i) for i in tok.encode(text)]
    pieces.append(decoder.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # The 4-byte emoji arrives as three empty pieces, then the whole character.
    emoji_at = len("é 世界 ".encode())
    assert pieces[emoji_at : emoji_at + 4] == ["", "", "", "🙂"]


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_decoder_reassembles_any_text(text):
    tok = byte_tokenizer()
    decoder = IncrementalDecoder(tok.decode)
    pieces = [decoder.push(i) for i in tok.encode(text)] + [decoder.flush()]
    assert "".join(pieces) == text


def test_decoder_keeps_context_for_tokenizers_that_strip_a_leading_space():
    # Like sentencepiece: a lone word token decodes without its leading space.
    vocab = {0: "▁Hello", 1: "▁world", 2: "!"}

    def decode(ids):
        return "".join(vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")

    decoder = IncrementalDecoder(decode)
    assert [decoder.push(i) for i in (0, 1, 2)] == ["Hello", " world", "!"]


def test_decoder_gives_up_on_invalid_bytes_and_moves_on():
    tok = byte_tokenizer()
    decoder = IncrementalDecoder(tok.decode, max_pending_tokens=4)
    out = [decoder.push(i) for i in (0xF0, 0x9F, 0x99, 0x41)]  # a cut 4-byte sequence, then "A"
    assert out[:3] == ["", "", ""]
    assert out[3].endswith("A") and "\ufffd" in out[3]


# ---- stop strings ----------------------------------------------------------------------------


def pieces(*texts: str, finish: str = "length"):
    """Deltas of one token each, the last with `finish`; records whether it was closed."""
    closed = []

    def gen():
        try:
            for i, text in enumerate(texts):
                yield Delta(text, 1, finish if i == len(texts) - 1 else None)
        finally:
            closed.append(True)

    return gen(), closed


@pytest.mark.parametrize("texts, stops, want, finish, tokens", [
    (("Hel", "lo ", "wor", "ld"), ("o w",), ["Hel", "l", ""], "stop", 3),  # split across three deltas
    (("ab", "c", "d"), ("cx", "bcd"), ["a", "", ""], "stop", 3),  # "b", then "bc", held for "bcd"
    (("ab", "c", "d"), ("cx",), ["ab", "", "cd"], "length", 3),  # a held prefix that never completes
    (("stop here",), ("stop",), [""], "stop", 1),
    (("a", "b"), (), ["a", "b"], "length", 2),
])
def test_stop_strings_cut_the_reply_and_close_the_generation(texts, stops, want, finish, tokens):
    deltas, closed = pieces(*texts)
    out = list(cut_at_stop_strings(deltas, stops))
    assert [d.text for d in out] == want
    assert out[-1].finish_reason == finish and sum(d.tokens for d in out) == tokens
    assert closed == [True]
    joined = "".join(texts)
    cuts = [joined.find(s) for s in stops if s in joined]
    assert "".join(want) == (joined[: min(cuts)] if cuts else joined)


# ---- the engine-backed backend ----------------------------------------------------------------


def test_backend_streams_the_reply_and_stops_at_assistant_end():
    backend, engine, tok = make_backend("Hi ☃ 🙂")
    messages = [text_message("user", "hello")]
    deltas = list(backend.stream(messages, SamplingSettings(temperature=0.0, top_k=0, max_tokens=64, seed=7)))
    assert "".join(d.text for d in deltas) == "Hi ☃ 🙂"
    assert deltas[-1].finish_reason == "stop"
    assert sum(d.tokens for d in deltas) == len("Hi ☃ 🙂".encode()) + 1
    call = engine.calls[0]
    assert call["prompt_ids"] == tok.render_for_completion({"messages": messages})
    assert call["top_k"] is None and call["temperature"] == 0.0 and call["seed"] == 7 and call["use_tools"]
    assert engine.closed.is_set()


def test_backend_writes_tool_calls_as_annotations():
    tok = byte_tokenizer()
    sp = tok.get_special_tokens()
    script = (tok.encode("x ") + [sp["<|python_start|>"]] + tok.encode("48/2") + [sp["<|python_end|>"]]
              + [sp["<|output_start|>"]] + tok.encode("24") + [sp["<|output_end|>"]] + tok.encode(" ok")
              + [sp["<|assistant_end|>"]])
    backend = EngineBackend(ScriptedEngine(script), tok, model_id="t", context_tokens=256)
    text = "".join(d.text for d in backend.stream([text_message("user", "q")], SamplingSettings()))
    assert text == "x <<48/2=24>> ok"


def test_backend_stops_at_max_tokens_and_clips_to_the_context():
    backend, engine, tok = make_backend("abcdefghijklmnop")
    deltas = list(backend.stream([text_message("user", "hi")], SamplingSettings(max_tokens=5)))
    assert "".join(d.text for d in deltas) == "abcde"
    assert deltas[-1].finish_reason == "length"
    assert engine.steps == 5 and engine.closed.is_set()

    prompt_tokens = backend.prompt_tokens([text_message("user", "hi")])
    small, engine2, _ = make_backend("abcdefghijklmnop", context_tokens=prompt_tokens + 3)
    deltas = list(small.stream([text_message("user", "hi")], SamplingSettings(max_tokens=100)))
    assert engine2.calls[0]["max_tokens"] == 3
    assert "".join(d.text for d in deltas) == "abc"


def test_backend_refuses_a_conversation_that_fills_the_context():
    backend, _, _ = make_backend(context_tokens=8)
    with pytest.raises(ChatError, match="start a new conversation"):
        list(backend.stream([text_message("user", "a long enough question")], SamplingSettings()))


@pytest.mark.parametrize(
    "roles, match",
    [
        ([], "no messages"),
        (["system"], "only a system message"),
        (["user", "user"], "expected"),
        (["assistant"], "expected"),
        (["user", "assistant"], "last message must be from the user"),
    ],
)
def test_check_messages_says_what_is_wrong(roles, match):
    with pytest.raises(ChatError, match=match):
        check_messages([text_message(r, "x") for r in roles])


def test_check_messages_accepts_a_well_formed_conversation():
    check_messages([text_message(r, "x") for r in ("system", "user", "assistant", "user")])


@pytest.mark.parametrize(
    "setting, match",
    [
        ({"temperature": float("nan")}, "temperature=nan must be a finite number >= 0"),
        ({"temperature": float("inf")}, "temperature=inf must be a finite number >= 0"),
        ({"temperature": -0.5}, "temperature=-0.5 must be a finite number >= 0"),
        ({"top_k": -1}, "top_k=-1 must be >= 0"),
        ({"top_p": 0.0}, r"top_p=0.0 must be a finite number in \(0, 1\]"),
        ({"top_p": float("nan")}, r"top_p=nan must be a finite number in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1.5 must be a finite number in \(0, 1\]"),
        ({"max_tokens": 0}, "max_tokens=0 must be >= 1"),
    ],
)
def test_sampling_settings_refuse_what_cannot_be_sampled(setting, match):
    with pytest.raises(ChatError, match=match):
        SamplingSettings(**setting)
    assert SamplingSettings(temperature=1e-40).temperature == 1e-40  # tiny is fine: the engine samples it greedily


# ---- the terminal loop ------------------------------------------------------------------------


class RecordingBackend:
    """Wraps a backend to record the messages and settings of each reply."""

    def __init__(self, inner):
        self.inner = inner
        self.model_id = inner.model_id
        self.context_tokens = inner.context_tokens
        self.seen: list[tuple[list[dict], SamplingSettings]] = []

    def count_tokens(self, text):
        return self.inner.count_tokens(text)

    def prompt_tokens(self, messages):
        return self.inner.prompt_tokens(messages)

    def stream(self, messages, settings):
        self.seen.append(([dict(m) for m in messages], settings))
        return self.inner.stream(messages, settings)


def test_chat_loop_multi_turn_commands_and_settings():
    backend = RecordingBackend(make_backend("ok ☃")[0])
    out = io.StringIO()
    lines = ["hello", "/temperature 1.5", "/topk 7", "again", "/help", "/clear", "fresh", "/bogus",
             "/temperature 9", "/topk x", "/quit", "never read"]
    messages = run_chat(backend, SamplingSettings(seed=10), lines=lines, out=out)
    text = out.getvalue()
    assert text.count("ok ☃") == 3
    assert "/temperature X" in text and "unknown command '/bogus'" in text
    assert "must be from 0 to 2" in text and "whole number" in text
    (m1, s1), (m2, s2), (m3, s3) = backend.seen
    assert [m["role"] for m in m1] == ["user"]
    assert [m["role"] for m in m2] == ["user", "assistant", "user"]
    assert m2[1]["content"][0]["text"] == "ok ☃"
    assert [m["role"] for m in m3] == ["user"], "/clear must start a new conversation"
    assert (s1.temperature, s1.top_k) == (0.6, 50)
    assert (s2.temperature, s2.top_k) == (1.5, 7)
    assert [s.seed for s in (s1, s2, s3)] == [10, 11, 12]
    assert [m["role"] for m in messages] == ["user", "assistant"]


def test_chat_one_shot_prompt():
    backend, engine, tok = make_backend("42")
    out = io.StringIO()
    messages = run_chat(backend, SamplingSettings(), lines=[], out=out, prompt="what is 6*7?")
    assert out.getvalue() == "42\n"
    assert messages[-1] == text_message("assistant", "42")
    assert len(engine.calls) == 1
