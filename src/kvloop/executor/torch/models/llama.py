"""The Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3, Mixtral,
Qwen3-MoE) over a paged KV cache.

One functional implementation: GQA attention with RoPE (transformers' rotate-half
convention; default, linear and llama3 frequency scaling), RMSNorm, a SwiGLU MLP or a mixture
of experts (``moe``), optional q/k/v bias (Qwen2), per-head query/key norms (Qwen3) and tied
embeddings. The layer is written once (:meth:`LlamaForCausalLM._forward`) against
``layer_ops`` (kvloop's fused CPU kernels or torch's ops, picked at load), attention
(``attention``/``flex``) and the layer matrices (``linear``); a step of decodes only may run
the same layer as one native call (``native.DecodeLayers``, built from the same weights).
Numerics follow transformers' modeling_llama: RMSNorm in float32 then cast back before the
weight, cos/sin computed in float32 from ``position * inv_freq`` and cast to the activation
dtype, scale ``head_dim ** -0.5``.

NOTE: q/k/v and gate/up projections are fused into one matrix each (one matmul instead of
three or two), and every layer matrix is stored in the layout its device multiplies fastest
(``executor.torch.linear``: oneDNN-packed on CPU, int4, or dense ``[out, in]``).
The LM head is one more such matrix (on CPU a packed copy of a tied embedding; elsewhere it
shares the embedding's storage); under ``int4`` it is stored at 8 bits where kvloop's kernel
runs (``linear.HEAD_QUANTIZATION``, as llama.cpp's 4-bit files keep it).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from kvloop.executor.torch import native
from kvloop.executor.torch.attention import AttentionMetadata, paged_attention
from kvloop.executor.torch.flex import flex_paged_attention
from kvloop.executor.torch.layer_ops import pick_layer_ops, rms_norm
from kvloop.executor.torch.linear import (
    HEAD_QUANTIZATION,
    Linear,
    int8_runs,
    logits,
    make_linear,
)
from kvloop.executor.torch.models.moe import MoE

if TYPE_CHECKING:
    from kvloop.executor.torch.huge_pages import HugePageMove
    from kvloop.executor.torch.models import ModelConfig


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse RoPE frequencies [head_dim / 2] (float32, CPU), as transformers computes them
    for the default, ``linear`` and ``llama3`` rope types."""
    dim = config.head_dim
    base = config.rope_theta
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    inv_freq = 1.0 / (base**exponent)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    assert rope_type == "llama3", rope_type
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@dataclass
class DecoderLayer:
    """One decoder layer's weights: norms, and fused q/k/v, o, fused gate/up and down
    matrices (their biases inside)."""

    input_norm: Tensor
    qkv: Linear
    o: Linear
    post_norm: Tensor
    gate_up: Linear | None
    """The fused gate/up matrix of a dense MLP (None where ``moe`` is the MLP)."""
    down: Linear | None
    q_norm: Tensor | None = None
    """RMSNorm weights [head_dim] of each query head before RoPE (Qwen3), or None."""
    k_norm: Tensor | None = None
    """And of each key head (with ``q_norm``)."""
    moe: MoE | None = None
    """The layer's mixture of experts, in place of the dense MLP (Mixtral, Qwen3-MoE)."""

    @property
    def mlp_tensors(self) -> list[Tensor]:
        """The MLP's tensors, in the order a step reads them."""
        if self.moe is not None:
            return self.moe.tensors
        assert self.gate_up is not None and self.down is not None
        return [*self.gate_up.tensors, *self.down.tensors]


class LlamaForCausalLM:
    """A Llama-family causal LM computing a mixed batch of tokens over a paged KV cache."""

    def __init__(
        self,
        config: ModelConfig,
        embed: Tensor,
        layers: list[DecoderLayer],
        norm: Tensor,
        lm_head: Linear,
    ) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.device = embed.device
        self.dtype = embed.dtype
        self.inv_freq = rope_inv_freq(config).to(self.device)
        self._rope_cos = self._rope_sin = embed.new_empty(0, config.head_dim)
        self.scale = config.head_dim**-0.5
        self._q_size = config.num_heads * config.head_dim
        self._qk_heads = config.num_heads + config.num_kv_heads
        self._dense_mlp = any(layer.moe is None for layer in layers)
        self.layer_ops = pick_layer_ops(self.device, self.dtype, config.hidden_size,
                                        config.head_dim, config.intermediate_size)
        """A layer's small ops (``layer_ops``): kvloop's fused CPU kernels where they run
        this model, else torch's."""
        self.weights_move: HugePageMove | None = None
        """The streamed weights' copy onto huge pages until it is applied (the loader makes
        it, :meth:`start_weights_move` starts it, :meth:`adopt_moved_weights` applies it)."""
        self._forward_lock = threading.Lock()
        self.loaded_ready = False
        """Whether the weights came from a ready-to-run file (``ready_weights``) rather
        than from converting the checkpoint."""
        self.saving_ready = False
        """Whether converted weights are being saved ready to run for later starts."""
        self.decode_layers = self.build_decode_layers() if self.layer_ops.fused else None
        """``native.DecodeLayers`` where every layer matrix is in kvloop's kernels: a step of
        decodes only, read in place, then runs all layers in one call (the layer of
        :meth:`_forward` with the same kernels, without Python between them), while
        :attr:`layer_ops` are kvloop's kernels."""

    def start_weights_move(self) -> None:
        """Start copying the streamed weights onto huge pages (:attr:`weights_move`) in the
        background; once copied they are swapped in at once if no forward is running, else
        by the next forward before it starts."""
        def adopt_if_idle() -> None:
            if self._forward_lock.acquire(blocking=False):
                try:
                    self._adopt(False)
                finally:
                    self._forward_lock.release()

        if self.weights_move is not None:
            self.weights_move.start(adopt_if_idle)

    def adopt_moved_weights(self, wait: bool = False) -> None:
        """Point the weights at their huge-page copies (:attr:`weights_move`) once they are
        made (``wait``: now), and rebuild ``DecodeLayers`` over them. Never during a forward.

        NOTE: DecodeLayers reads the weights where they were when built, and keeps that
        memory alive: dropped before the move (so the old copies are freed), built after."""
        with self._forward_lock:
            self._adopt(wait)

    def _adopt(self, wait: bool) -> None:
        """:meth:`adopt_moved_weights`, the forward lock held."""
        move = self.weights_move
        if move is None or not (wait or move.ready):
            return
        self.weights_move = None
        had_decode_layers, self.decode_layers = self.decode_layers is not None, None
        move.apply()
        if had_decode_layers:
            self.decode_layers = self.build_decode_layers()

    def build_decode_layers(self) -> object | None:
        """A ``native.DecodeLayers`` over the layers' current weights, or None where a layer
        matrix is not in kvloop's kernels.

        NOTE: it reads the weights' memory as it is now: build it again after moving them
        (as :meth:`adopt_moved_weights` does)."""
        cfg, norms, matrices = self.config, [], []
        for layer in self.layers:
            if layer.q_norm is not None or layer.moe is not None:  # NOTE: not in the one call
                return None
            norms += [layer.input_norm, layer.post_norm]
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                operands = getattr(lin, "native_operands", None)
                if operands is None:
                    return None
                matrices.append(operands)
        return native.decode_layers(norms, matrices, cfg.num_heads, cfg.num_kv_heads,
                                    cfg.head_dim, cfg.intermediate_size)

    @classmethod
    def load_weights(
        cls,
        config: ModelConfig,
        get: Callable[..., Tensor],
        has: Callable[[str], bool],
        quantization: str | None = None,
    ) -> LlamaForCausalLM:
        """Build the model from transformers-named tensors: ``get(name)`` returns one on the
        target device and dtype (``get(name, exact=True)``: in float32, to be quantised),
        ``has(name)`` says whether the checkpoint holds it; ``quantization`` (None or
        ``int4``) is how layer matrices are stored (and the LM head, ``HEAD_QUANTIZATION``)."""

        def linear(names: list[str], has_bias: bool) -> Linear:
            """The fused matrix of the weights ``names`` (and their bias if ``has_bias``)."""
            weight = torch.cat([get(n, exact=quantization is not None) for n in names])
            bias = None
            if has_bias:
                bias = torch.cat([get(n.replace("weight", "bias")) for n in names])
            return make_linear(weight, bias, quantization=quantization, dtype=embed.dtype)

        embed = get("model.embed_tokens.weight")
        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            att, mlp = p + "self_attn.", p + "mlp."
            qk_norms = has(att + "q_norm.weight")
            moe = (MoE.load(config.moe, p, get, linear)
                   if config.moe is not None and i in config.moe.layers else None)
            layers.append(
                DecoderLayer(
                    q_norm=get(att + "q_norm.weight") if qk_norms else None,
                    k_norm=get(att + "k_norm.weight") if qk_norms else None,
                    input_norm=get(p + "input_layernorm.weight"),
                    qkv=linear([att + f"{n}_proj.weight" for n in "qkv"], config.qkv_bias),
                    o=linear([att + "o_proj.weight"], config.o_bias),
                    post_norm=get(p + "post_attention_layernorm.weight"),
                    gate_up=None if moe else linear(
                        [mlp + "gate_proj.weight", mlp + "up_proj.weight"], config.mlp_bias),
                    down=None if moe else linear([mlp + "down_proj.weight"], config.mlp_bias),
                    moe=moe,
                )
            )
        head_quantization = HEAD_QUANTIZATION.get(quantization) if quantization else None
        if head_quantization == "int8" and not int8_runs(embed):
            head_quantization = None  # NOTE: a tied head then shares the embedding's storage
        if has("lm_head.weight") and not config.tie_word_embeddings:
            lm_head = get("lm_head.weight", exact=head_quantization is not None)
        elif config.tie_word_embeddings:
            lm_head = embed
            if head_quantization is not None:
                lm_head = get("model.embed_tokens.weight", exact=True)
        else:
            raise ValueError("checkpoint has no lm_head.weight and does not tie embeddings")
        head = make_linear(lm_head, None, quantization=head_quantization, dtype=embed.dtype)
        return cls(config, embed, layers, get("model.norm.weight"), head)

    @property
    def num_parameter_bytes(self) -> int:
        """Bytes held by the weights (storage a tied head shares with the embedding counted
        once; a packed copy of it counted)."""
        return _nbytes([self.embed, *self.streamed_tensors()])

    @property
    def streamed_bytes(self) -> int:
        """Bytes of weights one decode step reads: every layer's, the final norm and the LM
        head; not the embedding, of which a step reads only a few rows."""
        return _nbytes(self.streamed_tensors())

    @property
    def native_kernels(self) -> list[str]:
        """kvloop's CPU kernels (``native``) this model runs, by name (the load line)."""
        names: set[str] = set()
        for lin in (self.lm_head, *(m for layer in self.layers
                                    for m in (layer.qkv, layer.o, layer.gate_up, layer.down,
                                              *(m for pair in (layer.moe.experts if layer.moe
                                                               else ()) for m in pair)))):
            if (operands := getattr(lin, "native_operands", None)) is not None:
                names.add(operands[0])
        for name, rows in native.amx_rows().items():
            if name in names:
                names.discard(name)
                names.add(f"{name} with AMX from {rows} rows")
        if self.layer_ops.fused:
            names.update(("rms_norm", "rope_write_kv", "silu_mul"))
        if self.decode_layers is not None:
            names.add("DecodeLayers")
        return sorted(names)

    def streamed_tensors(self) -> list[Tensor]:
        """The tensors of :attr:`streamed_bytes`, in the order a decode step reads them."""
        tensors: list[Tensor] = []
        for layer in self.layers:
            tensors += [layer.input_norm, *layer.qkv.tensors, *layer.o.tensors,
                        layer.post_norm, *layer.mlp_tensors]
        return [*tensors, self.norm, *self.lm_head.tensors]

    def rope(self, positions: Tensor, num_positions: int) -> tuple[Tensor, Tensor]:
        """cos and signed sin [T, head_dim] in the activation dtype for ``positions``
        (all below ``num_positions``), rows of tables grown to cover them.

        NOTE: the tables hold what transformers computes per step (float32 ``position *
        inv_freq``, its cos and sin, cast to the activation dtype): elementwise, so a row is
        the same bits whichever step computes it; a step then indexes two rows instead of
        running ~10 small ops (~0.15 ms a step on CPU). ``native.DecodeLayers`` copies the
        rows of :meth:`rope_tables` itself.
        NOTE: transformers' ``rotate_half(x) * sin`` is ``cat(-x2, x1) * sin``, which equals
        ``cat(x2, x1) * cat(-sin1, sin2)`` exactly (negation is exact), saving one op per
        layer; the returned sin carries that sign.
        """
        cos_table, sin_table = self.rope_tables(num_positions)
        return cos_table.index_select(0, positions), sin_table.index_select(0, positions)

    def rope_tables(self, num_positions: int) -> tuple[Tensor, Tensor]:
        """The cos and signed sin tables [rows, head_dim] that :meth:`rope` indexes, grown
        to at least ``num_positions`` rows."""
        if num_positions > self._rope_cos.shape[0]:
            # NOTE: doubling, so a long generation grows the tables O(log n) times.
            n = max(num_positions, 2 * self._rope_cos.shape[0], 256)
            table = torch.arange(n, device=self.device)
            freqs = table[:, None].float() * self.inv_freq[None, :]
            self._rope_cos = torch.cat((freqs, freqs), dim=-1).cos().to(self.dtype)
            sin = freqs.sin().to(self.dtype)
            self._rope_sin = torch.cat((-sin, sin), dim=-1)
        return self._rope_cos, self._rope_sin

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_layers: list[Tensor],
        meta: AttentionMetadata,
        logits_indices: Tensor | None,
    ) -> Tensor:
        """Compute the step's tokens ([T] ids at [T] positions), writing their K/V into the
        per-layer caches; return float32 logits [N, vocab] of the rows ``logits_indices``
        (None: of every row, as in a step of decodes only)."""
        with self._forward_lock:  # NOTE: the weights do not move during a forward
            if self.weights_move is not None:
                self._adopt(False)
            return self._forward(input_ids, positions, kv_layers, meta, logits_indices)

    def _forward(self, input_ids: Tensor, positions: Tensor, kv_layers: list[Tensor],
                 meta: AttentionMetadata, logits_indices: Tensor | None) -> Tensor:
        cfg, ops = self.config, self.layer_ops
        eps, num_tokens = cfg.rms_norm_eps, input_ids.shape[0]
        head_dim, num_heads, num_kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        slots = meta.slot_mapping
        if ops.fused and self.decode_layers is not None and _all_decodes(meta, num_tokens):
            group = meta.groups[0]
            x = self.decode_layers.run(
                input_ids, self.embed, *self.rope_tables(meta.num_positions), positions,
                kv_layers, slots, group.blocks.view(num_tokens, -1), group.context_lens, eps,
                self.scale)
        else:
            cos, sin = self.rope(positions, meta.num_positions)
            attention = paged_attention if meta.flex_masks is None else flex_paged_attention
            x = F.embedding(input_ids, self.embed)
            # NOTE: x is this step's own buffer: residual adds go into it in place (fused
            # with the output projections), and one normed-input and one activation buffer
            # serve every layer. Fewer fresh buffers means fewer page faults on CPU.
            h = torch.empty_like(x)
            act = x.new_empty(num_tokens, cfg.intermediate_size) if self._dense_mlp else x
            for layer, cache in zip(self.layers, kv_layers, strict=True):
                ops.rms_norm(x, layer.input_norm, eps, h)
                qkv = layer.qkv(h)
                if layer.q_norm is not None:
                    self._norm_heads(qkv[:, :self._qk_heads * head_dim].view(
                        num_tokens, self._qk_heads, head_dim), layer)
                ops.rope_write_kv(qkv, cos, sin, cache, slots, num_heads, num_kv)
                q = qkv[:, :self._q_size].view(num_tokens, num_heads, head_dim)
                layer.o.add_to_(x, attention(q, cache, meta, self.scale))
                ops.rms_norm(x, layer.post_norm, eps, h)
                if layer.moe is not None:
                    x.add_(layer.moe(h))
                    continue
                assert layer.gate_up is not None and layer.down is not None
                ops.silu_mul(layer.gate_up(h), act)
                layer.down.add_to_(x, act)
        rows = _rows(x, logits_indices)
        ops.rms_norm(rows, self.norm, eps, rows)
        return logits(self.lm_head, rows)

    def _norm_heads(self, qk: Tensor, layer: DecoderLayer) -> None:
        """Qwen3's per-head RMSNorm of the query and key heads of ``qk`` [T, heads, d], in
        place, before RoPE."""
        n = self.config.num_heads
        eps = self.config.rms_norm_eps
        qk[:, :n] = rms_norm(qk[:, :n], layer.q_norm, eps)
        qk[:, n:] = rms_norm(qk[:, n:], layer.k_norm, eps)


def _rows(x: Tensor, indices: Tensor | None) -> Tensor:
    """The rows ``indices`` of ``x`` (a copy), or ``x`` itself for None (every row: a decode
    step's index_select cost ~0.08 ms on CPU, its code cold after the weights streamed)."""
    return x if indices is None else x.index_select(0, indices)


def _all_decodes(meta: AttentionMetadata, num_tokens: int) -> bool:
    """Whether the step's ``num_tokens`` tokens are decodes of as many sequences, in one
    group that kvloop's kernel reads in place (what ``native.DecodeLayers`` runs)."""
    if len(meta.groups) != 1 or meta.flex_masks is not None:
        return False
    group = meta.groups[0]
    return (group.context_lens is not None and group.starts is None
            and group.num_seqs == num_tokens)


def _nbytes(tensors: list[Tensor]) -> int:
    """Bytes of ``tensors``, storage shared between them counted once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t.is_mkldnn:  # a packed copy (linear.PackedLinear): shares nothing
            total += t.numel() * t.element_size()
        elif t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
