"""lockstep.core.runinfo, the one writer of every stage's run facts: what it adds to a stage's own
facts, NaN as null, and canonical JSON on disk."""

from __future__ import annotations

import json
from pathlib import Path

from lockstep.core.runinfo import NUMERICS_KEY, numerics_differences, numerics_facts, write_runinfo


def test_write_runinfo_adds_the_shared_facts_and_writes_canonical_json(tmp_path: Path) -> None:
    path = tmp_path / "runinfo" / "stage.json"
    info = write_runinfo(path, {"train_time_s": 1.5, "mfu": float("nan")})
    on_disk = path.read_text(encoding="utf-8")
    assert json.loads(on_disk) == info
    assert on_disk == json.dumps(info, ensure_ascii=False, sort_keys=True, separators=(",", ":")) + "\n"
    assert info["train_time_s"] == 1.5 and info["mfu"] is None  # NaN: nothing to measure
    assert isinstance(info["git_commit"], str) and info["git_commit"]


def test_write_runinfo_keeps_a_fact_the_stage_gave(tmp_path: Path) -> None:
    info = write_runinfo(tmp_path / "r.json", {"git_commit": "feedbeef"})
    assert info["git_commit"] == "feedbeef"


def test_write_runinfo_records_what_decides_the_numerics(tmp_path: Path) -> None:
    import torch

    info = write_runinfo(tmp_path / "r.json", {}, device="cpu")
    facts = info[NUMERICS_KEY]
    assert facts == numerics_facts("cpu")
    assert facts["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert facts["torch"] == torch.__version__ and facts["torch_git"] == torch.version.git_version
    assert facts["cuda"] == torch.version.cuda and facts["threads"] == torch.get_num_threads()
    assert facts["device_type"] == "cpu" and facts["device_name"]


def test_threads_are_a_numerics_fact(restore_process_state) -> None:
    import torch

    torch.set_num_threads(1)
    assert numerics_facts()["threads"] == 1


def test_numerics_differences_name_each_fact_that_differs() -> None:
    a = {NUMERICS_KEY: {"cpu_capability": "AVX2", "threads": 2, "torch": "2.5.0"}}
    b = {NUMERICS_KEY: {"cpu_capability": "AVX512", "threads": 2, "torch": "2.5.0"}}
    assert numerics_differences(a, b) == ["cpu_capability A 'AVX2', B 'AVX512'"]
    assert numerics_differences(a, a) == [] and numerics_differences({}, {}) == []


def test_write_runinfo_records_what_each_fast_path_did(tmp_path: Path) -> None:
    from lockstep.core import fastpath

    assert write_runinfo(tmp_path / "none.json", {})["fast_paths"] == {}  # no part ran
    assert numerics_facts()["fast_paths"] == ""
    fastpath.call("muon_compiled", lambda: 1, lambda: 2)

    def broken() -> int:
        raise RuntimeError("no kernel image is available\nmore text")

    assert fastpath.call("cuda_graphs", broken, lambda: 3) == 3
    info = write_runinfo(tmp_path / "r.json", {})
    assert info["fast_paths"] == {
        "cuda_graphs": {"path": "reference", "fast_calls": 0, "reference_calls": 1, "compiles": 0, "compile_s": 0.0,
                        "fell_back": "RuntimeError: no kernel image is available", "results": "reference"},
        "muon_compiled": {"path": "fast", "fast_calls": 1, "reference_calls": 0, "compiles": 0, "compile_s": 0.0}}
    assert info[NUMERICS_KEY]["fast_paths"] == "cuda_graphs=reference, muon_compiled=fast"
