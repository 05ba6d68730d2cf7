// The sampler's greedy pick: the index of the largest value of each logits row, as numpy's and
// torch's argmax give it (the first of equal maxima; the first NaN where a row has one).
//
// One pass a row: each lane keeps its largest value so far and where it first saw it (a
// strictly greater value replaces it); the lanes then agree on the smallest index among those
// holding the row's maximum. A row with a NaN is scanned again for its first one.
// NOTE: one call from Python instead of numpy's argmax and the torch and numpy conversions
// around it: right after a step has streamed the weights, each of those library calls runs
// from cold caches (a one-row int4 step's sampling took 165 µs there against 28 µs hot;
// docs/native-kernels.md).
#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "team.h"

namespace {

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(x[i])) return i;
  return -1;
}

// The lanes' (value, first index) pairs, then the tail [i, n) one by one: the row's argmax,
// or -1 where the tail holds a NaN.
int64_t finish(const float* best, const int32_t* at, int lanes, const float* x, int64_t i,
               int64_t n) {
  float m = -INFINITY;
  int64_t arg = 0;
  for (int l = 0; l < lanes; ++l) {
    if (best[l] > m || (best[l] == m && at[l] < arg)) {
      m = best[l];
      arg = at[l];
    }
  }
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return -1;
    if (x[i] > m) {
      m = x[i];
      arg = i;
    }
  }
  return arg;
}

// NOTE: lanes that never see a value above -inf keep index 0; they hold the maximum only
// when the whole row is -inf, whose argmax is 0.
int64_t argmax_row(const float* x, int64_t n) {
#if defined(__AVX512F__)
  constexpr int kLanes = 16;
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i at = _mm512_setzero_si512();
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(kLanes);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  const bool any_nan = nan != 0;
#else
  constexpr int kLanes = 8;
  __m256 best = _mm256_set1_ps(-INFINITY);
  __m256i at = _mm256_setzero_si256();
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(kLanes);
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, gt);
    at = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(idx), gt));
    idx = _mm256_add_epi32(idx, step);
  }
  const bool any_nan = _mm256_movemask_ps(nan) != 0;
#endif
  if (any_nan) return first_nan(x, n);
  alignas(64) float lane_best[kLanes];
  alignas(64) int32_t lane_at[kLanes];
#if defined(__AVX512F__)
  _mm512_store_ps(lane_best, best);
  _mm512_store_si512(lane_at, at);
#else
  _mm256_store_ps(lane_best, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_at), at);
#endif
  const int64_t arg = finish(lane_best, lane_at, kLanes, x, i, n);
  return arg >= 0 ? arg : first_nan(x, n);
}

}  // namespace

std::vector<int64_t> argmax_rows(const at::Tensor& logits, int64_t columns) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.stride(1) == 1,
              "argmax_rows: logits must be a CPU float32 [rows, columns] tensor with "
              "contiguous rows");
  // NOTE: lane indices are int32.
  TORCH_CHECK(columns >= 1 && columns <= std::min<int64_t>(logits.size(1), INT32_MAX),
              "argmax_rows: columns ", columns, " outside 1..",
              std::min<int64_t>(logits.size(1), INT32_MAX));
  const int64_t rows = logits.size(0), stride = logits.stride(0);
  const float* x = logits.data_ptr<float>();
  std::vector<int64_t> out(rows);
  kvloop::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = argmax_row(x + r * stride, columns);
  });
  return out;
}
