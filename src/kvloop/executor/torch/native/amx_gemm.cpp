// Products of many rows with AMX (tdpbf16ps), float32 sums, on CPUs with AMX-BF16 (Sapphire
// Rapids and later): what bf16_linear runs from kAmxRows rows, and q4_linear from
// kAmxQ4Rows rows of bfloat16 activations.
//
// bf16_linear's packed layout [N/16][K/2][16][2] is already AMX's B-tile layout: 16 rows of
// input pairs, each 64 bytes holding 16 outputs' two weights. So one 1 KiB block of it (16
// pairs, K = 32 inputs) loads as a B tile with a 64-byte stride, and 16 activation rows of
// 32 inputs load as an A tile straight from x (a stride of K * 2 bytes). A tdpbf16ps then
// does 16 x 16 x 32 multiply-adds: about 20 times the work of one vdpbf16ps per weight
// byte, which is what a prompt chunk or a wide batch of decodes needs (the vdpbf16ps kernel
// is bound by arithmetic from about 8 rows on).
//
// 4-bit weights (q4_linear's layout) are widened, two tiles of 16 outputs at a time, into a
// thread's scratch in that same layout, d * q + m rounded to bfloat16, then multiplied the
// same way: the widening is paid once per weight and call, the products as for bfloat16.
// Unlike the vdpbf16ps/VNNI path the activations stay bfloat16 (not quantised to int8).
//
// NOTE: tdpbf16ps, as vdpbf16ps, reads bfloat16 subnormals as zero and rounds its float32
// sums to nearest even; only the order of the float32 sums differs from the other kernels'.
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm_checks.h"
#include "kernels.h"

// NOTE: AMX needs GCC 11 or Clang 12 (their intrinsics) and a 64-bit Linux kernel that hands
// out the tile state (arch_prctl); elsewhere amx_available() is false and bf16_linear keeps
// its vdpbf16ps loop. The AMX functions carry a target attribute, so the rest of the build
// does not need the -mamx flags.
#if defined(__AVX512F__) && defined(__linux__) && defined(__x86_64__) &&   \
    ((defined(__clang__) && __clang_major__ >= 12) ||                      \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define KVLOOP_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd.h"
#include "team.h"
#else
#define KVLOOP_AMX 0
#endif

#if KVLOOP_AMX
namespace {

constexpr int64_t kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an XSAVE feature
constexpr int64_t kXfeatureXtiledata = 18;     // the AMX tile data

// Whether the CPU has AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22) and the OS
// lets this process use the tiles (Linux 5.16+ hands them out per process on request).
bool amx_usable() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// The tile configuration (palette 1): tiles 0-3 accumulators (16 rows of 16 float32),
// 4-5 activations (16 rows of 32 bfloat16), 6-7 weights (16 input pairs of 16 outputs).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int i = 0; i < 8; ++i) {
      colsb[i] = 64;
      rows[i] = 16;
    }
  }
};
static_assert(sizeof(TileConfig) == 64);

constexpr int kBlock = 16;  // rows of an A tile, outputs of a tile

// The products of rows [m0, m0 + 16 MB) with the NB tiles of outputs at w (bf16_linear's
// layout, a tile every K * 16 values), each 16 x 16 float32 stored to c + (mb * NB + nb) * 256.
// NOTE: tile numbers are part of the instructions, hence the unrolled cases.
template <int MB, int NB>
__attribute__((target("amx-tile,amx-bf16"))) void tile_block(const uint16_t* x,
                                                              const uint16_t* w, int64_t K,
                                                              int64_t m0, float* c) {
  static_assert(MB >= 1 && MB <= 2 && NB >= 1 && NB <= 2);
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  if constexpr (MB == 2) _tile_zero(2);
  if constexpr (MB == 2 && NB == 2) _tile_zero(3);
  const int64_t x_stride = K * 2;  // bytes between activation rows
  const uint16_t* a0 = x + m0 * K;
  const uint16_t* a1 = a0 + kBlock * K;
  const uint16_t* b0 = w;
  const uint16_t* b1 = b0 + K * kBlock;  // NOTE: a tile is K/2 pairs x 32 values
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(6, b0 + k * kBlock, 64);
    if constexpr (NB == 2) _tile_loadd(7, b1 + k * kBlock, 64);
    _tile_loadd(4, a0 + k, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MB == 2) {
      _tile_loadd(5, a1 + k, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (NB == 2) _tile_stored(1, c + 256, 64);
  if constexpr (MB == 2) _tile_stored(2, c + NB * 256, 64);
  if constexpr (MB == 2 && NB == 2) _tile_stored(3, c + 3 * 256, 64);
}

__attribute__((target("amx-tile"))) void load_config(const TileConfig& cfg) {
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

}  // namespace
#endif

bool amx_available() {
#if KVLOOP_AMX
  static const bool usable = amx_usable();
  return usable;
#else
  return false;
#endif
}

namespace {

#if KVLOOP_AMX
// bf16_linear's packed weights: tiles t0, t0 + 1 read in place.
struct Bf16Weights {
  const uint16_t* packed;
  int64_t K;
  const uint16_t* tiles(int64_t t0, int) const { return packed + t0 * K * kBlock; }
};

// q4_linear's packed weights: tiles t0 .. t0 + nb - 1 widened to bfloat16 pairs into a
// scratch of this thread (q4_linear.cpp has the layout: chunk c of a group holds the codes of
// inputs 8c + j and 8c + 4 + j of output n at byte 4n + j, low and high nibble).
struct Q4Weights {
  const uint8_t* packed;
  const uint16_t* scales;  // float16 [N/16][K/32][16]
  const uint16_t* mins;    // float16 [N/16][K/32][16]
  int64_t K;

  __attribute__((target("avx512bf16"))) const uint16_t* tiles(int64_t t0, int nb) const {
    thread_local std::vector<uint16_t> scratch;  // NOTE: tile loads need no alignment
    const int64_t G = K / kvloop::kGroup, per_tile = K * kBlock;
    if (static_cast<int64_t>(scratch.size()) < 2 * per_tile) scratch.resize(2 * per_tile);
    // Each output's scale (and offset) twice in a row: the lanes of a pair row (n, e).
    const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const auto widen = [](__m128i bytes) {  // 16 codes to float32
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
    };
    for (int j = 0; j < nb; ++j) {
      const int64_t t = t0 + j;
      uint16_t* dst = scratch.data() + j * per_tile;
      for (int64_t g = 0; g < G; ++g) {
        const __m512 d = kvloop::load_f16(scales + (t * G + g) * kBlock);
        const __m512 m = kvloop::load_f16(mins + (t * G + g) * kBlock);
        const __m512 d_lo = _mm512_permutexvar_ps(lo_idx, d);
        const __m512 d_hi = _mm512_permutexvar_ps(hi_idx, d);
        const __m512 m_lo = _mm512_permutexvar_ps(lo_idx, m);
        const __m512 m_hi = _mm512_permutexvar_ps(hi_idx, m);
        const uint8_t* src = packed + (t * G + g) * 256;
        for (int c = 0; c < 4; ++c) {
          const __m512i v = _mm512_loadu_si512(src + 64 * c);
          // NOTE: nibbles [n][j] for j = 0..3: inputs 8c + j (low) and 8c + 4 + j (high);
          // as 16-bit words [n][w], word 0 is the pair (8c, 8c + 1), word 1 (8c + 2, 8c + 3).
          const __m512i halves[2] = {_mm512_and_si512(v, nib),
                                     _mm512_and_si512(_mm512_srli_epi16(v, 4), nib)};
          for (int h = 0; h < 2; ++h) {
            for (int w = 0; w < 2; ++w) {
              // The pair row (n, e) of inputs 8c + 4h + 2w + e: 32 codes.
              const __m512i words = w ? _mm512_srli_epi32(halves[h], 16) : halves[h];
              const __m256i codes = _mm512_cvtepi32_epi16(words);
              const __m512 q0 = widen(_mm256_castsi256_si128(codes));
              const __m512 q1 = widen(_mm256_extracti128_si256(codes, 1));
              const __m512 w0 = _mm512_fmadd_ps(q0, d_lo, m_lo);
              const __m512 w1 = _mm512_fmadd_ps(q1, d_hi, m_hi);
              const int64_t pair = g * 16 + c * 4 + h * 2 + w;
              _mm512_storeu_si512(dst + pair * 32, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
            }
          }
        }
      }
    }
    return scratch.data();
  }
};

// out[M, N] (+)= x[M, K] @ W.T (+ bias) with AMX, W's tiles from ``weights.tiles(t0, nb)``
// (bf16_linear's layout, a tile every K * 16 values).
template <typename T, typename Weights>
void amx_gemm(const Weights& weights, const uint16_t* x, const float* bias, T* out, int64_t M,
              int64_t N, int64_t K, bool accumulate) {
  // NOTE: an A tile reads 16 rows: a row count that is not a multiple of 16 reads a copy
  // padded with zero rows (their sums are computed and dropped).
  const int64_t Mp = (M + kBlock - 1) / kBlock * kBlock;
  std::vector<uint16_t> padded;
  if (Mp != M) {
    padded.assign(Mp * K, 0);
    std::memcpy(padded.data(), x, M * K * sizeof(uint16_t));
    x = padded.data();
  }
  const int64_t tiles_n = N / kBlock, pairs = (tiles_n + 1) / 2;
  kvloop::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    // NOTE: the tile configuration and state are per thread: loaded here, released below.
    const TileConfig cfg;
    load_config(cfg);
    alignas(64) float c[4 * 256];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t0 = 2 * i;
      const int nb = tiles_n - t0 >= 2 ? 2 : 1;
      const uint16_t* w = weights.tiles(t0, nb);
      for (int64_t m0 = 0; m0 < Mp; m0 += 2 * kBlock) {
        const int mb = Mp - m0 >= 2 * kBlock ? 2 : 1;
        if (mb == 2 && nb == 2) tile_block<2, 2>(x, w, K, m0, c);
        else if (mb == 2) tile_block<2, 1>(x, w, K, m0, c);
        else if (nb == 2) tile_block<1, 2>(x, w, K, m0, c);
        else tile_block<1, 1>(x, w, K, m0, c);
        for (int r = 0; r < mb; ++r) {
          for (int j = 0; j < nb; ++j) {
            const float* cb = c + (r * nb + j) * 256;
            const int64_t n0 = (t0 + j) * kBlock;
            const __m512 b = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
            const int64_t rows = std::min<int64_t>(kBlock, M - m0 - r * kBlock);
            for (int64_t row = 0; row < rows; ++row) {
              T* o = out + (m0 + r * kBlock + row) * N + n0;
              __m512 y = _mm512_add_ps(_mm512_load_ps(cb + row * kBlock), b);
              if (accumulate) y = _mm512_add_ps(y, kvloop::load16(o));
              kvloop::store16(o, y);
            }
          }
        }
      }
    }
    release_tiles();
  });
}
#endif

}  // namespace

template <typename T>
void amx_bf16_gemm(const uint16_t* x, const uint16_t* packed, const float* bias, T* out,
                   int64_t M, int64_t N, int64_t K, bool accumulate) {
  TORCH_CHECK(amx_available(), "amx_bf16_gemm: needs AMX-BF16 (this CPU, OS or compiler lacks it)");
#if KVLOOP_AMX
  amx_gemm(Bf16Weights{packed, K}, x, bias, out, M, N, K, accumulate);
#endif
}

template <typename T>
void amx_q4_gemm(const uint16_t* x, const uint8_t* packed, const uint16_t* scales,
                 const uint16_t* mins, const float* bias, T* out, int64_t M, int64_t N,
                 int64_t K, bool accumulate) {
  TORCH_CHECK(amx_available(), "amx_q4_gemm: needs AMX-BF16 (this CPU, OS or compiler lacks it)");
#if KVLOOP_AMX
  amx_gemm(Q4Weights{packed, scales, mins, K}, x, bias, out, M, N, K, accumulate);
#endif
}

template void amx_bf16_gemm(const uint16_t*, const uint16_t*, const float*, uint16_t*, int64_t,
                            int64_t, int64_t, bool);
template void amx_bf16_gemm(const uint16_t*, const uint16_t*, const float*, float*, int64_t,
                            int64_t, int64_t, bool);
template void amx_q4_gemm(const uint16_t*, const uint8_t*, const uint16_t*, const uint16_t*,
                          const float*, uint16_t*, int64_t, int64_t, int64_t, bool);
template void amx_q4_gemm(const uint16_t*, const uint8_t*, const uint16_t*, const uint16_t*,
                          const float*, float*, int64_t, int64_t, int64_t, bool);
