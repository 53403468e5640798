"""Bits per byte is one measure: the figure a training stage reports as `val_bpb` equals the one
the eval stage reports as `bpb.<cache>`, for the same checkpoint and the same val tokens, on a
pretraining cache (every target) and on an SFT cache (assistant targets only; eval reads each
example at its own width, training pads it to the context, so there the two agree to rounding)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lockstep.core.runtime import RuntimeConfig, init_runtime
from lockstep.data.cache_build import build_pretrain_cache, build_sft_cache
from lockstep.data.records import text_message
from lockstep.pipeline.eval import EvalConfig, EvalPaths, run_eval_stage
from lockstep.pipeline.train import TrainStagePaths, run_training_stage
from lockstep.tokenizer.kinds import train_tokenizer
from lockstep.train.bpb import measure_bpb
from lockstep.train.optim import OptimConfig
from lockstep.train.trainer import ModelParams, TrainConfig

T = 64
ROOT = Path(__file__).resolve().parents[1]
_WORDS = "the king said to the queen that the castle was cold and the night was long".split()


def _docs(n: int, offset: int) -> list[str]:
    return [" ".join(_WORDS[(i * 3 + j + offset) % len(_WORDS)] for j in range(40)) + "." for i in range(n)]


def _chat(i: int) -> dict:
    return {"messages": [text_message("user", f"What is {i % 7} plus {i % 5}?"),
                         text_message("assistant", f"It is {i % 7 + i % 5}.")]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A pretrain and an SFT checkpoint trained by the stage library on caches whose val split
    holds exactly one window (pretrain: T+1 tokens) or one example (SFT): the random windows
    training draws and the sequential ones eval reads are then the same tokens."""
    root = tmp_path_factory.mktemp("bpb")
    tok = train_tokenizer("byte", [])
    tok.save(root / "tokenizer")
    build_pretrain_cache({"train": _docs(40, 0), "val": _docs(4, 5)}, root / "cache/pretrain/prose", tokenizer=tok,
                         max_train_tokens=None, max_val_tokens=T + 1, shard_bytes=1 << 20, seed=1, shuffle_buffer=8)
    build_sft_cache({"train": [_chat(i) for i in range(20)], "val": [_chat(20)]}, root / "cache/sft/chat",
                    tokenizer=tok, val_frac=None, seed=1)
    rt_cfg = RuntimeConfig(device="cpu", dtype="fp32", threads=1)
    rt = init_runtime(rt_cfg)
    # One row per forward and eval_tokens = T: training scores its val window once, as eval does.
    common = dict(batch_tokens=2 * T, device_batch_rows=1, num_steps=3, eval_every_steps=0, eval_tokens=T,
                  checkpoint_every_steps=0, sample_tokens=2, peak_flops=1e12, optim=OptimConfig())
    for stage, cfg, init, model in (
        (
            "pretrain",
            TrainConfig(mixture={"prose": 1.0}, **common),
            None,
            ModelParams(depth=1, sequence_len=T, head_dim=32),
        ),
        ("sft", TrainConfig(mixture={"sft/chat": 1.0}, loss="assistant", **common), root / "pretrain", None),
    ):
        paths = TrainStagePaths(
            cache=root / "cache",
            tokenizer=root / "tokenizer",
            out=root / stage,
            metrics=root / f"metrics/{stage}.json",
            runinfo=root / f"runinfo/{stage}.json",
            plots=root / f"plots/{stage}",
            runs=root / "runs",
            init=init,
        )
        run_training_stage(
            stage,
            cfg=cfg,
            paths=paths,
            rt=rt,
            seed=3,
            data_seed=5,
            runtime_config=rt_cfg,
            code_revision="test",
            started_s=0.0,
            model_params=model,
        )
    return root


@pytest.mark.parametrize("stage, eval_key", [("pretrain", "bpb.prose"), ("sft", "bpb.sft_chat")])
def test_training_and_eval_report_the_same_bpb(trained: Path, stage: str, eval_key: str) -> None:
    train_bpb = json.loads((trained / f"metrics/{stage}.json").read_text())["val_bpb"]
    cfg = EvalConfig(bpb_max_tokens=T, bpb_batch_rows=1, core_stages=(), chat_stages=())
    paths = EvalPaths(
        ckpt=trained / stage,
        cache=trained / "cache",
        tokenizer=trained / "tokenizer",
        raw=trained / "raw",
        evalsets=ROOT / "evalsets",
        out=trained / f"metrics/eval_{stage}.json",
        predictions=trained / f"eval/{stage}",
        runinfo=trained / f"runinfo/eval_{stage}.json",
    )
    metrics = run_eval_stage(stage, cfg, paths, rt=init_runtime(RuntimeConfig(device="cpu", dtype="fp32")))
    assert math.isfinite(train_bpb) and train_bpb > 0
    if stage == "pretrain":
        assert metrics[eval_key] == train_bpb
    else:  # training pads the example to T, eval reads it at its own width: the same sums to rounding
        assert metrics[eval_key] == pytest.approx(train_bpb, rel=1e-6)


def test_per_document_sums_add_up_and_split_at_each_document_start() -> None:
    """Documents open at <|bos|> (id 0 here), continue across rows, and their (nats, bytes) sum to
    the totals; positions that count no byte (ignored or special targets) belong to no document."""
    torch.manual_seed(0)
    bos = 0
    token_bytes = torch.tensor([0, 1, 2, 3, 1, 2])

    def model(x, targets, loss_reduction):  # a fixed, position-dependent loss
        return (targets.clamp(min=0).float() + 1) * 0.1 + torch.arange(x.shape[1]).float() * 0.01

    x1 = torch.tensor([[0, 1, 2, 3], [4, 0, 5, 1]])  # doc 0 = row 0 + row 1's first position
    y1 = torch.tensor([[1, 2, 3, 4], [0, 5, 1, -1]])
    x2 = torch.tensor([[2, 3, 0, 4]])  # doc 1 continues, then doc 2 opens
    y2 = torch.tensor([[3, 0, 4, 5]])
    sums = measure_bpb(model, [(x1, y1), (x2, y2)], token_bytes, doc_start_id=bos)
    assert len(sums.documents) == 3
    assert sum(d[0] for d in sums.documents) == pytest.approx(sums.nats)
    assert sum(d[1] for d in sums.documents) == sums.bytes
    # Bytes per document by hand: doc 0 targets 1,2,3,4 then (row 1) 4 -> 0 is special: 1+2+3+1;
    # doc 1 targets 5,1 (then -1 ignored), 3 (then 0 special); doc 2 targets 4,5.
    assert [d[1] for d in sums.documents] == [7, 2 + 1 + 3, 1 + 2]
    # Without doc_start_id nothing per document is kept, and the totals do not move.
    plain = measure_bpb(model, [(x1, y1), (x2, y2)], token_bytes)
    assert plain.documents == () and plain.nats == pytest.approx(sums.nats) and plain.bytes == sums.bytes
