"""The library's map is true in its two places. Each package's docstring names exactly the modules
and packages it holds, one line each (`- `name`: what it is`), so every module under lib/lockstep is
named in one docstring, its package's. docs/internals.md's Module map names every module under
lib/lockstep, and nothing else, by the rule written at the top of that section: a file `x/y.py` is
`lockstep.x.y`, a package's own name stands for its `__init__.py` alone, only `lockstep.pkg.*`
stands for a whole package, and each table holds the modules of the packages its title names."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "lib" / "lockstep"
DOC = ROOT / "docs" / "internals.md"
SECTION = "## Module map"
NAME = re.compile(r"`(lockstep(?:\.\w+)*(?:\.\*)?)`")
TITLE = re.compile(r"^\*\*[^*]+\*\* \(([^)]*)\)")  # **Data** (`lockstep.data`): ...
LISTED = re.compile(r"^- `(\w+)`: \S", re.MULTILINE)  # a docstring's line for one module


def library_modules(lib: Path = LIB) -> dict[str, str]:
    """Dotted name -> checkout-relative file, for every module and package under lib/lockstep but
    the root package itself (the map is of what it holds)."""
    found = {}
    for f in sorted(lib.rglob("*.py")):
        parts = f.relative_to(lib.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1:
            found[".".join(parts)] = f.relative_to(lib.parent.parent).as_posix()
    return found


def packages(lib: Path = LIB) -> list[Path]:
    """Every package folder under lib/lockstep, the root included."""
    return sorted(p.parent for p in lib.rglob("__init__.py"))


def held(package: Path) -> set[str]:
    """The names a package holds: its module files and its packages, one level down."""
    return ({f.stem for f in package.glob("*.py") if f.stem != "__init__"}
            | {d.name for d in package.iterdir() if (d / "__init__.py").is_file()})


def docstring_names(package: Path) -> list[str]:
    """The modules a package's docstring names, one `- `name`: ...` line each, in order."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    return LISTED.findall(doc)


def docstring_problems(lib: Path = LIB) -> list[str]:
    problems = []
    for package in packages(lib):
        where = package.relative_to(lib.parent.parent).as_posix() + "/__init__.py"
        names = docstring_names(package)
        twice = sorted(n for n, k in Counter(names).items() if k > 1)
        missing, extra = sorted(held(package) - set(names)), sorted(set(names) - held(package))
        if missing:
            problems.append(f"{where} does not name {', '.join(missing)}: add a line `- `NAME`: what it is` "
                            "to its docstring for each")
        if extra:
            problems.append(f"{where} names {', '.join(extra)}, which it does not hold: remove the line or "
                            "fix the name")
        if twice:
            problems.append(f"{where} names {', '.join(twice)} more than once")
    return problems


def map_names(text: str) -> list[str]:
    """The names in the first column of every table row of the Module map section."""
    return [name for _, rows in map_tables(text) for name in rows]


def map_tables(text: str) -> list[tuple[list[str], list[str]]]:
    """(names in a table's title, names in its rows' first column) for each table of the Module
    map; rows before any title come under an empty title."""
    start = text.index(SECTION + "\n")
    end = text.find("\n## ", start + len(SECTION))
    tables: list[tuple[list[str], list[str]]] = [([], [])]
    for line in text[start : end if end >= 0 else len(text)].splitlines():
        title = TITLE.match(line)
        cells = line.split("|")
        if title:
            tables.append((NAME.findall(title.group(1)), []))
        elif line.startswith("|") and len(cells) > 2:
            tables[-1][1].extend(NAME.findall(cells[1]))
    return [t for t in tables if t[0] or t[1]]


def covered(module: str, names: set[str]) -> bool:
    if module in names:
        return True
    parts = module.split(".")
    return any(".".join(parts[:i]) + ".*" in names for i in range(2, len(parts) + 1))


def within(name: str, owners: list[str]) -> bool:
    base = name.removesuffix(".*")
    return any(base == o or base.startswith(o + ".") for o in owners)


def test_rule_reads_whole_packages_only_from_a_star() -> None:
    names = {"lockstep.a", "lockstep.b.*"}
    assert covered("lockstep.a", names) and not covered("lockstep.a.x", names)
    assert covered("lockstep.b", names) and covered("lockstep.b.x", names) and covered("lockstep.b.x.y", names)
    rows = (f"{SECTION}\n\n| module | what |\n|---|---|\n| `lockstep.a`, `lockstep.c` | uses `lockstep.d` |\n\n"
            "**B** (`lockstep.b`): about `lockstep.e`\n\n| `lockstep.b.x` | x |\n\n## Next\n| `lockstep.e` | x |\n")
    assert map_names(rows) == ["lockstep.a", "lockstep.c", "lockstep.b.x"]
    assert map_tables(rows) == [([], ["lockstep.a", "lockstep.c"]), (["lockstep.b"], ["lockstep.b.x"])]


def test_every_library_module_is_in_the_module_map() -> None:
    tables = map_tables(DOC.read_text(encoding="utf-8"))
    names = {n for title, rows in tables for n in title + rows}
    modules = library_modules()
    missing = [f"{m} ({path})" for m, path in modules.items() if not covered(m, names)]
    assert not missing, (
        f"{len(missing)} module(s) missing from the Module map of docs/internals.md: {', '.join(missing)}.\n"
        f"fix: add a row like | `lockstep.PKG.NAME` | what it is | to its package's table under '{SECTION}' "
        "(a package's name covers its __init__.py only; `lockstep.PKG.*` covers all of a package)")


def test_the_module_map_names_only_modules_that_exist() -> None:
    modules = library_modules()
    stale = []
    for title, rows in map_tables(DOC.read_text(encoding="utf-8")):
        for name in title + rows:
            base = name.removesuffix(".*")
            if base not in modules:
                stale.append(name)
            elif name.endswith(".*") and not (LIB.parent / base.replace(".", "/") / "__init__.py").is_file():
                stale.append(f"{name} ({base} is a module, not a package)")
    assert not stale, (
        f"the Module map of docs/internals.md names what lib/lockstep does not hold: {', '.join(stale)}; "
        "fix the name or remove the row"
    )


def test_each_table_of_the_module_map_is_its_packages() -> None:
    """Every table names in its title the packages (or top-level modules) it holds, each top-level
    package is the title of one table, and every row lies in its own table's package."""
    tables = map_tables(DOC.read_text(encoding="utf-8"))
    untitled = [rows for title, rows in tables if not title]
    assert not untitled, f"Module map rows under no package title: {untitled}; put them under their package's table"
    astray = [f"{name} (in the table of {', '.join(title)})" for title, rows in tables for name in rows
              if not within(name, title)]
    assert not astray, (
        f"Module map rows in another package's table: {', '.join(astray)}; move each to its package's table"
    )
    titled = Counter(n for title, _ in tables for n in title)
    top = {f"lockstep.{p.name}" for p in LIB.iterdir() if (p / "__init__.py").is_file()}
    assert {p: titled[p] for p in sorted(top) if titled[p] != 1} == {}, (
        "each package under lib/lockstep is the title of exactly one Module map table, "
        "`**Title** (`lockstep.PKG`): ...`")


def test_every_package_docstring_names_exactly_its_modules() -> None:
    problems = docstring_problems()
    assert not problems, "\n".join(problems)


def test_each_module_is_named_in_exactly_one_package_docstring() -> None:
    """Every module file and package under lib/lockstep is named by the docstring of the package
    that holds it, and by no other (a docstring names only what it holds)."""
    named = Counter(f"{package.relative_to(LIB.parent).as_posix().replace('/', '.')}.{name}"
                    for package in packages() for name in docstring_names(package))
    assert {m: named[m] for m in library_modules() if named[m] != 1} == {}
    assert set(named) <= set(library_modules())


# The packages whose `__init__` is code as well: the tokenizer registry every loader needs, the
# LZ78 kind's tokenizer, and the source registry with fetch_source.
# The root sets OpenMP's wait policy, which must happen before torch loads: importing any lockstep
# module runs it first (lockstep.core.openmp imports nothing but os and sys).
INIT_WITH_CODE = {"lockstep", "lockstep.tokenizer", "lockstep.tokenizer.lz78", "lockstep.data.sources"}


def test_a_package_init_holds_its_docstring_alone() -> None:
    """No re-exports and no code in a package's `__init__` (but INIT_WITH_CODE's): importing
    `lockstep.model.ops` runs nothing of `lockstep.model.gpt`, and a stage's code deps stay the
    files it imports."""
    more = []
    for package in packages():
        name = package.relative_to(LIB.parent).as_posix().replace("/", ".")
        body = ast.parse((package / "__init__.py").read_text(encoding="utf-8")).body
        docstring_only = len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        if name not in INIT_WITH_CODE and not docstring_only:
            more.append(name)
    assert not more, f"package __init__ files with more than a docstring: {', '.join(more)}; move the code to a module"


def test_the_docstring_check_fails_on_a_module_nobody_named(tmp_path: Path) -> None:
    """What the checks above catch, on a small package tree: a module added and not named, and a
    name that no module answers to."""
    lib = tmp_path / "lib" / "lockstep"
    (lib / "core").mkdir(parents=True)
    (lib / "__init__.py").write_text('"""Root.\n\n- `core`: foundations\n"""\n')
    (lib / "core" / "__init__.py").write_text('"""Core.\n\n- `io`: files\n- `gone`: nothing\n"""\n')
    (lib / "core" / "io.py").write_text("")
    (lib / "core" / "new.py").write_text("")
    found = docstring_problems(lib)
    assert len(found) == 2 and "does not name new" in found[0] and "names gone" in found[1]
    assert set(library_modules(lib)) == {"lockstep.core", "lockstep.core.io", "lockstep.core.new"}
