"""Checkpoint directories: safetensors weights, per-rank optimizer state, meta.json and a sha256
manifest written last; latest-complete discovery, cleanup and pruning; and `load_model`, the one
way a stage, eval or chat turns a checkpoint into a GPT. Not a training loop: it stores what it
is given and refuses anything that does not match its manifest."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from lockstep.core.io import atomic_open, fsync_dir, read_json, sha256_file, write_json_atomic
from lockstep.model.gpt import GPT, GPTConfig

FORMAT = "lockstep-checkpoint-v1"
MODEL_FILE = "model.safetensors"
RNG_FILE = "rng.safetensors"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_PARTIAL_SUFFIX = ".partial"


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete, or does not match its manifest."""


def optim_file(rank: int) -> str:
    return f"optim_rank{rank}.pt"


def step_dir(run_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(run_dir) / f"step_{step:08d}"


def partial_dir(final_dir: str | os.PathLike[str]) -> Path:
    """Where a checkpoint is assembled before it is renamed into place. The name depends only on
    the final name, so every rank of a job agrees on it without talking."""
    final_dir = Path(final_dir)
    return final_dir.with_name(f".{final_dir.name}{_PARTIAL_SUFFIX}")


def begin_checkpoint(final_dir: str | os.PathLike[str]) -> Path:
    """A fresh, empty staging folder for `final_dir` (a leftover from a crash is discarded).
    Call on the one writing rank, then write every rank's optimizer state into it
    (write_optim_state), then finish_checkpoint."""
    staging = partial_dir(final_dir)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def write_optim_state(staging: Path, rank: int, state: Mapping[str, Any]) -> None:
    """One rank's optimizer state (tensors, numbers, strings, lists, dicts only: loadable with
    `torch.load(weights_only=True)`)."""
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    with atomic_open(staging / optim_file(rank), "wb") as f:
        f.write(buf.getvalue())


def _contiguous_cpu(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def finish_checkpoint(staging: Path, final_dir: str | os.PathLike[str], *, model_state: Mapping[str, torch.Tensor],
                      meta: Mapping[str, Any], rng_states: Mapping[str, torch.Tensor] | None = None) -> dict[str, str]:
    """Write weights, RNG states and meta.json into `staging`, then the manifest (sha256 of every
    file) last, then rename the folder onto `final_dir`. Returns the manifest's file map. A crash
    at any point leaves either no checkpoint at `final_dir` or a complete one."""
    final_dir = Path(final_dir)
    with atomic_open(staging / MODEL_FILE, "wb") as f:
        f.write(safetensors_save(_contiguous_cpu(model_state)))
    with atomic_open(staging / RNG_FILE, "wb") as f:
        f.write(safetensors_save(_contiguous_cpu(rng_states or {})))
    meta = dict(meta)
    meta["format"] = FORMAT
    write_json_atomic(staging / META_FILE, meta)
    names = sorted(p.name for p in staging.iterdir() if p.is_file() and not p.name.startswith("."))
    if MANIFEST_FILE in names:
        raise CheckpointError(f"{staging} already holds a manifest; start from begin_checkpoint()")
    files = {name: sha256_file(staging / name) for name in names}
    write_json_atomic(staging / MANIFEST_FILE, {"format": FORMAT, "files": files})
    fsync_dir(staging)
    old = None
    if final_dir.exists():
        old = final_dir.with_name(f".{final_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final_dir, old)
    os.replace(staging, final_dir)
    fsync_dir(final_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return files


def save_checkpoint(final_dir: str | os.PathLike[str], model_state: Mapping[str, torch.Tensor],
                    optim_states: Mapping[int, Mapping[str, Any]], meta: Mapping[str, Any],
                    rng_states: Mapping[str, torch.Tensor] | None = None) -> dict[str, str]:
    """Single-writer save: every rank's optimizer state is given here, keyed by rank. A save that
    fails (a full disk) leaves no staging folder beside `final_dir`."""
    staging = begin_checkpoint(final_dir)
    try:
        for rank, state in sorted(optim_states.items()):
            write_optim_state(staging, rank, state)
        return finish_checkpoint(staging, final_dir, model_state=model_state, meta=meta, rng_states=rng_states)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def verify_checkpoint(path: str | os.PathLike[str]) -> dict[str, str]:
    """Check that `path` holds exactly the files its manifest lists, with their sha256. Raises
    CheckpointError naming the first problem; returns the manifest's file map."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist; run the stage that writes it")
    if not (path / MANIFEST_FILE).is_file():
        raise CheckpointError(
            f"checkpoint {path} has no {MANIFEST_FILE}: it is incomplete (interrupted save); delete it"
        )
    try:
        manifest = read_json(path / MANIFEST_FILE, what="checkpoint manifest")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise CheckpointError(f"{path / MANIFEST_FILE} is not a {FORMAT} manifest; re-run the stage that wrote it")
    files: dict[str, str] = manifest["files"]
    present = {p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST_FILE}
    missing, extra = sorted(set(files) - present), sorted(present - set(files))
    if missing or extra:
        raise CheckpointError(f"checkpoint {path} does not match its manifest (missing {missing}, unlisted {extra}); "
                              "it was modified after saving: delete it and re-run the stage")
    for required in (MODEL_FILE, META_FILE):
        if required not in files:
            raise CheckpointError(f"checkpoint {path} has no {required}; re-run the stage that wrote it")
    for name, digest in sorted(files.items()):
        actual = sha256_file(path / name)
        if actual != digest:
            raise CheckpointError(f"{path / name} has sha256 {actual[:12]}..., manifest says {digest[:12]}...: "
                                  "the checkpoint is corrupted or was edited; delete it and re-run the stage")
    return files


@dataclass
class Checkpoint:
    """A verified checkpoint: weights and meta loaded; optimizer state loaded per rank on demand."""

    path: Path
    meta: dict[str, Any]
    model_state: dict[str, torch.Tensor]
    rng_states: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def optim_state(self, rank: int) -> dict[str, Any]:
        p = self.path / optim_file(rank)
        if not p.is_file():
            world = len(list(self.path.glob("optim_rank*.pt")))
            raise CheckpointError(
                f"{p} is missing: the checkpoint was written by {world} rank(s); resume with that many"
            )
        return torch.load(p, map_location="cpu", weights_only=True)


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Verify the manifest, then load weights (safetensors), RNG states and meta.json."""
    path = Path(path)
    verify_checkpoint(path)
    try:
        meta = read_json(path / META_FILE, what="checkpoint meta")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if not isinstance(meta, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(meta), "a number")
        raise CheckpointError(f"{path / META_FILE} holds {kind}, not a JSON object: it was not written by a lockstep "
                              "stage; delete the checkpoint and re-run the stage that writes it")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path / META_FILE} has format {meta.get('format')!r}, expected {FORMAT!r}")
    model_state = safetensors_load((path / MODEL_FILE).read_bytes())
    rng = safetensors_load((path / RNG_FILE).read_bytes()) if (path / RNG_FILE).is_file() else {}
    return Checkpoint(path=path, meta=meta, model_state=model_state, rng_states=rng)


def load_model(path: str | os.PathLike[str], device: torch.device | str, *,
               tokenizer_sha256: str | None = None, dtype: torch.dtype | None = None) -> tuple[GPT, dict[str, Any]]:
    """The GPT a checkpoint holds, on `device` in eval mode, and the checkpoint's meta. The
    manifest and format are verified first (`load_checkpoint`); with `tokenizer_sha256`, a
    checkpoint trained with another tokenizer is refused. The model is built from
    `meta["model_config"]` without initial weights and its weights loaded strictly, then cast to
    `dtype` when given (bf16 for decoding on a GPU; None keeps the stored fp32). Every failure is
    a CheckpointError that names the checkpoint."""
    path = Path(path)
    ck = load_checkpoint(path)
    meta = ck.meta
    if tokenizer_sha256 is not None and meta.get("tokenizer_sha256") != tokenizer_sha256:
        trained = meta.get("tokenizer_sha256")
        trained_with = f"tokenizer {trained[:12]}..." if isinstance(trained, str) else "no recorded tokenizer"
        raise CheckpointError(f"checkpoint {path} was trained with {trained_with}, not the tokenizer in use "
                              f"({tokenizer_sha256[:12]}...); re-run the earlier stages (dvc repro) so it is trained "
                              "with this tokenizer, or use the tokenizer it was trained with")
    if not isinstance(meta.get("model_config"), dict):
        raise CheckpointError(f"{path / META_FILE} has no model_config: it was not written by a training stage; "
                              "re-run the stage that writes it")
    try:
        config = GPTConfig.from_dict(meta["model_config"])
    except (ValueError, TypeError) as e:  # ConfigError, or a field the config's own checks refuse
        raise CheckpointError(f"{path / META_FILE} holds a model_config this code cannot build ({e}); re-run the "
                              "earlier stages (dvc repro) with this code") from None
    # No initial weights: built on the meta device and given uninitialised memory on `device`,
    # every parameter and persistent buffer is then copied from the checkpoint (strictly, so none
    # is left unfilled), and the rotary tables, derived data outside the state dict, computed.
    # So loading draws no random numbers and skips GPT.build's init: the d4 model builds and
    # loads in a third of the time on a CPU.
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_rotary()
    try:
        model.load_state_dict(ck.model_state)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[:2]
        raise CheckpointError(f"{path / MODEL_FILE} does not fit its model_config ({' '.join(first)}); re-run the "
                              "stage that wrote it") from None
    if dtype is not None:
        for p in model.parameters():  # the rotary tables are buffers and stay fp32, as GPT.build leaves them
            p.data = p.data.to(dtype)
    model.eval()
    return model, meta


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete-looking checkpoints (a manifest exists) in `run_dir`, by step, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for p in run_dir.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / MANIFEST_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint in `run_dir` that verifies against its manifest; newer ones that do
    not verify are skipped (and left for `clean_incomplete`)."""
    for _, p in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(p)
        except CheckpointError:
            continue
        return p
    return None


def clean_incomplete(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Remove staging folders and step folders without a manifest (interrupted saves)."""
    run_dir = Path(run_dir)
    removed: list[Path] = []
    if not run_dir.is_dir():
        return removed
    for p in sorted(run_dir.iterdir()):
        partial = p.name.startswith(".step_") and (p.name.endswith(_PARTIAL_SUFFIX) or p.name.endswith(".old"))
        bare = _STEP_DIR.match(p.name) and p.is_dir() and not (p / MANIFEST_FILE).is_file()
        if partial or bare:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def prune_checkpoints(run_dir: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (at least 2 are kept, so a
    crash while writing the newest still leaves a complete one behind)."""
    if keep_last < 2:
        raise ValueError(f"keep_last={keep_last} must be >= 2: one checkpoint may be mid-write when a crash comes")
    found = list_checkpoints(run_dir)
    removed = []
    for _, p in found[:-keep_last]:
        # Rename first so a crash mid-delete never leaves a step dir with a manifest but no weights.
        doomed = p.with_name(f".{p.name}.old")
        with contextlib.suppress(FileNotFoundError):
            os.replace(p, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(p)
    return removed

