"""Parity artifacts and `lockstep parity`: planted differences are named in words."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from lockstep.cli import app
from lockstep.core.io import canonical_json
from lockstep.data.cache_build import build_pretrain_cache, build_sft_cache
from lockstep.data.loaders import SFTExampleDataset
from lockstep.data.parity import dump_first_batch
from lockstep.dev.parity_files import write_dataset_snapshot, write_rendered_samples
from lockstep.tools.parity_diff import compare_artifacts, describe_text_difference


class DoubleBos:
    """A tokenizer that (wrongly) adds its own BOS to every chunk, as one implementation did."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, texts, num_threads=1):
        return [[self.inner.get_bos_token_id(), *ids] for ids in self.inner.encode(texts, num_threads=num_threads)]

    def encode_arrays(self, texts):
        return [np.asarray(ids, dtype=np.uint32) for ids in self.encode(texts)]


DOCS = [f"Document {i} says \u201chello\u201d to the reader number {i}." for i in range(30)]


def _pretrain(tok, out, docs=DOCS, seed=0, buffer=1):
    build_pretrain_cache({"train": docs, "val": docs[:2]}, out, tokenizer=tok, max_train_tokens=None,
                         max_val_tokens=None, shard_bytes=1 << 16, seed=seed, shuffle_buffer=buffer)  # fmt: skip


def test_identical_runs_have_no_difference(tok, tmp_path):
    _pretrain(tok, tmp_path / "a" / "cache")
    _pretrain(tok, tmp_path / "b" / "cache")
    assert compare_artifacts(tmp_path / "a", tmp_path / "b") == []
    result = CliRunner().invoke(app, ["parity", str(tmp_path / "a"), str(tmp_path / "b")])
    assert result.exit_code == 0 and "no difference" in result.output


def test_planted_double_bos_is_named(tok, tmp_path):
    _pretrain(DoubleBos(tok), tmp_path / "a" / "cache")
    _pretrain(tok, tmp_path / "b" / "cache")
    diffs = compare_artifacts(tmp_path / "a", tmp_path / "b")
    assert (
        diffs[0]
        == "cache/rendered_samples.json: train sample 0: A has 2 BOS tokens at positions 0,1; B has 1 at position 0"
    )
    result = CliRunner().invoke(app, ["parity", str(tmp_path / "a"), str(tmp_path / "b")])
    assert result.exit_code == 1 and "A has 2 BOS tokens at positions 0,1; B has 1" in result.output


def test_planted_reorder_is_named(tok, tmp_path):
    _pretrain(tok, tmp_path / "a" / "cache", buffer=8)  # shuffled at the document level
    _pretrain(tok, tmp_path / "b" / "cache", buffer=1)
    first = compare_artifacts(tmp_path / "a", tmp_path / "b")[0]
    assert first.startswith("cache/dataset_snapshot.json: train record 0: A's record is B's record ")
    assert "the order differs" in first


def test_planted_quote_change_is_named(tok, tmp_path):
    plain = [d.replace("\u201c", '"').replace("\u201d", '"') for d in DOCS]
    _pretrain(tok, tmp_path / "a" / "cache")
    _pretrain(tok, tmp_path / "b" / "cache", docs=DOCS[:5] + plain[5:])
    first = compare_artifacts(tmp_path / "a", tmp_path / "b")[0]
    assert first.startswith(
        "cache/dataset_snapshot.json: train record 5 field text differs only by Unicode quote characters"
    )
    assert "'\u201c'" in first


def test_snapshot_hash_catches_a_difference_past_the_first_records(tmp_path):
    recs = [{"text": f"r{i}"} for i in range(20)]
    write_dataset_snapshot(recs, tmp_path / "a" / "dataset_snapshot.json", n=4)
    write_dataset_snapshot(recs[:15] + [{"text": "other"}] + recs[16:], tmp_path / "b" / "dataset_snapshot.json", n=4)
    assert compare_artifacts(tmp_path / "a", tmp_path / "b") == [
        "dataset_snapshot.json: all: the first 4 records agree, but a later record differs (sha256 of all differs)"
    ]


def test_first_batch_names_the_drawn_examples(tok, tmp_path):
    convs = [{"messages": [{"role": "user", "content": [{"type": "text", "text": f"q{i}"}]},
                           {"role": "assistant", "content": [{"type": "text", "text": f"a{i}"}]}]}
             for i in range(30)]  # fmt: skip
    build_sft_cache({"train": convs}, tmp_path / "s", tokenizer=tok, val_frac=None, seed=0)
    ds = SFTExampleDataset(tmp_path / "s" / "train_tokens.bin", tmp_path / "s" / "train_idx.npy", T=16, pad_id=0)
    for run, seed in (("a", 1), ("b", 2)):
        x, y, ym = ds.get_batch(B=6, generator=torch.Generator().manual_seed(seed))
        dump_first_batch(tmp_path / run / "first_batch.json", x, y, ym, rows=ds.last_rows, meta={"step": 0})
    rows_a = json.loads((tmp_path / "a" / "first_batch.json").read_text())["rows"]
    rows_b = json.loads((tmp_path / "b" / "first_batch.json").read_text())["rows"]
    i = next(k for k, (p, q) in enumerate(zip(rows_a, rows_b)) if p != q)
    assert compare_artifacts(tmp_path / "a", tmp_path / "b") == [
        f"first_batch.json: batch 0 row {i}: A drew example {rows_a[i]['example']}, "
        f"B drew example {rows_b[i]['example']}"
    ]


def test_rendered_samples_mask_difference_and_serialization(tok, tmp_path):
    ids = tok.encode("abc", prepend="<|bos|>")
    write_rendered_samples([(ids, [0, 1, 1, 1])], tmp_path / "a" / "rendered_samples.json", tokenizer=tok)
    write_rendered_samples([(ids, [0, 1, 0, 1])], tmp_path / "b" / "rendered_samples.json", tokenizer=tok)
    assert compare_artifacts(tmp_path / "a", tmp_path / "b") == [
        "rendered_samples.json: train sample 0: loss mask differs first at position 2 ('b'): A [1], B [0] "
            "— same ids, so the chat template's loss masking changed"
    ]
    text = (tmp_path / "a" / "rendered_samples.json").read_text(encoding="utf-8")
    assert text == canonical_json(json.loads(text))


def test_text_difference_kinds():
    assert describe_text_difference("caf\u00e9", "cafe\u0301").startswith("differs only by Unicode normalization")
    assert describe_text_difference("a  b", "a b") == "differs only by whitespace"
    assert describe_text_difference("abcd", "abXd").startswith("differs first at char 2")


def test_data_inspect_cli(tok, tmp_path):
    _pretrain(tok, tmp_path / "c")
    tok.save(tmp_path / "tok")
    result = CliRunner().invoke(app, ["data", "inspect", str(tmp_path / "c"), "--tokenizer", str(tmp_path / "tok"),
                                      "--tokens", "20"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert 'kind: "pretrain"' in result.output and '"docs":30' in result.output and "window: shard 0" in result.output
    shutil.rmtree(tmp_path / "c" / "train")
    (tmp_path / "c" / "meta.json").unlink()
    result = CliRunner().invoke(app, ["data", "inspect", str(tmp_path / "c")])
    assert result.exit_code == 2 and "meta.json is missing" in result.output


def test_snapshot_hash_is_over_canonical_json_lines():
    import hashlib

    from lockstep.data.parity import SnapshotCollector

    recs = [{"text": 'a "quoted"\n\u00e9 \\ line'}, {"text": "x", "id": "1"}, {"text": "\u2028 \ud7ff"}]
    col = SnapshotCollector(1)
    for r in recs:
        col.add("train", r)
    want = hashlib.sha256("".join(canonical_json(r) for r in recs).encode("utf-8")).hexdigest()
    assert col.to_json()["splits"]["train"]["sha256"] == want


def test_parity_between_two_dvc_experiments(tmp_path, monkeypatch):
    """`lockstep parity NAME_A NAME_B` on DVC experiment names: artifacts come out of each
    experiment's commit and the DVC cache, not from the workspace."""
    import subprocess
    import sys

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    repo.mkdir()

    def run(*cmd: str) -> None:
        subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True)

    run("git", "init", "-q")
    run("git", "config", "user.email", "tests@lockstep")
    run("git", "config", "user.name", "tests")
    dvc = (sys.executable, "-m", "dvc")
    run(*dvc, "init", "-q")
    run(*dvc, "config", "core.analytics", "false")
    (repo / "params.yaml").write_text("quote: plain\n")
    (repo / "make.py").write_text(
        "import json, os, yaml\n"
        "q = yaml.safe_load(open('params.yaml'))['quote']\n"
        "text = 'He said \"hi\"' if q == 'plain' else 'He said \\u201chi\\u201d'\n"
        "os.makedirs('out/cache', exist_ok=True)\n"
        "snap = {'artifact': 'dataset_snapshot', 'n': 1,\n"
        "        'splits': {'train': {'count': 1, 'sha256': q, 'records': [{'text': text}]}}}\n"
        "json.dump(snap, open('out/cache/dataset_snapshot.json', 'w'), ensure_ascii=False, sort_keys=True)\n"
    )
    (repo / "dvc.yaml").write_text(
        "stages:\n  make:\n    cmd: python make.py\n    deps: [make.py]\n    params: [quote]\n    outs: [out]\n"
    )
    run("git", "add", "-A")
    run("git", "commit", "-qm", "init")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    run(*dvc, "exp", "run", "-q", "-n", "straight-quotes")
    run(*dvc, "exp", "run", "-q", "-n", "curly-quotes", "-S", "quote=curly")
    # The workspace now holds the second experiment; the first one's bytes exist only in git/DVC.
    monkeypatch.chdir(repo)
    result = CliRunner().invoke(app, ["parity", "straight-quotes", "curly-quotes"])
    assert result.exit_code == 1, result.output
    assert "train record 0 field text differs only by Unicode quote characters" in result.output
    result = CliRunner().invoke(app, ["parity", "curly-quotes", "curly-quotes"])
    assert result.exit_code == 0 and "no difference" in result.output
    result = CliRunner().invoke(app, ["parity", "straight-quotes", "no-such-experiment"])
    assert result.exit_code == 2


def _run_with_facts(root: Path, metrics: dict, numerics: dict | None) -> Path:
    """A run folder as a training stage leaves it: data/metrics/pretrain.json and its run facts."""
    (root / "data" / "metrics").mkdir(parents=True)
    (root / "data" / "runinfo").mkdir(parents=True)
    (root / "data" / "metrics" / "pretrain.json").write_text(canonical_json(metrics), encoding="utf-8")
    facts = {"train_time_s": 1.0, **({"numerics": numerics} if numerics is not None else {})}
    (root / "data" / "runinfo" / "pretrain.json").write_text(canonical_json(facts), encoding="utf-8")
    return root


HOST_A = {"cpu_capability": "AVX512", "threads": 2, "torch": "2.5.0", "device_name": "cpu A"}


def test_parity_says_which_numerics_facts_differ_when_metrics_do(tmp_path):
    a = _run_with_facts(tmp_path / "a", {"val_bpb": 1.929335, "steps": 10}, HOST_A)
    b = _run_with_facts(tmp_path / "b", {"val_bpb": 1.929728, "steps": 10},
                        {**HOST_A, "cpu_capability": "AVX2", "device_name": "cpu B"})
    diffs = compare_artifacts(a, b)
    assert diffs == ["data/metrics/pretrain.json: val_bpb: A 1.929335, B 1.929728; what decides the numerics differs: "
                     "cpu_capability A 'AVX512', B 'AVX2'; device_name A 'cpu A', B 'cpu B'"]
    result = CliRunner().invoke(app, ["parity", str(a), str(b)])
    assert result.exit_code == 1
    assert "first difference: data/metrics/pretrain.json: val_bpb" in result.output
    assert "cpu_capability A 'AVX512', B 'AVX2'" in result.output


def test_parity_names_a_fast_path_that_fell_back_in_one_run(tmp_path):
    a = _run_with_facts(tmp_path / "a", {"val_bpb": 1.0}, {**HOST_A, "fast_paths": "chunk_bodies=fast"})
    b = _run_with_facts(tmp_path / "b", {"val_bpb": 1.1}, {**HOST_A, "fast_paths": "chunk_bodies=reference"})
    (diff,) = compare_artifacts(a, b)
    assert diff.endswith("what decides the numerics differs: fast_paths A 'chunk_bodies=fast', "
                         "B 'chunk_bodies=reference'")


def test_parity_says_when_the_numerics_facts_agree_or_are_missing(tmp_path):
    a = _run_with_facts(tmp_path / "a", {"val_bpb": 1.0}, HOST_A)
    b = _run_with_facts(tmp_path / "b", {"val_bpb": 2.0}, HOST_A)
    c = _run_with_facts(tmp_path / "c", {"val_bpb": 2.0}, None)
    (same,) = compare_artifacts(a, b)
    assert same.endswith("both ran with the same CPU path, torch build, threads, device and fast paths, so their "
                         "params, seed, code or inputs differ")
    (missing,) = compare_artifacts(a, c)
    assert "run facts of B do not record what decides the numerics" in missing
    # Equal metrics are no difference, whatever the hosts.
    d = _run_with_facts(tmp_path / "d", {"val_bpb": 1.0}, {**HOST_A, "threads": 8})
    assert compare_artifacts(a, d) == []
