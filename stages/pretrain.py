"""Stage `pretrain`: a fresh model trained on the pretraining mixture. Parses paths, reads the
`runtime`, `model` and `pretrain` params sections, calls lockstep.pipeline.train."""

from __future__ import annotations

from lockstep.pipeline.train import (ERRORS, ModelParams, RuntimeConfig, TrainConfig, TrainStagePaths, code_revision,
                                     run_training_stage, shutdown)
from stages._common import entry, parse_training_args, preamble
from stages._runtime import start_runtime

STAGE_ERRORS = ERRORS


def main(argv: list[str] | None = None) -> int:
    args = parse_training_args("pretrain", argv, init=False, description=__doc__)
    pre = preamble("pretrain", args.params)
    cfg = pre.section("pretrain", TrainConfig)
    model_params = pre.section("model", ModelParams)
    rt_cfg = pre.section("runtime", RuntimeConfig)
    rt = start_runtime(pre, rt_cfg, module="stages.pretrain", argv=argv)
    if isinstance(rt, int):  # ran under torchrun: its exit status
        return rt
    paths = TrainStagePaths(cache=args.cache, tokenizer=args.tokenizer, out=args.out, metrics=args.metrics,
                            runinfo=args.runinfo, plots=args.plots, runs=args.runs, live=args.live)
    run_training_stage(
        "pretrain",
        cfg=cfg,
        paths=paths,
        rt=rt,
        seed=pre.seed,
        data_seed=pre.data_seed,
        runtime_config=rt_cfg,
        code_revision=code_revision("stages.pretrain"),
        started_s=pre.started_s,
        model_params=model_params,
    )
    shutdown(rt)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
