"""A stage run by a `python3` that is not the project's: `.venv/bin/dvc repro` from a shell without
the venv active runs dvc.yaml's `python3 -m stages.X` on the first `python3` on PATH. stages/__init__.py
runs the stage again with the project's .venv/bin/python, the same arguments; without one (or with
one that lacks the packages too) it ends with one error line that says what to activate."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    """A venv with the standard library only: neither torch nor lockstep imports, as under a system python."""
    where = tmp_path_factory.mktemp("bare") / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    return where / "bin" / "python"


def _project(tmp_path: Path, dot_venv: Path | None) -> Path:
    """A project folder with this checkout's stages/ and, when given, `.venv` linked to `dot_venv`."""
    shutil.copytree(ROOT / "stages", tmp_path / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    if dot_venv is not None:
        (tmp_path / ".venv").symlink_to(dot_venv, target_is_directory=True)
    return tmp_path


def _run(python: Path, project: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{python.parent}{os.pathsep}/usr/bin{os.pathsep}/bin"}
    env.pop("LOCKSTEP_STAGE_RERUN", None)
    return subprocess.run([str(python), "-m", "stages.report", "--help"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_stage_under_another_python_runs_with_the_projects(tmp_path, bare_python):
    project = _project(tmp_path, Path(sys.prefix))
    proc = _run(bare_python, project)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m stages.report")
    note = proc.stderr.strip().splitlines()
    assert len(note) == 1 and note[0].startswith(f"note: {bare_python} (first `python` on PATH) cannot import")
    assert str(project / ".venv" / "bin" / "python") in note[0]


def test_without_a_project_python_the_stage_says_how_to_activate_it(tmp_path, bare_python):
    proc = _run(bare_python, _project(tmp_path, None))
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {bare_python} cannot import") and "torch:" in lines[0]
    assert "source .venv/bin/activate" in lines[0] and "make repro" in lines[0]


def test_a_project_python_without_the_packages_ends_instead_of_looping(tmp_path, bare_python):
    proc = _run(bare_python, _project(tmp_path, bare_python.parent.parent))
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("note: ") and lines[1].startswith("error: "), proc.stderr


def test_dvc_yaml_runs_python3_which_a_system_without_python_has(tmp_path, bare_python):
    """Debian, Ubuntu and macOS have `python3` and no `python`: every stage command starts with
    `python3`, and from a PATH whose only interpreter is a system-like `python3`, the command as
    dvc.yaml writes it (through the shell, as DVC runs it) reaches the project's interpreter."""
    cmds = [line.split("cmd:", 1)[1].strip() for line in (ROOT / "dvc.yaml").read_text().splitlines()
            if line.strip().startswith("cmd:")]
    assert cmds and all(cmd.startswith("python3 -m stages.") for cmd in cmds), cmds
    only_python3 = tmp_path / "bin"
    only_python3.mkdir()
    (only_python3 / "python3").symlink_to(bare_python)
    project = _project(tmp_path / "project", Path(sys.prefix))
    env = {**os.environ, "PATH": str(only_python3)}
    env.pop("LOCKSTEP_STAGE_RERUN", None)
    assert shutil.which("python", path=env["PATH"]) is None
    proc = subprocess.run(["/bin/sh", "-c", "python3 -m stages.report --help"], cwd=project, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m stages.report")
    assert proc.stderr.startswith(f"note: {only_python3 / 'python3'} (first `python3` on PATH) cannot import")


def test_venv_dvc_repro_from_a_shell_without_the_venv(tmp_path):
    """The newcomer's `.venv/bin/dvc repro`, typed in a shell whose PATH has no venv (only the
    system's /usr/bin and /bin): DVC runs the stage command as dvc.yaml writes it, the system's
    python3 starts it, and the stage runs on the project's interpreter and succeeds."""
    from _exp_toy import DVC, sh, toy_env

    system = [d for d in ("/usr/bin", "/bin") if os.path.isdir(d)]
    python3 = shutil.which("python3", path=os.pathsep.join(system))
    if python3 is None or subprocess.run([python3, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("needs a system python3 (in /usr/bin or /bin) without torch, as on a fresh machine")
    project = _project(tmp_path / "project", Path(sys.prefix))
    (project / "dvc.yaml").write_text(
        "stages:\n  usage:\n    cmd: python3 -m stages.report --help > usage.txt\n    deps: [stages]\n"
        "    outs: [usage.txt]\n")
    env = toy_env(tmp_path / "home")
    sh(project, env, "git", "init", "-q")
    sh(project, env, DVC, "init", "-q")
    env = {**env, "PATH": os.pathsep.join(system)}
    env.pop("VIRTUAL_ENV", None)
    env.pop("LOCKSTEP_STAGE_RERUN", None)
    proc = subprocess.run([str(DVC), "repro"], cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (project / "usage.txt").read_text().startswith("usage: python -m stages.report")
    assert f"note: {python3} (first `python3` on PATH) cannot import" in proc.stdout + proc.stderr
