"""The Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2) over a paged KV cache.

One functional implementation: GQA attention with RoPE (transformers' rotate-half
convention; default, linear and llama3 frequency scaling), RMSNorm, a SwiGLU MLP, optional
q/k/v bias (Qwen2) and tied embeddings. Numerics follow transformers' modeling_llama:
RMSNorm in float32 then cast back before the weight, cos/sin computed in float32 from
``position * inv_freq`` and cast to the activation dtype, scale ``head_dim ** -0.5``.

NOTE: q/k/v and gate/up projections are fused into one matrix each (one matmul instead of
three or two), and every layer matrix is stored transposed, ``[in, out]``: on CPU
``x @ W_t`` beats ``F.linear(x, W)`` by 5-12% at decode batch sizes. The lm_head stays
``[vocab, hidden]`` (it is usually the tied embedding, and there the two are on par).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from kvloop.executor.torch.attention import AttentionMetadata, paged_attention, write_kv

if TYPE_CHECKING:
    from kvloop.executor.torch.models import ModelConfig


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale."""
    if x.dtype == torch.float32:  # one fused kernel computes the same thing
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


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


def _linear(x: Tensor, weight_t: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight_t (+ bias)`` for a transposed ``[in, out]`` weight."""
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def _add_linear_(x: Tensor, a: Tensor, weight_t: Tensor, bias: Tensor | None) -> None:
    """``x += a @ weight_t (+ bias)`` in place."""
    x.addmm_(a, weight_t)
    if bias is not None:
        x.add_(bias)


@dataclass
class DecoderLayer:
    """One decoder layer's weights: fused q/k/v and gate/up, matrices as ``[in, out]``."""

    input_norm: Tensor
    qkv_weight: Tensor
    qkv_bias: Tensor | None
    o_weight: Tensor
    o_bias: Tensor | None
    post_norm: Tensor
    gate_up_weight: Tensor
    gate_up_bias: Tensor | None
    down_weight: Tensor
    down_bias: Tensor | None


class LlamaForCausalLM:
    """A Llama-family causal LM computing a mixed batch of tokens over a paged KV cache."""

    def __init__(
        self,
        config: ModelConfig,
        embed: Tensor,
        layers: list[DecoderLayer],
        norm: Tensor,
        lm_head: Tensor,
    ) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.device = embed.device
        self.dtype = embed.dtype
        self.inv_freq = rope_inv_freq(config).to(self.device)
        self.scale = config.head_dim**-0.5
        self._q_size = config.num_heads * config.head_dim
        self._qk_heads = config.num_heads + config.num_kv_heads

    @classmethod
    def load_weights(
        cls,
        config: ModelConfig,
        get: Callable[[str], Tensor],
        has: Callable[[str], bool],
    ) -> LlamaForCausalLM:
        """Build the model from transformers-named tensors: ``get(name)`` returns one on the
        target device and dtype, ``has(name)`` says whether the checkpoint holds it."""

        def bias(names: list[str], flag: bool) -> Tensor | None:
            """The fused bias of the weights ``names`` when the config has one."""
            return cat([n.replace("weight", "bias") for n in names]) if flag else None

        def cat(names: list[str]) -> Tensor:
            return torch.cat([get(n) for n in names])

        def mat(names: list[str]) -> Tensor:
            return cat(names).t().contiguous()

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            att, mlp = p + "self_attn.", p + "mlp."
            qkv = [att + f"{n}_proj.weight" for n in "qkv"]
            gate_up = [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
            layers.append(
                DecoderLayer(
                    input_norm=get(p + "input_layernorm.weight"),
                    qkv_weight=mat(qkv),
                    qkv_bias=bias(qkv, config.qkv_bias),
                    o_weight=mat([att + "o_proj.weight"]),
                    o_bias=bias([att + "o_proj.weight"], config.o_bias),
                    post_norm=get(p + "post_attention_layernorm.weight"),
                    gate_up_weight=mat(gate_up),
                    gate_up_bias=bias(gate_up, config.mlp_bias),
                    down_weight=mat([mlp + "down_proj.weight"]),
                    down_bias=bias([mlp + "down_proj.weight"], config.mlp_bias),
                )
            )
        embed = get("model.embed_tokens.weight")
        if has("lm_head.weight") and not config.tie_word_embeddings:
            lm_head = get("lm_head.weight")
        elif config.tie_word_embeddings:
            lm_head = embed
        else:
            raise ValueError("checkpoint has no lm_head.weight and does not tie embeddings")
        return cls(config, embed, layers, get("model.norm.weight"), lm_head)

    @property
    def num_parameter_bytes(self) -> int:
        """Bytes held by the weights (a tied head counted once)."""
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, self.norm, self.lm_head]
        for layer in self.layers:
            tensors.extend(t for t in vars(layer).values() if t is not None)
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and signed sin [T, 1, head_dim] in the activation dtype for ``positions``.

        NOTE: transformers' ``rotate_half(x) * sin`` is ``cat(-x2, x1) * sin``, which equals
        ``cat(x2, x1) * cat(-sin1, sin2)`` exactly (negation is exact), saving one op per
        layer; the returned sin carries that sign.
        """
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        cos = torch.cat((freqs, freqs), dim=-1).cos().to(self.dtype)
        sin = freqs.sin().to(self.dtype)
        return cos[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_layers: list[Tensor],
        meta: AttentionMetadata,
        logits_indices: Tensor,
    ) -> Tensor:
        """Compute the step's tokens ([T] ids at [T] positions), writing their K/V into the
        per-layer caches; return float32 logits [N, vocab] of the rows ``logits_indices``."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        num_tokens = input_ids.shape[0]
        head_dim, num_heads, qk_heads = cfg.head_dim, cfg.num_heads, self._qk_heads
        qk_size = qk_heads * head_dim
        half = head_dim // 2
        cos, sin = self.rope(positions)
        slots = meta.slot_mapping
        x = F.embedding(input_ids, self.embed)
        # NOTE: x is this step's own buffer: residual adds go into it in place (fused with
        # the output projections as addmm), and RoPE / SiLU·up work in place in their
        # matmul outputs. Fewer fresh buffers means fewer page faults on CPU.
        for layer, cache in zip(self.layers, kv_layers, strict=True):
            h = rms_norm(x, layer.input_norm, eps)
            qkv = _linear(h, layer.qkv_weight, layer.qkv_bias)
            qk = qkv[:, :qk_size].view(num_tokens, qk_heads, head_dim)
            rotated = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
            qk.mul_(cos).addcmul_(rotated, sin)
            v = qkv[:, qk_size:].view(num_tokens, -1, head_dim)
            write_kv(cache, qk[:, num_heads:], v, slots)
            attn = paged_attention(qk[:, :num_heads], cache, meta, self.scale)
            _add_linear_(x, attn, layer.o_weight, layer.o_bias)
            h = rms_norm(x, layer.post_norm, eps)
            gate, up = _linear(h, layer.gate_up_weight, layer.gate_up_bias).chunk(2, dim=-1)
            _add_linear_(x, F.silu(gate, inplace=True).mul_(up), layer.down_weight, layer.down_bias)
        x = rms_norm(x.index_select(0, logits_indices), self.norm, eps)
        return F.linear(x, self.lm_head).float()
