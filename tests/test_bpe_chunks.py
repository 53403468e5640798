"""bpe's merges never cross the chunks its split pattern cuts the text into: the trainers (rustbpe
for bpe, `tokenizers` for hf) learn no token that holds bytes of two chunks, and encoding gives
each chunk the ids it gets alone."""

from __future__ import annotations

import itertools
import random

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.tokenizer import Tokenizer
from lockstep.tokenizer.bpe import SPLIT_PATTERN
from lockstep.tokenizer.kinds import train_tokenizer

# Pieces whose neighbours are frequent in the training text, so that a trainer merging across
# chunks would learn tokens spanning a space, a newline, a digit run or punctuation.
PIECES = [" the", "the ", " cat", "cat.", "\n", "\n\n", "  ", " ", "12", "345", "6789", "!!", "?\n", "'s", "'ll",
          "é", "漢", "\t", "a", "b"]  # fmt: skip
_TOKS: dict[str, Tokenizer] = {}


def _trained(kind: str) -> Tokenizer:
    if kind not in _TOKS:
        rng = random.Random(0)
        corpus = ["".join(rng.choices(PIECES, k=300)) for _ in range(200)]
        _TOKS[kind] = train_tokenizer(kind, corpus, vocab_size=600)
    return _TOKS[kind]


@pytest.mark.parametrize("kind", ["bpe", "hf"])
def test_bpe_merges_never_cross_pre_tokenizer_chunks(kind: str) -> None:
    """Trained on text where pairs across a chunk boundary (" the" + " cat", "cat." + "\\n", digits
    past two) are as frequent as pairs inside one, no learned token holds bytes of two chunks: each
    token that is whole UTF-8 text is one chunk of the split pattern by itself."""
    tok = _trained(kind)
    pieces = [p for p in tok.token_pieces() if p is not None and len(p) > 1]
    texts = [p.decode("utf-8") for p in pieces if _is_utf8(p)]
    assert len(texts) > 200  # the trainer learned plenty of merges to check
    crossing = [t for t in texts if regex.findall(SPLIT_PATTERN, t) != [t]]
    assert not crossing, crossing[:10]


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("kind", ["bpe", "hf"])
@settings(max_examples=150, deadline=None)
# Characters of Unicode's assigned blocks only: on code points a newer Unicode version assigns,
# Python's `regex` and tiktoken's engine may split differently, which is not what this checks.
@given(
    pieces=st.lists(
        st.sampled_from(PIECES) | st.text(alphabet="ab Z.,;:'\"\n\t\r 09-éß漢🙂!?", max_size=3), max_size=60
    )
)
def test_bpe_encodes_each_chunk_alone(kind: str, pieces: list[str]) -> None:
    """A text's ids are its chunks' ids one after another, and no token's bytes straddle a chunk
    boundary: a merge across chunks would break both."""
    tok = _trained(kind)
    text = "".join(pieces).encode("utf-8", "replace").decode("utf-8")
    chunks = regex.findall(SPLIT_PATTERN, text)
    assert "".join(chunks) == text
    ids = tok.encode(text)
    assert ids == [i for chunk in chunks for i in tok.encode(chunk)]
    bounds = set(itertools.accumulate(len(c.encode("utf-8")) for c in chunks))
    start = 0
    for i in ids:
        end = start + int(tok.token_bytes()[i])
        assert not any(start < b < end for b in bounds), (text, i)
        start = end
