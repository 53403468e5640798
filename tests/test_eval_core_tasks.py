"""`eval.core_tasks`: where the CORE tasks come from, our own folder under --evalsets or a fetched
bundle snapshot under --raw (the DCLM bundle for d12/d20, the rehearsal's sample bundle), checked
before any model loads, and named in the eval metrics (`core_source`, `core_tasks`, `core_items`)
so that the report can say which CORE it shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from _tiny_model import tiny_gpt
from lockstep.core.config import ConfigError, FieldError, build_config
from lockstep.core.runtime import RuntimeConfig, init_runtime
from lockstep.data.snapshot import SnapshotError
from lockstep.data.sources import SOURCE_CONFIGS, dclm_core, fetch_source
from lockstep.evaluate.core import load_core_tasks
from lockstep.model.checkpoint import save_checkpoint
from lockstep.pipeline.eval import EvalConfig, EvalPaths, check_inputs, core_tasks_source, run_eval_stage
from lockstep.tokenizer.kinds import train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
REHEARSAL = yaml.safe_load((ROOT / "presets" / "rehearsal.yaml").read_text())


def fetch_sample(raw: Path) -> Path:
    """The rehearsal's fetch.dclm_core (the committed sample bundle) into raw/dclm_core."""
    entry = {**REHEARSAL["fetch"]["dclm_core"]}
    entry["path"] = str(ROOT / entry["path"])
    cfg = build_config(SOURCE_CONFIGS["dclm_core"], entry, where="fetch.dclm_core")
    fetch_source("dclm_core", cfg, raw / "dclm_core", seed=REHEARSAL["data_seed"])
    return raw / "dclm_core"


@pytest.mark.parametrize(
    "value", ["core", "evalsets:", "raw:", "hub:core", "raw:a/b", "evalsets:../core", "evalsets:/abs"]
)
def test_a_bad_core_tasks_value_is_refused_by_name(value: str) -> None:
    with pytest.raises(
        FieldError, match=r"core_tasks=.* must be `evalsets:<folder under --evalsets>`.*raw:<fetch name>"
    ):
        EvalConfig(core_tasks=value)
    with pytest.raises(ConfigError, match=r"^eval\.core_tasks="):
        build_config(EvalConfig, {"core_tasks": value}, where="eval")


def test_presets_name_their_core_tasks() -> None:
    for preset, want in (("d12", "raw:dclm_core"), ("d20", "raw:dclm_core"), ("rehearsal", "raw:dclm_core"),
                         ("tiny", "evalsets:core"), ("smoke", "evalsets:core")):
        params = yaml.safe_load((ROOT / "presets" / f"{preset}.yaml").read_text())
        cfg = build_config(EvalConfig, params["eval"], where="eval")
        assert cfg.core_tasks == want, preset
        if want.startswith("raw:"):
            assert params["fetch"][want.removeprefix("raw:")]["source"] == "dclm_core", preset


def test_own_tasks_and_a_missing_folder(tmp_path: Path) -> None:
    assert core_tasks_source(EvalConfig(), tmp_path, ROOT / "evalsets") == (ROOT / "evalsets" / "core", "own")
    with pytest.raises(ConfigError, match="holds no core.yaml"):
        core_tasks_source(EvalConfig(core_tasks="evalsets:chat"), tmp_path, ROOT / "evalsets")


def test_a_bundle_snapshot_and_its_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = EvalConfig(core_tasks="raw:dclm_core")
    with pytest.raises(
        ConfigError,
        match=r"no snapshot at .*dclm_core: add fetch.dclm_core \(source: dclm_core\).*dvc repro fetch@dclm_core",
    ):
        check_inputs("pretrain", cfg, tmp_path / "raw", ROOT / "evalsets")
    check_inputs(
        "sft", EvalConfig(core_tasks="raw:dclm_core", chat_stages=()), tmp_path / "raw", ROOT / "evalsets"
    )  # not a CORE stage
    snap = fetch_sample(tmp_path / "raw")
    folder, source = core_tasks_source(cfg, tmp_path / "raw", ROOT / "evalsets")
    assert source == "bundle"  # the sample is not DCLM's zip
    tasks = load_core_tasks(folder)
    assert {t.task_type for t in tasks} == {"multiple_choice", "schema", "language_modeling"}
    assert all(len(t.items) == 40 for t in tasks)
    meta = json.loads((snap / "meta.json").read_text())
    meta["identity"] = "dclm"  # as the published zip's snapshot records it
    (snap / "meta.json").write_text(json.dumps(meta))
    assert core_tasks_source(cfg, tmp_path / "raw", ROOT / "evalsets")[1] == "dclm"
    (folder / "core.yaml").write_text("icl_tasks: []\n")
    with pytest.raises(SnapshotError, match="core.yaml listed in .* does not match its sha256"):
        check_inputs("pretrain", cfg, tmp_path / "raw", ROOT / "evalsets")
    assert dclm_core.PUBLISHED_SHA256 != REHEARSAL["fetch"]["dclm_core"]["sha256"]


@pytest.mark.parametrize("core_tasks", ["raw:dclm_core", "evalsets:core"])
def test_eval_metrics_name_the_core_source(tmp_path: Path, core_tasks: str) -> None:
    tok = train_tokenizer("byte", ["some text"])
    tok.save(tmp_path / "tokenizer")
    model = tiny_gpt(sequence_len=128, vocab_size=tok.get_vocab_size())
    save_checkpoint(tmp_path / "ckpt", model.state_dict(), {0: {}},
                    {"step": 0, "model_config": model.config.to_dict(), "tokenizer_sha256": tok.sha256})
    fetch_sample(tmp_path / "raw")
    cfg = EvalConfig(core_tasks=core_tasks, core_stages=("pretrain",), core_max_items=2, chat_stages=())
    paths = EvalPaths(ckpt=tmp_path / "ckpt", cache=tmp_path / "cache", tokenizer=tmp_path / "tokenizer",
                      raw=tmp_path / "raw", evalsets=ROOT / "evalsets", out=tmp_path / "eval_pretrain.json",
                      predictions=tmp_path / "eval", runinfo=tmp_path / "runinfo.json")
    metrics = run_eval_stage("pretrain", cfg, paths, rt=init_runtime(RuntimeConfig(device="cpu", dtype="fp32")))
    labels = (
        ["topic_field", "topic_schema", "count_on"]
        if core_tasks.startswith("raw:")
        else ["bard_order", "bard_agree", "bard_turn"]
    )
    assert {k: metrics[k] for k in ("core_source", "core_tasks", "core_items")} == {
        "core_source": "bundle" if core_tasks.startswith("raw:") else "own", "core_tasks": len(labels),
        "core_items": 2 * len(labels)}
    assert all(metrics[f"core.{label}.accuracy.n"] == 2 for label in labels)
    assert json.loads(paths.out.read_text())["core_source"] == metrics["core_source"]
