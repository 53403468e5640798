"""Progress lines (lockstep.core.progress): logged by wall time, not by count; fixed fields; the ETA of a
resumed run counts only the work done since it started."""

from __future__ import annotations

import logging

from lockstep.core.progress import Countdown, Progress


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


def test_countdown_is_never_silent_for_long_and_its_eta_follows_recent_items():
    clock, lines = Clock(), []
    c = Countdown("held-out eval", 10, lines.append, units="problems", interval_s=10.0, recent=2, clock=clock)
    for dt in (1, 1, 1):  # quick items within one interval: no line
        clock.t += dt
        c.tick()
    assert lines == []
    for dt in (30, 30):  # the machine got busy: each slow item gives a line, the ETA follows it
        clock.t += dt
        c.tick()
    assert lines == ["held-out eval: 4/10 problems | elapsed 33s | eta 1m33s",  # (1 + 30) / 2 s x 6 left
                     "held-out eval: 5/10 problems | elapsed 1m03s | eta 2m30s"]  # 30 s x 5 left
    for _ in range(5):
        clock.t += 30
        c.tick()
    assert len(lines) == 6 and c.done == 10  # no line for the last item: the caller reports the result


def test_rl_evaluation_and_rollouts_report_progress(tok, monkeypatch, caplog):
    """RL's held-out evaluation and its rollouts (minutes on a busy CPU) log countdown lines, one
    per batch of problems decoded together."""
    import torch

    from _tiny_model import randomize, tiny_gpt
    from lockstep.core import progress
    from lockstep.core.config import build_config
    from lockstep.infer.engine import Engine
    from lockstep.rl.config import RLConfig
    from lockstep.rl.trainer import RLTrainer, pass_at_k

    model = randomize(tiny_gpt(seed=5, n_layer=2), seed=6).eval()
    problems = [{"question": f"{i}+1?", "answer": f"#### {i + 1}"} for i in range(3)]
    real = progress.Countdown.__init__

    def every_item(self, *a, **kw):
        real(self, *a, **{**kw, "interval_s": 0.0})
    monkeypatch.setattr(progress.Countdown, "__init__", every_item)
    # 3 rows a batch: one problem's greedy and 2 samples
    cfg = build_config(RLConfig, {"group_size": 2, "problems_per_step": 3, "max_new_tokens": 4, "generate_batch": 2},
                       where="rl")
    with caplog.at_level(logging.INFO, logger="lockstep.rl"):
        pass_at_k(Engine(model, tok), tok, problems, k=2, temperature=1.0, max_new_tokens=4, seed=1, batch_rows=3)
        RLTrainer(model, tok, cfg, train_problems=problems, val_problems=problems, device=torch.device("cpu"),
                  seed=0).rollout(problems, seed=7)
    assert [line.split(" | ")[0] for line in caplog.messages] == [
        "held-out eval: 1/3 problems",
        "held-out eval: 2/3 problems",
        "rollouts: 1/3 problems",
        "rollouts: 2/3 problems",
    ]
