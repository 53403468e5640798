"""Bad input at the front doors, the `lockstep` command and the stage entry points, ends in one
`error: ...` line that names what is wrong and how to fix it, and a non-zero exit: never a
traceback. Also: a stage started by a `python` without the project's environment says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from _tiny_model import randomize, tiny_gpt
from lockstep.cli import app as cli_app
from lockstep.core.config import ConfigError, build_config
from lockstep.core.io import sha256_file
from lockstep.core.runtime import DeviceError, RuntimeConfig, device_from_name
from lockstep.model.checkpoint import MANIFEST_FILE, META_FILE, save_checkpoint
from lockstep.tokenizer.kinds import train_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def the_error_line(output: str) -> str:
    """The one `error:` line of a failed command's output, checking there is no traceback."""
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output
    return errors[0]


@pytest.fixture(scope="module")
def random_ckpt(tmp_path_factory) -> tuple[Path, Path]:
    """A 1-layer GPT with random weights (logits out at the soft cap, unlike a fresh init's zeros)
    over the byte tokenizer, with a 64-token context."""
    root = tmp_path_factory.mktemp("random_ckpt")
    tok = train_tokenizer("byte", [])
    tok.save(root / "tokenizer")
    model = randomize(tiny_gpt(vocab_size=tok.get_vocab_size(), n_kv_head=1), seed=1, scale=0.5)
    config = model.config
    save_checkpoint(root / "ckpt" / "sft", model.state_dict(), {},
                    {"model_config": config.to_dict(), "tokenizer_sha256": tok.sha256})
    return root / "ckpt" / "sft", root / "tokenizer"


def chat(ckpt: Path, tok_dir: Path, *args: str):
    return CliRunner().invoke(cli_app, ["chat", "--ckpt", str(ckpt), "--tokenizer", str(tok_dir), *args])


# ---- lockstep chat ------------------------------------------------------------------------------


def test_chat_prompt_longer_than_the_context(random_ckpt):
    r = chat(*random_ckpt, "-p", "x" * 100)
    assert r.exit_code == 2, r.output
    line = the_error_line(r.output)
    assert "104 tokens" in line and "64-token context" in line and "shorten the prompt" in line


def test_chat_at_a_tiny_temperature_answers_like_temperature_zero(random_ckpt):
    tiny = chat(*random_ckpt, "-p", "hello", "--max-tokens", "12", "--temperature", "1e-40")
    greedy = chat(*random_ckpt, "-p", "hello", "--max-tokens", "12", "--temperature", "0")
    assert tiny.exit_code == 0, tiny.output
    assert tiny.output == greedy.output


def test_chat_on_a_device_this_machine_lacks(random_ckpt, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = chat(*random_ckpt, "-p", "hi", "--device", "cuda")
    assert r.exit_code == 2, r.output
    line = the_error_line(r.output)
    assert "--device cuda" in line and "no CUDA device" in line and "use --device cpu" in line
    r = chat(*random_ckpt, "-p", "hi", "--device", "gpu0")
    assert r.exit_code == 2 and "'gpu0' is not a torch device" in the_error_line(r.output)


def test_device_names_are_checked_against_this_machine(monkeypatch):
    assert device_from_name("cpu", setting="--device") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device_from_name("cuda:0", setting="--device") == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match=r"--device cuda:3: torch sees 1 CUDA device\(s\), cuda:0 to cuda:0"):
        device_from_name("cuda:3", setting="--device")


def test_chat_refuses_a_checkpoint_whose_meta_is_not_an_object(random_ckpt, tmp_path):
    ckpt, tok_dir = random_ckpt
    bad = tmp_path / "sft"
    bad.mkdir()
    for f in ckpt.iterdir():
        bad.joinpath(f.name).write_bytes(f.read_bytes())
    # A consistent checkpoint (its manifest lists the new meta.json's hash) that no stage wrote.
    (bad / META_FILE).write_text(json.dumps([{"model_config": {}}]))
    manifest = json.loads((bad / MANIFEST_FILE).read_text())
    manifest["files"][META_FILE] = sha256_file(bad / META_FILE)
    (bad / MANIFEST_FILE).write_text(json.dumps(manifest))
    r = chat(bad, tok_dir, "-p", "hi")
    assert r.exit_code == 2, r.output
    line = the_error_line(r.output)
    assert "meta.json holds an array, not a JSON object" in line and "delete the checkpoint" in line


# ---- lockstep preset ----------------------------------------------------------------------------


def test_preset_with_invalid_yaml(tmp_path):
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "broken.yaml").write_text("preset: broken\nseed: [1, 2\nmodel: {depth: 4}\n")
    params = tmp_path / "params.yaml"
    params.write_text("preset: tiny\n")
    r = CliRunner().invoke(cli_app, ["preset", "broken", "--presets-dir", str(tmp_path / "presets"),
                                     "--params-file", str(params)])
    assert r.exit_code == 2, r.output
    line = the_error_line(r.output)
    assert "broken.yaml is not valid YAML" in line and "line 3, column 6" in line and "fix the file" in line
    assert params.read_text() == "preset: tiny\n"


# ---- params sections ----------------------------------------------------------------------------


@pytest.mark.parametrize("nproc", [0, -2])
def test_runtime_nproc_below_one_is_refused(nproc):
    with pytest.raises(ConfigError, match=f"runtime.nproc={nproc} must be >= 1"):
        build_config(RuntimeConfig, {"nproc": nproc}, where="runtime")
    with pytest.raises(ConfigError, match="runtime.threads=-1 must be >= 0"):
        build_config(RuntimeConfig, {"threads": -1}, where="runtime")


# ---- stage entry points -------------------------------------------------------------------------


def run_stage(module: str, *args: str, python: tuple[str, ...] = (sys.executable,)) -> subprocess.CompletedProcess:
    # This checkout's code, whatever is installed in the environment.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "lib"), str(ROOT)])}
    return subprocess.run([*python, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize(
    "section, key, value, expected",
    [
        ("model", "head_dim", 0, "model.head_dim=0 must be a positive even integer"),
        ("model", "head_dim", 48, "model.head_dim=48 must divide the width 64 * depth = 256"),
        ("runtime", "nproc", 0, "runtime.nproc=0 must be >= 1"),
    ],
)
def test_training_stage_refuses_a_bad_shape_or_process_count(tmp_path, section, key, value, expected):
    params = yaml.safe_load((ROOT / "presets" / "tiny.yaml").read_text())
    params[section][key] = value
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    paths = [
        f"--{name}={tmp_path / name}" for name in ("cache", "tokenizer", "out", "metrics", "runinfo", "plots", "runs")
    ]
    proc = run_stage("stages.pretrain", *paths, f"--params={tmp_path / 'params.yaml'}")
    assert proc.returncode != 0
    assert expected in the_error_line(proc.stderr)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: runtime.device=cuda is valid here")
def test_training_stage_asked_for_cuda_on_a_machine_without_it(tmp_path):
    params = yaml.safe_load((ROOT / "presets" / "tiny.yaml").read_text())
    params["runtime"]["device"] = "cuda"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    paths = [
        f"--{name}={tmp_path / name}" for name in ("cache", "tokenizer", "out", "metrics", "runinfo", "plots", "runs")
    ]
    proc = run_stage("stages.pretrain", *paths, f"--params={tmp_path / 'params.yaml'}")
    assert proc.returncode != 0
    line = the_error_line(proc.stderr)
    assert "runtime.device=cuda but torch sees no CUDA device" in line and "set runtime.device: cpu or auto" in line


def test_fetch_stage_with_a_source_file_in_the_wrong_format_says_so_in_one_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"  # OASST prompt lists, not the message trees oasst1 reads
    prompts.write_text('{"prompt": "Write a haiku"}\n{"prompt": "Explain DVC"}\n', encoding="utf-8")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(
        {"seed": 1, "data_seed": 1, "fetch": {"chats": {"source": "oasst1", "path": str(prompts), "val_frac": 0.5}}}))
    proc = run_stage("stages.fetch", "chats", f"--out={tmp_path / 'raw'}", f"--params={tmp_path / 'params.yaml'}")
    assert proc.returncode == 1
    line = the_error_line(proc.stderr)
    assert str(prompts) in line and "expected" in line
    assert not (tmp_path / "raw").exists()


def test_cache_stage_without_a_data_seed_refuses_instead_of_using_zero(tmp_path):
    params = yaml.safe_load((ROOT / "presets" / "tiny.yaml").read_text())
    del params["data_seed"]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "lib"), str(ROOT)])}
    # The cache stage reads params.yaml from its working folder, as under `dvc repro`.
    proc = subprocess.run([sys.executable, "-m", "stages.cache", "shakespeare", "--raw", str(tmp_path / "raw"),
                           "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "out")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "params.yaml `data_seed` must be an integer, got None" in the_error_line(proc.stderr)
    assert not (tmp_path / "out").exists()
