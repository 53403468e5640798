"""GPU benchmark of lockstep against the nanochat baseline, on one CUDA device (or on this CPU at
tiny sizes, to rehearse the script). Not a test. Each measuring subcommand prints one line
`RESULT {json}`; `compare` reads such lines back and prints ratios computed from them alone:
lockstep / nanochat (tok/s, peak memory, MFU) and fast / reference within lockstep.

  env                      torch, CUDA, the device, its datasheet bf16 peak and the measured bf16
                           matmul rate (8192^3 on CUDA, 512^3 on CPU)
  ls_train                 lockstep's Trainer, random token windows: `--kernels off` is the
                           reference path, `--kernels on` the fast paths (GPT.use_kernels(True)
                           and Runtime(kernels=True)); tok/s from the median of the Trainer's step times (as for nanochat), the
                           compile/warm-up step left out; peak memory torch.cuda.max_memory_allocated
  nc_train                 nanochat's GPT + MuonAdamW, the step of its base_train (compiled model,
                           backward, optimizer step), same shapes and the same MFU peak
  ls_decode / nc_decode    KV-cache engine, random weights, batch 1 and 8, sampling (T=1, top-k 50);
                           lockstep in bf16 weights, its reference engine and, where the Engine
                           takes one, its fast path
  stages                   lockstep's training stages, eval and RL on a smoke workspace (--smoke)
  compare FILE             ratios from a results.jsonl (or a log holding RESULT lines)

The baseline is optional: NANOCHAT_ROOT names a nanochat checkout at commit 92d63d4 (the folder
holding nanochat/gpt.py); nc_* refuse with a message without it. It is measured, never imported
by lockstep. Sizes default to the GPU check's (d12, 32 rows of 2048, vocab 65536); on CPU the
sequence defaults to 128. A CPU rehearsal:

    python bench/bench_gpu.py ls_train --depth 2 --rows 2 --steps 3 --compile off --kernels on
    bash bench/gpu_check.sh   # the whole check, see its header
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "lib") not in sys.path:
    sys.path.insert(0, str(ROOT / "lib"))  # run as a script from any folder

NANOCHAT_COMMIT = "92d63d4"
PROMPT = list(range(100, 116))  # 16 prompt ids, below any special id
DECODE_BATCHES = (1, 8)


# ---------------------------------------------------------------- shared
def result(phase: str, **fields: Any) -> None:
    """Print the phase's one RESULT line: its fields plus the software and the device."""
    import torch

    out: dict[str, Any] = {"phase": phase, **fields, "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        out["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 1e9, 2)
    else:
        out["gpu"] = None
        # Linux reports ru_maxrss in KiB: the whole process's high-water mark, not a tensor count
        out["host_peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)
    print("RESULT " + json.dumps(out), flush=True)


def device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def default_seq(a: argparse.Namespace) -> int:
    return a.seq or (2048 if device().type == "cuda" else 128)


def mfu_peak(dtype, declared_tflops: float) -> tuple[float, str]:
    """The FLOP/s MFU is quoted against, as lockstep's Trainer picks it (lockstep.runtime.peak_flops):
    --peak-tflops, else the datasheet bf16 peak of a known GPU, else a short matmul measurement."""
    from lockstep.runtime import Runtime, peak_flops

    rt = Runtime(device=device(), dtype=dtype, reason="bench")
    return peak_flops(rt, declared=declared_tflops * 1e12)


def compute_dtype(a: argparse.Namespace):
    """The compute dtype as a stage's `runtime.dtype` picks it (lockstep.runtime.choose_device_dtype):
    `auto` is bf16 autocast on CUDA sm80+ (the d12/d20 presets) and on CPUs with native bf16."""
    from lockstep.runtime import choose_device_dtype

    _, dtype, why = choose_device_dtype(device().type, a.dtype)
    return dtype, why


def cmd_env(a: argparse.Namespace) -> None:
    import torch

    from lockstep.runtime import declared_peak_flops

    d = device()
    n = 8192 if d.type == "cuda" else 512
    # Random operands: a GPU multiplies constant matrices faster than random ones (fewer bits
    # toggle, less power drawn), and training multiplies random-looking ones.
    g = torch.Generator(device=d).manual_seed(0)
    x = torch.randn(n, n, device=d, dtype=torch.bfloat16, generator=g)
    y = torch.randn(n, n, device=d, dtype=torch.bfloat16, generator=g)
    for _ in range(3):
        x @ y
    rates, reps = [], 10 if d.type == "cuda" else 2
    for _ in range(5):
        synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            x @ y
        synchronize()
        rates.append(2 * n**3 * reps / (time.perf_counter() - t0))
    rate = statistics.median(rates)
    declared = declared_peak_flops(d)
    result("env", device=str(d), capability=list(torch.cuda.get_device_capability(d)) if d.type == "cuda" else None,
           matmul_n=n, bf16_matmul_tflops=round(rate / 1e12, 3),
           declared_bf16_tflops=None if declared is None else round(declared / 1e12, 1),
           cpu_threads=torch.get_num_threads())


# ---------------------------------------------------------------- lockstep training
class RandomWindows:
    """Random windows of a fixed random token tensor on the host: what a cache reader hands the
    Trainer, without a cache."""

    def __init__(self, n_tokens: int, vocab: int, seq: int, seed: int = 0) -> None:
        import torch

        self.tokens = torch.randint(0, vocab, (n_tokens,), generator=torch.Generator().manual_seed(seed))
        self.T = seq

    def get_batch(self, *, B: int, generator):
        import torch

        starts = torch.randint(0, self.tokens.numel() - self.T - 1, (B,), generator=generator)
        rows = self.tokens[starts[:, None] + torch.arange(self.T + 1)]  # (B, T+1)
        return rows[:, :-1], rows[:, 1:]


def cmd_ls_train(a: argparse.Namespace) -> None:
    import logging

    import torch

    from lockstep.model import GPT, GPTConfig
    from lockstep.optim import OptimConfig
    from lockstep.runtime import Runtime
    from lockstep.train import TrainConfig, Trainer

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    d, seq, kernels = device(), default_seq(a), a.kernels == "on"
    dtype, why = compute_dtype(a)
    rt = Runtime(device=d, dtype=dtype, reason=why, compile=a.compile == "on", kernels=kernels)
    gcfg = GPTConfig.from_depth(a.depth, a.vocab, seq)
    model = GPT.build(gcfg, d, seed=0).use_kernels(kernels)
    cfg = TrainConfig(batch_tokens=a.rows * seq * a.accum, device_batch_rows=a.rows, num_steps=a.steps, warmup_steps=0,
                      eval_every_steps=0, checkpoint_every_steps=0, max_epochs=None, peak_flops=a.peak_tflops * 1e12,
                      optim=OptimConfig(muon_momentum_warmup_steps=0))
    data = RandomWindows(max(1 << 20, 8 * a.rows * (seq + 1)), a.vocab, seq)
    t0 = time.perf_counter()
    trainer = Trainer(model, cfg, rt, data=data, seed=0)
    # Steps alone (Trainer.step): fit() would also write a checkpoint, seconds of disk at d20.
    stats = [trainer.step() for _ in range(a.steps)]
    wall = time.perf_counter() - t0
    if not trainer.dts:
        raise SystemExit("no timed step: pass --steps >= 2 (the first step carries compile and warm-up)")
    step_s = statistics.median(trainer.dts)
    tok_s = cfg.batch_tokens / step_s
    result("ls_train", depth=a.depth, rows=a.rows, seq=seq, accum=a.accum, steps=a.steps, compile=a.compile,
           kernels=a.kernels, dtype=str(dtype).removeprefix("torch."), vocab=a.vocab, tok_per_s=round(tok_s),
           step_ms=round(1e3 * step_s, 2), mfu=round(100 * trainer.flops_per_token * tok_s / trainer.peak, 2),
           peak_flops=trainer.peak, peak_source=trainer.peak_why, flops_per_token=trainer.flops_per_token,
           params=model.num_params(), losses=[round(s.train_loss, 5) for s in stats],
           first_step_s=round(trainer.train_time_s - sum(trainer.dts), 2), wall_s=round(wall, 1))


# ---------------------------------------------------------------- nanochat (the baseline)
def nanochat_root(cmd: str) -> Path:
    """NANOCHAT_ROOT, checked to hold nanochat's package, or SystemExit(2) saying how to get one."""
    raw = os.environ.get("NANOCHAT_ROOT", "")
    root = Path(raw).expanduser().resolve() if raw else None
    if root is None or not (root / "nanochat" / "gpt.py").is_file():
        where = f"NANOCHAT_ROOT={raw!r} holds no nanochat/gpt.py" if raw else "NANOCHAT_ROOT is not set"
        print(f"error: {cmd} measures the nanochat baseline, and {where}. Clone it and point at the checkout: "
              f"git clone https://github.com/karpathy/nanochat && git -C nanochat checkout {NANOCHAT_COMMIT} && "
              f"export NANOCHAT_ROOT=$PWD/nanochat. The lockstep subcommands (ls_train, ls_decode) need none of this.",
              file=sys.stderr)
        raise SystemExit(2)
    return root


def import_nanochat(cmd: str, compile_on: bool) -> None:
    root = nanochat_root(cmd)
    sys.path.insert(0, str(root))
    if importlib.util.find_spec("rustbpe") is None:
        # nanochat.engine imports its tokenizer module, which imports rustbpe (a Rust extension
        # needed only to train a tokenizer); the benchmark never tokenizes text.
        sys.modules["rustbpe"] = types.ModuleType("rustbpe")
    if not compile_on:
        # nanochat's optimizer steps are torch.compile'd by decorator; --compile off runs the
        # functions they wrap eagerly, as it runs lockstep's (a CPU rehearsal without compiling).
        import nanochat.optim as optim

        for name in ("adamw_step_fused", "muon_step_fused"):
            fn = getattr(optim, name)
            setattr(optim, name, getattr(fn, "_torchdynamo_orig_callable", getattr(fn, "__wrapped__", fn)))


def nanochat_model(depth: int, vocab: int, seq: int, window: str):
    """nanochat's GPT of lockstep's shape at this depth: width 64 x depth, heads of 64, full
    attention in every layer (`window` "L"; nanochat's own default "SSSL" slides 3 of 4)."""
    import torch
    from nanochat.gpt import GPT, GPTConfig

    width = 64 * depth
    cfg = GPTConfig(sequence_len=seq, vocab_size=vocab, n_layer=depth, n_head=width // 64, n_kv_head=width // 64,
                    n_embd=width, window_pattern=window)
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device())
    model.init_weights()
    return model


def cmd_nc_train(a: argparse.Namespace) -> None:
    import torch

    import_nanochat("nc_train", a.compile == "on")
    from nanochat.common import COMPUTE_DTYPE

    seq = default_seq(a)
    model = nanochat_model(a.depth, a.vocab, seq, a.nc_window)
    opt = model.setup_optimizer()
    step_model = torch.compile(model, dynamic=False) if a.compile == "on" else model
    flops_per_token = model.estimate_flops()
    g = torch.Generator().manual_seed(0)
    data = RandomWindows(max(1 << 20, 8 * a.rows * (seq + 1)), a.vocab, seq)
    times, losses = [], []
    t_start = time.perf_counter()
    for _ in range(a.steps):
        batches = [data.get_batch(B=a.rows, generator=g) for _ in range(a.accum)]
        synchronize()
        t0 = time.perf_counter()
        for x, y in batches:
            # nanochat's loss views its targets flat: they must be contiguous, not a window slice
            loss = step_model(x.contiguous().to(device(), non_blocking=True), y.contiguous().to(device(), non_blocking=True))
            (loss / a.accum).backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the host transfer nanochat's loop makes to log the loss
        synchronize()
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t_start
    if len(times) < 2:
        raise SystemExit("no timed step: pass --steps >= 2 (the first step carries compile and warm-up)")
    step_s = statistics.median(times[1:])
    tok_s = a.rows * seq * a.accum / step_s
    # the same peak as lockstep's MFU, in the dtype nanochat computes in
    peak, source = mfu_peak(COMPUTE_DTYPE, a.peak_tflops)
    result("nc_train", depth=a.depth, rows=a.rows, seq=seq, accum=a.accum, steps=a.steps, compile=a.compile,
           window=a.nc_window, dtype=str(COMPUTE_DTYPE).removeprefix("torch."), vocab=a.vocab, tok_per_s=round(tok_s),
           step_ms=round(1e3 * step_s, 2), mfu=round(100 * flops_per_token * tok_s / peak, 2), peak_flops=peak,
           peak_source=source, flops_per_token=flops_per_token, params=sum(p.numel() for p in model.parameters()),
           losses=[round(x, 5) for x in losses], first_step_s=round(times[0], 2), wall_s=round(wall, 1),
           nanochat_commit=NANOCHAT_COMMIT)


# ---------------------------------------------------------------- decoding
class NoSpecials:
    """The tokenizer an engine needs for random weights: every special id is -1, which no row
    samples, so no row stops early and no tool call starts; text is bytes."""

    def encode_special(self, name: str) -> int:
        return -1

    def get_bos_token_id(self) -> int:
        return -1

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def decode_rates(generate: Callable[[int, int], int], new_tokens: int, reps: int) -> dict[str, float]:
    """Median tokens/s over `reps` runs per batch size: rows x steps yielded / wall time, after an
    untimed run of the same length per batch (allocation, compile or graph capture, which may
    depend on the cache's length)."""
    for b in DECODE_BATCHES:
        generate(b, new_tokens)
    out = {}
    for b in DECODE_BATCHES:
        rates = []
        for _ in range(reps):
            synchronize()
            t0 = time.perf_counter()
            steps = generate(b, new_tokens)
            synchronize()
            rates.append(b * steps / (time.perf_counter() - t0))
        out[f"b{b}_tok_s"] = round(statistics.median(rates), 1)
    return out


def cmd_ls_decode(a: argparse.Namespace) -> None:
    import torch

    from lockstep.engine import Engine
    from lockstep.model import GPT, GPTConfig

    d = device()
    weights = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.weights]
    gcfg = GPTConfig.from_depth(a.depth, a.vocab, a.decode_seq)
    model = GPT.build(gcfg, d, weights, seed=0).eval()
    tok = NoSpecials()

    def runner(engine) -> Callable[[int, int], int]:
        def generate(b: int, n: int) -> int:
            steps = 0
            with torch.no_grad():
                for _ in engine.generate(PROMPT, num_samples=b, max_tokens=n, temperature=1.0, top_k=50, use_tools=False):
                    steps += 1
            return steps

        return generate

    def greedy(engine) -> list[int]:
        return [col[0] for col in engine.generate(PROMPT, max_tokens=a.check_tokens, temperature=0.0, use_tools=False)]

    fields: dict[str, Any] = {}
    reference = Engine(model, tok)
    ref_ids = greedy(reference)
    fields.update({f"ref_{k}": v for k, v in decode_rates(runner(reference), a.new_tokens, a.reps).items()})
    # the fast path as the eval stage and RL run it: static KV cache, device-side sampling, the step
    # compiled (--compile on) and replayed as a CUDA graph on CUDA
    fast = Engine(model, tok, fast=True, compile_step=a.compile == "on")
    fast_ids = greedy(fast)
    agree = next((i for i, (x, y) in enumerate(zip(ref_ids, fast_ids)) if x != y), len(ref_ids))
    fields.update({f"fast_{k}": v for k, v in decode_rates(runner(fast), a.new_tokens, a.reps).items()})
    fields["fast_greedy_agrees_tokens"] = agree  # leading greedy tokens equal to the reference's
    model.use_kernels(False)
    result("ls_decode", depth=a.depth, vocab=a.vocab, weights=a.weights, new_tokens=a.new_tokens, reps=a.reps,
           prompt_tokens=len(PROMPT), check_tokens=a.check_tokens, compile=a.compile, **fields)


def cmd_nc_decode(a: argparse.Namespace) -> None:
    import torch

    import_nanochat("nc_decode", compile_on=True)
    from nanochat.common import COMPUTE_DTYPE
    from nanochat.engine import Engine

    model = nanochat_model(a.depth, a.vocab, a.decode_seq, a.nc_window).eval()
    engine = Engine(model, NoSpecials())

    def generate(b: int, n: int) -> int:
        steps = 0
        with torch.no_grad():
            for _ in engine.generate(PROMPT, num_samples=b, max_tokens=n, temperature=1.0, top_k=50):
                steps += 1
        return steps

    # nanochat keeps fp32 master weights and casts them to its compute dtype in every matmul
    result("nc_decode", depth=a.depth, vocab=a.vocab, weights="fp32 cast to " + str(COMPUTE_DTYPE).removeprefix("torch."),
           new_tokens=a.new_tokens, reps=a.reps, prompt_tokens=len(PROMPT), nanochat_commit=NANOCHAT_COMMIT,
           **{f"ref_{k}": v for k, v in decode_rates(generate, a.new_tokens, a.reps).items()})


# ---------------------------------------------------------------- lockstep's stages
STAGE_ORDER = (("pretrain", None), ("midtrain", None), ("sft", None), ("rl", None), ("eval", "rl"))


def stage_command(dvc: dict[str, Any], name: str, item: str | None) -> list[str]:
    """The stage's command as dvc.yaml writes it (so paths stay dvc.yaml's), `${item}` filled in."""
    spec = dvc["stages"][name]
    cmd = (spec["do"] if "foreach" in spec else spec)["cmd"]
    if item is not None:
        cmd = cmd.replace("${item}", item)
    words = cmd.split()
    if words[:2] != ["python", "-m"]:
        raise SystemExit(f"dvc.yaml stage {name}: expected `python -m ...`, got {cmd[:60]!r}")
    return [sys.executable, *words[1:]]


def cmd_stages(a: argparse.Namespace) -> None:
    """pretrain -> midtrain -> sft -> rl -> eval rl on the smoke workspace `--smoke` (params.yaml
    and data/{raw,tokenizer,cache} of the smoke preset) in a scratch copy of this checkout, on this
    device, with runtime.kernels from --kernels; each stage under --stage-timeout-s."""
    import yaml

    smoke = Path(a.smoke).resolve()
    need = [smoke / "params.yaml", *(smoke / "data" / p for p in ("raw", "tokenizer", "cache"))]
    if not all(p.exists() for p in need):
        raise SystemExit(f"error: --smoke {smoke} must hold params.yaml and data/raw, data/tokenizer, data/cache of the "
                         "smoke preset (see docs/performance.md, 'Stages on smoke data')")
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        w = Path(tmp)
        for sub in ("lib", "stages", "evalsets"):
            shutil.copytree(ROOT / sub, w / sub, ignore=shutil.ignore_patterns("__pycache__"))
        for sub in ("raw", "tokenizer", "cache"):
            shutil.copytree(smoke / "data" / sub, w / "data" / sub)
        params = yaml.safe_load((smoke / "params.yaml").read_text(encoding="utf-8"))
        params["runtime"] = {**(params.get("runtime") or {}), "device": device().type, "dtype": "auto",
                             "deterministic": False, "kernels": a.kernels == "on"}
        (w / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
        env = {**os.environ, "PYTHONPATH": f"{w / 'lib'}{os.pathsep}{w}", "PYTHONUNBUFFERED": "1"}
        for name, item in STAGE_ORDER:
            label = name if item is None else f"{name}@{item}"
            print(f"-- stage {label}", flush=True)
            t0 = time.perf_counter()
            try:
                rc = subprocess.run(stage_command(dvc, name, item), cwd=w, env=env, timeout=a.stage_timeout_s).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            rows.append({"stage": label, "rc": rc, "s": round(time.perf_counter() - t0, 1)})
            print(f"-- stage {label}: rc {rc}", flush=True)
            if rc != 0:
                break
        facts = {}
        for name in ("pretrain", "rl"):
            f = w / "data" / "runinfo" / f"{name}.json"
            if f.is_file():
                info = json.loads(f.read_text(encoding="utf-8"))
                facts[name] = {k: info[k] for k in ("tok_per_s", "mfu", "train_time_s") if k in info}
                dev = info.get("device") or {}
                facts[name].update({k: dev[k] for k in ("device", "dtype", "compile", "kernels") if k in dev})
    result("stages", kernels=a.kernels, stages=rows, runinfo=facts, ok=all(r["rc"] == 0 for r in rows)
           and len(rows) == len(STAGE_ORDER))


# ---------------------------------------------------------------- compare
def read_results(path: Path) -> list[dict[str, Any]]:
    """RESULT records from a results.jsonl (one JSON object a line) or a log with `RESULT {...}` lines."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line.startswith("RESULT "):
            line = line[len("RESULT "):]
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def _ratio(x: float | None, y: float | None) -> str:
    return f"{x / y:.3f}x" if x is not None and y else "-"


def _mem(r: dict[str, Any] | None) -> float | None:
    return None if r is None else r.get("peak_mem_gb", r.get("host_peak_rss_gb"))


def compare(records: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """Lines of text and a JSON-ready dict of ratios, from the records alone (the last record of a
    kind wins when a phase ran twice)."""
    lines: list[str] = []
    ratios: dict[str, Any] = {}
    env = next((r for r in reversed(records) if r["phase"] == "env"), None)
    if env:
        lines.append(f"device {env.get('gpu') or env.get('device')}, torch {env['torch']}, CUDA {env['cuda']}")
        if env.get("declared_bf16_tflops"):
            frac = env["bf16_matmul_tflops"] / env["declared_bf16_tflops"]
            lines.append(f"bf16 matmul {env['matmul_n']}^3: {env['bf16_matmul_tflops']} TFLOP/s measured, "
                         f"{frac:.3f} of the datasheet's {env['declared_bf16_tflops']}")
            ratios["matmul_of_datasheet"] = round(frac, 4)
    shapes: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in records:
        if r["phase"] in ("ls_train", "nc_train"):
            key = (r["depth"], r["rows"], r["seq"], r["accum"])
            who = f"ls_{r['kernels']}" if r["phase"] == "ls_train" else "nc"
            shapes.setdefault(key, {})[who] = r
    for (depth, rows, seq, accum), by in sorted(shapes.items()):
        name = f"d{depth} {rows}x{seq}" + (f"x{accum}" if accum > 1 else "")
        lines.append(f"train {name}:")
        for who, label in (("ls_off", "lockstep reference"), ("ls_on", "lockstep fast"), ("nc", "nanochat")):
            r = by.get(who)
            if r:
                where = "GPU" if "peak_mem_gb" in r else "host RSS"
                lines.append(f"  {label:18} {r['tok_per_s']:>10,} tok/s  MFU {r['mfu']:5.1f}%  peak {where} {_mem(r)} GB  "
                             f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}  (first step {r['first_step_s']} s)")
        entry: dict[str, Any] = {}
        for a_, b_, tag in (("ls_off", "nc", "reference/nanochat"), ("ls_on", "nc", "fast/nanochat"),
                            ("ls_on", "ls_off", "fast/reference")):
            x, y = by.get(a_), by.get(b_)
            if x and y:
                tok = x["tok_per_s"] / y["tok_per_s"]
                mem = (_mem(x) / _mem(y)) if _mem(x) and _mem(y) else None
                mfu = x["mfu"] / y["mfu"] if y["mfu"] else None
                entry[tag] = {"tok_per_s": round(tok, 4), "peak_mem": None if mem is None else round(mem, 4),
                              "mfu": None if mfu is None else round(mfu, 4)}
                line = f"  {tag:19} tok/s {tok:.3f}x  memory {_ratio(_mem(x), _mem(y))}  MFU {_ratio(x['mfu'], y['mfu'])}"
                if tag == "fast/reference":
                    diff = max(abs(p - q) for p, q in zip(x["losses"], y["losses"]))
                    entry[tag]["max_loss_diff"] = round(diff, 6)
                    line += f"  max |loss diff| {diff:.2e} over {min(len(x['losses']), len(y['losses']))} steps"
                lines.append(line)
        ratios[f"train_d{depth}_{rows}x{seq}x{accum}"] = entry
    ls = next((r for r in reversed(records) if r["phase"] == "ls_decode"), None)
    nc = next((r for r in reversed(records) if r["phase"] == "nc_decode"), None)
    if ls or nc:
        depth = (ls or nc)["depth"]
        lines.append(f"decode d{depth}, {(ls or nc)['new_tokens']} new tokens:")
        entry = {}
        for b in DECODE_BATCHES:
            k = f"b{b}_tok_s"
            parts = []
            ref, fast, base = (ls or {}).get(f"ref_{k}"), (ls or {}).get(f"fast_{k}"), (nc or {}).get(f"ref_{k}")
            if ref is not None:
                parts.append(f"lockstep reference {ref:,.1f} tok/s ({ls['weights']} weights)")
            if fast is not None:
                parts.append(f"fast {fast:,.1f}")
            if base is not None:
                parts.append(f"nanochat {base:,.1f}")
            row = {"reference/nanochat": ref / base if ref and base else None,
                   "fast/nanochat": fast / base if fast and base else None,
                   "fast/reference": fast / ref if fast and ref else None}
            entry[f"b{b}"] = {k2: round(v, 4) for k2, v in row.items() if v is not None}
            ratio_text = ", ".join(f"{k2} {v:.2f}x" for k2, v in row.items() if v is not None)
            lines.append(f"  batch {b}: " + "; ".join(parts) + (f"  [{ratio_text}]" if ratio_text else ""))
        if ls and "fast_greedy_agrees_tokens" in ls:
            lines.append(f"  fast path's greedy tokens equal the reference's for the first "
                         f"{ls['fast_greedy_agrees_tokens']} of {ls['check_tokens']}")
        ratios[f"decode_d{depth}"] = entry
    st = next((r for r in reversed(records) if r["phase"] == "stages"), None)
    if st:
        lines.append("stages (kernels " + st["kernels"] + "): "
                     + ", ".join(f"{s['stage']} rc {s['rc']} {s['s']} s" for s in st["stages"]))
    return lines, ratios


def cmd_compare(a: argparse.Namespace) -> None:
    path = Path(a.file)
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist; pass the results.jsonl the GPU check wrote")
    lines, ratios = compare(read_results(path))
    print("\n".join(lines))
    print("RATIOS " + json.dumps(ratios))


COMMANDS = {"env": cmd_env, "ls_train": cmd_ls_train, "nc_train": cmd_nc_train, "ls_decode": cmd_ls_decode,
            "nc_decode": cmd_nc_decode, "stages": cmd_stages, "compare": cmd_compare}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cmd", choices=sorted(COMMANDS))
    p.add_argument("file", nargs="?", default="results.jsonl", help="compare: the results.jsonl to read")
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--rows", type=int, default=32, help="sequences per forward pass")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps, the first untimed")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence; 0 = 2048 on CUDA, 128 on CPU")
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto", help="lockstep's compute dtype")
    p.add_argument("--compile", choices=("on", "off"), default="on")
    p.add_argument("--kernels", choices=("on", "off"), default="off",
                   help="ls_train, stages: lockstep's fast paths (on) or its reference path (off)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="MFU peak per device; 0 = datasheet or measured")
    p.add_argument("--nc-window", default="L", help="nanochat's window_pattern (L = full attention, as lockstep)")
    p.add_argument("--weights", choices=("bf16", "fp32"), default="bf16", help="ls_decode: lockstep's weight dtype")
    p.add_argument("--decode-seq", type=int, default=2048, help="decode: the model's context length")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--check-tokens", type=int, default=32, help="ls_decode: greedy tokens compared fast vs reference")
    p.add_argument("--smoke", default=str(ROOT / "bench" / "out" / "smoke"), help="stages: the smoke workspace")
    p.add_argument("--stage-timeout-s", type=int, default=100)
    a = p.parse_args(argv)
    COMMANDS[a.cmd](a)


if __name__ == "__main__":
    main()
