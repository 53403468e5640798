"""Every fetch source config checks every field: null where the field does not take it, a wrong
type and a value out of range are refused with the field's name, both when the config is built in
code and when the fetch stage reads it from params (one `error:` line naming fetch.<name>.<key>,
what it must be, and the default to fall back on). Walks SOURCE_CONFIGS, so a source added later
is covered, and a numeric field added without a range fails here."""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import types
import typing

import pytest
import yaml

from lockstep.core.config import ConfigError, FieldError, build_config
from lockstep.data.sources import SOURCE_CONFIGS


def _hint(source: str, name: str):
    return typing.get_type_hints(SOURCE_CONFIGS[source])[name]


def _arms(tp) -> tuple:
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def _cases(keep) -> list:
    """(source, field) for every field but `source` of every source config whose annotation's
    arms satisfy `keep`, with readable ids."""
    cases = [(source, f) for source, cls in sorted(SOURCE_CONFIGS.items()) for f in dataclasses.fields(cls)
             if f.name != "source" and keep(set(_arms(_hint(source, f.name))))]
    return [pytest.param(source, f, id=f"{source}.{f.name}") for source, f in cases]


ALL = _cases(lambda arms: True)
NULLABLE = _cases(lambda arms: type(None) in arms)
NOT_NULLABLE = _cases(lambda arms: type(None) not in arms)
NUMERIC = _cases(lambda arms: bool(arms & {int, float}))


def _wrong_type(tp):
    """A value no arm of `tp` accepts."""
    arms = set(_arms(tp))
    if arms & {int, float}:
        return "many"
    if str in arms or typing.get_origin(tp) is tuple:
        return 12
    if typing.get_origin(tp) is typing.Literal and all(isinstance(a, str) for a in typing.get_args(tp)):
        return 12  # a choice among names: a number is none of them
    if bool in arms:
        return "yes"
    raise AssertionError(f"no wrong value for {tp}")


def _refused(source: str, key: str, value) -> str:
    """The message of both paths (params and code), checked to name the key; returns the params one."""
    cls = SOURCE_CONFIGS[source]
    with pytest.raises(FieldError) as direct:
        cls(**{key: value})
    assert str(direct.value).startswith(f"{key}={value!r} must be "), direct.value
    with pytest.raises(ConfigError) as from_params:
        build_from_params(source, {key: value})
    msg = str(from_params.value)
    assert msg.startswith(f"fetch.x.{key}={value!r} must be "), msg
    return msg


def build_from_params(source: str, entry: dict):
    from lockstep.data.sources.fields import source_config

    return source_config(SOURCE_CONFIGS[source], {"source": source, **entry}, where="fetch.x")


@pytest.mark.parametrize("source, field", NOT_NULLABLE)
def test_null_is_refused_where_the_field_does_not_take_it(source, field):
    assert "(remove the key for the default " in _refused(source, field.name, None)


@pytest.mark.parametrize("source, field", NULLABLE)
def test_null_is_kept_where_it_means_something(source, field):
    assert getattr(build_from_params(source, {field.name: None}), field.name) is None


@pytest.mark.parametrize("source, field", ALL)
def test_a_wrong_type_is_refused(source, field):
    _refused(source, field.name, _wrong_type(_hint(source, field.name)))


@pytest.mark.parametrize("source, field", NUMERIC)
def test_numeric_fields_have_a_range_and_refuse_nan_and_values_outside_it(source, field):
    arms = set(_arms(_hint(source, field.name)))
    rule = SOURCE_CONFIGS[source].RULES.get(field.name)
    assert rule is not None and rule.ge is not None, f"{source}.{field.name} has no lower bound"
    step = 1 if int in arms else 0.5
    _refused(source, field.name, type(step)(rule.ge - step))
    if rule.le is not None:
        _refused(source, field.name, type(step)(rule.le + step))
    if rule.lt is not None:
        _refused(source, field.name, type(step)(rule.lt))
    if float in arms:
        assert "finite number" in _refused(source, field.name, math.nan)


@pytest.mark.parametrize("source", sorted(SOURCE_CONFIGS))
def test_defaults_and_boundaries_are_accepted(source):
    cls = SOURCE_CONFIGS[source]
    assert cls() == build_config(cls, {}, where="fetch.x")
    assert set(cls.RULES) <= {f.name for f in dataclasses.fields(cls)}, "a rule for a field that does not exist"
    hints = typing.get_type_hints(cls)
    for name, rule in cls.RULES.items():
        for edge in (rule.ge, rule.le):
            if edge is not None:
                value = int(edge) if int in _arms(hints[name]) else float(edge)
                assert getattr(build_from_params(source, {name: value}), name) == value


@pytest.mark.parametrize("source, key, value, says", [
    ("fineweb_edu", "shuffle_buffer", 0, "documents per shuffle window"),
    ("fineweb_edu", "max_train_chars", 0, "train budget in characters"),
    ("fineweb_edu", "max_val_chars", -1, "val budget"),
    ("fineweb_edu", "min_int_score", 6, "int_score runs 0..5"),
    ("wikitext", "val_frac", 1.0, "share of examples"),
    ("dolly15k", "max_retries", 1000, "network retries"),
    ("oasst1", "backoff_s", math.inf, "seconds before the first retry"),
    ("gsm8k", "artifact_records", -1, "dataset_snapshot.json"),
    ("gutenberg", "val_frac", -0.1, "share of books"),
    ("roam", "val_frac", 1.5, "share of notes"),
    ("shakespeare", "max_documents", 0, "scenes kept"),
    ("synth_chat", "identity_frac", 1.5, "identity conversations"),
    ("synth_chat", "n_val", -1, "conversations generated for val"),
    ("synth_math", "n_train", -3, "problems generated for train"),
])
def test_out_of_range_values_say_what_the_field_means(source, key, value, says):
    assert says in _refused(source, key, value)


def test_roam_suffixes_need_their_dot():
    with pytest.raises(
        ConfigError, match=r"^fetch\.x\.suffixes=\['\.md', 'txt'\] must be file suffixes with their dot"
    ):
        build_from_params("roam", {"suffixes": [".md", "txt"]})


@pytest.fixture
def fetch_workdir(tmp_path, monkeypatch, repo_root):
    monkeypatch.syspath_prepend(str(repo_root))  # `stages` is imported from the checkout, not installed
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _fetch_stage(workdir, capsys, monkeypatch, entry: dict) -> tuple[int, str]:
    from stages._common import entry as run_entry
    from stages.fetch import STAGE_ERRORS, main

    params = {"seed": 1, "data_seed": 2, "fetch": {"fineweb_edu": {"source": "fineweb_edu", "path": "shards", **entry}}}
    (workdir / "params.yaml").write_text(yaml.safe_dump(params), encoding="utf-8")
    monkeypatch.setattr(sys, "argv", ["stages.fetch", "fineweb_edu", "--out", "raw/fineweb_edu"])
    capsys.readouterr()
    status = run_entry(main, errors=STAGE_ERRORS)
    return status, capsys.readouterr().err


@pytest.mark.parametrize("value, requirement", [
    (None, "must be an integer >= 1; documents per shuffle window within a shard (memory: one window) "
           "(remove the key for the default 10000)"),
    (-1, "must be an integer >= 1; documents per shuffle window within a shard (memory: one window)"),
    ("big", "must be an integer >= 1; documents per shuffle window within a shard (memory: one window) "
            "(remove the key for the default 10000)"),
])
def test_fetch_stage_ends_a_bad_shuffle_buffer_in_one_error_line(
    fetch_workdir, capsys, monkeypatch, value, requirement
):
    status, err = _fetch_stage(fetch_workdir, capsys, monkeypatch, {"shuffle_buffer": value})
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 1 and "Traceback" not in err, err
    assert lines == [f"error: fetch.fineweb_edu.shuffle_buffer={value!r} {requirement}"]
    assert not (fetch_workdir / "raw").exists()


def test_direct_construction_with_null_names_the_field_not_a_type_error():
    from lockstep.data.sources.fineweb_edu import FinewebEduConfig

    with pytest.raises(FieldError, match=re.escape("shuffle_buffer=None must be an integer >= 1")):
        FinewebEduConfig(shuffle_buffer=None)
