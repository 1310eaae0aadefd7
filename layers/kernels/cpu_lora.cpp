// lora_add(y, x, slots, a, b): the LoRA products of a batch whose rows use different adapters
// (Punica's BGMV), added to y in place:
//
//   y[t] += (x[t] a[s]^T) b[s]^T,   s = slots[t]   (s < 0: no adapter, row t not touched)
//
// with y (rows, out) and x (rows, in) contiguous float32 or bfloat16, slots (rows,) int64 or
// int32, a (slots, r, in) and b (slots, out, r) stacked adapter weights in x's dtype (the
// scaling folded into b); summed in float32, y rounded once. meshserve.layers.lora_product is
// the torch reference (one shrink-expand pair of products per adapter in use).
//
// The rows are grouped by slot first (a counting sort), so that each adapter's weights pass
// once per group, not once per row: a decode batch's rows share a few adapters, and their
// weights (r x (in + out) each) outgrow the caches long before the rows do. Then two passes,
// each an at::parallel_for over (group, piece of the weight), so that a batch of one row
// still spreads over the threads:
//
// - shrink, over (group, j < r): h[t][j] = x[t] . a[s][j], a dot product along `in` for up to
//   four of the group's rows at once (one load of a per four rows);
// - expand, over (group, block of outputs): y[t][o] += h[t] . b[s][o] for eight outputs at a
//   time, b's eight rows (r long each) reduced together into one vector of sums.
//
// h is float32 (rows x r, small): the shrunk product is not rounded to the dtype between the
// two products, where the torch reference's bf16 matmuls round it.
//
// NOTE: the avx512 build runs the same 8-wide AVX2 loops (-mavx512f implies AVX2): both
// passes are short dot products (r is a few vectors), and one vector path is what every AVX2
// machine's tests check. The scalar build runs plain loops.
//
// Built with the other kernels by meshserve/layers/kernels/cpu_library.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using namespace meshserve_cpu;

constexpr int kShrinkRows = 4;
constexpr int64_t kExpandBlock = 64;  // outputs per expand task: eight groups of eight

// The rows that use one adapter, as positions [begin, end) of the sorted row order.
struct Group {
  int64_t slot, begin, end;
};

#if defined(__AVX2__) && defined(__FMA__)
// v[i]'s eight lanes summed, for i < 8, as one vector
inline __m256 sum8x8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 holds v[0..3]'s sums of lanes 0-3 in its low half and of lanes 4-7 in its high half
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// h[i * h_stride] = x[i] . w over `in` for R rows x[i]
template <typename scalar_t, int R>
inline void shrink_rows(const scalar_t* w, const scalar_t* const* x, int64_t in, float* h, int64_t h_stride) {
  float sums[R] = {};
  int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
  // two sums per row, to hide the FMA latency when R is 1
  __m256 even[R], odd[R];
  for (int i = 0; i < R; ++i) even[i] = odd[i] = _mm256_setzero_ps();
  for (; k + 16 <= in; k += 16) {
    const __m256 w0 = load8(w + k), w1 = load8(w + k + 8);
    for (int i = 0; i < R; ++i) {
      even[i] = _mm256_fmadd_ps(load8(x[i] + k), w0, even[i]);
      odd[i] = _mm256_fmadd_ps(load8(x[i] + k + 8), w1, odd[i]);
    }
  }
  for (; k + 8 <= in; k += 8) {
    const __m256 w0 = load8(w + k);
    for (int i = 0; i < R; ++i) even[i] = _mm256_fmadd_ps(load8(x[i] + k), w0, even[i]);
  }
  for (int i = 0; i < R; ++i) sums[i] = sum8(_mm256_add_ps(even[i], odd[i]));
#endif
  for (; k < in; ++k) {
    const float wk = static_cast<float>(w[k]);
    for (int i = 0; i < R; ++i) sums[i] += static_cast<float>(x[i][k]) * wk;
  }
  for (int i = 0; i < R; ++i) h[i * h_stride] = sums[i];
}

template <typename scalar_t>
inline float dot(const float* h, const scalar_t* b, int64_t r) {
  float s = 0.f;
  for (int64_t j = 0; j < r; ++j) s += h[j] * static_cast<float>(b[j]);
  return s;
}

// sums[i] = h . b[i] for b's eight rows of r
template <typename scalar_t>
inline void expand8(const float* h, const scalar_t* b, int64_t r, float* sums) {
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (; j + 8 <= r; j += 8) {
    const __m256 hv = _mm256_loadu_ps(h + j);
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(load8(b + i * r + j), hv, acc[i]);
  }
  _mm256_storeu_ps(sums, sum8x8(acc));
#else
  for (int i = 0; i < 8; ++i) sums[i] = 0.f;
#endif
  if (j < r)
    for (int i = 0; i < 8; ++i) sums[i] += dot(h + j, b + i * r + j, r - j);
}

template <typename scalar_t>
void lora_rows(scalar_t* y, const scalar_t* x, const scalar_t* a, const scalar_t* b, const std::vector<Group>& groups,
               const std::vector<int64_t>& order, int64_t in, int64_t out, int64_t r) {
  const int64_t num_groups = static_cast<int64_t>(groups.size());
  const int64_t rows = static_cast<int64_t>(order.size());
  const int64_t rows_per_group = (rows + num_groups - 1) / num_groups;
  std::vector<float> shrunk(rows * r);  // (position in `order`, r)
  float* h = shrunk.data();

  at::parallel_for(0, num_groups * r, rows_per_task(in * rows_per_group), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Group& g = groups[item / r];
      const int64_t j = item % r;
      const scalar_t* w = a + (g.slot * r + j) * in;
      const scalar_t* xs[kShrinkRows];
      int64_t p = g.begin;
      for (; p + kShrinkRows <= g.end; p += kShrinkRows) {
        for (int i = 0; i < kShrinkRows; ++i) xs[i] = x + order[p + i] * in;
        shrink_rows<scalar_t, kShrinkRows>(w, xs, in, h + p * r + j, r);
      }
      for (; p < g.end; ++p) {
        xs[0] = x + order[p] * in;
        shrink_rows<scalar_t, 1>(w, xs, in, h + p * r + j, r);
      }
    }
  });

  const int64_t blocks = (out + kExpandBlock - 1) / kExpandBlock;
  at::parallel_for(0, num_groups * blocks, rows_per_task(kExpandBlock * r * rows_per_group),
                   [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Group& g = groups[item / blocks];
      const int64_t o_begin = (item % blocks) * kExpandBlock, o_end = std::min(out, o_begin + kExpandBlock);
      const scalar_t* bs = b + g.slot * out * r;
      int64_t o = o_begin;
      for (; o + 8 <= o_end; o += 8) {
        for (int64_t p = g.begin; p < g.end; ++p) {
          float sums[8];
          expand8(h + p * r, bs + o * r, r, sums);
          scalar_t* yt = y + order[p] * out + o;
          for (int i = 0; i < 8; ++i) yt[i] = static_cast<scalar_t>(static_cast<float>(yt[i]) + sums[i]);
        }
      }
      for (; o < o_end; ++o)
        for (int64_t p = g.begin; p < g.end; ++p) {
          scalar_t& yo = y[order[p] * out + o];
          yo = static_cast<scalar_t>(static_cast<float>(yo) + dot(h + p * r, bs + o * r, r));
        }
    }
  });
}

void lora_add(at::Tensor y, const at::Tensor& x, const at::Tensor& slots, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0) && y.is_contiguous() && x.is_contiguous(),
              "lora_add takes contiguous y (rows, out) and x (rows, in), got ", y.sizes(), " and ", x.sizes());
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  y.scalar_type() == x.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  b.scalar_type() == x.scalar_type(),
              "lora_add: y, x, a and b must all be float32 or all bfloat16, got ", y.scalar_type(), ", ",
              x.scalar_type(), ", ", a.scalar_type(), ", ", b.scalar_type());
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.is_contiguous() && b.is_contiguous() && b.size(0) == a.size(0) &&
                  a.size(2) == x.size(1) && b.size(1) == y.size(1) && b.size(2) == a.size(1),
              "lora_add: a must be contiguous (slots, r, in=", x.size(1), ") and b (slots, out=", y.size(1),
              ", r), got ", a.sizes(), " and ", b.sizes());
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0) &&
                  (slots.scalar_type() == at::kLong || slots.scalar_type() == at::kInt),
              "lora_add: one int64 or int32 slot per row (", x.size(0), "), got ", slots.sizes(), " ",
              slots.scalar_type());
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1), num_slots = a.size(0), r = a.size(1);
  const at::Tensor ids = slots.to(at::kLong).contiguous();
  const int64_t* s = ids.data_ptr<int64_t>();

  std::vector<int64_t> start(num_slots + 1, 0);
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(s[t] < num_slots, "lora_add: row ", t, " uses slot ", s[t], " of ", num_slots);
    if (s[t] >= 0) ++start[s[t] + 1];
  }
  std::vector<Group> groups;
  for (int64_t slot = 0; slot < num_slots; ++slot) {
    if (start[slot + 1] > 0) groups.push_back({slot, start[slot], start[slot] + start[slot + 1]});
    start[slot + 1] += start[slot];
  }
  if (groups.empty() || r == 0 || out == 0) return;
  std::vector<int64_t> order(start[num_slots]), next(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < rows; ++t)
    if (s[t] >= 0) order[next[s[t]]++] = t;

  if (x.scalar_type() == at::kFloat) {
    lora_rows(y.data_ptr<float>(), x.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), groups, order, in,
              out, r);
  } else {
    lora_rows(y.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), a.data_ptr<c10::BFloat16>(),
              b.data_ptr<c10::BFloat16>(), groups, order, in, out, r);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MESHSERVE_NS, m) { m.def("lora_add(Tensor(a!) y, Tensor x, Tensor slots, Tensor a, Tensor b) -> ()"); }

TORCH_LIBRARY_IMPL(MESHSERVE_NS, CPU, m) { m.impl("lora_add", &lora_add); }
