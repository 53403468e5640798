"""FineWeb-Edu's `arrow_batches` path against the record path (the reference): byte-identical
snapshots (parts, dataset_snapshot.json, meta.json) over bad, blank, null, non-ASCII and
JSON-escaped texts, score filtering, windows smaller and larger than the stream's batches, parts
closing inside windows, both budget ends, strict mode, and resumes crossing from one path to the
other; plus the pieces it is built from, each against its row-by-row counterpart."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _fineweb_shards import no_thread_shutdown_sleep, write_shards
import lockstep.data.snapshot as snapshot
from lockstep.core.config import build_config
from lockstep.core.io import canonical_json
from lockstep.data.snapshot import BadRecordError, document_lines, documents_ok, schema_for
from lockstep.data.sources import SOURCE_CONFIGS, fetch_source
from lockstep.data.sources.common import SourceFormatError, dataset_rows, parquet_tables
from lockstep.data.sources.shards import STATE_FILE, window_shuffle, window_shuffle_tables

PART_BYTES = 2_000  # parts close inside shuffle windows
N_SHARDS, DOCS_PER_SHARD = 3, 60
# Texts the batch path must judge and serialize exactly as the record path: bad (empty, null,
# blank, only Python whitespace that is not ASCII), good but not ASCII, and JSON escapes.
ODD_TEXTS = ["", None, "  \n\t ", "\x1c\u2003", "日本語の文書だけ", 'quote " back \\ tab \t nl \n cr \r bs \b ff \f',
             "ctrl \x01 and \x1f", "sep \u2028 del \x7f é"]


@pytest.fixture(autouse=True)
def _no_thread_shutdown_sleep(monkeypatch):
    no_thread_shutdown_sleep(monkeypatch)


def _odd_rows(s: int, rows: list) -> None:
    for j, text in enumerate(ODD_TEXTS):
        rows[5 + 6 * j]["text"] = text
    rows[9]["id"] = None


def _shards(d: Path) -> Path:
    return write_shards(
        d, shards=N_SHARDS, docs=DOCS_PER_SHARD, edit=_odd_rows, int_score=lambda n: [None, 1, 2, 3, 4][n % 5]
    )


def _fetch(src: Path, out: Path, *, arrow: bool, resume: Path | None = None, **over) -> dict:
    params = {"source": "fineweb_edu", "path": str(src), "shuffle_buffer": 16, "max_train_chars": 30_000,
              "max_val_chars": 5_000, "max_retries": 0, "backoff_s": 0.0, **over}
    cfg = build_config(SOURCE_CONFIGS["fineweb_edu"], params, where="fetch.fw")
    return fetch_source("fw", cfg, out, seed=3, part_bytes=PART_BYTES, resume_dir=resume, arrow_batches=arrow)


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"min_int_score": 3},
        {"shuffle_buffer": 130, "max_train_chars": 10**9},  # windows span several batches; stream runs out
        {"shuffle_buffer": 1, "max_val_chars": 0},
        {"artifact_records": 100},  # the parity artifact keeps records past a batch boundary
    ],
)
def test_arrow_batches_write_the_same_bytes_as_the_record_path(tmp_path, over):
    src = _shards(tmp_path / "src")
    ref = _fetch(src, tmp_path / "record", arrow=False, **over)
    _fetch(src, tmp_path / "arrow", arrow=True, **over)
    assert _files(tmp_path / "arrow") == _files(tmp_path / "record")
    # The data is worth comparing: bad records were skipped, several parts written.
    assert ref["counts"]["skipped"] >= 2 and len(ref["files"]) >= 4


def test_a_batch_with_an_empty_and_a_null_text_is_skipped_counted_and_reported_alike(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rows = [{"text": t, "id": f"d{i}", "dump": "CC-MAIN-2024-10", "url": f"u{i}", "file_path": "f", "language": "en",
             "language_score": 0.9, "token_count": 1, "score": 3.0, "int_score": 3}
            for i, t in enumerate(["good one", "", "good two", None, "good three"])]
    pq.write_table(pa.Table.from_pylist(rows), src / "000_00000.parquet")
    metas = {
        arrow: _fetch(src, tmp_path / f"out{arrow}", arrow=arrow, max_val_chars=0, shuffle_buffer=1)
        for arrow in (False, True)
    }
    assert _files(tmp_path / "outTrue") == _files(tmp_path / "outFalse")
    assert metas[True]["counts"] == {"train": 3, "val": 0, "skipped": 2}
    assert metas[True]["bad_examples"] == ["000_00000.parquet row 1 id=d1: empty 'text'",
                                           "000_00000.parquet row 3 id=d3: missing field 'text'"]


def test_strict_mode_fails_on_the_same_record(tmp_path):
    src = _shards(tmp_path / "src")
    errors = []
    for arrow in (False, True):
        with pytest.raises(BadRecordError) as e:
            _fetch(src, tmp_path / f"out{arrow}", arrow=arrow, strict=True)
        errors.append(str(e.value))
        assert not (tmp_path / f"out{arrow}").exists()
    assert errors[0] == errors[1]


@pytest.mark.parametrize(("first", "then"), [(True, True), (True, False), (False, True)])
def test_resume_across_paths_gives_the_same_bytes(tmp_path, monkeypatch, first, then):
    src = _shards(tmp_path / "src")
    _fetch(src, tmp_path / "reference", arrow=False)
    partial, out = tmp_path / "partial", tmp_path / "out"
    name = "add_documents" if first else "add"
    real, calls = getattr(snapshot.SnapshotWriter, name), {"n": 0}

    def interrupted(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == (12 if first else 70):  # after some parts were finished
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(snapshot.SnapshotWriter, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        _fetch(src, out, arrow=first, resume=partial)
    monkeypatch.setattr(snapshot.SnapshotWriter, name, real)
    state = json.loads((partial / STATE_FILE).read_text())
    assert state["position"]["emitted"] > 0 and state["sink"]["splits"]["train"]["parts"]
    _fetch(src, out, arrow=then, resume=partial)
    assert _files(out) == _files(tmp_path / "reference")


def test_non_string_columns_are_converted_or_refused_as_the_record_path_does(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rows = [
        {
            "text": t,
            "id": i,
            "dump": "CC-MAIN-2024-10",
            "url": 1.5,
            "file_path": "f",
            "language": "en",
            "language_score": 0.9,
            "token_count": 1,
            "score": 3.0,
            "int_score": 3,
        }
        for i, t in enumerate(["a page", "another"])
    ]
    pq.write_table(pa.Table.from_pylist(rows), src / "000_00000.parquet")
    for arrow in (False, True):
        _fetch(src, tmp_path / f"ints{arrow}", arrow=arrow)
    assert _files(tmp_path / "intsTrue") == _files(tmp_path / "intsFalse")  # id 0 -> "0", url 1.5 -> "1.5"
    pq.write_table(pa.Table.from_pylist([{**r, "text": b"bytes"} for r in rows]), src / "000_00000.parquet")
    errors = []
    for arrow in (False, True):
        with pytest.raises(SourceFormatError, match="no usable record") as e:
            _fetch(src, tmp_path / f"bytes{arrow}", arrow=arrow)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "field 'text' must be a string, got bytes" in errors[0]


def test_hub_path_reads_hf_addresses_through_hf_file_system(tmp_path, monkeypatch):
    """The hub branch of the batch path (file list from the dataset builder, each `hf://` address
    opened through huggingface_hub's HfFileSystem) on local files standing in for the hub's."""
    import datasets
    import huggingface_hub

    src = _shards(tmp_path / "src")
    revision = "0123456789abcdef0123456789abcdef01234567"
    prefix = f"hf://datasets/HuggingFaceFW/fineweb-edu@{revision}/"

    class Builder:
        class config:
            data_files = {"train": [prefix + p.name for p in sorted(src.glob("*.parquet"))]}

    opened = []

    class FakeHfFileSystem:
        def open(self, ref, mode):
            opened.append(ref)
            return open(src / ref.removeprefix(prefix), mode)

    monkeypatch.setattr(datasets, "load_dataset_builder", lambda *a, **k: Builder())
    monkeypatch.setattr(huggingface_hub, "HfFileSystem", FakeHfFileSystem)
    hub = _fetch(src, tmp_path / "hub", arrow=True, path=None, revision=revision)
    local = _fetch(src, tmp_path / "local", arrow=True)
    assert sorted(set(opened)) == Builder.config.data_files["train"]
    assert hub["source_id"] == "HuggingFaceFW/fineweb-edu" and hub["revision"] == revision
    for part in local["files"]:
        assert (tmp_path / "hub" / part).read_bytes() == (tmp_path / "local" / part).read_bytes()


def test_parquet_tables_give_the_rows_of_dataset_rows(tmp_path):
    src = _shards(tmp_path / "src")
    files = sorted(src.glob("*.parquet"))
    tables = list(parquet_tables(files, max_retries=0, backoff_s=0.0))
    rows = list(
        dataset_rows(
            hub_id="", hub_config=None, hub_split="train", revision="", files=files, max_retries=0, backoff_s=0.0
        )
    )
    assert [r for t in tables for r in t.to_pylist()] == rows and len(rows) == N_SHARDS * DOCS_PER_SHARD


@pytest.mark.parametrize(("window", "batch_rows"), [(1, 3), (4, 3), (7, 20), (50, 7)])
def test_window_shuffle_tables_matches_window_shuffle(window, batch_rows):
    rows = [{"i": i} for i in range(37)]
    tables = (pa.Table.from_pylist(rows[s : s + batch_rows]) for s in range(0, len(rows), batch_rows))
    got = [(int(i), r) for idx, t in window_shuffle_tables(tables, window, torch.Generator().manual_seed(5))
           for i, r in zip(idx, t.to_pylist(), strict=True)]
    assert got == list(window_shuffle(rows, window, torch.Generator().manual_seed(5)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.text(), st.one_of(st.none(), st.text())), min_size=1, max_size=6))
def test_document_lines_equal_canonical_json(pairs):
    records = [{"text": t, "id": i, "url": "u", "dump": None} for t, i in pairs]
    table = pa.Table.from_pylist(records, schema=schema_for("document", ("id", "url", "dump")))
    assert document_lines(table) == "".join(canonical_json(r) for r in records).encode("utf-8")


def test_documents_ok_never_passes_a_record_the_rules_refuse():
    texts = ["ok", "", None, " \t", "\x1c", "\u3000", "日本", "x"]
    ok = documents_ok(pa.table({"text": pa.array(texts, pa.string())}))
    assert ok.tolist() == [True, False, False, False, False, False, False, True]
    assert documents_ok(pa.table({"text": pa.array([b"ok"], pa.binary())})).tolist() == [False]
    assert isinstance(ok, np.ndarray)
