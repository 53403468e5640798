"""Progress lines (lockstep.progress): logged by wall time, not by count; fixed fields; the ETA of a
resumed run counts only the work done since it started."""

from __future__ import annotations

import logging

from lockstep.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_lines_follow_the_clock_not_the_count(caplog):
    clock = Clock()
    p = Progress("fetch x", logging.getLogger("t.progress"), budget=1000, interval_s=5.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="t.progress"):
        for _ in range(10_000):  # many items within one interval: no line
            p.update(items=1, text_bytes=10, done=0)
        assert caplog.records == []
        clock.t += 5.0
        p.update(items=1, text_bytes=10, done=250, tokens=40)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("fetch x: 10.0k docs | 2.0k docs/s | 0.1 MB | 0.0 MB/s | 40 tokens | 8 tokens/s | "
                    "250/1.0k chars (25.0%) | elapsed 5s | eta 15s")


def test_resumed_eta_uses_only_new_work():
    clock = Clock()
    p = Progress("fetch x", logging.getLogger("t.progress"), budget=1000, already_done=500, clock=clock)
    clock.t += 60.0
    p.update(items=1, done=100)  # 100 in 60 s: 400 left take 240 s
    line = p.line()
    assert "600/1.0k chars (60.0%)" in line and "elapsed 1m00s" in line and line.endswith("eta 4m00s")
    fresh = Progress("y", logging.getLogger("t.progress"), budget=None, clock=clock)
    assert "eta" not in fresh.line() and "%" not in fresh.line()
