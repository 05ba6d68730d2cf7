// Attention of decode tokens over their paged KV, reading the cache blocks in place.
//
// One query token per sequence. Each sequence (or, with fewer sequences than twice the
// threads, each (sequence, KV head)) is one task: its query heads walk the block table once
// for K (scores in float32), take a softmax, then walk it once for V. Nothing is gathered
// into a contiguous copy. Float32 arithmetic for float32 and bfloat16 caches alike; the
// output is rounded once to the cache's dtype.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "attention_dispatch.h"
#include "kernels.h"
#include "simd.h"

namespace {

using kvloop::V16;
using kvloop::vfmadd;
using kvloop::vloadu;
using kvloop::vmul;
using kvloop::vset1;
using kvloop::vzero;

constexpr int kMaxHeads = 256;  // query heads of one task

// Software prefetch of the bytes [p, p + n) into L1/L2 (a block's rows, ahead of their use).
inline void prefetch(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < n; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// One task: sequence b, KV heads [h0, h1), each head's g query heads together. Reads the
// sequence's slots for K, then for V, prefetching a block ahead (all the task's heads of it).
template <typename T, int ND>
void attend(const T* q, const T* k_base, const T* v_base, int64_t block_size, int64_t row,
            const int64_t* blocks, int64_t L, int64_t h0, int64_t h1, int64_t G, float scale,
            float* qf, float* sc, int64_t* offs, T* out) {
  constexpr int64_t D = ND * 16;
  constexpr int GC = ND <= 4 ? 4 : (ND <= 8 ? 2 : 1);  // query heads accumulated in registers
  const int64_t nh = (h1 - h0) * G;  // query heads of this task
  const int64_t ld = L + 16;          // score row stride (room for a masked tail)
  const int64_t span = (h1 - h0) * D * sizeof(T);
  for (int64_t j = 0; j < nh; ++j)
    for (int i = 0; i < ND; ++i)
      kvloop::vstoreu(qf + j * D + 16 * i, vmul(kvloop::load16(q + j * D + 16 * i), vset1(scale)));
  // NOTE: each slot's offset is computed once per task, without dividing by the runtime block
  // size per key, head and pass (those divisions cost 4-15 % of the kernel's time).
  for (int64_t t = 0, blk = 0; t < L; ++blk)
    for (int64_t r = 0; r < block_size && t < L; ++r, ++t)
      offs[t] = (blocks[blk] * block_size + r) * row + h0 * D;
  auto slot = [&](const T* base, int64_t t, int64_t h) { return base + offs[t] + h * D; };
  auto prefetch_block = [&](const T* base, int64_t t) {  // the block holding slot t
    if (t >= L) return;
    const T* first = base + blocks[t / block_size] * block_size * row + h0 * D;
    for (int64_t r = 0; r < block_size; ++r) prefetch(first + r * row, span);
  };
  for (int64_t h = 0; h < h1 - h0; ++h) {
    if (h == 0) prefetch_block(k_base, 0);
    const float* qh = qf + h * G * D;
    float* sh = sc + h * G * ld;
    int64_t t = 0;
    for (; t + 4 <= L; t += 4) {
      if (h == 0 && t % block_size < 4) prefetch_block(k_base, t + block_size);
      V16 kv[4][ND];
      for (int j = 0; j < 4; ++j) {
        const T* k = slot(k_base, t + j, h);
        for (int i = 0; i < ND; ++i) kv[j][i] = kvloop::load16(k + 16 * i);
      }
      for (int64_t g = 0; g < G; ++g) {
        V16 s[4];
        for (int j = 0; j < 4; ++j) {
          s[j] = vmul(vloadu(qh + g * D), kv[j][0]);
          for (int i = 1; i < ND; ++i) s[j] = vfmadd(vloadu(qh + g * D + 16 * i), kv[j][i], s[j]);
        }
        _mm_storeu_ps(sh + g * ld + t, kvloop::hsum4(s[0], s[1], s[2], s[3]));
      }
    }
    for (; t < L; ++t) {
      const T* k = slot(k_base, t, h);
      for (int64_t g = 0; g < G; ++g) {
        V16 s = vmul(vloadu(qh + g * D), kvloop::load16(k));
        for (int i = 1; i < ND; ++i)
          s = vfmadd(vloadu(qh + g * D + 16 * i), kvloop::load16(k + 16 * i), s);
        sh[g * ld + t] = kvloop::vreduce_add(s);
      }
    }
  }
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
    inv_sum[j] = 1.0f / kvloop::vreduce_add(sum);
  }
  for (int64_t h = 0; h < h1 - h0; ++h) {
    for (int64_t g0 = 0; g0 < G; g0 += GC) {
      const int gc = static_cast<int>(std::min<int64_t>(GC, G - g0));
      const float* p = sc + (h * G + g0) * ld;
      V16 acc[GC][ND];
      for (int j = 0; j < GC; ++j)
        for (int i = 0; i < ND; ++i) acc[j][i] = vzero();
      for (int64_t t = 0; t < L; ++t) {
        if (h == 0 && g0 == 0 && t % block_size == 0) prefetch_block(v_base, t + block_size);
        const T* v = slot(v_base, t, h);
        V16 vv[ND];
        for (int i = 0; i < ND; ++i) vv[i] = kvloop::load16(v + 16 * i);
        for (int j = 0; j < GC; ++j) {
          if (j >= gc) break;
          const V16 w = vset1(p[j * ld + t]);
          for (int i = 0; i < ND; ++i) acc[j][i] = vfmadd(w, vv[i], acc[j][i]);
        }
      }
      for (int j = 0; j < gc; ++j) {
        const int64_t head = h * G + g0 + j;
        const V16 inv = vset1(inv_sum[head]);
        for (int i = 0; i < ND; ++i) kvloop::store16(out + head * D + 16 * i, vmul(acc[j][i], inv));
      }
    }
  }
}

template <typename T, int ND>
void run(const T* q, int64_t q_stride, const T* cache, int64_t num_blocks, int64_t block_size,
         const int64_t* table, int64_t table_stride, const int64_t* lens, int64_t B, int64_t H,
         int64_t KV, float scale, T* out) {
  constexpr int64_t D = ND * 16;
  const int64_t G = H / KV;
  const int64_t row = KV * D;  // elements per cache slot
  const T* v_base = cache + num_blocks * block_size * row;
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, lens[b]);
  // NOTE: whole sequences per task when there are enough of them (each slot's heads read
  // together); one KV head per task otherwise, so that a lone sequence still uses every thread.
  const int64_t split = B >= 2 * at::get_num_threads() ? 1 : KV;
  const int64_t heads_per_task = KV / split;
  at::parallel_for(0, B * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads_per_task * G * D);
    std::vector<float> sc(heads_per_task * G * (max_len + 16));
    std::vector<int64_t> offs(max_len);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / split, h0 = (task % split) * heads_per_task;
      attend<T, ND>(q + b * q_stride + h0 * G * D, cache, v_base, block_size, row,
                    table + b * table_stride, lens[b], h0, h0 + heads_per_task, G, scale,
                    qf.data(), sc.data(), offs.data(), out + b * H * D + h0 * G * D);
    }
  });
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
