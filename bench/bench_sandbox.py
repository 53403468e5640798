"""Benchmark of the code sandbox's cost per item: `run_tests` on the project's own code items with
their reference solutions (what the eval stage runs per generated solution), against a baseline
sandbox module taken from a git revision (by default 37d4ad1: mount, network and IPC namespaces,
no PID namespace, no minimal root, no syscall filter), alternating the two item by item in this
process. Prints the median and p90 per item of each, their ratio, and how many items each passed
(both should pass every reference solution). Not a test.

    .venv/bin/python bench/bench_sandbox.py --items 40
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lockstep.evaluate import sandbox
from lockstep.evaluate.chat import code_context, code_items, code_program, code_tests

ROOT = Path(__file__).resolve().parents[1]


def load_baseline(rev: str):
    """The sandbox module as it was at `rev`, imported under its own name."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:lib/lockstep/evaluate/sandbox.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="bench-sandbox-")) / f"sandbox_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"sandbox_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=40, help="code items timed (from evalsets/chat/code_own.jsonl)")
    p.add_argument("--baseline-rev", default="37d4ad1", help="git revision whose sandbox.py is the baseline")
    args = p.parse_args()
    records = [json.loads(line) for line in (ROOT / "evalsets" / "chat" / "code_own.jsonl").open()][: args.items]
    solutions = {r["task_id"]: r["canonical_solution"] for r in records}
    items = code_items(records)
    baseline = load_baseline(args.baseline_rev)
    sides = {"current": sandbox, f"baseline {args.baseline_rev}": baseline}
    print(f"containment now: {sandbox.os_containment()}")
    times: dict[str, list[float]] = {name: [] for name in sides}
    passed = dict.fromkeys(sides, 0)
    for i, item in enumerate(items):
        order = list(sides.items()) if i % 2 == 0 else list(sides.items())[::-1]
        for name, module in order:
            limits = module.SandboxLimits(timeout_s=10.0)
            t0 = time.perf_counter()
            run = module.run_tests(
                code_program(item, solutions[item.task_id]),
                code_tests(item),
                entry_point=item.entry_point,
                setup=code_context(item),
                limits=limits,
            )
            times[name].append(time.perf_counter() - t0)
            passed[name] += int(run.passed)
    print(f"{len(items)} items, python {sys.version.split()[0]}")
    for name, ts in times.items():
        p90 = statistics.quantiles(ts, n=10)[-1] if len(ts) > 1 else ts[0]
        print(f"  {name:>20}: median {statistics.median(ts) * 1e3:7.1f} ms | p90 {p90 * 1e3:7.1f} ms | "
              f"passed {passed[name]}/{len(items)}")
    current, base = (statistics.median(times[name]) for name in sides)
    print(f"ratio current/baseline (median per item): {current / base:.2f}x (target: <= 2x)")


if __name__ == "__main__":
    main()
