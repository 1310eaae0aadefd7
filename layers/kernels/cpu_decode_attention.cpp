// Paged decode attention on the CPU: one query token per sequence over the keys and values
// its block table lists, read in place from the cache (no gather into a padded copy, no
// mask). The query heads sharing a KV head are scored together against each cached key,
// softmaxed in float32, and weight the values.
//
// The cache holds q's dtype, or int8 (cache.dtype=int8, meshserve/layers/kv_quant.py): each
// (token, KV head) row is head_dim codes followed by the row's float32 scale in 4 bytes, so
// a row is dequantized as codes * scale. The scale of a key multiplies its score, the scale
// of a value its softmax weight.
//
// The avx512 build scores and weighs 16 lanes at a time, the avx2 build 8 (with its own
// exp): the avx2 build's plain loops, as the compiler vectorized them, read the cache well
// below the memory's bandwidth (scripts/bench_decode_attention.py).
//
// paged_tree_decode_attention also takes `skip` (one int64 per query): keys of the query's
// last 64 positions it does not attend to, bit j for the key at position len - 1 - j: a
// verify step's rows of a draft tree (engine/speculative/tree.py) see the sequence's cache
// and their own path through the tree, not the branches beside it. A block holding such a
// key takes the plain loop, which masks its scores; the other blocks are unchanged.
//
// Registered as meshserve_cpu::paged_decode_attention and ::paged_tree_decode_attention
// (meshserve/layers/kernels/cpu_library.py builds this file and registers the ops' shape
// functions for torch.compile).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_vec.h"

namespace {

#if defined(__AVX512F__)
using meshserve_cpu::load16;
using meshserve_cpu::softmax_block;
#endif

// The float32 scale stored after the `dim` codes of an int8 cache row; 1 for other dtypes.
template <typename cache_t>
inline float row_scale(const cache_t* row, int64_t dim) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    float scale;
    std::memcpy(&scale, row + dim, sizeof(float));
    return scale;
  } else {
    return 1.f;
  }
}

// Elements a cache row of `dim` values takes: the codes and their scale for int8.
template <typename cache_t>
constexpr int64_t row_length(int64_t dim) {
  return std::is_same_v<cache_t, int8_t> ? dim + static_cast<int64_t>(sizeof(float)) : dim;
}

template <typename scalar_t>
inline void load_row(const scalar_t* src, float* dst, int64_t n) {
  const float by = row_scale(src, n);
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]) * by;
}

#if defined(__AVX512F__)
template <typename scalar_t, int64_t DIM>
constexpr bool kVectorized =
    DIM > 0 && DIM % 16 == 0 && (meshserve_cpu::kHasVec16<scalar_t> || std::is_same_v<scalar_t, int8_t>);
#endif

// scores[g * stride] = query[g] . key for the `group` query heads of one KV head.
template <typename scalar_t, int64_t DIM>
inline void score_key(const float* query, const scalar_t* key, int64_t group, int64_t dim, float* row, float* scores,
                      int64_t stride) {
#if defined(__AVX512F__)
  if constexpr (kVectorized<scalar_t, DIM>) {
    __m512 k[DIM / 16];
    for (int64_t i = 0; i < DIM / 16; ++i) k[i] = load16(key + 16 * i);
    for (int64_t g = 0; g < group; ++g) {
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(query + g * DIM), k[0]);
      for (int64_t i = 1; i < DIM / 16; ++i) a = _mm512_fmadd_ps(_mm512_loadu_ps(query + g * DIM + 16 * i), k[i], a);
      scores[g * stride] = _mm512_reduce_add_ps(a) * row_scale(key, DIM);
    }
    return;
  }
#endif
  load_row(key, row, dim);
  for (int64_t g = 0; g < group; ++g) {
    float s = 0.f;
    for (int64_t d = 0; d < dim; ++d) s += query[g * dim + d] * row[d];
    scores[g * stride] = s;
  }
}

// acc[g] += weights[g * stride] * value for the `group` query heads of one KV head.
template <typename scalar_t, int64_t DIM>
inline void accumulate_value(const scalar_t* value, const float* weights, int64_t stride, int64_t group, int64_t dim,
                             float* row, float* acc) {
#if defined(__AVX512F__)
  if constexpr (kVectorized<scalar_t, DIM>) {
    __m512 v[DIM / 16];
    for (int64_t i = 0; i < DIM / 16; ++i) v[i] = load16(value + 16 * i);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 p = _mm512_set1_ps(weights[g * stride] * row_scale(value, DIM));
      for (int64_t i = 0; i < DIM / 16; ++i) {
        float* a = acc + g * DIM + 16 * i;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(p, v[i], _mm512_loadu_ps(a)));
      }
    }
    return;
  }
#endif
  load_row(value, row, dim);
  for (int64_t g = 0; g < group; ++g) {
    const float p = weights[g * stride];
    for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p * row[d];
  }
}

#if defined(__AVX512F__)
// One block of at most 16 cached tokens for the G query heads of one KV head: scores (q is
// pre-scaled), the softmax carried over (top, total), and the values weighted into acc,
// which stays in registers for the block.
template <typename scalar_t, int64_t DIM, int G>
inline void attend_block(const float* q, const scalar_t* kb, const scalar_t* vb, int64_t stride, int64_t rows,
                         float* top, float* total, float* acc) {
  constexpr int64_t NV = DIM / 16;
  alignas(64) float s[G][16];
  for (int64_t t = 0; t < rows; ++t) {
    __m512 k[NV];
    for (int64_t i = 0; i < NV; ++i) k[i] = load16(kb + t * stride + 16 * i);
    const float by = row_scale(kb + t * stride, DIM);
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q + g * DIM), k[0]);
      for (int64_t i = 1; i < NV; ++i) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * DIM + 16 * i), k[i], a);
      s[g][t] = _mm512_reduce_add_ps(a) * by;
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  float rescale[G];
  for (int g = 0; g < G; ++g)
    _mm512_store_ps(s[g], softmax_block(_mm512_maskz_loadu_ps(mask, s[g]), mask, top[g], total[g], rescale[g]));
  __m512 a[G][NV];
  for (int g = 0; g < G; ++g)
    for (int64_t i = 0; i < NV; ++i)
      a[g][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * DIM + 16 * i), _mm512_set1_ps(rescale[g]));
  for (int64_t t = 0; t < rows; ++t) {
    __m512 v[NV];
    for (int64_t i = 0; i < NV; ++i) v[i] = load16(vb + t * stride + 16 * i);
    const float by = row_scale(vb + t * stride, DIM);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(s[g][t] * by);
      for (int64_t i = 0; i < NV; ++i) a[g][i] = _mm512_fmadd_ps(p, v[i], a[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int64_t i = 0; i < NV; ++i) _mm512_storeu_ps(acc + g * DIM + 16 * i, a[g][i]);
}

// attend_block over `group` query heads, up to 4 at a time.
template <typename scalar_t, int64_t DIM>
inline void attend_block_heads(const float* q, const scalar_t* kb, const scalar_t* vb, int64_t stride, int64_t rows,
                               int64_t group, float* top, float* total, float* acc) {
  for (int64_t g = 0; g < group; g += 4) {
    const float* qg = q + g * DIM;
    float* ag = acc + g * DIM;
    switch (std::min<int64_t>(4, group - g)) {
      case 1: attend_block<scalar_t, DIM, 1>(qg, kb, vb, stride, rows, top + g, total + g, ag); break;
      case 2: attend_block<scalar_t, DIM, 2>(qg, kb, vb, stride, rows, top + g, total + g, ag); break;
      case 3: attend_block<scalar_t, DIM, 3>(qg, kb, vb, stride, rows, top + g, total + g, ag); break;
      default: attend_block<scalar_t, DIM, 4>(qg, kb, vb, stride, rows, top + g, total + g, ag); break;
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
using meshserve_cpu::exp8;
using meshserve_cpu::load8;
using meshserve_cpu::sum8;

template <typename scalar_t, int64_t DIM>
constexpr bool kVectorized8 = DIM > 0 && DIM % 8 == 0 && DIM <= 128 && meshserve_cpu::kHasVec8<scalar_t>;

// Lane j: the sum of v[j]'s 8 lanes (8 horizontal sums in 9 shuffles and adds).
inline __m256 sum8x8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // ab: v0..v3's sums of lanes 0-3, then of lanes 4-7; cd: v4..v7's
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// The AVX2 build's block of at most 16 cached tokens, one query head at a time: scores 8
// keys at a time (8 independent sums, summed across lanes together), the softmax carried
// over (top, total; exp 8 lanes at a time), and the values weighted into acc.
template <typename scalar_t, int64_t DIM>
inline void attend_block8(const float* q, const scalar_t* kb, const scalar_t* vb, int64_t stride, int64_t rows,
                          int64_t group, float* top, float* total, float* acc) {
  constexpr int64_t NV = DIM / 8;
  alignas(32) float s[16];
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * DIM;
    __m256 best = _mm256_set1_ps(top[g]);
    for (int64_t t0 = 0; t0 < rows; t0 += 8) {
      __m256 d[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) d[j] = _mm256_setzero_ps();
      // rows past the block's last score its last row again: the max is unchanged, and those
      // lanes of s are never read
      const scalar_t* key[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) key[j] = kb + std::min<int64_t>(t0 + j, rows - 1) * stride;
      for (int64_t i = 0; i < NV; ++i) {
        const __m256 qi = _mm256_loadu_ps(qg + 8 * i);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) d[j] = _mm256_fmadd_ps(qi, load8(key[j] + 8 * i), d[j]);
      }
      __m256 scores = sum8x8(d);
      if constexpr (std::is_same_v<scalar_t, int8_t>) {
        alignas(32) float by[8];
        for (int j = 0; j < 8; ++j) by[j] = row_scale(key[j], DIM);
        scores = _mm256_mul_ps(scores, _mm256_load_ps(by));
      }
      _mm256_store_ps(s + t0, scores);
      best = _mm256_max_ps(best, scores);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(best), _mm256_extractf128_ps(best, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float new_top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const __m256 shift = _mm256_set1_ps(new_top);
    for (int64_t t = 0; t < rows; t += 8) _mm256_store_ps(s + t, exp8(_mm256_sub_ps(_mm256_load_ps(s + t), shift)));
    float sum = 0.f;
    for (int64_t t = 0; t < rows; ++t) sum += s[t];
    const float rescale = std::exp(top[g] - new_top);
    total[g] = total[g] * rescale + sum;
    top[g] = new_top;
    float* ag = acc + g * DIM;
    __m256 a[NV];
    for (int64_t i = 0; i < NV; ++i) a[i] = _mm256_mul_ps(_mm256_loadu_ps(ag + 8 * i), _mm256_set1_ps(rescale));
    for (int64_t t = 0; t < rows; ++t) {
      const scalar_t* value = vb + t * stride;
      const __m256 p = _mm256_set1_ps(s[t] * row_scale(value, DIM));
      for (int64_t i = 0; i < NV; ++i) a[i] = _mm256_fmadd_ps(p, load8(value + 8 * i), a[i]);
    }
    for (int64_t i = 0; i < NV; ++i) _mm256_storeu_ps(ag + 8 * i, a[i]);
  }
}
#endif

// Asks for the lines of the first `row` elements of `rows` rows `stride` apart.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* src, int64_t rows, int64_t stride, int64_t row) {
  const int64_t bytes = row * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(src + r * stride) + b);
}

// The first `row` elements of `rows` rows `stride` apart, packed into dst.
template <typename scalar_t>
inline void copy_rows(const scalar_t* src, scalar_t* dst, int64_t rows, int64_t stride, int64_t row) {
  if (row == stride) {
    std::memcpy(dst, src, rows * row * sizeof(scalar_t));
    return;
  }
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * row, src + r * stride, row * sizeof(scalar_t));
}

template <typename scalar_t, typename cache_t, int64_t DIM>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
            const at::Tensor& seq_lens, const int64_t* skips, float scale, at::Tensor& out) {
  const int64_t n = q.size(0), heads = q.size(1), dim = DIM ? DIM : q.size(2), row = row_length<cache_t>(dim);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), group = heads / kv_heads;
  const int64_t width = block_tables.size(1), slot_stride = kv_heads * row, block_stride = block_size * slot_stride;
  const scalar_t* qs = q.data_ptr<scalar_t>();
  const cache_t* ks = k_cache.data_ptr<cache_t>();
  const cache_t* vs = v_cache.data_ptr<cache_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* os = out.data_ptr<scalar_t>();

  // A task is one sequence, or one (sequence, KV head) when there are too few sequences to
  // keep every thread busy. It walks the sequence's blocks in order, with the softmax carried
  // from block to block (running max and sum, flash-attention style). A block's K and V rows
  // of the task's heads are first copied into a local buffer: a plain copy keeps many cache
  // misses in flight, the arithmetic between the loads does not (with the cache in memory).
  // Asking for the next block's lines before working on this one gains a little more (two
  // blocks ahead, or into L2 only, no better). On AVX2 CPUs too, reading the cache in place,
  // with or without the prefetch, was faster only while the cache stayed in L3, and slower
  // from memory (scripts/bench_decode_attention.py, with and without --warm).
  const int64_t per_task = n >= 2 * at::get_num_threads() ? kv_heads : 1, splits = kv_heads / per_task;
  at::parallel_for(0, n * splits, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows_per_task = per_task * group;  // query heads of a task
    std::vector<float> query(rows_per_task * dim), acc(rows_per_task * dim), unpacked(dim),
        scores(rows_per_task * block_size), top(rows_per_task), total(rows_per_task);
    const int64_t kept = per_task * row;  // elements of a cached token's slot the task reads
    std::vector<cache_t> kbuf(block_size * kept), vbuf(block_size * kept);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / splits, first_head = task % splits * per_task, len = lens[seq];
      const uint64_t skip = skips ? static_cast<uint64_t>(skips[seq]) : 0;
      const int64_t* table = tables + seq * width;
      const int64_t blocks = (len + block_size - 1) / block_size;
      const scalar_t* q_first = qs + (seq * heads + first_head * group) * dim;
      for (int64_t r = 0; r < rows_per_task; ++r) {
        load_row(q_first + r * dim, query.data() + r * dim, dim);
        for (int64_t d = 0; d < dim; ++d) query[r * dim + d] *= scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(top.begin(), top.end(), -1e30f);  // finite: -ffast-math assumes no infinities
      std::fill(total.begin(), total.end(), 0.f);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t rows = std::min(block_size, len - b * block_size);
        const int64_t source = table[b] * block_stride + first_head * row;
        if (b + 1 < blocks) {
          const int64_t next = table[b + 1] * block_stride + first_head * row;
          prefetch_rows(ks + next, block_size, slot_stride, kept);
          prefetch_rows(vs + next, block_size, slot_stride, kept);
        }
        copy_rows(ks + source, kbuf.data(), rows, slot_stride, kept);
        copy_rows(vs + source, vbuf.data(), rows, slot_stride, kept);
        const cache_t* kb = kbuf.data();
        const cache_t* vb = vbuf.data();
        uint64_t skipped = 0;  // bit t: the block's row t is not attended
        if (skip)
          for (int64_t t = 0; t < rows; ++t) {
            const int64_t back = len - 1 - (b * block_size + t);
            if (back < 64 && (skip >> back) & 1) skipped |= uint64_t{1} << t;
          }
        for (int64_t h = 0; h < per_task; ++h) {
          const int64_t offset = h * row;
          const float* qh = query.data() + h * group * dim;
          float* ah = acc.data() + h * group * dim;
#if defined(__AVX512F__)
          if constexpr (kVectorized<cache_t, DIM>) {
            if (block_size <= 16 && !skipped) {
              attend_block_heads<cache_t, DIM>(qh, kb + offset, vb + offset, kept, rows, group,
                                                top.data() + h * group, total.data() + h * group, ah);
              continue;
            }
          }
#elif defined(__AVX2__) && defined(__FMA__)
          if constexpr (kVectorized8<cache_t, DIM>) {
            if (block_size <= 16 && !skipped) {
              attend_block8<cache_t, DIM>(qh, kb + offset, vb + offset, kept, rows, group, top.data() + h * group,
                                          total.data() + h * group, ah);
              continue;
            }
          }
#endif
          float* sh = scores.data() + h * group * block_size;
          for (int64_t t = 0; t < rows; ++t)
            score_key<cache_t, DIM>(qh, kb + offset + t * kept, group, dim, unpacked.data(), sh + t, block_size);
          for (int64_t g = 0; g < group; ++g) {
            float* sg = sh + g * block_size;
            for (int64_t t = 0; t < rows; ++t)
              if ((skipped >> t) & 1) sg[t] = -1e30f;  // finite: exp of it less the max is 0
            const int64_t r = h * group + g;
            const float new_top = std::max(top[r], *std::max_element(sg, sg + rows));
            const float rescale = std::exp(top[r] - new_top);
            float sum = 0.f;
            for (int64_t t = 0; t < rows; ++t) {
              sg[t] = std::exp(sg[t] - new_top);
              sum += sg[t];
            }
            total[r] = total[r] * rescale + sum;
            top[r] = new_top;
            for (int64_t d = 0; d < dim; ++d) ah[g * dim + d] *= rescale;
          }
          for (int64_t t = 0; t < rows; ++t)
            accumulate_value<cache_t, DIM>(vb + offset + t * kept, sh + t, block_size, group, dim,
                                           unpacked.data(), ah);
        }
      }
      scalar_t* o = os + (seq * heads + first_head * group) * dim;
      for (int64_t r = 0; r < rows_per_task; ++r) {
        const float inv = 1.f / total[r];
        for (int64_t d = 0; d < dim; ++d) o[r * dim + d] = static_cast<scalar_t>(acc[r * dim + d] * inv);
      }
    }
  });
}

template <typename scalar_t, typename cache_t>
void decode_head_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const int64_t* skips, float scale,
                     at::Tensor& out) {
  if (q.size(2) == 64)
    decode<scalar_t, cache_t, 64>(q, k_cache, v_cache, block_tables, seq_lens, skips, scale, out);
  else if (q.size(2) == 128)
    decode<scalar_t, cache_t, 128>(q, k_cache, v_cache, block_tables, seq_lens, skips, scale, out);
  else
    decode<scalar_t, cache_t, 0>(q, k_cache, v_cache, block_tables, seq_lens, skips, scale, out);
}

at::Tensor attend_paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                        const std::optional<at::Tensor>& skip) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4,
              "q (n, heads, head_dim) and a cache (blocks, block_size, kv_heads, head_dim)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "the K and V caches must be contiguous and of one shape");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK((int8 || q.scalar_type() == k_cache.scalar_type()) && k_cache.scalar_type() == v_cache.scalar_type(),
              "the cache must hold q's dtype or int8");
  TORCH_CHECK(q.size(2) + (int8 ? 4 : 0) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "the cache's rows must be q's head_dim (", q.size(2), ") long, plus 4 bytes of scale for int8 (got ",
              k_cache.size(3), "), and q's heads a multiple of the KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block tables and sequence lengths are int64");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && seq_lens.size(0) == q.size(0),
              "one block table and length per query");
  const at::Tensor query = q.contiguous(), tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  TORCH_CHECK((k_cache.size(1) & (k_cache.size(1) - 1)) == 0, "the cache's block size (", k_cache.size(1),
              ") must be a power of two");
  const int64_t width = tables.size(1), capacity = width * k_cache.size(1), num_blocks = k_cache.size(0);
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < q.size(0); ++i) {
    TORCH_CHECK(len[i] >= 1 && len[i] <= capacity, "sequence ", i, " has length ", len[i], ", its block table holds ",
                capacity);
    for (int64_t b = 0; b < (len[i] + k_cache.size(1) - 1) / k_cache.size(1); ++b)
      TORCH_CHECK(table[i * width + b] >= 0 && table[i * width + b] < num_blocks, "block id ", table[i * width + b],
                  " outside the cache's ", num_blocks, " blocks");
  }
  at::Tensor skips;
  if (skip.has_value()) {
    skips = skip->contiguous();
    TORCH_CHECK(skips.scalar_type() == at::kLong && skips.numel() == q.size(0), "skip: one int64 per query");
    const int64_t* bits = skips.data_ptr<int64_t>();
    for (int64_t i = 0; i < q.size(0); ++i)
      TORCH_CHECK((bits[i] & 1) == 0, "query ", i, " skips its own key (bit 0 of skip)");
  }
  const int64_t* skip_bits = skip.has_value() ? skips.data_ptr<int64_t>() : nullptr;
  at::Tensor out = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    if (int8)
      decode_head_dim<scalar_t, int8_t>(query, k_cache, v_cache, tables, lens, skip_bits, static_cast<float>(scale),
                                        out);
    else
      decode_head_dim<scalar_t, scalar_t>(query, k_cache, v_cache, tables, lens, skip_bits, static_cast<float>(scale),
                                          out);
  });
  return out;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  return attend_paged(q, k_cache, v_cache, block_tables, seq_lens, scale, std::nullopt);
}

at::Tensor paged_tree_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                       const at::Tensor& skip) {
  return attend_paged(q, k_cache, v_cache, block_tables, seq_lens, scale, skip);
}

}  // namespace

// Two schemas rather than one with `Tensor? skip=None`: inductor's generated C++ drops an
// argument that is None, and the dispatcher then reads past the end of its stack.
TORCH_LIBRARY(MESHSERVE_NS, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale) -> Tensor");
  m.def("paged_tree_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor skip) -> Tensor");
}

TORCH_LIBRARY_IMPL(MESHSERVE_NS, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_tree_decode_attention", &paged_tree_decode_attention);
}
