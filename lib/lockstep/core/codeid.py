"""A stage's code identity: the project files it runs, found by following its imports.

Two things need to know which code a stage runs: the code revision that names a training run's
folder and goes into every checkpoint's `meta.json`, and the `deps` that dvc.yaml lists for the
stage. Both come from this one scan, so an edit reruns exactly the stages whose code it touches,
and a docs or test edit reruns nothing.

The scan starts at a stage's entry module (e.g. `stages.pretrain`) and follows every `import` and
`from ... import` of a module inside the project's own packages (`lockstep`, `stages`), wherever
the statement sits (module level or inside a function), adding the package `__init__` files that
importing a submodule runs. It reads sources with `ast` and imports nothing. It over-approximates
(an import in a branch never taken still counts), so an edit may rerun a stage that would not have
changed, never the reverse. Third-party packages are not followed: the environment pins them."""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterable
from pathlib import Path

from lockstep.core.io import sha256_file, sha256_of_manifest

PROJECT_PACKAGES = ("lockstep", "stages")


class CodeScanError(RuntimeError):
    """The entry module or one of the project's packages cannot be found."""


def package_dir(package: str) -> Path:
    """The folder of a top-level project package, located without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CodeScanError(f"package {package!r} is not importable from here; run from the project root "
                            "(where stages/ is) with the project installed (`make setup`)")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def _module_file(name: str, roots: dict[str, Path]) -> Path | None:
    """The source file of a project module or package, or None when `name` is no module (e.g. the
    `y` of `from lockstep.x import y` when y is a function)."""
    top, *rest = name.split(".")
    path = roots[top].joinpath(*rest)
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    if path.with_suffix(".py").is_file():
        return path.with_suffix(".py")
    return None


def _imported_names(file: Path, module: str) -> set[str]:
    """Every module name an import statement in `file` may load (for `from a import b`, both `a`
    and `a.b`: whether b is a submodule is settled by looking for its file)."""
    tree = ast.parse(file.read_bytes(), filename=str(file))
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level > len(parts):
                    raise CodeScanError(f"{file}: relative import beyond the top-level package")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names if alias.name != "*")
    return {n for n in names if n.split(".")[0] in PROJECT_PACKAGES}


def module_files(entry: str, roots: dict[str, Path] | None = None) -> list[Path]:
    """The project source files that running module `entry` can execute, sorted."""
    roots = roots or {p: package_dir(p) for p in PROJECT_PACKAGES}
    if entry.split(".")[0] not in roots:
        raise CodeScanError(f"{entry!r} is not a module of the project packages {sorted(roots)}")
    if _module_file(entry, roots) is None:
        raise CodeScanError(f"module {entry!r} not found under {roots[entry.split('.')[0]]}")
    seen: set[str] = set()
    files: set[Path] = set()
    todo = [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        file = _module_file(name, roots)
        if file is None:
            continue
        files.add(file)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # parent packages' __init__ run first
        todo.extend(_imported_names(file, name))
    return sorted(files)


def _package_relative(files: Iterable[Path], roots: dict[str, Path]) -> dict[str, Path]:
    """`lockstep/model/gpt.py`-style names: the same in every checkout and installation."""
    named = {}
    for f in files:
        for package, root in roots.items():
            if root == f.parent or root in f.parents:
                named[f"{package}/{f.relative_to(root).as_posix()}"] = f
                break
    return named


def code_revision(entry: str, roots: dict[str, Path] | None = None) -> str:
    """`sha256:<hex>` over the names and contents of the files `entry` can execute. Unlike a git
    commit it does not move when unrelated files change, so identical runs keep byte-identical
    checkpoints and DVC output hashes."""
    roots = roots or {p: package_dir(p) for p in PROJECT_PACKAGES}
    named = _package_relative(module_files(entry, roots), roots)
    return "sha256:" + sha256_of_manifest({name: sha256_file(f) for name, f in named.items()})
