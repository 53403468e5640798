"""dvc.yaml stays honest and a stage's identity follows what it imports: every stage lists exactly
the project files its entry module can execute (lockstep.core.codeid), and the code revision in its
checkpoints moves when, and only when, one of those files changes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lockstep.cli import app
from lockstep.core.codeid import CodeScanError, code_revision, module_files
from lockstep.dev.dvcdeps import DepsError, problems, project_roots, rewrite, stage_deps

ROOT = Path(__file__).resolve().parents[1]


def test_every_stage_lists_exactly_the_code_it_imports() -> None:
    found = problems(ROOT / "dvc.yaml")
    assert not found, "dvc.yaml code deps differ from the imports:\n" + "\n".join(found) + \
        "\nfix: lockstep dev deps --write"


def test_docs_and_tests_are_no_stage_dependency() -> None:
    for s in stage_deps(ROOT / "dvc.yaml"):
        assert all(p.startswith(("stages/", "lib/lockstep/")) for p in s.expected), s.stage
    text = (ROOT / "dvc.yaml").read_text()
    assert "- docs" not in text, "docs/ is documentation: no stage may depend on it"


def test_scan_follows_from_imports_function_level_imports_and_parent_packages(tmp_path: Path) -> None:
    lib = tmp_path / "lib" / "lockstep"
    (lib / "sub").mkdir(parents=True)
    (tmp_path / "stages").mkdir()
    (lib / "__init__.py").write_text("")
    (lib / "sub" / "__init__.py").write_text("")
    (lib / "sub" / "deep.py").write_text("from . import sibling\n")
    (lib / "sub" / "sibling.py").write_text("import os\n")
    (lib / "lazy.py").write_text("def f():\n    from lockstep.sub import deep\n    return deep\n")
    (lib / "unused.py").write_text("X = 1\n")
    (tmp_path / "stages" / "__init__.py").write_text("")
    (tmp_path / "stages" / "one.py").write_text("import numpy\nfrom lockstep.lazy import f\n")
    roots = project_roots(tmp_path)
    names = {p.relative_to(tmp_path).as_posix() for p in module_files("stages.one", roots)}
    assert names == {"stages/__init__.py", "stages/one.py", "lib/lockstep/__init__.py", "lib/lockstep/lazy.py",
                     "lib/lockstep/sub/__init__.py", "lib/lockstep/sub/deep.py", "lib/lockstep/sub/sibling.py"}

    before = code_revision("stages.one", roots)
    (lib / "unused.py").write_text("X = 2\n")
    assert code_revision("stages.one", roots) == before, "a file the stage never imports moved its identity"
    (lib / "sub" / "sibling.py").write_text("import os  # a comment is an edit too\n")
    assert code_revision("stages.one", roots) != before


def test_code_revision_is_per_stage() -> None:
    # The report stage runs no model code: a model edit must not rename the report's code.
    report = {p.name for p in module_files("stages.report")}
    assert "gpt.py" not in report
    assert code_revision("stages.report") != code_revision("stages.pretrain")
    assert code_revision("stages.pretrain") == code_revision("stages.pretrain")
    with pytest.raises(CodeScanError, match="not found"):
        module_files("stages.no_such_stage")


def _copy_dag(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "lib" / "lockstep", tmp_path / "lib" / "lockstep",
                    ignore=shutil.ignore_patterns("__pycache__", "static"))
    shutil.copytree(ROOT / "stages", tmp_path / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    return tmp_path / "dvc.yaml"


def test_check_names_missing_and_extra_files_and_write_fixes_them(tmp_path: Path) -> None:
    dvc_yaml = _copy_dag(tmp_path)
    text = dvc_yaml.read_text()
    # Drop the model from pretrain's deps, and list the report module where the tokenizer never imports it.
    pretrain_block = text.index("\n  pretrain:")
    cut = text.index("      - lib/lockstep/model/gpt.py\n", pretrain_block)
    text = text[:cut] + text[cut:].replace("      - lib/lockstep/model/gpt.py\n", "", 1)
    tok = text.index("\n  tokenizer:")
    at = text.index("      - stages/tokenizer.py\n", tok)
    text = text[:at] + "      - lib/lockstep/pipeline/report.py  # not imported\n" + text[at:]
    dvc_yaml.write_text(text)
    found = problems(dvc_yaml)
    assert "pretrain: imports but does not list lib/lockstep/model/gpt.py" in found
    assert "tokenizer: lists but does not import lib/lockstep/pipeline/report.py" in found

    result = CliRunner().invoke(app, ["dev", "deps", "--dvc-yaml", str(dvc_yaml)])
    assert result.exit_code == 1 and "lib/lockstep/model/gpt.py" in result.output

    fixed = rewrite(dvc_yaml)
    dvc_yaml.write_text(fixed)
    assert problems(dvc_yaml) == []
    # Only the code entries moved: comments, params, data deps and outs are kept line for line.
    assert fixed.splitlines()[0] == (ROOT / "dvc.yaml").read_text().splitlines()[0]
    assert fixed == (ROOT / "dvc.yaml").read_text()
    result = CliRunner().invoke(app, ["dev", "deps", "--dvc-yaml", str(dvc_yaml)])
    assert result.exit_code == 0, result.output


def test_a_stage_without_a_stage_module_is_refused(tmp_path: Path) -> None:
    dvc_yaml = _copy_dag(tmp_path)
    dvc_yaml.write_text(dvc_yaml.read_text().replace("python3 -m stages.report", "bash make_report.sh", 1))
    with pytest.raises(DepsError, match="report.*python3 -m stages.NAME"):
        problems(dvc_yaml)


def test_params_is_the_tiny_preset() -> None:
    assert (ROOT / "params.yaml").read_bytes() == (ROOT / "presets" / "tiny.yaml").read_bytes(), (
        "params.yaml differs from presets/tiny.yaml: edit the preset and run `lockstep preset tiny`"
    )
