// Checks and dispatch shared by kvloop's integer GEMMs, free of SIMD code (the AVX-512 and
// the AVX2 builds both include it).
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

namespace kvloop {

constexpr int kGroup = 32;  // input elements sharing one scale
constexpr int kTile = 16;   // outputs of one tile (one AVX-512 vector, two AVX2 ones)

// Checks shared by the integer GEMMs' entry points.
inline void check_gemm(const char* name, const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.is_contiguous() && out.is_contiguous(),
              name, ": layout");
  TORCH_CHECK(x.size(1) % kGroup == 0 && out.size(1) % kTile == 0 && out.size(0) == x.size(0),
              name, ": shapes");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), name, ": dtypes");
}

// The bias's data (float32 [N], contiguous, CPU), or null without one.
inline const float* bias_data(const char* name, const std::optional<at::Tensor>& bias,
                              int64_t N) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N &&
                  bias->is_contiguous() && bias->device().is_cpu(), name, ": bias");
  return bias->data_ptr<float>();
}

// run(x, out) with their data typed by the activation dtype (bfloat16 as raw 16 bits).
template <typename Run>
void by_activation_dtype(const char* name, const at::Tensor& x, at::Tensor& out, Run&& run) {
  if (x.scalar_type() == at::kBFloat16) {
    run(reinterpret_cast<const uint16_t*>(x.data_ptr()),
        reinterpret_cast<uint16_t*>(out.data_ptr()));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": x must be bfloat16 or float32");
    run(x.data_ptr<float>(), out.data_ptr<float>());
  }
}

// The weights of an integer GEMM: ``packed`` (``bits`` per weight, of ``packed_type``) and
// two per-(output, group) tensors, float32 ``scales`` and ``extra`` (of ``extra_type``).
inline void check_weights(const char* name, const at::Tensor& x, const at::Tensor& out,
                          const at::Tensor& packed, at::ScalarType packed_type, int64_t bits,
                          const at::Tensor& scales, const at::Tensor& extra,
                          at::ScalarType extra_type) {
  const int64_t K = x.size(1), N = out.size(1);
  TORCH_CHECK(packed.scalar_type() == packed_type && packed.numel() == N * K * bits / 8 &&
                  scales.scalar_type() == at::kFloat && scales.numel() == N * K / kGroup &&
                  extra.scalar_type() == extra_type && extra.numel() == N * K / kGroup,
              name, ": W");
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous() && extra.is_contiguous() &&
                  packed.device().is_cpu() && scales.device().is_cpu() &&
                  extra.device().is_cpu(),
              name, ": W must be contiguous CPU tensors");
}

// The operands of bf16_linear: bfloat16 x and out, W packed [N/16, K/2, 16, 2].
inline void check_bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& out) {
  check_gemm("bf16_linear", x, out);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "bf16_linear: x must be bfloat16");
  const int64_t K = x.size(1), N = out.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 &&
                  packed.size(0) == N / kTile && packed.size(1) == K / 2 &&
                  packed.size(2) == kTile && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.device().is_cpu(),
              "bf16_linear: W must be packed [N/16, K/2, 16, 2] (native.pack_bf16)");
  // NOTE: tiles read x while others store out (q4/q8 read a quantised copy): no aliasing.
  at::assert_no_overlap(out, x);
}

}  // namespace kvloop
