"""The comparison behind `lockstep parity`: read two runs' parity artifacts (lockstep.data.parity) and
name the first difference in words, upstream first (the dataset snapshot explains a different
rendered sample, which explains a different first batch). Then, for each stage that writes run
facts (data/runinfo/<stage>.json), compare its metrics; where they differ, say which of the facts
that decide a run's numerics (lockstep.core.runinfo.numerics_facts: CPU path, torch build, threads,
device, the path each fast path took) differ between the two runs, or that none does."""

from __future__ import annotations

import os
import re
import tempfile
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dvc.api import DVCFileSystem
from dvc.scm import SCMError

from lockstep.core.io import canonical_json, read_json
from lockstep.core.runinfo import NUMERICS_KEY, numerics_differences
from lockstep.data.parity import FIRST_BATCH_FILE, RENDERED_FILE, SNAPSHOT_FILE

# Pipeline order: the first difference upstream explains the ones downstream.
ARTIFACT_ORDER = (SNAPSHOT_FILE, RENDERED_FILE, "meta.json", FIRST_BATCH_FILE)
# Folders of the data stages in pipeline order (data/raw/<source>, data/tokenizer, data/cache/...);
# artifacts anywhere else (training runs) come after them.
STAGE_DIRS = ("raw", "tokenizer", "cache")
# Folders of a stage's metrics and run facts (data/metrics/<stage>.json, data/runinfo/<stage>.json).
METRICS_DIR, RUNINFO_DIR = "metrics", "runinfo"

_SPECIAL_PIECE = re.compile(r"<\|[a-z_]+\|>")
_QUOTES = str.maketrans(
    {
        "\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'", "\u00b4": "'", "`": "'",
        "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u201f": '"', "\u2033": '"', "\u00ab": '"', "\u00bb": '"',
    }
)  # fmt: skip


def _fmt_positions(ps: Sequence[int]) -> str:
    return ",".join(str(p) for p in ps[:8]) + (",…" if len(ps) > 8 else "")


def describe_text_difference(a: str, b: str) -> str:
    """Name how two strings differ: quotes only, Unicode normalization only, whitespace only,
    or the first differing character."""
    if a.translate(_QUOTES) == b.translate(_QUOTES):
        i = next(k for k, (ca, cb) in enumerate(zip(a, b)) if ca != cb)
        return f"differs only by Unicode quote characters (first at char {i}: A {a[i]!r}, B {b[i]!r})"
    if unicodedata.normalize("NFC", a) == unicodedata.normalize("NFC", b):
        return "differs only by Unicode normalization (NFC-equal)"
    if "".join(a.split()) == "".join(b.split()):
        return "differs only by whitespace"
    if a.replace("\r\n", "\n") == b.replace("\r\n", "\n"):
        return "differs only by line endings (CRLF vs LF)"
    i = next((k for k, (ca, cb) in enumerate(zip(a, b)) if ca != cb), min(len(a), len(b)))
    return f"differs first at char {i}: A {a[i : i + 24]!r}, B {b[i : i + 24]!r} (lengths {len(a)}, {len(b)})"


def _strings(obj: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(obj, str):
        return {prefix: obj}
    out: dict[str, str] = {}
    if isinstance(obj, Mapping):
        for k in sorted(obj):
            out.update(_strings(obj[k], f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_strings(v, f"{prefix}[{i}]"))
    return out


def _describe_record(i: int, ra: Any, rb: Any, b_records: list[Any]) -> str:
    if ra in b_records:
        return f"record {i}: A's record is B's record {b_records.index(ra)} (the order differs: shuffled differently)"
    sa, sb = _strings(ra), _strings(rb)
    if sa.keys() == sb.keys():
        for k in sa:
            if sa[k] != sb[k]:
                field = f" field {k}" if k else ""
                return f"record {i}{field} {describe_text_difference(sa[k], sb[k])}"
    return f"record {i} differs: A {canonical_json(ra)[:120]!r}, B {canonical_json(rb)[:120]!r}"


def compare_snapshots(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    sa, sb = a.get("splits", {}), b.get("splits", {})
    if sorted(sa) != sorted(sb):
        return f"splits differ: A has {sorted(sa)}, B has {sorted(sb)}"
    for split in sorted(sa):
        xa, xb = sa[split], sb[split]
        ra, rb = xa["records"], xb["records"]
        for i, (ea, eb) in enumerate(zip(ra, rb)):
            if ea != eb:
                return f"{split} " + _describe_record(i, ea, eb, rb)
        if len(ra) != len(rb) or xa["count"] != xb["count"]:
            return f"{split}: A has {xa['count']} records, B has {xb['count']}"
        if xa["sha256"] != xb["sha256"]:
            return f"{split}: the first {len(ra)} records agree, but a later record differs (sha256 of all differs)"
    return None


def _bos_positions(ids: Sequence[int], bos_id: int | None) -> list[int]:
    return [] if bos_id is None else [p for p, t in enumerate(ids) if t == bos_id]


def _template_hint(*pieces: str) -> str:
    if any(_SPECIAL_PIECE.fullmatch(p) for p in pieces):
        return " — a special token differs, so the chat template (or the special-token ids) changed"
    return ""


def compare_rendered(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    if a.get("bos_id") != b.get("bos_id"):
        return f"BOS id differs: A {a.get('bos_id')}, B {b.get('bos_id')} (different tokenizers)"
    bos = a.get("bos_id")
    for sa, sb in zip(a["samples"], b["samples"]):
        name = f"{sa['split']} sample {sa['index']}"
        ia, ib = sa["ids"], sb["ids"]
        pa, pb = _bos_positions(ia, bos), _bos_positions(ib, bos)
        if len(pa) != len(pb):
            def at(ps: list[int]) -> str:
                return f" at position{'s' * (len(ps) != 1)} {_fmt_positions(ps)}" if ps else ""

            return f"{name}: A has {len(pa)} BOS token{'s' * (len(pa) != 1)}{at(pa)}; B has {len(pb)}{at(pb)}"
        if ia != ib:
            p = next((k for k, (ta, tb) in enumerate(zip(ia, ib)) if ta != tb), min(len(ia), len(ib)))
            if p == min(len(ia), len(ib)):
                longer, extra = ("A", sa["pieces"][p]) if len(ia) > len(ib) else ("B", sb["pieces"][p])
                return (
                    f"{name}: A has {len(ia)} tokens, B has {len(ib)} (one is a prefix of the other; "
                    f"{longer} goes on at position {p} with {extra!r}){_template_hint(extra)}"
                )
            pa_, pb_ = sa["pieces"][p], sb["pieces"][p]
            hint = _template_hint(pa_, pb_)
            return f"{name} position {p}: A has id {ia[p]} ({pa_!r}), B has id {ib[p]} ({pb_!r}){hint}"
        if sa.get("mask") != sb.get("mask"):
            ma, mb = sa.get("mask") or [], sb.get("mask") or []
            p = next((k for k, (x, y) in enumerate(zip(ma, mb)) if x != y), min(len(ma), len(mb)))
            return (
                f"{name}: loss mask differs first at position {p} ({sa['pieces'][p]!r}): A {ma[p:p+1]}, B {mb[p:p+1]} "
                "— same ids, so the chat template's loss masking changed"
            )
    if len(a["samples"]) != len(b["samples"]):
        return f"A has {len(a['samples'])} rendered samples, B has {len(b['samples'])}"
    return None


def _describe_row(r: Mapping[str, Any] | None) -> str:
    if not r:
        return "an unrecorded row"
    parts = []
    if "source" in r:
        parts.append(f"source {r['source']}")
    if "example" in r:
        parts.append(f"example {r['example']}")
    if "start" in r:
        parts.append(f"the window at token {r['start']}" + (f" of shard {r['shard']}" if "shard" in r else ""))
    return " ".join(parts) or canonical_json(dict(r)).strip()


def compare_batches(a: Mapping[str, Any], b: Mapping[str, Any], *, batch: int = 0) -> str | None:
    if a["shape"] != b["shape"]:
        return f"batch {batch}: shape A {a['shape']}, B {b['shape']}"
    ra, rb = a.get("rows") or [], b.get("rows") or []
    for i, (x, y) in enumerate(zip(ra, rb)):
        if x != y:
            return f"batch {batch} row {i}: A drew {_describe_row(x)}, B drew {_describe_row(y)}"
    for key in ("x", "y", "y_masked"):
        ta, tb = a.get(key), b.get(key)
        if ta == tb:
            continue
        if ta is None or tb is None:
            return f"batch {batch}: {key} is present in {'A' if tb is None else 'B'} only"
        for i, (row_a, row_b) in enumerate(zip(ta, tb)):
            if row_a != row_b:
                p = next(k for k, (u, v) in enumerate(zip(row_a, row_b)) if u != v)
                return f"batch {batch} row {i}: {key} differs first at position {p} (A {row_a[p]}, B {row_b[p]})"
    if a.get("meta") != b.get("meta"):
        return f"batch {batch}: meta differs: A {a.get('meta')}, B {b.get('meta')}"
    return None


def compare_json(a: Any, b: Any, where: str = "") -> str | None:
    """First differing key path of two JSON values."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for k in sorted(set(a) | set(b)):
            path = f"{where}.{k}" if where else str(k)
            if k not in a or k not in b:
                return f"{path} is present in {'A' if k in a else 'B'} only"
            d = compare_json(a[k], b[k], path)
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            d = compare_json(x, y, f"{where}[{i}]")
            if d:
                return d
        return None if len(a) == len(b) else f"{where}: A has {len(a)} items, B has {len(b)}"
    return None if a == b else f"{where}: A {a!r}, B {b!r}"


_COMPARERS = {SNAPSHOT_FILE: compare_snapshots, RENDERED_FILE: compare_rendered, FIRST_BATCH_FILE: compare_batches}


def _collect(root: Path) -> dict[str, Path]:
    found = {}
    for name in ARTIFACT_ORDER:
        for p in sorted(root.rglob(name)):
            if not any(part.startswith(".") for part in p.relative_to(root).parts):
                found[p.relative_to(root).as_posix()] = p
    return found


def _order_key(rel: str) -> tuple[int, int, str]:
    parts = rel.split("/")[:-1]
    stage = min((STAGE_DIRS.index(p) for p in parts if p in STAGE_DIRS), default=len(STAGE_DIRS))
    return (stage, ARTIFACT_ORDER.index(rel.rsplit("/", 1)[-1]), rel)


def _stage_facts(root: Path) -> dict[str, tuple[Path, Path]]:
    """{metrics file relative to `root`: (its path, the stage's run facts path)} for every stage
    with run facts under `root` (a `runinfo/<stage>.json` beside a `metrics/` folder)."""
    found = {}
    for runinfo in sorted(root.rglob(f"{RUNINFO_DIR}/*.json")):
        metrics = runinfo.parent.parent / METRICS_DIR / runinfo.name
        found[metrics.relative_to(root).as_posix()] = (metrics, runinfo)
    return found


def explain_numerics(runinfo_a: Mapping[str, Any], runinfo_b: Mapping[str, Any]) -> str:
    """Why two runs of a stage may compute different numbers, from their run facts: the facts
    that decide the numerics and differ, or that they agree on all of them."""
    if NUMERICS_KEY not in runinfo_a or NUMERICS_KEY not in runinfo_b:
        missing = " and ".join(t for t, r in (("A", runinfo_a), ("B", runinfo_b)) if NUMERICS_KEY not in r)
        return (f"run facts of {missing} do not record what decides the numerics ({NUMERICS_KEY}); "
                "rerun the stage to record them")
    differences = numerics_differences(runinfo_a, runinfo_b)
    if differences:
        return "what decides the numerics differs: " + "; ".join(differences)
    return ("both ran with the same CPU path, torch build, threads, device and fast paths, so their params, seed, "
            "code or inputs differ")


def compare_metrics(root_a: Path, root_b: Path) -> list[str]:
    """One line per stage with run facts whose metrics differ between two run folders: the first
    differing metric, then `explain_numerics` of the two runs' facts."""
    sa, sb = _stage_facts(root_a), _stage_facts(root_b)
    lines = []
    for rel in sorted(set(sa) & set(sb)):
        (ma, ra), (mb, rb) = sa[rel], sb[rel]
        if not (ma.is_file() and mb.is_file()):
            continue
        d = compare_json(read_json(ma, what="metrics"), read_json(mb, what="metrics"))
        if d:
            facts_a, facts_b = read_json(ra, what="run facts"), read_json(rb, what="run facts")
            lines.append(f"{rel}: {d}; {explain_numerics(facts_a, facts_b)}")
    return lines


def compare_artifacts(run_a: str | os.PathLike[str], run_b: str | os.PathLike[str]) -> list[str]:
    """Compare the parity artifacts of two run folders, in pipeline order, then the metrics of
    the stages with run facts (`compare_metrics`). Returns one line per artifact or stage that
    differs (the first line names the earliest difference); [] when all agree."""
    root_a, root_b = Path(run_a), Path(run_b)
    for r in (root_a, root_b):
        if not r.is_dir():
            raise FileNotFoundError(f"{r} is not a folder; pass two run folders (or two DVC experiment refs)")
    fa, fb = _collect(root_a), _collect(root_b)
    if not fa and not fb and not _stage_facts(root_a) and not _stage_facts(root_b):
        raise FileNotFoundError(f"no parity artifacts ({', '.join(ARTIFACT_ORDER)}) under {root_a} or {root_b}")
    diffs = []
    for rel in sorted(set(fa) | set(fb), key=_order_key):
        if rel not in fa or rel not in fb:
            diffs.append(f"{rel}: present in {'A' if rel in fa else 'B'} only")
            continue
        ja, jb = read_json(fa[rel], what="artifact"), read_json(fb[rel], what="artifact")
        cmp = _COMPARERS.get(rel.rsplit("/", 1)[-1], compare_json)
        d = cmp(ja, jb)
        if d:
            diffs.append(f"{rel}: {d}")
    return diffs + compare_metrics(root_a, root_b)


def materialize_rev(rev: str, out_dir: Path, *, repo: str | os.PathLike[str] = ".") -> Path:
    """Copy the parity artifacts, metrics and run facts of a git revision or DVC experiment ref
    into `out_dir`, through DVC's filesystem view of that revision (files in DVC outputs, the run
    facts among them, come from the local cache; one missing there is left out)."""
    fs = DVCFileSystem(os.fspath(repo), rev=rev)
    names = set(ARTIFACT_ORDER)
    n = 0
    try:
        paths = fs.find("/", detail=False, dvc_only=False)
    except SCMError as e:
        raise FileNotFoundError(
            f"{rev!r} is neither a folder nor a git revision or DVC experiment of {os.path.abspath(repo)} ({e}); "
            "pass two run folders, or two names from `dvc exp list`"
        ) from None
    for path in paths:
        parts = path.rsplit("/", 2)
        facts = len(parts) == 3 and parts[1] in (METRICS_DIR, RUNINFO_DIR) and parts[2].endswith(".json")
        if parts[-1] in names or facts:
            dest = out_dir / path.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                fs.get_file(path, os.fspath(dest))
            except FileNotFoundError:
                if not facts:
                    raise
                continue  # run facts not in the local cache: `dvc pull` from a DVC remote brings them
            n += 1 if parts[-1] in names else 0
    if n == 0:
        raise FileNotFoundError(f"revision {rev!r} holds no parity artifacts ({', '.join(ARTIFACT_ORDER)})")
    return out_dir


def compare_runs(run_a: str, run_b: str, *, repo: str | os.PathLike[str] = ".") -> list[str]:
    """`compare_artifacts` over two folders, or two git/DVC experiment refs when a name is not a folder."""
    with tempfile.TemporaryDirectory(prefix="lockstep-parity-") as tmp:
        roots = []
        for tag, run in (("a", run_a), ("b", run_b)):
            roots.append(Path(run) if Path(run).is_dir() else materialize_rev(run, Path(tmp) / tag, repo=repo))
        return compare_artifacts(*roots)
