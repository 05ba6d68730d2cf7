"""The layer matrices of a model, each stored the way this device multiplies it fastest.

A decoder layer computes ``x @ W (+ b)`` four times (fused QKV, O, fused gate/up, down).
At decode batch sizes these products only stream their weights, and on CPU the stock
kernels stream them well below the machine's read bandwidth. Three layouts:

- :class:`DenseLinear`: ``W`` as ``[in, out]``, one ``torch.mm`` (CUDA, bf16/fp16 on CPU,
  one CPU thread).
- :class:`SplitLinear` (float32 on CPU with 2+ threads): ``W`` cut along its outputs into
  ``[S, in, out / S]`` and multiplied by one ``torch.bmm``. MKL runs a small-M ``sgemm`` on
  one thread but spreads a batched one over its threads; measured on a 2-core AVX-512 VM
  (all 30 layers of SmolLM2-135M): M=1 25.3 -> 19.3 ms, M=8 57.7 -> 31.8 ms, M=32 74.9 ->
  54.4 ms, never slower up to M=1024.
- :class:`Int4Linear` (``quantization="int4"``, CPU, bfloat16 activations): weight-only
  4-bit, groups of 32 along the input with a scale and a zero per group (asymmetric
  min/max, as llama.cpp's Q4_1), through torch's ``_weight_int4pack_mm_for_cpu``. A 4-bit
  GGUF (Q4_1) dequantised at conversion is re-quantised here onto its own grid: every Q4_1
  group holds its min (code 0) and its max (code 15), so min/max recover its scale and
  offset, up to the bfloat16 rounding of the kernel's scales.
"""

from __future__ import annotations

import torch
from torch import Tensor

INT4_GROUP = 32
"""Input elements sharing one int4 scale and zero (llama.cpp's Q4_0/Q4_1 block)."""
QUANTIZATIONS = ("int4",)
"""Accepted values of ``quantization`` (None: weights in the activation dtype)."""


class DenseLinear:
    """``x @ W (+ b)`` with ``W`` stored transposed, ``[in, out]``.

    NOTE: on CPU ``x @ W_t`` beats ``F.linear(x, W)`` by 5-12% at decode batch sizes."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.weight_t = weight.t().contiguous()
        self.bias = bias
        self.in_features, self.out_features = self.weight_t.shape

    @property
    def tensors(self) -> list[Tensor]:
        return [t for t in (self.weight_t, self.bias) if t is not None]

    def __call__(self, x: Tensor) -> Tensor:
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def add_to_(self, out: Tensor, x: Tensor) -> None:
        """``out += x @ W (+ b)`` in place."""
        out.addmm_(x, self.weight_t)
        if self.bias is not None:
            out.add_(self.bias)


class SplitLinear:
    """``x @ W (+ b)`` with ``W``'s outputs cut into ``splits`` parts: ``[S, in, out / S]``,
    one batched matmul (module docstring)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, splits: int) -> None:
        out_features, in_features = weight.shape
        self.weight = weight.view(splits, out_features // splits, in_features).transpose(1, 2)
        self.weight = self.weight.contiguous()
        self.bias = bias
        self.in_features, self.out_features = in_features, out_features

    @property
    def tensors(self) -> list[Tensor]:
        return [t for t in (self.weight, self.bias) if t is not None]

    def _parts(self, x: Tensor) -> Tensor:
        """[M, S, out / S]: a strided view of the batched product."""
        return torch.bmm(x.expand(self.weight.shape[0], -1, -1), self.weight).transpose(0, 1)

    def __call__(self, x: Tensor) -> Tensor:
        y = self._parts(x).reshape(x.shape[0], self.out_features)
        return y if self.bias is None else y.add_(self.bias)

    def add_to_(self, out: Tensor, x: Tensor) -> None:
        """``out += x @ W (+ b)`` in place (no merged copy of the product)."""
        parts = self._parts(x)
        out.view(parts.shape).add_(parts)
        if self.bias is not None:
            out.add_(self.bias)


class Int4Linear:
    """Weight-only int4 ``x @ W (+ b)``: ``W[o, i] ~ (q[o, i] - 8) * scale[g, o] + zero[g, o]``
    with ``g = i // 32`` (module docstring). ``x`` must be bfloat16."""

    def __init__(self, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> None:
        out_features, in_features = weight.shape
        if in_features % INT4_GROUP:
            raise ValueError(f"quantization int4 needs input sizes divisible by "
                             f"{INT4_GROUP}; a matrix has {in_features}")
        groups = weight.detach().float().view(out_features, -1, INT4_GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = (high - low) / 15
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 15)
        q = codes.to(torch.int32).view(out_features, in_features)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # NOTE: the kernel computes (q - 8) * scale + zero, so zero = low + 8 * scale.
        zero = low + 8 * scale
        self.scale_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
        self.bias = bias
        self.in_features, self.out_features = in_features, out_features

    @property
    def tensors(self) -> list[Tensor]:
        return [t for t in (self.packed, self.scale_zeros, self.bias) if t is not None]

    def __call__(self, x: Tensor) -> Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed,
                                                       INT4_GROUP, self.scale_zeros)
        return y if self.bias is None else y.add_(self.bias)

    def add_to_(self, out: Tensor, x: Tensor) -> None:
        out.add_(self(x))


Linear = DenseLinear | SplitLinear | Int4Linear
"""One layer matrix in whichever layout :func:`make_linear` chose."""


def parse_quantization(value: str | None) -> str | None:
    """``quantization`` as given (None or ``"none"``: no quantization; else one of
    ``QUANTIZATIONS``), ``ValueError`` naming the field otherwise."""
    if value is None or value == "none":
        return None
    if value not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or none "
                         f"(None); got {value!r}")
    return value


def check_quantization(quantization: str | None, device: torch.device,
                       dtype: torch.dtype) -> None:
    """Refuse a quantization this device and dtype cannot run, naming the field."""
    quantization = parse_quantization(quantization)
    if quantization is None:
        return
    if device.type != "cpu":
        raise ValueError(f"quantization {quantization} runs on CPU only (device {device})")
    if dtype != torch.bfloat16:
        raise ValueError(f"quantization {quantization} needs dtype bfloat16 (its kernel's "
                         f"activations); got {str(dtype).removeprefix('torch.')}: use "
                         "--dtype bfloat16 or auto")


def make_linear(weight: Tensor, bias: Tensor | None, *, quantization: str | None = None,
                dtype: torch.dtype | None = None) -> Linear:
    """The layout for ``weight`` (``[out, in]``, on its device; in the activation dtype, or
    in float32 to be quantised for activations of ``dtype``) on this machine."""
    if quantization == "int4":
        return Int4Linear(weight, bias, dtype or torch.bfloat16)
    splits = 2
    if (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.get_num_threads() >= splits and weight.shape[0] % splits == 0):
        return SplitLinear(weight, bias, splits)
    return DenseLinear(weight, bias)
