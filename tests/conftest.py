"""Shared pytest fixtures: the real-format samples beside the checkout, and hermetic defaults."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_FIXTURES = ROOT.parent / "shared" / "fixtures"
SHARED_NANOCHAT = ROOT.parent / "shared" / "nanochat"  # nanochat's checkout at 92d63d4, a yardstick


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def shared_fixtures() -> Path:
    """`../shared/fixtures` (real-format data samples); tests using it skip when it is absent,
    as in a user's clone."""
    if not SHARED_FIXTURES.is_dir():
        pytest.skip(f"real-format samples not found at {SHARED_FIXTURES} (only present beside the dev checkout)")
    return SHARED_FIXTURES


@pytest.fixture(scope="session")
def nanochat_root() -> Iterator[Path]:
    """`../shared/nanochat`, nanochat's own code put on sys.path (its `nanochat` and `tasks`
    packages) to compare against; tests using it skip when it is absent, as in a user's clone."""
    if not (SHARED_NANOCHAT / "tasks").is_dir():
        pytest.skip(f"nanochat's checkout not found at {SHARED_NANOCHAT} (only present beside the dev checkout)")
    sys.path.insert(0, str(SHARED_NANOCHAT))
    try:
        yield SHARED_NANOCHAT
    finally:
        sys.path.remove(str(SHARED_NANOCHAT))


@pytest.fixture(scope="session")
def tok():
    """The `byte` tokenizer (id = byte value, specials after): needs no training data."""
    from lockstep.tokenizer.kinds import train_tokenizer

    return train_tokenizer("byte", [])


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """A finished `dvc repro` of the whole DAG on the `smoke` preset, in a scratch copy of the
    checkout (git-initialised, first commit made): built once per test run, shared by both
    pytest-xdist workers (the first to ask builds it, the other waits for it). Read it and never
    write in it, not even through a `dvc` command (which writes `.dvc/tmp`): a test that changes
    it or runs DVC in it works on `_scratch_repo.copy_run(smoke_run, tmp_path / ...)`."""
    from _scratch_repo import build_once, build_pipeline, run_folder, session_stage_progress

    progress = session_stage_progress(request.config, "smoke run")
    return build_once(run_folder(tmp_path_factory), "smoke_run", lambda work: build_pipeline(work, "smoke", progress))


@pytest.fixture
def restore_process_state(monkeypatch: pytest.MonkeyPatch):
    """For tests that run a stage in this process: stages set process-wide state (torch threads
    and deterministic mode in their runtime section, the CUDA workspace variable, logging
    handlers in their preamble), put back afterwards."""
    import logging

    import torch

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    deterministic, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    torch.use_deterministic_algorithms(deterministic)
    torch.set_num_threads(threads)
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def keep_fd_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests that run `lockstep serve` in this process, which raises its soft open-file limit
    toward the hard one: the limit stays as it is, and serving is planned under it."""
    import resource

    from lockstep.infer import serving

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    monkeypatch.setattr(serving, "raise_fd_limit", lambda: (soft, soft, hard))


@pytest.fixture(autouse=True)
def _hermetic(monkeypatch: pytest.MonkeyPatch):
    # No test may reach the network: the hub libraries honour these.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    from lockstep.core import fastpath

    # A fast path that a test made fail stays failed for the process: every test starts afresh.
    fastpath.reset()
    yield
    fastpath.reset()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The end-to-end tests first, then the other tests marked slow, then the rest, each in their
    # order. pytest-xdist hands out whole files in the order of their first test (pyproject's
    # addopts): the files holding the long tests start early and the short ones fill in around
    # them, so that none of them starts near the end and keeps one worker busy while the other
    # has nothing left to run.
    items.sort(key=lambda item: 0 if item.get_closest_marker("e2e") else 1 if item.get_closest_marker("slow") else 2)


def pytest_configure(config: pytest.Config) -> None:
    # Two cores are shared by the suite; keep torch from oversubscribing them.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
