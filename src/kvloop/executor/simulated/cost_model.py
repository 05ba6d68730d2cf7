"""Roofline step-time model for the simulated executor.

One engine step pushes every scheduled token (prefill chunks and decodes, mixed) through the
model once. With T tokens from S sequences, its predicted time (seconds, per rank; all ranks
run in lockstep) is the sum of

    gemm      = max(F / (P·mfu), W / (B·mbu))
                F = 2·N_lin·T + 2·V_r·H·S      projection FLOPs + LM head on each last token
                W = weight bytes streamed       every weight but an untied input embedding
    attention = max(4·L·h_r·d·A / (P·attn_mfu), (R + T)·kv / (B·attn_mbu))
                A = Σ c·(p + (c+1)/2)           query-key pairs under the causal mask
                R = Σ (p + c)                   KV entries read; T entries written
    allreduce = 2·L·(2(tp−1)/tp · T·H·b / B_ar + t_ar)          (0 when tp = 1)
    swap      = n_swap·block / (B_host·host_frac)
    copy      = 2·n_copy·block / (B·mbu)                         (read + write)
    overhead  = t_step + S·t_seq

where a request computes a chunk of c new tokens after p cached ones; L layers, H hidden
size, b dtype bytes, d head_dim; N_lin the per-rank projection weights (q, k, v, o, gate,
up, down over all layers), V_r the per-rank vocabulary, h_r the per-rank query heads, kv the
per-rank KV bytes per token, ``block`` the per-rank KV bytes of one block; P peak FLOP/s,
B memory bandwidth, B_ar all-reduce bus bandwidth, t_ar all-reduce latency, B_host host link
bandwidth. A step with no tokens costs only its swaps and copies (0 when there are none).
Not modelled: the vocab-parallel logits gather, sampling kernels, and overlap of swaps with
compute (vLLM issues them on the compute stream before the forward).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvloop.executor.simulated.specs import HardwareSpec, ModelSpec


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of the hardware peaks, and fixed software costs.

    Defaults describe a vLLM-class engine (CUDA graphs, FlashAttention/FlashInfer kernels,
    async output processing) serving bf16 weights. With them Llama-3.1-8B on one H100
    decodes at ~6.5 ms per step at batch 1 and prefills 2,048 tokens in ~68 ms.
    """

    mfu: float = 0.45
    """Fraction of peak FLOP/s the projection GEMMs reach end to end (norm, RoPE and SwiGLU
    kernels in between included). Llama-3 8B training in Megatron-LM runs at 413-430
    TFLOP/s per H100, 42-43% of 989 (swiss-ai/Megatron-LM PR #29, "Llama 3b/8b
    baseline"); inference prefill runs GEMMs of the same shapes (M = 2k-8k tokens)."""
    mbu: float = 0.75
    """Fraction of memory bandwidth achieved streaming weights. Fitted, together with
    ``step_overhead_s``, to two measured vLLM batch-1 decodes of Llama-3.1-8B bf16:
    6.48 ms TPOT on H100 (InferenceBench "Recipe: concurrency sweep",
    yobitelcomm.github.io/bench, vLLM 0.21) and ~75 tok/s on A100-40GB ("vLLM
    throughput-latency sweep on NVIDIA A100", johnmusgrave.com, vLLM 0.23: "roughly 77% of
    the memory-bandwidth ceiling"). Solving both gives 0.76 and 0.55 ms."""
    attn_mfu: float = 0.40
    """Fraction of peak FLOP/s of prefill attention. FlashAttention-3 (Shah et al., 2024)
    reports FlashAttention-2 at ~35% of H100 peak and FA3 up to 75% (740 TFLOP/s) on long
    sequences; serving runs short causal varlen chunks, in between."""
    attn_mbu: float = 0.70
    """Fraction of memory bandwidth reading/writing paged KV. FA2 paged batch decode on H100
    SXM reaches 47% of peak at only 65 MiB of KV, rising with size as its ~20 us fixed cost
    amortizes (microsoft/onnxruntime PR #21414); a bit below ``mbu`` for block gathers."""
    step_overhead_s: float = 5e-4
    """Fixed seconds per step: CUDA-graph launch, input preparation, sampling, scheduler.
    Fitted with ``mbu`` (see there). "vLLM v0.6.0: 2.7x Throughput Improvement and 5x
    Latency Reduction" (blog.vllm.ai, 2024-09-05) measured CPU work (API server 33%,
    scheduling 29%) dominating Llama-3-8B on H100 before async output processing and
    multi-step scheduling hid most of it; this is the part left on the critical path."""
    seq_overhead_s: float = 5e-6
    """Seconds per scheduled sequence per step (input tensors, sampling, output
    processing): the batch-proportional share of the CPU time in the same vLLM post;
    an estimate (1.3 ms at 256 sequences)."""
    host_link_fraction: float = 0.75
    """Fraction of the host link's line rate a KV swap reaches. nvbandwidth measures
    25.1 GB/s host-to-device on A100 (PCIe Gen4, 32 GB/s: 0.79; NVIDIA/nvbandwidth #42)
    and 35-53 GB/s on H100 (Gen5, 64 GB/s; NVIDIA/nvbandwidth #24)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s"):
                if value < 0:
                    raise ValueError(f"Efficiency.{f.name} must be >= 0, got {value}")
            elif not 0.0 < value <= 1.0:
                raise ValueError(f"Efficiency.{f.name} must be in (0, 1], got {value}")


class CostModel:
    """Predicts the wall time of one engine step from what the scheduler put in it.

    All constants are folded in ``__init__`` so :meth:`step_time` is a few multiply-adds:
    the simulator calls it once per step, hundreds of thousands of times.
    """

    def __init__(
        self, model: ModelSpec, hw: HardwareSpec, tp: int = 1, efficiency: Efficiency | None = None
    ) -> None:
        model.check_tp(tp)
        eff = efficiency if efficiency is not None else Efficiency()
        self.model, self.hw, self.tp, self.efficiency = model, hw, tp, eff
        gemm_rate = hw.peak_flops * eff.mfu
        self._t_flop_token = 2 * model.linear_params(tp) / gemm_rate
        self._t_flop_seq = 2 * model.vocab_params(tp) / gemm_rate
        self._t_weights = model.streamed_weight_bytes(tp) / (hw.mem_bandwidth * eff.mbu)
        heads = model.num_heads // tp
        self._t_attn_pair = (
            4 * model.num_layers * heads * model.head_dim / (hw.peak_flops * eff.attn_mfu)
        )
        kv = model.kv_bytes_per_token(tp)
        self._t_kv_token = kv / (hw.mem_bandwidth * eff.attn_mbu)
        self._t_swap_token = kv / (hw.host_link_bandwidth * eff.host_link_fraction)
        self._t_copy_token = 2 * kv / (hw.mem_bandwidth * eff.mbu)
        # NOTE: two all-reduces per layer (after attention and after the MLP), ring cost.
        if tp > 1:
            ring = 2 * (tp - 1) / tp
            self._t_ar_token = (
                2
                * model.num_layers
                * ring
                * model.hidden_size
                * model.dtype_bytes
                / hw.allreduce_bandwidth
            )
            self._t_ar_step = 2 * model.num_layers * hw.allreduce_latency_s
        else:
            self._t_ar_token = self._t_ar_step = 0.0
        self._t_step = eff.step_overhead_s
        self._t_seq = eff.seq_overhead_s

    def step_time(
        self,
        num_tokens: int,
        num_seqs: int,
        attn_pairs: float,
        kv_read_tokens: int,
        swap_blocks: int = 0,
        copy_blocks: int = 0,
        block_size: int = 16,
    ) -> float:
        """Seconds one step takes (see the module docstring for every term).

        ``num_tokens``: tokens computed (prefill chunks + decodes); ``num_seqs``: requests
        in the step; ``attn_pairs``: Σ c·(p + (c+1)/2); ``kv_read_tokens``: Σ (p + c);
        ``swap_blocks``/``copy_blocks``: KV blocks moved to/from host / copied on device.
        """
        moved = 0.0
        if swap_blocks or copy_blocks:
            moved = block_size * (
                swap_blocks * self._t_swap_token + copy_blocks * self._t_copy_token
            )
        if num_tokens <= 0:
            return moved
        gemm = num_tokens * self._t_flop_token + num_seqs * self._t_flop_seq
        if gemm < self._t_weights:
            gemm = self._t_weights
        attn = attn_pairs * self._t_attn_pair
        attn_mem = (kv_read_tokens + num_tokens) * self._t_kv_token
        if attn < attn_mem:
            attn = attn_mem
        return (
            gemm
            + attn
            + num_tokens * self._t_ar_token
            + self._t_ar_step
            + moved
            + self._t_step
            + num_seqs * self._t_seq
        )

    def breakdown(
        self,
        num_tokens: int,
        num_seqs: int,
        attn_pairs: float,
        kv_read_tokens: int,
        swap_blocks: int = 0,
        copy_blocks: int = 0,
        block_size: int = 16,
    ) -> dict[str, float]:
        """The terms of :meth:`step_time` by name, in seconds (``total`` is their sum)."""
        swap = block_size * swap_blocks * self._t_swap_token
        copy = block_size * copy_blocks * self._t_copy_token
        active = num_tokens > 0
        parts = {
            "gemm_compute": (num_tokens * self._t_flop_token + num_seqs * self._t_flop_seq)
            if active
            else 0.0,
            "gemm_memory": self._t_weights if active else 0.0,
            "attention_compute": attn_pairs * self._t_attn_pair if active else 0.0,
            "attention_memory": (
                (kv_read_tokens + num_tokens) * self._t_kv_token if active else 0.0
            ),
            "allreduce": (num_tokens * self._t_ar_token + self._t_ar_step) if active else 0.0,
            "swap": swap,
            "copy": copy,
            "overhead": (self._t_step + num_seqs * self._t_seq) if active else 0.0,
        }
        parts["gemm"] = max(parts["gemm_compute"], parts["gemm_memory"])
        parts["attention"] = max(parts["attention_compute"], parts["attention_memory"])
        parts["total"] = (
            parts["gemm"]
            + parts["attention"]
            + parts["allreduce"]
            + swap
            + copy
            + parts["overhead"]
        )
        return parts

    def decode_step_time(self, batch: int, context: int) -> float:
        """One decode step of ``batch`` sequences with ``context`` tokens cached each."""
        return self.step_time(batch, batch, batch * (context + 1.0), batch * (context + 1))

    def prefill_time(self, prompt_len: int) -> float:
        """One request's whole prompt of ``prompt_len`` tokens in a single step, no cache."""
        return self.step_time(prompt_len, 1, prompt_len * (prompt_len + 1) / 2, prompt_len)
