"""Each source states its own expected size (`size(cfg, *, name, root)` in its module,
lockstep.data.sources.size), and `lockstep plan` reads it there: a toy source, one module and one
`SOURCE_CONFIGS` line, is sized and its epochs estimated without any edit to the plan."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from lockstep.data.sources import SOURCE_CONFIGS, source_module
from lockstep.data.sources.fields import CheckedFields, Rule
from lockstep.data.sources.size import SourceSize, generated_examples
from lockstep.tools import plan

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ToyConfig(CheckedFields):
    source: Literal["toy"] = "toy"
    n_train: int = 300
    n_val: int = 30
    strict: bool = False
    artifact_records: int = 8

    RULES = {"n_train": Rule("conversations to generate for train", ge=0),
             "n_val": Rule("conversations to generate for val", ge=0),
             "artifact_records": Rule("records per split kept in the parity artifact", ge=0)}


def _toy_module() -> types.ModuleType:
    toy = types.ModuleType("lockstep.data.sources.toy")
    toy.KIND = "conversation"
    toy.EXTRA_FIELDS = ()
    toy.EXPECTED = "n_train + n_val > 0 conversations to generate"
    toy.ToyConfig = ToyConfig

    def size(cfg: ToyConfig, *, name: str, root: Path) -> SourceSize:
        return generated_examples(name, n_train=cfg.n_train, n_val=cfg.n_val, tokens_per_example=40)

    toy.size = size
    return toy


@pytest.fixture
def toy_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy source registered: its module where the sources' modules live, and its one line."""
    monkeypatch.setitem(sys.modules, "lockstep.data.sources.toy", _toy_module())
    monkeypatch.setitem(SOURCE_CONFIGS, "toy", ToyConfig)


def test_a_toy_source_is_sized_by_its_own_module(toy_source: None) -> None:
    size = plan.source_size("drills", {"source": "toy", "n_train": 500}, root=ROOT)
    assert size == SourceSize(train_examples=500, val_examples=30, tokens_per_example=40, basis="fetch.drills.n_train")
    params = {"fetch": {"drills": {"source": "toy", "n_train": 500}}, "tokenizer": {"vocab_size": 4096},
              "cache": {"drills": {"kind": "sft", "val_frac": 0.1}}}
    holding = plan.estimated_holding("drills", params, seq_len=256, root=ROOT)
    assert (holding.kind, holding.examples, holding.tokens) == ("sft", 450, 450 * 40)
    assert holding.origin == "estimate: fetch.drills.n_train"


def test_a_source_without_a_size_is_unknown_to_the_plan(toy_source: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(sys.modules["lockstep.data.sources.toy"], "size")
    assert plan.source_size("drills", {"source": "toy"}, root=ROOT) is None


@pytest.mark.parametrize("source", sorted(set(SOURCE_CONFIGS) - {"dclm_core"}))
def test_every_record_source_states_its_size(source: str) -> None:
    """Every source but the file bundle (whose items the plan counts from CORE's facts) states
    a size, with its basis named."""
    assert callable(getattr(source_module(source), "size", None)), f"lockstep.data.sources.{source} has no size()"
    size = plan.source_size(
        source,
        {"source": source, "path": "corpus"} if source in ("roam", "gutenberg") else {"source": source},
        root=ROOT,
    )
    assert size is not None and size.basis
