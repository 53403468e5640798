"""The tokenizer comparison of docs/experiments.md (section 7), measured (dev/LOG.md, 2026-11-25):
in one scratch copy of the checkout on a preset (tiny by default), each variant's params are set and
`dvc repro eval@pretrain` runs (fetch, tokenizer, caches, pretrain, the base model's eval), one
variant after the other in the same process, so throughput is compared within one run. Finished
variants are kept in the `--out` JSON and skipped on a rerun. Variants share what their params
share: the lz78 tokenizer and caches are built once. Every variant trains the same model shape for
the same steps on the same batch size in tokens; what differs is what a token is. Bits per byte
compares tokenizers only on the same text: the preset's `eval.bpb_max_tokens` must cover each val
split whole (tiny's does), or a tokenizer with fewer bytes per token is scored on fewer documents.

Prints a markdown table (bits per byte on each eval source, with the bootstrap's 95% interval
from the eval records; bytes/token; training tok/s and its ratio to the first variant) and writes
the raw figures as JSON. Not a test.

    PYTHONPATH=lib:. .venv/bin/python bench/compare_tokenizers.py [--preset tiny] [--out /tmp/compare.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from _scratch_repo import BIN, git_commit_all, preset_copy, run_in  # noqa: E402

from lockstep.core.stats import bootstrap_ratio_interval  # noqa: E402

LN2 = math.log(2)  # nats per bit
# name -> params overrides (section -> key -> value)
VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "bpe flat": {},
    "bpe prefix_smooth": {"pretrain": {"objective": "prefix_smooth"}},
    "lz78 flat": {"tokenizer": {"kind": "lz78"}},
    "lz78 structured": {"tokenizer": {"kind": "lz78"}, "model": {"embedding": "structured"}},
    "lz78 tuple": {"tokenizer": {"kind": "lz78"}, "model": {"embedding": "tuple"}},
    "lz78 prefix_smooth": {"tokenizer": {"kind": "lz78"}, "pretrain": {"objective": "prefix_smooth"}},
}


def bpb_interval(path: Path) -> tuple[float, float, float, int]:
    """(bpb, low, high, documents) from an eval's per-document records."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    nats = [r["nats"] for r in rows]
    n_bytes = [r["bytes"] for r in rows]
    low, high = bootstrap_ratio_interval(nats, n_bytes)
    return sum(nats) / sum(n_bytes) / LN2, low / LN2, high / LN2, len(rows)


def run_variant(work: Path, base: dict[str, Any], overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    params = json.loads(json.dumps(base))
    for section, values in overrides.items():
        params[section].update(values)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run_in([str(BIN / "dvc"), "repro", "eval@pretrain"], work, 3600)
    data = work / "data"
    tok = json.loads((data / "metrics" / "tokenizer.json").read_text())
    info = json.loads((data / "runinfo" / "pretrain.json").read_text())
    pre = json.loads((data / "metrics" / "pretrain.json").read_text())
    bpb = {
        p.stem.removeprefix("bpb_"): bpb_interval(p) for p in sorted((data / "eval" / "pretrain").glob("bpb_*.jsonl"))
    }
    return {"bytes_per_token": tok["bytes_per_token"], "vocab_size": tok["vocab_size"], "bpb": bpb,
            "tok_per_s": info["tok_per_s"], "train_time_s": info["train_time_s"], "steps": pre.get("steps"),
            "val_bpb": pre["val_bpb"], "setup": info["setup"]}


def table(results: dict[str, dict[str, Any]]) -> str:
    first = next(iter(results.values()))
    sources = list(first["bpb"])
    head = ["variant", *(f"bpb {s}" for s in sources), "bytes/token shakespeare", "tok/s", "x first"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        cells = [name, *(f"{r['bpb'][s][0]:.3f} [{r['bpb'][s][1]:.3f}, {r['bpb'][s][2]:.3f}]" for s in sources),
                 f"{r['bytes_per_token'].get('shakespeare', float('nan')):.2f}", f"{r['tok_per_s']:,.0f}",
                 f"{r['tok_per_s'] / first['tok_per_s']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--only", nargs="*", help="variant names to run (default: all)")
    parser.add_argument("--out", type=Path, default=Path("compare_tokenizers.json"))
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a params override for every variant (YAML value), e.g. eval.bpb_max_tokens=131072")
    parser.add_argument("--work", type=Path, help="scratch copy to (re)use: a rerun after a failure finds the finished "
                                                  "stages up to date (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp) / "repo"
        if not (work / "params.yaml").is_file():
            work.mkdir(parents=True, exist_ok=True)
            preset_copy(work, args.preset)
            git_commit_all(work)
            (work / "base_params.yaml").write_text((work / "params.yaml").read_text())
        base = yaml.safe_load((work / "base_params.yaml").read_text())
        for item in args.set:
            key, _, value = item.partition("=")
            section, _, name = key.partition(".")
            base[section][name] = yaml.safe_load(value)
        results = json.loads(args.out.read_text()) if args.out.is_file() else {}
        for name, overrides in VARIANTS.items():
            if (args.only and name not in args.only) or name in results:
                continue
            print(f"== {name}", flush=True)
            results[name] = run_variant(work, base, overrides)
            print(json.dumps(results[name]), flush=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
