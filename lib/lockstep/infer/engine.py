"""KV-cache engine: batched sampling from a GPT with the calculator tool's output forced into
the stream, either one prompt sampled many ways (`Engine.generate`) or many prompts decoded
together, greedily or sampled (`Engine.generate_many`: evaluation, RL's rollouts). Token ids in, token ids out; it
knows nothing about chat templates or text beyond decoding a tool call and encoding its result.
Each loop comes twice: the reference, over the growing KVCache here, and the fast path
(`Engine(fast=True)`) over lockstep.infer.decode's static cache and device-side step, CUDA-graphed on a
GPU; they share the row state and the tool handling, which are easiest to check side by side."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lockstep.core import fastpath
from lockstep.infer.calculator import NO_RESULT, evaluate
from lockstep.infer.cpu_step import CpuStep
from lockstep.infer.decode import (
    DecodeWeights,
    Sampling,
    StaticKVCache,
    StaticStep,
    StepPool,
    cache_tokens,
    capture_graph,
    compile_step,
    sample_on_device,
    step_rows,
    weights_dtype,
)
from lockstep.infer.sampling import UNSCALED_TEMPERATURE, check_temperature, check_top_p, is_greedy, nucleus_top_p
from lockstep.model.gpt import GPT

if TYPE_CHECKING:
    from lockstep.tokenizer import Tokenizer

# Cache rows grow in steps of this many positions when a sequence outruns them.
CACHE_GROW_TOKENS = 128


class KVCache:
    """Keys and values of every layer in one tensor `(n_layer, 2, B, n_kv_head, T_cap, D)`,
    allocated on the first update with that update's dtype and device, and grown (copying) when
    a row would pass `T_cap`, never beyond `max_len` (the model's context). Each row has its own
    position; rows that share one take the cheap path (slices, no mask)."""

    def __init__(
        self, *, batch_size: int, n_layer: int, n_kv_head: int, head_dim: int, max_len: int, capacity_tokens: int = 0
    ):
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size} must be positive")
        self.batch_size = batch_size
        self.n_layer = n_layer
        self.n_kv_head = n_kv_head
        self.head_dim = head_dim
        self.max_len = max_len
        self.capacity_tokens = min(max(capacity_tokens, 1), max_len)
        self.kv: torch.Tensor | None = None  # (L, 2, B, Hkv, T_cap, D) once allocated
        self._pos = [0] * batch_size  # next position per row

    @classmethod
    def for_model(cls, model: GPT, batch_size: int, capacity_tokens: int = 0) -> KVCache:
        c = model.config
        return cls(
            batch_size=batch_size,
            n_layer=c.n_layer,
            n_kv_head=c.n_kv_head,
            head_dim=c.head_dim,
            max_len=c.sequence_len,
            capacity_tokens=capacity_tokens,
        )

    # -- what the model calls ---------------------------------------------------------------

    def positions(self) -> torch.Tensor | int:
        """The shared position when all rows agree, else a (B,) int64 tensor of positions."""
        first = self._pos[0]
        if all(p == first for p in self._pos):
            return first
        return torch.tensor(self._pos, dtype=torch.long)

    def update(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store k, v (B, Hkv, T, D) at each row's next T positions; return this layer's keys and
        values so far (B, Hkv, Tk, D) and the attention mask (B or 1, 1, T, Tk) of bool, or None
        when all rows share a position and plain causal alignment holds (prefill from 0, or a
        single new token that sees every cached key)."""
        B, H, T, D = k.shape
        if B != self.batch_size or H != self.n_kv_head or D != self.head_dim:
            raise ValueError(
                f"k of shape {tuple(k.shape)} does not fit this cache "
                f"(B={self.batch_size}, Hkv={self.n_kv_head}, D={self.head_dim})"
            )
        end = max(self._pos) + T
        if self.kv is None or end > self.kv.size(4):
            self._reserve(end, k)
        kv = self.kv
        assert kv is not None
        pos = self.positions()
        if isinstance(pos, int):
            kv[layer_idx, 0, :, :, pos : pos + T] = k
            kv[layer_idx, 1, :, :, pos : pos + T] = v
            mask = None
            if pos > 0 and T > 1:
                q_pos = pos + torch.arange(T, device=k.device)  # (T,)
                mask = (torch.arange(end, device=k.device)[None, :] <= q_pos[:, None])[None, None]  # (1, 1, T, Tk)
        else:
            pos = pos.to(k.device)
            if T == 1:  # decoding: one scatter per layer rather than a copy per row
                rows = torch.arange(B, device=k.device)
                kv[layer_idx, 0, rows, :, pos] = k[:, :, 0]  # (B, Hkv, D) at (row, pos[row])
                kv[layer_idx, 1, rows, :, pos] = v[:, :, 0]
            else:
                for b, p in enumerate(self._pos):
                    kv[layer_idx, 0, b, :, p : p + T] = k[b]
                    kv[layer_idx, 1, b, :, p : p + T] = v[b]
            q_pos = pos[:, None] + torch.arange(T, device=k.device)  # (B, T)
            mask = (torch.arange(end, device=k.device)[None, None, :] <= q_pos[:, :, None])[:, None]  # (B, 1, T, Tk)
        return kv[layer_idx, 0, :, :, :end], kv[layer_idx, 1, :, :, :end], mask

    def advance(self, num_tokens: int) -> None:
        self._pos = [p + num_tokens for p in self._pos]

    # -- what the engine calls --------------------------------------------------------------

    def row_positions(self) -> list[int]:
        return list(self._pos)

    def _reserve(self, needed_tokens: int, like: torch.Tensor) -> None:
        if needed_tokens > self.max_len:
            raise ValueError(
                f"a row would reach position {needed_tokens}, past the model's context of {self.max_len} tokens"
            )
        cap = max(self.capacity_tokens, needed_tokens)
        if self.kv is not None:
            # grow geometrically-ish so a long generation reallocates a handful of times
            cap = max(cap, self.kv.size(4) + CACHE_GROW_TOKENS)
        cap = min(cap, self.max_len)
        shape = (self.n_layer, 2, self.batch_size, self.n_kv_head, cap, self.head_dim)
        # zeros, not empty: slots a row has not reached are masked out of attention, but a masked
        # weight of 0 times a garbage NaN still makes NaN (and deterministic mode fills empty
        # memory with NaN on purpose)
        new = torch.zeros(shape, dtype=like.dtype, device=like.device)
        if self.kv is not None:
            used = max(self._pos)
            new[:, :, :, :, :used] = self.kv[:, :, :, :, :used]
        self.kv = new
        self.capacity_tokens = cap

    def replicate(self, num_rows: int, capacity_tokens: int = 0) -> KVCache:
        """A new cache of `num_rows` rows, each a copy of this single-row cache (a prompt prefilled
        once, then sampled many ways), with room for `capacity_tokens` positions."""
        if self.batch_size != 1:
            raise ValueError(f"replicate() needs a single-row cache, this one has {self.batch_size} rows")
        return KVCache.stack([self] * num_rows, capacity_tokens)

    def put_row(self, row: int, source: KVCache) -> None:
        """Make row `row` a copy of the single-row cache `source` (a prompt prefilled on its own),
        position included, growing this cache when `source` is longer. Whatever the row held
        before stays in memory past the new position, where the attention mask hides it."""
        if source.batch_size != 1:
            raise ValueError(f"put_row() needs a single-row source, this one has {source.batch_size} rows")
        if not 0 <= row < self.batch_size:
            raise ValueError(f"row {row} is outside this cache of {self.batch_size} rows")
        n = source._pos[0]
        if source.kv is not None and n:
            if self.kv is None or n > self.kv.size(4):
                self._reserve(n, source.kv)
            assert self.kv is not None
            self.kv[:, :, row, :, :n] = source.kv[:, :, 0, :, :n]
        self._pos[row] = n

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only `rows`, in the order given, so finished rows stop costing work. When each
        kept row either stays where it is or comes from past the kept range (the engine fills a
        finished row's place with the last row), the rest moves in place, one row copy per moved
        row, and the cache shrinks to a view; any other order copies the whole cache."""
        rows = list(rows)
        if not rows:
            raise ValueError("keep_rows() needs at least one row to keep")
        if len(set(rows)) != len(rows) or not all(0 <= r < self.batch_size for r in rows):
            raise ValueError(f"keep_rows() needs distinct rows in 0..{self.batch_size - 1}, got {rows}")
        n = len(rows)
        if self.kv is not None:
            if all(r == i or r >= n for i, r in enumerate(rows)):
                for i, r in enumerate(rows):
                    if r != i:
                        self.kv[:, :, i] = self.kv[:, :, r]
                self.kv = self.kv[:, :, :n]
            else:
                self.kv = self.kv.index_select(2, torch.tensor(rows, dtype=torch.long, device=self.kv.device))
        self._pos = [self._pos[r] for r in rows]
        self.batch_size = n

    @classmethod
    def stack(cls, caches: Sequence[KVCache], capacity_tokens: int = 0) -> KVCache:
        """One cache whose rows are the rows of `caches` in order, keeping each row's position
        (so prompts of different lengths can decode together)."""
        if not caches:
            raise ValueError("stack() needs at least one cache")
        first = caches[0]
        rows = sum(c.batch_size for c in caches)
        used = max(max(c._pos) for c in caches)
        out = cls(
            batch_size=rows,
            n_layer=first.n_layer,
            n_kv_head=first.n_kv_head,
            head_dim=first.head_dim,
            max_len=first.max_len,
            capacity_tokens=max(capacity_tokens, used),
        )
        out._pos = [p for c in caches for p in c._pos]
        if all(c.kv is None for c in caches):
            return out
        like = next(c.kv for c in caches if c.kv is not None)
        assert like is not None
        shape = (first.n_layer, 2, rows, first.n_kv_head, out.capacity_tokens, first.head_dim)
        out.kv = torch.zeros(shape, dtype=like.dtype, device=like.device)  # zeros: see _reserve
        b = 0
        for c in caches:
            n = max(c._pos)
            if c.kv is not None and n:
                out.kv[:, :, b : b + c.batch_size, :, :n] = c.kv[:, :, :, :, :n]
            b += c.batch_size
        return out


@dataclass
class _Row:
    """Tool-call state of one sampled row."""

    forced: deque[int] = field(default_factory=deque)
    in_python: bool = False
    python_ids: list[int] = field(default_factory=list)
    done: bool = False


@dataclass
class _Reply(_Row):
    """One prompt of `Engine.generate_many` while it decodes in a cache row."""

    index: int = 0          # the prompt's place in the caller's list
    budget: int = 0         # max_tokens of this prompt
    feed: int = 0           # the token the next forward pass reads for this row
    ids: list[int] = field(default_factory=list)
    masks: list[int] = field(default_factory=list)  # 1 sampled, 0 forced by the tool


@dataclass
class _Prefill:
    """The latest prompt `Engine.generate_many` prefilled (all but its last token) and its
    single-row cache, which the next row copies when its prompt is the same."""

    ids: list[int] = field(default_factory=list)
    cache: KVCache | None = None


def sample_next(
    logits: torch.Tensor, *, temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator
) -> torch.Tensor:
    """Next ids (B,) from logits (B, V): argmax at temperature 0 (or below
    sampling.GREEDY_TEMPERATURE), else a draw from softmax(logits / temperature) restricted to the
    top_k ids and then to the smallest set whose probability reaches top_p (a top_p below
    sampling.TOP_P_FLOOR keeps the top id alone): lockstep.infer.decode.sample_on_device, one uniform
    number per row from `generator`."""
    top_p = nucleus_top_p(top_p)  # refuses a top_p outside (0, 1] before the greedy shortcut too
    if is_greedy(temperature):
        return logits.argmax(dim=-1)
    return sample_on_device(logits, top_k=top_k, temperature=temperature, top_p=top_p, generator=generator)


def _fill_from_the_end(alive: Sequence[bool]) -> list[int]:
    """The rows to keep, ordered so that each finished row's place goes to the last live row
    (KVCache.keep_rows then moves rows in place): alive [T, F, T, T] -> [0, 3, 2]."""
    keep = [i for i, a in enumerate(alive) if a]
    n = len(keep)
    tail = [i for i in keep if i >= n]
    return [i if i in keep else tail.pop() for i in range(n)]


def decode_settings(device: torch.device, dtype: torch.dtype, kernels: bool, compile: bool = False) -> dict[str, Any]:
    """The Engine keywords for a run on `device` computing in `dtype` with `runtime.kernels` and
    `runtime.compile`: on CUDA, the static-cache, CUDA-graphed fast path when kernels is on, its
    step compiled when compile is on too, and bf16 decoding when the run computes in bf16; on the
    CPU, the reference path in the model's own dtype (or the caller's autocast), its decode step
    lockstep.infer.cpu_step's when kernels is on."""
    on_cuda = device.type == "cuda"
    fast = kernels and on_cuda
    return {"fast": fast, "dtype": torch.bfloat16 if on_cuda and dtype == torch.bfloat16 else None,
            "compile_step": fast and compile, "cpu_step": kernels and device.type == "cpu"}


class Engine:
    """Samples completions of one prompt from a GPT: the prompt is prefilled once, its cache
    copied to `num_samples` rows, and the rows decoded together; or decodes many prompts in one
    batch (`generate_many`, greedily `generate_greedy`). Of the tokenizer it uses the special ids
    (`encode_special`) and, for tool calls, `decode` and `encode`.

    `fast` decodes through lockstep.infer.decode: a preallocated cache, sampling on the device, one host
    read per step (the stop and tool check), the step replayed from a CUDA graph when the model is
    on CUDA (`cuda_graphs`, None = there and only there; a capture that fails leaves that step and
    every later one in the process uncaptured: lockstep.core.fastpath's "cuda_graphs" alone says
    whether captures are still made); greedy tokens equal the reference's in fp32, sampled ones
    too on the CPU for the same seed (tests/test_static_cache.py). `dtype`
    (bf16, or None for the model's own) is what decoding computes in: the reference path runs
    under autocast to it, the fast path with a copy of the weights in it, refreshed from the model
    at every call. A fast engine reuses its steps across calls and serves concurrent calls, each
    on its own step; the weights copy assumes they do not change while a call decodes.
    `compile_step` runs each step through torch.compile (lockstep.infer.decode.compile_step) before it
    is captured: fewer, fused kernels per token, the same tokens to rounding (exactly, under
    aot_eager on the CPU), at the price of a compile per new step (batch rows, cache length,
    sampling graph key): 3-17 s with its first run on a 2-core CPU (bench/bench_decode.py). A
    compile that fails does not end the call: the step runs eagerly instead, for the rest of the
    process, recorded in lockstep.core.fastpath's facts ("decode_compiled").

    `cpu_step` (reference path, model on the CPU) decodes each token through
    lockstep.infer.cpu_step.CpuStep instead of the model's forward: the same logits to rounding in
    fewer, cheaper ops, greedy tokens equal in fp32 (tests/test_cpu_step.py). A step that raises is
    answered by the model's forward, for the rest of the process ("cpu_decode_step")."""

    STOP_TOKENS = ("<|assistant_end|>", "<|bos|>")

    def __init__(self, model: GPT, tokenizer: Tokenizer, *, fast: bool = False, dtype: torch.dtype | None = None,
                 cuda_graphs: bool | None = None, compile_step: bool = False, cpu_step: bool = False):
        self.model = model
        self.tokenizer = tokenizer
        sp = tokenizer.encode_special
        self.stop_ids = frozenset(sp(name) for name in self.STOP_TOKENS)
        self.assistant_end_id = sp("<|assistant_end|>")
        self.python_start_id = sp("<|python_start|>")
        self.python_end_id = sp("<|python_end|>")
        self.output_start_id = sp("<|output_start|>")
        self.output_end_id = sp("<|output_end|>")
        if dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype={dtype} must be None (the model's own) or a 16-bit float to decode in, "
                             "e.g. torch.bfloat16")
        if (cuda_graphs is not None or compile_step) and not fast:
            raise ValueError("cuda_graphs and compile_step apply to the fast path only; pass fast=True with them")
        self.fast = fast
        self.compile_step = compile_step
        self.dtype = dtype
        self.cuda_graphs = self._device().type == "cuda" if cuda_graphs is None else cuda_graphs
        if fast and self.cuda_graphs and self._device().type != "cuda":
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, it is on {self._device()}; leave "
                             "cuda_graphs unset (None) to capture graphs on CUDA only")
        if cpu_step and (fast or self._device().type != "cpu"):
            raise ValueError(f"cpu_step decodes on the reference path with the model on the CPU (fast={fast}, model on "
                             f"{self._device()}); drop cpu_step, or pass fast=False with the model on the CPU")
        self._cpu_step = CpuStep(model) if cpu_step else None
        self._weights = DecodeWeights(model, dtype)
        self._pool = StepPool(self._make_step)

    def _make_step(self, batch_size: int, cache_len: int, sampling: Sampling) -> StaticStep:
        with torch.inference_mode():
            model = self._weights.last()  # the caller has just refreshed it
            step = StaticStep(model, StaticKVCache.for_model(model, batch_size, cache_len), sampling)
            if self.compile_step:
                # compiles at the step's first run (capture_graph's warm-up on CUDA), where a compile
                # that fails falls back to the eager step (lockstep.core.fastpath's "decode_compiled")
                compile_step(step)
            if not self.cuda_graphs:
                return step
            # A capture that fails (an op that cannot be captured, a torch whose graph API moved)
            # leaves this step and every later one uncaptured: the same tokens, launched op by op.
            return fastpath.call("cuda_graphs", lambda: capture_graph(step), lambda: step)

    def _reference_precision(self) -> contextlib.AbstractContextManager:
        """Autocast to `dtype` for the reference path, where one was asked for and the weights are
        not already in it."""
        if self.dtype is None or weights_dtype(self.model) == self.dtype:
            return contextlib.nullcontext()
        return torch.autocast(self._device().type, dtype=self.dtype)

    def _device(self) -> torch.device:
        return self.model.rotary_cos.device

    def _next_logits(self, col: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The reference path's logits (B, V) of one new token per row, col (B, 1)."""
        def forward() -> torch.Tensor:
            return self.model(col, kv_cache=cache)[:, -1, :]

        if self._cpu_step is None:
            return forward()
        step = self._cpu_step
        return fastpath.call("cpu_decode_step", lambda: step(col, cache), forward)

    def _check(
        self, prompt_ids: Sequence[int], num_samples: int, max_tokens: int, temperature: float, top_k, top_p
    ) -> None:
        limit = self.model.config.sequence_len
        vocab = self.model.config.vocab_size
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids is empty: pass at least one token (e.g. <|bos|>)")
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_ids):
            raise ValueError(f"prompt_ids must be ints in [0, {vocab}) for this model's vocabulary")
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be >= 1")
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be >= 1")
        if len(prompt_ids) + max_tokens > limit:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens={max_tokens} exceeds the model's context of {limit} "
                f"tokens: lower max_tokens to {max(limit - len(prompt_ids), 0)} or shorten the prompt"
            )
        check_temperature(temperature)
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k} must be >= 1 or None")
        if top_p is not None:
            check_top_p(top_p)

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        num_samples: int = 1,
        max_tokens: int,
        temperature: float = UNSCALED_TEMPERATURE,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        use_tools: bool = True,
    ) -> Iterator[tuple[list[int], list[int]]]:
        """Yield one `(tokens, masks)` column per step, each a list of `num_samples` ints: the
        next token of every row, and 1 where it was sampled, 0 where it was forced (a tool
        result) or where the row has already finished (its column entry then repeats
        <|assistant_end|>). A row finishes on <|assistant_end|> or <|bos|> (that token is
        yielded); the generator ends when every row has finished or after `max_tokens` steps,
        tool tokens included. Stopping early is just ceasing to iterate: no work is done ahead
        of the consumer.

        A tool call is the text between <|python_start|> and <|python_end|>; the engine then
        forces `<|output_start|> value <|output_end|>`, where value is
        `lockstep.infer.calculator.evaluate(text)` or, when it refuses, `calculator.NO_RESULT`
        ("no result"). Rows draw from one `torch.Generator` seeded with `seed`; temperature 0 (and
        any below sampling.GREEDY_TEMPERATURE) is greedy and needs no randomness."""
        prompt_ids = list(prompt_ids)
        self._check(prompt_ids, num_samples, max_tokens, temperature, top_k, top_p)
        steps = self._fast_steps if self.fast else self._steps
        return steps(prompt_ids, num_samples, max_tokens, temperature, top_k, top_p, seed, use_tools)

    def _steps(self, prompt_ids, num_samples, max_tokens, temperature, top_k, top_p, seed, use_tools):
        # A separate generator function so that argument errors raise at the call, not at the
        # first next().
        with torch.inference_mode(), self._reference_precision():
            device = self._device()
            generator = torch.Generator(device=device).manual_seed(seed)
            total = len(prompt_ids) + max_tokens
            prefill = KVCache.for_model(self.model, 1, capacity_tokens=len(prompt_ids))
            ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # (1, T)
            logits = self.model(ids, kv_cache=prefill)[:, -1, :]  # (1, V)
            cache = prefill.replicate(num_samples, capacity_tokens=total)
            del prefill
            logits = logits.expand(num_samples, -1)  # (B, V)
            rows = [_Row() for _ in range(num_samples)]
        for step in range(max_tokens):
            with torch.inference_mode():
                sampled = sample_next(
                    logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
                ).tolist()
            tokens, masks = [], []
            for row, tok in zip(rows, sampled):
                if row.done:
                    tokens.append(self.assistant_end_id)
                    masks.append(0)
                    continue
                tok, m = self._emit(row, tok, use_tools)
                tokens.append(tok)
                masks.append(m)
            yield tokens, masks
            if step + 1 == max_tokens or all(r.done for r in rows):
                return
            with torch.inference_mode(), self._reference_precision():
                col = torch.tensor(tokens, dtype=torch.long, device=device)[:, None]  # (B, 1)
                logits = self._next_logits(col, cache)  # (B, V)

    def _fast_steps(self, prompt_ids, num_samples, max_tokens, temperature, top_k, top_p, seed, use_tools):
        """`_steps` on the fast path. The prompt is prefilled by the plain forward and copied into
        every row of a static step's cache; the first column is sampled from its logits, every
        later one by the step, which feeds each row its own pick back. The host reads the picks
        once a step and writes the step's input only where a row's next token is not its pick (a
        forced tool token); a finished row keeps decoding its own picks, ignored. The step has
        exactly `num_samples` rows, not generate_many's power of two (decode.step_rows): rows
        added would draw uniform numbers from the step's generator too, so from the second token
        on a row's draw would no longer be the reference's for the same seed, and drawing for the
        asked rows alone would fix their count into the captured graph. lockstep's own callers
        ask for one row (eval's one-at-a-time replies, chat, serve), so this adds one step per
        cache length and sampling kind."""
        model = self._weights.current()
        sampling = Sampling.of(temperature, top_k, top_p)
        cache_len = cache_tokens(len(prompt_ids) + max_tokens, self.model.config.sequence_len)
        step = self._pool.acquire(num_samples, cache_len, sampling)
        try:
            with torch.inference_mode(), torch.autocast(self._device().type, enabled=False):
                step.set_sampling(sampling, seed)
                prefill = KVCache.for_model(model, 1, capacity_tokens=len(prompt_ids))
                ids = torch.tensor([prompt_ids], dtype=torch.long, device=step.device)  # (1, T)
                logits = model(ids, kv_cache=prefill)[:, -1, :]  # (1, V)
                step.cache.put_rows(range(num_samples), prefill)
                del prefill
                picked = step.pick(logits.expand(num_samples, -1))  # (B,)
                step.tokens.copy_(picked[:, None])
                rows = [_Row() for _ in range(num_samples)]
            for i in range(max_tokens):
                sampled = picked.tolist()  # the one host sync of a step
                tokens, masks, feed = [], [], []
                for row, tok in zip(rows, sampled):
                    if row.done:
                        tokens.append(self.assistant_end_id)
                        masks.append(0)
                        feed.append(tok)
                        continue
                    t, m = self._emit(row, tok, use_tools)
                    tokens.append(t)
                    masks.append(m)
                    feed.append(t)
                yield tokens, masks
                if i + 1 == max_tokens or all(r.done for r in rows):
                    return
                with torch.inference_mode():
                    if feed != sampled:
                        step.tokens.copy_(torch.tensor(feed, dtype=torch.long)[:, None])  # (B, 1)
                    step()
                    picked = step.next_ids
        finally:
            self._pool.release(step)

    def _emit(self, row: _Row, pick: int, use_tools: bool) -> tuple[int, int]:
        """The token a live `row` emits when the model picked `pick`, and its mask: the row's next
        forced token (0) when it has one, else `pick` (1). A stop token finishes the row; with
        tools on, the token moves the row's tool-call state."""
        if row.forced:
            tok, mask = row.forced.popleft(), 0
        else:
            tok, mask = pick, 1
        if tok in self.stop_ids:
            row.done = True
        elif use_tools:
            self._tool_state(row, tok)
        return tok, mask

    def _tool_state(self, row: _Row, tok: int) -> None:
        if tok == self.python_start_id:
            row.in_python, row.python_ids = True, []
        elif tok == self.python_end_id and row.in_python:
            row.in_python = False
            value = evaluate(self.tokenizer.decode(row.python_ids))
            text = NO_RESULT if value is None else value
            row.forced.extend([self.output_start_id, *self.tokenizer.encode(text), self.output_end_id])
        elif row.in_python:
            row.python_ids.append(tok)

    def generate_greedy(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int | Sequence[int],
        batch_rows: int,
        use_tools: bool = True,
    ) -> list[list[int]]:
        """Greedy completions of many different prompts, up to `batch_rows` of them decoding
        together: per prompt, the tokens `generate(prompt, max_tokens=m, temperature=0.0)` yields
        for its one row (tool results forced the same way), up to and including the stop token
        when one comes; equal to rounding, which in low precision can tip a near tie. `max_tokens`
        is one budget for all or one per prompt. `generate_many` at temperature 0, ids only."""
        ids, _ = self.generate_many(prompts, max_tokens=max_tokens, batch_rows=batch_rows, use_tools=use_tools)
        return ids

    def generate_many(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int | Sequence[int],
        batch_rows: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int = 0,
        use_tools: bool = True,
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Completions of many prompts, up to `batch_rows` of them decoding together, and per
        completion its masks (1 sampled, 0 forced by the tool), as `generate_batch` returns them.
        Greedy at temperature 0; above it every row draws from one `torch.Generator` seeded with
        `seed`, so a call's draws depend on the prompts, their order and `batch_rows` (the same
        call gives the same completions). Pass a prompt k times for k samples of it.

        Each prompt but its last token is prefilled on its own (once for a run of equal prompts,
        such as a problem's k samples) and copied into a free row of one shared cache, rows
        keeping their own positions; every step then reads one token per row
        (a fresh row's last prompt token, else its previous token) in a single forward pass. A
        row that finishes hands its place to the next waiting prompt, and once none waits the
        finished rows are dropped from the cache, so they stop costing work."""
        budgets = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        if len(budgets) != len(prompts):
            raise ValueError(
                f"max_tokens has {len(budgets)} budgets for {len(prompts)} prompts; pass one per prompt or one int"
            )
        if batch_rows < 1:
            raise ValueError(f"batch_rows={batch_rows} must be >= 1")
        waiting: deque[tuple[int, list[int], int]] = deque()
        for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
            self._check(list(prompt), 1, budget, temperature, top_k, None)
            waiting.append((i, list(prompt), budget))
        out: list[list[int]] = [[] for _ in prompts]
        masks: list[list[int]] = [[] for _ in prompts]
        if not waiting:
            return out, masks
        if self.fast:
            self._fast_many(waiting, out, masks, batch_rows, Sampling.of(temperature, top_k, None), seed, use_tools)
            return out, masks
        with torch.inference_mode(), self._reference_precision():
            device = self._device()
            generator = torch.Generator(device=device).manual_seed(seed)
            first = list(waiting)[:batch_rows]
            # Room for the first rows' whole replies up front; a longer prompt later grows the cache.
            cache = KVCache.for_model(self.model, len(first), capacity_tokens=max(len(p) + b for _, p, b in first))
            last = _Prefill()
            rows: list[_Reply] = [self._start_reply(cache, r, *waiting.popleft(), last=last)
                                  for r in range(cache.batch_size)]
            while rows:
                col = torch.tensor([r.feed for r in rows], dtype=torch.long, device=device)[:, None]  # (B, 1)
                logits = self._next_logits(col, cache)  # (B, V)
                picks = sample_next(
                    logits, temperature=temperature, top_k=top_k, top_p=None, generator=generator
                ).tolist()
                for slot, (row, pick) in enumerate(zip(rows, picks)):
                    tok, m = self._emit(row, pick, use_tools)
                    row.ids.append(tok)
                    row.masks.append(m)
                    row.done = row.done or len(row.ids) == row.budget
                    row.feed = tok
                    if row.done:
                        out[row.index], masks[row.index] = row.ids, row.masks
                        if waiting:
                            rows[slot] = self._start_reply(cache, slot, *waiting.popleft(), last=last)
                if any(r.done for r in rows):
                    keep = _fill_from_the_end([not r.done for r in rows])
                    if keep:
                        cache.keep_rows(keep)
                    rows = [rows[slot] for slot in keep]
        return out, masks

    def _start_reply(self, cache: KVCache | StaticKVCache, slot: int, index: int, prompt: list[int], budget: int,
                     model: GPT | None = None, last: _Prefill | None = None) -> _Reply:
        """Prefill all of `prompt` but its last token into row `slot` of `cache`; the last token
        is the row's first feed, so its logits come from the shared decode step. `last`, one per
        call of generate_many, keeps the latest prefill: a prompt that repeats the one before it
        (a problem's k samples) copies that cache rather than running the model again."""
        model = self.model if model is None else model
        head_ids = prompt[:-1]
        if last is not None and last.cache is not None and last.ids == head_ids:
            head = last.cache
        else:
            head = KVCache.for_model(model, 1, capacity_tokens=len(prompt))
            if head_ids:
                model(torch.tensor([head_ids], dtype=torch.long, device=self._device()), kv_cache=head)  # (1, T - 1)
            if last is not None:
                last.ids, last.cache = head_ids, head
        cache.put_row(slot, head)
        return _Reply(index=index, budget=budget, feed=prompt[-1])

    def _fast_many(self, waiting: deque[tuple[int, list[int], int]], out: list[list[int]], masks: list[list[int]],
                   batch_rows: int, sampling: Sampling, seed: int, use_tools: bool) -> None:
        """`generate_many` on the fast path, filling `out` and `masks`: the rows of one static
        step, each prompt prefilled by the plain forward into a free row, a finished row's place
        going to the next waiting prompt. The rows stay (fixed shapes); once none waits, a finished
        row keeps decoding its own picks, ignored, until the last live row finishes. The step has
        decode.step_rows rows, a power of two up to `batch_rows`, so that any number of prompts
        reuses one of a few steps (and their compiles); the rows no prompt fills decode their own
        picks from the first step on, ignored. Greedy, it gives the reference path's tokens;
        sampled, draws from the same distributions but not the same draws (the step also draws for
        rows that finished or hold no prompt)."""
        model = self._weights.current()
        limit = self.model.config.sequence_len
        cache_len = cache_tokens(max(len(p) + b for _, p, b in waiting), limit)  # room for the longest request
        step = self._pool.acquire(step_rows(len(waiting), batch_rows), cache_len, sampling)
        try:
            with torch.inference_mode(), torch.autocast(self._device().type, enabled=False):
                step.set_sampling(sampling, seed)
                last = _Prefill()
                rows: list[_Reply | None] = [self._start_reply(step.cache, slot, *waiting.popleft(), model=model,
                                                               last=last) if waiting else None
                                             for slot in range(step.batch_size)]
                # What the step's input holds (its picks, once it has run): first each prompt's last
                # token, and for a row with no prompt id 0, which every vocabulary has, read at
                # whatever position that cache row was left (its picks are ignored, and rows never
                # see each other's keys).
                sampled = [0 if row is None else row.feed for row in rows]
                step.tokens.copy_(torch.tensor(sampled, dtype=torch.long)[:, None])  # (B, 1)
                while any(r is not None for r in rows):
                    feed = [sampled[slot] if row is None else row.feed for slot, row in enumerate(rows)]
                    if feed != sampled:
                        step.tokens.copy_(torch.tensor(feed, dtype=torch.long)[:, None])  # (B, 1)
                    step()
                    sampled = step.next_ids.tolist()  # the one host sync of a step
                    for slot, row in enumerate(rows):
                        if row is None:
                            continue
                        tok, m = self._emit(row, sampled[slot], use_tools)
                        row.ids.append(tok)
                        row.masks.append(m)
                        row.done = row.done or len(row.ids) == row.budget
                        row.feed = tok
                        if row.done:
                            out[row.index], masks[row.index] = row.ids, row.masks
                            rows[slot] = (self._start_reply(step.cache, slot, *waiting.popleft(), model=model,
                                                            last=last)
                                          if waiting else None)
        finally:
            self._pool.release(step)

    def generate_batch(self, prompt_ids: Sequence[int], **kwargs: Any) -> tuple[list[list[int]], list[list[int]]]:
        """Run `generate` to the end; return per row the completion ids (prompt excluded, the
        stop token included when one was produced) and their masks (1 sampled, 0 forced)."""
        n = kwargs.get("num_samples", 1)
        seqs: list[list[int]] = [[] for _ in range(n)]
        masks: list[list[int]] = [[] for _ in range(n)]
        done = [False] * n
        for tokens, ms in self.generate(prompt_ids, **kwargs):
            for i, (t, m) in enumerate(zip(tokens, ms)):
                if done[i]:
                    continue
                seqs[i].append(t)
                masks[i].append(m)
                done[i] = t in self.stop_ids
        return seqs, masks
