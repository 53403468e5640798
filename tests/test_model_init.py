"""`model.init`: the two weight recipes GPT.init_weights draws from (lockstep.model.gpt.INITS),
lockstep's own by default and nanochat's by name, held to nanochat's own init_weights where its
checkout is beside this one."""

from __future__ import annotations

import pytest
import torch

from lockstep.core.config import FieldError
from lockstep.model.gpt import GPT, GPTConfig
from lockstep.train.trainer import ModelParams

C = 256  # depth 4: wide enough that a weight's sample std is within 1% of its law's


def weights(model) -> dict[str, torch.Tensor]:
    """The weights both recipes name alike, by the role they play: q, k, v, proj, fc, fc_proj of
    block 0, the token table and the head."""
    if isinstance(model, GPT):
        b = model.blocks[0]
        table = model.embed.wte.weight
    else:  # nanochat's GPT
        b = model.transformer.h[0]
        table = model.transformer.wte.weight
    a, m = b.attn, b.mlp
    return {"q": a.c_q.weight, "k": a.c_k.weight, "v": a.c_v.weight, "proj": a.c_proj.weight, "fc": m.c_fc.weight,
            "fc_proj": m.c_proj.weight, "table": table, "head": model.lm_head.weight}


def law(init: str) -> dict[str, tuple[str, float]]:
    """(distribution, std) of each weight of weights() under `init`."""
    s = C**-0.5
    if init == "nanochat":
        return {"q": ("uniform", s), "k": ("uniform", s), "v": ("uniform", s), "fc": ("uniform", 0.4 * s),
                "proj": ("zero", 0.0), "fc_proj": ("zero", 0.0), "table": ("normal", 0.8), "head": ("normal", 1e-3)}
    return {"q": ("normal", s), "k": ("normal", s), "v": ("normal", s), "fc": ("normal", s),
            "proj": ("zero", 0.0), "fc_proj": ("zero", 0.0), "table": ("normal", 1.0), "head": ("normal", 1e-3)}


def check_law(ws: dict[str, torch.Tensor], expected: dict[str, tuple[str, float]]) -> None:
    for name, (kind, std) in expected.items():
        w = ws[name].detach().float()
        if kind == "zero":
            assert not w.any(), name
            continue
        assert w.std().item() == pytest.approx(std, rel=0.02), name
        bound = 3**0.5 * std
        if kind == "uniform":  # inside its bound, and filling it
            assert w.abs().max().item() <= bound * (1 + 1e-6) and w.abs().max().item() > 0.99 * bound, name
        else:  # a Normal's tails pass the bound of the uniform of the same std (8% of draws)
            assert (w.abs() > bound).float().mean().item() == pytest.approx(0.083, abs=0.02), name


@pytest.mark.parametrize("init", ["lockstep", "nanochat"])
def test_each_recipe_draws_its_distributions(init: str) -> None:
    model = GPT.build(GPTConfig.from_depth(4, vocab_size=4096, sequence_len=64, init=init), "cpu", seed=3)
    check_law(weights(model), law(init))


def test_lockstep_is_the_default_and_an_old_config_reads_as_it() -> None:
    assert GPTConfig.from_depth(4, vocab_size=64, sequence_len=16).init == "lockstep"
    assert ModelParams().gpt_config(64).init == "lockstep"
    old = GPTConfig.from_depth(4, vocab_size=64, sequence_len=16).to_dict()
    del old["init"]  # a checkpoint's meta.json from before the setting existed
    assert GPTConfig.from_dict(old).init == "lockstep"
    a = GPT.build(GPTConfig.from_depth(2, vocab_size=64, sequence_len=16), "cpu", seed=1)
    b = GPT.build(GPTConfig.from_depth(2, vocab_size=64, sequence_len=16, init="nanochat"), "cpu", seed=1)
    assert not torch.equal(a.blocks[0].attn.c_q.weight, b.blocks[0].attn.c_q.weight)


def test_a_recipe_is_reproducible_from_its_seed() -> None:
    cfg = GPTConfig.from_depth(2, vocab_size=64, sequence_len=16, init="nanochat")
    a, b = GPT.build(cfg, "cpu", seed=7), GPT.build(cfg, "cpu", seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_an_unknown_recipe_names_the_setting_and_the_choices() -> None:
    with pytest.raises(FieldError, match=r"init.*lockstep, nanochat"):
        ModelParams(init="xavier")


def test_nanochat_recipe_matches_nanochats_own_init(nanochat_root) -> None:
    """nanochat's GPT.init_weights at the same shape draws each of these weights from the law
    lockstep's `init: nanochat` does (its generator is its own, so the laws are compared)."""
    from nanochat.gpt import GPT as NanochatGPT
    from nanochat.gpt import GPTConfig as NanochatConfig

    torch.manual_seed(0)
    cfg = NanochatConfig(sequence_len=64, vocab_size=4096, n_layer=4, n_head=2, n_kv_head=2, n_embd=C,
                         window_pattern="L")
    with torch.device("meta"):
        theirs = NanochatGPT(cfg)
    theirs.to_empty(device="cpu")
    theirs.init_weights()
    check_law(weights(theirs), law("nanochat"))
    with pytest.raises(AssertionError):
        check_law(weights(theirs), law("lockstep"))  # the check tells the two apart
