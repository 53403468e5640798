"""Structured embeddings (model.embedding): which rows each id reads, shapes, gradients into
both tables and the projection, parameter and FLOP accounting, refusal of a hierarchical mode
without a compressed dictionary, the stage asking the tokenizer for the structure an embedding
needs (not for its kind), and a checkpoint that reloads without its tokenizer and generates the
same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _text_corpus import CORPUS
from lockstep.core.config import ConfigError
from lockstep.infer.engine import Engine
from lockstep.model import checkpoint as ckpt
from lockstep.model.embeddings import EMBEDDINGS, NO_BYTE_ROW
from lockstep.model.gpt import GPT, GPTConfig
from lockstep.pipeline.train import token_structure
from lockstep.tokenizer import NotProvidedError
from lockstep.tokenizer.base import TOKEN_STRUCTURES, register_kind, unregister_kind
from lockstep.tokenizer.byte import ByteTokenizer
from lockstep.tokenizer.kinds import train_tokenizer
from lockstep.tokenizer.lz78.train import from_dictionary
from lockstep.tokenizer.lz78.train import train as train_lz78_tokenizer
from lockstep.tokenizer.lz78.tsv import CompressedDictionary, write_compressed_tsv
from lockstep.train.optim import split_params


def config(vocab: int, embedding: str) -> GPTConfig:
    return GPTConfig.from_depth(2, vocab, 32, head_dim=32, embedding=embedding)


#          0:a   1:ab   2:abc  3:b   4:<special> 5:<special>
PARENTS = [-1,   0,     1,     -1,   -1,         -1]
LAST = [97, 98, 99, 98, -1, -1]


def test_rows_follow_parent_and_last_byte_and_specials_stay_distinct():
    model = GPT.build(config(6, "structured"), "cpu", token_structure=(PARENTS, LAST))
    P = model.config.padded_vocab_size
    assert model.embed.token_parent_row[:6].tolist() == [P, 0, 1, P, 4, 5]
    assert model.embed.token_byte_row[:6].tolist() == [97, 98, 99, 98, NO_BYTE_ROW, NO_BYTE_ROW]
    assert (model.embed.token_parent_row[6:] == P).all() and (model.embed.token_byte_row[6:] == NO_BYTE_ROW).all()
    x = model.embed(torch.tensor([[1, 4, 5]]))
    w, b = model.embed.wte.weight, model.embed.wbe.weight
    assert torch.equal(x[0, 0], w[0] + b[98])  # "ab" = code "a" + byte "b"
    assert torch.equal(x[0, 1], w[4] + b[NO_BYTE_ROW]) and not torch.equal(x[0, 1], x[0, 2])
    with pytest.raises(ValueError, match="parents must be -1 or another id"):
        model.embed.set_token_structure([0, 0, 1, -1, -1, -1], LAST)  # id 0 its own parent
    with pytest.raises(ValueError, match="does not fit"):
        model.embed.set_token_structure(PARENTS[:5], LAST[:5])
    with pytest.raises(ValueError, match="flat embedding"):
        GPT.build(config(6, "flat"), "cpu").embed.set_token_structure(PARENTS, LAST)


@pytest.mark.parametrize("embedding", [e for e in EMBEDDINGS if e != "flat"])
def test_shapes_gradients_and_accounting(embedding):
    tok = train_tokenizer("bpe", CORPUS, vocab_size=400)
    tree = tok.prefix_tree()
    cfg = config(tok.get_vocab_size(), embedding)
    model = GPT.build(cfg, "cpu", token_structure=(tree.parent, tree.last_byte))
    flat = GPT.build(config(tok.get_vocab_size(), "flat"), "cpu")
    idx = torch.tensor([tok.encode(CORPUS[0])[:32]])
    logits = model(idx)
    assert logits.shape == (1, idx.shape[1], tok.get_vocab_size())
    model(idx, idx.roll(-1, 1)).backward()
    used = idx.unique()
    assert model.embed.wte.weight.grad[model.embed.token_parent_row[used]].abs().sum() > 0
    assert model.embed.wbe.weight.grad[model.embed.token_byte_row[used]].abs().sum() > 0
    C, P = cfg.n_embd, cfg.padded_vocab_size
    extra = (P + 1 + NO_BYTE_ROW + 1) * C - P * C  # the two tables against flat's one
    groups = split_params(model)
    if embedding == "tuple":
        assert model.embed.embed_proj.weight.grad.abs().sum() > 0
        extra += 2 * C * C
        assert any(p is model.embed.embed_proj.weight for _, p in groups["matrix"])
        # the projection is a matmul: it counts towards FLOPs, the tables do not
        assert model.flops_per_token() == flat.flops_per_token() + 6 * 2 * C * C
    else:
        assert model.flops_per_token() == flat.flops_per_token()
    assert model.num_params() == flat.num_params() + extra
    assert {id(p) for _, p in groups["embed"]} == {id(model.embed.wte.weight), id(model.embed.wbe.weight)}


@pytest.mark.parametrize("embedding", list(EMBEDDINGS))
def test_weights_keep_their_top_level_names_and_sort_into_one_group_each(embedding):
    """model.embed is a module of its own, but its weights save under the names they had before
    it was (no `embed.` prefix), in the same order, and load back from them."""
    structure = None if embedding == "flat" else (PARENTS, LAST)
    model = GPT.build(config(6, embedding), "cpu", seed=1, token_structure=structure)
    own = {"flat": ["wte.weight"], "tuple": ["token_parent_row", "token_byte_row", "wte.weight", "wbe.weight",
                                            "embed_proj.weight"]}.get(embedding, ["token_parent_row", "token_byte_row",
                                                                               "wte.weight", "wbe.weight"])
    keys = list(model.state_dict())
    assert keys[: len(own)] == own and keys[len(own)].startswith("blocks.0.") and keys[-1] == "lm_head.weight"
    fresh = GPT.build(config(6, embedding), "cpu", seed=2)
    fresh.load_state_dict(model.state_dict())  # strict: every name found
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True))
    weights = model.embed.tables() + model.embed.matrices()
    assert sorted(map(id, weights)) == sorted(map(id, model.embed.parameters()))


def test_checkpoint_reloads_without_the_tokenizer_and_generates_the_same(tmp_path):
    tok = train_lz78_tokenizer(CORPUS, vocab_size=600)
    tree = tok.prefix_tree()
    cfg = config(tok.get_vocab_size(), "tuple")
    model = GPT.build(cfg, "cpu", seed=3, token_structure=(tree.parent, tree.last_byte)).eval()
    ckpt.save_checkpoint(tmp_path / "ck", model.state_dict(), {}, {"model_config": cfg.to_dict()})
    loaded, _ = ckpt.load_model(tmp_path / "ck", "cpu")  # no tokenizer folder anywhere
    assert torch.equal(loaded.embed.token_parent_row, model.embed.token_parent_row)
    assert torch.equal(loaded.embed.token_byte_row, model.embed.token_byte_row)
    prompt = tok.encode("To be, or not", prepend="<|bos|>")
    kw = dict(num_samples=2, max_tokens=12, temperature=1.0, seed=7)
    assert Engine(loaded, tok).generate_batch(prompt, **kw) == Engine(model, tok).generate_batch(prompt, **kw)


def test_hierarchical_needs_a_compressed_dictionary(tmp_path):
    lz = train_lz78_tokenizer(CORPUS, vocab_size=600)
    with pytest.raises(ConfigError, match="use model.embedding: structured"):
        token_structure(lz, "hierarchical")
    with pytest.raises(ConfigError, match="model.embedding=tuple: .*no prefix tree"):
        token_structure(train_tokenizer("sentencepiece", CORPUS * 3, vocab_size=400, model_type="bpe", seed=0), "tuple")
    # A tool's dictionary where "abc" hangs off the root beside "ab": its hierarchical parent is
    # none, its prefix parent "ab".
    d = CompressedDictionary.from_tokens([b"a", b"ab", b"abc", b"t", b"th", b"the"])
    d = CompressedDictionary(d.tokens, np.array([-1, 0, 1, 0, 0, 4, 5], np.int32),
                             (b"", b"a", b"b", b"abc", b"t", b"h", b"e"), np.array([0, 1, 2, 3, 4, 5, 6], np.int32),
                             d.source_codes)
    write_compressed_tsv(tmp_path / "d.tsv", d)
    tok = from_dictionary(tmp_path / "d.tsv")
    parents, last = token_structure(tok, "hierarchical")
    structured, _ = token_structure(tok, "structured")
    abc = tok.encode("abc")
    assert len(abc) == 1 and structured[abc[0]] == tok.encode("ab")[0] and parents[abc[0]] == -1
    assert last[abc[0]] == ord("c")
    the = tok.encode("the")[0]
    assert parents[the] == structured[the] == tok.encode("th")[0]
    model = GPT.build(config(tok.get_vocab_size(), "hierarchical"), "cpu", token_structure=(parents, last))
    assert model.embed.token_parent_row[abc[0]] == model.config.padded_vocab_size


def test_each_embedding_needs_a_structure_a_tokenizer_can_name():
    assert {cls.needs for cls in EMBEDDINGS.values()} <= {None, *TOKEN_STRUCTURES}
    assert EMBEDDINGS["flat"].needs is None and EMBEDDINGS["hierarchical"].needs == "hierarchical"


def test_the_stage_asks_the_tokenizer_what_it_provides_not_which_kind_it_is():
    """A kind of its own that gives hierarchical parents (every id's parent: none) feeds the
    hierarchical embedding with no edit to the stage, and the refusal of a kind without them
    names it as one that provides them."""

    class RootedBytes(ByteTokenizer):
        kind = "rooted_bytes"
        hierarchical_parents_from = "tokenizer.kind: rooted_bytes"

        @property
        def has_hierarchical_parents(self) -> bool:
            return True

        def hierarchical_parents(self) -> np.ndarray:
            return np.full(self.get_vocab_size(), -1, np.int64)

    register_kind(RootedBytes)
    try:
        tok = RootedBytes()
        parents, last = token_structure(tok, "hierarchical")
        assert (parents == -1).all() and np.array_equal(last, tok.prefix_tree().last_byte)
        with pytest.raises(
            ConfigError,
            match="model.embedding=hierarchical: needs the tokenizer's hierarchical parents: "
            "this byte tokenizer has none; .*tokenizer.kind: rooted_bytes provides them; "
            "or use model.embedding: structured, tuple or flat",
        ):
            token_structure(ByteTokenizer(), "hierarchical")
    finally:
        unregister_kind("rooted_bytes")
    with pytest.raises(NotProvidedError, match="hierarchical"):
        ByteTokenizer().token_structure("hierarchical")
