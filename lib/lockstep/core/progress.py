"""Progress lines for long data work (fetching a source, building a cache): one `logging` line with
fixed fields every few seconds of wall time, whatever the size of the items. Counts and times
only; knows nothing of what is being counted."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


def format_duration(seconds: float) -> str:
    """12s, 3m05s, 1h02m: a duration for a progress line."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _count(n: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.1f}{suffix}"
    return f"{n:.0f}"


class Progress:
    """Rate-limited progress of one piece of work: `update` is cheap enough to call per document,
    and a line goes to `log` at most every `interval_s` seconds. Each line has the items done and
    their rate, MB of text and MB/s, optional extra counters with rates (e.g. tokens), elapsed
    time, and, when `budget` is known, how far `done` has come towards it and the ETA at the rate
    so far (`budget_unit` names what `done` counts: chars, tokens, bytes). `already_done` is work
    a resumed run finds done: it counts towards the budget but not towards the rate."""

    def __init__(
        self,
        what: str,
        log: logging.Logger,
        *,
        items: str = "docs",
        budget: int | None = None,
        budget_unit: str = "chars",
        already_done: int = 0,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.log, self.items_name = what, log, items
        self.budget, self.budget_unit, self.interval_s = budget, budget_unit, interval_s
        self.clock = clock
        self.start = self.last = clock()
        self.items = 0
        self.text_bytes = 0
        self.already_done = already_done
        self.done = already_done
        self.extra: dict[str, int] = {}
        self.lines = 0

    def update(self, items: int = 0, text_bytes: int = 0, done: int = 0, **extra: int) -> None:
        """Add to the counters; log a line when `interval_s` has passed since the last one."""
        self.items += items
        self.text_bytes += text_bytes
        self.done += done
        for k, v in extra.items():
            self.extra[k] = self.extra.get(k, 0) + v
        now = self.clock()
        if now - self.last >= self.interval_s:
            self.last = now
            self.log.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        """The progress line as of `now` (the clock's time by default)."""
        elapsed = max((self.clock() if now is None else now) - self.start, 1e-9)
        mb = self.text_bytes / 1e6
        fields = [
            f"{self.what}: {_count(self.items)} {self.items_name}",
            f"{_count(self.items / elapsed)} {self.items_name}/s",
            f"{mb:.1f} MB",
            f"{mb / elapsed:.1f} MB/s",
        ]
        fields += [f"{_count(v)} {k} | {_count(v / elapsed)} {k}/s" for k, v in self.extra.items()]
        if self.budget:
            frac = min(self.done / self.budget, 1.0)
            fields.append(f"{_count(self.done)}/{_count(self.budget)} {self.budget_unit} ({100 * frac:.1f}%)")
        fields.append(f"elapsed {format_duration(elapsed)}")
        if self.budget and self.done > self.already_done:
            remaining_s = max(self.budget - self.done, 0) * elapsed / (self.done - self.already_done)
            fields.append(f"eta {format_duration(remaining_s)}")
        self.lines += 1
        return " | ".join(fields)

    def finish(self) -> None:
        """Log the final line (totals and mean rates) whatever the interval."""
        self.log.info("%s", self.line())


class Countdown:
    """Progress of a known number of equal-ish items (held-out problems, rollout groups): `tick`
    after each one, and a line "what: done/total units | elapsed | eta" goes to `log` at most every
    `interval_s` seconds, so work that takes minutes is never silent. The ETA is the mean time of
    the last `recent` items times those left: it follows a machine that got busy or quiet."""

    def __init__(self, what: str, total: int, log: Callable[[str], None], *, units: str = "items",
                 interval_s: float = 10.0, recent: int = 8, clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.total, self.log, self.units = what, total, log, units
        self.interval_s, self.recent, self.clock = interval_s, recent, clock
        self.start = self.last_line = self.last_tick = clock()
        self.durations: list[float] = []

    @property
    def done(self) -> int:
        return len(self.durations)

    def tick(self, n: int = 1) -> None:
        """`n` items done (in one piece: each counts for an equal share of the time since the last
        tick); log a line if `interval_s` has passed since the last one (or the start)."""
        now = self.clock()
        self.durations.extend([(now - self.last_tick) / n] * n)
        self.last_tick = now
        if now - self.last_line >= self.interval_s and self.done < self.total:
            self.last_line = now
            self.log(self.line(now))

    def line(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        recent = self.durations[-self.recent:]
        fields = [f"{self.what}: {self.done}/{self.total} {self.units}", f"elapsed {format_duration(now - self.start)}"]
        if recent:
            fields.append(f"eta {format_duration(sum(recent) / len(recent) * (self.total - self.done))}")
        return " | ".join(fields)
