"""`lockstep plan --calibrate` against measured training on this CPU.

In each of R rounds it calibrates the plan of a preset (a few timed steps of its pretrain
shape), then runs N steps of that pretraining through the real training loop (random token
windows, the preset's runtime: threads, dtype, kernels) and prints planned / measured for the N
steps; the pairs sit side by side in time so that a shared machine's changing load moves both. Then the plan's full
pretrain/midtrain/sft times, at the median calibration, against the recorded run facts
(data/runinfo/*.json), which an earlier run of the pipeline measured, possibly under another
load. Not a test.

    PYTHONPATH=lib:. .venv/bin/python bench/bench_plan.py [--preset tiny] [--rounds 4] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
import yaml

from lockstep.core.config import build_config
from lockstep.core.runtime import RuntimeConfig, init_runtime
from lockstep.model.gpt import GPT
from lockstep.tools.plan import RandomTokens, calibrate_training, make_plan
from lockstep.train.trainer import ModelParams, TrainConfig, Trainer

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", help="presets/NAME.yaml to plan and run")
    p.add_argument("--rounds", type=int, default=4, help="calibration + measurement pairs")
    p.add_argument("--steps", type=int, default=6, help="measured training steps per round (the first is left out)")
    p.add_argument("--calibrate-steps", type=int, default=3, help="timed steps per calibration (after its warm-up)")
    p.add_argument("--runinfo", type=Path, default=ROOT / "data" / "runinfo", help="recorded run facts to compare with")
    args = p.parse_args()

    params = yaml.safe_load((ROOT / "presets" / f"{args.preset}.yaml").read_text())
    rt_cfg = build_config(RuntimeConfig, params["runtime"], where="runtime")
    cfg = build_config(TrainConfig, params["pretrain"], where="pretrain")
    gcfg = build_config(ModelParams, params["model"], where="model").gpt_config(params["tokenizer"]["vocab_size"])
    run_cfg = build_config(TrainConfig, {**params["pretrain"], "num_steps": args.steps, "eval_every_steps": 0,
                                         "checkpoint_every_steps": 0, "sample_every_steps": 0}, where="pretrain")
    rt = None
    calibrated, ratios = [], []
    for r in range(args.rounds):
        tok_s = calibrate_training(gcfg, cfg, runtime=rt_cfg, steps=args.calibrate_steps,
                                   configure_process=True).tok_per_s
        rt = rt or init_runtime(rt_cfg)
        model = GPT.build(gcfg, rt.device, seed=r).use_kernels(rt.kernels)
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(model, run_cfg, rt, data=RandomTokens(gcfg.vocab_size, gcfg.sequence_len), seed=r)
            result = trainer.fit(Path(tmp), {"code_revision": "bench"})
        # Both sides are medians of timed steps (the loop's tok/s leaves its first step out).
        planned_s = args.steps * cfg.batch_tokens / tok_s
        measured_s = args.steps * cfg.batch_tokens / result.tok_per_s
        calibrated.append(tok_s)
        ratios.append(planned_s / measured_s)
        print(f"round {r}: calibrated {tok_s:,.0f} tok/s, measured {result.tok_per_s:,.0f} tok/s over {args.steps} "
              f"steps: planned {planned_s:.1f} s / measured {measured_s:.1f} s = {ratios[-1]:.2f}", flush=True)
    assert rt is not None
    print(f"preset {args.preset}: {rt.describe()['dtype']} on {rt.device}, kernels {rt.kernels}, "
          f"{torch.get_num_threads()} threads; planned/measured median {statistics.median(ratios):.2f} "
          f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    tok_s = statistics.median(calibrated)
    plan = make_plan(params, device="cpu", tok_per_s=tok_s)
    print(f"full stages at {tok_s:,.0f} tok/s (median calibration) vs {args.runinfo}:")
    for stage in plan["stages"]:
        facts = args.runinfo / f"{stage['stage']}.json"
        if not facts.is_file():
            print(f"  {stage['stage']:9} planned {stage['time_s']:7.1f} s  (no {facts})")
            continue
        info = json.loads(facts.read_text())
        recorded = info["train_time_s"]
        recorded_median = stage["tokens"] / info["tok_per_s"]
        print(f"  {stage['stage']:9} planned {stage['time_s']:7.1f} s  recorded {recorded:7.1f} s (ratio "
              f"{stage['time_s'] / recorded:.2f}); at the recorded median {info['tok_per_s']:,.0f} tok/s "
              f"{recorded_median:7.1f} s (ratio {stage['time_s'] / recorded_median:.2f})")


if __name__ == "__main__":
    main()
