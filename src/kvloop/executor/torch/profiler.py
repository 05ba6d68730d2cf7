"""``kvloop profile``'s measurements: the torch executor timed piece by piece on this device.

What is timed (each the mean of a few runs after a warm-up; CUDA synchronised):

1. per-token work at T tokens: the model's forward pass with attention stubbed out (every
   layer's GEMMs on the real weights, norms, RoPE with the KV write, activation, residual
   adds, embedding);
2. the four projection GEMMs alone over all layers at T tokens (for the device's GEMM
   curve, so the calibration also serves models other than the profiled one);
3. per-request work at S requests: final norm, LM head and greedy sampling;
4. paged attention (every layer's cache in turn) for decode batches
   (B requests over spread contexts) and prefill chunks (c tokens after p cached);
5. whole ``TorchModelRunner.execute`` steps (decode batches and mixed steps): what they
   cost beyond 1-4 is the runner's own per-step work;
6. the engine loop (scheduler + ``LLMEngine.step`` output handling) over a null executor,
   timed by the caller's ``engine_loop`` (``kvloop.engine.loop_timing``).

:func:`fit_calibration` turns these into a :class:`Calibration` (``kvloop.executor.
simulated.calibration``): 1 and 3 become its tables, 2 a fitted GEMM curve, 4 a fitted
attention curve, 5 and 6 the engine overhead.
"""

from __future__ import annotations

import datetime
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvloop.core.interface import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from kvloop.executor.simulated.calibration import Measurements
from kvloop.executor.torch.attention import build_metadata, paged_attention
from kvloop.executor.torch.layer_ops import rms_norm
from kvloop.executor.torch.linear import Linear, logits
from kvloop.executor.torch.loader import cpu_flags, cpu_has_native_bf16
from kvloop.executor.torch.model_runner import TorchModelRunner
from kvloop.executor.torch.models import llama as _llama
from kvloop.executor.torch.sampler import SamplingState
from kvloop.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@dataclass(frozen=True)
class ProfileSettings:
    """How much to measure."""

    max_num_batched_tokens: int = 2048
    """Largest step measured (tokens)."""
    max_num_seqs: int = 64
    """Largest decode batch measured."""
    max_context: int = 2048
    """Longest context measured (capped at the model's max length)."""
    budget_s: float = 0.6
    """Seconds spent repeating one measurement (at least ``min_runs`` runs)."""
    min_runs: int = 5
    """Fewest timed runs per measurement (after one warm-up)."""
    engine_steps: int = 60
    """Engine-loop steps timed per batch size."""


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name with threads and widest vector ISA."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f
                         if ln.startswith("model name")), name)
    except OSError:
        pass
    flags = cpu_flags()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    if cpu_has_native_bf16():
        isa += " with native bf16"
    name = f"{name}, {isa}"
    return f"{name}, {torch.get_num_threads()} threads"


def robust_mean(runs: list[float]) -> float:
    """The mean of ``runs`` without the stalls: runs over 3x the median are dropped.

    NOTE: the mean, not the median: a served step pays its rare slow runs (allocator,
    interrupts) and the simulator predicts throughput. A run 3x the median is the machine
    stopping the process (a neighbour, a page-in), not the step's cost; one such run in five
    would otherwise skew the fitted curves several-fold."""
    median = statistics.median(runs)
    return statistics.fmean(r for r in runs if r <= 3.0 * median)


class _Timer:
    def __init__(self, device: torch.device, settings: ProfileSettings) -> None:
        self.device, self.settings = device, settings
        self.last_runs: list[float] = []
        """The timed runs of the last call (seconds each)."""

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn: Callable[[], object]) -> float:
        """Mean seconds of ``fn`` (one warm-up, then repeats within the budget)."""
        fn()
        self.sync()
        runs: list[float] = []
        spent = 0.0
        while len(runs) < self.settings.min_runs or (spent < self.settings.budget_s
                                                     and len(runs) < 50):
            start = time.perf_counter()
            fn()
            self.sync()
            dt = time.perf_counter() - start
            runs.append(dt)
            spent += dt
        self.last_runs = runs
        return robust_mean(runs)


def _powers(limit: int) -> list[int]:
    out = [1 << i for i in range(max(1, limit).bit_length()) if (1 << i) <= limit]
    return out if out[-1] == limit else [*out, limit]


@contextmanager
def _attention_stubbed() -> Iterator[None]:
    """The model's forward with attention replaced by a zero output (the KV writes stay:
    they are part of ``rope_write_kv``)."""
    saved = (_llama.paged_attention, _llama.flex_paged_attention)

    def no_attention(
        q: torch.Tensor, cache: torch.Tensor, meta: object, scale: float
    ) -> torch.Tensor:
        return q.new_zeros(q.shape[0], q.shape[1] * q.shape[2])

    _llama.paged_attention = no_attention  # type: ignore[assignment]
    _llama.flex_paged_attention = no_attention  # type: ignore[assignment]
    try:
        yield
    finally:
        _llama.paged_attention, _llama.flex_paged_attention = saved


class Profiler:
    """Runs the measurements of the module docstring against one runner."""

    def __init__(self, runner: TorchModelRunner, settings: ProfileSettings) -> None:
        self.runner, self.settings = runner, settings
        self.model = runner.model
        # NOTE: measured on the weights as they serve: moved onto huge pages, no copy running.
        self.model.adopt_moved_weights(wait=True)
        self.cfg = runner.model_config
        self.device = runner.device
        self.timer = _Timer(self.device, settings)
        self.max_context = min(settings.max_context, runner.max_model_len)
        self.rng = random.Random(0)
        # NOTE: block ids drawn from a shuffled pool, as a block pool looks after some
        # churn: gathers over scattered blocks cost ~5% more on a CPU than consecutive ones.
        self._pool = list(range(1, runner.num_gpu_blocks))
        self.rng.shuffle(self._pool)

    def fits(self, batch: int, context: int, extra: int = 0) -> bool:
        """Whether ``batch`` requests spread around ``context`` (plus ``extra`` tokens)
        surely fit the KV pool."""
        top = min(int(context * 1.9), self.max_context) + 64
        return -(-top // self.runner.block_size) * batch + -(-extra // self.runner.block_size) \
            < len(self._pool)

    def _blocks(self, tables_tokens: list[int]) -> list[list[int]]:
        """Disjoint block tables holding the given numbers of tokens."""
        bs, out, at = self.runner.block_size, [], 0
        for tokens in tables_tokens:
            need = -(-tokens // bs)
            out.append(self._pool[at:at + need])
            at += need
        if at > len(self._pool):
            raise RuntimeError("profile KV pool too small for its own grid")
        return out

    # -- helpers ---------------------------------------------------------------------
    def _ids(self, n: int) -> torch.Tensor:
        return torch.randint(3, self.cfg.vocab_size, (n,), device=self.device)

    def _meta(self, starts: list[int], lengths: list[int], num_decodes: int):
        bs = self.runner.block_size
        tables = self._blocks([s + n for s, n in zip(starts, lengths, strict=True)])
        return build_metadata(starts=starts, lengths=lengths, block_tables=tables,
                              num_decodes=num_decodes, block_size=bs, device=self.device,
                              dtype=self.runner.dtype,
                              native=self.runner.native_attention)

    # -- 1 and 2: per-token work and GEMMs ----------------------------------------------
    def token_work(self, t: int) -> float:
        meta, positions = self._meta([0], [t], 0)
        ids, last = self._ids(t), torch.tensor([t - 1], device=self.device)
        layers = self.runner.kv_cache.layers
        with _attention_stubbed():
            total = self.timer(lambda: self.model.forward(ids, positions, layers, meta, last))
        return max(total - self._head(1), 0.0)

    def gemms(self, t: int) -> list[tuple[float, float, float]]:
        """(flops, bytes, s per layer) of the QKV, O, gate/up and down GEMMs at T = t."""
        layers = self.model.layers
        elem = torch.empty((), dtype=self.runner.dtype).element_size()
        out = []
        for name in ("qkv", "o", "gate_up", "down"):
            first = getattr(layers[0], name)
            k, n = first.in_features, first.out_features
            x = torch.randn(t, k, device=self.device, dtype=self.runner.dtype)
            weights = [getattr(layer, name) for layer in layers]

            def run(x: torch.Tensor = x, weights: list[Linear] = weights) -> None:
                for w in weights:
                    w(x)

            per_layer = self.timer(run) / len(weights)
            out.append((2.0 * t * n * k, float((n * k + t * k + t * n) * elem), per_layer))
        return out

    # -- 3: per-request work -----------------------------------------------------------
    def _head(self, s: int) -> float:
        x = torch.randn(s, self.cfg.hidden_size, device=self.device, dtype=self.runner.dtype)
        norm, lm_head, eps = self.model.norm, self.model.lm_head, self.cfg.rms_norm_eps
        return self.timer(lambda: logits(lm_head, rms_norm(x, norm, eps)))

    def seq_work(self, s: int) -> float:
        x = torch.randn(s, self.cfg.hidden_size, device=self.device, dtype=self.runner.dtype)
        norm, lm_head, eps = self.model.norm, self.model.lm_head, self.cfg.rms_norm_eps
        states = [SamplingState(GREEDY, [1, 2, 3], []) for _ in range(s)]
        sampler = self.runner.sampler

        def run() -> None:
            sampler.sample(logits(lm_head, rms_norm(x, norm, eps)), states)
            for st in states:
                st.output_token_ids.clear()

        return self.timer(run)

    # -- 4: attention ------------------------------------------------------------------
    def _attention(self, starts: list[int], lengths: list[int], num_decodes: int) -> float:
        meta, _ = self._meta(starts, lengths, num_decodes)
        cfg = self.cfg
        t = sum(lengths)
        q = torch.randn(t, cfg.num_heads, cfg.head_dim, device=self.device,
                        dtype=self.runner.dtype)
        caches = self.runner.kv_cache.layers
        scale = cfg.head_dim**-0.5

        def run() -> None:
            # NOTE: every layer's own cache in turn, as in a forward pass: one layer
            # repeated would find its KV in the CPU caches and look faster than it is. The
            # KV write is part of ``rope_write_kv``, which the per-token work (run with
            # attention stubbed) times.
            for cache in caches:
                paged_attention(q, cache, meta, scale)

        return self.timer(run)

    def decode_attention(self, batch: int, context: int) -> tuple[int, int, float]:
        ctx = self.spread(context, batch)
        return batch, sum(ctx), self._attention([c - 1 for c in ctx], [1] * batch, batch)

    def prefill_attention(self, c: int, p: int) -> tuple[int, int, float]:
        return c, p, self._attention([p], [c], 0)

    # -- 5: whole runner steps ---------------------------------------------------------
    def runner_step(self, decode_ctx: list[int], chunks: list[tuple[int, int]]) -> float:
        """Mean seconds of ``runner.execute`` for a steady-state step: requests decoding
        at the given contexts (admitted beforehand, untimed) plus fresh prefill chunks."""
        slack = 64
        runner = self.runner
        tables = self._blocks([k + slack for k in decode_ctx] + [p + c for c, p in chunks])
        decode_ids = [f"profile-d{i}" for i in range(len(decode_ctx))]
        admit = [NewRequestData(rid, self._ids(k).tolist(), [], GREEDY, table, k - 1)
                 for rid, k, table in zip(decode_ids, decode_ctx, tables, strict=False)]
        one = dict.fromkeys(decode_ids, 1)
        if admit:
            runner.execute(SchedulerOutput(0, admit, CachedRequestData(), one, len(one)))
        chunk_reqs = [NewRequestData(f"profile-c{i}", self._ids(p + c).tolist(), [], GREEDY,
                                     tables[len(decode_ctx) + i], p)
                      for i, (c, p) in enumerate(chunks)]
        scheduled = one | {r.request_id: c for r, (c, _) in zip(chunk_reqs, chunks, strict=True)}
        total = sum(scheduled.values())

        def step() -> None:
            cached = CachedRequestData(
                list(decode_ids), [[] for _ in decode_ids],
                [runner.requests[rid].num_computed for rid in decode_ids],
                [False] * len(decode_ids),
            )
            runner.execute(SchedulerOutput(1, chunk_reqs, cached, scheduled, total))
            for r in chunk_reqs:
                runner.requests.pop(r.request_id, None)

        try:
            return self.timer(step)
        finally:
            runner.requests.clear()

    def spread(self, base: int, n: int) -> list[int]:
        """``n`` contexts around ``base`` (uniform in [0.1, 1.9]·base), sorted, capped so
        that 64 more tokens still fit the measured range."""
        top = max(2, self.max_context - 64)
        return sorted(min(top, max(2, int(base * self.rng.uniform(0.1, 1.9))))
                      for _ in range(n))


def plan(
    runner: TorchModelRunner, settings: ProfileSettings, m: Measurements,
    engine_loop: Callable[[int], float] | None = None,
) -> list[tuple[str, Callable[[], None]]]:
    """The measurements of the module docstring as (label, action) pairs; each action
    appends its result to ``m``. ``engine_loop(batch)`` times the engine loop over a null
    executor (``kvloop.engine.loop_timing``: the engine sits above this layer, so the
    caller passes it); None leaves that item out."""
    prof = Profiler(runner, settings)
    max_t, max_s = settings.max_num_batched_tokens, settings.max_num_seqs
    items: list[tuple[str, Callable[[], None]]] = []

    def add(label: str, action: Callable[[], None]) -> None:
        items.append((label, action))

    for t in _powers(max_t):
        def tokens(t: int = t) -> None:
            m.token_work.append((t, prof.token_work(t)))
            m.gemms.extend((t, *g) for g in prof.gemms(t))
        add(f"per-token work, {t} tokens", tokens)
    for s in _powers(max_s):
        add(f"LM head and sampler, {s} requests",
            lambda s=s: m.seq_work.append((s, prof.seq_work(s))))
    contexts = [c for c in (16, 128, 512, 2048) if c <= prof.max_context]
    for b in [b for b in (1, 4, 16, 64) if b <= max_s]:
        for c in [c for c in contexts if prof.fits(b, c)]:
            add(f"decode attention, {b} x {c}",
                lambda b=b, c=c: m.decode_attention.append(prof.decode_attention(b, c)))
    for c in sorted({c for c in (16, 64, 256, 1024, max_t) if 2 <= c <= max_t}):
        for p in (0, 256, 1024):
            if c + p <= prof.max_context:
                add(f"prefill attention, {c} after {p}",
                    lambda c=c, p=p: m.prefill_attention.append(prof.prefill_attention(c, p)))
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_s]
    chunk = min(256, max_t // 2, prof.max_context // 2)
    prefix = min(512, prof.max_context - chunk)
    for b in batches:
        layouts: list[tuple[int, list[tuple[int, int]]]] = [(64, []), (512, [])]
        if chunk >= 2:
            layouts.append((256, [(chunk, 0)]))
            if b in (4, 16) and prefix > 0:
                layouts.append((256, [(max(2, chunk // 2), prefix)]))
            if b in (8, 32) and max_t - b > chunk:  # a full step: decodes + a big chunk
                layouts.append((256, [(min(max_t - b, prof.max_context // 2), 0)]))
            # NOTE: small chunks too (short prompts, a chunk's tail), so that the step fit
            # can tell a chunk's fixed cost from its cost per token; both sizes at one
            # decode, so that a profile of one request still has a step per coefficient.
            small = (16, 64) if b == 1 else (16,) if b in (2, 8, 32) else (64,)
            layouts += [(256, [(c, 0)]) for c in small if c < chunk]
        for base, chunks in layouts:
            extra = sum(c + p for c, p in chunks)
            if base > prof.max_context or not prof.fits(b, base, extra):
                continue
            decode_ctx = prof.spread(base, b)

            def step(b: int = b, dc: list[int] = decode_ctx, ch: list = chunks) -> None:
                m.runner_steps.append({"decodes": b, "decode_context": sum(dc),
                                       "chunks": ch, "s": prof.runner_step(dc, ch)})
            chunk_label = "".join(f" + a {c}-token chunk" + (f" after {p}" if p else "")
                                  for c, p in chunks)
            add(f"runner step, {b} decodes of ~{base} tokens{chunk_label}", step)
    for b in [b for b in (1, 16, 64) if b <= max_s and engine_loop is not None]:
        assert engine_loop is not None
        add(f"engine loop, {b} requests",
            lambda b=b: m.engine_loop.append((b, engine_loop(b))))
    return items


NOISY_SPREAD = 0.25
"""Streaming-copy runs further apart than this (fastest to slowest, as a fraction of the
median) mean the machine is busy: another process takes cores or memory bandwidth, and every
measurement (so the calibration) is noisy. On a quiet machine the runs agree within a few
percent."""


def new_measurements(runner: TorchModelRunner, bandwidth: float | None = None) -> Measurements:
    """Empty measurements of ``runner``'s device, with its streaming bandwidth (bytes/s): the
    one given (``measure_bandwidth``'s), else measured now."""
    dev = runner.device
    if bandwidth is None:
        bandwidth, _ = measure_bandwidth(dev)
    return Measurements(
        device=str(dev), device_name=device_name(dev),
        dtype=str(runner.dtype).removeprefix("torch."), bandwidth=bandwidth,
    )


def measure_bandwidth(device: torch.device) -> tuple[float, float]:
    """(bytes/s, spread) of a streaming copy far larger than the caches (read + write); the
    spread is ``run_spread`` of its timed runs (above ``NOISY_SPREAD``: a busy machine)."""
    timer = _Timer(device, ProfileSettings())
    n = (256 << 20) // 4 if device.type == "cpu" else (1 << 30) // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = timer(lambda: dst.copy_(src))
    return 2 * n * 4 / seconds, run_spread(timer.last_runs)


def run_spread(runs: list[float]) -> float:
    """How far repeats of one measurement disagree: (slowest - fastest) / median."""
    return (max(runs) - min(runs)) / statistics.median(runs)


def created_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def blocks_for(settings: ProfileSettings, block_size: int, max_model_len: int) -> int:
    """KV blocks the smallest measurement needs: one step's tokens after the longest
    context (bigger layouts are skipped when the pool cannot hold them)."""
    ctx = min(settings.max_context, max_model_len)
    return -(-(settings.max_num_batched_tokens + ctx) // block_size) + 64
