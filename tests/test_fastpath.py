"""lockstep.core.fastpath: a fast path that raises is answered by its reference path, once warned, for
the rest of the process; what each part did is counted for the run facts, compiles included."""

from __future__ import annotations

import logging

import pytest
import torch

from lockstep.core import fastpath


def _fails(message: str = "inductor: boom"):
    def fast():
        raise RuntimeError(message)

    return fast


def test_a_working_fast_path_answers_and_is_counted() -> None:
    assert fastpath.enabled("muon_compiled")
    assert [fastpath.call("muon_compiled", lambda: "fast", lambda: "reference") for _ in range(3)] == ["fast"] * 3
    assert fastpath.facts() == {"muon_compiled": {"path": "fast", "fast_calls": 3, "reference_calls": 0, "compiles": 0,
                                                  "compile_s": 0.0}}
    assert fastpath.paths_summary() == "muon_compiled=fast"


def test_a_failing_fast_path_falls_back_once_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def broken_backend(gm, example_inputs):
        raise RuntimeError("past 32-bit indexing")

    compiled = torch.compile(lambda x: x + 1, backend=broken_backend, fullgraph=True)

    def fast():
        calls.append("fast")
        return compiled(torch.ones(2))

    with caplog.at_level(logging.WARNING, logger="lockstep.core.fastpath"):
        got = [fastpath.call("chunk_bodies", fast, lambda: "reference") for _ in range(4)]
    assert got == ["reference"] * 4 and calls == ["fast"]  # tried once, never again
    assert not fastpath.enabled("chunk_bodies")
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "fast path chunk_bodies" in warning and "BackendCompilerFailed" in warning
    assert "the results are the reference path's" in warning and "runtime.kernels: false" in warning
    facts = fastpath.facts()["chunk_bodies"]
    assert facts["path"] == "reference" and facts["results"] == "reference" and facts["reference_calls"] == 4
    assert facts["fell_back"].startswith("BackendCompilerFailed: ")


def test_a_fallback_after_fast_results_says_the_run_is_mixed(caplog: pytest.LogCaptureFixture) -> None:
    fastpath.call("decode_compiled", lambda: 1, lambda: 2)
    with caplog.at_level(logging.WARNING, logger="lockstep.core.fastpath"):
        assert fastpath.call("decode_compiled", _fails("recompile failed\nTraceback ..."), lambda: 2) == 2
    assert "answered 1 call(s) already" in caplog.text and "equal neither" in caplog.text
    facts = fastpath.facts()["decode_compiled"]
    assert facts["results"] == "mixed" and facts["fell_back"] == "RuntimeError: recompile failed"
    assert fastpath.paths_summary() == "decode_compiled=fast>reference"


def test_an_error_of_the_reference_path_propagates() -> None:
    with pytest.raises(ValueError, match="bad input"):
        fastpath.call("cuda_graphs", _fails(), lambda: (_ for _ in ()).throw(ValueError("bad input")))


def test_fall_back_by_hand_and_unknown_parts() -> None:
    fastpath.fall_back("cuda_graphs", "this torch cannot capture the step")
    assert fastpath.call("cuda_graphs", lambda: "fast", lambda: "reference") == "reference"
    assert fastpath.facts()["cuda_graphs"]["fell_back"] == "this torch cannot capture the step"
    with pytest.raises(ValueError, match="unknown fast path 'nope'"):
        fastpath.call("nope", lambda: 1, lambda: 2)
    fastpath.reset()
    assert fastpath.facts() == {} and fastpath.enabled("cuda_graphs")


def test_compiles_count_towards_the_innermost_part() -> None:
    torch._dynamo.reset()
    inner = torch.compile(lambda x: x * 2 + 1, backend="eager", fullgraph=True)
    outer = torch.compile(lambda x: x.sin().cos(), backend="eager", fullgraph=True)
    x = torch.randn(4)

    def outer_step():
        # the outer part compiles one graph of its own and calls the inner part, which compiles one
        y = outer(x)
        return fastpath.call("chunk_bodies", lambda: inner(y), lambda: y * 2 + 1)

    for _ in range(3):
        fastpath.call("compiled_loss", outer_step, lambda: None)
    facts = fastpath.facts()
    assert facts["compiled_loss"]["compiles"] == 1 and facts["chunk_bodies"]["compiles"] == 1
    assert facts["compiled_loss"]["fast_calls"] == 3 and facts["chunk_bodies"]["fast_calls"] == 3
    assert facts["compiled_loss"]["compile_s"] > 0 and facts["chunk_bodies"]["compile_s"] > 0
