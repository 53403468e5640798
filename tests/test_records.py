"""Record kinds: each kind's contract, and the one problem -> conversation conversion that the
SFT cache, the tokenizer stage and RL prompts share."""

from __future__ import annotations

import pytest

from lockstep.data.records import (
    BadRecord,
    as_conversation,
    problem_to_conversation,
    text_message,
    user_prompt,
    validate_conversation,
    validate_record,
)

PROBLEM = {"question": "Tom has 3 apples and buys 4. How many?", "answer": "He has <<3+4=7>>7.\n#### 7"}


def test_as_conversation_dispatches_each_shape() -> None:
    conv = {"messages": [text_message("user", "hi"), text_message("assistant", "hello")]}
    assert as_conversation(conv, "ex 0") == conv
    assert as_conversation(conv["messages"], "ex 1") == conv  # a bare list of messages
    assert as_conversation(PROBLEM, "ex 2") == problem_to_conversation(PROBLEM)
    with pytest.raises(TypeError, match="ex 3 is neither a conversation"):
        as_conversation({"text": "a document"}, "ex 3")


def test_a_problem_becomes_a_valid_tool_using_conversation() -> None:
    conv = problem_to_conversation(PROBLEM)
    validate_conversation(conv["messages"])
    assert conv["messages"][0] == text_message("user", PROBLEM["question"])
    parts = conv["messages"][1]["content"]
    assert [p["type"] for p in parts] == ["text", "python", "python_output", "text"]
    assert user_prompt("q") == {"messages": [text_message("user", "q")]}


@pytest.mark.parametrize("kind, record, message", [
    ("document", {"text": "  "}, "empty 'text'"),
    ("problem", {"question": "q"}, "missing field 'answer'"),
    ("conversation", {"messages": [text_message("user", "q")]}, "must end with an assistant message"),
    ("conversation", {"messages": [text_message("user", "q"), text_message("user", "q")]}, "roles must alternate"),
])
def test_records_that_break_their_kind_are_refused(kind: str, record: dict, message: str) -> None:
    with pytest.raises(BadRecord, match=message):
        validate_record(kind, record)
    with pytest.raises(ValueError, match="record kind 'image'"):
        validate_record("image", record)
