"""The shipped eval sets: exactly the generator's output, big enough to measure something (>= 200
items per accuracy), gold answers spread over the positions, no repeats, every code item's
reference solution passing its tests while a near miss fails, in the sandbox for a sample that
covers what the items send through it (that no stage imports the generator,
lockstep.dev.evalsets_build, is tests/test_dev_tools.py's)."""

from __future__ import annotations

import ast
import collections
import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lockstep.cli import app
from lockstep.dev import evalsets_build
from lockstep.evaluate import chat
from lockstep.evaluate.core import load_core_tasks
from lockstep.evaluate.sandbox import SandboxLimits, run_tests
from lockstep.tokenizer.kinds import train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
EVALSETS = ROOT / "evalsets"
MIN_ITEMS = 200
FILES = (
    evalsets_build.BARD_ORDER,
    evalsets_build.BARD_AGREE,
    evalsets_build.BARD_CHOICE,
    evalsets_build.BARD_SCHEMA,
    evalsets_build.BARD_CLOZE,
    evalsets_build.BARD_TURN,
    evalsets_build.ARC_OWN,
    evalsets_build.BARD_LINE,
    evalsets_build.CODE_OWN,
)
LIMITS = SandboxLimits(timeout_s=10.0, memory_bytes=512 << 20)


def _read(rel: str) -> list[dict]:
    return [json.loads(line) for line in (EVALSETS / rel).read_text(encoding="utf-8").splitlines() if line.strip()]


def test_committed_files_are_the_generators_output() -> None:
    assert evalsets_build.drifted(EVALSETS) == [], "fix: lockstep dev evalsets --write"
    assert set(evalsets_build.build_evalsets()) == set(FILES)


def test_hand_written_items_come_first_in_order() -> None:
    for rel, hand in (
        (evalsets_build.BARD_CHOICE, evalsets_build.BARD_CHOICE_HAND),
        (evalsets_build.BARD_SCHEMA, evalsets_build.BARD_SCHEMA_HAND),
        (evalsets_build.BARD_CLOZE, evalsets_build.BARD_CLOZE_HAND),
        (evalsets_build.ARC_OWN, evalsets_build.ARC_HAND),
    ):
        assert _read(rel)[: len(hand)] == list(hand), rel
    code = _read(evalsets_build.CODE_OWN)
    assert [{k: r[k] for k in ("task_id", "prompt", "entry_point", "test")} for r in code[:5]] == list(
        evalsets_build.CODE_HAND
    )


@pytest.mark.parametrize("rel", FILES)
def test_every_task_has_enough_items_and_no_repeats(rel: str) -> None:
    items = _read(rel)
    assert len(items) >= MIN_ITEMS, (
        f"{rel} holds {len(items)} items; one item would move its accuracy by more than 0.5 points"
    )
    seen = [json.dumps({k: v for k, v in it.items() if k != "task_id"}, sort_keys=True) for it in items]
    assert len(set(seen)) == len(seen), f"{rel} repeats an item"


@pytest.mark.parametrize(
    ("rel", "options_key", "gold_of"),
    [
        (evalsets_build.BARD_ORDER, "choices", lambda it: it["gold"]),
        (evalsets_build.BARD_AGREE, "context_options", lambda it: it["gold"]),
        (evalsets_build.BARD_CHOICE, "choices", lambda it: it["gold"]),
        (evalsets_build.BARD_SCHEMA, "context_options", lambda it: it["gold"]),
        (evalsets_build.ARC_OWN, "choices", lambda it: "ABCD".index(it["answer"])),
    ],
)
def test_gold_answers_are_spread_over_the_positions(rel: str, options_key: str, gold_of) -> None:
    items = _read(rel)
    widths = {len(it[options_key]) for it in items}
    assert len(widths) == 1, f"{rel} mixes {sorted(widths)}-way items"
    n = widths.pop()
    counts = collections.Counter(gold_of(it) for it in items)
    share = max(counts.values()) / len(items)
    # A model always picking one position scores chance, not more: at most ~35% of 4-way golds
    # (chance 25%) or ~60% of 2-way golds (chance 50%) sit in any one position.
    assert share <= {4: 0.35, 2: 0.60}[n], f"{rel}: {dict(counts)}"
    for it in items:
        options = it[options_key]
        assert len(set(options)) == n, f"{rel}: repeated option in {options}"


def test_the_files_load_through_the_evaluators() -> None:
    core = {t.label: t for t in load_core_tasks(EVALSETS / "core")}
    assert set(core) == {"bard_order", "bard_agree", "bard_turn"}  # the offline presets' CORE-style tasks
    tasks = {**core, **{t.label: t for t in load_core_tasks(EVALSETS / "core_hard")}}
    assert {t.task_type for t in tasks.values()} == {"multiple_choice", "schema", "language_modeling"}
    assert all(len(t.items) >= MIN_ITEMS for t in tasks.values())
    assert all(it["continuation"] and not it["context"].endswith(" ") for it in tasks["bard_cloze"].items)
    arc = chat.categorical_items(_read(evalsets_build.ARC_OWN))
    assert len(arc) >= MIN_ITEMS and all(len(it.choices) == 4 for it in arc)
    code = chat.code_items(_read(evalsets_build.CODE_OWN))
    assert len({it.entry_point for it in code}) == len(code), "two code items share an entry point"


def test_bard_choice_distractors_are_other_items_answers() -> None:
    # Drawn from the answers, a distractor is as long and as frequent as an answer on average.
    # Everyday words as distractors ("teapot") were 3.3 tokens of the tiny preset's tokenizer
    # against 1.7 for the famous lines' words, and option length decided those items
    # (dev/LOG.md, 2026-11-26, "Own eval tasks at chance"). The hand-written items are left as written.
    items = _read(evalsets_build.BARD_CHOICE)[len(evalsets_build.BARD_CHOICE_HAND) :]
    answers = {it["choices"][it["gold"]] for it in items}
    odd = sorted({c for it in items for j, c in enumerate(it["choices"]) if j != it["gold"] and c not in answers})
    assert odd == [], f"{len(odd)} distractors answer no item: {odd[:8]}"


def test_bard_order_options_reorder_one_window_of_the_line() -> None:
    # The wrong orders shuffle the same window of at most four neighbouring words, so the line is
    # one of four orders of that window: a random scorer picks it a quarter of the time (three
    # single swaps would put it one swap from each, and a random scorer below a quarter).
    for it in _read(evalsets_build.BARD_ORDER):
        line = it["choices"][it["gold"]].split(" ")
        moved = set()
        for j, choice in enumerate(it["choices"]):
            words = choice.split(" ")
            assert sorted(words) == sorted(line), (choice, line)
            moved |= {k for k in range(len(line)) if words[k] != line[k]}
        assert len(set(it["choices"])) == 4 and max(moved) - min(moved) < evalsets_build._ORDER_WINDOW, it


def test_bard_order_options_are_the_same_tokens() -> None:
    # With a BPE that splits at spaces, an item's options are one multiset of tokens: length and
    # word frequency say nothing, only the order does. (Where a tokenizer has no token for a
    # capitalised first word after a space, " Under" -> " ", "Under", the space is scored only in
    # the options that do not start with it: 1 of 366 items with the tiny preset's tokenizer.)
    items = _read(evalsets_build.BARD_ORDER)
    tok = train_tokenizer("bpe", ["\n".join(it["choices"][it["gold"]] for it in items)], vocab_size=512)
    differ = [
        it["choices"][it["gold"]]
        for it in items
        if len({tuple(sorted(tok.encode(" " + c))) for c in it["choices"]}) > 1
    ]
    assert differ == [], f"{len(differ)} of {len(items)} items have options of other tokens: {differ[:3]}"


def test_bard_agree_asks_each_pair_both_ways() -> None:
    # The contexts differ in their last word, the subject; for each pair of contexts, as many items
    # want the one as the other, so preferring one subject whatever follows scores half.
    wanted: dict[tuple[str, ...], collections.Counter] = collections.defaultdict(collections.Counter)
    for it in _read(evalsets_build.BARD_AGREE):
        a, b = it["context_options"]
        assert a != b and a.rsplit(" ", 1)[0] == b.rsplit(" ", 1)[0], it
        wanted[tuple(sorted((a, b)))][it["context_options"][it["gold"]]] += 1
    for contexts, counts in wanted.items():
        assert counts[contexts[0]] == counts[contexts[1]], (contexts, counts)


def _judge(record: dict, body: str):
    item = chat.code_items([record])[0]
    return run_tests(
        chat.code_program(item, body),
        chat.code_tests(item),
        entry_point=item.entry_point,
        setup=chat.code_context(item),
        limits=LIMITS,
    )


def _judge_here(record: dict, body: str) -> str:
    """How the item's tests end on `body`, the programs assembled as for the sandbox but run in this
    process (our own items: trusted code): "passed", or the class of what they raised."""
    item = chat.code_items([record])[0]
    scope: dict = {}
    try:
        for code in (chat.code_context(item), chat.code_program(item, body), chat.code_tests(item)):
            exec(code, scope)
    except Exception as e:  # the tests' AssertionError, or what the body raised
        return type(e).__name__
    return "passed"


def _shape(value) -> str:
    """The type of a plain value, with those of the items of a container: `list[int|str]`."""
    if isinstance(value, dict):
        return "dict[" + "|".join(sorted({f"{_shape(k)}:{_shape(v)}" for k, v in value.items()})) + "]"
    if isinstance(value, (list, tuple, set)):
        return f"{type(value).__name__}[" + "|".join(sorted({_shape(v) for v in value})) + "]"
    return type(value).__name__


def _sandbox_cases(record: dict, wrong: str) -> set[tuple]:
    """What judging the item in the sandbox exercises: the shapes of the arguments of each call its
    tests make and of the value each call must equal (or be), which the tests' process and the
    solution's exchange as plain data, and how its near miss fails."""
    cases: set[tuple] = {("near miss", _judge_here(record, wrong))}
    for node in ast.walk(ast.parse(record["test"])):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call):
            cases.add(("arguments", tuple(_shape(ast.literal_eval(a)) for a in node.left.args)))
            cases.add(("result", type(node.ops[0]).__name__, _shape(ast.literal_eval(node.comparators[0]))))
    return cases


def _code_sample() -> list[tuple[dict, str]]:
    """A hand-written item, one of a parametrised family and two written out one by one, then as
    few items more as cover every case of `_sandbox_cases` that any item has (picked greedily:
    each time the item with the most cases not yet covered, the first of equals)."""
    pairs = evalsets_build.code_items_with_wrong()
    by_entry = {r["entry_point"]: (r, w) for r, w in pairs}
    sample = [by_entry[name] for name in ("count_letter", "caesar_shift_three", "merge_sorted", "letter_counts")]
    cases = {r["entry_point"]: _sandbox_cases(r, w) for r, w in pairs}
    left = set().union(*cases.values()) - set().union(*(cases[r["entry_point"]] for r, _ in sample))
    while left:
        best = max(cases, key=lambda name: len(cases[name] & left))
        sample.append(by_entry[best])
        left -= cases[best]
    return sample


@pytest.mark.parametrize("pair", _code_sample(), ids=lambda p: p[0]["entry_point"])
def test_code_reference_passes_and_a_near_miss_fails_in_the_sandbox(pair) -> None:
    record, wrong = pair
    assert _judge(record, record["canonical_solution"]).passed
    assert not _judge(record, wrong).passed
    assert not _judge(record, "    return None\n").passed


def test_every_code_reference_passes_and_its_near_miss_fails() -> None:
    """Every item, judged in this process: the sandbox judges the sample above, which sends every
    shape of argument and result these items have through it and meets every way their near
    misses fail (judging all of them there, about 400 sandboxed runs, took minutes and showed the
    sandbox nothing more; tests/test_sandbox_load.py runs references there under load)."""
    committed = _read(evalsets_build.CODE_OWN)
    pairs = evalsets_build.code_items_with_wrong()
    assert [r for r, _ in pairs] == committed
    failed = [(r["task_id"], v) for r, _ in pairs if (v := _judge_here(r, r["canonical_solution"])) != "passed"]
    caught = [r["task_id"] for r, w in pairs if _judge_here(r, w) == "passed"]
    assert failed == [] and caught == [], f"references failing: {failed}; near misses passing: {caught}"


def test_a_wrong_solution_that_passes_is_refused_at_generation() -> None:
    spec = evalsets_build.CodeSpec(
        "twice", "n", "Return 2 * n.", "    return 2 * n\n", "    return n + n\n", ((3,), (0,))
    )
    with pytest.raises(evalsets_build.EvalsetBuildError, match="twice: the wrong solution passes every case"):
        evalsets_build._code_record("own/x", spec)


def test_cli_check_names_a_drifted_file_and_write_fixes_it(tmp_path: Path) -> None:
    copy = tmp_path / "evalsets"
    shutil.copytree(EVALSETS, copy)
    runner = CliRunner()
    ok = runner.invoke(app, ["dev", "evalsets", "--evalsets", str(copy)])
    assert ok.exit_code == 0, ok.output
    target = copy / evalsets_build.ARC_OWN
    target.write_text(target.read_text(encoding="utf-8").replace('"answer": "B"', '"answer": "A"', 1), encoding="utf-8")
    bad = runner.invoke(app, ["dev", "evalsets", "--evalsets", str(copy)])
    assert bad.exit_code == 1
    assert str(target) in bad.output and "lockstep dev evalsets --write" in bad.output
    fixed = runner.invoke(app, ["dev", "evalsets", "--write", "--evalsets", str(copy)])
    assert fixed.exit_code == 0 and evalsets_build.ARC_OWN in fixed.output
    assert target.read_bytes() == (EVALSETS / evalsets_build.ARC_OWN).read_bytes()
    missing = runner.invoke(app, ["dev", "evalsets", "--evalsets", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "is not a folder" in missing.output


def test_the_readme_gives_each_files_item_count() -> None:
    readme = (EVALSETS / "README.md").read_text(encoding="utf-8").splitlines()
    for rel in FILES:
        row = next(line for line in readme if line.startswith(f"| `{rel}` |"))
        assert f"| {len(_read(rel))} |" in row, f"evalsets/README.md gives another count for {rel}: {row[:120]}"


def test_bard_turn_answer_is_the_speaker_before_the_last() -> None:
    # Neither the first name nor the last is ever the answer, and the pair's two speakers answer
    # equally often: copying a name from the context pays only by following the turns.
    items = _read(evalsets_build.BARD_TURN)
    first_of_pair = 0
    for it in items:
        speakers = re.findall(r"^\*\*([A-Z ]+)\*\*$", it["context"], flags=re.M)
        assert it["context"].endswith("\n\n**") and len(speakers) >= 4, it
        opener, a, b = speakers[:3]
        assert len({opener, a, b}) == 3 and all(speakers[i] == (a if i % 2 else b) for i in range(1, len(speakers)))
        assert it["continuation"] == speakers[-2] and it["continuation"] not in (opener, speakers[-1])
        first_of_pair += it["continuation"] == a
    assert first_of_pair * 2 == len(items)
