// 4-bit weights times 8-bit activations with AVX-512 VNNI (llama.cpp's Q4_1 x Q8_1 scheme).
//
// W[n, k] = d[n, g] * q[n, k] + m[n, g], q in 0..15, g = k / 32. The rows of x are quantised
// per group of 32 to int8: x[k] ~ s[g] * a[k]. Then, per output and group,
//   sum_k W[n, k] x[k] ~ d[n, g] s[g] sum_k q[n, k] a[k] + m[n, g] s[g] sum_k a[k],
// the integer dot done by vpdpbusd (unsigned q times signed a, 4 products per 32-bit lane).
//
// Packed layout (built by kvloop.executor.torch.native.pack_q4): [N/16][K/32][256] bytes.
// For 16 outputs and one group, chunk c (64 bytes, c = 0..3) holds, at byte 4 * n + j, the
// code of k = 8c + j in its low nibble and of k = 8c + 4 + j in its high one. Scales d and
// offsets m are float32 [N/16][K/32][16].
#include <ATen/Parallel.h>

#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int kGroup = 32;
constexpr int kTile = 16;
constexpr int kRows = 4;  // activation rows sharing one pass over a tile's weights

struct QuantRows {
  std::vector<int8_t> a;   // [M][K]
  std::vector<float> s;    // [M][G] scale of each group
  std::vector<float> ssum; // [M][G] s * sum of the group's codes
};

template <typename T>
QuantRows quantize_rows(const T* x, int64_t M, int64_t K) {
  const int64_t G = K / kGroup;
  QuantRows q{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const T* src = x + m * K + g * kGroup;
      __m512 lo = kvloop::load16(src), hi = kvloop::load16(src + 16);
      __m512 amax = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
      float mx = _mm512_reduce_max_ps(amax);
      float s = mx / 127.0f;
      float inv = mx > 0 ? 127.0f / mx : 0.0f;
      __m512 vinv = _mm512_set1_ps(inv);
      __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vinv));  // round to nearest even
      __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vinv));
      int8_t* dst = q.a.data() + m * K + g * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(ql));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qh));
      int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
      q.s[m * G + g] = s;
      q.ssum[m * G + g] = s * static_cast<float>(sum);
    }
  }
  return q;
}

// acc[r] (16 outputs of tile t) for R rows starting at row m0.
template <int R>
inline void tile_rows(const uint8_t* w, const float* d, const float* mn, const QuantRows& q,
                      int64_t m0, int64_t K, int64_t G, __m512* acc) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + g * 256;
    __m512i wl[4], wh[4];
    for (int c = 0; c < 4; ++c) {
      __m512i v = _mm512_loadu_si512(wg + 64 * c);
      wl[c] = _mm512_and_si512(v, nib);
      wh[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    }
    const __m512 dv = _mm512_loadu_ps(d + g * kTile);
    const __m512 mv = _mm512_loadu_ps(mn + g * kTile);
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int32_t* a4 = reinterpret_cast<const int32_t*>(q.a.data() + m * K + g * kGroup);
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        s0 = _mm512_dpbusd_epi32(s0, wl[c], _mm512_set1_epi32(a4[2 * c]));
        s1 = _mm512_dpbusd_epi32(s1, wh[c], _mm512_set1_epi32(a4[2 * c + 1]));
      }
      __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(q.s[m * G + g])), acc[r]);
      acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(q.ssum[m * G + g]), acc[r]);
    }
  }
}

template <typename T>
void run(const T* x, const uint8_t* packed, const float* scales, const float* mins,
         const float* bias, T* out, int64_t M, int64_t K, int64_t N, bool accumulate) {
  const int64_t G = K / kGroup;
  const QuantRows q = quantize_rows(x, M, K);
  const int64_t tiles = N / kTile;
  // NOTE: a grain of 4 tiles (64 outputs) still splits the smallest matrices over threads.
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    __m512 acc[kRows];
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* w = packed + t * G * 256;
      const float* d = scales + t * G * kTile;
      const float* mn = mins + t * G * kTile;
      const __m512 b = bias ? _mm512_loadu_ps(bias + t * kTile) : _mm512_setzero_ps();
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, M - m0);
        switch (rows) {
          case 4: tile_rows<4>(w, d, mn, q, m0, K, G, acc); break;
          case 3: tile_rows<3>(w, d, mn, q, m0, K, G, acc); break;
          case 2: tile_rows<2>(w, d, mn, q, m0, K, G, acc); break;
          default: tile_rows<1>(w, d, mn, q, m0, K, G, acc); break;
        }
        for (int64_t r = 0; r < rows; ++r) {
          T* o = out + (m0 + r) * N + t * kTile;
          __m512 y = _mm512_add_ps(acc[r], b);
          if (accumulate) y = _mm512_add_ps(y, kvloop::load16(o));
          kvloop::store16(o, y);
        }
      }
    }
  });
}

}  // namespace

void q4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
               const torch::Tensor& mins, const std::optional<torch::Tensor>& bias,
               torch::Tensor& out, bool accumulate) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous(), "q4_linear: layout");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(K % kGroup == 0 && N % kTile == 0 && out.size(0) == M, "q4_linear: shapes");
  TORCH_CHECK(packed.numel() == N * K / 2 && scales.numel() == N * K / kGroup, "q4_linear: W");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "q4_linear: dtypes");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "q4_linear: bias");
    b = bias->data_ptr<float>();
  }
  const auto* w = packed.data_ptr<uint8_t>();
  const float* d = scales.data_ptr<float>();
  const float* mn = mins.data_ptr<float>();
  if (x.scalar_type() == at::kBFloat16) {
    run(reinterpret_cast<const uint16_t*>(x.data_ptr()), w, d, mn, b,
        reinterpret_cast<uint16_t*>(out.data_ptr()), M, K, N, accumulate);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "q4_linear: x must be bfloat16 or float32");
    run(x.data_ptr<float>(), w, d, mn, b, out.data_ptr<float>(), M, K, N, accumulate);
  }
}
