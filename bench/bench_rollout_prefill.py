"""Benchmark of RL's rollouts on this machine: `Engine.generate_many` decoding 16 problems x 8
samples of the multistep family (the tiny preset's rollout shape) from an SFT checkpoint, where
a problem's 8 copies share one prefill, as a ratio against the same call with every row
prefilled on its own, measured in the same run; runs alternate the sides and must draw the
same tokens. Not a test.

    .venv/bin/python bench/bench_rollout_prefill.py --ckpt data/ckpt/sft [--bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import rl_step  # the tiny preset's RL step (bench/ is on sys.path)
from lockstep.infer.engine import Engine
from lockstep.rl.rollouts import prompt_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    rl_step.add_arguments(ap)
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="decode under bf16 autocast (RL decodes in the model's fp32 on a CPU, under bf16 on CUDA)",
    )
    args = ap.parse_args()
    tok, model, rows = rl_step.load(args)
    prompts = [prompt_ids(tok, r["question"]) for r in rows for _ in range(rl_step.GROUP_SIZE)]
    budgets = [min(rl_step.MAX_NEW_TOKENS, model.config.sequence_len - len(p)) for p in prompts]
    engine = Engine(model, tok)
    start_reply = Engine._start_reply

    def separate(self, *a, last=None, **kw):  # every row prefilled on its own
        return start_reply(self, *a, **kw)

    def run(prefill_each: bool) -> tuple[float, list[list[int]]]:
        Engine._start_reply = separate if prefill_each else start_reply
        try:
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                seqs, _ = engine.generate_many(prompts, max_tokens=budgets, batch_rows=128, temperature=1.0, seed=1)
            return time.perf_counter() - t0, seqs
        finally:
            Engine._start_reply = start_reply

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu {torch.backends.cpu.get_cpu_capability()}"
    )
    base, ours = [], []
    for _ in range(args.repeats):
        t_base, want = run(prefill_each=True)
        t_ours, got = run(prefill_each=False)
        if got != want:
            raise SystemExit("shared prefill drew other tokens than separate prefills")
        base.append(t_base)
        ours.append(t_ours)
    b, o = statistics.median(base), statistics.median(ours)
    tokens = sum(len(s) for s in want)
    print(f"128 rollouts, {tokens} tokens: each row prefilled {b:.2f} s, shared per problem {o:.2f} s, "
          f"speedup {b / o:.2f}x")


if __name__ == "__main__":
    main()
