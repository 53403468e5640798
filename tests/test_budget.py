"""Epochs per mixture component (lockstep.data.budget): the arithmetic on small caches built here,
pretraining and SFT, against hand counts; the refusal before any step and what it says to fix;
the run facts; and every preset passing its own check from its fetch budgets."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from lockstep.core.config import ConfigError, build_config
from lockstep.core.runtime import Runtime, RuntimeConfig
from lockstep.data.budget import EpochBudgetError, Holding, check_epochs, mixture_epochs, sft_holding
from lockstep.data.cache_build import build_pretrain_cache, build_sft_cache
from lockstep.data.loaders import PretrainTokenStreamDataset, open_sft_dataset
from lockstep.pipeline.train import AllTargets, TrainStagePaths, holding_of, run_training_stage
from lockstep.tools.plan import estimated_holding, model_figures
from lockstep.train.trainer import STAGE_CONFIGS, ModelParams, TrainConfig, horizon_steps

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(p.stem for p in (ROOT / "presets").glob("*.yaml"))
T = 32


def _chat(i: int, words: int) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": f"q{i}"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": " ".join(["ok"] * words)}]}]}


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tok) -> Path:
    root = tmp_path_factory.mktemp("budget")
    tok.save(root / "tokenizer")
    docs = ["the quick brown fox jumps over the lazy dog " * 3 for _ in range(20)]
    build_pretrain_cache({"train": docs, "val": docs[:4]}, root / "cache/pretrain/prose", tokenizer=tok,
                         max_train_tokens=None, max_val_tokens=None, shard_bytes=1 << 20, seed=1, shuffle_buffer=8)
    # Short and long conversations: the long ones are cut to T+1 tokens by the loader.
    chats = [_chat(i, 2 if i % 2 else 30) for i in range(12)]
    build_sft_cache({"train": chats, "val": chats[:3]}, root / "cache/sft/chat", tokenizer=tok, val_frac=None, seed=1)
    return root


def test_pretrain_epochs_are_tokens_drawn_over_tokens_held(caches: Path, tok) -> None:
    ds = PretrainTokenStreamDataset(caches / "cache/pretrain/prose/train", T=T, tokenizer_sha256=tok.sha256)
    meta = json.loads((caches / "cache/pretrain/prose/meta.json").read_text())
    h = holding_of(AllTargets(ds))  # the midtraining wrapper holds what it wraps
    assert h == Holding("pretrain", tokens=meta["train_tokens"], examples=None, origin="cache")
    (c,) = mixture_epochs({"prose": 3.0}, {"prose": h}, total_tokens=5000, seq_len=T)
    assert c.weight == 1.0 and c.drawn_tokens == 5000 and c.epochs == pytest.approx(5000 / meta["train_tokens"])


def test_sft_epochs_count_rows_as_whole_examples_cut_to_t_plus_one(caches: Path, tok) -> None:
    ds = open_sft_dataset(caches / "cache/sft/chat", "train", T=T, pad_id=tok.get_bos_token_id(),
                          tokenizer_sha256=tok.sha256)
    offsets = np.load(caches / "cache/sft/chat/train_idx.npy")
    meta = json.loads((caches / "cache/sft/chat/meta.json").read_text())
    lengths = np.diff(np.append(offsets, meta["train_tokens"]))
    assert lengths.max() > T + 1 > lengths.min()  # both kinds present
    h = holding_of(ds)
    assert h.examples == len(ds) == 12  # every example has an assistant token within T
    assert h.tokens == int(np.minimum(lengths, T + 1).sum())
    # Two components, weights 1:3, over 40 rows of T tokens: 10 rows of chat, 30 of prose.
    parts = {"chat": h, "prose": Holding("pretrain", tokens=1000, examples=None, origin="x")}
    chat, prose = mixture_epochs({"chat": 1.0, "prose": 3.0}, parts, total_tokens=40 * T, seq_len=T)
    assert chat.drawn_rows == pytest.approx(10.0) and chat.epochs == pytest.approx(10 / 12)
    assert chat.drawn_tokens == pytest.approx(10 * h.tokens / 12)
    assert prose.drawn_tokens == pytest.approx(30 * T) and prose.epochs == pytest.approx(30 * T / 1000)


def test_sft_holding_by_hand() -> None:
    h = sft_holding([5, 40, 33, 34], seq_len=32)
    assert (h.tokens, h.examples) == (5 + 33 + 33 + 33, 4)


def test_refusal_says_what_to_fetch_and_what_to_lower() -> None:
    held = {"fineweb_edu": Holding("pretrain", tokens=200_000_000, examples=None, origin="cache"),
            "sft/gsm8k": Holding("sft", tokens=700_000, examples=7000, origin="cache")}
    comps = mixture_epochs({"fineweb_edu": 0.9, "sft/gsm8k": 0.1}, held, total_tokens=1000 * 524288, seq_len=2048)
    check_epochs(comps, stage="midtrain", max_epochs=None, num_steps=1000, horizon="num_steps")  # no limit
    with pytest.raises(EpochBudgetError) as e:
        check_epochs(comps, stage="pretrain", max_epochs=1.0, num_steps=1000, horizon="tokens_params_ratio",
                     chars_per_token=4.5)
    msg = str(e.value)
    assert isinstance(e.value, ConfigError)
    # 0.9 x 524.288M = 471.9M tokens drawn from 200M: 2.36 epochs; fetch 471.9M tokens = 2.12B chars.
    assert "fineweb_edu would be read 2.36 times" in msg and "fetch >= 472M train tokens" in msg
    assert "~2.12B characters at ~4.5 chars/token" in msg and "fetch.fineweb_edu.max_train_chars" in msg
    assert "lower pretrain.tokens_params_ratio to <= 0.424x its value (<= 423 steps)" in msg
    # 256 rows/step x 1000 x 0.1 = 25,600 rows over 7,000 examples: 3.66 epochs.
    assert "sft/gsm8k would be read 3.66 times" in msg and "fetch >= 25600 train examples" in msg
    assert "fetch.gsm8k.n_train" in msg and "pretrain.mixture.sft/gsm8k to a normalised weight <= 0.0273" in msg
    assert "pretrain.max_epochs" in msg


def test_max_epochs_defaults_per_stage_and_range() -> None:
    assert {s: c().max_epochs for s, c in STAGE_CONFIGS.items()} == {"pretrain": 1.0, "midtrain": 2.0, "sft": 4.0}
    assert build_config(STAGE_CONFIGS["sft"], {"max_epochs": None}).max_epochs is None
    with pytest.raises(ConfigError, match="sft.max_epochs=0"):
        build_config(STAGE_CONFIGS["sft"], {"max_epochs": 0}, where="sft")


def _run(caches: Path, out: str, cfg: TrainConfig) -> dict:
    paths = TrainStagePaths(cache=caches / "cache", tokenizer=caches / "tokenizer", out=caches / out,
                            metrics=caches / f"{out}.metrics.json", runinfo=caches / f"{out}.runinfo.json",
                            plots=caches / f"{out}.plots", runs=caches / f"{out}.runs")
    rt = Runtime(device=torch.device("cpu"), dtype=torch.float32, reason="test")
    return run_training_stage("pretrain", cfg=cfg, paths=paths, rt=rt, seed=1, data_seed=1,
                              runtime_config=RuntimeConfig(device="cpu", dtype="fp32"), code_revision="sha256:test",
                              started_s=0.0, model_params=ModelParams(depth=1, sequence_len=T, head_dim=32))


def test_stage_refuses_before_any_step_and_records_epochs_when_it_runs(caches: Path) -> None:
    common = dict(mixture={"prose": 1.0}, batch_tokens=2 * T, device_batch_rows=2, eval_every_steps=0, eval_tokens=T,
                  checkpoint_every_steps=0, peak_flops=1e12, sample_tokens=1)
    held = json.loads((caches / "cache/pretrain/prose/meta.json").read_text())["train_tokens"]
    too_many = math.ceil(held / (2 * T)) + 1  # one step past a single pass
    with pytest.raises(EpochBudgetError, match="prose would be read 1.0"):
        _run(caches, "refused", TrainConfig(num_steps=too_many, **common))
    assert not (caches / "refused.runs").exists() and not (caches / "refused.plots").exists()
    _run(caches, "ran", TrainConfig(num_steps=2, **common))
    facts = json.loads((caches / "ran.runinfo.json").read_text())["epochs"]
    assert facts["max_epochs"] == 1.0
    assert facts["components"]["prose"]["epochs"] == pytest.approx(2 * 2 * T / held)
    assert facts["components"]["prose"]["train_tokens"] == held


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_passes_its_own_check_from_its_fetch_budgets(name: str) -> None:
    """No data needed: each component's size is estimated from the preset's fetch params (as
    `lockstep plan` does) and each training stage's horizon from its own params."""
    p = yaml.safe_load((ROOT / "presets" / f"{name}.yaml").read_text())
    gcfg = build_config(ModelParams, p["model"], where="model").gpt_config(p["tokenizer"]["vocab_size"])
    m = model_figures(gcfg)
    for stage, cls in STAGE_CONFIGS.items():
        cfg = build_config(cls, p[stage], where=stage)
        steps, _ = horizon_steps(cfg, flops_per_token=m["flops_per_token"], num_params=m["params_non_embedding"])
        held = {k: estimated_holding(k, p, seq_len=gcfg.sequence_len, root=ROOT) for k in cfg.mixture}
        assert all(h is not None for h in held.values()), f"{name}.{stage}: a component has no size estimate"
        comps = mixture_epochs(cfg.mixture, held, total_tokens=steps * cfg.batch_tokens, seq_len=gcfg.sequence_len)
        check_epochs(comps, stage=f"{name}.{stage}", max_epochs=cfg.max_epochs, num_steps=steps, horizon="num_steps")
    if p["tokenizer"]["vocab_size"] >= 65536:  # the hub presets: pretraining reads its text at most once
        cfg = build_config(TrainConfig, p["pretrain"], where="pretrain")
        assert cfg.max_epochs == 1.0
        assert p["tokenizer"]["max_chars"] <= p["fetch"]["fineweb_edu"]["max_train_chars"]
