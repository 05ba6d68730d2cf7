// What decode_attention.cpp and prefill_attention.cpp share: the checks of their common
// tensors, and calling a kernel body templated on the cache's element type and head size.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace kvloop {

// q [T, H, D] (rows of heads, each head contiguous), the cache [2, blocks, block size, KV, D]
// (contiguous), out [T, H * D] (contiguous), all on CPU with `others` (the kernel's index
// tensors), one dtype, D a multiple of 16 and H a multiple of KV; a RuntimeError otherwise.
inline void check_attention_tensors(const char* kernel, const at::Tensor& q,
                                    const at::Tensor& cache, const at::Tensor& out,
                                    std::initializer_list<at::Tensor> others) {
  bool cpu = q.device().is_cpu() && cache.device().is_cpu() && out.device().is_cpu();
  for (const at::Tensor& t : others) cpu = cpu && t.device().is_cpu();
  TORCH_CHECK(cpu, kernel, ": CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q layout");
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous(), "cache layout");
  TORCH_CHECK(cache.size(4) == q.size(2) && q.size(2) % 16 == 0, "head size");
  TORCH_CHECK(cache.size(3) > 0 && q.size(1) % cache.size(3) == 0, "query heads per KV head");
  TORCH_CHECK(out.is_contiguous() && out.numel() == q.numel(), "out");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "dtypes");
}

// f(tag, nd) with tag a null T* (uint16_t for bfloat16, float for float32: q's dtype) and nd a
// std::integral_constant<int, ND> for q's head size 16 * ND (ND in 1..8 or 16); anything else
// is refused with a RuntimeError naming the kernel.
template <typename F>
void by_dtype_and_head_size(const char* kernel, const at::Tensor& q, F&& f) {
  auto with_head_size = [&](auto* tag) {
    switch (q.size(2) / 16) {
      case 1: return f(tag, std::integral_constant<int, 1>{});
      case 2: return f(tag, std::integral_constant<int, 2>{});
      case 3: return f(tag, std::integral_constant<int, 3>{});
      case 4: return f(tag, std::integral_constant<int, 4>{});
      case 5: return f(tag, std::integral_constant<int, 5>{});
      case 6: return f(tag, std::integral_constant<int, 6>{});
      case 7: return f(tag, std::integral_constant<int, 7>{});
      case 8: return f(tag, std::integral_constant<int, 8>{});
      case 16: return f(tag, std::integral_constant<int, 16>{});
      default: TORCH_CHECK(false, kernel, ": head size ", q.size(2), " not supported");
    }
  };
  if (q.scalar_type() == at::kBFloat16) return with_head_size(static_cast<uint16_t*>(nullptr));
  TORCH_CHECK(q.scalar_type() == at::kFloat, kernel, ": bfloat16 or float32");
  with_head_size(static_cast<float*>(nullptr));
}

}  // namespace kvloop
