"""The DCLM eval bundle source: a zip in the published layout (`eval_bundle/` inside, directory
entries, macOS litter), its unpacked folder and a download (through urllib, from a file:// address)
all become the same file-bundle snapshot, which lockstep.evaluate.core reads back item for item; a
wrong sha256, a damaged zip and a tampered snapshot fail with errors that say what to do, and a
failed fetch leaves the earlier snapshot as it was."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

import pytest

from lockstep.core.config import FieldError
from lockstep.data.snapshot import BUNDLE_DIR, SnapshotError, open_bundle, read_meta
from lockstep.data.sources import SourceFormatError, SourceUnavailableError, fetch_source
from lockstep.data.sources import dclm_core
from lockstep.data.sources.dclm_core import DclmCoreConfig
from lockstep.evaluate.core import load_core_tasks

TASKS = {
    "mc": ("world_knowledge/mc.jsonl", "multiple_choice", 25,
           [{"query": "The sea is", "choices": ["wet", "dry", "loud"], "gold": 0},
            {"query": "Fire is", "choices": ["cold", "hot"], "gold": 1}]),
    "schema": ("commonsense_reasoning/schema.jsonl", "schema", 50,
               [{"context_options": ["Ice is", "Steam is"], "continuation": "cold.", "gold": 0}]),
    "lm": ("language_modeling/lm.jsonl", "language_modeling", 0,
           [{"context": "1, 2, 3,", "continuation": "4"}, {"context": "a, b,", "continuation": "c"}]),
}


def members(prefix: str = "eval_bundle/") -> list[tuple[str, bytes]]:
    """The bundle's files in the published zip's layout (core.yaml names files as eval_data/...)."""
    spec = "icl_tasks:\n" + "".join(
        f"- label: {label}\n  dataset_uri: {uri}\n  num_fewshot: [0]\n  icl_task_type: {kind}\n"
        f"  continuation_delimiter: ' '\n" for label, (uri, kind, _b, _i) in TASKS.items())
    csv = "Eval Task,Task Category,Task Type,#shots,Random baseline\n" + "".join(
        f"{label},x,{kind},0,{baseline}\n" for label, (_u, kind, baseline, _i) in TASKS.items())
    out = [(f"{prefix}core.yaml", spec.encode()), (f"{prefix}eval_meta_data.csv", csv.encode())]
    for uri, _k, _b, items in TASKS.values():
        out.append((f"{prefix}eval_data/{uri}", "".join(json.dumps(i) + "\n" for i in items).encode()))
    return out


def make_zip(path: Path, prefix: str = "eval_bundle/") -> str:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        if prefix:
            zf.writestr(prefix, b"")  # the folder entry the published zip has
        for name, data in members(prefix):
            zf.writestr(name, data)
        zf.writestr("__MACOSX/eval_bundle/._core.yaml", b"\x00\x05")  # litter a Mac zip carries
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


def fetch(tmp_path: Path, out: Path | None = None, **fields):
    out = out or tmp_path / "raw" / "dclm_core"
    return fetch_source("dclm_core", DclmCoreConfig(**fields), out, seed=1), out


def check_read_back(out: Path) -> None:
    folder, meta = open_bundle(out)
    assert folder == out / BUNDLE_DIR
    tasks = load_core_tasks(folder)
    assert [(t.label, t.task_type, t.random_baseline, list(t.items)) for t in tasks] == [
        (label, kind, baseline / 100, items) for label, (_u, kind, baseline, items) in TASKS.items()]
    assert meta["counts"] == {"tasks": 3, "items": 5}
    assert not (out / "__MACOSX").exists() and not any("MACOSX" in f for f in meta["files"])


def test_local_zip_in_the_published_layout(tmp_path: Path) -> None:
    digest = make_zip(tmp_path / "eval_bundle.zip")
    meta, out = fetch(tmp_path, path=str(tmp_path / "eval_bundle.zip"), sha256=digest)
    check_read_back(out)
    assert meta["archive_sha256"] == digest and meta["identity"] == "unverified" and meta["kind"] == "eval_bundle"
    assert sorted(meta["files"]) == sorted(f"{BUNDLE_DIR}/{n.removeprefix('eval_bundle/')}" for n, _ in members())


def test_a_zip_without_the_top_folder_reads_the_same(tmp_path: Path) -> None:
    digest = make_zip(tmp_path / "flat.zip", prefix="")
    _, out = fetch(tmp_path, path=str(tmp_path / "flat.zip"), sha256=digest)
    check_read_back(out)


def test_the_published_digest_makes_it_dclm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digest = make_zip(tmp_path / "eval_bundle.zip")
    monkeypatch.setattr(dclm_core, "PUBLISHED_SHA256", digest)
    meta, _ = fetch(tmp_path, path=str(tmp_path / "eval_bundle.zip"), sha256=digest)
    assert meta["identity"] == "dclm"


@pytest.mark.parametrize("top", ["eval_bundle", "."])
def test_unpacked_folder_needs_sha256_null(tmp_path: Path, top: str) -> None:
    root = tmp_path / "unpacked"
    for name, data in members():
        f = root / (name if top == "eval_bundle" else name.removeprefix("eval_bundle/"))
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
    with pytest.raises(SourceFormatError, match="cannot be checked against the zip's sha256.*sha256: null"):
        fetch(tmp_path, path=str(root))
    assert not (tmp_path / "raw" / "dclm_core").exists()
    meta, out = fetch(tmp_path, path=str(root), sha256=None)
    check_read_back(out)
    assert meta["archive_sha256"] is None and meta["identity"] == "unverified"


def test_wrong_sha256_is_refused_and_the_earlier_snapshot_kept(tmp_path: Path) -> None:
    digest = make_zip(tmp_path / "eval_bundle.zip")
    _, out = fetch(tmp_path, path=str(tmp_path / "eval_bundle.zip"), sha256=digest)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(
        SourceFormatError, match=f"has sha256 {digest}, not the pinned {'0' * 64}.*Nothing was published"
    ):
        fetch(tmp_path, path=str(tmp_path / "eval_bundle.zip"), sha256="0" * 64)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["dclm_core"]  # no work folder left behind


def test_damaged_zip_is_refused(tmp_path: Path) -> None:
    make_zip(tmp_path / "eval_bundle.zip")
    cut = tmp_path / "cut.zip"
    cut.write_bytes((tmp_path / "eval_bundle.zip").read_bytes()[:-200])
    with pytest.raises(SourceFormatError, match="is not a readable zip.*download it again"):
        fetch(tmp_path, path=str(cut), sha256=None)
    assert not (tmp_path / "raw").exists() or not any((tmp_path / "raw").iterdir())


def test_a_zip_without_core_yaml_is_refused(tmp_path: Path) -> None:
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as zf:
        zf.writestr("data/train.jsonl", b"{}\n")
    with pytest.raises(SourceFormatError, match="expected one core.yaml.*found none"):
        fetch(tmp_path, path=str(tmp_path / "other.zip"), sha256=None)


def test_download_checks_the_digest(tmp_path: Path) -> None:
    digest = make_zip(tmp_path / "mirror.zip")
    url = (tmp_path / "mirror.zip").as_uri()
    meta, out = fetch(tmp_path, url=url, sha256=digest)
    check_read_back(out)
    assert meta["source_id"] == url and not (out / ".download.zip").exists()
    with pytest.raises(SourceFormatError, match="the download of .* has sha256 .*run the fetch again"):
        fetch(tmp_path, tmp_path / "raw" / "again", url=url, sha256="1" * 64)
    assert not (tmp_path / "raw" / "again").exists()


def test_an_unreachable_address_fails_after_its_retries(tmp_path: Path) -> None:
    with pytest.raises(SourceUnavailableError, match="network error after 0 retries"):
        fetch(tmp_path, url=(tmp_path / "missing.zip").as_uri(), max_retries=0)


def test_tampered_snapshot_and_record_readers_are_refused(tmp_path: Path) -> None:
    digest = make_zip(tmp_path / "eval_bundle.zip")
    _, out = fetch(tmp_path, path=str(tmp_path / "eval_bundle.zip"), sha256=digest)
    with pytest.raises(SnapshotError, match="is an eval bundle .* not a snapshot of records"):
        read_meta(out)
    f = out / BUNDLE_DIR / "eval_data" / "language_modeling" / "lm.jsonl"
    f.write_text(f.read_text().replace('"4"', '"5"'))
    with pytest.raises(
        SnapshotError, match=r"lm.jsonl listed in .* does not match its sha256; run `dvc repro --force fetch@dclm_core`"
    ):
        open_bundle(out)


def test_sha256_must_be_a_digest() -> None:
    with pytest.raises(FieldError, match="sha256='abc' must be 64 lowercase hex digits"):
        DclmCoreConfig(sha256="abc")
    assert DclmCoreConfig().sha256 == dclm_core.PUBLISHED_SHA256 and DclmCoreConfig().url == dclm_core.URL
