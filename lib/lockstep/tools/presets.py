"""Presets: versioned, complete params files (presets/NAME.yaml) copied onto params.yaml so that a
whole run's settings switch at once and stay reviewable. Knows nothing of what the params mean."""

from __future__ import annotations

from pathlib import Path

import yaml

from lockstep.core.io import write_bytes_atomic


class PresetError(ValueError):
    """A preset file that does not parse, or does not name itself; params.yaml is left as it was."""


def available_presets(presets_dir: Path) -> list[str]:
    return sorted(p.stem for p in Path(presets_dir).glob("*.yaml"))


def write_preset(name: str, *, presets_dir: Path, params_file: Path) -> None:
    """Copy presets/NAME.yaml onto `params_file` (atomically), after checking it parses and
    records its own name under `preset`; PresetError says what is wrong otherwise."""
    src = Path(presets_dir) / f"{name}.yaml"
    if not src.is_file():
        raise FileNotFoundError(
            f"no preset {name!r} in {presets_dir}/; available: {', '.join(available_presets(presets_dir)) or 'none'}"
        )
    data = src.read_bytes()
    try:
        parsed = yaml.safe_load(data)
    except yaml.YAMLError as e:
        # One line, not PyYAML's multi-line report: what is wrong and where.
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise PresetError(f"{src} is not valid YAML: {problem}{where}; fix the file there ({params_file} was not "
                          "changed)") from None
    if not isinstance(parsed, dict) or parsed.get("preset") != name:
        raise PresetError(f"{src} must be a mapping whose `preset` key is {name!r}")
    write_bytes_atomic(params_file, data)
