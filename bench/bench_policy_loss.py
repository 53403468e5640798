"""Benchmark of RL's policy-loss passes on this machine: `policy_loss_backward` with
`prompt_once` (a group's prompt through the model once, its keys and values read by all the
group's completions) as a ratio against the plain passes (every completion with its whole
prompt), measured in the same run on the same rollouts: 16 problems x 8 samples of the multistep
family (the tiny preset's step) from an SFT checkpoint. Runs alternate the sides; the gradients
of the two must agree. Not a test.

    .venv/bin/python bench/bench_policy_loss.py --ckpt data/ckpt/sft [--bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import rl_step  # the tiny preset's RL step (bench/ is on sys.path)
from lockstep.rl.config import RLConfig
from lockstep.rl.losses import policy_loss_backward
from lockstep.rl.trainer import RLTrainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    rl_step.add_arguments(ap)
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="the passes under bf16 autocast, as the runtime picks on CPUs with native bf16",
    )
    args = ap.parse_args()
    tok, model, problems = rl_step.load(args)
    model.use_kernels(True)
    cfg = RLConfig(
        problems="synth_multistep",
        problems_per_step=rl_step.PROBLEMS_PER_STEP,
        group_size=rl_step.GROUP_SIZE,
        max_new_tokens=rl_step.MAX_NEW_TOKENS,
        step_advantage=0.5,
    )
    trainer = RLTrainer(
        model, tok, cfg, train_problems=problems, val_problems=problems, device=torch.device("cpu"), seed=1
    )
    ro = trainer.rollout(problems, seed=1)
    model.train()

    def run(prompt_once: bool) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        precision = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)
        t0 = time.perf_counter()
        policy_loss_backward(model, ro, device=torch.device("cpu"), rows_per_pass=cfg.device_batch_rows,
                             autocast=precision, prompt_once=prompt_once)
        return time.perf_counter() - t0, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu {torch.backends.cpu.get_cpu_capability()}, "
        f"{'bf16 autocast' if args.bf16 else 'fp32'}"
    )
    run(False)  # warm-up: allocator, thread pools
    plain, once = [], []
    for _ in range(args.repeats):
        t_plain, want = run(prompt_once=False)
        t_once, got = run(prompt_once=True)
        worst = max(float((g - w).norm() / w.norm().clamp(min=1e-30)) for g, w in zip(got, want))
        if worst > (0.1 if args.bf16 else 1e-4):  # bf16 rounds each pass its own way: ~2% here, fp32 ~1e-6
            raise SystemExit(f"prompt_once's gradients differ from the plain passes' by {worst:.2g} (relative norm)")
        plain.append(t_plain)
        once.append(t_once)
    p, o = statistics.median(plain), statistics.median(once)
    tokens = sum(len(c.ids) for c in ro.completions)
    print(
        f"{len(ro.completions)} completions, {tokens} tokens, "
        f"prompts of {statistics.mean(len(c.prompt) for c in ro.completions):.0f}: "
        f"plain {p:.2f} s, prompt once {o:.2f} s, speedup {p / o:.2f}x (gradients within {worst:.1g})"
    )


if __name__ == "__main__":
    main()
