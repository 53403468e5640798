"""The `lockstep` command line: presets, the cost plan of a params file, data inspection, parity
checks, seed-sweep summaries of DVC experiments, chat, serving, export and the dev tools. Each command
imports the library modules it needs when it runs: together they bring torch, dvc, FastAPI and
uvicorn, about 4 s of imports against 0.3 s for `lockstep --help` (measured on a 2-core CPU),
which help, completion and the light commands should not pay."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path

import typer

from lockstep.core.openmp import choose_wait_policy

choose_wait_policy()  # before any command imports torch (lockstep.core.openmp)

# `chat` and `serve` share their --kernels option (runtime.kernels of the stages that decode).
DECODE_KERNELS_HELP = ("run the model and its decoding on their fast paths (runtime.kernels: on the CPU "
                       "lockstep.model.kernels and lockstep.infer.cpu_step, same results to rounding); "
                       "--no-kernels for the reference")

app = typer.Typer(no_args_is_help=True, add_completion=False, help="lockstep: reproducible chat-model training.")


@app.callback()
def main() -> None:
    """lockstep: train, compare and chat with small language models, reproducibly."""


@app.command()
def preset(
    name: str = typer.Argument(..., help="preset name: a file presets/NAME.yaml (tiny, smoke, d12, d20, rehearsal)"),
    presets_dir: Path = typer.Option(Path("presets"), help="folder of versioned preset files"),
    params_file: Path = typer.Option(Path("params.yaml"), help="params file to write"),
) -> None:
    """Switch every param at once: write params.yaml from presets/NAME.yaml."""
    from lockstep.tools.presets import write_preset

    try:
        write_preset(name, presets_dir=presets_dir, params_file=params_file)
    except (FileNotFoundError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {params_file} from preset {name!r}; run `dvc repro`")


@app.command()
def plan(
    preset_name: str = typer.Option(None, "--preset", help="plan presets/NAME.yaml instead of the params file"),
    params_file: Path = typer.Option(Path("params.yaml"), "--params", help="params file to plan"),
    presets_dir: Path = typer.Option(Path("presets"), help="folder of versioned preset files"),
    gpus: int = typer.Option(1, "--gpus", min=1, help="devices training runs on (ranks scale linearly)"),
    device: str = typer.Option(None, "--device", help="h100, h200, a100 or cpu (default: cpu without CUDA, else h100)"),
    mfu: float = typer.Option(None, "--mfu", min=0.001, max=1.0, help="assumed model FLOPs utilisation"),
    peak_tflops: float = typer.Option(None, "--peak-tflops", min=0.0, help="per-device peak, overriding the table"),
    kernels: bool = typer.Option(
        None,
        "--kernels/--no-kernels",
        help="plan the fast paths (runtime.kernels): the "
        "chunked loss head's memory, the fast engine's decode rate; default: the params' value",
    ),
    calibrate: bool = typer.Option(
        False,
        "--calibrate",
        help="time a few training steps of the pretrain shape on "
        "this machine, compiled as the stage compiles them, for the throughput and the "
        "step's peak memory (a few seconds on CPU for tiny)",
    ),
    calibrate_steps: int = typer.Option(
        3,
        "--calibrate-steps",
        min=1,
        help="timed steps, after the untimed warm-up (the first step and any later one that compiles)",
    ),
    cache: Path = typer.Option(Path("data/cache"), help="where built caches are read from when they exist"),
    raw: Path = typer.Option(Path("data/raw"), help="where raw snapshots are measured when they exist"),
    as_json: bool = typer.Option(False, "--json", help="JSON, for scripts"),
) -> None:
    """What the params will cost, without training or data: parameters, FLOPs per token, tokens
    and wall time per stage, epochs per data source, disk and memory per device. Figures over
    a limit are flagged (!!)."""
    import dataclasses
    import json

    import torch
    import yaml

    from lockstep.core.config import ConfigError, build_config
    from lockstep.core.runtime import RuntimeConfig
    from lockstep.tools.plan import FLAG, calibrate_training, make_plan, render_text
    from lockstep.train.trainer import ModelParams, TrainConfig

    source = presets_dir / f"{preset_name}.yaml" if preset_name else params_file
    try:
        params = yaml.safe_load(source.read_text(encoding="utf-8"))
        if not isinstance(params, dict):
            raise ConfigError(f"{source} must hold a mapping of params sections")
        device = device or ("h100" if torch.cuda.is_available() else "cpu")
        calibration = None
        if calibrate:
            if device != "cpu" and not torch.cuda.is_available():
                raise ConfigError(f"--calibrate times this machine, which has no CUDA device; use --device cpu, "
                                  f"or drop --calibrate to plan for {device}")
            pre = build_config(TrainConfig, params.get("pretrain") or {}, where="pretrain")
            gcfg = build_config(ModelParams, params.get("model") or {}, where="model").gpt_config(
                params["tokenizer"]["vocab_size"])
            rt_cfg = build_config(RuntimeConfig, params.get("runtime") or {}, where="runtime")
            if kernels is not None:  # time the paths the plan is asked for
                rt_cfg = dataclasses.replace(rt_cfg, kernels=kernels)
            calibration = calibrate_training(gcfg, pre, runtime=rt_cfg, steps=calibrate_steps, configure_process=True)
        result = make_plan(params, device=device, gpus=gpus, mfu=mfu, peak_tflops=peak_tflops, calibration=calibration,
                           cache_root=cache, raw_root=raw, root=Path.cwd(), kernels=kernels)
    except (OSError, ValueError, KeyError, yaml.YAMLError) as e:
        typer.echo(f"error: {source}: {e}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(result, indent=2, allow_nan=False))
        return
    for line in render_text(result).splitlines():
        typer.echo(typer.style(line, fg="red") if FLAG in line else line)


data_app = typer.Typer(no_args_is_help=True, help="Look inside token caches.")
app.add_typer(data_app, name="data")


dev_app = typer.Typer(no_args_is_help=True, help="Tools for working on lockstep itself.")
app.add_typer(dev_app, name="dev")


def _check_or_write(*, write: bool, regenerate: Callable[[], str], check: Callable[[], list[str]],
                    errors: tuple[type[Exception], ...], ok: str, fix: str) -> None:
    """The shape every `lockstep dev` checker shares: with --write, regenerate and print what
    changed; otherwise print each difference and the command that fixes it (exit 1), or `ok`.
    An error of `errors` is one `error:` line (exit 2)."""
    try:
        if write:
            typer.echo(regenerate())
            return
        found = check()
    except errors as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if not found:
        typer.echo(ok)
        return
    for line in found:
        typer.echo(line)
    typer.echo(f"fix: {fix}", err=True)
    raise typer.Exit(1)


@dev_app.command("deps")
def dev_deps(
    dvc_yaml: Path = typer.Option(Path("dvc.yaml"), "--dvc-yaml", help="the DAG file whose code deps to check"),
    write: bool = typer.Option(False, "--write", help="rewrite each stage's code deps from its imports"),
) -> None:
    """Check that every stage's code deps in dvc.yaml are exactly the files it imports (exit 1 if
    not); with --write, regenerate them."""
    from lockstep.core.codeid import CodeScanError
    from lockstep.dev.dvcdeps import DepsError, problems, rewrite

    def regenerate() -> str:
        text = rewrite(dvc_yaml)
        changed = text != dvc_yaml.read_text(encoding="utf-8")
        if changed:
            dvc_yaml.write_text(text, encoding="utf-8")
        return f"{'rewrote' if changed else 'already right:'} the code deps in {dvc_yaml}"

    _check_or_write(write=write, regenerate=regenerate, check=lambda: problems(dvc_yaml),
                    errors=(DepsError, CodeScanError, FileNotFoundError, SyntaxError),
                    ok=f"{dvc_yaml}: every stage lists exactly the code it imports",
                    fix=f"lockstep dev deps --write --dvc-yaml {dvc_yaml}")


exp_app = typer.Typer(no_args_is_help=True, help="Summaries of DVC experiments.")
app.add_typer(exp_app, name="exp")


@exp_app.command("summary")
def exp_summary(
    names: list[str] = typer.Argument(None, help="experiments or revs to summarise, the first one's configuration "
                                      "compared with the rest (default: the baseline and all its experiments)"),
    from_file: Path = typer.Option(None, "--from", help="read saved `dvc exp show --json` output instead"),
    metric: list[str] = typer.Option([], "--metric", help="only metrics matching this glob, e.g. "
                                     "'eval_sft.chat.*' (repeatable)"),
    markdown: bool = typer.Option(False, "--markdown", help="a markdown table, for docs"),
    as_json: bool = typer.Option(False, "--json", help="JSON, for scripts"),
    seed_key: str = typer.Option("seed", "--seed-key", help="the param that tells seed runs apart "
                                 "(left out of the grouping)"),
) -> None:
    """Seed-sweep summary: each metric as mean ± std (n runs) per configuration, runs grouped by
    their params with the seed left out; further configurations show their difference to the first,
    marked ~ when it is within seed-to-seed spread."""
    import json
    import shutil

    from lockstep.tools.exp_summary import (ExpSummaryError, load_exp_show, render_markdown, render_text,
                                            run_exp_show, summarize, summary_json)

    if markdown and as_json:
        typer.echo("error: --markdown and --json exclude each other; pick one", err=True)
        raise typer.Exit(2)
    try:
        if from_file is not None:
            exp_show, source = load_exp_show(from_file), str(from_file)
        else:
            exp_show, source = run_exp_show(Path.cwd()), "`dvc exp show`"
        summary = summarize(exp_show, names or (), metric, seed_key=seed_key, source=source)
    except ExpSummaryError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(summary_json(summary), indent=2, allow_nan=False))
    elif markdown:
        typer.echo(render_markdown(summary), nl=False)
    else:
        typer.echo(render_text(summary, width=shutil.get_terminal_size((100, 24)).columns), nl=False)


@dev_app.command("evalsets")
def dev_evalsets(
    evalsets: Path = typer.Option(
        Path("evalsets"), "--evalsets", help="the eval sets folder whose generated files to check"
    ),
    write: bool = typer.Option(False, "--write", help="regenerate the files from lockstep.dev.evalsets_build"),
) -> None:
    """Check that the generated eval set files are exactly the generator's output (exit 1 if not);
    with --write, regenerate them."""
    from lockstep.dev.evalsets_build import EvalsetBuildError, drifted, write_evalsets

    if not evalsets.is_dir():
        typer.echo(f"error: {evalsets} is not a folder; pass the eval sets folder with --evalsets", err=True)
        raise typer.Exit(2)

    def regenerate() -> str:
        changed = write_evalsets(evalsets)
        return (
            f"rewrote {', '.join(changed)} under {evalsets}"
            if changed
            else f"already right: the generated files under {evalsets}"
        )

    _check_or_write(
        write=write,
        regenerate=regenerate,
        check=lambda: [f"{evalsets / rel}: differs from the generator's output" for rel in drifted(evalsets)],
        errors=(EvalsetBuildError, OSError),
        ok=f"{evalsets}: every generated eval set file is the generator's output",
        fix=f"lockstep dev evalsets --write --evalsets {evalsets}",
    )


@dev_app.command("own-eval")
def dev_own_eval(
    task: str = typer.Argument(
        ...,
        help="a task label listed by a core.yaml in a folder under --evalsets, or a "
        "categorical file's stem under chat/ (arc_own)",
    ),
    ckpt: Path = typer.Option(..., "--ckpt", help="checkpoint folder, e.g. data/ckpt/pretrain"),
    tokenizer: Path = typer.Option(
        Path("data/tokenizer"), "--tokenizer", help="the tokenizer the checkpoint was trained with"
    ),
    evalsets: Path = typer.Option(Path("evalsets"), "--evalsets", help="the eval sets folder"),
    items: bool = typer.Option(False, "--items", help="also print one line per item"),
    max_items: int = typer.Option(0, "--max-items", min=0, help="the first N items of the task's order; 0 = all"),
    control_seed: int = typer.Option(0, "--control-seed", help="init seed of the untrained control model"),
    as_json: bool = typer.Option(False, "--json", help="the summary as JSON, for scripts"),
    threads: int = typer.Option(1, "--threads", min=0, help="torch CPU threads; 0 = torch's default"),
) -> None:
    """Per-item analysis of an own eval task for a checkpoint and, as the control, an untrained
    model of its config: accuracy under each scoring rule (with 95% intervals), choices by
    position, option token lengths."""
    import json

    import torch

    from lockstep.dev.own_eval_analysis import OwnEvalError, analyse_checkpoint, render
    from lockstep.model.checkpoint import CheckpointError
    from lockstep.tokenizer import TokenizerFileError

    if threads:
        # One forward pass per item is small: on a shared 2-core CPU, 1 thread ran bard_choice
        # (252 items, two models) in ~15 s and torch's default in over 5 minutes.
        torch.set_num_threads(threads)
    try:
        analysis = analyse_checkpoint(task, ckpt, tokenizer, evalsets=evalsets, control_seed=control_seed,
                                      max_items=max_items or None)
    except (OwnEvalError, CheckpointError, TokenizerFileError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(analysis.to_json(), indent=1) if as_json else render(analysis, per_item=items), nl=as_json)


@dev_app.command("hub-samples")
def dev_hub_samples(
    root: Path = typer.Option(Path("corpus/hub"), "--root", help="the folder of hub-layout samples to check"),
    write: bool = typer.Option(False, "--write", help="regenerate the files from lockstep.dev.hub_samples"),
) -> None:
    """Check that the hub-layout sample files (the rehearsal's data) hold exactly the generator's
    rows (exit 1 if not); with --write, regenerate them."""
    from lockstep.dev.hub_samples import HubSampleError, drifted, write_samples

    def regenerate() -> str:
        changed = write_samples(root)
        return f"rewrote {', '.join(changed)} under {root}" if changed else f"already right: the samples under {root}"

    _check_or_write(write=write, regenerate=regenerate,
                    check=lambda: [f"{root / rel}: differs from the generator's output (or is not one of its files)"
                                   for rel in drifted(root)],
                    errors=(HubSampleError, OSError), ok=f"{root}: every sample file holds the generator's rows",
                    fix=f"lockstep dev hub-samples --write --root {root}")


@dev_app.command("rehearsal")
def dev_rehearsal(
    presets_dir: Path = typer.Option(
        Path("presets"), "--presets-dir", help="folder holding d12.yaml and rehearsal.yaml"
    ),
    write: bool = typer.Option(
        False, "--write", help="regenerate rehearsal.yaml from d12.yaml and lockstep.dev.rehearsal"
    ),
) -> None:
    """Check that presets/rehearsal.yaml is d12.yaml with the rehearsal's sample paths and sizes
    (exit 1 if not); with --write, regenerate it."""
    from lockstep.dev.rehearsal import RehearsalError, is_stale, write_rehearsal

    target = presets_dir / "rehearsal.yaml"
    _check_or_write(
        write=write,
        regenerate=lambda: f"rewrote {target}" if write_rehearsal(presets_dir) else f"already right: {target}",
        check=lambda: (
            [f"{target}: differs from what {presets_dir / 'd12.yaml'} and lockstep.dev.rehearsal give"]
            if is_stale(presets_dir)
            else []
        ),
        errors=(RehearsalError, OSError),
        ok=f"{target}: generated from {presets_dir / 'd12.yaml'} as it is now",
        fix=f"lockstep dev rehearsal --write --presets-dir {presets_dir}",
    )


@app.command()
def parity(
    run_a: str = typer.Argument(..., help="run A: a folder of artifacts, or a git/DVC experiment ref"),
    run_b: str = typer.Argument(..., help="run B: a folder of artifacts, or a git/DVC experiment ref"),
) -> None:
    """Compare two runs' parity artifacts, then the metrics of each stage with run facts, and name
    the first difference; for differing metrics, say which facts that decide the numerics (CPU
    path, torch build, threads, device) differ (exit 1 when anything differs)."""
    from lockstep.tools.parity_diff import compare_runs

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
    from lockstep.data.cache import CacheError
    from lockstep.data.loaders import inspect_cache

    try:
        tok = None
        if tokenizer is not None:
            from lockstep.tokenizer import load_tokenizer

            tok = load_tokenizer(tokenizer)
        typer.echo(inspect_cache(path, tokenizer=tok, split=split, seed=seed, window_tokens=tokens))
    except (CacheError, FileNotFoundError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@app.command()
def chat(
    ckpt: Path = typer.Option(..., "--ckpt", help="checkpoint directory, e.g. data/ckpt/sft"),
    tokenizer: Path = typer.Option(
        Path("data/tokenizer"), "--tokenizer", help="the tokenizer the checkpoint was trained with"
    ),
    prompt: str | None = typer.Option(None, "-p", "--prompt", help="answer this one prompt and exit"),
    # Ranges are checked by lockstep.infer.chat.person_settings (one `error:` line naming the option),
    # the same table the /commands use.
    temperature: float = typer.Option(0.6, help="sampling temperature, 0 to 2; 0 (and below 1e-4) is greedy"),
    top_k: int = typer.Option(50, "--top-k", help="sample from the K most likely tokens, 0 to 200; 0 = all"),
    top_p: float = typer.Option(
        1.0, "--top-p", help="sample from the fewest likely tokens whose probability reaches P, 0 < P <= 1; 1 = all"
    ),
    max_tokens: int = typer.Option(256, "--max-tokens", help="new tokens per reply at most"),
    seed: int = typer.Option(0, help="seed of the first reply; each later reply adds its turn number"),
    device: str = typer.Option("cpu", help="torch device to run on: cpu, cuda, cuda:1, mps"),
    kernels: bool = typer.Option(True, help=DECODE_KERNELS_HELP),
) -> None:
    """Chat with a checkpoint in the terminal, replies streamed as they are sampled."""
    from lockstep.infer.chat import ChatError, load_backend, person_settings, run_chat

    try:
        settings = person_settings(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens, seed=seed)
        backend = load_backend(ckpt, tokenizer, device=device, kernels=kernels)
    except (FileNotFoundError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None

    def typed_lines():
        while True:
            try:
                yield input("you> ")
            except EOFError:
                return

    try:
        # A one-shot reply alone on stdout; its notes (turns left out, a cut reply) on stderr.
        run_chat(backend, settings, lines=typed_lines(), out=sys.stdout, prompt=prompt,
                 notes=sys.stderr if prompt is not None else None)
    except ChatError as e:  # the one-shot prompt's; the interactive loop reports its own and goes on
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


EXPORT_FORMATS = ("hf",)


@app.command()
def export(
    to: str = typer.Option(..., "--to", help="the format: hf, a Hugging Face model folder (transformers)"),
    ckpt: Path = typer.Option(..., "--ckpt", help="checkpoint directory, e.g. data/ckpt/sft"),
    tokenizer: Path = typer.Option(
        Path("data/tokenizer"), "--tokenizer", help="the tokenizer the checkpoint was trained with"
    ),
    out: Path = typer.Option(..., "--out", help="the folder to write (new, empty, or an earlier export)"),
) -> None:
    """Write a checkpoint and its tokenizer in another format: `--to hf` for transformers and the Hub."""
    if to not in EXPORT_FORMATS:
        typer.echo(f"error: --to {to}: the formats lockstep exports to are: {', '.join(EXPORT_FORMATS)}", err=True)
        raise typer.Exit(2)
    from lockstep.tools.export_hf import export_hf

    try:
        export_hf(ckpt, tokenizer, out)
    except (OSError, ValueError) as e:  # ExportError, CheckpointError, TokenizerFileError; a folder it cannot write
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {out}: load it with transformers' "
               f"AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")


@app.command()
def serve(
    ckpt: Path = typer.Option(..., "--ckpt", help="checkpoint directory, e.g. data/ckpt/sft"),
    tokenizer: Path = typer.Option(
        Path("data/tokenizer"), "--tokenizer", help="the tokenizer the checkpoint was trained with"
    ),
    host: str = typer.Option("127.0.0.1", help="address to bind; the default is reachable from this machine only"),
    port: int = typer.Option(8000, help="TCP port to listen on, 0 to 65535 (0 = any free port)"),
    workers: int = typer.Option(1, help="replies generated at once, 1 or more"),
    max_queued: int = typer.Option(4, "--max-queued", help="requests waiting for a worker before 503, 0 or more"),
    allow_origin: list[str] = typer.Option(
        [], "--allow-origin", help="a web origin allowed to call the API (repeatable)"
    ),
    header_timeout_s: float = typer.Option(
        10.0,
        "--header-timeout-s",
        help="seconds a client has to send a request's "
        "headers, from connecting or from its previous reply; later, 408 and closed",
    ),
    body_timeout_s: float = typer.Option(
        15.0,
        "--body-timeout-s",
        help="seconds a client has to send a request's "
        "body after its headers; later, 408 and closed. Replies are not timed",
    ),
    max_connections: int = typer.Option(
        0,
        "--max-connections",
        help="open connections at most; 0 = 1000, fewer if "
        "the open-file limit needs. At the cap a new connection replaces the one "
        "waiting longest for a request, or gets 503 when all are busy",
    ),
    device: str = typer.Option("cpu", help="torch device to run on: cpu, cuda, cuda:1, mps"),
    kernels: bool = typer.Option(True, help=DECODE_KERNELS_HELP),
) -> None:
    """Serve the chat UI and an OpenAI-compatible API (/v1/chat/completions) for a checkpoint."""
    from lockstep.core.config import FieldError, build_config
    from lockstep.infer import serving
    from lockstep.infer.chat import load_backend
    from lockstep.infer.server import ServerConfig, create_app

    # The options that set a ServerConfig or ServingLimits field, to name them in its errors.
    options = {"workers": "--workers", "max_queued": "--max-queued", "allowed_origins": "--allow-origin",
               "header_timeout_s": "--header-timeout-s", "body_timeout_s": "--body-timeout-s",
               "max_connections": "--max-connections"}
    if not 0 <= port <= 65535:
        typer.echo(f"error: --port={port} must be from 0 to 65535 (0 = any free port)", err=True)
        raise typer.Exit(2)
    try:
        # Checked before the model loads: a bad option fails in a second, not after the weights.
        config = build_config(ServerConfig, {"workers": workers, "max_queued": max_queued,
                                             "allowed_origins": list(allow_origin)})
        limits = build_config(serving.ServingLimits, {"header_timeout_s": header_timeout_s,
                                                      "body_timeout_s": body_timeout_s,
                                                      "max_connections": max_connections})
        plan = serving.plan_for_this_process(limits)  # raises the open-file limit where allowed
    except FieldError as e:
        typer.echo(f"error: {options.get(e.key, e.key)}={e.value!r} {e.requirement}", err=True)
        raise typer.Exit(2) from None
    try:
        backend = load_backend(ckpt, tokenizer, device=device, kernels=kernels)
    except (FileNotFoundError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo(
            f"warning: binding {host}: the API has no authentication; anyone who can reach it can use it", err=True
        )
    # Request lines from lockstep.infer.server (sizes and timings, never message text) next to uvicorn's.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s %(message)s")
    typer.echo(f"serving {backend.model_id} on http://{host}:{port}/")
    serving.run_server(create_app(backend, config), limits, plan, host=host, port=port)


if __name__ == "__main__":
    app()
