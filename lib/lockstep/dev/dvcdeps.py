"""dvc.yaml's code deps, generated from what each stage imports (see lockstep.core.codeid).

Each stage's `deps` list the project files its entry module can execute, file by file, and no
others; data deps (`data/...`, `evalsets`, a notes folder) stay as written. `lockstep dev deps`
checks this both ways and `lockstep dev deps --write` rewrites the code entries in place, keeping
every other line of dvc.yaml (comments included) as it is."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from lockstep.core.codeid import module_files

_ENTRY = re.compile(r"python3? -m (stages\.\w+)")
_STAGE_LINE = re.compile(r"^  ([A-Za-z_][\w-]*):\s*(#.*)?$")
_DEPS_LINE = re.compile(r"^(\s+)deps:\s*(#.*)?$")


class DepsError(ValueError):
    """dvc.yaml cannot be checked (a stage runs no `python -m stages.NAME`, a missing module)."""


@dataclass(frozen=True)
class StageDeps:
    stage: str
    expected: tuple[str, ...]   # code files the entry module can execute, checkout-relative
    listed: tuple[str, ...]     # code entries dvc.yaml lists now

    @property
    def missing(self) -> list[str]:
        return sorted(set(self.expected) - set(self.listed))

    @property
    def extra(self) -> list[str]:
        return sorted(set(self.listed) - set(self.expected))


def project_roots(root: Path) -> dict[str, Path]:
    """The project's packages in a checkout: lib/lockstep and stages (the layout in the README)."""
    roots = {"lockstep": root / "lib" / "lockstep", "stages": root / "stages"}
    for name, path in roots.items():
        if not (path / "__init__.py").is_file():
            raise DepsError(f"{path} is not the {name} package; run from the checkout root or pass its dvc.yaml")
    return roots


def is_code_path(entry: str) -> bool:
    """A deps entry that names project code (and so belongs to the generated part)."""
    return entry == "stages" or entry.startswith(("stages/", "lib/lockstep"))


def _order(paths: set[str]) -> tuple[str, ...]:
    return tuple(sorted(paths, key=lambda p: (not p.startswith("stages/"), p)))


def stage_deps(dvc_yaml: Path) -> list[StageDeps]:
    """Expected and listed code deps for every stage of `dvc_yaml`."""
    root = dvc_yaml.resolve().parent
    roots = project_roots(root)
    doc = yaml.safe_load(dvc_yaml.read_text(encoding="utf-8")) or {}
    found = []
    for name, stage in (doc.get("stages") or {}).items():
        body = stage.get("do", stage)
        m = _ENTRY.search(str(body.get("cmd", "")))
        if not m:
            raise DepsError(f"{dvc_yaml}: stage {name!r} does not run `python3 -m stages.NAME`; "
                            "every stage's command must, so that its code deps can be derived")
        files = module_files(m.group(1), roots)
        expected = {f.relative_to(root).as_posix() for f in files}
        listed = tuple(d for d in body.get("deps", []) if isinstance(d, str) and is_code_path(d))
        found.append(StageDeps(name, _order(expected), listed))
    return found


def problems(dvc_yaml: Path) -> list[str]:
    """One line per stage whose code deps differ from its imports; empty when dvc.yaml is right."""
    lines = []
    for s in stage_deps(dvc_yaml):
        if s.missing:
            lines.append(f"{s.stage}: imports but does not list {', '.join(s.missing)}")
        if s.extra:
            lines.append(f"{s.stage}: lists but does not import {', '.join(s.extra)}")
    return lines


def rewrite(dvc_yaml: Path) -> str:
    """dvc.yaml's text with each stage's code deps replaced by the generated list (placed first,
    data deps after them in their order); every other line unchanged."""
    expected = {s.stage: s.expected for s in stage_deps(dvc_yaml)}
    lines = dvc_yaml.read_text(encoding="utf-8").splitlines(keepends=True)
    out: list[str] = []
    stage = None
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _STAGE_LINE.match(line)
        if m:
            stage = m.group(1)
        d = _DEPS_LINE.match(line)
        if d and stage in expected:
            out.append(line)
            item_indent = None
            data_items = []
            i += 1
            while i < len(lines):
                item = re.match(r"^(\s+)- (.*?)\s*$", lines[i])
                if not item or len(item.group(1)) <= len(d.group(1)):
                    break
                item_indent = item.group(1)
                value = item.group(2).split(" #")[0].strip()
                if not is_code_path(value):
                    data_items.append(lines[i])
                i += 1
            indent = item_indent or d.group(1) + "  "
            out.extend(f"{indent}- {p}\n" for p in expected[stage])
            out.extend(data_items)
            continue
        out.append(line)
        i += 1
    return "".join(out)
