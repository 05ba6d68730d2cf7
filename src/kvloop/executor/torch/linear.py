"""The layer matrices of a model, each stored the way this device multiplies it fastest.

A decoder layer computes ``x @ W.T (+ b)`` four times (fused QKV, O, fused gate/up, down),
and the LM head once more per request. At decode batch sizes these products only stream
their weights, and on CPU the stock kernels stream them well below the machine's read
bandwidth. The layouts:

- :class:`DenseLinear`: ``W`` as loaded, ``[out, in]``, one ``F.linear`` (CUDA; CPUs
  without oneDNN; float16 on CPU).
- :class:`PackedLinear` (float32 and bfloat16 on CPU where kvloop's kernels do not run):
  ``W`` reordered once into oneDNN's blocked layout for this CPU, then multiplied by oneDNN
  without the per-call reorder the stock path pays (torch's own CPU compiler packs weights
  the same way when it freezes a model). On the 2-core AVX-512 VM this was measured on it
  gave ``F.linear``'s result to the bit (M = 1 ... 512) and was faster at every size:
  bfloat16, fused gate/up of SmolLM2-135M, M=1 111 -> 51 µs, M=32 353 -> 313 µs; its 49k-row
  LM head M=1 4.7 -> 2.1 ms, M=32 11.0 -> 6.2 ms; float32 gate/up M=1 67 -> 68 µs, M=8 283
  -> 155 µs, M=32 784 -> 553 µs against the output-split ``bmm`` layout it replaced
  (``docs/benchmarks.md``).
- :class:`Bf16Linear` (bfloat16 on CPUs with AVX-512 BF16, and on AVX2 CPUs through the AVX2
  build, where kvloop's kernels run): ``W`` in ``vdpbf16ps``'s pair order, multiplied by
  kvloop's own kernel (``native.bf16_linear``), which streams the weights at the machine's
  read bandwidth where oneDNN reaches about half of it at decode sizes. Measured on that VM,
  the 30 layers of SmolLM2-135M with cold weights (``benchmarks/gemv_bandwidth.py``): M=1
  6.0 vs oneDNN's 14.3 ms, M=8 10.4 vs 15.6 ms, M=32 and up within ±10% of oneDNN (both near
  the CPU's ``vdpbf16ps`` peak). On CPUs with AMX (Sapphire Rapids on), from 4 rows the same
  packed weights go through AMX tiles instead (``amx_gemm.cpp``): on a 2-core Sapphire
  Rapids VM, M=16 13 ms (oneDNN 24, ``vdpbf16ps`` 35), M=64 28 (oneDNN 27, ``vdpbf16ps`` 119).
- :class:`F32Linear` (float32 on CPU through kvloop's AVX2 build; ``native.f32_preferred``):
  ``W`` in 16-output tiles, multiplied by kvloop's FMA kernel (``native.f32_linear``). On a 2-core
  AVX2 EPYC (Zen 1), the 30 layers of SmolLM2-135M: M=1 19.4 vs oneDNN's 33.2 ms (22 GB/s
  of weights, near the machine's read bandwidth), M=8 34.0 vs 50.6 ms, M=32 105 vs 121 ms,
  M=512 within 1% of it.
- :class:`Int4Linear` (``quantization="int4"``, CPU, bfloat16 activations): weight-only
  4-bit, groups of 32 along the input with a scale and a zero per group (asymmetric
  min/max, as llama.cpp's Q4_1, both float16 as in its blocks), through kvloop's own
  AVX-512 VNNI kernel (``native.q4_linear``, int8 activations as llama.cpp's Q8_1) where it
  runs (from 32 rows on AMX CPUs: the weights widened to bfloat16, AMX tiles), else torch's
  ``_weight_int4pack_mm_for_cpu`` (bfloat16 activations and scales). A
  4-bit GGUF (Q4_1) dequantised at conversion is re-quantised here onto its own grid: every
  Q4_1 group holds its min (code 0) and its max (code 15), so min/max recover its float16
  scale and offset (exactly with kvloop's kernel; up to the bfloat16 rounding of torch's
  scales).
  The LM head is stored at 8 bits (:class:`Int8Linear`, where kvloop's kernel runs), as
  llama.cpp's 4-bit files keep it (the default model's is Q8_0, found again exactly).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kvloop.executor.torch import native

QUANT_GROUP = 32
"""Input elements sharing one scale (and, at 4 bits, one offset): llama.cpp's block of its
Q4_1 and Q8_0 formats, for ``Int4Linear`` and ``Int8Linear`` alike."""
QUANTIZATIONS = ("int4",)
"""Accepted values of ``quantization`` (None: weights in the activation dtype)."""
HEAD_QUANTIZATION = {"int4": "int8"}
"""How each ``quantization`` stores the LM head: at 8 bits, as llama.cpp's 4-bit files do
(where kvloop's int8 kernel runs; in the activation dtype elsewhere)."""


class DenseLinear:
    """``x @ W.T (+ b)`` with ``W`` as loaded, ``[out, in]`` (no copy: a tied LM head shares
    the embedding's storage)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    @property
    def tensors(self) -> list[Tensor]:
        return [t for t in (self.weight, self.bias) if t is not None]

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def add_to_(self, out: Tensor, x: Tensor) -> None:
        """``out += x @ W.T (+ b)`` in place."""
        if self.bias is None:
            out.addmm_(x, self.weight.t())
        else:
            out.add_(self(x))


class PackedLinear:
    """``x @ W.T (+ b)`` through oneDNN, ``W`` reordered once into its blocked layout
    (module docstring). CPU, float32 or bfloat16."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        # NOTE: an opaque oneDNN tensor: no storage, no data_ptr, not picklable. It is a copy,
        # so a tied LM head holds its weights twice (the embedding keeps the plain ones).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        self.bias = bias

    @property
    def tensors(self) -> list[Tensor]:
        return [t for t in (self.packed, self.bias) if t is not None]

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def add_to_(self, out: Tensor, x: Tensor) -> None:
        """``out += x @ W.T (+ b)`` in place."""
        out.add_(self(x))


def packable(weight: Tensor) -> bool:
    """Whether :class:`PackedLinear` serves ``weight`` on this machine: a CPU tensor in
    float32, or in bfloat16 where oneDNN runs it (AVX-512 or AVX-NE-CONVERT; it refuses
    bfloat16 elsewhere, and ``--quantization int4`` picks bfloat16 on any CPU)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


class _FloatKernelLinear:
    """``x @ W.T (+ b)`` through one of kvloop's float kernels (:attr:`kernel`), ``W``
    copied once into its layout (:attr:`pack`; a tied LM head then holds its weights twice,
    as with :class:`PackedLinear`), ``x`` and ``W`` in
    :attr:`dtype`. Products and sums are float32, rounded once to the output (with the bias,
    and with ``out`` in :meth:`add_to_`): the result is torch's up to the order of the
    float32 sums."""

    kernel: str
    """kvloop's kernel (``native``) that multiplies it."""
    pack: Callable[[Tensor], Tensor]
    """``W`` ``[out, in]`` to the kernel's layout (a copy)."""
    dtype: torch.dtype
    """The dtype of ``W``, ``x`` and the output."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        if not float_kernel_runs(weight) or weight.dtype != self.dtype:
            raise ValueError(f"{type(self).__name__} needs a {self.dtype} CPU matrix of "
                             f"{native.TILE}k rows and {QUANT_GROUP}k columns where kvloop's "
                             f"{self.kernel} runs; got {weight.dtype} {tuple(weight.shape)} "
                             f"on {weight.device}")
        self.packed = self.pack(weight)
        self._bias32 = None if bias is None else bias.float().contiguous()

    @property
    def tensors(self) -> list[Tensor]:
        """The tensors a product reads (the float32 bias copy, not the loaded bias)."""
        return [t for t in (self.packed, self._bias32) if t is not None]

    @property
    def native_operands(self) -> tuple[str, list[Tensor], Tensor | None]:
        """(kernel, weight tensors, float32 bias) of this matrix in kvloop's kernels (what
        ``native.DecodeLayers`` multiplies)."""
        return self.kernel, [self.packed], self._bias32

    def __call__(self, x: Tensor) -> Tensor:
        return _native_product(self.kernel, x, (self.packed,), self._bias32,
                               x.new_empty(x.shape[0], self.out_features))

    def add_to_(self, out: Tensor, x: Tensor) -> None:
        """``out += x @ W.T (+ b)`` in place (one rounding where ``out`` is contiguous)."""
        if out.is_contiguous():
            _native_product(self.kernel, x, (self.packed,), self._bias32, out,
                            accumulate=True)
        else:
            out.add_(self(x))


class Bf16Linear(_FloatKernelLinear):
    """bfloat16 ``x @ W.T (+ b)`` through kvloop's kernel (``native.bf16_linear``:
    ``vdpbf16ps``, or shifts and FMA in the AVX2 build; module docstring)."""

    kernel = "bf16_linear"
    pack = staticmethod(native.pack_bf16)
    dtype = torch.bfloat16


class F32Linear(_FloatKernelLinear):
    """float32 ``x @ W.T (+ b)`` through kvloop's kernel (``native.f32_linear``: FMA over
    ``[N/16, K, 16]`` tiles; module docstring)."""

    kernel = "f32_linear"
    pack = staticmethod(native.pack_f32)
    dtype = torch.float32


def float_kernel_runs(weight: Tensor) -> bool:
    """Whether :class:`Bf16Linear` (bfloat16) or :class:`F32Linear` (float32) serves
    ``weight`` here: a CPU matrix of sizes their kernels tile, the kernels built, and for
    bfloat16 a CPU that runs ``bf16_linear`` (AVX-512 BF16, or the AVX2 build)."""
    if not _tiles(weight):
        return False
    if weight.dtype == torch.bfloat16:
        return native.bf16_supported()
    return weight.dtype == torch.float32 and native.kernels() is not None


class Int4Linear:
    """Weight-only int4 ``x @ W.T (+ b)``: ``W[o, i] ~ scale[o, g] * q[o, i] + low[o, g]``
    with ``g = i // 32`` and ``q`` in 0..15 (module docstring). ``x`` is bfloat16 (torch's
    kernel needs it; kvloop's also takes float32).

    Through kvloop's own kernel where it runs (``native.q4_linear``: float16 scales and
    offsets, activations quantised per group of 32 to int8, as llama.cpp multiplies Q4_1),
    else torch's ``_weight_int4pack_mm_for_cpu`` (bfloat16 scales, bfloat16 activations)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> None:
        out_features, in_features = weight.shape
        if in_features % QUANT_GROUP:
            raise ValueError(f"quantization int4 needs input sizes divisible by "
                             f"{QUANT_GROUP}; a matrix has {in_features}")
        groups = weight.detach().float().view(out_features, -1, QUANT_GROUP)
        # NOTE: offsets and scales are float16 (as a Q4_1 block holds them: a fifth fewer
        # bytes a step than float32), and the codes are taken against those rounded values.
        low = _float16_values(groups.amin(-1), "int4", "offset")
        scale = _float16_values((groups.amax(-1) - low) / 15, "int4", "scale")
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 15)
        q = codes.to(torch.int32).view(out_features, in_features)
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias
        self.native = out_features % native.TILE == 0 and native.kernels() is not None
        """Whether kvloop's kernel multiplies this matrix (else torch's)."""
        if self.native:
            self.packed, self.scales, self.lows = native.pack_q4(q, scale, low)
            # NOTE: the kernel adds a float32 bias before its one rounding to the output.
            self._bias32 = None if bias is None else bias.float().contiguous()
            return
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # NOTE: torch's kernel computes (q - 8) * scale + zero, so zero = low + 8 * scale.
        zero = low + 8 * scale
        self.scale_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()

    @property
    def tensors(self) -> list[Tensor]:
        if self.native:
            return [t for t in (self.packed, self.scales, self.lows, self._bias32)
                    if t is not None]
        return [t for t in (self.packed, self.scale_zeros, self.bias) if t is not None]

    @property
    def native_operands(self) -> tuple[str, list[Tensor], Tensor | None] | None:
        """As :attr:`F32Linear.native_operands` (None on torch's kernel)."""
        if not self.native:
            return None
        return "q4_linear", [self.packed, self.scales, self.lows], self._bias32

    def __call__(self, x: Tensor) -> Tensor:
        if self.native:
            return _native_product("q4_linear", x, (self.packed, self.scales, self.lows),
                                   self._bias32, x.new_empty(x.shape[0], self.out_features))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed,
                                                       QUANT_GROUP, self.scale_zeros)
        return y if self.bias is None else y.add_(self.bias)

    def add_to_(self, out: Tensor, x: Tensor) -> None:
        """``out += x @ W.T (+ b)`` in place (one rounding with kvloop's kernel)."""
        if self.native and out.is_contiguous():
            _native_product("q4_linear", x, (self.packed, self.scales, self.lows),
                            self._bias32, out, accumulate=True)
        else:
            out.add_(self(x))


def _float16_values(t: Tensor, quantization: str, name: str) -> Tensor:
    """``t`` (float32) rounded to float16 values, kept as float32; ``ValueError`` where one
    is not finite in float16 (a weight group of ``quantization`` beyond its range, or
    holding a NaN or an infinity)."""
    rounded = t.half().float()
    if not bool(torch.isfinite(rounded).all()):
        worst = float(t.abs().max())
        raise ValueError(f"quantization {quantization} holds each group's {name} as float16 "
                         f"(at most 65504 in magnitude): a weight group's {name} is {worst:g}")
    return rounded


class Int8Linear:
    """Weight-only int8 ``x @ W.T``, ``W[o, i] ~ scale[o, g] * q[o, i]``, ``g = i // 32``,
    ``q`` in -127..127 and ``scale = amax / 127`` rounded to float16 (llama.cpp's Q8_0, the
    LM head of its 4-bit files: a Q8_0 file's values are found again exactly), through
    kvloop's own kernel (``native.q8_linear``, activations quantised per 32 to int8). CPU
    only, where the kernel runs (:func:`make_linear` falls back to the dense layouts
    elsewhere)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.out_features, self.in_features = weight.shape
        if native.kernels() is None:
            raise RuntimeError("Int8Linear needs kvloop's CPU kernels (native.kernels())")
        groups = weight.detach().float().view(self.out_features, -1, QUANT_GROUP)
        # NOTE: float16 scales (as a Q8_0 block holds them: half the scale bytes of float32,
        # 1.8 MB a step less for SmolLM2's head), the codes taken against the rounded values.
        scale = _float16_values(groups.abs().amax(-1) / 127, "int8", "scale")
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = (groups / scale[..., None]).round_().clamp_(-127, 127).to(torch.int8)
        self.packed, self.scales = native.pack_q8(codes.view(weight.shape), scale)
        self._bias32 = None if bias is None else bias.float().contiguous()

    @property
    def tensors(self) -> list[Tensor]:
        """The tensors a product reads (the float32 bias copy, not the loaded bias)."""
        return [t for t in (self.packed, self.scales, self._bias32) if t is not None]

    @property
    def native_operands(self) -> tuple[str, list[Tensor], Tensor | None]:
        """As :attr:`F32Linear.native_operands`."""
        return "q8_linear", [self.packed, self.scales], self._bias32

    def __call__(self, x: Tensor) -> Tensor:
        return _native_product("q8_linear", x, (self.packed, self.scales),
                               self._bias32, x.new_empty(x.shape[0], self.out_features))

    def add_to_(self, out: Tensor, x: Tensor) -> None:
        out.add_(self(x))


def _native_product(kernel: str, x: Tensor, weights: tuple[Tensor, ...], bias: Tensor | None,
                    out: Tensor, accumulate: bool = False) -> Tensor:
    """``out (+)= x @ W.T (+ bias)`` through kvloop's kernel ``kernel`` (``q4_linear``,
    ``q8_linear`` or ``bf16_linear``) on its packed ``weights``; returns ``out``."""
    native.call(kernel, x.contiguous(), *weights, bias, out, accumulate)
    return out


def logits(head: Linear, x: Tensor) -> Tensor:
    """float32 ``x @ W.T (+ b)`` of an LM head. kvloop's kernels write it from their
    float32 sums (for bfloat16 ``x`` too), so close candidates stay apart; elsewhere the
    product in ``x``'s dtype, widened: bfloat16 logits step by 0.125 near 20, where two
    candidates of a greedy choice can round to a tie."""
    operands = getattr(head, "native_operands", None)
    if operands is None:
        return head(x).float()
    kernel, weights, bias = operands
    out = x.new_empty(x.shape[0], head.out_features, dtype=torch.float32)
    return _native_product(kernel, x, tuple(weights), bias, out)


def int8_runs(weight: Tensor) -> bool:
    """Whether :class:`Int8Linear` serves ``weight`` here (CPU, sizes its kernel tiles, the
    kernels built)."""
    return _tiles(weight) and native.kernels() is not None


def _tiles(weight: Tensor) -> bool:
    """Whether kvloop's GEMM kernels tile ``weight``: on CPU, ``[16k, 32j]``."""
    out_features, in_features = weight.shape
    return (weight.device.type == "cpu" and out_features % native.TILE == 0
            and in_features % QUANT_GROUP == 0)


Linear = DenseLinear | PackedLinear | Bf16Linear | F32Linear | Int4Linear | Int8Linear
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
    if quantization == "int8" and int8_runs(weight):
        return Int8Linear(weight, bias)
    if quantization == "int8":  # NOTE: without kvloop's kernel, the head stays dense
        weight = weight.to(dtype or weight.dtype)
    if float_kernel_runs(weight) and (weight.dtype == torch.bfloat16 or native.f32_preferred()):
        kind = Bf16Linear if weight.dtype == torch.bfloat16 else F32Linear
        return kind(weight, bias)
    if packable(weight):
        try:
            return PackedLinear(weight, bias)
        except RuntimeError:  # NOTE: a oneDNN build that cannot pack it still multiplies it
            pass
    return DenseLinear(weight, bias)
