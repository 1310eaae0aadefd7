// dense_linear(x, weight): y = x W^T for a float32 or bfloat16 weight [N, K] as stored (row
// major, no packing) and x [..., K] in float32 or bfloat16; y in x's dtype, summed in float32.
//
// For CPUs with AVX2 + FMA and no AVX-512, where oneDNN's float32 products ran SmolLM2's
// decode at ~16 GB/s of the ~25-35 GB/s a sum reads (2-core EPYC). Each output is a dot
// product of a weight row and an x row along K, 8 floats at a time; a tile of R weight rows x
// MT x rows keeps R * MT sums in registers, so each weight vector is loaded once per MT x
// rows and each x vector once per R weight rows:
//
// - one x row (batch-1 decode): 8 weight rows a tile, a pure stream over the weight;
// - 2-3 rows: 4 x 2; 4 and more: 3 x 4 (12 sums + 3 weight vectors + 1 x vector = the 16
//   registers), with the x rows taken in chunks that stay in L2 (~192 KB) while every weight
//   tile of this thread's share passes.
//
// Measured against oneDNN's packed product (2 threads, float32, SmolLM2's shapes, weights
// from memory): one row 1.4-2x faster (576 x 3072: 371 -> 261 us; the 49152-row head 5.4 ->
// 4.1 ms), 8 rows 1.3-1.9x, 32 rows 1.0-1.3x, 512 rows 1.05-1.08x. A bfloat16 weight is
// widened in registers (half the bytes read; no bf16 dot products needed).
//
// Threads split the weight's row tiles (at::parallel_for), at least ~16K weights a task.
// Builds without AVX2 (scalar) run plain loops: correct, for tests; meshserve only chooses
// this op in the avx2 build (layers/matmul.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using namespace meshserve_cpu;

constexpr int64_t kChunkBytes = 192 * 1024;

template <typename w_t>
inline float widen(w_t v) {
  return static_cast<float>(v);
}

#if defined(__AVX2__) && defined(__FMA__)

// y[m * ldy + r] = dot(x row m, w row r) for r < R, m < MT
template <int R, int MT, typename w_t>
inline void tile(const float* x, const w_t* w, int64_t K, float* y, int64_t ldy) {
  // NOTE: every loop over r and m is unrolled by pragma: left to itself GCC kept acc on the
  // stack and stored all R x MT sums every k step (a batch-1 product read its weight at ~21
  // GB/s where a sum reads ~28).
  __m256 acc[R][MT];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
  const int64_t k8 = K / 8 * 8;
  for (int64_t k = 0; k < k8; k += 8) {
    if constexpr (MT == 1) {  // each weight vector used at once: R sums + 2 registers
      const __m256 xv = _mm256_loadu_ps(x + k);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][0] = _mm256_fmadd_ps(load8(w + r * K + k), xv, acc[r][0]);
    } else {
      __m256 wv[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) wv[r] = load8(w + r * K + k);
#pragma GCC unroll 16
      for (int m = 0; m < MT; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * K + k);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 16
    for (int m = 0; m < MT; ++m) {
      float s = sum8(acc[r][m]);
      for (int64_t k = k8; k < K; ++k) s += widen(w[r * K + k]) * x[m * K + k];
      y[m * ldy + r] = s;
    }
  }
}

#else

template <int R, int MT, typename w_t>
inline void tile(const float* x, const w_t* w, int64_t K, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r) {
    for (int m = 0; m < MT; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += widen(w[r * K + k]) * x[m * K + k];
      y[m * ldy + r] = s;
    }
  }
}

#endif

// All M x rows against this task's weight rows [n0, n1), in tiles of R x MT.
template <int R, int MT, typename w_t>
void rows_range(const float* x, const w_t* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const int64_t chunk = std::max<int64_t>(MT, kChunkBytes / (4 * K) / MT * MT);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m1 = std::min(M, m0 + chunk);
    for (int64_t n = n0; n < n1;) {
      const bool full = n + R <= n1;
      int64_t m = m0;
      if (full) {
        for (; m + MT <= m1; m += MT) tile<R, MT>(x + m * K, w + n * K, K, y + m * N + n, N);
        for (; m < m1; ++m) tile<R, 1>(x + m * K, w + n * K, K, y + m * N + n, N);
        n += R;
      } else {
        for (; m + MT <= m1; m += MT) tile<1, MT>(x + m * K, w + n * K, K, y + m * N + n, N);
        for (; m < m1; ++m) tile<1, 1>(x + m * K, w + n * K, K, y + m * N + n, N);
        n += 1;
      }
    }
  }
}

template <int R, int MT, typename w_t>
void split_rows(const float* x, const w_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t tiles = (N + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, 16384 / (R * K));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    rows_range<R, MT>(x, w, y, M, N, K, t0 * R, std::min(N, t1 * R));
  });
}

template <typename w_t>
void dense(const float* x, const w_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  if (M == 1) {
    split_rows<8, 1>(x, w, y, M, N, K);
  } else if (M < 4) {
    split_rows<4, 2>(x, w, y, M, N, K);
  } else {
    split_rows<3, 4>(x, w, y, M, N, K);
  }
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "dense_linear: weight must be a contiguous [N, K] matrix");
  TORCH_CHECK(x.size(-1) == weight.size(1), "dense_linear: x has ", x.size(-1), " columns, the weight ",
              weight.size(1));
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "dense_linear: x must be float32 or bfloat16");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "dense_linear: the weight must be float32 or bfloat16");
  const int64_t K = weight.size(1), N = weight.size(0);
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, xf.options());
  if (K == 0) {
    y.zero_();
  } else if (M > 0 && N > 0) {
    if (weight.scalar_type() == at::kFloat) {
      dense(xf.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), M, N, K);
    } else {
      dense(xf.data_ptr<float>(), weight.data_ptr<c10::BFloat16>(), y.data_ptr<float>(), M, N, K);
    }
  }
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MESHSERVE_NS, m) { m.def("dense_linear(Tensor x, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(MESHSERVE_NS, CPU, m) { m.impl("dense_linear", &dense_linear); }
