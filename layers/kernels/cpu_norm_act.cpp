// The small ops between the linears of an eager (prefill) step on the CPU, one pass each:
//
// - rms_norm(x, weight, eps[, residual]): with a residual, x + residual (rounded to x's dtype,
//   as the torch reference adds) is normed and returned too;
// - silu_and_mul(x): silu(x[:, :n]) * x[:, n:] for x of 2n columns;
// - argmax_rows(x): each float32 row's first largest index, for greedy sampling (torch's
//   argmax is many times slower than its amax over a batch of vocabulary-wide rows);
// - rotary(q, k, cos, sin): q * cos + rotate_half(q) * sin and the same for k (Hugging Face
//   Llama's half-split layout), each product and the sum rounded to the dtype as the torch
//   ops round them; q and k may be strided views of the qkv product (rows of contiguous
//   heads). In torch ops that is ~16 ops a layer (at one token, far more dispatch than
//   arithmetic).
//
// In torch ops these are 7 and 2 passes over the rows (a sizeable share of a prefill step's
// time goes to such elementwise ops). Compiled graphs keep the torch ops,
// which inductor fuses itself. Built with the other kernels by
// meshserve/layers/kernels/cpu_library.py.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>

namespace {

using namespace meshserve_cpu;

template <typename scalar_t>
inline float rounded(float value) {
  return static_cast<float>(static_cast<scalar_t>(value));
}

// One row: sum = x + residual rounded to scalar_t (when residual), out = weight * (h / rms(h))
// with h the sum (or x) and the normalized value rounded to scalar_t, as the torch reference.
template <typename scalar_t>
void norm_row(const scalar_t* x, const scalar_t* residual, const scalar_t* weight, float eps, int64_t cols,
              scalar_t* out, scalar_t* sum) {
  int64_t c = 0;
  float squares = 0.f;
  const scalar_t* h = x;
#if defined(__AVX512F__)
  if constexpr (kHasVec16<scalar_t>) {
    __m512 acc = _mm512_setzero_ps();
    for (; c + 16 <= cols; c += 16) {
      __m512 v = load16(x + c);
      if (residual != nullptr) {
        store16(sum + c, _mm512_add_ps(v, load16(residual + c)));
        v = load16(sum + c);
      }
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    squares = _mm512_reduce_add_ps(acc);
  }
#endif
  for (; c < cols; ++c) {
    float v = static_cast<float>(x[c]);
    if (residual != nullptr) {
      sum[c] = static_cast<scalar_t>(v + static_cast<float>(residual[c]));
      v = static_cast<float>(sum[c]);
    }
    squares += v * v;
  }
  if (residual != nullptr) h = sum;
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(cols) + eps);
  c = 0;
#if defined(__AVX512F__)
  if constexpr (kHasVec16<scalar_t>) {
    const __m512 scale = _mm512_set1_ps(inv);
    for (; c + 16 <= cols; c += 16) {
      store16(out + c, _mm512_mul_ps(load16(h + c), scale));  // rounded to scalar_t here,
      store16(out + c, _mm512_mul_ps(load16(weight + c), load16(out + c)));  // then weighted
    }
  }
#endif
  for (; c < cols; ++c)
    out[c] = static_cast<scalar_t>(static_cast<float>(weight[c]) * rounded<scalar_t>(static_cast<float>(h[c]) * inv));
}

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                            const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm takes contiguous (rows, hidden), got ", x.sizes());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: one weight per column (", x.size(1), ") in x's dtype");
  const bool add = residual.has_value();
  if (add)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == x.scalar_type(),
                "rms_norm: the residual must be contiguous and of x's shape and dtype");
  at::Tensor out = at::empty_like(x);
  at::Tensor sum = add ? at::empty_like(x) : at::empty({0}, x.options());
  if (x.numel() == 0) return {out, sum};
  const int64_t rows = x.size(0), cols = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    const scalar_t* rs = add ? residual->data_ptr<scalar_t>() : nullptr;
    const scalar_t* ws = weight.data_ptr<scalar_t>();
    scalar_t* os = out.data_ptr<scalar_t>();
    scalar_t* ss = add ? sum.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, rows, meshserve_cpu::rows_per_task(cols), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        norm_row<scalar_t>(xs + r * cols, rs ? rs + r * cols : nullptr, ws, static_cast<float>(eps), cols,
                           os + r * cols, ss ? ss + r * cols : nullptr);
    });
  });
  return {out, sum};
}

template <typename scalar_t>
void silu_mul_row(const scalar_t* gate, const scalar_t* up, int64_t half, scalar_t* out) {
  int64_t c = 0;
#if defined(__AVX512F__)
  if constexpr (kHasVec16<scalar_t>) {
    for (; c + 16 <= half; c += 16) store16(out + c, silu_mul16(load16(gate + c), load16(up + c)));
  }
#endif
  for (; c < half; ++c) {
    // NOTE: exp's argument capped below float's overflow: under -ffast-math the division by
    // 1 + inf may come out as inf * 0 = NaN (it did, at g = -90, in the AVX2 build).
    const float g = static_cast<float>(gate[c]);
    out[c] = static_cast<scalar_t>(g / (1.f + std::exp(std::min(-g, 88.f))) * static_cast<float>(up[c]));
  }
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul takes contiguous (rows, 2n), got ", x.sizes());
  const int64_t half = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), half}, x.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    scalar_t* os = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), meshserve_cpu::rows_per_task(half), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) silu_mul_row<scalar_t>(xs + 2 * r * half, xs + (2 * r + 1) * half, half,
                                                                   os + r * half);
    });
  });
  return out;
}

int64_t argmax_row(const float* x, int64_t n) {
  int64_t c = 0, best_index = 0;
  float best = x[0];
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 top = _mm512_loadu_ps(x);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), at = index;
    for (c = 16; c + 16 <= n; c += 16) {
      index = _mm512_add_epi32(index, step);
      const __m512 v = _mm512_loadu_ps(x + c);
      const __mmask16 larger = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);  // strictly: a lane keeps its first
      top = _mm512_mask_mov_ps(top, larger, v);
      at = _mm512_mask_mov_epi32(at, larger, index);
    }
    best = _mm512_reduce_max_ps(top);
    best_index = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(top, _mm512_set1_ps(best), _CMP_EQ_OQ), at);
  }
#endif
  for (; c < n; ++c)
    if (x[c] > best) {
      best = x[c];
      best_index = c;
    }
  return best_index;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "argmax_rows takes contiguous float32 (rows, n > 0), got ", x.sizes(), " ", x.scalar_type());
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* xs = x.data_ptr<float>();
  int64_t* os = out.data_ptr<int64_t>();
  const int64_t n = x.size(1);
  at::parallel_for(0, x.size(0), meshserve_cpu::rows_per_task(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) os[r] = argmax_row(xs + r * n, n);
  });
  return out;
}

template <typename scalar_t>
void rotate_head(const scalar_t* x, const scalar_t* cos, const scalar_t* sin, int64_t half, scalar_t* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (kHasVec16<scalar_t>) {
    for (; i + 16 <= half; i += 16) {
      const __m512 lo = load16(x + i), hi = load16(x + i + half);
      const __m512 lo_cos = round16<scalar_t>(_mm512_mul_ps(lo, load16(cos + i)));
      const __m512 hi_sin = round16<scalar_t>(_mm512_mul_ps(hi, load16(sin + i)));
      const __m512 hi_cos = round16<scalar_t>(_mm512_mul_ps(hi, load16(cos + i + half)));
      const __m512 lo_sin = round16<scalar_t>(_mm512_mul_ps(lo, load16(sin + i + half)));
      store16(out + i, _mm512_sub_ps(lo_cos, hi_sin));
      store16(out + i + half, _mm512_add_ps(hi_cos, lo_sin));
    }
  }
#endif
  for (; i < half; ++i) {
    const float lo = static_cast<float>(x[i]), hi = static_cast<float>(x[i + half]);
    out[i] = static_cast<scalar_t>(rounded<scalar_t>(lo * static_cast<float>(cos[i])) +
                                   rounded<scalar_t>(-hi * static_cast<float>(sin[i])));
    out[i + half] = static_cast<scalar_t>(rounded<scalar_t>(hi * static_cast<float>(cos[i + half])) +
                                          rounded<scalar_t>(lo * static_cast<float>(sin[i + half])));
  }
}

// x (tokens, heads, dim) with contiguous heads, cos/sin (tokens, [1,] dim) contiguous -> a
// contiguous rotated copy
template <typename scalar_t>
void rotate_all(const at::Tensor& x, const scalar_t* cos, const scalar_t* sin, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  const scalar_t* xs = x.data_ptr<scalar_t>();
  scalar_t* os = out.data_ptr<scalar_t>();
  at::parallel_for(0, tokens * heads, meshserve_cpu::rows_per_task(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / heads, h = r % heads;
      rotate_head<scalar_t>(xs + t * token_stride + h * head_stride, cos + t * dim, sin + t * dim, dim / 2,
                            os + r * dim);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.size(2) == k.size(2) &&
                  q.size(2) % 2 == 0 && q.size(0) == k.size(0),
              "rotary takes q and k of (tokens, heads, even head_dim) with contiguous heads, got ", q.sizes(), " and ",
              k.sizes());
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == q.size(0) * q.size(2) &&
                  sin.sizes() == cos.sizes() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type() && k.scalar_type() == q.scalar_type(),
              "rotary: cos and sin must be contiguous (tokens, [1,] head_dim) in q's dtype");
  at::Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    rotate_all<scalar_t>(q, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), q_out);
    rotate_all<scalar_t>(k, cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), k_out);
  });
  return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MESHSERVE_NS, m) {
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(MESHSERVE_NS, CPU, m) {
  m.impl("rotary", &rotary);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
}
