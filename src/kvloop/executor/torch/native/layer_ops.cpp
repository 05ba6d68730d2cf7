// The small ops around a decoder layer's products, fused: each replaces 2-5 torch ops (and
// their dispatch, ~5-10 µs each on CPU) with one call, rounding where torch's sequence rounds.
//
// rms_norm:      out = w * (x * rsqrt(mean(x^2) + eps)).to(dtype)   (transformers' LlamaRMSNorm)
// rope_write_kv: q, k heads of qkv rotated in place, x * cos + rotate_half(x) * sin, then k and
//                v stored at their cache slots (attention.write_kv)
// silu_mul:      out = silu(gate) * up, gate and up the halves of one [T, 2I] product
#include <cmath>

#include "kernels.h"
#include "simd.h"
#include "team.h"

namespace {

using kvloop::load16;
using kvloop::round_to;
using kvloop::store16;
using kvloop::V16;
using kvloop::vadd;
using kvloop::vdiv;
using kvloop::vfmadd;
using kvloop::vmul;
using kvloop::vset1;
using kvloop::vsub;
using kvloop::vzero;

constexpr int64_t kGrain = 16;  // rows per thread task (one row alone stays on the caller)

template <typename T>
// NOTE: out may be x (in place): a row's sum of squares is taken before any of it is written,
// and each element is read before its own output is stored.
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t H, float eps) {
  kvloop::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * H;
      V16 ss = vzero();
      for (int64_t i = 0; i < H; i += 16) {
        const V16 v = load16(xr + i);
        ss = vfmadd(v, v, ss);
      }
      const float inv = 1.0f / std::sqrt(kvloop::vreduce_add(ss) / H + eps);
      const V16 vinv = vset1(inv);
      for (int64_t i = 0; i < H; i += 16) {
        const V16 y = round_to(vmul(load16(xr + i), vinv), xr);
        store16(out + r * H + i, vmul(load16(w + i), y));
      }
    }
  });
}

template <typename T>
void rope_write(T* qkv, const T* cos, const T* sin, T* cache, const int64_t* slots, int64_t rows,
                int64_t heads, int64_t kv, int64_t D, int64_t slots_per_half) {
  const int64_t half = D / 2, width = (heads + 2 * kv) * D;
  kvloop::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = qkv + r * width;
      const T* c = cos + r * D;
      const T* s = sin + r * D;
      for (int64_t h = 0; h < heads + kv; ++h) {
        T* x = row + h * D;
        for (int64_t i = 0; i < half; i += 16) {
          const V16 x1 = load16(x + i), x2 = load16(x + half + i);
          // NOTE: torch rounds after x * cos (mul_) and after + rotated * sin (addcmul_).
          const V16 a = round_to(vmul(x1, load16(c + i)), x);
          const V16 b = round_to(vmul(x2, load16(c + half + i)), x);
          store16(x + i, vfmadd(x2, load16(s + i), a));
          store16(x + half + i, vfmadd(x1, load16(s + half + i), b));
        }
      }
      const int64_t slot = slots[r];
      T* k_dst = cache + slot * kv * D;
      T* v_dst = cache + (slots_per_half + slot) * kv * D;
      std::copy(row + heads * D, row + (heads + kv) * D, k_dst);
      std::copy(row + (heads + kv) * D, row + width, v_dst);
    }
  });
}

template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t I) {
  kvloop::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * I;
      for (int64_t i = 0; i < I; i += 16) {
        const V16 x = load16(g + i);
        const V16 e = kvloop::exp16(vsub(vzero(), x));
        // NOTE: torch rounds silu(gate) to the dtype before multiplying by up.
        const V16 act = round_to(vdiv(x, vadd(vset1(1.0f), e)), g);
        store16(out + r * I + i, vmul(act, load16(g + I + i)));
      }
    }
  });
}

template <typename F>
void by_dtype(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kBFloat16) {
    f(static_cast<uint16_t*>(nullptr));
  } else {
    TORCH_CHECK(t.scalar_type() == at::kFloat, "kvloop layer ops: bfloat16 or float32");
    f(static_cast<float*>(nullptr));
  }
}

template <typename T>
T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

}  // namespace

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
              at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && out.device().is_cpu(),
              "rms_norm: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous() &&
                  out.sizes() == x.sizes() && x.size(1) % 16 == 0, "rms_norm: shapes");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: weight");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "rms_norm: dtypes");
  by_dtype(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows(ptr<T>(x), ptr<T>(weight), ptr<T>(out), x.size(0), x.size(1),
                  static_cast<float>(eps));
  });
}

void rope_write_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                   at::Tensor& cache, const at::Tensor& slots, int64_t num_heads,
                   int64_t num_kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu() &&
                  cache.device().is_cpu() && slots.device().is_cpu(),
              "rope_write_kv: CPU tensors only");
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous(), "cache layout");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "rope_write_kv: head counts");
  TORCH_CHECK(qkv.dim() == 2, "rope_write_kv: qkv must be [tokens, width]");
  const int64_t D = cache.size(4), T = qkv.size(0);
  TORCH_CHECK(cache.size(3) == num_kv_heads && D % 32 == 0, "rope_write_kv: head size");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() &&
                  qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "rope_write_kv: qkv");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D &&
                  sin.numel() == T * D, "rope_write_kv: cos/sin");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T,
              "rope_write_kv: slots");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
                  cache.scalar_type() == qkv.scalar_type(), "rope_write_kv: dtypes");
  const int64_t slots_per_half = cache.size(1) * cache.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < T; ++r)
    TORCH_CHECK(sp[r] >= 0 && sp[r] < slots_per_half, "rope_write_kv: slot out of range");
  by_dtype(qkv, [&](auto* tag) {
    using E = std::remove_pointer_t<decltype(tag)>;
    rope_write(ptr<E>(qkv), ptr<E>(cos), ptr<E>(sin), ptr<E>(cache), sp, T, num_heads,
               num_kv_heads, D, slots_per_half);
  });
}

void silu_mul(const at::Tensor& gate_up, at::Tensor& out) {
  TORCH_CHECK(gate_up.device().is_cpu() && out.device().is_cpu(), "silu_mul: CPU tensors only");
  TORCH_CHECK(out.dim() == 2, "silu_mul: shapes");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && out.is_contiguous() &&
                  gate_up.size(1) == 2 * out.size(1) && out.size(0) == gate_up.size(0) &&
                  out.size(1) % 16 == 0, "silu_mul: shapes");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "silu_mul: dtypes");
  by_dtype(gate_up, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_mul_rows(ptr<T>(gate_up), ptr<T>(out), gate_up.size(0), out.size(1));
  });
}
