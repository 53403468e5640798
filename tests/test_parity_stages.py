"""Parity artifacts of the data stages: dataset_snapshot.json inside each raw snapshot,
rendered_samples.json beside the tokenizer, and `compare_runs` over two runs' data/ folders
naming a planted quote change and a planted chat-template change in words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lockstep.core.io import read_json, sha256_file
from lockstep.data.snapshot import SnapshotWriter, first_records
from lockstep.data.sources import fetch_source, iter_records
from lockstep.data.sources.roam import RoamConfig
from lockstep.data.sources.synth_chat import SynthChatConfig
from lockstep.data.sources.synth_math import SynthMathConfig
from lockstep.pipeline.tokenizer import DOC_SAMPLE_TOKENS, TokenizerConfig, run_tokenizer_stage
from lockstep.tokenizer import Tokenizer, load_tokenizer
from lockstep.tools.parity_diff import compare_runs

NOTE = "# Note {i}\n\nIt's the note {i}: merges are learned from text like this, {n}.\n"


def _notes(folder: Path, *, curly_in: int | None = None) -> Path:
    folder.mkdir(parents=True)
    for i in range(5):
        text = NOTE.format(i=i, n=i * 37) * (40 if i == 0 else 3)
        if i == curly_in:
            text = text.replace("It's", "It\u2019s", 1)
        (folder / f"note{i}.md").write_text(text, encoding="utf-8")
    return folder


def _data(root: Path, notes: Path) -> Path:
    """A data/ folder as the DAG lays it out: raw snapshots under raw/, then the tokenizer."""
    data = root / "data"
    fetch_source("notes", RoamConfig(path=str(notes), val_frac=0.0, artifact_records=3), data / "raw" / "notes", seed=5)
    fetch_source("chat", SynthChatConfig(n_train=12, n_val=3, artifact_records=3), data / "raw" / "chat", seed=5)
    fetch_source("math", SynthMathConfig(n_train=12, n_val=3, artifact_records=3), data / "raw" / "math", seed=5)
    return data


def _tokenize(data: Path) -> dict:
    cfg = TokenizerConfig(kind="bpe", vocab_size=300, train_sources=("notes",), max_chars=4000,
                          metric_sources=("chat", "math"), artifact_records=2)  # fmt: skip
    return run_tokenizer_stage(cfg, data / "raw", data / "tokenizer", data / "metrics" / "tokenizer.json", seed=5)


def test_fetch_publishes_dataset_snapshot_listed_in_meta(tmp_path: Path) -> None:
    out = tmp_path / "raw" / "math"
    meta = fetch_source("math", SynthMathConfig(n_train=20, n_val=4, artifact_records=3), out, seed=2)
    art = read_json(out / "dataset_snapshot.json")
    assert meta["artifacts"] == {"dataset_snapshot.json": sha256_file(out / "dataset_snapshot.json")}
    assert all(name.endswith(".parquet") for name in meta["files"])
    for split in ("train", "val"):
        records = list(iter_records(out, split))  # still verifies every listed part
        assert art["splits"][split]["count"] == meta["counts"][split] == len(records)
        assert art["splits"][split]["records"] == records[:3]
    again = tmp_path / "again"
    fetch_source("math", SynthMathConfig(n_train=20, n_val=4, artifact_records=3), again, seed=2)
    assert (again / "dataset_snapshot.json").read_bytes() == (out / "dataset_snapshot.json").read_bytes()
    other = tmp_path / "other"
    fetch_source("math", SynthMathConfig(n_train=20, n_val=4, artifact_records=3), other, seed=3)
    assert read_json(other / "dataset_snapshot.json") != art
    # The default keeps 8 records, and an empty split is still listed.
    default = tmp_path / "default"
    fetch_source("chat", SynthChatConfig(n_train=10, n_val=0), default, seed=2)
    splits = read_json(default / "dataset_snapshot.json")["splits"]
    assert len(splits["train"]["records"]) == 8 and splits["val"] == {
        "count": 0, "records": [], "sha256": splits["val"]["sha256"]
    }  # fmt: skip


def test_first_records_from_the_artifact_or_the_parts(tmp_path: Path) -> None:
    out = tmp_path / "chat"
    fetch_source("chat", SynthChatConfig(n_train=9, n_val=2, artifact_records=4), out, seed=1)
    train = list(iter_records(out, "train"))
    for n in (0, 3, 4, 5, 20):  # up to 4 from the artifact, more from the parquet parts
        assert first_records(out, "train", n) == train[:n]
    assert first_records(out, "val", 8) == list(iter_records(out, "val"))
    # A tampered artifact is not trusted: the records come from the verified parts instead.
    art = read_json(out / "dataset_snapshot.json")
    art["splits"]["train"]["records"][0] = {"messages": []}
    (out / "dataset_snapshot.json").write_text(json.dumps(art), encoding="utf-8")
    assert first_records(out, "train", 3) == train[:3]
    with pytest.raises(ValueError, match="split"):
        first_records(out, "test", 3)


def test_snapshot_writer_refuses_negative_artifact_records(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="artifact_records"):
        SnapshotWriter(tmp_path / "x", kind="document", artifact_records=-1)


def test_tokenizer_stage_writes_rendered_samples_without_changing_identity(tmp_path: Path) -> None:
    data = _data(tmp_path, _notes(tmp_path / "notes"))
    metrics = _tokenize(data)
    tok_dir = data / "tokenizer"
    tok = load_tokenizer(tok_dir)  # the extra file does not disturb the checked load
    meta = read_json(tok_dir / "meta.json")
    assert "rendered_samples.json" not in meta["files"]
    assert tok.sha256 == meta["sha256"] == metrics["tokenizer_sha256"]
    art = read_json(tok_dir / "rendered_samples.json")
    bos = tok.get_bos_token_id()
    assert art["bos_id"] == bos
    by_label: dict[str, list] = {}
    for s in art["samples"]:
        by_label.setdefault(s["split"], []).append(s)
    assert sorted(by_label) == ["chat/train", "math/train", "notes/train"]
    assert all(len(v) == 2 for v in by_label.values())
    doc = by_label["notes/train"][0]
    first_note = next(iter_records(data / "raw" / "notes", "train"))["text"]
    assert doc["mask"] is None and doc["truncated"] and len(doc["ids"]) == DOC_SAMPLE_TOKENS
    assert doc["ids"] == tok.encode(first_note, prepend=bos)[:DOC_SAMPLE_TOKENS]
    chat = by_label["chat/train"][1]
    ids, mask = tok.render_conversation(list(iter_records(data / "raw" / "chat", "train"))[1])
    assert (chat["ids"], chat["mask"], chat["truncated"]) == (ids, mask, False)
    assert chat["pieces"][0] == "<|bos|>" and "<|assistant_end|>" in chat["pieces"]
    math = by_label["math/train"][0]
    assert math["mask"] is not None and "<|python_start|>" in math["pieces"]
    # Same inputs, same bytes.
    before = (tok_dir / "rendered_samples.json").read_bytes()
    _tokenize(data)
    assert (tok_dir / "rendered_samples.json").read_bytes() == before


def test_compare_runs_names_a_curly_quote_in_a_fetched_record_first(tmp_path: Path) -> None:
    a = _data(tmp_path / "a", _notes(tmp_path / "notes_a"))
    b = _data(tmp_path / "b", _notes(tmp_path / "notes_b", curly_in=0))
    for data in (a, b):
        _tokenize(data)
    assert compare_runs(str(a), str(a)) == []
    diffs = compare_runs(str(a), str(b))
    # The raw snapshot comes first: the tokenizer differences downstream follow from it.
    assert diffs[0].startswith(
        "raw/notes/dataset_snapshot.json: train record 0 field text differs only by Unicode quote"
    )
    assert "A \"'\", B '\u2019'" in diffs[0]
    names = [d.split(":", 1)[0] for d in diffs]
    assert names.index("raw/notes/dataset_snapshot.json") < names.index("raw/notes/meta.json")
    assert all(not n.startswith("tokenizer/") for n in names[: names.index("raw/notes/meta.json") + 1])
    assert "tokenizer/meta.json" in names  # trained on the changed note


def test_compare_runs_names_a_chat_template_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    notes = _notes(tmp_path / "notes")
    a, b, c = (_data(tmp_path / r, notes) for r in "abc")
    _tokenize(a)
    render = Tokenizer.render_conversation

    def without_assistant_end(self, conversation, max_tokens=None):
        ids, mask = render(self, conversation, max_tokens)
        end = self.encode_special("<|assistant_end|>")
        keep = [i for i, t in enumerate(ids) if t != end]
        return [ids[i] for i in keep], [mask[i] for i in keep]

    monkeypatch.setattr(Tokenizer, "render_conversation", without_assistant_end)
    _tokenize(b)

    def tool_output_trained(self, conversation, max_tokens=None):
        ids, mask = render(self, conversation, max_tokens)
        start, end = self.encode_special("<|output_start|>"), self.encode_special("<|output_end|>")
        inside = False
        for i, t in enumerate(ids):
            inside = inside or t == start
            if inside:
                mask[i] = 1
            inside = inside and t != end
        return ids, mask

    monkeypatch.setattr(Tokenizer, "render_conversation", tool_output_trained)
    _tokenize(c)

    diffs = compare_runs(str(a), str(b))
    assert len(diffs) == 1, diffs  # same raw data, same tokenizer files: only the rendering moved
    assert diffs[0].startswith("tokenizer/rendered_samples.json: chat/train sample 0: ")
    assert "with '<|assistant_end|>')" in diffs[0] and "so the chat template" in diffs[0]
    diffs = compare_runs(str(a), str(c))
    assert len(diffs) == 1, diffs
    assert "loss mask differs" in diffs[0] and "('<|output_start|>'): A [0], B [1]" in diffs[0]
    assert "chat template's loss masking changed" in diffs[0]
    assert (a / "tokenizer" / "meta.json").read_bytes() == (b / "tokenizer" / "meta.json").read_bytes()


def test_snapshot_hash_is_the_same_whatever_the_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    from lockstep.core.io import canonical_json
    from lockstep.data import parity

    records = [{"text": f"line {i} \u2019quoted\u2019"} for i in range(50)]
    records += [{"text": "x", "id": None}, {"question": "q", "answer": "a"}]
    want = hashlib.sha256("".join(canonical_json(r) for r in records).encode("utf-8")).hexdigest()
    for chunk_chars in (1, 100, 1 << 20):
        monkeypatch.setattr(parity, "HASH_CHUNK_CHARS", chunk_chars)
        col = parity.SnapshotCollector(2)
        for r in records:
            col.add("train", r)
        got = col.to_json()["splits"]["train"]
        assert (got["sha256"], got["count"], got["records"]) == (want, len(records), records[:2])
        assert col.to_json()["splits"]["train"]["sha256"] == want  # to_json twice gives the same
