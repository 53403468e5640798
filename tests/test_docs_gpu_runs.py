"""README.md, docs/team.md and docs/performance.md say the same about what has run on a GPU: each
has a "What has run on a GPU" passage, and the three name the same runs, by date and commit."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMIT = re.compile(r"\b[0-9a-f]{7}\b")


def passage(path: Path) -> str:
    """The text from the "What has run on a GPU" heading or bullet to the next heading or bullet
    at its level (a README bullet ends at a blank line)."""
    text = path.read_text(encoding="utf-8")
    m = re.search(r"^(#+ |- \*\*)What has run on a GPU", text, flags=re.M)
    assert m, f"{path.name} has no 'What has run on a GPU' passage"
    rest = text[m.end():]
    end = re.search(r"^#{1,%d} " % len(m.group(1).strip()), rest, flags=re.M) if m.group(1).startswith("#") \
        else re.search(r"\n\n", rest)
    return rest[: end.start() if end else len(rest)]


def runs(path: Path) -> tuple[set[str], set[str]]:
    text = passage(path)
    return set(DATE.findall(text)), set(COMMIT.findall(text))


def test_the_three_docs_name_the_same_gpu_runs() -> None:
    docs = [ROOT / "README.md", ROOT / "docs" / "team.md", ROOT / "docs" / "performance.md"]
    found = {d.relative_to(ROOT).as_posix(): runs(d) for d in docs}
    dates, commits = found["docs/performance.md"]
    assert dates and commits, "docs/performance.md's passage names no run"
    for name, (d, c) in found.items():
        assert (d, c) == (dates, commits), f"{name} names runs {sorted(d)} at {sorted(c)}, docs/performance.md " \
                                           f"{sorted(dates)} at {sorted(commits)}"


def test_the_passage_ends_at_the_next_heading(tmp_path: Path) -> None:
    import pytest

    doc = tmp_path / "doc.md"
    doc.write_text("# x\n\n## What has run on a GPU\n\nOne run, 2026-11-26 at 37d4ad1.\n\n## Next\n"
                   "2026-11-27 c343c0a\n", encoding="utf-8")
    assert runs(doc) == ({"2026-11-26"}, {"37d4ad1"})  # the next section is not part of it
    doc.write_text("# nothing here\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="no 'What has run on a GPU' passage"):
        runs(doc)
