"""Forged and damaged tokenizer folders: whatever is wrong (no folder, meta.json missing,
truncated or garbage, a listed file missing or changed, files re-hashed into meta.json that no
tokenizer stage wrote), loading ends in one TokenizerFileError naming the folder or file and the
fix, and every entry point that loads one (the cache, training, RL and eval stages, `lockstep
chat`, `lockstep serve`, `lockstep data inspect`) prints it as one `error:` line, no traceback."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from lockstep.core.io import sha256_of_manifest
from lockstep.tokenizer import TokenizerFileError, load_tokenizer
from lockstep.tokenizer.kinds import train_tokenizer
from stages._common import entry

ROOT = Path(__file__).resolve().parents[1]
FIX = "dvc repro tokenizer"
TEXTS = ["the quick brown fox jumps over the lazy dog, 12345 times. " * 30, "Speak, speak! " * 40]
KINDS = {"bpe": 300, "hf": 300, "sentencepiece": 320, "lz78": 300, "char": None, "byte": None}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for kind, vocab in KINDS.items():
        train_tokenizer(kind, TEXTS, vocab_size=vocab).save(root / kind)
        out[kind] = root / kind
    return out


def _meta(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text())


def _reseal(folder: Path) -> None:
    """Rewrite meta.json so that it lists the files as they now are: the forger's move."""
    meta = _meta(folder)
    meta["files"] = {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in meta["files"]}
    meta["sha256"] = sha256_of_manifest(meta["files"])
    (folder / "meta.json").write_text(json.dumps(meta))


def _set_meta(key: str, value: object) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        meta = _meta(folder)
        meta[key] = value
        (folder / "meta.json").write_text(json.dumps(meta))
    return damage


def _kind_file(folder: Path) -> str:
    """The kind's own first file (bpe.json, tokenizer.json, spm.model, ...): not one of the shared ones."""
    return next(n for n in sorted(_meta(folder)["files"]) if not n.startswith("token_"))


def _forge(content: bytes, name: Callable[[Path], str] = _kind_file) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / name(folder)).write_bytes(content)
        _reseal(folder)
    return damage


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    # name: (what is done to a sound folder, the file or folder the error must name)
    "no meta.json": (lambda d: (d / "meta.json").unlink(), "{d}"),
    "meta.json truncated": (
        lambda d: (d / "meta.json").write_text((d / "meta.json").read_text()[:40]),
        "{d}/meta.json",
    ),
    "meta.json empty": (lambda d: (d / "meta.json").write_text(""), "{d}/meta.json"),
    "meta.json garbage bytes": (lambda d: (d / "meta.json").write_bytes(b"\xff\xfe\x00garbage"), "{d}/meta.json"),
    "meta.json an array": (lambda d: (d / "meta.json").write_text("[1, 2]"), "{d}/meta.json"),
    "meta.json a folder": (lambda d: ((d / "meta.json").unlink(), (d / "meta.json").mkdir()), "{d}"),
    "unknown kind": (_set_meta("kind", "wordpiece"), "{d}/meta.json"),
    "files not a map": (_set_meta("files", ["a"]), "{d}/meta.json"),
    "a digest not a string": (_set_meta("files", {"x": 5}), "{d}/meta.json"),
    "special ids not a map": (_set_meta("special_token_ids", [1, 2]), "{d}/meta.json"),
    "vocab size not a number": (_set_meta("vocab_size", "big"), "{d}/meta.json"),
    "a listed file missing": (lambda d: (d / "token_bytes.npy").unlink(), "{d}/token_bytes.npy"),
    "a listed file a folder": (
        lambda d: ((d / "token_bytes.npy").unlink(), (d / "token_bytes.npy").mkdir()),
        "{d}/token_bytes.npy",
    ),
    "a file whose sha256 differs": (
        lambda d: (d / "token_bytes.npy").write_bytes(b"\x93NUMPY tampered"),
        "{d}/token_bytes.npy",
    ),
    "a path outside the folder": (_set_meta("files", {"../escape": "0" * 64}), "{d}/meta.json"),
    "kind file forged and resealed": (_forge(b"garbage\x00\xff{"), "{d}"),
    "kind file truncated and resealed": (lambda d: _forge((d / _kind_file(d)).read_bytes()[:30])(d), "{d}"),
    "kind file unfinished JSON, resealed": (_forge(b'{"a": [1, 2'), "{d}"),
    "token_bytes pickled, resealed": (_forge(b"\x80\x04K\x01.", lambda d: "token_bytes.npy"), "{d}"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_damaged_folder_is_one_error_naming_it_and_the_fix(saved, tmp_path, kind, damage):
    folder = tmp_path / kind
    shutil.copytree(saved[kind], folder)
    do, names = DAMAGE[damage]
    do(folder)
    with pytest.raises(TokenizerFileError) as e:
        load_tokenizer(folder)
    message = str(e.value)
    assert names.format(d=folder) in message and FIX in message, message
    assert "\n" not in message


def test_no_folder_or_a_file_in_its_place(tmp_path):
    for where in (tmp_path / "nowhere", tmp_path / "a_file"):
        if where.name == "a_file":
            where.write_text("not a folder")
        with pytest.raises(TokenizerFileError, match=f"no tokenizer folder at {where}: .*{FIX}"):
            load_tokenizer(where)


def test_sound_folders_still_load(saved):
    for kind, folder in saved.items():
        assert load_tokenizer(folder).kind == kind


# ---- every entry point that loads a tokenizer folder ------------------------------------------


@pytest.fixture(scope="module")
def forged(saved, tmp_path_factory) -> Path:
    """A bpe folder whose kind file was replaced and meta.json re-hashed to fit it."""
    folder = tmp_path_factory.mktemp("forged") / "tokenizer"
    shutil.copytree(saved["bpe"], folder)
    _forge(b"{not the tokenizer stage's}")(folder)
    return folder


def _one_error_line(output: str, folder: Path) -> str:
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output
    assert str(folder) in errors[0] and FIX in errors[0], errors[0]
    return errors[0]


def _run_in_process(module: str, argv: list[str]) -> tuple[int, str]:
    import importlib

    stage = importlib.import_module(module)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = entry(lambda: stage.main(argv), errors=stage.STAGE_ERRORS)
    return status, err.getvalue()


def _params(tmp_path: Path, **sections) -> Path:
    params = yaml.safe_load((ROOT / "presets" / "tiny.yaml").read_text())
    params.update(sections)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def test_cache_stage(forged, tmp_path, monkeypatch, restore_process_state):
    monkeypatch.chdir(tmp_path)  # the cache stage reads ./params.yaml
    _params(tmp_path)
    status, stderr = _run_in_process("stages.cache", ["shakespeare", "--raw", str(tmp_path / "raw"),
                                                      "--tokenizer", str(forged), "--out", str(tmp_path / "cache")])
    assert status == 1
    _one_error_line(stderr, forged)
    assert not (tmp_path / "cache").exists()


def test_eval_stage(forged, tmp_path, restore_process_state):
    params = _params(tmp_path, runtime={"device": "cpu", "dtype": "fp32", "threads": 1})
    argv = [
        "pretrain",
        "--ckpt",
        str(tmp_path / "ckpt"),
        "--cache",
        str(tmp_path / "cache"),
        "--tokenizer",
        str(forged),
        "--raw",
        str(tmp_path / "raw"),
        "--evalsets",
        str(ROOT / "evalsets"),
        "--out",
        str(tmp_path / "m.json"),
        "--runinfo",
        str(tmp_path / "r.json"),
        "--predictions",
        str(tmp_path / "p"),
        "--params",
        str(params),
    ]
    status, stderr = _run_in_process("stages.eval", argv)
    assert status == 1
    _one_error_line(stderr, forged)


@pytest.mark.parametrize("stage", ["pretrain", "rl"])
def test_training_and_rl_stages(forged, tmp_path, stage):
    params = _params(tmp_path, runtime={"device": "cpu", "dtype": "fp32", "threads": 1})
    if stage == "pretrain":
        argv = ["--cache", str(tmp_path / "cache"), "--tokenizer", str(forged), "--out", str(tmp_path / "ckpt"),
                "--metrics", str(tmp_path / "m.json"), "--runinfo", str(tmp_path / "r.json"),
                "--plots", str(tmp_path / "plots"), "--runs", str(tmp_path / "runs"), "--params", str(params)]
    else:
        argv = [
            "--init",
            str(tmp_path / "sft"),
            "--raw",
            str(tmp_path / "raw"),
            "--tokenizer",
            str(forged),
            "--out",
            str(tmp_path / "ckpt"),
            "--metrics",
            str(tmp_path / "m.json"),
            "--runinfo",
            str(tmp_path / "r.json"),
            "--plots",
            str(tmp_path / "plots"),
            "--params",
            str(params),
        ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'lib'}"}
    r = subprocess.run([sys.executable, "-m", f"stages.{stage}", *argv], cwd=tmp_path, capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 1, r.stderr
    _one_error_line(r.stderr, forged)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.usefixtures("keep_fd_limit")
def test_lockstep_chat_serve_and_data_inspect(forged, tmp_path):
    from lockstep.cli import app

    runner = CliRunner()
    for args in (["chat", "--ckpt", str(tmp_path), "--tokenizer", str(forged), "-p", "hi"],
                 ["serve", "--ckpt", str(tmp_path), "--tokenizer", str(forged)],
                 ["data", "inspect", str(tmp_path), "--tokenizer", str(forged)]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, r.output
        _one_error_line(r.output, forged)
