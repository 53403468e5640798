"""`tokenizer.options.dictionary` (kind lz78) through the tokenizer stage's entry point: every bad dictionary file
(a code past 2^63, a 10,000-digit id, a header and nothing else, a missing file, a folder, a link
out of corpus/dictionaries/) ends in exactly one `error:` line that names the key, the file and,
where there is one, the line, with nothing published; `tokenizer.options.prefixes` is checked like
the other lz78 options, and both of its values run."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import yaml

from stages._common import entry

sys.path.insert(0, str(Path(__file__).resolve().parent))


def assert_one_error_line(status: int, stderr: str, key: str) -> None:
    """Exit status 1, no traceback, and the last line of stderr the only `error:` line, naming `key`."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert status == 1 and "Traceback" not in stderr, stderr
    assert len(errors) == 1 and lines[-1] == errors[0] and key in errors[0], stderr


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_tokenizer_stage import _snapshots

    return _snapshots(tmp_path_factory.mktemp("snapshots"))


def run_stage(tmp_path: Path, raw: Path, section: dict, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """The stage run from `tmp_path` as the project root (where corpus/dictionaries/ lives)."""
    from stages.tokenizer import STAGE_ERRORS, main

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"seed": 3, "data_seed": 3, "tokenizer": section}))
    monkeypatch.chdir(tmp_path)
    argv = ["--raw", str(raw), "--out", "tok", "--metrics", "metrics.json", "--params", str(params)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # an exception the entry does not turn into its line propagates
        status = entry(lambda: main(argv), errors=STAGE_ERRORS)
    return status, err.getvalue()


SECTION = {"kind": "lz78", "train_sources": [], "metric_sources": ["notes"], "max_chars": 5000}
GOOD = "# a character-level dictionary\n1\t0\tt\tt\n2\t1\th\tth\n3\t2\te\tthe\n4\t0\té\té\n5\t0\t \t \n"


@pytest.mark.parametrize("name, text, where", [
    ("huge.tsv", "1\t0\ta\ta\n9223372036854775808\t1\tb\tab\n", "huge.tsv:2: code '9223372036854775808' is outside"),
    ("digits.tsv", "1\t0\ta\ta\n" + "2" * 10_000 + "\t1\tb\tab\n", "digits.tsv:2: code '2222"),
    ("header.tsv", "code\tparent_code\tchar\tpattern\n", "header.tsv: no dictionary lines with a code"),
    ("cr.tsv", "1\t0\ta\ta\n2\t1\tb\ta\rb\n", "cr.tsv:2: a carriage return inside the line"),
    ("compressed.tsv", "0\t\t0\t\t\n1\ta\t0\t0\ta\n", "compressed.tsv:2: output_code 0"),
])
def test_a_bad_dictionary_file_is_one_error_line(tmp_path: Path, raw: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                                 text: str, where: str) -> None:
    (tmp_path / "corpus" / "dictionaries").mkdir(parents=True)
    (tmp_path / "corpus" / "dictionaries" / name).write_text(text, encoding="utf-8")
    status, stderr = run_stage(
        tmp_path, raw, {**SECTION, "options": {"dictionary": f"corpus/dictionaries/{name}"}}, monkeypatch
    )
    assert_one_error_line(status, stderr, "tokenizer.options.dictionary")
    assert where in stderr
    assert not (tmp_path / "tok").exists() and not (tmp_path / "metrics.json").exists()


@pytest.mark.parametrize("name, where", [
    ("missing.tsv", "missing.tsv: no such file; copy the dictionary into corpus/dictionaries/"),
    ("folder", "folder is a folder; name a TSV dictionary file"),
    ("link.tsv", "link.tsv resolves to"),
])
def test_a_dictionary_path_that_is_no_file_inside_the_folder(tmp_path: Path, raw: Path, monkeypatch: pytest.MonkeyPatch,
                                                            name: str, where: str) -> None:
    folder = tmp_path / "corpus" / "dictionaries"
    (folder / "folder").mkdir(parents=True)
    outside = tmp_path / "outside.tsv"
    outside.write_text(GOOD, encoding="utf-8")
    outside.chmod(0)
    (folder / "link.tsv").symlink_to(outside)
    status, stderr = run_stage(
        tmp_path, raw, {**SECTION, "options": {"dictionary": f"corpus/dictionaries/{name}"}}, monkeypatch
    )
    assert_one_error_line(status, stderr, "tokenizer.options.dictionary")
    assert where in stderr
    assert not (tmp_path / "tok").exists() and not (tmp_path / "metrics.json").exists()


def test_lz78_prefixes_is_checked_and_both_values_run(
    tmp_path: Path, raw: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for bad in ({"options": {"prefixes": "open", "dictionary": "corpus/dictionaries/good.tsv"}},
                {"options": {"prefixes": "closed"}, "train_sources": ["notes"], "vocab_size": 300}):  # nothing to close
        status, stderr = run_stage(tmp_path, raw, {**SECTION, **bad}, monkeypatch)
        assert_one_error_line(status, stderr, "tokenizer.options.prefixes")
    (tmp_path / "corpus" / "dictionaries").mkdir(parents=True)
    (tmp_path / "corpus" / "dictionaries" / "good.tsv").write_text(GOOD, encoding="utf-8")
    vocab = {}
    for prefixes in ("file", "closed"):
        section = {**SECTION, "options": {"dictionary": "corpus/dictionaries/good.tsv", "prefixes": prefixes}}
        status, stderr = run_stage(tmp_path, raw, section, monkeypatch)
        assert status == 0, stderr
        vocab[prefixes] = json.loads((tmp_path / "metrics.json").read_text())["vocab_size"]
    # é's first byte is no code of the file; closing the dictionary adds it.
    assert vocab == {"file": 5 + 266, "closed": 6 + 266}
