"""Shared plumbing for stage entry points: the preamble every stage that reads params starts with
(logging, the params file, its two seeds, one params section at a time into its dataclass), the command
line the three training stages share, and the entry point that ends the process with one line on
Ctrl-C or a known error. Stages are the only
code that reads params.yaml. Imports no torch, so the data stages stay light: the runtime half of
the preamble, for the stages that run a model, is stages._runtime."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

import stages  # the package, run first: its ANCESTRY was read before the heavy imports
from lockstep.core import lifeline
from lockstep.core.config import ConfigError, build_config

T = TypeVar("T")
PARAMS_FILE = Path("params.yaml")


def load_params(path: Path = PARAMS_FILE) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            params = yaml.safe_load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: run `lockstep preset tiny` to write it") from None
    if not isinstance(params, dict):
        raise ConfigError(f"{path} must hold a mapping of sections")
    return params


def seed_of(params: dict[str, Any], key: str = "seed") -> int:
    """The params' top-level `seed` (or `data_seed`), refused unless it is an integer (a missing
    seed is not 0)."""
    seed = params.get(key)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(
            f"params.yaml `{key}` must be an integer, got {seed!r}; set it or switch preset with `lockstep preset`"
        )
    return seed


def section(params: dict[str, Any], dotted: str, cls: type[T]) -> T:
    """The params section at `dotted` (e.g. `fetch.roam`) as the frozen dataclass `cls`."""
    node: Any = params
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"params.yaml has no section {dotted!r}; add it or switch preset with `lockstep preset`")
        node = node[part]
    return build_config(cls, node or {}, where=dotted)


def setup(stage: str) -> logging.Logger:
    """Logging to stderr with a fixed format; one line per event."""
    logging.basicConfig(
        level=os.environ.get("LOCKSTEP_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    return logging.getLogger(f"lockstep.{stage}")


@dataclass(frozen=True)
class Preamble:
    """What a stage knows once its preamble ran: its logger, the params and their seeds, and when
    it started (time.perf_counter), for its wall time.

    The two seeds mean one thing each. `data_seed` fixes the data: the train/val splits of every
    source, the tokenizer, the caches, and which validation windows and few-shot examples the
    measurements use. `seed` is the training seed: initialisation, batch order, and sampling in RL.
    So `dvc exp run -S seed=43` re-draws training and nothing else, and every run is measured on
    the same validation bytes."""

    log: logging.Logger
    params: dict[str, Any]
    seed: int
    data_seed: int
    started_s: float

    def section(self, dotted: str, cls: type[T]) -> T:
        """The params section at `dotted` as the frozen dataclass `cls` (see `section`)."""
        return section(self.params, dotted, cls)


def preamble(stage: str, params_path: Path = PARAMS_FILE) -> Preamble:
    """The start of every stage that reads params: logging set up under `lockstep.<stage>`, the
    params file read, its seeds checked."""
    started_s = time.perf_counter()
    log = setup(stage)
    params = load_params(params_path)
    return Preamble(log=log, params=params, seed=seed_of(params), data_seed=seed_of(params, "data_seed"),
                    started_s=started_s)


def add_params_option(parser: argparse.ArgumentParser) -> None:
    """The `--params` option every stage that reads params takes: the params file, params.yaml by
    default (tests and `lockstep` commands point it elsewhere)."""
    parser.add_argument("--params", type=Path, default=PARAMS_FILE, help=f"params file ({PARAMS_FILE})")


def parse_training_args(stage: str, argv: list[str] | None, *, init: bool, description: str) -> argparse.Namespace:
    """The command line of a training stage (pretrain, midtrain, sft): its paths, and `--init`
    (the checkpoint to start from) when `init`."""
    p = argparse.ArgumentParser(prog=f"python -m stages.{stage}", description=description)
    p.add_argument("--cache", type=Path, required=True, help="token caches root (pretrain/<name>/, sft/<name>/)")
    p.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder (data/tokenizer)")
    p.add_argument("--out", type=Path, required=True, help=f"final checkpoint folder (data/ckpt/{stage})")
    p.add_argument(
        "--metrics", type=Path, required=True, help=f"metrics JSON, results only (data/metrics/{stage}.json)"
    )
    p.add_argument(
        "--runinfo", type=Path, required=True, help=f"run facts JSON: timings, device (data/runinfo/{stage}.json)"
    )
    p.add_argument("--plots", type=Path, required=True, help=f"per-step series folder (data/plots/{stage})")
    p.add_argument("--runs", type=Path, required=True, help="git-ignored folder for intermediate checkpoints")
    p.add_argument("--live", type=Path, default=None,
                   help=f"the latest step's values while it runs, for DVC's tools (data/live/{stage}.json)")
    add_params_option(p)
    if init:
        p.add_argument("--init", type=Path, required=True, help="checkpoint to start from")
    return p.parse_args(argv)


def entry(main: Callable[[], object], *, errors: tuple[type[Exception], ...] = ()) -> int:
    """Run a stage's `main` as the process's entry point: `raise SystemExit(entry(main))`. An int
    that `main` returns is the exit status; anything else it returns (a stage's result, for tests
    that call `main` directly) means success.

    Ctrl-C ends with one line on stderr and exit status 130 (128 + SIGINT), not a traceback: the
    stage's own message when it raised KeyboardInterrupt with one (where a rerun resumes), else
    a generic line. An exception of the `errors` types, whose message already says what to fix,
    ends with one `error: ...` line and status 1. Under torchrun only rank 0 prints.

    A stage that DVC or torchrun started ends, with one `stopped:` line and status 129, as soon
    as that launcher dies (lockstep.core.lifeline), so that it never publishes behind a `dvc repro` run
    after it; one started by hand is not tied to its shell."""
    lifeline.arm(lifeline.find_launcher(stages.ANCESTRY))
    speak = os.environ.get("RANK", "0") == "0"
    try:
        status = main()
        return status if isinstance(status, int) and not isinstance(status, bool) else 0
    except KeyboardInterrupt as e:
        if speak:
            print(f"interrupted: {str(e) or 'the stage did not finish; `dvc repro` runs it again'}", file=sys.stderr)
        return 130
    except errors as e:
        if speak:
            print(f"error: {e}", file=sys.stderr)
        return 1
