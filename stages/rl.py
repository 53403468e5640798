"""Stage `rl`: GRPO-style policy gradient from the SFT checkpoint on GSM8K-format problems; writes
the RL checkpoint, its metrics and per-step series (reward, held-out pass@k, completion length).
Parses paths, reads the `runtime` and `rl` params sections, calls lockstep.pipeline.rl."""

from __future__ import annotations

import argparse
from pathlib import Path

from lockstep.pipeline.rl import ERRORS, RLConfig, RLStagePaths, RuntimeConfig, code_revision, run_rl_stage
from stages._common import add_params_option, entry, preamble
from stages._runtime import start_runtime

STAGE_ERRORS = ERRORS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stages.rl", description=__doc__)
    ap.add_argument("--init", type=Path, required=True, help="checkpoint to start from (data/ckpt/sft)")
    ap.add_argument("--raw", type=Path, required=True, help="raw snapshots folder (data/raw)")
    ap.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder (data/tokenizer)")
    ap.add_argument("--out", type=Path, required=True, help="final checkpoint folder (data/ckpt/rl)")
    ap.add_argument("--metrics", type=Path, required=True, help="metrics JSON, results only (data/metrics/rl.json)")
    ap.add_argument(
        "--runinfo", type=Path, required=True, help="run facts JSON: timings, device (data/runinfo/rl.json)"
    )
    ap.add_argument("--plots", type=Path, required=True, help="per-step series folder (data/plots/rl)")
    ap.add_argument("--cache", type=Path, default=None, help="token caches folder (data/cache): rl.anchor's SFT caches")
    ap.add_argument("--live", type=Path, default=None,
                    help="the latest step's values while it runs, for DVC's tools (data/live/rl.json)")
    add_params_option(ap)
    args = ap.parse_args(argv)
    pre = preamble("rl", args.params)
    cfg = pre.section("rl", RLConfig)
    rt = start_runtime(pre, pre.section("runtime", RuntimeConfig), module=None, argv=argv)
    assert not isinstance(rt, int)  # a single-process stage is never re-run under torchrun
    paths = RLStagePaths(init=args.init, raw=args.raw, tokenizer=args.tokenizer, out=args.out, metrics=args.metrics,
                         runinfo=args.runinfo, plots=args.plots, cache=args.cache,
                         live=args.live)
    run_rl_stage(cfg=cfg, paths=paths, rt=rt, seed=pre.seed, code_revision=code_revision("stages.rl"),
                 started_s=pre.started_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
