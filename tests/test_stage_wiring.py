"""The stage layer's wiring rules, checked over every module under stages/: each stage that
dvc.yaml gives a `params:` list takes `--params`, the file it reads them from (params.yaml by
default), each stage's list of one-line errors (STAGE_ERRORS) is a library module's ERRORS, so
the library that raises an error is the one that says it is the user's to fix, and each stage takes
what it needs of the library from its own module of lockstep.pipeline alone."""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _stages_with_params() -> dict[str, bool]:
    """{module name under stages/: whether its dvc.yaml entry lists params}."""
    dag = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"]
    found: dict[str, bool] = {}
    for entry in dag.values():
        body = entry.get("do", entry)
        module = body["cmd"].split()[2].removeprefix("stages.")
        found[module] = found.get(module, False) or bool(body.get("params"))
    return found


def test_every_stage_module_is_in_the_dag() -> None:
    modules = {p.stem for p in (ROOT / "stages").glob("*.py") if not p.stem.startswith("_")}
    assert modules == set(_stages_with_params())


@pytest.mark.parametrize("module", sorted(m for m, reads in _stages_with_params().items() if reads))
def test_a_stage_that_reads_params_takes_params(module: str, repo_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(repo_root))
    main = importlib.import_module(f"stages.{module}").main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert "--params" in out.getvalue(), f"stages.{module} has no --params option"


@pytest.mark.parametrize("module", sorted(_stages_with_params()))
def test_a_stage_error_list_is_a_library_one(module: str, repo_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(repo_root))
    errors = importlib.import_module(f"stages.{module}").STAGE_ERRORS
    owners = [name for name, mod in list(sys.modules.items())
              if name.startswith("lockstep") and getattr(mod, "ERRORS", None) is errors]
    assert owners, f"stages.{module}.STAGE_ERRORS is not any lockstep module's ERRORS"
    assert all(issubclass(e, Exception) for e in errors)


# Which module of lockstep.pipeline holds a stage's work, where its name is not the stage's.
PIPELINE_OF = {"pretrain": "train", "midtrain": "train", "sft": "train"}


@pytest.mark.parametrize("module", sorted(_stages_with_params()))
def test_a_stage_imports_the_library_through_its_pipeline_module(module: str) -> None:
    """stages/X.py takes everything of lockstep from lockstep.pipeline.X (stages._common and
    stages._runtime are the stage layer's own), so the pipeline module is the stage's whole
    interface to the library."""
    tree = ast.parse((ROOT / "stages" / f"{module}.py").read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    own = f"lockstep.pipeline.{PIPELINE_OF.get(module, module)}"
    others = sorted(m for m in imported if m.split(".")[0] == "lockstep" and m != own)
    assert own in imported and not others, (f"stages/{module}.py imports {others or 'nothing of ' + own}; "
                                            f"take what it needs from {own}")
