"""bench/gpu_check.py, the GPU check's scheduler, without running any phase: its settings refuse
bad values, it says what it leaves out and why, and its warm waves keep concurrent compiles within
the device's memory and the parallel limit."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_defaults_are_the_check_on_one_gpu(check) -> None:
    s = check.Settings.from_env({})
    assert (s.depth, s.rows, s.depth20, s.rows20, s.vocab, s.total_s, s.compile, s.warm) == \
           (12, 32, 20, 16, 65536, 480, "on", True)
    names = [p.name for p in check.phases(s)]
    assert names[:2] == ["ls_decode_check", "ls_shard"]  # the equality checks first
    assert {"ls_train d12 off", "ls_train d12 on", "nc_train d12", "ls_train d20 off", "ls_train d20 on",
            "nc_train d20", "ls_decode", "nc_decode", "ls_head"} <= set(names)
    by = {p.name: p for p in check.phases(s)}
    assert by["ls_train d12 off"].memory_gb == 45.2 and by["ls_train d20 off"].memory_gb == 50.5
    with pytest.raises(SystemExit, match="COMPILE='maybe' must be on or off"):
        check.Settings.from_env({"COMPILE": "maybe"})
    with pytest.raises(SystemExit, match="TOTAL_S='8m' must be an integer"):
        check.Settings.from_env({"TOTAL_S": "8m"})


def test_it_says_what_it_leaves_out_and_why(check) -> None:
    s = check.Settings.from_env({"COMPILE": "off"})
    run, why = check.skipped(check.phases(s), s)
    assert not any(p.needs_nanochat for p in run)
    assert "nc_train d12: NANOCHAT_ROOT is not set (the nanochat baseline)" in why
    assert any(w.startswith("stages: SMOKE is not set") for w in why)
    assert any("COMPILE=off compiles nothing" in w for w in why)
    s = check.Settings.from_env({"NANOCHAT_ROOT": "/x", "SMOKE": "/y", "WARM": "off"})
    run, why = check.skipped(check.phases(s), s)
    assert [p.name for p in run][-1] == "stages" and why == ["warm runs: WARM=off (every timed run compiles cold)"]


def _schedule(check, todo, capacity, parallel) -> list[list[str]]:
    """What runs side by side when every warm run takes as long: next_warm until nothing fits,
    then all end together."""
    pending, waves = sorted(todo, key=lambda p: -p.memory_gb), []
    while pending:
        running = []
        while (p := check.next_warm(pending, running, capacity, parallel)) is not None:
            pending.remove(p)
            running.append(p)
        assert running, "nothing could start"
        waves.append(running)
    return waves


def test_warm_runs_fit_the_memory_and_the_parallel_limit(check) -> None:
    s = check.Settings.from_env({"NANOCHAT_ROOT": "/x"})
    todo = [p for p in check.phases(s) if p.compiles]
    for capacity, parallel in ((0.85 * 141, 4), (0.85 * 80, 4), (0.85 * 80, 2)):
        waves = _schedule(check, todo, capacity, parallel)
        assert sorted(p.name for w in waves for p in w) == sorted(p.name for p in todo)  # each phase once
        assert all(len(w) <= parallel for w in waves)
        assert all(sum(p.memory_gb for p in w) <= capacity for w in waves)
    assert len(_schedule(check, todo, 0.85 * 141, 4)) < len(_schedule(check, todo, 0.85 * 80, 4))  # H200 < H100
    big = check.Phase("big", [], 60, 500.0, True)  # larger than the device: it starts alone
    assert check.next_warm([big], [], 100.0, 4) is big and check.next_warm([big], [todo[0]], 100.0, 4) is None
    assert check.next_warm(todo, todo[:2], None, 2) is None  # on a CPU only the parallel limit
    assert check.next_warm(todo[1:], todo[:1], None, 2) is todo[1]
