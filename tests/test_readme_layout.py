"""README.md's Layout tree is true: every path it names exists, and every package under
lib/lockstep (at any depth) and every module at its top level appears in it.

The tree's grammar: an entry line starts at an indent under DESCRIPTION_COLUMN with one or more
names separated by single spaces (`a.py b.py`), then two or more spaces and its description; a
line indented to the description column or beyond continues the description above it. A name is
a path relative to the nearest entry above it, indented less, whose name ends in `/`."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LIB = ROOT / "lib" / "lockstep"
DESCRIPTION_COLUMN = 20


def layout_block(text: str) -> list[str]:
    """The lines of the first code block after the `## Layout` heading."""
    section = text[text.index("## Layout\n"):]
    start = section.index("```\n") + 4
    return section[start : section.index("```", start)].splitlines()


def tree_paths(lines: list[str]) -> list[str]:
    """Every path the tree names, checkout-relative (folders keep their trailing `/`)."""
    parents: list[tuple[int, str]] = []  # (indent, path) of the folders enclosing the current line
    paths = []
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= DESCRIPTION_COLUMN:
            continue
        while parents and parents[-1][0] >= indent:
            parents.pop()
        base = parents[-1][1] if parents else ""
        names = re.split(r" {2,}", line.strip(), maxsplit=1)[0].split(" ")
        for name in names:
            paths.append(base + name)
        folders = [base + n for n in names if n.endswith("/")]
        if len(folders) == 1 and len(names) == 1:
            parents.append((indent, folders[0]))
    return paths


def test_the_grammar_on_a_small_tree() -> None:
    lines = ["top.txt           a file",
             "lib/x/            a folder",
             "  a.py b.py       two modules",
             "                    a continued description",
             "  sub/            a folder in it",
             "    c.py          one module",
             "  d.py            back up one level",
             "docs/             another"]
    assert tree_paths(lines) == ["top.txt", "lib/x/", "lib/x/a.py", "lib/x/b.py", "lib/x/sub/", "lib/x/sub/c.py",
                                 "lib/x/d.py", "docs/"]


def test_every_path_in_the_layout_exists() -> None:
    missing = [p for p in tree_paths(layout_block(README.read_text(encoding="utf-8"))) if not (ROOT / p).exists()]
    assert not missing, (
        f"README.md's Layout names what the checkout does not hold: {', '.join(missing)}; fix or remove them"
    )


def test_every_package_and_top_level_module_is_in_the_layout() -> None:
    named = set(tree_paths(layout_block(README.read_text(encoding="utf-8"))))
    lib = LIB.relative_to(ROOT).as_posix()
    wanted = {f"{lib}/{p.parent.relative_to(LIB).as_posix()}/" for p in LIB.rglob("__init__.py") if p.parent != LIB}
    wanted |= {f"{lib}/{f.name}" for f in LIB.glob("*.py") if f.name != "__init__.py"}
    missing = sorted(wanted - named)
    assert not missing, (
        f"README.md's Layout leaves out {', '.join(missing)}; add a line for each under `lib/lockstep/` "
        "(a package as `name/`, indented under its parent, with what it is)"
    )
