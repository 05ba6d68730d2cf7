// One 16-output tile of a float32 product, a few rows at a time: f32_linear's inner loop, also
// the AVX2 bf16_linear's for products of many rows (over a thread's float32 copy of the
// tile, avx2_gemm.cpp). The tile is [K][16] floats: the K inputs follow one another, 64 bytes
// each, and each row's x[m, k] is broadcast once per 16 products.
#pragma once

#include <cstdint>

#include "gemm_checks.h"
#include "simd.h"

namespace kvloop {

#if defined(__AVX512F__)
constexpr int kF32Rows = 8;  // rows per pass: 8 sums, 1 weight and 1 broadcast register of 32
#else
constexpr int kF32Rows = 4;  // rows per pass: 8 sums, 2 weight and 2 broadcast registers of 16
#endif

// acc[r] = the tile's 16 outputs for row m0 + r of x ([M][K]), r < R, each summed in U
// independent chains (input k into chain k % U), added at the end.
// NOTE: U chains per output vector cover the FMA latency when few rows share a pass (one
// row: 4 chains instead of 1). K % 32 == 0 (check_gemm), so U (1, 2 or 4) divides K.
template <int R, int U = (R >= 4 ? 1 : 4 / R)>
inline void f32_tile(const float* w, const float* x, int64_t K, int64_t m0, V16* acc) {
  V16 part[U][R];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r) part[u][r] = vzero();
  for (int64_t k = 0; k < K; k += U) {
    for (int u = 0; u < U; ++u) {
      const V16 wv = vloadu(w + (k + u) * kTile);
      for (int r = 0; r < R; ++r)
        part[u][r] = vfmadd(wv, vset1(x[(m0 + r) * K + k + u]), part[u][r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    V16 s = part[0][r];
    for (int u = 1; u < U; ++u) s = vadd(s, part[u][r]);
    acc[r] = s;
  }
}

// f32_tile for the runtime row count ``rows`` (1..R).
template <int R>
inline void f32_tile_rows(int64_t rows, const float* w, const float* x, int64_t K, int64_t m0,
                          V16* acc) {
  if constexpr (R > 1) {
    if (rows < R) return f32_tile_rows<R - 1>(rows, w, x, K, m0, acc);
  }
  f32_tile<R>(w, x, K, m0, acc);
}

}  // namespace kvloop
