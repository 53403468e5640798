"""The report card renders from a fixture metrics set; every chart is a valid PNG."""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path

import pytest

from lockstep.core.series import SeriesWriter
from lockstep.pipeline.report import (
    FEW_POINTS,
    MICRO_ITEMS,
    MICRO_RUN,
    QUANTITIES,
    build_report,
    describe_data,
    flatten,
    load_metrics,
    micro_run_line,
    plan_charts,
    read_series,
    render_markdown,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ENV = {"code revision": "abc123", "python": "3.11", "torch": "2.13.0"}


def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"{path}: bad CRC in {kind!r}"
        chunks.append(kind)
        pos += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100


@pytest.fixture()
def run_files(tmp_path: Path) -> tuple[Path, Path]:
    metrics, plots = tmp_path / "metrics", tmp_path / "plots"
    metrics.mkdir()
    for stage, n in (("pretrain", 1), ("midtrain", 2), ("sft", 3), ("rl", 4)):
        (metrics / f"{stage}.json").write_text(
            json.dumps({"train_time_s": 10.0 * n, "tokens": 1000 * n, "final_loss": 3.0 / n})
        )
        (metrics / f"eval_{stage}.json").write_text(json.dumps({
            "core": 0.1 * n, "bpb": {"shakespeare": 2.0 / n}, "device": "cpu", "dtype": "float32",
            "core_source": "own", "core_tasks": 3, "core_items": 761,
            **({"chatcore": 0.05 * n, "gsm8k.accuracy": 0.01 * n} if stage != "pretrain" else {}),
        }))
        d = plots / stage
        d.mkdir(parents=True)
        cols = "step\tloss\tval_bpb\n" if stage != "rl" else "step\treward\tpass@1\n"
        (d / "train.tsv").write_text(cols + "".join(f"{s}\t{3.0 - s / 10}\t{2.5 - s / 20}\n" for s in range(5)))
    (metrics / "tokenizer.json").write_text(json.dumps({"bytes_per_token": {"shakespeare": 3.9}, "vocab_size": 4096}))
    return metrics, plots


def test_series_are_named_by_stage_in_the_layout_the_stages_write(tmp_path: Path) -> None:
    # The stages write with lockstep.core.series: <stage>/train.tsv and <stage>/val.tsv.
    plots = tmp_path / "plots"
    for stage, start in (("pretrain", 8.0), ("midtrain", 3.0), ("sft", 1.0)):
        writer = SeriesWriter(plots / stage, {"train": ("train_loss", "lr_mult"), "val": ("val_bpb",)})
        for s in (1, 2, 3):
            writer.add({"step": s, "train_loss": start - s / 10, "lr_mult": 1.0})
        writer.add({"step": 3, "val_bpb": start / 2})
        writer.write()
    rl = SeriesWriter(plots / "rl", {"train": ("reward",), "val": ("val_pass@1",)})
    rl.add({"step": 1, "reward": 0.5})
    rl.add({"step": 2, "reward": 0.7})
    rl.write()  # no held-out row: val.tsv holds its header only
    (plots / "pretrain" / "first_batch.json").write_text("{}")  # the parity artifact beside the series
    series = read_series(plots)
    assert set(series["train_loss"]) == {"pretrain", "midtrain", "sft"}  # one line per stage
    assert series["train_loss"]["midtrain"] == [(1.0, 2.9), (2.0, 2.8), (3.0, 2.7)]
    assert series["val_bpb"]["sft"] == [(3.0, 0.5)]
    assert series["reward"] == {"rl": [(1.0, 0.5), (2.0, 0.7)]}
    assert "val_pass@1" not in series  # an empty series draws no chart


def test_report_renders_from_fixture(tmp_path: Path, run_files: tuple[Path, Path]) -> None:
    metrics, plots = run_files
    out = build_report(metrics, plots, tmp_path / "report", environment=ENV)
    text = out.read_text()
    assert "| metric | BASE | MID | SFT | RL |" in text
    assert "| CORE-style (own tasks, 761 items) | 0.1000 | 0.2000 | 0.3000 | 0.4000 |" in text
    assert "| chatcore | - | 0.1000 | 0.1500 | 0.2000 |" in text
    assert text.index("| CORE-style (own tasks") < text.index("| bpb.shakespeare |")
    assert "| core |" not in text and "core_tasks" not in text and "core_source" not in text
    assert "| train_time_s | 10.0000 | 20.0000 | 30.0000 | 40.0000 |" in text
    assert "bytes_per_token.shakespeare" in text and "abc123" in text and "eval_sft: dtype" in text
    charts = sorted(p.name for p in (tmp_path / "report").glob("*.png"))
    # One chart per stage and quantity: the fixture's `loss` and `pass@1` are no catalogued series,
    # so each stays in its stage's chart, named by its column.
    assert charts == sorted([f"{s}_{q}.png" for s in ("pretrain", "midtrain", "sft") for q in ("loss", "val_bpb")]
                            + ["rl_reward.png", "rl_pass_1.png"])
    for png in (tmp_path / "report").glob("*.png"):
        _check_png(png)
        assert f"]({png.name})" in text


def test_report_is_reproducible(tmp_path: Path, run_files: tuple[Path, Path]) -> None:
    metrics, plots = run_files
    a = build_report(metrics, plots, tmp_path / "a", environment=ENV).parent
    b = build_report(metrics, plots, tmp_path / "b", environment=ENV).parent
    assert {p.name: p.read_bytes() for p in a.iterdir()} == {p.name: p.read_bytes() for p in b.iterdir()}


def test_missing_metrics_folder_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="dvc repro"):
        load_metrics(tmp_path / "nope")


def test_tsv_without_step_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pretrain").mkdir()
    (tmp_path / "pretrain" / "x.tsv").write_text("loss\n1.0\n")
    with pytest.raises(ValueError, match="step"):
        read_series(tmp_path)


def test_flatten() -> None:
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a.b": 1, "a.c.d": 2, "e": 3}


def test_results_carry_intervals_and_run_facts_stay_apart(tmp_path: Path) -> None:
    metrics, runinfo, preds, plots = (tmp_path / d for d in ("metrics", "runinfo", "eval", "plots"))
    for d in (metrics, runinfo, preds / "sft", plots):
        d.mkdir(parents=True)
    (metrics / "eval_sft.json").write_text(json.dumps({
        "chat.synth_math.accuracy": 0.8, "chat.synth_math.accuracy.n": 10, "bpb.shakespeare": 2.0, "step": 5}))
    (metrics / "rl.json").write_text(json.dumps({"pass@1": 0.715, "pass@1.n": 100, "steps": 20}))
    (runinfo / "eval_sft.json").write_text(json.dumps({"eval_time_s": 12.5, "device": "cpu"}))
    (runinfo / "pretrain.json").write_text(json.dumps({
        "tok_per_s": 5000.0, "git_commit": "feedbeef", "numerics": {"fast_paths": "compiled_loss=reference"},
        "fast_paths": {"compiled_loss": {"path": "reference", "results": "reference", "compiles": 0,
                                         "fell_back": "RuntimeError: no kernel"}}}))
    (runinfo / "sft.json").write_text(json.dumps({"numerics": {"fast_paths": ""}}))  # no fast path ran
    # Three documents whose bits per byte are 1.0, 2.0 and 3.0.
    docs = [{"index": i, "nats": b * (i + 1) * math.log(2), "bytes": b} for i, b in enumerate((100, 100, 100))]
    (preds / "sft" / "bpb_shakespeare.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    text = build_report(metrics, plots, tmp_path / "report", environment=ENV, runinfo_dir=runinfo,
                        predictions_dir=preds).read_text()
    # Wilson for 8 of 10 is (0.490, 0.943); the count is shown, not listed as a metric of its own.
    assert "| chat.synth_math.accuracy | - | - | 0.8000 [0.490, 0.943] n=10 | - |" in text
    assert "accuracy.n" not in text
    # A bootstrap over the three documents: inside the range of their own values.
    row = next(line for line in text.splitlines() if line.startswith("| bpb.shakespeare |"))
    lo, hi = (float(x) for x in row.split("[")[1].split("]")[0].split(","))
    assert 1.0 <= lo < 2.0 < hi <= 3.0 and "n=3" in row
    assert "0.7150 [" in text and "n=100" in text  # rl's pass@1 in its own section
    # Run facts in their own table and the environment, not among the results.
    facts = text[text.index("## Run facts"):]
    assert "| tok_per_s | 5000.0000 |" in facts and "| eval_time_s |" in facts
    assert "tok_per_s" not in text[:text.index("## Run facts")]
    assert "pretrain: git_commit | feedbeef" in text
    # Which path each fast path took, once, and why one fell back; nothing for a stage that used none.
    assert "| pretrain: numerics.fast_paths | compiled_loss=reference |" in text
    assert "| pretrain: fast_paths.compiled_loss.fell_back | RuntimeError: no kernel |" in text
    assert "fast_paths.compiled_loss.path" not in text and "sft: numerics.fast_paths" not in text


def test_header_names_tokenizer_embedding_and_losses(tmp_path: Path) -> None:
    metrics, runinfo, plots = (tmp_path / d for d in ("metrics", "runinfo", "plots"))
    for d in (metrics, runinfo, plots):
        d.mkdir()
    (metrics / "tokenizer.json").write_text(
        json.dumps({"kind": "lz78", "vocab_size": 4096, "bytes_per_token": {"a": 3.0}})
    )
    (runinfo / "pretrain.json").write_text(json.dumps(
        {"setup": {"embedding": "tuple", "objective": "prefix_smooth", "prefix_weight": 0.1}}))
    (runinfo / "sft.json").write_text(json.dumps({"setup": {"embedding": "tuple", "objective": "ce"}}))
    text = build_report(metrics, plots, tmp_path / "r", environment=ENV, runinfo_dir=runinfo).read_text()
    assert text.splitlines()[2] == ("**Tokenizer** lz78 (4096 ids) · **embedding** tuple · "
                                    "**loss** pretrain prefix_smooth w=0.1, sft ce")
    bare = build_report(metrics, plots, tmp_path / "r2", environment=ENV).read_text()
    assert bare.splitlines()[2] == "**Tokenizer** lz78 (4096 ids) · **embedding** - · **loss** -"


def test_the_core_row_says_which_core_it_is() -> None:
    env = {"commit": "abc"}
    def row(**facts):
        text = render_markdown({"eval_pretrain": {"core": 0.2, **facts}}, [], env)
        # the per-stage metrics table's row (the comparable table names its CORE column instead)
        return (
            next(line for line in text.splitlines() if "0.2000" in line and not line.startswith("| base"))
            .split("|")[1]
            .strip()
        )

    assert row(core_source="dclm", core_tasks=22, core_items=11000) == "CORE (DCLM, 22 tasks)"
    assert row(core_source="own", core_tasks=3, core_items=761) == "CORE-style (own tasks, 761 items)"
    assert (
        row(core_source="bundle", core_tasks=3, core_items=12)
        == "CORE-style (bundle not verified as DCLM's, 3 tasks, 12 items)"
    )
    assert row() == "CORE-style (task source not recorded)"  # metrics from before core_source: never the bare name


# The tiny run's shape: three supervised stages on different mixtures, RL with its held-out scores
# measured twice (before the first update and after the last).
def _tiny_like_series() -> dict[str, dict[str, list[tuple[float, float]]]]:
    def ramp(n: int, start: float) -> list[tuple[float, float]]:
        return [(float(s), start - s / 100) for s in range(1, n + 1)]

    def sched(n: int) -> list[tuple[float, float]]:
        return [(float(s), min(1.0, 2 * (n - s) / n)) for s in range(1, n + 1)]

    return {
        "train_loss": {"pretrain": ramp(12, 8.0), "midtrain": ramp(6, 3.0), "sft": ramp(6, 0.3)},
        "lr_mult": {"pretrain": sched(12), "midtrain": sched(6), "sft": sched(6)},  # midtrain = sft
        "val_bpb": {"pretrain": [(4.0, 2.2), (8.0, 2.0), (12.0, 1.9)], "midtrain": [(3.0, 1.34), (6.0, 1.22)],
                    "sft": [(3.0, 0.13), (6.0, 0.02)]},
        "reward": {"rl": [(float(s), 0.6 + s / 100) for s in range(1, 6)]},
        "completion_len": {"rl": [(float(s), 60.0 - s) for s in range(1, 6)]},
        "loss": {"rl": [(float(s), -0.15 + s / 100) for s in range(1, 6)]},
        "val_pass@1": {"rl": [(0.0, 0.66625), (5.0, 0.715)]},
        "val_pass@8": {"rl": [(0.0, 0.99), (5.0, 0.99)]},
        "val_greedy": {"rl": [(0.0, 1.0), (5.0, 0.99)]},
        "val_completion_len": {"rl": [(0.0, 65.63), (5.0, 65.62)]},
    }


TINY_RUNINFO = {
    "pretrain": {"epochs.components.shakespeare.weight": 0.9, "epochs.components.roam.weight": 0.1,
                 "setup.objective": "ce", "setup.loss": "all"},
    "midtrain": {"epochs.components.shakespeare.weight": 0.3, "epochs.components.synth_math.weight": 0.4,
                 "epochs.components.synth_chat.weight": 0.3, "setup.objective": "ce", "setup.loss": "all"},
    "sft": {"epochs.components.synth_math.weight": 0.6, "epochs.components.synth_chat.weight": 0.4,
            "setup.objective": "prefix_smooth", "setup.prefix_weight": 0.1, "setup.loss": "assistant"},
    "rl": {"setup.problems": "synth_math", "setup.problems_per_step": 12, "setup.group_size": 8,
           "setup.temperature": 1.3, "setup.pass_k": 8, "setup.eval_problems": 100},
}


def test_one_chart_per_question_each_naming_its_data() -> None:
    charts = {c.key: c for c in plan_charts(_tiny_like_series(), TINY_RUNINFO)}
    assert list(charts) == [
        "lr_mult", "pretrain_train_loss", "pretrain_val_bpb", "midtrain_train_loss", "midtrain_val_bpb",
        "sft_train_loss", "sft_val_bpb", "rl_reward", "rl_objective", "rl_rollout_len", "rl_heldout_accuracy",
        "rl_heldout_len"]
    # Validation on each stage's own mixture: one chart each, its data in the title.
    assert charts["pretrain_val_bpb"].title == (
        "pretrain: validation bits per byte\non val split of shakespeare 0.9 + roam 0.1, all tokens")
    assert charts["midtrain_val_bpb"].title.endswith(
        "val split of synth_math 0.4 + shakespeare 0.3 + synth_chat 0.3, all tokens"
    )
    assert charts["sft_val_bpb"].title.endswith("val split of synth_math 0.6 + synth_chat 0.4, assistant tokens only")
    # Stages share a chart only for what is measured on no data (the schedule).
    for c in charts.values():
        assert len(c.stages) == 1 or c.data == "", c.key
        assert c.data == "" or f"on {c.data}" in c.title, c.key
    assert charts["lr_mult"].stages == ("pretrain", "midtrain", "sft")
    # RL's objective and the supervised train losses go by different names.
    assert charts["rl_objective"].title.startswith(
        "rl: RL objective (policy-gradient loss)\non train split of synth_math"
    )
    assert charts["pretrain_train_loss"].title.startswith("pretrain: train cross-entropy\non train split of")
    assert charts["sft_train_loss"].title.startswith("sft: train loss (prefix-smoothed cross-entropy, w=0.1)\n")
    # Held-out accuracies share one chart (same problems, same unit), each named.
    acc = charts["rl_heldout_accuracy"]
    assert [ln.label for ln in acc.lines] == ["pass@1 (mean over the samples)", "pass@8 (any of 8 samples)",
                                              "greedy (temperature 0)"]
    assert "val split of synth_math: 100 problems" in acc.title and acc.ylim == (0.0, 1.0)


def test_identical_schedules_share_a_line_named_by_both() -> None:
    lr = next(c for c in plan_charts(_tiny_like_series()) if c.key == "lr_mult")
    assert [ln.label for ln in lr.lines] == ["pretrain", "midtrain = sft"]  # sft's line would hide midtrain's
    assert all(ln.style == "line" for ln in lr.lines)


def test_few_point_series_are_points_with_their_change_on_a_zero_based_axis() -> None:
    charts = {c.key: c for c in plan_charts(_tiny_like_series(), TINY_RUNINFO)}
    length = charts["rl_heldout_len"]
    (line,) = length.lines
    assert line.style == "points" and line.change == "65.63 -> 65.62 (-0.01)"
    assert length.ylim is not None and length.ylim[0] == 0.0 and length.ylim[1] > 65.63  # not an offset axis
    assert charts["midtrain_val_bpb"].lines[0].style == "points"
    assert charts["pretrain_val_bpb"].lines[0].style == "line"  # more than FEW_POINTS
    assert len(charts["pretrain_val_bpb"].lines[0].points) > FEW_POINTS
    assert charts["pretrain_val_bpb"].ylim is None
    assert charts["rl_reward"].ylim == (0.0, 1.0)  # a rate keeps its full range
    # The markdown prints the changes under the chart.
    text = render_markdown({}, list(charts.values()), ENV)
    assert "*rl/val_completion_len: 65.63 -> 65.62 (-0.01)*" in text
    assert ("*pass@1 (mean over the samples): 0.6663 -> 0.715 (+0.04875); pass@8 (any of 8 samples): 0.99 -> 0.99 "
            "(+0); greedy (temperature 0): 1 -> 0.99 (-0.01)*") in text
    sections = [line for line in text.splitlines() if line.startswith("### ")]
    assert sections == ["### all stages", "### pretrain", "### midtrain", "### sft", "### rl"]


def test_without_run_facts_each_stage_names_its_own_split() -> None:
    charts = {c.key: c for c in plan_charts(_tiny_like_series())}
    assert charts["midtrain_val_bpb"].title == "midtrain: validation bits per byte\non the midtrain mixture's val split"
    assert charts["sft_train_loss"].title.startswith("sft: train loss (the stage's objective)\n")
    assert charts["rl_heldout_len"].title.endswith("on held-out problems")
    assert describe_data("rl", "rollouts", {}) == "sampled training rollouts"
    facts = {"setup.problems": "synth_multistep", "setup.mixture.synth_math": 0.25, "setup.problems_per_step": 16,
             "setup.group_size": 8, "setup.temperature": 1.0}
    assert describe_data("rl", "rollouts", facts) == ("train split of synth_multistep + synth_math 0.25: 16 problems "
                                                      "x 8 samples per step, temperature 1")
    assert describe_data("rl", "anchor", {}) == "SFT train conversations, assistant tokens only"
    anchor = {"setup.anchor.synth_chat": 0.5, "setup.anchor.synth_math": 0.5, "setup.anchor_rows": 16}
    assert describe_data("rl", "anchor", anchor) == ("train split of synth_chat 0.5 + synth_math 0.5: 16 conversations "
                                                     "per update, assistant tokens only")
    kl = {**anchor, "setup.anchor_target": "sft"}
    assert describe_data("rl", "anchor", kl) == ("train split of synth_chat 0.5 + synth_math 0.5: 16 conversations "
                                                 "per update, KL to the starting checkpoint, assistant tokens only")
    # every mixture reads the same way: heaviest first, then by name
    facts |= {"setup.mixture.a_chat": 0.125, "setup.mixture.z_math": 0.5}
    assert describe_data("rl", "rollouts", facts).startswith("train split of synth_multistep + z_math 0.5 + "
                                                             "synth_math 0.25 + a_chat 0.125: ")


def test_unknown_series_stay_in_their_stage() -> None:
    charts = plan_charts({"grad_norm": {"pretrain": [(1.0, 2.0), (2.0, 1.0), (3.0, 0.5)], "sft": [(1.0, 1.0)]}})
    assert [(c.key, c.stages) for c in charts] == [("pretrain_grad_norm", ("pretrain",)), ("sft_grad_norm", ("sft",))]
    assert (
        charts[0].title
        == "pretrain: grad_norm\ndata not recorded (a series lockstep.pipeline.report.QUANTITIES does not describe)"
    )
    assert charts[1].lines[0].change == "1 at step 1"


def test_every_series_the_stages_write_is_catalogued() -> None:
    import re

    from lockstep.rl.config import RLConfig
    from lockstep.rl.trainer import series_columns
    from lockstep.train.trainer import SERIES_COLUMNS

    def known(stage: str, column: str) -> bool:
        return any(re.fullmatch(q.pattern, column) and (not q.stages or stage in q.stages) for q in QUANTITIES)

    for stage in ("pretrain", "midtrain", "sft"):
        assert all(known(stage, c) for cols in SERIES_COLUMNS.values() for c in cols)
    for k in (1, 8):
        assert all(known("rl", c) for cols in series_columns(RLConfig(pass_k=k)).values() for c in cols)


def test_dvc_plots_show_one_question_per_plot(repo_root: Path) -> None:
    import yaml

    from lockstep.rl.config import RLConfig
    from lockstep.rl.trainer import series_columns
    from lockstep.train.trainer import SERIES_COLUMNS

    plots = yaml.safe_load((repo_root / "dvc.yaml").read_text())["plots"]
    for entry in plots:
        ((name, spec),) = entry.items()
        assert spec.get("title") and spec.get("x_label") and spec.get("y_label"), name
        # One stage per plot: stages are measured on different data, and DVC draws every line of
        # one revision in one colour, so overlaid equal schedules hid each other.
        (stage,) = {Path(f).parent.name for f in spec["y"]}
        assert name.startswith(f"{stage}_"), name
        # Every column is one the stage writes, in that file, whatever the preset's pass_k.
        declared = series_columns(RLConfig(pass_k=2)) if stage == "rl" else SERIES_COLUMNS
        for f, cols in spec["y"].items():
            assert set([cols] if isinstance(cols, str) else cols) <= set(declared[Path(f).stem]), (name, f)


def _committed_metrics() -> dict[str, dict]:
    """The committed tiny run's metrics (data/metrics/*.json), as the report stage loads them."""
    return load_metrics(Path(__file__).resolve().parents[1] / "data" / "metrics")


def _with_counts(metrics: dict[str, dict], count) -> dict[str, dict]:
    return {stem: {k: count(k, v) if k.endswith(".n") else v for k, v in flat.items()}
            for stem, flat in metrics.items()}


def test_a_micro_run_says_so_at_the_top_and_the_tiny_run_does_not() -> None:
    tiny = _committed_metrics()
    # The committed run scores every task on well over MICRO_ITEMS items (synth_chat's 197 the fewest).
    assert min(v for flat in tiny.values() for k, v in flat.items() if k.endswith(".n")) >= 5 * MICRO_ITEMS
    card = render_markdown(tiny, [], ENV)
    assert MICRO_RUN not in card and micro_run_line(tiny) is None
    # The smoke preset's shape: 3 items per eval task, 4 RL problems.
    smoke = _with_counts(tiny, lambda k, v: 4 if k.startswith(("pass@", "greedy_acc")) else 3)
    lines = render_markdown(smoke, [], ENV).splitlines()
    assert lines[0] == "# lockstep report card" and lines[2].startswith(f"**{MICRO_RUN}**")
    assert "fewer than 30 items (at most 4)" in lines[2] and sum(MICRO_RUN in line for line in lines) == 1


def test_the_micro_run_rule_is_every_count_below_the_threshold() -> None:
    tiny = _committed_metrics()
    assert micro_run_line(_with_counts(tiny, lambda k, v: MICRO_ITEMS - 1)) is not None
    assert micro_run_line(_with_counts(tiny, lambda k, v: MICRO_ITEMS)) is None
    # One small task in a real run does not make it a micro run.
    assert micro_run_line(_with_counts(tiny, lambda k, v: 3 if k.startswith("chat.arc_own") else v)) is None
    # Without item counts there is nothing to judge by.
    assert micro_run_line({"pretrain": {"val_bpb": 1.9}}) is None
