"""End to end: the `rehearsal` preset (d12 at CPU size on the hub-layout samples in corpus/hub/)
through the whole DVC DAG in a scratch copy of the checkout. It checks what the rehearsal is for:
every hub source was read from local files with the hub's splits, GSM8K's test split reached only
val and the evals, the SFT caches hold the real conversations rendered token for token (multi-turn
OASST, Dolly with its context, GSM8K with calculator calls as python parts), the six ChatCORE
benchmarks and the conversation scores reach the metrics, CORE is scored on the bundle in the DCLM
layout, and the report card holds the table comparable with nanochat's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from _scratch_repo import BIN, git_commit_all, preset_copy, run_in, stage_progress
from lockstep.data.records import as_conversation
from lockstep.data.snapshot import iter_records
from lockstep.evaluate.chatcore import BENCHMARKS
from lockstep.tokenizer import load_tokenizer

HUB_SOURCES = {  # fetch key -> (local_splits read from the file names, or None for a stream; split rule)
    "fineweb_edu": None,
    "wikitext": (
        {
            "train": ["wikitext-103-raw-v1/train-00000-of-00001.parquet"],
            "val": ["wikitext-103-raw-v1/validation-00000-of-00001.parquet"],
        },
        "file names",
    ),
    "gsm8k": (
        {"train": ["main/train-00000-of-00001.parquet"], "val": ["main/test-00000-of-00001.parquet"]},
        "file names",
    ),
    "dolly15k": ({"train": ["databricks-dolly-15k.jsonl"]}, "val_frac"),
    "oasst1": (None, "file names"),  # the shard names carry a hash; checked by pattern below
}


def _examples(cache: Path, split: str) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) of every example of an SFT cache split, read straight from its files."""
    meta = json.loads((cache / "meta.json").read_text())
    ids = np.fromfile(cache / f"{split}_tokens.bin", dtype=np.dtype(meta["token_dtype"]).newbyteorder("<"))
    mask = np.fromfile(cache / f"{split}_mask.bin", dtype=np.uint8)
    starts = [*np.load(cache / f"{split}_idx.npy").tolist(), len(ids)]
    return [(ids[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(starts, starts[1:])]


def _assistant_runs(mask: list[int]) -> int:
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


@pytest.mark.e2e
@pytest.mark.slow
def test_rehearsal_pipeline_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "repo"
    work.mkdir()
    preset_copy(work, "rehearsal")
    git_commit_all(work)
    run_in([str(BIN / "dvc"), "repro"], work, 900, stage_progress(capsys, "rehearsal"))
    check_rehearsal_run(work)


def check_rehearsal_run(work: Path) -> None:
    """The assertions on a finished rehearsal run in `work`."""
    params = yaml.safe_load((work / "params.yaml").read_text())
    raw = work / "data" / "raw"
    for name, expected in HUB_SOURCES.items():
        meta = json.loads((raw / name / "meta.json").read_text())
        assert meta["source_id"] == f"local:{params['fetch'][name]['path']}", name
        assert meta["revision"].startswith("sha256:") and meta["counts"]["train"] > 0 and meta["counts"]["val"] > 0, (
            name
        )
        if expected is None:
            continue
        splits, rule = expected
        assert meta["split_rule"] == rule, name
        if splits is not None:
            assert meta["local_splits"] == splits, name
    oasst_meta = json.loads((raw / "oasst1" / "meta.json").read_text())
    assert [
        Path(f).name.split("-00000-of-00001-")[0] for s in ("train", "val") for f in oasst_meta["local_splits"][s]
    ] == ["train", "validation"]
    assert oasst_meta["filtered_trees"] > 0
    assert json.loads((raw / "wikitext" / "meta.json").read_text())["unused_files"] == \
        ["wikitext-103-raw-v1/test-00000-of-00001.parquet"]

    tok = load_tokenizer(work / "data" / "tokenizer")
    sft = work / "data" / "cache" / "sft"
    # OASST and Dolly: each cache split is its snapshot split, rendered token for token.
    for name in ("oasst1", "dolly15k"):
        for split in ("train", "val"):
            records = list(iter_records(raw / name, split))
            got = _examples(sft / name, split)
            assert [tuple(map(tuple, tok.render_conversation(r))) for r in records] == \
                [(tuple(i), tuple(m)) for i, m in got], f"{name} {split}"
    oasst = _examples(sft / "oasst1", "train")
    assert max(_assistant_runs(m) for _, m in oasst) >= 3, "no multi-turn OASST conversation in the SFT cache"
    dolly_records = [
        json.loads(line) for line in (work / "corpus/hub/dolly15k/databricks-dolly-15k.jsonl").read_text().splitlines()
    ]
    contexts = [r["context"] for r in dolly_records if r["context"]]
    dolly_text = [
        tok.decode(ids) for ids, _ in _examples(sft / "dolly15k", "train") + _examples(sft / "dolly15k", "val")
    ]
    assert sum(any(f"\n\n{c}" in t for t in dolly_text) for c in contexts) == len(contexts)

    # GSM8K: the cache holds the snapshot's train problems only (its val carved from them); the
    # test split is the snapshot's val, read by RL's held-out check and the eval, never trained on.
    gsm_train = list(iter_records(raw / "gsm8k", "train"))
    gsm_test = list(iter_records(raw / "gsm8k", "val"))
    cached = _examples(sft / "gsm8k", "train") + _examples(sft / "gsm8k", "val")
    rendered = {tuple(tok.render_conversation(as_conversation(p, "gsm8k"))[0]) for p in gsm_train}
    assert {tuple(ids) for ids, _ in cached} == rendered and len(cached) == len(gsm_train)
    cached_text = "\n".join(tok.decode(ids) for ids, _ in cached)
    assert not [p["question"] for p in gsm_test if p["question"] in cached_text], (
        "a GSM8K test problem was cached for training"
    )
    py_start, out_start = tok.encode_special("<|python_start|>"), tok.encode_special("<|output_start|>")
    calls = [(ids, m) for ids, m in cached if ids.count(py_start) >= 2]
    assert calls, "no GSM8K example with several calculator calls"
    for ids, m in calls:
        assert ids.count(py_start) == ids.count(out_start)
        assert all(m[i] == 1 for i, t in enumerate(ids) if t == py_start)  # the call is trained ...
        assert all(m[i] == 0 for i, t in enumerate(ids) if t == out_start)  # ... its output is not
    midtrain = json.loads((work / "data" / "cache" / "sft" / "gsm8k" / "meta.json").read_text())
    assert midtrain["train_examples"] + midtrain["val_examples"] == len(gsm_train)

    # Evals: the six ChatCORE benchmarks (read from their hub-layout samples) and the conversation
    # scores on every chat stage; CORE from the bundle in the DCLM layout on the base ones.
    metrics = work / "data" / "metrics"
    chat_tasks = params["eval"]["chat_tasks"]
    assert sorted(chat_tasks) == sorted(BENCHMARKS)
    for stage in ("midtrain", "sft", "rl"):
        m = json.loads((metrics / f"eval_{stage}.json").read_text())
        for task in (*chat_tasks, *params["eval"]["conversation_sources"]):
            assert 0 < m[f"chat.{task}.accuracy.n"] <= params["eval"]["chat_max_items"], (stage, task)
            assert 0.0 <= m[f"chat.{task}.accuracy"] <= 1.0
        assert m["chatcore"] is not None, stage
    for stage in ("pretrain", "midtrain"):
        m = json.loads((metrics / f"eval_{stage}.json").read_text())
        assert m["core"] is not None and any(k.startswith("core.") and k.endswith(".accuracy") for k in m), stage
        assert (m["core_source"], m["core_tasks"]) == ("bundle", 3), stage  # the rehearsal's own bundle, not DCLM's
        assert {"bpb.fineweb_edu", "bpb.wikitext"} <= set(m), stage
    rl = json.loads((metrics / "rl.json").read_text())
    assert rl, "rl metrics are empty"

    card = (work / "data" / "report" / "report.md").read_text()
    assert "| metric | BASE | MID | SFT | RL |" in card
    for task in params["eval"]["conversation_sources"]:
        row = next((line for line in card.splitlines() if line.startswith(f"| chat.{task}.accuracy |")), None)
        assert row is not None, f"report.md has no row for chat.{task}.accuracy"
        assert row.count(f"n={params['eval']['chat_max_items']}") == 3, row  # MID, SFT and RL
    # The table comparable with nanochat's: its CORE column named by its tasks (not DCLM's here),
    # so nanochat's CORE is not set beside it, while its ChatCORE reference lines are.
    assert "## Comparable with nanochat" in card
    header = next(line for line in card.splitlines() if line.startswith("| stage |"))
    assert header.startswith("| stage | CORE-style (bundle not verified as DCLM's"), header
    assert "ChatCORE |" in header
    refs = [line for line in card.splitlines() if "(reference: nanochat d20" in line]
    assert refs and not any("0.2219" in line for line in refs)
