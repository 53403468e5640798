"""Local source files keep the hub's split mapping (GSM8K test -> val, OASST and WikiText
validation -> val), pooling only with an explicit `val_frac`; and input in the wrong format, or
input that yields no record, fails the fetch and publishes nothing. Tests that read the real
samples in ../shared/fixtures skip without them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lockstep.data.sources.gsm8k as gsm8k_mod
from lockstep.core.config import ConfigError, build_config
from lockstep.data.sources import (
    SOURCE_CONFIGS,
    SourceFormatError,
    SplitLayoutError,
    fetch_source,
    iter_records,
    read_meta,
)
from lockstep.data.sources.hub import HubFields

FIX = Path(__file__).parent / "fixtures" / "sources"

TRAIN_PROBLEMS = [
    {"question": "Ann has 3 boxes of 5 pens. How many pens?", "answer": "3 * 5 = <<3*5=15>>15\n#### 15"},
    {"question": "Bo had 20 cards and gave away 7. How many are left?", "answer": "20 - 7 = <<20-7=13>>13\n#### 13"},
    {"question": "Cy reads 4 pages a day for 6 days. How many pages?", "answer": "4 * 6 = <<4*6=24>>24\n#### 24"},
]
HELD_OUT = [{"question": "Di buys 2 kites at $9 each. What does she pay?", "answer": "2 * 9 = <<2*9=18>>18\n#### 18"}]


@pytest.fixture(autouse=True)
def _no_thread_shutdown_sleep(monkeypatch):
    # `datasets` sleeps 5 s after each shuffled stream (fineweb_edu's); harmless in a real fetch.
    import datasets.config

    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)


def run(tmp_path: Path, params: dict, *, sub: str = "out", seed: int = 1):
    cfg = build_config(SOURCE_CONFIGS[params["source"]], params, where="fetch.t")
    out = tmp_path / sub
    meta = fetch_source("t", cfg, out, seed=seed)
    return meta, list(iter_records(out, "train")), list(iter_records(out, "val"))


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def assert_nothing_published(tmp_path: Path, sub: str = "out") -> None:
    assert not (tmp_path / sub).exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{sub}.")]  # no temp folder either


def real_test_problems(shared_fixtures: Path) -> list[dict]:
    lines = (shared_fixtures / "gsm8k/test.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


# --- local files keep the hub's splits ---------------------------------------------------------


def test_val_frac_is_unset_by_default_for_every_hub_source():
    for source, cls in SOURCE_CONFIGS.items():
        if issubclass(cls, HubFields):
            assert cls().val_frac is None, source


def test_gsm8k_real_train_and_test_files_keep_the_hub_split(tmp_path, shared_fixtures):
    test = real_test_problems(shared_fixtures)
    assert len(test) == 1319
    d = tmp_path / "gsm8k"
    jsonl(d / "train.jsonl", TRAIN_PROBLEMS)
    shutil.copy(shared_fixtures / "gsm8k/test.jsonl", d / "test.jsonl")
    meta, train, val = run(tmp_path, {"source": "gsm8k", "path": str(d)})
    assert val == test  # exactly the test problems, in file order: the eval set stays out of train
    assert train == TRAIN_PROBLEMS
    assert meta["counts"] == {"train": 3, "val": 1319, "skipped": 0}
    assert meta["split_rule"] == "file names"
    assert meta["local_splits"] == {"train": ["train.jsonl"], "val": ["test.jsonl"]}
    # An explicit val_frac does not re-split files that carry the hub's splits.
    _, train_f, val_f = run(tmp_path, {"source": "gsm8k", "path": str(d), "val_frac": 0.5}, sub="f")
    assert (train_f, val_f) == (train, val)


def test_gsm8k_real_hub_parquet_layout_keeps_the_hub_split(tmp_path, shared_fixtures):
    test = real_test_problems(shared_fixtures)
    d = tmp_path / "openai_gsm8k"
    parquet(d / "main" / "train-00000-of-00001.parquet", TRAIN_PROBLEMS)
    parquet(d / "main" / "test-00000-of-00001.parquet", test)
    meta, train, val = run(tmp_path, {"source": "gsm8k", "path": str(d)})
    assert val == test and train == TRAIN_PROBLEMS
    assert meta["local_splits"] == {
        "train": ["main/train-00000-of-00001.parquet"],
        "val": ["main/test-00000-of-00001.parquet"],
    }
    assert meta["streamed"] is True


def test_gsm8k_whole_hub_download_reads_only_the_configured_config(tmp_path):
    # A full download of openai/gsm8k holds `main/` and `socratic/` (the same questions with other
    # answers) and the download tool's `.cache/`: the hub path reads one config, so does this.
    d = tmp_path / "openai_gsm8k"
    parquet(d / "main" / "train-00000-of-00001.parquet", TRAIN_PROBLEMS)
    parquet(d / "main" / "test-00000-of-00001.parquet", HELD_OUT)
    socratic = [{**p, "answer": "How many? ** " + p["answer"]} for p in TRAIN_PROBLEMS]
    parquet(d / "socratic" / "train-00000-of-00001.parquet", socratic)
    parquet(d / "socratic" / "test-00000-of-00001.parquet", HELD_OUT)
    jsonl(d / ".cache" / "huggingface" / "stray.jsonl", [{"question": "q", "answer": "#### 1"}])
    meta, train, val = run(tmp_path, {"source": "gsm8k", "path": str(d)})
    assert train == TRAIN_PROBLEMS and val == HELD_OUT
    assert meta["unused_files"] == ["socratic/test-00000-of-00001.parquet", "socratic/train-00000-of-00001.parquet"]
    meta, train, _ = run(tmp_path, {"source": "gsm8k", "path": str(d), "config": "socratic"}, sub="s")
    assert train == socratic
    assert meta["local_splits"]["train"] == ["socratic/train-00000-of-00001.parquet"]


def test_gsm8k_download_without_the_configured_config_is_refused(tmp_path):
    # Only `main/` was downloaded but the params ask for `socratic`: reading main's files would
    # train on the other config's answers without a word.
    d = tmp_path / "openai_gsm8k"
    parquet(d / "main" / "train-00000-of-00001.parquet", TRAIN_PROBLEMS)
    parquet(d / "main" / "test-00000-of-00001.parquet", HELD_OUT)
    with pytest.raises(FileNotFoundError, match=r"config folder\(s\) main but not `socratic`"):
        run(tmp_path, {"source": "gsm8k", "path": str(d), "config": "socratic"})


def test_gsm8k_split_folders_and_hashed_shard_names(tmp_path):
    d = tmp_path / "g"
    jsonl(d / "train" / "part-a.jsonl", TRAIN_PROBLEMS[:2])
    parquet(d / "train" / "part-b.parquet", TRAIN_PROBLEMS[2:])
    parquet(d / "test" / "test-00000-of-00001-5f1c2e0a9b.parquet", HELD_OUT)
    _, train, val = run(tmp_path, {"source": "gsm8k", "path": str(d)})
    assert train == TRAIN_PROBLEMS and val == HELD_OUT


def test_unnamed_files_are_refused_without_val_frac_and_pooled_with_it(tmp_path):
    d = tmp_path / "mine"
    jsonl(d / "easy.jsonl", TRAIN_PROBLEMS)
    jsonl(d / "hard.jsonl", HELD_OUT)
    with pytest.raises(SplitLayoutError) as e:
        run(tmp_path, {"source": "gsm8k", "path": str(d)})
    msg = str(e.value)
    assert str(d) in msg and "easy.jsonl, hard.jsonl" in msg  # the folder and the files found
    assert "train.jsonl and test.jsonl" in msg and "val_frac" in msg  # both ways to fix it
    assert_nothing_published(tmp_path)
    meta, train, val = run(tmp_path, {"source": "gsm8k", "path": str(d), "val_frac": 0.25})
    assert meta["split_rule"] == "val_frac" and (len(train), len(val)) == (3, 1)
    assert sorted(p["question"] for p in train + val) == sorted(p["question"] for p in TRAIN_PROBLEMS + HELD_OUT)


def test_ambiguous_or_partial_layouts_are_refused(tmp_path):
    d = tmp_path / "mixed"
    jsonl(d / "train.jsonl", TRAIN_PROBLEMS)
    jsonl(d / "test.jsonl", HELD_OUT)
    jsonl(d / "extra.jsonl", HELD_OUT)
    for params in ({}, {"val_frac": 0.1}):  # a stray file is never pooled with a named test split
        with pytest.raises(SplitLayoutError, match=r"extra\.jsonl"):
            run(tmp_path, {"source": "gsm8k", "path": str(d), **params})
    d = tmp_path / "foreign"
    jsonl(d / "train.jsonl", TRAIN_PROBLEMS)
    jsonl(d / "validation.jsonl", HELD_OUT)
    with pytest.raises(
        SplitLayoutError,
        match=r"validation\.jsonl is named for the `validation` split, which openai/gsm8k does not have",
    ):
        run(tmp_path, {"source": "gsm8k", "path": str(d)})
    with pytest.raises(SplitLayoutError, match="more than one split"):
        jsonl(tmp_path / "both" / "train" / "test.jsonl", HELD_OUT)
        run(tmp_path, {"source": "gsm8k", "path": str(tmp_path / "both")})
    assert_nothing_published(tmp_path)


def test_train_only_or_test_only_needs_val_frac(tmp_path):
    d = tmp_path / "train_only"
    jsonl(d / "train.jsonl", TRAIN_PROBLEMS + HELD_OUT)
    with pytest.raises(SplitLayoutError, match=r"only the `train` split.*test\.jsonl.*val_frac"):
        run(tmp_path, {"source": "gsm8k", "path": str(d)})
    meta, train, val = run(tmp_path, {"source": "gsm8k", "path": str(d), "val_frac": 0.25})
    assert (len(train), len(val), meta["split_rule"]) == (3, 1, "val_frac")
    single = jsonl(tmp_path / "t" / "test.jsonl", TRAIN_PROBLEMS)
    with pytest.raises(SplitLayoutError, match=r"no `train` split, only `test`.*val_frac"):
        run(tmp_path, {"source": "gsm8k", "path": str(single)}, sub="single")
    assert_nothing_published(tmp_path, "single")


def _tree(i: int) -> dict:
    return {
        "message_tree_id": f"t{i}",
        "tree_state": "ready_for_export",
        "prompt": {
            "message_id": f"p{i}",
            "parent_id": None,
            "text": f"Question number {i}?",
            "role": "prompter",
            "lang": "en",
            "rank": None,
            "deleted": False,
            "synthetic": False,
            "replies": [
                {
                    "message_id": f"a{i}",
                    "parent_id": f"p{i}",
                    "text": f"Answer number {i}.",
                    "role": "assistant",
                    "lang": "en",
                    "rank": 0,
                    "deleted": False,
                    "synthetic": False,
                    "replies": [],
                }
            ],
        },
    }


def _flat(trees: list[dict]) -> list[dict]:
    rows = []

    def walk(m, tree_id):
        rows.append({k: v for k, v in m.items() if k != "replies"} | {"message_tree_id": tree_id})
        for r in m.get("replies") or []:
            walk(r, tree_id)

    for t in trees:
        walk(t["prompt"], t["message_tree_id"])
    return rows


def test_oasst1_hub_parquet_layout_keeps_train_and_validation(tmp_path):
    trees = [_tree(i) for i in range(6)]
    d = tmp_path / "oasst1"
    parquet(d / "data" / "train-00000-of-00001-b42a775f407cee45.parquet", _flat(trees[:4]))
    parquet(d / "data" / "validation-00000-of-00001-134b8fd0c89408b6.parquet", _flat(trees[4:]))
    meta, train, val = run(tmp_path, {"source": "oasst1", "path": str(d)})
    question = lambda c: c["messages"][0]["content"][0]["text"]  # noqa: E731
    assert [question(c) for c in train] == [f"Question number {i}?" for i in range(4)]
    assert [question(c) for c in val] == ["Question number 4?", "Question number 5?"]
    assert meta["split_rule"] == "file names"
    with pytest.raises(SplitLayoutError, match="val_frac"):  # the tree export names no split
        run(
            tmp_path,
            {"source": "oasst1", "path": str(jsonl(tmp_path / "x" / "2023_oasst_ready.trees.jsonl", trees))},
            sub="x",
        )


def test_oasst1_real_trees_in_split_files_match_the_export(tmp_path, shared_fixtures):
    lines = (shared_fixtures / "oasst1/en_100_tree.jsonl").read_text(encoding="utf-8").splitlines()
    trees = [json.loads(x) for x in lines]
    d = tmp_path / "split"
    jsonl(d / "train.jsonl", trees[:80])
    jsonl(d / "validation.jsonl", trees[80:])
    _, train, val = run(tmp_path, {"source": "oasst1", "path": str(d)})
    _, want_val, _ = run(
        tmp_path, {"source": "oasst1", "path": str(jsonl(tmp_path / "v.jsonl", trees[80:])), "val_frac": 0.0}, sub="v"
    )
    _, want_train, _ = run(
        tmp_path, {"source": "oasst1", "path": str(jsonl(tmp_path / "t.jsonl", trees[:80])), "val_frac": 0.0}, sub="t"
    )
    assert val == want_val and train == want_train and len(val) > 5


def test_wikitext_hub_layout_reads_train_and_validation_not_test(tmp_path):
    text = (FIX / "wikitext" / "tiny.raw").read_text(encoding="utf-8")
    rows = [{"text": line + "\n" if line.strip() else ""} for line in text.splitlines()]
    renamed = [{"text": r["text"].replace("Alpha", "Gamma").replace("Beta", "Delta")} for r in rows]
    d = tmp_path / "wikitext-2-raw-v1"
    parquet(d / "train-00000-of-00001.parquet", rows)
    parquet(d / "validation-00000-of-00001.parquet", renamed)
    parquet(d / "test-00000-of-00001.parquet", [{"text": " = Omega = \n"}, {"text": " Not read . \n"}])
    meta, train, val = run(tmp_path, {"source": "wikitext", "path": str(d)})
    assert [a["title"] for a in train] == ["Alpha", "Beta"] and [a["title"] for a in val] == ["Gamma", "Delta"]
    assert meta["unused_files"] == ["test-00000-of-00001.parquet"]
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "wiki.train.raw").write_text(text, encoding="utf-8")
    (raw / "wiki.valid.raw").write_text(text.replace("Alpha", "Gamma").replace("Beta", "Delta"), encoding="utf-8")
    (raw / "wiki.test.raw").write_text(" = Omega = \n", encoding="utf-8")
    _, train_r, val_r = run(tmp_path, {"source": "wikitext", "path": str(raw)}, sub="r")
    assert (train_r, val_r) == (train, val)
    with pytest.raises(SplitLayoutError, match="only `test`"):
        run(tmp_path, {"source": "wikitext", "path": str(raw / "wiki.test.raw")}, sub="t")


def test_dolly_has_no_val_split_so_val_frac_is_required(tmp_path):
    rows = [{"instruction": f"Say {i}.", "context": "", "response": f"{i}.", "category": "open_qa"} for i in range(10)]
    f = jsonl(tmp_path / "databricks-dolly-15k.jsonl", rows)
    with pytest.raises(ConfigError, match=r"no val split of its own.*val_frac"):
        run(tmp_path, {"source": "dolly15k", "path": str(f)})
    with pytest.raises(ConfigError, match="val_frac"):  # refused before any network access
        run(tmp_path, {"source": "dolly15k"})
    _, train, val = run(tmp_path, {"source": "dolly15k", "path": str(f), "val_frac": 0.2})
    assert (len(train), len(val)) == (8, 2)


def _fineweb_rows(n: int, int_score: int = 3) -> list[dict]:
    return [
        {
            "text": f"Page {i} about rivers and hills.",
            "id": f"d{i}",
            "dump": "CC-MAIN-2024-10",
            "url": f"https://e.x/{i}",
            "file_path": "s3://x/000.parquet",
            "language": "en",
            "language_score": 0.9,
            "token_count": 8,
            "score": 3.0,
            "int_score": int_score,
        }
        for i in range(n)
    ]


def test_fineweb_edu_refuses_a_split_it_does_not_have(tmp_path):
    d = tmp_path / "fwe"
    parquet(d / "train-00000-of-00001.parquet", _fineweb_rows(6))
    parquet(d / "test-00000-of-00001.parquet", _fineweb_rows(2))
    params = {"source": "fineweb_edu", "path": str(d), "shuffle_buffer": 4, "max_val_chars": 40}
    with pytest.raises(
        SplitLayoutError, match=r"test-00000-of-00001\.parquet is named for the `test` split.*only `train`"
    ):
        run(tmp_path, params)
    (d / "test-00000-of-00001.parquet").unlink()
    meta, train, val = run(tmp_path, params)
    assert len(train) + len(val) == 6


# --- wrong-format input fails the fetch --------------------------------------------------------


def test_gutenberg_path_may_be_one_book(tmp_path):
    meta, train, val = run(tmp_path, {"source": "gutenberg", "path": str(FIX / "gutenberg" / "tiny_a.txt")})
    assert (train, val) == (
        [{"text": "CHAPTER I\n\nIt was a small book, and it knew it.\n", "id": "tiny_a.txt", "title": "A Tiny Book"}],
        [],
    )
    assert list(meta["input_sha256"]) == [(FIX / "gutenberg" / "tiny_a.txt").as_posix()]


def test_gutenberg_real_single_book(tmp_path, shared_fixtures):
    _, train, val = run(tmp_path, {"source": "gutenberg", "path": str(shared_fixtures / "gutenberg/pg11_alice.txt")})
    assert val == [] and [d["id"] for d in train] == ["pg11_alice.txt"] and "rabbit-hole" in train[0]["text"]


def test_book_without_markers_fails_and_keeps_the_previous_snapshot(tmp_path):
    for name in ("tiny_b.txt", "no_markers.txt"):
        (tmp_path / name.removesuffix(".txt")).mkdir()
        shutil.copy(FIX / "gutenberg" / name, tmp_path / name.removesuffix(".txt") / name)
    good = run(tmp_path, {"source": "gutenberg", "path": str(tmp_path / "tiny_b")})
    before = {p.relative_to(tmp_path / "out"): p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}
    with pytest.raises(SourceFormatError, match=r"no_markers\.txt.*START OF.*expected Project Gutenberg"):
        run(tmp_path, {"source": "gutenberg", "path": str(tmp_path / "no_markers")})
    after = {p.relative_to(tmp_path / "out"): p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}
    assert after == before and read_meta(tmp_path / "out")["counts"] == good[0]["counts"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")]


@pytest.mark.parametrize(
    "lines",
    [
        [{"prompt": ["What is the capital of France?", "Name a colour."]}],  # prompt lists, not trees
        [{"prompt": "What is the capital of France?"}, {"prompt": "Name a colour."}],  # bare prompt strings
        [{"instruction": "Say hi.", "response": "Hi."}],  # another dataset's rows
    ],
)
def test_oasst1_file_in_another_format_fails(tmp_path, lines):
    f = jsonl(tmp_path / "prompts.jsonl", lines)
    with pytest.raises(SourceFormatError, match=r"prompts\.jsonl: not one row is an OpenAssistant message tree"):
        run(tmp_path, {"source": "oasst1", "path": str(f), "val_frac": 0.1})
    assert_nothing_published(tmp_path)


def test_oasst1_wrong_format_file_fails_even_beside_good_ones(tmp_path):
    d = tmp_path / "trees"
    jsonl(d / "a.jsonl", [_tree(i) for i in range(3)])
    jsonl(d / "b.jsonl", [{"prompt": ["one", "two"]}])
    with pytest.raises(SourceFormatError, match=r"b\.jsonl"):
        run(tmp_path, {"source": "oasst1", "path": str(d), "val_frac": 0.1})
    assert_nothing_published(tmp_path)


def test_oasst1_trees_with_nothing_usable_fail_naming_the_filter(tmp_path):
    f = jsonl(tmp_path / "de.jsonl", [_tree(0) | {"prompt": _tree(0)["prompt"] | {"lang": "de"}}])
    with pytest.raises(
        SourceFormatError, match=r"de\.jsonl \(0 bad, 1 tree\(s\) filtered out \(no usable reply in the chosen `lang`\)"
    ):
        run(tmp_path, {"source": "oasst1", "path": str(f), "val_frac": 0.1})
    assert_nothing_published(tmp_path)


def test_gsm8k_file_without_the_fields_fails_even_beside_a_good_file(tmp_path):
    d = tmp_path / "g"
    jsonl(d / "train.jsonl", TRAIN_PROBLEMS)
    jsonl(d / "test.jsonl", [{"instruction": "Say hi.", "response": "Hi."}] * 3)
    with pytest.raises(SourceFormatError, match=r"test\.jsonl: not one usable record in it \(3 row\(s\) read, 3 bad"
                                                r".*missing field 'question'.*expected GSM8K"):
        run(tmp_path, {"source": "gsm8k", "path": str(d)})
    assert_nothing_published(tmp_path)
    p = parquet(tmp_path / "p" / "test-00000-of-00001.parquet", [{"text": "a"}, {"text": "b"}])
    with pytest.raises(SourceFormatError, match=r"test-00000-of-00001\.parquet: not one usable record"):
        run(tmp_path, {"source": "gsm8k", "path": str(p), "val_frac": 0.1})


def test_wikitext_parquet_without_text_column_fails(tmp_path):
    p = parquet(tmp_path / "train-00000-of-00001.parquet", [{"line": "= A =\n"}])
    with pytest.raises(
        SourceFormatError, match=r"train-00000-of-00001\.parquet row 0: no string `text` column \(fields: line\)"
    ):
        run(tmp_path, {"source": "wikitext", "path": str(p), "val_frac": 0.1})
    assert_nothing_published(tmp_path)


def test_a_failure_after_records_were_written_publishes_nothing(tmp_path, monkeypatch):
    real = gsm8k_mod.produce

    def produce_then_fail(cfg, sink, *, seed):
        real(cfg, sink, seed=seed)
        for i in range(3000):  # past a row group, so a parquet part is open when it fails
            sink.add("train", {"question": f"q{i}", "answer": "#### 1"}, f"gen {i}")
        raise RuntimeError("reader died")

    monkeypatch.setattr(gsm8k_mod, "produce", produce_then_fail)
    with pytest.raises(RuntimeError, match="reader died"):
        run(tmp_path, {"source": "gsm8k", "path": str(FIX / "gsm8k.jsonl"), "val_frac": 0.1})
    assert list(tmp_path.iterdir()) == []


def test_fineweb_edu_with_every_row_filtered_fails(tmp_path):
    f = parquet(tmp_path / "fwe" / "000_00000.parquet", _fineweb_rows(5, int_score=1))
    with pytest.raises(SourceFormatError, match=r"no usable record in .*000_00000\.parquet \(0 bad, 5 row\(s\) "
                                                r"below `min_int_score`\).*fineweb-edu schema"):
        run(tmp_path, {"source": "fineweb_edu", "path": str(f), "shuffle_buffer": 4, "min_int_score": 3})
    assert_nothing_published(tmp_path)
