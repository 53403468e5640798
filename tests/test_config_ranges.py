"""Every numeric setting of the training and RL sections is checked when the section is built:
NaN, inf and out-of-range values are refused with the full params key, boundary values pass,
and the optimizers refuse non-finite settings given to them directly."""

from __future__ import annotations

import math
import re

import pytest
import torch
import yaml
from torch import nn

from lockstep.core.config import ConfigError, build_config
from lockstep.rl.config import RLConfig
from lockstep.train.optim import AdamW, Muon, OptimConfig
from lockstep.train.trainer import TrainConfig
from stages._common import section

NAN, INF = math.nan, math.inf


def _nested(dotted: str, value: object) -> dict:
    """{"a": {"b": value}} from "a.b"."""
    node: dict = {}
    head, _, rest = dotted.partition(".")
    node[head] = _nested(rest, value) if rest else value
    return node


@pytest.mark.parametrize("where,key,value", [
    ("pretrain", "optim.matrix_lr", NAN),
    ("pretrain", "optim.embed_lr", INF),
    ("midtrain", "optim.unembed_lr", -0.001),
    ("sft", "optim.scalar_lr", -INF),
    ("pretrain", "optim.weight_decay", -0.1),
    ("pretrain", "optim.adam_beta1", 1.0),
    ("pretrain", "optim.adam_beta2", NAN),
    ("pretrain", "optim.adam_eps", 0.0),
    ("pretrain", "optim.muon_momentum_start", -0.1),
    ("pretrain", "optim.muon_momentum_end", 1.0),
    ("pretrain", "optim.muon_momentum_warmup_steps", -1),
    ("pretrain", "optim.grad_clip", INF),
    ("pretrain", "optim.grad_clip", -1.0),
    ("pretrain", "warmdown_frac", NAN),
    ("pretrain", "final_lr_frac", 1.5),
    ("pretrain", "warmup_steps", -1),
    ("pretrain", "num_steps", -5),
    ("pretrain", "target_flops", INF),
    ("pretrain", "tokens_params_ratio", NAN),
    ("pretrain", "peak_flops", -1.0),
    ("pretrain", "eval_tokens", 0),
    ("pretrain", "checkpoint_every_steps", -1),
    ("pretrain", "nonfinite_patience", -1),
    ("pretrain", "mixture.prose", NAN),
    ("rl", "optim.matrix_lr", NAN),
    ("rl", "optim.adam_eps", -1e-8),
    ("rl", "temperature", NAN),
    ("rl", "top_k", 0),
    ("rl", "warmdown_frac", -0.5),
    ("rl", "final_lr_frac", INF),
    ("rl", "nonfinite_patience", -1),
])
def test_out_of_range_setting_is_refused_with_its_full_key(where: str, key: str, value: float) -> None:
    cls = RLConfig if where == "rl" else TrainConfig
    with pytest.raises(ConfigError, match=rf"^{re.escape(f'{where}.{key}={value!r}')} must be ") as e:
        build_config(cls, _nested(key, value), where=where)
    assert "finite number" in str(e.value) or "integer" in str(e.value)


def test_nan_learning_rate_in_params_yaml_says_what_to_set() -> None:
    params = yaml.safe_load("pretrain:\n  optim:\n    matrix_lr: .nan\n")
    with pytest.raises(ConfigError) as e:
        section(params, "pretrain", TrainConfig)
    assert str(e.value) == ("pretrain.optim.matrix_lr=nan must be a finite number >= 0; "
                            "a learning rate (0 freezes that group)")


def test_direct_construction_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^adam_beta2=1\.5 must be a finite number in \[0, 1\)"):
        OptimConfig(adam_beta2=1.5)


def test_boundary_values_are_accepted() -> None:
    optim = {
        "matrix_lr": 0.0,
        "adam_beta1": 0.0,
        "weight_decay": 0.0,
        "grad_clip": 0.0,
        "muon_momentum_warmup_steps": 0,
    }
    cfg = build_config(
        TrainConfig,
        {"optim": optim, "warmdown_frac": 1.0, "final_lr_frac": 0.0, "nonfinite_patience": 3},
        where="pretrain",
    )
    assert cfg.optim.grad_clip == 0.0 and cfg.nonfinite_patience == 3
    rl = build_config(RLConfig, {"top_k": 1, "warmdown_frac": 0.0, "nonfinite_patience": 0}, where="rl")
    assert rl.top_k == 1


@pytest.mark.parametrize("kw", [{"lr": NAN}, {"lr": INF}, {"eps": NAN}, {"weight_decay": -1.0}, {"weight_decay": NAN}])
def test_adamw_refuses_non_finite_settings(kw: dict) -> None:
    with pytest.raises(ValueError, match="finite"):
        AdamW([nn.Parameter(torch.zeros(3))], **kw)


@pytest.mark.parametrize("kw", [{"lr": NAN}, {"lr": -INF}, {"weight_decay": INF}])
def test_muon_refuses_non_finite_settings(kw: dict) -> None:
    with pytest.raises(ValueError, match="finite"):
        Muon([nn.Parameter(torch.zeros(3, 3))], **kw)
