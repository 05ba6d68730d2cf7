// float32 weights times float32 activations, FMA over simd.h's V16 (one AVX-512 register in
// the full build, two AVX2 ones in the AVX2 build): for the decode-sized products of a
// float32 model, where oneDNN streams the weights at about half the machine's read bandwidth
// (docs/native-kernels.md, fourth round).
//
// Packed layout (built by kvloop.executor.torch.native.pack_f32): [N/16][K][16]. For 16
// outputs, the K inputs follow one another, 64 bytes each: one tile is one contiguous stream
// of K * 64 bytes, and each row's x[m, k] is broadcast once per 16 products.
//
// NOTE: every product and sum is float32 FMA; only the order of the sums differs from
// oneDNN's (independent partial sums over k, added at the end), so results agree with
// torch's to float32 rounding, not to the bit.
#include <ATen/Parallel.h>

#include <algorithm>

#include "gemm_checks.h"
#include "kernels.h"
#include "simd.h"

namespace {

using kvloop::kTile;
using kvloop::V16;

#if defined(__AVX512F__)
constexpr int kRows = 8;  // rows per pass: 8 sums, 1 weight and 1 broadcast register of 32
#else
constexpr int kRows = 4;  // rows per pass: 8 sums, 2 weight and 2 broadcast registers of 16
#endif

// acc[r] = the tile's 16 outputs for row m0 + r, r < R.
template <int R>
void tile_rows(const float* w, const float* x, int64_t K, int64_t m0, V16* acc) {
  // NOTE: U independent sums per output vector cover the FMA latency when few rows share a
  // pass (one row: 4 chains instead of 1). K % 32 == 0 (check_gemm), so U divides K.
  constexpr int U = R >= 4 ? 1 : 4 / R;
  V16 part[U][R];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) part[u][r] = kvloop::vzero();
  for (int64_t k = 0; k < K; k += U) {
    for (int u = 0; u < U; ++u) {
      const V16 wv = kvloop::vloadu(w + (k + u) * kTile);
      for (int r = 0; r < R; ++r)
        part[u][r] = kvloop::vfmadd(wv, kvloop::vset1(x[(m0 + r) * K + k + u]), part[u][r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    V16 s = part[0][r];
    for (int u = 1; u < U; ++u) s = kvloop::vadd(s, part[u][r]);
    acc[r] = s;
  }
}

template <int R>
void rows_of(int64_t rows, const float* w, const float* x, int64_t K, int64_t m0, V16* acc) {
  if constexpr (R > 1) {
    if (rows < R) return rows_of<R - 1>(rows, w, x, K, m0, acc);
  }
  tile_rows<R>(w, x, K, m0, acc);
}

}  // namespace

void f32_linear(const at::Tensor& x, const at::Tensor& packed,
                const std::optional<at::Tensor>& bias, at::Tensor& out, bool accumulate) {
  kvloop::check_f32_linear(x, packed, out);
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  const float* b = kvloop::bias_data("f32_linear", bias, out);
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N / kTile, 4, [&](int64_t begin, int64_t end) {
    V16 acc[kRows];
    for (int64_t t = begin; t < end; ++t) {
      const float* w = wp + t * K * kTile;
      const V16 bv = b ? kvloop::vloadu(b + t * kTile) : kvloop::vzero();
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, M - m0);
        rows_of<kRows>(rows, w, xp, K, m0, acc);
        for (int64_t r = 0; r < rows; ++r) {
          float* o = op + (m0 + r) * N + t * kTile;
          V16 v = kvloop::vadd(acc[r], bv);
          if (accumulate) v = kvloop::vadd(v, kvloop::vloadu(o));
          kvloop::vstoreu(o, v);
        }
      }
    }
  });
}
