"""EleutherAI's lm-evaluation-harness on an exported lockstep model, offline: its `hf` model with
`trust_remote_code=True` runs tasks defined from local JSON-lines files of CORE's three item
shapes (multiple choice, schema, language modelling), through `lm_eval.simple_evaluate` in a
fresh process with the hub switched off and no lockstep importable. Every log-likelihood it
reports is the sum of the log-probs lockstep's GPT gives the same continuation tokens. Its
scored spans are set beside CORE's (lockstep.evaluate.core, nanochat's spans) item by item: the
same rows, a span that differs only by the leading tokens every choice shares (multiple choice)
or the context ending every row shares (schema), and its decisions equal CORE's where the rule
makes them equal (stated in docs/evaluation.md, "lm-evaluation-harness")."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from _tiny_model import fit_rows
from lockstep.evaluate.core import CoreTask, choose_option, evaluate_task, option_losses, render_item
from lockstep.model.checkpoint import save_checkpoint
from lockstep.tokenizer.kinds import train_tokenizer
from lockstep.tools.export_hf import export_hf

for module, extra in [("transformers", "hf"), ("lm_eval", "eval")]:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: install the `{extra}` extra (pip install -e '.[{extra}]')",
                    allow_module_level=True)  # fmt: skip

pytestmark = pytest.mark.slow

# CORE's multiple-choice items (query, choices, gold). Choices of one token each, choices of
# different lengths, choices that share their first token (` the`), and digits, before which the
# delimiter's space is a token of its own.
MC = [
    {"query": "The cat sat on the", "choices": ["mat", "dog", "sun"], "gold": 0},
    {"query": "The dog ran to the", "choices": ["park", "moon", "cat"], "gold": 0},
    {"query": "A bird can", "choices": ["swim", "fly", "read"], "gold": 1},
    {"query": "At night the", "choices": ["sun", "moon", "mat"], "gold": 1},
    {"query": "The sun is", "choices": ["hot and bright", "cold", "a cat"], "gold": 0},
    {"query": "Fish live in", "choices": ["the sea", "the sky", "the park"], "gold": 0},
    {"query": "A cat and a", "choices": ["dog", "the moon", "fish"], "gold": 0},
    {"query": "Q: 2 + 2 =", "choices": ["4", "5", "22"], "gold": 0},
    {"query": "Q: 1 + 2 =", "choices": ["4", "3", "12"], "gold": 1},
]
# CORE's schema items (context_options, continuation, gold): contexts that end on different
# tokens, and contexts that end alike (` sat on the`, ` can`), which CORE scores with the continuation.
SCHEMA = [
    {"context_options": ["A bird can", "A cat and a"], "continuation": "fly", "gold": 0},
    {"context_options": ["The sun is", "At night the"], "continuation": "moon", "gold": 1},
    {"context_options": ["At night the dog", "At night the cat"], "continuation": "sat", "gold": 1},
    {"context_options": ["The dog sat on the", "The cat sat on the"], "continuation": "mat", "gold": 1},
    {"context_options": ["A bird can", "A fish can"], "continuation": "fly", "gold": 0},
    {"context_options": ["The moon ran to the", "The dog ran to the"], "continuation": "park", "gold": 1},
    {"context_options": ["A fish can", "A bird can"], "continuation": "swim", "gold": 0},
    {"context_options": ["At night the", "The sun is"], "continuation": "hot and bright", "gold": 1},
    {"context_options": ["The dog ran to a", "The cat sat on the"], "continuation": "park", "gold": 0},
]
# A schema item whose second row is MC[5]'s first (`Fish live in the sea`) split elsewhere: ` sea`
# after `Fish live in the`, where MC[5] scores ` the sea` after `Fish live in`. Run in one
# evaluation with MC, lm_eval 0.4.13's logits cache (on by default) reads the shorter
# continuation's log-prob from the longer one's first position; `logits_cache=False` does not.
RESPLIT = [{"context_options": ["Fish live in a", "Fish live in the"], "continuation": "sea", "gold": 1}]
# CORE's language-modelling items (context, continuation): right when every token is the argmax.
LM = [
    {"context": "The cat sat on the", "continuation": "mat"},
    {"context": "A bird can  ", "continuation": "fly"},  # trailing spaces: both trim them
    {"context": "The dog ran to the", "continuation": "park"},
    {"context": "The sun is", "continuation": "cold and dark"},
    {"context": "Q: 2 + 2 =", "continuation": "4"},
]
# What the model is trained on: some items' right answers, so that some decisions are right and
# some are not.
TRAIN = [
    "The cat sat on the mat",
    "The dog ran to the park",
    "A bird can fly",
    "Fish live in the sea",
    "Q: 2 + 2 = 4",
]
# The tokenizer's text: every word of the items a token of its own (with its leading space).
TOKENIZER_TEXT = [
    *TRAIN,
    "At night the moon and the sun. A cat and a dog and a fish swim. It is hot and bright, cold, or dark.\n",
    "A bird can read the sky.\n",
] * 3

# An lm_eval task over one JSON-lines file of items, their CORE fields read as lm_eval's; `acc` per item.
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
{fields}
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
TASKS = {
    # (items, output_type, how lm_eval reads an item)
    "lockstep_mc": (MC, "multiple_choice", "doc_to_text: query\ndoc_to_choice: choices\ndoc_to_target: gold\n"
                    'target_delimiter: " "'),
    # doc_to_text an int: lm_eval's "multiple inputs", one context per option, as winogrande
    "lockstep_schema": (SCHEMA, "multiple_choice", "doc_to_text: gold\ndoc_to_choice: context_options\n"
                        'doc_to_target: continuation\ntarget_delimiter: " "'),
    "lockstep_resplit": (RESPLIT, "multiple_choice", "doc_to_text: gold\ndoc_to_choice: context_options\n"
                         'doc_to_target: continuation\ntarget_delimiter: " "'),
    "lockstep_lm": (LM, "loglikelihood", 'doc_to_text: "{{context | trim}}"\n'
                    "doc_to_target: \"{{' ' + continuation}}\""),
}  # fmt: skip

# Runs in a fresh process: the hub and datasets offline, HF_HOME a temp folder, no lockstep.
HARNESS = """
import json, sys
sys.modules["lockstep"] = None  # the folder needs no lockstep: importing it fails here
import lm_eval
from lm_eval.tasks import TaskManager

folder, tasks_dir, out = sys.argv[1:]
manager = TaskManager(include_path=tasks_dir, include_defaults=False)
runs = {  # name: (extra model_args, tasks)
    "default": ("", ["lockstep_mc", "lockstep_schema", "lockstep_lm"]),
    "no_logits_cache": (",logits_cache=False", ["lockstep_mc", "lockstep_resplit"]),
}
written = {}
for name, (extra, tasks) in runs.items():
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={folder},trust_remote_code=True,dtype=float32" + extra,
        tasks=tasks,
        task_manager=manager,
        batch_size=4,
        device="cpu",
        log_samples=True,
    )
    samples = {
        task: [{k: s[k] for k in ("doc_id", "arguments", "resps", "filtered_resps", "acc")} for s in rows]
        for task, rows in results["samples"].items()
    }
    written[name] = {"results": results["results"], "samples": samples}
json.dump(written, open(out, "w"))
"""


STEPS = 30


def _train(tok, steps: int = STEPS) -> torch.nn.Module:
    """The tiny GPT over `tok`, seeded, trained for `steps` full-batch steps on TRAIN."""
    rows = tok.encode(TRAIN, prepend="<|bos|>")
    return fit_rows(rows, steps=steps, lr=0.01, pad_id=tok.get_bos_token_id(), sequence_len=128,
                    vocab_size=tok.get_vocab_size())  # fmt: skip


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """(lockstep GPT, lockstep tokenizer, lm_eval's results and samples) of TASKS."""
    root = tmp_path_factory.mktemp("lm_eval")
    tok = train_tokenizer("bpe", TOKENIZER_TEXT, vocab_size=400)
    tok.save(root / "tokenizer")
    model = _train(tok)
    meta = {"step": STEPS, "model_config": model.config.to_dict(), "tokenizer_sha256": tok.sha256}
    save_checkpoint(root / "ckpt", model.state_dict(), {0: {}}, meta)
    export_hf(root / "ckpt", root / "tokenizer", root / "hf")
    tasks = root / "tasks"
    tasks.mkdir()
    for name, (items, output_type, fields) in TASKS.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
        yaml = TASK.format(name=name, data=data, output_type=output_type, fields=fields)
        (tasks / f"{name}.yaml").write_text(yaml, encoding="utf-8")
    (root / "harness.py").write_text(HARNESS, encoding="utf-8")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(root / "hf_home"),
        "PYTHONPATH": "",
    }
    env.pop("HF_MODULES_CACHE", None)
    env.pop("HF_DATASETS_CACHE", None)
    r = subprocess.run(
        [sys.executable, str(root / "harness.py"), str(root / "hf"), str(tasks), str(root / "out.json")],
        capture_output=True, text=True, env=env, cwd=root, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    return model, tok, json.loads((root / "out.json").read_text())


def lm_eval_split(tok, context: str, continuation: str) -> tuple[list[int], int]:
    """lm_eval's row and the start of the continuation it scores, for a causal model: trailing
    whitespace moves from the context to the continuation, the two are tokenized as one string
    (the folder's tokenizer prepends <|bos|>), and the continuation is what follows as many tokens
    as the context alone has. Here with lockstep's tokenizer, which gives the folder's ids."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    return tok.encode(context + continuation, prepend="<|bos|>"), len(tok.encode(context, prepend="<|bos|>"))


@torch.no_grad()
def token_logprobs(model, row: list[int]) -> torch.Tensor:
    """log p(row[t] | row[:t]) under lockstep's GPT for t = 1 .. len(row) - 1, in fp32."""
    logits = model(torch.tensor([row])).float()
    return torch.log_softmax(logits[0, :-1], dim=-1).gather(1, torch.tensor(row[1:])[:, None])[:, 0]


@torch.no_grad()
def greedy(model, row: list[int], start: int) -> bool:
    """Whether every token of row[start:] is the GPT's argmax prediction."""
    logits = model(torch.tensor([row]))
    return bool(torch.equal(logits[0, start - 1 : -1].argmax(-1), torch.tensor(row[start:])))


def requests(out: dict, task: str) -> list[tuple[int, str, str, float, bool]]:
    """(doc_id, context, continuation, log-likelihood, is_greedy) of every request lm_eval made."""
    rows = []
    for s in sorted(out["samples"][task], key=lambda s: s["doc_id"]):
        assert [list(r[0]) for r in s["resps"]] == [list(f) for f in s["filtered_resps"]]  # no filter changes them
        for (context, continuation), (ll, is_greedy) in zip(s["arguments"], s["filtered_resps"]):
            rows.append((s["doc_id"], context, continuation, ll, is_greedy))
    return rows


@pytest.mark.parametrize("run", ["default", "no_logits_cache"])
def test_every_loglikelihood_is_the_gpts_sum_of_logprobs(harness, run: str) -> None:
    """Computed with lockstep's GPT directly: log-softmax of its fp32 logits, summed over the
    tokens lm_eval scores; and lm_eval's is_greedy is the GPT's argmax over them. The second run
    has RESPLIT beside MC, with lm_eval's logits cache off."""
    model, tok, out = harness
    out = out[run]
    n = 0
    for task in out["samples"]:
        for _, context, continuation, ll, is_greedy in requests(out, task):
            row, start = lm_eval_split(tok, context, continuation)
            ours = token_logprobs(model, row)[start - 1 :].sum().item()
            assert ll == pytest.approx(ours, abs=1e-5), (task, context, continuation)
            assert is_greedy == greedy(model, row, start), (task, context, continuation)
            n += 1
    items = [item for task in out["samples"] for item in TASKS[task][0]]
    assert n == sum(len(it.get("choices", it.get("context_options", [0]))) for it in items)  # one per option


def core_decisions(model, tok, kind: str, items: list[dict]) -> tuple[CoreTask, dict[int, bool]]:
    """A zero-shot CORE task of `items` and, by item, whether lockstep's CORE gets it right."""
    task = CoreTask("t", kind, 0, " ", 0.0, tuple(items))  # type: ignore[arg-type]
    decisions: dict[int, bool] = {}
    evaluate_task(model, task, encode=tok.encode, bos_id=tok.get_bos_token_id(), max_seq_len=128,
                  device=torch.device("cpu"),
                  on_item=lambda i, scored, ok, skip: decisions.__setitem__(i, ok))  # fmt: skip
    return task, decisions


def core_losses(model, rows: list[list[int]], spans: list[tuple[int, int]]) -> list[float]:
    """CORE's mean cross-entropy of each row over its span (lockstep.evaluate.core.option_losses)."""
    T = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (T - len(r)) for r in rows])
    with torch.no_grad():
        return option_losses(model(ids).float(), ids, spans)


def side_by_side(harness, task_name: str, kind: str, items: list[dict]):
    """Per item: CORE's rendering, its decision, lm_eval's (row, start, log-likelihood) per option,
    CORE's mean loss per option, the GPT's log-probs per row, and lm_eval's acc."""
    model, tok, out = harness
    out = out["default"]
    task, core_ok = core_decisions(model, tok, kind, items)
    theirs: dict[int, list[tuple[list[int], int, float]]] = {}
    for doc_id, context, continuation, ll, _ in requests(out, task_name):
        theirs.setdefault(doc_id, []).append((*lm_eval_split(tok, context, continuation), ll))
    acc = {s["doc_id"]: bool(s["acc"]) for s in out["samples"][task_name]}
    for index in range(len(items)):
        scored = render_item(task, index, tok.encode, tok.get_bos_token_id())
        assert [row for row, _, _ in theirs[index]] == scored.rows  # the same text, tokenized whole
        logprobs = [token_logprobs(model, row) for row in scored.rows]
        yield scored, core_ok[index], theirs[index], core_losses(model, scored.rows, scored.spans), logprobs, acc[index]


def test_multiple_choice_spans_and_decisions_beside_cores(harness) -> None:
    """lm_eval scores each choice from the end of the query's tokens, CORE from the end of the
    tokens every choice's row shares: lm_eval's log-likelihood is CORE's span's plus those shared
    tokens', which are the same for every choice. So lm_eval's `acc` (the highest sum) is CORE's
    decision wherever CORE's spans are alike in length (its mean then orders as the sum), and CORE's
    mean, recomputed from lm_eval's numbers, decides as CORE where the spans are the same."""
    seen = {"same spans": 0, "shared tokens in front": 0, "acc is CORE's": 0, "lengths differ": 0}
    rights = []
    for scored, core_ok, theirs, losses, logprobs, acc in side_by_side(harness, "lockstep_mc", "multiple_choice", MC):
        shared = []
        for (row, start, ll), (s, e), loss, lp in zip(theirs, scored.spans, losses, logprobs):
            assert start <= s and e == len(row)
            shared.append(lp[start - 1 : s - 1].sum().item())
            assert ll == pytest.approx(shared[-1] - (e - s) * loss, abs=1e-5)
        assert shared == pytest.approx([shared[0]] * len(shared), abs=1e-5)  # the same prefix in every row
        lengths = [e - s for s, e in scored.spans]
        if [start for _, start, _ in theirs] == [s for s, _ in scored.spans]:
            seen["same spans"] += 1
            means = [-ll / n for (_, _, ll), n in zip(theirs, lengths)]
            assert choose_option(means) == choose_option(losses)
        else:
            seen["shared tokens in front"] += 1
        if len(set(lengths)) == 1:
            seen["acc is CORE's"] += 1
            assert acc == core_ok
            rights.append(core_ok)
        else:
            seen["lengths differ"] += 1
    assert all(seen.values()), seen
    assert any(rights) and not all(rights)  # the model gets some right and some wrong


def test_schema_spans_and_decisions_beside_cores(harness) -> None:
    """lm_eval scores the continuation after each context; CORE also the context ending all the
    rows share, whose log-probs differ from context to context. Where no ending is shared the
    spans are the same, alike in length, and lm_eval's `acc` is CORE's decision."""
    seen = {"same spans": 0, "shared ending in the span": 0}
    rights = []
    for scored, core_ok, theirs, losses, logprobs, acc in side_by_side(harness, "lockstep_schema", "schema", SCHEMA):
        for (row, start, ll), (s, e), loss, lp in zip(theirs, scored.spans, losses, logprobs):
            assert s <= start and e == len(row)
            assert ll == pytest.approx(-(e - s) * loss - lp[s - 1 : start - 1].sum().item(), abs=1e-5)
        if [start for _, start, _ in theirs] == [s for s, _ in scored.spans]:
            seen["same spans"] += 1
            assert acc == core_ok
            rights.append(core_ok)
        else:
            seen["shared ending in the span"] += 1
    assert all(seen.values()), seen
    assert any(rights) and not all(rights)


def test_language_modelling_decisions_are_cores(harness) -> None:
    """A loglikelihood task's `acc` is lm_eval's is_greedy: every continuation token the argmax,
    as CORE's language modelling; its span is CORE's (no token merges across the end of a
    context here), so the decisions are CORE's."""
    model, tok, out = harness
    out = out["default"]
    task, core_ok = core_decisions(model, tok, "language_modeling", LM)
    acc = {s["doc_id"]: s["acc"] for s in out["samples"]["lockstep_lm"]}
    for doc_id, context, continuation, _, _ in requests(out, "lockstep_lm"):
        row, start = lm_eval_split(tok, context, continuation)
        assert render_item(task, doc_id, tok.encode, tok.get_bos_token_id()).spans == [(start, len(row))]
        assert bool(acc[doc_id]) == core_ok[doc_id], doc_id
    assert any(core_ok.values()) and not all(core_ok.values())
    assert out["results"]["lockstep_lm"]["acc,none"] == pytest.approx(sum(core_ok.values()) / len(LM))
