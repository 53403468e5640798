"""Stage `midtrain`: continued training of the base model on chat, tool-use and pretraining text,
every token trained. Parses paths, reads the `runtime` and `midtrain` params sections, calls
lockstep.pipeline.train (the model and its shape come from the --init checkpoint)."""

from __future__ import annotations

from lockstep.pipeline.train import (ERRORS, MidtrainConfig, RuntimeConfig, TrainStagePaths, code_revision,
                                     run_training_stage, shutdown)
from stages._common import entry, parse_training_args, preamble
from stages._runtime import start_runtime

STAGE_ERRORS = ERRORS


def main(argv: list[str] | None = None) -> int:
    args = parse_training_args("midtrain", argv, init=True, description=__doc__)
    pre = preamble("midtrain", args.params)
    cfg = pre.section("midtrain", MidtrainConfig)
    rt_cfg = pre.section("runtime", RuntimeConfig)
    rt = start_runtime(pre, rt_cfg, module="stages.midtrain", argv=argv)
    if isinstance(rt, int):  # ran under torchrun: its exit status
        return rt
    paths = TrainStagePaths(cache=args.cache, tokenizer=args.tokenizer, out=args.out, metrics=args.metrics,
                            runinfo=args.runinfo, plots=args.plots, runs=args.runs, init=args.init)
    run_training_stage("midtrain", cfg=cfg, paths=paths, rt=rt, seed=pre.seed, data_seed=pre.data_seed,
                       runtime_config=rt_cfg, code_revision=code_revision("stages.midtrain"), started_s=pre.started_s)
    shutdown(rt)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
