"""Training on a CPU that is not quiet: the d4 benchmark model's step time alone and beside a
competing CPU-bound process, for several thread counts and OpenMP wait policies. A fair scheduler
gives the training process its share of the cores, so a slowdown far beyond 1 / share means the
threads spin or are oversubscribed. Prints, per setting, the mean step time quiet and loaded and
their ratio against the CPU-share expectation, all measured in this run. Not a test.

    .venv/bin/python bench/bench_load.py [--steps 12] [--settings threads=2,threads=2:passive,threads=1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(threads: int, steps: int, dtype_name: str) -> None:
    """One training run in this process; prints {"step_s": [...]} (the first step left out)."""
    import torch

    from lockstep.core.runtime import Runtime, keep_heap_memory
    from lockstep.model.gpt import GPT, GPTConfig
    from lockstep.train.optim import OptimConfig
    from lockstep.train.trainer import TrainConfig, Trainer

    torch.set_num_threads(threads)
    keep_heap_memory()
    T, B, V, depth = 256, 8, 32768, 4
    tokens = torch.randint(0, V, (200_000,), generator=torch.Generator().manual_seed(0))

    class Windows:
        def get_batch(self, *, B: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            starts = torch.randint(0, tokens.numel() - T - 1, (B,), generator=generator)
            rows = tokens[starts[:, None] + torch.arange(T + 1)]  # (B, T+1)
            return rows[:, :-1], rows[:, 1:]

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    rt = Runtime(device=torch.device("cpu"), dtype=dtype, reason="bench", kernels=True)
    model = GPT.build(GPTConfig.from_depth(depth, V, T), "cpu", seed=0).use_kernels(True)
    cfg = TrainConfig(batch_tokens=B * T, device_batch_rows=B, num_steps=steps, warmup_steps=0, eval_every_steps=0,
                      eval_tokens=B * T, checkpoint_every_steps=0, peak_flops=1e12,
                      optim=OptimConfig(muon_momentum_warmup_steps=steps))
    trainer = Trainer(model, cfg, rt, data=Windows(), seed=0)
    for _ in range(steps):
        trainer.step()
    print(json.dumps({"step_s": trainer.dts}))


def run(setting: dict, steps: int, dtype: str, loaded: bool) -> list[float]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'lib'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("OMP_WAIT_POLICY", None)  # `threads=N` alone is OpenMP's default policy (spin, then sleep)
    if setting["passive"]:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if loaded else None
    try:
        time.sleep(0.5 if loaded else 0)
        out = subprocess.run([sys.executable, __file__, "--child", "--threads", str(setting["threads"]), "--steps",
                              str(steps), "--dtype", dtype], env=env, check=True, capture_output=True, text=True)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])["step_s"]


def parse(text: str) -> dict:
    threads, _, policy = text.removeprefix("threads=").partition(":")
    return {"name": text, "threads": int(threads), "passive": policy == "passive"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--settings", default="threads=2,threads=2:passive,threads=1")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.threads, a.steps, a.dtype)
        return
    cores = os.cpu_count() or 1
    print(f"{cores} cores; d4 model, seq 256, batch 8, {a.dtype}; competing load: one busy-looping process")
    base = None
    for setting in map(parse, a.settings.split(",")):
        quiet = run(setting, a.steps, a.dtype, loaded=False)
        loaded = run(setting, a.steps, a.dtype, loaded=True)
        q, lo = sum(quiet) / len(quiet), sum(loaded) / len(loaded)
        # runnable threads share the cores fairly: training keeps threads / (threads + 1) of min(cores, threads + 1)
        share = min(1.0, cores / (setting["threads"] + 1))
        base = base or q
        print(f"{setting['name']:>18}: quiet {q * 1e3:7.0f} ms/step (x{q / base:.2f} of the first setting) | "
              f"loaded {lo * 1e3:7.0f} ms/step | slowdown x{lo / q:.2f}, x{share * lo / q:.2f} of the CPU-share "
              f"expectation x{1 / share:.2f}", flush=True)


if __name__ == "__main__":
    main()
