"""The GPU check: bench/bench_gpu.py's phases run as one job that fits one device call, compiles
included. Not a test; bench/gpu_check.sh is its entry point (docs/performance.md says how to run it).

Compiling is most of a cold check's time (40-100 s per model graph at d12/d20, on a few CPU
cores each), so the check runs in three parts:

1. `env` alone: the device, its memory, the measured matmul rate.
2. Warm runs (`bench_gpu.py PHASE --warm`) of every phase that compiles, side by side in waves
   whose estimated peak memory fits the device (WARM_PARALLEL at a time at most): each compiles
   its graphs and fills torch.compile's on-disk caches (inductor's FX graph cache, AOT
   autograd's cache, Triton's kernels; all in COMPILE_CACHE) and prints a WARM line. A warm run
   that fails or outlives WARM_S costs nothing but its time: the timed run compiles what is missing.
3. Timed runs, one at a time and alone on the device: the same phase, now reading the compile
   caches, prints its RESULT. Every phase has its own time limit, and none starts once TOTAL_S
   seconds have passed since the start (it is logged as skipped, with the reason).

After every timed phase $OUT/results.jsonl (the RESULT lines so far) and $OUT/compare.txt
(`bench_gpu.py compare`: ratios, checks, recompiles, fast paths that fell back) are rewritten, so
a run cut short still leaves what finished. $OUT/log.txt holds everything, $OUT/schedule.json
what ran when.

Settings (environment): OUT (bench/out/gpu), PY (this Python), NANOCHAT_ROOT (a nanochat checkout
at 92d63d4; unset: its phases are skipped), D R STEPS (12 32 10), D20 R20 STEPS20 (20 16 8), SEQ
(0 = 2048 on CUDA, 128 on CPU), VOCAB (65536), COMPILE (on), NEW_TOKENS (200), REPS (2),
DECODE_SEQ (2048), CHECK_TOKENS (32), SHARD_ROWS (4), SMOKE (a smoke workspace; unset: no
stages), STAGE_KERNELS (on), TOTAL_S (480), WARM (on; off: no warm runs), WARM_S (240),
WARM_PARALLEL (a quarter of the CPUs, at least 2), COMPILE_CACHE ($TMPDIR/lockstep-compile-cache).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "bench_gpu.py"

# Peak device memory (GB) of each phase at the check's default shapes, and the tokens per step it
# was taken at (None: the phase's memory does not follow the training shape): measured on an H100
# on 2026-11-26 (lockstep's reference path and nanochat), the plan's memory model elsewhere
# (docs/budgets.md), or a generous guess for the small phases. Only the warm waves read them, to
# keep concurrent compiles inside the device's memory; a wrong figure costs a warm run, never a
# result.
MEMORY_GB: dict[str, tuple[float, int | None]] = {
    "ls_train d12 off": (45.2, 32 * 2048), "ls_train d12 on": (29.5, 32 * 2048), "nc_train d12": (35.2, 32 * 2048),
    "ls_train d20 off": (50.5, 16 * 2048), "ls_train d20 on": (36.0, 16 * 2048), "nc_train d20": (46.7, 16 * 2048),
    "ls_head": (30.0, 32 * 2048), "ls_shard": (8.0, None), "ls_decode_check": (4.0, None), "ls_decode": (6.0, None),
    "nc_decode": (4.0, None), "stages": (10.0, None)}


def memory_gb(name: str, step_tokens: int) -> float:
    """MEMORY_GB's estimate for phase `name` at `step_tokens` tokens per step (rehearsals run other
    shapes: the estimate scales with them)."""
    gb, at = MEMORY_GB[name]
    return gb if at is None else gb * step_tokens / at


# The share of the device's memory that warm runs may fill together.
WARM_MEMORY_SHARE = 0.85


@dataclass
class Phase:
    """One bench_gpu.py phase of the check."""

    name: str  # label in the log and the schedule, e.g. "ls_train d12 on"
    args: list[str]  # bench_gpu.py's arguments
    limit_s: int  # the timed run's time limit
    memory_gb: float  # estimated peak device memory (the warm waves' packing)
    compiles: bool  # has graphs to compile, so a warm run is worth it
    needs_nanochat: bool = False


@dataclass
class Settings:
    out: Path
    py: str
    nanochat: str
    depth: int
    rows: int
    steps: int
    depth20: int
    rows20: int
    steps20: int
    seq: int
    vocab: int
    compile: str
    new_tokens: int
    reps: int
    decode_seq: int
    check_tokens: int
    shard_rows: int
    smoke: str
    stage_kernels: str
    total_s: int
    warm: bool
    warm_s: int
    warm_parallel: int
    compile_cache: Path

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Settings:
        def num(key: str, default: int) -> int:
            raw = env.get(key, "")
            try:
                return int(raw) if raw else default
            except ValueError:
                raise SystemExit(f"error: {key}={raw!r} must be an integer (default {default})") from None

        def switch(key: str, default: str) -> str:
            value = env.get(key, default) or default
            if value not in ("on", "off"):
                raise SystemExit(f"error: {key}={value!r} must be on or off")
            return value

        cache = env.get("COMPILE_CACHE") or str(Path(tempfile.gettempdir()) / "lockstep-compile-cache")
        return cls(out=Path(env.get("OUT") or ROOT / "bench" / "out" / "gpu"), py=env.get("PY") or sys.executable,
                   nanochat=env.get("NANOCHAT_ROOT", ""), depth=num("D", 12), rows=num("R", 32), steps=num("STEPS", 10),
                   depth20=num("D20", 20), rows20=num("R20", 16), steps20=num("STEPS20", 8), seq=num("SEQ", 0),
                   vocab=num("VOCAB", 65536), compile=switch("COMPILE", "on"), new_tokens=num("NEW_TOKENS", 200),
                   reps=num("REPS", 2), decode_seq=num("DECODE_SEQ", 2048), check_tokens=num("CHECK_TOKENS", 32),
                   shard_rows=num("SHARD_ROWS", 4), smoke=env.get("SMOKE", ""),
                   stage_kernels=switch("STAGE_KERNELS", "on"), total_s=num("TOTAL_S", 480),
                   warm=switch("WARM", "on") == "on", warm_s=num("WARM_S", 240),
                   warm_parallel=num("WARM_PARALLEL", max(2, (os.cpu_count() or 1) // 4)), compile_cache=Path(cache))


def phases(s: Settings) -> list[Phase]:
    """The check's phases, in the order they are timed: the equality checks first (cheap, and what
    a first run on a new device must establish), then d12 training, decoding, the head loss, d20."""
    common = ["--seq", str(s.seq), "--vocab", str(s.vocab), "--compile", s.compile]
    decode = [
        "--depth",
        str(s.depth),
        "--vocab",
        str(s.vocab),
        "--decode-seq",
        str(s.decode_seq),
        "--compile",
        s.compile,
    ]
    seq = s.seq or 2048  # the memory estimates are for CUDA's default sequence

    def phase(name: str, args: list[str], limit_s: int, step_tokens: int = 0, *, compiles: bool = True,
              needs_nanochat: bool = False) -> Phase:
        return Phase(name, args, limit_s, memory_gb(name, step_tokens), compiles, needs_nanochat)

    out = [phase("ls_decode_check", ["ls_decode_check", *decode, "--check-tokens", str(s.check_tokens)], 120),
           phase("ls_shard", ["ls_shard", "--depth", str(s.depth), "--rows", str(s.shard_rows), "--steps", "3",
                              "--kernels", "on", *common], 90)]
    for depth, rows, steps, label in ((s.depth, s.rows, s.steps, "d12"), (s.depth20, s.rows20, s.steps20, "d20")):
        train = ["--depth", str(depth), "--rows", str(rows), "--steps", str(steps), *common]
        out += [phase(f"ls_train {label} off", ["ls_train", *train, "--kernels", "off"], 120, rows * seq),
                phase(f"ls_train {label} on", ["ls_train", *train, "--kernels", "on"], 120, rows * seq),
                phase(f"nc_train {label}", ["nc_train", *train], 120, rows * seq, needs_nanochat=True)]
        if label == "d12":
            rates = [*decode, "--new-tokens", str(s.new_tokens), "--reps", str(s.reps)]
            out += [phase("ls_decode", ["ls_decode", *rates], 120),
                    phase("nc_decode", ["nc_decode", *rates], 60, compiles=False, needs_nanochat=True),
                    phase("ls_head", ["ls_head", "--depth", str(depth), "--rows", str(rows), "--reps", "3", *common],
                          90, rows * seq)]
    if s.smoke:
        out.append(phase("stages", ["stages", "--smoke", s.smoke, "--kernels", s.stage_kernels,
                                    "--stage-timeout-s", "100"], 420, compiles=False))
    return out


def skipped(all_phases: list[Phase], s: Settings) -> tuple[list[Phase], list[str]]:
    """The phases that run here, and one line for each thing left out and why."""
    run, why = [], []
    for p in all_phases:
        if p.needs_nanochat and not s.nanochat:
            why.append(f"{p.name}: NANOCHAT_ROOT is not set (the nanochat baseline)")
        else:
            run.append(p)
    if not s.smoke:
        why.append("stages: SMOKE is not set (a smoke workspace, docs/performance.md)")
    if s.compile == "off":
        why.append("warm runs and the compiled decode engine: COMPILE=off compiles nothing")
    elif not s.warm:
        why.append("warm runs: WARM=off (every timed run compiles cold)")
    return run, why


def next_warm(pending: list[Phase], running: list[Phase], capacity_gb: float | None, parallel: int) -> Phase | None:
    """The warm run to start now beside `running`, or None: while fewer than `parallel` run, the
    first of `pending` (kept largest estimated memory first) whose memory fits beside theirs
    within `capacity_gb` (None: unbounded); a phase larger than the capacity starts only alone."""
    if len(running) >= parallel:
        return None
    used = sum(p.memory_gb for p in running)
    return next((p for p in pending if not running or capacity_gb is None or used + p.memory_gb <= capacity_gb), None)


@dataclass
class Run:
    """One child process of the check, for the schedule."""

    phase: str
    kind: str  # "warm" or "timed"
    start_s: float
    limit_s: int
    seconds: float = 0.0
    rc: int | str | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Check:
    """The check's run: its log, its children, its results."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        self.start = time.monotonic()
        s.out.mkdir(parents=True, exist_ok=True)
        self.log_path = s.out / "log.txt"
        self.log_path.write_text("", encoding="utf-8")
        for name in ("results.jsonl", "compare.txt", "schedule.json"):
            (s.out / name).unlink(missing_ok=True)
        self.runs: list[Run] = []
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "lib"), str(ROOT),
                                                                                os.environ.get("PYTHONPATH", "")])),
                    "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(s.compile_cache / "inductor"),
                    "TRITON_CACHE_DIR": str(s.compile_cache / "triton")}
        if s.nanochat:
            self.env["NANOCHAT_ROOT"] = s.nanochat

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def say(self, line: str) -> None:
        with self.log_path.open("a", encoding="utf-8") as f:
            f.write(f"== {self.elapsed():6.0f}s {line}\n")
        print(line, flush=True)

    def _start(self, p: Phase, kind: str, limit: int) -> tuple[subprocess.Popen, Run, Path]:
        out = self.s.out / "phases" / f"{p.name.replace(' ', '_')}.{kind}.txt"
        out.parent.mkdir(exist_ok=True)
        args = [*p.args, "--warm"] if kind == "warm" else p.args
        self.say(f"start {kind} {p.name} [limit {limit}s]: bench_gpu.py {' '.join(args)}")
        with out.open("w", encoding="utf-8") as f:
            proc = subprocess.Popen([self.s.py, str(BENCH), *args], cwd=ROOT, env=self.env, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        run = Run(p.name, kind, round(self.elapsed(), 1), limit)
        self.runs.append(run)
        return proc, run, out

    def _finish(self, proc: subprocess.Popen, run: Run, out: Path, deadline: float) -> None:
        """Wait for `proc` until `deadline` (time.monotonic), killing it there, and log what it printed."""
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        self._reap(proc, run, out)

    def _reap(self, proc: subprocess.Popen, run: Run, out: Path) -> None:
        rc: int | str | None = proc.poll()
        if rc is None:
            os.killpg(proc.pid, 9)  # the phase and anything it started (inductor's compile workers)
            proc.wait()
            rc = "time limit"
        run.rc, run.seconds = rc, round(self.elapsed() - run.start_s, 1)
        text = out.read_text(encoding="utf-8", errors="replace")
        with self.log_path.open("a", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") or not text else text + "\n")
        for line in text.splitlines():
            if line.startswith("WARM "):
                run.info = json.loads(line[len("WARM "):])
        self.say(f"end {run.kind} {run.phase}: rc {rc}, {run.seconds} s")

    def warm(self, todo: list[Phase], capacity_gb: float | None) -> None:
        """The warm runs, side by side: a run starts whenever one ends and the next fits
        (next_warm); at WARM_S (or TOTAL_S) the ones still running are stopped."""
        self.say(f"warm runs: {len(todo)} phases, at most {self.s.warm_parallel} at once, estimated memory within "
                 f"{'any' if capacity_gb is None else f'{capacity_gb:.0f} GB'}")
        stop = self.start + min(self.s.warm_s, self.s.total_s)
        pending = sorted(todo, key=lambda p: -p.memory_gb)
        running: list[tuple[Phase, subprocess.Popen, Run, Path]] = []
        while pending or running:
            now = time.monotonic()
            while now < stop - 15 and (p := next_warm(pending, [r[0] for r in running], capacity_gb,
                                                      self.s.warm_parallel)):
                pending.remove(p)
                running.append((p, *self._start(p, "warm", int(stop - now))))
            for item in [r for r in running if r[1].poll() is not None or now >= stop]:
                running.remove(item)
                self._reap(*item[1:])
            if now >= stop - 15 and pending:
                self.say(f"warm runs stop: WARM_S={self.s.warm_s} spent; not warmed: "
                         f"{', '.join(p.name for p in pending)}")
                pending = []
            time.sleep(0.5)

    def timed(self, p: Phase) -> None:
        left = self.start + self.s.total_s - time.monotonic()
        if left < 15:
            self.say(f"skipped {p.name}: TOTAL_S={self.s.total_s} spent")
            self.runs.append(Run(p.name, "timed", round(self.elapsed(), 1), 0, rc="skipped: TOTAL_S spent"))
            return
        limit = int(min(p.limit_s, left))
        proc, run, out = self._start(p, "timed", limit)
        self._finish(proc, run, out, time.monotonic() + limit)
        self.collect()

    def results(self) -> list[str]:
        return [line[len("RESULT "):] for line in self.log_path.read_text(encoding="utf-8").splitlines()
                if line.startswith("RESULT ")]

    def collect(self) -> None:
        """results.jsonl, compare.txt and schedule.json from what has finished, each replaced whole."""
        out = self.s.out
        (out / "results.jsonl.tmp").write_text("".join(r + "\n" for r in self.results()), encoding="utf-8")
        os.replace(out / "results.jsonl.tmp", out / "results.jsonl")
        cmp = subprocess.run([self.s.py, str(BENCH), "compare", str(out / "results.jsonl")], cwd=ROOT, env=self.env,
                             capture_output=True, text=True, check=False)
        (out / "compare.txt.tmp").write_text(cmp.stdout + cmp.stderr, encoding="utf-8")
        os.replace(out / "compare.txt.tmp", out / "compare.txt")
        schedule = {"elapsed_s": round(self.elapsed(), 1), "total_s": self.s.total_s,
                    "runs": [asdict(r) for r in self.runs]}
        (out / "schedule.json").write_text(json.dumps(schedule, indent=1) + "\n", encoding="utf-8")


def device_memory_gb(check: Check) -> float | None:
    """The device's memory from the env phase's RESULT (None on a CPU: no packing by memory)."""
    env = next((json.loads(r) for r in reversed(check.results()) if '"phase": "env"' in r), None)
    return None if env is None else env.get("device_memory_gb")


def git_line() -> str:
    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return r.stdout.strip() if r.returncode == 0 else "?"

    dirty = " (uncommitted changes)" if git("status", "--porcelain") not in ("", "?") else ""
    return f"lockstep {git('rev-parse', '--short', 'HEAD')}{dirty}"


def main() -> int:
    s = Settings.from_env(dict(os.environ))
    check = Check(s)
    check.say(f"{git_line()}; nanochat: {s.nanochat or 'not set'}; compile caches in {s.compile_cache}")
    run_these, left_out = skipped(phases(s), s)
    for line in left_out:
        check.say(f"skipped {line}")
    check.timed(Phase("env", ["env"], 60, 0.0, False))
    memory = device_memory_gb(check)
    if s.warm and s.compile == "on":
        check.warm([p for p in run_these if p.compiles], None if memory is None else memory * WARM_MEMORY_SHARE)
    for p in run_these:
        check.timed(p)
    check.collect()
    check.say(f"done in {check.elapsed():.0f} s (TOTAL_S {s.total_s})")
    for line in left_out:
        check.say(f"not run: {line}")
    print((s.out / "compare.txt").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
