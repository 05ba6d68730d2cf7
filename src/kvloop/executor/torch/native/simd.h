// The 16-float vector kvloop's float kernels (layer_ops.cpp, decode_attention.cpp) are written
// in: one AVX-512 register in the full build, two AVX2 registers in the AVX2 build (compiled
// without -mavx512f). The AVX-512 functions are the very intrinsics the kernels used before
// this layer; the integer and bfloat16 GEMMs stay AVX-512 code of their own.
#pragma once

#include <immintrin.h>

#include <cstdint>

// NOTE: GCC keeps an array of vector accumulators (V16 acc[N]) in memory, a store per FMA,
// unless the loops that index it are unrolled before its scalar replacement pass (-O3 unrolls
// them too late): a loop over such a register block carries KVLOOP_UNROLL.
#define KVLOOP_UNROLL _Pragma("GCC unroll 16")

namespace kvloop {

// Whether a stream's software prefetches ask for their lines into L2 (prefetcht1) rather than
// into every level (prefetcht0): on AMD CPUs (the products' weights, int_gemm.h's
// prefetch_ahead, and decode attention's keys).
// NOTE: measured per CPU. On Zen 4, asking for the weights into L1 made a one-row bfloat16
// pass slower than no prefetch at all (8.7 against 8.3 ms over the default model's layers)
// and asking for them into L2 faster (6.7 ms; docs/native-kernels.md); the
// keys into L2 made a one-row int4 step at ~2,000 slots 0.935x the time and a 32-row one
// 0.95x. On Sapphire Rapids only prefetcht0 was measured.
inline const bool kPrefetchToL2 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") != 0;
}();

#if defined(__AVX512F__)

using V16 = __m512;

inline V16 vzero() { return _mm512_setzero_ps(); }
inline V16 vset1(float f) { return _mm512_set1_ps(f); }
inline V16 vloadu(const float* p) { return _mm512_loadu_ps(p); }
inline void vstoreu(float* p, V16 v) { _mm512_storeu_ps(p, v); }
inline V16 vadd(V16 a, V16 b) { return _mm512_add_ps(a, b); }
inline V16 vsub(V16 a, V16 b) { return _mm512_sub_ps(a, b); }
inline V16 vmul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
inline V16 vdiv(V16 a, V16 b) { return _mm512_div_ps(a, b); }
inline V16 vmax(V16 a, V16 b) { return _mm512_max_ps(a, b); }
inline V16 vmin(V16 a, V16 b) { return _mm512_min_ps(a, b); }
inline V16 vfmadd(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }
inline V16 vfnmadd(V16 a, V16 b, V16 c) { return _mm512_fnmadd_ps(a, b, c); }
inline float vreduce_add(V16 v) { return _mm512_reduce_add_ps(v); }
inline float vreduce_max(V16 v) { return _mm512_reduce_max_ps(v); }

inline __mmask16 first(int64_t n) {
  return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
}
// The first n lanes of p (n in 1..16), the others 0; v with lanes n.. set to 0; v's first n
// lanes stored to p.
inline V16 vloadu_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
inline V16 vkeep_n(V16 v, int64_t n) { return _mm512_maskz_mov_ps(first(n), v); }
inline void vstoreu_n(float* p, V16 v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }

// The sums of the 16 lanes of each of s0..s3, as [sum s0, sum s1, sum s2, sum s3].
inline __m128 hsum4(V16 s0, V16 s1, V16 s2, V16 s3) {
  const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(s0, s1), _mm512_unpackhi_ps(s0, s1));
  const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(s2, s3), _mm512_unpackhi_ps(s2, s3));
  const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b);
  const __m512 c = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ad, bd)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(ad, bd)));
  const __m256 d = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
  return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
}

// 16 bfloat16 values (raw 16-bit) widened to float32 (exact).
inline V16 load_bf16(const uint16_t* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 float16 values (raw 16-bit) widened to float32 (exact).
inline V16 load_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// float32 to bfloat16, round to nearest even (as torch's .to(torch.bfloat16)); NaN kept NaN.
inline __m256i to_bf16(V16 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// v rounded to bfloat16 precision and back.
inline V16 round_bf16(V16 v) {
  __m256i b = to_bf16(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

inline void store_bf16(uint16_t* p, V16 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
}

// x rounded to the nearest integer (ties to even); p * 2^n for integral n.
inline V16 vnearest(V16 x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline V16 vscale2(V16 p, V16 n) { return _mm512_scalef_ps(p, n); }
// a <= b ? x : y, lane by lane (false where a or b is NaN).
inline V16 vselect_le(V16 a, V16 b, V16 x, V16 y) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LE_OQ), y, x);
}

#else  // AVX2 and FMA: a V16 is two 8-lane halves, every operation done on each

struct V16 {
  __m256 lo, hi;
};

inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vset1(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
inline V16 vloadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstoreu(float* p, V16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 vsub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 vdiv(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
// NOTE: as AVX-512's, max/min return their second operand when one is NaN.
inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 vmin(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V16 vfmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 vfnmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vreduce_add(V16 v) { return hsum8(_mm256_add_ps(v.lo, v.hi)); }
inline float vreduce_max(V16 v) {
  __m256 m = _mm256_max_ps(v.lo, v.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane masks for the first n of 16 lanes (all ones where lane < n).
inline __m256i lanes_below(int64_t n, int offset) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n) - offset), iota);
}
inline V16 vloadu_n(const float* p, int64_t n) {
  return {_mm256_maskload_ps(p, lanes_below(n, 0)), _mm256_maskload_ps(p + 8, lanes_below(n, 8))};
}
inline V16 vkeep_n(V16 v, int64_t n) {
  return {_mm256_and_ps(v.lo, _mm256_castsi256_ps(lanes_below(n, 0))),
          _mm256_and_ps(v.hi, _mm256_castsi256_ps(lanes_below(n, 8)))};
}
inline void vstoreu_n(float* p, V16 v, int64_t n) {
  _mm256_maskstore_ps(p, lanes_below(n, 0), v.lo);
  _mm256_maskstore_ps(p + 8, lanes_below(n, 8), v.hi);
}

inline __m128 hsum4(V16 s0, V16 s1, V16 s2, V16 s3) {
  const __m256 a = _mm256_hadd_ps(_mm256_add_ps(s0.lo, s0.hi), _mm256_add_ps(s1.lo, s1.hi));
  const __m256 b = _mm256_hadd_ps(_mm256_add_ps(s2.lo, s2.hi), _mm256_add_ps(s3.lo, s3.hi));
  const __m256 c = _mm256_hadd_ps(a, b);
  return _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
}

inline __m256 widen_bf16(__m128i raw) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline V16 load_bf16(const uint16_t* p) {
  return {widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline V16 load_f16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}

// The float32 bits of v rounded to nearest even at bfloat16 precision (low 16 bits not yet
// cleared); NaN kept NaN (quietened).
inline __m256i bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
}
inline __m256 round_bf16_8(__m256 v) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(bf16_bits(v), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline V16 round_bf16(V16 v) { return {round_bf16_8(v.lo), round_bf16_8(v.hi)}; }

inline void store_bf16(uint16_t* p, V16 v) {
  const __m256i lo = _mm256_srli_epi32(bf16_bits(v.lo), 16);
  const __m256i hi = _mm256_srli_epi32(bf16_bits(v.hi), 16);
  // packus works within 128-bit lanes: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> lo 0-7, hi 0-7.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
}

inline __m256 nearest8(__m256 x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline V16 vnearest(V16 x) { return {nearest8(x.lo), nearest8(x.hi)}; }
// NOTE: n in -126..127 (exp16's clamp): 2^n built in the exponent field is exact (scalef's
// job on AVX-512). A NaN p stays NaN in the product.
inline __m256 scale8(__m256 p, __m256 n) {
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline V16 vscale2(V16 p, V16 n) { return {scale8(p.lo, n.lo), scale8(p.hi, n.hi)}; }
inline V16 vselect_le(V16 a, V16 b, V16 x, V16 y) {
  return {_mm256_blendv_ps(y.lo, x.lo, _mm256_cmp_ps(a.lo, b.lo, _CMP_LE_OQ)),
          _mm256_blendv_ps(y.hi, x.hi, _mm256_cmp_ps(a.hi, b.hi, _CMP_LE_OQ))};
}

#endif

// exp(x) with x clamped to [-87, 88] (softmax, SiLU); relative error ~2e-7.
inline V16 exp16(V16 x) {
  // NOTE: max/min return their second operand when one is NaN: x second keeps a NaN.
  x = vmin(vset1(88.0f), vmax(vset1(-87.0f), x));
  const V16 n = vnearest(vmul(x, vset1(1.44269504088896341f)));
  V16 r = vfnmadd(n, vset1(0.693145751953125f), x);
  r = vfnmadd(n, vset1(1.428606765330187e-06f), r);
  // exp(r) on |r| <= ln2/2: Taylor to degree 7.
  V16 p = vset1(1.0f / 5040);
  p = vfmadd(p, r, vset1(1.0f / 720));
  p = vfmadd(p, r, vset1(1.0f / 120));
  p = vfmadd(p, r, vset1(1.0f / 24));
  p = vfmadd(p, r, vset1(1.0f / 6));
  p = vfmadd(p, r, vset1(0.5f));
  p = vfmadd(p, r, vset1(1.0f));
  p = vfmadd(p, r, vset1(1.0f));
  return vscale2(p, n);
}

inline V16 load16(const float* p) { return vloadu(p); }
inline V16 load16(const uint16_t* p) { return load_bf16(p); }

// v rounded to T's precision and back (identity for float32): torch's rounding between ops.
inline V16 round_to(V16 v, const float*) { return v; }
inline V16 round_to(V16 v, const uint16_t*) { return round_bf16(v); }

inline void store16(float* p, V16 v) { vstoreu(p, v); }
inline void store16(uint16_t* p, V16 v) { store_bf16(p, v); }

// 16 values of p in some order of lanes that store16_unordered puts back, for lane-wise work
// (dot products of two such loads, sums over rows): float32 loads are plain; the AVX2 build
// widens bfloat16 by interleaving with zeros (lanes 0-3 8-11 | 4-7 12-15), one shuffle per
// 8 values where load16 spends a widening load and a shift, and its store then needs no
// cross-lane permute. NOTE: the lane order is the same for every load and store of a kind.
inline V16 load16_unordered(const float* p) { return vloadu(p); }
inline void store16_unordered(float* p, V16 v) { vstoreu(p, v); }
#if defined(__AVX512F__)
inline V16 load16_unordered(const uint16_t* p) { return load_bf16(p); }
inline void store16_unordered(uint16_t* p, V16 v) { store_bf16(p, v); }
#else
inline V16 load16_unordered(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw)),
          _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw))};
}
inline void store16_unordered(uint16_t* p, V16 v) {
  // NOTE: packus interleaves 128-bit lanes back: [lo 0-3, hi 0-3 | lo 4-7, hi 4-7] are
  // elements 0-7 | 8-15 of load16_unordered's order.
  const __m256i lo = _mm256_srli_epi32(bf16_bits(v.lo), 16);
  const __m256i hi = _mm256_srli_epi32(bf16_bits(v.hi), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_packus_epi32(lo, hi));
}
#endif

}  // namespace kvloop
