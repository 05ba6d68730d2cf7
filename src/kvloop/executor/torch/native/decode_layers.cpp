// A bfloat16 or float32 model's decoder layers for one decode step, in one call: the sequence of
// LlamaForCausalLM._forward's layer (RMSNorm, QKV, RoPE + KV write, attention read in place,
// O + residual, RMSNorm, gate/up, SiLU·up, down + residual) without returning to Python
// between the ~10 kernels of each layer (about a quarter of a one-token step was that
// Python). Each kernel is the one the Python loop calls, so results are the same bits. The
// call also takes the embedding rows and the RoPE tables' rows (three torch ops, ~0.1 ms of
// a one-row int4 step with the host code cold after the weights streamed by).
#include <ATen/Functions.h>
#include <ATen/record_function.h>

#include <cstring>
#include <type_traits>

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
    // NOTE: every layer's O and down write the hidden size (x's width): the products write
    // their whole output, so a wider one would write past x.
    TORCH_CHECK(mats_[4 * l].out_features == (num_heads_ + 2 * num_kv_heads_) * head_dim_ &&
                    mats_[4 * l + 2].out_features == 2 * intermediate_ &&
                    mats_[4 * l + 1].out_features == mats_[1].out_features &&
                    mats_[4 * l + 3].out_features == mats_[1].out_features,
                "DecodeLayers: layer ", l, "'s matrix sizes");
  }
  // NOTE: each product's operands are checked here, once, as its kernel's entry point checks
  // them on every call; a step then passes the kernels raw data only (kernels.h, *_product).
  const int64_t hidden = mats_[1].out_features;
  for (size_t i = 0; i < n; ++i) {
    const int64_t in = i % 4 == 1 ? num_heads_ * head_dim_ : i % 4 == 3 ? intermediate_ : hidden;
    check_matrix(i, mats_[i], in);
    if (mats_[i].kind != kQ4) {
      TORCH_CHECK(float_kind_ < 0 || float_kind_ == mats_[i].kind,
                  "DecodeLayers: bfloat16 and float32 matrices in one model");
      float_kind_ = mats_[i].kind;
    }
  }
}

void DecodeLayers::check_matrix(size_t i, Matrix& m, int64_t in) const {
  const int64_t N = m.out_features;
  TORCH_CHECK(in % kvloop::kGroup == 0, "DecodeLayers: matrix ", i, "'s input size ", in,
              " is not a multiple of ", kvloop::kGroup);
  // The packed layouts of q4_linear.cpp, bf16_linear.cpp and f32_linear.cpp.
  const int64_t tiles = N / kvloop::kTile, groups = in / kvloop::kGroup;
  auto dense = [&](const at::Tensor& t, at::ScalarType type, at::IntArrayRef shape) {
    TORCH_CHECK(t.scalar_type() == type && t.sizes() == shape && t.is_contiguous() &&
                    t.device().is_cpu(),
                "DecodeLayers: matrix ", i, "'s weights (", t.scalar_type(), " ", t.sizes(),
                "): want contiguous CPU ", type, " ", shape);
    m.data.push_back(t.data_ptr());
    m.keep.push_back(t.storage());
  };
  if (m.kind == kQ4) {
    dense(m.w[0], at::kByte, {tiles, groups, 256});
    dense(m.w[1], at::kHalf, {tiles, groups, kvloop::kTile});
    dense(m.w[2], at::kHalf, {tiles, groups, kvloop::kTile});
  } else if (m.kind == kBf16) {
    dense(m.w[0], at::kBFloat16, {tiles, in / 2, kvloop::kTile, 2});
  } else {
    dense(m.w[0], at::kFloat, {tiles, in, kvloop::kTile});
  }
  if (m.bias) {
    TORCH_CHECK(m.bias->scalar_type() == at::kFloat && m.bias->numel() == N &&
                    m.bias->is_contiguous() && m.bias->device().is_cpu(),
                "DecodeLayers: matrix ", i, "'s bias: want ", N, " contiguous CPU float32 values");
    m.bias_data = m.bias->data_ptr<float>();
    m.keep.push_back(m.bias->storage());
  }
  m.in_features = in;
}

template <typename T>
void DecodeLayers::linear(const Matrix& m, const T* x, T* out, int64_t rows,
                          bool accumulate) const {
  const int64_t N = m.out_features, K = m.in_features;
  if (m.kind == kQ4) {
    traced("kvloop::q4_linear", [&] {
      q4_product(x, static_cast<const uint8_t*>(m.data[0]),
                 static_cast<const uint16_t*>(m.data[1]), static_cast<const uint16_t*>(m.data[2]),
                 m.bias_data, out, rows, N, K, accumulate);
    });
  } else if constexpr (std::is_same_v<T, uint16_t>) {  // NOTE: run() matched x to the kind
    traced("kvloop::bf16_linear", [&] {
      bf16_product(x, static_cast<const uint16_t*>(m.data[0]), m.bias_data, out, rows, N, K,
                   accumulate);
    });
  } else {
    traced("kvloop::f32_linear", [&] {
      f32_product(x, static_cast<const float*>(m.data[0]), m.bias_data, out, rows, N, K,
                  accumulate);
    });
  }
}

void DecodeLayers::layers(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                          const std::vector<at::Tensor>& caches, const at::Tensor& slots,
                          const at::Tensor& block_table, const at::Tensor& context_lens,
                          double eps, double scale) const {
  const int64_t num_layers = static_cast<int64_t>(mats_.size() / 4);
  TORCH_CHECK(static_cast<int64_t>(caches.size()) == num_layers,
              "DecodeLayers: one cache per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == mats_[1].out_features,
              "DecodeLayers: x layout");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "DecodeLayers: x must be bfloat16 or float32");
  // NOTE: bfloat16 matrices multiply bfloat16 activations, float32 ones float32 (as their
  // kernels check); 4-bit ones either.
  TORCH_CHECK(float_kind_ < 0 ||
                  x.scalar_type() == (float_kind_ == kBf16 ? at::kBFloat16 : at::kFloat),
              "DecodeLayers: x is ", x.scalar_type(), " for ",
              float_kind_ == kBf16 ? "bfloat16" : "float32", " matrices");
  const int64_t T = x.size(0), q_size = num_heads_ * head_dim_;
  // NOTE: buffers shared by every layer of the step (as in LlamaForCausalLM._forward).
  at::Tensor h = at::empty_like(x);
  at::Tensor qkv = x.new_empty({T, mats_[0].out_features});
  at::Tensor attn = x.new_empty({T, q_size});
  at::Tensor gate_up = x.new_empty({T, 2 * intermediate_});
  at::Tensor act = x.new_empty({T, intermediate_});
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads_, head_dim_});
  kvloop::by_output_dtype(x, [&](auto* xp) {
    using E = std::remove_pointer_t<decltype(xp)>;
    auto raw = [](const at::Tensor& t) { return static_cast<E*>(t.data_ptr()); };
    E *hp = raw(h), *qkvp = raw(qkv), *attnp = raw(attn), *gate_upp = raw(gate_up),
      *actp = raw(act);
    // NOTE: one team of threads for the whole step (team.h): each kernel's parallel part is a
    // handshake with threads already running, not an OpenMP fork and join.
    const int64_t threads = kvloop::Team::run([&] {
      for (int64_t l = 0; l < num_layers; ++l) {
        const Matrix* m = &mats_[4 * l];
        at::Tensor cache = caches[l];
        traced("kvloop::rms_norm", [&] { rms_norm(x, norms_[2 * l], eps, h); });
        linear(m[0], hp, qkvp, T, false);
        traced("kvloop::rope_write_kv", [&] {
          rope_write_kv(qkv, cos, sin, cache, slots, num_heads_, num_kv_heads_);
        });
        traced("kvloop::decode_attention",
               [&] { decode_attention(q, cache, block_table, context_lens, scale, attn); });
        linear(m[1], attnp, xp, T, true);
        traced("kvloop::rms_norm", [&] { rms_norm(x, norms_[2 * l + 1], eps, h); });
        linear(m[2], hp, gate_upp, T, false);
        traced("kvloop::silu_mul", [&] { silu_mul(gate_up, act); });
        linear(m[3], actp, xp, T, true);
      }
    });
    threads_.store(threads, std::memory_order_relaxed);
  });
}

at::Tensor DecodeLayers::run(const at::Tensor& ids, const at::Tensor& embed,
                             const at::Tensor& cos_table, const at::Tensor& sin_table,
                             const at::Tensor& positions, const std::vector<at::Tensor>& caches,
                             const at::Tensor& slots, const at::Tensor& block_table,
                             const at::Tensor& context_lens, double eps, double scale) const {
  auto index = [](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous() &&
                    t.device().is_cpu(),
                "DecodeLayers: ", name, " must be a contiguous CPU int64 vector");
    return t.data_ptr<int64_t>();
  };
  const int64_t* id = index(ids, "ids");
  const int64_t* pos = index(positions, "positions");
  const int64_t T = ids.numel(), hidden = mats_[1].out_features;
  TORCH_CHECK(positions.numel() == T, "DecodeLayers: ", T, " ids and ", positions.numel(),
              " positions");
  auto table = [&](const at::Tensor& t, int64_t width, const char* name) {
    TORCH_CHECK(t.dim() == 2 && t.size(1) == width && t.is_contiguous() && t.device().is_cpu() &&
                    t.scalar_type() == embed.scalar_type(),
                "DecodeLayers: ", name, " must be a contiguous CPU [rows, ", width, "] table of ",
                embed.scalar_type());
  };
  table(embed, hidden, "embed");
  table(cos_table, head_dim_, "cos_table");
  table(sin_table, head_dim_, "sin_table");
  TORCH_CHECK(sin_table.size(0) == cos_table.size(0), "DecodeLayers: RoPE tables' rows");
  at::Tensor x = embed.new_empty({T, hidden});
  at::Tensor cos = cos_table.new_empty({T, head_dim_});
  at::Tensor sin = sin_table.new_empty({T, head_dim_});
  // NOTE: row copies, so the same bits as F.embedding and index_select; every index is
  // checked before a byte is written (nothing here touches the cache yet).
  const size_t item = embed.element_size();
  const auto* e = static_cast<const char*>(embed.data_ptr());
  const auto* c = static_cast<const char*>(cos_table.data_ptr());
  const auto* s = static_cast<const char*>(sin_table.data_ptr());
  auto* xp = static_cast<char*>(x.data_ptr());
  auto* cp = static_cast<char*>(cos.data_ptr());
  auto* sp = static_cast<char*>(sin.data_ptr());
  const size_t row = hidden * item, rope_row = head_dim_ * item;
  for (int64_t r = 0; r < T; ++r) {
    TORCH_CHECK(id[r] >= 0 && id[r] < embed.size(0), "DecodeLayers: token id ", id[r],
                " is outside the vocabulary (", embed.size(0), ")");
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos_table.size(0), "DecodeLayers: position ", pos[r],
                " is outside the RoPE tables (", cos_table.size(0), " rows)");
    std::memcpy(xp + r * row, e + id[r] * row, row);
    std::memcpy(cp + r * rope_row, c + pos[r] * rope_row, rope_row);
    std::memcpy(sp + r * rope_row, s + pos[r] * rope_row, rope_row);
  }
  layers(x, cos, sin, caches, slots, block_table, context_lens, eps, scale);
  return x;
}
