"""The `eval@<stage>` pipeline: load a checkpoint, run bits per byte on every val cache, CORE-style
tasks (base stages) and chat tasks (chat stages), write flat metrics and per-item predictions.
Paths and config come from the caller; the scoring itself lives in lockstep.train.bpb (the measure training
uses too) and evaluate.core and .chat."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lockstep.core.config import ConfigError, FieldError, check_range
from lockstep.core.io import atomic_dir, canonical_json, write_json_atomic
from lockstep.core.runinfo import write_runinfo
from lockstep.data.cache import CacheError, CacheTooSmallError, list_caches, open_pretrain_split
from lockstep.data.loaders import ShardedTokenLoader, open_sft_dataset
from lockstep.data.snapshot import SnapshotError, iter_records, open_bundle
from lockstep.evaluate import chat, core
from lockstep.evaluate.chat import CategoricalPrompt
from lockstep.evaluate.chatcore import BENCHMARKS, chatcore_of
from lockstep.evaluate.sandbox import SandboxLimits
from lockstep.infer.engine import Engine, decode_settings
from lockstep.model.checkpoint import CheckpointError, load_model
from lockstep.tokenizer import TokenizerFileError, load_tokenizer
from lockstep.train.bpb import BpbSums, measure_bpb
# The eval stage (stages/eval.py) imports from this module alone: with the work come its runtime
# section's class and the runtime's end.
from lockstep.core.runtime import RuntimeConfig, shutdown  # noqa: F401

if TYPE_CHECKING:
    from lockstep.core.runtime import Runtime

log = logging.getLogger("lockstep.eval")
STAGES = ("pretrain", "midtrain", "sft", "rl")
CORE_TASK_ROOTS = ("evalsets", "raw")  # eval.core_tasks prefixes: the --evalsets or the --raw folder
# Errors whose message says what to fix: the eval stage's entry point prints them as one line.
ERRORS = (ConfigError, CacheError, CheckpointError, SnapshotError, TokenizerFileError, FileNotFoundError)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """The `eval` params section."""

    bpb_max_tokens: int = 65536  # per val cache (all ranks together); the first tokens of the split
    bpb_batch_rows: int = 8  # rows per forward pass
    core_stages: tuple[str, ...] = ("pretrain", "midtrain")  # checkpoints that get CORE tasks
    # Where the CORE tasks come from: `evalsets:<folder>`, a folder in the DCLM bundle layout under
    # --evalsets (our own tasks), or `raw:<fetch name>`, a bundle snapshot under --raw (dclm_core).
    core_tasks: str = "evalsets:core"
    core_max_items: int = 0  # per task; 0 = all
    chat_stages: tuple[str, ...] = ("midtrain", "sft", "rl")  # checkpoints that get chat tasks
    chat_max_items: int = 0  # per chat task; 0 = all
    math_sources: tuple[str, ...] = ("synth_math",)  # problem snapshots under --raw (val split)
    conversation_sources: tuple[str, ...] = ("synth_chat",)  # tool-use conversations under --raw (val split)
    categorical_files: tuple[str, ...] = ("chat/arc_own.jsonl",)  # under --evalsets, answered with a letter
    # How lettered items (categorical_files, categorical chat_tasks) are worded: nanochat's prompt
    # with the dataset's own labels, or letter_first, the project's older one (chat.CategoricalPrompt).
    categorical_prompt: CategoricalPrompt = "nanochat"
    # Under --evalsets, the same format scored without letters: each choice as the whole reply
    # (chat.evaluate_reply_choice).
    reply_choice_files: tuple[str, ...] = ()
    code_files: tuple[str, ...] = ("chat/code_own.jsonl",)  # under --evalsets
    # ChatCORE benchmarks: {task: fetch name of its snapshot under --raw (val split)}, tasks from
    # evaluate.chatcore.BENCHMARKS. When set, `chatcore` is over these alone, with fixed baselines.
    chat_tasks: dict[str, str] = dataclasses.field(default_factory=dict)
    max_new_tokens: int = 96  # per generated reply
    generate_batch: int = 1  # chat replies decoded together (Engine.generate_greedy); 1 = one at a time, the reference
    sandbox_timeout_s: float = 5.0
    sandbox_memory_mb: int = 512

    def __post_init__(self) -> None:
        # FieldError names the field; build_config prefixes `eval.`, and the stage's entry prints
        # the one `error:` line.
        for name, why in (
            ("bpb_max_tokens", "val tokens scored per cache"),
            ("bpb_batch_rows", "rows per forward pass"),
            ("max_new_tokens", "tokens per generated reply"),
            ("generate_batch", "chat replies decoded together; 1 = one at a time, the reference"),
        ):
            check_range(name, getattr(self, name), ge=1, why=why)
        for name in ("core_max_items", "chat_max_items"):
            check_range(name, getattr(self, name), ge=0, why="items per task; 0 = all items")
        check_range("sandbox_timeout_s", self.sandbox_timeout_s, gt=0, le=3600, why="wall-clock seconds per code run")
        # Below 16 MiB of address space the interpreter itself does not start (measured: 8 fails,
        # 16 runs), and every code item would fail without saying why.
        check_range(
            "sandbox_memory_mb", self.sandbox_memory_mb, ge=16, le=10**6, why="MiB of address space per code run"
        )
        for name in ("core_stages", "chat_stages"):
            bad = [s for s in getattr(self, name) if s not in STAGES]
            if bad:
                raise FieldError(
                    name, list(getattr(self, name)), f"names unknown stage(s) {bad}; use some of {list(STAGES)}"
                )
        for name in ("math_sources", "conversation_sources"):
            for source in getattr(self, name):
                if not source or PurePosixPath(source).name != source or source in (".", ".."):
                    raise FieldError(
                        name,
                        list(getattr(self, name)),
                        f"must name raw snapshots (folders under --raw, e.g. synth_math); {source!r} is no folder name",
                    )
        kind, _, where = self.core_tasks.partition(":")
        if (
            kind not in CORE_TASK_ROOTS
            or not where
            or PurePosixPath(where).is_absolute()
            or ".." in PurePosixPath(where).parts
            or (kind == "raw" and PurePosixPath(where).name != where)
        ):
            raise FieldError(
                "core_tasks",
                self.core_tasks,
                "must be `evalsets:<folder under --evalsets>` (e.g. evalsets:core) "
                "or `raw:<fetch name>` (e.g. raw:dclm_core)",
            )
        bad_tasks = sorted(set(self.chat_tasks) - set(BENCHMARKS))
        if bad_tasks:
            raise FieldError("chat_tasks", dict(self.chat_tasks),
                             f"names unknown task(s) {bad_tasks}; use some of {list(BENCHMARKS)}, each mapped to "
                             "the fetch name of its snapshot (e.g. arc_easy: arc_easy)")
        own = {
            *self.math_sources,
            *self.conversation_sources,
            *(PurePosixPath(rel).stem for rel in (*self.categorical_files, *self.reply_choice_files, *self.code_files)),
        }
        if own & set(self.chat_tasks):
            raise FieldError(
                "chat_tasks",
                dict(self.chat_tasks),
                f"repeats {sorted(own & set(self.chat_tasks))}, also evaluated as an own set (math_sources, "
                "conversation_sources, categorical_files, reply_choice_files or code_files); list each task once",
            )
        for task, source in self.chat_tasks.items():
            if not source or PurePosixPath(source).name != source or source in (".", ".."):
                raise FieldError("chat_tasks", dict(self.chat_tasks),
                                 "must map each task to a raw snapshot (a folder under --raw); "
                                 f"{task}: {source!r} is no folder name")
        for name in ("categorical_files", "reply_choice_files", "code_files"):
            for rel in getattr(self, name):
                path = PurePosixPath(rel)
                if path.is_absolute() or ".." in path.parts or path.suffix != ".jsonl":
                    raise FieldError(name, list(getattr(self, name)),
                                     f"must list .jsonl files under the --evalsets folder, as relative paths without "
                                     f"'..' (e.g. chat/arc_own.jsonl); {rel!r} is not one")


@dataclasses.dataclass(frozen=True)
class EvalPaths:
    ckpt: Path
    cache: Path  # data/cache: pretrain/<source>/val and sft/<source>/val_* are evaluated
    tokenizer: Path
    raw: Path
    evalsets: Path
    out: Path  # metrics JSON: results, each accuracy with its item count `<metric>.n`
    predictions: Path  # folder of <task>.jsonl: per-item records (bpb_<cache>.jsonl: per document)
    runinfo: Path  # run facts JSON: device, dtype, world size, time


def core_tasks_source(cfg: EvalConfig, raw: Path, evalsets: Path) -> tuple[Path, str]:
    """The folder in the DCLM bundle layout that `eval.core_tasks` names, and what it is: "dclm"
    (a bundle snapshot whose zip was the published DCLM bundle), "bundle" (another bundle
    snapshot, e.g. the rehearsal's) or "own" (a folder of our own tasks under --evalsets). A
    bundle snapshot's files are checked against their sha256 here."""
    kind, _, where = cfg.core_tasks.partition(":")
    if kind == "evalsets":
        folder = evalsets / where
        if not (folder / "core.yaml").is_file():
            raise ConfigError(f"eval.core_tasks={cfg.core_tasks!r}: {folder} holds no core.yaml; name a folder under "
                              f"{evalsets} in the DCLM bundle layout, or `raw:<fetch name>` for a fetched bundle")
        return folder, "own"
    if not (raw / where).is_dir():
        raise ConfigError(f"eval.core_tasks={cfg.core_tasks!r} has no snapshot at {raw / where}: add fetch.{where} "
                          f"(source: dclm_core) to params.yaml and run `dvc repro fetch@{where}`, or use evalsets:core")
    folder, meta = open_bundle(raw / where)
    return folder, "dclm" if meta.get("identity") == "dclm" else "bundle"


def check_inputs(stage: str, cfg: EvalConfig, raw: Path, evalsets: Path) -> None:
    """Refuse, before any model loads, the CORE tasks (for a CORE stage) or a snapshot or eval set
    file that the `eval` section lists for this stage's chat tasks and that is not there, naming
    the key that lists it."""
    if stage in cfg.core_stages:
        core_tasks_source(cfg, raw, evalsets)
    if stage not in cfg.chat_stages:
        return
    for key in ("math_sources", "conversation_sources"):
        for source in getattr(cfg, key):
            if not (raw / source).is_dir():
                raise ConfigError(
                    f"eval.{key} lists {source!r}, which has no snapshot at {raw / source}: add it under "
                    f"`fetch:` in params.yaml and run `dvc repro fetch@{source}`, or drop it from eval.{key}"
                )
    for task, source in cfg.chat_tasks.items():
        if not (raw / source).is_dir():
            raise ConfigError(
                f"eval.chat_tasks.{task} names {source!r}, which has no snapshot at {raw / source}: add it "
                f"under `fetch:` in params.yaml and run `dvc repro fetch@{source}`, or drop {task} from eval.chat_tasks"
            )
    for key in ("categorical_files", "reply_choice_files", "code_files"):
        for rel in getattr(cfg, key):
            if not (evalsets / rel).is_file():
                raise ConfigError(
                    f"eval.{key} lists {rel!r}, which is not a file under {evalsets}: fix the name, drop it "
                    f"from eval.{key}, or regenerate the shipped sets with `lockstep dev evalsets --write`"
                )


class _Autocast:
    """Calls the model under the runtime's autocast (bf16 where chosen)."""

    def __init__(self, model: torch.nn.Module, autocast: Callable[[], Any]) -> None:
        self.model, self.autocast = model, autocast

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.autocast():
            return self.model(*args, **kwargs)


def _gather(records: list[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    if world_size > 1 and dist.is_initialized():
        parts: list[Any] = [None] * world_size
        dist.all_gather_object(parts, records)
        records = [r for p in parts for r in p]
    return sorted(records, key=lambda r: r.get("index", 0))


def _cap(items: list[Any], n: int) -> list[Any]:
    return items[:n] if n else items


def _pretrain_batches(val_dir: Path, *, rows: int, T: int, max_tokens: int, rt: Runtime,
                      tokenizer_sha256: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]] | None:
    """Sequential val batches, or None when the split is too small for one T-token row per rank.
    A damaged or mismatched cache raises its CacheError: it must fail the stage, not vanish from
    the metrics."""
    n_tokens = open_pretrain_split(val_dir, tokenizer_sha256=tokenizer_sha256).tokens  # checks every shard
    # As many rows as fit, up to `rows`: one step takes world_size*B*T tokens plus the last target.
    B = min(rows, max(n_tokens - 1, 0) // (rt.world_size * T))
    if B < 1:
        log.warning("%s holds %d tokens, fewer than the %d that one %d-token row per rank needs (%d rank(s)); "
                    "left out of bpb", val_dir, n_tokens, rt.world_size * T + 1, T, rt.world_size)
        return None
    loader = ShardedTokenLoader(val_dir, B=B, T=T, rank=rt.rank, world_size=rt.world_size, device=rt.device,
                                tokenizer_sha256=tokenizer_sha256, verify=False)  # hashed just above
    steps = max(1, min(loader.steps_per_epoch, max_tokens // loader.span_tokens))
    return (loader.next_batch() for _ in range(steps))


def _sft_batches(cache_dir: Path, *, rows: int, T: int, max_tokens: int, rt: Runtime, pad_id: int,
                 tokenizer_sha256: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]] | None:
    """The val examples as `SFTExampleDataset.in_order` reads them, or None when no val example is usable at T
    (an empty split, or every prompt longer than T). Damage raises, as for pretrain caches."""
    try:
        ds = open_sft_dataset(cache_dir, "val", T=T, device=rt.device, pad_id=pad_id, tokenizer_sha256=tokenizer_sha256)
    except CacheTooSmallError as e:
        log.warning("%s; left out of bpb", e)
        return None
    return ds.in_order(rows=rows, max_tokens=max_tokens, rank=rt.rank, world_size=rt.world_size)


def _record_bpb(metrics: dict[str, Any], predictions: dict[str, list[dict[str, Any]]], key: str, sums: BpbSums,
                cache_dir: Path, rt: Runtime) -> None:
    """The bits per byte under `key`, and its documents' (nats, bytes) as per-item records, the
    items a bootstrap interval resamples (numbered so that ranks interleave)."""
    if sums.bytes:
        metrics[key] = sums.bpb
        predictions[key.replace(".", "_")] = [{"index": i * rt.world_size + rt.rank, "nats": nats, "bytes": n_bytes}
                                              for i, (nats, n_bytes) in enumerate(sums.documents)]
    else:  # every target a special token: no text to measure, and the log says so
        log.warning("%s: the val targets scored hold no text bytes; %s left out", cache_dir, key)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"eval set {path} is missing; fix the eval params or the --evalsets folder")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def make_generate(engine: Any, *, stop_ids: set[int], max_new_tokens: int, context_tokens: int,
                  batch_rows: int = 1) -> chat.Generate:
    """Greedy replies from lockstep.infer.engine (calculator tool on), cut at the first stop token: one
    prompt at a time (`batch_rows` 1, the reference), or up to `batch_rows` prompts decoding
    together through `Engine.generate_greedy`: the same tokens in fp32; under bf16 another batch
    shape rounds differently and a near tie may go the other way (4 of 607 replies of the tiny
    preset's SFT checkpoint)."""

    def one_at_a_time(prompts: list[list[int]]) -> list[list[int]]:
        out = []
        for prompt in prompts:
            room = context_tokens - len(prompt)
            if room <= 0:
                out.append([])
                continue
            ids: list[int] = []
            steps = engine.generate(prompt, num_samples=1, max_tokens=min(max_new_tokens, room), temperature=0.0,
                                    top_k=None, seed=0, use_tools=True)
            for token_column, _mask in steps:
                token = int(token_column[0])
                if token in stop_ids:
                    break
                ids.append(token)
                if len(ids) >= max_new_tokens:
                    break
            close = getattr(steps, "close", None)
            if close is not None:
                close()
            out.append(ids)
        return out

    def batched(prompts: list[list[int]]) -> list[list[int]]:
        fits = [
            i for i, p in enumerate(prompts) if len(p) < context_tokens
        ]  # a prompt filling the context gets no reply
        replies = engine.generate_greedy(
            [prompts[i] for i in fits],
            batch_rows=batch_rows,
            use_tools=True,
            max_tokens=[min(max_new_tokens, context_tokens - len(prompts[i])) for i in fits],
        )
        out: list[list[int]] = [[] for _ in prompts]
        for i, ids in zip(fits, replies):
            cut = next((k for k, t in enumerate(ids) if t in stop_ids), len(ids))
            out[i] = ids[:cut]
        return out

    return one_at_a_time if batch_rows == 1 else batched


def run_chat_tasks(cfg: EvalConfig, fwd: Callable[[torch.Tensor], torch.Tensor], raw: Path, *, tokenizer: Any,
                   generate: chat.Generate, limits: SandboxLimits, device: torch.device, max_seq_len: int,
                   rt: Runtime) -> dict[str, tuple[chat.TaskResult, float]]:
    """The ChatCORE benchmarks `eval.chat_tasks` lists, each read from its snapshot's val split by
    its benchmark's reader and scored by its kind, with its answer check: categorical by the
    preferred answer letter, generative by a greedy reply, code by the sandbox.
    {task: (result, fixed baseline)}."""
    out: dict[str, tuple[chat.TaskResult, float]] = {}
    for task, source in cfg.chat_tasks.items():
        bench = BENCHMARKS[task]
        items = _cap(bench.read(iter_records(raw / source, "val")), cfg.chat_max_items)
        if bench.kind == "categorical":
            res = chat.evaluate_categorical(fwd, items, tokenizer=tokenizer, device=device, max_seq_len=max_seq_len,
                                            rank=rt.rank, world_size=rt.world_size, check=bench.check,
                                            prompt=cfg.categorical_prompt)
        elif bench.kind == "code":
            with rt.autocast():
                res = chat.evaluate_code(items, tokenizer=tokenizer, generate=generate, limits=limits,
                                         rank=rt.rank, world_size=rt.world_size, check=bench.check)
        else:
            with rt.autocast():
                res = chat.evaluate_generative(items, tokenizer=tokenizer, generate=generate,
                                               rank=rt.rank, world_size=rt.world_size, check=bench.check)
        out[task] = (res, bench.baseline)
    return out


def run_eval_stage(stage: str, cfg: EvalConfig, paths: EvalPaths, *, rt: Runtime) -> dict[str, Any]:
    """Evaluate the `stage` checkpoint; rank 0 writes the metrics JSON and the predictions folder.
    `rt` is a lockstep.core.runtime.Runtime. Nothing is drawn: every val split is read in order, replies
    are greedy, and CORE's few-shot draws follow the reference's fixed seeds, so every training
    seed is measured on the same items. Returns the metrics."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; evaluate one of {list(STAGES)}")
    t0 = time.monotonic()
    tokenizer = load_tokenizer(paths.tokenizer)
    model, meta = load_model(paths.ckpt, rt.device, tokenizer_sha256=tokenizer.sha256)
    model.use_kernels(rt.kernels)
    fwd = _Autocast(model, rt.autocast)
    T = model.config.sequence_len
    bos = tokenizer.get_bos_token_id()
    metrics: dict[str, Any] = {"step": int(meta["step"])}
    predictions: dict[str, list[dict[str, Any]]] = {}

    # Bits per byte on every val cache present.
    token_bytes = torch.from_numpy(tokenizer.token_bytes().astype("int64"))  # a copy: the array is read-only
    # list_caches skips the dot-named work folders an interrupted cache build leaves behind.
    for cache_dir in list_caches(paths.cache / "pretrain"):
        batches = _pretrain_batches(cache_dir / "val", rows=cfg.bpb_batch_rows, T=T, max_tokens=cfg.bpb_max_tokens,
                                    rt=rt, tokenizer_sha256=tokenizer.sha256)
        if batches is not None:
            sums = measure_bpb(model, batches, token_bytes, device=rt.device, autocast=rt.autocast, doc_start_id=bos)
            _record_bpb(metrics, predictions, f"bpb.{cache_dir.name}", sums, cache_dir, rt)
    for cache_dir in list_caches(paths.cache / "sft"):
        batches = _sft_batches(cache_dir, rows=cfg.bpb_batch_rows, T=T, max_tokens=cfg.bpb_max_tokens, rt=rt,
                               pad_id=bos, tokenizer_sha256=tokenizer.sha256)
        if batches is not None:
            sums = measure_bpb(model, batches, token_bytes, device=rt.device, autocast=rt.autocast, doc_start_id=bos)
            _record_bpb(metrics, predictions, f"bpb.sft_{cache_dir.name}", sums, cache_dir, rt)
    log.info("bpb done: %s", {k: round(v, 4) for k, v in metrics.items() if k.startswith("bpb.")})

    if stage in cfg.core_stages:
        centered_by_task = {}
        core_dir, core_source = core_tasks_source(cfg, paths.raw, paths.evalsets)
        for task in core.load_core_tasks(core_dir, max_items_per_task=cfg.core_max_items or None):
            recs: list[dict[str, Any]] = []

            def on_item(index: int, scored: core.Scored, ok: bool | None, skip: str | None,
                        _task: core.CoreTask = task, _recs: list = recs) -> None:
                rec = {"index": index, "input": _task.items[index], "correct": ok,
                       "scored_text": [tokenizer.decode(r[s:e]) for r, (s, e) in zip(scored.rows, scored.spans)]}
                if skip is not None:
                    rec["skipped"] = skip
                _recs.append(rec)

            res = core.evaluate_task(fwd, task, encode=tokenizer.encode, bos_id=bos, max_seq_len=T, device=rt.device,
                                     rank=rt.rank, world_size=rt.world_size, on_item=on_item)
            metrics[f"core.{task.label}.accuracy"] = res["accuracy"]
            metrics[f"core.{task.label}.accuracy.n"] = res["items"]
            metrics[f"core.{task.label}.centered"] = res["centered"]
            metrics[f"core.{task.label}.skipped"] = res["skipped"]
            centered_by_task[task.label] = res["centered"]
            predictions[f"core_{task.label}"] = recs
            log.info("core %s: accuracy %.4f centred %.4f (%d items, %d skipped)", task.label, res["accuracy"],
                     res["centered"], res["items"], res["skipped"])
            if not res["items"]:  # CORE is then null: a mean over fewer tasks is another metric
                log.warning("core %s: every item skipped (reasons in its predictions); core left null", task.label)
        metrics["core"] = core.core_score(centered_by_task)
        # What the `core` mean is over, for the report's name of it (lockstep.pipeline.report.core_label).
        metrics.update(core_source=core_source, core_tasks=len(centered_by_task),
                       core_items=sum(metrics[f"core.{label}.accuracy.n"] for label in centered_by_task))

    if stage in cfg.chat_stages:
        stop_ids = {tokenizer.encode_special("<|assistant_end|>"), bos}
        # On CUDA with runtime.kernels the replies decode through the static-cache, CUDA-graphed
        # path in bf16, its step compiled under runtime.compile; on the CPU through the reference
        # path, as before.
        engine = Engine(model, tokenizer, **decode_settings(rt.device, rt.dtype, rt.kernels, rt.compile))
        generate = make_generate(engine, stop_ids=stop_ids, max_new_tokens=cfg.max_new_tokens,
                                 context_tokens=T, batch_rows=cfg.generate_batch)
        per_task: dict[str, tuple[float, float]] = {}
        results: dict[str, tuple[chat.TaskResult, float]] = {}
        for src in cfg.math_sources:
            items = _cap(chat.problem_items(iter_records(paths.raw / src, "val")), cfg.chat_max_items)
            with rt.autocast():
                results[src] = (chat.evaluate_generative(items, tokenizer=tokenizer, generate=generate,
                                                         rank=rt.rank, world_size=rt.world_size), 0.0)
        for src in cfg.conversation_sources:
            items = _cap(
                chat.conversation_items(iter_records(paths.raw / src, "val"), require_tool=True), cfg.chat_max_items
            )
            with rt.autocast():
                results[src] = (chat.evaluate_generative(items, tokenizer=tokenizer, generate=generate,
                                                         rank=rt.rank, world_size=rt.world_size), 0.0)
        for rel in cfg.categorical_files:
            items = _cap(chat.categorical_items(_read_jsonl(paths.evalsets / rel)), cfg.chat_max_items)
            res = chat.evaluate_categorical(fwd, items, tokenizer=tokenizer, device=rt.device, max_seq_len=T,
                                            rank=rt.rank, world_size=rt.world_size, prompt=cfg.categorical_prompt)
            results[Path(rel).stem] = (res, chat.random_baseline_categorical(items))
        for rel in cfg.reply_choice_files:
            items = _cap(chat.categorical_items(_read_jsonl(paths.evalsets / rel)), cfg.chat_max_items)
            res = chat.evaluate_reply_choice(fwd, items, tokenizer=tokenizer, device=rt.device, max_seq_len=T,
                                             rank=rt.rank, world_size=rt.world_size)
            results[Path(rel).stem] = (res, chat.random_baseline_categorical(items))
        limits = SandboxLimits(timeout_s=cfg.sandbox_timeout_s, memory_bytes=cfg.sandbox_memory_mb << 20)
        for rel in cfg.code_files:
            items = _cap(chat.code_items(_read_jsonl(paths.evalsets / rel)), cfg.chat_max_items)
            with rt.autocast():
                res = chat.evaluate_code(items, tokenizer=tokenizer, generate=generate, limits=limits,
                                         rank=rt.rank, world_size=rt.world_size)
            results[Path(rel).stem] = (res, 0.0)
        benchmarks = run_chat_tasks(cfg, fwd, paths.raw, tokenizer=tokenizer, generate=generate, limits=limits,
                                    device=rt.device, max_seq_len=T, rt=rt)
        accuracy_by_task: dict[str, float] = {}
        for name, (res, baseline) in {**results, **benchmarks}.items():
            res.reduce(rt.device)
            if res.total == 0:
                log.warning("chat task %s has no items; left out", name)
                continue
            metrics[f"chat.{name}.accuracy"] = res.accuracy
            metrics[f"chat.{name}.accuracy.n"] = res.total
            if res.skipped:
                metrics[f"chat.{name}.skipped"] = res.skipped
            if name in benchmarks:
                accuracy_by_task[name] = res.accuracy
                metrics[f"chat.{name}.centered"] = (res.accuracy - baseline) / (1.0 - baseline)
            else:
                per_task[name] = (res.accuracy, baseline)
            predictions[f"chat_{name}"] = res.records
            log.info("chat %s: accuracy %.4f (%d items)", name, res.accuracy, res.total)
        # With benchmarks listed, ChatCORE is nanochat's: over them alone, with their fixed baselines.
        metrics["chatcore"] = chatcore_of(accuracy_by_task) if cfg.chat_tasks else chat.chatcore(per_task)

    runinfo = {"device": str(rt.device), "dtype": str(rt.dtype).removeprefix("torch."), "world_size": rt.world_size,
               "eval_time_s": time.monotonic() - t0}
    gathered = {name: _gather(recs, rt.world_size) for name, recs in sorted(predictions.items())}
    if rt.is_main:
        metrics = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}
        with atomic_dir(paths.predictions) as tmp:
            for name, recs in gathered.items():
                (tmp / f"{name}.jsonl").write_text("".join(canonical_json(r) for r in recs), encoding="utf-8")
        write_runinfo(paths.runinfo, runinfo, device=rt.device)
        write_json_atomic(paths.out, metrics)
    return metrics
