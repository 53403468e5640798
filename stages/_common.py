"""Shared plumbing for stage entry points: read one params section into its dataclass, set up
logging and thread counts. Stages are the only code that reads params.yaml."""

from __future__ import annotations

import logging
import os
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
