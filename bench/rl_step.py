"""What the RL benchmarks (bench_rollout_prefill, bench_policy_loss) run on: the tiny preset's
step, 16 problems of the multistep family, from an SFT checkpoint on the CPU. Not a benchmark."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from lockstep.model import checkpoint as ckpt
from lockstep.model.gpt import GPT
from lockstep.tokenizer import load_tokenizer
from lockstep.tokenizer.base import Tokenizer

PROBLEMS_PER_STEP = 16
GROUP_SIZE = 8
MAX_NEW_TOKENS = 192


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--ckpt", default="data/ckpt/sft")
    ap.add_argument("--tokenizer", default="data/tokenizer")
    ap.add_argument("--problems", default="data/raw/synth_multistep/train")
    ap.add_argument("--repeats", type=int, default=3)


def load(args: argparse.Namespace) -> tuple[Tokenizer, GPT, list[dict[str, Any]]]:
    """The tokenizer, the checkpoint's model (eval mode) and a step's problems."""
    tok = load_tokenizer(args.tokenizer)
    model, _ = ckpt.load_model(args.ckpt, torch.device("cpu"), tokenizer_sha256=tok.sha256)
    model.eval()
    problems = pq.read_table(sorted(Path(args.problems).glob("*.parquet"))[0]).to_pylist()[:PROBLEMS_PER_STEP]
    return tok, model, problems
