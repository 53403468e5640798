"""LZ78 trie core: hand-checked parses for each strategy, the reference parse against a textbook
LZ78 written here, the compiled path against the reference (hypothesis), greedy encoding against
brute-force longest match, pruning, ancestor chains and the errors bad input gets."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lockstep.tokenizer.lz78.train import STRATEGIES, count_uses, prune, train_lz78
from lockstep.tokenizer.lz78.trie import LZ78Trie, LZ78TrieError, ancestor_chains, encode, encode_batch, fallback_byte


def tokens(trie: LZ78Trie) -> list[bytes]:
    return [trie.token_bytes(c) for c in range(1, trie.n_codes + 1)]


def textbook_lz78(docs: list[bytes], max_codes: int) -> list[bytes]:
    """LZ78 phrases by string lookup, in creation order: a phrase is the shortest prefix of the
    rest of the document that is not yet a phrase."""
    phrases: dict[bytes, int] = {}
    for doc in docs:
        w = b""
        for b in doc:
            w += bytes([b])
            if w not in phrases:
                if len(phrases) == max_codes:
                    return list(phrases)
                phrases[w] = len(phrases) + 1
                w = b""
    return list(phrases)


def brute_force_encode(vocab: list[bytes], data: bytes) -> list[int]:
    """Longest match by trying every length at every position, longest first."""
    code_of = {t: c for c, t in enumerate(vocab, 1)}
    longest = max(map(len, vocab), default=0)
    out, i = [], 0
    while i < len(data):
        for n in range(min(longest, len(data) - i), 0, -1):
            if data[i:i + n] in code_of:
                out.append(code_of[data[i:i + n]])
                i += n
                break
        else:
            out.append(-1 - data[i])
            i += 1
    return out


# Few distinct bytes so that phrases repeat and tries grow deep; sometimes any byte.
small_alphabet = st.binary(max_size=60).map(lambda b: bytes(x % 3 + 97 for x in b))
documents = st.lists(st.one_of(small_alphabet, st.binary(max_size=30)), max_size=8)


def test_standard_parse_by_hand():
    # a | b | ab | abc | abca | bc | d
    trained = train_lz78([b"abababcabcabcd"], 100)
    assert tokens(trained.trie) == [b"a", b"b", b"ab", b"abc", b"abca", b"bc", b"d"]
    assert trained.trie.parent.tolist() == [0, 0, 0, 1, 3, 4, 2, 0]
    # Greedy encoding of the same text: ab | ab | abca | bc | abc | d, and no fallback.
    assert trained.uses.tolist() == [0, 0, 0, 2, 1, 1, 1, 1]
    # The cap stops the parse; the parse restarts at each document.
    assert tokens(train_lz78([b"abababcabcabcd"], 4).trie) == [b"a", b"b", b"ab", b"abc"]
    assert tokens(train_lz78([b"aab"], 10).trie) == [b"a", b"ab"]
    assert tokens(train_lz78([b"aa", b"b"], 10).trie) == [b"a", b"b"]


def test_frequency_gated_by_hand():
    # a, b, ab fill the budget of 3; the 4th phrase (a+c) finds it full, and as 4 is a multiple
    # of the period 2 the leaves reached by fewer than 2 phrases (b, ab) go; then ad is added.
    trained = train_lz78(
        [b"ab", b"ab", b"ac", b"ad"], 3, strategy="frequency_gated", gate_period_phrases=2, gate_min_count=2
    )
    assert tokens(trained.trie) == [b"a", b"ad"]
    assert trained.uses.tolist() == [3, 3, 1]  # a+fallback b, a+fallback b, a+fallback c, ad
    # Without eviction (a period never reached) it is the standard parse.
    never = train_lz78([b"ab", b"ab", b"ac", b"ad"], 3, strategy="frequency_gated", gate_period_phrases=100)
    assert tokens(never.trie) == tokens(train_lz78([b"ab", b"ab", b"ac", b"ad"], 3).trie)


def test_multi_round_by_hand():
    docs = [b"abababcabcabcd"]
    # 4 x 2 = 8 codes allowed, 7 phrases learnt (as above), used ab:2 abc:1 abca:1 bc:1 d:1.
    # Pruning drops leaves, fewest uses first, newest on ties: d, bc, then b (a leaf now, 0 uses),
    # abca, abc; a and ab remain.
    trained = train_lz78(docs, 2, strategy="multi_round")
    full = train_lz78(docs, 8).trie
    assert tokens(trained.trie) == tokens(prune(full, count_uses(full, docs), 2))
    assert tokens(trained.trie) == [b"a", b"ab"]
    # Counts re-taken with the pruned dictionary: ab ab ab c ab c ab c d (c and d fall back).
    assert trained.uses.tolist() == [4, 0, 5]


def test_prune_by_hand():
    trie = LZ78Trie(np.array([0, 0, 0, 1, 3]), np.frombuffer(b"\0abbc", np.uint8))  # a b ab abc
    pruned = prune(trie, np.array([0, 5, 1, 3, 2]), 2)  # leaves b (1) then abc (2) go
    assert tokens(pruned) == [b"a", b"ab"]
    tie = prune(trie, np.array([0, 5, 2, 3, 2]), 3)  # b and abc tie at 2: the newer, abc, goes
    assert tokens(tie) == [b"a", b"b", b"ab"]
    assert prune(trie, np.zeros(5), 4) is trie


@settings(max_examples=200, deadline=None)
@given(docs=documents, max_codes=st.integers(1, 40))
def test_reference_parse_is_textbook_lz78(docs, max_codes):
    assert tokens(train_lz78(docs, max_codes).trie) == textbook_lz78(docs, max_codes)


@settings(max_examples=150, deadline=None)
@given(docs=documents, max_codes=st.integers(1, 40), strategy=st.sampled_from(STRATEGIES),
       period=st.integers(1, 12), min_count=st.integers(1, 4))
def test_compiled_training_equals_reference(docs, max_codes, strategy, period, min_count):
    ref = compiled_and_reference_training(docs, max_codes, strategy=strategy, gate_period_phrases=period,
                                          gate_min_count=min_count)
    assert ref.uses.sum() == sum(map(len, encode_batch(ref.trie, docs)))


def compiled_and_reference_training(docs, max_codes, **kwargs):
    """The reference's training, after checking that the compiled path gives the same arrays."""
    ref = train_lz78(docs, max_codes, **kwargs)
    fast = train_lz78(docs, max_codes, fast=True, **kwargs)
    assert ref.trie.n_codes <= max_codes
    np.testing.assert_array_equal(fast.trie.parent, ref.trie.parent)
    np.testing.assert_array_equal(fast.trie.last_byte, ref.trie.last_byte)
    np.testing.assert_array_equal(fast.uses, ref.uses)
    return ref


@settings(max_examples=150, deadline=None)
@given(train=documents, text=st.one_of(small_alphabet, st.binary(max_size=80)), max_codes=st.integers(1, 60))
def test_encoding_is_brute_force_longest_match(train, text, max_codes):
    trie = train_lz78(train, max_codes).trie
    expected = brute_force_encode(tokens(trie), text)
    assert encode(trie, text).tolist() == expected
    assert encode(trie, text, fast=True).tolist() == expected
    # Codes and fallback markers spell the input back.
    assert b"".join(trie.token_bytes(c) if c > 0 else bytes([fallback_byte(c)]) for c in expected) == text


def test_threaded_batch_equals_one_thread():
    rng = np.random.default_rng(0)
    docs = [bytes(rng.integers(97, 101, size=int(n), dtype=np.uint8)) for n in rng.integers(0, 300, size=200)]
    docs[5] = b""
    trie = train_lz78(docs[:50], 300, fast=True).trie
    one = encode_batch(trie, docs, fast=True)
    two = encode_batch(trie, docs, num_threads=2, fast=True)
    ref = encode_batch(trie, docs)
    assert len(one) == len(two) == len(ref) == len(docs)
    for a, b, r in zip(one, two, ref, strict=True):
        assert a.dtype == np.int32
        np.testing.assert_array_equal(a, r)
        np.testing.assert_array_equal(b, r)
    assert encode_batch(trie, [], num_threads=2, fast=True) == []


def test_training_is_repeatable():
    rng = np.random.default_rng(1)
    docs = [bytes(rng.integers(97, 103, size=500, dtype=np.uint8)) for _ in range(20)]
    for strategy in STRATEGIES:
        first = train_lz78(docs, 64, strategy=strategy, gate_period_phrases=16, fast=True)
        again = train_lz78(docs, 64, strategy=strategy, gate_period_phrases=16, fast=True)
        assert first.trie.parent.tobytes() == again.trie.parent.tobytes()
        assert first.trie.last_byte.tobytes() == again.trie.last_byte.tobytes()


def test_ancestor_chains_by_hand():
    trie = train_lz78([b"abababcabcabcd"], 100).trie  # a b ab abc abca bc d
    chains, depths = ancestor_chains(trie.parent)
    assert chains.dtype == np.int32 and chains.shape == (8, 4)
    assert chains.tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [2, 0, 0, 0], [3, 1, 0, 0], [4, 3, 1, 0],
                               [5, 4, 3, 1], [6, 2, 0, 0], [7, 0, 0, 0]]
    assert depths.tolist() == [0, 1, 1, 2, 3, 4, 2, 1]
    assert depths.tolist()[1:] == [len(t) for t in tokens(trie)]
    # A vocabulary past the codes (fallback bytes, specials) hangs off the root.
    vocab_parent = np.concatenate([trie.parent, np.zeros(3, np.int32)])
    assert ancestor_chains(vocab_parent)[1].tolist()[-3:] == [1, 1, 1]
    assert ancestor_chains(np.array([0]))[0].tolist() == [[0]]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="strategy 'lzw'"):
        train_lz78([b"a"], 4, strategy="lzw")
    with pytest.raises(ValueError, match="max_codes=0"):
        train_lz78([b"a"], 0)
    with pytest.raises(ValueError, match="gate_period_phrases=0"):
        train_lz78([b"a"], 4, gate_period_phrases=0)
    with pytest.raises(TypeError, match="document 1 is str"):
        train_lz78([b"a", "b"], 4)
    with pytest.raises(LZ78TrieError, match="node 2 has parent 2"):
        LZ78Trie(np.array([0, 0, 2]), np.array([0, 97, 98]))
    with pytest.raises(LZ78TrieError, match="node 1 has parent 5"):
        LZ78Trie(np.array([0, 5]), np.array([0, 97]))
    with pytest.raises(LZ78TrieError, match="node 2 is on a parent cycle"):
        LZ78Trie(np.array([0, 0, 3, 2]), np.array([0, 97, 98, 99]))
    with pytest.raises(LZ78TrieError, match=r"nodes \[1, 2\] both spell parent 0 \+ byte 97"):
        LZ78Trie(np.array([0, 0, 0]), np.array([0, 97, 97]))
    with pytest.raises(LZ78TrieError, match="root"):
        LZ78Trie(np.array([1, 0]), np.array([0, 97]))
    with pytest.raises(LZ78TrieError, match="node 2 is no code and has no children"):
        LZ78Trie(np.array([0, 0, 0]), np.array([0, 97, 98]), 1)
    with pytest.raises(LZ78TrieError, match="n_codes=3"):
        LZ78Trie(np.array([0, 0]), np.array([0, 97]), 3)
    with pytest.raises(LZ78TrieError, match="id 1 has parent 1"):
        ancestor_chains(np.array([0, 1, 0, 0]))
    with pytest.raises(LZ78TrieError, match="id 1 is on a parent cycle"):
        ancestor_chains(np.array([0, 3, 0, 1]))
    with pytest.raises(LZ78TrieError, match="prefix-closed"):
        prune(LZ78Trie(np.array([0, 2, 0]), np.array([0, 97, 98]), 1), np.zeros(3), 1)
    with pytest.raises(ValueError, match="num_threads=0"):
        encode_batch(LZ78Trie(np.array([0]), np.array([0])), [b"a"], num_threads=0)


def test_codes_in_any_order_and_prefixes_that_are_no_codes():
    # Codes 1..3: "ab", "c", "abd"; node 4 is "a", a prefix but no code. "ab"'s parent is node 4,
    # a larger number, and "abd"'s parent "ab" comes first: any numbering without cycles will do.
    trie = LZ78Trie(np.array([0, 4, 0, 1, 0]), np.frombuffer(b"\0bcda", np.uint8), 3)
    assert (trie.n_codes, trie.n_nodes, trie.is_prefix_closed) == (3, 4, False)
    assert tokens(trie) == [b"ab", b"c", b"abd"]
    assert trie.depths().tolist() == [0, 2, 1, 3, 1]
    assert trie.code_parents().tolist() == [0, 0, 0, 1]
    flat, offsets = trie.spell()
    assert flat.tobytes() == b"abcabd" and offsets.tolist() == [0, 0, 2, 3, 6]
    fast_flat, fast_offsets = trie.spell(fast=True)
    assert np.array_equal(fast_flat, flat) and np.array_equal(fast_offsets, offsets)
    # "a" alone is no code: it falls back; "ab" and "abd" are the longest matches.
    for fast in (False, True):
        assert encode(trie, b"abdabaxc", fast=fast).tolist() == [3, 1, -1 - ord("a"), -1 - ord("x"), 2]
    closed = trie.closed()
    assert closed.n_codes == 4 and tokens(closed) == [b"ab", b"c", b"abd", b"a"]
    assert encode(closed, b"abaxc").tolist() == [1, 4, -1 - ord("x"), 2]
    chains, depths = ancestor_chains(closed.parent)
    assert chains.tolist() == [[0, 0, 0], [1, 4, 0], [2, 0, 0], [3, 1, 4], [4, 0, 0]] and depths.tolist() == [
        0,
        2,
        1,
        3,
        1,
    ]


@settings(max_examples=150, deadline=None)
@given(vocab=st.lists(st.binary(min_size=1, max_size=5).map(lambda b: bytes(x % 3 + 97 for x in b)), unique=True,
                      min_size=1, max_size=25),
       text=st.binary(max_size=60).map(lambda b: bytes(x % 4 + 97 for x in b)))
def test_any_token_set_encodes_by_longest_match(vocab, text):
    from lockstep.tokenizer.lz78.tsv import trie_from_tokens

    trie = trie_from_tokens(vocab)
    assert tokens(trie) == vocab
    expected = brute_force_encode(vocab, text)
    assert encode(trie, text).tolist() == expected == encode(trie, text, fast=True).tolist()
    closed = trie.closed()
    assert tokens(closed)[: len(vocab)] == vocab
    assert encode(closed, text, fast=True).tolist() == brute_force_encode(tokens(closed), text)


# --- the parse by whole characters (portable) ----------------------------------------------------

# Characters of one to four bytes, and the three bytes a portable code never holds.
portable_text = st.text(alphabet="ab é©漢🙂\t\n\r", max_size=60).map(str.encode)
portable_documents = st.lists(st.one_of(portable_text, st.binary(max_size=30)), max_size=8)


def textbook_portable(docs: list[bytes], max_codes: int) -> list[bytes]:
    """LZ78 phrases over characters by string lookup: each document cut at tab, \\n, \\r and every
    byte outside valid UTF-8, each piece parsed as textbook LZ78 over its characters."""
    phrases: dict[str, int] = {}
    for doc in docs:
        text = doc.decode("utf-8", "surrogateescape")
        for piece in "".join("\0" if ch in "\t\n\r" or "\udc80" <= ch <= "\udcff" else ch for ch in text).split("\0"):
            w = ""
            for ch in piece:
                w += ch
                if w not in phrases:
                    if len(phrases) == max_codes:
                        return [p.encode() for p in phrases]
                    phrases[w] = len(phrases) + 1
                    w = ""
    return [p.encode() for p in phrases]


@settings(max_examples=150, deadline=None)
@given(docs=portable_documents, max_codes=st.integers(1, 40))
def test_portable_parse_is_textbook_lz78_over_characters(docs, max_codes):
    docs = [d.replace(b"\0", b"") for d in docs]  # NUL is the textbook's cut mark
    trie = train_lz78(docs, max_codes, portable=True).trie
    assert tokens(trie) == textbook_portable(docs, max_codes)
    for token in tokens(trie):
        token.decode("utf-8")  # whole characters, none cut
        assert not any(b in token for b in b"\t\n\r")


@settings(max_examples=150, deadline=None)
@given(docs=portable_documents, max_codes=st.integers(1, 40), strategy=st.sampled_from(STRATEGIES),
       period=st.integers(1, 12), min_count=st.integers(1, 4), text=portable_text)
def test_compiled_portable_training_equals_reference(docs, max_codes, strategy, period, min_count, text):
    ref = compiled_and_reference_training(docs, max_codes, strategy=strategy, gate_period_phrases=period,
                                          gate_min_count=min_count, portable=True)
    assert encode(ref.trie, text, fast=True).tolist() == encode(ref.trie, text).tolist()
    for token in tokens(ref.trie):
        token.decode("utf-8")
        assert not any(b in token for b in b"\t\n\r")
    # Tabs, line breaks and bytes outside UTF-8 fall back to single bytes.
    codes = encode(ref.trie, b"\t\xff\r\n\xc3", fast=True).tolist()
    assert codes == [-1 - b for b in b"\t\xff\r\n\xc3"]
