"""The eval pipeline wired end to end on a tiny random model: byte tokenizer, a pretrain cache,
a checkpoint, the shipped eval sets; metrics are flat and predictions carry their inputs; chat
replies decoded together are the tokens of replies decoded one at a time."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest

from _tiny_model import randomize, tiny_gpt
from lockstep.core.config import FieldError, build_config
from lockstep.core.runtime import RuntimeConfig, init_runtime
from lockstep.data.cache import CacheError
from lockstep.data.cache_build import build_pretrain_cache, build_sft_cache
from lockstep.infer.engine import Engine
from lockstep.model.checkpoint import save_checkpoint
from lockstep.pipeline.eval import EvalConfig, EvalPaths, make_generate, run_eval_stage
from lockstep.tokenizer.kinds import train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXT = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. " * 20


def test_run_eval_stage_tiny(tmp_path: Path) -> None:
    tok = train_tokenizer("byte", [TEXT])
    tok.save(tmp_path / "tokenizer")
    build_pretrain_cache({"train": [TEXT] * 4, "val": [TEXT] * 4}, tmp_path / "cache" / "pretrain" / "bard",
                         tokenizer=tok, max_train_tokens=None, max_val_tokens=None, shard_bytes=1 << 20, seed=0,
                         shuffle_buffer=4, num_threads=1)
    model = tiny_gpt(sequence_len=256, vocab_size=tok.get_vocab_size())
    config = model.config
    save_checkpoint(tmp_path / "ckpt", model.state_dict(), {0: {}},
                    {"step": 0, "model_config": config.to_dict(), "tokenizer_sha256": tok.sha256})
    cfg = EvalConfig(bpb_max_tokens=1024, bpb_batch_rows=2, core_stages=("midtrain",), core_max_items=2,
                     chat_stages=("midtrain",), chat_max_items=2, math_sources=(), conversation_sources=(),
                     max_new_tokens=8, sandbox_timeout_s=3.0)
    paths = EvalPaths(ckpt=tmp_path / "ckpt", cache=tmp_path / "cache", tokenizer=tmp_path / "tokenizer",
                      raw=tmp_path / "raw", evalsets=ROOT / "evalsets", out=tmp_path / "metrics" / "eval_midtrain.json",
                      predictions=tmp_path / "eval" / "midtrain", runinfo=tmp_path / "runinfo" / "eval_midtrain.json")
    rt = init_runtime(RuntimeConfig(device="cpu", dtype="fp32"))
    metrics = run_eval_stage("midtrain", cfg, paths, rt=rt)
    on_disk = json.loads(paths.out.read_text())
    assert on_disk == json.loads(json.dumps(metrics))
    assert all(not isinstance(v, dict) for v in on_disk.values())  # flat keys for `dvc metrics diff`
    # a random model: about log2(vocab) bits per token, one byte per token
    assert 4.0 < on_disk["bpb.bard"] < 12.0
    assert {"core", "chatcore", "core.bard_order.accuracy", "chat.arc_own.accuracy", "chat.code_own.accuracy"} <= set(
        on_disk
    )
    assert math.isfinite(on_disk["core"])
    # Each accuracy with the number of items behind it, and no run facts among the results.
    assert on_disk["core.bard_order.accuracy.n"] == 2 and on_disk["chat.arc_own.accuracy.n"] == 2
    assert not {"device", "dtype", "world_size", "eval_time_s"} & set(on_disk)
    info = json.loads(paths.runinfo.read_text())
    assert info["device"] == "cpu" and info["world_size"] == 1 and info["eval_time_s"] > 0
    names = sorted(p.name for p in paths.predictions.iterdir())
    assert names == ["bpb_bard.jsonl", "chat_arc_own.jsonl", "chat_code_own.jsonl", "core_bard_agree.jsonl",
                     "core_bard_order.jsonl", "core_bard_turn.jsonl"]
    # bpb per document scored (the first 1024 tokens: one document here), whose sums give the metric back.
    docs = [json.loads(line) for line in (paths.predictions / "bpb_bard.jsonl").read_text().splitlines()]
    assert docs and all(d["bytes"] > 0 for d in docs)
    assert sum(d["nats"] for d in docs) / (math.log(2) * sum(d["bytes"] for d in docs)) == pytest.approx(
        on_disk["bpb.bard"]
    )
    first = json.loads((paths.predictions / "core_bard_order.jsonl").read_text().splitlines()[0])
    assert "query" in first["input"] and isinstance(first["correct"], bool)


# ---------------------------------------------------------------------------------------------
# bits per byte over the caches present: damage fails the stage, only a small split is skipped

T_BPB = 64


def _conversation(i: int) -> dict:
    return {
        "messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]
    }


@pytest.fixture
def bpb_only(tmp_path: Path):
    """A checkpoint, a tokenizer and one sound pretrain cache `bard`; eval runs bpb only."""
    tok = train_tokenizer("byte", [TEXT])
    tok.save(tmp_path / "tokenizer")
    _pretrain(tok, tmp_path / "cache" / "pretrain" / "bard")
    model = tiny_gpt(sequence_len=T_BPB, vocab_size=tok.get_vocab_size())
    config = model.config
    save_checkpoint(tmp_path / "ckpt", model.state_dict(), {0: {}},
                    {"step": 0, "model_config": config.to_dict(), "tokenizer_sha256": tok.sha256})
    cfg = EvalConfig(bpb_max_tokens=512, bpb_batch_rows=2, core_stages=(), chat_stages=())
    paths = EvalPaths(ckpt=tmp_path / "ckpt", cache=tmp_path / "cache", tokenizer=tmp_path / "tokenizer",
                      raw=tmp_path / "raw", evalsets=ROOT / "evalsets", out=tmp_path / "metrics" / "eval_pretrain.json",
                      predictions=tmp_path / "eval" / "pretrain", runinfo=tmp_path / "runinfo" / "eval_pretrain.json")
    rt = init_runtime(RuntimeConfig(device="cpu", dtype="fp32"))
    return tok, cfg, paths, rt


def _pretrain(tok, out: Path, max_val_tokens: int | None = None) -> None:
    build_pretrain_cache({"train": [TEXT], "val": [TEXT] * 2}, out, tokenizer=tok, max_train_tokens=None,
                         max_val_tokens=max_val_tokens, shard_bytes=1 << 20, seed=0, shuffle_buffer=1, num_threads=1)


def _bpb_keys(metrics: dict) -> list[str]:
    return sorted(k for k in metrics if k.startswith("bpb."))


def test_a_damaged_val_cache_fails_eval(bpb_only) -> None:
    _tok, cfg, paths, rt = bpb_only
    shard = paths.cache / "pretrain" / "bard" / "val" / "shard_00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheError, match=r"val/shard_00000\.bin fails its sha256 check"):
        run_eval_stage("pretrain", cfg, paths, rt=rt)
    assert not paths.out.exists()


def test_a_cache_folder_without_meta_fails_eval(bpb_only) -> None:
    _tok, cfg, paths, rt = bpb_only
    (paths.cache / "pretrain" / "bard" / "meta.json").unlink()
    with pytest.raises(CacheError, match=r"bard/meta\.json is missing"):
        run_eval_stage("pretrain", cfg, paths, rt=rt)


def test_a_too_small_val_split_is_skipped_with_its_size(bpb_only, caplog) -> None:
    tok, cfg, paths, rt = bpb_only
    _pretrain(tok, paths.cache / "pretrain" / "small", max_val_tokens=T_BPB)  # one token short of a row
    _pretrain(tok, paths.cache / "pretrain" / "narrow", max_val_tokens=T_BPB + 1)  # one row, fewer than bpb_batch_rows
    with caplog.at_level(logging.WARNING, logger="lockstep.eval"):
        metrics = run_eval_stage("pretrain", cfg, paths, rt=rt)
    assert _bpb_keys(metrics) == ["bpb.bard", "bpb.narrow"]
    assert 4.0 < metrics["bpb.narrow"] < 12.0
    skipped = [r.getMessage() for r in caplog.records if "left out of bpb" in r.getMessage()]
    assert (
        len(skipped) == 1
        and "small/val holds 64 tokens, fewer than the 65 that one 64-token row per rank needs" in skipped[0]
    )


def test_work_folders_of_interrupted_builds_are_not_read(bpb_only) -> None:
    tok, cfg, paths, rt = bpb_only
    # What a killed build leaves: hidden temp folders with data files and no meta.json.
    pre = paths.cache / "pretrain" / ".bard.k2j4h5g6.tmp"
    shutil.copytree(paths.cache / "pretrain" / "bard" / "val", pre / "val")
    sft = paths.cache / "sft" / ".chat.abcdefgh.tmp"
    sft.mkdir(parents=True)
    (sft / "val_tokens.bin").write_bytes(b"\0\0" * 8)
    (paths.cache / "sft" / ".gitignore").write_text("/chat\n")
    metrics = run_eval_stage("pretrain", cfg, paths, rt=rt)
    assert _bpb_keys(metrics) == ["bpb.bard"]


def test_sft_val_splits_scored_and_an_empty_one_skipped(bpb_only, caplog) -> None:
    tok, cfg, paths, rt = bpb_only
    convs = [_conversation(i) for i in range(6)]
    build_sft_cache(
        {"train": convs[:4], "val": convs[4:]}, paths.cache / "sft" / "chat", tokenizer=tok, val_frac=None, seed=0
    )
    build_sft_cache({"train": convs}, paths.cache / "sft" / "trainonly", tokenizer=tok, val_frac=None, seed=0)
    with caplog.at_level(logging.WARNING, logger="lockstep.eval"):
        metrics = run_eval_stage("pretrain", cfg, paths, rt=rt)
    assert _bpb_keys(metrics) == ["bpb.bard", "bpb.sft_chat"]
    assert math.isfinite(metrics["bpb.sft_chat"])
    skipped = [r.getMessage() for r in caplog.records if "left out of bpb" in r.getMessage()]
    assert len(skipped) == 1 and "none of the 0 examples in" in skipped[0] and "trainonly" in skipped[0]


# ---------------------------------------------------------------------------------------------
# chat replies: the batched path gives the reference path's tokens


def test_make_generate_batched_equals_one_at_a_time(tok) -> None:
    model = randomize(
        tiny_gpt(sequence_len=48, vocab_size=tok.get_vocab_size(), n_layer=2, n_head=4), seed=3, scale=0.5
    )
    engine = Engine(model.eval(), tok)
    # A stop id the engine does not know (the letter "e") cuts replies the way <|assistant_end|> does.
    stop_ids = {*engine.stop_ids, ord("e")}
    prompts = [tok.encode(t) for t in ("one", "two words", "x" * 47, "x" * 48, "three more words here", "z")]
    kw = dict(stop_ids=stop_ids, max_new_tokens=20, context_tokens=48)
    reference = make_generate(engine, **kw)(prompts)
    assert reference[3] == [] and len(reference[2]) <= 1  # no room, one token of room
    assert any(0 < len(r) < 20 for r in reference) and any(len(r) == 20 for r in reference)
    for batch_rows in (2, 4, 8):
        assert make_generate(engine, batch_rows=batch_rows, **kw)(prompts) == reference, batch_rows


def test_generate_batch_must_be_positive() -> None:
    with pytest.raises(FieldError, match=r"^generate_batch=0 must be an integer >= 1"):
        EvalConfig(generate_batch=0)
    with pytest.raises(FieldError, match=r"^eval.generate_batch=0 must be an integer >= 1"):
        build_config(EvalConfig, {"generate_batch": 0}, where="eval")


def test_an_eval_stage_whose_decode_compile_fails_finishes_with_the_reference_results(tmp_path: Path, monkeypatch,
                                                                                      caplog) -> None:
    """The fast decode path as on CUDA (static cache, step compiled), with a compiler that raises:
    the stage's generations fall back to the eager static step, so its metrics and every
    prediction equal the reference engine's run, and its run facts say decode_compiled fell back."""
    import functools
    import logging

    from lockstep.core import fastpath
    from lockstep.infer import decode, engine
    from lockstep.pipeline import eval as eval_run

    tok = train_tokenizer("byte", [TEXT])
    tok.save(tmp_path / "tokenizer")
    build_pretrain_cache({"train": [TEXT] * 4, "val": [TEXT] * 4}, tmp_path / "cache" / "pretrain" / "bard",
                         tokenizer=tok, max_train_tokens=None, max_val_tokens=None, shard_bytes=1 << 20, seed=0,
                         shuffle_buffer=4, num_threads=1)
    model = tiny_gpt(sequence_len=256, vocab_size=tok.get_vocab_size())
    save_checkpoint(tmp_path / "ckpt", model.state_dict(), {0: {}},
                    {"step": 0, "model_config": model.config.to_dict(), "tokenizer_sha256": tok.sha256})
    cfg = EvalConfig(bpb_max_tokens=256, bpb_batch_rows=2, core_stages=(), chat_stages=("midtrain",),
                     chat_max_items=3, math_sources=(), conversation_sources=(), max_new_tokens=8,
                     sandbox_timeout_s=3.0)
    rt = init_runtime(RuntimeConfig(device="cpu", dtype="fp32"))

    def run(name: str) -> tuple[dict, dict[str, str], dict]:
        paths = EvalPaths(ckpt=tmp_path / "ckpt", cache=tmp_path / "cache", tokenizer=tmp_path / "tokenizer",
                          raw=tmp_path / "raw", evalsets=ROOT / "evalsets", out=tmp_path / name / "metrics.json",
                          predictions=tmp_path / name / "eval", runinfo=tmp_path / name / "runinfo.json")
        metrics = run_eval_stage("midtrain", cfg, paths, rt=rt)
        predictions = {p.name: p.read_text() for p in sorted(paths.predictions.iterdir())}
        return metrics, predictions, json.loads(paths.runinfo.read_text())

    reference = run("reference")

    def broken(gm, example_inputs):
        raise RuntimeError("triton: no kernel image for this device")

    monkeypatch.setattr(
        eval_run, "decode_settings", lambda *a, **k: {"fast": True, "dtype": None, "compile_step": True}
    )
    monkeypatch.setattr(engine, "compile_step", functools.partial(decode.compile_step, backend=broken))
    with caplog.at_level(logging.WARNING, logger="lockstep.core.fastpath"):
        fell_back = run("fell_back")
    assert fell_back[0] == reference[0] and fell_back[1] == reference[1]
    assert any(name.startswith("chat_") for name in reference[1])  # the generations are compared
    part = fell_back[2]["fast_paths"]["decode_compiled"]
    assert part["path"] == "reference" and part["results"] == "reference" and part["reference_calls"] > 0
    assert "no kernel image" in part["fell_back"] and reference[2]["fast_paths"] == {}
    assert fastpath.facts()["decode_compiled"]["fast_calls"] == 0
    assert sum("fast path decode_compiled" in r.getMessage() for r in caplog.records) == 1
