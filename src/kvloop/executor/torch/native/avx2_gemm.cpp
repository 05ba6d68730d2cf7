// kvloop's integer GEMMs for CPUs with AVX2 but without AVX-512 VNNI (the build
// ``kvloop_native_avx2``, compiled with -mavx2 -mfma only, where they replace q4_linear.cpp
// and q8_linear.cpp; the other kernels are the same sources over simd.h's AVX2 V16): on the
// very layouts of q4_linear.cpp and q8_linear.cpp (packed by native.pack_q4 / pack_q8), with
// the same arithmetic, so that both builds give the same bits.
//
// AVX2 has no vpdpbusd: vpmaddubsw multiplies unsigned by signed bytes into 16-bit sums of
// pairs, vpmaddwd then sums pairs of those into the 32-bit lane of one output (bytes 4n..4n+3
// of a chunk belong to output n, as vpdpbusd reads them). A 256-bit register holds 8 outputs:
// a 16-output tile is two halves.
//   q4: weight codes 0..15 (unsigned) times activation codes -127..127: a pair sums to at most
//       2 * 15 * 127 = 3810, so the 8 products of a group (4 chunks, 2 nibbles) add up in 16
//       bits (<= 30480) before one vpmaddwd.
//   q8: weights -127..127 are signed, so (llama.cpp's trick) |w| is the unsigned operand and
//       the activation takes w's sign (vpsignb): a pair sums to at most 2 * 127 * 127 = 32258,
//       each chunk widened at once.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "f32_tile.h"
#include "gemm_checks.h"
#include "kernels.h"
#include "simd.h"
#include "team.h"

namespace {

using kvloop::bias_data;
using kvloop::int_gemm;
using kvloop::kGroup;
using kvloop::kTile;
using kvloop::V16;

// x[m, k] ~ s[m, g] * a[m, k], a in -127..127 (signed); ssum = s * the group's sum of a.
// NOTE: the same codes as int_gemm.h's quantize_rows (v * (127 / amax) rounded to nearest
// even by vcvtps2dq, saturated to int8; a NaN or inf in a group gives scale NaN), so both
// builds agree to the bit.
struct QuantRows {
  std::vector<int8_t> a;
  std::vector<float> s;
  std::vector<float> ssum;
};

// The 32 codes of v[0..3] (8 lanes each, in order) at ``inv``, stored to dst; returns their sum.
inline int quantize_group(const __m256 (&v)[4], float inv, int8_t* dst) {
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256i c[4];
  for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv));
  // packs work within 128-bit lanes: the bytes come out as 0-3 8-11 16-19 24-27 4-7 ...;
  // a dword permute puts them back in order.
  const __m256i w16 =
      _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  const __m256i codes =
      _mm256_permutevar8x32_epi32(w16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), codes);
  // NOTE: summed from the saturated bytes (a NaN lane counts -128, as the int8 code it got).
  const __m256i sums = _mm256_sad_epu8(_mm256_xor_si256(codes, _mm256_set1_epi8(-128)),
                                       _mm256_setzero_si256());
  const __m128i s2 = _mm_add_epi64(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
  return static_cast<int>(_mm_cvtsi128_si64(s2) + _mm_extract_epi64(s2, 1)) - 32 * 128;
}

template <typename T>
QuantRows quantize_rows(const T* x, int64_t M, int64_t K) {
  const int64_t G = K / kGroup;
  QuantRows q{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G)};
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const T* src = x + m * K + g * kGroup;
      const V16 lo = kvloop::load16(src), hi = kvloop::load16(src + 16);
      const __m256 v[4] = {lo.lo, lo.hi, hi.lo, hi.hi};
      __m256 amax = _mm256_setzero_ps(), unord = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
        unord = _mm256_or_ps(unord, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
      }
      float mx = kvloop::vreduce_max({amax, amax});
      // NOTE: a NaN or inf activation must poison the result, not become a finite code
      // (max_ps may drop a NaN).
      if (_mm256_movemask_ps(unord) || std::isinf(mx)) mx = std::numeric_limits<float>::quiet_NaN();
      const float inv = mx > 0 ? 127.0f / mx : 0.0f;  // NOTE: 0 for NaN: scale NaN
      const int sum = quantize_group(v, inv, q.a.data() + m * K + g * kGroup);
      q.s[m * G + g] = mx / 127.0f;
      q.ssum[m * G + g] = q.s[m * G + g] * static_cast<float>(sum);
    }
  }
  return q;
}

// Asks for the ``bytes`` at p (whole cache lines) into L1 ahead of their use, as
// non-temporal: weights are read once a step, so they bypass the outer caches instead of
// evicting what a step reuses (activations, KV blocks); on Zen 1 that made one-row products
// 5-20 % faster than the same prefetch into every level (docs/native-kernels.md).
// NOTE: a tile's groups, and the tiles of a thread's own share, follow one another in
// memory, so reading a few groups ahead of the current one also covers the start of the next
// tile (pieces taken from the back of another share, team.h, start cold); past the end of a
// matrix a prefetch is a no-op (it never faults).
template <int bytes>
inline void prefetch(const void* p) {
  for (int i = 0; i < bytes; i += 64) _mm_prefetch(static_cast<const char*>(p) + i, _MM_HINT_NTA);
}

// How far ahead of the data it multiplies a tile prefetches its weights (4 groups of Q4, 2
// of Q8, 16 input pairs of bfloat16): the hardware prefetchers alone left one-row products
// at 60-75 % of the read bandwidth on Zen 1 (the Q4 and Q8 tiles' three interleaved streams,
// and the bfloat16 loop, whose widening leaves fewer loads in flight than a plain read);
// 1 KiB ahead made them 1.2-1.3x faster there, 512 B ahead less (docs/native-kernels.md).
// NOTE: the float32 kernel's denser loop (one load, four FMAs)
// already keeps the reads in flight; prefetch gained nothing there, measured twice.
constexpr int64_t kAheadBytes = 1024;

inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// Outputs [16 t, 16 t + 16) of rows [m0, m0 + R): acc[2 r + h] holds half h (8 outputs).
struct Q4Tiles {
  const uint8_t* packed;
  const uint16_t* scales;  // float16
  const uint16_t* mins;    // float16
  const QuantRows& q;
  int64_t K, G;

  // NOTE: 2 rows per pass: 4 sums, 4 integer sums, 4 unpacked weight and 2 activation
  // registers fill AVX2's 16 (4 rows spilled to the stack and ran slower).
  static constexpr int kRows = 2;

  template <int R>
  void rows(int64_t t, int64_t m0, __m256* acc) const {
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const uint8_t* w = packed + t * G * 256;
    const uint16_t* d = scales + t * G * kTile;
    const uint16_t* mn = mins + t * G * kTile;
    for (int i = 0; i < 2 * R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      if (m0 == 0) {  // NOTE: later row passes find the tile in L1
        constexpr int64_t ahead = kAheadBytes / 256;
        prefetch<256>(w + (g + ahead) * 256);
        prefetch<32>(d + (g + ahead) * kTile);
        prefetch<32>(mn + (g + ahead) * kTile);
      }
      __m256i s[2 * R];
      for (int i = 0; i < 2 * R; ++i) s[i] = _mm256_setzero_si256();
      // NOTE: not unrolled: GCC would then hoist all 16 products and spill them.
#pragma GCC unroll 1
      for (int c = 0; c < 4; ++c) {  // NOTE: both halves of a chunk share the broadcasts
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i v =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 256 + 64 * c + 32 * h));
          lo[h] = _mm256_and_si256(v, nib);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* a = q.a.data() + (m0 + r) * K + g * kGroup + 8 * c;
          const __m256i al = broadcast4(a), ah = broadcast4(a + 4);
          for (int h = 0; h < 2; ++h) {
            s[2 * r + h] = _mm256_add_epi16(
                s[2 * r + h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], al),
                                               _mm256_maddubs_epi16(hi[h], ah)));
          }
        }
      }
      const V16 dg = kvloop::load_f16(d + g * kTile), mg = kvloop::load_f16(mn + g * kTile);
      for (int h = 0; h < 2; ++h) {
        const __m256 dv = h ? dg.hi : dg.lo, mv = h ? mg.hi : mg.lo;
        for (int r = 0; r < R; ++r) {
          const int64_t m = m0 + r;
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[2 * r + h], ones));
          __m256& o = acc[2 * r + h];
          o = _mm256_fmadd_ps(dot, _mm256_mul_ps(dv, _mm256_set1_ps(q.s[m * G + g])), o);
          o = _mm256_fmadd_ps(mv, _mm256_set1_ps(q.ssum[m * G + g]), o);
        }
      }
    }
  }
};

struct Q8Tiles {
  const int8_t* packed;
  const uint16_t* scales;  // float16
  const QuantRows& q;
  int64_t K, G;

  static constexpr int kRows = 2;  // as Q4Tiles: 4 sums and 4 integer sums stay in registers

  template <int R>
  void rows(int64_t t, int64_t m0, __m256* acc) const {
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t* w = packed + t * G * 512;
    const uint16_t* d = scales + t * G * kTile;
    for (int i = 0; i < 2 * R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      if (m0 == 0) {  // NOTE: later row passes find the tile in L1
        constexpr int64_t ahead = kAheadBytes / 512;
        prefetch<512>(w + (g + ahead) * 512);
        prefetch<32>(d + (g + ahead) * kTile);
      }
      __m256i s[2 * R];
      for (int i = 0; i < 2 * R; ++i) s[i] = _mm256_setzero_si256();
#pragma GCC unroll 1
      for (int c = 0; c < 8; ++c) {  // NOTE: both halves of a chunk share the broadcast
        __m256i wv[2], wa[2];
        for (int h = 0; h < 2; ++h) {
          wv[h] =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 512 + 64 * c + 32 * h));
          wa[h] = _mm256_sign_epi8(wv[h], wv[h]);
        }
        for (int r = 0; r < R; ++r) {
          const __m256i a = broadcast4(q.a.data() + (m0 + r) * K + g * kGroup + 4 * c);
          for (int h = 0; h < 2; ++h) {
            const __m256i signed_a = _mm256_sign_epi8(a, wv[h]);
            s[2 * r + h] = _mm256_add_epi32(
                s[2 * r + h], _mm256_madd_epi16(_mm256_maddubs_epi16(wa[h], signed_a), ones));
          }
        }
      }
      const V16 dg = kvloop::load_f16(d + g * kTile);
      for (int h = 0; h < 2; ++h) {
        const __m256 dv = h ? dg.hi : dg.lo;
        for (int r = 0; r < R; ++r) {
          const __m256 dot = _mm256_cvtepi32_ps(s[2 * r + h]);
          __m256& o = acc[2 * r + h];
          o = _mm256_fmadd_ps(dot, _mm256_mul_ps(dv, _mm256_set1_ps(q.s[(m0 + r) * G + g])), o);
        }
      }
    }
  }
};

// The bfloat16 values in the low (even_bf16) and high (odd_bf16) halves of v's 32-bit lanes,
// widened exactly to float32 (a shift, a mask).
inline __m256 even_bf16(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 odd_bf16(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// A thread's 64-byte aligned scratch of at least ``floats`` floats (kept between calls).
inline float* thread_scratch(int64_t floats) {
  static thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < floats + 16) buf.resize(floats + 16);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) &
                                  ~uintptr_t{63});
}

// bfloat16 weights in pack_bf16's layout ([N/16][K/2][16][2]: each 32-bit lane holds W[n, 2p]
// in its low and W[n, 2p + 1] in its high half) times bfloat16 rows, float32 sums: a shift
// and a mask widen both halves exactly, FMA multiplies (products of bfloat16 values are
// exact in float32).
//   Up to kWidenRows rows (decode steps): each pass widens the weights as it reads them
//   (the copy below made 5-8 rows 1.13-1.16x slower: two passes do not pay for it).
//   More rows (prefill chunks, steps mixing them with decodes): the first pass of a tile
//   widens it once into the thread's scratch, [K][16] floats, and every pass is f32_tile's
//   (f32_linear's loop) on that copy: ~1.2x faster on Zen 1 from 32 rows on, as the widening
//   leaves the FMA loop (docs/native-kernels.md).
// NOTE: both paths sum in the same order (up to 2 rows: even and odd inputs apart, then
// added; 3 and 4 rows: one chain), so a row's result is the same bits either way: a prompt
// gives the same logits as before the copy existed, and whether a call has 8 rows or 9.
struct Bf16Tiles {
  const uint16_t* packed;
  const float* x;  // the rows widened to float32 once, so that a broadcast is one load
  int64_t K, M;

  static constexpr int kRows = kvloop::kF32Rows;  // 8 sums, 2 weight and 2 row registers
  static constexpr int64_t kWidenRows = 2 * kRows;

  template <int R>
  void rows(int64_t t, int64_t m0, __m256* acc) const {
    const uint16_t* w = packed + t * K * kTile;
    if (M <= kWidenRows) return widening_rows<R>(w, m0, acc);
    // NOTE: store_tiles runs a tile's passes in order (m0 = 0, 4, ...) on one thread, in one
    // call (parallel_tiles never cuts a tile), so the copy the first pass makes is this
    // tile's in the later ones.
    float* wf = thread_scratch(K * kTile);
    if (m0 == 0) widen(w, wf);
    V16 v[R];
    kvloop::f32_tile<R, (R <= 2 ? 2 : 1)>(wf, x, K, m0, v);
    for (int r = 0; r < R; ++r) acc[2 * r] = v[r].lo, acc[2 * r + 1] = v[r].hi;
  }

  // The tile at w as float32 [K][16] at wf.
  void widen(const uint16_t* w, float* wf) const {
    for (int64_t p = 0; p < K / 2; ++p, w += 2 * kTile, wf += 2 * kTile) {
      prefetch<64>(w + kAheadBytes / 2);
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * h));
        _mm256_store_ps(wf + 8 * h, even_bf16(v));
        _mm256_store_ps(wf + kTile + 8 * h, odd_bf16(v));
      }
    }
  }

  template <int R>
  void widening_rows(const uint16_t* w, int64_t m0, __m256* acc) const {
    // NOTE: up to 2 rows sum even and odd inputs apart (4 R chains cover the FMA latency);
    // 3 and 4 rows share one sum per output vector (2 R chains), so that they fit 16
    // registers. The rows' pointers are hoisted: recomputed in the loop, their addresses
    // took a quarter of its instructions (1.15x slower from 4 rows on).
    constexpr int C = R <= 2 ? 2 : 1;
    __m256 sum[C][2 * R];
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < 2 * R; ++i) sum[c][i] = _mm256_setzero_ps();
    const float* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = x + (m0 + r) * K;
    const bool first = m0 == 0;
    for (int64_t p = 0; p < K / 2; ++p, w += 2 * kTile) {
      if (first) prefetch<64>(w + kAheadBytes / 2);  // NOTE: later passes find it in L1
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));
      const __m256 e0 = even_bf16(v0), e1 = even_bf16(v1);
      for (int r = 0; r < R; ++r) {
        const __m256 xe = _mm256_broadcast_ss(xr[r] + 2 * p);
        sum[0][2 * r] = _mm256_fmadd_ps(e0, xe, sum[0][2 * r]);
        sum[0][2 * r + 1] = _mm256_fmadd_ps(e1, xe, sum[0][2 * r + 1]);
      }
      const __m256 o0 = odd_bf16(v0), o1 = odd_bf16(v1);
      for (int r = 0; r < R; ++r) {
        const __m256 xo = _mm256_broadcast_ss(xr[r] + 2 * p + 1);
        sum[C - 1][2 * r] = _mm256_fmadd_ps(o0, xo, sum[C - 1][2 * r]);
        sum[C - 1][2 * r + 1] = _mm256_fmadd_ps(o1, xo, sum[C - 1][2 * r + 1]);
      }
    }
    for (int i = 0; i < 2 * R; ++i) {
      acc[i] = sum[0][i];
      if constexpr (C == 2) acc[i] = _mm256_add_ps(acc[i], sum[C - 1][i]);
    }
  }
};

template <int RM, typename Tiles>
void rows_of(const Tiles& tiles, int64_t rows, int64_t t, int64_t m0, __m256* acc) {
  if constexpr (RM > 1) {
    if (rows < RM) return rows_of<RM - 1>(tiles, rows, t, m0, acc);
  }
  tiles.template rows<RM>(t, m0, acc);
}

// out[M, N] (+)= the tiles' results (+ bias), rounded once to T: as int_gemm.h's store_tiles.
template <typename T, typename Tiles>
void store_tiles(const Tiles& tiles, const float* bias, T* out, int64_t M, int64_t N,
                 bool accumulate) {
  const int64_t tiles_n = N / kTile;
  kvloop::parallel_tiles(0, tiles_n, 4, [&](int64_t begin, int64_t end) {
    constexpr int RM = Tiles::kRows;
    __m256 acc[2 * RM];
    for (int64_t t = begin; t < end; ++t) {
      const V16 b = bias ? kvloop::vloadu(bias + t * kTile) : kvloop::vzero();
      for (int64_t m0 = 0; m0 < M; m0 += RM) {
        const int64_t rows = std::min<int64_t>(RM, M - m0);
        rows_of<RM>(tiles, rows, t, m0, acc);
        for (int64_t r = 0; r < rows; ++r) {
          T* o = out + (m0 + r) * N + t * kTile;
          V16 y = kvloop::vadd(V16{acc[2 * r], acc[2 * r + 1]}, b);
          if (accumulate) y = kvloop::vadd(y, kvloop::load16(o));
          kvloop::store16(o, y);
        }
      }
    }
  });
}

// An integer product on raw data (int_gemm.h's int_product, over this file's QuantRows).
template <typename X, typename O, typename MakeTiles>
void int_product(const X* x, const float* bias, O* out, int64_t M, int64_t N, int64_t K,
                 bool accumulate, MakeTiles&& make_tiles) {
  const QuantRows rows = quantize_rows(x, M, K);
  store_tiles(make_tiles(rows), bias, out, M, N, accumulate);
}

}  // namespace

// NOTE: the AVX2 build's definitions of kernels.h's q4_product, q4_linear, q8_linear,
// bf16_product and bf16_linear (in place of q4_linear.cpp's, q8_linear.cpp's and
// bf16_linear.cpp's).
template <typename X, typename O>
void q4_product(const X* x, const uint8_t* packed, const uint16_t* scales, const uint16_t* mins,
                const float* bias, O* out, int64_t M, int64_t N, int64_t K, bool accumulate) {
  int_product(x, bias, out, M, N, K, accumulate, [&](const QuantRows& rows) {
    return Q4Tiles{packed, scales, mins, rows, K, K / kGroup};
  });
}

KVLOOP_Q4_PRODUCT(uint16_t, uint16_t);
KVLOOP_Q4_PRODUCT(uint16_t, float);
KVLOOP_Q4_PRODUCT(float, float);

void q4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
               const at::Tensor& mins, const std::optional<at::Tensor>& bias, at::Tensor& out,
               bool accumulate) {
  int_gemm("q4_linear", x, packed, at::kByte, 4, {{scales, at::kHalf}, {mins, at::kHalf}}, bias,
           out, [&](const auto* xp, const float* b, auto* op) {
             q4_product(xp, packed.data_ptr<uint8_t>(),
                        static_cast<const uint16_t*>(scales.data_ptr()),
                        static_cast<const uint16_t*>(mins.data_ptr()), b, op, x.size(0),
                        out.size(1), x.size(1), accumulate);
           });
}

void q8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
               const std::optional<at::Tensor>& bias, at::Tensor& out, bool accumulate) {
  int_gemm("q8_linear", x, packed, at::kChar, 8, {{scales, at::kHalf}}, bias, out,
           [&](const auto* xp, const float* b, auto* op) {
             const int64_t K = x.size(1);
             int_product(xp, b, op, x.size(0), out.size(1), K, accumulate,
                         [&](const QuantRows& rows) {
                           return Q8Tiles{packed.data_ptr<int8_t>(),
                                          static_cast<const uint16_t*>(scales.data_ptr()), rows,
                                          K, K / kGroup};
                         });
           });
}

bool bf16_available() { return true; }

// NOTE: the AVX2 build's bf16_product (in place of bf16_linear.cpp's, which needs AVX-512
// BF16): the same packed layout, float32 sums in another order.
template <typename O>
void bf16_product(const uint16_t* x, const uint16_t* packed, const float* bias, O* out,
                  int64_t M, int64_t N, int64_t K, bool accumulate) {
  std::vector<float> xf(M * K);
  // NOTE: K % 32 == 0 (checked by the callers), so M * K is a multiple of 16.
  for (int64_t i = 0; i < M * K; i += 16) kvloop::vstoreu(xf.data() + i, kvloop::load_bf16(x + i));
  store_tiles(Bf16Tiles{packed, xf.data(), K, M}, bias, out, M, N, accumulate);
}

KVLOOP_BF16_PRODUCT(uint16_t);
KVLOOP_BF16_PRODUCT(float);

void bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                 const std::optional<at::Tensor>& bias, at::Tensor& out, bool accumulate) {
  kvloop::check_bf16_linear(x, packed, out);
  const float* b = bias_data("bf16_linear", bias, out);
  kvloop::by_output_dtype(out, [&](auto* op) {
    bf16_product(reinterpret_cast<const uint16_t*>(x.data_ptr()),
                 reinterpret_cast<const uint16_t*>(packed.data_ptr()), b, op, x.size(0),
                 out.size(1), x.size(1), accumulate);
  });
}
