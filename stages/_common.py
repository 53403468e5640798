"""Shared plumbing for stage entry points: read one params section into its dataclass, set up
logging, end the process with one line on Ctrl-C or a known error. Stages are the only code that
reads params.yaml."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from lockstep.config import ConfigError, build_config

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


def seed_of(params: dict[str, Any]) -> int:
    """The params' top-level `seed`, refused unless it is an integer (a missing seed is not 0)."""
    seed = params.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"params.yaml `seed` must be an integer, got {seed!r}; set it or switch preset with `lockstep preset`")
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


def entry(main: Callable[[], object], *, errors: tuple[type[Exception], ...] = ()) -> int:
    """Run a stage's `main` as the process's entry point: `raise SystemExit(entry(main))`. An int
    that `main` returns is the exit status; anything else it returns (a stage's result, for tests
    that call `main` directly) means success.

    Ctrl-C ends with one line on stderr and exit status 130 (128 + SIGINT), not a traceback: the
    stage's own message when it raised KeyboardInterrupt with one (where a rerun resumes), else
    a generic line. An exception of the `errors` types, whose message already says what to fix,
    ends with one `error: ...` line and status 1. Under torchrun only rank 0 prints."""
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
