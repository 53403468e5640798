"""The body of the two stages that continue training from a checkpoint, midtrain and sft: they
differ only in their name and their params section's class, which stages/midtrain.py and
stages/sft.py pass in. Parses the training stage's paths and --init, reads the `runtime` section
and the stage's own, calls lockstep.pipeline.train (the model and its shape come from the --init
checkpoint)."""

from __future__ import annotations

from lockstep.pipeline.train import (RuntimeConfig, TrainConfig, TrainStagePaths, code_revision, run_training_stage,
                                     shutdown)
from stages._common import parse_training_args, preamble
from stages._runtime import start_runtime


def main(stage: str, config: type[TrainConfig], argv: list[str] | None, *, description: str) -> int:
    """Run training stage `stage` (its params section read as `config`) from the --init checkpoint;
    the process's exit status."""
    module = f"stages.{stage}"
    args = parse_training_args(stage, argv, init=True, description=description)
    pre = preamble(stage, args.params)
    cfg = pre.section(stage, config)
    rt_cfg = pre.section("runtime", RuntimeConfig)
    rt = start_runtime(pre, rt_cfg, module=module, argv=argv)
    if isinstance(rt, int):  # ran under torchrun: its exit status
        return rt
    paths = TrainStagePaths(cache=args.cache, tokenizer=args.tokenizer, out=args.out, metrics=args.metrics,
                            runinfo=args.runinfo, plots=args.plots, runs=args.runs, init=args.init,
                            live=args.live)
    run_training_stage(stage, cfg=cfg, paths=paths, rt=rt, seed=pre.seed, data_seed=pre.data_seed,
                       runtime_config=rt_cfg, code_revision=code_revision(module), started_s=pre.started_s)
    shutdown(rt)
    return 0
