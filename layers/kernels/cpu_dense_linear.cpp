// dense_linear(x, weight): y = x W^T for a float32 or bfloat16 weight W [N, K] in panel order
// (pack_panels) and x [..., K] in float32 or bfloat16; y in x's dtype, summed in float32.
// panel_rows(weight, ids): rows of a panel-ordered W, as an embedding looks them up.
//
// Written for CPUs with AVX2 + FMA and no AVX-512, where oneDNN's float32 products ran a small
// model's decode well below the bandwidth a plain sum reads; the avx512 build has its own
// tile (below), ahead of oneDNN's packed AVX-512 float32 product too
// (scripts/bench_decode_products.py times each build against both).
//
// Panel order: W's first N / 16 * 16 rows as panels of 16 rows, each panel stored k-major
// (row n, column k of panel p at p * 16 K + k * 16 + n - 16 p), then the last N % 16 rows as
// they were; same shape, same elements, no padding. A panel is one sequential stream, read
// once per tile of x rows. The tile's outputs are the outer product of 16 weight columns
// (two vectors) and MR <= 6 x values broadcast, accumulated over all of K in 2 * MR
// registers (12 + 2 weight vectors + 1 broadcast of the 16): no horizontal sums at the end,
// and 8 loads per 12 FMAs. The x rows go in chunks that stay in L2 (~256 KB) while every panel
// of this thread's share passes. One x row (batch-1 decode) is a pure stream over the weight,
// two k steps at a time (4 sums, to hide the FMA latency).
//
// It replaced row-major dot-product tiles, which need a horizontal sum per output and read x
// once per output row. A bfloat16 weight is widened in registers (half the bytes read; no bf16
// dot products needed).
//
// The avx512 build's tile is two adjacent panels (32 outputs, two vectors) by up to 12 x rows:
// 24 sums in registers, 14 loads per 24 FMAs (README's CPU tables quote it against oneDNN's
// packed float32 product and the AVX2 tile).
//
// Threads split the panels (at::parallel_for over tiles' panel groups; the panels left over
// and the last N % 16 rows are more tasks). Builds without AVX2 (scalar) run plain loops:
// correct, for tests; meshserve chooses this op in the avx2 and avx512 builds (layers/matmul.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace meshserve_cpu;

constexpr int64_t kPanel = 16;
constexpr int64_t kChunkBytes = 256 * 1024;

template <typename w_t>
inline float widen(w_t v) {
  return static_cast<float>(v);
}

#if defined(__AVX512F__)

// Two adjacent panels a tile (32 outputs, two vectors) and up to 12 x rows: 24 sums, 2 weight
// vectors and 1 broadcast of the 32 registers; 14 loads per 24 FMAs.
constexpr int kMaxTileRows = 12;
constexpr int kTilePanels = 2;

// y[m * ldy + 16 p + j] = sum_k x[m * K + k] * panel_p[k * 16 + j] for m < MR, p < NP, j < 16,
// panel p at panel + p * 16 K
template <int MR, int NP, typename w_t>
inline void panel_tile(const float* x, const w_t* panel, int64_t K, float* y, int64_t ldy) {
  __m512 acc[MR][NP];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  if constexpr (MR == 1) {  // a stream per panel: two k steps at a time in separate sums
    __m512 odd[NP];
#pragma GCC unroll 2
    for (int p = 0; p < NP; ++p) odd[p] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
      const __m512 x0 = _mm512_set1_ps(x[k]), x1 = _mm512_set1_ps(x[k + 1]);
#pragma GCC unroll 2
      for (int p = 0; p < NP; ++p) {
        const w_t* w = panel + p * kPanel * K + k * kPanel;
        acc[0][p] = _mm512_fmadd_ps(load16(w), x0, acc[0][p]);
        odd[p] = _mm512_fmadd_ps(load16(w + kPanel), x1, odd[p]);
      }
    }
    if (k < K) {
      const __m512 x0 = _mm512_set1_ps(x[k]);
#pragma GCC unroll 2
      for (int p = 0; p < NP; ++p) acc[0][p] = _mm512_fmadd_ps(load16(panel + p * kPanel * K + k * kPanel), x0, acc[0][p]);
    }
#pragma GCC unroll 2
    for (int p = 0; p < NP; ++p) acc[0][p] = _mm512_add_ps(acc[0][p], odd[p]);
  } else {
    for (int64_t k = 0; k < K; ++k) {
      __m512 w[NP];
#pragma GCC unroll 2
      for (int p = 0; p < NP; ++p) w[p] = load16(panel + p * kPanel * K + k * kPanel);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const __m512 xb = _mm512_set1_ps(x[m * K + k]);
#pragma GCC unroll 2
        for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_fmadd_ps(w[p], xb, acc[m][p]);
      }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(y + m * ldy + p * kPanel, acc[m][p]);
}

template <typename w_t>
inline float row_dot(const float* x, const w_t* w, int64_t K) {
  __m512 a = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) a = _mm512_fmadd_ps(load16(w + k), _mm512_loadu_ps(x + k), a);
  float s = _mm512_reduce_add_ps(a);
  for (; k < K; ++k) s += widen(w[k]) * x[k];
  return s;
}

#elif defined(__AVX2__) && defined(__FMA__)

constexpr int kMaxTileRows = 6;
constexpr int kTilePanels = 1;
// How many k steps ahead the tile of several rows asks for its panel's line. Its FMAs take
// longer per line than the memory delivers one, and the hardware prefetcher alone then lets
// the memory idle while they run: a few verify rows of a speculative step cost nearly a row's
// compute each on top of the stream. Asked for this far ahead (8 KB of a float32 panel, past
// the memory's latency at the tile's pace, and on into the next panel at a panel's end), the
// stream overlaps the FMAs. One row is a pure stream the prefetcher keeps up with.
constexpr int64_t kPrefetchSteps = 128;

// y[m * ldy + j] = sum_k x[m * K + k] * panel[k * 16 + j] for m < MR, j < 16
template <int MR, int NP, typename w_t>
inline void panel_tile(const float* x, const w_t* panel, int64_t K, float* y, int64_t ldy) {
  static_assert(NP == 1, "the AVX2 tile is one panel wide");
  // NOTE: every loop over m is unrolled by pragma and the sums are stored before any runtime
  // loop: otherwise GCC keeps them on the stack and stores each one every k step (a tile
  // then runs at half speed).
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  if constexpr (MR == 1) {  // a stream: two k steps at a time in separate sums
    __m256 odd0 = _mm256_setzero_ps(), odd1 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
      const __m256 x0 = _mm256_broadcast_ss(x + k), x1 = _mm256_broadcast_ss(x + k + 1);
      acc[0][0] = _mm256_fmadd_ps(load8(panel + k * kPanel), x0, acc[0][0]);
      acc[0][1] = _mm256_fmadd_ps(load8(panel + k * kPanel + 8), x0, acc[0][1]);
      odd0 = _mm256_fmadd_ps(load8(panel + k * kPanel + 16), x1, odd0);
      odd1 = _mm256_fmadd_ps(load8(panel + k * kPanel + 24), x1, odd1);
    }
    if (k < K) {
      const __m256 x0 = _mm256_broadcast_ss(x + k);
      acc[0][0] = _mm256_fmadd_ps(load8(panel + k * kPanel), x0, acc[0][0]);
      acc[0][1] = _mm256_fmadd_ps(load8(panel + k * kPanel + 8), x0, acc[0][1]);
    }
    acc[0][0] = _mm256_add_ps(acc[0][0], odd0);
    acc[0][1] = _mm256_add_ps(acc[0][1], odd1);
  } else {
    for (int64_t k = 0; k < K; ++k) {
      _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchSteps) * kPanel), _MM_HINT_T0);
      const __m256 w0 = load8(panel + k * kPanel), w1 = load8(panel + k * kPanel + 8);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * K + k);
        acc[m][0] = _mm256_fmadd_ps(w0, xb, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(w1, xb, acc[m][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(y + m * ldy, acc[m][0]);
    _mm256_storeu_ps(y + m * ldy + 8, acc[m][1]);
  }
}

template <typename w_t>
inline float row_dot(const float* x, const w_t* w, int64_t K) {
  __m256 a = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) a = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), a);
  float s = sum8(a);
  for (; k < K; ++k) s += widen(w[k]) * x[k];
  return s;
}

#else

constexpr int kMaxTileRows = 6;
constexpr int kTilePanels = 1;

template <int MR, int NP, typename w_t>
inline void panel_tile(const float* x, const w_t* panel, int64_t K, float* y, int64_t ldy) {
  for (int m = 0; m < MR; ++m) {
    for (int p = 0; p < NP; ++p) {
      const w_t* w = panel + p * kPanel * K;
      float sums[kPanel] = {};
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < kPanel; ++j) sums[j] += widen(w[k * kPanel + j]) * x[m * K + k];
      std::memcpy(y + m * ldy + p * kPanel, sums, sizeof(sums));
    }
  }
}

template <typename w_t>
inline float row_dot(const float* x, const w_t* w, int64_t K) {
  float s = 0.f;
  for (int64_t k = 0; k < K; ++k) s += widen(w[k]) * x[k];
  return s;
}

#endif

// A tile of `rows` < MR x rows (the last of a chunk).
template <int NP, int MR, typename w_t>
inline void last_tile(int64_t rows, const float* x, const w_t* panel, int64_t K, float* y, int64_t ldy) {
  if constexpr (MR > 0) {
    if (rows == MR) return panel_tile<MR, NP>(x, panel, K, y, ldy);
    last_tile<NP, MR - 1>(rows, x, panel, K, y, ldy);
  }
}

// x rows [m0, m1) against NP panels from `panel` (their outputs from column n), in tiles of
// <= kMaxTileRows rows
template <int NP, typename w_t>
void rows_by_panel(const float* x, const w_t* panel, float* y, int64_t m0, int64_t m1, int64_t N, int64_t K, int64_t n) {
  int64_t m = m0;
  for (; m + kMaxTileRows <= m1; m += kMaxTileRows)
    panel_tile<kMaxTileRows, NP>(x + m * K, panel, K, y + m * N + n, N);
  last_tile<NP, kMaxTileRows - 1>(m1 - m, x + m * K, panel, K, y + m * N + n, N);
}

// Tasks: the groups of kTilePanels panels, the panels left over, then the last N % 16 rows.
template <typename w_t>
void dense(const float* x, const w_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t panels = N / kPanel, groups = panels / kTilePanels, single = panels % kTilePanels;
  const int64_t tail = N % kPanel, tasks = groups + single + (tail > 0);
  const int64_t chunk = std::max<int64_t>(kMaxTileRows, kChunkBytes / (4 * K) / kMaxTileRows * kMaxTileRows);
  const int64_t grain = std::max<int64_t>(1, 16384 / (kTilePanels * kPanel * K));
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t m1 = std::min(M, m0 + chunk);
      for (int64_t q = t0; q < t1; ++q) {
        if (q < groups) {
          const int64_t n = q * kTilePanels * kPanel;
          rows_by_panel<kTilePanels>(x, w + n * K, y, m0, m1, N, K, n);
        } else if (q < groups + single) {
          const int64_t n = (groups * kTilePanels + q - groups) * kPanel;
          rows_by_panel<1>(x, w + n * K, y, m0, m1, N, K, n);
        } else {
          for (int64_t n = panels * kPanel; n < N; ++n)
            for (int64_t m = m0; m < m1; ++m) y[m * N + n] = row_dot(x + m * K, w + n * K, K);
        }
      }
    }
  });
}

void check_weight(const at::Tensor& weight, const char* op) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), op, ": the weight must be a contiguous [N, K] matrix");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16, op,
              ": the weight must be float32 or bfloat16");
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight) {
  check_weight(weight, "dense_linear");
  TORCH_CHECK(x.size(-1) == weight.size(1), "dense_linear: x has ", x.size(-1), " columns, the weight ",
              weight.size(1));
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "dense_linear: x must be float32 or bfloat16");
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

// Element (n, k) of W [N, K] in panel order: its offset.
inline int64_t panel_offset(int64_t n, int64_t k, int64_t N, int64_t K) {
  const int64_t full = N / kPanel * kPanel;
  if (n >= full) return n * K + k;
  return (n / kPanel) * kPanel * K + k * kPanel + n % kPanel;
}

template <typename w_t>
void permute_rows(const w_t* src, w_t* dst, int64_t N, int64_t K) {
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t k = 0; k < K; ++k) dst[panel_offset(n, k, N, K)] = src[n * K + k];
  });
}

at::Tensor pack_panels(const at::Tensor& weight) {
  check_weight(weight, "pack_panels");
  at::Tensor out = at::empty_like(weight);
  const int64_t N = weight.size(0), K = weight.size(1);
  if (weight.scalar_type() == at::kFloat) {
    permute_rows(weight.data_ptr<float>(), out.data_ptr<float>(), N, K);
  } else {
    permute_rows(weight.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), N, K);
  }
  return out;
}

template <typename w_t>
void gather_rows(const w_t* w, const int64_t* ids, w_t* out, int64_t count, int64_t N, int64_t K) {
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = ids[i];
    TORCH_CHECK(n >= 0 && n < N, "panel_rows: id ", n, " is outside the ", N, " rows");
    if (n >= N / kPanel * kPanel) {
      std::memcpy(out + i * K, w + n * K, K * sizeof(w_t));
    } else {
      const w_t* column = w + panel_offset(n, 0, N, K);
      for (int64_t k = 0; k < K; ++k) out[i * K + k] = column[k * kPanel];
    }
  }
}

at::Tensor panel_rows(const at::Tensor& weight, const at::Tensor& ids) {
  check_weight(weight, "panel_rows");
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, "panel_rows: ids must be int64 or int32");
  const at::Tensor flat = ids.to(at::kLong).contiguous();
  const int64_t N = weight.size(0), K = weight.size(1), count = flat.numel();
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(K);
  at::Tensor out = at::empty(shape, weight.options());
  if (weight.scalar_type() == at::kFloat) {
    gather_rows(weight.data_ptr<float>(), flat.data_ptr<int64_t>(), out.data_ptr<float>(), count, N, K);
  } else {
    gather_rows(weight.data_ptr<c10::BFloat16>(), flat.data_ptr<int64_t>(), out.data_ptr<c10::BFloat16>(), count, N,
                K);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MESHSERVE_NS, m) {
  m.def("dense_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_rows(Tensor weight, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(MESHSERVE_NS, CPU, m) {
  m.impl("dense_linear", &dense_linear);
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_rows", &panel_rows);
}
