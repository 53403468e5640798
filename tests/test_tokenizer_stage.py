"""Tokenizer stage pieces: the bytes/token metric on a hand-made case, the train-text cap, record
texts, determinism across processes, and the stage run on real raw snapshots (with the bytes a
char alphabet loses, and the char reference rule without special tokens)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from lockstep.core.config import ConfigError, build_config
from lockstep.data.cache_build import build_sft_cache
from lockstep.data.sources import SnapshotError, fetch_source, iter_records
from lockstep.data.sources.roam import RoamConfig
from lockstep.data.sources.synth_chat import SynthChatConfig
from lockstep.data.sources.synth_math import SynthMathConfig
from lockstep.pipeline import tokenizer as pipeline
from lockstep.pipeline.tokenizer import (
    CappedTexts,
    TokenizerConfig,
    bytes_per_token,
    capped_train_texts,
    record_texts,
    run_tokenizer_stage,
    snapshot_texts,
)
from lockstep.tokenizer import load_tokenizer
from lockstep.tokenizer.base import NoSpecialTokensError
from lockstep.tokenizer.kinds import train_tokenizer
from lockstep.tokenizer.lz78.train import train as train_lz78_tokenizer
from lockstep.tokenizer.lz78.tsv import CompressedDictionary, write_compressed_tsv

ROOT = Path(__file__).resolve().parents[1]


def test_bytes_per_token_hand_made() -> None:
    # One merge is learned from "abab...": the token "ab". "abab" -> [ab, ab] (4 bytes, 2 tokens);
    # "é" has no merge -> its 2 UTF-8 bytes (2 bytes, 2 tokens). Total 6 bytes / 4 tokens.
    tok = train_tokenizer("bpe", ["ab" * 50], vocab_size=256 + 1 + 9)
    assert tok.get_vocab_size() == 266
    assert len(tok.encode("abab")) == 2 and len(tok.encode("é")) == 2
    m = bytes_per_token(tok, ["abab", "é"], num_threads=1)
    assert m == {"bytes": 6, "tokens": 4, "bytes_per_token": 1.5, "unknown_bytes": 0, "kept_bytes_per_token": 1.5}
    byte = train_tokenizer("byte", [])
    assert bytes_per_token(byte, ["héllo"])["bytes_per_token"] == 1.0
    # A char alphabet of "ab": "c" (1 byte) and "é" (2 bytes) encode to id 0, one token per byte.
    # 5 bytes in 5 tokens, of which 2 bytes survive.
    char = train_tokenizer("char", ["ab"])
    m = bytes_per_token(char, ["abc", "é"])
    assert m == {"bytes": 5, "tokens": 5, "bytes_per_token": 1.0, "unknown_bytes": 3, "kept_bytes_per_token": 0.4}
    with pytest.raises(ValueError, match="val split is not empty"):
        bytes_per_token(byte, [""])


@pytest.mark.parametrize("kind", ["bpe", "byte", "char"])
def test_bytes_per_token_on_threads_counts_every_text_once(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Texts of very different sizes over several batches: the threaded batch call must neither
    # drop nor repeat a text.

    tok = (
        train_tokenizer("bpe", ["ab" * 50], vocab_size=256 + 1 + 9) if kind == "bpe" else train_tokenizer(kind, ["abx"])
    )
    texts = ["abab" * (i % 7) + "é" * (i % 3) + "x" for i in range(300)] + ["ab" * 5000]
    serial = bytes_per_token(tok, texts, num_threads=1)
    assert serial["tokens"] == sum(len(tok.encode(t)) for t in texts)
    assert serial["bytes"] == sum(len(t.encode("utf-8")) for t in texts)
    monkeypatch.setattr(pipeline, "METRIC_BATCH_TEXTS", 64)
    assert bytes_per_token(tok, texts, num_threads=3) == serial


def test_capped_texts_is_exact_and_ordered() -> None:
    capped = CappedTexts([["abc", "defg"], ["hij"], ["never"]], max_chars=8)
    assert list(capped) == ["abc", "defg", "h"]
    assert (capped.chars, capped.texts) == (8, 3)


def test_record_texts() -> None:
    assert record_texts("document", {"text": "hello"}) == ["hello"]
    conv = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "S"}]},
            {"role": "user", "content": [{"type": "text", "text": "U"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "python", "text": "1+1"},
                                              {"type": "python_output", "text": "2"}]},
        ]
    }  # fmt: skip
    assert record_texts("conversation", conv) == ["S", "U", "A", "1+1", "2"]
    problem = {"question": "What is 48/2?", "answer": "Half is <<48/2=24>>24.\n#### 24"}
    assert record_texts("problem", problem) == ["What is 48/2?", "Half is ", "48/2", "24", "24.\n#### 24"]
    with pytest.raises(ValueError, match="record kind"):
        record_texts("image", {})


def test_config_refuses_bad_values() -> None:
    with pytest.raises(ConfigError, match="tokenizer.kind"):
        build_config(TokenizerConfig, {"kind": "wordpiece", "train_sources": ["a"]}, where="tokenizer")
    with pytest.raises(ConfigError, match="tokenizer.vocab"):
        build_config(TokenizerConfig, {"vocab": 10, "train_sources": ["a"]}, where="tokenizer")
    with pytest.raises(ConfigError, match=r"^tokenizer.train_sources=\[\] names no raw source"):
        build_config(TokenizerConfig, {"kind": "bpe"}, where="tokenizer")
    byte = build_config(TokenizerConfig, {"kind": "byte"})
    assert not byte.kind_options.uses_vocab_size() and byte.kind_options.train_kwargs(seed=0, root=Path(".")) == {}
    # The char options' defaults keep today's char tokenizer: the most frequent bytes, specials after.
    char = build_config(TokenizerConfig, {"kind": "char", "train_sources": ["a"]})
    assert not char.kind_options.uses_vocab_size()
    assert char.kind_options.train_kwargs(seed=0, root=Path(".")) == {
        "max_alphabet": 65,
        "order": "frequency",
        "specials": True,
    }
    ref = build_config(TokenizerConfig, {"kind": "char", "train_sources": ["a"],
                                         "options": {"order": "sorted", "specials": False}},
                       where="tokenizer")  # fmt: skip
    assert ref.kind_options.train_kwargs(seed=0, root=Path(".")) == {
        "max_alphabet": 65,
        "order": "sorted",
        "specials": False,
    }
    with pytest.raises(
        ConfigError, match=r"tokenizer.options.order='alphabetical' must be one of \['frequency', 'sorted'\]"
    ):
        build_config(TokenizerConfig, {"kind": "char", "train_sources": ["a"], "options": {"order": "alphabetical"}},
                     where="tokenizer")  # fmt: skip
    # Options belong to their kind: another kind's are unknown keys, listing the valid ones.
    with pytest.raises(ConfigError, match=r"unknown key\(s\) tokenizer.options.specials; valid keys: $"):
        build_config(
            TokenizerConfig, {"kind": "bpe", "train_sources": ["a"], "options": {"specials": False}}, where="tokenizer"
        )
    with pytest.raises(ConfigError, match=r"tokenizer.options.max_alphabet=0 must be an integer in \[1, 256\]"):
        build_config(
            TokenizerConfig, {"kind": "char", "train_sources": ["a"], "options": {"max_alphabet": 0}}, where="tokenizer"
        )


@pytest.mark.parametrize(("old", "new"), [
    ("lz78_strategy", "options.strategy"), ("lz78_gate_period_phrases", "options.gate_period_phrases"),
    ("lz78_gate_min_count", "options.gate_min_count"), ("lz78_round_factor", "options.round_factor"),
    ("lz78_chunking", "options.chunking"), ("lz78_dictionary", "options.dictionary"),
    ("lz78_prefixes", "options.prefixes"),
    ("spm_model_type", "options.model_type"), ("char_max_alphabet", "options.max_alphabet"),
    ("char_order", "options.order"), ("char_specials", "options.specials"),
])  # fmt: skip
def test_a_flat_key_of_one_kind_names_its_new_place(old: str, new: str) -> None:
    with pytest.raises(
        ConfigError, match=rf"^tokenizer.{old} has moved: set tokenizer.{new} instead \(with kind: \w+\)$"
    ):
        build_config(TokenizerConfig, {"kind": "bpe", "train_sources": ["a"], old: 1}, where="tokenizer")


_TRAIN_IN_CHILD = """
import sys
from lockstep.tokenizer.kinds import train_tokenizer
texts = ["Whether 'tis nobler in the mind to suffer\\n",
         "The slings and arrows of outrageous fortune, 1234 \\u00e9\\u6f22"] * 3
for kind, vocab in (("char", None), ("bpe", 290), ("sentencepiece", 300)):
    print(kind, train_tokenizer(kind, texts, vocab_size=vocab).sha256)
"""


def test_training_is_identical_across_processes_and_hash_seeds() -> None:
    outputs = set()
    for hash_seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", _TRAIN_IN_CHILD], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(out.stdout)
    assert len(outputs) == 1, outputs
    assert len(outputs.pop().splitlines()) == 3


def test_char_alphabet_parity_case(shared_fixtures: Path) -> None:
    text = (shared_fixtures / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    tok = train_tokenizer("char", [text])
    assert len(tok.alphabet) == 65 and tok.get_vocab_size() == 65 + 9
    assert tok.decode(tok.encode(text)) == text
    assert tok.alphabet[0] == ord("\n") and tok.encode("\n") == [0]
    assert tok.encode("~") == [0]  # an unknown byte maps to id 0
    capped = train_tokenizer("char", [text], max_alphabet=3)
    # The three most frequent bytes of the play, in sorted byte order.
    assert bytes(capped.alphabet) == b" et"


def _snapshots(tmp_path: Path) -> Path:
    """Tiny raw snapshots of three record kinds, written by the real fetch code."""
    notes = tmp_path / "notes"
    notes.mkdir()
    for i in range(6):
        (notes / f"note{i}.md").write_text(
            f"# Note {i}\n\nThe tokenizer learns merges from text like this, {i * 37}.\n" * 5
        )
    raw = tmp_path / "raw"
    fetch_source("notes", RoamConfig(path=str(notes), val_frac=0.34), raw / "notes", seed=3)
    fetch_source("math", SynthMathConfig(n_train=40, n_val=8), raw / "math", seed=3)
    fetch_source("chat", SynthChatConfig(n_train=30, n_val=6), raw / "chat", seed=3)
    return raw


@pytest.mark.parametrize("kind", ["bpe", "char", "hf", "lz78"])
def test_stage_end_to_end_is_reproducible(tmp_path: Path, kind: str) -> None:
    raw = _snapshots(tmp_path)
    cfg = TokenizerConfig(kind=kind, vocab_size=300, train_sources=("notes", "chat", "math"), max_chars=5000,
                          metric_sources=("notes", "math", "chat"))  # fmt: skip
    m1 = run_tokenizer_stage(cfg, raw, tmp_path / "tok1", tmp_path / "m1.json", seed=3)
    m2 = run_tokenizer_stage(cfg, raw, tmp_path / "tok2", tmp_path / "m2.json", seed=3)
    assert (tmp_path / "m1.json").read_bytes() == (tmp_path / "m2.json").read_bytes()
    for p in sorted((tmp_path / "tok1").iterdir()):
        assert p.read_bytes() == (tmp_path / "tok2" / p.name).read_bytes(), p.name
    tok = load_tokenizer(tmp_path / "tok1")
    assert m1 == m2 and m1["tokenizer_sha256"] == tok.sha256 and m1["train_chars"] == 5000
    assert json.loads((tmp_path / "m1.json").read_text()) == m1
    # The reported figure is exactly bytes / tokens of each val split's texts.
    for name in cfg.metric_sources:
        texts = list(snapshot_texts(raw / name, "val"))
        n_bytes = sum(len(t.encode("utf-8")) for t in texts)
        n_tokens = sum(len(tok.encode(t)) for t in texts)
        assert m1["val_bytes"][name] == n_bytes and m1["val_tokens"][name] == n_tokens
        assert m1["bytes_per_token"][name] == pytest.approx(n_bytes / n_tokens)
        # Bytes lost to the unknown id: those outside a char alphabet; a bpe tokenizer spells every byte.
        n_unknown = sum(b not in tok.alphabet for t in texts for b in t.encode("utf-8")) if kind == "char" else 0
        assert m1["val_unknown_bytes"][name] == n_unknown
        assert m1["kept_bytes_per_token"][name] == pytest.approx((n_bytes - n_unknown) / n_tokens)
    # The report keeps the order of params.
    assert list(m1["bytes_per_token"]) == list(m1["val_tokens"]) == list(cfg.metric_sources)
    # Counting on 3 encoder threads changes nothing.
    threaded = dataclasses.replace(cfg, encode_threads=3)
    assert run_tokenizer_stage(threaded, raw, tmp_path / "tok3", tmp_path / "m3.json", seed=3) == m1


def test_stage_reads_a_brought_lz78_dictionary(tmp_path: Path) -> None:
    raw = _snapshots(tmp_path)
    trained = train_lz78_tokenizer(list(snapshot_texts(raw / "notes", "train")), vocab_size=300)
    (tmp_path / "corpus" / "dictionaries").mkdir(parents=True)
    write_compressed_tsv(
        tmp_path / "corpus" / "dictionaries" / "notes.tsv", CompressedDictionary.from_trie(trained.trie)
    )
    cfg = TokenizerConfig(kind="lz78", vocab_size=999, train_sources=(), metric_sources=("notes",),
                          options={"dictionary": "corpus/dictionaries/notes.tsv"})  # fmt: skip
    m = run_tokenizer_stage(cfg, raw, tmp_path / "tok", tmp_path / "m.json", seed=3, root=tmp_path)
    tok = load_tokenizer(tmp_path / "tok")
    # the file decides the vocabulary, and a canonical compressed trie keeps every code
    assert m["vocab_size"] == tok.get_vocab_size() == trained.get_vocab_size() and m["train_chars"] == 0
    assert tok.has_hierarchical_parents and (tmp_path / "tok" / "lz78_hier_parent.npy").is_file()
    text = "The tokenizer learns merges from text like this, 74."
    assert tok.encode(text) == trained.encode(text)
    with pytest.raises(ConfigError, match="unknown key"):
        TokenizerConfig(kind="bpe", train_sources=("notes",), options={"dictionary": "corpus/dictionaries/notes.tsv"})
    for bad in ("/tmp/notes.tsv", "corpus/dictionaries/../notes.tsv", "notes.tsv"):
        with pytest.raises(ConfigError, match="under corpus/dictionaries/"):
            TokenizerConfig(kind="lz78", options={"dictionary": bad})
    with pytest.raises(ConfigError, match="options.round_factor=0"):
        TokenizerConfig(kind="lz78", train_sources=("notes",), options={"round_factor": 0})
    with pytest.raises(ConfigError, match="options.portable=True applies to training"):
        TokenizerConfig(kind="lz78", options={"dictionary": "corpus/dictionaries/notes.tsv", "portable": True})
    with pytest.raises(ConfigError, match="tokenizer.options.portable"):
        TokenizerConfig(kind="lz78", train_sources=("notes",), options={"portable": "yes"})


def test_stage_reports_the_bytes_a_char_alphabet_loses(tmp_path: Path) -> None:
    """A char alphabet learned from notes, cut to its 20 most frequent bytes, has no digits: the
    math source loses them to id 0 and still encodes one token per byte, so bytes/token reads 1.0;
    the stage says how many bytes were lost and counts only the survivors in kept_bytes_per_token."""
    raw = _snapshots(tmp_path)
    cfg = TokenizerConfig(
        kind="char", options={"max_alphabet": 20}, train_sources=("notes",), metric_sources=("notes", "math")
    )
    m = run_tokenizer_stage(cfg, raw, tmp_path / "tok", tmp_path / "m.json", seed=3)
    assert json.loads((tmp_path / "m.json").read_text()) == m
    # The alphabet by hand: the 20 most frequent bytes of the train text, ties to the lower byte.
    counts = Counter(b for t in capped_train_texts(cfg, [raw / "notes"]) for b in t.encode("utf-8"))
    alphabet = set(sorted(counts, key=lambda b: (-counts[b], b))[:20])
    assert not alphabet & set(b"0123456789")
    for name in cfg.metric_sources:
        val = b"".join(t.encode("utf-8") for t in snapshot_texts(raw / name, "val"))
        lost = sum(b not in alphabet for b in val)
        assert m["val_unknown_bytes"][name] == lost and m["bytes_per_token"][name] == 1.0
        assert m["kept_bytes_per_token"][name] == pytest.approx((len(val) - lost) / len(val))
    math_val = b"".join(t.encode("utf-8") for t in snapshot_texts(raw / "math", "val"))
    assert m["val_unknown_bytes"]["math"] >= sum(chr(b).isdigit() for b in math_val) > 0


def test_stage_reference_rule_without_special_tokens(tmp_path: Path) -> None:
    """char `order: sorted, specials: false`: the saved tokenizer gives the reference rule's
    ids on the train text, the artifact renders documents without BOS and leaves chat sources out,
    and a cache refuses the tokenizer at once."""
    raw = _snapshots(tmp_path)
    cfg = TokenizerConfig(kind="char", options={"order": "sorted", "specials": False, "max_alphabet": 24},
                          train_sources=("notes", "chat"), metric_sources=("notes", "math", "chat"))  # fmt: skip
    m = run_tokenizer_stage(cfg, raw, tmp_path / "tok", tmp_path / "m.json", seed=3)
    corpus = b"".join(t.encode("utf-8") for t in capped_train_texts(cfg, [raw / "notes", raw / "chat"]))
    vocab = sorted(set(corpus))[:24]
    stoi = {b: i for i, b in enumerate(vocab)}
    tok = load_tokenizer(tmp_path / "tok")
    assert m["vocab_size"] == tok.get_vocab_size() == len(vocab) == 24 and not tok.has_special_tokens
    assert tok.encode(corpus.decode("utf-8")) == [stoi.get(b, 0) for b in corpus]
    for name in cfg.metric_sources:
        val = b"".join(t.encode("utf-8") for t in snapshot_texts(raw / name, "val"))
        assert m["val_unknown_bytes"][name] == sum(b not in stoi for b in val)
    assert m["val_unknown_bytes"]["chat"] > 0  # 24 of the corpus's distinct bytes leave lowercase letters out

    rendered = json.loads((tmp_path / "tok" / "rendered_samples.json").read_text())
    assert rendered["bos_id"] is None and rendered["samples"]
    assert {s["split"] for s in rendered["samples"]} == {"notes/train"}
    first_doc = next(iter(snapshot_texts(raw / "notes", "train"))).encode("utf-8")
    assert rendered["samples"][0]["ids"] == [stoi.get(b, 0) for b in first_doc][: len(rendered["samples"][0]["ids"])]

    with pytest.raises(NoSpecialTokensError, match="tokenizer.options.specials: true"):
        build_sft_cache(
            {"train": iter_records(raw / "chat", "train")}, tmp_path / "cache", tokenizer=tok, val_frac=None, seed=3
        )
    assert not (tmp_path / "cache").exists()


def test_stage_cli_and_missing_snapshot(tmp_path: Path) -> None:
    raw = _snapshots(tmp_path)
    params = tmp_path / "params.yaml"
    params.write_text(
        "seed: 3\ndata_seed: 3\ntokenizer:\n  kind: bpe\n  vocab_size: 280\n  train_sources: [notes]\n"
        "  max_chars: 100000\n"
        "  metric_sources: [notes, chat]\n"
    )
    cmd = [sys.executable, "-m", "stages.tokenizer", "--raw", str(raw), "--out", str(tmp_path / "tok"),
           "--metrics", str(tmp_path / "metrics.json"), "--params", str(params)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert set(metrics["bytes_per_token"]) == {"notes", "chat"} and metrics["vocab_size"] <= 280

    cfg = TokenizerConfig(train_sources=("notes",), metric_sources=("notes", "wikitext"))
    with pytest.raises(FileNotFoundError, match="dvc repro fetch@wikitext"):
        run_tokenizer_stage(cfg, raw, tmp_path / "tok", tmp_path / "metrics.json", seed=3)


@pytest.mark.parametrize("damage", ["decodable", "undecodable", "val"])
def test_stage_refuses_a_damaged_part_and_publishes_nothing(tmp_path: Path, damage: str) -> None:
    """Every part is hashed before training: a part that does not match meta.json fails with the
    sha256 error, whether it decodes or not, and no tokenizer or metrics are written."""
    raw = _snapshots(tmp_path)
    part = raw / "notes" / ("val" if damage == "val" else "train") / "part_00000.parquet"
    if damage == "undecodable":
        part.write_bytes(part.read_bytes()[:-40] + b"\0" * 40)  # footer gone
    else:  # same schema, other text: decodes fine
        table = pq.read_table(part)
        pq.write_table(table.set_column(0, "text", [[t.upper() for t in table.column("text").to_pylist()]]), part)
    cfg = TokenizerConfig(vocab_size=280, train_sources=("notes",), metric_sources=("notes", "chat"))
    with pytest.raises(SnapshotError, match="does not match its sha256"):
        run_tokenizer_stage(cfg, raw, tmp_path / "tok", tmp_path / "metrics.json", seed=3)
    assert not (tmp_path / "tok").exists() and not (tmp_path / "metrics.json").exists()


def test_tokenizer_stage_does_not_import_torch() -> None:
    # The stage reads snapshots, renders problems as chats and trains with rustbpe; torch is no
    # part of that, and importing it tripled the stage's wall time on the offline preset. It
    # reads snapshots through lockstep.data.snapshot and loads no source loader either.
    code = (
        "import sys, stages.tokenizer, lockstep.pipeline.tokenizer\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'lockstep.data.sources' not in sys.modules, 'a source loader was imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "lib")])}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True)
