"""presets/rehearsal.yaml is d12 at CPU size: generated from d12.yaml (the committed file is not
stale), with d12's sources, caches, mixtures, tokenizer, RL problems and eval sets, a local sample
behind every hub source, and no difference to d12 outside the sample paths and the size table."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from lockstep.cli import app
from lockstep.data.sources import SOURCE_CONFIGS
from lockstep.data.sources.hub import HubFields, local_splits
from lockstep.dev import rehearsal
from lockstep.pipeline.eval import EvalConfig
from lockstep.tools.presets import write_preset
from stages._common import section

ROOT = Path(__file__).resolve().parents[1]
D12 = yaml.safe_load((ROOT / "presets" / "d12.yaml").read_text())
REH = yaml.safe_load((ROOT / "presets" / "rehearsal.yaml").read_text())


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(_flat(v, key) if isinstance(v, dict) and k != "mixture" else {key: v})
    return out


def test_committed_rehearsal_preset_is_generated_from_d12() -> None:
    assert not rehearsal.is_stale(ROOT / "presets"), "run `lockstep dev rehearsal --write`"


def test_only_sample_paths_and_the_size_table_differ_from_d12() -> None:
    d12, reh = _flat(D12), _flat(REH)
    differ = {k for k in d12.keys() | reh.keys() if d12.get(k, "<absent>") != reh.get(k, "<absent>")}
    allowed = {"preset"} | {k for k, _ in rehearsal.OVERRIDES} | {f"fetch.{n}.path" for n in D12["fetch"]}
    assert differ <= allowed, sorted(differ - allowed)
    assert REH["preset"] == "rehearsal" and REH["seed"] == D12["seed"] and REH["data_seed"] == D12["data_seed"]


def test_same_sources_caches_mixtures_tokenizer_rl_and_evals_as_d12() -> None:
    assert {k: v["source"] for k, v in REH["fetch"].items()} == {k: v["source"] for k, v in D12["fetch"].items()}
    assert REH["cache"] == D12["cache"]  # keys, kinds and the GSM8K carve-out alike
    for stage in ("pretrain", "midtrain", "sft"):
        assert REH[stage]["mixture"] == D12[stage]["mixture"], stage
        assert REH[stage].get("loss") == D12[stage].get("loss"), stage
    for key in ("kind", "train_sources", "metric_sources"):
        assert REH["tokenizer"][key] == D12["tokenizer"][key]
    assert REH["rl"]["problems"] == D12["rl"]["problems"] == "gsm8k"
    reh_eval, d12_eval = section(REH, "eval", EvalConfig), section(D12, "eval", EvalConfig)
    for key in (
        "math_sources",
        "conversation_sources",
        "categorical_files",
        "categorical_prompt",
        "code_files",
        "core_stages",
        "chat_stages",
    ):
        assert getattr(reh_eval, key) == getattr(d12_eval, key), key
    assert reh_eval.chat_tasks == d12_eval.chat_tasks and reh_eval.chat_tasks["gsm8k"] == "gsm8k"  # ChatCORE's six
    assert reh_eval.core_max_items > 0 and reh_eval.chat_max_items > 0  # every task runs, on a few items
    assert REH["runtime"]["nproc"] == 1 and REH["runtime"]["deterministic"] is True


def test_every_hub_source_reads_its_sample_and_gsm8k_test_stays_out_of_training() -> None:
    for name, entry in REH["fetch"].items():
        if issubclass(SOURCE_CONFIGS[entry["source"]], HubFields):
            assert entry["path"].startswith("corpus/hub/") and (ROOT / entry["path"]).is_dir(), name
    gsm = section(REH, "fetch.gsm8k", SOURCE_CONFIGS["gsm8k"])
    assert gsm.val_frac is None  # the test split is the snapshot's val, not a share carved from a pool
    plan = local_splits(gsm.__class__(**{**gsm.__dict__, "path": str(ROOT / gsm.path)}), dataset=gsm.dataset,
                        hub_splits={"train": "train", "val": "test"}, suffixes=(".parquet",), config=gsm.config)
    assert [f.name for f in plan.files["val"]] == ["test-00000-of-00001.parquet"]
    # The gsm8k cache (trained on by midtrain and SFT) reads the snapshot's train split only and
    # carves its own val from it; the snapshot's val (GSM8K test) feeds RL's and the eval's held-out problems.
    assert REH["cache"]["gsm8k"]["val_frac"] > 0


def test_the_preset_command_writes_it(tmp_path: Path) -> None:
    out = tmp_path / "params.yaml"
    write_preset("rehearsal", presets_dir=ROOT / "presets", params_file=out)
    assert out.read_bytes() == (ROOT / "presets" / "rehearsal.yaml").read_bytes()


def test_a_d12_edit_flows_through_with_unknown_keys_unchanged(tmp_path: Path) -> None:
    presets = tmp_path / "presets"
    presets.mkdir()
    shutil.copy(ROOT / "presets" / "rehearsal.yaml", presets)
    d12 = yaml.safe_load((ROOT / "presets" / "d12.yaml").read_text())
    d12["pretrain"]["max_epochs"] = 3
    d12["midtrain"]["mixture"]["wikitext"] = 0.05
    d12["runtime"]["rendezvous"] = {"backend": "c10d", "endpoint": "head:29400"}
    d12["fetch"]["fineweb_edu"]["max_fetch_bytes"] = 123
    (presets / "d12.yaml").write_text(yaml.safe_dump(d12, sort_keys=False))
    runner = CliRunner()
    stale = runner.invoke(app, ["dev", "rehearsal", "--presets-dir", str(presets)])
    assert stale.exit_code == 1 and "rehearsal.yaml: differs" in stale.output
    assert runner.invoke(app, ["dev", "rehearsal", "--write", "--presets-dir", str(presets)]).exit_code == 0
    assert runner.invoke(app, ["dev", "rehearsal", "--presets-dir", str(presets)]).exit_code == 0
    new = yaml.safe_load((presets / "rehearsal.yaml").read_text())
    assert new["pretrain"]["max_epochs"] == 3 and new["midtrain"]["mixture"]["wikitext"] == 0.05
    assert new["runtime"]["rendezvous"] == {"backend": "c10d", "endpoint": "head:29400"}
    assert new["fetch"]["fineweb_edu"]["max_fetch_bytes"] == 123


def test_a_d12_that_no_longer_fits_is_refused_by_name() -> None:
    moved = {k: v for k, v in D12.items() if k != "rl"}
    with pytest.raises(rehearsal.RehearsalError, match="override rl.num_steps: presets/d12.yaml has no section rl"):
        rehearsal.rehearsal_params(moved)
    unsampled = {**D12, "fetch": {**D12["fetch"], "books": {"source": "gutenberg", "path": "x"}}}
    assert rehearsal.rehearsal_params(unsampled)["fetch"]["books"]["path"] == "x"  # not a hub source
    with_hub_copy = {**D12, "fetch": {**D12["fetch"], "gsm8k_socratic": {"source": "gsm8k", "config": "socratic"}}}
    assert rehearsal.rehearsal_params(with_hub_copy)["fetch"]["gsm8k_socratic"]["path"] == "corpus/hub/gsm8k"


def test_a_hub_source_without_a_local_sample_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(rehearsal.SAMPLE_PATHS, "wikitext")
    with pytest.raises(rehearsal.RehearsalError, match=r"fetch.wikitext \(source wikitext\) .* has no local sample"):
        rehearsal.rehearsal_params(D12)
