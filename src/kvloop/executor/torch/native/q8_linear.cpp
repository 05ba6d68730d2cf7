// 8-bit weights times 8-bit activations with AVX-512 VNNI (llama.cpp's Q8_0 x Q8_0 scheme).
//
// W[n, k] = d[n, g] * w[n, k], w in -127..127, g = k / 32, and x[k] ~ s[g] * a[k] per group
// of 32. vpdpbusd multiplies unsigned by signed bytes, so the weights enter as w + 128 (their
// bytes with the top bit flipped, one xor per 64 bytes):
//   sum_k w a = sum_k (w + 128) a - 128 sum_k a,
// the last term from the activations' own group sums (QuantRows::sum), exact in int32.
// NOTE: entering the activations as a + 128 instead would need a per-(output, group)
// correction 128 * sum_k w stored with the weights: 4 bytes per 32 weights, a tenth of what
// a one-row product streams. The integer dot is the same.
//
// Packed layout (built by kvloop.executor.torch.native.pack_q8): [N/16][K/32][512] bytes.
// For 16 outputs and one group, chunk c (64 bytes, c = 0..7) holds at byte 4 * n + j the
// weight of k = 4c + j. Scales d are float16 [N/16][K/32][16] (as a Q8_0 block's, widened
// exactly to float32).
#include "int_gemm.h"
#include "kernels.h"

namespace {

using kvloop::kGroup;
using kvloop::kTile;
using kvloop::QuantRows;

struct Q8Tiles {
  const int8_t* packed;
  const uint16_t* scales;  // float16
  const QuantRows& q;
  int64_t K, G;

  static constexpr int kWidth = 1;
  static constexpr int kRows = kvloop::kRows;

  template <int R, int W>
  void rows(int64_t t, int64_t m0, __m512* acc) const {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    const int8_t* w = packed + t * G * 512;
    const uint16_t* d = scales + t * G * kTile;
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      if (m0 == 0) {  // NOTE: 8 groups ahead; later row passes find the tile in L1
        kvloop::prefetch_ahead(w + g * 512, 8 * 512, 512);
        kvloop::prefetch_ahead(d + g * kTile, 8 * 32, 32);
      }
      __m512i wv[8];  // w + 128 as unsigned bytes
      for (int c = 0; c < 8; ++c)
        wv[c] = _mm512_xor_si512(_mm512_loadu_si512(w + g * 512 + 64 * c), flip);
      const __m512 dv = kvloop::load_f16(d + g * kTile);
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const int8_t* a = q.a.data() + m * K + g * kGroup;
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int c = 0; c < 8; c += 2) {
          s0 = _mm512_dpbusd_epi32(s0, wv[c], kvloop::broadcast4(a + 4 * c));
          s1 = _mm512_dpbusd_epi32(s1, wv[c + 1], kvloop::broadcast4(a + 4 * c + 4));
        }
        const __m512i offset = _mm512_set1_epi32(128 * q.sum[m * G + g]);
        __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(s0, s1), offset));
        acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(q.s[m * G + g])), acc[r]);
      }
    }
  }
};

}  // namespace

void q8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
               const std::optional<at::Tensor>& bias, at::Tensor& out, bool accumulate) {
  kvloop::int_gemm("q8_linear", x, packed, at::kChar, 8, {{scales, at::kHalf}}, bias, out,
                   [&](const auto* xp, const float* b, auto* op) {
                     const int64_t K = x.size(1);
                     kvloop::int_product(xp, b, op, x.size(0), out.size(1), K, accumulate,
                                         [&](const QuantRows& rows) {
                                           return Q8Tiles{packed.data_ptr<int8_t>(),
                                                          static_cast<const uint16_t*>(
                                                              scales.data_ptr()),
                                                          rows, K, K / kGroup};
                                         });
                   });
}
