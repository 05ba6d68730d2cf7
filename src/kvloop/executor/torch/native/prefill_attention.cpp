// Attention of prefill chunks over their paged KV, reading the cache blocks in place.
//
// Chunk b computes the tokens at positions [starts[b], context_lens[b]) of its sequence; its
// rows of q follow the previous chunk's. Query token i of the chunk attends the keys at
// positions <= starts[b] + i: the cached prefix, then its own chunk up to itself (the
// chunk's K/V must already be in the cache). Nothing is padded and nothing is gathered.
//
// A task is (chunk, KV head, tile of up to kTileRows / G query tokens). The G query heads of
// each token sharing that KV head are the task's query rows, and every vector holds 16 of
// them (lanes = rows), so the softmax is lane-wise: no horizontal sums or maxima. The task
// walks the keys kKeys at a time, flash-style:
//   S^T = K Q^T     each key's d-th value broadcast against 16 rows of Q^T (one FMA);
//   causal mask     only on the tiles that cross the diagonal;
//   online softmax  running max m and sum l per row, O rescaled by exp(m_old - m_new);
//   O^T += V^T P^T  each key's d-th value broadcast against 16 rows of P^T.
// K and V are read slot by slot from their blocks (each tile's rows widened to float32 once);
// tiles past the diagonal are never visited. Tasks differ in cost (causal tiles late in a
// chunk see more keys), so the threads take them largest first from a shared counter.
//
// NOTE: float32 arithmetic for float32 and bfloat16 caches alike; each output is rounded once
// to the cache's dtype. Results agree with SDPA's to float32 rounding, not to the bit.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "attention_dispatch.h"
#include "kernels.h"
#include "simd.h"
#include "team.h"

namespace {

using kvloop::V16;
using kvloop::vfmadd;
using kvloop::vloadu;
using kvloop::vset1;
using kvloop::vstoreu;
using kvloop::vzero;

constexpr int kKb = 4;  // keys (or head-dim values) per register block
#if defined(__AVX512F__)
constexpr int kLb = 2;  // 16-row vectors per register block: 8 sums, 2 rows, 1 broadcast of 32
#else
constexpr int kLb = 1;  // 16-row vectors per register block: 8 sums, 2 rows, 1 broadcast of 16
#endif
constexpr int64_t kKeys = 32;      // keys per tile (a multiple of kKb)
constexpr int64_t kRowAlign = 16 * kLb;
constexpr int64_t kTileRows = 96;  // query rows (tokens x G) per task, before alignment

struct Task {
  int64_t chunk, kv_head, first, count;  // tokens [first, first + count) of the chunk
  double cost;
};

// Per-thread scratch, sized for the largest task: transposed Q and O ([D][rows]), the tile's
// scores ([kKeys][rows]), K and V rows ([kKeys][D]), and per row m, l and position.
struct Scratch {
  std::vector<float> q, o, s, k, v, m, l, pos;
  Scratch(int64_t rows, int64_t D)
      : q(D * rows), o(D * rows), s(kKeys * rows), k(kKeys * D), v(kKeys * D), m(rows),
        l(rows), pos(rows) {}
};

// s[j][lanes] = sum_d k[j][d] q[d][lanes] for kKb keys j and kLb vectors of lanes.
template <int ND>
inline void scores(const float* k, const float* q, int64_t rows, float* s) {
  constexpr int64_t D = ND * 16;
  V16 acc[kKb][kLb];
  for (int j = 0; j < kKb; ++j)
    for (int l = 0; l < kLb; ++l) acc[j][l] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    V16 qv[kLb];
    for (int l = 0; l < kLb; ++l) qv[l] = vloadu(q + d * rows + 16 * l);
    for (int j = 0; j < kKb; ++j) {
      const V16 kk = vset1(k[j * D + d]);
      for (int l = 0; l < kLb; ++l) acc[j][l] = vfmadd(kk, qv[l], acc[j][l]);
    }
  }
  for (int j = 0; j < kKb; ++j)
    for (int l = 0; l < kLb; ++l) vstoreu(s + j * rows + 16 * l, acc[j][l]);
}

// o[d][lanes] += sum_j v[j][d] p[j][lanes] for kKb values d, kLb vectors of lanes, keys j < n.
template <int ND>
inline void accumulate(const float* v, const float* p, int64_t rows, int64_t n, float* o) {
  constexpr int64_t D = ND * 16;
  V16 acc[kKb][kLb];
  for (int d = 0; d < kKb; ++d)
    for (int l = 0; l < kLb; ++l) acc[d][l] = vloadu(o + d * rows + 16 * l);
  for (int64_t j = 0; j < n; ++j) {
    V16 pv[kLb];
    for (int l = 0; l < kLb; ++l) pv[l] = vloadu(p + j * rows + 16 * l);
    for (int d = 0; d < kKb; ++d) {
      const V16 vv = vset1(v[j * D + d]);
      for (int l = 0; l < kLb; ++l) acc[d][l] = vfmadd(vv, pv[l], acc[d][l]);
    }
  }
  for (int d = 0; d < kKb; ++d)
    for (int l = 0; l < kLb; ++l) vstoreu(o + d * rows + 16 * l, acc[d][l]);
}

inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T, int ND>
void attend(const Task& task, const T* q, int64_t q_stride, const T* k_base, const T* v_base,
            int64_t block_size, int64_t slot_stride, const int64_t* blocks, int64_t start,
            int64_t G, int64_t H, float scale, Scratch& w, T* out) {
  constexpr int64_t D = ND * 16;
  const int64_t rows = task.count * G;
  const int64_t padded = (rows + kRowAlign - 1) / kRowAlign * kRowAlign;
  const int64_t head0 = task.kv_head * G;
  // Row r is token first + r / G, query head head0 + r % G. Padding rows repeat the last row's
  // position (valid keys) with a zero query; their output is dropped.
  for (int64_t r = 0; r < padded; ++r) {
    const int64_t tok = task.first + std::min(r, rows - 1) / G;
    w.pos[r] = static_cast<float>(start + tok);
    const T* qr = q + tok * q_stride + (head0 + r % G) * D;
    for (int64_t d = 0; d < D; ++d) {
      w.q[d * padded + r] = r < rows ? widen(qr[d]) * scale : 0.0f;
      w.o[d * padded + r] = 0.0f;
    }
  }
  for (int64_t r = 0; r < padded; r += 16) {
    vstoreu(w.m.data() + r, vset1(-INFINITY));
    vstoreu(w.l.data() + r, vzero());
  }
  // NOTE: positions are exact in float32 up to 2^24 tokens (the mask compares them; the entry
  // point refuses longer contexts).
  const int64_t first_pos = start + task.first;
  const int64_t end = first_pos + task.count;  // keys [0, end) are seen by some row
  for (int64_t t0 = 0; t0 < end; t0 += kKeys) {
    const int64_t live = std::min(kKeys, end - t0);
    const int64_t blocked = (live + kKb - 1) / kKb * kKb;
    for (int64_t j = 0; j < blocked; ++j) {
      float* kj = w.k.data() + j * D;
      float* vj = w.v.data() + j * D;
      if (j < live) {
        const int64_t t = t0 + j;
        const int64_t slot = (blocks[t / block_size] * block_size + t % block_size) * slot_stride +
                             task.kv_head * D;
        for (int i = 0; i < ND; ++i) {
          vstoreu(kj + 16 * i, kvloop::load16(k_base + slot + 16 * i));
          vstoreu(vj + 16 * i, kvloop::load16(v_base + slot + 16 * i));
        }
      } else {
        for (int i = 0; i < ND; ++i) vstoreu(kj + 16 * i, vzero());
      }
    }
    for (int64_t j = 0; j < blocked; j += kKb)
      for (int64_t r = 0; r < padded; r += kRowAlign)
        scores<ND>(w.k.data() + j * D, w.q.data() + r, padded, w.s.data() + j * padded + r);
    // NOTE: every row sees key 0 (in the tile at t0 = 0), so m is finite from then on.
    const bool diagonal = t0 + live - 1 > first_pos;
    const V16 neg_inf = vset1(-INFINITY);
    for (int64_t r = 0; r < padded; r += 16) {
      const V16 pos = vloadu(w.pos.data() + r);
      const V16 m_old = vloadu(w.m.data() + r);
      V16 m_new = m_old;
      for (int64_t j = 0; j < live; ++j) {
        float* sj = w.s.data() + j * padded + r;
        V16 sv = vloadu(sj);
        if (diagonal) {
          sv = kvloop::vselect_le(vset1(static_cast<float>(t0 + j)), pos, sv, neg_inf);
          vstoreu(sj, sv);
        }
        m_new = kvloop::vmax(m_new, sv);
      }
      const V16 alpha = kvloop::exp16(kvloop::vsub(m_old, m_new));
      V16 sum = kvloop::vmul(vloadu(w.l.data() + r), alpha);
      for (int64_t d = 0; d < D; ++d) {
        float* od = w.o.data() + d * padded + r;
        vstoreu(od, kvloop::vmul(vloadu(od), alpha));
      }
      for (int64_t j = 0; j < live; ++j) {
        float* sj = w.s.data() + j * padded + r;
        V16 p = kvloop::exp16(kvloop::vsub(vloadu(sj), m_new));
        if (diagonal) p = kvloop::vselect_le(vset1(static_cast<float>(t0 + j)), pos, p, vzero());
        vstoreu(sj, p);
        sum = kvloop::vadd(sum, p);
      }
      vstoreu(w.m.data() + r, m_new);
      vstoreu(w.l.data() + r, sum);
    }
    for (int64_t d = 0; d < D; d += kKb)
      for (int64_t r = 0; r < padded; r += kRowAlign)
        accumulate<ND>(w.v.data() + d, w.s.data() + r, padded, live, w.o.data() + d * padded + r);
  }
  float row[D];
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / w.l[r];
    for (int64_t d = 0; d < D; ++d) row[d] = w.o[d * padded + r] * inv;
    T* dst = out + (task.first + r / G) * H * D + (head0 + r % G) * D;
    for (int i = 0; i < ND; ++i) kvloop::store16(dst + 16 * i, vloadu(row + 16 * i));
  }
}

template <typename T, int ND>
void run(const T* q, int64_t q_stride, const T* cache, int64_t num_blocks, int64_t block_size,
         const int64_t* table, int64_t table_stride, const int64_t* starts, const int64_t* lens,
         int64_t B, int64_t H, int64_t KV, float scale, T* out) {
  constexpr int64_t D = ND * 16;
  const int64_t G = H / KV;
  const int64_t slot_stride = KV * D;
  const T* v_base = cache + num_blocks * block_size * slot_stride;
  const int64_t tokens_per_task = std::max<int64_t>(1, kTileRows / G);
  std::vector<Task> tasks;
  std::vector<int64_t> first_row(B);
  int64_t row = 0;
  for (int64_t b = 0; b < B; ++b) {
    first_row[b] = row;
    const int64_t n = lens[b] - starts[b];
    row += n;
    for (int64_t i = 0; i < n; i += tokens_per_task) {
      const int64_t c = std::min(tokens_per_task, n - i);
      for (int64_t h = 0; h < KV; ++h)
        tasks.push_back({b, h, i, c, static_cast<double>(c) * (starts[b] + i + c)});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const int64_t max_rows = (tokens_per_task * G + kRowAlign - 1) / kRowAlign * kRowAlign;
  std::atomic<int64_t> next{0};
  const auto n_tasks = static_cast<int64_t>(tasks.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n_tasks);
  kvloop::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch w(max_rows, D);
    for (int64_t k = next++; k < n_tasks; k = next++) {
      const Task& t = tasks[k];
      attend<T, ND>(t, q + first_row[t.chunk] * q_stride, q_stride, cache, v_base, block_size,
                    slot_stride, table + t.chunk * table_stride, starts[t.chunk], G, H, scale,
                    w, out + first_row[t.chunk] * H * D);
    }
  });
}

}  // namespace

void prefill_attention(const at::Tensor& q, const at::Tensor& cache,
                       const at::Tensor& block_table, const at::Tensor& starts,
                       const at::Tensor& context_lens, double scale, at::Tensor& out) {
  kvloop::check_attention_tensors("prefill_attention", q, cache, out,
                                  {block_table, starts, context_lens});
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 2 &&
                  block_table.stride(1) == 1, "block_table");
  const int64_t B = block_table.size(0);
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts.is_contiguous() && starts.numel() == B,
              "starts");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.numel() == B, "context_lens");
  // NOTE: every slot the kernel will read must exist and every q row must belong to a chunk:
  // a bad table or length would read out of bounds.
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t bs = cache.size(2), nb = cache.size(1);
  int64_t rows = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(st[b] >= 0 && lens[b] > st[b] && lens[b] <= block_table.size(1) * bs,
                "prefill_attention: chunk [", st[b], ", ", lens[b], ") outside the block table");
    TORCH_CHECK(lens[b] <= (int64_t{1} << 24), "prefill_attention: context of ", lens[b],
                " tokens: positions past 2^24 are not exact in float32");
    rows += lens[b] - st[b];
    for (int64_t j = 0; j < (lens[b] + bs - 1) / bs; ++j) {
      const int64_t id = table[b * block_table.stride(0) + j];
      TORCH_CHECK(id >= 0 && id < nb, "prefill_attention: block id ", id, " out of range");
    }
  }
  TORCH_CHECK(rows == q.size(0), "prefill_attention: the chunks have ", rows, " tokens, q ",
              q.size(0));
  const int64_t H = q.size(1), KV = cache.size(3);
  kvloop::by_dtype_and_head_size("prefill_attention", q, [&](auto* tag, auto nd) {
    using T = std::remove_pointer_t<decltype(tag)>;
    run<T, decltype(nd)::value>(static_cast<const T*>(q.data_ptr()), q.stride(0),
                                static_cast<const T*>(cache.data_ptr()), nb, bs, table,
                                block_table.stride(0), st, lens, B, H, KV,
                                static_cast<float>(scale), static_cast<T*>(out.data_ptr()));
  });
}
