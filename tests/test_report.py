"""The report card renders from a fixture metrics set; every chart is a valid PNG."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

from lockstep.report import build_report, flatten, load_metrics, read_series
from lockstep.series import SeriesWriter

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ENV = {"code revision": "abc123", "python": "3.11", "torch": "2.13.0"}


def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"{path}: bad CRC in {kind!r}"
        chunks.append(kind)
        pos += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100


@pytest.fixture()
def run_files(tmp_path: Path) -> tuple[Path, Path]:
    metrics, plots = tmp_path / "metrics", tmp_path / "plots"
    metrics.mkdir()
    for stage, n in (("pretrain", 1), ("midtrain", 2), ("sft", 3), ("rl", 4)):
        (metrics / f"{stage}.json").write_text(json.dumps({"train_time_s": 10.0 * n, "tokens": 1000 * n, "final_loss": 3.0 / n}))
        (metrics / f"eval_{stage}.json").write_text(json.dumps({
            "core": 0.1 * n, "bpb": {"shakespeare": 2.0 / n}, "device": "cpu", "dtype": "float32",
            **({"chatcore": 0.05 * n, "gsm8k.accuracy": 0.01 * n} if stage != "pretrain" else {}),
        }))
        d = plots / stage
        d.mkdir(parents=True)
        cols = "step\tloss\tval_bpb\n" if stage != "rl" else "step\treward\tpass@1\n"
        (d / "train.tsv").write_text(cols + "".join(f"{s}\t{3.0 - s / 10}\t{2.5 - s / 20}\n" for s in range(5)))
    (metrics / "tokenizer.json").write_text(json.dumps({"bytes_per_token": {"shakespeare": 3.9}, "vocab_size": 4096}))
    return metrics, plots


def test_series_are_named_by_stage_in_the_layout_the_stages_write(tmp_path: Path) -> None:
    # The stages write with lockstep.series: <stage>/train.tsv and <stage>/val.tsv.
    plots = tmp_path / "plots"
    for stage, start in (("pretrain", 8.0), ("midtrain", 3.0), ("sft", 1.0)):
        writer = SeriesWriter(plots / stage, {"train": ("train_loss", "lr_mult"), "val": ("val_bpb",)})
        for s in (1, 2, 3):
            writer.add({"step": s, "train_loss": start - s / 10, "lr_mult": 1.0})
        writer.add({"step": 3, "val_bpb": start / 2})
        writer.write()
    rl = SeriesWriter(plots / "rl", {"train": ("reward",), "val": ("val_pass@1",)})
    rl.add({"step": 1, "reward": 0.5})
    rl.add({"step": 2, "reward": 0.7})
    rl.write()  # no held-out row: val.tsv holds its header only
    (plots / "pretrain" / "first_batch.json").write_text("{}")  # the parity artifact beside the series
    series = read_series(plots)
    assert set(series["train_loss"]) == {"pretrain", "midtrain", "sft"}  # one line per stage
    assert series["train_loss"]["midtrain"] == [(1.0, 2.9), (2.0, 2.8), (3.0, 2.7)]
    assert series["val_bpb"]["sft"] == [(3.0, 0.5)]
    assert series["reward"] == {"rl": [(1.0, 0.5), (2.0, 0.7)]}
    assert "val_pass@1" not in series  # an empty series draws no chart


def test_report_renders_from_fixture(tmp_path: Path, run_files: tuple[Path, Path]) -> None:
    metrics, plots = run_files
    out = build_report(metrics, plots, tmp_path / "report", environment=ENV)
    text = out.read_text()
    assert "| metric | BASE | MID | SFT | RL |" in text
    assert "| core | 0.1000 | 0.2000 | 0.3000 | 0.4000 |" in text
    assert "| chatcore | - | 0.1000 | 0.1500 | 0.2000 |" in text
    assert text.index("| core |") < text.index("| bpb.shakespeare |")
    assert "| train_time_s | 10.0000 | 20.0000 | 30.0000 | 40.0000 |" in text
    assert "bytes_per_token.shakespeare" in text and "abc123" in text and "eval_sft: dtype" in text
    charts = sorted(p.name for p in (tmp_path / "report").glob("*.png"))
    assert charts == ["loss.png", "pass_1.png", "reward.png", "val_bpb.png"]
    for png in (tmp_path / "report").glob("*.png"):
        _check_png(png)
        assert f"]({png.name})" in text


def test_report_is_reproducible(tmp_path: Path, run_files: tuple[Path, Path]) -> None:
    metrics, plots = run_files
    a = build_report(metrics, plots, tmp_path / "a", environment=ENV).parent
    b = build_report(metrics, plots, tmp_path / "b", environment=ENV).parent
    assert {p.name: p.read_bytes() for p in a.iterdir()} == {p.name: p.read_bytes() for p in b.iterdir()}


def test_missing_metrics_folder_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="dvc repro"):
        load_metrics(tmp_path / "nope")


def test_tsv_without_step_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pretrain").mkdir()
    (tmp_path / "pretrain" / "x.tsv").write_text("loss\n1.0\n")
    with pytest.raises(ValueError, match="step"):
        read_series(tmp_path)


def test_flatten() -> None:
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a.b": 1, "a.c.d": 2, "e": 3}
