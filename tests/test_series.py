"""The per-step series writer: identical rows give identical bytes, values read back exactly,
timings and undeclared columns are refused, and a training run's series hold results only."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lockstep.core.runtime import Runtime
from lockstep.core.series import SeriesError, SeriesWriter, is_timed, read_series_file
from lockstep.model.gpt import GPT
from lockstep.train.trainer import SERIES_COLUMNS, ModelParams, TrainConfig, Trainer, Validation

COLUMNS = {"train": ("train_loss", "lr_mult"), "val": ("val_bpb",)}


def _rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    for step in range(1, 6):
        rows.append(
            {"step": step, "train_loss": 4.0 / step + torch.rand((), generator=g).item(), "lr_mult": 1.0 - step / 10}
        )
        if step % 2 == 0:
            rows.append({"step": step, "val_bpb": 3.0 / step})
    return rows


def _write(folder: Path, rows: list[dict]) -> list[Path]:
    writer = SeriesWriter(folder, COLUMNS)
    for row in rows:
        writer.add(row)
    return writer.write()


def test_identical_rows_write_identical_bytes(tmp_path: Path) -> None:
    a, b = _write(tmp_path / "a", _rows()), _write(tmp_path / "b", _rows())
    assert [p.name for p in a] == ["train.tsv", "val.tsv"]
    for pa, pb in zip(a, b):
        assert pa.read_bytes() == pb.read_bytes()
    assert (tmp_path / "a" / "train.tsv").read_text().splitlines()[0] == "step\ttrain_loss\tlr_mult"


def test_values_read_back_exactly(tmp_path: Path) -> None:
    rows = _rows() + [{"step": 7, "train_loss": float("nan")}]  # lr_mult missing: an empty cell
    _write(tmp_path, rows)
    back = read_series_file(tmp_path / "train.tsv")
    assert back["train_loss"][:5] == [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r][:5]
    assert back["train_loss"][5][0] == 7 and math.isnan(back["train_loss"][5][1])
    assert [s for s, _ in back["lr_mult"]] == [1, 2, 3, 4, 5]
    assert read_series_file(tmp_path / "val.tsv")["val_bpb"] == [(2, 1.5), (4, 0.75)]


@pytest.mark.parametrize("column", ["tok_per_s", "mfu", "dt_s", "train_time_s"])
def test_timing_columns_are_refused(tmp_path: Path, column: str) -> None:
    assert is_timed(column)
    with pytest.raises(SeriesError, match="is a timing; series hold results only"):
        SeriesWriter(tmp_path, {"train": ("train_loss", column)})
    writer = SeriesWriter(tmp_path, COLUMNS)
    with pytest.raises(SeriesError, match=rf"\['{column}'\] are not declared \(timings stay out of the series\)"):
        writer.add({"step": 1, "train_loss": 2.0, column: 1.0})


def test_rows_that_do_not_fit_are_refused(tmp_path: Path) -> None:
    writer = SeriesWriter(tmp_path, COLUMNS)
    with pytest.raises(SeriesError, match="not declared"):
        writer.add({"step": 1, "reward": 0.5})
    with pytest.raises(SeriesError, match="exactly one file"):
        writer.add({"step": 1, "train_loss": 2.0, "val_bpb": 1.0})
    with pytest.raises(SeriesError, match="integer `step`"):
        writer.add({"step": 1.5, "train_loss": 2.0})
    writer.add({"step": 2, "train_loss": 2.0})
    with pytest.raises(SeriesError, match="step 2 after step 2; steps must increase"):
        writer.add({"step": 2, "train_loss": 1.0})
    with pytest.raises(SeriesError, match="declared for both"):
        SeriesWriter(tmp_path, {"a": ("x",), "b": ("x",)})
    assert not list(tmp_path.iterdir()), "nothing is written before write()"


def test_training_series_hold_results_only(tmp_path: Path) -> None:
    """What lockstep.train.trainer reports per step fits the declared columns: no timing reaches a file."""
    V, T = 64, 16

    class Stream:
        def get_batch(self, *, B: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
            x = torch.randint(1, V, (B, T + 1), generator=generator)
            return x[:, :-1], x[:, 1:]

    assert not any(is_timed(c) for cols in SERIES_COLUMNS.values() for c in cols)
    model = GPT.build(ModelParams(depth=1, sequence_len=T, head_dim=16).gpt_config(V), "cpu", seed=0)
    cfg = TrainConfig(batch_tokens=2 * T, device_batch_rows=2, num_steps=3, eval_every_steps=2, eval_tokens=2 * T,
                      checkpoint_every_steps=0, peak_flops=1e12)
    writer = SeriesWriter(tmp_path / "plots", SERIES_COLUMNS)
    trainer = Trainer(
        model,
        cfg,
        Runtime(device=torch.device("cpu"), dtype=torch.float32, reason="test"),
        data=Stream(),
        seed=1,
        validation=Validation(Stream(), torch.ones(V, dtype=torch.int64)),
        on_step=writer.add,
    )
    trainer.fit(tmp_path / "run", {"code_revision": "test"})
    writer.write()
    assert [s for s, _ in read_series_file(tmp_path / "plots" / "train.tsv")["train_loss"]] == [1, 2, 3]
    assert [s for s, _ in read_series_file(tmp_path / "plots" / "val.tsv")["val_bpb"]] == [2, 3]
