"""Engine arguments: every knob of a real engine in one frozen dataclass, named like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvloop.config import CacheConfig, SchedulerConfig


@dataclass(frozen=True)
class EngineArgs:
    """What ``LLM(...)``, ``kvloop generate`` and ``kvloop serve`` accept (``kvloop simulate``
    takes the scheduler and KV-cache fields)."""

    model: str = "default"
    """``default`` (the embedded SmolLM2-135M-Instruct), a local Hugging Face folder, or a
    ``.gguf`` file. kvloop never downloads models."""
    dtype: str = "auto"
    """``float32``, ``bfloat16``, ``float16`` or ``auto`` (bfloat16 on CUDA and on CPUs with
    native bfloat16, AVX-512-BF16 or AMX; float32 on other CPUs)."""
    quantization: str | None = None
    """``int4``: weight-only 4-bit layer matrices (groups of 32, as a Q4_1 GGUF) and an 8-bit
    LM head (where kvloop's CPU kernels run), CPU with bfloat16 activations; None: weights
    in ``dtype``."""
    device: str | None = None
    """``cpu``, ``cuda`` or ``cuda:N``; None picks CUDA when available."""
    seed: int = 0
    """Engine seed for requests without their own."""
    block_size: int = 16
    """Tokens per KV block."""
    num_gpu_blocks: int | None = None
    """KV blocks on the device; None derives them from the memory budget."""
    kv_cache_memory: int | None = None
    """Bytes of KV cache on CPU (None: the runner's default budget)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of CUDA memory kvloop may use (weights + KV cache + activations)."""
    swap_space: float = 4.0
    """Host swap space in GiB for swap preemption."""
    kv_offload_space: float = 0.0
    """Host memory in GiB for the prefix cache's second tier (0: none; see
    ``CacheConfig.kv_offload_blocks``)."""
    kv_offload_write_policy: str = "write_back"
    """``write_back`` or ``write_through`` (``CacheConfig.kv_offload_write_policy``)."""
    kv_offload_load: str = "auto"
    """``auto``, ``load`` or ``recompute`` for host hits (``CacheConfig.kv_offload_load``)."""
    kv_eviction: str = "lru"
    """``lru`` or ``queue-aware`` (``CacheConfig.kv_eviction``)."""
    max_model_len: int | None = None
    """Longest prompt + output; None uses the model's max_position_embeddings."""
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step; None: 2048 on CUDA (and in the simulator), on CPU what
    keeps a step near 0.5 s for this model on this machine (``executor.torch.budget``)."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps."""
    long_prefill_token_threshold: int = 0
    """Cap on one prompt's chunk per step (0: none; see ``SchedulerConfig``)."""
    max_num_partial_prefills: int = 1
    """Most prompts whose prefill may be unfinished at once."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of equal prompt prefixes."""
    preemption_mode: str = "recompute"
    """``recompute`` or ``swap``."""
    scheduling_policy: str = "fcfs"
    """``fcfs``, ``priority``, ``slo``, ``fair``, ``sjf``, ``mlfq`` or ``balanced`` (see
    ``SchedulerConfig.policy``)."""
    slo_ttft: float | None = None
    """Default TTFT target in seconds (``slo`` needs it; goodput counts it)."""
    slo_tpot: float | None = None
    """Default TPOT target in seconds (``slo`` caps prefill to keep it; goodput counts it)."""
    slo_overload: str = "defer"
    """Under ``slo``: ``defer`` or ``reject`` requests that can no longer meet their TTFT."""
    aging_s: float = 60.0
    """Seconds of waiting worth one priority level (``priority``) or past the deadline
    before a deferred request comes first (``slo``): the starvation bound."""
    tenant_weights: tuple[tuple[str, float], ...] = ()
    """Under ``fair``: ``(tenant, weight)`` pairs (default weight 1)."""
    length_predictor: str = "history"
    """Output lengths for ``sjf`` and ``balanced``: ``oracle``, ``noisy`` or ``history``."""
    predictor_tau: float = 0.5
    """Kendall's tau the ``noisy`` predictor aims at."""
    cost_aware_preemption: bool = True
    """Pick victims by the work they throw away (see ``SchedulerConfig``); False: newest."""
    max_preemptions: int = 3
    """A request preempted this many times is spared while another victim exists."""
    scheduling_order: str = "decode-first"
    """``decode-first`` or ``prefill-first``."""
    skip_tokenizer_init: bool = False
    """Load no tokenizer (as vLLM): prompts must be token ids, outputs carry token ids and
    empty text, stop strings and chat are unavailable. For model folders without one."""
    generation_config: str = "auto"
    """Where default sampling settings come from (vLLM's ``--generation-config``): ``auto``,
    the model's ``generation_config.json`` (temperature, top_p, top_k, min_p,
    repetition_penalty, max_new_tokens as max_tokens); ``vllm``, vLLM's neutral defaults
    (temperature 1.0, 16 tokens); or a path to such a file or its folder. Defaults only:
    explicit sampling parameters win (``kvloop.engine.generation_config``)."""

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineArgs:
        """Build from keyword arguments, naming any unknown one in a ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)  # type: ignore[arg-type]

    # NOTE: the one derivation of the scheduler and cache configs: ``LLMEngine.from_args``
    # and ``kvloop simulate`` both call these; the executor (model runner or simulated
    # device) supplies only the model's length limit and the block counts.
    def scheduler_config(self, max_model_len: int, default_budget: int = 2048) -> SchedulerConfig:
        """The scheduler's config for a model that takes ``max_model_len`` tokens
        (``default_budget`` when ``max_num_batched_tokens`` is None)."""
        budget = self.max_num_batched_tokens or default_budget
        if not self.enable_chunked_prefill:
            budget = max(budget, max_model_len)
        return SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
            policy=self.scheduling_policy,  # type: ignore[arg-type]
            preemption_mode=self.preemption_mode,  # type: ignore[arg-type]
            scheduling_order=self.scheduling_order,  # type: ignore[arg-type]
            slo_ttft=self.slo_ttft,
            slo_tpot=self.slo_tpot,
            slo_overload=self.slo_overload,  # type: ignore[arg-type]
            aging_s=self.aging_s,
            tenant_weights=tuple(self.tenant_weights),
            length_predictor=self.length_predictor,  # type: ignore[arg-type]
            predictor_tau=self.predictor_tau,
            cost_aware_preemption=self.cost_aware_preemption,
            max_preemptions=self.max_preemptions,
        )

    def cache_config(self, num_gpu_blocks: int, num_cpu_blocks: int,
                     kv_offload_blocks: int = 0,
                     load_costs: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> CacheConfig:
        """The KV cache's config for the block counts the executor has room for;
        ``load_costs``: (seconds per block loaded, per load, per prompt token prefilled)."""
        per_block, latency, per_token = load_costs
        if not (isinstance(self.kv_offload_space, (int, float)) and self.kv_offload_space >= 0):
            raise ValueError(
                f"kv_offload_space (--kv-offload-space) must be >= 0 GiB, got "
                f"{self.kv_offload_space!r}")
        return CacheConfig(
            block_size=self.block_size,
            num_gpu_blocks=num_gpu_blocks,
            num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_offload_blocks=kv_offload_blocks,
            kv_offload_write_policy=self.kv_offload_write_policy,  # type: ignore[arg-type]
            kv_offload_load=self.kv_offload_load,  # type: ignore[arg-type]
            kv_load_s_per_block=per_block,
            kv_load_latency_s=latency,
            kv_recompute_s_per_token=per_token,
            kv_eviction=self.kv_eviction,  # type: ignore[arg-type]
        )
