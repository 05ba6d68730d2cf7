// float32 weights times float32 activations, FMA over simd.h's V16 (one AVX-512 register in
// the full build, two AVX2 ones in the AVX2 build): for the decode-sized products of a
// float32 model, where oneDNN streams the weights at about half the machine's read bandwidth
// (docs/native-kernels.md).
//
// Packed layout (built by kvloop.executor.torch.native.pack_f32): [N/16][K][16], f32_tile.h's
// tiles one after another: one tile is one contiguous stream of K * 64 bytes.
//
// NOTE: every product and sum is float32 FMA; only the order of the sums differs from
// oneDNN's (independent partial sums over k, added at the end), so results agree with
// torch's to float32 rounding, not to the bit.
#include <algorithm>

#include "f32_tile.h"
#include "gemm_checks.h"
#include "kernels.h"
#include "team.h"

using kvloop::kF32Rows;
using kvloop::kTile;
using kvloop::V16;

void f32_product(const float* x, const float* packed, const float* bias, float* out, int64_t M,
                 int64_t N, int64_t K, bool accumulate) {
  kvloop::parallel_tiles(0, N / kTile, 4, [&](int64_t begin, int64_t end) {
    V16 acc[kF32Rows];
    for (int64_t t = begin; t < end; ++t) {
      const float* w = packed + t * K * kTile;
      const V16 bv = bias ? kvloop::vloadu(bias + t * kTile) : kvloop::vzero();
      for (int64_t m0 = 0; m0 < M; m0 += kF32Rows) {
        const int64_t rows = std::min<int64_t>(kF32Rows, M - m0);
        kvloop::f32_tile_rows<kF32Rows>(rows, w, x, K, m0, acc);
        for (int64_t r = 0; r < rows; ++r) {
          float* o = out + (m0 + r) * N + t * kTile;
          V16 v = kvloop::vadd(acc[r], bv);
          if (accumulate) v = kvloop::vadd(v, kvloop::vloadu(o));
          kvloop::vstoreu(o, v);
        }
      }
    }
  });
}

void f32_linear(const at::Tensor& x, const at::Tensor& packed,
                const std::optional<at::Tensor>& bias, at::Tensor& out, bool accumulate) {
  kvloop::check_f32_linear(x, packed, out);
  f32_product(x.data_ptr<float>(), packed.data_ptr<float>(),
              kvloop::bias_data("f32_linear", bias, out), out.data_ptr<float>(), x.size(0),
              out.size(1), x.size(1), accumulate);
}
