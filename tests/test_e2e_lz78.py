"""End to end with the second tokenizer family: the whole `smoke` DAG with an LZ78 tokenizer,
structured embeddings and the prefix-smoothed loss in pretraining and midtraining, under bf16
autocast with the CPU fast paths, in a scratch copy of the checkout. Every stage must run on
them unchanged (caches, training, the engine's chat and calculator evals, RL, the report),
and the card must say what it was trained with."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from _scratch_repo import BIN, git_commit_all, preset_copy, run_in, stage_progress
from lockstep.infer.engine import Engine
from lockstep.model import checkpoint as ckpt
from lockstep.tokenizer import load_tokenizer


@pytest.mark.e2e
@pytest.mark.slow
def test_smoke_pipeline_with_lz78_structured_and_prefix_smooth(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "repo"
    work.mkdir()
    preset_copy(work, "smoke")
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["tokenizer"].update(kind="lz78", options={"chunking": True})
    params["model"]["embedding"] = "structured"
    for stage in ("pretrain", "midtrain"):
        params[stage].update(objective="prefix_smooth", prefix_weight=0.2)
    # the training path of a CPU with native bf16 (tiny's): autocast and the fused head
    params["runtime"].update(dtype="bf16", kernels=True)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    git_commit_all(work)

    run_in([str(BIN / "dvc"), "repro"], work, 1500, stage_progress(capsys, "e2e lz78"))

    data = work / "data"
    tok = load_tokenizer(data / "tokenizer")
    assert tok.kind == "lz78" and tok.get_vocab_size() == params["tokenizer"]["vocab_size"]
    assert (data / "tokenizer" / "token_ancestors.npy").is_file()
    tok_metrics = json.loads((data / "metrics" / "tokenizer.json").read_text())
    assert tok_metrics["kind"] == "lz78"
    assert all(1.0 < b < 8.0 for b in tok_metrics["bytes_per_token"].values()), tok_metrics["bytes_per_token"]

    # The checkpoints carry the structured embedding and its per-id rows: they load and generate
    # without the tokenizer folder, and the rows are the tokenizer's tree.
    tree = tok.prefix_tree()
    for stage in ("pretrain", "midtrain", "sft", "rl"):
        model, meta = ckpt.load_model(data / "ckpt" / stage, "cpu")
        assert model.config.embedding == "structured", stage
        rows = model.embed.token_parent_row[: tok.get_vocab_size()].numpy()
        coded = tree.last_byte >= 0
        assert np.array_equal(rows[coded & (tree.parent >= 0)], tree.parent[coded & (tree.parent >= 0)]), stage
        metrics = json.loads((data / "metrics" / f"{stage}.json").read_text())
        assert all(math.isfinite(v) for k, v in metrics.items() if isinstance(v, float)), (stage, metrics)
    prompt = tok.encode("To be, or not", prepend="<|bos|>")
    completions, _ = Engine(model, tok).generate_batch(prompt, num_samples=1, max_tokens=8, temperature=0.0)
    assert completions[0] and all(0 <= i < tok.get_vocab_size() for i in completions[0])

    info = json.loads((data / "runinfo" / "pretrain.json").read_text())
    assert info["setup"] == {"embedding": "structured", "objective": "prefix_smooth", "prefix_weight": 0.2,
                             "loss": "all"}
    assert json.loads((data / "runinfo" / "sft.json").read_text())["setup"]["objective"] == "ce"
    # The engine's chat evals ran on the lz78 model (the calculator tasks included).
    sft_eval = json.loads((data / "metrics" / "eval_sft.json").read_text())
    assert {"chat.synth_math.accuracy", "chat.synth_chat.accuracy"} <= set(sft_eval)
    card = (data / "report" / "report.md").read_text()
    setup = next(line for line in card.splitlines() if line.startswith("**Tokenizer** "))
    assert card.splitlines()[2].startswith("**micro run"), card[:300]  # smoke: a micro run, and it says so
    assert "lz78 (" in setup and "structured" in setup, setup
    assert "pretrain prefix_smooth w=0.2" in setup and "midtrain prefix_smooth w=0.2" in setup and "sft ce" in setup, (
        setup
    )
