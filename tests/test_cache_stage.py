"""The `cache@<name>` stage end to end on tiny raw snapshots: pretrain from documents, SFT from
problems, identical outputs on a rerun, and params that do not fit the snapshot refused."""

from __future__ import annotations

import pytest
import yaml

from _cache_stage import make_workdir, one_error_line, run_stage, tree
from lockstep.data.cache import CacheError, open_pretrain_split, open_sft_split


@pytest.fixture
def workdir(tmp_path, monkeypatch, repo_root):
    make_workdir(tmp_path, monkeypatch, repo_root)
    params = {
        "seed": 3,
        "data_seed": 4,
        "cache": {
            "notes": {"kind": "pretrain", "shard_bytes": 512, "shuffle_buffer": 4, "max_val_tokens": 100},
            "math": {"kind": "sft", "val_frac": 0.1},
            "wrong": {"kind": "sft"},
        },
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    return tmp_path


def test_cache_stage_pretrain_and_sft(workdir):
    from stages.cache import main

    meta = main(["notes", "--raw", "raw/notes", "--tokenizer", "tok", "--out", "cache/pretrain/notes"])
    split = open_pretrain_split(workdir / "cache/pretrain/notes/train", tokenizer_sha256=meta["tokenizer_sha256"])
    assert split.tokens == meta["train_tokens"] > 0 and len(split.shards) > 1
    assert meta["val_tokens"] == 100 and meta["dataset_name"] == "notes" and meta["seed"] == 4  # the data seed
    assert (workdir / "cache/pretrain/notes/rendered_samples.json").is_file()
    first = tree(workdir / "cache/pretrain/notes")
    main(["notes", "--raw", "raw/notes", "--tokenizer", "tok", "--out", "cache/pretrain/notes"])
    assert tree(workdir / "cache/pretrain/notes") == first

    meta = main(["math", "--raw", "raw/math", "--tokenizer", "tok", "--out", "cache/sft/math"])
    assert (meta["train_examples"], meta["val_examples"]) == (27, 3)  # 30 train problems, val_frac 0.1
    s = open_sft_split(workdir / "cache/sft/math/train_tokens.bin", workdir / "cache/sft/math/train_idx.npy")
    assert len(s) == 27 and int(s.mask.sum()) == meta["train_supervised_tokens"]


def test_cache_stage_refuses_a_kind_mismatch(workdir):
    from stages.cache import main

    with pytest.raises(CacheError, match="kind sft needs a conversation or problem snapshot"):
        main(["wrong", "--raw", "raw/notes", "--tokenizer", "tok", "--out", "cache/sft/wrong"])
    assert not (workdir / "cache/sft/wrong").exists()


def test_cache_stage_removes_work_left_by_a_killed_run_of_the_same_cache(workdir):
    from stages.cache import main

    root = workdir / "cache/pretrain"
    stale = root / ".notes.x1y2z3w4.tmp"  # what a killed build of this cache leaves
    (stale / "train").mkdir(parents=True)
    (stale / "train" / "shard_00000.bin").write_bytes(b"\0\0")
    other = root / ".roam.x1y2z3w4.tmp"  # another cache's work: not this stage's to remove
    other.mkdir()
    main(["notes", "--raw", "raw/notes", "--tokenizer", "tok", "--out", "cache/pretrain/notes"])
    assert sorted(p.name for p in root.iterdir()) == [".roam.x1y2z3w4.tmp", "notes"]


def test_cache_stage_reads_the_params_file_that_params_names(workdir):
    from stages.cache import main

    other = workdir / "other.yaml"
    other.write_text(
        yaml.safe_dump(
            {
                "seed": 3,
                "data_seed": 4,
                "cache": {"notes": {"kind": "pretrain", "shard_bytes": 512, "shuffle_buffer": 4, "max_val_tokens": 50}},
            }
        ),
        encoding="utf-8",
    )
    meta = main(
        ["notes", "--raw", "raw/notes", "--tokenizer", "tok", "--out", "cache/pretrain/notes", "--params", str(other)]
    )
    assert meta["val_tokens"] == 50  # params.yaml says 100


@pytest.mark.parametrize("name,kind,setting,key", [
    ("notes", "pretrain", {"val_frac": 0.1}, "cache.notes.val_frac=0.1 applies to SFT caches only"),
    ("math", "sft", {"max_train_tokens": 100}, "cache.math.max_train_tokens=100 applies to pretrain caches only"),
    ("math", "sft", {"max_val_tokens": 10}, "cache.math.max_val_tokens=10 applies to pretrain caches only"),
    ("math", "sft", {"num_workers": 2}, "cache.math.num_workers=2 applies to pretrain caches only"),
])  # fmt: skip
def test_a_setting_of_the_other_cache_kind_is_one_error_line(tmp_path, monkeypatch, repo_root, capsys, name, kind,
                                                             setting, key):
    make_workdir(tmp_path, monkeypatch, repo_root)
    params = yaml.safe_load((tmp_path / "params.yaml").read_text(encoding="utf-8"))
    params["cache"][name].update(setting)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    status, err = run_stage(monkeypatch, capsys, name, kind)
    assert status == 1 and key in one_error_line(err)
    assert not (tmp_path / "cache" / kind / name).exists()
