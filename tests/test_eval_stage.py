"""The eval pipeline wired end to end on a tiny random model: byte tokenizer, a pretrain cache,
a checkpoint, the shipped eval sets; metrics are flat and predictions carry their inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from lockstep.cache import build_pretrain_cache
from lockstep.checkpoint import save_checkpoint
from lockstep.evaluate.run import EvalConfig, EvalPaths, run_eval_stage
from lockstep.model import GPT, GPTConfig
from lockstep.runtime import RuntimeConfig, init_runtime
from lockstep.tokenizer import train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXT = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. " * 20


def test_run_eval_stage_tiny(tmp_path: Path) -> None:
    tok = train_tokenizer("byte", [TEXT])
    tok.save(tmp_path / "tokenizer")
    build_pretrain_cache({"train": [TEXT] * 4, "val": [TEXT] * 4}, tmp_path / "cache" / "pretrain" / "bard",
                         tokenizer=tok, max_train_tokens=None, max_val_tokens=None, shard_bytes=1 << 20, seed=0,
                         shuffle_buffer=4, num_threads=1)
    config = GPTConfig(sequence_len=256, vocab_size=tok.get_vocab_size(), n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
    model = GPT.build(config, torch.device("cpu"), seed=0)
    save_checkpoint(tmp_path / "ckpt", model.state_dict(), {0: {}},
                    {"step": 0, "model_config": config.to_dict(), "tokenizer_sha256": tok.sha256})
    cfg = EvalConfig(bpb_max_tokens=1024, bpb_batch_rows=2, core_stages=("midtrain",), core_max_items=2,
                     chat_stages=("midtrain",), chat_max_items=2, math_sources=(), conversation_sources=(),
                     max_new_tokens=8, sandbox_timeout_s=3.0)
    paths = EvalPaths(ckpt=tmp_path / "ckpt", cache=tmp_path / "cache", tokenizer=tmp_path / "tokenizer",
                      raw=tmp_path / "raw", evalsets=ROOT / "evalsets", out=tmp_path / "metrics" / "eval_midtrain.json",
                      predictions=tmp_path / "eval" / "midtrain")
    rt = init_runtime(RuntimeConfig(device="cpu", dtype="fp32"))
    metrics = run_eval_stage("midtrain", cfg, paths, rt=rt, seed=1)
    on_disk = json.loads(paths.out.read_text())
    assert on_disk == json.loads(json.dumps(metrics))
    assert all(not isinstance(v, dict) for v in on_disk.values())  # flat keys for `dvc metrics diff`
    # a random model: about log2(vocab) bits per token, one byte per token
    assert 4.0 < on_disk["bpb.bard"] < 12.0
    assert {"core", "chatcore", "core.bard_choice.accuracy", "chat.arc_own.accuracy", "chat.code_own.accuracy"} <= set(on_disk)
    assert math.isfinite(on_disk["core"])
    names = sorted(p.name for p in paths.predictions.iterdir())
    assert names == ["chat_arc_own.jsonl", "chat_code_own.jsonl", "core_bard_choice.jsonl", "core_bard_cloze.jsonl", "core_bard_schema.jsonl"]
    first = json.loads((paths.predictions / "core_bard_choice.jsonl").read_text().splitlines()[0])
    assert "query" in first["input"] and isinstance(first["correct"], bool)
