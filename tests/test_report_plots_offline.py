"""`dvc plots show` with the shipped template renders a chart in headless Chromium with the
network blocked (skipped where Chromium is not installed)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_template_has_no_remote_scripts() -> None:
    page = (ROOT / ".dvc" / "plots" / "offline.html").read_text(encoding="utf-8")
    assert "{plot_divs}" in page and "{scripts}" not in page  # DVC's CDN tags have nowhere to go
    assert not re.search(r"<script[^>]+src=", page)


def test_dvc_plots_render_offline(tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        pytest.skip("headless Chromium not installed")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([str(BIN / "dvc"), "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".dvc" / "plots").mkdir()
    shutil.copy(ROOT / ".dvc" / "plots" / "offline.html", tmp_path / ".dvc" / "plots" / "offline.html")
    shutil.copy(ROOT / ".dvc" / "config", tmp_path / ".dvc" / "config")
    (tmp_path / "loss.tsv").write_text("step\tloss\n0\t3.0\n1\t2.5\n2\t2.2\n")
    (tmp_path / "dvc.yaml").write_text("plots:\n  - loss.tsv:\n      x: step\n      y: loss\n")
    subprocess.run([str(BIN / "dvc"), "plots", "show", "-o", "out"], cwd=tmp_path, check=True, capture_output=True)
    html = (tmp_path / "out" / "index.html").read_text(encoding="utf-8")
    assert "cdn.jsdelivr" not in html
    dom = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--proxy-server=127.0.0.1:9",
         "--virtual-time-budget=5000", "--dump-dom", str(tmp_path / "out" / "index.html")],
        capture_output=True, text=True, timeout=120,
    ).stdout
    body = dom[dom.rfind("<body"):]
    assert re.search(r'<canvas[^>]*class="marks"|<svg[^>]*class="marks"', body), body[:2000]
