"""The tokenizer, eval and server settings at bad values, through the real entry points: each ends
in exactly one `error:` line naming the full params key (or the option), exit status 1 or 2, no
traceback and nothing written; and the boundary values still run."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from stages._common import entry

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


# Stages run in this process set process-wide state; conftest's fixture puts it back.
pytestmark = pytest.mark.usefixtures("restore_process_state")


def run_entry(main: Callable[[], object], errors: tuple[type[Exception], ...]) -> tuple[int, str]:
    """(exit status, stderr) of a stage's entry point run in this process. Any exception that
    the entry does not turn into its one line propagates: the traceback a user would see."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = entry(main, errors=errors)
    return status, err.getvalue()


def assert_one_error_line(status: int, stderr: str, key: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    # Log lines (INFO, WARNING) may come first; the error is the last line, and the only one.
    errors = [line for line in lines if line.startswith("error:")]
    assert status == 1, stderr
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    assert key in errors[0], f"{key!r} not named in {errors[0]!r}"
    assert "Traceback" not in stderr


# ---- tokenizer ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_tokenizer_stage import _snapshots

    return _snapshots(tmp_path_factory.mktemp("snapshots"))


def _tokenizer_stage(tmp_path: Path, raw: Path, section: dict) -> tuple[int, str]:
    from stages.tokenizer import STAGE_ERRORS, main

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"seed": 3, "data_seed": 3, "tokenizer": section}))
    argv = ["--raw", str(raw), "--out", str(tmp_path / "tok"), "--metrics", str(tmp_path / "metrics.json"),
            "--params", str(params)]
    return run_entry(lambda: main(argv), STAGE_ERRORS)


TOKENIZER_BASE = {"kind": "bpe", "vocab_size": 280, "train_sources": ["notes"], "max_chars": 5000,
                  "metric_sources": ["notes"]}


@pytest.mark.parametrize("overrides,key", [
    ({"kind": "wordpiece"}, "tokenizer.kind"),
    ({"vocab_size": 0}, "tokenizer.vocab_size"),
    ({"vocab_size": 264}, "tokenizer.vocab_size"),
    ({"kind": "hf", "vocab_size": -1}, "tokenizer.vocab_size"),
    ({"kind": "sentencepiece", "vocab_size": 266}, "tokenizer.vocab_size"),
    ({"kind": "lz78", "vocab_size": 266}, "tokenizer.vocab_size"),
    ({"vocab_size": 10**12}, "tokenizer.vocab_size"),
    ({"vocab_size": "4k"}, "tokenizer.vocab_size"),
    ({"kind": "lz78", "vocab_size": 100_000}, "tokenizer.vocab_size"),  # more codes than the text yields
    ({"kind": "sentencepiece", "vocab_size": 267}, "tokenizer.vocab_size"),  # fewer than the text's characters need
    ({"train_sources": []}, "tokenizer.train_sources"),
    ({"train_sources": ["nowhere"]}, "tokenizer.train_sources"),
    ({"max_chars": 0}, "tokenizer.max_chars"),
    ({"max_chars": -5}, "tokenizer.max_chars"),
    ({"max_chars": 1.5}, "tokenizer.max_chars"),
    ({"metric_sources": ["nowhere"]}, "tokenizer.metric_sources"),
    ({"metric_sources": "notes"}, "tokenizer.metric_sources"),
    ({"kind": "sentencepiece", "options": {"model_type": "word"}}, "tokenizer.options.model_type"),
    ({"kind": "char", "options": {"max_alphabet": 0}}, "tokenizer.options.max_alphabet"),
    ({"kind": "char", "options": {"max_alphabet": 257}}, "tokenizer.options.max_alphabet"),
    ({"kind": "char", "options": {"order": "alphabetical"}}, "tokenizer.options.order"),
    ({"options": {"specials": False}}, "tokenizer.options.specials"),
    ({"kind": "char", "options": {"specials": "no"}}, "tokenizer.options.specials"),
    ({"kind": "lz78", "options": {"strategy": "greedy"}}, "tokenizer.options.strategy"),
    ({"kind": "lz78", "options": {"gate_period_phrases": 0}}, "tokenizer.options.gate_period_phrases"),
    ({"kind": "lz78", "options": {"gate_min_count": -1}}, "tokenizer.options.gate_min_count"),
    ({"kind": "lz78", "options": {"round_factor": 0}}, "tokenizer.options.round_factor"),
    ({"kind": "lz78", "options": {"dictionary": "/etc/passwd"}}, "tokenizer.options.dictionary"),
    ({"lz78_dictionary": "corpus/dictionaries/x.tsv"}, "tokenizer.options.dictionary"),
    ({"encode_threads": 0}, "tokenizer.encode_threads"),
    ({"encode_threads": 10**6}, "tokenizer.encode_threads"),
    ({"artifact_records": -1}, "tokenizer.artifact_records"),
    ({"merges": 10}, "tokenizer.merges"),
])
def test_tokenizer_key_at_a_bad_value_is_one_error_line(tmp_path: Path, raw: Path, overrides: dict, key: str) -> None:
    status, stderr = _tokenizer_stage(tmp_path, raw, {**TOKENIZER_BASE, **overrides})
    assert_one_error_line(status, stderr, key)
    assert not (tmp_path / "tok").exists() and not (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize("overrides", [
    {"vocab_size": 265},  # every byte and the 9 specials, no merge
    {"kind": "lz78", "vocab_size": 267},
    {"max_chars": 1},
    {"encode_threads": 1024},
    {"artifact_records": 0},
    {"kind": "char", "options": {"max_alphabet": 1}},
    {"kind": "char", "options": {"max_alphabet": 256}},
])
def test_tokenizer_boundary_values_run(tmp_path: Path, raw: Path, overrides: dict) -> None:
    status, stderr = _tokenizer_stage(tmp_path, raw, {**TOKENIZER_BASE, **overrides})
    assert status == 0, stderr
    assert (tmp_path / "tok" / "meta.json").is_file() and (tmp_path / "metrics.json").is_file()


# ---- eval ------------------------------------------------------------------------------------------


def _eval_stage(tmp_path: Path, section: dict, *, stage: str = "sft", ckpt: Path | None = None,
                tokenizer: Path | None = None, raw: Path | None = None) -> tuple[int, str]:
    from stages.eval import STAGE_ERRORS, main

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"seed": 3, "data_seed": 3, "eval": section,
                                      "runtime": {"device": "cpu", "dtype": "fp32", "threads": 1}}))
    argv = [stage, "--ckpt", str(ckpt or tmp_path / "ckpt"), "--cache", str(tmp_path / "cache"),
            "--tokenizer", str(tokenizer or tmp_path / "tokenizer"), "--raw", str(raw or tmp_path / "raw"),
            "--evalsets", str(ROOT / "evalsets"), "--out", str(tmp_path / "metrics.json"),
            "--runinfo", str(tmp_path / "runinfo.json"), "--predictions", str(tmp_path / "predictions"),
            "--params", str(params)]
    return run_entry(lambda: main(argv), STAGE_ERRORS)


@pytest.mark.parametrize("overrides,key", [
    ({"bpb_max_tokens": 0}, "eval.bpb_max_tokens"),
    ({"bpb_max_tokens": -1}, "eval.bpb_max_tokens"),
    ({"bpb_batch_rows": 0}, "eval.bpb_batch_rows"),
    ({"bpb_batch_rows": 2.5}, "eval.bpb_batch_rows"),
    ({"core_stages": ["pretrain", "final"]}, "eval.core_stages"),
    ({"core_stages": "pretrain"}, "eval.core_stages"),
    ({"core_max_items": -1}, "eval.core_max_items"),
    ({"chat_stages": ["chat"]}, "eval.chat_stages"),
    ({"chat_max_items": -1}, "eval.chat_max_items"),
    ({"math_sources": ["../raw/synth_math"]}, "eval.math_sources"),
    ({"math_sources": [""]}, "eval.math_sources"),
    ({"math_sources": ["nowhere"]}, "eval.math_sources"),  # no such snapshot under --raw
    ({"conversation_sources": ["a/b"]}, "eval.conversation_sources"),
    ({"conversation_sources": ["nowhere"]}, "eval.conversation_sources"),
    ({"categorical_files": ["/etc/passwd"]}, "eval.categorical_files"),
    ({"categorical_files": ["../pyproject.toml"]}, "eval.categorical_files"),
    ({"categorical_files": ["chat/nowhere.jsonl"]}, "eval.categorical_files"),
    ({"code_files": ["chat/code_own.json"]}, "eval.code_files"),
    ({"code_files": ["chat/nowhere.jsonl"]}, "eval.code_files"),
    ({"max_new_tokens": 0}, "eval.max_new_tokens"),
    ({"generate_batch": 0}, "eval.generate_batch"),
    ({"generate_batch": -4}, "eval.generate_batch"),
    ({"sandbox_timeout_s": 0}, "eval.sandbox_timeout_s"),
    ({"sandbox_timeout_s": -1.0}, "eval.sandbox_timeout_s"),
    ({"sandbox_timeout_s": float("nan")}, "eval.sandbox_timeout_s"),
    ({"sandbox_timeout_s": float("inf")}, "eval.sandbox_timeout_s"),
    ({"sandbox_timeout_s": 1e9}, "eval.sandbox_timeout_s"),
    ({"sandbox_memory_mb": 0}, "eval.sandbox_memory_mb"),
    ({"sandbox_memory_mb": 8}, "eval.sandbox_memory_mb"),
    ({"sandbox_memory_mb": 2**50}, "eval.sandbox_memory_mb"),
    ({"max_tokens": 5}, "eval.max_tokens"),
])
def test_eval_key_at_a_bad_value_is_one_error_line(tmp_path: Path, overrides: dict, key: str) -> None:
    status, stderr = _eval_stage(tmp_path, {"math_sources": [], "conversation_sources": [], **overrides})
    assert_one_error_line(status, stderr, key)
    assert not (tmp_path / "metrics.json").exists() and not (tmp_path / "predictions").exists()


def test_a_source_or_file_only_other_stages_read_is_not_required(tmp_path: Path) -> None:
    # The pretrain eval runs no chat task, so a missing chat source does not stop it before the
    # checkpoint is looked at (there is none here: that is the error it ends on).
    status, stderr = _eval_stage(tmp_path, {"math_sources": ["nowhere"], "chat_stages": ["sft"]}, stage="pretrain")
    assert status == 1 and "eval.math_sources" not in stderr and "Traceback" not in stderr


def test_eval_boundary_values_run(tmp_path: Path, ckpt_and_tokenizer: tuple[Path, Path]) -> None:
    ckpt, tok = ckpt_and_tokenizer
    section = {"bpb_max_tokens": 1, "bpb_batch_rows": 1, "core_stages": [], "core_max_items": 0, "chat_stages": ["sft"],
               "chat_max_items": 1, "math_sources": [], "conversation_sources": [], "code_files": [],
               "max_new_tokens": 1, "generate_batch": 1, "sandbox_timeout_s": 3600, "sandbox_memory_mb": 16}
    status, stderr = _eval_stage(tmp_path, section, ckpt=ckpt, tokenizer=tok)
    assert status == 0, stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["chat.arc_own.accuracy.n"] == 1


# ---- the server: ServerConfig and `lockstep serve` ---------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("max_messages", 0), ("max_message_tokens", 0), ("max_message_chars", -1), ("max_conversation_tokens", -1),
    ("max_reply_tokens", 0), ("default_max_tokens", 0), ("default_max_tokens", 1025), ("max_body_bytes", 0),
    ("workers", 0), ("max_queued", -1), ("queue_timeout_s", -0.5), ("queue_timeout_s", float("nan")),
    ("queue_timeout_s", float("inf")), ("default_temperature", -0.1), ("default_temperature", 2.5),
    ("default_temperature", float("nan")), ("default_top_k", -1), ("default_top_k", 201), ("default_seed", -1),
    ("default_seed", 2**63), ("allowed_origins", ("https://a.example", "*")),
])
def test_server_config_refuses_a_bad_field_naming_it(field: str, value: object) -> None:
    from lockstep.core.config import FieldError
    from lockstep.infer.server import ServerConfig

    with pytest.raises(FieldError) as e:
        ServerConfig(**{field: value})
    assert e.value.key == field and str(e.value).startswith(f"{field}=")


def test_server_config_takes_its_boundary_values() -> None:
    from lockstep.infer.server import ServerConfig

    ServerConfig(max_messages=1, max_message_tokens=1, max_message_chars=0, max_conversation_tokens=0,
                 max_reply_tokens=1, default_max_tokens=1, max_body_bytes=1, workers=1, max_queued=0,
                 queue_timeout_s=0.0, default_temperature=0.0, default_top_k=0, default_seed=0)
    ServerConfig(default_temperature=2.0, default_top_k=200, default_seed=2**63 - 1, default_max_tokens=1024)


@pytest.fixture(scope="module")
def ckpt_and_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from _tiny_model import tiny_gpt
    from lockstep.model.checkpoint import save_checkpoint
    from lockstep.tokenizer.kinds import train_tokenizer

    root = tmp_path_factory.mktemp("serve")
    tok = train_tokenizer("byte", [])
    tok.save(root / "tokenizer")
    model = tiny_gpt(sequence_len=256, vocab_size=tok.get_vocab_size(), n_kv_head=1, n_embd=16)
    config = model.config
    save_checkpoint(root / "ckpt", model.state_dict(), {}, {"step": 0, "model_config": config.to_dict(),
                                                             "tokenizer_sha256": tok.sha256})
    return root / "ckpt", root / "tokenizer"


def _serve(ckpt: Path, tok: Path, *args: str, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, list]:
    from typer.testing import CliRunner

    from lockstep.cli import app
    from lockstep.infer import serving

    served: list = []
    monkeypatch.setattr(serving, "run_server", lambda asgi, limits, plan, **kw: served.append({**kw, "limits": limits}))
    r = CliRunner().invoke(app, ["serve", "--ckpt", str(ckpt), "--tokenizer", str(tok), *args])
    assert "Traceback" not in r.output, r.output
    return r.exit_code, r.output, served


@pytest.mark.parametrize(
    "args, named",
    [
        (["--workers", "0"], "--workers=0 must be an integer >= 1"),
        (["--workers", "-3"], "--workers=-3"),
        (["--max-queued", "-1"], "--max-queued=-1 must be an integer >= 0"),
        (
            ["--allow-origin", "https://a.example", "--allow-origin", "*"],
            "--allow-origin=['https://a.example', '*'] may not",
        ),
        (["--header-timeout-s", "0"], "--header-timeout-s=0.0 must be a finite number > 0"),
        (["--body-timeout-s", "nan"], "--body-timeout-s=nan must be a finite number > 0"),
        (["--max-connections", "-1"], "--max-connections=-1 must be an integer >= 0"),
        (["--max-connections", "100000000"], "--max-connections=100000000 must be at most"),
        (["--port", "65536"], "--port=65536 must be from 0 to 65535"),
        (["--port", "-1"], "--port=-1"),
        (["--device", "tpu"], "--device"),
        (["--ckpt", "/nonexistent/ckpt"], "--ckpt"),
        (["--tokenizer", "/nonexistent/tok"], "--tokenizer"),
    ],
)
@pytest.mark.usefixtures("keep_fd_limit")
def test_serve_refuses_a_bad_option_in_one_line(ckpt_and_tokenizer, monkeypatch, args, named) -> None:
    ckpt, tok = ckpt_and_tokenizer
    status, output, served = _serve(ckpt, tok, *args, monkeypatch=monkeypatch)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert status == 2 and len(errors) == 1, output
    assert named in errors[0], errors[0]
    assert served == []


@pytest.mark.usefixtures("keep_fd_limit")
def test_serve_takes_the_boundary_values(ckpt_and_tokenizer, monkeypatch) -> None:
    from lockstep.infer.serving import ServingLimits

    ckpt, tok = ckpt_and_tokenizer
    status, output, served = _serve(ckpt, tok, "--workers", "1", "--max-queued", "0", "--port", "0",
                                    "--allow-origin", "https://a.example", "--header-timeout-s", "0.001",
                                    "--body-timeout-s", "0.001", "--max-connections", "1", monkeypatch=monkeypatch)
    assert status == 0, output
    assert served == [{"host": "127.0.0.1", "port": 0, "limits": ServingLimits(header_timeout_s=0.001,
                                                                              body_timeout_s=0.001, max_connections=1)}]
