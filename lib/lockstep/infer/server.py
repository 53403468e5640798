"""HTTP serving of a chat backend: an OpenAI-compatible chat API (streaming SSE and not), model
listing, health, and the single-page UI from lockstep/infer/static. Not the sampling (lockstep.infer.engine)
and not the process runner (the `lockstep serve` command starts uvicorn). Over 400 lines because
the request schema, its limits, the body reader and the error bodies a client sees are the API's
contract and read best next to the two endpoints that apply them."""

import asyncio
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lockstep.core.config import FieldError, check_range
from lockstep.data.records import text_message
from lockstep.infer.chat import (
    ChatBackend,
    ChatError,
    Delta,
    SamplingSettings,
    check_messages,
    check_person_setting,
    cut_at_stop_strings,
)
from lockstep.infer.context import ContextFullError, FittedConversation, fit_conversation, min_reply_tokens
from lockstep.infer.sampling import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SEED,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
)

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
# The UI loads nothing from elsewhere; the policy makes a stray external reference fail loudly.
CSP = ("default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'; "
       "frame-ancestors 'none'")
# Default character cap of a message per token of max_message_tokens. Text averages 2-4 characters
# per token (the tiny preset's 4k-id BPE: 1.9-3.3 bytes per token, data/metrics/tokenizer.json;
# large vocabularies about 4 on English), so 16 leaves room for long tokens while bounding what
# one message costs to tokenize.
MESSAGE_CHARS_PER_TOKEN = 16
# Response headers of a completion: how many of the oldest user+assistant pairs were left out to fit
# the model's context (0 when none), and that context's size. Headers, so OpenAI clients, which
# read the body only, are untouched by them.
DROPPED_TURNS_HEADER = "x-lockstep-dropped-turns"
CONTEXT_TOKENS_HEADER = "x-lockstep-context-tokens"
# Stop strings a request may give, as OpenAI documents ("up to 4 sequences"), and the characters of
# each: the text that may begin one is held back from the stream, so its length bounds that delay.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class ServerConfig:
    """Limits and defaults of the chat API. Token limits are counted with the model's tokenizer."""

    max_messages: int = 64  # messages per request
    max_message_tokens: int = 2048  # tokens in one message's text
    # Characters in one message's text, refused before any token is counted; 0 = 16 per token of
    # max_message_tokens (MESSAGE_CHARS_PER_TOKEN).
    max_message_chars: int = 0
    # Rendered prompt tokens at most, the oldest turns left out to fit; 0 = what the model's context
    # leaves after the reply's room (lockstep.infer.context).
    max_conversation_tokens: int = 0
    max_reply_tokens: int = 1024  # the largest max_tokens a request may ask for
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # max_tokens when a request does not say
    max_body_bytes: int = 1 << 20  # larger request bodies are refused with 413
    workers: int = 1  # generations running at once
    max_queued: int = 4  # requests waiting for a worker; more are refused with 503
    queue_timeout_s: float = 30.0  # a queued request waits this long for a worker, then 503
    default_temperature: float = DEFAULT_TEMPERATURE
    default_top_k: int = DEFAULT_TOP_K
    default_seed: int = DEFAULT_SEED
    allowed_origins: tuple[str, ...] = ()  # CORS origins allowed to call the API; empty = same-origin only

    def __post_init__(self) -> None:
        # FieldError names the field; `lockstep serve` names the option that set it.
        check_range("max_messages", self.max_messages, ge=1, why="messages per request")
        check_range("max_message_tokens", self.max_message_tokens, ge=1, why="tokens in one message's text")
        check_range(
            "max_message_chars",
            self.max_message_chars,
            ge=0,
            why=f"characters in one message's text; 0 = {MESSAGE_CHARS_PER_TOKEN} per token of max_message_tokens",
        )
        check_range("max_conversation_tokens", self.max_conversation_tokens, ge=0,
                    why="rendered prompt tokens, the oldest turns left out to fit; 0 = what the context leaves")
        check_range("max_reply_tokens", self.max_reply_tokens, ge=1, why="the largest max_tokens a request may ask for")
        check_range("default_max_tokens", self.default_max_tokens, ge=1, le=self.max_reply_tokens,
                    why="max_tokens when a request does not say, at most max_reply_tokens")
        check_range("max_body_bytes", self.max_body_bytes, ge=1, why="larger request bodies are refused with 413")
        check_range("workers", self.workers, ge=1, why="generations running at once")
        check_range(
            "max_queued", self.max_queued, ge=0, why="requests waiting for a worker; 0 refuses all but the running ones"
        )
        check_range("queue_timeout_s", self.queue_timeout_s, ge=0, why="seconds a queued request waits for a worker")
        check_range("default_temperature", self.default_temperature, ge=0, le=MAX_TEMPERATURE, why="0 is greedy")
        check_range("default_top_k", self.default_top_k, ge=0, le=MAX_TOP_K, why="0 = no top-k cut")
        if not 0 <= self.default_seed <= MAX_SEED:
            raise FieldError("default_seed", self.default_seed, f"must be an integer from 0 to {MAX_SEED}")
        if "*" in self.allowed_origins:
            raise FieldError("allowed_origins", list(self.allowed_origins),
                             "may not contain '*': list the origins that may call the API")

    @property
    def message_char_limit(self) -> int:
        return self.max_message_chars or MESSAGE_CHARS_PER_TOKEN * self.max_message_tokens


class RequestLimitError(ValueError):
    """A request over a limit that takes token counts to check; `param` names where
    (`messages.0.content`, `max_tokens`), as in a 422 from the schema. A conversation the context
    cannot hold is a 400 with code `context_length_exceeded`, as OpenAI answers it."""

    def __init__(self, param: str, message: str, *, status: int = 422, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


class Busy(Exception):
    """Every worker is taken and the queue is full (or the wait ran out)."""


class WorkerPool:
    """At most `workers` generations at once, at most `max_queued` requests waiting for one; the
    rest are refused at once so callers see 503 instead of an ever-growing queue."""

    def __init__(self, workers: int, max_queued: int, queue_timeout_s: float):
        self.workers = workers
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self._slots = threading.Semaphore(workers)
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._executor: ThreadPoolExecutor | None = None

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return self._waiting

    async def acquire(self) -> None:
        if self._slots.acquire(blocking=False):
            with self._lock:
                self._running += 1
            return
        with self._lock:
            if self._waiting >= self.max_queued:
                raise Busy
            self._waiting += 1
        try:
            # A thread waits, not the event loop; queued waiters are bounded by max_queued.
            got = await anyio.to_thread.run_sync(lambda: self._slots.acquire(timeout=self.queue_timeout_s))
        finally:
            with self._lock:
                self._waiting -= 1
        if not got:
            raise Busy
        with self._lock:
            self._running += 1

    def release(self) -> None:
        with self._lock:
            self._running -= 1
        self._slots.release()

    def submit(self, fn: Any) -> None:
        # Created on demand: an app outlives a lifespan cycle (test clients start and stop one
        # per use), and must keep serving after the previous executor was shut down.
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="lockstep-generate")
            self._executor.submit(fn)

    def shutdown(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


class BodySizeLimit:
    """Refuses request bodies over `max_body_bytes` with 413, by Content-Length up front and by
    counting the bytes of chunked bodies as they arrive."""

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared_bytes = int(value)
                except ValueError:
                    await _send_error(send, 400, "Content-Length is not a number", "invalid_request_error")
                    return
                if declared_bytes > self.max_body_bytes:
                    await _send_error(send, 413, self._too_large(), "request_too_large")
                    return
        received_bytes = 0

        async def counting_receive() -> Message:
            nonlocal received_bytes
            message = await receive()
            if message["type"] == "http.request":
                received_bytes += len(message.get("body", b""))
                if received_bytes > self.max_body_bytes:
                    # FastAPI passes HTTPException raised while reading the body straight through.
                    raise StarletteHTTPException(413, self._too_large())
            return message

        await self.app(scope, counting_receive, send)

    def _too_large(self) -> str:
        return f"request body is over {self.max_body_bytes} bytes: send fewer or shorter messages"


class SecurityHeaders:
    """Adds the content-security and no-sniff headers to every response. A plain ASGI wrapper, so
    streamed responses pass through untouched and still see the client disconnect."""

    HEADERS = [
        (b"content-security-policy", CSP.encode()),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
    ]

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(n, v) for n, v in self.HEADERS if n not in present]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def _send_error(send: Send, status: int, message: str, kind: str) -> None:
    body = json.dumps(_error_body(message, kind)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- reading the request body ---------------------------------------------------------------
#
# FastAPI would parse the body with json.loads and answer 400 "There was an error parsing the
# body" for anything but a syntax error: bytes that are not UTF-8, an integer past Python's
# 4300-digit conversion limit, nesting deeper than the interpreter's recursion limit. Every
# malformed body is instead a 422 in the API's own error shape, with `param` naming where: the key
# at fault when it can be placed, else `body`.

# The integers of this API fit 19 digits (a seed is at most 2**63 - 1); longer digit strings are
# kept as _LongNumber, which no field accepts, so the schema refuses them at their own key.
MAX_INT_DIGITS = 100
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800-\udfff in JSON's escape syntax
_SURROGATE = re.compile("[\ud800-\udfff]")


class _LongNumber:
    """An integer of the body too long to be any setting of this API, by its digit count."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _parse_int(digits: str) -> int | _LongNumber:
    return int(digits) if len(digits) <= MAX_INT_DIGITS else _LongNumber(len(digits.lstrip("-")))


class BodyError(StarletteHTTPException):
    """A request body that is no JSON this API can read, answered with 422. `param` names where
    (`messages.0.content`), or is `body` for the body as a whole. An HTTPException, so that
    FastAPI passes it through from the body reader untouched."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(422, message)
        self.param = param


def parse_body(raw: bytes) -> Any:
    """The JSON value of a request body, or BodyError saying what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError("body", f"the request body is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start}; "
                                "send the JSON encoded as UTF-8") from None
    text = text.removeprefix("\ufeff")  # a byte order mark, which RFC 8259 lets a reader ignore
    try:
        value = json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise BodyError("body", f"the request body is not valid JSON: {e.msg} at character {e.pos}") from None
    except RecursionError:
        raise BodyError(_too_deep_key(text), "arrays and objects nest too deeply to read; a request nests five levels "
                                             "at most (the body, messages, a message, its parts, a part)") from None
    # A lone surrogate can only come from a \u escape (UTF-8 cannot encode one), so bodies
    # without such an escape skip the walk.
    if _SURROGATE_ESCAPE.search(text):
        where = _lone_surrogate(value)
        if where is not None:
            param, what, index, char = where
            raise BodyError(param, f"{param}: {what} holds an unpaired surrogate \\u{ord(char):04x} at character "
                                   f"{index}, which encodes no character: send the text as UTF-8, or escape a "
                                   "character beyond U+FFFF as a pair of surrogates")
    return value


def _too_deep_key(text: str) -> str:
    """The top-level key of a JSON object whose value nests too deeply to parse, found by decoding
    the values one key at a time; `body` when the body is no object or the key cannot be told."""
    decoder = json.JSONDecoder()
    ws = re.compile(r"[ \t\n\r]*")
    try:
        i = ws.match(text, 0).end()
        if text[i] != "{":
            return "body"
        i = ws.match(text, i + 1).end()
        while text[i] == '"':
            key, i = json.decoder.scanstring(text, i + 1)
            i = ws.match(text, i).end()
            if text[i] != ":":
                return "body"
            try:
                _, i = decoder.raw_decode(text, ws.match(text, i + 1).end())
            except RecursionError:
                return key
            i = ws.match(text, i).end()
            if text[i] == ",":
                i = ws.match(text, i + 1).end()
    except (ValueError, IndexError):  # broken elsewhere too: the body as a whole
        pass
    return "body"


def _lone_surrogate(value: Any) -> tuple[str, str, int, str] | None:
    """(where, "text" or "a key", index, the surrogate) of the first string holding an unpaired
    surrogate, in document order; walked with a stack, since the body may nest almost as deep as
    the parser allows. A key is reported at the object that holds it: the key itself cannot be
    written back into a JSON answer."""

    def join(path: str, part: object) -> str:
        return f"{path}.{part}" if path else str(part)

    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, str):
            found = _SURROGATE.search(node)
            if found:
                return path or "body", "the text", found.start(), found.group()
        elif isinstance(node, dict):
            for key in node:
                found = _SURROGATE.search(key)
                if found:
                    return path or "body", "a key", found.start(), found.group()
            stack.extend(reversed([(join(path, key), child) for key, child in node.items()]))
        elif isinstance(node, list):
            stack.extend(reversed([(join(path, i), child) for i, child in enumerate(node)]))
    return None


class _BodyRequest(Request):
    """A request whose JSON body is read by parse_body."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_body(await self.body())
        return self._json


class _BodyRoute(APIRoute):
    """Routes that read their JSON body with parse_body (FastAPI's custom-request pattern)."""

    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def read_with_parse_body(request: Request) -> Response:
            return await handler(_BodyRequest(request.scope, request.receive))

        return read_with_parse_body


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "true or false", type(None): "null"}
# The union `str | list[TextPart]` reports one error per branch, its loc naming the branch.
_UNION_BRANCHES = frozenset({"str", "list[TextPart]"})
_RANGE_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})


def _out_of_range(param: str, value: Any, max_reply_tokens: int) -> str | None:
    """The words for a setting out of its range, as `lockstep chat` says them for the same setting;
    None for a field the schema's own words fit."""
    if param in ("temperature", "top_k", "top_p"):
        try:
            check_person_setting(param, value, name=param)
        except ChatError as e:
            return str(e)
    if param in ("max_tokens", "max_completion_tokens"):
        return f"{param} must be from 1 to {max_reply_tokens} (the longest reply this server gives), got {value}"
    if param == "n":
        return (f"n={value}: this server samples one choice per request; send {value} requests, each with its "
                "own seed, for more")
    return None


def validation_error_body(errors: list[dict], *, max_reply_tokens: int) -> dict:
    """The 422 body for schema errors: one error, with `param` naming where and a message saying
    what is wrong, never echoing the input (it may be a long message body). A number out of range
    is said in lockstep's words (`temperature must be from 0 to 2 (0 is greedy), got 2.5`)."""
    if not errors:
        return _error_body("invalid request", "invalid_request_error", "body")
    # Of a union's branch errors the deepest is from the branch the input was meant for (a list of
    # parts that holds a bad part), not "should be a valid string".
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = [p for p in first.get("loc", ()) if p != "body"]
    param = ".".join(str(p) for p in loc if p not in _UNION_BRANCHES) or "body"
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    given = first.get("input")
    if isinstance(given, _LongNumber):
        message = f"a {given.digits}-digit number is out of range for any setting of this API"
    elif loc and loc[-1] in _UNION_BRANCHES:
        message = 'should be a string, or a list of text parts {"type": "text", "text": "..."}'
    elif param == "body":
        if first.get("type") == "missing":
            message = 'the request body is empty: send a JSON object such as {"messages": [...]}'
        elif isinstance(given, (bytes, bytearray)):
            message = "the request body was not read as JSON: send it with Content-Type: application/json"
        else:
            message = ("the request body must be a JSON object with a messages list, got "
                       f"{_JSON_TYPES.get(type(given), 'another value')}")
        return _error_body(message, "invalid_request_error", param)
    if first.get("type") in _RANGE_ERRORS:
        words = _out_of_range(param, given, max_reply_tokens)
        if words is not None:
            return _error_body(words, "invalid_request_error", param)
    return _error_body(f"{param}: {message}", "invalid_request_error", param)


def sse_event(payload: dict | str) -> str:
    """One server-sent event. JSON escapes newlines, so no token text (a blank line, "data: ")
    can end the event early or start a forged one."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    assert "\n" not in data and "\r" not in data
    return f"data: {data}\n\n"


def _message_text(content: str | list) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def _as_conversation(messages: list[Any]) -> list[dict]:
    """Request messages (OpenAI shape: text or text parts) as the project's conversation messages."""
    return [text_message(m.role, _message_text(m.content)) for m in messages]


def build_request_model(config: ServerConfig, backend: ChatBackend) -> type[BaseModel]:
    """The request schema for POST /v1/chat/completions with this server's limits in it. The
    validators check shape, ranges, role order and a character cap per message, all cheap enough
    for the event loop; the token limits, which need the tokenizer, are checked by
    `fit`, which raises RequestLimitError."""
    context_tokens = backend.context_tokens
    conversation_limit = config.max_conversation_tokens or None
    char_limit = config.message_char_limit

    class TextPart(BaseModel):
        type: Literal["text"]
        text: str = Field(max_length=char_limit)

    class ChatMessage(BaseModel):
        role: Literal["system", "user", "assistant"]
        content: str | list[TextPart] = Field(
            description=f"the message text; at most {config.max_message_tokens} tokens and {char_limit} characters",
        )
        name: str | None = Field(default=None, max_length=64)

        @field_validator("content")
        @classmethod
        def _message_chars(cls, content: Any) -> Any:
            # Before any token is counted: the tokenizer never sees more than this per message.
            n_chars = len(_message_text(content))
            if n_chars > char_limit:
                raise ValueError(f"message is {n_chars} characters, the limit is {char_limit}: shorten it")
            return content

    StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]

    class StreamOptions(BaseModel):
        include_usage: bool = Field(default=False, strict=True)

    # strict: JSON true is not the integer 1, nor "5" the number 5; inf and NaN are no numbers.
    class ChatCompletionRequest(BaseModel):
        model_config = ConfigDict(extra="ignore")

        model: str | None = Field(default=None, max_length=256, description="ignored: this server has one model")
        messages: list[ChatMessage] = Field(
            min_length=1,
            max_length=config.max_messages,
            description="optional system message, then user/assistant alternating, ending with user; the oldest "
            f"user/assistant pairs that do not fit the model's {context_tokens}-token context are left out "
            f"(response header {DROPPED_TURNS_HEADER})",
        )
        stream: bool = Field(default=False, strict=True)
        stream_options: StreamOptions | None = None
        max_tokens: int | None = Field(
            default=None, ge=1, le=config.max_reply_tokens, strict=True,
            description="room the reply is given: the oldest turns are left out to make it; refused, not "
            "clipped, when the latest user message alone leaves less",
        )
        max_completion_tokens: int | None = Field(default=None, ge=1, le=config.max_reply_tokens, strict=True,
                                                  description="as max_tokens, which it overrides")
        temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE, strict=True, allow_inf_nan=False)
        top_k: int | None = Field(default=None, ge=0, le=MAX_TOP_K, strict=True)
        top_p: float | None = Field(default=None, gt=0.0, le=1.0, strict=True, allow_inf_nan=False)
        seed: int | None = Field(default=None, ge=0, le=MAX_SEED, strict=True)
        n: int | None = Field(default=None, ge=1, le=1, strict=True, description="only one choice per request")
        stop: list[StopString] | None = Field(
            default=None, max_length=MAX_STOP_STRINGS,
            description="a string or a list of them; the reply ends before the first that appears in its text "
            "(finish_reason stop), which is left out",
        )

        @field_validator("stop", mode="before")
        @classmethod
        def _one_stop(cls, stop: Any) -> Any:
            return [stop] if isinstance(stop, str) else stop

        @field_validator("messages")
        @classmethod
        def _roles(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
            try:
                check_messages(_as_conversation(messages))
            except ChatError as e:
                raise ValueError(str(e)) from None
            return messages

        def conversation(self) -> list[dict]:
            return _as_conversation(self.messages)

        def fit(self) -> tuple[FittedConversation, SamplingSettings]:
            """Check the token limit of each message, fit the conversation into the context
            (lockstep.infer.context: the oldest whole turns left out) and return it with the
            sampling settings. A max_tokens the request sets is room it asks for, so turns are left
            out until the reply has all of it (prompt plus max_tokens within the context, as OpenAI
            counts); the server's default asks min_reply_tokens and is fitted into what is left.
            Tokenizing is the costly part of a request's checks: call this off the event loop."""
            for i, m in enumerate(self.messages):
                n_tokens = backend.count_tokens(_message_text(m.content))
                if n_tokens > config.max_message_tokens:
                    raise RequestLimitError(
                        f"messages.{i}.content",
                        f"message is {n_tokens} tokens, the limit is {config.max_message_tokens}: shorten it",
                    )
            param = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
            asked = getattr(self, param)
            reply_tokens = asked if asked is not None else min_reply_tokens(context_tokens, config.default_max_tokens)
            try:
                fitted = fit_conversation(self.conversation(), prompt_tokens=backend.prompt_tokens,
                                          context_tokens=context_tokens, reply_tokens=reply_tokens,
                                          max_prompt_tokens=conversation_limit)
            except ContextFullError as e:
                # The parameter at fault: the max_tokens asked for when less would fit, else the messages.
                room_tokens = context_tokens - e.prompt_tokens
                if asked is not None and room_tokens >= 1:
                    at_fault = param
                    message = (f"{param}={asked} does not fit: {e.sizes()}; ask for at most {room_tokens}, or "
                               "start a new conversation with a shorter message")
                else:
                    at_fault, message = "messages", f"{e.sizes()}: shorten it and start a new conversation"
                raise RequestLimitError(at_fault, message, status=400, code="context_length_exceeded") from None
            settings = SamplingSettings(
                temperature=config.default_temperature if self.temperature is None else self.temperature,
                top_k=config.default_top_k if self.top_k is None else self.top_k,
                top_p=DEFAULT_TOP_P if self.top_p is None else self.top_p,
                max_tokens=asked if asked is not None else min(config.default_max_tokens, fitted.room_tokens),
                seed=config.default_seed if self.seed is None else self.seed,
            )
            return fitted, settings

    return ChatCompletionRequest


class _Generation:
    """One reply generated on a pool thread and handed to the event loop delta by delta. Setting
    `cancel` stops it after the engine step in progress."""

    def __init__(self, pool: WorkerPool, deltas: Iterator[Delta]):
        self.pool = pool
        self.cancel = threading.Event()
        self.queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._deltas = deltas
        pool.submit(self._run)

    def _put(self, item: tuple[str, Any]) -> None:
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            self.cancel.set()

    def _run(self) -> None:
        try:
            for delta in self._deltas:
                if self.cancel.is_set():
                    break
                self._put(("delta", delta))
        except ChatError as e:
            self._put(("error", e))
        except Exception as e:
            log.exception("generation failed")
            self._put(("error", e))
        finally:
            try:
                close = getattr(self._deltas, "close", None)
                if close is not None:
                    close()
            finally:
                self.pool.release()
                self._put(("end", None))

    async def next(self) -> tuple[str, Any]:
        return await self.queue.get()

    async def watch_disconnect(self, request: Request) -> None:
        """Cancel the generation when the client goes away. For non-streaming replies; a streamed
        reply is cancelled by Starlette, which listens for the disconnect itself."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.cancel.set()
                self._put(("disconnect", None))
                return


def create_app(backend: ChatBackend, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving `backend` under `config`'s limits."""
    config = config or ServerConfig()
    pool = WorkerPool(config.workers, config.max_queued, config.queue_timeout_s)
    RequestModel = build_request_model(config, backend)
    context_tokens = backend.context_tokens

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        pool.shutdown()

    app = FastAPI(title="lockstep", version="1", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.router.route_class = _BodyRoute  # before any route is added: every body goes through parse_body
    app.state.pool = pool
    app.state.backend = backend
    app.state.config = config
    app.add_middleware(BodySizeLimit, max_body_bytes=config.max_body_bytes)
    if config.allowed_origins:
        # Credentials stay off: the API has no cookies, and with them any listed site could act as the user.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_credentials=False,
            allow_methods=["GET", "POST"],
            allow_headers=["content-type", "authorization"],
            expose_headers=[DROPPED_TURNS_HEADER, CONTEXT_TOKENS_HEADER],
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error_body(list(exc.errors()), max_reply_tokens=config.max_reply_tokens),
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, BodyError):
            return JSONResponse(_error_body(str(exc.detail), "invalid_request_error", exc.param), status_code=422)
        kind = "request_too_large" if exc.status_code == 413 else "invalid_request_error"
        return JSONResponse(_error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers)

    app.add_middleware(SecurityHeaders)

    @app.get("/health")
    def health() -> dict:
        return {
            "status": "ok",
            "model": backend.model_id,
            "workers": pool.workers,
            "running": pool.running,
            "waiting": pool.waiting,
        }

    @app.get("/v1/models")
    def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": backend.model_id, "object": "model", "created": 0, "owned_by": "lockstep"}],
        }

    @app.post(
        "/v1/chat/completions",
        responses={400: {"description": "the latest user message does not fit the model's context"},
                   413: {"description": "request body too large"}, 503: {"description": "all workers busy"}},
    )
    async def chat_completions(body: RequestModel, request: Request) -> Any:  # type: ignore[valid-type]
        try:
            # On a worker thread: tokenizing up to max_body_bytes of text would stall every other
            # request, /health included, if it ran on the event loop.
            fitted, settings = await run_in_threadpool(body.fit)
        except RequestLimitError as e:
            return JSONResponse(_error_body(f"{e.param}: {e}", "invalid_request_error", e.param, e.code),
                                status_code=e.status)
        messages, prompt_tokens = fitted.messages, fitted.prompt_tokens
        fit_headers = {DROPPED_TURNS_HEADER: str(fitted.dropped_turns), CONTEXT_TOKENS_HEADER: str(context_tokens)}
        request_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        try:
            await pool.acquire()
        except Busy:
            log.info("%s refused: all %d workers busy, %d waiting", request_id, pool.workers, pool.waiting)
            return JSONResponse(
                _error_body("all workers are busy; retry shortly", "server_busy"),
                status_code=503,
                headers={"Retry-After": "1"},
            )
        try:
            gen = _Generation(pool, cut_at_stop_strings(backend.stream(messages, settings), tuple(body.stop or ())))
        except BaseException:
            pool.release()
            raise
        created = int(time.time())
        start_s = time.perf_counter()
        # Sizes and timings only: message text never goes to the log.
        log.info(
            "%s start: %d messages (%d oldest turns left out), %d prompt tokens, max_tokens %d",
            request_id,
            len(messages),
            fitted.dropped_turns,
            prompt_tokens,
            settings.max_tokens,
        )

        def done(completion_tokens: int, finish: str) -> None:
            log.info(
                "%s %s: %d completion tokens in %.2fs",
                request_id,
                finish,
                completion_tokens,
                time.perf_counter() - start_s,
            )

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream_events(gen, request, request_id, created, backend.model_id, prompt_tokens, include_usage, done),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **fit_headers},
            )

        parts: list[str] = []
        completion_tokens = 0
        finish = "length"
        watcher = asyncio.ensure_future(gen.watch_disconnect(request))
        try:
            while True:
                kind, item = await gen.next()
                if kind == "delta":
                    parts.append(item.text)
                    completion_tokens += item.tokens
                    if item.finish_reason:
                        finish = item.finish_reason
                elif kind == "error":
                    gen.cancel.set()
                    done(completion_tokens, "error")
                    if isinstance(item, ChatError):
                        return JSONResponse(_error_body(str(item), "invalid_request_error"), status_code=422)
                    return JSONResponse(_error_body("generation failed", "server_error"), status_code=500)
                elif kind == "disconnect":
                    done(completion_tokens, "disconnect")
                    return JSONResponse(_error_body("client went away", "cancelled"), status_code=499)
                else:
                    break
        finally:
            gen.cancel.set()
            watcher.cancel()
        done(completion_tokens, finish)
        return JSONResponse({
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": backend.model_id,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "".join(parts)}, "finish_reason": finish}
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }, headers=fit_headers)

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


async def _stream_events(
    gen: _Generation,
    request: Request,
    request_id: str,
    created: int,
    model_id: str,
    prompt_tokens: int,
    include_usage: bool,
    done: Any,
) -> AsyncIterator[str]:
    def chunk(delta: dict, finish: str | None) -> dict:
        return {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model_id,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    completion_tokens = 0
    finish = "length"
    outcome = "disconnect"
    try:
        yield sse_event(chunk({"role": "assistant", "content": ""}, None))
        while True:
            kind, item = await gen.next()
            if kind == "delta":
                completion_tokens += item.tokens
                if item.finish_reason:
                    finish = item.finish_reason
                if item.text:
                    yield sse_event(chunk({"content": item.text}, None))
            elif kind == "error":
                outcome = "error"
                message = str(item) if isinstance(item, ChatError) else "generation failed"
                yield sse_event(
                    _error_body(message, "invalid_request_error" if isinstance(item, ChatError) else "server_error")
                )
                # A stream always ends with [DONE], so a client that reads to it stops here too.
                yield sse_event("[DONE]")
                return
            else:
                break
        yield sse_event(chunk({}, finish))
        if include_usage:
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }
            yield sse_event({"id": request_id, "object": "chat.completion.chunk", "created": created,
                             "model": model_id, "choices": [], "usage": usage})
        yield sse_event("[DONE]")
        outcome = finish
    finally:
        # Runs on normal end and when the server cancels the stream because the client left.
        gen.cancel.set()
        done(completion_tokens, outcome)
