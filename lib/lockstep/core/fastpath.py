"""Fast paths that fall back instead of ending a run. Each optional fast path of lockstep (PARTS:
the Trainer's compiled loss, the chunked head loss's compiled chunk bodies, Muon's compiled update,
the compiled decode step, the decode step's CUDA graph, the CPU decode step) runs through
`call(part, fast, reference)`. The first time a part's fast path raises (a compile that fails, a
capture that cannot be made, a first step that errors), one warning names the part and the reason,
that call is answered by the reference path, and so is every later call of the part in this
process. `facts()` says, for a
stage's run facts, which path each part ran, how many graphs it compiled and how long those calls
took, and whether the run's results are still those of one path.

Process-wide on purpose: a part fails for a reason of this process (its torch build, its device,
its compiler), and every caller of the part must then agree on the path. Knows nothing of models,
training or decoding: the callers decide what their fast and reference paths are, and must make a
failed fast call leave no effect behind (a compile raises before anything runs; a caller whose
fast path may fail midway restores what it changed before the reference runs)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

# Every part, and what its fast and reference paths are, for the warning and the docs.
PARTS: dict[str, tuple[str, str]] = {
    "compiled_loss": ("the Trainer's torch.compile of the model and loss (runtime.compile)", "the eager model"),
    "chunk_bodies": ("the chunked head loss's compiled chunk bodies", "the same chunks run eagerly"),
    "muon_compiled": ("Muon's compiled update", "Muon's eager update"),
    "decode_compiled": ("the static-cache decode step through torch.compile", "the same step run eagerly"),
    "cuda_graphs": ("the static-cache decode step replayed from a CUDA graph", "the step launched op by op"),
    "cpu_decode_step": ("the CPU decode step of lockstep.infer.cpu_step", "the model's own forward"),
}
# The first line of a failure's message kept in the warning and the run facts.
REASON_CHARS = 300


@dataclass
class PartRecord:
    """What one part did in this process."""

    path: str = "fast"  # "fast", or "reference" once it fell back
    fast_calls: int = 0  # calls answered by the fast path
    reference_calls: int = 0  # calls answered by the reference path after the fallback
    compiles: int = 0  # graphs torch.compile made during the part's own calls (nested parts' not counted)
    compile_s: float = 0.0  # wall time of the calls that compiled (the compile and that call's run)
    reason: str = ""  # why it fell back
    mixed: bool = False  # fast results were used before the fallback: the run matches neither path's exactly


_lock = threading.Lock()
_records: dict[str, PartRecord] = {}
_nested = threading.local()  # per thread: graphs and seconds of compiling calls inside the current call


def _record(part: str) -> PartRecord:
    if part not in PARTS:
        raise ValueError(f"unknown fast path {part!r}; the parts are {', '.join(PARTS)}")
    with _lock:
        return _records.setdefault(part, PartRecord())


def enabled(part: str) -> bool:
    """Whether `part` still takes its fast path in this process."""
    return _record(part).path == "fast"


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (0 before torch._dynamo is imported): what
    `call` counts towards a part, and what lockstep.tools.plan's calibration reads to tell the steps
    that compiled from the ones it times."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def _reason(error: BaseException) -> str:
    """`Type: first line of the message`, and the same of the error underneath when there is one:
    torch.compile wraps a compiler's error in BackendCompilerFailed, whose own first line only says
    which backend raised."""
    parts = []
    seen: BaseException | None = error
    while seen is not None and len(parts) < 3:
        lines = [line for line in str(seen).strip().splitlines() if line.strip()]
        parts.append(f"{type(seen).__name__}: {lines[0] if lines else ''}".rstrip(": "))
        seen = getattr(seen, "inner_exception", None) or seen.__cause__
    return " <- ".join(parts)[:REASON_CHARS]


def fall_back(part: str, error: BaseException | str) -> None:
    """Send every later call of `part` to its reference path, with one warning naming the part and
    the reason (`error`, or a sentence); a part that already fell back is left as it is."""
    rec = _record(part)
    with _lock:
        if rec.path != "fast":
            return
        rec.path = "reference"
        rec.reason = error if isinstance(error, str) else _reason(error)
        rec.mixed = rec.fast_calls > 0
    fast, reference = PARTS[part]
    if rec.mixed:
        results = (f"it had answered {rec.fast_calls} call(s) already, so this run's results mix both paths and "
                   "equal neither a fast nor a reference run exactly")
    else:
        results = "nothing it computed was used, so the results are the reference path's"
    log.warning("fast path %s (%s) failed: %s. Running %s instead for the rest of this process; %s. The run facts "
                "record it (fast_paths); set runtime.kernels: false (or runtime.compile: off) to take the reference "
                "paths from the start", part, fast, rec.reason, reference, results)


def call(part: str, fast: Callable[[], T], reference: Callable[[], T]) -> T:
    """`fast()` while `part` is on its fast path, else `reference()`. When `fast()` raises, the part
    falls back (`fall_back`) and `reference()` answers this call too, so the caller gets a result
    either way; an error of the reference path itself propagates. Graphs compiled during `fast()`
    count towards the part (minus those of parts called inside it)."""
    rec = _record(part)
    if rec.path != "fast":
        rec.reference_calls += 1
        return reference()
    outer = getattr(_nested, "acc", None)
    _nested.acc = [0, 0.0]  # graphs and compile seconds of parts called inside this one
    before, t0 = graphs_compiled(), time.perf_counter()
    try:
        out = fast()
    except Exception as e:  # noqa: BLE001 - any failure of a fast path is answered by its reference
        fall_back(part, e)
        out = None
        failed = True
    else:
        failed = False
    finally:
        inner_graphs, inner_s = _nested.acc
        _nested.acc = outer
    graphs = graphs_compiled() - before
    seconds = time.perf_counter() - t0 if graphs else 0.0
    with _lock:
        if graphs - inner_graphs > 0:
            rec.compiles += graphs - inner_graphs
            rec.compile_s += max(0.0, seconds - inner_s)
        if not failed:
            rec.fast_calls += 1
    if outer is not None:
        outer[0] += graphs
        outer[1] += seconds
    if failed:
        rec.reference_calls += 1
        return reference()
    return out  # type: ignore[return-value]


def facts() -> dict[str, dict[str, Any]]:
    """For the run facts: per part used in this process, the path it ended on, its calls, the graphs
    it compiled and the seconds of those calls, and after a fallback the reason and whether the
    results are the reference path's (`results`: "reference") or a mix of both ("mixed")."""
    with _lock:
        out = {}
        for part, r in sorted(_records.items()):
            if not (r.fast_calls or r.reference_calls or r.path != "fast"):
                continue
            entry: dict[str, Any] = {"path": r.path, "fast_calls": r.fast_calls, "reference_calls": r.reference_calls,
                                     "compiles": r.compiles, "compile_s": round(r.compile_s, 3)}
            if r.path != "fast":
                entry["fell_back"] = r.reason
                entry["results"] = "mixed" if r.mixed else "reference"
            out[part] = entry
        return out


def paths_summary() -> str:
    """The path each part used here took, as one comparable string (`part=path` in part order;
    `fast>reference` for a part that fell back after its fast path had answered): what lockstep
    parity compares between two runs. Empty when no part ran."""
    return ", ".join(f"{part}={'fast>reference' if f.get('results') == 'mixed' else f['path']}"
                     for part, f in facts().items())


def reset() -> None:
    """Forget every part's record (tests; a process that starts a new run)."""
    with _lock:
        _records.clear()
