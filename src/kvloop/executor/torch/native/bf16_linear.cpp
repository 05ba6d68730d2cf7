// bfloat16 weights times bfloat16 activations with AVX-512 BF16 (vdpbf16ps), float32 sums.
//
// Packed layout (built by kvloop.executor.torch.native.pack_bf16): [N/16][K/2][16][2]. For 16
// outputs and one pair of inputs p, 64 bytes hold W[n, 2p] and W[n, 2p + 1] at 16-bit lanes
// 2n and 2n + 1: vdpbf16ps's operand order, so that one load and one instruction do 32
// multiply-adds against x[m, 2p], x[m, 2p + 1] broadcast as one 32-bit value.
//
// NOTE: vdpbf16ps ignores MXCSR: it reads bfloat16 subnormals as zero and rounds to nearest
// even. Products of two bfloat16 values are exact in float32; only the order of the float32
// sums differs from oneDNN's, so outputs agree with torch's to the last bfloat16 step.
#include <cstring>

#include "gemm_checks.h"
#include "kernels.h"

#if KVLOOP_BF16
#include "int_gemm.h"
#endif

bool bf16_available() { return cpu_bf16(); }

#if KVLOOP_BF16
namespace {

using kvloop::kTile;

// W tiles a pass: 2 from 3 rows on (2 weight loads feed 2 R products), 1 for one or two rows.
// NOTE: a pass of few rows only streams its weights, and one tile a pass reads each thread's
// tiles as one sequential run of memory instead of two runs a tile apart. On the 2-core
// Zen 4 VM, one tile a pass took 0.79-0.93x the time of two for the default model's decode
// step at batch 1 (docs/native-kernels.md), and 0.88-0.95x for its layers
// at batch 2; at 3 and 4 rows it took 1.12x and 1.15x. From 3 rows on,
// the shared loads count more.
constexpr int64_t kOneTileRows = 2;
template <int W_>
struct Bf16Tiles {
  const uint16_t* packed;
  const uint16_t* x;
  int64_t K;

  static constexpr int kWidth = W_;
  // Rows per pass: two tiles, 8 rows (16 sums, 2 weight and 8 row registers); one tile,
  // the rows it serves (4 sums a row: more would spill, and only kOneTileRows come here).
  static constexpr int kRows = W_ == 1 ? kOneTileRows : 8;

  // NOTE: only this function needs AVX-512 BF16 (checked by the caller, as the CPUs with
  // VNNI but without BF16 run the other kernels); a target attribute keeps the rest of the
  // build free of it.
  template <int R, int W>
  __attribute__((target("avx512bf16"))) void rows(int64_t t, int64_t m0, __m512* acc) const {
    // NOTE: independent sums per output vector, to cover vdpbf16ps's latency: 4 with one
    // tile a pass. With 2, the sums' chains (a vdpbf16ps every 3 cycles at best) held back
    // the loads queued behind them: on the 2-core Zen 4 VM a one-row decode step's products
    // took 1.37x the time of the same loads without arithmetic; with 4 chains 1.03x, and the
    // default model's layers 0.69x the time they took with 2 (8 and 16 chains were no
    // faster). From cache, in a standalone harness, 4 is slower than 2: measure the loop from
    // memory.
    constexpr int U = W_ == 1 ? 4 : R * W >= 4 ? 1 : 4 / (R * W);
    const uint16_t* w = packed + t * K * kTile;
    const int64_t P = K / 2;
    __m512 part[U][R * W];
    for (int u = 0; u < U; ++u)
      for (int i = 0; i < R * W; ++i) part[u][i] = _mm512_setzero_ps();
    // NOTE: K % 32 == 0 (check_gemm; DecodeLayers::check_matrix), so U divides P
    for (int64_t p = 0; p < P; p += U) {
      for (int u = 0; u < U; ++u) {
        __m512bh wv[W];
        for (int j = 0; j < W; ++j) {
          const uint16_t* line = w + j * K * kTile + (p + u) * 2 * kTile;
          kvloop::prefetch_ahead(line, 2048, 64);
          wv[j] = (__m512bh)_mm512_loadu_si512(line);
        }
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, x + (m0 + r) * K + 2 * (p + u), sizeof pair);
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
          for (int j = 0; j < W; ++j)
            part[u][W * r + j] = _mm512_dpbf16_ps(part[u][W * r + j], wv[j], xv);
        }
      }
    }
    for (int i = 0; i < R * W; ++i) {
      __m512 s = part[0][i];
      for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, part[u][i]);
      acc[i] = s;
    }
  }
};

}  // namespace
#endif

template <typename O>
void bf16_product(const uint16_t* x, const uint16_t* packed, const float* bias, O* out,
                  int64_t M, int64_t N, int64_t K, bool accumulate) {
  // NOTE: without this check a CPU lacking AVX-512 BF16 would die of SIGILL.
  TORCH_CHECK(bf16_available(), "bf16_linear: needs AVX-512 BF16 (this CPU or compiler lacks it)");
#if KVLOOP_BF16
  if (M >= kAmxRows && amx_available()) {
    amx_bf16_gemm(x, packed, bias, out, M, N, K, accumulate);
  } else if (M <= kOneTileRows) {
    kvloop::store_tiles(Bf16Tiles<1>{packed, x, K}, bias, out, M, N, accumulate);
  } else {
    kvloop::store_tiles(Bf16Tiles<2>{packed, x, K}, bias, out, M, N, accumulate);
  }
#endif
}

KVLOOP_BF16_PRODUCT(uint16_t);
KVLOOP_BF16_PRODUCT(float);

void bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                 const std::optional<at::Tensor>& bias, at::Tensor& out, bool accumulate) {
  TORCH_CHECK(bf16_available(), "bf16_linear: needs AVX-512 BF16 (this CPU or compiler lacks it)");
  kvloop::check_bf16_linear(x, packed, out);
  const float* b = kvloop::bias_data("bf16_linear", bias, out);
  kvloop::by_output_dtype(out, [&](auto* op) {
    bf16_product(reinterpret_cast<const uint16_t*>(x.data_ptr()),
                 reinterpret_cast<const uint16_t*>(packed.data_ptr()), b, op, x.size(0),
                 out.size(1), x.size(1), accumulate);
  });
}
