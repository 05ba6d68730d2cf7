// What kvloop's integer GEMMs share: activation rows quantised per group of 32 to int8
// (llama.cpp's Q8_1), and the loop over 16-output tiles that stores their results.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "gemm_checks.h"
#include "simd.h"
#include "team.h"

namespace kvloop {

constexpr int kRows = 4;    // activation rows sharing one pass over an integer tile's weights

// x[m, k] ~ s[m, g] * a[m, k], g = k / 32, a in -127..127 (signed: vpdpbusd's second
// operand); sum = the group's sum of a, ssum = s * sum.
struct QuantRows {
  std::vector<int8_t> a;    // [M][K]
  std::vector<float> s;     // [M][G] scale of each group
  std::vector<float> ssum;  // [M][G] s * sum of the group's codes
  std::vector<int32_t> sum; // [M][G] sum of the group's codes
};

template <typename T>
inline QuantRows quantize_rows(const T* x, int64_t M, int64_t K) {
  const int64_t G = K / kGroup;
  QuantRows q{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G),
              std::vector<int32_t>(M * G)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const T* src = x + m * K + g * kGroup;
      __m512 lo = kvloop::load16(src), hi = kvloop::load16(src + 16);
      __m512 amax = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
      float mx = _mm512_reduce_max_ps(amax);
      // NOTE: a NaN or inf activation must poison the result, not become a finite code
      // (max_ps may drop a NaN, and int conversion turns one into -128).
      const __mmask16 bad = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) |
                            _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q);
      if (bad || std::isinf(mx)) mx = std::numeric_limits<float>::quiet_NaN();
      float s = mx / 127.0f;
      float inv = mx > 0 ? 127.0f / mx : 0.0f;  // NOTE: 0 for NaN: codes 0, scale NaN
      __m512 vinv = _mm512_set1_ps(inv);
      __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vinv));  // round to nearest even
      __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vinv));
      int8_t* dst = q.a.data() + m * K + g * kGroup;
      const __m128i bl = _mm512_cvtsepi32_epi8(ql), bh = _mm512_cvtsepi32_epi8(qh);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), bl);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), bh);
      int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
      q.s[m * G + g] = s;
      q.ssum[m * G + g] = s * static_cast<float>(sum);
      q.sum[m * G + g] = sum;
    }
  }
  return q;
}

// tiles.rows<R, W>(t, m0, acc) for the runtime row count ``rows`` (1..RM).
template <int RM, int W, typename Tiles>
inline void rows_of(const Tiles& tiles, int64_t rows, int64_t t, int64_t m0, __m512* acc) {
  if constexpr (RM > 1) {
    if (rows < RM) return rows_of<RM - 1, W>(tiles, rows, t, m0, acc);
  }
  tiles.template rows<RM, W>(t, m0, acc);
}

// out[M, N] (+)= the tiles' results (+ bias, float32 [N] or null), rounded once to T.
// ``tiles.rows<R, W>(t, m0, acc)`` computes outputs [16 t, 16 (t + W)) of rows [m0, m0 + R)
// into acc[W * r + w]; ``Tiles::kWidth`` (1 or 2) is the most tiles and ``Tiles::kRows`` the
// most rows one call computes.
template <typename T, typename Tiles>
void store_tiles(const Tiles& tiles, const float* bias, T* out, int64_t M, int64_t N,
                 bool accumulate) {
  constexpr int W = Tiles::kWidth, RM = Tiles::kRows;
  const int64_t tiles_n = N / kTile;
  // NOTE: a grain of 4 tiles (64 outputs) still splits the smallest matrices over threads.
  kvloop::parallel_tiles(0, (tiles_n + W - 1) / W, 4 / W, [&](int64_t begin, int64_t end) {
    __m512 acc[RM * W];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i * W;
      const int width = static_cast<int>(std::min<int64_t>(W, tiles_n - t));
      __m512 b[W];
      for (int w = 0; w < width; ++w)
        b[w] = bias ? _mm512_loadu_ps(bias + (t + w) * kTile) : _mm512_setzero_ps();
      for (int64_t m0 = 0; m0 < M; m0 += RM) {
        const int64_t rows = std::min<int64_t>(RM, M - m0);
        if (width == W) {
          rows_of<RM, W>(tiles, rows, t, m0, acc);
        } else {  // NOTE: the last, odd tile of a 2-wide pass
          rows_of<RM, 1>(tiles, rows, t, m0, acc);
        }
        for (int64_t r = 0; r < rows; ++r) {
          for (int w = 0; w < width; ++w) {
            const int64_t n0 = (t + w) * kTile;
            T* o = out + (m0 + r) * N + n0;
            __m512 y = _mm512_add_ps(acc[width * r + w], b[w]);
            if (accumulate) y = _mm512_add_ps(y, load16(o));
            store16(o, y);
          }
        }
      }
    }
  });
}

// Asks for the 64-byte lines holding [p + ahead, p + ahead + bytes) (into L2 or every level:
// kPrefetchToL2).
// NOTE: a one-row product streams its weights once and does little arithmetic per byte; the
// hardware prefetchers alone kept its reads at 60-80 % of a plain sum's bandwidth, on the
// Sapphire Rapids VM and on the Zen 4 one, and asking for the bytes 2-4 KiB ahead brought
// them to 85-100 % and 75-100 % (docs/native-kernels.md).
// A tile's groups, and the tiles of a thread's own share, follow one another in memory, so
// reading ahead also covers the start of the next tile (pieces taken from the back of another
// share, team.h, start cold); past the end of a matrix a prefetch is a no-op (it never
// faults).
inline void prefetch_ahead(const void* p, int64_t ahead, int64_t bytes) {
  const char* c = static_cast<const char*>(p) + ahead;
  if (kPrefetchToL2) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T1);
  } else {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
  }
}

// 4 bytes of ``p`` broadcast to every 32-bit lane (memcpy: no aliasing of int8 as int32).
inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// An integer product on raw data: x's rows quantised, then out (+)= the tiles of
// ``make_tiles(rows)`` (+ bias).
template <typename X, typename O, typename MakeTiles>
void int_product(const X* x, const float* bias, O* out, int64_t M, int64_t N, int64_t K,
                 bool accumulate, MakeTiles&& make_tiles) {
  const QuantRows rows = quantize_rows(x, M, K);
  store_tiles(make_tiles(rows), bias, out, M, N, accumulate);
}

}  // namespace kvloop
