"""Benchmark of the eval stage's chat replies on this machine: greedy replies to many different
prompts decoded together (Engine.generate_greedy, `eval.generate_batch` rows) as a ratio against
the baseline measured in the same run, the same replies generated one prompt at a time
(Engine.generate per prompt, what `eval.generate_batch: 1` runs, the reference path). A
tiny-preset-sized model with random weights, its stop tokens made unreachable and each prompt
given its own reply budget, so replies end at spread-out lengths as real ones do; prompts of
spread-out lengths too. Reports generated tokens per second (medians of runs that alternate the
two sides; the one-at-a-time side answers only the first prompts, to keep a run short) and checks
that both sides gave the same tokens. Not a test.

    .venv/bin/python bench/bench_eval_generate.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from lockstep.infer.engine import Engine
from lockstep.model.gpt import GPT, GPTConfig

from bench_decode import IdsOnly  # the engine's minimal tokenizer for random-weight runs (bench/ is on sys.path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=4, help="model depth (the tiny preset's is 4)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--context", type=int, default=256, help="sequence_len, as eval's context_tokens")
    ap.add_argument("--prompts", type=int, default=64, help="prompts answered by the batched path per run")
    ap.add_argument("--seq-prompts", type=int, default=16, help="the first N of them answered one at a time per run")
    ap.add_argument("--batch", type=int, default=32, help="eval.generate_batch of the batched path")
    ap.add_argument(
        "--max-new", type=int, default=128, help="eval.max_new_tokens; each reply's budget is drawn below it"
    )
    ap.add_argument(
        "--dtype", default="fp32", choices=["bf16", "fp32"], help="bf16 runs under CPU autocast, as the stage does"
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not 0 < args.seq_prompts <= args.prompts:
        ap.error("--seq-prompts must be in 1..--prompts")
    print(f"{torch.get_num_threads()} threads, {args.dtype}, d{args.depth} vocab {args.vocab} context {args.context}, "
          f"{args.prompts} prompts batched {args.batch} at a time vs the first {args.seq_prompts} one at a time, "
          f"median of {args.reps}")
    # Other processes on a small machine skew every figure here; print the load so a reader can tell.
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")

    config = GPTConfig.from_depth(args.depth, vocab_size=args.vocab, sequence_len=args.context)
    model = GPT.build(config, "cpu", seed=0).use_kernels(True).eval()
    tok = IdsOnly(args.vocab)
    with torch.no_grad():  # every reply runs to its own budget, not to a random stop
        for name in ("<|assistant_end|>", "<|bos|>"):
            model.lm_head.weight[tok.encode_special(name)] = 0
    engine = Engine(model, tok)
    g = torch.Generator().manual_seed(0)
    prompt_lens = torch.randint(20, 120, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in prompt_lens]
    # A budget per prompt: each reply ends at its own length, as it would at a stop token.
    budgets = torch.randint(args.max_new // 8, args.max_new + 1, (args.prompts,), generator=g).tolist()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16")

    def run(batch_rows: int, n: int) -> tuple[float, list[list[int]]]:
        """(generated tokens per second, the replies) for the first n prompts."""
        t0 = time.perf_counter()
        with autocast:
            if batch_rows == 1:
                outs = [
                    engine.generate_batch(p, max_tokens=m, temperature=0.0)[0][0]
                    for p, m in zip(prompts[:n], budgets[:n])
                ]
            else:
                outs = engine.generate_greedy(prompts[:n], max_tokens=budgets[:n], batch_rows=batch_rows)
        return sum(map(len, outs)) / (time.perf_counter() - t0), outs

    run(1, 2)  # warm-up, both sides
    run(args.batch, 4)
    seq, bat, ratios = [], [], []
    for _ in range(args.reps):  # alternating, so a change in the machine's load hits both sides
        s_tok_s, s_out = run(1, args.seq_prompts)
        b_tok_s, b_out = run(args.batch, args.prompts)
        seq.append(s_tok_s)
        bat.append(b_tok_s)
        ratios.append(b_tok_s / s_tok_s)
    same = sum(a == b for a, b in zip(s_out, b_out))
    per_reply = sum(map(len, b_out)) / args.prompts
    print(f"one at a time: {statistics.median(seq):6.0f} tok/s | batched {args.batch}: {statistics.median(bat):6.0f} "
          f"tok/s ({per_reply:.0f} tokens/reply: {per_reply / statistics.median(bat) * 1e3:.0f} ms/reply) | "
          f"{statistics.median(ratios):5.2f}x one at a time (paired median) | identical replies {same}/{len(s_out)}")

if __name__ == "__main__":
    main()
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")
