"""The DCLM eval bundle (`eval_bundle.zip`: `core.yaml`, `eval_meta_data.csv`, `eval_data/`), the
22 CORE tasks, as a file-bundle snapshot: downloaded from the address nanochat's base_eval reads
(or taken from a local zip or unpacked folder), checked against a pinned sha256, and its files
kept verbatim under `data/raw/<name>/eval_bundle/` with a sha256 per file in meta.json
(lockstep.data.snapshot.close_bundle). Checks the layout and counts tasks and items; it does not parse
or score them (lockstep.evaluate.core reads the folder)."""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import yaml

from lockstep.core.config import FieldError
from lockstep.data.snapshot import BUNDLE_DIR, BUNDLE_KIND, close_bundle
from lockstep.data.sources.common import SourceFormatError, SourceUnavailableError, with_retries
from lockstep.data.sources.fields import CheckedFields, Rule

log = logging.getLogger("lockstep.sources")

KIND = BUNDLE_KIND
EXPECTED = (
    "the DCLM eval bundle: eval_bundle.zip, or its unpacked folder, holding core.yaml (an `icl_tasks` list), "
    "eval_meta_data.csv and eval_data/<category>/<task>.jsonl"
)
URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
# sha256 of eval_bundle.zip as served at URL. Not measured here (this project's build machines
# have no route to it): it is the value several independent projects that pin this download
# publish, each alongside the same URL, 22 tasks and 91,037 items. A first real fetch checks it.
PUBLISHED_SHA256 = "90a7c19e28ee7a52b4f6e1f87658deb9fde7f63deba2379045bdb1fe9ea5d200"
REQUIRED = ("core.yaml", "eval_meta_data.csv")
CHUNK_BYTES = 1 << 20
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class DclmCoreConfig(CheckedFields):
    source: Literal["dclm_core"] = "dclm_core"
    url: str = URL  # where the zip is downloaded from when `path` is null (http(s), or file:// for a local mirror)
    # sha256 the zip must have (download or local zip); null: not checked, and the tasks are then
    # reported as CORE-style, not as DCLM's CORE. A local folder can only be taken with null.
    sha256: str | None = PUBLISHED_SHA256
    path: str | None = None  # a local eval_bundle.zip, or the folder it unpacks to; null: download `url`
    timeout_s: float = 120.0  # seconds without a byte before a download attempt fails
    max_retries: int = 5  # network retries before giving up
    backoff_s: float = 2.0  # first retry wait; doubles each retry

    RULES = {
        "timeout_s": Rule("seconds a download waits for the next byte", ge=1, le=3600),
        "max_retries": Rule("network retries before giving up", ge=0, le=20),
        "backoff_s": Rule("seconds before the first retry, doubling each retry", ge=0, le=3600),
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sha256 is not None and not _HEX64.fullmatch(self.sha256):
            raise FieldError("sha256", self.sha256, "must be 64 lowercase hex digits (the zip's sha256), or null "
                                                    "to take the bundle unchecked")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _download(cfg: DclmCoreConfig, dest: Path) -> None:
    """Stream `cfg.url` into `dest`, retrying network errors; an HTTP error status is final."""

    def attempt() -> None:
        try:
            with urllib.request.urlopen(cfg.url, timeout=cfg.timeout_s) as resp, open(dest, "wb") as out:
                shutil.copyfileobj(resp, out, CHUNK_BYTES)
        except urllib.error.HTTPError as e:
            raise SourceUnavailableError(
                f"{cfg.url} answered HTTP {e.code} ({e.reason}); the bundle may have moved: set `fetch.<name>.url` "
                "to where it is now, or download it yourself and set `fetch.<name>.path` to the zip"
            ) from None
        except urllib.error.URLError as e:  # no route, DNS, refused: worth retrying
            raise ConnectionError(str(e.reason)) from e

    with_retries(attempt, what=f"download {cfg.url}", max_retries=cfg.max_retries, backoff_s=cfg.backoff_s)


def _check_sha(cfg: DclmCoreConfig, got: str, where: str) -> None:
    if cfg.sha256 is not None and got != cfg.sha256:
        fix = ("the download was damaged or the file at the address changed; run the fetch again, and if the "
               "digest stays the same, check the file and set `fetch.<name>.sha256` to its digest (or null)"
               if cfg.path is None else
               "it is not the pinned bundle or it is damaged; download it again, or set `fetch.<name>.sha256` to "
               "its digest (or null) if this is the bundle you mean to evaluate")
        raise SourceFormatError(f"{where} has sha256 {got}, not the pinned {cfg.sha256}: {fix}. Nothing was published, "
                                "and an earlier snapshot, if any, is as it was")


def _bundle_root(names: list[str], where: str) -> str:
    """The folder (as a prefix, '' for the top) inside the archive or folder that holds core.yaml:
    the top itself or one folder down (the published zip's `eval_bundle/`)."""
    roots = sorted({n[: -len("core.yaml")] for n in names
                    if n.endswith("core.yaml") and n.count("/") <= 1 and PurePosixPath(n).name == "core.yaml"})
    if len(roots) != 1:
        found = "none" if not roots else ", ".join(r or "(top)" for r in roots)
        raise SourceFormatError(f"{where}: expected one core.yaml at the top or in one folder (found {found}); "
                                f"expected {EXPECTED}")
    return roots[0]


def extract_zip(archive: Path, dest: Path) -> None:
    """The bundle's files from `archive` into `dest` (its `eval_bundle/` prefix dropped), each
    member's CRC checked as it is read; anything outside the bundle folder is left out."""
    try:
        with zipfile.ZipFile(archive) as zf:
            names = [i.filename for i in zf.infolist() if not i.is_dir()]
            prefix = _bundle_root(names, str(archive))
            for info in zf.infolist():
                if info.is_dir() or not info.filename.startswith(prefix):
                    continue
                rel = PurePosixPath(info.filename[len(prefix):])
                if rel.is_absolute() or ".." in rel.parts or rel.parts[0] == "__MACOSX" or rel.name == ".DS_Store":
                    continue
                target = dest / Path(*rel.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out, CHUNK_BYTES)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
        raise SourceFormatError(f"{archive} is not a readable zip ({e}): a damaged or partial file; download it "
                                f"again. Nothing was published. Expected {EXPECTED}") from None


def _copy_folder(folder: Path, dest: Path) -> None:
    names = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    prefix = _bundle_root(names, str(folder))
    root = folder / prefix if prefix else folder
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != ".DS_Store":
            target = dest / p.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, target)


def bundle_counts(folder: Path) -> dict[str, int]:
    """Tasks in core.yaml and items (non-blank lines) over the task files it names, after checking
    the layout: both required files, an `icl_tasks` list, each task's file under eval_data/."""
    for name in REQUIRED:
        if not (folder / name).is_file():
            raise SourceFormatError(f"the bundle has no {name}; expected {EXPECTED}")
    try:
        spec = yaml.safe_load((folder / "core.yaml").read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise SourceFormatError(f"the bundle's core.yaml does not parse ({e}); expected {EXPECTED}") from None
    tasks = spec.get("icl_tasks") if isinstance(spec, dict) else None
    if not isinstance(tasks, list) or not tasks:
        raise SourceFormatError(f"the bundle's core.yaml has no `icl_tasks` list; expected {EXPECTED}")
    items = 0
    for task in tasks:
        uri = str((task or {}).get("dataset_uri", ""))
        rel = next((uri[len(p):] for p in ("eval/local_data/", "local_data/", "eval_data/") if uri.startswith(p)), uri)
        f = folder / "eval_data" / rel
        if not uri or not f.is_file():
            raise SourceFormatError(f"task {(task or {}).get('label')!r} in the bundle's core.yaml names "
                                    f"{uri!r}, which is not a file under eval_data/; expected {EXPECTED}")
        with open(f, "rb") as fh:
            items += sum(1 for line in fh if line.strip())
    return {"tasks": len(tasks), "items": items}


def publish(cfg: DclmCoreConfig, root: Path, *, name: str, config: dict[str, Any], seed: int) -> dict[str, Any]:
    """Write the bundle snapshot into `root` (an atomic_dir work folder): the files under
    BUNDLE_DIR, then meta.json. `identity` is "dclm" when the zip is the published bundle
    (its sha256 is PUBLISHED_SHA256), else "unverified"."""
    dest = root / BUNDLE_DIR
    dest.mkdir()
    archive_sha: str | None = None
    if cfg.path is not None:
        local = Path(cfg.path)
        if not local.exists():
            raise FileNotFoundError(f"fetch.{name}.path: {local} does not exist; point it at eval_bundle.zip or its "
                                    "unpacked folder, or set it to null to download the bundle")
        if local.is_dir():
            if cfg.sha256 is not None:
                raise SourceFormatError(
                    f"fetch.{name}.path is the folder {local}, which cannot be checked against the zip's sha256; "
                    f"point path at eval_bundle.zip itself, or set fetch.{name}.sha256: null to take the folder "
                    "unchecked (its CORE is then reported as CORE-style)")
            _copy_folder(local, dest)
            source_id = f"local:{local.as_posix()}"
        else:
            archive_sha = _sha256(local)
            _check_sha(cfg, archive_sha, str(local))
            extract_zip(local, dest)
            source_id = f"local:{local.as_posix()}"
    else:
        # Downloaded inside the work folder, which atomic_dir removes on any failure.
        archive = root / ".download.zip"
        _download(cfg, archive)
        archive_sha = _sha256(archive)
        _check_sha(cfg, archive_sha, f"the download of {cfg.url}")
        extract_zip(archive, dest)
        archive.unlink()
        source_id = cfg.url
    counts = bundle_counts(dest)
    identity = "dclm" if archive_sha == PUBLISHED_SHA256 else "unverified"
    log.info("%s: %d tasks, %d items (%s)", source_id, counts["tasks"], counts["items"], identity)
    return close_bundle(root, name=name, source=cfg.source, config=config, seed=seed, source_id=source_id,
                        archive_sha256=archive_sha, identity=identity, counts=counts, bad_examples=[])
