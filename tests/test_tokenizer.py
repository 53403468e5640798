"""Tokenizer interface tests run against every kind: round trips, special-token injection, BOS
count, chat rendering masks (hand-checked), save/load identity and tamper refusal."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _text_corpus import CORPUS
from lockstep.tokenizer import (
    SPECIAL_TOKENS,
    ConversationError,
    Tokenizer,
    TokenizerFileError,
    load_tokenizer,
)
from lockstep.tokenizer.kinds import train_tokenizer


# name -> (kind, vocab_size, kind options): every kind, sentencepiece in both model types.
SPECS: dict[str, tuple[str, int | None, dict]] = {
    "byte": ("byte", None, {}),
    "char": ("char", None, {}),
    "bpe": ("bpe", 300, {}),
    "spm_bpe": ("sentencepiece", 400, {"model_type": "bpe"}),
    "spm_unigram": ("sentencepiece", 400, {"model_type": "unigram"}),
}
KINDS = list(SPECS)
_TOKENIZERS: dict[str, Tokenizer] = {}


def train_spec(name: str, corpus: list[str]) -> Tokenizer:
    kind, vocab, options = SPECS[name]
    return train_tokenizer(kind, corpus, vocab_size=vocab, **options)


def tiny_tokenizer(name: str) -> Tokenizer:
    """One small tokenizer per kind, trained once per test session (tokenizers are immutable)."""
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = train_spec(name, CORPUS)
    return _TOKENIZERS[name]


@pytest.fixture(params=KINDS)
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return tiny_tokenizer(request.param)


def roundtrip_text(tok: Tokenizer) -> st.SearchStrategy[str]:
    if tok.kind == "char":  # only bytes of the learned alphabet survive a char round trip
        return st.text(alphabet=[chr(b) for b in tok.alphabet if b < 128], max_size=200)
    return st.text(max_size=200)


def sample_conversation() -> dict:
    return {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "What is 2+3?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me check."},
                    {"type": "python", "text": "2+3"},
                    {"type": "python_output", "text": "5"},
                    {"type": "text", "text": "It is 5."},
                ],
            },
            {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Welcome."}]},
        ]
    }


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_roundtrip(kind: str, data: st.DataObject) -> None:
    tok = tiny_tokenizer(kind)
    text = data.draw(roundtrip_text(tok))
    ids = tok.encode(text)
    assert all(0 <= i < tok.get_vocab_size() and not tok.is_special(i) for i in ids)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=60, deadline=None)
@given(
    prefix=st.text(max_size=8),
    suffix=st.text(max_size=8),
    order=st.permutations(SPECIAL_TOKENS),
    sep=st.sampled_from(["", " ", "\n", "x", "<", "|", ">"]),
)
def test_special_strings_in_text_never_become_special_ids(kind: str, prefix: str, suffix: str, order, sep: str) -> None:
    tok = tiny_tokenizer(kind)
    text = prefix + sep.join(order) + suffix
    specials = set(tok.get_special_tokens().values())
    assert not specials & set(tok.encode(text))
    # the array path the caches use gives the very same ids
    (arr,) = tok.encode_arrays([text])
    assert arr.dtype.kind == "u" and arr.tolist() == tok.encode(text)
    conv = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": text}]},
            {"role": "user", "content": [{"type": "text", "text": text}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": text},
                    {"type": "python", "text": text},
                    {"type": "python_output", "text": text},
                ],
            },
        ]
    }
    ids, mask = tok.render_conversation(conv)
    sp = tok.get_special_tokens()
    special_seq = [i for i in ids if i in specials]
    names = {v: k for k, v in sp.items()}
    assert [names[i] for i in special_seq] == [
        "<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|python_start|>",
        "<|python_end|>", "<|output_start|>", "<|output_end|>", "<|assistant_end|>",
    ]  # fmt: skip
    assert len(ids) == len(mask)


# Text ends that could fuse with a neighbour: whitespace, newlines, digits, partial special
# strings and special strings themselves.
EDGE_PIECES = ["\n", "\r\n", " \n", " ", "\t", "a", " the", "'s", "1", "12", "!", "?!\n", "é", "🙂", "\u3000",
               *SPECIAL_TOKENS, "<|bo", "s|>", "<|", "|>", "<", ">"]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=100, deadline=None)
@given(
    texts=st.lists(st.lists(st.sampled_from(EDGE_PIECES) | st.text(max_size=3), max_size=12).map("".join), max_size=12)
)
def test_batch_encode_on_threads_encodes_each_text_alone(kind: str, texts: list[str]) -> None:
    """The tokenizer stage counts val tokens through the threaded batch call: each text must get
    the ids it gets encoded alone, whatever the texts start and end with."""
    tok = tiny_tokenizer(kind)
    assert tok.encode(texts, num_threads=2) == [tok.encode(t) for t in texts]


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=60, deadline=None)
@given(texts=st.lists(st.text(max_size=40), max_size=4))
def test_count_unknown_bytes_is_what_decode_loses(kind: str, texts: list[str]) -> None:
    """Only char has an unknown-byte id: every byte outside its alphabet. The other kinds spell
    every byte, so they count none and give every text back."""
    tok = tiny_tokenizer(kind)
    lost = tok.count_unknown_bytes(texts)
    if tok.kind == "char":
        assert lost == sum(b not in tok.alphabet for t in texts for b in t.encode("utf-8"))
    else:
        assert lost == 0 and [tok.decode(ids) for ids in tok.encode(texts)] == texts


def test_bpe_batch_encode_of_text_with_a_lone_surrogate() -> None:
    tok = tiny_tokenizer("bpe")  # encodes it as U+FFFD, as tiktoken does
    texts = ["ab\ud800cd", "12 34", ""]
    assert tok.encode(texts, num_threads=2) == [tok.encode(t) for t in texts]


def test_encode_arrays_match_encode(tok: Tokenizer) -> None:
    docs = CORPUS[:5] + ["", "<|bos|><|bos|>", "héllo ☃ 12345"]
    arrays = tok.encode_arrays(docs)
    assert [a.tolist() for a in arrays] == tok.encode(docs)
    assert all(a.dtype.kind == "u" for a in arrays)


def test_bulk_encoding_from_other_threads(tok: Tokenizer) -> None:
    """Bulk calls from worker threads give the ids the building thread gives; for bpe each worker
    encodes with its own tiktoken Encoding, kept for its later calls, never the shared one."""
    docs = CORPUS[:5] + ["", "<|bos|><|bos|>", "héllo ☃ 12345"]
    want = tok.encode(docs, num_threads=1)
    seen: dict[int, list] = {}

    def work(_: int) -> tuple[list, list]:
        if tok.kind == "bpe":
            seen.setdefault(threading.get_ident(), []).append(tok._bulk_encoding())
        return [a.tolist() for a in tok.encode_arrays(docs)], tok.encode(docs, num_threads=1)

    with ThreadPoolExecutor(2) as pool:
        for arrays, lists in pool.map(work, range(6)):
            assert arrays == want and lists == want
    if tok.kind == "bpe":
        assert tok._bulk_encoding() is tok._enc  # the building thread keeps the shared one
        for encodings in seen.values():
            assert all(e is encodings[0] for e in encodings) and encodings[0] is not tok._enc


def test_batch_encode_matches_single_and_one_bos(tok: Tokenizer) -> None:
    bos = tok.get_bos_token_id()
    docs = CORPUS[:5] + ["", "<|bos|><|bos|>"]
    batch = tok.encode(docs, prepend="<|bos|>", num_threads=2)
    for doc, ids in zip(docs, batch, strict=True):
        assert ids == tok.encode(doc, prepend=bos)
        assert ids.count(bos) == 1 and ids[0] == bos
    assert tok.encode("ab", append="<|assistant_end|>")[-1] == tok.encode_special("<|assistant_end|>")


def test_render_conversation_has_exactly_one_bos(tok: Tokenizer) -> None:
    ids, _ = tok.render_conversation(sample_conversation())
    assert ids.count(tok.get_bos_token_id()) == 1 and ids[0] == tok.get_bos_token_id()


def test_render_conversation_mask_hand_checked(tok: Tokenizer) -> None:
    sp = tok.get_special_tokens()
    e = tok.encode
    expected = [
        ([sp["<|bos|>"]], 0),
        ([sp["<|user_start|>"]], 0),
        (e("Be brief.\n\nWhat is 2+3?"), 0),  # system text folded into the first user turn
        ([sp["<|user_end|>"]], 0),
        ([sp["<|assistant_start|>"]], 0),
        (e("Let me check."), 1),
        ([sp["<|python_start|>"]] + e("2+3") + [sp["<|python_end|>"]], 1),
        ([sp["<|output_start|>"]] + e("5") + [sp["<|output_end|>"]], 0),
        (e("It is 5."), 1),
        ([sp["<|assistant_end|>"]], 1),
        ([sp["<|user_start|>"]], 0),
        (e("Thanks"), 0),
        ([sp["<|user_end|>"]], 0),
        ([sp["<|assistant_start|>"]], 0),
        (e("Welcome."), 1),
        ([sp["<|assistant_end|>"]], 1),
    ]
    want_ids = [i for chunk, _ in expected for i in chunk]
    want_mask = [m for chunk, m in expected for _ in chunk]
    ids, mask = tok.render_conversation(sample_conversation())
    assert ids == want_ids
    assert mask == want_mask
    cut_ids, cut_mask = tok.render_conversation(sample_conversation(), max_tokens=7)
    assert cut_ids == want_ids[:7] and cut_mask == want_mask[:7]


def test_render_for_completion(tok: Tokenizer) -> None:
    sp = tok.get_special_tokens()
    conv = sample_conversation()
    prompt = tok.render_for_completion(conv)
    full, _ = tok.render_conversation(conv)
    # Everything up to the last assistant turn, then <|assistant_start|> to prompt the reply.
    last_start = len(full) - 1 - full[::-1].index(sp["<|assistant_start|>"])
    assert prompt == full[: last_start + 1]
    assert prompt[-1] == sp["<|assistant_start|>"]
    # A conversation that already ends with the user gets the same prompt.
    assert tok.render_for_completion({"messages": conv["messages"][:-1]}) == prompt


def test_bad_conversations_raise(tok: Tokenizer) -> None:
    with pytest.raises(ConversationError, match="alternate"):
        tok.render_conversation({"messages": [{"role": "assistant", "content": [{"type": "text", "text": "hi"}]}]})
    with pytest.raises(ConversationError, match="allows"):
        tok.render_conversation({"messages": [{"role": "user", "content": [{"type": "python", "text": "1"}]}]})
    with pytest.raises(ConversationError, match="messages"):
        tok.render_conversation([{"role": "user", "content": "hi"}])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a special token"):
        tok.encode_special("<|system|>")


def test_token_bytes(tok: Tokenizer) -> None:
    tb = tok.token_bytes()
    assert tb.dtype == np.int32 and tb.shape == (tok.get_vocab_size(),)
    assert all(tb[i] == 0 for i in tok.get_special_tokens().values())
    # Summing token_bytes over a text's ids gives its UTF-8 length (bits-per-byte relies on it).
    text = CORPUS[0] + CORPUS[3]
    assert int(tb[tok.encode(text)].sum()) == len(text.encode("utf-8"))


def test_save_load_roundtrip_is_byte_identical(tok: Tokenizer, tmp_path) -> None:
    meta = tok.save(tmp_path / "a")
    loaded = load_tokenizer(tmp_path / "a")
    assert loaded.sha256 == tok.sha256 == meta["sha256"]
    assert loaded.kind == tok.kind and loaded.get_vocab_size() == tok.get_vocab_size()
    assert loaded.get_special_tokens() == tok.get_special_tokens()
    loaded.save(tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert loaded.encode(CORPUS[4]) == tok.encode(CORPUS[4])
    assert type(tok).from_directory(tmp_path / "a").sha256 == tok.sha256


def test_tampered_file_is_refused(tok: Tokenizer, tmp_path) -> None:
    meta = tok.save(tmp_path / "t")
    for name in meta["files"]:
        path = tmp_path / "t" / name
        original = path.read_bytes()
        path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        with pytest.raises(TokenizerFileError, match="re-run the tokenizer stage"):
            load_tokenizer(tmp_path / "t")
        path.unlink()
        with pytest.raises(TokenizerFileError, match="missing"):
            load_tokenizer(tmp_path / "t")
        path.write_bytes(original)
    assert load_tokenizer(tmp_path / "t").sha256 == tok.sha256


def test_training_twice_gives_identical_files(tmp_path) -> None:
    for kind in KINDS:
        a = tiny_tokenizer(kind)
        b = train_spec(kind, list(CORPUS))
        assert a.sha256 == b.sha256, kind
        a.save(tmp_path / f"{kind}_a")
        b.save(tmp_path / f"{kind}_b")
        for p in (tmp_path / f"{kind}_a").iterdir():
            assert p.read_bytes() == (tmp_path / f"{kind}_b" / p.name).read_bytes(), (kind, p.name)


def test_unknown_kind_and_bad_vocab() -> None:
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        train_tokenizer("wordpiece", CORPUS, vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size=None"):
        train_tokenizer("byte", CORPUS, vocab_size=300)
