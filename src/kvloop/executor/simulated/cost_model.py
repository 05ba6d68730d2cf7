"""Step-time model for the simulated executor (cost model v2).

One engine step pushes every scheduled token (prefill chunks and decodes, mixed) through
the model once. With T tokens from S requests (D decodes over contexts k_i, and prefill
chunks of c tokens after p cached ones), its predicted time in seconds, per rank (all ranks
run in lockstep), is the sum of these terms:

    gemm        L · Σ_g gemm(T', n_g, k_g)         g ∈ {qkv, o}, and gate_up, down in the
                                                   L_d dense-MLP layers
    experts     L_m · (gemm(T', E, H)              the router, replicated
                  + Σ_g gemm*(T'·k, n_g, k_g; u)   one fused kernel per projection over the
                                                   T'·k routed rows, reading the weights of
                                                   the u = E·(1 − (1 − k/E)^T') experts they
                                                   touch
                  + Σ_g gemm(T', n_g, k_g)         shared experts, if any
                  + op(4·T'·k·H·b))                dispatch to experts, weighted combine
    lm_head     gemm(S, V_r, H)                    logits of each request's last token
    norm        (2L + 1) · op(2·T·H·b)             RMSNorm read + write
    rope        L · op(2·T·(h_r + kv_r)·d·b)
    activation  L · op(3·T·I_r·b)                  SwiGLU: gate, up in; product out
    residual    2L · op(3·T·H·b)
    embedding   op(2·T·H·b)
    sampling    op(3·S·V·4)                        fp32 logits: softmax, top-k/p, sample
    attention   L · (prefill chunks + decodes + launch)   see AttentionCurve
    allreduce   2L · allreduce(T·H·b)              tensor parallel only
    swap        n_swap · block / (B_host · host_link_fraction)
    copy        2 · n_copy · block / (B · gemm.memory_fraction)
    overhead    step_s + seq_s·S + token_s·T       the serving engine (EngineOverhead)

where ``gemm(m, n, k)`` is the :class:`GemmCurve` at F = 2·m·n·k FLOPs and
W = (n·k + m·k + m·n)·b bytes, and ``op(bytes)`` a :class:`MemoryOp`. L layers (L_d with a
dense MLP, L_m with experts: ``ModelSpec.moe``, E routed experts, k per token, split across
the ranks as vLLM's tensor parallelism splits them), H hidden size, I_r the per-rank MLP
width, V the vocabulary (V_r per rank), h_r / kv_r the per-rank query / KV heads, d the head
dimension, b the weight dtype's bytes. T' is T, or under an engine that replays CUDA
graphs (``EngineOverhead.cuda_graphs``) the captured size T is padded to (vLLM's sizes: 1,
2, 4, then multiples of 8 to 256, of 16 to 512; its decode-only steps replay whole-step
graphs, mixed ones piecewise graphs around attention, both padded). A step with no tokens
costs only its swaps and copies.

With expert parallelism (``expert_parallel``, vLLM's ``--enable-expert-parallel``) over
``ep = tp·dp`` ranks each rank holds E/ep whole experts and computes their share of the
routed rows of every data-parallel rank's tokens (``dp`` ranks, each assumed to run a batch
like this one); with ``dp > 1`` each MoE layer adds a dispatch and a combine all-to-all of
the rank's T'·k·H·b bytes, costed as an all-reduce (NCCL's or vLLM's custom one, not the
fused kernel) of half as many bytes (the traffic an all-to-all puts on each GPU).

Not modelled: speculative decoding, quantized weights, overlap of swaps with compute, the
vocab-parallel logits gather, pipeline parallelism, skewed routing, load imbalance between
data-parallel ranks.

With measured tables (``kvloop profile``, :class:`StepTables`) for the very model, ``gemm``
is the table's per-token work at T (norms, RoPE, activation, residual and embedding folded
in, those terms 0) and ``lm_head`` its per-request work at S (sampling folded in).

Every term that depends only on T or S is computed once per distinct value and cached, so a
step costs a few dictionary lookups plus a short loop over its prefill chunks: the simulator
calls this hundreds of thousands of times.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from kvloop.executor.simulated.efficiency import DeviceEfficiency, EngineOverhead
from kvloop.executor.simulated.network import AllReduceModel, allreduce_model
from kvloop.executor.simulated.specs import HardwareSpec, ModelSpec
from kvloop.executor.simulated.tables import StepTables

CUDA_GRAPH_SIZES = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))
"""Batch sizes vLLM captures CUDA graphs of for decode-only steps (its default
``cudagraph_capture_sizes`` up to 512)."""

Chunk = tuple[int, int]
"""(c, p): a request computing c > 1 prompt tokens after p cached ones."""

TERMS = (
    "gemm",
    "experts",
    "lm_head",
    "norm",
    "rope",
    "activation",
    "residual",
    "embedding",
    "sampling",
    "attention_prefill",
    "attention_decode",
    "attention_launch",
    "allreduce",
    "swap",
    "overhead",
)
"""Names of :meth:`CostModel.breakdown`'s terms (their sum is ``total``)."""


class CostModel:
    """Predicts the wall time of one engine step from what the scheduler put in it.

    ``efficiency`` defaults to the GPU's shipped profile (``hw.efficiency``); ``overhead``
    to no engine overhead; ``tables`` (measured for this model) replace the per-token and
    per-request terms. See the module docstring for every term.
    """

    def __init__(
        self,
        model: ModelSpec,
        hw: HardwareSpec,
        tp: int = 1,
        efficiency: DeviceEfficiency | None = None,
        overhead: EngineOverhead | None = None,
        tables: StepTables | None = None,
        *,
        dp: int = 1,
        expert_parallel: bool = False,
    ) -> None:
        model.check_tp(tp)
        if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
            raise ValueError(f"data parallel size must be a positive int, got {dp!r}")
        if expert_parallel and model.moe is None:
            raise ValueError(f"{model.name} has no experts: expert parallelism needs a "
                             "mixture-of-experts model")
        self.model, self.hw, self.tp = model, hw, tp
        self.dp = dp
        """Data-parallel ranks the step's experts serve (vLLM's ``--data-parallel-size``):
        each runs a batch like this one; this model costs one of them."""
        self.ep = tp * dp if expert_parallel else 1
        """Ranks the experts are spread over (1: split by tensor parallelism instead)."""
        self.efficiency = eff = efficiency if efficiency is not None else hw.efficiency()
        self.overhead = overhead if overhead is not None else EngineOverhead(source="none")
        self.tables = tables
        b = model.dtype_bytes
        heads, kv_heads = model.num_heads // tp, model.kv_heads_per_rank(tp)
        d, h = model.head_dim, model.hidden_size
        inter = math.ceil(model.intermediate_size / tp)
        self._layers = model.num_layers
        self._moe_layers = model.num_moe_layers
        dense_layers = self._layers - self._moe_layers
        # (n, k) of each projection GEMM, per rank, and the layers that run it.
        self._gemms = (
            (self._layers, ((heads + 2 * kv_heads) * d, h)),
            (self._layers, (h, heads * d)),
            (dense_layers, (2 * inter, h)),
            (dense_layers, (h, inter)),
        )
        act_bytes = dense_layers * 3 * inter
        moe = model.moe
        if moe is not None:
            # NOTE: with expert parallelism each rank holds whole experts (a 1/ep share of
            # them), else a 1/tp slice of every expert
            expert = moe.expert_intermediate_size if self.ep > 1 else math.ceil(
                moe.expert_intermediate_size / tp)
            shared = math.ceil(moe.shared_intermediate_size / tp)
            self._expert_gemms = ((2 * expert, h), (h, expert))
            self._shared_gemms = ((2 * shared, h), (h, shared)) if shared else ()
            rows = moe.experts_per_token * dp / self.ep if self.ep > 1 else moe.experts_per_token
            act_bytes += self._moe_layers * 3 * (rows * expert + shared)
            self._alltoall: AllReduceModel | None = (
                allreduce_model(hw.interconnect, self.ep, fused=False)
                if self.ep > 1 and dp > 1 else None)
        self._vocab_r = math.ceil(model.vocab_size / tp)
        self._b = b
        self._ops_per_token = (
            (2 * self._layers + 1, 2 * h * b, eff.norm),
            (self._layers, 2 * (heads + kv_heads) * d * b, eff.rope),
            (self._layers, act_bytes * b / self._layers, eff.activation),
            (2 * self._layers, 3 * h * b, eff.residual),
            (1, 2 * h * b, eff.embedding),
        )
        # NOTE: vLLM fuses the all-reduce with the RMSNorm only with one data-parallel rank
        self._allreduce: AllReduceModel | None = (
            allreduce_model(hw.interconnect, tp, fused=dp == 1) if tp > 1 else None
        )
        bw, att = hw.mem_bandwidth, eff.attention
        kv_layer = 2 * kv_heads * d * b  # K and V of one token in one layer
        self._kv_layer = kv_layer
        self._q_layer = heads * d * b
        self._pair_flops = 4 * heads * d  # QK^T and PV per query-key pair, one layer
        self._t_decode_token = self._layers * kv_layer / (bw * att.decode_fraction)
        self._decode_pad = att.decode_half_context
        self._t_attn_step = self._layers * att.launch_s
        self._t_chunk = self._layers * att.chunk_s
        kv_all = model.kv_bytes_per_token(tp)
        self._t_swap_token = kv_all / (hw.host_link_bandwidth * eff.host_link_fraction)
        self._by_tokens: dict[int, tuple[float, ...]] = {}
        self._by_seqs: dict[int, tuple[float, float]] = {}

    # -- cached per-T and per-S terms ---------------------------------------------------
    def _gemm(self, m: int, n: int, k: int) -> float:
        f = 2.0 * m * n * k
        w = (n * k + m * k + m * n) * self._b
        return self.efficiency.gemm.time(f, w, self.hw.peak_flops, self.hw.mem_bandwidth)

    def _experts(self, t: int) -> float:
        """One MoE layer's router, routed and shared experts, dispatch and combine at T = t
        (the module docstring's ``experts`` term, per layer)."""
        moe = self.model.moe
        assert moe is not None
        h, b, hw = self.model.hidden_size, self._b, self.hw
        ep, k = self.ep, moe.experts_per_token
        # NOTE: the experts serve every data-parallel rank's tokens (each rank runs a batch
        # like this one); with expert parallelism this rank computes its share of the
        # experts (and of their rows), else its slice of all of them.
        touched = moe.experts_touched(t * self.dp) / ep
        pairs = t * self.dp * k / ep  # (token, expert) rows this rank computes
        time = self._gemm(t, moe.num_experts, h)
        if self._alltoall is not None:
            # NOTE: dispatch and combine: each moves this rank's t·k rows, (ep-1)/ep of them
            # to other ranks, half what a ring all-reduce of the same bytes moves
            time += 2 * self._alltoall.time(t * k * h * b / 2)
        for n, kk in self._expert_gemms:
            # NOTE: one fused kernel per projection for all experts (vLLM's fused_moe):
            # the touched experts' weights, every routed row in and out.
            flops = 2.0 * pairs * n * kk
            moved = (touched * n * kk + pairs * (n + kk)) * b
            time += self.efficiency.gemm.time(flops, moved, hw.peak_flops, hw.mem_bandwidth)
        time += sum(self._gemm(t, n, kk) for n, kk in self._shared_gemms)
        return time + self.efficiency.residual.time(4 * pairs * h * b, hw.mem_bandwidth)

    def _token_terms(self, t: int) -> tuple[float, ...]:
        """(gemm, experts, norm, rope, activation, residual, embedding, allreduce) at T = t."""
        terms = self._by_tokens.get(t)
        if terms is None:
            bw = self.hw.mem_bandwidth
            experts = 0.0
            if self.tables is not None:
                gemm, ops = self.tables.token_time(t), (0.0,) * len(self._ops_per_token)
            else:
                gemm = sum(layers * self._gemm(t, n, k) for layers, (n, k) in self._gemms)
                if self._moe_layers:
                    experts = self._moe_layers * self._experts(t)
                ops = tuple(count * op.time(t * per, bw) for count, per, op in self._ops_per_token)
            ar = 0.0
            if self._allreduce is not None:
                ar = 2 * self._layers * self._allreduce.time(t * self.model.hidden_size * self._b)
            terms = (gemm, experts, *ops, ar)
            self._by_tokens[t] = terms
        return terms

    def _seq_terms(self, s: int) -> tuple[float, float]:
        """(lm_head, sampling) at S = s."""
        terms = self._by_seqs.get(s)
        if terms is None:
            if self.tables is not None:
                terms = (self.tables.seq_time(s), 0.0)
            else:
                lm_head = self._gemm(s, self._vocab_r, self.model.hidden_size)
                sampling = self.efficiency.activation.time(
                    3 * s * self.model.vocab_size * 4, self.hw.mem_bandwidth
                )
                terms = (lm_head, sampling)
            self._by_seqs[s] = terms
        return terms

    def _chunk(self, c: int, p: int) -> float:
        """Attention of one prefill chunk over all layers (AttentionCurve's formula)."""
        att, hw = self.efficiency.attention, self.hw
        k = p + c
        eff = att.prefill_fraction * k / (k + att.prefill_half_context)
        compute = self._pair_flops * c * (p + (c + 1) / 2) / (hw.peak_flops * eff)
        memory = (k * self._kv_layer + c * self._q_layer) / (hw.mem_bandwidth * att.decode_fraction)
        return self._layers * max(compute, memory) + self._t_chunk

    # -- the step -------------------------------------------------------------------------
    def step_time(
        self,
        num_decodes: int,
        decode_context: int,
        chunks: Sequence[Chunk] = (),
        swap_blocks: int = 0,
        block_size: int = 16,
    ) -> float:
        """Seconds one step takes.

        ``num_decodes``: requests computing one token; ``decode_context``: Σ of their
        contexts including that token (p + 1); ``chunks``: (c, p) of every request
        computing c > 1 tokens; ``swap_blocks``: KV blocks moved to or from
        the host.
        """
        moved = block_size * swap_blocks * self._t_swap_token if swap_blocks else 0.0
        tokens = num_decodes
        attention = 0.0
        for c, p in chunks:
            tokens += c
            attention += self._chunk(c, p)
        if tokens <= 0:
            return moved
        seqs = num_decodes + len(chunks)
        if num_decodes:
            attention += (decode_context + num_decodes * self._decode_pad) * self._t_decode_token
        gemm, experts, norm, rope, act, res, emb, ar = self._token_terms(
            self._graph_tokens(tokens))
        lm_head, sampling = self._seq_terms(seqs)
        return (
            gemm + experts + norm + rope + act + res + emb + ar + lm_head + sampling
            + attention + self._t_attn_step + moved + self.overhead.time(seqs, tokens)
        )

    def _graph_tokens(self, tokens: int) -> int:
        """The batch a step of ``tokens`` runs at: its CUDA graph's captured size when the
        engine replays graphs (up to the largest), else ``tokens``."""
        if not self.overhead.cuda_graphs or tokens > CUDA_GRAPH_SIZES[-1]:
            return tokens
        return CUDA_GRAPH_SIZES[bisect.bisect_left(CUDA_GRAPH_SIZES, tokens)]

    def breakdown(
        self,
        num_decodes: int,
        decode_context: int,
        chunks: Sequence[Chunk] = (),
        swap_blocks: int = 0,
        block_size: int = 16,
    ) -> dict[str, float]:
        """The terms of :meth:`step_time` by name (``TERMS``), in seconds, plus ``total``."""
        parts = dict.fromkeys(TERMS, 0.0)
        parts["swap"] = block_size * swap_blocks * self._t_swap_token
        tokens = num_decodes + sum(c for c, _ in chunks)
        if tokens > 0:
            seqs = num_decodes + len(chunks)
            names = ("gemm", "experts", "norm", "rope", "activation", "residual", "embedding",
                     "allreduce")
            parts.update(zip(names, self._token_terms(self._graph_tokens(tokens)), strict=True))
            parts["lm_head"], parts["sampling"] = self._seq_terms(seqs)
            parts["attention_prefill"] = sum(self._chunk(c, p) for c, p in chunks)
            parts["attention_decode"] = (
                (decode_context + num_decodes * self._decode_pad) * self._t_decode_token
                if num_decodes
                else 0.0
            )
            parts["attention_launch"] = self._t_attn_step
            parts["overhead"] = self.overhead.time(seqs, tokens)
        parts["total"] = sum(parts[name] for name in TERMS)
        return parts

    def decode_step_time(self, batch: int, context: int) -> float:
        """One decode step of ``batch`` requests with ``context`` tokens cached each."""
        return self.step_time(batch, batch * (context + 1))

    def prefill_time(self, prompt_len: int) -> float:
        """One request's whole prompt of ``prompt_len`` tokens in a single step, no cache."""
        if prompt_len == 1:
            return self.step_time(1, 1)
        return self.step_time(0, 0, [(prompt_len, 0)])
