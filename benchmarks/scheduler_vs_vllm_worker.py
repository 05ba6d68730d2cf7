"""The vLLM half of ``scheduler_vs_vllm.py``: vLLM V1's scheduler driven on the same plans,
run under vLLM's own venv (``--vllm-python``) as a worker process; imports nothing from
kvloop. Also the plan and sample records both halves exchange as JSON.

    <vllm-venv>/bin/python benchmarks/scheduler_vs_vllm_worker.py [--vllm-hash-algo sha256]
        [--no-vllm-log-stats]    # one JSON plan per stdin line, one sample per stdout line
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FIRST_TOKEN_ID = 1000
"""Prompts use consecutive token ids from here on (as scheduler_overhead's ``_Ids``)."""
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": 1 << 20,
    "max_position_embeddings": 1 << 16,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass
class Plan:
    """One workload, JSON-able, sized by scheduler_overhead and replayed by both sides."""

    scenario: str
    n: int
    steps: int
    block_size: int
    max_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    num_gpu_blocks: int
    chunk: int
    """long_prefill_token_threshold (0: none)."""
    decode_prompt_len: int
    n_long: int
    long_max_tokens: int
    stream_prompt_len: int
    stream_output_len: int
    n_stream: int
    warm_steps: int


@dataclass
class Sample:
    """One timed run of one plan."""

    seconds: float
    mean_running: float
    finished: int
    admitted: int
    prefill_tokens: int
    add_request_build_us: float = 0.0
    """vLLM mixed only: mean µs to build one stream Request (prompt block hashing), untimed."""
    prompt_hash_us: float = 0.0
    """kvloop mixed only: µs to hash one stream prompt's blocks (inside its timed region)."""
    cpu_share: float = 0.0
    """Process CPU time / wall time over the whole run (warm-up included)."""


# -- vLLM side (runs in the vLLM venv; imports nothing from kvloop) ------------------------


class _VllmSide:
    """Builds vLLM V1 schedulers the way EngineCore does, minus the executor."""

    def __init__(self, hash_algo: str, log_stats: bool, model_dir: str) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        self.hash_algo = hash_algo
        self.log_stats = log_stats
        self.model_dir = model_dir
        self._hash_fn = get_hash_fn_by_name(hash_algo)
        init_none_hash(self._hash_fn)
        self._hasher_factory = get_request_block_hasher
        self._hasher: Any = None
        self._next_id = FIRST_TOKEN_ID

    def scheduler(self, plan: Plan) -> Any:
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        model_config = ModelConfig(
            model=self.model_dir,
            skip_tokenizer_init=True,
            dtype="float32",
            seed=0,
            max_model_len=plan.max_model_len,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=plan.max_num_seqs,
            max_num_batched_tokens=plan.max_batched_tokens,
            max_model_len=plan.max_model_len,
            enable_chunked_prefill=True,
            long_prefill_token_threshold=plan.chunk,
            async_scheduling=False,
            is_encoder_decoder=False,
        )
        cache_config = CacheConfig(
            block_size=plan.block_size,
            enable_prefix_caching=True,
            prefix_caching_hash_algo=self.hash_algo,
        )
        vllm_config = VllmConfig(
            model_config=model_config,
            scheduler_config=scheduler_config,
            cache_config=cache_config,
        )
        num_blocks = plan.num_gpu_blocks + 1  # block 0 is vLLM's null block
        spec = FullAttentionSpec(
            block_size=plan.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        self._hasher = self._hasher_factory(hash_block_size, self._hash_fn)
        self._next_id = FIRST_TOKEN_ID
        return Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            log_stats=self.log_stats,
        )

    def request(self, rid: str, prompt_len: int, max_tokens: int) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        start = self._next_id
        self._next_id += prompt_len
        return Request(
            request_id=rid,
            prompt_token_ids=list(range(start, start + prompt_len)),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=self._hasher,
        )


@dataclass
class _StepInfo:
    seconds: float
    prefill_tokens: int
    preempted: int


def _vllm_step(s: Any) -> _StepInfo:
    """One step; returns the seconds in the two scheduler calls (harness excluded)."""
    from vllm.v1.outputs import ModelRunnerOutput

    t0 = time.perf_counter()
    out = s.schedule()
    t1 = time.perf_counter()
    req_ids = list(out.num_scheduled_tokens)
    requests = s.requests
    sampled: list[list[int]] = []
    prefill = 0
    for rid in req_ids:
        r = requests[rid]
        done = r.num_computed_tokens  # already advanced by schedule()
        before = done - out.num_scheduled_tokens[rid]
        if before < r.num_prompt_tokens:
            prefill += min(done, r.num_prompt_tokens) - before
        sampled.append([0] if done >= r.num_tokens else [])
    result = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )
    t2 = time.perf_counter()
    s.update_from_output(out, result)
    seconds = (t1 - t0) + (time.perf_counter() - t2)
    return _StepInfo(seconds, prefill, len(out.preempted_req_ids or ()))


def _vllm_warm_long(s: Any, reqs: list[Any]) -> int:
    for r in reqs:
        s.add_request(r)
    preempted = 0
    for _ in range(10_000):
        if all(r.num_output_tokens for r in reqs):
            return preempted
        preempted += _vllm_step(s).preempted
    raise RuntimeError("vLLM warm-up did not bring every request to decoding")


def run_vllm(side: _VllmSide, plan: Plan) -> Sample:
    from vllm.utils.gc_utils import freeze_gc_heap

    gc.unfreeze()
    wall, cpu = time.perf_counter(), time.process_time()
    s = side.scheduler(plan)
    freeze_gc_heap()  # as EngineCore.__init__ does once the scheduler exists
    sample = _run_vllm_plan(side, s, plan)
    sample.cpu_share = (time.process_time() - cpu) / (time.perf_counter() - wall)
    return sample


def _run_vllm_plan(side: _VllmSide, s: Any, plan: Plan) -> Sample:
    reqs = [
        side.request(f"d{i}", plan.decode_prompt_len, plan.long_max_tokens)
        for i in range(plan.n_long)
    ]
    preempted = _vllm_warm_long(s, reqs)
    build_s = 0.0
    if plan.scenario == "decode":
        for _ in range(plan.warm_steps):
            preempted += _vllm_step(s).preempted
        gc.collect()
        total = 0.0
        for _ in range(plan.steps):
            info = _vllm_step(s)
            total += info.seconds
            preempted += info.preempted
        running, waiting = s.get_request_counts()
        if running != plan.n or waiting or preempted:
            raise RuntimeError(
                f"vLLM decode N={plan.n}: not a steady decode batch "
                f"({running} running, {waiting} waiting, {preempted} preempted)"
            )
        return Sample(total, float(plan.n), 0, 0, 0)

    stream = iter(range(plan.n_stream))

    def add_stream() -> float:
        t = time.perf_counter()
        req = side.request(f"s{next(stream)}", plan.stream_prompt_len, plan.stream_output_len)
        elapsed = time.perf_counter() - t
        s.add_request(req)
        return elapsed

    for _ in range(plan.n_stream - plan.steps):
        add_stream()
        preempted += _vllm_step(s).preempted
    gc.collect()
    total = 0.0
    running = finished = admitted = prefill = 0
    for _ in range(plan.steps):
        build_s += add_stream()
        waiting_before = s.get_request_counts()[1]
        live_before = len(s.requests)
        info = _vllm_step(s)
        total += info.seconds
        preempted += info.preempted
        prefill += info.prefill_tokens
        n_running, waiting_after = s.get_request_counts()
        admitted += waiting_before - waiting_after
        finished += live_before - len(s.requests)
        running += n_running
    if preempted:
        raise RuntimeError(f"vLLM mixed N={plan.n}: {preempted} preemptions")
    return Sample(
        total, running / plan.steps, finished, admitted, prefill, build_s / plan.steps * 1e6
    )


_MARK = "@@sched-vs-vllm@@ "
"""Prefix of the worker's answer lines on stdout (anything else there is vLLM's chatter)."""


def vllm_main(hash_algo: str, log_stats: bool) -> int:
    """The worker: one JSON plan per stdin line, one marked JSON sample per stdout line."""
    import vllm

    def answer(obj: dict[str, Any]) -> None:
        sys.stdout.write(_MARK + json.dumps(obj) + "\n")
        sys.stdout.flush()

    with tempfile.TemporaryDirectory(prefix="tiny-llama-") as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(TINY_LLAMA))
        side = _VllmSide(hash_algo, log_stats, model_dir)
        answer({"version": vllm.__version__})
        for line in sys.stdin:
            if line.strip():
                answer(asdict(run_vllm(side, Plan(**json.loads(line)))))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-hash-algo", default="sha256")
    p.add_argument("--vllm-log-stats", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)
    return vllm_main(args.vllm_hash_algo, args.vllm_log_stats)


if __name__ == "__main__":
    raise SystemExit(main())
