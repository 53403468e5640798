"""Source loaders on the real-format samples in ../shared/fixtures (skipped without them), and
the fineweb-edu streaming path on a parquet file in the fineweb-edu schema built here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lockstep.data.sources.common as common
from lockstep.core.config import build_config
from lockstep.data.records import problem_to_conversation
from lockstep.data.sources import SOURCE_CONFIGS, fetch_source, iter_records
from lockstep.data.sources.common import SourceUnavailableError
from lockstep.data.sources.fineweb_edu import SCHEMA, SchemaError
from lockstep.data.sources.gsm8k import final_answer


@pytest.fixture(autouse=True)
def _no_thread_shutdown_sleep(monkeypatch):
    # `datasets` sleeps 5 s after each interleaved/shuffled stream (an arrow thread-shutdown
    # workaround); harmless in a real fetch, but it would dominate these tiny tests.
    import datasets.config

    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)


def run(tmp_path: Path, params: dict, *, seed: int = 1, sub: str = "out"):
    cfg = build_config(SOURCE_CONFIGS[params["source"]], params, where="fetch.t")
    out = tmp_path / sub
    meta = fetch_source("t", cfg, out, seed=seed)
    return meta, list(iter_records(out, "train")), list(iter_records(out, "val"))


def test_gsm8k_real(tmp_path, shared_fixtures):
    meta, train, val = run(
        tmp_path, {"source": "gsm8k", "path": str(shared_fixtures / "gsm8k/test.jsonl"), "val_frac": 0.1}
    )
    assert meta["counts"] == {"train": 1187, "val": 132, "skipped": 0}
    assert meta["revision"].startswith("sha256:")
    for p in train[:200]:
        conv = problem_to_conversation(p)
        parts = conv["messages"][1]["content"]
        assert final_answer(p["answer"]) is not None
        # Every annotation became a python part followed by its output.
        assert sum(x["type"] == "python" for x in parts) == p["answer"].count("<<")
    assert any("," in p["answer"].splitlines()[-1] for p in train + val)  # commas in `#### 1,000` occur


def _flat_rows(tree_file: Path) -> list[dict]:
    rows = []

    def walk(m, tree_id):
        rows.append(
            {k: v for k, v in m.items() if k != "replies"}
            | {"message_tree_id": tree_id, "parent_id": m.get("parent_id")}
        )
        for r in m.get("replies") or []:
            walk(r, tree_id)

    for line in tree_file.read_text(encoding="utf-8").splitlines():
        tree = json.loads(line)
        walk(tree["prompt"], tree["message_tree_id"])
    return rows


def test_oasst1_real_tree_and_flat_agree(tmp_path, shared_fixtures):
    tree = shared_fixtures / "oasst1/en_100_tree.jsonl"
    meta_t, train_t, val_t = run(tmp_path, {"source": "oasst1", "path": str(tree), "val_frac": 0.1}, sub="tree")
    rows = _flat_rows(tree)
    assert len(rows) == 1167
    flat = tmp_path / "flat.jsonl"
    flat.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    meta_f, train_f, val_f = run(tmp_path, {"source": "oasst1", "path": str(flat), "val_frac": 0.1}, sub="flat")
    assert train_t == train_f and val_t == val_f
    assert (
        meta_t["counts"]["train"] + meta_t["counts"]["val"] + meta_t["filtered_trees"] + meta_t["counts"]["skipped"]
        == 100
    )
    assert meta_t["counts"]["train"] > 60
    assert all(len(c["messages"]) % 2 == 0 for c in train_t)


def test_gutenberg_real(tmp_path, shared_fixtures):
    books = tmp_path / "books"
    shutil.copytree(shared_fixtures / "gutenberg", books)
    meta, train, val = run(tmp_path, {"source": "gutenberg", "path": str(books)})
    assert meta["counts"] == {"train": 1, "val": 1, "skipped": 0}
    docs = {d["id"]: d for d in train + val}
    alice, news = docs["pg11_alice.txt"], docs["pg3261_news_from_nowhere.txt"]
    for d in (alice, news):
        assert "\r" not in d["text"] and "\ufeff" not in d["text"]
        assert "PROJECT GUTENBERG" not in d["text"].upper().replace("PROJECT GUTENBERG-TM", "")[:2000]
        assert (
            "START OF" not in d["text"]
            and "END OF THE PROJECT" not in d["text"]
            and "END OF THIS PROJECT" not in d["text"]
        )
        assert "Section 1. General Terms of Use" not in d["text"]  # the license after END
    assert alice["title"].startswith("Alice") and "rabbit-hole" in alice["text"]
    assert news["title"].startswith("News from Nowhere")


def test_wikitext_raw_and_hf_rows_give_same_articles(tmp_path, shared_fixtures):
    wt = shared_fixtures / "wikitext-2-raw"
    meta_r, train_r, val_r = run(
        tmp_path, {"source": "wikitext", "path": str(wt / "wiki.test.raw"), "val_frac": 0.1}, sub="raw"
    )
    meta_p, train_p, val_p = run(
        tmp_path, {"source": "wikitext", "path": str(wt / "test-00000-of-00001.parquet"), "val_frac": 0.1}, sub="pq"
    )
    assert train_r == train_p and val_r == val_p
    assert meta_r["counts"]["train"] + meta_r["counts"]["val"] >= 60
    titles = [d["title"] for d in train_r + val_r]
    assert "Robert Boulter" in titles and "Du Fu" in titles
    assert all(d["text"].startswith(f"= {d['title']} =\n") for d in train_r + val_r)


def _fineweb_parquet(tmp_path: Path, shared_fixtures: Path | None, n_fake: int = 0) -> Path:
    if shared_fixtures is not None:
        src = pq.read_table(shared_fixtures / "parquet_text/fineweb_sample_100docs.parquet").to_pylist()
    else:
        src = [
            {"text": f"Document {i}. " + "words " * (i % 17 + 3), "id": f"doc{i}", "url": f"https://e.x/{i}"}
            for i in range(n_fake)
        ]
    rows = [
        {
            "text": r["text"],
            "id": r["id"],
            "dump": "CC-MAIN-2024-10",
            "url": r["url"],
            "file_path": "s3://x/000.parquet",
            "language": "en",
            "language_score": 0.9,
            "token_count": len(r["text"]) // 4,
            "score": 3.1,
            "int_score": 3,
        }
        for r in src
    ]
    rows[5]["text"] = ""  # one bad record
    d = tmp_path / "fwe"
    d.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[: len(rows) // 2]), d / "000_00000.parquet")
    pq.write_table(pa.Table.from_pylist(rows[len(rows) // 2 :]), d / "000_00001.parquet")
    return d


def test_fineweb_edu_streams_shuffled_to_char_budget(tmp_path, shared_fixtures):
    d = _fineweb_parquet(tmp_path, shared_fixtures)
    params = {
        "source": "fineweb_edu",
        "path": str(d),
        "shuffle_buffer": 16,
        "max_train_chars": 60_000,
        "max_val_chars": 10_000,
    }
    meta, train, val = run(tmp_path, params, seed=7, sub="a")
    assert meta["streamed"] and meta["shuffle_buffer"] == 16 and meta["shuffle_seed"] == 7
    assert sum(len(r["text"]) for r in val) >= 10_000 > sum(len(r["text"]) for r in val[:-1])
    assert sum(len(r["text"]) for r in train) >= 60_000 > sum(len(r["text"]) for r in train[:-1])
    assert not meta["stream_exhausted"] and meta["rows_consumed"] < 100
    assert set(train[0]) == {"text", "id", "url", "dump"}
    meta_b, train_b, _ = run(tmp_path, params, seed=7, sub="b")
    assert (tmp_path / "a/train/part_00000.parquet").read_bytes() == (
        tmp_path / "b/train/part_00000.parquet"
    ).read_bytes()
    _, train_c, _ = run(tmp_path, params, seed=8, sub="c")
    assert [r["id"] for r in train_c] != [r["id"] for r in train]
    all_meta, all_train, all_val = run(tmp_path, {**params, "max_train_chars": 10**9}, seed=7, sub="all")
    assert all_meta["stream_exhausted"] and all_meta["counts"]["skipped"] == 1
    assert len(all_train) + len(all_val) == 99


def test_fineweb_edu_refuses_other_schema(tmp_path, shared_fixtures):
    with pytest.raises(SchemaError, match="dump"):
        run(
            tmp_path,
            {"source": "fineweb_edu", "path": str(shared_fixtures / "parquet_text/fineweb_sample_100docs.parquet")},
        )
    assert not (tmp_path / "out").exists()
    assert "int_score" in SCHEMA


def test_fineweb_edu_network_failure_publishes_nothing(tmp_path, monkeypatch):
    d = _fineweb_parquet(tmp_path, None, n_fake=40)
    params = {"source": "fineweb_edu", "path": str(d), "shuffle_buffer": 8, "max_train_chars": 10**6,
              "max_val_chars": 100, "max_retries": 2, "backoff_s": 0.0}
    good_meta, good_train, _ = run(tmp_path, params, sub="good")
    real = common.retrying_stream
    state = {"opens": 0, "fail_opens": 2}

    def flaky_stream(make_iter, **kw):
        def opened():
            state["opens"] += 1
            fail = state["opens"] <= state["fail_opens"]
            for i, row in enumerate(make_iter()):
                if fail and i == 7:
                    raise ConnectionError("reset")
                yield row

        return real(opened, **kw)

    monkeypatch.setattr(common, "retrying_stream", flaky_stream)
    meta, train, _ = run(tmp_path, params, sub="flaky")
    # Each of the two shard files is its own stream: the first is opened 3 times (reopened where it
    # broke), the second once.
    assert train == good_train and state["opens"] == 4
    state.update(opens=0, fail_opens=99)
    with pytest.raises(SourceUnavailableError, match="local files"):
        run(tmp_path, params, sub="dead")
    assert not (tmp_path / "dead").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".dead")]
