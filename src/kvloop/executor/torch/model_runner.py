"""The real executor: runs scheduled steps of a Hugging Face model on CPU or CUDA.

Per step: forget finished / recompute-preempted requests, apply the scheduler's block
copies (swap out, swap in, copy on write), lay out the step's tokens (decodes first, then
prefill chunks), run one forward pass over all of them, and sample one token for every
request whose known tokens are all computed by this step.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvloop.core.interface import ModelRunnerOutput, NewRequestData, SchedulerOutput
from kvloop.executor.torch import native
from kvloop.executor.torch.attention import build_metadata, long_tensor
from kvloop.executor.torch.kv_cache import (
    KVCache,
    block_bytes,
    cpu_kv_budget,
    cuda_kv_budget,
    physical_memory,
)
from kvloop.executor.torch.linear import check_quantization, parse_quantization
from kvloop.executor.torch.loader import (
    auto_dtype_note,
    load_model,
    resolve_device,
    resolve_dtype,
)
from kvloop.executor.torch.models import ModelConfig
from kvloop.executor.torch.sampler import Sampler, SamplingState

_CUDA_RESERVE_SLACK = 512 << 20
"""CUDA memory kept free beyond the activation estimate (allocator fragmentation)."""


@dataclass
class _RequestState:
    """What the runner remembers of a request between steps."""

    prompt: list[int]
    output: list[int]
    """Generated tokens; the same list object the request's ``SamplingState`` holds."""
    block_ids: list[int]
    num_computed: int
    sampling: SamplingState

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        if start >= n:
            return self.output[start - n : end - n]
        return self.prompt[start:] + self.output[: end - n]


class TorchModelRunner:
    """Executor over a real model with a paged KV cache (implements ``Executor``).

    ``num_gpu_blocks`` is taken as given, or sized from a memory budget: ``kv_cache_memory``
    bytes when given (any device), else on CPU 2 GiB capped at a fifth of RAM, and on CUDA
    ``total × gpu_memory_utilization − memory in use after loading − an activation
    reserve``. The host swap pool has ``num_cpu_blocks`` blocks, or as many as
    ``swap_space_bytes`` holds (default: none); the prefix cache's host tier adds as many
    as ``kv_offload_bytes`` holds (``num_offload_blocks``) to the same host pool.

    ``quantization`` (None or ``int4``) stores the layer matrices as weight-only int4
    (``executor.torch.linear``).

    ``max_model_len`` defaults to the model's ``max_position_embeddings``, capped at its
    sliding window if it has one (kvloop attends to the full context, which equals sliding
    attention only up to the window); the scheduler should use ``runner.max_model_len``.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str | torch.dtype = "auto",
        quantization: str | None = None,
        device: str | torch.device | None = None,
        block_size: int,
        num_gpu_blocks: int | None,
        num_cpu_blocks: int | None = None,
        swap_space_bytes: int | None = None,
        kv_offload_bytes: int = 0,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int | None = None,
        seed: int = 0,
        flex_attention: bool = False,
    ) -> None:
        self.model_path = Path(model_path)
        """The model's folder."""
        self.device = resolve_device(device)
        self.flex_attention = flex_attention
        """Attention reads the KV blocks in place (``flex.py``) instead of gathering them.
        Off unless asked for: its block lists are checked on CPU, its compiled CUDA kernels
        not yet on a GPU (``flex.py``); on CPU the gather path and kvloop's kernels are
        faster."""
        quantization = parse_quantization(quantization)
        auto = dtype == "auto"
        self.dtype = resolve_dtype(dtype, self.device, quantization)
        check_quantization(quantization, self.device, self.dtype)
        self.quantization = quantization
        self.dtype_note = auto_dtype_note(self.device, self.dtype) if auto else ""
        """Why ``auto`` chose this dtype (empty when the dtype was given)."""
        self.seed = seed
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.model_config: ModelConfig
        self.model_config, self.model = load_model(
            model_path, dtype=self.dtype, device=self.device, quantization=quantization
        )
        self.max_model_len = self._resolve_max_model_len(max_model_len)
        cfg = self.model_config
        self.native_attention: bool = not self.flex_attention and native.attention_supported(
            self.device, self.dtype, cfg.head_dim, cfg.num_heads)
        """Decodes and prefill chunks read the KV blocks in place through kvloop's CPU
        kernels (``native.decode_attention``, ``native.prefill_attention``)."""
        per_block = block_bytes(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, self.dtype
        )
        if num_gpu_blocks is None:
            num_gpu_blocks = self._blocks_from_budget(
                per_block, kv_cache_memory, gpu_memory_utilization
            )
        if num_cpu_blocks is None:
            num_cpu_blocks = (swap_space_bytes or 0) // per_block
        if num_gpu_blocks < 1 or num_cpu_blocks < 0:
            raise ValueError(
                f"need num_gpu_blocks >= 1 and num_cpu_blocks >= 0, got {num_gpu_blocks} and "
                f"{num_cpu_blocks} (one block takes {per_block} bytes)"
            )
        self.num_gpu_blocks: int = num_gpu_blocks
        self.num_cpu_blocks: int = num_cpu_blocks
        if kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be >= 0, got {kv_offload_bytes}")
        self.num_offload_blocks: int = kv_offload_bytes // per_block
        """Host blocks of the prefix cache's second tier (after the swap blocks)."""
        self.block_bytes: int = per_block
        self.kv_cache = KVCache(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks + self.num_offload_blocks,
            dtype=self.dtype,
            device=self.device,
        )
        self.sampler = Sampler(cfg.vocab_size, self.device)
        self.requests: dict[str, _RequestState] = {}

    @property
    def precision(self) -> str:
        """The activation dtype and the weights' quantisation if any: ``"float32"``,
        ``"bfloat16, int4 weights"`` (``dtype_note`` says why when ``auto`` chose it)."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}, {self.quantization} weights" if self.quantization else dtype

    @property
    def kernels_note(self) -> str:
        """Whose kernels run the model, for the load line: on CPU, kvloop's (by name) or
        torch's, with the reason where kvloop's are off; empty on other devices."""
        if self.device.type != "cpu":
            return ""
        attention = ["decode_attention", "prefill_attention"] if self.native_attention else []
        used = [*self.model.native_kernels, *attention]
        if used:
            return f"kvloop's CPU kernels: {', '.join(sorted(used))}"
        reason = native.unavailable_reason() or (
            "their build failed" if native.kernels() is None else "")
        return f"torch's kernels (kvloop's are off: {reason})" if reason else "torch's kernels"

    # -- setup -----------------------------------------------------------------------
    def _resolve_max_model_len(self, max_model_len: int | None) -> int:
        cfg = self.model_config
        window = cfg.sliding_window
        if max_model_len is None:
            limit = cfg.max_position_embeddings
            return min(limit, window) if window else limit
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"({cfg.max_position_embeddings})"
            )
        if window and window < max_model_len:
            raise ValueError(
                f"{cfg.architecture} uses sliding-window attention ({window} tokens), which "
                f"kvloop does not implement; set max_model_len <= {window} (got "
                f"{max_model_len}) so that full attention is exact"
            )
        return max_model_len

    def activation_reserve(self) -> int:
        """Estimated peak bytes of one step's activations beyond weights and KV cache."""
        cfg = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        per_token = 6 * cfg.hidden_size + 3 * qkv + 4 * cfg.intermediate_size
        tokens = self.max_num_batched_tokens
        logits = 4 * self.max_num_seqs * cfg.vocab_size * 4  # float32 logits + sampler copies
        return tokens * per_token * elem + logits + _CUDA_RESERVE_SLACK

    def device_memory(self) -> int:
        """Bytes of the device's memory: the GPU's total, or physical RAM on CPU."""
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[1]
        return physical_memory() or cpu_kv_budget(None)

    def _blocks_from_budget(
        self, per_block: int, kv_cache_memory: int | None, utilization: float
    ) -> int:
        if kv_cache_memory is not None or self.device.type != "cuda":
            budget = cpu_kv_budget(kv_cache_memory)
        else:
            budget = cuda_kv_budget(self.device, utilization, self.activation_reserve())
        if not (self.native_attention or self.flex_attention):
            # NOTE: the gather path copies one layer's context at a time (padded to the
            # longest request): keep room for about two layers' worth of cache for that
            # copy. kvloop's kernels and FlexAttention read the blocks in place.
            layers = self.model_config.num_layers
            budget = budget * layers // (layers + 2)
        return budget // per_block

    # -- the step --------------------------------------------------------------------
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step (the ``Executor`` protocol)."""
        start = time.perf_counter()
        with torch.inference_mode():
            self._apply_changes(scheduler_output)
            sampled, logprobs, errors = self._run(scheduler_output)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return ModelRunnerOutput(
            sampled_token_ids=sampled,
            step_time_s=time.perf_counter() - start,
            logprobs=logprobs,
            errors=errors,
        )

    def _apply_changes(self, so: SchedulerOutput) -> None:
        """Update per-request state and move blocks, in the order the contract fixes."""
        requests = self.requests
        for rid in so.finished_request_ids:
            requests.pop(rid, None)
        if so.preempted_request_ids:
            kept = set(so.swapped_out_request_ids)
            for rid in so.preempted_request_ids:
                if rid not in kept:
                    requests.pop(rid, None)
        # NOTE: device -> host (swap-outs, prefix stores) before host -> device (swap-ins,
        # prefix loads): a store reads its device block before anything of the step
        # writes it, and a load lands before the forward pass reads it. A load may read
        # a host block a store of the same step wrote (a block evicted, then hit): in
        # order, that is right; a swap-in never reads one.
        out = so.blocks_to_swap_out + so.blocks_to_offload if so.blocks_to_offload else (
            so.blocks_to_swap_out)
        _check_disjoint(out, so.blocks_to_swap_in)
        self.kv_cache.swap_out(out)
        self.kv_cache.swap_in(so.blocks_to_swap_in + so.blocks_to_load if so.blocks_to_load
                              else so.blocks_to_swap_in)
        self.kv_cache.copy(so.blocks_to_copy)
        for new in so.new_requests:
            requests[new.request_id] = self._new_state(new)
        cached = so.cached_requests
        for rid, blocks, computed, resumed in zip(
            cached.request_ids,
            cached.new_block_ids,
            cached.num_computed_tokens,
            cached.resumed_from_swap,
            strict=True,
        ):
            state = requests[rid]
            if resumed:
                state.block_ids = list(blocks)
            else:
                state.block_ids.extend(blocks)
            state.num_computed = computed

    def _new_state(self, new: NewRequestData) -> _RequestState:
        prompt = list(new.prompt_token_ids)
        output = list(new.output_token_ids)
        sampling = SamplingState(
            params=new.sampling_params,
            prompt_token_ids=prompt,
            output_token_ids=output,
            seed_offset=_request_seed(self.seed, new.request_id),
            stop_ids=new.stop_ids,
        )
        return _RequestState(prompt, output, list(new.block_ids), new.num_computed_tokens, sampling)

    def _run(self, so: SchedulerOutput) -> tuple[
            dict[str, Sequence[int]], dict[str, list[dict[int, float]]] | None,
            dict[str, str] | None]:
        """The step's sampled tokens, logprobs, and why a request got no token."""
        if not so.num_scheduled_tokens:
            return {}, None, None
        requests = self.requests
        decodes: list[tuple[int, str]] = []
        prefills: list[tuple[int, str]] = []
        for rid, n in so.num_scheduled_tokens.items():
            ctx = requests[rid].num_computed + n
            (decodes if n == 1 else prefills).append((ctx, rid))
        # NOTE: each kind sorted by context length, so attention groups pad little.
        decodes.sort()
        prefills.sort()
        order = [rid for _, rid in decodes] + [rid for _, rid in prefills]
        starts: list[int] = []
        lengths: list[int] = []
        tables: list[list[int]] = []
        input_ids: list[int] = []
        logits_rows: list[int] = []
        sample_ids: list[str] = []
        for rid in order:
            state = requests[rid]
            n = so.num_scheduled_tokens[rid]
            begin = state.num_computed
            end = begin + n
            known = state.num_tokens
            if end > known:
                raise RuntimeError(f"{rid}: scheduled up to token {end} but knows {known}")
            input_ids.extend(state.tokens(begin, end))
            if end == known:
                logits_rows.append(len(input_ids) - 1)
                sample_ids.append(rid)
            starts.append(begin)
            lengths.append(n)
            tables.append(state.block_ids)
            state.num_computed = end
        dev = self.device
        meta, positions = build_metadata(
            starts=starts,
            lengths=lengths,
            block_tables=tables,
            num_decodes=len(decodes),
            block_size=self.block_size,
            device=dev,
            dtype=self.dtype,
            flex_pool_blocks=self.num_gpu_blocks if self.flex_attention else None,
            native=self.native_attention,
        )
        ids_t = long_tensor(input_ids).to(dev, non_blocking=True)
        # NOTE: None when every row samples (they are then rows 0..T-1 in order).
        rows_t = (None if len(logits_rows) == len(input_ids) else
                  torch.tensor(logits_rows, dtype=torch.long).to(dev, non_blocking=True))
        logits = self.model.forward(ids_t, positions, self.kv_cache.layers, meta, rows_t)
        if not sample_ids:
            return {}, None, None
        states = [requests[rid].sampling for rid in sample_ids]
        tokens, token_logprobs = self.sampler.sample(logits, states)
        sampled: dict[str, Sequence[int]] = {}
        logprobs: dict[str, list[dict[int, float]]] = {}
        errors: dict[str, str] = {}
        for rid, state, tok, lp in zip(sample_ids, states, tokens, token_logprobs, strict=True):
            if tok is None:
                errors[rid] = ("the model's output for this request is not a number (NaN): "
                               "no token can be sampled from it")
                continue
            state.output_token_ids.append(tok)
            sampled[rid] = [tok]
            if lp is not None:
                logprobs[rid] = [lp]
        return sampled, logprobs or None, errors or None


def _check_disjoint(out: list[tuple[int, int]], into: list[tuple[int, int]]) -> None:
    """NOTE: swap-out runs before swap-in. That is safe when no host block freed by this
    step's swap-in is refilled by its swap-out, and no device block a swap-in fills is a
    swap-out source that has not been copied yet (the scheduler never swaps both ways in one
    step; the prefix host tier pins the host blocks its loads and stores touch and frees a
    swap-in's host blocks only after the step). Refuse a step that would break it rather
    than corrupt a cache silently."""
    if out and into and {h for _, h in out} & {h for h, _ in into}:
        raise RuntimeError("a host block is both a swap-out target and a swap-in source")


def _request_seed(seed: int, request_id: str) -> int:
    """A distinct, non-zero sampling stream for an unseeded request: derived from the
    runner seed and the request id, so it survives a recompute preemption."""
    digest = hashlib.blake2b(f"{seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") | 1
