"""Loaders: window invariant, SFT masking of a chat rendered by the real template against a
hand-built sequence, rank sharding, resume, mixtures, determinism from the generator, and the
in-order read of evaluation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lockstep.data.cache import CacheError
from lockstep.data.cache_build import build_pretrain_cache, build_sft_cache
from lockstep.data.loaders import (
    Mixture,
    PretrainTokenStreamDataset,
    ShardedTokenLoader,
    open_sft_dataset,
)
from lockstep.model.gpt import IGNORE_INDEX
from lockstep.tokenizer.kinds import train_tokenizer


@pytest.fixture(scope="module")
def pretrain(tok, tmp_path_factory):
    out = tmp_path_factory.mktemp("p") / "c"
    docs = [f"doc {i} " + "words and more words " * (i % 9) for i in range(300)]
    build_pretrain_cache({"train": docs, "val": docs[:20]}, out, tokenizer=tok, max_train_tokens=None,
                         max_val_tokens=None, shard_bytes=3000, seed=0, shuffle_buffer=32)  # fmt: skip
    return out


def _stream(ds) -> np.ndarray:
    return np.concatenate([np.asarray(s, dtype=np.int64) for s in ds.split.shards])


def test_window_invariant_ids_in_vocab_and_rows_match_shards(tok, pretrain):
    ds = PretrainTokenStreamDataset(pretrain / "train", T=64, device="cpu", tokenizer_sha256=tok.sha256)
    g = torch.Generator().manual_seed(0)
    seen_shards = set()
    for _ in range(20):
        x, y = ds.get_batch(B=8, generator=g)
        assert x.shape == y.shape == (8, 64) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y[:, :-1], x[:, 1:])
        assert int(x.min()) >= 0 and int(torch.cat([x, y]).max()) < tok.get_vocab_size()
        for row, info in enumerate(ds.last_rows):
            shard = ds.split.shards[info["shard"]]
            assert x[row].tolist() == shard[info["start"] : info["start"] + 64].tolist()
            assert int(y[row, -1]) == int(shard[info["start"] + 64])
            seen_shards.add(info["shard"])
    assert len(seen_shards) > 3
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert all(torch.equal(a, b) for a, b in zip(ds.get_batch(B=4, generator=g1), ds.get_batch(B=4, generator=g2)))


def test_window_longer_than_every_shard_is_refused(pretrain):
    with pytest.raises(CacheError, match="lower T"):
        PretrainTokenStreamDataset(pretrain / "train", T=5000, device="cpu")


@pytest.mark.parametrize("world_size", [1, 3])
def test_sharded_loader_ranks_disjoint_and_complete(pretrain, world_size):
    B, T = 2, 16
    loaders = [
        ShardedTokenLoader(pretrain / "train", B=B, T=T, rank=r, world_size=world_size) for r in range(world_size)
    ]
    stream = _stream(loaders[0])
    steps = loaders[0].steps_per_epoch
    covered = np.zeros(stream.size, dtype=np.int64)
    for _ in range(steps):
        for ld in loaders:
            x, y = ld.next_batch()
            for row, info in enumerate(ld.last_rows):
                s = info["start"]
                assert x[row].tolist() == stream[s : s + T].tolist()
                assert y[row].tolist() == stream[s + 1 : s + T + 1].tolist()
                covered[s : s + T] += 1
    span = steps * world_size * B * T
    assert (covered[:span] == 1).all() and (covered[span:] == 0).all()  # disjoint and together complete
    assert stream.size - span < world_size * B * T + 1  # what is left cannot fill another step
    loaders[0].next_batch()
    assert loaders[0].epoch == 1 and loaders[0].last_rows[0]["start"] == 0


def test_sharded_loader_resume_gives_the_same_next_8_batches(pretrain):
    a = ShardedTokenLoader(pretrain / "train", B=3, T=32, rank=1, world_size=2)
    for _ in range(a.steps_per_epoch - 3):  # resume across an epoch boundary too
        a.next_batch()
    state = a.state_dict()
    want = [a.next_batch() for _ in range(8)]
    b = ShardedTokenLoader(pretrain / "train", B=3, T=32, rank=1, world_size=2)
    b.load_state_dict(state)
    got = [b.next_batch() for _ in range(8)]
    assert all(torch.equal(p, q) for w, g in zip(want, got) for p, q in zip(w, g))
    c = ShardedTokenLoader(pretrain / "train", B=4, T=32, rank=1, world_size=2)
    with pytest.raises(ValueError, match="B=3"):
        c.load_state_dict(state)


def test_sft_masking_supervises_only_assistant_tokens_and_end(tok, tmp_path):
    """`sys`, `usr`, then the assistant's `AB`, through the real chat template, the SFT cache and
    the loader: only A, B and <|assistant_end|> are targets; the rest, and the padding, ignored.
    The expected sequence is spelled out by hand from the template's definition (docs/tokenizers.md),
    not taken from render_conversation, so a wrong masking rule fails here."""
    conv = {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": [{"type": "text", "text": "usr"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "AB"}]},
    ]}  # fmt: skip
    sp = tok.encode_special
    names = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>")
    bos, u0, u1, a0, a1 = (sp(name) for name in names)
    A, B = ord("A"), ord("B")  # the byte tokenizer: id = byte value
    # The system text is folded into the user turn: "sys", a blank line, "usr".
    seq = [bos, u0, *b"sys\n\nusr", u1, a0, A, B, a1]  # 15 ids
    T, pad = 20, 0
    build_sft_cache({"train": [conv]}, tmp_path / "s", tokenizer=tok, val_frac=None, seed=0)
    ds = open_sft_dataset(tmp_path / "s", "train", T=T, device="cpu", pad_id=pad, tokenizer_sha256=tok.sha256)
    x, y, y_masked = ds.get_batch(B=2, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == y_masked.shape == (2, T)
    n = len(seq)
    for row in range(2):  # one example in the cache: both rows hold it
        assert x[row].tolist() == seq + [pad] * (T - n)
        assert y[row].tolist() == seq[1:] + [IGNORE_INDEX] * (T - n + 1)
        # Targets at positions 11, 12, 13 are the tokens at 12, 13, 14: A, B and the end token.
        assert y_masked[row].tolist() == [IGNORE_INDEX] * 11 + [A, B, a1] + [IGNORE_INDEX] * (T - 14)


def test_sft_batch_with_tools_truncation_and_no_nan(tok, tmp_path):
    tool_conv = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is 6*7?"}]},
        {"role": "assistant", "content": [{"type": "python", "text": "6*7"}, {"type": "python_output", "text": "42"},
                                          {"type": "text", "text": "It is 42."}]},
    ]}  # fmt: skip
    long_prompt = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 100}]},
                                {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]}  # fmt: skip
    build_sft_cache({"train": [tool_conv, long_prompt]}, tmp_path / "s", tokenizer=tok, val_frac=None, seed=0)
    ds = open_sft_dataset(tmp_path / "s", "train", T=32, device="cpu", pad_id=0)
    assert len(ds) == 1 and ds.skipped_examples == 1  # the long prompt has no supervised target within T
    x, y, y_masked = ds.get_batch(B=4, generator=torch.Generator().manual_seed(1))
    ids, mask = tok.render_conversation(tool_conv)
    n = min(len(ids), 33)
    want = [t if m else IGNORE_INDEX for t, m in zip(ids[1:n], mask[1:n])]
    assert y_masked[0, : n - 1].tolist() == want
    out_start, out_end = tok.encode_special("<|output_start|>"), tok.encode_special("<|output_end|>")
    assert out_start in y[0].tolist() and out_start not in y_masked[0].tolist() and out_end not in y_masked[0].tolist()
    logits = torch.zeros(4, 32, tok.get_vocab_size())
    loss = F.cross_entropy(logits.flatten(0, 1), y_masked.flatten(), ignore_index=IGNORE_INDEX)
    assert torch.isfinite(loss)


def test_mixture_draws_rows_per_source_reproducibly(tok, pretrain, tmp_path):
    build_pretrain_cache({"train": ["zzzz " * 200] * 5}, tmp_path / "z", tokenizer=tok, max_train_tokens=None,
                         max_val_tokens=None, shard_bytes=1 << 16, seed=0, shuffle_buffer=1)  # fmt: skip
    a = PretrainTokenStreamDataset(pretrain / "train", T=16, device="cpu")
    z = PretrainTokenStreamDataset(tmp_path / "z" / "train", T=16, device="cpu")
    mix = Mixture([(a, 0.75), (z, 0.25)], names=["prose", "zzz"])
    x, y = mix.get_batch(B=400, generator=torch.Generator().manual_seed(3))
    sources = [r["source"] for r in mix.last_rows]
    assert 0.65 < sources.count("prose") / 400 < 0.85
    z_id = tok.encode("z")[0]
    for row, src in enumerate(sources):
        is_z = set(x[row].tolist()) <= {z_id, tok.encode(" ")[0], tok.get_bos_token_id()}
        assert is_z == (src == "zzz")
    x2, _ = mix.get_batch(B=400, generator=torch.Generator().manual_seed(3))
    assert torch.equal(x, x2)
    with pytest.raises(ValueError, match="weights"):
        Mixture([(a, 0.0)])


def _qa(i: int) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": f"q{i}" + "?" * (i % 4)}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "a" * (1 + i % 5)}]}]}


def test_in_order_reads_each_example_once_at_its_own_width(tmp_path) -> None:
    # 11 examples of 8-14 tokens, T = 10: batches of 4 in the split's order, each as wide as its
    # longest example (cut to T + 1 tokens), assistant targets only, every example once; ranks
    # split them and together read them all; a token cap stops at the example that reaches it.
    tok = train_tokenizer("byte", [])
    build_sft_cache({"train": [_qa(i) for i in range(11)]}, tmp_path / "s", tokenizer=tok, val_frac=None, seed=0)
    ds = open_sft_dataset(tmp_path / "s", "train", T=10, device="cpu", pad_id=0)
    lengths = ds.example_lengths()
    assert lengths.min() < 11 < lengths.max() and len(ds) == 11
    tokens, mask, offsets = ds.split.tokens, ds.split.mask, ds.split.offsets
    batches = list(ds.in_order(rows=4))
    assert [x.shape[0] for x, _ in batches] == [4, 4, 3]
    for b, (x, y) in enumerate(batches):
        examples = range(4 * b, 4 * b + x.shape[0])
        assert x.shape == y.shape and x.shape[1] == min(int(lengths[list(examples)].max()), 11) - 1
        for r, ex in enumerate(examples):
            lo, n = int(offsets[ex]), min(int(lengths[ex]), 11)
            want_y = [t if m else IGNORE_INDEX for t, m in zip(tokens[lo + 1 : lo + n].tolist(), mask[lo + 1 : lo + n])]
            assert x[r, : n - 1].tolist() == tokens[lo : lo + n - 1].tolist()
            assert y[r].tolist() == want_y + [IGNORE_INDEX] * (x.shape[1] - n + 1)
            assert any(t != IGNORE_INDEX for t in want_y)
    whole = torch.cat([x.flatten() for x, _ in batches])
    by_rank = torch.cat([x.flatten() for r in range(3) for x, _ in ds.in_order(rows=2, rank=r, world_size=3)])
    assert sorted(whole[whole != 0].tolist()) == sorted(by_rank[by_rank != 0].tolist())
    capped = list(ds.in_order(rows=4, max_tokens=min(int(lengths[0]), 11) + 1))
    assert len(capped) == 1 and capped[0][0].shape[0] == 2
