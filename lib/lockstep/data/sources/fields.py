"""Field checks of the fetch source configs: every field has its annotated type (null only where
the annotation allows it), strings and lists are not empty, numbers lie in their range. A source
config runs them in __post_init__ (`CheckedFields`), so one built in code is checked as one built
from params; `source_config` checks a params entry before lockstep.core.config.build_config, so that a
wrong type is refused with the same message as a wrong value: the full key, what it must be, what
it means and its default. Knows nothing about what the sources do."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from lockstep.core.config import ConfigError, FieldError, build_config, check_range

T = TypeVar("T")


@dataclass(frozen=True)
class Rule:
    """What one field means (`why`, said after the requirement) and, for numbers, its bounds
    (`ge`/`le` inclusive, `gt`/`lt` exclusive)."""

    why: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None


def _fits(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arm) for arm in args)
    if tp is type(None):
        return value is None
    if origin is typing.Literal:
        return value in args
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str) and value != ""
    if origin is tuple:  # tuple[X, ...]: a non-empty list of X
        return isinstance(value, (list, tuple)) and len(value) > 0 and all(_fits(v, args[0]) for v in value)
    raise TypeError(f"no field check for the annotation {tp!r}; extend lockstep.data.sources.fields")


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in args if a is not type(None)]
        return " or ".join(_describe(a) for a in arms) + (" or null" if len(arms) < len(args) else "")
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        return f"a non-empty list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a non-empty string"}[tp]


def _bounds(rule: Rule | None) -> str:
    if rule is None:
        return ""
    bounds = ((">=", rule.ge), (">", rule.gt), ("<=", rule.le), ("<", rule.lt))
    parts = [f"{op} {v:g}" for op, v in bounds if v is not None]
    return " " + " and ".join(parts) if parts else ""


def _shown(value: Any) -> str:
    """A default as params.yaml spells it: null, true, 0.1, "main", [".md"]."""
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def check_value(key: str, value: Any, tp: Any, rule: Rule | None, default: Any) -> None:
    """Raise FieldError (named `key`) unless `value` has type `tp` and lies within `rule`."""
    if not _fits(value, tp):
        why = f"; {rule.why}" if rule else ""
        keep = f" (remove the key for the default {_shown(default)})" if default is not dataclasses.MISSING else ""
        raise FieldError(key, value, f"must be {_describe(tp)}{_bounds(rule)}{why}{keep}")
    if rule is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
        check_range(key, value, ge=rule.ge, gt=rule.gt, le=rule.le, lt=rule.lt, why=rule.why)


class CheckedFields:
    """Base of the source configs: checks every dataclass field on construction against its
    annotation and the class's RULES (a subclass adds its own to its base's: `{**Base.RULES, ...}`)."""

    RULES: ClassVar[Mapping[str, Rule]] = {}

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            check_value(f.name, getattr(self, f.name), hints[f.name], self.RULES.get(f.name), f.default)


def source_config(cls: type[T], entry: Mapping[str, Any], *, where: str) -> T:
    """A source config built from the params entry at `where` (`fetch.<name>`). The values given
    are checked with the config's own rules first, so a null, a wrong type and a value out of
    range all end in one ConfigError naming `<where>.<field>`; build_config then refuses unknown
    keys."""
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where} must be a mapping of the source's settings, got {entry!r}")
    if dataclasses.is_dataclass(cls) and issubclass(cls, CheckedFields):
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, value in entry.items():
            if key in fields:
                check_value(f"{where}.{key}", value, hints[key], cls.RULES.get(key), fields[key].default)
    return build_config(cls, entry, where=where)
