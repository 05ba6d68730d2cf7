"""Command-line flags shared by ``simulate``, ``generate`` and ``serve``: vLLM's names.

They map onto ``EngineArgs`` fields, which derive the scheduler and cache configs for the
engine and the simulator alike."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
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
    "kv_offload_space",
    "kv_offload_write_policy",
    "kv_offload_load",
    "kv_eviction",
    "slo_ttft",
    "slo_tpot",
    "slo_overload",
    "aging_s",
    "tenant_weights",
    "length_predictor",
    "predictor_tau",
    "cost_aware_preemption",
    "max_preemptions",
)


_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")
SIZE_HELP = "bytes, or with a unit: 512MiB, 1GiB, 2GB (K/M/G/T alone: KiB/MiB/GiB/TiB)"


def parse_size(text: str) -> int:
    """Bytes from ``text``: a number of bytes (``1073741824``) or a number with a unit, binary
    (``KiB MiB GiB TiB``, or ``K M G T`` alone) or decimal (``KB MB GB TB``), in any case:
    ``512MiB``, ``1.5GiB``, ``2GB``. Raises ``argparse.ArgumentTypeError`` (a ``ValueError``
    argparse reports as ``argument --flag: <message>``) for anything else."""
    m = _SIZE.fullmatch(text)
    unit = _SIZE_UNITS.get(m.group(2).lower()) if m else None
    if m is None or unit is None:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: give {SIZE_HELP.replace('bytes', 'a number of bytes', 1)}")
    return int(float(m.group(1)) * unit)


def positive_size(text: str) -> int:
    """``parse_size`` for flags that need at least one byte (``--kv-cache-memory``)."""
    size = parse_size(text)
    if size < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be at least 1 byte")
    return size


def size_gib(text: str) -> float:
    """GiB (a float) for ``--swap-space``: a bare number is GiB as before (``4``, ``0.5``); a
    number with a unit is converted (``512MiB`` -> 0.5)."""
    m = _SIZE.fullmatch(text)
    if m is not None and not m.group(2):
        return float(m.group(1))
    return parse_size(text) / (1 << 30)


def format_size(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``48.0 MiB``, ``1.50 GiB``."""
    if n < 1 << 10:
        return f"{n} B"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def parse_tenant_weights(text: str) -> tuple[tuple[str, float], ...]:
    """``"gold=4,free=1"`` -> ``(("gold", 4.0), ("free", 1.0))``."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, weight = item.partition("=")
        try:
            value = float(weight)
        except ValueError:
            value = float("nan")
        if not sep or not name or not 0 < value < 1e9:
            raise argparse.ArgumentTypeError(
                f"expected TENANT=WEIGHT,... with positive weights, got {item!r}")
        pairs.append((name, value))
    return tuple(pairs)


def add_scheduler_args(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """Scheduler and KV-cache knobs; ``defaults`` override ``EngineArgs``' defaults."""
    d = EngineArgs()
    dv = {name: defaults.get(name, getattr(d, name)) for name in _SCHEDULER_FLAGS}
    g = p.add_argument_group("scheduler and KV cache")
    g.add_argument("--max-num-seqs", type=int, default=dv["max_num_seqs"])
    auto = ("auto: 2048 on CUDA; on CPU what keeps a step near 0.5 s for the model, "
            "measured at start-up")
    g.add_argument("--max-num-batched-tokens", type=int, default=dv["max_num_batched_tokens"],
                   help="tokens per step (default: "
                   f"{auto if dv['max_num_batched_tokens'] is None else '%(default)s'})")
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
        "--scheduling-policy",
        choices=["fcfs", "priority", "slo", "fair", "sjf", "mlfq", "balanced"],
        default=dv["scheduling_policy"],
        help="waiting-queue order: fcfs; priority (aged by --aging); slo (earliest TTFT "
        "deadline, prefill capped to keep --slo-tpot); fair (per-tenant fair share); sjf "
        "(shortest predicted work first); mlfq (skip-join multi-level feedback queue); "
        "balanced (slo's deadlines, shorter first, within fair shares) (default: %(default)s)",
    )
    g.add_argument("--length-predictor", choices=["oracle", "noisy", "history"],
                   default=dv["length_predictor"],
                   help="output lengths for sjf and balanced: oracle (max_tokens), noisy "
                   "(the oracle at Kendall's tau --predictor-tau), history (learned from "
                   "finished requests) (default: %(default)s)")
    g.add_argument("--predictor-tau", type=float, default=dv["predictor_tau"], metavar="TAU",
                   help="Kendall's tau of the noisy predictor, in [0, 1] (default: "
                   "%(default)s)")
    g.add_argument("--slo-ttft", type=float, default=dv["slo_ttft"], metavar="SECONDS",
                   help="TTFT target in seconds: what 'slo' schedules for and goodput counts "
                   "(requests may carry their own) (default: none)")
    g.add_argument("--slo-tpot", type=float, default=dv["slo_tpot"], metavar="SECONDS",
                   help="TPOT target in seconds (requests may carry their own) (default: none)")
    g.add_argument("--slo-overload", choices=["defer", "reject"], default=dv["slo_overload"],
                   help="under slo, what happens to a request that can no longer meet its "
                   "TTFT (default: %(default)s)")
    g.add_argument("--aging", dest="aging_s", type=float, default=dv["aging_s"],
                   metavar="SECONDS", help="starvation bound: seconds of waiting worth one "
                   "priority level; under slo, how late a deferred request may get before it "
                   "comes first (default: %(default)s)")
    g.add_argument("--tenant-weights", type=parse_tenant_weights, default=dv["tenant_weights"],
                   metavar="T=W,...", help="under fair: service share weights, e.g. "
                   "gold=4,free=1 (default: every tenant weight 1)")
    g.add_argument("--cost-aware-preemption", action=argparse.BooleanOptionalAction,
                   default=dv["cost_aware_preemption"],
                   help="pick victims by the work they throw away; --no-cost-aware-preemption: "
                   "the newest least urgent request (vLLM) (default: %(default)s)")
    g.add_argument("--max-preemptions", type=int, default=dv["max_preemptions"],
                   help="a request preempted this many times is spared while another victim "
                   "exists (default: %(default)s)")
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
        "--swap-space", type=size_gib, default=dv["swap_space"], metavar="GIB",
        help="host swap space per GPU: GiB, or a size with a unit such as 512MiB "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--kv-offload-space", type=size_gib, default=dv["kv_offload_space"], metavar="GIB",
        help="host memory per GPU for the prefix cache's second tier: blocks leaving the "
        "device cache are kept there and loaded back on a hit (default: 0, none)",
    )
    g.add_argument("--kv-offload-write-policy", choices=["write_back", "write_through"],
                   default=dv["kv_offload_write_policy"],
                   help="copy a block to host memory when the device evicts it, or as soon "
                   "as it is cached (default: %(default)s)")
    g.add_argument("--kv-offload-load", choices=["auto", "load", "recompute"],
                   default=dv["kv_offload_load"],
                   help="host hits: load, recompute, or per request whichever the cost "
                   "model finds cheaper (default: %(default)s)")
    g.add_argument("--kv-eviction", choices=["lru", "queue-aware"], default=dv["kv_eviction"],
                   help="device prefix-cache eviction: lru, or queue-aware (LRU passing over "
                   "blocks the next waiting requests would hit) (default: %(default)s)")


def _quantization(text: str) -> str | None:
    """``--quantization``: ``none`` or one of ``QUANTIZATIONS`` (``parse_quantization``)."""
    from kvloop.executor.torch.linear import parse_quantization

    try:
        return parse_quantization(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Flags of a real engine: model, dtype, device, memory, seed."""
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default="default",
        help="'default' (embedded SmolLM2-135M-Instruct), a HF folder or a .gguf "
        "(default: default)",
    )
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="activation and weight dtype; auto: bfloat16 on CUDA and on CPUs with "
                   "native bfloat16 (AVX-512-BF16, AMX), else float32 (default: auto)")
    g.add_argument("--quantization", default=None, type=_quantization, metavar="none|int4",
                   help="int4: weight-only 4-bit layer matrices (groups of 32, as a Q4_1 "
                   "GGUF) and an 8-bit LM head; CPU, bfloat16; kvloop's fastest CPU path "
                   "where its AVX-512 VNNI kernels run (default: none)")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: auto)")
    g.add_argument("--kv-cache-memory", type=positive_size, default=None, metavar="SIZE",
                   help=f"KV cache size on CPU (on CUDA too when given): {SIZE_HELP} "
                   "(default: 2 GiB, at most a fifth of RAM)")
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


def local_model_config(model: str) -> tuple[dict[str, Any], Path] | None:
    """(config.json, its path) of ``--model`` when that is already on disk, read without
    loading, converting or importing torch: a local folder, or the cached conversion of
    ``default`` or of a ``.gguf`` file once it exists. None when it cannot be read cheaply
    (the engine then reports whatever is wrong with the model)."""
    try:
        if model == "default" or model.lower().endswith(".gguf"):
            from kvloop.engine.model_source import converted_path, default_gguf_path

            gguf = default_gguf_path() if model == "default" else Path(model).expanduser()
            if not gguf.is_file():
                return None
            folder = converted_path(gguf)
        else:
            folder = Path(model).expanduser()
        path = folder / "config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return (config, path) if isinstance(config, dict) else None


def check_max_tokens_early(args: argparse.Namespace) -> None:
    """Refuse ``--max-tokens`` (and ``--max-model-len``) beyond the model's length before the
    model loads, when its ``config.json`` is at hand (``local_model_config``): a prompt needs
    at least one token, so ``max_tokens`` must be below ``max_model_len`` (the flag, else the
    model's ``max_position_embeddings``). Raises ``ValueError``; silent when the limit is not
    known yet (the engine checks each request exactly, sliding windows included)."""
    max_tokens = getattr(args, "max_tokens", None)
    max_model_len = getattr(args, "max_model_len", None)
    if max_tokens is None and max_model_len is None:
        return
    found = local_model_config(str(getattr(args, "model", "default")))
    if found is None:
        return
    config, path = found
    model_len = config.get("max_position_embeddings")
    limit = int(model_len) if isinstance(model_len, int) and model_len > 0 else None
    origin = f"the model's max_position_embeddings in {path}"
    if max_model_len is not None:
        if limit is not None and max_model_len > limit:
            raise ValueError(f"--max-model-len {max_model_len} exceeds the model's "
                             f"max_position_embeddings ({limit}, in {path})")
        limit, origin = max_model_len, "--max-model-len"
    if max_tokens is not None and limit is not None and max_tokens >= limit:
        raise ValueError(
            f"--max-tokens {max_tokens} leaves no room for a prompt: a prompt and its output "
            f"fit in {limit} tokens ({origin}); use --max-tokens {limit - 1} or less")


def check_prompts_early(args: argparse.Namespace, prompts: list[Any]) -> None:
    """Refuse a prompt that cannot run before the model loads: an empty one (text without
    ``--chat``, or token ids), and, when the model's ``config.json`` and tokenizer are on
    disk (``local_model_config``), one whose tokens (through the chat template with
    ``--chat``) leave no room for an output token within ``--max-model-len`` or the model's
    ``max_position_embeddings``, or for ``--max-tokens`` of them. Raises ``ValueError``
    naming the prompt (``--prompt 2``: the second); silent when the limit is not known yet
    (the engine checks each request exactly, its KV cache too)."""
    chat = bool(getattr(args, "chat", False))

    def name(i: int) -> str:
        return "--prompt" if len(prompts) == 1 else f"--prompt {i + 1}"

    for i, prompt in enumerate(prompts):
        if not chat and not (prompt.strip() if isinstance(prompt, str) else prompt):
            raise ValueError(f"{name(i)} is empty: give the text to continue")
    found = local_model_config(str(getattr(args, "model", "default")))
    if found is None or getattr(args, "skip_tokenizer_init", False):
        return
    config, path = found
    model_len = config.get("max_position_embeddings")
    limit = getattr(args, "max_model_len", None) or (
        model_len if isinstance(model_len, int) and model_len > 0 else None)
    if limit is None:
        return
    try:
        from kvloop.engine.tokenizer import load_tokenizer  # NOTE: tokenizers only, not torch

        tokenizer = load_tokenizer(path.parent)
        system = getattr(args, "system", None)
        counts = [len(tokenizer.apply_chat_template(
            [*([{"role": "system", "content": system}] if system else []),
             {"role": "user", "content": p}]) if chat else tokenizer.encode(p))
            for p in prompts]
    except Exception:  # NOTE: the engine reports whatever is wrong with the tokenizer
        return
    origin = ("--max-model-len" if getattr(args, "max_model_len", None)
              else f"the model's max_position_embeddings in {path}")
    max_tokens = getattr(args, "max_tokens", None) or 1
    for i, n in enumerate(counts):
        if n + max_tokens > limit:
            out = f"--max-tokens {max_tokens}" if max_tokens > 1 else "one output token"
            raise ValueError(f"{name(i)} is {n} tokens; with {out} that is more than the "
                             f"{limit} tokens the model takes ({origin})")
