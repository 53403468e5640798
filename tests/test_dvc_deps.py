"""dvc.yaml stays honest: every stage's deps cover the library modules its entry point imports
(transitively), so editing a module reruns exactly the stages that use it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "lib"


def _module_file(name: str) -> Path | None:
    """The file of a `lockstep...` or `stages...` module inside the checkout, or None."""
    base = LIB if name.split(".")[0] == "lockstep" else ROOT
    path = base.joinpath(*name.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return None


def _imports(file: Path, module: str) -> set[str]:
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] in ("lockstep", "stages")}


def transitive_files(entry_module: str) -> set[Path]:
    seen: set[str] = set()
    files: set[Path] = set()
    todo = [entry_module]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        f = _module_file(mod)
        if f is None:
            continue
        files.add(f)
        # a submodule import also executes its parent packages' __init__
        parts = mod.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        todo.extend(_imports(f, mod))
    return files


def _stages() -> list[tuple[str, dict]]:
    doc = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))
    out = []
    for name, stage in doc["stages"].items():
        out.append((name, stage.get("do", stage)))
    return out


@pytest.mark.parametrize("name,stage", _stages(), ids=[n for n, _ in _stages()])
def test_stage_deps_cover_imported_modules(name: str, stage: dict) -> None:
    m = re.search(r"python -m (stages\.\w+)", stage["cmd"])
    assert m, f"stage {name}: cmd must run `python -m stages.NAME`"
    assert _module_file(m.group(1)) is not None, f"stage {name}: {m.group(1)} does not exist"
    files = transitive_files(m.group(1))
    deps = [ROOT / d for d in stage.get("deps", []) if "${" not in d]
    missing = sorted(
        str(f.relative_to(ROOT))
        for f in files
        if f.name != "__init__.py" or f.parent.name != "stages"
        if not any(f == d or d in f.parents for d in deps)
    )
    assert not missing, f"stage {name} imports modules not in its deps: {missing}; add them to dvc.yaml"


def test_transitive_import_scan_finds_nested_modules(tmp_path: Path) -> None:
    # The scanner itself must see through `from lockstep.x import y` chains.
    files = transitive_files("stages._common")
    names = {f.name for f in files}
    assert {"_common.py", "config.py"} <= names


def test_params_is_the_tiny_preset() -> None:
    assert (ROOT / "params.yaml").read_bytes() == (ROOT / "presets" / "tiny.yaml").read_bytes(), (
        "params.yaml differs from presets/tiny.yaml: edit the preset and run `lockstep preset tiny`"
    )
