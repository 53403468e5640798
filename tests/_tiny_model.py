"""The tiny GPT the tests build, in one place: `tiny_config`/`tiny_gpt` give a one-layer,
32-channel model over the byte vocabulary on the CPU, each field overridable by keyword, and
`randomize` replaces the init with random weights for tests whose outputs must depend on every
weight (the zero-initialised projections and the near-zero lm_head included), `fit_rows` trains
one a few steps on given token rows (so that its scores are not uniform), and
`save_untrained_chat_model` writes an eval stage's model inputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lockstep.model.checkpoint import save_checkpoint
from lockstep.model.gpt import GPT, GPTConfig
from lockstep.tokenizer.kinds import train_tokenizer

TINY = dict(sequence_len=64, vocab_size=265, n_layer=1, n_head=2, n_kv_head=2, n_embd=32)


def tiny_config(**overrides: Any) -> GPTConfig:
    """TINY with `overrides` (any GPTConfig field)."""
    return GPTConfig(**{**TINY, **overrides})


def tiny_gpt(*, seed: int = 0, **overrides: Any) -> GPT:
    """GPT.build(tiny_config(**overrides), "cpu", seed=seed)."""
    return GPT.build(tiny_config(**overrides), "cpu", seed=seed)


def randomize(model: GPT, seed: int = 0, scale: float = 0.3) -> GPT:
    """Every parameter drawn from N(0, scale^2) by a generator seeded with `seed`, in place;
    returns the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def fit_rows(rows: list[list[int]], *, steps: int, lr: float, pad_id: int = 0, seed: int = 0, **overrides: Any) -> GPT:
    """tiny_gpt(seed=seed, **overrides) trained for `steps` full-batch AdamW steps at `lr` on
    `rows` (token rows, each padded with `pad_id` to the longest; no pad is a target), in eval mode."""
    T = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad_id] * (T - len(r)) for r in rows])
    targets = torch.tensor([r[1:] + [-100] * (T - len(r) + 1) for r in rows])
    model = tiny_gpt(seed=seed, **overrides)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        model(ids, targets).backward()
        opt.step()
    return model.eval()


def save_untrained_chat_model(folder: Path, *, sequence_len: int = 512) -> None:
    """A byte tokenizer in `folder/tokenizer` and tiny_gpt over it, untrained, as the checkpoint
    `folder/ckpt`: what an eval stage loads."""
    tok = train_tokenizer("byte", ["some text"])
    tok.save(folder / "tokenizer")
    model = tiny_gpt(sequence_len=sequence_len, vocab_size=tok.get_vocab_size())
    save_checkpoint(folder / "ckpt", model.state_dict(), {0: {}},
                    {"step": 0, "model_config": model.config.to_dict(), "tokenizer_sha256": tok.sha256})
