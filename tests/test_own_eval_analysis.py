"""`lockstep dev own-eval` (lockstep.dev.own_eval_analysis): the scoring rules worked out by hand,
the CORE and letter rules equal to the eval stage's own decisions item by item (the reference),
schema pairs counted both ways, and the command printing a checkpoint beside its untrained
control, or one `error:` line naming the tasks it knows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from _tiny_model import randomize, tiny_gpt
from lockstep.cli import app
from lockstep.dev.own_eval_analysis import (analyse, analyse_categorical, analyse_core_task, choice_picks, find_task,
                                            gold_and_other_tokens, pair_agreement, render, summarise)
from lockstep.evaluate import chat, core
from lockstep.model.checkpoint import save_checkpoint
from lockstep.tokenizer.kinds import train_tokenizer

CPU = torch.device("cpu")
MC = [
    {"query": f"Q{i}: the cat sat on the", "choices": ["mat", "dog", "hat and a coat", "x"], "gold": i % 4}
    for i in range(6)
]
SCHEMA = [  # one pair asked both ways, and one item alone
    {"context_options": ["It was cold", "It was hot"], "continuation": "so I shivered.", "gold": 0},
    {"context_options": ["It was cold", "It was hot"], "continuation": "so I sweated.", "gold": 1},
    {"context_options": ["A dog", "A cat"], "continuation": "barked.", "gold": 0},
]
LM = [{"context": f"Count {i}, {i + 1},", "continuation": str(i + 2)} for i in range(4)]
ARC = [{"question": f"Which is number {i}?", "choices": ["one", "two", "three", "four"], "answer": "ABCD"[i % 4]}
       for i in range(5)]


def _bundle(root: Path) -> Path:
    folder = root / "core"
    rows = [
        ("mc", "multiple_choice", MC, 25, 2),
        ("sc", "schema", SCHEMA, 50, 1),
        ("lm", "language_modeling", LM, 0, 1),
    ]
    spec, meta = ["icl_tasks:"], ["Eval Task,Random baseline"]
    for label, kind, items, baseline, shots in rows:
        spec.append(f"- {{label: {label}, dataset_uri: {label}.jsonl, num_fewshot: [{shots}], icl_task_type: {kind}, "
                    "continuation_delimiter: ' '}")
        meta.append(f"{label},{baseline}")
        (folder / "eval_data").mkdir(parents=True, exist_ok=True)
        (folder / "eval_data" / f"{label}.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    (folder / "core.yaml").write_text("\n".join(spec) + "\n")
    (folder / "eval_meta_data.csv").write_text("\n".join(meta) + "\n")
    (root / "chat").mkdir()
    (root / "chat" / "arc_x.jsonl").write_text("".join(json.dumps(i) + "\n" for i in ARC))
    return root


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer("byte", [])


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return randomize(tiny_gpt(sequence_len=128, vocab_size=tok.get_vocab_size()), seed=3).eval()


def test_rules_by_hand() -> None:
    # One token at 3 nats against three at 4 + 0.5 + 0.5: the mean (1.67) picks the long option,
    # the sum (5 > 3) the short one. An option with nothing scored wins under neither.
    assert choice_picks([(3.0,), (4.0, 0.5, 0.5)]) == {"mean": 1, "sum": 0}
    assert choice_picks([(), (9.0,)]) == {"mean": 1, "sum": 1}
    assert choice_picks([(2.0,), (1.0, 1.0)], prefix="cloze_") == {"cloze_mean": 1, "cloze_sum": 0}  # tie: lower index


def test_core_rules_match_the_eval_stage_item_by_item(tmp_path: Path, tok, model) -> None:
    root = _bundle(tmp_path)
    for label in ("mc", "sc", "lm"):
        _, task = find_task(root, label)
        official: dict[int, bool] = {}
        res = core.evaluate_task(model, task, encode=tok.encode, bos_id=tok.get_bos_token_id(), max_seq_len=128,
                                 device=CPU, on_item=lambda i, _s, ok, _skip: official.__setitem__(i, ok))
        mine = analyse_core_task(
            model, task, encode=tok.encode, bos_id=tok.get_bos_token_id(), max_seq_len=128, device=CPU
        )
        rule = "exact" if task.task_type == "language_modeling" else "mean"
        assert {r.index: r.picks[rule] == r.gold for r in mine} == official, label
        assert summarise(mine, [rule])[rule].accuracy == pytest.approx(res["accuracy"])
        for r in mine:  # the sum rule, recomputed from the per-token losses
            if task.task_type != "language_modeling":
                sums = [sum(n) for n in r.nats]
                assert r.picks["sum"] == min(range(len(sums)), key=lambda j: (sums[j], j))
            assert all(math.isfinite(x) and x >= 0 for n in r.nats for x in n)


@pytest.mark.parametrize("prompt", chat.CATEGORICAL_PROMPTS)
def test_letter_rule_matches_the_eval_stage(tok, prompt) -> None:
    torch.manual_seed(0)  # a context that holds nanochat's longer prompt (~140 byte tokens)
    model = randomize(tiny_gpt(sequence_len=256, vocab_size=tok.get_vocab_size()), seed=3).eval()
    items = chat.categorical_items(ARC)
    official = chat.evaluate_categorical(model, items, tokenizer=tok, device=CPU, max_seq_len=256, prompt=prompt)
    mine = analyse_categorical(model, items, tokenizer=tok, device=CPU, max_seq_len=256, prompt=prompt)
    assert official.total == len(items)
    assert [r.picks["letter"] for r in mine] == ["ABCD".index(rec["predicted"]) for rec in official.records]
    # The cloze reading scores each choice's text as the reply: its span is the choice's bytes.
    assert [r.tokens for r in mine] == [tuple(len(c.encode()) for c in it.choices) for it in items]


def test_summary_counts_positions_lengths_and_pairs(tmp_path: Path, tok, model) -> None:
    root = _bundle(tmp_path)
    analysis = analyse(
        "mc",
        {"trained": model, "untrained": tiny_gpt(sequence_len=128, vocab_size=tok.get_vocab_size())},
        evalsets=root,
        tokenizer=tok,
        max_seq_len=128,
        device=CPU,
    )
    res = analysis.models["trained"]
    s = summarise(res, ["mean", "sum"])
    assert sum(s["mean"].picks_by_position) == len(MC)
    # Byte tokens, the delimiter's space being a token of its own (context, not scored): "mat" 3,
    # "dog" 3, "hat and a coat" 14, "x" 1; golds mat, dog, hat.., x, mat, dog.
    golds = (3, 3, 14, 1, 3, 3)
    assert gold_and_other_tokens(res) == (pytest.approx(sum(golds) / 6), pytest.approx(sum(21 - g for g in golds) / 18))
    assert s["sum"].picks_shortest + s["sum"].picks_longest <= len(MC)
    text = render(analysis, per_item=True)
    assert "accuracy mean (CORE)" in text and "untrained" in text and "tokens, gold / other options" in text
    _, schema = find_task(root, "sc")
    results = analyse_core_task(
        model, schema, encode=tok.encode, bos_id=tok.get_bos_token_id(), max_seq_len=128, device=CPU
    )
    counts = pair_agreement(schema, results)
    assert sum(counts.values()) == 1  # the lone item is no pair
    both = [r.picks["mean"] == r.gold for r in results[:2]]
    assert counts == {sum(both): 1}


def test_cli_prints_trained_beside_untrained_and_names_unknown_tasks(tmp_path: Path, tok, model) -> None:
    root = _bundle(tmp_path / "evalsets")
    tok.save(tmp_path / "tokenizer")
    save_checkpoint(tmp_path / "ckpt", model.state_dict(), {0: {}},
                    {"step": 7, "model_config": model.config.to_dict(), "tokenizer_sha256": tok.sha256})
    runner = CliRunner()
    args = ["dev", "own-eval", "--ckpt", str(tmp_path / "ckpt"), "--tokenizer", str(tmp_path / "tokenizer"),
            "--evalsets", str(root)]
    out = runner.invoke(app, [*args, "arc_x", "--items"])
    assert out.exit_code == 0, out.output
    assert "accuracy letter (eval)" in out.output and "accuracy cloze_mean" in out.output
    assert "trained" in out.output and "untrained" in out.output
    js = runner.invoke(app, [*args, "sc", "--json"])
    assert js.exit_code == 0, js.output
    data = json.loads(js.output)
    assert data["kind"] == "schema" and set(data["models"]) == {"trained", "untrained"}
    assert data["models"]["trained"]["mean"]["n"] == len(SCHEMA)
    bad = runner.invoke(app, [*args, "nope"])
    assert bad.exit_code == 2 and "no task 'nope'" in bad.output and "mc, sc, lm" in bad.output
