"""Typed configs: build a frozen dataclass from a params mapping, refusing unknown keys, wrong
types and out-of-range values with a message that names the key. Does not read params.yaml;
stages do."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A params section does not fit its dataclass."""


class FieldError(ConfigError):
    """A dataclass's own check refuses one of its fields. It is raised with the field's name
    relative to the dataclass (`matrix_lr`); build_config prefixes the section path, so the
    message names the full params key (`pretrain.optim.matrix_lr`)."""

    def __init__(self, key: str, value: Any, requirement: str) -> None:
        self.key, self.value, self.requirement = key, value, requirement
        super().__init__(f"{key}={value!r} {requirement}")


def check_range(key: str, value: float, *, ge: float | None = None, gt: float | None = None,
                le: float | None = None, lt: float | None = None, why: str = "") -> None:
    """Raise FieldError unless `value` is a finite number within the bounds given (`ge`/`le`
    inclusive, `gt`/`lt` exclusive). `why` follows the requirement in the message: what the value
    means, or what to set instead."""
    inside = (math.isfinite(value) and (ge is None or value >= ge) and (gt is None or value > gt)
              and (le is None or value <= le) and (lt is None or value < lt))
    if inside:
        return
    low = f"[{ge:g}" if ge is not None else f"({gt:g}" if gt is not None else None
    high = f"{le:g}]" if le is not None else f"{lt:g})" if lt is not None else None
    if low and high:
        bounds = f" in {low}, {high}"
    elif low:
        bounds = f" >= {ge:g}" if ge is not None else f" > {gt:g}"
    elif high:
        bounds = f" <= {le:g}" if le is not None else f" < {lt:g}"
    else:
        bounds = ""
    kind = "an integer" if isinstance(value, int) and not isinstance(value, bool) else "a finite number"
    raise FieldError(key, value, f"must be {kind}{bounds}" + (f"; {why}" if why else ""))


def _check_type(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arm in args:
            try:
                return _check_type(value, arm, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}={value!r} fits none of {tp}")
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{where} must be null, got {value!r}")
        return None
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}={value!r} must be one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return build_config(tp, value, where=where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        item_tp = args[0] if args else Any
        return tuple(_check_type(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        kt, vt = args if args else (Any, Any)
        return {_check_type(k, kt, f"{where} key"): _check_type(v, vt, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    return value


def build_config(cls: type[T], params: Mapping[str, Any], *, where: str = "") -> T:
    """Build the frozen dataclass `cls` from `params`. Unknown keys and wrong types raise
    ConfigError naming the full key (e.g. `pretrain.lr_embed`), so a typo in params.yaml or in
    `dvc exp run -S` fails loudly instead of being ignored. Missing keys take field defaults."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls} is not a dataclass")
    if not isinstance(params, Mapping):
        raise ConfigError(f"{where or cls.__name__} must be a mapping, got {params!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(params) - set(fields))
    # A class may name keys it used to have: MOVED_KEYS maps each to (its new key, a note).
    moved = [(k, *getattr(cls, "MOVED_KEYS", {})[k]) for k in unknown if k in getattr(cls, "MOVED_KEYS", {})]
    if moved:
        raise ConfigError(
            "; ".join(
                f"{where + '.' if where else ''}{old} has moved: set {where + '.' if where else ''}{new} "
                f"instead ({note})"
                for old, new, note in moved
            )
        )
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(f'{where}.{k}' if where else k for k in unknown)}; "
            f"valid keys: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, f in fields.items():
        key = f"{where}.{name}" if where else name
        if name in params:
            kwargs[name] = _check_type(params[name], hints[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
            raise ConfigError(f"missing required key {key}")
    try:
        return cls(**kwargs)
    except FieldError as e:
        if not where:
            raise
        raise FieldError(f"{where}.{e.key}", e.value, e.requirement) from None


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A plain JSON-ready dict of a config dataclass (tuples become lists)."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, Mapping):
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(cfg)
