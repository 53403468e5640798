"""Every preset is complete and valid: each params section builds into its stage's config class,
every cache and mixture names a fetched source, and `lockstep preset` writes it verbatim."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from lockstep.core.config import ConfigError
from lockstep.core.runtime import RuntimeConfig
from lockstep.data.cache_build import CacheConfig
from lockstep.data.sources import SOURCE_CONFIGS
from lockstep.pipeline.eval import EvalConfig
from lockstep.pipeline.tokenizer import TokenizerConfig
from lockstep.rl.config import RLConfig
from lockstep.tools.presets import PresetError, write_preset
from lockstep.train.trainer import ModelParams, TrainConfig
from stages._common import section

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (ROOT / "presets").glob("*.yaml"))


def test_the_four_presets_exist():
    assert {"tiny", "smoke", "d12", "d20"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_sections_build(name: str) -> None:
    p = yaml.safe_load((ROOT / "presets" / f"{name}.yaml").read_text())
    assert p["preset"] == name and isinstance(p["seed"], int)
    for key, entry in p["fetch"].items():
        section(p, f"fetch.{key}", SOURCE_CONFIGS[entry["source"]])
    tok = section(p, "tokenizer", TokenizerConfig)
    assert set(tok.train_sources) <= set(p["fetch"])
    for key in p["cache"]:
        assert key in p["fetch"], f"cache.{key} has no fetch.{key} snapshot to read"
        section(p, f"cache.{key}", CacheConfig)
    section(p, "runtime", RuntimeConfig)
    section(p, "model", ModelParams)
    for stage in ("pretrain", "midtrain", "sft"):
        cfg = section(p, stage, TrainConfig)
        for cache in cfg.mixture:
            assert cache.split("/")[-1] in p["cache"], f"{stage}.mixture names {cache}, which no cache stage builds"
    rl = section(p, "rl", RLConfig)
    assert rl.problems in p["fetch"]
    section(p, "eval", EvalConfig)


def test_unknown_key_is_refused_with_its_name() -> None:
    p = yaml.safe_load((ROOT / "presets" / "tiny.yaml").read_text())
    p["pretrain"]["num_stpes"] = 3
    with pytest.raises(ConfigError, match="pretrain.num_stpes"):
        section(p, "pretrain", TrainConfig)


def test_preset_command_writes_the_file_verbatim(tmp_path: Path) -> None:
    out = tmp_path / "params.yaml"
    write_preset("smoke", presets_dir=ROOT / "presets", params_file=out)
    assert out.read_bytes() == (ROOT / "presets" / "smoke.yaml").read_bytes()
    with pytest.raises(FileNotFoundError, match="available: .*tiny"):
        write_preset("nope", presets_dir=ROOT / "presets", params_file=out)


@pytest.mark.parametrize(
    "text, match",
    [
        (
            "preset: bad\nseed: [1, 2\nmodel: {depth: 4}\n",
            r"bad.yaml is not valid YAML: .* at line 3, column 6; fix the file there",
        ),
        ("preset: bad\n\tseed: 1\n", r"bad.yaml is not valid YAML: .* at line 2, column 1"),
        ("- just\n- a list\n", r"bad.yaml must be a mapping whose `preset` key is 'bad'"),
    ],
)
def test_a_broken_preset_is_refused_with_where_and_params_left_alone(tmp_path: Path, text: str, match: str) -> None:
    (tmp_path / "bad.yaml").write_text(text)
    out = tmp_path / "params.yaml"
    out.write_text("preset: tiny\n")
    with pytest.raises(PresetError, match=match):
        write_preset("bad", presets_dir=tmp_path, params_file=out)
    assert out.read_text() == "preset: tiny\n"


@pytest.mark.parametrize("name", ["d12", "d20"])
def test_real_presets_take_nanochats_shape_and_schedule(name: str) -> None:
    """nanochat derives its heads as ceil(n_embd / 128) (d12: 6, d20: 10), decays the learning rate
    over the last 20% of pretraining and rotates at base 100,000 (docs/recipe.md)."""
    p = yaml.safe_load((ROOT / "presets" / f"{name}.yaml").read_text())
    gcfg = section(p, "model", ModelParams).gpt_config(p["tokenizer"]["vocab_size"])
    assert (gcfg.n_head, gcfg.n_kv_head) == (math.ceil(gcfg.n_embd / 128),) * 2
    assert gcfg.head_dim == 128 and gcfg.rope_theta == 100_000
    assert section(p, "pretrain", TrainConfig).warmdown_frac == 0.2
