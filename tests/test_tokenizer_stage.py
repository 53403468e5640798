"""Tokenizer stage pieces: the bytes/token metric on a hand-made case, the train-text cap, record
texts, determinism across processes, and the stage run on real raw snapshots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.config import ConfigError, build_config
from lockstep.tokenizer import train_tokenizer
from lockstep.tokenizer.pipeline import CappedTexts, TokenizerConfig, bytes_per_token, record_texts

ROOT = Path(__file__).resolve().parents[1]


def test_bytes_per_token_hand_made() -> None:
    # One merge is learned from "abab...": the token "ab". "abab" -> [ab, ab] (4 bytes, 2 tokens);
    # "é" has no merge -> its 2 UTF-8 bytes (2 bytes, 2 tokens). Total 6 bytes / 4 tokens.
    tok = train_tokenizer("bpe", ["ab" * 50], vocab_size=256 + 1 + 9)
    assert tok.get_vocab_size() == 266
    assert len(tok.encode("abab")) == 2 and len(tok.encode("é")) == 2
    m = bytes_per_token(tok, ["abab", "é"], num_threads=1)
    assert m == {"bytes": 6, "tokens": 4, "bytes_per_token": 1.5}
    byte = train_tokenizer("byte", [])
    assert bytes_per_token(byte, ["héllo"])["bytes_per_token"] == 1.0
    with pytest.raises(ValueError, match="val split is not empty"):
        bytes_per_token(byte, [""])


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
    with pytest.raises(ValueError, match="train_sources is empty"):
        build_config(TokenizerConfig, {"kind": "bpe"}, where="tokenizer")
    assert build_config(TokenizerConfig, {"kind": "byte"}).train_options(0) == {"vocab_size": None}


_TRAIN_IN_CHILD = """
import sys
from lockstep.tokenizer import train_tokenizer
texts = ["Whether 'tis nobler in the mind to suffer\\n", "The slings and arrows of outrageous fortune, 1234 \\u00e9\\u6f22"] * 3
for kind, vocab in (("char", None), ("bpe", 290), ("sentencepiece", 300)):
    print(kind, train_tokenizer(kind, texts, vocab_size=vocab).sha256)
"""


def test_training_is_identical_across_processes_and_hash_seeds() -> None:
    outputs = set()
    for hash_seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", _TRAIN_IN_CHILD], env=env, capture_output=True, text=True, check=True)
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
