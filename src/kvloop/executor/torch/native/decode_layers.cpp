// A bfloat16 or float32 model's decoder layers for one decode step, in one call: the sequence of
// LlamaForCausalLM._fused_layers (RMSNorm, QKV, RoPE + KV write, attention read in place,
// O + residual, RMSNorm, gate/up, SiLU·up, down + residual) without returning to Python
// between the ~10 kernels of each layer (about a quarter of a one-token step was that
// Python). Each kernel is the one the Python loop calls, so results are the same bits.
#include <ATen/Functions.h>
#include <ATen/record_function.h>

#include "gemm_checks.h"
#include "kernels.h"
#include "team.h"

namespace {

// One call of a kernel, shown under torch's profiler as ``kvloop::<name>`` (as in Python).
template <typename Fn>
void traced(const char* name, Fn&& fn) {
  RECORD_FUNCTION(name, std::vector<c10::IValue>());
  fn();
}

}  // namespace

DecodeLayers::DecodeLayers(std::vector<at::Tensor> norms, std::vector<int64_t> kinds,
                           std::vector<std::vector<at::Tensor>> weights,
                           std::vector<std::optional<at::Tensor>> biases, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t intermediate)
    : norms_(std::move(norms)), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
      head_dim_(head_dim), intermediate_(intermediate) {
  const size_t n = kinds.size();
  TORCH_CHECK(n > 0 && n % 4 == 0 && norms_.size() == n / 2 && weights.size() == n &&
                  biases.size() == n,
              "DecodeLayers: 2 norms and 4 matrices per layer");
  for (size_t i = 0; i < n; ++i) {
    const size_t expected = kinds[i] == kBf16 || kinds[i] == kF32 ? 1 : kinds[i] == kQ4 ? 3 : 0;
    TORCH_CHECK(expected > 0 && weights[i].size() == expected, "DecodeLayers: matrix ", i,
                " has kind ", kinds[i], " and ", weights[i].size(), " tensors");
    TORCH_CHECK(kinds[i] != kBf16 || bf16_available(),
                "DecodeLayers: bfloat16 matrices need AVX-512 BF16");
    TORCH_CHECK(weights[i][0].dim() >= 1, "DecodeLayers: matrix ", i, "'s weights");
    // NOTE: every layout is [N/16, ...] (bf16_, f32_, q4_linear.cpp); the kernels
    // check the rest of each shape on every call.
    const int64_t out_features = weights[i][0].size(0) * kvloop::kTile;
    mats_.push_back(Matrix{kinds[i], std::move(weights[i]), std::move(biases[i]), out_features});
  }
  for (size_t l = 0; l < n / 4; ++l) {
    TORCH_CHECK(mats_[4 * l].out_features == (num_heads_ + 2 * num_kv_heads_) * head_dim_ &&
                    mats_[4 * l + 2].out_features == 2 * intermediate_ &&
                    mats_[4 * l + 1].out_features == mats_[4 * l + 3].out_features,
                "DecodeLayers: layer ", l, "'s matrix sizes");
  }
}

void DecodeLayers::linear(const Matrix& m, const at::Tensor& x, at::Tensor& out,
                          bool accumulate) const {
  if (m.kind == kBf16) {
    traced("kvloop::bf16_linear", [&] { bf16_linear(x, m.w[0], m.bias, out, accumulate); });
  } else if (m.kind == kF32) {
    traced("kvloop::f32_linear", [&] { f32_linear(x, m.w[0], m.bias, out, accumulate); });
  } else {
    traced("kvloop::q4_linear",
           [&] { q4_linear(x, m.w[0], m.w[1], m.w[2], m.bias, out, accumulate); });
  }
}

void DecodeLayers::run(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       const std::vector<at::Tensor>& caches, const at::Tensor& slots,
                       const at::Tensor& block_table, const at::Tensor& context_lens,
                       double eps, double scale) const {
  const int64_t layers = static_cast<int64_t>(mats_.size() / 4);
  TORCH_CHECK(static_cast<int64_t>(caches.size()) == layers, "DecodeLayers: one cache per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == mats_[1].out_features,
              "DecodeLayers: x layout");
  const int64_t T = x.size(0), q_size = num_heads_ * head_dim_;
  // NOTE: buffers shared by every layer of the step (as in _fused_layers).
  at::Tensor h = at::empty_like(x);
  at::Tensor qkv = x.new_empty({T, mats_[0].out_features});
  at::Tensor attn = x.new_empty({T, q_size});
  at::Tensor gate_up = x.new_empty({T, 2 * intermediate_});
  at::Tensor act = x.new_empty({T, intermediate_});
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads_, head_dim_});
  // NOTE: one team of threads for the whole step (team.h): each kernel's parallel part is a
  // handshake with threads already running, not an OpenMP fork and join.
  const int64_t threads = kvloop::Team::run([&] {
    for (int64_t l = 0; l < layers; ++l) {
      const Matrix* m = &mats_[4 * l];
      at::Tensor cache = caches[l];
      traced("kvloop::rms_norm", [&] { rms_norm(x, norms_[2 * l], eps, h); });
      linear(m[0], h, qkv, false);
      traced("kvloop::rope_write_kv", [&] {
        rope_write_kv(qkv, cos, sin, cache, slots, num_heads_, num_kv_heads_);
      });
      traced("kvloop::decode_attention",
             [&] { decode_attention(q, cache, block_table, context_lens, scale, attn); });
      linear(m[1], attn, x, true);
      traced("kvloop::rms_norm", [&] { rms_norm(x, norms_[2 * l + 1], eps, h); });
      linear(m[2], h, gate_up, false);
      traced("kvloop::silu_mul", [&] { silu_mul(gate_up, act); });
      linear(m[3], act, x, true);
    }
  });
  threads_.store(threads, std::memory_order_relaxed);
}
