"""Chat sessions over a model: the text-streaming backend seam, incremental UTF-8 decoding, stop
strings and the terminal chat loop. Not the HTTP server (lockstep.infer.server), not sampling
(lockstep.infer.engine) and not which turns fit the context (lockstep.infer.context)."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TextIO

import torch

from lockstep.core.runtime import choose_device_dtype, device_from_name
from lockstep.data.records import text_message
from lockstep.infer.context import ContextFullError, dropped_notice, fit_conversation, min_reply_tokens
from lockstep.infer.engine import Engine, decode_settings
from lockstep.infer.sampling import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SEED,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    check_temperature,
    check_top_p,
)
from lockstep.model.checkpoint import load_model
from lockstep.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

# A GSM8K-style annotation is how a tool call reads as plain text: `<<48/2=24>>`.
TOOL_MARKERS = {
    "<|python_start|>": "<<",
    "<|python_end|>": "=",
    "<|output_start|>": "",
    "<|output_end|>": ">>",
}


@dataclass(frozen=True)
class SamplingSettings:
    """How one reply is sampled."""

    temperature: float = DEFAULT_TEMPERATURE  # 0 = greedy
    top_k: int = DEFAULT_TOP_K  # 0 = no top-k cut
    top_p: float = DEFAULT_TOP_P  # 1.0 = no nucleus cut
    max_tokens: int = DEFAULT_MAX_TOKENS  # new tokens at most in the reply
    seed: int = DEFAULT_SEED  # seeds the sampling torch.Generator

    def __post_init__(self) -> None:
        # Refused here, before a reply starts, by the rule the engine samples with.
        try:
            check_temperature(self.temperature)
            check_top_p(self.top_p)
        except ValueError as e:
            raise ChatError(str(e)) from None
        if self.top_k < 0:
            raise ChatError(f"top_k={self.top_k} must be >= 0 (0 = no top-k cut)")
        if self.max_tokens < 1:
            raise ChatError(f"max_tokens={self.max_tokens} must be >= 1")


@dataclass(frozen=True)
class Delta:
    """One step of a streamed reply: the text that became printable (possibly empty, when a
    token ends mid-character), the tokens consumed, and on the last delta why it ended."""

    text: str
    tokens: int = 1
    finish_reason: str | None = None  # "stop" | "length" on the last delta


class ChatBackend(Protocol):
    """Messages in, a stream of text deltas out. The server and the terminal chat only see this,
    so both run against a fake in tests and against a checkpoint in use."""

    model_id: str
    context_tokens: int  # prompt + reply tokens the model can attend to

    def count_tokens(self, text: str) -> int: ...

    def prompt_tokens(self, messages: list[dict]) -> int: ...

    def stream(self, messages: list[dict], settings: SamplingSettings) -> Iterator[Delta]: ...


class ChatError(ValueError):
    """A conversation or setting the model cannot be asked about; the message says how to fix it."""


def check_messages(messages: list[dict]) -> None:
    """Refuse a conversation that cannot be completed: an optional leading system message, then
    user and assistant alternating, ending with a user message."""
    if not messages:
        raise ChatError("no messages: send at least one user message")
    body = messages[1:] if messages[0]["role"] == "system" else messages
    if not body:
        raise ChatError("only a system message: add a user message after it")
    for i, m in enumerate(body):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            raise ChatError(
                f"message {i + len(messages) - len(body)} has role {m['role']!r} where {want!r} was expected: "
                "after an optional first system message, user and assistant must alternate"
            )
    if body[-1]["role"] != "user":
        raise ChatError("the last message must be from the user: the reply is the assistant's turn")


class IncrementalDecoder:
    """Turns token ids into text as they arrive, emitting only complete characters.

    A token may end in the middle of a multi-byte UTF-8 character; decoding it alone gives
    U+FFFD. Pending ids are held until they decode cleanly (at most `max_pending_tokens`, so a
    model that truly emits invalid bytes still makes progress). One token of left context is kept
    so tokenizers that drop a leading space when decoding a lone token still decode right."""

    def __init__(self, decode: Callable[[list[int]], str], *, max_pending_tokens: int = 4):
        self._decode = decode
        self._max_pending = max_pending_tokens
        self._ids: list[int] = []
        self._prefix_start = 0  # context ids begin here
        self._read_start = 0  # ids not yet emitted begin here

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_start : self._read_start])
        full = self._decode(self._ids[self._prefix_start :])
        pending = len(self._ids) - self._read_start
        if full.endswith("\ufffd") and pending < self._max_pending:
            return ""
        piece = full[len(prefix) :] if full.startswith(prefix) else full
        self._prefix_start, self._read_start = self._read_start, len(self._ids)
        if self._prefix_start > 0:
            # Keep one id of context; drop the rest so decode cost stays constant per token.
            keep = self._prefix_start - 1
            self._ids = self._ids[keep:]
            self._prefix_start -= keep
            self._read_start -= keep
        return piece

    def flush(self) -> str:
        """Whatever is still pending, replacement characters included; then start afresh."""
        prefix = self._decode(self._ids[self._prefix_start : self._read_start])
        full = self._decode(self._ids[self._prefix_start :])
        piece = full[len(prefix) :] if full.startswith(prefix) else full
        self.reset()
        return piece

    def reset(self) -> None:
        self._ids, self._prefix_start, self._read_start = [], 0, 0


def cut_at_stop_strings(deltas: Iterator[Delta], stops: tuple[str, ...]) -> Iterator[Delta]:
    """`deltas` cut where the first of `stops` (non-empty strings) appears in the reply's text: the
    text before it is the last delta, with finish_reason "stop", and `deltas` is closed, which ends
    the generation. Text that could be the start of a stop string is held back until the next delta
    tells, so a stop string split across tokens is cut all the same and never reaches the client."""
    if not stops:
        yield from deltas
        return
    held = ""
    try:
        for delta in deltas:
            text = held + delta.text
            found = [at for at in (text.find(stop) for stop in stops) if at >= 0]
            if found:
                yield Delta(text[: min(found)], delta.tokens, "stop")
                return
            if delta.finish_reason:
                yield Delta(text, delta.tokens, delta.finish_reason)
                return
            keep = next((k for k in range(min(len(text), max(map(len, stops)) - 1), 0, -1)
                         if any(stop.startswith(text[-k:]) for stop in stops)), 0)
            held = text[len(text) - keep :]
            yield Delta(text[: len(text) - keep], delta.tokens)
        if held:
            yield Delta(held, 0)
    finally:
        close = getattr(deltas, "close", None)
        if close is not None:
            close()


class EngineBackend:
    """A ChatBackend over lockstep.infer.engine: renders the conversation with the tokenizer, samples with
    the engine (calculator tool on) and decodes the reply incrementally."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, *, model_id: str, context_tokens: int):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.context_tokens = context_tokens
        specials = tokenizer.get_special_tokens()
        self._markers = {specials[name]: text for name, text in TOOL_MARKERS.items() if name in specials}
        # Any other special token ends the turn: the model has left the assistant's role.
        self._stop_ids = {i for name, i in specials.items() if name not in TOOL_MARKERS}

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def _prompt_ids(self, messages: list[dict]) -> list[int]:
        check_messages(messages)
        return self.tokenizer.render_for_completion({"messages": messages})

    def prompt_tokens(self, messages: list[dict]) -> int:
        return len(self._prompt_ids(messages))

    def stream(self, messages: list[dict], settings: SamplingSettings) -> Iterator[Delta]:
        prompt = self._prompt_ids(messages)
        room_tokens = self.context_tokens - len(prompt)
        if room_tokens <= 0:
            raise ChatError(
                f"the conversation is {len(prompt)} tokens and the model's context is {self.context_tokens}, "
                "which leaves no room for a reply: shorten it or start a new conversation"
            )
        max_tokens = min(settings.max_tokens, room_tokens)
        decoder = IncrementalDecoder(self.tokenizer.decode)
        steps = self.engine.generate(
            prompt,
            num_samples=1,
            max_tokens=max_tokens,
            temperature=settings.temperature,
            top_k=settings.top_k if settings.top_k > 0 else None,
            top_p=settings.top_p,
            seed=settings.seed,
            use_tools=True,
        )
        n_tokens = 0
        try:
            for token_column, _mask_column in steps:
                token = int(token_column[0])
                n_tokens += 1
                if token in self._stop_ids:
                    yield Delta(decoder.flush(), 1, "stop")
                    return
                if token in self._markers:
                    text = decoder.flush() + self._markers[token]
                else:
                    text = decoder.push(token)
                if n_tokens >= max_tokens:
                    yield Delta(text + decoder.flush(), 1, "length")
                    return
                yield Delta(text, 1)
            # The engine ran out of steps without a stop token: it hit its own length bound.
            yield Delta(decoder.flush(), 0, "length")
        finally:
            close = getattr(steps, "close", None)
            if close is not None:
                close()


def load_backend(ckpt_dir: Path, tokenizer_dir: Path, *, device: str = "cpu", kernels: bool = False) -> EngineBackend:
    """Load a checkpoint and its tokenizer into an EngineBackend on `device` ("cpu", "cuda",
    "cuda:1", "mps"), refusing a device this machine lacks and a tokenizer other than the one the
    checkpoint was trained with. On CUDA with bf16 (sm80+) the weights are loaded in bf16; elsewhere
    they stay fp32. `kernels` runs the model on lockstep.model.kernels (GPT.use_kernels) and, on CUDA,
    decodes through the static-cache, CUDA-graphed engine path (lockstep.infer.engine.decode_settings)."""
    ckpt_dir, tokenizer_dir = Path(ckpt_dir), Path(tokenizer_dir)
    # Checked before anything loads: a device this machine lacks fails in seconds, not after the weights.
    torch_device = device_from_name(device, setting="--device")
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {ckpt_dir}: pass --ckpt data/ckpt/<stage>")
    if not tokenizer_dir.is_dir():
        raise FileNotFoundError(f"no tokenizer directory at {tokenizer_dir}: pass --tokenizer data/tokenizer")
    tokenizer = load_tokenizer(tokenizer_dir)
    dtype = torch.float32
    if torch_device.type == "cuda":
        _, dtype, why = choose_device_dtype("cuda", "auto", local_rank=torch_device.index or 0)
        log.info("decoding in %s", why)
    model, _ = load_model(ckpt_dir, torch_device, tokenizer_sha256=tokenizer.sha256, dtype=dtype)
    model.use_kernels(kernels)
    engine = Engine(model, tokenizer, **decode_settings(torch_device, dtype, kernels))
    model_id = f"lockstep-{ckpt_dir.name}"
    return EngineBackend(engine, tokenizer, model_id=model_id, context_tokens=model.config.sequence_len)


# What a person may set, by setting: (lowest, highest, whether the lowest itself is allowed, what
# the ends mean). One table for the `lockstep chat` options and the /commands; the server's
# request schema and the web UI's inputs offer the same ranges.
PERSON_RANGES: dict[str, tuple[float, float, bool, str]] = {
    "temperature": (0.0, MAX_TEMPERATURE, True, "0 is greedy"),
    "top_k": (0, MAX_TOP_K, True, "0 = no top-k cut"),
    "top_p": (0.0, 1.0, False, "1 = no nucleus cut"),
    "max_tokens": (1, float("inf"), True, "new tokens per reply"),
    "seed": (0, MAX_SEED, True, "each later reply adds its turn number"),
}


def check_person_setting(setting: str, value: float, *, name: str) -> None:
    """Refuse `value` for `setting` outside PERSON_RANGES (NaN and infinities included) with a
    ChatError that names it as the person typed it (`name`: `--top-p`, `/topp`)."""
    low, high, low_ok, meaning = PERSON_RANGES[setting]
    # An int is compared as it is: a 400-digit seed has no float to test for finiteness.
    finite = isinstance(value, int) or math.isfinite(value)
    inside = finite and (value >= low if low_ok else value > low) and value <= high
    if not inside:
        if math.isinf(high):
            bounds = f"at least {_number(low)}"
        elif low_ok:
            bounds = f"from {_number(low)} to {_number(high)}"
        else:
            bounds = f"above {_number(low)} and at most {_number(high)}"
        raise ChatError(f"{name} must be {bounds} ({meaning}), got {_number(value)}")


def _number(value: float) -> str:
    """A number as people write it: 200, 0.6, 9223372036854775807; a huge one by its length."""
    text = str(value) if isinstance(value, int) else f"{value:g}"
    return text if len(text) <= 24 else f"a {len(text)}-digit number"


def person_settings(*, temperature: float, top_k: int, top_p: float, max_tokens: int, seed: int) -> SamplingSettings:
    """The settings of `lockstep chat`'s options, each checked against PERSON_RANGES and named by
    its option in the error."""
    for setting, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                           ("max_tokens", max_tokens), ("seed", seed)):
        check_person_setting(setting, value, name="--" + setting.replace("_", "-"))
    return SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens, seed=seed)


HELP = f"""commands:
  /clear            start a new conversation
  /temperature X    sampling temperature, 0 (greedy) to {MAX_TEMPERATURE:g}
  /topk K           sample from the K most likely tokens, 0 to {MAX_TOP_K} (0 = all)
  /topp P           sample from the fewest likely tokens whose probability reaches P, 0 < P <= 1 (1 = all)
  /help             this text
  /quit             leave (also Ctrl-D)"""

# Each /command that changes a setting: the setting, and how its value is read.
SETTING_COMMANDS: dict[str, tuple[str, type]] = {
    "/temperature": ("temperature", float),
    "/topk": ("top_k", int),
    "/topp": ("top_p", float),
}


def _set_setting(settings: SamplingSettings, command: str, arg: str) -> SamplingSettings:
    setting, kind = SETTING_COMMANDS[command]
    low, high, _, _ = PERSON_RANGES[setting]
    try:
        value = kind(arg)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise ChatError(f"{command} needs {what} from {_number(low)} to {_number(high)}, got {arg!r}") from None
    check_person_setting(setting, value, name=command)
    return dataclasses.replace(settings, **{setting: value})


@dataclass(frozen=True)
class Reply:
    """A reply as it was streamed: its text, why it ended and the most tokens it was allowed."""

    text: str
    finish_reason: str | None  # "stop" | "length"
    max_tokens: int


def reply(backend: ChatBackend, messages: list[dict], settings: SamplingSettings, out: TextIO) -> Reply:
    """Stream one reply to `out` as it is sampled."""
    parts: list[str] = []
    finish = None
    for delta in backend.stream(messages, settings):
        if delta.text:
            out.write(delta.text)
            out.flush()
            parts.append(delta.text)
        finish = delta.finish_reason or finish
    out.write("\n")
    out.flush()
    return Reply("".join(parts), finish, settings.max_tokens)


def context_full_message(e: ContextFullError) -> str:
    """The terminal chat's words for a message too long to answer. Earlier exchanges are left out
    already by then, so starting afresh would not make room either."""
    return f"{e.sizes()}: shorten your message (earlier exchanges are already left out, so /clear would not help)"


def cut_notice(answer: Reply, context_tokens: int, settings: SamplingSettings) -> str:
    """The line saying a reply was cut: at the model's context or at the reply's own limit."""
    if answer.max_tokens < settings.max_tokens:
        return (f"the reply was cut off at {answer.max_tokens} tokens, where it filled the model's "
                f"{context_tokens}-token context")
    return f"the reply was cut off at its {answer.max_tokens}-token limit (--max-tokens)"


def answer_turn(
    backend: ChatBackend, messages: list[dict], settings: SamplingSettings, out: TextIO, notes: TextIO,
    *, lead: str = "",
) -> list[dict]:
    """Fit `messages` (ending with the user's message) into the backend's context, with a `note:`
    line on `notes` when the oldest exchanges are left out; then write `lead` and stream the reply
    to `out`, with a `note:` line when it was cut. Returns the conversation kept, reply included.
    Raises ContextFullError, before writing anything, when the latest message alone does not fit."""
    context_tokens = backend.context_tokens
    fitted = fit_conversation(messages, prompt_tokens=backend.prompt_tokens, context_tokens=context_tokens,
                              reply_tokens=min_reply_tokens(context_tokens, settings.max_tokens))
    if fitted.dropped_turns:
        notes.write(f"note: {dropped_notice(fitted.dropped_turns, context_tokens)}\n")
        notes.flush()
    out.write(lead)
    turn_settings = dataclasses.replace(settings, max_tokens=min(settings.max_tokens, fitted.room_tokens))
    answer = reply(backend, fitted.messages, turn_settings, out)
    if answer.finish_reason == "length":
        notes.write(f"note: {cut_notice(answer, context_tokens, settings)}\n")
        notes.flush()
    return [*fitted.messages, text_message("assistant", answer.text)]


def run_chat(
    backend: ChatBackend,
    settings: SamplingSettings,
    *,
    lines: Iterable[str],
    out: TextIO,
    prompt: str | None = None,
    show_prompt: Callable[[str], None] | None = None,
    notes: TextIO | None = None,
) -> list[dict]:
    """The terminal chat loop. `lines` yields the user's input lines (stdin in use, a list in
    tests); with `prompt`, answer it once and return. Each reply gets its own seed (the base seed
    plus the turn number) so a session replays exactly. The conversation keeps the latest turns
    that fit the model's context (lockstep.infer.context), one `note:` line saying when the oldest
    are left out and one when a reply is cut; notes go to `notes` (`out` when None). Returns the
    final conversation."""
    notes = out if notes is None else notes
    messages: list[dict] = []
    if prompt is not None:
        try:
            return answer_turn(backend, [text_message("user", prompt)], settings, out, notes)
        except ContextFullError as e:
            raise ChatError(f"{e.sizes()}: shorten the prompt") from None
    out.write(f"lockstep chat with {backend.model_id} ({backend.context_tokens}-token context); /help for commands\n")
    turn = 0
    line_iter = iter(lines)
    while True:
        if show_prompt is not None:
            show_prompt("you> ")
        try:
            line = next(line_iter)
        except StopIteration:
            break
        text = line.rstrip("\n")
        stripped = text.strip()
        if not stripped:
            continue
        if stripped.startswith("/"):
            command, _, arg = stripped.partition(" ")
            if command in ("/quit", "/exit"):
                break
            if command == "/help":
                out.write(HELP + "\n")
            elif command == "/clear":
                messages = []
                out.write("conversation cleared\n")
            elif command in SETTING_COMMANDS:
                if not arg.strip():
                    out.write(f"{command[1:]} = {getattr(settings, SETTING_COMMANDS[command][0])}\n")
                else:
                    try:
                        settings = _set_setting(settings, command, arg.strip())
                    except ChatError as e:
                        out.write(f"error: {e}\n")
                    else:
                        out.write(f"temperature = {settings.temperature}, topk = {settings.top_k}, "
                                  f"topp = {settings.top_p}\n")
            else:
                out.write(f"unknown command {command!r}; /help lists the commands\n")
            out.flush()
            continue
        turn_settings = dataclasses.replace(settings, seed=settings.seed + turn)
        try:
            # The turns left out stay out: the next turn is fitted from what this one kept.
            messages = answer_turn(backend, [*messages, text_message("user", text)], turn_settings, out, notes,
                                   lead="assistant> ")
        except ContextFullError as e:
            out.write(f"error: {context_full_message(e)}\n")
            continue
        except ChatError as e:
            out.write(f"error: {e}\n")
            continue
        turn += 1
    return messages
