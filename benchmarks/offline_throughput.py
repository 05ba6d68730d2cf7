"""Offline throughput: kvloop vs transformers static ``generate`` vs transformers continuous
batching, on the default model (SmolLM2-135M-Instruct, fp32 unless ``--dtype``, CPU unless
``--device``).

Same prompts and greedy settings for every engine, output lengths forced:

- ``varied``: 64 requests whose (prompt, output) lengths are drawn (seed 0, without
  replacement) from kvloop's shipped ShareGPT length trace and *scaled* (not clipped) into
  ≤ 512 prompt / ≤ 256 output tokens: every prompt length is multiplied by 512 / (longest
  prompt of the whole trace) and every output length by 256 / (longest output of the trace),
  rounded, then kept ≥ 4 (prompt) and ≥ 1 (output). Scaling keeps the trace's spread of
  lengths, which is what separates continuous from static batching.
- ``equal``: 32 prompts × 64 prompt tokens × 64 output tokens.

Prompt token ids are random ids from the tokenizer's normal-token range (above the added /
special tokens), seeded, identical for every engine (no prefix-cache hits between requests).

Engines (each loads its model untimed and runs one short warm-up first):

- ``kvloop``: ``LLM(model="default", max_num_seqs=S, max_num_batched_tokens=T)``,
  ``SamplingParams(temperature=0, max_tokens=L, ignore_eos=True)`` per request; output tokens
  are the tokens actually returned; wall time is the ``generate`` call (first add to last
  finish). ``--kvloop-tokens 512,1024,2048`` runs one row per token budget; the best row
  (highest tok/s on ``varied``) is the one the ratios and targets use.
- ``hf-static``: transformers ``generate`` on left-padded batches (attention mask, greedy,
  EOS disabled, ``min_new_tokens = max_new_tokens`` = the batch's longest requested output),
  ``--hf-batch-size`` requests per batch (default: all in one batch). The whole batch waits
  for its longest member; "output tokens" counts only each request's requested length (the
  raw number generated is reported too).
- ``hf-cb``: transformers continuous batching through the manager API
  (``init_continuous_batching`` / ``continuous_batching_context_manager`` +
  ``manager.add_request(input_ids, request_id=..., max_new_tokens=L, eos_token_id=-1)``), so
  every request stops at its own length: the same work ``generate_batch`` does, with
  per-request lengths. Default ``ContinuousBatchingConfig``; attention ``--hf-cb-attn``
  (``sdpa`` by default, which transformers' CB accepts on CPU; ``paged|eager`` is the other).

Then the ceiling. FLOPs per token come from the model config (2 × non-embedding matmul
params + 2 × the LM head, ~0.27 GFLOP here). The naive ceiling divides the hot-cache fp32
``torch.mm`` rate (one layer's weights reused call after call) by it: the "~700
tok/s". But a real forward pass streams every layer's weights (~425 MB fp32) from memory, so
the script also times one pass's matmuls with 30 distinct layers at M = 1 ... 1024 tokens,
and from those a floor per workload: the matmuls alone of kvloop's kind of schedule
(decodes first, prompt chunks fill the token budget, at most ``max_num_seqs`` requests),
attention, sampling and all overheads free. kvloop's tok/s is reported against both.

``torch.set_num_threads`` is set to the CPUs this process may use (``--threads``).

Run (from the repository root, with the project's virtual environment active)::

    python benchmarks/offline_throughput.py                  # full run (~30+ min on 2 cores)
    python benchmarks/offline_throughput.py --quick          # 8 requests each, smoke run
    python benchmarks/offline_throughput.py --json out_offline.json --profile
    python benchmarks/offline_throughput.py --engines kvloop --kvloop-tokens 512,1024,2048
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import itertools
import json
import logging
import os
import platform
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvloop.engine.model_source import resolve_model
from kvloop.sampling_params import SamplingParams
from kvloop.sim.traces import trace_lengths

ENGINES = ("kvloop", "hf-static", "hf-cb")
VARIED_REQUESTS = 64
MAX_PROMPT = 512
MAX_OUTPUT = 256
MIN_PROMPT = 4
EQUAL_REQUESTS = 32
EQUAL_PROMPT = 64
EQUAL_OUTPUT = 64
DEFAULT_SEQS = 64
DEFAULT_TOKENS = "1024"
TARGET_RATIO = 1.5
"""kvloop must be at least this many times faster than each transformers engine (varied)."""
TARGET_EQUAL_TOK_S = 200.0
"""kvloop must beat this many output tok/s on the equal-length workload."""
WARMUP_REQUESTS = 4
WARMUP_PROMPT = 16
WARMUP_OUTPUT = 4


# -- workloads ---------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    how: str
    """How the lengths were made (printed above the table)."""

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def describe(self) -> str:
        p, o = self.prompt_lens, self.output_lens
        return (
            f"{len(p)} requests; prompt {min(p)}..{max(p)} (sum {sum(p)}, median "
            f"{statistics.median(p):g}), output {min(o)}..{max(o)} (sum {sum(o)}, median "
            f"{statistics.median(o):g}); {self.how}"
        )


def random_prompt(rng: random.Random, length: int, lo: int, hi: int) -> list[int]:
    """``length`` token ids drawn uniformly from ``[lo, hi)``."""
    return [rng.randrange(lo, hi) for _ in range(length)]


def varied_workload(n: int, seed: int, id_range: tuple[int, int]) -> Workload:
    rows = trace_lengths("sharegpt")
    max_p = max(p for p, _ in rows)
    max_o = max(o for _, o in rows)
    sp, so = MAX_PROMPT / max_p, MAX_OUTPUT / max_o
    picked = random.Random(seed).sample(rows, n)
    lens = [
        (
            min(MAX_PROMPT, max(MIN_PROMPT, round(p * sp))),
            min(MAX_OUTPUT, max(1, round(o * so))),
        )
        for p, o in picked
    ]
    rng = random.Random(seed + 1)
    prompts = [random_prompt(rng, p, *id_range) for p, _ in lens]
    how = (
        f"ShareGPT trace ({len(rows)} rows, longest prompt {max_p}, output {max_o}), "
        f"{n} rows sampled with seed {seed}, scaled ×{sp:.4f} prompt / ×{so:.4f} output"
    )
    return Workload("varied", prompts, [o for _, o in lens], how)


def equal_workload(n: int, plen: int, olen: int, seed: int, id_range: tuple[int, int]) -> Workload:
    rng = random.Random(seed + 2)
    prompts = [random_prompt(rng, plen, *id_range) for _ in range(n)]
    return Workload("equal", prompts, [olen] * n, f"{plen} prompt × {olen} output tokens each")


def warmup_workload(seed: int, id_range: tuple[int, int]) -> Workload:
    rng = random.Random(seed + 3)
    prompts = [random_prompt(rng, WARMUP_PROMPT + i, *id_range) for i in range(WARMUP_REQUESTS)]
    return Workload("warmup", prompts, [WARMUP_OUTPUT] * WARMUP_REQUESTS, "warm-up")


# -- results -----------------------------------------------------------------------------
class Timer:
    """Wall and process CPU seconds of a ``with`` block, and the load average before it.

    The CPU time (all threads of this process) over wall × threads tells how much of the
    machine the run really had: other processes on a shared 2-core box show up as a share
    well below 100%.
    """

    def __enter__(self) -> Timer:
        self.load = os.getloadavg()[0]
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0


@dataclass
class Result:
    engine: str
    """Row label."""
    kind: str
    """``kvloop``, ``hf-static`` or ``hf-cb``."""
    workload: str
    output_tokens: int
    """Useful output tokens (each request's requested length at most)."""
    wall_s: float
    generated_tokens: int
    """Tokens the engine computed, padding waste included."""
    settings: dict[str, Any] = field(default_factory=dict)
    tokens: list[list[int]] | None = field(default=None, repr=False)
    """Per request output ids (for the agreement check; not saved to JSON)."""
    cpu_s: float = 0.0
    """Process CPU seconds (all threads) during the timed run."""
    load_before: float = 0.0
    """1-minute load average just before the timed run."""

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cpu_share(self) -> float:
        """CPU seconds / (wall × torch threads): near 1.0 when the run had its cores."""
        return self.cpu_s / (self.wall_s * torch.get_num_threads()) if self.wall_s > 0 else 0.0

    def timed(self, t: Timer) -> Result:
        self.cpu_s, self.load_before = t.cpu, t.load
        return self


# -- kvloop ------------------------------------------------------------------------------
def load_llm(seqs: int, tokens: int, device: str | None, dtype: str = "float32") -> Any:
    try:
        from kvloop import LLM  # type: ignore[attr-defined]
    except ImportError:  # not re-exported yet
        from kvloop.engine.llm import LLM
    kwargs: dict[str, Any] = {"max_num_seqs": seqs, "max_num_batched_tokens": tokens}
    kwargs["dtype"] = dtype
    if device is not None:
        kwargs["device"] = device
    return LLM(model="default", **kwargs)


def run_kvloop(llm: Any, wl: Workload, label: str, settings: dict[str, Any]) -> Result:
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_lens
    ]
    with Timer() as t:
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
    tokens = [list(o.token_ids) for o in outs]
    bad = [i for i, (t, n) in enumerate(zip(tokens, wl.output_lens, strict=True)) if len(t) != n]
    if bad:
        print(f"  ! kvloop: {len(bad)} requests returned a length other than requested")
    got = sum(min(len(t), n) for t, n in zip(tokens, wl.output_lens, strict=True))
    gen = sum(map(len, tokens))
    return Result(label, "kvloop", wl.name, got, t.wall, gen, settings, tokens).timed(t)


# -- transformers ------------------------------------------------------------------------
def load_hf(path: Path, device: str, attn: str, dtype: str = "float32") -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype), attn_implementation=attn
    )
    return model.to(device).eval()


def run_hf_static(model: Any, wl: Workload, batch_size: int, pad_id: int) -> Result:
    rows: list[list[int]] = []
    with Timer() as timer:
        for b in range(0, len(wl.prompts), batch_size):
            rows += _static_batch(
                model,
                wl.prompts[b : b + batch_size],
                max(wl.output_lens[b : b + batch_size]),
                pad_id,
            )
    tokens = [row[:n] for row, n in zip(rows, wl.output_lens, strict=True)]
    useful = sum(map(len, tokens))
    generated = sum(map(len, rows))
    label = f"hf generate (static, batch {min(batch_size, len(wl.prompts))})"
    settings = {"batch_size": batch_size, "padding": "left", "attn": "sdpa"}
    r = Result(label, "hf-static", wl.name, useful, timer.wall, generated, settings, tokens)
    return r.timed(timer)


def _static_batch(
    model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int
) -> list[list[int]]:
    """One left-padded greedy ``generate`` call; every row gets exactly ``new_tokens``."""
    from transformers import GenerationConfig

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,  # EOS disabled: every row runs to max_new_tokens
        pad_token_id=pad_id,
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            generation_config=cfg,
        )
    return out[:, width:].tolist()


@contextlib.contextmanager
def quiet_cb_logger() -> Iterator[None]:
    """The CB logger reports a harmless missing-psutil ERROR on CPU; keep it quiet."""
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    old = cb_logger.level
    cb_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        cb_logger.setLevel(old)


def run_hf_cb(model: Any, workloads: Sequence[Workload], warm: Workload, attn: str) -> list[Result]:
    """One manager per workload (sized by its hints), warm-up inside it, then the timed run."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    try:
        from transformers.generation.continuous_batching.initialization import WorkloadHints
    except ImportError:  # older layout
        WorkloadHints = None

    results = []
    for wl in workloads:
        gen = GenerationConfig(do_sample=False, max_new_tokens=max(wl.output_lens))
        gen.eos_token_id = -1
        cb = ContinuousBatchingConfig()
        hints = None
        if WorkloadHints is not None:
            hints = WorkloadHints(
                max_prompt_length=max(wl.prompt_lens),
                max_generated_length=max(wl.output_lens),
                num_requests=len(wl.prompts),
            )
        with (
            quiet_cb_logger(),
            torch.inference_mode(),
            model.continuous_batching_context_manager(
                generation_config=gen, continuous_batching_config=cb, workload_hints=hints
            ) as manager,
        ):
            _cb_round(manager, warm, "warm")
            with Timer() as timer:
                outs = _cb_round(manager, wl, "req")
            resolved = manager.continuous_batching_config
        tokens = [list(outs[i]) for i in range(len(wl.prompts))]
        useful = sum(min(len(t), n) for t, n in zip(tokens, wl.output_lens, strict=True))
        settings = {
            "attn": attn,
            "per_request_max_new_tokens": True,
            "num_blocks": resolved.num_blocks,
            "page_size": resolved.page_size,
            "max_batch_tokens": resolved.max_batch_tokens,
            "max_requests_per_batch": resolved.max_requests_per_batch,
        }
        label = f"hf generate_batch (CB, {attn})"
        gen = sum(map(len, tokens))
        r = Result(label, "hf-cb", wl.name, useful, timer.wall, gen, settings, tokens)
        results.append(r.timed(timer))
    return results


def _cb_round(manager: Any, wl: Workload, prefix: str) -> dict[int, list[int]]:
    for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True)):
        manager.add_request(p, request_id=f"{prefix}{i}", max_new_tokens=n, eos_token_id=-1)
    done: dict[int, list[int]] = {}
    while len(done) < len(wl.prompts):
        res = manager.get_result(timeout=1.0)
        if res is None:
            if not manager.is_running():
                raise RuntimeError("transformers CB generation thread stopped")
            continue
        if res.is_finished():
            if getattr(res, "error", None):
                raise RuntimeError(f"transformers CB request {res.request_id}: {res.error}")
            done[int(res.request_id[len(prefix) :])] = list(res.generated_tokens)
    return done


# -- ceiling -----------------------------------------------------------------------------
PASS_M = (1, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Tokens per forward pass at which the streamed-weight matmul pass is timed."""


@dataclass
class ModelCost:
    body_flops: float
    """FLOPs of one token through the decoder layers' matmuls (2 × their params)."""
    head_flops: float
    """FLOPs of the LM head for one token (2 × vocab × hidden)."""
    attn_flops_per_ctx: float
    """Attention FLOPs per token per context position (QK and PV, all layers)."""
    layer_shapes: list[tuple[int, int]]
    """(in, out) of one layer's matmuls, fused as a runner does: qkv, o, gate_up, down."""
    vocab: int
    hidden: int
    layers: int

    @property
    def per_token(self) -> float:
        return self.body_flops + self.head_flops

    def workload_flops(self, wl: Workload) -> float:
        total = 0.0
        for p, o in zip(wl.prompt_lens, wl.output_lens, strict=True):
            fed = p + o - 1  # the last sampled token is never fed back
            total += fed * self.body_flops + o * self.head_flops
            total += self.attn_flops_per_ctx * fed * (fed + 1) / 2  # position t sees t+1 keys
        return total


def model_cost(path: Path) -> ModelCost:
    cfg = json.loads((path / "config.json").read_text())
    h, inter, n_layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim") or h // heads
    shapes = [(h, (heads + 2 * kv) * hd), (heads * hd, h), (h, 2 * inter), (inter, h)]
    per_layer = sum(a * b for a, b in shapes)
    return ModelCost(
        body_flops=2.0 * per_layer * n_layers,
        head_flops=2.0 * cfg["vocab_size"] * h,
        attn_flops_per_ctx=4.0 * heads * hd * n_layers,
        layer_shapes=shapes,
        vocab=cfg["vocab_size"],
        hidden=h,
        layers=n_layers,
    )


def _time_fn(fn: Callable[[], object], min_s: float = 0.6, batches: int = 20) -> float:
    """Best seconds per call over ``batches`` short batches of calls (``min_s`` in all).

    The best batch, not the median: on a shared machine the slower ones measure the
    neighbours, not the hardware, and short batches catch the quiet moments.
    """
    fn()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_s / batches:
        fn()
        reps += 1
    reps = max(1, reps)
    times = []
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t) / reps)
    return min(times)


def measure_gemm(cost: ModelCost, device: str) -> dict[str, float]:
    """fp32 GFLOP/s of torch.mm at the model's shapes, the weights hot in cache (one matrix
    or one layer's four, reused call after call): what ~200 GFLOP/s means."""
    out: dict[str, float] = {}
    h = cost.hidden
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for m, k, n in ((64, h, 1536), (256, h, 1536), (1024, h, 1536)):
            a = torch.randn(m, k, generator=gen).to(device)
            b = torch.randn(k, n, generator=gen).to(device)
            s = _time_fn(lambda a=a, b=b: torch.mm(a, b))
            out[f"mm [{m},{k}]x[{k},{n}]"] = 2 * m * k * n / s / 1e9
        for m in (64, 256, 1024):  # one layer's matmuls, the same weights every call
            ins = {k: torch.randn(m, k, generator=gen).to(device) for k, _ in cost.layer_shapes}
            pairs = [
                (ins[k], torch.randn(k, n, generator=gen).to(device)) for k, n in cost.layer_shapes
            ]

            def layer(pairs: list[tuple[torch.Tensor, torch.Tensor]] = pairs) -> None:
                for a, b in pairs:
                    torch.mm(a, b)

            flops = 2 * m * sum(k * n for k, n in cost.layer_shapes)
            out[f"one layer (hot) M={m}"] = flops / _time_fn(layer) / 1e9
    return out


def measure_model_pass(cost: ModelCost, device: str) -> tuple[dict[int, float], dict[int, float]]:
    """Seconds of one forward pass's matmuls at M tokens with every layer's weights distinct,
    so they stream from memory as in the real model (about 425 MB fp32 per pass for this
    one), and seconds of the LM head at M rows. Best of a few passes per M."""
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        layers = [
            [torch.randn(k, n, generator=gen).to(device) for k, n in cost.layer_shapes]
            for _ in range(cost.layers)
        ]
        head = torch.randn(cost.hidden, cost.vocab, generator=gen).to(device)
        body: dict[int, float] = {}
        lm: dict[int, float] = {}
        for m in PASS_M:
            ins = {k: torch.randn(m, k, generator=gen).to(device) for k, _ in cost.layer_shapes}

            def one_pass(ins: dict[int, torch.Tensor] = ins) -> None:
                for ws in layers:
                    for w in ws:
                        torch.mm(ins[w.shape[0]], w)

            body[m] = _time_fn(one_pass, min_s=0.0, batches=5 if m <= 256 else 3)
            x = ins[cost.hidden]
            lm[m] = _time_fn(lambda x=x: torch.mm(x, head), min_s=0.0, batches=5)
    # NOTE: a pass over m tokens can always be padded to more, so a time measured at a
    # larger m bounds every smaller one: take the suffix minimum (irons out noise).
    for table in (body, lm):
        keys = sorted(table)
        for big, small in itertools.pairwise(reversed(keys)):
            table[small] = min(table[small], table[big])
    return body, lm


def _interp(table: dict[int, float], m: float) -> float:
    """Seconds at ``m`` tokens: linear between measured points, per-token rate beyond."""
    keys = sorted(table)
    if m <= keys[0]:
        return table[keys[0]]
    if m >= keys[-1]:
        return table[keys[-1]] * m / keys[-1]
    for lo, hi in itertools.pairwise(keys):
        if lo <= m <= hi:
            return table[lo] + (table[hi] - table[lo]) * (m - lo) / (hi - lo)
    raise AssertionError("unreachable")


def schedule_floor(
    wl: Workload, seqs: int, budget: int, body: dict[int, float], lm: dict[int, float]
) -> tuple[float, int]:
    """Seconds and steps of the matmuls alone under kvloop's own kind of schedule, with
    nothing else costing anything: every step runs one decode token for each request that
    is past its prompt, then fills the rest of the ``budget`` with prompt chunks (FCFS, at
    most ``seqs`` requests admitted), as one forward pass at its streamed-weight cost plus
    the LM head for every row sampled in that step. Attention, norms, sampling and Python
    count as zero."""
    n = len(wl.prompts)
    prompt, target = wl.prompt_lens, wl.output_lens
    computed, generated = [0] * n, [0] * n
    admitted: list[int] = []
    queue = list(range(n))
    t, steps = 0.0, 0
    while admitted or queue:
        while queue and len(admitted) < seqs:
            admitted.append(queue.pop(0))
        decodes = [i for i in admitted if computed[i] == prompt[i]]
        tokens = sampled = len(decodes)
        for i in decodes:
            generated[i] += 1
        for i in admitted:
            if computed[i] < prompt[i] and tokens < budget:
                chunk = min(prompt[i] - computed[i], budget - tokens)
                computed[i] += chunk
                tokens += chunk
                if computed[i] == prompt[i]:
                    generated[i] += 1
                    sampled += 1
        t += _interp(body, tokens) + (_interp(lm, sampled) if sampled else 0.0)
        steps += 1
        admitted = [i for i in admitted if generated[i] < target[i]]
    return t, steps


# -- profiles ----------------------------------------------------------------------------
OP_BUCKETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("matmul (mm / addmm / linear / bmm)", ("::mm", "::addmm", "::linear", "::bmm", "::matmul",
                                            "::_linear_pointwise")),
    ("KV gather (index_select / index)", ("::index_select", "::index")),
    ("KV write (index_copy_ / index_put_)", ("::index_copy", "::index_put")),
    ("attention (SDPA kernels)", ("scaled_dot_product", "flash_attention", "softmax")),
    ("rms_norm", ("rms_norm",)),
)
"""Bucket of a torch op: the first whose patterns match (``::x`` is the op ``x`` or
``x_``; other patterns match anywhere in the name)."""


def _bucket(op: str) -> str:
    base = "::" + op.split("::", 1)[-1].rstrip("_")
    for name, patterns in OP_BUCKETS:
        if any(base == p if p.startswith("::") else p in op for p in patterns):
            return name
    return "other torch ops (elementwise, copies, rope, sampler, ...)"


def profile_kvloop(llm: Any, wl: Workload, settings: dict[str, Any], top: int) -> dict[str, Any]:
    """One kvloop run of ``wl`` under cProfile and torch.profiler together (one run, not two:
    on a 2-core CPU a run takes minutes); prints and returns summaries."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    print(f"\n== profile: kvloop on {wl.name} ({settings}) ==")
    prof = cProfile.Profile()
    with torch_profile(activities=[ProfilerActivity.CPU]) as tp, Timer() as timer:
        prof.enable()
        run_kvloop(llm, wl, "profile", settings)
        prof.disable()
    wall = timer.wall
    stats = pstats.Stats(prof)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values())

    def rows(key: int, only_kvloop: bool) -> list[tuple[str, int, float, float]]:
        items = []
        for (file, line, name), (_, ncalls, tt, ct, _) in raw.items():
            if only_kvloop and "kvloop" not in file:
                continue
            short = file.split("site-packages/")[-1].split("src/")[-1]
            items.append((f"{short}:{line}({name})", ncalls, tt, ct))
        items.sort(key=lambda r: r[key], reverse=True)
        return items[:top]

    steps = next(
        (v[1] for (f, _, n), v in raw.items() if n == "step" and f.endswith("llm_engine.py")), 0
    )
    tokens = sum(wl.prompt_lens) + sum(wl.output_lens)
    share = timer.cpu / wall / torch.get_num_threads()
    print(
        f"{wall:.2f} s wall under both profilers (cpu {100 * share:.0f}%), "
        f"{steps} engine steps: {1e3 * wall / max(steps, 1):.0f} ms per step, "
        f"{tokens / max(steps, 1):.0f} tokens (prompt + output) per step on average"
    )
    avgs = tp.key_averages()
    ops_total = sum(e.self_cpu_time_total for e in avgs) / 1e6
    buckets: dict[str, float] = {}
    for e in avgs:
        key = _bucket(e.key)
        buckets[key] = buckets.get(key, 0.0) + e.self_cpu_time_total / 1e6
    buckets["outside torch ops (Python glue and the profilers' own cost; see cProfile)"] = max(
        0.0, wall - ops_total
    )
    print("\nwhere the time goes (torch.profiler self CPU time of ops, bucketed):")
    for name, sec in sorted(buckets.items(), key=lambda kv: kv[1], reverse=True):
        print(f"  {sec:8.2f} s {100 * sec / wall:5.1f}%  {name}")

    ops = sorted(avgs, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    print(f"\ntop {top} torch ops by self CPU time:")
    print(f"  {'self s':>8} {'%wall':>6} {'calls':>8} {'avg ms':>8}  op")
    op_rows = []
    for e in ops:
        sec = e.self_cpu_time_total / 1e6
        avg_ms = 1e3 * sec / e.count
        print(f"  {sec:8.2f} {100 * sec / wall:6.1f} {e.count:8d} {avg_ms:8.3f}  {e.key}")
        op_rows.append({"op": e.key, "self_s": sec, "calls": e.count})

    by_tt = rows(2, False)
    print(f"\ncProfile, top {top} functions by own time (tottime; torch calls include their ops):")
    print(f"  {'tottime s':>9} {'%':>5} {'calls':>9} {'cumtime s':>9}  function")
    for name, nc, tt, ct in by_tt:
        print(f"  {tt:9.2f} {100 * tt / total:5.1f} {nc:9d} {ct:9.2f}  {name}")
    by_ct = rows(3, True)
    print(f"\ncProfile, top {top} kvloop functions by cumulative time:")
    print(f"  {'cumtime s':>9} {'%':>5} {'calls':>9} {'tottime s':>9}  function")
    for name, nc, tt, ct in by_ct:
        print(f"  {ct:9.2f} {100 * ct / total:5.1f} {nc:9d} {tt:9.2f}  {name}")
    return {
        "wall_s": wall,
        "cpu_s": timer.cpu,
        "steps": steps,
        "buckets_s": buckets,
        "torch_ops": op_rows,
        "cprofile_by_tottime": [
            {"function": n, "calls": c, "tottime_s": tt, "cumtime_s": ct} for n, c, tt, ct in by_tt
        ],
        "cprofile_kvloop_by_cumtime": [
            {"function": n, "calls": c, "tottime_s": tt, "cumtime_s": ct} for n, c, tt, ct in by_ct
        ],
    }


# -- reporting ---------------------------------------------------------------------------
def progress(r: Result) -> None:
    print(
        f"  {r.kind} {r.workload}: {r.output_tokens} tok in {r.wall_s:.2f} s = {r.tok_s:.1f} tok/s",
        flush=True,
    )


def print_table(wl: Workload, rows: list[Result], best: Result | None) -> None:
    print(f"\n== {wl.name}: {wl.describe()} ==")
    print(
        f"{'engine':<40} {'output tok':>10} {'generated':>9} {'wall s':>8} {'tok/s':>8}"
        f" {'kvloop/engine':>13} {'cpu%':>5} {'load':>5}"
    )
    for r in rows:
        ratio = f"{best.tok_s / r.tok_s:.2f}x" if best is not None and r.tok_s else ""
        print(
            f"{r.engine:<40} {r.output_tokens:>10d} {r.generated_tokens:>9d} {r.wall_s:>8.2f}"
            f" {r.tok_s:>8.1f} {ratio:>13} {100 * r.cpu_share:>5.0f} {r.load_before:>5.1f}"
        )


def agreement(a: Result, b: Result) -> str:
    """How many requests' greedy outputs are identical, and the mean common-prefix share."""
    if a.tokens is None or b.tokens is None:
        return "n/a"
    same, shares = 0, []
    for x, y in zip(a.tokens, b.tokens, strict=True):
        n = max(len(x), 1)
        diff = (i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q)
        k = next(diff, min(len(x), len(y)))
        same += x == y
        shares.append(k / n)
    share = 100 * statistics.mean(shares)
    return f"{same}/{len(a.tokens)} identical, mean common prefix {share:.0f}%"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 requests per workload, shorter")
    ap.add_argument("--profile", action="store_true", help="profile the kvloop varied run")
    ap.add_argument("--json", metavar="PATH", help="save settings, rows, ceiling, profile")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma list: " + ",".join(ENGINES))
    ap.add_argument("--workloads", default="varied,equal", help="comma list: varied,equal")
    ap.add_argument("--kvloop-seqs", type=int, default=DEFAULT_SEQS, help="max_num_seqs")
    ap.add_argument(
        "--kvloop-tokens",
        default=DEFAULT_TOKENS,
        help="max_num_batched_tokens, or a comma list (one row each; the best one is used)",
    )
    ap.add_argument("--hf-batch-size", type=int, default=0, help="static batch (0: all at once)")
    ap.add_argument("--hf-cb-attn", default="sdpa", help="attention for transformers CB")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--device", default=None, help="cpu (default) or cuda")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="weights and activations of every engine (float32: the targets' figures)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top", type=int, default=20, help="rows per profile table")
    args = ap.parse_args(argv)

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        ap.error(f"unknown engine(s) {sorted(unknown)}; choose from {ENGINES}")
    budgets = [int(x) for x in args.kvloop_tokens.split(",")]
    torch.set_num_threads(args.threads)
    device = args.device or "cpu"
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    path = resolve_model("default")
    tok = AutoTokenizer.from_pretrained(str(path))
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    id_range = (max(special) + 1, len(tok))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    n_var = 8 if args.quick else VARIED_REQUESTS
    n_eq = 8 if args.quick else EQUAL_REQUESTS
    eq_len = 32 if args.quick else EQUAL_OUTPUT
    wanted = [w.strip() for w in args.workloads.split(",") if w.strip()]
    workloads = []
    if "varied" in wanted:
        workloads.append(varied_workload(n_var, args.seed, id_range))
    if "equal" in wanted:
        workloads.append(equal_workload(n_eq, EQUAL_PROMPT, eq_len, args.seed, id_range))
    warm = warmup_workload(args.seed, id_range)

    print(
        f"offline throughput: SmolLM2-135M-Instruct ({path.name}), {args.dtype}, device {device}, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads "
        f"({os.cpu_count()} CPUs visible), {platform.processor() or platform.machine()}"
    )
    lo, hi = id_range
    print(f"prompt ids: uniform in [{lo}, {hi}) (normal tokens), seed {args.seed}")

    results: dict[str, list[Result]] = {w.name: [] for w in workloads}
    best_llm_settings: dict[str, Any] | None = None
    profile_out: dict[str, Any] | None = None

    if "kvloop" in engines:
        for budget in budgets:
            settings = {"max_num_seqs": args.kvloop_seqs, "max_num_batched_tokens": budget}
            t = time.perf_counter()
            llm = load_llm(args.kvloop_seqs, budget, args.device, args.dtype)
            print(f"kvloop loaded in {time.perf_counter() - t:.1f} s with {settings}")
            run_kvloop(llm, warm, "warm", settings)
            label = f"kvloop (seqs {args.kvloop_seqs}, tokens {budget})"
            for wl in workloads:
                r = run_kvloop(llm, wl, label, settings)
                results[wl.name].append(r)
                progress(r)
            del llm
            gc.collect()

    if "hf-static" in engines:
        model = load_hf(path, device, "sdpa", args.dtype)
        run_hf_static(model, warm, len(warm.prompts), pad_id)
        for wl in workloads:
            bs = args.hf_batch_size or len(wl.prompts)
            r = run_hf_static(model, wl, bs, pad_id)
            results[wl.name].append(r)
            progress(r)
        del model
        gc.collect()

    if "hf-cb" in engines:
        model = load_hf(path, device, args.hf_cb_attn, args.dtype)
        for r in run_hf_cb(model, workloads, warm, args.hf_cb_attn):
            results[r.workload].append(r)
            progress(r)
        del model
        gc.collect()

    # the best kvloop row: highest tok/s on the first workload (varied when run)
    kv_rows = {w.name: [r for r in results[w.name] if r.kind == "kvloop"] for w in workloads}
    best_budget: int | None = None
    if workloads and kv_rows[workloads[0].name]:
        first = max(kv_rows[workloads[0].name], key=lambda r: r.tok_s)
        best_budget = first.settings["max_num_batched_tokens"]
        best_llm_settings = first.settings

    def best_of(name: str) -> Result | None:
        for r in kv_rows.get(name, []):
            if r.settings.get("max_num_batched_tokens") == best_budget:
                return r
        return None

    for wl in workloads:
        print_table(wl, results[wl.name], best_of(wl.name))
        b = best_of(wl.name)
        for r in results[wl.name]:
            if b is not None and r.kind != "kvloop":
                print(f"  greedy agreement kvloop vs {r.kind}: {agreement(b, r)}")
    if best_llm_settings is not None:
        print(f"\nkvloop settings used for ratios and targets: {best_llm_settings}")
    shared = [
        r for w in workloads for r in results[w.name] if r.cpu_share < 0.8 or r.load_before > 2.5
    ]
    if shared:
        names = ", ".join(sorted({f"{r.kind}/{r.workload}" for r in shared}))
        print(
            f"note: cpu% < 80 or load > 2.5 for {names}: other processes shared the "
            f"{torch.get_num_threads()} cores (a 2-thread GEMM whose second thread is "
            "descheduled waits milliseconds per op), so those rows understate the engine"
        )

    # targets
    targets: list[dict[str, Any]] = []
    by = {w: {r.kind: r for r in results[w] if r.kind != "kvloop"} for w in results}
    bv, be = best_of("varied"), best_of("equal")
    if bv is not None:
        for kind in ("hf-static", "hf-cb"):
            other = by["varied"].get(kind)
            if other is not None and other.tok_s:
                ratio = bv.tok_s / other.tok_s
                targets.append(
                    {
                        "target": f"varied: kvloop >= {TARGET_RATIO}x {kind}",
                        "value": ratio,
                        "met": ratio >= TARGET_RATIO,
                        "shown": f"{ratio:.2f}x",
                    }
                )
    if be is not None:
        note = "" if not args.quick else " (quick run: 8 x 64/32, not the target workload)"
        targets.append(
            {
                "target": f"equal: kvloop > {TARGET_EQUAL_TOK_S:.0f} tok/s{note}",
                "value": be.tok_s,
                "met": be.tok_s > TARGET_EQUAL_TOK_S,
                "shown": f"{be.tok_s:.1f} tok/s",
            }
        )
    if targets:
        scope = "" if args.dtype == "float32" else f" (set for float32; this run is {args.dtype})"
        print(f"\ntargets{scope}:")
        for t in targets:
            print(f"  {t['target']:<52} {t['shown']:>12}  {'MET' if t['met'] else 'NOT MET'}")

    # ceiling (NOTE: always measured in float32, whatever --dtype the engines ran)
    cost = model_cost(path)
    gemm = measure_gemm(cost, device)
    body, lm = measure_model_pass(cost, device)
    hot = gemm["one layer (hot) M=256"]
    print(
        f"\n== ceiling ==\nFLOPs per token: body {cost.body_flops / 1e9:.3f} GFLOP (2 x "
        f"{cost.body_flops / 2e6:.1f} M non-embedding matmul params) + LM head "
        f"{cost.head_flops / 1e9:.3f} GFLOP = {cost.per_token / 1e9:.3f} GFLOP"
    )
    print(f"fp32 torch.mm on {torch.get_num_threads()} threads, weights hot in cache:")
    for k, v in gemm.items():
        print(f"  {k:<32} {v:7.1f} GFLOP/s")
    decode_ceiling = hot * 1e9 / cost.per_token
    print(
        f"-> naive ceiling {hot:.0f} GFLOP/s / {cost.per_token / 1e9:.3f} GFLOP = "
        f"{decode_ceiling:.0f} tok/s (~700: every token at hot-cache GEMM speed)"
    )
    weights_mb = 4 * cost.layers * sum(k * n for k, n in cost.layer_shapes) / 1e6
    print(
        f"one forward pass's matmuls with every layer's weights distinct ({weights_mb:.0f} MB "
        "streamed from memory per pass, as in the real model), and the LM head:"
    )
    print(f"  {'M tokens':>8} {'body ms':>8} {'GFLOP/s':>8} {'head ms':>8} {'tok/s at M':>10}")
    for m in PASS_M:
        g = 2 * m * cost.layers * sum(k * n for k, n in cost.layer_shapes) / body[m] / 1e9
        print(
            f"  {m:>8d} {1e3 * body[m]:>8.1f} {g:>8.1f} {1e3 * lm[m]:>8.1f}"
            f" {m / (body[m] + lm[m]):>10.0f}"
        )
    seqs = best_llm_settings["max_num_seqs"] if best_llm_settings else args.kvloop_seqs
    budget = best_llm_settings["max_num_batched_tokens"] if best_llm_settings else budgets[0]
    print(
        f"workload floors: the matmuls of kvloop's kind of schedule ({seqs} sequences, "
        f"{budget}-token steps, decodes first, prompt chunks fill the rest) at the "
        "streamed-weight times above; attention, sampling and all overheads free:"
    )
    ceiling_rows = []
    for wl in workloads:
        flops = cost.workload_flops(wl)
        floor_s, floor_steps = schedule_floor(wl, seqs, budget, body, lm)
        ceil_tok_s = sum(wl.output_lens) / floor_s
        row: dict[str, Any] = {
            "workload": wl.name,
            "flops": flops,
            "floor_s": floor_s,
            "floor_steps": floor_steps,
            "ceiling_tok_s": ceil_tok_s,
            "naive_ceiling_tok_s": decode_ceiling,
        }
        line = (
            f"  {wl.name}: {flops / 1e12:.2f} TFLOP in all; {floor_steps} steps, floor "
            f"{floor_s:.1f} s -> ceiling {ceil_tok_s:.0f} output tok/s"
        )
        kv = best_of(wl.name)
        if kv is not None:
            achieved = flops / kv.wall_s / 1e9
            row |= {
                "kvloop_tok_s": kv.tok_s,
                "kvloop_gflop_s": achieved,
                "kvloop_share_of_ceiling": kv.tok_s / ceil_tok_s,
                "kvloop_share_of_naive_ceiling": kv.tok_s / decode_ceiling,
            }
            line += (
                f"; kvloop {kv.tok_s:.0f} tok/s = {100 * kv.tok_s / ceil_tok_s:.0f}% of it, "
                f"{100 * kv.tok_s / decode_ceiling:.0f}% of the naive one "
                f"({achieved:.0f} GFLOP/s achieved)"
            )
        print(line)
        ceiling_rows.append(row)

    if args.profile and best_llm_settings is not None and workloads:
        budget = best_llm_settings["max_num_batched_tokens"]
        llm = load_llm(args.kvloop_seqs, budget, args.device, args.dtype)
        run_kvloop(llm, warm, "warm", best_llm_settings)
        profile_out = profile_kvloop(llm, workloads[0], best_llm_settings, args.top)
        del llm

    if args.json:
        doc = {
            "model": path.name,
            "device": device,
            "dtype": args.dtype,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "quick": args.quick,
            "seed": args.seed,
            "workloads": [
                {
                    "name": w.name,
                    "how": w.how,
                    "prompt_lens": w.prompt_lens,
                    "output_lens": w.output_lens,
                }
                for w in workloads
            ],
            "kvloop_settings": best_llm_settings,
            "results": [
                {k: v for k, v in asdict(r).items() if k != "tokens"} | {"tok_s": r.tok_s}
                for w in workloads
                for r in results[w.name]
            ],
            "targets": targets,
            "flops_per_token": cost.per_token,
            "gemm_hot_gflop_s": gemm,
            "model_pass_s": {"body": body, "lm_head": lm},
            "ceiling": ceiling_rows,
            "profile": profile_out,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
