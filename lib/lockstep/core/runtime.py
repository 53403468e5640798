"""Runtime: device and dtype choice (once, with a reason), device names checked against this
machine, distributed detection, the torchrun command for one node or several (c10d rendezvous),
determinism settings and peak-FLOPs. Knows nothing about models, data or training."""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import re
import socket
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from lockstep.core.config import ConfigError, FieldError
from lockstep.core.openmp import torch_read_the_default, wait_policy

# Dense bf16 tensor-core peaks from the vendors' datasheets (no sparsity), FLOP/s per device.
_DECLARED_BF16_PEAK_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("A10G", 125e12),
    ("L4", 121e12),
    ("4090", 165e12),
    ("3090", 71e12),
)


@dataclass(frozen=True)
class RuntimeConfig:
    """The `runtime` params section."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    nproc: int = 1  # processes on this node; >1 makes the stage re-run itself under torchrun
    # Nodes in the job; >1: the same stage command, started on every node, joins one torchrun job
    # of nnodes * nproc ranks through the c10d rendezvous at `rdzv_endpoint`.
    nnodes: int = 1
    rdzv_endpoint: str = ""  # HOST:PORT on one node that every node reaches; empty = torchrun --standalone
    rdzv_id: str = "lockstep"  # job id that every node of one job passes; a new id starts a new job
    threads: int = 0  # torch intra-op threads per process on CPU; 0 = cores // nproc
    compile: Literal["auto", "on", "off"] = "auto"  # torch.compile: auto = on for CUDA only
    deterministic: bool = True  # torch.use_deterministic_algorithms (bit-exact CPU resume needs it)
    # the model's fast paths, switched on by GPT.use_kernels: on CPU lockstep.model.kernels (fused head
    # loss, RMSNorm backward, decode head), on CUDA the chunked head loss (lockstep.model.ops.CUDA_OPS);
    # false runs the stock-PyTorch reference
    kernels: bool = False

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise FieldError(
                "nproc", self.nproc, "must be >= 1: processes on this node, 1 for a single process without torchrun"
            )
        if self.threads < 0:
            raise FieldError("threads", self.threads, "must be >= 0: torch threads per process, 0 = cores // nproc")
        if self.nnodes < 1:
            raise FieldError("nnodes", self.nnodes, "must be >= 1: nodes in the job, 1 for a single machine")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise FieldError("rdzv_endpoint", self.rdzv_endpoint, f"must be HOST:PORT when nnodes={self.nnodes}: a "
                             "free port on one of the nodes that all of them reach, e.g. node0.cluster:29400")
        if self.rdzv_endpoint:
            split_endpoint(self.rdzv_endpoint)
        if not _RDZV_ID.fullmatch(self.rdzv_id):
            raise FieldError("rdzv_id", self.rdzv_id, "must be 1-64 letters, digits, '.', '_' or '-': the job id "
                             "every node passes to the rendezvous")

    def identity(self) -> dict:
        """The fields that can change a run's results, for naming its run folder: where the
        nodes meet (`rdzv_endpoint`, `rdzv_id`) is left out, so a job restarted under a new id
        or on another rendezvous host resumes its run."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("rdzv_endpoint", "rdzv_id")}

    @property
    def multi_process(self) -> bool:
        """Whether the stage runs under torchrun (several processes, or a rendezvous to join)."""
        return self.nproc > 1 or self.nnodes > 1


_RDZV_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST and PORT of a rendezvous endpoint `HOST:PORT` (`[v6addr]:PORT` for IPv6), or a
    FieldError for `rdzv_endpoint` that says what is wrong."""
    host, sep, port = endpoint.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if not sep or not host or (":" in host and not bracketed) or any(c.isspace() for c in host):
        raise FieldError("rdzv_endpoint", endpoint, "must be HOST:PORT (IPv6 as [ADDR]:PORT), e.g. "
                         "node0.cluster:29400: the node that hosts the rendezvous and a free port on it")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise FieldError("rdzv_endpoint", endpoint, f"has port {port!r}; give a TCP port in 1..65535 after the last "
                         "':', e.g. node0.cluster:29400")
    return host, int(port)


class DeviceError(ConfigError):
    """A device that this machine does not have, or a name that is not a torch device."""


@dataclass(frozen=True)
class Runtime:
    """What the process runs on, decided once at the stage entry and passed explicitly."""

    device: torch.device
    dtype: torch.dtype  # compute dtype of matmuls: float32, or bfloat16 under autocast
    reason: str  # why this device and dtype, for the log
    rank: int = 0  # global rank: data shards and which process writes outputs (rank 0)
    local_rank: int = 0  # rank on this node: which CUDA device
    world_size: int = 1  # processes in the job, all nodes together
    nodes: int = 1  # nodes in the job (torchrun's GROUP_WORLD_SIZE)
    compile: bool = False
    kernels: bool = False  # run models on their fast paths (GPT.use_kernels)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self) -> torch.autocast:
        """Autocast context for forward passes: bf16 where chosen, a no-op for fp32."""
        return torch.autocast(
            device_type=self.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16
        )

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def settings(self) -> dict:
        """What the run computes with, for checkpoints: `describe()` without the reason, which
        names host facts (CPU features) that must not make identical results differ."""
        return {k: v for k, v in self.describe().items() if k != "reason"}

    def describe(self) -> dict:
        return {
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "reason": self.reason,
            "world_size": self.world_size,
            "compile": self.compile,
            "kernels": self.kernels,
        }


def cpu_bf16_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The CPU flags by which it executes bf16 dot products natively, of AVX-512 BF16
    (`avx512_bf16`) and AMX-BF16 (`amx_bf16`), as `cpuinfo` lists them; empty elsewhere."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return sorted(flags & {"avx512_bf16", "amx_bf16"})
    return []


def choose_device_dtype(
    device: str = "auto", dtype: str = "auto", *, local_rank: int = 0
) -> tuple[torch.device, torch.dtype, str]:
    """Pick the device and compute dtype, and say why. CPU fp32 always works and is what `auto`
    picks on CPUs without native bf16; on CPUs with it (AVX-512 BF16 / AMX), `auto` picks bf16
    autocast: about 2x the training throughput there, with per-step losses within ~1e-4 of fp32
    and the same val bpb after 40 tiny-preset steps (bench/bench_train.py)."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"runtime.device={device!r} must be auto, cpu or cuda")
    if dtype not in ("auto", "fp32", "bf16"):
        raise ValueError(f"runtime.dtype={dtype!r} must be auto, fp32 or bf16")
    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise DeviceError(f"runtime.device=cuda but torch sees no CUDA device ({_no_cuda_reason()}); "
                          "set runtime.device: cpu or auto")
    if device == "cuda" or (device == "auto" and has_cuda):
        dev = torch.device("cuda", local_rank)
        major, minor = torch.cuda.get_device_capability(dev)
        name = torch.cuda.get_device_name(dev)
        bf16_ok = major >= 8
        if dtype == "bf16" and not bf16_ok:
            raise ValueError(f"runtime.dtype=bf16 needs CUDA sm80+, {name} is sm{major}{minor}; use fp32 or auto")
        if dtype == "fp32" or (dtype == "auto" and not bf16_ok):
            why = "requested" if dtype == "fp32" else f"sm{major}{minor} has no bf16 tensor cores"
            return dev, torch.float32, f"fp32 on CUDA {name} ({why})"
        return dev, torch.bfloat16, f"bf16 autocast on CUDA {name} sm{major}{minor}"
    dev = torch.device("cpu")
    if dtype == "bf16":
        native = cpu_bf16_features()
        note = f"native {' and '.join(native)}" if native else "no native bf16 on this CPU: emulated and slow"
        return dev, torch.bfloat16, f"bf16 autocast on CPU (requested; {note})"
    native = cpu_bf16_features() if dtype == "auto" else []
    if native:
        why = f"auto: native {' and '.join(native)}; trains as well as fp32"
        return dev, torch.bfloat16, f"bf16 autocast on CPU ({why})"
    why = "requested" if dtype == "fp32" else "auto: no native bf16 on this CPU"
    return dev, torch.float32, f"fp32 on CPU ({why})"


def _no_cuda_reason() -> str:
    if torch.version.cuda is None:
        return f"this torch {torch.__version__} is a CPU-only build"
    return (f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, but no GPU is visible or its driver "
            "is missing")


def device_from_name(name: str, *, setting: str) -> torch.device:
    """The torch device `name` ("cpu", "cuda", "cuda:1", "mps"), checked to exist on this machine
    before anything is built on it. `setting` names where the value came from (`--device`), for
    the message of the DeviceError raised otherwise."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise DeviceError(f"{setting} {name!r} is not a torch device; use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"{setting} {name}: torch sees no CUDA device ({_no_cuda_reason()}); use {setting} cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise DeviceError(f"{setting} {name}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}; "
                              f"pick one of them, or set CUDA_VISIBLE_DEVICES to show more")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError(f"{setting} {name}: torch sees no Apple MPS device on this machine; use {setting} cpu")
    elif dev.type != "cpu":
        raise DeviceError(f"{setting} {name}: {dev.type} devices are not supported; use cpu, cuda, cuda:N or mps")
    return dev


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or a launcher that sets the same variables):
    then its rank, world size and rendezvous come from the environment, whatever params say."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def local_processes(cfg: RuntimeConfig) -> int:
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE under torchrun, else `cfg.nproc`."""
    if under_torchrun() and os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    return cfg.nproc


def torchrun_argv(nproc: int, module: str, args: list[str], *, nnodes: int = 1, rdzv_endpoint: str = "",
                  rdzv_id: str = "lockstep") -> list[str]:
    """The command that re-runs `python -m module args` under torchrun: `nproc` processes on this
    node, alone (`--standalone`) without `rdzv_endpoint`, else joining the `nnodes`-node job
    `rdzv_id` through the c10d rendezvous at `rdzv_endpoint`. Every node runs the same command."""
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    if not rdzv_endpoint:
        if nnodes != 1:
            raise ValueError(f"runtime.nnodes={nnodes} needs runtime.rdzv_endpoint (HOST:PORT of the rendezvous)")
        return [*launcher, "--standalone", f"--nproc_per_node={nproc}", "-m", module, *args]
    return [*launcher, f"--nnodes={nnodes}", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={rdzv_endpoint}", f"--rdzv_id={rdzv_id}", "-m", module, *args]


def configure_threads(threads: int, nproc: int) -> int:
    """Set torch's intra-op thread count; 0 shares the cores evenly among this node's processes.
    Results on CPU are bit-reproducible only for a fixed thread count (reduction order)."""
    if threads < 0:
        raise ValueError(f"runtime.threads={threads} must be >= 0 (0 = cores // nproc)")
    n = threads or max(1, (os.cpu_count() or 1) // max(1, nproc))
    torch.set_num_threads(n)
    return n


def configure_determinism(deterministic: bool) -> None:
    """Deterministic kernels. On CPU, with a fixed thread count, this makes training bit-exact
    run to run; on CUDA it also needs CUBLAS_WORKSPACE_CONFIG, set here, and holds per GPU model
    and software stack only."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic, warn_only=False)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers from glibc's malloc.h


def keep_heap_memory() -> bool:
    """Ask glibc's malloc to serve large blocks from the heap and keep freed memory for reuse,
    instead of mapping every large tensor afresh and unmapping it when freed. A CPU training step
    allocates the same large tensors every step (the d4/32k head's 134 MB gradient buffer among
    them); with fresh mappings each one page-faults on first touch, every step. Measured on this
    2-core CPU: the d4/32k bf16 step 0.47-0.56 s -> 0.42-0.46 s, the head's forward (one
    thread) 0.40 s -> 0.25 s. The cost: memory freed by the process is kept, not returned to the
    OS. Returns False (and changes nothing) where the C library is not glibc."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 31))


def init_runtime(cfg: RuntimeConfig) -> Runtime:
    """Detect torchrun from the environment, join the process group, choose device and dtype."""
    rank, local_rank, world_size, nodes = 0, 0, 1, 1
    if under_torchrun():
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ["LOCAL_RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    dev, dt, reason = choose_device_dtype(cfg.device, cfg.dtype, local_rank=local_rank)
    if dev.type == "cpu" and keep_heap_memory():
        reason += "; large CPU blocks reused from the heap (glibc mallopt), not re-mapped every step"
    if dev.type == "cpu":
        reason += f"; OpenMP wait policy {wait_policy()}"
        if torch_read_the_default() and rank == 0:
            logging.getLogger("lockstep.runtime").warning("OpenMP wait policy %s", wait_policy())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, device_id=dev if dev.type == "cuda" else None)
    return Runtime(device=dev, dtype=dt, reason=reason, rank=rank, local_rank=local_rank, world_size=world_size,
                   nodes=nodes, compile=compile_enabled(cfg.compile, dev.type), kernels=cfg.kernels)


def compile_enabled(setting: str, device_type: str) -> bool:
    """Whether a run on a `device_type` ("cpu", "cuda") device compiles (torch.compile) under
    runtime.compile `setting`: `on`, or `auto` on CUDA. One rule for the stages (init_runtime)
    and for what `lockstep plan` plans and times, so the two cannot disagree."""
    return setting == "on" or (setting == "auto" and device_type == "cuda")


class NodeOrderError(ConfigError):
    """Rank 0, which writes a stage's outputs, landed on another node than the one DVC runs on."""


def writer_host(rt: Runtime, *, launched_by_dvc: bool) -> str:
    """The host name of global rank 0, the one process that writes the stage's outputs (a
    collective: call it on every rank). torchrun's c10d rendezvous numbers the nodes by their
    sorted addresses, not by who hosts the rendezvous, so this is known only once the job has
    formed. `launched_by_dvc`: whether DVC started the stage on this node; if it did on some node
    and rank 0 is elsewhere, DVC would look for the outputs on a disk that never gets them, so
    every rank raises NodeOrderError before any training."""
    mine = (socket.gethostname(), launched_by_dvc)
    everyone = [mine]
    if rt.distributed:
        everyone = [None] * rt.world_size
        dist.all_gather_object(everyone, mine)
    host0, dvc0 = everyone[0]
    dvc_hosts = sorted({host for host, dvc in everyone if dvc})
    if dvc_hosts and not dvc0:
        raise NodeOrderError(
            f"rank 0, which writes this stage's outputs, runs on host {host0}, but DVC started the stage on "
            f"{', '.join(dvc_hosts)}: torchrun's c10d rendezvous gives rank 0 to the node whose address sorts first. "
            f"Run `dvc repro` on {host0} and the stage command alone on the other nodes (docs/team.md)")
    return host0


def shutdown(rt: Runtime) -> None:
    if rt.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier(rt: Runtime) -> None:
    if rt.distributed:
        dist.barrier()


def declared_peak_flops(device: torch.device) -> float | None:
    """Datasheet bf16 peak for known CUDA devices, None when unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in _DECLARED_BF16_PEAK_FLOPS:
        if key in name:
            return flops
    return None


def measure_matmul_peak_flops(
    device: torch.device, dtype: torch.dtype, *, n: int = 1024, min_time_s: float = 0.5
) -> float:
    """Measured dense matmul throughput (FLOP/s) for square n x n products: the honest peak to
    quote MFU against on a CPU, whose datasheet peak is unreachable in practice. The best of
    repeated timed batches after a warm-up: other work on the machine only ever slows a batch down
    (the median of a 2-core CPU's batches, beside another process, read 67 GFLOP/s where the best
    read 400, and the model itself ran at 1.4x the median)."""
    a = torch.ones(n, n, device=device, dtype=dtype) / n
    b = torch.ones(n, n, device=device, dtype=dtype) / n
    for _ in range(3):
        torch.mm(a, b)
    rates = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_time_s or len(rates) < 3:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        reps = 4
        for _ in range(reps):
            torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rates.append(2.0 * n**3 * reps / (time.perf_counter() - t0))
    return max(rates)


def peak_flops(rt: Runtime, *, declared: float = 0.0) -> tuple[float, str]:
    """The peak MFU is quoted against: `declared` if given, else the datasheet for known GPUs,
    else a short measurement of this device in its compute dtype."""
    if declared > 0:
        return declared, "declared in params"
    known = declared_peak_flops(rt.device)
    if known is not None and rt.dtype == torch.bfloat16:
        return known, "datasheet bf16 dense"
    return measure_matmul_peak_flops(rt.device, rt.dtype), f"measured {str(rt.dtype).removeprefix('torch.')} matmul"

