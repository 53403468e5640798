"""The developer tools stay apart from the pipeline: no stage's import closure (the scan behind
dvc.yaml's code deps, lockstep.core.codeid) reaches a module of lockstep.dev, and no library module
outside it imports one, so that editing a generator or a checker reruns no stage."""

from __future__ import annotations

from pathlib import Path

from lockstep.core.codeid import module_files
from lockstep.dev.dvcdeps import project_roots, stage_deps

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "lib" / "lockstep"
DEV = "lib/lockstep/dev/"
# The console script is the tools' front door (`lockstep dev ...`); it imports them inside its commands.
FRONT_DOORS = {"lockstep.cli"}


def _rel(files: list[Path]) -> list[str]:
    return [f.resolve().relative_to(ROOT).as_posix() for f in files]


def _library_modules() -> list[str]:
    names = []
    for f in sorted(LIB.rglob("*.py")):
        parts = f.relative_to(LIB.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def test_dvc_stages_import_no_dev_tool() -> None:
    found = {s.stage: [p for p in s.expected if p.startswith(DEV)] for s in stage_deps(ROOT / "dvc.yaml")}
    bad = {stage: files for stage, files in found.items() if files}
    assert not bad, ("a stage's imports reach lockstep.dev, a developer tool no stage may run: "
                     f"{bad}; move what the stage needs out of lib/lockstep/dev/")


def test_no_stage_module_imports_a_dev_tool() -> None:
    # Every stages/*.py, also one that dvc.yaml does not list yet.
    roots = project_roots(ROOT)
    for path in sorted((ROOT / "stages").glob("*.py")):
        dev = [p for p in _rel(module_files(f"stages.{path.stem}", roots)) if p.startswith(DEV)]
        assert not dev, f"stages.{path.stem} imports {dev}; move what it needs out of lib/lockstep/dev/"


def test_only_the_dev_package_and_the_console_script_import_dev_tools() -> None:
    roots = project_roots(ROOT)
    modules = _library_modules()
    assert "lockstep.dev.dvcdeps" in modules and "lockstep.dev" in modules
    for name in modules:
        if name == "lockstep.dev" or name.startswith("lockstep.dev.") or name in FRONT_DOORS:
            continue
        dev = [p for p in _rel(module_files(name, roots)) if p.startswith(DEV)]
        assert not dev, (f"{name} imports {dev}: runtime code must not depend on lockstep.dev; "
                         "move the shared part to the library and import it from both")
