// Causal prefill attention on the CPU for chunks with no cached prefix (a prompt's first
// chunk): each chunk's queries attend to its own keys and values, in the flat batch of a
// step, read in place. torch's flash kernel ran far below the CPU's peak on many short
// prompts of a small model's heads (9 heads, 3 KV heads, head_dim 64: README's CPU section).
//
// A task is (chunk, KV head, tile of 16 query tokens). It widens the keys and values its
// tile can see to float32 once (keys transposed, 16 to a tile), then for each query head
// of the KV head computes 16 x 16 score tiles as 16 rows of FMAs, softmaxes them with the
// running max and sum carried from tile to tile, and weights the values 4 rows at a time.
//
// Registered as meshserve_cpu::prefill_attention (built by cpu_library.py).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_prefill_chunks.h"
#include "cpu_vec.h"

namespace {

constexpr int64_t kTile = 16;

struct Rows {
  int64_t token, head;  // strides of (tokens, heads, head_dim) with contiguous head_dim
};

#if defined(__AVX512F__)
using meshserve_cpu::load16;
using meshserve_cpu::softmax_block;
using meshserve_cpu::store16;

// One task, NV = head_dim / 16. q rows are pre-scaled into `query` (group x 16 x D).
template <typename scalar_t, int NV>
void attend_tile(const scalar_t* q, const scalar_t* k, const scalar_t* v, scalar_t* out, Rows qs, Rows ks, Rows vs,
                 Rows os, int64_t group, int64_t first, int64_t rows, float scale, std::vector<float>& kt_buf,
                 std::vector<float>& v_buf) {
  constexpr int64_t D = NV * 16;
  const int64_t keys = first + rows, key_tiles = (keys + kTile - 1) / kTile;
  kt_buf.resize(key_tiles * D * kTile);
  v_buf.resize(key_tiles * kTile * D);
  // keys transposed per tile: kt[tile][d][16]; values v[key][d]; past `keys`: zeros
  for (int64_t j = 0; j < key_tiles * kTile; ++j) {
    float* kt = kt_buf.data() + (j / kTile) * D * kTile + j % kTile;
    float* vr = v_buf.data() + j * D;
    if (j < keys) {
      alignas(64) float row[D];
      for (int i = 0; i < NV; ++i) _mm512_store_ps(row + 16 * i, load16(k + j * ks.token + 16 * i));
      for (int64_t d = 0; d < D; ++d) kt[d * kTile] = row[d];
      for (int i = 0; i < NV; ++i) _mm512_storeu_ps(vr + 16 * i, load16(v + j * vs.token + 16 * i));
    } else {
      for (int64_t d = 0; d < D; ++d) kt[d * kTile] = 0.f;
      for (int64_t d = 0; d < D; ++d) vr[d] = 0.f;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    alignas(64) float query[kTile][D];
    alignas(64) float acc[kTile][D];
    alignas(64) float p[kTile][kTile];
    float top[kTile], total[kTile];
    for (int64_t r = 0; r < kTile; ++r) {
      const int64_t t = first + std::min(r, rows - 1);  // rows past the chunk repeat its last query
      for (int i = 0; i < NV; ++i)
        _mm512_store_ps(query[r] + 16 * i,
                        _mm512_mul_ps(load16(q + t * qs.token + g * qs.head + 16 * i), _mm512_set1_ps(scale)));
      for (int i = 0; i < NV; ++i) _mm512_store_ps(acc[r] + 16 * i, _mm512_setzero_ps());
      top[r] = -1e30f;  // finite: -ffast-math assumes no infinities
      total[r] = 0.f;
    }
    const int64_t last_tile = (first + rows - 1) / kTile;
    for (int64_t tile = 0; tile <= last_tile; ++tile) {
      const float* kt = kt_buf.data() + tile * D * kTile;
      __m512 s[kTile];
      for (int r = 0; r < kTile; ++r) s[r] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const __m512 kd = _mm512_loadu_ps(kt + d * kTile);
        for (int r = 0; r < kTile; ++r) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(query[r][d]), kd, s[r]);
      }
      float rescale[kTile];
      for (int r = 0; r < kTile; ++r) {
        // query token first + r sees keys up to itself: tile * 16 + c <= first + r
        const int64_t visible = std::min<int64_t>(kTile, first + r - tile * kTile + 1);
        const __mmask16 mask = visible <= 0 ? 0 : static_cast<__mmask16>((1u << visible) - 1);
        _mm512_store_ps(p[r], softmax_block(s[r], mask, top[r], total[r], rescale[r]));
      }
      const float* vt = v_buf.data() + tile * kTile * D;
      for (int r0 = 0; r0 < kTile; r0 += 4) {
        __m512 a[4][NV];
        for (int r = 0; r < 4; ++r)
          for (int i = 0; i < NV; ++i)
            a[r][i] = _mm512_mul_ps(_mm512_load_ps(acc[r0 + r] + 16 * i), _mm512_set1_ps(rescale[r0 + r]));
        for (int64_t c = 0; c < kTile; ++c) {
          __m512 vc[NV];
          for (int i = 0; i < NV; ++i) vc[i] = _mm512_loadu_ps(vt + c * D + 16 * i);
          for (int r = 0; r < 4; ++r) {
            const __m512 w = _mm512_set1_ps(p[r0 + r][c]);
            for (int i = 0; i < NV; ++i) a[r][i] = _mm512_fmadd_ps(w, vc[i], a[r][i]);
          }
        }
        for (int r = 0; r < 4; ++r)
          for (int i = 0; i < NV; ++i) _mm512_store_ps(acc[r0 + r] + 16 * i, a[r][i]);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / total[r]);
      for (int i = 0; i < NV; ++i)
        store16(out + (first + r) * os.token + g * os.head + 16 * i, _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * i), inv));
    }
  }
}
#endif

// Without AVX-512, or for other head sizes: the same causal softmax, one query at a time.
template <typename scalar_t>
void attend_rows(const scalar_t* q, const scalar_t* k, const scalar_t* v, scalar_t* out, Rows qs, Rows ks, Rows vs,
                 Rows os, int64_t group, int64_t dim, int64_t first, int64_t rows, float scale) {
  std::vector<float> scores(first + rows), acc(dim);
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t t = first; t < first + rows; ++t) {
      float top = -1e30f;
      for (int64_t j = 0; j <= t; ++j) {
        float s = 0.f;
        for (int64_t d = 0; d < dim; ++d)
          s += static_cast<float>(q[t * qs.token + g * qs.head + d]) * static_cast<float>(k[j * ks.token + d]);
        scores[j] = s * scale;
        top = std::max(top, scores[j]);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float total = 0.f;
      for (int64_t j = 0; j <= t; ++j) {
        const float w = std::exp(scores[j] - top);
        total += w;
        for (int64_t d = 0; d < dim; ++d) acc[d] += w * static_cast<float>(v[j * vs.token + d]);
      }
      for (int64_t d = 0; d < dim; ++d) out[t * os.token + g * os.head + d] = static_cast<scalar_t>(acc[d] / total);
    }
  }
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& chunks,
                             double scale) {
  const at::Tensor spans = meshserve_cpu::checked_prefill_chunks(q, k, v, chunks);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v share a dtype");
  const int64_t* span = spans.data_ptr<int64_t>();
  const int64_t n = spans.size(0), tokens = q.size(0), heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
  const int64_t group = heads / kv_heads;
  std::vector<int64_t> task_chunk, task_first;  // one task per (chunk, 16-query tile); KV heads below
  for (int64_t c = 0; c < n; ++c) {
    for (int64_t first = 0; first < span[2 * c + 1]; first += kTile) {
      task_chunk.push_back(c);
      task_first.push_back(first);
    }
  }
  at::Tensor out = at::empty({tokens, heads, dim}, q.options());
  const Rows qs{q.stride(0), q.stride(1)}, ks{k.stride(0), k.stride(1)}, vs{v.stride(0), v.stride(1)};
  const Rows os{out.stride(0), out.stride(1)};
  const int64_t tasks = static_cast<int64_t>(task_chunk.size()) * kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> kt_buf, v_buf;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t t = task / kv_heads, h = task % kv_heads, c = task_chunk[t];
        const int64_t start = span[2 * c], first = task_first[t], rows = std::min(kTile, span[2 * c + 1] - first);
        const scalar_t* qc = qp + start * qs.token + h * group * qs.head;
        const scalar_t* kc = kp + start * ks.token + h * ks.head;
        const scalar_t* vc = vp + start * vs.token + h * vs.head;
        scalar_t* oc = op + start * os.token + h * group * os.head;
#if defined(__AVX512F__)
        if constexpr (meshserve_cpu::kHasVec16<scalar_t>) {
          if (dim == 64) {
            attend_tile<scalar_t, 4>(qc, kc, vc, oc, qs, ks, vs, os, group, first, rows, static_cast<float>(scale),
                                     kt_buf, v_buf);
            continue;
          }
          if (dim == 128) {
            attend_tile<scalar_t, 8>(qc, kc, vc, oc, qs, ks, vs, os, group, first, rows, static_cast<float>(scale),
                                     kt_buf, v_buf);
            continue;
          }
        }
#endif
        attend_rows<scalar_t>(qc, kc, vc, oc, qs, ks, vs, os, group, dim, first, rows, static_cast<float>(scale));
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MESHSERVE_NS, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor chunks, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(MESHSERVE_NS, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
