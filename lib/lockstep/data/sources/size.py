"""What a fetch entry is expected to hold before it is fetched: `SourceSize`, and the rules the
sources share to state theirs (a published size, a benchmark's test split, a generated count,
a folder of text files). Each source module states its own through `size(cfg, *, name, root)`;
`lockstep plan` reads it there. Estimates only: no snapshot is read and nothing is fetched."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SourceSize:
    """A fetch entry's expected train/val size: characters for text, examples for conversations."""

    train_chars: float | None = None
    val_chars: float | None = None
    train_examples: float | None = None
    val_examples: float | None = None
    tokens_per_example: float | None = None
    basis: str = ""


def published_examples(source: str, *, examples: int, tokens_per_example: float, val_frac: float | None,
                       val_examples: int | None = None) -> SourceSize:
    """A conversation or problem source of a published size: `val_examples` held out when the
    source has a val split of its own, else `val_frac` of the examples."""
    vf = val_frac or 0.0
    return SourceSize(
        train_examples=examples * (1 - vf),
        val_examples=examples * vf if val_examples is None else val_examples,
        tokens_per_example=tokens_per_example,
        basis=f"{source}'s published size",
    )


def eval_split_examples(source: str, config: str, *, by_config: Mapping[str, int],
                        tokens_per_example: float) -> SourceSize | None:
    """An eval-only benchmark: its hub test split becomes val alone, sized by its config (None
    for a config whose size is not listed)."""
    n = by_config.get(config)
    if n is None:
        return None
    return SourceSize(train_examples=0, val_examples=n, tokens_per_example=tokens_per_example,
                      basis=f"{source} {config}'s published test size")


def generated_examples(name: str, *, n_train: int, n_val: int, tokens_per_example: float) -> SourceSize:
    """A generated source: as many examples as its params ask for."""
    return SourceSize(train_examples=n_train, val_examples=n_val, tokens_per_example=tokens_per_example,
                      basis=f"fetch.{name}.n_train")


def text_files(folder: Path, suffixes: tuple[str, ...], *, val_frac: float) -> SourceSize | None:
    """A file or folder of text: its bytes (files with one of `suffixes`), split by `val_frac`;
    None when it is not there."""
    if not folder.exists():
        return None
    files = [folder] if folder.is_file() else [p for p in folder.rglob("*") if p.suffix in suffixes]
    chars = sum(p.stat().st_size for p in files)
    return SourceSize(train_chars=chars * (1 - val_frac), val_chars=chars * val_frac, basis=f"the size of {folder}")
