"""Static-shape decoding: a KV cache preallocated to a fixed length whose per-row positions live
in a device tensor, a decode step (forward, soft cap, sampling) with no host sync inside, the
step's optional torch.compile, and a CUDA-graph runner that replays that step. Token ids in,
token ids out; the engine (lockstep.infer.engine) drives it and keeps the stop and tool logic. Not a
reference: lockstep.infer.engine's KVCache and sample_next are, and tests/test_static_cache.py holds
this path equal to them."""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lockstep.core import fastpath
from lockstep.infer.sampling import is_greedy, nucleus_top_p
from lockstep.model.ops import capped_logits

# Cache lengths come in powers of two from this many positions up to the model's context, so the
# steps (and their CUDA graphs) of requests of similar length are shared, while a short request
# does not attend over the whole context: at d12 (12 layers x 12 heads x 64 channels, bf16) a
# row's cache is 37 KB per position, 75 MB per step at batch 8 and 256 positions, 600 MB at 2048.
MIN_CACHE_TOKENS = 256
# Idle steps kept for reuse per engine (each holds its cache and, on CUDA, its graph); the least
# recently used beyond this are freed, and a freed step asked for again is built, compiled and
# captured again. generate_many's row counts (step_rows) are 1, 2, 4, ..., batch_rows, so 6 idle
# steps hold every row count of one cache length and sampling kind up to batch_rows 32, or up to
# 16 beside one other step; more shapes in turn than that (several cache lengths and kinds, as
# RL's rollouts and held-out evaluation alternate) rebuild some. Not raised: every idle step
# keeps its cache's memory (see MIN_CACHE_TOKENS).
MAX_IDLE_STEPS = 6
# Eager runs before a capture: the first call of some CUDA libraries initialises state (cuBLAS
# handles and workspaces) that must not happen during capture; torch's own examples use a few.
GRAPH_WARMUP_STEPS = 3
# An eager step on the CPU attends over the cache's first positions only, up to the farthest row's
# position rounded up to a multiple of this many (StaticKVCache.update); a captured or compiled
# step attends over the whole buffer, whose shape it fixes. At d4 (4 heads of 64) and batch 8, one
# layer's attention over 256 masked positions took 0.70 ms of CPU time in bf16 and 0.09 ms in fp32,
# over 80 of them 0.23 ms and 0.03 ms (torch 2.13, one thread, this project's 2-core EPYC).
ATTEND_STEP_TOKENS = 32


def cache_tokens(needed_tokens: int, limit: int) -> int:
    """The cache length for a request that reaches `needed_tokens` positions: the smallest power
    of two >= needed_tokens and >= MIN_CACHE_TOKENS, capped at the model's context `limit`."""
    if not 0 < needed_tokens <= limit:
        raise ValueError(f"a request of {needed_tokens} positions does not fit the model's context of {limit} tokens")
    return min(limit, max(MIN_CACHE_TOKENS, 1 << (needed_tokens - 1).bit_length()))


def step_rows(needed_rows: int, max_rows: int) -> int:
    """The rows of the step that decodes `needed_rows` requests at most `max_rows` at a time: the
    smallest power of two >= needed_rows, capped at max_rows. Any number of requests then takes
    one of at most floor(log2(max_rows)) + 2 row counts (1, 2, 4, ..., max_rows), so an engine
    builds, compiles and captures at most that many steps per cache length and sampling kind,
    where exact counts made the short last batch of every call a new shape, and so a new compile
    (tens of seconds each on a GPU, docs/performance.md). The rows past `needed_rows` decode
    ignored tokens: up to as many rows again of work, in calls with fewer requests than max_rows
    only."""
    if needed_rows < 1 or max_rows < 1:
        raise ValueError(f"needed_rows={needed_rows} and max_rows={max_rows} must be >= 1")
    return min(max_rows, 1 << (needed_rows - 1).bit_length())


def weights_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter: what it computes in without
    autocast, and so the dtype of the keys and values it produces."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    raise ValueError("the model has no floating-point parameters to take a dtype from")


class RowSource(Protocol):
    """A single-row cache to copy from (lockstep.infer.engine.KVCache after a prefill)."""

    kv: torch.Tensor | None  # (L, 2, 1, Hkv, T, D) once allocated

    def row_positions(self) -> list[int]: ...


class StaticKVCache:
    """The keys and the values of each layer in a preallocated tensor `(B, Hkv, T_max, D)` of its
    own (`keys[layer]`, `values[layer]`), and the next position of each row in a `(B,)` int64
    tensor on the same device, so no shape ever changes and a step can be captured. A step writes
    each row's new keys at its own position (one index_copy_ per layer into the flattened buffer)
    and attends over the whole buffer under a mask of the positions each row has reached (an eager
    step on the CPU, over its first positions only: ATTEND_STEP_TOKENS).
    Positions stop at T_max - 1: the engine never feeds a live row past its budget, but a finished
    row that keeps decoding (its output ignored) must not index outside the buffer or the rotary
    tables. Separate tensors rather than views of one: in a compiled step (compile_step) inductor
    writes into a tensor in place, but an index_copy_ into a view of one shared buffer made it
    copy the whole buffer every step (its generated code on the CPU, torch 2.13)."""

    def __init__(self, *, batch_size: int, n_layer: int, n_kv_head: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str):
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"batch_size={batch_size} and max_len={max_len} must be positive")
        self.batch_size, self.n_layer, self.n_kv_head, self.head_dim, self.max_len = (
            batch_size, n_layer, n_kv_head, head_dim, max_len)
        shape = (batch_size, n_kv_head, max_len, head_dim)
        # zeros, not empty: masked slots still enter the attention product (0 weight times a NaN
        # from uninitialised memory is NaN)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.pos = torch.zeros(batch_size, dtype=torch.long, device=device)  # next position per row
        self._key_pos = torch.arange(max_len, device=device)  # (T_max,)
        # Offsets of each (row, head) slab in the flattened (B * Hkv * T_max, D) view of a layer.
        slab = torch.arange(batch_size * n_kv_head, device=device) * max_len  # (B * Hkv,)
        self._slab = slab.view(batch_size, n_kv_head, 1)  # (B, Hkv, 1)
        self._write_at: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._seen = max_len  # the positions this step's layers attend over (attended)

    @classmethod
    def for_model(cls, model: nn.Module, batch_size: int, max_len: int) -> StaticKVCache:
        c = model.config
        if max_len > c.sequence_len:
            raise ValueError(f"max_len={max_len} is past the model's context of {c.sequence_len} tokens")
        return cls(batch_size=batch_size, n_layer=c.n_layer, n_kv_head=c.n_kv_head, head_dim=c.head_dim,
                   max_len=max_len, dtype=weights_dtype(model), device=model.rotary_cos.device)

    # -- what the model calls ---------------------------------------------------------------

    def positions(self) -> torch.Tensor:
        """The (B,) positions tensor itself, on the cache's device (read without a host sync)."""
        return self.pos

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
        """Write k, v (B, Hkv, T, D) at each row's next T positions; return this layer's key
        and value buffers (B, Hkv, Tk, D) and the mask (B, 1, T, Tk) to add to the scores, in k's
        dtype: 0 where a query may see a key, -inf elsewhere. Tk is T_max, the whole buffers,
        except in an eager step on the CPU (`attended`). The write index and the mask depend on
        the positions only, so layer 0 makes them and the other layers reuse them."""
        B, H, T, D = k.shape
        if B != self.batch_size or H != self.n_kv_head or D != self.head_dim:
            raise ValueError(f"k of shape {tuple(k.shape)} does not fit this cache "
                             f"(B={self.batch_size}, Hkv={self.n_kv_head}, D={self.head_dim})")
        if layer_idx == 0 or self._write_at is None:
            at = (self.pos[:, None] + torch.arange(T, device=k.device)).clamp_(max=self.max_len - 1)  # (B, T)
            self._write_at = (self._slab + at[:, None, :]).reshape(-1)  # (B * Hkv * T,)
            self._seen = self.attended(at)
            # additive, in the queries' dtype: SDPA would otherwise turn a bool mask into this in
            # every layer (a kernel per layer per token)
            hidden = (self._key_pos[: self._seen] > at[:, :, None])[:, None]  # (B, 1, T, Tk)
            self._mask = torch.zeros(hidden.shape, dtype=k.dtype, device=k.device).masked_fill_(hidden, float("-inf"))
        assert self._mask is not None
        keys, values = self.keys[layer_idx], self.values[layer_idx]  # (B, Hkv, T_max, D) each
        keys.view(-1, D).index_copy_(0, self._write_at, k.reshape(-1, D).to(keys.dtype))
        values.view(-1, D).index_copy_(0, self._write_at, v.reshape(-1, D).to(values.dtype))
        if self._seen == self.max_len:
            return keys, values, self._mask
        return keys[:, :, : self._seen], values[:, :, : self._seen], self._mask

    def attended(self, at: torch.Tensor) -> int:
        """How many of the buffer's first positions a step whose queries sit at `at` (B, T)
        attends over: all T_max, except in an eager step on the CPU, where reading the farthest
        position costs no device sync: that position + 1 rounded up to ATTEND_STEP_TOKENS. The
        positions past it are masked for every row, so leaving them out changes no weight. A
        captured or compiled step keeps the whole buffer (its shapes are fixed, and a compiled
        step cannot read a tensor's value into a shape)."""
        if at.device.type != "cpu" or torch.compiler.is_compiling():
            return self.max_len
        reach = int(at.max()) + 1
        return min(self.max_len, -(-reach // ATTEND_STEP_TOKENS) * ATTEND_STEP_TOKENS)

    def advance(self, num_tokens: int) -> None:
        self.pos.add_(num_tokens).clamp_(max=self.max_len - 1)

    # -- what the engine calls --------------------------------------------------------------

    def put_row(self, row: int, source: RowSource) -> None:
        """Make row `row` a copy of the single-row cache `source` (a prompt prefilled on its
        own), position included; what the row held before stays past the new position, masked."""
        self.put_rows(range(row, row + 1), source)

    def put_rows(self, rows: range, source: RowSource) -> None:
        """put_row for each row of the contiguous range `rows` (a prompt sampled many ways)."""
        (n,) = source.row_positions()
        if not (0 <= rows.start and rows.stop <= self.batch_size and rows.step == 1 and len(rows)):
            raise ValueError(f"rows {rows} are not a contiguous range inside this cache of {self.batch_size} rows")
        if n > self.max_len:
            raise ValueError(f"a prompt of {n} positions does not fit this cache of {self.max_len}")
        if source.kv is not None and n:
            for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
                keys[rows.start : rows.stop, :, :n] = source.kv[layer, 0, :1, :, :n]  # broadcast over the rows
                values[rows.start : rows.stop, :, :n] = source.kv[layer, 1, :1, :, :n]
        self.pos[rows.start : rows.stop] = n


@dataclass(frozen=True)
class Sampling:
    """How a step picks the next id: `greedy` (argmax), else softmax(logits / temperature) cut to
    the top_k ids and then to the nucleus of mass top_p (None: no cut). Built by `of`, which
    applies lockstep.infer.sampling's rules (what counts as greedy, the top_p floor)."""

    greedy: bool
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    @classmethod
    def of(cls, temperature: float, top_k: int | None, top_p: float | None) -> Sampling:
        top_p = nucleus_top_p(top_p)
        if is_greedy(temperature):
            return cls(greedy=True)
        return cls(greedy=False, temperature=temperature, top_k=top_k, top_p=top_p)

    def graph_key(self) -> Hashable:
        """What fixes the shapes and ops of a step: the temperature and top_p values are device
        tensors a step reads, so one captured step serves every value of them."""
        return (self.greedy, self.top_k, self.top_p is not None)


def sample_on_device(logits: torch.Tensor, *, top_k: int | None, temperature: torch.Tensor | float,
                     top_p: torch.Tensor | float | None, generator: torch.Generator) -> torch.Tensor:
    """Next ids (B,) drawn from logits (B, V) at a sampling temperature, without reading anything
    back to the host (torch.multinomial reads the probabilities back to check them: a host sync
    per token, and not capturable in a CUDA graph). lockstep.infer.engine.sample_next is this function,
    so both decoding paths draw the same ids from a generator in the same state. In three parts
    (candidates, the uniforms, draw) so that a compiled step can leave the random numbers outside."""
    probs, idx = candidates(logits, top_k=top_k, temperature=temperature, top_p=top_p)
    return draw(probs, idx, uniforms(probs, generator))


def candidates(logits: torch.Tensor, *, top_k: int | None, temperature: torch.Tensor | float,
               top_p: torch.Tensor | float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ids a draw from logits (B, V) chooses among and their probabilities after the top_k and
    top_p cuts (0 for an id the nucleus cuts): (probs, ids), each (B, k), most likely first; with
    no cut, the whole softmax in vocabulary order and ids None (no sort: sorting every row's
    vocabulary was a third of a CPU decode step)."""
    logits = logits.float() / temperature
    if top_k is None and top_p is None:
        return torch.softmax(logits, dim=-1), None
    if top_k is not None and top_k < logits.size(-1):
        vals, idx = torch.topk(logits, top_k, dim=-1)  # (B, k), sorted descending
    else:
        vals, idx = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    probs = torch.softmax(vals, dim=-1)
    if top_p is not None:
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely ids
        probs = probs.masked_fill(before >= top_p, 0.0)  # the top id's is exactly 0 < top_p: it survives
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs, idx


def _cdf_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def uniforms(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One U[0, 1) number per row of probs (B, k): (B, 1), what `draw` turns into an id."""
    return torch.rand(probs.size(0), 1, dtype=_cdf_dtype(probs.device), device=probs.device, generator=generator)


def draw(probs: torch.Tensor, idx: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """The picked ids (B,) by inverse transform: in each row the first candidate whose cumulative
    probability passes u (B, 1) times the row's total, summed in float64 (float32 on MPS) so that
    the smallest probabilities keep their share. A candidate of probability 0 is never picked (its
    cumulative sum equals its predecessor's, and u * total stays below the total). `idx` (B, k)
    maps a candidate's place to its id; None when the candidates are the vocabulary in order."""
    cdf = probs.to(u.dtype).cumsum(dim=-1)  # (B, k)
    total = cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    place = torch.searchsorted(cdf, target, right=True)  # (B, 1)
    return (place if idx is None else idx.gather(-1, place)).squeeze(-1)


class TransposedHead:
    """The lm_head for one row of fp32 decoding on the CPU: x (B, T, C) @ w.T read from a
    contiguous copy of w.T (C, V), which streams the weight in the order a one-row product reads
    it. At d4's 32768 x 256 fp32 head that took 1.2 ms of CPU time per token against 2.8 ms for
    lockstep.model.kernels' weight-on-the-left product and 2.9 ms for F.linear (torch 2.13, one
    thread, this project's 2-core EPYC; at 2 rows and more, and in bf16, the copy was no faster, so
    no step keeps one there: cpu_decode_head). The copy costs the head's memory again; `refresh`
    copies the weight in again when it has changed in place since (an optimiser step, a
    load_state_dict: its version counter moved), so a model being trained decodes with its latest
    weights."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.t = weight.detach().t().contiguous()  # (C, V)
        self._version = weight._version

    def refresh(self) -> None:
        if self.weight._version != self._version:
            self.t.copy_(self.weight.detach().t())
            self._version = self.weight._version

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        return torch.mm(x.reshape(B * T, C), self.t).view(B, T, -1)  # (B, T, V)


def cpu_decode_head(model: nn.Module, rows: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The head a CPU decode step of `rows` rows computes its logits with, where one measured
    faster than the model's own (`model.ops.head`), else None: TransposedHead at one row in fp32,
    F.linear at 2 rows and more in bf16 (at d4, batch 8: 1.7 ms of CPU time per step against 2.8
    ms weight on the left; torch 2.13, one thread, this project's 2-core EPYC). The same logits to
    rounding. None off the CPU and for a model that is not a lockstep GPT."""
    if not hasattr(model, "final_hidden") or model.lm_head.weight.device.type != "cpu":
        return None
    dtype = model.lm_head.weight.dtype
    if dtype == torch.float32 and rows == 1:
        return TransposedHead(model.lm_head.weight)
    if dtype == torch.bfloat16 and rows > 1:
        return F.linear
    return None


# A decode step's parts: greedy (the whole greedy step), candidates, draw; see StaticStep.run.
_Parts = tuple[Callable[[], None], Callable[[], tuple[torch.Tensor, torch.Tensor | None]],
               Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], None]]


class StaticStep:
    """One decode step of fixed shape over a StaticKVCache: reads `tokens` (B, 1) at the cache's
    positions, writes the picked ids to `next_ids` (B,) and also into `tokens`, so the next step
    reads them unless the engine writes other ids there (a forced tool token, a new prompt), and
    advances the positions. Every tensor it reads or writes is allocated here, once. `run()` is the
    step itself (the CPU path, and what a CUDA graph captures), eager unless `compile_step` has
    compiled its parts, and then eager again if the compiled run fails (lockstep.core.fastpath's
    "decode_compiled"); calling the step replays its graph once `capture_graph` has made one, else
    runs it. Autocast is off inside: it computes in the model's weights' dtype, whatever context
    the caller is in."""

    def __init__(self, model: nn.Module, cache: StaticKVCache, sampling: Sampling):
        device = cache.pos.device
        self.model, self.cache, self.sampling, self.device = model, cache, sampling, device
        B = cache.batch_size
        self.tokens = torch.zeros(B, 1, dtype=torch.long, device=device)  # (B, 1) the step's input
        self.next_ids = torch.zeros(B, dtype=torch.long, device=device)  # (B,) the step's output
        self.temperature = torch.ones((), dtype=torch.float32, device=device)
        self.top_p = torch.ones((), dtype=torch.float32, device=device)
        self.generator = torch.Generator(device=device)
        self.replay: Callable[[], None] | None = None  # set by capture_graph
        self._compiled_parts: _Parts | None = None  # _greedy, _candidates, _draw through torch.compile: compile_step
        # What a compiled run starts from, copied in before it (outside a capture): a run that fails
        # after its forward advanced the positions and wrote `tokens` is put back to this before
        # the eager run repeats the step. next_ids needs no copy: the eager run rewrites all of it.
        self._pos_before = torch.zeros_like(cache.pos)  # (B,)
        self._tokens_before = torch.zeros_like(self.tokens)  # (B, 1)
        # the sampling's graph key, fixed for the step's life: what the compiled parts read
        self._top_k, self._nucleus = sampling.top_k, sampling.top_p is not None
        self._head = cpu_decode_head(model, B)  # None: the model's own forward

    @property
    def compiled(self) -> bool:
        """Whether compile_step has compiled the step's parts (they compile at its first run)."""
        return self._compiled_parts is not None

    @property
    def batch_size(self) -> int:
        return self.cache.batch_size

    @property
    def key(self) -> tuple[int, int, Hashable]:
        """What decides whether a request can use this step: (rows, cache length, sampling key)."""
        return (self.cache.batch_size, self.cache.max_len, self.sampling.graph_key())

    def set_sampling(self, sampling: Sampling, seed: int) -> None:
        """Take this request's temperature and top_p (same graph key) and reseed the generator."""
        if sampling.graph_key() != self.sampling.graph_key():
            raise ValueError(f"sampling {sampling} needs another step than this one's {self.sampling}")
        self.sampling = sampling
        self.temperature.fill_(sampling.temperature)
        self.top_p.fill_(1.0 if sampling.top_p is None else sampling.top_p)
        self.generator.manual_seed(seed)
        if isinstance(self._head, TransposedHead):
            self._head.refresh()

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Next ids (B,) from logits (B, V) under this step's sampling, on the device."""
        s = self.sampling
        if s.greedy:
            return logits.argmax(dim=-1)
        return sample_on_device(logits, top_k=s.top_k, temperature=self.temperature,
                                top_p=self.top_p if s.top_p is not None else None, generator=self.generator)

    def run(self) -> None:
        """pick(forward(tokens)) into next_ids and tokens: one part when greedy, else the
        candidates, the uniforms from the step's generator, and the draw. The uniforms stay outside the
        parts compile_step compiles: dynamo does not trace a torch.Generator argument, and
        inductor would draw from its own philox stream rather than this generator.

        Compiled, the run goes through lockstep.core.fastpath's "decode_compiled": when the compiled
        run raises (a compile that fails, or a part that fails after an earlier one ran), the
        positions and `tokens` are put back, the eager run repeats the step with the uniforms the
        compiled run drew (the generator has moved past them), and every later run in this
        process is eager, so the step's result is the eager step's. That costs two copies of a few
        integers per token outside a capture (see _run_compiled); a replayed graph runs none of
        this Python."""
        with torch.autocast(self.device.type, enabled=False):
            compiled = self._compiled_parts
            if compiled is None:
                self._run_parts(self._eager_parts(), [])
            elif capturing(self.device):
                # The graph records the path in use as it is. No copies for an undo (they would be
                # recorded, and replayed with every token), and no eager rerun after a failed
                # compiled part (the replays would run the failed part's recorded kernels and the
                # rerun's both): a failure fails the capture, whose caller keeps the step uncaptured.
                self._run_parts(compiled if fastpath.enabled("decode_compiled") else self._eager_parts(), [])
            else:
                self._run_compiled(compiled)

    def _run_compiled(self, compiled: _Parts) -> None:
        # The undo's two copies into the step's own buffers (no allocation) took 1.5 us and
        # fastpath.call's bookkeeping 3-5 us on the 2-core CPU, against 1.0-1.7 ms for a step of the
        # tests' 2-layer model at 8 rows (aot_eager, torch 2.13): under 0.5%. On a GPU the copies
        # are two small launches, and a replayed graph runs neither.
        undo = fastpath.enabled("decode_compiled")
        if undo:
            self._pos_before.copy_(self.cache.pos)
            self._tokens_before.copy_(self.tokens)
        drawn: list[torch.Tensor] = []  # the uniforms the compiled run drew, for the eager rerun

        def eager() -> None:
            if undo:  # the compiled run failed, maybe part way: start the step again from its inputs
                self.cache.pos.copy_(self._pos_before)
                self.tokens.copy_(self._tokens_before)
            self._run_parts(self._eager_parts(), drawn)

        fastpath.call("decode_compiled", lambda: self._run_parts(compiled, drawn), eager)

    def _eager_parts(self) -> _Parts:
        return self._greedy, self._candidates, self._draw

    def _run_parts(self, parts: _Parts, drawn: list[torch.Tensor]) -> None:
        """One run through the given parts (eager or compiled). A sampled run draws its uniforms
        into `drawn`, or reuses the ones there: those a failed compiled run of this step drew,
        which the eager step would have drawn from the generator in the same state."""
        greedy_part, candidates_part, draw_part = parts
        if self.sampling.greedy:
            greedy_part()
            return
        probs, idx = candidates_part()  # (B, k) each
        if not drawn:
            drawn.append(uniforms(probs, self.generator))
        draw_part(probs, idx, drawn[0])

    # The parts of run() that compile_step compiles. Of the sampling they read the graph key's
    # fixed copy only: dynamo guards on every Python value a part reads, and reading
    # self.sampling.top_p recompiled the step for each new top_p (TORCH_LOGS=recompiles).

    def _logits(self) -> torch.Tensor:
        if self._head is None:
            return self.model(self.tokens, kv_cache=self.cache)[:, -1, :]  # (B, V)
        # the model's forward with this step's head (cpu_decode_head) in place of model.ops.head
        m = self.model
        x = m.final_hidden(self.tokens, self.cache)  # (B, 1, C)
        return capped_logits(self._head, x, m.lm_head.weight, m.config.softcap, m.config.vocab_size)[:, -1, :]

    def _greedy(self) -> None:
        self._emit(self._logits().argmax(dim=-1))

    def _candidates(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return candidates(self._logits(), top_k=self._top_k, temperature=self.temperature,
                          top_p=self.top_p if self._nucleus else None)

    def _draw(self, probs: torch.Tensor, idx: torch.Tensor | None, u: torch.Tensor) -> None:
        self._emit(draw(probs, idx, u))

    def _emit(self, ids: torch.Tensor) -> None:
        self.next_ids.copy_(ids)
        self.tokens.copy_(ids[:, None])

    def __call__(self) -> None:
        if self.replay is not None:
            self.replay()
        else:
            self.run()


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on `device`'s current stream (never, off CUDA: a
    CPU-only torch has no capture to ask about, and its query raises)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@functools.cache
def isolated_recompiles() -> dict[str, bool]:
    """torch.compile's keyword that gives each compiled step its own recompile budget, where this
    torch has it ({} where not: torch 2.11 has no `isolate_recompiles`). Without it an engine's
    steps share dynamo's recompile limit, and a step past it runs uncompiled (dynamo warns)."""
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        return {"isolate_recompiles": True}
    limit = getattr(torch._dynamo.config, "recompile_limit", None)
    logging.getLogger(__name__).warning(
        "torch %s's torch.compile has no isolate_recompiles: compiled decode steps share dynamo's recompile "
        "limit (%s); a step past it runs uncompiled", torch.__version__, limit)
    return {}


def compile_step(step: StaticStep, *, backend: str | Callable = "inductor") -> StaticStep:
    """Make `step.run()` go through torch.compile (fullgraph, static shapes, default mode: the CUDA
    graph is capture_graph's, not inductor's), so its elementwise work (rotary, RMSNorm, soft cap,
    mask, sampling math) runs in fused kernels: a d12 greedy step's 425 eager ops (views aside)
    became 135 kernel calls in inductor's CPU code, 85 of them its matmuls and attentions (torch
    2.13; not yet counted on a GPU). Compiles nothing yet: the first run() compiles
    (capture_graph's warm-up, on CUDA), and the step then runs the compiled code for its life,
    which recompiles nothing (its shapes never change; the parts read no value that set_sampling
    changes). Each step's compiled code is its own (isolate_recompiles, where this torch has it),
    so an engine's many steps do not add up to dynamo's recompile limit. The cache's buffers are
    attributes the compiled parts mutate in place (inductor keeps an index_copy_ into a whole input
    tensor in place, not into a view: see StaticKVCache). The eager parts stay beside the
    compiled ones, for the fallback (StaticStep.run). Compile before capture_graph. Returns the
    step."""
    if step.replay is not None:
        raise ValueError("compile_step must come before capture_graph: the captured graph runs the step as it was")
    if not step.compiled:
        opts = dict(fullgraph=True, dynamic=False, backend=backend, **isolated_recompiles())
        step._compiled_parts = (torch.compile(step._greedy, **opts), torch.compile(step._candidates, **opts),
                                torch.compile(step._draw, **opts))
    return step


class GraphBackend(Protocol):
    """How capture_graph warms up and captures a step: CudaGraphs on a GPU; tests pass a stand-in
    to check the wrapper's logic on the CPU."""

    def check(self, device: torch.device) -> None: ...

    def warm_up(self, fn: Callable[[], None], steps: int, device: torch.device) -> None: ...

    def capture(self, fn: Callable[[], None], generator: torch.Generator | None,
                device: torch.device) -> Callable[[], None]: ...


# torch allows one capture at a time per process; the server generates on several threads.
_CAPTURE_LOCK = threading.Lock()


class CudaGraphs:
    """torch.cuda graphs: the eager runs on a side stream (as capture needs), then one capture
    per step in its own memory pool (steps are replayed in any order and from several threads,
    which a shared pool does not allow), with the step's generator registered where torch asks for
    it (register_generator), so each replay draws fresh numbers from it."""

    # Set once a register_generator_state call has warned of its deprecation in this process.
    registration_deprecated = False

    def check(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {device}; decode with the "
                             "eager static step there (Engine(..., cuda_graphs=False)), or move the model to cuda")
        if not torch.cuda.is_available():
            raise ValueError("CUDA graphs need a CUDA device, and torch sees none")

    def warm_up(self, fn: Callable[[], None], steps: int, device: torch.device) -> None:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(steps):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)

    def capture(self, fn: Callable[[], None], generator: torch.Generator | None,
                device: torch.device) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            self.register_generator(graph, generator)
        # thread_local: work that other server threads run meanwhile does not break the capture
        with torch.cuda.device(device), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
        return graph.replay

    def register_generator(self, graph: torch.cuda.CUDAGraph, generator: torch.Generator) -> None:
        """Tell `graph` that its capture draws from `generator`, where this torch wants to be told.
        torch 2.3 to 2.13 must be told (CUDAGraph.register_generator_state), or the capture's
        draws do not come from the generator's state at each replay; torch 2.14 registers a
        generator at its first draw in a capture and made the call a deprecated no-op that warns
        at every call (pytorch/pytorch#176753); a later torch drops it. Decided by what the graph
        has and says, never by torch's version: no call where the method is gone or marked
        deprecated (PEP 702's `__deprecated__`), and none after a call has warned of its
        deprecation through Python's warnings (the rest of the process), which is logged once
        instead. A warning that torch prints from C++ without Python's warnings seeing it cannot
        be told apart; then each sampled step's capture prints it (a greedy step registers
        nothing), as many times as there are sampled step shapes."""
        register = getattr(graph, "register_generator_state", None)
        if register is None or getattr(register, "__deprecated__", None) or type(self).registration_deprecated:
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            register(generator)
        deprecation = [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))]
        for w in caught:
            if w not in deprecation:  # any other warning is not ours to hide
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if deprecation:
            type(self).registration_deprecated = True
            said = str(deprecation[0].message).strip().partition("\n")[0]
            logging.getLogger(__name__).info(
                "torch's CUDAGraph.register_generator_state is deprecated here (%s); a capture registers the "
                "generators it draws from by itself, so the decode steps' later captures skip the call", said)


def capture_graph(step: StaticStep, *, backend: GraphBackend | None = None,
                  warmup_steps: int = GRAPH_WARMUP_STEPS) -> StaticStep:
    """Make `step` replay a CUDA graph of its `run()`: a few eager warm-up runs, whose moves are
    undone (positions and input restored; the slots they wrote lie past every row's position,
    where the mask hides them until real steps overwrite them), then one capture, given the step's
    generator when it samples (a greedy step draws nothing). The step's buffers are the graph's
    inputs and outputs; a replay reads and writes them in place, so nothing is allocated per
    token. A warm-up or capture that raises leaves the step as it was, uncaptured, positions and
    input restored, and the error propagates. Refuses (ValueError) a step that is not on a CUDA
    device. Returns the step."""
    backend = backend if backend is not None else CudaGraphs()
    backend.check(step.device)
    with _CAPTURE_LOCK:
        pos, tokens = step.cache.pos.clone(), step.tokens.clone()
        try:
            backend.warm_up(step.run, warmup_steps, step.device)
            generator = None if step.sampling.greedy else step.generator
            replay = backend.capture(step.run, generator, step.device)  # records, runs nothing
        finally:
            step.cache.pos.copy_(pos)
            step.tokens.copy_(tokens)
        step.replay = replay
    return step


class StepPool:
    """The steps an engine has built, by (batch rows, cache length, sampling graph key): a request
    takes one for its whole length (`acquire`) and gives it back (`release`), so concurrent
    requests never share buffers, and a later request of the same shape reuses it (its cache and
    graph included) instead of allocating. At most MAX_IDLE_STEPS idle steps are kept."""

    def __init__(self, make: Callable[[int, int, Sampling], StaticStep], max_idle: int = MAX_IDLE_STEPS):
        self._make = make
        self._max_idle = max_idle
        self._idle: OrderedDict[tuple[Hashable, int], StaticStep] = OrderedDict()
        self._lock = threading.Lock()
        self._serial = 0
        self.built = 0  # steps made so far (a test reads it to see reuse)

    def acquire(self, batch_size: int, cache_len: int, sampling: Sampling) -> StaticStep:
        key = (batch_size, cache_len, sampling.graph_key())
        with self._lock:
            for slot in reversed(self._idle):
                if slot[0] == key:
                    return self._idle.pop(slot)
        step = self._make(batch_size, cache_len, sampling)
        with self._lock:
            self.built += 1
        return step

    def release(self, step: StaticStep) -> None:
        with self._lock:
            self._serial += 1
            self._idle[(step.key, self._serial)] = step
            while len(self._idle) > self._max_idle:
                self._idle.popitem(last=False)


class DecodeWeights:
    """The model an engine's static path decodes with: the model itself when its weights are in
    the decode dtype, else a copy of it in that dtype (bf16 weights for a model trained in fp32:
    a decode step reads every weight once per token, so 2-byte weights halve the bytes, and no
    cast runs per step). `current()` copies the live weights into it first, in place (the CUDA
    graphs keep their addresses), so a model being trained (RL) decodes with its latest weights."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None):
        self.model = model
        self.dtype = dtype
        self._copy: nn.Module | None = None

    def current(self) -> nn.Module:
        """The decode model with the live weights (copied in first when it is a copy)."""
        if self.dtype is None or weights_dtype(self.model) == self.dtype:
            return self.model
        with torch.no_grad():
            if self._copy is None:
                self._copy = copy.deepcopy(self.model)
                for p in self._copy.parameters():
                    p.requires_grad_(False)
                    p.grad = None
                    if p.is_floating_point():
                        p.data = p.data.to(self.dtype)
                self._copy.eval()
            else:
                for dst, src in zip(self._copy.parameters(), self.model.parameters(), strict=True):
                    dst.copy_(src)
            if hasattr(self.model, "ops"):
                self._copy.ops = self.model.ops  # follow GPT.use_kernels
        return self._copy

    def last(self) -> nn.Module:
        """The decode model as `current()` last returned it, without copying the weights again."""
        return self.model if self._copy is None else self._copy
