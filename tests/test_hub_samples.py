"""The hub-layout samples under corpus/hub/ (the rehearsal's data): the committed files are the
generator's rows, and each hub loader reads them with the rehearsal preset's own fetch params the
way it reads a real download: hub splits from the file names, the hub's columns and dtypes, and
the record conversions the real presets depend on."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from lockstep.cli import app
from lockstep.core.config import build_config
from lockstep.data.records import problem_to_conversation
from lockstep.data.sources import SOURCE_CONFIGS, SourceFormatError, fetch_source, iter_records
from lockstep.data.sources.gsm8k import final_answer
from lockstep.dev import hub_samples as hs

ROOT = Path(__file__).resolve().parents[1]
HUB = ROOT / "corpus" / "hub"
PRESET = yaml.safe_load((ROOT / "presets" / "rehearsal.yaml").read_text())


@pytest.fixture(autouse=True)
def _no_thread_shutdown_sleep(monkeypatch):
    # `datasets` sleeps 5 s after each shuffled stream (an arrow thread-shutdown workaround).
    import datasets.config

    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)


def fetch(tmp_path: Path, name: str, **changes):
    """The rehearsal's `fetch.<name>` on the committed samples (or `changes`, e.g. another path)."""
    params = {**PRESET["fetch"][name], **changes}
    params["path"] = str(ROOT / params["path"]) if not Path(params["path"]).is_absolute() else params["path"]
    cfg = build_config(SOURCE_CONFIGS[params["source"]], params, where=f"fetch.{name}")
    out = tmp_path / name
    meta = fetch_source(name, cfg, out, seed=PRESET["data_seed"])
    return meta, list(iter_records(out, "train")), list(iter_records(out, "val"))


def test_committed_samples_are_the_generators_output() -> None:
    assert hs.drifted(HUB) == [], "run `lockstep dev hub-samples --write`"


def test_cli_check_names_a_changed_row_and_an_extra_file_and_write_fixes_them(tmp_path: Path) -> None:
    copy = tmp_path / "hub"
    shutil.copytree(HUB, copy)
    gsm = copy / "gsm8k" / "main" / "test-00000-of-00001.parquet"
    table = pq.read_table(gsm)
    rows = table.to_pylist()
    rows[3]["answer"] = rows[3]["answer"].replace("####", "#### 1")
    pq.write_table(table.from_pylist(rows, schema=table.schema), gsm)
    (copy / "gsm8k" / "main" / "stray.jsonl").write_text("{}\n")
    runner = CliRunner()
    bad = runner.invoke(app, ["dev", "hub-samples", "--root", str(copy)])
    assert bad.exit_code == 1
    assert "gsm8k/main/test-00000-of-00001.parquet: differs" in bad.output and "stray.jsonl" in bad.output
    assert "train-00000-of-00001.parquet: differs" not in bad.output
    fixed = runner.invoke(app, ["dev", "hub-samples", "--write", "--root", str(copy)])
    assert fixed.exit_code == 0, fixed.output
    assert runner.invoke(app, ["dev", "hub-samples", "--root", str(copy)]).exit_code == 0
    assert not (copy / "gsm8k" / "main" / "stray.jsonl").exists()


def test_fineweb_edu_sample_has_the_full_schema_and_streams_to_its_budgets(tmp_path: Path) -> None:
    (f,) = sorted((HUB / "fineweb-edu").rglob("*.parquet"))
    assert f.relative_to(HUB).as_posix() == "fineweb-edu/data/CC-MAIN-2024-10/train-00000-of-00001.parquet"
    schema = pq.read_schema(f).remove_metadata()
    assert [(c.name, str(c.type)) for c in schema] == [
        ("text", "string"), ("id", "string"), ("dump", "string"), ("url", "string"), ("file_path", "string"),
        ("language", "string"), ("language_score", "double"), ("token_count", "int64"), ("score", "double"),
        ("int_score", "int64")]
    rows = pq.read_table(f).to_pylist()
    assert 200_000 <= sum(len(r["text"]) for r in rows) <= 400_000
    assert all(r["int_score"] == int(r["score"] + 0.5) and r["id"].startswith("<urn:uuid:") for r in rows)
    meta, train, val = fetch(tmp_path, "fineweb_edu")
    assert meta["source_id"].startswith("local:") and list(meta["input_sha256"]) == [f.as_posix()]
    assert meta["stream_exhausted"] and meta["counts"]["train"] + meta["counts"]["val"] == len(rows)
    assert PRESET["fetch"]["fineweb_edu"]["max_val_chars"] <= meta["chars"]["val"] < 40_000
    assert {d["dump"] for d in train + val} == {"CC-MAIN-2024-10"}


def test_fineweb_edu_reads_only_the_configured_dump_of_a_hub_download(tmp_path: Path) -> None:
    download = tmp_path / "fineweb-edu"
    shutil.copytree(HUB / "fineweb-edu", download)
    other = download / "data" / "CC-MAIN-2023-50"
    other.mkdir()
    shutil.copy(
        download / "data" / "CC-MAIN-2024-10" / "train-00000-of-00001.parquet", other / "train-00000-of-00003.parquet"
    )
    meta, _train, _val = fetch(tmp_path, "fineweb_edu", path=str(download))
    assert [Path(p).parent.name for p in meta["input_sha256"]] == ["CC-MAIN-2024-10"]
    with pytest.raises(FileNotFoundError, match="CC-MAIN-2019-04"):
        fetch(tmp_path, "fineweb_edu", path=str(download), config="CC-MAIN-2019-04")


def test_wikitext_sample_reads_train_and_validation_as_articles_and_leaves_test(tmp_path: Path) -> None:
    rows = pq.read_table(HUB / "wikitext" / "wikitext-103-raw-v1" / "train-00000-of-00001.parquet").to_pylist()
    texts = [r["text"] for r in rows]
    assert "" in texts and all(t == "" or t.endswith(" \n") for t in texts)
    meta, train, val = fetch(tmp_path, "wikitext")
    assert meta["local_splits"] == {"train": ["wikitext-103-raw-v1/train-00000-of-00001.parquet"],
                                    "val": ["wikitext-103-raw-v1/validation-00000-of-00001.parquet"]}
    assert meta["unused_files"] == ["wikitext-103-raw-v1/test-00000-of-00001.parquet"]
    assert (len(train), len(val)) == (hs.WIKITEXT_ARTICLES["train"], hs.WIKITEXT_ARTICLES["validation"])
    first = train[0]
    assert first["text"].startswith(f"= {first['title']} =\n") and "\n= = History = =\n" in first["text"]
    assert sum(t == f" = {a['title']} = \n" for a in train for t in texts) == len(train)


def _conversations(records: list[dict]) -> list[str]:
    return sorted(json.dumps(r["messages"], sort_keys=True) for r in records)


def test_oasst1_flat_hub_layout_and_trees_export_give_the_same_conversations(tmp_path: Path) -> None:
    meta, train, val = fetch(tmp_path, "oasst1")
    assert meta["split_rule"] == "file names"
    assert [Path(p).name.split("-")[0] for s in ("train", "val") for p in meta["local_splits"][s]] == [
        "train",
        "validation",
    ]
    export, e_train, e_val = fetch(tmp_path / "export", "oasst1", path=str(HUB / "oasst1-trees"))
    assert export["split_rule"] == "val_frac"  # the export has no split: the preset's val_frac carves one
    assert _conversations(train + val) == _conversations(e_train + e_val)
    assert meta["filtered_trees"] == export["filtered_trees"] > 0  # the trees whose prompt is not English
    turns = [len(r["messages"]) for r in train + val]
    assert max(turns) >= 6 and min(turns) == 2 and all(n % 2 == 0 for n in turns)


def test_oasst1_follows_the_best_ranked_live_english_reply(tmp_path: Path) -> None:
    _meta, train, val = fetch(tmp_path, "oasst1")
    texts = {m["content"][0]["text"] for r in train + val for m in r["messages"]}
    skipped_deleted = skipped_lang = 0
    for split in hs.OASST1_TREES_PER_SPLIT:
        for tree in hs.oasst1_trees(split):
            stack = [tree]
            while stack:
                node = stack.pop()
                stack.extend(node["replies"])
                replies = sorted(node["replies"], key=lambda r: r["rank"] if r["rank"] is not None else 99)
                if not replies or node["role"] != "prompter" or node["lang"] != "en":
                    continue
                live = [r for r in replies if not r["deleted"] and r["lang"] == "en"]
                if node["text"] in texts and live:
                    assert live[0]["text"] in texts
                    skipped_deleted += replies[0]["deleted"]
                    skipped_lang += replies[0]["lang"] != "en"
                for r in replies:
                    if r["deleted"] or r["lang"] != "en":
                        assert r["text"] not in texts
    assert skipped_deleted > 0 and skipped_lang > 0


def test_gsm8k_sample_keeps_test_as_val_with_annotations_and_commas(tmp_path: Path) -> None:
    meta, train, val = fetch(tmp_path, "gsm8k")
    assert meta["local_splits"] == {"train": ["main/train-00000-of-00001.parquet"],
                                    "val": ["main/test-00000-of-00001.parquet"]}
    assert (len(train), len(val)) == (hs.GSM8K_PROBLEMS["train"], hs.GSM8K_PROBLEMS["test"])
    test_questions = {r["question"] for r in hs.gsm8k_rows("test")}
    assert {p["question"] for p in val} == test_questions and not test_questions & {p["question"] for p in train}
    steps = []
    for p in train + val:
        parts = problem_to_conversation(p)["messages"][1]["content"]
        calls = [x for x in parts if x["type"] == "python"]
        assert len(calls) == p["answer"].count("<<") >= 1
        steps.append(len(calls))
        last = p["answer"].splitlines()[-1]
        assert final_answer(p["answer"]) == last.removeprefix("#### ").replace(",", "")
    assert max(steps) == 3 and any("," in p["answer"].splitlines()[-1] for p in train + val)


def test_dolly_sample_puts_the_context_after_the_instruction_and_carves_val(tmp_path: Path) -> None:
    records = [json.loads(line) for line in (HUB / "dolly15k" / "databricks-dolly-15k.jsonl").read_text().splitlines()]
    assert all(set(r) == {"instruction", "context", "response", "category"} for r in records)
    meta, train, val = fetch(tmp_path, "dolly15k")
    assert (
        meta["split_rule"] == "val_frac" and len(val) == round(0.1 * len(records)) and len(train + val) == len(records)
    )
    users = {m["messages"][0]["content"][0]["text"] for m in train + val}
    with_context = [r for r in records if r["context"]]
    assert with_context and all(f"{r['instruction']}\n\n{r['context']}" in users for r in with_context)


def test_gzipped_json_lines_keep_their_split_names_and_a_damaged_file_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    for split in ("train", "test"):
        lines = "".join(json.dumps(r) + "\n" for r in hs.gsm8k_rows(split)).encode()
        (folder / f"{split}.jsonl.gz").write_bytes(gzip.compress(lines, mtime=0))
    meta, train, val = fetch(tmp_path / "out", "gsm8k", path=str(folder))
    assert meta["local_splits"] == {"train": ["train.jsonl.gz"], "val": ["test.jsonl.gz"]}
    assert (train, val) == (hs.gsm8k_rows("train"), hs.gsm8k_rows("test"))
    damaged = folder / "test.jsonl.gz"
    damaged.write_bytes(damaged.read_bytes()[:200])
    with pytest.raises(SourceFormatError, match=r"test.jsonl.gz: not a readable gzip file"):
        fetch(tmp_path / "again", "gsm8k", path=str(folder))
