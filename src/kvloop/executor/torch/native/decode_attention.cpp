// Attention of decode tokens over their paged KV, reading the cache blocks in place.
//
// One query token per sequence. A task is a sequence's context, or with few sequences a part
// of it (parts merge their softmaxes afterwards, flash-decoding style), for all KV heads or,
// with fewer still, one; the threads take the tasks longest first from a shared counter. A
// task reads its slots in three passes, nothing gathered into a copy:
//   scores   kKeys slots at a time (all of the task's KV heads of a slot: one contiguous run
//            of the cache), each key's values loaded once for kHeads query heads (a
//            bfloat16 cache on a CPU with AVX-512 BF16: vdpbf16ps on the raw query and key
//            values, the scale applied to each sum; score_tile_dp);
//   softmax  per query head over its row of scores;
//   output   per KV head and 16 (AVX-512: 32; AVX-512 and a bfloat16 cache: 64) output
//            values, up to kHeads query heads at a time, every slot's V values
//            broadcast-weighted by their probabilities (output_tile, output_tile_bf16).
// NOTE: each pass prefetches the slots it reads kAhead slots ahead. Without it the kernel ran
// at half to two thirds of this speed from memory: the output passes read one cache line of
// every slot (a stride the hardware prefetchers do not follow) and the scores pass jumps from
// block to block. The scores pass also asks for the same slots' values into L2, so that the
// output passes, one line a slot each, do not wait on memory for every slot (1.2-1.5x faster
// from memory on the Sapphire Rapids VM; docs/native-kernels.md). On AMD CPUs
// the keys too go into L2 only (kPrefetchToL2).
//
// NOTE: float32 arithmetic for float32 and bfloat16 caches alike; each output is rounded once
// to the cache's dtype. The register blocks fit AVX2's 16 registers (no spills in the loops).
// Queries, keys, values and outputs all go through simd.h's *_unordered loads and stores
// (except score_tile_dp's raw loads, queries and keys in the same order, and
// output_tile_bf16's raw loads of values and in-order stores): every sum is lane-wise, so
// their lane order never shows (AVX2 bfloat16: one shuffle per 8 values instead of a
// widening load and a shift; the kernel 4-16 % faster on Zen 1).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <type_traits>
#include <vector>

#include "attention_dispatch.h"
#include "kernels.h"
#include "simd.h"
#include "team.h"

namespace {

using kvloop::load16_unordered;
using kvloop::V16;
using kvloop::vfmadd;
using kvloop::vloadu;
using kvloop::vmul;
using kvloop::vset1;
using kvloop::vzero;

constexpr int kMaxHeads = 256;  // query heads of one task
constexpr int kHeads = 3;  // query heads (of one KV head) computed together, in both passes
#if defined(__AVX512F__)
constexpr int kKeys = 4;   // keys per score tile
constexpr int kVecsV = 2;  // V16s of each head's output accumulated together
#else
constexpr int kKeys = 2;
constexpr int kVecsV = 1;
#endif
constexpr int64_t kAhead = 8;  // slots ahead that each pass prefetches
constexpr int64_t kTasksPerThread = 4;  // below this many tasks a thread, contexts split
constexpr int64_t kMinPart = 128;       // slots of a context's part, at least
constexpr int64_t kMaxParts = 64;       // parts of one context, at most

// The GH * N dot products whose lanes are summed in acc, times ``scale``, to
// s[g * ld + j]: four sums at a time (padded with zeros).
template <int GH, int N>
inline void store_scores(const V16 (&acc)[GH][N], float* s, int64_t ld, float scale) {
  constexpr int M = (GH * N + 3) / 4 * 4;
  alignas(16) float sums[M];
  KVLOOP_UNROLL for (int m = 0; m < M; m += 4) {
    V16 four[4];
    KVLOOP_UNROLL for (int r = 0; r < 4; ++r)
      four[r] = m + r < GH * N ? acc[(m + r) / N][(m + r) % N] : vzero();
    _mm_store_ps(sums + m, kvloop::hsum4(four[0], four[1], four[2], four[3]));
  }
  KVLOOP_UNROLL for (int g = 0; g < GH; ++g)
    KVLOOP_UNROLL for (int j = 0; j < N; ++j) s[g * ld + j] = sums[g * N + j] * scale;
}

// Scores of GH query heads sharing one KV head (qh: their scaled float32 rows, D apart)
// against N keys: s[g * ld + j] = q_g . k[j]. Each key's 16 values are loaded once for the GH
// heads.
template <typename T, int ND, int GH, int N>
inline void score_tile(const float* qh, const T* const* k, float* s, int64_t ld) {
  constexpr int64_t D = ND * 16;
  V16 acc[GH][N];
  KVLOOP_UNROLL for (int j = 0; j < N; ++j) {
    const V16 kj = load16_unordered(k[j]);
    KVLOOP_UNROLL for (int g = 0; g < GH; ++g) acc[g][j] = vmul(vloadu(qh + g * D), kj);
  }
  KVLOOP_UNROLL for (int i = 1; i < ND; ++i) {
    KVLOOP_UNROLL for (int j = 0; j < N; ++j) {
      const V16 kj = load16_unordered(k[j] + 16 * i);
      KVLOOP_UNROLL for (int g = 0; g < GH; ++g)
        acc[g][j] = vfmadd(vloadu(qh + g * D + 16 * i), kj, acc[g][j]);
    }
  }
  store_scores<GH, N>(acc, s, ld, 1.0f);
}

// All G query heads of one KV head against N keys, kHeads heads at a time.
template <typename T, int ND, int N>
inline void score_heads(const float* qh, const T* const* k, float* s, int64_t ld, int64_t G) {
  constexpr int64_t D = ND * 16;
  int64_t g = 0;
  static_assert(kHeads == 3, "the remainders below are 1 and 2 query heads");
  for (; g + kHeads <= G; g += kHeads)
    score_tile<T, ND, kHeads, N>(qh + g * D, k, s + g * ld, ld);
  if (G - g == 2) score_tile<T, ND, 2, N>(qh + g * D, k, s + g * ld, ld);
  if (G - g == 1) score_tile<T, ND, 1, N>(qh + g * D, k, s + g * ld, ld);
}

// Whether a cache of T with head size 16 * ND has score_tile_dp's scores where the CPU has
// AVX-512 BF16 (attend then skips the float32 query copy score_tile reads).
template <typename T, int ND>
constexpr bool kDpShape = KVLOOP_BF16 && std::is_same_v<T, uint16_t> && ND % 2 == 0;

#if KVLOOP_BF16
// score_tile for a bfloat16 cache with AVX-512 BF16: the raw bfloat16 query rows (qh, D apart)
// against the keys as stored, 32 products a vdpbf16ps, each sum times ``scale`` at the end.
// NOTE: exact products, float32 sums in another order than score_tile's, and the scale
// applied to each sum instead of to q first (the same for a power-of-two scale such as 1/8
// at D = 64; one rounding fewer otherwise); vdpbf16ps flushes subnormal inputs, products and
// partial sums to zero. Half score_tile's multiply-adds, and none of its widenings of the
// keys: on the 2-core Zen 4 VM the scores pass took 0.86x the time at 32 sequences of ~150
// slots (docs/native-kernels.md).
template <int ND, int GH, int N>
__attribute__((target("avx512bf16"))) inline void score_tile_dp(
    const uint16_t* qh, const uint16_t* const* k, float* s, int64_t ld, float scale) {
  constexpr int64_t D = ND * 16;
  static_assert(ND % 2 == 0, "32 values a vdpbf16ps");
  V16 acc[GH][N];
  KVLOOP_UNROLL for (int g = 0; g < GH; ++g)
    KVLOOP_UNROLL for (int j = 0; j < N; ++j) acc[g][j] = vzero();
  KVLOOP_UNROLL for (int i = 0; i < ND / 2; ++i) {
    KVLOOP_UNROLL for (int j = 0; j < N; ++j) {
      const __m512bh kj = (__m512bh)_mm512_loadu_si512(k[j] + 32 * i);
      KVLOOP_UNROLL for (int g = 0; g < GH; ++g) {
        const __m512bh qg = (__m512bh)_mm512_loadu_si512(qh + g * D + 32 * i);
        acc[g][j] = _mm512_dpbf16_ps(acc[g][j], qg, kj);
      }
    }
  }
  store_scores<GH, N>(acc, s, ld, scale);
}

// score_heads with score_tile_dp.
// NOTE: score_heads' loop over again, not a shared template: code that calls vdpbf16ps must
// carry the target attribute all the way down to be inlined.
template <int ND, int N>
__attribute__((target("avx512bf16"))) inline void score_heads_dp(
    const uint16_t* qh, const uint16_t* const* k, float* s, int64_t ld, int64_t G, float scale) {
  constexpr int64_t D = ND * 16;
  int64_t g = 0;
  static_assert(kHeads == 3, "the remainders below are 1 and 2 query heads");
  for (; g + kHeads <= G; g += kHeads)
    score_tile_dp<ND, kHeads, N>(qh + g * D, k, s + g * ld, ld, scale);
  if (G - g == 2) score_tile_dp<ND, 2, N>(qh + g * D, k, s + g * ld, ld, scale);
  if (G - g == 1) score_tile_dp<ND, 1, N>(qh + g * D, k, s + g * ld, ld, scale);
}

// score_heads_dp for n keys: kKeys together, or fewer one at a time.
template <int ND>
__attribute__((target("avx512bf16"))) void score_keys_dp(
    const uint16_t* qh, const uint16_t* const* k, int64_t n, float* s, int64_t ld, int64_t G,
    float scale) {
  if (n == kKeys) {
    score_heads_dp<ND, kKeys>(qh, k, s, ld, G, scale);
  } else {
    for (int64_t j = 0; j < n; ++j) score_heads_dp<ND, 1>(qh, k + j, s + j, ld, G, scale);
  }
}
#endif

// The scores pass of a task over its L slots (offs) and nkv KV heads, kKeys keys at a time:
// s[(h * G + g) * ld + t] = q_(h, g) . k_h[t] times scale, with score_heads from qf (the query
// heads' scaled float32 rows) or, where ``dp``, score_keys_dp from q (their raw rows).
template <typename T, int ND>
void score_pass(bool dp, const T* q, const float* qf, const T* k_base, const T* v_base,
                const int64_t* offs, int64_t L, int64_t nkv, int64_t G, int64_t ld, float scale,
                float* sc) {
  constexpr int64_t D = ND * 16;
  const int64_t span = nkv * D * static_cast<int64_t>(sizeof(T));  // bytes of a slot read
  for (int64_t t = 0; t < L; t += kKeys) {
    const int64_t n = std::min<int64_t>(kKeys, L - t);
    for (int64_t a = t + kAhead; a < std::min(t + kAhead + n, L); ++a) {
      const char* kl = reinterpret_cast<const char*>(k_base + offs[a]);
      const char* vl = reinterpret_cast<const char*>(v_base + offs[a]);
      for (int64_t i = 0; i < span; i += 64) {
        if (kvloop::kPrefetchToL2) {
          _mm_prefetch(kl + i, _MM_HINT_T1);
        } else {
          _mm_prefetch(kl + i, _MM_HINT_T0);
        }
        _mm_prefetch(vl + i, _MM_HINT_T1);
      }
    }
    for (int64_t h = 0; h < nkv; ++h) {
      const T* k[kKeys];
      for (int64_t j = 0; j < n; ++j) k[j] = k_base + offs[t + j] + h * D;
      float* s = sc + h * G * ld + t;
#if KVLOOP_BF16
      if constexpr (kDpShape<T, ND>) {
        if (dp) {
          score_keys_dp<ND>(q + h * G * D, k, n, s, ld, G, scale);
          continue;
        }
      }
#endif
      const float* qh = qf + h * G * D;
      if (n == kKeys) {
        score_heads<T, ND, kKeys>(qh, k, s, ld, G);
      } else {
        for (int64_t j = 0; j < n; ++j) score_heads<T, ND, 1>(qh, k + j, s + j, ld, G);
      }
    }
  }
}

// Output values [16 c, 16 (c + NV)) of GH query heads sharing one KV head: the sum over slots
// of p[g][t] * V[t] (p unnormalised; inv[g] normalises), stored to out[g * D + ...].
template <typename T, int ND, int GH, int NV, typename O>
inline void output_tile(const T* v_base, const int64_t* offs, int64_t L, int64_t c,
                        const float* p, int64_t ld, const float* inv, O* out) {
  constexpr int64_t D = ND * 16;
  V16 acc[GH][NV];
  KVLOOP_UNROLL for (int g = 0; g < GH; ++g)
    KVLOOP_UNROLL for (int i = 0; i < NV; ++i) acc[g][i] = vzero();
  for (int64_t t = 0; t < L; ++t) {
    // NOTE: a pass reads 16 * NV values of each slot, a cache line or less in a run of
    // KV * D: hardware prefetchers miss such strides, so the pass fetches its own.
    if (t + kAhead < L) _mm_prefetch(v_base + offs[t + kAhead] + 16 * c, _MM_HINT_T0);
    const T* v = v_base + offs[t] + 16 * c;
    V16 vv[NV];
    KVLOOP_UNROLL for (int i = 0; i < NV; ++i) vv[i] = load16_unordered(v + 16 * i);
    KVLOOP_UNROLL for (int g = 0; g < GH; ++g) {
      const V16 w = vset1(p[g * ld + t]);
      KVLOOP_UNROLL for (int i = 0; i < NV; ++i) acc[g][i] = vfmadd(w, vv[i], acc[g][i]);
    }
  }
  KVLOOP_UNROLL for (int g = 0; g < GH; ++g)
    KVLOOP_UNROLL for (int i = 0; i < NV; ++i)
      kvloop::store16_unordered(out + g * D + 16 * (c + i), vmul(acc[g][i], vset1(inv[g])));
}

#if defined(__AVX512F__)
// output_tile for a bfloat16 cache: values [32 c, 32 (c + NR)) of GH query heads, each run of
// 32 values loaded once as raw bits and split into its even and odd elements, exactly (a
// shift and a mask: where load16_unordered widens 16 values with two operations, this takes
// one), accumulated apart and put back in order when stored.
// NOTE: every output lane sums the same products in the same order as output_tile's: the same
// bits for finite results (a NaN's sign may differ: which operand's NaN an FMA keeps). With
// a head's 64 values of a slot in one pass, each slot's probabilities are broadcast once, not
// once per 32 values. On the 2-core Zen 4 VM a one-sequence decode attention took 0.88-0.93x
// the time from cache, and a one-row int4 step at ~2,000 slots 0.93x.
template <int ND, int GH, int NR, typename O>
inline void output_tile_bf16(const uint16_t* v_base, const int64_t* offs, int64_t L, int64_t c,
                             const float* p, int64_t ld, const float* inv, O* out) {
  constexpr int64_t D = ND * 16;
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  V16 acc[GH][2 * NR];
  KVLOOP_UNROLL for (int g = 0; g < GH; ++g)
    KVLOOP_UNROLL for (int i = 0; i < 2 * NR; ++i) acc[g][i] = vzero();
  for (int64_t t = 0; t < L; ++t) {
    if (t + kAhead < L) {  // NOTE: one cache line a run of 32 values (see output_tile)
      const uint16_t* ahead = v_base + offs[t + kAhead] + 32 * c;
      KVLOOP_UNROLL for (int r = 0; r < NR; ++r) _mm_prefetch(ahead + 32 * r, _MM_HINT_T0);
    }
    const uint16_t* v = v_base + offs[t] + 32 * c;
    V16 vv[2 * NR];
    KVLOOP_UNROLL for (int r = 0; r < NR; ++r) {
      const __m512i raw = _mm512_loadu_si512(v + 32 * r);
      vv[2 * r] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      vv[2 * r + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, high_half));
    }
    KVLOOP_UNROLL for (int g = 0; g < GH; ++g) {
      const V16 w = vset1(p[g * ld + t]);
      KVLOOP_UNROLL for (int i = 0; i < 2 * NR; ++i) acc[g][i] = vfmadd(w, vv[i], acc[g][i]);
    }
  }
  const __m512i first16 = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i last16 = _mm512_add_epi32(first16, _mm512_set1_epi32(8));
  KVLOOP_UNROLL for (int g = 0; g < GH; ++g) {
    KVLOOP_UNROLL for (int r = 0; r < NR; ++r) {
      const V16 even = vmul(acc[g][2 * r], vset1(inv[g]));
      const V16 odd = vmul(acc[g][2 * r + 1], vset1(inv[g]));
      O* o = out + g * D + 32 * (c + r);
      // NOTE: back in order here, so stored in order (store16), not store16_unordered's.
      kvloop::store16(o, _mm512_permutex2var_ps(even, first16, odd));
      kvloop::store16(o + 16, _mm512_permutex2var_ps(even, last16, odd));
    }
  }
}
#endif

template <typename T, int ND, int GH, typename O>
inline void output_heads(const T* v_base, const int64_t* offs, int64_t L, const float* p,
                         int64_t ld, const float* inv, O* out) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, uint16_t> && ND % 2 == 0) {
    // NOTE: at most 64 values (2 runs of 32) a pass: GH * 4 accumulators stay in registers.
    for (int64_t c = 0; c < ND / 2; c += 2) {
      if (c + 2 <= ND / 2)
        output_tile_bf16<ND, GH, 2, O>(v_base, offs, L, c, p, ld, inv, out);
      else
        output_tile_bf16<ND, GH, 1, O>(v_base, offs, L, c, p, ld, inv, out);
    }
    return;
  }
#endif
  for (int64_t c = 0; c < ND; c += kVecsV) {
    if (c + kVecsV <= ND)
      output_tile<T, ND, GH, kVecsV, O>(v_base, offs, L, c, p, ld, inv, out);
    else
      output_tile<T, ND, GH, 1, O>(v_base, offs, L, c, p, ld, inv, out);
  }
}

// One task: the slots [t0, t1) of a sequence (blocks: its block table) for the query heads of
// KV heads [h0, h1), each KV head's G query heads. Writes each head's output, normalised by
// its sum over these slots, and that sum's max and total to m and l when given.
template <typename T, int ND, typename O>
void attend(const T* q, const T* k_base, const T* v_base, int64_t block_size, int64_t row,
            const int64_t* blocks, int64_t t0, int64_t t1, int64_t h0, int64_t h1, int64_t G,
            float scale, bool dp, float* qf, float* sc, int64_t* offs, O* out, float* m_out,
            float* l_out) {
  constexpr int64_t D = ND * 16;
  const int64_t L = t1 - t0;                  // slots read
  const int64_t nkv = h1 - h0, nh = nkv * G;  // KV heads and query heads of this task
  const int64_t ld = L + 16;                  // score row stride (room for a masked tail)
  if (!dp) {
    for (int64_t j = 0; j < nh; ++j)
      for (int i = 0; i < ND; ++i)
        kvloop::vstoreu(qf + j * D + 16 * i,
                        vmul(load16_unordered(q + j * D + 16 * i), vset1(scale)));
  }
  // NOTE: each slot's offset is computed once per task, without dividing by the runtime block
  // size per key, head and pass (those divisions cost 4-15 % of the kernel's time).
  for (int64_t t = 0, blk = t0 / block_size, r = t0 % block_size; t < L; ++blk, r = 0)
    for (; r < block_size && t < L; ++r, ++t)
      offs[t] = (blocks[blk] * block_size + r) * row + h0 * D;
  score_pass<T, ND>(dp, q, qf, k_base, v_base, offs, L, nkv, G, ld, scale, sc);
  float inv_sum[kMaxHeads];
  for (int64_t j = 0; j < nh; ++j) {
    float* s = sc + j * ld;
    V16 mx = vset1(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= L; t += 16) mx = kvloop::vmax(mx, vloadu(s + t));
    float m = kvloop::vreduce_max(mx);
    for (; t < L; ++t) m = std::max(m, s[t]);
    V16 sum = vzero();
    const V16 vm = vset1(m);
    for (t = 0; t < L; t += 16) {
      const int64_t live = std::min<int64_t>(16, L - t);
      V16 e = kvloop::exp16(kvloop::vsub(kvloop::vloadu_n(s + t, live), vm));
      e = kvloop::vkeep_n(e, live);
      kvloop::vstoreu_n(s + t, e, live);
      sum = kvloop::vadd(sum, e);
    }
    const float l = kvloop::vreduce_add(sum);
    inv_sum[j] = 1.0f / l;
    if (m_out != nullptr) {
      m_out[j] = m;
      l_out[j] = l;
    }
  }
  for (int64_t h = 0; h < nkv; ++h) {
    const T* vh = v_base + h * D;  // + offs[t]: slot t's values of KV head h
    for (int64_t g0 = 0; g0 < G; g0 += kHeads) {
      const int64_t j = h * G + g0;
      const float* p = sc + j * ld;
      switch (std::min<int64_t>(kHeads, G - g0)) {
        case 3: output_heads<T, ND, 3>(vh, offs, L, p, ld, inv_sum + j, out + j * D);
          break;
        case 2: output_heads<T, ND, 2>(vh, offs, L, p, ld, inv_sum + j, out + j * D);
          break;
        default: output_heads<T, ND, 1>(vh, offs, L, p, ld, inv_sum + j, out + j * D);
      }
    }
  }
}

struct Task {
  int64_t b, h0, t0, t1;
  int64_t part;  // its row of the parts' buffers, or -1: the task covers its whole context
};

// Head j of sequence b from its P parts' outputs (each normalised by its own sum l, with max m):
// out = sum_p w_p o_p / sum_p w_p, w_p = exp(m_p - max m) l_p.
template <typename T, int ND>
void merge_parts(const float* po, const float* pm, const float* pl, int64_t P, int64_t H,
                 int64_t j, T* out) {
  constexpr int64_t D = ND * 16;
  float m = -INFINITY;
  for (int64_t p = 0; p < P; ++p) m = std::max(m, pm[p * H + j]);
  float w[kMaxParts], total = 0.0f;
  for (int64_t p = 0; p < P; ++p) total += w[p] = std::exp(pm[p * H + j] - m) * pl[p * H + j];
  for (int64_t p = 0; p < P; ++p) w[p] /= total;
  for (int i = 0; i < ND; ++i) {
    V16 acc = vzero();
    for (int64_t p = 0; p < P; ++p)
      acc = vfmadd(vset1(w[p]), vloadu(po + (p * H + j) * D + 16 * i), acc);
    kvloop::store16_unordered(out + 16 * i, acc);
  }
}

template <typename T, int ND>
void run(const T* q, int64_t q_stride, const T* cache, int64_t num_blocks, int64_t block_size,
         const int64_t* table, int64_t table_stride, const int64_t* lens, int64_t B, int64_t H,
         int64_t KV, float scale, T* out) {
  constexpr int64_t D = ND * 16;
  const int64_t G = H / KV;
  const int64_t row = KV * D;  // elements per cache slot
  // NOTE: a bfloat16 cache's scores through vdpbf16ps where the CPU has it (score_tile_dp).
  // Not bf16_available(), which the AVX2 build answers for its own bfloat16 products.
  static const bool cpu_has_bf16 = cpu_bf16();
  const bool dp = kDpShape<T, ND> && cpu_has_bf16;
  const T* v_base = cache + num_blocks * block_size * row;
  // NOTE: torch's thread count, in a team or not (a team may have fewer): the same plan, so
  // the same bits, as the Python loop's call.
  const int64_t threads = at::get_num_threads();
  // NOTE: whole sequences per task when there are enough of them (each slot's KV heads read
  // together: one contiguous run of the cache); with fewer than kTasksPerThread a thread, long
  // contexts split into parts of at least kMinPart slots, merged afterwards; and if that still
  // leaves fewer than 2 tasks a thread, each part splits by KV head too.
  const int64_t wanted = kTasksPerThread * threads;
  auto count_parts = [&](int64_t b, int64_t split) {
    const int64_t most = std::min<int64_t>(kMaxParts, (wanted + B * split - 1) / (B * split));
    return std::clamp<int64_t>(lens[b] / kMinPart, 1, most);
  };
  int64_t whole = 0;  // tasks without a split by KV head
  for (int64_t b = 0; b < B; ++b) whole += count_parts(b, 1);
  const int64_t split = whole >= 2 * threads ? 1 : KV;
  const int64_t heads_per_task = KV / split;
  std::vector<Task> tasks;
  std::vector<int64_t> first_part(B, -1), parts(B, 1);
  int64_t n_parts = 0, max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    parts[b] = count_parts(b, split);
    const int64_t len = (lens[b] + parts[b] - 1) / parts[b];
    if (parts[b] > 1) first_part[b] = n_parts, n_parts += parts[b];
    for (int64_t p = 0; p < parts[b]; ++p)
      for (int64_t s = 0; s < split; ++s)
        tasks.push_back({b, s * heads_per_task, p * len, std::min(lens[b], (p + 1) * len),
                         parts[b] > 1 ? first_part[b] + p : -1});
    max_len = std::max(max_len, len);
  }
  std::stable_sort(tasks.begin(), tasks.end(),  // longest first
                   [](const Task& a, const Task& b) { return a.t1 - a.t0 > b.t1 - b.t0; });
  std::vector<float> po(n_parts * H * D), pm(n_parts * H), pl(n_parts * H);
  const auto n_tasks = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, n_tasks);
  kvloop::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> qf(dp ? 0 : heads_per_task * G * D);
    std::vector<float> sc(heads_per_task * G * (max_len + 16));
    std::vector<int64_t> offs(max_len);
    for (int64_t k = next++; k < n_tasks; k = next++) {
      const Task& t = tasks[k];
      const int64_t head = t.h0 * G;  // the task's first query head
      const T* qt = q + t.b * q_stride + head * D;
      const int64_t* blocks = table + t.b * table_stride;
      const int64_t h1 = t.h0 + heads_per_task;
      if (t.part < 0) {
        attend<T, ND>(qt, cache, v_base, block_size, row, blocks, t.t0, t.t1, t.h0, h1, G, scale,
                      dp, qf.data(), sc.data(), offs.data(), out + (t.b * H + head) * D,
                      static_cast<float*>(nullptr), static_cast<float*>(nullptr));
      } else {
        const int64_t at = t.part * H + head;
        attend<T, ND>(qt, cache, v_base, block_size, row, blocks, t.t0, t.t1, t.h0, h1, G, scale,
                      dp, qf.data(), sc.data(), offs.data(), po.data() + at * D, pm.data() + at,
                      pl.data() + at);
      }
    }
  });
  for (int64_t b = 0; b < B; ++b)
    if (parts[b] > 1)
      for (int64_t j = 0; j < H; ++j)
        merge_parts<T, ND>(po.data() + first_part[b] * H * D, pm.data() + first_part[b] * H,
                           pl.data() + first_part[b] * H, parts[b], H, j,
                           out + (b * H + j) * D);
}

}  // namespace

void decode_attention(const at::Tensor& q, const at::Tensor& cache,
                      const at::Tensor& block_table, const at::Tensor& context_lens,
                      double scale, at::Tensor& out) {
  kvloop::check_attention_tensors("decode_attention", q, cache, out,
                                  {block_table, context_lens});
  TORCH_CHECK(q.size(1) <= kMaxHeads, "query heads per KV head: at most ", kMaxHeads);
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 &&
                  block_table.stride(1) == 1 && block_table.size(0) == q.size(0), "block_table");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0), "context_lens");
  // NOTE: every slot the kernel will read must exist: a bad table would read out of bounds.
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t bs = cache.size(2), nb = cache.size(1);
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= block_table.size(1) * bs,
                "decode_attention: context length ", lens[b], " outside the block table");
    for (int64_t j = 0; j < (lens[b] + bs - 1) / bs; ++j) {
      const int64_t id = table[b * block_table.stride(0) + j];
      TORCH_CHECK(id >= 0 && id < nb, "decode_attention: block id ", id, " out of range");
    }
  }
  const int64_t H = q.size(1), KV = cache.size(3);
  kvloop::by_dtype_and_head_size("decode_attention", q, [&](auto* tag, auto nd) {
    using T = std::remove_pointer_t<decltype(tag)>;
    run<T, decltype(nd)::value>(static_cast<const T*>(q.data_ptr()), q.stride(0),
                                static_cast<const T*>(cache.data_ptr()), nb, bs, table,
                                block_table.stride(0), lens, q.size(0), H, KV,
                                static_cast<float>(scale), static_cast<T*>(out.data_ptr()));
  });
}
