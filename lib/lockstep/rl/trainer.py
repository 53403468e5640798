"""GRPO-style policy gradient on GSM8K-format problems: sample a group of tool-using completions
per problem with the engine, reward the correct `####` answer, push up the log-probability of
sampled tokens in proportion to (reward - group mean). Not a general RL library: no value
function, no KL penalty, single process.

Choices, and why:
- Advantage = reward - mean(group reward), without dividing by the group's std (which inflates
  the weight of near-unanimous groups; Dr. GRPO, Liu et al. 2025). `advantage: group_std`
  divides by it (GRPO, Shao et al. 2024): a lone right answer in a group of eight then gets 2.65
  rather than 0.875, the answers of an even group 1.0 rather than 0.5.
- The loss is normalised by the number of sampled tokens in the whole step (token-level, as in
  DAPO, Yu et al. 2025), so long completions are not down-weighted per token.
- `step_advantage` adds credit for each tool call on the tokens that write it: whether its
  result is one of the reference solution's calculator results, against the group's calls. A
  completion that binds its second step to the wrong number otherwise shares one advantage over
  all its tokens with the steps it got right (process supervision, as in Lightman et al. 2023
  and GRPO's process variant, here with the synthetic reference as the judge of each step).
- Only sampled tokens carry gradient: forced tool outputs (`<|output_start|> ... <|output_end|>`)
  are the calculator's words, not the policy's.
- No KL term on the rollouts: on-policy sampling with one update per batch keeps the policy
  close on the problems. Held-out pass@k is logged so a collapse is visible.
- What the reward never sees can still drift (a chat's identity reply turned into a math
  solution midway). `rl.anchor` adds a loss on SFT conversations to every update, scaled by
  `anchor_weight`: their cross-entropy (`anchor_target: data`, the pretraining mix of PPO-ptx,
  Ouyang et al. 2022), or the KL from the starting checkpoint's next-token distributions on them
  (`anchor_target: sft`), which, unlike the cross-entropy of a few conversations, has no gradient
  until the policy drifts, at the cost of a frozen copy of the weights.

How it is built: a completion is one `Completion` record, a step's rollouts a list of them
(`Rollouts`, lockstep.rl.rollouts). How a group is scored is chosen once, by name, from the four
tables of lockstep.rl.strategies; the update's gradients come from lockstep.rl.losses. `RLTrainer`
is the loop, in the shape of lockstep.train.trainer.Trainer (rollout, update, evaluate, step,
state_dict, fit), with its NaN guard, LR schedule and progress line.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from lockstep.core.progress import Countdown
from lockstep.core.seeds import derive_seed
from lockstep.evaluate.benchmarks.gsm8k import reward
from lockstep.infer.engine import Engine
from lockstep.rl.config import RLConfig
from lockstep.rl.losses import anchor_loss_backward, policy_loss_backward
from lockstep.rl.rollouts import Completion, Rollouts, prompt_ids
from lockstep.rl.strategies import ADVANTAGES, CREDIT, GREEDY_ROLLOUTS, REFERENCE_ROLLOUTS, Group
from lockstep.train.optim import build_optimizers, global_grad_norm, set_lr
from lockstep.train.trainer import NonFiniteGuard, eta_text, progress_line

if TYPE_CHECKING:
    from lockstep.tokenizer.base import Tokenizer

log = logging.getLogger("lockstep.rl")


def _derived_seed(*parts: Any) -> int:
    """RL's seeds: lockstep.core.seeds.derive_seed in the `lockstep-rl` namespace."""
    return derive_seed("lockstep-rl", *parts)


def series_columns(cfg: RLConfig) -> dict[str, tuple[str, ...]]:
    """The per-step series RLTrainer reports through `on_step`, by file: columns besides `step`.
    Every value is a result (rewards, lengths, losses, held-out scores); timings stay in the log."""
    held_out = dict.fromkeys(("pass@1", f"pass@{cfg.pass_k}", "greedy", "completion_len"))  # pass@1 once when k = 1
    train = ("reward", "completion_len", "loss") + (("anchor_loss",) if cfg.anchor else ())
    return {"train": train, "val": tuple(f"val_{k}" for k in held_out)}


def _chunks(n: int, size: int) -> list[range]:
    return [range(start, min(start + size, n)) for start in range(0, n, size)]


def _prompts_and_budgets(engine: Engine, tokenizer: Tokenizer, problems: Sequence[dict[str, Any]],
                         max_new_tokens: int) -> tuple[list[list[int]], list[int]]:
    prompts, budgets = [], []
    for problem in problems:
        prompt = prompt_ids(tokenizer, problem["question"])
        budget = min(max_new_tokens, engine.model.config.sequence_len - len(prompt))
        if budget < 1:
            raise ValueError(f"problem prompt of {len(prompt)} tokens leaves no room in the model's context")
        prompts.append(prompt)
        budgets.append(budget)
    return prompts, budgets


def _sample(engine: Engine, prompts: list[list[int]], budgets: list[int], *, k: int, batch_rows: int,
            temperature: float, top_k: int | None, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """k completions of each prompt (tools on), all decoded together `batch_rows` at a time;
    completions of prompt i are rows i*k .. i*k+k-1."""
    return engine.generate_many(
        [p for p in prompts for _ in range(k)],
        max_tokens=[b for b in budgets for _ in range(k)],
        batch_rows=batch_rows,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
    )


@torch.no_grad()
def pass_at_k(engine: Engine, tokenizer: Tokenizer, problems: Sequence[dict[str, Any]], *, k: int, temperature: float,
              max_new_tokens: int, seed: int, batch_rows: int = 128) -> dict[str, float]:
    """Held-out scores on `problems` from k completions sampled at `temperature` per problem:
    pass@1 is the mean fraction correct (the unbiased pass@1 estimate from k samples), pass@k
    the fraction of problems with any correct completion. Also the greedy (temperature 0)
    accuracy and the mean greedy completion length. `batch_rows` completions decode together;
    progress lines to the `lockstep.rl` log while it takes longer than ~10 s."""
    prompts, budgets = _prompts_and_budgets(engine, tokenizer, problems, max_new_tokens)
    sampled_correct = any_correct = greedy_correct = 0.0
    lengths = []
    countdown = Countdown("held-out eval", len(problems), log.info, units="problems")
    per_call = max(1, batch_rows // (k + 1))
    for c, chunk in enumerate(_chunks(len(problems), per_call)):
        ps, bs = prompts[chunk.start:chunk.stop], budgets[chunk.start:chunk.stop]
        greedy = engine.generate_greedy(ps, max_tokens=bs, batch_rows=batch_rows)
        seqs, _ = _sample(engine, ps, bs, k=k, batch_rows=batch_rows, temperature=temperature, top_k=None,
                          seed=_derived_seed(seed, "eval", c))
        for j, i in enumerate(chunk):
            greedy_correct += reward(tokenizer.decode(greedy[j]), problems[i]["answer"])
            lengths.append(len(greedy[j]))
            hits = [reward(tokenizer.decode(seqs[j * k + g]), problems[i]["answer"]) for g in range(k)]
            sampled_correct += sum(hits) / k
            any_correct += max(hits)
        countdown.tick(len(chunk))
    n = len(problems)
    return {"pass@1": sampled_correct / n, f"pass@{k}": any_correct / n, "greedy": greedy_correct / n,
            "completion_len": sum(lengths) / n}


@dataclass
class RLResult:
    steps: int
    before: dict[str, float]  # held-out scores of the starting checkpoint
    after: dict[str, float]  # held-out scores after the last update
    mean_reward_first: float  # mean training reward of the first step ...
    mean_reward_last: float  # ... and of the last
    rollout_tokens: int
    train_time_s: float
    optimizer_state: dict[str, Any]  # {"optimizers": [state_dict, ...]}, for the checkpoint


def draw_problems(train_problems: Sequence[dict[str, Any]], mixture_problems: Mapping[str, Sequence[dict[str, Any]]],
                  cfg: RLConfig, *, seed: int, step: int) -> list[dict[str, Any]]:
    """One step's problems, drawn with replacement by a generator seeded from (seed, step): the
    rest from `train_problems`, then `cfg.draws()` from each mixture source (in name order), then
    all of them shuffled, so that the `cfg.updates_per_step` consecutive parts of a step mix the
    sources rather than the mixture's problems all landing in the last. Without a mixture there
    is nothing to shuffle and the draw is what it has always been, so earlier runs reproduce."""
    g = torch.Generator().manual_seed(_derived_seed(seed, "draw", step))
    draws = cfg.draws()
    n_main = cfg.problems_per_step - sum(draws.values())
    picked = [train_problems[i] for i in torch.randint(len(train_problems), (n_main,), generator=g).tolist()]
    for name, n in draws.items():
        source = mixture_problems[name]
        picked += [source[i] for i in torch.randint(len(source), (n,), generator=g).tolist()]
    if draws:
        picked = [picked[i] for i in torch.randperm(len(picked), generator=g).tolist()]
    return picked


@dataclass(frozen=True)
class UpdateStats:
    """What one `RLTrainer.update` did."""

    loss: float  # the policy loss per sampled token over the step's updates
    tokens: int  # sampled tokens trained on
    lr_mult: float
    anchor_loss: float | None  # mean over the updates that carried it (NaN: none did); None without an anchor


class RLTrainer:
    """The RL loop in the shape of lockstep.train.trainer.Trainer, sharing its NaN guard
    (NonFiniteGuard), LR schedule (LRSchedule) and progress line (progress_line, eta_text):
    `rollout()` samples and scores problems, `update()` trains on a step's rollouts,
    `evaluate()` scores the held-out problems, `step()` is one draw, rollout and update,
    `state_dict()` holds the weights and optimizer state, and `fit()` runs `cfg.num_steps` steps.

    The rollout's strategies are looked up once here from cfg's names: GREEDY_ROLLOUTS,
    ADVANTAGES, CREDIT and REFERENCE_ROLLOUTS. Problems per step are drawn with a generator seeded
    from (seed, step), so a run is a pure function of its inputs and seed. An update whose loss or
    gradient norm is NaN or inf is skipped; more in a row than `cfg.nonfinite_patience`, or
    non-finite weights at the end, raise lockstep.train.trainer.NonFiniteError. `on_step` gets each
    result row, as `series_columns(cfg)` names them: a held-out row (`val_*`) at each evaluation, a
    training row after every step. `decode` holds the Engine's keywords for the rollouts and
    held-out scores (lockstep.infer.engine.decode_settings: on CUDA, bf16 and the fast path); None
    is the reference. `mixture_problems` holds the train problems of each `cfg.mixture` source,
    which give `cfg.draws()` of each update's problems. `anchor` is the loader of `cfg.anchor`'s SFT
    conversations (lockstep.data.loaders.Mixture), required exactly when cfg.anchor names caches.
    Progress goes to the `lockstep.rl` log."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        cfg: RLConfig,
        *,
        train_problems: Sequence[dict[str, Any]],
        val_problems: Sequence[dict[str, Any]],
        device: torch.device,
        seed: int,
        autocast: Any = None,
        on_step: Callable[[dict[str, float]], None] | None = None,
        decode: Mapping[str, Any] | None = None,
        mixture_problems: Mapping[str, Sequence[dict[str, Any]]] | None = None,
        anchor: Any = None,
    ) -> None:
        _check_inputs(cfg, train_problems, val_problems, dict(mixture_problems or {}), anchor)
        self.model, self.tokenizer, self.cfg, self.device, self.seed = model, tokenizer, cfg, device, seed
        self.autocast, self.on_step, self.anchor = autocast, on_step, anchor
        self.train_problems, self.mixture_problems = train_problems, dict(mixture_problems or {})
        self.engine = Engine(model, tokenizer, **(decode or {}))
        # The anchor's reference: the starting weights, frozen (KL(start || policy) on its conversations).
        self.start_policy = (copy.deepcopy(model).eval().requires_grad_(False)
                             if anchor is not None and cfg.anchor_target == "sft" else None)
        self.optimizers = build_optimizers(model, cfg.optim, model_dim=model.config.n_embd)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.held_out = list(val_problems[: cfg.eval_problems])
        self.guard = NonFiniteGuard(cfg.nonfinite_patience, keys="rl.")
        self.greedy, self.reference = GREEDY_ROLLOUTS[cfg.greedy_rollout], REFERENCE_ROLLOUTS[cfg.reference_rollout]
        self.advantage, self.credit = ADVANTAGES[cfg.advantage], CREDIT[cfg.credit]
        self.step_count = 0  # steps completed
        self.step_times: list[float] = []
        self.rewards: list[float] = []  # each step's mean training reward
        self.rollout_tokens = 0

    def rollout(self, problems: Sequence[dict[str, Any]], *, seed: int) -> Rollouts:
        """Sample `group_size` completions for each problem (tools on), `generate_batch` of them
        decoding together, and score them; progress lines while it takes longer than ~10 s. Each
        group's rows: its samples, then what the greedy and reference strategies add."""
        cfg, engine, k = self.cfg, self.engine, self.cfg.group_size
        self.model.eval()
        prompts, budgets = _prompts_and_budgets(engine, self.tokenizer, problems, cfg.max_new_tokens)
        countdown = Countdown("rollouts", len(problems), log.info, units="problems")
        out: list[Completion] = []
        for c, chunk in enumerate(_chunks(len(problems), max(1, cfg.generate_batch // k))):
            part, ps, bs = (
                problems[chunk.start : chunk.stop],
                prompts[chunk.start : chunk.stop],
                budgets[chunk.start : chunk.stop],
            )
            seqs, masks = _sample(engine, ps, bs, k=k, batch_rows=cfg.generate_batch, temperature=cfg.temperature,
                                  top_k=cfg.top_k, seed=_derived_seed(seed, c))
            greedy = self.greedy.complete(engine, part, ps, bs, cfg.generate_batch)
            references = self.reference.complete(engine, part, ps, bs, cfg.generate_batch)
            for j, problem in enumerate(part):
                samples = [
                    Completion(ps[j], seqs[g], masks[g], reward(self.tokenizer.decode(seqs[g]), problem["answer"]))
                    for g in range(j * k, (j + 1) * k)
                ]
                out += self._score(Group(problem, bs[j], samples), greedy[j], references[j])
            countdown.tick(len(chunk))
        return Rollouts(out)

    def _score(self, group: Group, greedy: Completion | None, reference: Completion | None) -> list[Completion]:
        """The group's completions, scored: the greedy completion joins (or is the baseline),
        then the advantages and credit, then the reference solution joins."""
        self.greedy.join(group, greedy)
        rewards = [m.reward for m in group.members]
        baseline = sum(rewards) / len(rewards) if group.baseline is None else group.baseline
        for m, advantage in zip(group.members, self.advantage(rewards, baseline)):
            m.advantage = advantage
        self.credit(group.members, self.engine, group.problem["answer"], self.cfg.step_advantage)
        self.reference.join(group, reference)
        return group.members

    def update(self, ro: Rollouts) -> UpdateStats:
        """Train on step `step_count`'s rollouts at its scheduled LR: `updates_per_step` optimizer
        updates, each on the gradients of its own consecutive whole groups (and of the anchor's
        conversations, when there is one). A part without trained tokens makes no update; one whose
        loss or gradient norm is not finite is skipped (or raises past the patience)."""
        cfg, step, model = self.cfg, self.step_count, self.model
        model.train()
        parts: list[tuple[float, int]] = []  # (loss, sampled tokens) per update
        anchor_losses: list[float] = []
        lrm = cfg.lr_multiplier(step, cfg.num_steps)
        for u, part in enumerate(ro.split(cfg.updates_per_step, cfg.group_rows)):
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            part_loss, part_tokens = policy_loss_backward(
                model,
                part,
                device=self.device,
                rows_per_pass=cfg.device_batch_rows,
                autocast=self.autocast,
                prompt_once=cfg.prompt_once,
            )
            if part_tokens and self.anchor is not None:
                g = torch.Generator().manual_seed(_derived_seed(self.seed, "anchor", step, u))
                anchor_losses.append(anchor_loss_backward(model, self.anchor, cfg, device=self.device, generator=g,
                                                          autocast=self.autocast, reference=self.start_policy))
            if part_tokens:
                # The loss is already a host float; the norm's transfer is one per update, against one
                # per sampled token in the rollouts.
                norm = float(global_grad_norm(self.params, cfg.optim.grad_clip))
                if self.guard.check(step + 1, cfg.num_steps, part_loss, norm):
                    set_lr(self.optimizers, lrm, momentum=cfg.optim.muon_momentum_end)
                    for opt in self.optimizers:
                        opt.step()
            parts.append((part_loss, part_tokens))
        n_tokens = sum(t for _, t in parts)
        loss = parts[0][0] if len(parts) == 1 else sum(v * t for v, t in parts) / max(n_tokens, 1)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        anchor_loss = None if self.anchor is None else (  # NaN when no update stepped (every group unanimous)
            sum(anchor_losses) / len(anchor_losses) if anchor_losses else math.nan)
        return UpdateStats(loss=loss, tokens=n_tokens, lr_mult=lrm, anchor_loss=anchor_loss)

    def step(self) -> dict[str, float]:
        """One step: its problems drawn, rolled out and trained on; the progress line logged and
        the training row recorded (and returned)."""
        t0 = time.perf_counter()
        step = self.step_count
        problems = draw_problems(self.train_problems, self.mixture_problems, self.cfg, seed=self.seed, step=step)
        ro = self.rollout(problems, seed=_derived_seed(self.seed, "roll", step))
        self.rollout_tokens += ro.decoded_tokens
        stats = self.update(ro)
        dt = time.perf_counter() - t0
        self.step_count = step + 1
        self.step_times.append(dt)
        self.rewards.append(ro.mean_reward)
        row = {"step": step + 1, "reward": ro.mean_reward, "completion_len": ro.mean_length, "loss": stats.loss}
        if stats.anchor_loss is not None:
            row["anchor_loss"] = stats.anchor_loss
        self._report(ro, stats, dt)
        self._record(row)
        return row

    def _report(self, ro: Rollouts, stats: UpdateStats, dt: float) -> None:
        fields = [f"reward {ro.mean_reward:.3f}", f"loss {stats.loss:+.4f}"]
        if stats.anchor_loss is not None:
            fields.append(f"anchor {stats.anchor_loss:.4f}")
        references = [c for c in ro.completions if c.role == "reference"]
        if references:
            fields.append(f"references {sum(1 for c in references if c.advantage)}")
        fields += [f"lr {stats.lr_mult:.2f}", f"tokens {stats.tokens}", f"len {ro.mean_length:.1f}", f"dt {dt:.1f}s"]
        total = self.cfg.num_steps
        log.info(
            "%s", progress_line(self.step_count, total, fields, eta=eta_text(self.step_times, total - self.step_count))
        )

    def _record(self, row: dict[str, float]) -> None:
        if self.on_step is not None:
            self.on_step(row)

    def evaluate(self) -> dict[str, float]:
        """Held-out scores now (pass_at_k on the first `eval_problems` val problems), logged and
        recorded as a `val_*` row."""
        cfg, step = self.cfg, self.step_count
        self.model.eval()
        scores = pass_at_k(self.engine, self.tokenizer, self.held_out, k=cfg.pass_k, temperature=cfg.temperature,
                           max_new_tokens=cfg.max_new_tokens, seed=self.seed, batch_rows=cfg.generate_batch)
        log.info(
            "eval step %d | pass@1 %.3f | pass@%d %.3f | greedy %.3f | len %.1f | %d problems",
            step,
            scores["pass@1"],
            cfg.pass_k,
            scores[f"pass@{cfg.pass_k}"],
            scores["greedy"],
            scores["completion_len"],
            len(self.held_out),
        )
        self._record({"step": step, **{f"val_{k}": v for k, v in scores.items()}})
        return scores

    def state_dict(self) -> dict[str, Any]:
        """The step, the weights and the optimizers' state (live tensors, as torch's state dicts)."""
        return {"step": self.step_count, "model": self.model.state_dict(),
                "optimizers": [o.state_dict() for o in self.optimizers]}

    def fit(self) -> RLResult:
        """Evaluate, run `cfg.num_steps` steps with an evaluation every `eval_every_steps`, check the
        weights are finite, and evaluate again."""
        cfg = self.cfg
        before = self.evaluate()
        t_start = time.perf_counter()
        while self.step_count < cfg.num_steps:
            step = self.step()["step"]
            if cfg.eval_every_steps and step % cfg.eval_every_steps == 0 and step < cfg.num_steps:
                self.evaluate()
        train_time_s = time.perf_counter() - t_start
        self.guard.check_weights(self.model, cfg.num_steps)  # the caller checkpoints these weights
        after = self.evaluate()
        self.model.eval()
        return RLResult(
            steps=cfg.num_steps,
            before=before,
            after=after,
            mean_reward_first=self.rewards[0],
            mean_reward_last=self.rewards[-1],
            rollout_tokens=self.rollout_tokens,
            train_time_s=train_time_s,
            optimizer_state={"optimizers": self.state_dict()["optimizers"]},
        )


def _check_inputs(cfg: RLConfig, train_problems: Sequence[dict[str, Any]], val_problems: Sequence[dict[str, Any]],
                  mixture_problems: Mapping[str, Sequence[dict[str, Any]]], anchor: Any) -> None:
    """Refuse problems or an anchor that do not match cfg, saying which."""
    if not train_problems:
        raise ValueError("no training problems: the problems snapshot's train split is empty")
    if set(mixture_problems) != set(cfg.mixture):
        raise ValueError(
            f"rl.mixture names {sorted(cfg.mixture)} but train problems came for {sorted(mixture_problems)}"
        )
    for name, problems in mixture_problems.items():
        if not problems:
            raise ValueError(f"no training problems for rl.mixture.{name}: its snapshot's train split is empty")
    if not val_problems:
        raise ValueError("no held-out problems: the problems snapshot's val split is empty")
    if (anchor is None) != (not cfg.anchor):
        raise ValueError(f"rl.anchor names {sorted(cfg.anchor)} but the anchor loader is "
                         f"{'missing' if anchor is None else 'given'}")

