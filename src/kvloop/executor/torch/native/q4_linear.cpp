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
// offsets m are float16 [N/16][K/32][16] (as a Q4_1 block's), widened exactly to float32.
#include <type_traits>

#include "int_gemm.h"
#include "kernels.h"

namespace {

using kvloop::kGroup;
using kvloop::kTile;
using kvloop::QuantRows;

struct Q4Tiles {
  const uint8_t* packed;
  const uint16_t* scales;  // float16
  const uint16_t* mins;    // float16
  const QuantRows& q;
  int64_t K, G;

  static constexpr int kWidth = 1;
  static constexpr int kRows = kvloop::kRows;

  template <int R, int W>
  void rows(int64_t t, int64_t m0, __m512* acc) const {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const uint8_t* w = packed + t * G * 256;
    const uint16_t* d = scales + t * G * kTile;
    const uint16_t* mn = mins + t * G * kTile;
    // NOTE: each row's pointers taken once, not reloaded from q every group (the compiler
    // cannot tell that the stores to acc leave q's vectors alone).
    const int8_t* a_row[R];
    const float* s_row[R];
    const float* ssum_row[R];
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_setzero_ps();
      a_row[r] = q.a.data() + (m0 + r) * K;
      s_row[r] = q.s.data() + (m0 + r) * G;
      ssum_row[r] = q.ssum.data() + (m0 + r) * G;
    }
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wg = w + g * 256;
      if (m0 == 0) {  // NOTE: later row passes find the tile in L1
        kvloop::prefetch_ahead(wg, 16 * 256, 256);
        kvloop::prefetch_ahead(d + g * kTile, 16 * 32, 32);
        kvloop::prefetch_ahead(mn + g * kTile, 16 * 32, 32);
      }
      // The low nibbles, and the high ones kept in place (16 times their codes): two
      // operations a chunk where shift-and-mask took three, the factor 16 taken out of the
      // integer sum below (exactly: every term is a multiple of 16).
      __m512i lo[4], hi16[4];
      for (int c = 0; c < 4; ++c) {
        __m512i v = _mm512_loadu_si512(wg + 64 * c);
        // NOTE: keeps v in a register: otherwise the compiler folds the load into both uses
        // and reads each chunk twice (on Zen 4 the loads, not the arithmetic, then bounded a
        // one-row pass from cache: this and the row pointers made it 0.85-0.93x the time).
        asm("" : "+v"(v));
        lo[c] = _mm512_and_si512(v, nib);
        hi16[c] = _mm512_xor_si512(v, lo[c]);
      }
      const __m512 dv = kvloop::load_f16(d + g * kTile);
      const __m512 mv = kvloop::load_f16(mn + g * kTile);
      for (int r = 0; r < R; ++r) {
        const int8_t* a = a_row[r] + g * kGroup;
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
          s0 = _mm512_dpbusd_epi32(s0, lo[c], kvloop::broadcast4(a + 8 * c));
          s1 = _mm512_dpbusd_epi32(s1, hi16[c], kvloop::broadcast4(a + 8 * c + 4));
        }
        // NOTE: |s1| <= 16 * 240 * 127 per lane (no int32 overflow); >> 4 divides exactly.
        const __m512i sum = _mm512_add_epi32(s0, _mm512_srai_epi32(s1, 4));
        const __m512 dot = _mm512_cvtepi32_ps(sum);
        acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(s_row[r][g])), acc[r]);
        acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(ssum_row[r][g]), acc[r]);
      }
    }
  }
};

}  // namespace

template <typename X, typename O>
void q4_product(const X* x, const uint8_t* packed, const uint16_t* scales, const uint16_t* mins,
                const float* bias, O* out, int64_t M, int64_t N, int64_t K, bool accumulate) {
  if constexpr (std::is_same_v<X, uint16_t>) {
    if (M >= kAmxQ4Rows && amx_available()) {
      amx_q4_gemm(x, packed, scales, mins, bias, out, M, N, K, accumulate);
      return;
    }
  }
  kvloop::int_product(x, bias, out, M, N, K, accumulate, [&](const QuantRows& rows) {
    return Q4Tiles{packed, scales, mins, rows, K, K / kGroup};
  });
}

KVLOOP_Q4_PRODUCT(uint16_t, uint16_t);
KVLOOP_Q4_PRODUCT(uint16_t, float);
KVLOOP_Q4_PRODUCT(float, float);

void q4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
               const at::Tensor& mins, const std::optional<at::Tensor>& bias,
               at::Tensor& out, bool accumulate) {
  kvloop::int_gemm("q4_linear", x, packed, at::kByte, 4,
                   {{scales, at::kHalf}, {mins, at::kHalf}}, bias, out,
                   [&](const auto* xp, const float* b, auto* op) {
                     q4_product(xp, packed.data_ptr<uint8_t>(),
                                static_cast<const uint16_t*>(scales.data_ptr()),
                                static_cast<const uint16_t*>(mins.data_ptr()), b, op, x.size(0),
                                out.size(1), x.size(1), accumulate);
                   });
}
