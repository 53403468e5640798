"""Record kinds and their conversions: a raw snapshot holds documents (`text`), conversations
(`messages`) or problems (`question`, `answer` in GSM8K form). This module says what each kind
must contain, turns a problem into the tool-using conversation training sees, and builds
messages. It imports nothing from lockstep, so every layer (sources, caches, tokenizers, chat,
RL, eval) can use it; it reads no files and knows no tokenizer.

A conversation is `{"messages": [{"role": ..., "content": [{"type": ..., "text": ...}, ...]}]}`:
an optional leading system message, then user and assistant alternating, ending with the
assistant in stored records. Part types are `text`, and for assistants also `python` (a tool
call) and `python_output` (its result)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

KINDS = ("document", "conversation", "problem")
ROLES = ("system", "user", "assistant")
PART_TYPES = ("text", "python", "python_output")

# `<<48/2=24>>`: GSM8K's calculator annotation; the expression may not contain `=` or angle brackets.
_CALC = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


class BadRecord(ValueError):
    """One record breaks the contract of its kind (missing field, empty text, bad roles, ...)."""


def text_message(role: str, text: str) -> dict[str, Any]:
    """A message with one text part."""
    return {"role": role, "content": [{"type": "text", "text": text}]}


def user_prompt(text: str) -> dict[str, Any]:
    """A conversation of one user message: what a model is asked to reply to."""
    return {"messages": [text_message("user", text)]}


def problem_to_conversation(problem: Mapping[str, Any]) -> dict[str, Any]:
    """A problem as a two-turn conversation: the question as the user turn; the solution as the
    assistant turn, where each `<<expr=result>>` becomes a `python` part (`expr`) followed by a
    `python_output` part (`result`), the surrounding text kept as text parts."""
    answer = problem["answer"]
    parts: list[dict[str, str]] = []
    pos = 0
    for m in _CALC.finditer(answer):
        if m.start() > pos:
            parts.append({"type": "text", "text": answer[pos : m.start()]})
        parts.append({"type": "python", "text": m.group(1)})
        parts.append({"type": "python_output", "text": m.group(2)})
        pos = m.end()
    if pos < len(answer):
        parts.append({"type": "text", "text": answer[pos:]})
    return {"messages": [text_message("user", problem["question"]), {"role": "assistant", "content": parts}]}


def as_conversation(example: Any, where: str) -> dict[str, Any]:
    """The conversation an SFT example stands for: a conversation as it is, a bare list of
    messages as its `messages`, a problem through `problem_to_conversation`. `where` names the
    example in the TypeError raised for anything else."""
    if isinstance(example, Mapping) and "messages" in example:
        return dict(example)
    if isinstance(example, Mapping) and "question" in example and "answer" in example:
        return problem_to_conversation(example)
    if isinstance(example, (list, tuple)) and example and all(isinstance(m, Mapping) and "role" in m for m in example):
        return {"messages": list(example)}
    raise TypeError(
        f"{where} is neither a conversation ({{'messages': [...]}}), a list of messages ([{{'role', 'content'}}, ...]) "
        "nor a problem ({'question', 'answer'})"
    )


def _nonempty_str(record: Mapping[str, Any], key: str) -> str:
    if key not in record or record[key] is None:
        raise BadRecord(f"missing field {key!r}")
    value = record[key]
    if not isinstance(value, str):
        raise BadRecord(f"field {key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise BadRecord(f"empty {key!r}")
    return value


def validate_conversation(messages: Any) -> None:
    """Raise BadRecord unless `messages` is a stored conversation (see the module docstring):
    valid roles, non-empty typed parts, tool parts on assistants only, user and assistant
    alternating after an optional system message, the assistant last."""
    if not isinstance(messages, list) or not messages:
        raise BadRecord("conversation has no messages")
    body = messages[1:] if messages[0].get("role") == "system" else messages
    if not body:
        raise BadRecord("conversation holds only a system message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRecord(f"message {i} has no valid role (one of {ROLES})")
        content = m.get("content")
        if not isinstance(content, list) or not content:
            raise BadRecord(f"message {i} has no content parts")
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") not in PART_TYPES
                or not isinstance(part.get("text"), str)
            ):
                raise BadRecord(f"message {i} has a part that is not {{type in {PART_TYPES}, text: str}}")
            if part["type"] != "text" and m["role"] != "assistant":
                raise BadRecord(f"message {i} ({m['role']}) carries a {part['type']} part; only assistants may")
        if not "".join(p["text"] for p in content).strip():
            raise BadRecord(f"message {i} is empty")
    for i, m in enumerate(body):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            raise BadRecord(f"roles must alternate user/assistant; turn {i} is {m['role']}")
    if body[-1]["role"] != "assistant":
        raise BadRecord("conversation must end with an assistant message")


def validate_record(kind: str, record: Mapping[str, Any], extra_fields: Sequence[str] = ()) -> dict[str, Any]:
    """The record reduced to the fields of `kind` (a document keeps `extra_fields` as strings or
    None); raises BadRecord when it breaks the contract."""
    if kind == "document":
        out = {"text": _nonempty_str(record, "text")}
        for f in extra_fields:
            v = record.get(f)
            out[f] = None if v is None else str(v)
        return out
    if kind == "conversation":
        validate_conversation(record.get("messages"))
        return {
            "messages": [
                {"role": m["role"], "content": [{"type": p["type"], "text": p["text"]} for p in m["content"]]}
                for m in record["messages"]
            ]
        }
    if kind == "problem":
        return {"question": _nonempty_str(record, "question"), "answer": _nonempty_str(record, "answer")}
    raise ValueError(f"record kind {kind!r} must be one of {KINDS}")
