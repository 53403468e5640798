"""Tokenizer kinds as plug-ins: one table (lockstep.tokenizer.kinds.KINDS) names each kind's
options and trainer; the stages that only load a tokenizer import no trainer and no dictionary
reader, so editing one reruns the tokenizer stage alone; a new kind is one module plus one line in
the table (tests/_toy_kind.py is written the way docs/internals.md says)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import lockstep.tokenizer  # noqa: F401  # every kind's encoder registers with load_tokenizer
from lockstep.core.codeid import module_files
from lockstep.core.config import ConfigError, build_config
from lockstep.data.sources import fetch_source
from lockstep.data.sources.synth_math import SynthMathConfig
from lockstep.dev.dvcdeps import project_roots, stage_deps
from lockstep.pipeline.tokenizer import TokenizerConfig, run_tokenizer_stage
from lockstep.tokenizer import base, load_tokenizer
from lockstep.tokenizer.kinds import KINDS, TokenizerKind, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = "lib/lockstep/tokenizer/"


def _file(obj: object) -> str:
    return Path(inspect.getfile(obj)).resolve().relative_to(ROOT).as_posix()  # type: ignore[arg-type]


def _training_side() -> set[str]:
    """Files only training needs: each kind's trainer and options modules, the table, the stage's
    work (lockstep.pipeline.tokenizer), and LZ78's dictionary interchange (TSV reading and writing)
    with its kernels."""
    files = {_file(k.train) for k in KINDS.values()} | {_file(k.options) for k in KINDS.values()}
    files |= {TOKENIZER + name for name in ("kinds.py", "options.py", "lz78/tsv.py", "lz78/tsv_kernels.py",
                                            "lz78/train.py", "lz78/train_kernels.py")}  # fmt: skip
    return files | {"lib/lockstep/pipeline/tokenizer.py"}


def test_only_the_tokenizer_stage_depends_on_trainers_and_the_tsv_module() -> None:
    """What an edit of a trainer or of the TSV reader reruns, from the same scan that writes
    dvc.yaml's deps: the tokenizer stage, and no stage that only loads a tokenizer."""
    training = _training_side()
    assert TOKENIZER + "lz78/tsv.py" in training and TOKENIZER + "bpe_train.py" in training
    users = {s.stage: set(s.expected) for s in stage_deps(ROOT / "dvc.yaml")}
    for stage, files in users.items():
        if stage == "tokenizer":
            assert training <= files, sorted(training - files)
        else:
            assert not files & training, (stage, sorted(files & training))
    rerun_by_tsv_edit = sorted(stage for stage, files in users.items() if TOKENIZER + "lz78/tsv.py" in files)
    assert rerun_by_tsv_edit == ["tokenizer"]
    # ... while every stage that loads a tokenizer still depends on every kind's encoder.
    encoders = {_file(cls) for cls in base._KINDS.values()}
    for stage in ("cache", "pretrain", "eval", "rl"):
        assert encoders <= users[stage], (stage, sorted(encoders - users[stage]))


def test_every_kind_in_the_table_loads_on_the_encoding_path() -> None:
    """A kind's encoder module is imported by lockstep.tokenizer (what load_tokenizer's callers
    import): a kind in the table whose folders no stage could load fails here."""
    encoding_path = {
        f.resolve().relative_to(ROOT).as_posix() for f in module_files("lockstep.tokenizer", project_roots(ROOT))
    }
    assert set(KINDS) == {k for k in base._KINDS if k != "toy"}
    for kind in KINDS:
        assert _file(base.tokenizer_class(kind)) in encoding_path, kind
    assert not encoding_path & _training_side()


# ---- a new kind by the recipe -----------------------------------------------------------------


@pytest.fixture()
def toy(monkeypatch: pytest.MonkeyPatch):
    from tests import _toy_kind

    # The recipe's one registry line: the kind's options and trainer in the table.
    monkeypatch.setitem(KINDS, "toy", TokenizerKind(_toy_kind.ToyOptions, _toy_kind.train))
    base.register_kind(_toy_kind.ToyTokenizer)  # what importing its module did; undone below
    yield _toy_kind
    base.unregister_kind("toy")


def test_a_toy_kind_trains_saves_loads_and_encodes_through_the_public_paths(toy, tmp_path: Path) -> None:
    texts = ["abracadabra, the toy said", "a b c"]
    tok = train_tokenizer("toy", texts, order="frequency")
    assert tok.encode("a")[0] == 0  # the most frequent byte
    tok.save(tmp_path / "api")
    loaded = load_tokenizer(tmp_path / "api")
    assert type(loaded) is toy.ToyTokenizer and loaded.sha256 == tok.sha256
    assert loaded.encode("abc", prepend="<|bos|>") == tok.encode("abc", prepend="<|bos|>")
    assert loaded.decode(loaded.encode("héllo")) == "héllo"

    # The params path: the kind's options under tokenizer.options, checked like any section.
    cfg = build_config(TokenizerConfig, {"kind": "toy", "train_sources": ["math"], "metric_sources": ["math"],
                                         "options": {"order": "value"}}, where="tokenizer")  # fmt: skip
    assert isinstance(cfg.kind_options, toy.ToyOptions) and not cfg.kind_options.uses_vocab_size()
    with pytest.raises(ConfigError, match=r"^tokenizer.options.min_count=-1 must be >= 0"):
        build_config(
            TokenizerConfig, {"kind": "toy", "train_sources": ["a"], "options": {"min_count": -1}}, where="tokenizer"
        )
    with pytest.raises(ConfigError, match=r"unknown key\(s\) tokenizer.options.strategy; valid keys: min_count, order"):
        build_config(
            TokenizerConfig, {"kind": "toy", "train_sources": ["a"], "options": {"strategy": "x"}}, where="tokenizer"
        )
    raw = tmp_path / "raw"
    fetch_source("math", SynthMathConfig(n_train=20, n_val=4), raw / "math", seed=3)
    metrics = run_tokenizer_stage(cfg, raw, tmp_path / "stage", tmp_path / "m.json", seed=3)
    staged = load_tokenizer(tmp_path / "stage")
    assert metrics["kind"] == "toy" and metrics["tokenizer_sha256"] == staged.sha256
    assert staged.encode("abc") == [97, 98, 99]  # order: value


def test_the_toy_kind_is_gone_after_the_test() -> None:
    assert "toy" not in KINDS and "toy" not in base._KINDS
    with pytest.raises(ValueError, match="unknown tokenizer kind 'toy'"):
        train_tokenizer("toy", ["x"])
