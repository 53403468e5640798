"""RL: the reward reads the `####` answer; only sampled tokens carry gradient; one policy update
raises the log-probability of rewarded completions and lowers that of unrewarded ones."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from _tiny_model import randomize, tiny_gpt
from lockstep.core.config import ConfigError, build_config
from lockstep.infer.engine import Engine
from lockstep.model.gpt import GPT
from lockstep.model.gpt import IGNORE_INDEX
import lockstep.rl
from lockstep.rl.config import RLConfig
from lockstep.rl.losses import anchor_loss_backward, policy_loss_backward
from lockstep.evaluate.benchmarks.gsm8k import reward
from lockstep.rl.rollouts import Completion, Rollouts, prompt_ids, reference_completion, reference_results, tool_steps
from lockstep.rl.trainer import RLTrainer, _derived_seed, draw_problems, series_columns


def tiny_model(seed: int = 0) -> GPT:
    return randomize(tiny_gpt(seed=seed, n_layer=2), seed=seed + 1)


def rollouts(prompts, ids, sampled, rewards, advantages, *, credit=None, roles=None) -> Rollouts:
    """Rollouts of one Completion per position of the lists given."""
    n = len(ids)
    return Rollouts(
        [
            Completion(*row, role=role, credit=c)
            for row, role, c in zip(
                zip(prompts, ids, sampled, rewards, advantages), roles or ["sample"] * n, credit or [None] * n
            )
        ]
    )


def rollout(model: GPT, tok, problems, cfg: RLConfig, *, seed: int, **decode) -> Rollouts:
    """RLTrainer.rollout of `problems`, decoding with the Engine keywords `decode`."""
    trainer = RLTrainer(
        model,
        tok,
        cfg,
        train_problems=problems,
        val_problems=problems,
        device=torch.device("cpu"),
        seed=0,
        decode=decode,
    )
    return trainer.rollout(problems, seed=seed)


def col(ro: Rollouts, name: str) -> list:
    """One field of every completion, in order."""
    return [getattr(c, name) for c in ro.completions]


@pytest.mark.parametrize("completion,ok", [
    ("so 3+4 = 7\n#### 7", True),
    ("#### 1,234", False),
    ("the answer is 7", False),  # no `####`: a number elsewhere in the text does not count
    ("#### 7.0", True),
    ("#### -7", False),
])
def test_reward_reads_the_final_answer(completion, ok):
    assert reward(completion, "3+4=<<3+4=7>>7\n#### 7") == (1.0 if ok else 0.0)


def test_reward_refuses_reference_without_answer():
    with pytest.raises(ValueError, match="no final number"):
        reward("#### 3", "no number here")


def test_config_refuses_group_of_one():
    with pytest.raises(ConfigError, match="group_size"):
        build_config(RLConfig, {"group_size": 1}, where="rl")


@pytest.mark.parametrize("updates, message", [
    (0, r"rl\.updates_per_step=0 must be"),
    (9, r"rl\.updates_per_step=9 splits 8 problems per step: at most problems_per_step"),
])
def test_config_refuses_more_updates_than_problems(updates, message):
    with pytest.raises(ConfigError, match=message):
        build_config(RLConfig, {"problems_per_step": 8, "updates_per_step": updates}, where="rl")


def test_split_keeps_each_group_in_one_update():
    # 3 groups of 2 into 2 updates: whole groups, in order, nothing lost or repeated.
    ro = rollouts([[g] for g in (0, 0, 1, 1, 2, 2)], [[10 + i] for i in range(6)], [[1]] * 6,
                  [1.0, 0.0, 1.0, 1.0, 0.0, 1.0], [0.5, -0.5, 0.0, 0.0, -0.5, 0.5])
    parts = ro.split(2, group_rows=2)
    assert [len(p.completions) for p in parts] == [4, 2]
    assert [col(p, "prompt") for p in parts] == [[[0], [0], [1], [1]], [[2], [2]]]
    assert sum((p.completions for p in parts), []) == ro.completions
    assert ro.split(1, group_rows=2)[0] == ro


@pytest.mark.parametrize("mixture, message", [
    ({"synth_math": 0.25}, r"rl\.mixture\.synth_math=0\.25 names rl\.problems itself"),
    ({"other": 1.0}, r"rl\.mixture\.other=1\.0 must be a finite number in \(0, 1\)"),
    ({"other": 0.01}, r"rl\.mixture\.other=0\.01 gives no problem of the 8 per update"),
    ({"a": 0.5, "b": 0.5}, r"rl\.mixture=.* leaves no problem of rl\.problems in an update of 8"),
])
def test_config_refuses_a_mixture_that_leaves_a_source_no_problem(mixture, message):
    with pytest.raises(ConfigError, match=message):
        build_config(RLConfig, {"problems": "synth_math", "problems_per_step": 8, "mixture": mixture}, where="rl")


def test_draw_takes_each_mixture_share_and_is_unchanged_without_one():
    main = [{"id": f"m{i}"} for i in range(50)]
    easy = [{"id": f"e{i}"} for i in range(50)]
    plain = RLConfig(problems="hard", problems_per_step=8)
    mixed = RLConfig(problems="hard", problems_per_step=8, mixture={"easy": 0.25})
    assert mixed.draws() == {"easy": 2}
    got = draw_problems(main, {"easy": easy}, mixed, seed=5, step=3)
    assert sorted(p["id"][0] for p in got) == ["e"] * 2 + ["m"] * 6
    # shuffled: with updates_per_step=2, the first update of a step gets mixture problems too
    first_halves = [draw_problems(main, {"easy": easy}, mixed, seed=5, step=s)[:4] for s in range(20)]
    assert sum(p["id"][0] == "e" for half in first_halves for p in half) > 0
    assert got == draw_problems(main, {"easy": easy}, mixed, seed=5, step=3)  # a function of (seed, step)
    assert got != draw_problems(main, {"easy": easy}, mixed, seed=5, step=4)
    # without a mixture: the draw every earlier run made (randint over the whole update)
    g = torch.Generator().manual_seed(_derived_seed(5, "draw", 3))
    expected = [main[i] for i in torch.randint(len(main), (8,), generator=g).tolist()]
    assert draw_problems(main, {}, plain, seed=5, step=3) == expected


def _logp(model: GPT, prompt: list[int], completion: list[int]) -> float:
    seq = torch.tensor([prompt + completion])
    y = torch.full_like(seq, -100)[:, :-1].clone()
    y[0, len(prompt) - 1:] = torch.tensor(completion)
    with torch.no_grad():
        return -float(model(seq[:, :-1], targets=y, loss_reduction="sum"))


def test_forced_tokens_carry_no_gradient(tok):
    model = tiny_model()
    prompt = tok.encode("q: 1+1?")
    comp_a = tok.encode("#### 2") + [tok.encode_special("<|output_end|>")]
    comp_b = comp_a[:-1] + [tok.encode_special("<|assistant_end|>")]  # differs only in the last, forced token
    sampled = [1] * (len(comp_a) - 1) + [0]
    losses = []
    for comp in (comp_a, comp_b):
        ro = rollouts([prompt, prompt], [comp, comp], [sampled, sampled], [1.0, 0.0], [0.5, 0.25])
        loss, n = policy_loss_backward(model, ro, device=torch.device("cpu"), rows_per_pass=2)
        assert n == 2 * (len(comp) - 1)
        losses.append(loss)
        model.zero_grad()
    assert losses[0] == pytest.approx(losses[1], abs=0, rel=1e-6)


def test_zero_advantage_step_is_a_no_op(tok):
    model = tiny_model()
    prompt = tok.encode("q")
    ro = rollouts([prompt] * 2, [[65, 66]] * 2, [[1, 1]] * 2, [1.0, 1.0], [0.0, 0.0])
    assert policy_loss_backward(model, ro, device=torch.device("cpu"), rows_per_pass=4) == (0.0, 0)
    assert all(p.grad is None for p in model.parameters())


def test_policy_update_moves_logprobs_by_advantage(tok):
    model = tiny_model(3)
    prompt = tok.encode("Q: 2+2? A:")
    good, bad = tok.encode("#### 4"), tok.encode("#### 5")
    before = (_logp(model, prompt, good), _logp(model, prompt, bad))
    ro = rollouts([prompt, prompt], [good, bad], [[1] * len(good), [1] * len(bad)], [1.0, 0.0], [0.5, -0.5])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    policy_loss_backward(model, ro, device=torch.device("cpu"), rows_per_pass=1)
    opt.step()
    after = (_logp(model, prompt, good), _logp(model, prompt, bad))
    assert after[0] > before[0] and after[1] < before[1]



def _tool_call(tok, text: str, expr: str, result: str) -> list[int]:
    """`text` then a finished tool call as the engine emits it: `expr` sampled, `result` forced."""
    sp = tok.encode_special
    return (tok.encode(text) + [sp("<|python_start|>"), *tok.encode(expr), sp("<|python_end|>"),
                                sp("<|output_start|>"), *tok.encode(result), sp("<|output_end|>")])


def test_tool_steps_mark_each_call_and_whether_its_result_is_the_reference_s(tok):
    engine = Engine(tiny_model(), tok)
    first, second, third = (_tool_call(tok, "a ", "3*4", "12"), _tool_call(tok, "12. b ", "3*4", "12"),
                            _tool_call(tok, "12. c ", "12+5", "17"))
    cut = [tok.encode_special("<|python_start|>"), *tok.encode("17-2"), tok.encode_special("<|python_end|>")]
    completion = first + second + third + cut
    results = reference_results("<<3*4=12>>12 <<12+5=17>>17 <<17-2=15>>15\n#### 15")
    assert results == {"12": 1, "17": 1, "15": 1}
    steps = tool_steps(completion, engine, results)
    assert results == {"12": 1, "17": 1, "15": 1}  # the caller's count is left as it was, for the next completion
    python_end = [i for i, t in enumerate(completion) if t == engine.python_end_id]
    assert [(w.start, w.stop) for w, _ in steps] == [(0, python_end[0] + 1), (len(first), python_end[1] + 1),
                                                     (len(first + second), python_end[2] + 1)]
    # the reference's 12 matches one call only; the last call got no output before the budget ran out
    assert [right for _, right in steps] == [True, False, True]


def test_token_credit_adds_to_each_token_s_advantage(tok):
    """The loss with per-token credit equals -sum((A + credit) x log p) / N, written out; a
    completion whose advantage is 0 still counts when its credit is not."""
    prompt = tok.encode("Q: 2+2? A:")
    good, bad = tok.encode("#### 4"), tok.encode("#### 5")
    credit = [[0.1 * t for t in range(len(good))], [-0.2] * len(bad)]
    ro = rollouts([prompt, prompt], [good, bad], [[1] * len(good), [1] * len(bad)], [1.0, 1.0], [0.0, 0.0],
                  credit=credit)
    model = tiny_model(3)
    loss, n = policy_loss_backward(model, ro, device=torch.device("cpu"), rows_per_pass=1)
    assert n == len(good) + len(bad)
    expected = 0.0
    for comp, row in zip((good, bad), credit):
        seq = torch.tensor([prompt + comp])
        with torch.no_grad():
            logits = model(seq[:, :-1])
        logp = torch.log_softmax(logits.float(), -1)[0, len(prompt) - 1:].gather(1, torch.tensor(comp)[:, None])[:, 0]
        expected += float(-(torch.tensor(row) * logp).sum()) / n
    assert loss == pytest.approx(expected, rel=1e-5)
    assert col(ro.select([1]), "credit") == [credit[1]]


def _two_groups(tok) -> Rollouts:
    """Two problems' groups of three: prompts of different lengths (one a lone <|bos|>), a
    forced tool output, per-token credit, and a zero-advantage completion without credit."""
    sp = tok.encode_special
    long_prompt, short_prompt = [sp("<|bos|>")] + tok.encode("Q: 12 eggs, 3 eaten. A:"), [sp("<|bos|>")]
    forced = _tool_call(tok, "eggs ", "12-3", "9")
    comps = [forced + tok.encode(" #### 9"), tok.encode("#### 8"), tok.encode("#### 9 eggs"),
             tok.encode("#### 4"), tok.encode("#### 40 or so"), tok.encode("#### 5")]
    out_start, out_end = forced.index(sp("<|output_start|>")), forced.index(sp("<|output_end|>"))
    sampled = [[1] * len(c) for c in comps]
    sampled[0][out_start:out_end + 1] = [0] * (out_end + 1 - out_start)  # the calculator's words
    credit = [[0.25] * len(c) if k == 0 else [0.0] * len(c) for k, c in enumerate(comps)]
    credit[4] = [0.0] * len(comps[4])  # with advantage 0 below: skipped by both paths
    return rollouts([long_prompt] * 3 + [short_prompt] * 3, comps, sampled, [1.0, 0.0, 1.0, 1.0, 0.5, 0.0],
                    [1 / 3, -2 / 3, 1 / 3, 0.5, 0.0, -0.5], credit=credit)


@pytest.mark.parametrize("rows_per_pass", [2, 16])
def test_prompt_once_gives_the_plain_loss_and_gradients(tok, rows_per_pass):
    """The shared-prompt passes equal the plain ones (fp32, to rounding): loss, token count and
    every parameter's gradient, whether a group fits one pass or is cut into several."""
    ro = _two_groups(tok)
    results = []
    for once in (False, True):
        model = tiny_model(4)
        loss, n = policy_loss_backward(model, ro, device=torch.device("cpu"), rows_per_pass=rows_per_pass,
                                       prompt_once=once)
        results.append((loss, n, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}))
    (plain_loss, plain_n, plain_grads), (once_loss, once_n, once_grads) = results
    assert once_n == plain_n == sum(sum(ro.completions[i].sampled) for i in (0, 1, 2, 3, 5))
    assert once_loss == pytest.approx(plain_loss, rel=1e-5)
    assert once_grads.keys() == plain_grads.keys() and plain_grads
    for name, g in plain_grads.items():
        torch.testing.assert_close(once_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_prompt_once_passes_hold_one_prompt_each(tok, monkeypatch):
    """Passes break where the prompt changes and at rows_per_pass; each runs its prompt once."""
    import lockstep.rl.losses as losses

    ro = _two_groups(tok)
    rows = [ro.completions[i] for i in (0, 1, 2, 3, 5)]
    runs = [[ro.completions.index(c) for c in run] for run in losses._same_prompt_runs(rows, 2)]
    assert runs == [[0, 1], [2], [3, 5]]
    runs = [[ro.completions.index(c) for c in run] for run in losses._same_prompt_runs(rows, 16)]
    assert runs == [[0, 1, 2], [3, 5]]
    model = tiny_model(4)
    widths = []
    real = GPT.final_hidden

    def watch(self, idx, kv_cache=None):
        widths.append(tuple(idx.shape))
        return real(self, idx, kv_cache)

    monkeypatch.setattr(GPT, "final_hidden", watch)
    policy_loss_backward(model, ro, device=torch.device("cpu"), rows_per_pass=16, prompt_once=True)
    longest = max(len(c.ids) for c in ro.completions[:3])
    # the long prompt less its last token once, then its three completions; the lone <|bos|>
    # leaves nothing to run before its two completions
    assert widths == [(1, len(ro.completions[0].prompt) - 1), (3, longest),
                      (2, max(len(ro.completions[i].ids) for i in (3, 5)))]


@pytest.mark.parametrize("section, message", [
    ({"anchor": {"synth_chat": 0.0}}, r"rl\.anchor\.synth_chat=0\.0 must be a finite number > 0; the weight"),
    ({"anchor": {"synth_chat": 1.0}, "anchor_weight": 0.0}, r"rl\.anchor_weight=0\.0 must be .*> 0; drop rl\.anchor"),
    ({"anchor_rows": 0}, r"rl\.anchor_rows=0 must be an integer >= 1"),
])
def test_config_refuses_an_anchor_without_weight_or_rows(section, message):
    with pytest.raises(ConfigError, match=message):
        build_config(RLConfig, section, where="rl")


class FixedBatches:
    """A loader that gives the same (x, y, y_masked) whatever it is asked for."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def get_batch(self, *, B: int, generator: torch.Generator):
        assert B == self.x.shape[0]
        return self.x, self.y, self.y


def anchor_conversations(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Three conversations of 12 tokens as an anchor batch (x, y): a 5-token prompt, the third
    reply shorter, the last 2 columns padding, so the passes read only the first 10."""
    x = torch.randint(0, 200, (3, 12), generator=g)
    y = torch.randint(0, 200, (3, 12), generator=g)
    y[:, :5] = IGNORE_INDEX  # the prompt
    y[2, 8:] = IGNORE_INDEX  # a shorter reply
    y[:, 10:] = IGNORE_INDEX  # padding
    return x, y


def test_anchor_adds_its_weighted_mean_cross_entropy_to_the_gradient():
    # Three conversations, two passes (device_batch_rows 2), cut to the last supervised column:
    # the gradient is anchor_weight times that of the mean cross-entropy over every supervised
    # target of the three, read at full width, and the series gets an anchor_loss column.
    g = torch.Generator().manual_seed(0)
    x, y = anchor_conversations(g)
    cfg = RLConfig(anchor={"chat": 1.0}, anchor_rows=3, anchor_weight=0.4, device_batch_rows=2)
    model = tiny_model(5)
    loss = anchor_loss_backward(model, FixedBatches(x, y), cfg, device=torch.device("cpu"), generator=g)
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    want = torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX)
    (0.4 * want).backward()
    assert loss == pytest.approx(want.item(), rel=1e-5)
    for a, p in zip(got, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)
    assert "anchor_loss" in series_columns(cfg)["train"] and "anchor_loss" not in series_columns(RLConfig())["train"]


def test_sft_anchor_is_the_kl_to_the_reference_and_zero_until_the_policy_moves():
    # The same three conversations as above. Against itself the loss and every gradient are zero;
    # against another model it is KL(reference || model) per supervised target, read at full
    # width from the full logits, with the reference left untouched.
    g = torch.Generator().manual_seed(0)
    x, y = anchor_conversations(g)
    cfg = RLConfig(anchor={"chat": 1.0}, anchor_rows=3, anchor_weight=0.4, device_batch_rows=2, anchor_target="sft")
    model, reference = tiny_model(5), tiny_model(5).requires_grad_(False)
    loss = anchor_loss_backward(model, FixedBatches(x, y), cfg, device=torch.device("cpu"), generator=g,
                                reference=reference)
    assert loss == pytest.approx(0.0, abs=1e-6)
    assert all(float(p.grad.abs().max()) < 1e-6 for p in model.parameters())

    model = tiny_model(6)
    loss = anchor_loss_backward(model, FixedBatches(x, y), cfg, device=torch.device("cpu"), generator=g,
                                reference=reference)
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    keep = y != IGNORE_INDEX
    ref = reference(x).float().log_softmax(-1)[keep]
    kl = (ref.exp() * (ref - model(x).float().log_softmax(-1)[keep])).sum(-1).mean()
    (0.4 * kl).backward()
    assert loss == pytest.approx(kl.item(), rel=1e-4) and kl.item() > 0.01
    for a, p in zip(got, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)
    assert all(p.grad is None for p in reference.parameters())


@pytest.mark.parametrize("target", ["data", "sft"])
def test_rl_keeps_a_frozen_reference_only_for_the_sft_anchor(tok, target, monkeypatch):
    seen = []
    def fake_anchor(model, anchor, cfg, *, device, generator, autocast=None, reference=None):
        seen.append(reference)
        return 0.0
    monkeypatch.setattr("lockstep.rl.trainer.anchor_loss_backward", fake_anchor)
    monkeypatch.setattr("lockstep.rl.trainer.reward", lambda text, answer: float(len(text) % 2))
    model = tiny_model(5)
    start = [p.detach().clone() for p in model.parameters()]
    cfg = build_config(RLConfig, {"group_size": 4, "problems_per_step": 2, "max_new_tokens": 8, "num_steps": 2,
                                  "eval_every_steps": 0, "eval_problems": 1, "pass_k": 1, "anchor": {"chat": 1.0},
                                  "anchor_target": target}, where="rl")
    problems = [{"question": f"{i}+1?", "answer": "#### 1"} for i in range(4)]
    RLTrainer(model, tok, cfg, train_problems=problems, val_problems=problems, device=torch.device("cpu"), seed=3,
              anchor=FixedBatches(None, None)).fit()
    assert seen, "no update carried the anchor"
    if target == "data":
        assert all(r is None for r in seen)
    else:
        assert all(r is seen[0] for r in seen) and seen[0] is not model
        assert not any(p.requires_grad for p in seen[0].parameters()) and not seen[0].training
        for a, b in zip(start, seen[0].parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # the starting weights, kept as they were


def test_rollout_groups_share_a_prompt_and_center_rewards(tok):
    model = tiny_model(5).eval()
    cfg = build_config(RLConfig, {"group_size": 4, "problems_per_step": 2, "max_new_tokens": 8}, where="rl")
    problems = [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "#### 4"}]
    ro = rollout(model, tok, problems, cfg, seed=7)
    assert len(ro.completions) == 8
    for g in range(2):
        group = ro.completions[4 * g: 4 * g + 4]
        assert sum(c.advantage for c in group) == pytest.approx(0.0)
        assert all(c.prompt == group[0].prompt for c in group)
    again = rollout(model, tok, problems, cfg, seed=7)
    assert again.completions == ro.completions  # seeded: a pure function of its inputs


@pytest.mark.parametrize("mode", ["member", "baseline"])
def test_greedy_rollout_joins_its_group_or_is_its_baseline(tok, mode, monkeypatch):
    model = tiny_model(5).eval()
    for where in ("trainer", "strategies"):  # the samples' rewards and the greedy completion's; a random model scores 0
        monkeypatch.setattr(f"lockstep.rl.{where}.reward", lambda text, answer: float(len(text) % 2))
    cfg = build_config(RLConfig, {"group_size": 4, "problems_per_step": 2, "max_new_tokens": 8,
                                  "greedy_rollout": mode}, where="rl")
    problems = [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "#### 4"}]
    engine = Engine(model, tok)
    plain = rollout(model, tok, problems, dataclasses.replace(cfg, greedy_rollout="off"), seed=7)
    ro = rollout(model, tok, problems, cfg, seed=7)
    greedy = engine.generate_greedy([prompt_ids(tok, p["question"]) for p in problems], max_tokens=8, batch_rows=8)
    g_rewards = [float(len(tok.decode(g)) % 2) for g in greedy]
    rows = 5 if mode == "member" else 4
    assert len(ro.completions) == 2 * rows
    for g in range(2):
        group = ro.completions[rows * g: rows * g + rows]
        assert [c.ids for c in group[:4]] == col(plain, "ids")[4 * g: 4 * g + 4]  # the same samples
        rewards = [c.reward for c in group]
        if mode == "member":
            assert group[4].ids == greedy[g] and [c.role for c in group] == ["sample"] * 4 + ["greedy"]
            assert [c.advantage for c in group] == pytest.approx([r - sum(rewards) / 5 for r in rewards])
        else:
            assert [c.role for c in group] == ["sample"] * 4
            assert [c.advantage for c in group] == pytest.approx([r - g_rewards[g] for r in rewards])
    assert ro.mean_reward == pytest.approx(plain.mean_reward)  # over the samples only


def test_group_std_advantage_divides_each_group_by_its_std(tok, monkeypatch):
    model = tiny_model(5).eval()
    monkeypatch.setattr(
        "lockstep.rl.trainer.reward", lambda text, answer: float(len(text) % 2)
    )  # a random model scores 0
    cfg = build_config(RLConfig, {"group_size": 8, "problems_per_step": 3, "max_new_tokens": 8,
                                  "advantage": "group_std"}, where="rl")
    problems = [{"question": q, "answer": "#### 2"} for q in ("1+1?", "2+2?", "3+3?")]
    plain = rollout(model, tok, problems, dataclasses.replace(cfg, advantage="mean"), seed=7)
    ro = rollout(model, tok, problems, cfg, seed=7)
    assert col(ro, "ids") == col(plain, "ids") and col(ro, "reward") == col(plain, "reward")
    spread = 0
    for g in range(3):
        group = slice(8 * g, 8 * g + 8)
        std = torch.tensor(col(ro, "reward")[group]).std(unbiased=False).item()
        if std == 0:  # unanimous: nothing to push, in either mode
            assert col(ro, "advantage")[group] == [0.0] * 8
            continue
        spread += 1
        assert col(ro, "advantage")[group] == pytest.approx([a / std for a in col(plain, "advantage")[group]])
        assert torch.tensor(col(ro, "advantage")[group]).std(unbiased=False).item() == pytest.approx(1.0)
    assert spread, "no group had both rewards: pick another seed"


def test_rollout_credits_each_call_against_its_group_s_calls(tok, monkeypatch):
    model = tiny_model(5).eval()
    # one call per completion, on its first token, right when that token is even
    monkeypatch.setattr(
        "lockstep.rl.strategies.tool_steps", lambda ids, engine, results: [(range(0, 1), ids[0] % 2 == 0)]
    )
    cfg = build_config(RLConfig, {"group_size": 8, "problems_per_step": 2, "max_new_tokens": 8,
                                  "step_advantage": 0.5}, where="rl")
    problems = [{"question": q, "answer": "#### 2"} for q in ("1+1?", "3+3?")]
    ro = rollout(model, tok, problems, cfg, seed=7)
    plain = rollout(model, tok, problems, dataclasses.replace(cfg, step_advantage=0.0), seed=7)
    assert col(plain, "credit") == [None] * 16 and col(ro, "advantage") == col(plain, "advantage")
    for g in range(2):
        group = ro.completions[8 * g: 8 * g + 8]
        flags = [c.ids[0] % 2 == 0 for c in group]
        assert 0 < sum(flags) < 8, "a group of one kind tests nothing: pick another seed"
        mean = sum(flags) / 8
        for c, right in zip(group, flags):
            assert c.credit == [0.5 * (right - mean)] + [0.0] * (len(c.ids) - 1)


def test_config_refuses_an_unknown_greedy_rollout():
    with pytest.raises(ConfigError, match=r"rl\.greedy_rollout='on' must be one of \['off', 'member', 'baseline'\]"):
        build_config(RLConfig, {"greedy_rollout": "on"}, where="rl")


@pytest.mark.parametrize("key, choices", [("reference_rollout", r"\['off', 'unsolved'\]"),
                                          ("advantage", r"\['mean', 'group_std'\]")])
def test_config_refuses_a_strategy_name_its_table_lacks(key, choices):
    with pytest.raises(ConfigError, match=rf"rl\.{key}='on' must be one of {choices}"):
        build_config(RLConfig, {key: "on"}, where="rl")


def test_rollouts_on_the_static_cache_path_equal_the_reference(tok):
    """What RL's rollouts get on CUDA with runtime.kernels (Engine(fast=True)), here on the CPU:
    the same completions, masks and rewards for the same seed."""
    model = tiny_model(5).eval()
    cfg = build_config(RLConfig, {"group_size": 4, "problems_per_step": 2, "max_new_tokens": 12}, where="rl")
    problems = [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "#### 4"}]
    ref = rollout(model, tok, problems, cfg, seed=7)
    fast = rollout(model, tok, problems, cfg, seed=7, fast=True)
    assert fast.completions == ref.completions  # ids, masks, rewards and advantages
    assert len({tuple(c.ids) for c in ref.completions}) > 1


@pytest.mark.parametrize("greedy, reference, rows", [("off", "off", 8), ("baseline", "off", 8), ("member", "off", 9),
                                                     ("off", "unsolved", 9), ("member", "unsolved", 10)])
def test_group_rows_counts_a_member_greedy_completion_and_the_reference(greedy, reference, rows):
    assert RLConfig(group_size=8, greedy_rollout=greedy, reference_rollout=reference).group_rows == rows


_SOLVED = {"question": "2+2?", "answer": "Two and two make 2 + 2 = <<2+2=4>>4.\n#### 4"}
_UNSOLVED = {"question": "1+1?", "answer": "One and one make 1 + 1 = <<1+1=2>>2.\n#### 2"}


def test_reference_completion_is_the_solution_as_the_model_would_write_it(tok):
    prompt = prompt_ids(tok, _SOLVED["question"])
    ids, mask = reference_completion(tok, _SOLVED, prompt)
    full, _ = tok.render_conversation({"messages": [{"role": "user", "content": "2+2?"}, {
        "role": "assistant", "content": [{"type": "text", "text": "Two and two make 2 + 2 = "},
                                         {"type": "python", "text": "2+2"}, {"type": "python_output", "text": "4"},
                                         {"type": "text", "text": "4.\n#### 4"}]}]})
    assert prompt + ids == full and ids[-1] == tok.encode_special("<|assistant_end|>")
    assert reward(tok.decode(ids), _SOLVED["answer"]) == 1.0
    forced = [t for t, m in zip(ids, mask) if not m]  # the calculator's output and its delimiters, nothing else
    assert forced == [tok.encode_special("<|output_start|>"), *tok.encode("4"), tok.encode_special("<|output_end|>")]


@pytest.mark.parametrize("max_new_tokens, trained", [(64, 1.0), (16, 0.0)])
def test_reference_rollout_trains_the_solution_beside_an_unsolved_group_only(tok, monkeypatch, max_new_tokens, trained):
    """Beside a group none of whose samples is right, the reference solution is trained with
    advantage 1 when it fits the completion budget; the samples, their advantages and credit and
    the step's mean reward stay as without it."""
    model = tiny_model(5).eval()
    # samples of the 2+2 problem are right at odd lengths; no sample of 1+1 is ever right
    monkeypatch.setattr(
        "lockstep.rl.trainer.reward", lambda text, answer: float(answer.endswith("4") and len(text) % 2)
    )
    monkeypatch.setattr(
        "lockstep.rl.strategies.tool_steps", lambda ids, engine, results: [(range(0, 1), ids[0] % 2 == 0)]
    )
    cfg = build_config(RLConfig, {"group_size": 4, "problems_per_step": 2, "max_new_tokens": max_new_tokens,
                                  "step_advantage": 0.5, "reference_rollout": "unsolved"}, where="rl")
    plain = rollout(model, tok, [_UNSOLVED, _SOLVED], dataclasses.replace(cfg, reference_rollout="off"), seed=7)
    ro = rollout(model, tok, [_UNSOLVED, _SOLVED], cfg, seed=7)
    assert any(col(plain, "reward")[4:]), "the 2+2 group has no right sample: pick another seed"
    assert len(ro.completions) == 10 and col(ro, "role") == (["sample"] * 4 + ["reference"]) * 2
    for g, problem in enumerate((_UNSOLVED, _SOLVED)):
        assert ro.completions[5 * g: 5 * g + 4] == plain.completions[4 * g: 4 * g + 4]  # every field
        ref = ro.completions[5 * g + 4]
        ref_ids, ref_mask = reference_completion(tok, problem, prompt_ids(tok, problem["question"]))
        assert (ref.prompt, ref.ids, ref.sampled) == (prompt_ids(tok, problem["question"]), ref_ids, ref_mask)
        assert ref.credit is None  # no credit of its own
    assert ro.completions[4].advantage == trained and ro.completions[9].advantage == 0.0
    assert (ro.mean_reward, ro.mean_length) == (plain.mean_reward, plain.mean_length)  # the samples' only
    assert ro.decoded_tokens == plain.decoded_tokens == sum(len(c.ids) for c in plain.completions)


def test_a_trained_reference_is_the_cross_entropy_of_its_written_tokens(tok):
    """A reference row with advantage 1, the rest 0: the policy loss is the summed cross-entropy
    of the tokens the model writes in the solution, not the calculator's output, over their count."""
    model = tiny_model(3)
    prompt = prompt_ids(tok, _UNSOLVED["question"])
    ids, mask = reference_completion(tok, _UNSOLVED, prompt)
    ro = rollouts([prompt] * 2, [[65, 66], ids], [[1, 1], mask], [0.0, 1.0], [0.0, 1.0], roles=["sample", "reference"])
    loss, n = policy_loss_backward(model, ro, device=torch.device("cpu"), rows_per_pass=2)
    seq = torch.tensor([prompt + ids])
    y = torch.full_like(seq, IGNORE_INDEX)[:, :-1].clone()
    y[0, len(prompt) - 1:] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), IGNORE_INDEX)
    with torch.no_grad():
        expected = float(model(seq[:, :-1], targets=y, loss_reduction="sum"))
    assert n == sum(mask) < len(ids)
    assert loss == pytest.approx(expected / n, rel=1e-5)


@pytest.mark.parametrize("reference", ["off", "unsolved"])
def test_rl_learns_from_the_reference_where_every_sample_misses(tok, monkeypatch, caplog, reference):
    """Every sample scores 0: without the reference no group has an advantage and no update
    moves the weights; with it every step trains each problem's reference solution."""
    monkeypatch.setattr("lockstep.rl.trainer.reward", lambda text, answer: 0.0)
    model = tiny_model(5)
    start = [p.detach().clone() for p in model.parameters()]
    cfg = build_config(RLConfig, {"group_size": 2, "problems_per_step": 2, "max_new_tokens": 48, "num_steps": 2,
                                  "eval_every_steps": 0, "eval_problems": 1, "pass_k": 1,
                                  "reference_rollout": reference}, where="rl")
    with caplog.at_level("INFO", logger="lockstep.rl"):
        RLTrainer(
            model,
            tok,
            cfg,
            train_problems=[_UNSOLVED, _SOLVED],
            val_problems=[_UNSOLVED],
            device=torch.device("cpu"),
            seed=3,
        ).fit()
    moved = any(not torch.equal(a, b) for a, b in zip(start, model.parameters()))
    steps = [line for line in caplog.messages if line.startswith("step ")]
    if reference == "off":
        assert not moved and not any("references" in line for line in steps)
    else:
        assert moved and all("| references 2 |" in line for line in steps), steps


def reward_itself(rewards, baseline):
    """A toy advantage written as docs/internals.md's recipe says: each completion's reward, no
    baseline (REINFORCE), so that only right completions are pushed, and pushed up."""
    return [float(r) for r in rewards]


def test_a_toy_advantage_is_one_function_and_one_table_line(tok, monkeypatch):
    """Registered with one line in ADVANTAGES and selected by name through RLConfig, a toy
    advantage scores a real rollout and drives a real update of a tiny model; unregistered, the
    same name is refused with the table's keys."""
    import lockstep.rl.strategies as strategies

    section = {"group_size": 4, "problems_per_step": 2, "max_new_tokens": 8, "num_steps": 1, "advantage": "toy"}
    with pytest.raises(ConfigError, match=r"rl\.advantage='toy' must be one of \['mean', 'group_std'\]"):
        build_config(RLConfig, section, where="rl")
    monkeypatch.setitem(strategies.ADVANTAGES, "toy", reward_itself)
    monkeypatch.setattr(
        "lockstep.rl.trainer.reward", lambda text, answer: float(len(text) % 2)
    )  # a random model scores 0
    cfg = build_config(RLConfig, section, where="rl")
    model = tiny_model(5)
    start = [p.detach().clone() for p in model.parameters()]
    problems = [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "#### 4"}]
    trainer = RLTrainer(
        model, tok, cfg, train_problems=problems, val_problems=problems, device=torch.device("cpu"), seed=3
    )
    ro = trainer.rollout(problems, seed=7)
    assert col(ro, "advantage") == col(ro, "reward") and 0 < sum(col(ro, "reward")) < 8
    stats = trainer.update(ro)
    assert stats.tokens == sum(sum(c.sampled) for c in ro.completions if c.reward)  # the right ones only
    assert any(not torch.equal(a, b) for a, b in zip(start, model.parameters()))


def test_each_rl_module_imports_only_those_listed_before_it():
    """lockstep.rl's docstring lists its modules in layers: each imports from the package only
    the modules above it, so the package has no cycle and a reader can take it top down."""
    order = re.findall(r"^- `(\w+)`:", lockstep.rl.__doc__, re.MULTILINE)
    assert len(order) >= 5, order
    folder = Path(lockstep.rl.__file__).parent
    for i, name in enumerate(order):
        tree = ast.parse((folder / f"{name}.py").read_text(encoding="utf-8"))
        modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported = {m.split(".")[2] for m in modules if m.startswith("lockstep.rl.")}
        assert imported <= set(order[:i]), (
            f"lockstep.rl.{name} imports {sorted(imported - set(order[:i]))}, listed after it"
        )
