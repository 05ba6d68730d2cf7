// What decode_attention.cpp and prefill_attention.cpp share: calling a kernel body templated
// on the cache's element type and the head size.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <type_traits>

namespace kvloop {

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
