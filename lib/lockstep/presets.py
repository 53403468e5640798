"""Presets: versioned, complete params files (presets/NAME.yaml) copied onto params.yaml so that a
whole run's settings switch at once and stay reviewable. Knows nothing of what the params mean."""

from __future__ import annotations

from pathlib import Path

import yaml

from lockstep.io import write_bytes_atomic


def available_presets(presets_dir: Path) -> list[str]:
    return sorted(p.stem for p in Path(presets_dir).glob("*.yaml"))


def write_preset(name: str, *, presets_dir: Path, params_file: Path) -> None:
    """Copy presets/NAME.yaml onto `params_file` (atomically), after checking it parses and
    records its own name under `preset`."""
    src = Path(presets_dir) / f"{name}.yaml"
    if not src.is_file():
        raise FileNotFoundError(
            f"no preset {name!r} in {presets_dir}/; available: {', '.join(available_presets(presets_dir)) or 'none'}"
        )
    data = src.read_bytes()
    parsed = yaml.safe_load(data)
    if not isinstance(parsed, dict) or parsed.get("preset") != name:
        raise ValueError(f"{src} must be a mapping whose `preset` key is {name!r}")
    write_bytes_atomic(params_file, data)
