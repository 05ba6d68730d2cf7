"""A decoder layer's small ops (RMSNorm, RoPE with the KV write, SiLU·up) behind one
interface, its implementation picked once when a model loads.

- :data:`TORCH_OPS`: torch's ops with transformers' numerics (any device and dtype).
- :data:`NATIVE_OPS`: kvloop's fused CPU kernels, the operators ``torch.ops.kvloop.*``
  (``native``): in bfloat16 rounding where torch's ops round; in float32 computing in float32
  throughout (torch's results up to float32 rounding; greedy outputs matched transformers' in
  the parity tests).

Both write into the buffers they are given, so the model's layer (``models.llama``) is
written once against :class:`LayerOps`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from kvloop.executor.torch import native
from kvloop.executor.torch.attention import write_kv


def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale (into
    ``out`` when given, which may be ``x``)."""
    if x.dtype == torch.float32:  # one fused kernel computes the same thing
        y = F.rms_norm(x, weight.shape, weight, eps)
        return y if out is None else out.copy_(y)
    # NOTE: the same fused kernel on a float32 copy; the cast back and the scale stay two
    # steps, as transformers rounds between them.
    return torch.mul(weight, F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype),
                     out=out)


class LayerOps(Protocol):
    """The small ops of a decoder layer, each writing into its arguments."""

    fused: bool
    """Whether these are kvloop's fused kernels (the model's load line names them)."""

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
        """``out = RMSNorm(x) * weight`` (``out`` may be ``x``)."""
        ...

    def rope_write_kv(self, qkv: Tensor, cos: Tensor, sin: Tensor, cache: Tensor,
                      slots: Tensor, num_heads: int, num_kv_heads: int) -> None:
        """RoPE on the query and key heads of ``qkv`` [T, (H + 2K) * d] in place (``cos``
        and signed ``sin`` [T, d], as ``LlamaForCausalLM.rope`` gives them), then the keys
        and values into ``cache`` at ``slots``."""
        ...

    def silu_mul(self, gate_up: Tensor, out: Tensor) -> None:
        """``out = silu(gate) * up`` for ``gate_up`` = [gate | up] [T, 2I] (a temporary: its
        gate half may be overwritten)."""
        ...


class TorchLayerOps:
    """:class:`LayerOps` in torch's ops, transformers' numerics (every device)."""

    fused = False

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
        rms_norm(x, weight, eps, out)

    def rope_write_kv(self, qkv: Tensor, cos: Tensor, sin: Tensor, cache: Tensor,
                      slots: Tensor, num_heads: int, num_kv_heads: int) -> None:
        tokens, head_dim = cos.shape
        qk_heads = num_heads + num_kv_heads
        qk = qkv[:, :qk_heads * head_dim].view(tokens, qk_heads, head_dim)
        half = head_dim // 2
        # NOTE: transformers' ``x * cos + rotate_half(x) * sin`` with the sign of
        # rotate_half carried by ``sin`` (``LlamaForCausalLM.rope``).
        rotated = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
        qk.mul_(cos[:, None]).addcmul_(rotated, sin[:, None])
        v = qkv[:, qk_heads * head_dim:].view(tokens, num_kv_heads, head_dim)
        write_kv(cache, qk[:, num_heads:], v, slots)

    def silu_mul(self, gate_up: Tensor, out: Tensor) -> None:
        gate, up = gate_up.chunk(2, dim=-1)
        torch.mul(F.silu(gate, inplace=True), up, out=out)


class NativeLayerOps:
    """:class:`LayerOps` as kvloop's fused CPU kernels (``torch.ops.kvloop``)."""

    fused = True

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
        native.call("rms_norm", x, weight, eps, out)

    def rope_write_kv(self, qkv: Tensor, cos: Tensor, sin: Tensor, cache: Tensor,
                      slots: Tensor, num_heads: int, num_kv_heads: int) -> None:
        native.call("rope_write_kv", qkv, cos, sin, cache, slots, num_heads, num_kv_heads)

    def silu_mul(self, gate_up: Tensor, out: Tensor) -> None:
        native.call("silu_mul", gate_up, out)


TORCH_OPS = TorchLayerOps()
NATIVE_OPS = NativeLayerOps()


def pick_layer_ops(device: torch.device, dtype: torch.dtype, hidden_size: int, head_dim: int,
                   intermediate_size: int) -> LayerOps:
    """:data:`NATIVE_OPS` where kvloop's kernels run this model (CPU, bfloat16 or float32,
    their shape multiples), else :data:`TORCH_OPS`."""
    runs = (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
            and hidden_size % 16 == 0 and head_dim % 32 == 0 and intermediate_size % 16 == 0
            and native.kernels() is not None)
    return NATIVE_OPS if runs else TORCH_OPS
