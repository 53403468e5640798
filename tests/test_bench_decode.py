"""bench/bench_decode.py's nanochat comparison, on the CPU at a toy length: it builds nanochat's
model at lockstep's shape (heads included) through bench_gpu's helper, decodes every path it
names and prints a ratio for each. It broke once when that helper's signature moved; no timing is
checked here. Skips without nanochat's checkout, as in a user's clone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_nanochat_comparison_runs_every_path(nanochat_root: Path) -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "bench_decode.py"), "--nanochat", str(nanochat_root),
           "--shapes", "tiny", "--dtypes", "fp32", "--batches", "1,2", "--new", "4", "--prompt", "4",
           "--reps", "1", "--threads", "1", "--no-compiled"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "lib"))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for batch in (1, 2):
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith(f"tiny fp32 batch {batch}:"))
        for path in ("engine", "cpu_step", "static"):
            assert re.search(rf"\| {path} +\d+ \(\d+\.\d\dx\)", line), line
