"""Memory of the lz78 paths that grow with their input, measured as the peak resident size a fresh
Linux process adds (no clocks: time is measured by bench/bench_lz78.py). Reading a dictionary file
costs a few hundred bytes a line, not a kilobyte; decoding costs a few bytes per byte of text it
returns, not a hundred."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak resets")


def write_dictionary(path: Path, n: int, seed: int = 0) -> None:
    """An lz78-layout file of `n` codes in creation order: each code a random earlier code (or the
    root) plus a letter."""
    rng = np.random.default_rng(seed)
    alphabet = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    taken: set[tuple[int, str]] = set()
    pattern = [""]
    lines = []
    for code in range(1, n + 1):
        while True:
            parent = int(rng.integers(0, code))
            char = alphabet[int(rng.integers(0, len(alphabet)))]
            if (parent, char) not in taken:
                break
        taken.add((parent, char))
        pattern.append(pattern[parent] + char)
        lines.append(f"{code}\t{parent}\t{char}\t{pattern[code]}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def peak_growth(script: str, *args: str) -> dict:
    """Run `script` in a fresh interpreter; it prints a JSON object, to which `growth` is added: how
    far the peak resident size rose past the resident size at the point the script calls `mark()`,
    in bytes. `mark` resets the kernel's peak (clear_refs), so numba's compilation before it, which
    peaks high, does not hide what comes after."""
    prelude = textwrap.dedent("""
        import json, sys
        def status(field):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
        def mark():
            global BASE
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM, the peak resident size, to the current one
            BASE = status("VmRSS")
        def report(**facts):
            print(json.dumps({**facts, "growth": status("VmHWM") - BASE}))
    """)
    env_path = f"{ROOT / 'lib'}:{ROOT}"
    out = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_reading_a_dictionary_costs_hundreds_of_bytes_a_line(tmp_path: Path) -> None:
    n = 200_000
    write_dictionary(tmp_path / "big.tsv", n)
    write_dictionary(tmp_path / "small.tsv", 50)
    facts = peak_growth("""
        from lockstep.tokenizer.lz78.train import from_dictionary
        from_dictionary(sys.argv[2]).encode("warm up the compiled paths")
        mark()
        tok = from_dictionary(sys.argv[1])
        report(n_codes=tok.n_codes, ids=tok.encode("cab"))
    """, str(tmp_path / "big.tsv"), str(tmp_path / "small.tsv"))
    assert facts["n_codes"] == n
    # about 100 bytes a line here; the plain reader takes about 1 KB
    assert facts["growth"] / n < 400, facts


def test_decoding_costs_a_few_bytes_per_byte_of_text(tmp_path: Path) -> None:
    write_dictionary(tmp_path / "d.tsv", 20_000)
    facts = peak_growth("""
        import numpy as np
        from lockstep.tokenizer.lz78.train import from_dictionary
        tok = from_dictionary(sys.argv[1])
        rng = np.random.default_rng(0)
        words = ["the", "cab", "cafe", "abbey", "zebra", "quiz", "fact", "élan"]
        text = " ".join(words[i] for i in rng.integers(0, len(words), size=1_500_000))
        ids = tok.encode(text)
        tok.decode(ids[:100])
        mark()
        back = tok.decode(ids)
        report(same=back == text, text_bytes=len(text.encode()))
    """, str(tmp_path / "d.tsv"))
    assert facts["same"]
    # the text itself (1 byte a character here) and the gathered UTF-8, about 4 bytes per byte in
    # all; decoding through one Python object per token took over 100
    assert facts["growth"] / facts["text_bytes"] < 12, facts
