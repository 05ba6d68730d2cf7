// kvloop's CPU kernels (AVX-512 with VNNI): declarations shared by the sources.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

// out[M, N] (+)= x[M, K] @ W.T (+ bias), W in 4 bits (see q4_linear.cpp for the layout).
void q4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
               const at::Tensor& mins, const std::optional<at::Tensor>& bias,
               at::Tensor& out, bool accumulate);

// The same with W in 8 bits (see q8_linear.cpp).
void q8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
               const at::Tensor& corr, const std::optional<at::Tensor>& bias,
               at::Tensor& out, bool accumulate);

// The same with W and x in bfloat16 (see bf16_linear.cpp; needs AVX-512 BF16).
void bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                 const std::optional<at::Tensor>& bias, at::Tensor& out, bool accumulate);

// A decoder layer's small ops, fused (see layer_ops.cpp).
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out);
void rope_write_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor& cache, const at::Tensor& slots, int64_t num_heads,
                   int64_t num_kv_heads);
void silu_mul(const at::Tensor& gate_up, at::Tensor& out);

// Attention of one query token per sequence over its paged context, read in place.
void decode_attention(const at::Tensor& q, const at::Tensor& cache,
                      const at::Tensor& block_table, const at::Tensor& context_lens,
                      double scale, at::Tensor& out);
