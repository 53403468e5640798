"""Chat-model evaluations: GSM8K-format problems (generated with tools, exact final number),
ARC/MMLU-style categorical multiple choice (argmax over the answer labels' logits), letter
counting/spelling conversations, HumanEval-style code run in the sandbox, and the ChatCORE
aggregate; `Benchmark`, what a ChatCORE benchmark module declares (lockstep.evaluate.benchmarks.*,
registered in lockstep.evaluate.chatcore). Generation is passed in as a function; this module never
builds a model or engine."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from collections.abc import Callable, Iterable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from lockstep.data.records import text_message
from lockstep.evaluate.sandbox import SandboxLimits, TestRunResult, run_tests

LETTERS = "ABCDEFGHIJ"
# Number with optional sign, currency sign, thousands commas (groups of three) and decimals.
_NUMBER = re.compile(r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", re.DOTALL)

# (prompts as token id lists) -> completions as token id lists, greedy, tool calls answered.
Generate = Callable[[list[list[int]]], list[list[int]]]


class ChatTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def render_for_completion(self, conversation: dict[str, Any]) -> list[int]: ...
    def encode_special(self, name: str) -> int: ...


def normalize_number(text: str) -> str | None:
    """A number as a canonical string: `$1,234.50` -> `1234.5`, `-3.0` -> `-3`; None if not one."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The final answer of a solution or completion: the number after the last `####` when there
    is one (GSM8K convention), else the last number in the text (so a tool-computed result that
    the model leaves as its last number counts). Normalised with `normalize_number`."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        m = _NUMBER.search(tail)
        return normalize_number(m.group(0)) if m else None
    found = _NUMBER.findall(text)
    return normalize_number(found[-1]) if found else None


def _normalize_text(text: str) -> str:
    return " ".join(text.strip().lower().split()).rstrip(".!")


def final_answer_of_text(text: str) -> tuple[Literal["number", "text"], str] | None:
    """How a reply is judged: by its final number when it has one, else by its last line."""
    num = extract_answer(text)
    if num is not None:
        return ("number", num)
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return ("text", _normalize_text(lines[-1])) if lines else None


def answers_match(reference: str, completion: str) -> bool:
    """Exact match of the final answer: numbers after normalisation, else the last line."""
    ref = final_answer_of_text(reference)
    if ref is None:
        raise ValueError(f"reference answer {reference!r} has no final answer; drop the item")
    kind, value = ref
    if kind == "number":
        return extract_answer(completion) == value
    lines = [ln for ln in completion.strip().splitlines() if ln.strip()]
    return bool(lines) and _normalize_text(lines[-1]) == value


def _text_of(message: dict[str, Any]) -> str:
    return "".join(p["text"] for p in message["content"] if p["type"] in ("text", "python_output"))


def _final_text_of(message: dict[str, Any]) -> str:
    texts = [p["text"] for p in message["content"] if p["type"] == "text"]
    return texts[-1] if texts else _text_of(message)


@dataclasses.dataclass(frozen=True)
class GenerativeItem:
    conversation: dict[str, Any]  # ends with the reference assistant turn (dropped when prompting)
    reference: str                # text holding the final answer


def problem_items(problems: Iterable[dict[str, Any]]) -> list[GenerativeItem]:
    """GSM8K-format problems (`question`, `answer` ending `#### N`) as generative items."""
    items = []
    for i, p in enumerate(problems):
        if "question" not in p or "answer" not in p:
            raise ValueError(f"problem {i} needs `question` and `answer` (GSM8K format), got keys {sorted(p)}")
        if extract_answer(p["answer"]) is None:
            raise ValueError(f"problem {i} answer has no final number (`#### N` line): {p['answer'][-80:]!r}")
        conv = {"messages": [text_message("user", p["question"]), text_message("assistant", p["answer"])]}
        items.append(GenerativeItem(conv, p["answer"]))
    return items


def conversation_items(conversations: Iterable[dict[str, Any]], *, require_tool: bool = False) -> list[GenerativeItem]:
    """Conversations (e.g. letter counting and spelling) judged on their last assistant turn's final
    answer; conversations whose last turn has no final answer are left out, and with
    `require_tool` so are those whose last turn makes no python call (chit-chat, identity)."""
    items = []
    for conv in conversations:
        messages = conv.get("messages") or []
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("a conversation must end with an assistant message (see docs/internals.md records)")
        if require_tool and not any(p["type"] == "python" for p in messages[-1]["content"]):
            continue
        reference = _final_text_of(messages[-1])
        if final_answer_of_text(reference) is not None:
            items.append(GenerativeItem(conv, reference))
    return items


# How a categorical item's user turn is worded (`eval.categorical_prompt`). "nanochat": nanochat's
# tasks' rendering, `Multiple Choice question: <question>`, one `- <choice>=<label>` line per choice
# (the label after the choice, no space before it: the reply is that label's one token), a blank
# line and `Respond only with the letter of the correct answer.`; the labels are the dataset's own
# (ARC labels some items 1-4). "letter_first": the project's older wording, the question, a blank
# line, `A. <choice>` lines lettered by position, a blank line and `Answer with the letter only.`
CategoricalPrompt = Literal["nanochat", "letter_first"]
CATEGORICAL_PROMPTS: tuple[str, ...] = typing.get_args(CategoricalPrompt)


@dataclasses.dataclass(frozen=True)
class CategoricalItem:
    question: str
    choices: tuple[str, ...]
    answer: int  # index into choices
    # Each choice's label as its dataset gives it (ARC: A-D, or 1-4 on some items); left empty,
    # the choices are lettered by position, A first (MMLU's labels).
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.labels:
            object.__setattr__(self, "labels", tuple(LETTERS[: len(self.choices)]))
            return
        labels = self.labels
        one_each = len(labels) == len(self.choices) and len(set(labels)) == len(labels)
        if not one_each or not all(isinstance(x, str) and x and x.strip() == x for x in labels):
            raise ValueError(
                f"labels {list(labels)!r} must be one distinct non-empty label (no surrounding spaces) per choice, "
                f"{len(self.choices)} of them; leave them out to letter the choices by position"
            )


def categorical_items(records: Iterable[dict[str, Any]]) -> list[CategoricalItem]:
    """ARC/MMLU-style records: `question`, `choices` (list of strings), `answer` (index, or letter by
    position) and optionally `labels`, the choices' own labels (then a string `answer` is one of
    them)."""
    items = []
    for i, r in enumerate(records):
        choices = r.get("choices")
        if not isinstance(choices, list) or not 2 <= len(choices) <= len(LETTERS):
            raise ValueError(f"item {i}: `choices` must be a list of 2..{len(LETTERS)} strings")
        labels = r.get("labels")
        if labels is not None and (not isinstance(labels, list) or not all(isinstance(x, str) for x in labels)):
            raise ValueError(f"item {i}: `labels` must be a list of strings, one per choice, got {labels!r}")
        named = tuple(labels) if labels else tuple(LETTERS[: len(choices)])
        ans = r.get("answer")
        if isinstance(ans, str) and ans in named:
            ans = named.index(ans)
        if isinstance(ans, bool) or not isinstance(ans, int) or not 0 <= ans < len(choices):
            raise ValueError(
                f"item {i}: `answer` must be one of the labels {list(named)} or an index among {len(choices)} "
                f"choices, got {r.get('answer')!r}"
            )
        try:
            items.append(CategoricalItem(str(r["question"]), tuple(map(str, choices)), ans, tuple(labels or ())))
        except ValueError as e:
            raise ValueError(f"item {i}: {e}") from None
    return items


def benchmark_categorical_items(records: Iterable[dict[str, Any]]) -> list[CategoricalItem]:
    """Multiple-choice items from a benchmark snapshot (lockstep.data.sources.ai2_arc, .mmlu): documents
    whose `text` is the question, `choices` a JSON list, `answer` the right choice's letter by
    position and, where the source keeps them (ARC), `labels` the choices' own labels as a JSON
    list. A snapshot without `labels` letters its choices by position."""
    out = []
    for i, r in enumerate(records):
        try:
            choices = json.loads(r.get("choices") or "")
            labels = json.loads(r["labels"]) if r.get("labels") else None
        except json.JSONDecodeError:
            raise ValueError(
                f"benchmark item {i}: `choices` or `labels` is not a JSON list; refetch the snapshot"
            ) from None
        answer = r.get("answer")
        if isinstance(answer, str) and len(answer) == 1 and answer in LETTERS:
            answer = LETTERS.index(answer)  # the snapshot's answer is by position, whatever the labels
        record = {"question": r.get("text"), "choices": choices, "answer": answer}
        out.extend(categorical_items([record if labels is None else {**record, "labels": labels}]))
    return out


def prompt_labels(item: CategoricalItem, style: CategoricalPrompt = "nanochat") -> tuple[str, ...]:
    """The labels a categorical prompt of `style` shows and scores: the item's own ("nanochat"),
    or letters by position ("letter_first")."""
    if style == "nanochat":
        return item.labels
    if style == "letter_first":
        return tuple(LETTERS[: len(item.choices)])
    raise ValueError(f"categorical prompt {style!r} must be one of {list(CATEGORICAL_PROMPTS)}")


def categorical_prompt(item: CategoricalItem, style: CategoricalPrompt = "nanochat") -> dict[str, Any]:
    """The conversation for a categorical item in `style` (see `CategoricalPrompt`): the user turn,
    then the reply, the right choice's label."""
    labels = prompt_labels(item, style)
    if style == "nanochat":
        lines = [f"Multiple Choice question: {item.question}"]
        lines += [f"- {choice}={label}" for label, choice in zip(labels, item.choices)]
        lines += ["", "Respond only with the letter of the correct answer."]
    else:
        lines = [item.question, ""]
        lines += [f"{label}. {choice}" for label, choice in zip(labels, item.choices)]
        lines += ["", "Answer with the letter only."]
    user = "\n".join(lines)
    return {"messages": [text_message("user", user), text_message("assistant", labels[item.answer])]}


@dataclasses.dataclass(frozen=True)
class CodeItem:
    task_id: str
    prompt: str       # function signature and docstring
    test: str         # defines check(candidate)
    entry_point: str


def code_items(records: Iterable[dict[str, Any]]) -> list[CodeItem]:
    """HumanEval-format records: `task_id`, `prompt`, `test`, `entry_point`."""
    items = []
    for i, r in enumerate(records):
        missing = [k for k in ("task_id", "prompt", "test", "entry_point") if k not in r]
        if missing:
            raise ValueError(f"code item {i} misses {missing} (HumanEval format)")
        items.append(CodeItem(str(r["task_id"]), r["prompt"], r["test"], r["entry_point"]))
    return items


def benchmark_code_items(records: Iterable[dict[str, Any]]) -> list[CodeItem]:
    """Code items from a HumanEval snapshot (lockstep.data.sources.humaneval): documents whose `text`
    is the prompt, with `task_id`, `test` and `entry_point` beside it."""
    return code_items({**r, "prompt": r.get("text")} for r in records)


def code_program(item: CodeItem, completion: str) -> str:
    """The solution the sandbox runs: the model's code (from a ```python block when there is one;
    after the prompt when it does not define the entry point itself). The tests run apart from it."""
    blocks = _CODE_BLOCK.findall(completion)
    code = blocks[0] if blocks else completion
    if f"def {item.entry_point}" not in code:
        code = item.prompt + code
    return code


def code_tests(item: CodeItem) -> str:
    """The tests' side of a code item: its `check(candidate)` and the call that runs it."""
    return f"{item.test}\n\ncheck({item.entry_point})\n"


def code_context(item: CodeItem) -> str:
    """The prompt as code the tests may lean on (HumanEval tests call helpers that the prompt
    defines, e.g. `poly` or `encode_cyclic`): as it is when it compiles; with a placeholder body
    when it stops at the entry point's header; else nothing (such tests then fail on the name)."""
    for candidate in (item.prompt, item.prompt.rstrip() + "\n    pass\n"):
        try:
            compile(candidate, "setup.py", "exec")
        except SyntaxError:
            continue
        return candidate
    return ""


def letter_is_answer(item: CategoricalItem, letter: str) -> bool:
    """A categorical item's answer check: the label the model preferred is the answer's. `item` is
    as prompted (`evaluate_categorical` passes it with the labels its prompt showed)."""
    return letter == item.labels[item.answer]


def reply_is_answer(item: GenerativeItem, reply: str) -> bool:
    """A generative item's answer check: the reply's final answer is the reference's
    (`answers_match`: the number after its last `####`, else its last number, else its last line)."""
    return answers_match(item.reference, reply)


def passes_tests(item: CodeItem, reply: str, limits: SandboxLimits) -> TestRunResult:
    """A code item's answer check: the item's tests, run apart from the reply's code and calling
    it through the sandbox's proxy (see `sandbox.run_tests`); `.passed` is the verdict."""
    return run_tests(code_program(item, reply), code_tests(item), entry_point=item.entry_point,
                     setup=code_context(item), limits=limits)


# The answer checks the evaluate functions take, one per kind of item: (item as prompted, with the
# labels its prompt showed; the preferred label), (item, the decoded reply), (item, the decoded
# reply, the sandbox's limits).
CategoricalCheck = Callable[[CategoricalItem, str], bool]
GenerativeCheck = Callable[[GenerativeItem, str], bool]
CodeCheck = Callable[[CodeItem, str, SandboxLimits], TestRunResult]


@dataclasses.dataclass
class TaskResult:
    correct: int = 0
    total: int = 0
    skipped: int = 0  # items left out (a categorical prompt longer than the model's context)
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def reduce(self, device: torch.device) -> None:
        """Sum counts over ranks when a process group is up (records stay per rank)."""
        if dist.is_available() and dist.is_initialized():
            t = torch.tensor([self.correct, self.total, self.skipped], dtype=torch.float64)
            t = t.to(device) if device.type == "cuda" else t
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            self.correct, self.total, self.skipped = int(t[0].item()), int(t[1].item()), int(t[2].item())

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else float("nan")


def _shard(seq: Sequence[Any], rank: int, world_size: int) -> list[tuple[int, Any]]:
    return [(i, seq[i]) for i in range(rank, len(seq), world_size)]


def _generate_in_batches(generate: Generate, prompts: list[list[int]], batch_size: int | None) -> list[list[int]]:
    out: list[list[int]] = []
    step = batch_size or max(len(prompts), 1)
    for s in range(0, len(prompts), step):
        out.extend(generate(prompts[s : s + step]))
    if len(out) != len(prompts):
        raise ValueError(f"generate returned {len(out)} completions for {len(prompts)} prompts")
    return out


def evaluate_generative(
    items: Sequence[GenerativeItem],
    *,
    tokenizer: ChatTokenizer,
    generate: Generate,
    batch_size: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    check: GenerativeCheck = reply_is_answer,
) -> TaskResult:
    """`check` of each generated reply (tool calls included in the reply): by default exact match
    of its final answer. `generate` gets `batch_size` prompts a call, or all of this rank's at once
    when None (then it batches as it likes: see lockstep.pipeline.eval.make_generate)."""
    mine = _shard(items, rank, world_size)
    prompts = [tokenizer.render_for_completion(item.conversation) for _, item in mine]
    completions = _generate_in_batches(generate, prompts, batch_size)
    result = TaskResult()
    for (index, item), ids in zip(mine, completions):
        text = tokenizer.decode(ids)
        ok = check(item, text)
        result.correct += int(ok)
        result.total += 1
        result.records.append({
            "index": index,
            "prompt": _text_of(item.conversation["messages"][-2]) if len(item.conversation["messages"]) > 1 else "",
            "reference": item.reference,
            "completion": text,
            "extracted": extract_answer(text),
            "correct": ok,
        })
    return result


def label_token_ids(tokenizer: ChatTokenizer, labels: Sequence[str], known: dict[str, int] | None = None) -> list[int]:
    """The one token id of each label, the reply a categorical prompt asks for (`known`: a cache
    of labels already encoded). A label that is not one token is refused."""
    known = {} if known is None else known
    for label in labels:
        if label not in known:
            ids = tokenizer.encode(label)
            if len(ids) != 1:
                raise ValueError(
                    f"label {label!r} encodes to {len(ids)} tokens; categorical scoring needs one token per label"
                )
            known[label] = ids[0]
    return [known[label] for label in labels]


@torch.no_grad()
def evaluate_categorical(
    model: Callable[[torch.Tensor], torch.Tensor],
    items: Sequence[CategoricalItem],
    *,
    tokenizer: ChatTokenizer,
    device: torch.device,
    max_seq_len: int,
    rank: int = 0,
    world_size: int = 1,
    check: CategoricalCheck = letter_is_answer,
    prompt: CategoricalPrompt = "nanochat",
) -> TaskResult:
    """Argmax over the logits of the item's labels at the first reply position: the label the
    model prefers among those its `prompt` style shows (the dataset's own for "nanochat", A.. by
    position for "letter_first"), the rule of nanochat's categorical tasks, judged by `check` on
    the item as prompted. An item whose prompt does not fit in `max_seq_len` is skipped and counted
    in `skipped`, never scored and never fatal."""
    if prompt not in CATEGORICAL_PROMPTS:
        raise ValueError(f"categorical prompt {prompt!r} must be one of {list(CATEGORICAL_PROMPTS)}")
    known: dict[str, int] = {}
    result = TaskResult()
    for index, item in _shard(items, rank, world_size):
        shown = dataclasses.replace(item, labels=prompt_labels(item, prompt))
        ids = tokenizer.render_for_completion(categorical_prompt(shown, prompt))
        allowed = label_token_ids(tokenizer, shown.labels, known)
        if len(ids) > max_seq_len:
            result.skipped += 1
            continue
        logits = model(torch.tensor([ids], dtype=torch.long, device=device))  # (1, T, V)
        pick = int(logits[0, -1, torch.tensor(allowed, device=device)].float().argmax().item())
        predicted = shown.labels[pick]
        ok = check(shown, predicted)
        result.correct += int(ok)
        result.total += 1
        result.records.append({
            "index": index, "question": item.question, "choices": list(item.choices),
            "labels": list(shown.labels), "reference": shown.labels[item.answer], "predicted": predicted,
            "correct": ok,
        })
    return result


def reply_choice_prompt(item: CategoricalItem) -> dict[str, Any]:
    """The conversation for a reply-choice item: the question alone, no lettered choices; each
    choice is then scored as the whole reply."""
    return {"messages": [text_message("user", item.question), text_message("assistant", item.choices[item.answer])]}


@torch.no_grad()
def evaluate_reply_choice(
    model: Callable[[torch.Tensor], torch.Tensor],
    items: Sequence[CategoricalItem],
    *,
    tokenizer: ChatTokenizer,
    device: torch.device,
    max_seq_len: int,
    rank: int = 0,
    world_size: int = 1,
) -> TaskResult:
    """Multiple choice without letters (the cloze formulation): after the question, each choice's
    text followed by <|assistant_end|> is scored as the assistant's reply, and the model picks
    the choice with the lowest mean cross-entropy per reply token, CORE's rule for multiple
    choice. It asks what the model prefers to say, not whether it has learned to answer with a
    letter. An item whose longest choice does not fit in `max_seq_len` is skipped and counted in
    `skipped`."""
    end = tokenizer.encode_special("<|assistant_end|>")
    result = TaskResult()
    for index, item in _shard(items, rank, world_size):
        prompt = tokenizer.render_for_completion(reply_choice_prompt(item))
        replies = [tokenizer.encode(c) + [end] for c in item.choices]
        width = len(prompt) + max(len(r) for r in replies)
        if width > max_seq_len:
            result.skipped += 1
            continue
        ids = torch.zeros(len(replies), width, dtype=torch.long)  # (C, T), right-padded
        for j, r in enumerate(replies):
            ids[j, : len(prompt) + len(r)] = torch.tensor(prompt + r)
        logp = torch.log_softmax(model(ids.to(device)).float(), dim=-1)  # (C, T, V)
        mean_nats = []
        for j, r in enumerate(replies):
            at = torch.arange(
                len(prompt) - 1, len(prompt) - 1 + len(r), device=device
            )  # positions predicting the reply
            mean_nats.append(float(-logp[j, at, torch.tensor(r, device=device)].mean()))
        pick = min(range(len(replies)), key=lambda j: mean_nats[j])
        ok = pick == item.answer
        result.correct += int(ok)
        result.total += 1
        result.records.append({
            "index": index, "question": item.question, "choices": list(item.choices),
            "reference": LETTERS[item.answer], "predicted": LETTERS[pick], "correct": ok,
            "mean_nats": [round(x, 4) for x in mean_nats],
        })
    return result


def evaluate_code(
    items: Sequence[CodeItem],
    *,
    tokenizer: ChatTokenizer,
    generate: Generate,
    limits: SandboxLimits,
    batch_size: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    check: CodeCheck = passes_tests,
) -> TaskResult:
    """pass@1: `check` of each generated reply, by default the item's tests, run apart from the
    generated code and calling it through the sandbox's proxy, reach their last line (see
    `sandbox.run_tests`). `batch_size` as for `evaluate_generative`."""
    mine = _shard(items, rank, world_size)
    convs = [{"messages": [text_message("user", it.prompt), text_message("assistant", "")]} for _, it in mine]
    completions = _generate_in_batches(generate, [tokenizer.render_for_completion(c) for c in convs], batch_size)
    result = TaskResult()
    for (index, item), ids in zip(mine, completions):
        text = tokenizer.decode(ids)
        run = check(item, text, limits)
        result.correct += int(run.passed)
        result.total += 1
        result.records.append({
            "index": index, "task_id": item.task_id, "completion": text, "status": run.status,
            "stderr_tail": run.tests.stderr[-500:], "solution_stderr_tail": run.solution.stderr[-500:],
            "correct": run.passed,
        })
    return result


def random_baseline_categorical(items: Sequence[CategoricalItem]) -> float:
    return sum(1.0 / len(it.choices) for it in items) / len(items) if items else 0.0


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """What a ChatCORE benchmark declares in its module (lockstep.evaluate.benchmarks.*), read from
    the one table lockstep.evaluate.chatcore.BENCHMARKS by the eval stage (how its items are read
    and judged), the ChatCORE score (its baseline), the report card (its column) and the plan (its
    kind's cost)."""

    kind: Literal["categorical", "generative", "code"]  # scored by evaluate_categorical, _generative, _code
    baseline: float  # random-guess accuracy, the centre of its ChatCORE term (acc - b) / (1 - b)
    column: str  # its column in the report card's comparable table (nanochat's name for it)
    read: Callable[[Iterable[dict[str, Any]]], list[Any]]  # its snapshot's val records -> items of its kind
    check: Callable[..., Any]  # its kind's answer check: CategoricalCheck, GenerativeCheck or CodeCheck


def chatcore(accuracy_and_baseline: dict[str, tuple[float, float]]) -> float:
    """ChatCORE: mean over tasks of accuracy centred on the task's random baseline (0 for
    open-ended generation), so guessing scores 0 and a perfect model 1."""
    if not accuracy_and_baseline:
        raise ValueError("no chat tasks were evaluated; enable at least one in the eval params")
    vals = [(acc - base) / (1.0 - base) for acc, base in accuracy_and_baseline.values()]
    return sum(vals) / len(vals)
