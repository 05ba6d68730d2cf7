"""Command-line flags shared by ``simulate``, ``generate`` and ``serve``: vLLM's names.

They map onto ``EngineArgs`` fields, which derive the scheduler and cache configs for the
engine and the simulator alike."""

from __future__ import annotations

import argparse
from typing import Any

from kvloop.engine.args import EngineArgs

_SCHEDULER_FLAGS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "enable_chunked_prefill",
    "long_prefill_token_threshold",
    "max_num_partial_prefills",
    "scheduling_policy",
    "scheduling_order",
    "preemption_mode",
    "block_size",
    "enable_prefix_caching",
    "num_gpu_blocks",
    "gpu_memory_utilization",
    "swap_space",
)


def add_scheduler_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """Scheduler and KV-cache knobs; ``defaults`` override ``EngineArgs``' defaults."""
    d = EngineArgs()
    dv = {name: defaults.get(name, getattr(d, name)) for name in _SCHEDULER_FLAGS}
    g = p.add_argument_group("scheduler and KV cache")
    g.add_argument("--max-num-seqs", type=int, default=dv["max_num_seqs"])
    g.add_argument("--max-num-batched-tokens", type=int, default=dv["max_num_batched_tokens"],
                   help="tokens per step (default: %(default)s; None: 2048 on CUDA, on CPU "
                   "what keeps steps near 0.5 s for the model)")
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: the model's max_position_embeddings",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=dv["enable_chunked_prefill"],
    )
    g.add_argument(
        "--long-prefill-token-threshold", type=int, default=dv["long_prefill_token_threshold"]
    )
    g.add_argument("--max-num-partial-prefills", type=int, default=dv["max_num_partial_prefills"])
    g.add_argument(
        "--scheduling-policy", choices=["fcfs", "priority"], default=dv["scheduling_policy"]
    )
    g.add_argument(
        "--scheduling-order",
        choices=["decode-first", "prefill-first"],
        default=dv["scheduling_order"],
    )
    g.add_argument(
        "--preemption-mode", choices=["recompute", "swap"], default=dv["preemption_mode"]
    )
    g.add_argument("--block-size", type=int, default=dv["block_size"])
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=dv["enable_prefix_caching"],
    )
    g.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="KV blocks on the device (default: from the memory budget)",
    )
    g.add_argument("--gpu-memory-utilization", type=float, default=dv["gpu_memory_utilization"])
    g.add_argument(
        "--swap-space", type=float, default=dv["swap_space"], help="host swap space per GPU in GiB"
    )


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Flags of a real engine: model, dtype, device, memory, seed."""
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default="default",
        help="'default' (embedded SmolLM2-135M-Instruct), a HF folder or a .gguf",
    )
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: auto)")
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache on CPU")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: prompts and outputs are token ids")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|PATH",
                   help="default sampling settings: 'auto', the model's generation_config.json "
                   "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); "
                   "'vllm', vLLM's neutral ones; or a generation_config.json (or its folder) "
                   "(default: auto)")
    add_scheduler_args(p)


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from parsed flags (only the fields the parser defined)."""
    names = {f for f in EngineArgs.__dataclass_fields__ if hasattr(args, f)}
    return EngineArgs(**{n: getattr(args, n) for n in names})


def scheduler_args_from(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from the ``add_scheduler_args`` flags alone (the simulator's ``--model``
    and ``--seed`` name a model preset and a workload seed, not an engine's)."""
    return EngineArgs(**{n: getattr(args, n) for n in _SCHEDULER_FLAGS})
