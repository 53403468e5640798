"""The linter holds the code to pyproject.toml's [tool.ruff] settings: a finding fails here with
ruff's own line (`path:line:col: CODE message`), fixed in place or with a `# noqa: CODE` that
says why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["lib", "stages", "tests", "bench"]


def _ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_ruff_finds_nothing() -> None:
    out = _ruff("check", "--no-cache", "--output-format", "concise", *CHECKED)
    assert out.returncode == 0, f"ruff check found:\n{out.stdout}{out.stderr}"


def test_ruff_reads_the_project_settings(tmp_path: Path) -> None:
    """The check above is only as strict as its settings: a line one over the width and an unused
    import, in a file under a checked folder, are both findings."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    bad = tmp_path / "lib" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("import os\n\nX = '" + "x" * 115 + "'\n")
    assert len(bad.read_text().splitlines()[2]) == 121
    out = _ruff("check", "--no-cache", "--output-format", "concise", "lib", cwd=tmp_path)
    assert out.returncode == 1
    assert "lib/bad.py:1:8: F401" in out.stdout and "lib/bad.py:3:" in out.stdout and "E501" in out.stdout
