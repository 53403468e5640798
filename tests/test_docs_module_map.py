"""docs/internals.md's Module map names every module under lib/lockstep, and nothing else, by the
rule written at the top of that section: a file `x/y.py` is `lockstep.x.y`, a package's own name
stands for its `__init__.py` alone, and only `lockstep.pkg.*` stands for a whole package."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "lib" / "lockstep"
DOC = ROOT / "docs" / "internals.md"
SECTION = "## Module map"
NAME = re.compile(r"`(lockstep(?:\.\w+)*(?:\.\*)?)`")


def library_modules() -> dict[str, str]:
    """Dotted name -> checkout-relative file, for every module and package under lib/lockstep but
    the root package itself (the map is of what it holds)."""
    found = {}
    for f in sorted(LIB.rglob("*.py")):
        parts = f.relative_to(LIB.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1:
            found[".".join(parts)] = f.relative_to(ROOT).as_posix()
    return found


def map_names(text: str) -> list[str]:
    """The names in the first column of every table row of the Module map section."""
    start = text.index(SECTION + "\n")
    end = text.find("\n## ", start + len(SECTION))
    names = []
    for line in text[start : end if end >= 0 else len(text)].splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2:
            names += NAME.findall(cells[1])
    return names


def covered(module: str, names: set[str]) -> bool:
    if module in names:
        return True
    parts = module.split(".")
    return any(".".join(parts[:i]) + ".*" in names for i in range(2, len(parts) + 1))


def test_rule_reads_whole_packages_only_from_a_star() -> None:
    names = {"lockstep.a", "lockstep.b.*"}
    assert covered("lockstep.a", names) and not covered("lockstep.a.x", names)
    assert covered("lockstep.b", names) and covered("lockstep.b.x", names) and covered("lockstep.b.x.y", names)
    rows = f"{SECTION}\n\n| module | what |\n|---|---|\n| `lockstep.a`, `lockstep.c` | uses `lockstep.d` |\n\n## Next\n| `lockstep.e` | x |\n"
    assert map_names(rows) == ["lockstep.a", "lockstep.c"]


def test_every_library_module_is_in_the_module_map() -> None:
    names = set(map_names(DOC.read_text(encoding="utf-8")))
    modules = library_modules()
    missing = [f"{m} ({path})" for m, path in modules.items() if not covered(m, names)]
    assert not missing, (
        f"{len(missing)} module(s) missing from the Module map of docs/internals.md: {', '.join(missing)}.\n"
        f"fix: add a row like | `lockstep.NAME` | what it is | to the table of its layer under '{SECTION}' "
        "(a package's name covers its __init__.py only; `lockstep.PKG.*` covers all of a package)")


def test_the_module_map_names_only_modules_that_exist() -> None:
    modules = library_modules()
    stale = []
    for name in map_names(DOC.read_text(encoding="utf-8")):
        base = name.removesuffix(".*")
        if base not in modules:
            stale.append(name)
        elif name.endswith(".*") and not (LIB.parent / base.replace(".", "/") / "__init__.py").is_file():
            stale.append(f"{name} ({base} is a module, not a package)")
    assert not stale, (f"the Module map of docs/internals.md names what lib/lockstep does not hold: {', '.join(stale)}; "
                       "fix the name or remove the row")
