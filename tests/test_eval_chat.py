"""Chat scorers on planted outputs: final-number extraction, generative, categorical, code, ChatCORE."""

from __future__ import annotations

import pytest
import torch

from lockstep.evaluate.chat import (
    answers_match,
    categorical_items,
    chatcore,
    code_items,
    code_program,
    conversation_items,
    evaluate_categorical,
    evaluate_code,
    evaluate_generative,
    evaluate_reply_choice,
    extract_answer,
    normalize_number,
    problem_items,
)
from lockstep.evaluate.sandbox import SandboxLimits
from _eval_helpers import ASSISTANT_START, BigramModel, CharTokenizer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She pays 3*4=12 dollars.\n#### 1,234", "1234"),
        ("#### -7", "-7"),
        ("The answer is 3.50 dollars", "3.5"),
        ("#### $2,000.00", "2000"),
        ("first 5, then 6 and finally 42.", "42"),
        ("no number here", None),
        ("-0.25 is the change", "-0.25"),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_normalize_number() -> None:
    assert normalize_number("1,000") == "1000"
    assert normalize_number("-3.0") == "-3"
    assert normalize_number("abc") is None


def test_answers_match_planted() -> None:
    ref = "He has 48/2 = <<48/2=24>>24 apples.\n#### 1,024"
    assert answers_match(ref, "so the total is 1024")
    assert answers_match(ref, "#### 1,024.0")
    assert not answers_match(ref, "#### 1023")
    assert answers_match("#### -15", "The change was -15")
    assert not answers_match("#### -15", "The change was 15")
    assert answers_match("#### 2.5", "#### 2.50")
    # tool-computed: the number comes from the calculator's output, left as the reply's last number
    assert answers_match("#### 391", "<|python_start|>17*23<|python_end|><|output_start|>391<|output_end|>")
    # spelling: no number, judged on the last line
    assert answers_match("The word spelled out:\nc-a-t", "Sure.\nc-a-t.")
    assert not answers_match("c-a-t", "c-a-r")


def _planted_generate(tok: CharTokenizer, replies: dict[str, str]):
    def generate(prompts: list[list[int]]) -> list[list[int]]:
        return [tok.encode(replies.get(tok.decode(p), "no idea")) for p in prompts]
    return generate


def test_evaluate_generative_planted() -> None:
    tok = CharTokenizer()
    problems = [
        {"question": "What is 2+3?", "answer": "2+3=<<2+3=5>>5\n#### 5"},
        {"question": "What is 1000*2?", "answer": "#### 2,000"},
        {"question": "What is 3-10?", "answer": "#### -7"},
    ]
    replies = {"What is 2+3?": "#### 5", "What is 1000*2?": "It is 2,000.", "What is 3-10?": "#### 7"}
    res = evaluate_generative(
        problem_items(problems), tokenizer=tok, generate=_planted_generate(tok, replies), batch_size=2
    )
    assert (res.correct, res.total) == (2, 3)
    assert [r["correct"] for r in res.records] == [True, True, False]
    # rank sharding splits the items
    r1 = evaluate_generative(
        problem_items(problems), tokenizer=tok, generate=_planted_generate(tok, replies), rank=1, world_size=2
    )
    assert r1.total == 1 and r1.records[0]["index"] == 1


def test_conversation_items_skip_turns_without_an_answer() -> None:
    def conv(answer: str) -> dict:
        return {"messages": [
            {"role": "user", "content": [{"type": "text", "text": "How many r in strawberry?"}]},
            {"role": "assistant", "content": [{"type": "python", "text": "'strawberry'.count('r')"},
                                              {"type": "python_output", "text": "3"},
                                              {"type": "text", "text": answer}]},
        ]}
    items = conversation_items([conv("There are 3."), conv("   ")])
    assert len(items) == 1 and items[0].reference == "There are 3."


def test_problem_without_final_number_is_refused() -> None:
    with pytest.raises(ValueError, match="####"):
        problem_items([{"question": "q", "answer": "no final line"}])


def test_categorical_planted() -> None:
    tok = CharTokenizer()
    items = categorical_items([
        {"question": "Pick B", "choices": ["x", "y", "z"], "answer": "B"},
        {"question": "Pick A", "choices": ["x", "y"], "answer": 0},
    ])
    model = BigramModel()
    with torch.no_grad():
        model.table[ASSISTANT_START, tok.encode("B")[0]] = 5.0
        model.table[ASSISTANT_START, tok.encode("D")[0]] = 9.0  # not a valid letter for 3 choices
    res = evaluate_categorical(model, items, tokenizer=tok, device=torch.device("cpu"), max_seq_len=512)
    assert [r["predicted"] for r in res.records] == ["B", "B"]
    assert (res.correct, res.total) == (1, 2)


def test_reply_choice_scores_each_choice_as_the_reply() -> None:
    """No letters: the choice the model would rather say after the question wins, by mean nats per
    reply token (the end token included), whatever its letter; too long an item is skipped."""
    tok = CharTokenizer()
    items = categorical_items([
        {"question": "Say it", "choices": ["cab", "abc", "bca"], "answer": "B"},
        {"question": "Again", "choices": ["abc", "cab"], "answer": "A"},
        {"question": "x" * 40, "choices": ["abc", "cab"], "answer": "A"},
    ])
    model = BigramModel()
    model.plant(tok, "abc\n")  # a -> b -> c -> end
    with torch.no_grad():
        model.table[ASSISTANT_START, tok.encode("a")[0]] = 10.0
        model.table[ASSISTANT_START, tok.encode("c")[0]] = 9.0  # "cab" starts almost as well
    res = evaluate_reply_choice(model, items, tokenizer=tok, device=torch.device("cpu"), max_seq_len=32)
    assert [r["predicted"] for r in res.records] == ["B", "A"]
    assert (res.correct, res.total, res.skipped) == (2, 2, 1)
    # the first item's "cab" by hand: a start, then c->a, a->b, b->end under the bigram table
    logp = torch.log_softmax(model.table.detach(), dim=-1)
    ids = [ASSISTANT_START, *tok.encode("cab"), 96]
    want = -sum(float(logp[a, b]) for a, b in zip(ids, ids[1:])) / 4
    assert res.records[0]["mean_nats"][0] == pytest.approx(want, abs=1e-4)


def test_categorical_answer_validation() -> None:
    with pytest.raises(ValueError, match="answer"):
        categorical_items([{"question": "q", "choices": ["a", "b"], "answer": "C"}])


def test_code_program_and_sandbox_pass_at_1() -> None:
    tok = CharTokenizer()
    items = code_items([
        {"task_id": "t/0", "prompt": "def add(a, b):\n", "entry_point": "add",
         "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"},
        {"task_id": "t/1", "prompt": "def neg(a):\n", "entry_point": "neg",
         "test": "def check(candidate):\n    assert candidate(2) == -2\n"},
    ])
    assert "def add(a, b):\n    return a + b" in code_program(items[0], "    return a + b\n")
    replies = {
        "def add(a, b):\n": "```python\ndef add(a, b):\n    return a + b\n```",
        "def neg(a):\n": "    return a\n",
    }
    res = evaluate_code(
        items, tokenizer=tok, generate=_planted_generate(tok, replies), limits=SandboxLimits(timeout_s=5)
    )
    assert [r["correct"] for r in res.records] == [True, False]
    assert res.records[1]["status"] == "error"


ADD_ITEM = {"task_id": "t/add", "prompt": "def add(a, b):\n", "entry_point": "add",
            "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"}


@pytest.mark.parametrize(
    "completion",
    [
        # leaves before the tests run, with exit status 0
        "import sys\nsys.exit(0)\ndef add(a, b):\n    return 0\n",
        "def add(a, b):\n    raise SystemExit(0)\n",
        "def add(a, b):\n    import os\n    os._exit(0)\n",
        # turns the failed assertion's exit into exit status 0
        "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return 0\n",
        "import sys, os\nsys.excepthook = lambda *exc: os._exit(0)\ndef add(a, b):\n    return 0\n",
        # prints what a success marker might look like, then writes it to every descriptor it has
        "import os\ndef add(a, b):\n    for fd in range(1, 256):\n        try:\n"
        "            os.write(fd, b'ok passed done ' * 4 + b'\\n')\n        except OSError:\n            pass\n"
        "    os._exit(0)\n",
        # answers every comparison with True
        "class Anything:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Anything()\n",
        "class Zero(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return Zero(0)\n",
    ],
    ids=["sys_exit_at_top", "system_exit_in_function", "os_exit_in_function", "atexit_hook", "excepthook",
         "fake_markers", "always_equal", "always_equal_int"],
)
def test_code_that_skips_or_fakes_its_tests_does_not_pass(completion: str) -> None:
    tok = CharTokenizer()
    items = code_items([ADD_ITEM])
    res = evaluate_code(items, tokenizer=tok, generate=_planted_generate(tok, {ADD_ITEM["prompt"]: completion}),
                        limits=SandboxLimits(timeout_s=5))
    assert [r["correct"] for r in res.records] == [False], res.records


def test_code_tests_may_use_helpers_defined_in_the_prompt() -> None:
    # HumanEval-style: the prompt defines a helper and the entry point's stub; the tests call both.
    tok = CharTokenizer()
    prompt = ('def encode(s):\n    return s[::-1]\n\n\ndef decode(s):\n    """Undo encode."""\n')
    items = code_items([{"task_id": "t/dec", "prompt": prompt, "entry_point": "decode",
                         "test": "def check(candidate):\n    assert candidate(encode('abc')) == 'abc'\n"}])
    replies = {prompt: "    return s[::-1]\n"}
    res = evaluate_code(
        items, tokenizer=tok, generate=_planted_generate(tok, replies), limits=SandboxLimits(timeout_s=5)
    )
    assert [r["correct"] for r in res.records] == [True], res.records


def test_chatcore() -> None:
    assert chatcore({"math": (0.5, 0.0), "arc": (0.25, 0.25)}) == 0.25
    with pytest.raises(ValueError):
        chatcore({})
