"""The tokenizer, eval and server settings at bad values, through the real entry points: each ends
in exactly one `error:` line naming the full params key (or the option), exit status 1 or 2, no
traceback and nothing written; and the boundary values still run."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from stages._common import entry

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


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
    ({"train_sources": []}, "tokenizer.train_sources"),
    ({"train_sources": ["nowhere"]}, "tokenizer.train_sources"),
    ({"max_chars": 0}, "tokenizer.max_chars"),
    ({"max_chars": -5}, "tokenizer.max_chars"),
    ({"max_chars": 1.5}, "tokenizer.max_chars"),
    ({"metric_sources": ["nowhere"]}, "tokenizer.metric_sources"),
    ({"metric_sources": "notes"}, "tokenizer.metric_sources"),
    ({"kind": "sentencepiece", "spm_model_type": "word"}, "tokenizer.spm_model_type"),
    ({"kind": "char", "char_max_alphabet": 0}, "tokenizer.char_max_alphabet"),
    ({"kind": "char", "char_max_alphabet": 257}, "tokenizer.char_max_alphabet"),
    ({"kind": "char", "char_order": "alphabetical"}, "tokenizer.char_order"),
    ({"char_specials": False}, "tokenizer.char_specials"),
    ({"char_specials": "no"}, "tokenizer.char_specials"),
    ({"kind": "lz78", "lz78_strategy": "greedy"}, "tokenizer.lz78_strategy"),
    ({"kind": "lz78", "lz78_gate_period_phrases": 0}, "tokenizer.lz78_gate_period_phrases"),
    ({"kind": "lz78", "lz78_gate_min_count": -1}, "tokenizer.lz78_gate_min_count"),
    ({"kind": "lz78", "lz78_round_factor": 0}, "tokenizer.lz78_round_factor"),
    ({"kind": "lz78", "lz78_dictionary": "/etc/passwd"}, "tokenizer.lz78_dictionary"),
    ({"lz78_dictionary": "corpus/dictionaries/x.tsv"}, "tokenizer.lz78_dictionary"),
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
    {"kind": "char", "char_max_alphabet": 1},
    {"kind": "char", "char_max_alphabet": 256},
])
def test_tokenizer_boundary_values_run(tmp_path: Path, raw: Path, overrides: dict) -> None:
    status, stderr = _tokenizer_stage(tmp_path, raw, {**TOKENIZER_BASE, **overrides})
    assert status == 0, stderr
    assert (tmp_path / "tok" / "meta.json").is_file() and (tmp_path / "metrics.json").is_file()
