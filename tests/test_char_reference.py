"""The char tokenizer's reference rule (sorted unique bytes, capped, unknown bytes -> 0, no special
tokens) against an independent few-line implementation, its saved form, and the refusals of a
tokenizer built without special tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lockstep.tokenizer import TokenizerFileError, load_tokenizer

from lockstep.tokenizer.kinds import train_tokenizer
from lockstep.tokenizer.base import NoSpecialTokensError
from lockstep.tokenizer.char import CHAR_FILE, CharTokenizer

# Bytes that tiny Shakespeare lacks (most digits, '~', a tab, a two-byte character) around some it has.
PROBE = "Fortune's 1594 wheel ~ turns\t(caf\u00e9) 3 times!\n"


def reference_char_ids(corpus: bytes, text: bytes, cap: int = 65) -> tuple[int, list[int]]:
    """The rule as another implementation writes it: the sorted unique bytes of the corpus, the
    first `cap` of them kept, ids in that order, any other byte -> 0. (vocab size, ids of text)"""
    vocab = sorted(set(corpus))[:cap]
    stoi = {b: i for i, b in enumerate(vocab)}
    return len(vocab), [stoi.get(b, 0) for b in text]


def test_reference_rule_matches_an_independent_implementation_on_tinyshakespeare(shared_fixtures: Path) -> None:
    raw = (shared_fixtures / "tinyshakespeare" / "input.txt").read_bytes()
    text = raw.decode("utf-8")
    tok = train_tokenizer("char", [text], order="sorted", specials=False)
    n, ids = reference_char_ids(raw, raw)
    assert tok.get_vocab_size() == n == 65 and tok.get_special_tokens() == {}
    assert tok.encode(text) == ids
    assert tok.decode(ids) == text
    assert tok.encode(PROBE) == reference_char_ids(raw, PROBE.encode("utf-8"))[1]
    assert 0 in tok.encode("1") and tok.count_unknown_bytes([PROBE]) == sum(b not in raw for b in PROBE.encode("utf-8"))

    # A cap below the corpus's 65 bytes is where the two rules part: the reference keeps the
    # lowest byte values, the frequency rule the most common ones.
    for cap in (1, 13, 40):
        capped = train_tokenizer("char", [text], max_alphabet=cap, order="sorted", specials=False)
        n, ids = reference_char_ids(raw, raw, cap)
        assert capped.get_vocab_size() == n == cap
        assert capped.encode(text) == ids
        frequent = train_tokenizer("char", [text], max_alphabet=cap, specials=False)
        assert frequent.alphabet != capped.alphabet
        assert cap == 1 or frequent.encode(text) != ids  # one kept byte: every id is 0 under both rules


def test_reference_rule_on_a_hand_made_corpus() -> None:
    corpus = "zzzz yyy xx a\n"
    for cap in (1, 3, 6, 65):
        tok = train_tokenizer("char", [corpus], max_alphabet=cap, order="sorted", specials=False)
        n, ids = reference_char_ids(corpus.encode(), (corpus + "zebra").encode(), cap)
        assert tok.get_vocab_size() == n and tok.encode(corpus + "zebra") == ids
    # cap 3: the reference keeps "\n", " ", "a"; the frequency rule keeps " ", "y", "z".
    assert bytes(train_tokenizer("char", [corpus], max_alphabet=3, order="sorted").alphabet) == b"\n a"
    assert bytes(train_tokenizer("char", [corpus], max_alphabet=3).alphabet) == b" yz"
    # With the special tokens they follow the alphabet; the alphabet's ids do not move.
    with_specials = train_tokenizer("char", [corpus], order="sorted")
    assert with_specials.get_vocab_size() == 6 + 9 and min(with_specials.get_special_tokens().values()) == 6
    assert with_specials.encode(corpus) == train_tokenizer("char", [corpus], order="sorted", specials=False).encode(
        corpus
    )
    with pytest.raises(ValueError, match="order='alphabetical' must be one of"):
        train_tokenizer("char", [corpus], order="alphabetical")


def test_id_0_decodes_to_the_smallest_byte_whatever_was_encoded() -> None:
    # Documented ambiguity: an unknown byte and the alphabet's smallest byte share id 0.
    tok = train_tokenizer("char", ["ba\n"], order="sorted", specials=False)
    assert tok.encode("a\n") == [1, 0] and tok.encode("a~") == [1, 0]
    assert tok.decode(tok.encode("a~")) == "a\n"
    assert tok.count_unknown_bytes(["a~", "\u00e9\n"]) == 1 + 2


@pytest.mark.parametrize("order", ["frequency", "sorted"])
@pytest.mark.parametrize("specials", [True, False])
def test_saved_tokenizer_records_its_mode_and_encodes_the_same(tmp_path: Path, order: str, specials: bool) -> None:
    corpus = ["To be, or not to be: that is the question.\n", "Whether 'tis nobler in the mind 2 suffer\n"]
    tok = train_tokenizer("char", corpus, max_alphabet=12, order=order, specials=specials)
    meta = tok.save(tmp_path / "tok")
    stored = json.loads((tmp_path / "tok" / CHAR_FILE).read_text())
    assert stored["order"] == order and stored["special_token_ids"] == tok.get_special_tokens()
    assert (meta["bos_token_id"] is None) == (not specials)
    loaded = load_tokenizer(tmp_path / "tok")
    assert isinstance(loaded, CharTokenizer) and loaded.order == order and loaded.has_special_tokens == specials
    assert loaded.sha256 == tok.sha256 and loaded.get_vocab_size() == tok.get_vocab_size()
    text = "".join(corpus) + "1594 ~"
    assert loaded.encode(text) == tok.encode(text) and loaded.alphabet == tok.alphabet
    # The two modes and the two rules give different files, hence different identities.
    other = train_tokenizer("char", corpus, max_alphabet=12, order=order, specials=not specials)
    assert other.sha256 != tok.sha256


def test_char_file_without_order_is_refused(tmp_path: Path) -> None:
    tok = train_tokenizer("char", ["abc"])
    tok.save(tmp_path / "tok")
    stored = json.loads((tmp_path / "tok" / CHAR_FILE).read_text())
    del stored["order"]  # the layout before the rule was saved
    (tmp_path / "tok" / CHAR_FILE).write_text(json.dumps(stored))
    with pytest.raises(TokenizerFileError, match="order=None.*re-run the tokenizer stage"):
        CharTokenizer._from_files(tmp_path / "tok", {})
    stored["order"] = "frequency"
    stored["special_token_ids"] = {"<|bos|>": 0}
    (tmp_path / "tok" / CHAR_FILE).write_text(json.dumps(stored))
    with pytest.raises(TokenizerFileError, match="special ids that do not follow its alphabet"):
        CharTokenizer._from_files(tmp_path / "tok", {})


CONVERSATION = {
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
    ]
}


def test_a_tokenizer_without_specials_refuses_bos_and_chat_with_a_clear_error() -> None:
    tok = train_tokenizer("char", ["hi ok\n"], order="sorted", specials=False)
    assert not tok.has_special_tokens and tok.get_vocab_size() == 6
    # Plain text still works both ways.
    assert tok.decode(tok.encode("hi ok")) == "hi ok" and tok.token_bytes().tolist() == [1] * 6
    for call in (
        tok.get_bos_token_id,
        lambda: tok.encode_special("<|assistant_end|>"),
        lambda: tok.encode("hi", prepend="<|bos|>"),
        lambda: tok.render_conversation(CONVERSATION),
        lambda: tok.render_for_completion(CONVERSATION),
    ):
        with pytest.raises(NoSpecialTokensError, match=r"without special tokens.*tokenizer.options.specials: true"):
            call()


def test_caches_refuse_a_tokenizer_without_specials_before_writing(tmp_path: Path) -> None:
    from lockstep.data.cache_build import build_pretrain_cache, build_sft_cache

    tok = train_tokenizer("char", ["hi ok\n"], order="sorted", specials=False)
    with pytest.raises(NoSpecialTokensError, match="no <\\|bos\\|>"):
        build_pretrain_cache({"train": ["hi ok"] * 4}, tmp_path / "p", tokenizer=tok, max_train_tokens=None,
                             max_val_tokens=None, shard_bytes=1 << 12, seed=0, shuffle_buffer=1)  # fmt: skip
    with pytest.raises(NoSpecialTokensError):
        build_sft_cache({"train": [CONVERSATION]}, tmp_path / "s", tokenizer=tok, val_frac=None, seed=0)
    assert not (tmp_path / "p").exists() and not (tmp_path / "s").exists()
