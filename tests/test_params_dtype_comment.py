"""params.yaml's comment on `runtime.dtype: auto` says what `auto` picks on each kind of machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lockstep.core import runtime

ROOT = Path(__file__).resolve().parents[1]


def _dtype_comment(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.strip().startswith("dtype: auto"):
            return line.split("#", 1)[1]
    raise AssertionError(f"{path} has no `dtype: auto` line")


@pytest.mark.parametrize("native", [True, False])
def test_auto_on_cpu_matches_the_comment(monkeypatch, native: bool) -> None:
    monkeypatch.setattr(runtime.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(runtime, "cpu_bf16_features", lambda: ["avx512_bf16"] if native else [])
    _, dtype, _ = runtime.choose_device_dtype("auto", "auto")
    assert dtype == (torch.bfloat16 if native else torch.float32)
    comment = _dtype_comment(ROOT / "params.yaml")
    if native:
        assert "avx512_bf16" in comment and "AMX" in comment, comment
    assert "fp32" in comment and "fp32 on CPU" not in comment, comment
