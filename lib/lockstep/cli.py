"""The `lockstep` command line: presets, data inspection, parity checks, chat and serving. Each
command imports its library module lazily, so `lockstep --help` stays fast."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="lockstep: reproducible chat-model training.")


@app.callback()
def main() -> None:
    """lockstep: train, compare and chat with small language models, reproducibly."""


@app.command()
def preset(
    name: str = typer.Argument(..., help="preset name: a file presets/NAME.yaml (tiny, smoke, d12, d20)"),
    presets_dir: Path = typer.Option(Path("presets"), help="folder of versioned preset files"),
    params_file: Path = typer.Option(Path("params.yaml"), help="params file to write"),
) -> None:
    """Switch every param at once: write params.yaml from presets/NAME.yaml."""
    from lockstep.presets import write_preset

    try:
        write_preset(name, presets_dir=presets_dir, params_file=params_file)
    except (FileNotFoundError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {params_file} from preset {name!r}; run `dvc repro`")


data_app = typer.Typer(no_args_is_help=True, help="Look inside token caches.")
app.add_typer(data_app, name="data")


@app.command()
def parity(
    run_a: str = typer.Argument(..., help="run A: a folder of artifacts, or a git/DVC experiment ref"),
    run_b: str = typer.Argument(..., help="run B: a folder of artifacts, or a git/DVC experiment ref"),
) -> None:
    """Compare two runs' parity artifacts and name the first difference (exit 1 when they differ)."""
    from lockstep.parity import compare_runs

    try:
        diffs = compare_runs(run_a, run_b)
    except (FileNotFoundError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if not diffs:
        typer.echo("no difference: every parity artifact agrees")
        return
    typer.echo(f"first difference: {diffs[0]}")
    for d in diffs[1:]:
        typer.echo(f"also: {d}")
    raise typer.Exit(1)


@data_app.command("inspect")
def data_inspect(
    path: Path = typer.Argument(..., help="a cache folder: data/cache/pretrain/NAME or data/cache/sft/NAME"),
    tokenizer: Path = typer.Option(None, help="tokenizer folder to decode with (e.g. data/tokenizer)"),
    split: str = typer.Option("train", help="train or val"),
    seed: int = typer.Option(0, help="seed of the random window / example"),
    tokens: int = typer.Option(64, help="window length in tokens (pretrain)"),
) -> None:
    """Stats of a cache and one decoded random window or example, supervised tokens in [[ ]]."""
    from lockstep.cache import CacheError
    from lockstep.loaders import inspect_cache

    try:
        tok = None
        if tokenizer is not None:
            from lockstep.tokenizer import load_tokenizer

            tok = load_tokenizer(tokenizer)
        typer.echo(inspect_cache(path, tokenizer=tok, split=split, seed=seed, window_tokens=tokens))
    except (CacheError, FileNotFoundError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


if __name__ == "__main__":
    app()
