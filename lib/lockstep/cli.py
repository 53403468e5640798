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


if __name__ == "__main__":
    app()
