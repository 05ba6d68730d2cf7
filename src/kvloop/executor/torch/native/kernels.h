// kvloop's CPU kernels (AVX-512 with VNNI): declarations shared by the sources.
#pragma once

#include <torch/extension.h>

#include <optional>

// out[M, N] (+)= x[M, K] @ W.T (+ bias), W in 4 bits (see q4_linear.cpp for the layout).
void q4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
               const torch::Tensor& mins, const std::optional<torch::Tensor>& bias,
               torch::Tensor& out, bool accumulate);

// The same with W in 8 bits (see q8_linear.cpp).
void q8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
               const torch::Tensor& corr, const std::optional<torch::Tensor>& bias,
               torch::Tensor& out, bool accumulate);

// A decoder layer's small ops, fused (see layer_ops.cpp).
void rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, torch::Tensor& out);
void rope_write_kv(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                   torch::Tensor& cache, const torch::Tensor& slots, int64_t num_heads,
                   int64_t num_kv_heads);
void silu_mul(const torch::Tensor& gate_up, torch::Tensor& out);

// Attention of one query token per sequence over its paged context, read in place.
void decode_attention(const torch::Tensor& q, const torch::Tensor& cache,
                      const torch::Tensor& block_table, const torch::Tensor& context_lens,
                      double scale, torch::Tensor& out);
