"""lockstep.tools.exp_summary (`lockstep exp summary`): the seed-sweep summary of DVC experiments, on
real `dvc exp show --json` captures (tests/fixtures/exp_show/, made by tests/_exp_toy.py) and, in
the slow test, on a toy git + DVC project built and run here."""

from __future__ import annotations

import copy
import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from _exp_toy import DVC, exp_run, make_project, toy_env
from lockstep.cli import app
from lockstep.tools.exp_summary import (
    DvcNotFoundError,
    ExpShowError,
    NoMetricsError,
    NoRunsError,
    NotADvcRepoError,
    UnknownExperimentError,
    load_exp_show,
    render_markdown,
    render_text,
    run_exp_show,
    summarize,
    summary_json,
)

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "exp_show"
SWEEP = FIXTURES / "sweep.json"
NO_BASELINE = FIXTURES / "no_baseline_metrics.json"
METRICS = ["eval.bpb.shakespeare", "eval.chat.synth_math.accuracy", "train.loss.final",
           "train.runtime.world_size", "train.steps"]


@pytest.fixture
def sweep() -> list:
    return load_exp_show(SWEEP)


def _states(exp_show: list) -> dict[str, dict]:
    """Every revision's ExpState by name, read straight from the capture."""
    out = {}
    for base in exp_show:
        out[base["name"] or base["rev"]] = base
        for exp_range in base["experiments"] or ():
            out[exp_range["name"]] = exp_range["revs"][0]
    return out


def _raw(exp_show: list, name: str, path: str, *keys: str) -> float:
    value = _states(exp_show)[name]["data"]["metrics"][path]["data"]
    for key in keys:
        value = value[key]
    return value


def _row(summary, metric):
    return next(r for r in summary.rows if r.metric == metric)


def test_groups_by_params_without_the_seed_and_skips_what_has_no_result(sweep):
    s = summarize(sweep)
    assert [(g.label, dict(g.params), sorted(r.name for r in g.runs)) for g in s.groups] == [
        ("A", {"train.lr": 0.01}, ["main", "s43", "s44"]),
        ("B", {"train.lr": 0.02}, ["lr2-s42", "lr2-s43"]),
    ]
    assert {r.seed for r in s.groups[0].runs} == {42, 43, 44}
    reasons = {k.name: k.reason for k in s.skipped}
    assert reasons["q45"].startswith("queued")
    # bad-lr failed in the queue but its capture still carries metrics (the ones it started from).
    assert _raw(sweep, "bad-lr", "metrics/eval.json", "chat.synth_math.accuracy") > 0
    assert reasons["bad-lr"].startswith("failed")
    # A second run of a configuration's seed would count one seed twice and shrink the spread.
    assert reasons["rerun-s42"] == "same params and seed 42 as main"
    assert "workspace" not in reasons and all(r.name != "workspace" for g in s.groups for r in g.runs)


def test_numbers_are_mean_and_sample_std_of_the_captured_metrics(sweep):
    s = summarize(sweep)
    assert [r.metric for r in s.rows] == METRICS  # counts (.n), strings and booleans are not metrics
    for metric, path, keys in (("eval.chat.synth_math.accuracy", "metrics/eval.json", ("chat.synth_math.accuracy",)),
                               ("train.loss.final", "metrics/train.json", ("loss", "final"))):
        row = _row(s, metric)
        for cell, names in zip(row.cells, (["main", "s43", "s44"], ["lr2-s42", "lr2-s43"])):
            values = [_raw(sweep, n, path, *keys) for n in names]
            assert cell.mean == pytest.approx(statistics.mean(values))
            assert cell.std == pytest.approx(statistics.stdev(values))
            assert cell.n == len(names)
        (d,) = row.differences
        assert d.difference == pytest.approx(row.cells[1].mean - row.cells[0].mean)
        assert d.spread == pytest.approx(max(row.cells[0].std, row.cells[1].std))
        assert d.within_spread is (abs(d.difference) < d.spread)
    assert _row(s, "eval.chat.synth_math.accuracy").cells[0].items == (50,)
    assert _row(s, "train.loss.final").cells[0].items == ()


def test_the_mark_within_outside_and_unknown(sweep):
    s = summarize(sweep)
    # Accuracy moves by 10 * lr = 0.1 against seed noise of at most 0.1 * U(0, 1): outside the spread.
    assert _row(s, "eval.chat.synth_math.accuracy").differences[0].within_spread is False
    # Equal constants differ by nothing: within any spread, a zero one too.
    assert _row(s, "train.steps").differences[0].within_spread is True
    # One lr=0.02 run: its spread is unknown, so no mark but "?".
    one = summarize(sweep, ["s43", "s44", "lr2-s42"])
    assert all(r.differences[0].within_spread is None for r in one.rows)
    assert all(line.endswith(" ?") for line in render_text(one).splitlines() if line.startswith(("eval.", "train.")))


def test_text_table_has_a_row_per_metric_the_marks_and_the_legend(sweep):
    text = render_text(summarize(sweep), width=200)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("metric"))
    assert lines[header].split() == ["metric", "items", "A", "B", "B-A"]
    rows = {line.split()[0]: line for line in lines[header + 1: header + 1 + len(METRICS)]}
    assert sorted(rows) == METRICS
    assert rows["eval.chat.synth_math.accuracy"].split()[1] == "50"
    assert rows["train.steps"].endswith(" 0 ~")
    assert not rows["eval.chat.synth_math.accuracy"].endswith(("~", "?"))
    assert "  ~  within seed noise" in text and "  ?  spread unknown" in text
    assert "skipped: " in text and "q45 (queued" in text


def test_text_splits_groups_that_do_not_fit_the_width(sweep):
    # Four configurations: lr 0.01 and 0.02, each with a further param that only some runs changed.
    data = copy.deepcopy(sweep)
    states = _states(data)
    for name in ("s44", "lr2-s43"):
        states[name]["data"]["params"]["params.yaml"]["data"]["train"]["steps"] = 20
    s = summarize(data)
    assert len(s.groups) == 4
    text = render_text(s, width=80)
    assert max(len(line) for line in text.splitlines()) <= 80
    headers = [line.split() for line in text.splitlines() if line.startswith("metric")]
    assert len(headers) > 1 and all(h[:2] == ["metric", "items"] for h in headers)
    assert [c for h in headers for c in h[2:]] == ["A", "B", "B-A", "C", "C-A", "D", "D-A"]


def _preset_state(name: str, rev: str, preset: str, seed: int, items: int | None = None) -> dict:
    """A run as `dvc exp show --json` lists it: the params of presets/PRESET.yaml and the committed
    tiny run's metrics files, with every item count set to `items` where given."""
    params = yaml.safe_load((ROOT / "presets" / f"{preset}.yaml").read_text()) | {"seed": seed}
    metrics = {}
    for path in sorted((ROOT / "data" / "metrics").glob("*.json")):
        values = json.loads(path.read_text())
        if items is not None:
            values = {k: items if k.endswith(".n") else v for k, v in values.items()}
        metrics[f"data/metrics/{path.name}"] = {"data": values}
    return {"rev": rev, "name": name, "error": None, "experiments": None,
            "data": {"rev": rev, "timestamp": f"2026-12-01T00:00:{seed % 60:02d}", "metrics": metrics,
                     "params": {"params.yaml": {"data": params}}}}


@pytest.fixture
def presets() -> list:
    """The committed tiny run as the baseline and two seeds of the smoke preset (3 items per eval
    task) as its experiments: hundreds of params, dozens of them different."""
    base = _preset_state("main", "a" * 40, "tiny", 1337)
    runs = [_preset_state(f"smoke-{seed}", c * 40, "smoke", seed, items=3) for seed, c in ((1337, "b"), (43, "c"))]
    base["experiments"] = [{"revs": [r], "executor": None, "name": r["name"]} for r in runs]
    return [base]


def test_text_of_two_presets_names_them_and_keeps_within_the_width(presets):
    s = summarize(presets)
    params = [dict(_flatten(yaml.safe_load((ROOT / "presets" / f"{p}.yaml").read_text()))) for p in ("tiny", "smoke")]
    keys = (params[0].keys() | params[1].keys()) - {"seed"}
    differing = {k for k in keys if params[0].get(k, "unset") != params[1].get(k, "unset")}
    assert set(s.groups[0].params) == differing and s.equal_params == len(keys) - len(differing) > 0
    for width in (80, 100, 140):
        text = render_text(s, width=width)
        lines = text.splitlines()
        assert max(map(len, lines)) <= width, width
        head = " ".join(text.split("  A  ")[0].split())
        assert head.endswith(f"(seed left out of the grouping); {len(differing)} params differ, {s.equal_params} equal")
        assert "  A  preset tiny, 1 run: main (seed 1337)" in lines
        assert "  B  preset smoke, 2 runs: smoke-1337 (seed 1337), smoke-43 (seed 43)" in lines
        # A few lines of the params each configuration differs in, then how many more.
        blocks = [[line for line in lines[i + 1:] if line.startswith("     ")] for i, line in enumerate(lines)
                  if line.startswith(("  A  ", "  B  "))]
        assert len(blocks) == 2 and all(len(b) >= 5 and b[4].startswith("     ... and ") for b in blocks)
        row = next(line for line in lines if line.startswith("eval_midtrain.chat.arc_own.accuracy "))
        assert row.split()[1:4] == ["238", "/", "3"]
        assert "  A / B  items: each configuration's count, where they differ" in lines
    assert "model.depth=4" in render_text(s, width=1000) and "model.depth=2" in render_text(s, width=1000)
    assert summary_json(s)["groups"][1]["params"]["model.depth"] == 2


def _flatten(data, prefix=""):
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def test_items_one_count_where_all_agree_and_a_range_where_seeds_differ(presets):
    s = summarize(presets, ["smoke-1337", "smoke-43"])
    assert _row(s, "eval_midtrain.chat.arc_own.accuracy").cells[0].items == (3,)
    assert "each configuration's count" not in render_text(s)
    presets[0]["experiments"][1]["revs"][0]["data"]["metrics"]["data/metrics/eval_midtrain.json"]["data"][
        "chat.arc_own.accuracy.n"] = 5
    row = next(line for line in render_text(summarize(presets, ["smoke-1337", "smoke-43", "main"])).splitlines()
               if line.startswith("eval_midtrain.chat.arc_own.accuracy "))
    assert row.split()[1:4] == ["3..5", "/", "238"]


def test_markdown_escapes_the_tilde_and_keeps_the_columns(sweep):
    md = render_markdown(summarize(sweep))
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len({line.count(" | ") for line in table[2:]}) == 1 and len(table) == 2 + len(METRICS)
    assert table[0] == "| metric | items | A | B | B-A |"
    # A bare ~ pair in a row would render as strikethrough on GitHub.
    assert all("\\~" in line for line in table if "~" in line)
    assert "`~`" in md and "**A** `train.lr=0.01`" in md


def test_json_is_plain_values_with_null_for_an_unknown_spread(sweep):
    out = summary_json(summarize(sweep, ["s43", "lr2-s42", "s44"], ["eval.chat.*"]))
    text = json.dumps(out, allow_nan=False)  # no NaN reaches a script
    assert json.loads(text) == out
    (row,) = out["metrics"]
    assert row["metric"] == "eval.chat.synth_math.accuracy"
    assert [g["n"] for g in row["groups"]] == [2, 1] and row["groups"][1]["std"] is None
    (diff,) = row["differences"]
    assert (diff["label"], diff["to"], diff["spread"], diff["within_spread"]) == ("B", "A", None, None)
    assert diff["difference"] == pytest.approx(row["groups"][1]["mean"] - row["groups"][0]["mean"])
    assert out["groups"][0]["runs"][0] == {"name": "s43", "rev": _states(sweep)["s43"]["rev"], "seed": 43}


def test_names_pick_runs_and_the_first_sets_the_reference(sweep):
    s = summarize(sweep, ["lr2-s42", "s43", "lr2-s43"])
    assert [dict(g.params) for g in s.groups] == [{"train.lr": 0.02}, {"train.lr": 0.01}]
    assert [r.name for r in s.groups[0].runs] == ["lr2-s42", "lr2-s43"]
    rev = _states(sweep)["s44"]["rev"]
    assert [r.name for g in summarize(sweep, [rev[:8]]).groups for r in g.runs] == ["s44"]
    # A name given twice, or as its name and its rev, is one run.
    assert sum(len(g.runs) for g in summarize(sweep, ["s44", rev, "s44"]).groups) == 1
    ws = summarize(sweep, ["workspace"])
    assert [r.name for r in ws.groups[0].runs] == ["workspace"]


def test_the_reference_is_the_first_runs_configuration_even_without_its_metrics(sweep):
    data = copy.deepcopy(sweep)
    main = _states(data)["main"]["data"]
    main["metrics"] = {p: {"error": {"type": "FileNotFoundError", "msg": "gone"}} for p in main["metrics"]}
    s = summarize(data, ["main", "lr2-s42", "s43"])
    assert [(dict(g.params), [r.name for r in g.runs]) for g in s.groups] == [
        ({"train.lr": 0.01}, ["s43"]), ({"train.lr": 0.02}, ["lr2-s42"])]
    assert not s.notes
    s = summarize(data, ["main", "lr2-s42"])
    assert s.notes == ("no run of main's configuration has metrics: differences are to the first configuration found",)


def test_unknown_or_ambiguous_names_are_refused(sweep):
    with pytest.raises(UnknownExperimentError, match=r"'s99'.*known there: .*s43"):
        summarize(sweep, ["s99"])
    data = copy.deepcopy(sweep)
    data[1]["experiments"][1]["revs"][0]["rev"] = data[1]["experiments"][0]["revs"][0]["rev"][:6] + "0" * 34
    with pytest.raises(UnknownExperimentError, match="more than one run"):
        summarize(data, [data[1]["experiments"][0]["revs"][0]["rev"][:6]])


def test_metric_globs_filter_and_say_what_matched_nothing(sweep):
    s = summarize(sweep, metric_globs=["eval.*", "nope.*"])
    assert [r.metric for r in s.rows] == METRICS[:2]
    assert "--metric 'nope.*' matched no metric" in s.notes
    # Counts are not metrics, so a glob for them alone matches nothing.
    with pytest.raises(NoMetricsError, match=r"matched none of the metrics: eval.bpb.shakespeare"):
        summarize(sweep, metric_globs=["*.n"])


def test_a_baseline_without_metrics_is_skipped_and_an_unreadable_file_noted():
    data = load_exp_show(NO_BASELINE)
    s = summarize(data)
    assert [r.name for g in s.groups for r in g.runs] == ["s43"]
    (skip,) = s.skipped
    assert skip.name == "main" and "metrics/eval.json (FileNotFoundError)" in skip.reason
    ws = summarize(data, ["workspace"])
    assert ws.notes == ("workspace: left out metrics/train.json (JSONFileCorruptedError)",)
    assert [r.metric for r in ws.rows] == METRICS[:2]
    with pytest.raises(NoRunsError, match="main: no numeric metrics"):
        summarize(data, ["main"])


def test_no_runs_and_a_seed_key_that_is_not_there(sweep):
    with pytest.raises(NoRunsError, match=r"q45: queued.*dvc queue start"):
        summarize(sweep, ["q45", "bad-lr"])
    with pytest.raises(NoRunsError):
        summarize([])
    s = summarize(sweep, seed_key="train.seed")
    assert any("no param 'train.seed'" in n for n in s.notes)
    # Without a seed param nothing is a rerun: main and rerun-s42 are two runs of one group.
    assert [dict(g.params) for g in s.groups][:2] == [{"seed": 42, "train.lr": 0.01}, {"seed": 43, "train.lr": 0.01}]
    assert len(s.groups) == 5 and [r.name for r in s.groups[0].runs] == ["main", "rerun-s42"]


def test_files_sharing_a_stem_are_named_by_their_path(sweep):
    data = copy.deepcopy(sweep)
    for state in _states(data).values():
        metrics = (state.get("data") or {}).get("metrics") or {}
        if "metrics/train.json" in metrics:
            metrics["more/eval.json"] = metrics.pop("metrics/train.json")
    names = [r.metric for r in summarize(data).rows]
    assert "metrics/eval.chat.synth_math.accuracy" in names and "more/eval.loss.final" in names


def test_live_progress_files_are_left_out(sweep):
    """data/live/<stage>.json (the training stages' latest step, for DVC's tools while
    they run) repeats what the stage's own metrics say: neither a row nor a note of its own."""
    data = copy.deepcopy(sweep)
    for state in _states(data).values():
        metrics = (state.get("data") or {}).get("metrics")
        if metrics:
            metrics["data/live/pretrain.json"] = {"data": {"step": 3, "train_loss": 1.5}}
            metrics["data/live/rl.json"] = {"error": {"type": "FileNotFoundError", "msg": "not yet"}}
    plain = summarize(sweep)
    s = summarize(data)
    assert [r.metric for r in s.rows] == [r.metric for r in plain.rows] and s.notes == plain.notes


def test_malformed_input_is_refused_with_how_to_fix(tmp_path, sweep):
    bad = tmp_path / "show.json"
    bad.write_text("ERROR: something\n")
    with pytest.raises(ExpShowError, match="not JSON.*dvc exp show --json"):
        load_exp_show(bad)
    bad.write_text('{"rev": "workspace"}')
    with pytest.raises(ExpShowError, match="list of revisions"):
        load_exp_show(bad)
    with pytest.raises(ExpShowError, match="no such file.*dvc exp show --json >"):
        load_exp_show(tmp_path / "missing.json")
    data = copy.deepcopy(sweep)
    data[1]["experiments"][0]["revs"] = []
    with pytest.raises(ExpShowError, match="shape"):
        summarize(data)


def test_dvc_missing_and_not_a_dvc_repo(tmp_path):
    with pytest.raises(DvcNotFoundError, match="install"):
        run_exp_show(tmp_path, dvc=tmp_path / "no-dvc-here")
    if not DVC.is_file():
        pytest.skip(f"no dvc beside {sys.executable}")
    with pytest.raises(NotADvcRepoError, match=r"not inside a DVC repository.*--from"):
        run_exp_show(tmp_path, dvc=DVC)


def test_cli_prints_json_and_reports_errors_with_exit_2():
    runner = CliRunner()
    done = runner.invoke(app, ["exp", "summary", "--from", str(SWEEP), "--json", "--metric", "train.steps"])
    assert done.exit_code == 0, done.output
    assert [m["metric"] for m in json.loads(done.output)["metrics"]] == ["train.steps"]
    done = runner.invoke(app, ["exp", "summary", "--from", str(SWEEP), "s99"])
    assert done.exit_code == 2 and "error: no experiment or revision 's99'" in done.output
    done = runner.invoke(app, ["exp", "summary", "--from", str(SWEEP), "--json", "--markdown"])
    assert done.exit_code == 2 and "pick one" in done.output


@pytest.mark.slow
def test_summary_of_a_real_seed_sweep(tmp_path, monkeypatch):
    """Three seeds and one other learning rate through `dvc exp run`, summarised from `dvc exp
    show` run here, checked against the metrics the stage itself logged."""
    if not DVC.is_file():
        pytest.skip(f"no dvc beside {sys.executable}")
    log = tmp_path / "logged.jsonl"
    env = toy_env(tmp_path, log)
    repo = tmp_path / "toy"
    make_project(repo, env, run_baseline=False)
    for seed in (42, 43, 44):
        exp_run(repo, env, f"s{seed}", f"seed={seed}", "train.lr=0.01")
    exp_run(repo, env, "lr2", "seed=42", "train.lr=0.02")
    exp_run(repo, env, "q45", "seed=45", "train.lr=0.01", queue=True)
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(logged) == 4

    for key in ("HOME", "DVC_NO_ANALYTICS", "DVC_SITE_CACHE_DIR", "PATH"):
        monkeypatch.setenv(key, env[key])
    s = summarize(run_exp_show(repo, DVC))
    assert [(dict(g.params), sorted(r.seed for r in g.runs)) for g in s.groups] == [
        ({"train.lr": 0.01}, [42, 43, 44]), ({"train.lr": 0.02}, [42])]
    reasons = {k.name: k.reason.split(":")[0] for k in s.skipped}
    assert reasons == {"main": "no numeric metrics", "q45": "queued, no results yet"}
    for metric, pick in (("eval.chat.synth_math.accuracy", lambda m: m["eval"]["chat.synth_math.accuracy"]),
                         ("eval.bpb.shakespeare", lambda m: m["eval"]["bpb.shakespeare"]),
                         ("train.loss.final", lambda m: m["train"]["loss"]["final"])):
        row = _row(s, metric)
        seeds = [pick(m) for m in logged if m["lr"] == 0.01]
        (other,) = [pick(m) for m in logged if m["lr"] == 0.02]
        assert row.cells[0].mean == pytest.approx(statistics.mean(seeds))
        assert row.cells[0].std == pytest.approx(statistics.stdev(seeds))
        assert (row.cells[1].mean, row.cells[1].n) == (pytest.approx(other), 1) and math.isnan(row.cells[1].std)
        assert row.differences[0].difference == pytest.approx(other - statistics.mean(seeds))
        assert row.differences[0].within_spread is None

    monkeypatch.chdir(repo)
    done = CliRunner().invoke(app, ["exp", "summary", "--metric", "eval.chat.*"])
    assert done.exit_code == 0, done.output
    print(done.output)
    assert "  A  3 runs:" in done.output and "  B  1 run: lr2 (seed 42)\n     train.lr=0.02\n" in done.output
    acc = [line for line in done.output.splitlines() if line.startswith("eval.chat.synth_math.accuracy")]
    assert len(acc) == 1 and acc[0].split()[1] == "50" and acc[0].endswith("?")
