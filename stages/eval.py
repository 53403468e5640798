"""Stage `eval@<stage>`: parse paths, read the `eval` and `runtime` params sections, re-run under
torchrun when asked, call lockstep.pipeline.eval. No scoring logic lives here."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lockstep.pipeline.eval import (ERRORS, STAGES, EvalConfig, EvalPaths, RuntimeConfig, check_inputs, run_eval_stage,
                                    shutdown)
from stages._common import add_params_option, entry, preamble
from stages._runtime import start_runtime

STAGE_ERRORS = ERRORS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stages.eval", description=__doc__)
    parser.add_argument("stage", choices=STAGES, help="which checkpoint is evaluated")
    parser.add_argument("--ckpt", type=Path, required=True, help="checkpoint folder (data/ckpt/STAGE)")
    parser.add_argument(
        "--cache", type=Path, required=True, help="token caches (data/cache); every val split is scored"
    )
    parser.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder (data/tokenizer)")
    parser.add_argument(
        "--raw", type=Path, required=True, help="raw snapshots (data/raw); chat items come from val splits"
    )
    parser.add_argument("--evalsets", type=Path, required=True, help="eval sets folder (evalsets)")
    parser.add_argument(
        "--out", type=Path, required=True, help="metrics JSON, results only (data/metrics/eval_STAGE.json)"
    )
    parser.add_argument(
        "--runinfo", type=Path, required=True, help="run facts JSON: device, time (data/runinfo/eval_STAGE.json)"
    )
    parser.add_argument("--predictions", type=Path, required=True, help="per-item predictions folder (data/eval/STAGE)")
    add_params_option(parser)
    args = parser.parse_args(argv)
    pre = preamble(f"eval.{args.stage}", args.params)
    cfg = pre.section("eval", EvalConfig)
    check_inputs(args.stage, cfg, args.raw, args.evalsets)
    rt = start_runtime(pre, pre.section("runtime", RuntimeConfig), module="stages.eval", argv=argv)
    if isinstance(rt, int):  # ran under torchrun: its exit status
        return rt
    paths = EvalPaths(ckpt=args.ckpt, cache=args.cache, tokenizer=args.tokenizer, raw=args.raw,
                      evalsets=args.evalsets, out=args.out, predictions=args.predictions, runinfo=args.runinfo)
    try:
        metrics = run_eval_stage(args.stage, cfg, paths, rt=rt)
    finally:
        shutdown(rt)
    pre.log.info("eval %s done in %.1fs: core=%s chatcore=%s", args.stage, time.perf_counter() - pre.started_s,
                 metrics.get("core"), metrics.get("chatcore"))
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
