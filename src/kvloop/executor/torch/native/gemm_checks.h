// Checks and dispatch shared by kvloop's GEMMs (integer and float), free of SIMD code (the
// AVX-512 and the AVX2 builds both include it).
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>
#include <optional>

namespace kvloop {

constexpr int kGroup = 32;  // input elements sharing one scale
constexpr int kTile = 16;   // outputs of one tile (one AVX-512 vector, two AVX2 ones)

// Checks shared by every GEMM's entry point.
// NOTE: out is x's dtype, or float32 where x is bfloat16: an LM head's logits, the float32
// sums rounded once to float32 rather than to bfloat16 (whose steps, 0.125 near 20, make
// close candidates tie).
inline void check_gemm(const char* name, const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.is_contiguous() && out.is_contiguous(),
              name, ": layout");
  TORCH_CHECK(x.size(1) % kGroup == 0 && out.size(1) % kTile == 0 && out.size(0) == x.size(0),
              name, ": shapes");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() ||
                  (x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kFloat),
              name, ": dtypes (out is x's dtype, or float32 for bfloat16 x)");
}

// The bias's data (float32 [N], contiguous, CPU, not overlapping ``out``), or null without
// one.
inline const float* bias_data(const char* name, const std::optional<at::Tensor>& bias,
                              const at::Tensor& out) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == out.size(1) &&
                  bias->is_contiguous() && bias->device().is_cpu(), name, ": bias");
  at::assert_no_overlap(out, *bias);
  return bias->data_ptr<float>();
}

// run(out) with out's data typed by its dtype (float32, or bfloat16 as raw 16 bits).
template <typename Run>
void by_output_dtype(at::Tensor& out, Run&& run) {
  if (out.scalar_type() == at::kFloat) {
    run(out.data_ptr<float>());
  } else {
    run(reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
}

// run(x, out) with their data typed by their dtypes (bfloat16 as raw 16 bits; check_gemm
// allows float32 out for bfloat16 x).
template <typename Run>
void by_activation_dtype(const char* name, const at::Tensor& x, at::Tensor& out, Run&& run) {
  if (x.scalar_type() == at::kBFloat16) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    by_output_dtype(out, [&](auto* op) { run(xp, op); });
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": x must be bfloat16 or float32");
    run(x.data_ptr<float>(), out.data_ptr<float>());
  }
}

// A per-(output, group) tensor of an integer GEMM's weights (its scales, Q4's offsets) and
// the dtype it must have.
struct PerGroup {
  const at::Tensor& t;
  at::ScalarType type;
};

// The weights of an integer GEMM: ``packed`` (``bits`` per weight, of ``packed_type``) and
// its per-(output, group) tensors.
inline void check_weights(const char* name, const at::Tensor& x, const at::Tensor& out,
                          const at::Tensor& packed, at::ScalarType packed_type, int64_t bits,
                          std::initializer_list<PerGroup> per_group) {
  const int64_t K = x.size(1), N = out.size(1);
  bool shapes = packed.scalar_type() == packed_type && packed.numel() == N * K * bits / 8;
  bool layout = packed.is_contiguous() && packed.device().is_cpu();
  for (const PerGroup& g : per_group) {
    shapes = shapes && g.t.scalar_type() == g.type && g.t.numel() == N * K / kGroup;
    layout = layout && g.t.is_contiguous() && g.t.device().is_cpu();
  }
  TORCH_CHECK(shapes, name, ": W");
  TORCH_CHECK(layout, name, ": W must be contiguous CPU tensors");
}

// Every check of an integer GEMM's entry point: x and out, the weights (as check_weights)
// and the bias; returns the bias's data (or null).
inline const float* check_int_gemm(const char* name, const at::Tensor& x, const at::Tensor& out,
                                   const at::Tensor& packed, at::ScalarType packed_type,
                                   int64_t bits, std::initializer_list<PerGroup> per_group,
                                   const std::optional<at::Tensor>& bias) {
  check_gemm(name, x, out);
  check_weights(name, x, out, packed, packed_type, bits, per_group);
  return bias_data(name, bias, out);
}

// The body of an integer GEMM's entry point (both builds): checks x, out, the weights
// (``packed``, ``bits`` per weight, and its per-(output, group) tensors) and the bias, then
// ``product(x, bias, out)`` on their data (x and out typed by their dtypes).
template <typename Product>
void int_gemm(const char* name, const at::Tensor& x, const at::Tensor& packed,
              at::ScalarType packed_type, int64_t bits, std::initializer_list<PerGroup> per_group,
              const std::optional<at::Tensor>& bias, at::Tensor& out, Product&& product) {
  const float* b = check_int_gemm(name, x, out, packed, packed_type, bits, per_group, bias);
  by_activation_dtype(name, x, out, [&](const auto* xp, auto* op) { product(xp, b, op); });
}

// The operands of a float GEMM ``name``: x and out of ``dtype`` (called ``dtype_name``), W
// of ``dtype`` packed as ``shape`` (``layout`` names it in the error).
inline void check_float_linear(const char* name, at::ScalarType dtype, const char* dtype_name,
                               const at::Tensor& x, const at::Tensor& packed,
                               const at::Tensor& out, at::IntArrayRef shape,
                               const char* layout) {
  check_gemm(name, x, out);
  TORCH_CHECK(x.scalar_type() == dtype, name, ": x must be ", dtype_name);
  TORCH_CHECK(packed.scalar_type() == dtype && packed.sizes() == shape &&
                  packed.is_contiguous() && packed.device().is_cpu(),
              name, ": W must be packed ", layout);
  // NOTE: tiles read x (and W) while others store out (q4/q8 read a quantised copy of x): no
  // aliasing.
  at::assert_no_overlap(out, x);
  at::assert_no_overlap(out, packed);
}

// The operands of bf16_linear: bfloat16 x and out, W packed [N/16, K/2, 16, 2].
inline void check_bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& out) {
  const int64_t K = x.dim() == 2 ? x.size(1) : 0, N = out.dim() == 2 ? out.size(1) : 0;
  check_float_linear("bf16_linear", at::kBFloat16, "bfloat16", x, packed, out,
                     {N / kTile, K / 2, kTile, 2}, "[N/16, K/2, 16, 2] (native.pack_bf16)");
}

// The operands of f32_linear: float32 x and out, W packed [N/16, K, 16].
inline void check_f32_linear(const at::Tensor& x, const at::Tensor& packed,
                             const at::Tensor& out) {
  const int64_t K = x.dim() == 2 ? x.size(1) : 0, N = out.dim() == 2 ? out.size(1) : 0;
  check_float_linear("f32_linear", at::kFloat, "float32", x, packed, out,
                     {N / kTile, K, kTile}, "[N/16, K, 16] (native.pack_f32)");
}

}  // namespace kvloop
