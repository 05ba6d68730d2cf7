// kvloop's CPU kernels (AVX-512 with VNNI): declarations shared by the sources.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <optional>
#include <vector>

// out[M, N] (+)= x[M, K] @ W.T (+ bias), W in 4 bits (see q4_linear.cpp for the layout).
void q4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
               const at::Tensor& mins, const std::optional<at::Tensor>& bias,
               at::Tensor& out, bool accumulate);

// The products on raw data, their operands already checked: out[M, N] (+)= x[M, K] @ W.T
// (+ bias: float32 [N] or null), W packed as for q4_linear, bf16_linear and f32_linear. Each
// of those entry points checks its tensors, then calls one; DecodeLayers checks its matrices
// once, when built. X and O are the activations' and outputs' element types (uint16_t:
// bfloat16's raw bits; float): q4 takes bfloat16 or float32 x, out x's type or float32.
// NOTE: called after its checks, a decode step's product touches no tensor object: after
// ~0.5 MB of weights has gone through L2, those objects come from memory again (~1 µs a
// product of a one-row step; docs/native-kernels.md).
template <typename X, typename O>
void q4_product(const X* x, const uint8_t* packed, const uint16_t* scales, const uint16_t* mins,
                const float* bias, O* out, int64_t M, int64_t N, int64_t K, bool accumulate);
template <typename O>
void bf16_product(const uint16_t* x, const uint16_t* packed, const float* bias, O* out,
                  int64_t M, int64_t N, int64_t K, bool accumulate);
void f32_product(const float* x, const float* packed, const float* bias, float* out, int64_t M,
                 int64_t N, int64_t K, bool accumulate);
// The element types each build's definitions are instantiated for (one line per pair).
#define KVLOOP_Q4_PRODUCT(X, O)                                                               \
  template void q4_product(const X*, const uint8_t*, const uint16_t*, const uint16_t*,       \
                           const float*, O*, int64_t, int64_t, int64_t, bool)
#define KVLOOP_BF16_PRODUCT(O)                                                                \
  template void bf16_product(const uint16_t*, const uint16_t*, const float*, O*, int64_t,     \
                             int64_t, int64_t, bool)

// The same with W in 8 bits (see q8_linear.cpp).
void q8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
               const std::optional<at::Tensor>& bias, at::Tensor& out, bool accumulate);

// NOTE: compilers before GCC 10 and Clang 9 lack the AVX-512 BF16 intrinsics, and the AVX2
// build (no -mavx512f) cannot use them: there the kernels' vdpbf16ps loops are left out and
// the rest still builds (bf16_linear.cpp's bf16_available() is then false; the AVX2 build
// has avx2_gemm.cpp's bfloat16 products, and decode_attention its float32 scores).
#if defined(__AVX512F__) && ((defined(__clang__) && __clang_major__ >= 9) || \
                             (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define KVLOOP_BF16 1
#else
#define KVLOOP_BF16 0
#endif

// Whether this CPU has AVX-512 BF16 and this build its intrinsics (KVLOOP_BF16): where the
// vdpbf16ps loops (bf16_linear.cpp, decode_attention.cpp's scores) run.
inline bool cpu_bf16() {
#if KVLOOP_BF16
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// Whether bf16_linear runs here (the CPU has AVX-512 BF16 and the compiler had it).
bool bf16_available();
// The same with W and x in bfloat16 (see bf16_linear.cpp; needs bf16_available()).
void bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                 const std::optional<at::Tensor>& bias, at::Tensor& out, bool accumulate);

// Whether amx_bf16_gemm and amx_q4_gemm run here (the CPU has AMX-BF16, the OS grants its
// tiles and the compiler had it).
bool amx_available();
// Rows from which bf16_linear multiplies with AMX where amx_available(). NOTE: measured on a
// 2-core Sapphire Rapids VM, SmolLM2-135M's 30 layers: from 4 rows on AMX takes the same
// time as one row (~15.5 ms, the weights' bandwidth) where the vdpbf16ps loop grows with the
// rows (16.0 at 4, 18.0 at 6, 20.1 at 8, 35 at 16, 119 at 64); below 4 they are even.
constexpr int64_t kAmxRows = 4;
// Rows of bfloat16 activations from which q4_linear multiplies with AMX where
// amx_available() (its weights widened to bfloat16 once per call; amx_gemm.cpp). NOTE:
// measured as kAmxRows: the widening costs about what 15 ms of the VNNI loop does (1-16
// rows); at 32 rows both took 21-29 ms, at 64 AMX 34-43 vs 56-64, at 192 86-91 vs 163-185.
constexpr int64_t kAmxQ4Rows = 32;
// bf16_linear's and q4_linear's products with AMX (see amx_gemm.cpp; need amx_available()):
// out[M, N] (+)= x[M, K] @ W.T (+ bias, float32 [N] or null), x raw bfloat16, out (T) raw
// bfloat16 or float32, W packed as for bf16_linear or as for q4_linear.
template <typename T>
void amx_bf16_gemm(const uint16_t* x, const uint16_t* packed, const float* bias, T* out,
                   int64_t M, int64_t N, int64_t K, bool accumulate);
template <typename T>
void amx_q4_gemm(const uint16_t* x, const uint8_t* packed, const uint16_t* scales,
                 const uint16_t* mins, const float* bias, T* out, int64_t M, int64_t N,
                 int64_t K, bool accumulate);

// The same with W and x in float32 (see f32_linear.cpp).
void f32_linear(const at::Tensor& x, const at::Tensor& packed,
                const std::optional<at::Tensor>& bias, at::Tensor& out, bool accumulate);

// A decoder layer's small ops, fused (see layer_ops.cpp).
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out);
void rope_write_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor& cache, const at::Tensor& slots, int64_t num_heads,
                   int64_t num_kv_heads);
void silu_mul(const at::Tensor& gate_up, at::Tensor& out);

// The index of the largest of each row's first ``columns`` values (the first of equal maxima,
// the first NaN where there is one; see argmax.cpp).
std::vector<int64_t> argmax_rows(const at::Tensor& logits, int64_t columns);

// Attention of one query token per sequence over its paged context, read in place.
void decode_attention(const at::Tensor& q, const at::Tensor& cache,
                      const at::Tensor& block_table, const at::Tensor& context_lens,
                      double scale, at::Tensor& out);

// Attention of prefill chunks (tokens [starts[b], context_lens[b]) of each sequence, causal)
// over their paged context, read in place.
void prefill_attention(const at::Tensor& q, const at::Tensor& cache,
                       const at::Tensor& block_table, const at::Tensor& starts,
                       const at::Tensor& context_lens, double scale, at::Tensor& out);

// A model's decoder layers for one decode step in one call (see decode_layers.cpp): built
// once per model from its norms and layer matrices, 4 per layer (qkv, o, gate_up, down),
// each bfloat16 (``kBf16``: the packed weights), float32 (``kF32``: the packed weights) or
// 4-bit (``kQ4``: packed, scales, mins).
// NOTE: it reads the matrices' memory as it was when built (and keeps that memory alive): a
// weight changed in place is seen; a matrix replaced by another object, or moved to other
// memory (Tensor.set_, as move_to_huge_pages does), is not: build a new one.
class DecodeLayers {
 public:
  static constexpr int64_t kBf16 = 0;
  static constexpr int64_t kQ4 = 1;
  static constexpr int64_t kF32 = 2;

  DecodeLayers(std::vector<at::Tensor> norms, std::vector<int64_t> kinds,
               std::vector<std::vector<at::Tensor>> weights,
               std::vector<std::optional<at::Tensor>> biases, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, int64_t intermediate);

  // The layers on a step of T decodes of T sequences: x [T, hidden] is ``embed``'s rows
  // ``ids``, cos and sin the RoPE tables' rows ``positions`` (the same bits as torch's
  // embedding and index_select); returns x after the layers.
  at::Tensor run(const at::Tensor& ids, const at::Tensor& embed, const at::Tensor& cos_table,
                 const at::Tensor& sin_table, const at::Tensor& positions,
                 const std::vector<at::Tensor>& caches, const at::Tensor& slots,
                 const at::Tensor& block_table, const at::Tensor& context_lens, double eps,
                 double scale) const;

  // The threads that ran the last call: its team's size (team.h), 1 without a team.
  int64_t threads() const { return threads_.load(std::memory_order_relaxed); }

 private:
  struct Matrix {
    int64_t kind;
    std::vector<at::Tensor> w;
    std::optional<at::Tensor> bias;  // float32 [out]
    int64_t out_features;
    int64_t in_features = 0;
    std::vector<const void*> data;    // w's data, taken when built
    const float* bias_data = nullptr;
    std::vector<c10::Storage> keep;   // the memory of data and bias_data, kept alive
  };
  void check_matrix(size_t i, Matrix& m, int64_t in_features) const;
  // The layers with x [T, hidden] updated in place and cos, sin [T, head_dim].
  void layers(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
              const std::vector<at::Tensor>& caches, const at::Tensor& slots,
              const at::Tensor& block_table, const at::Tensor& context_lens, double eps,
              double scale) const;
  template <typename T>
  void linear(const Matrix& m, const T* x, T* out, int64_t rows, bool accumulate) const;

  std::vector<at::Tensor> norms_;  // input and post-attention norm of each layer
  std::vector<Matrix> mats_;
  int64_t float_kind_ = -1;  // kBf16 or kF32 where a matrix is one (x's dtype then), else -1
  mutable std::atomic<int64_t> threads_{0};
  int64_t num_heads_, num_kv_heads_, head_dim_, intermediate_;
};
