// Dynamic 8-bit activations for the w8a8 linears (meshserve/layers/quant.py), one pass each:
//
// - quantize_rows_u8(x) -> (codes, scales): per row, scale = absmax / 127 and
//   codes = round(x / scale) + 128 as uint8 (oneDNN's u8 x s8 kernel takes zero point 128);
// - scale_rows_(y, scales): y[i, :] *= scales[i] in place, the row scales the product
//   still lacks (oneDNN's quantized linear takes one scale for the whole input);
// - w8a8_linear(x, packed, w_scale, w_zero): the whole multiply, x (..., k) -> (..., n):
//   quantize_rows_u8, oneDNN's u8 x s8 product (onednn::qlinear_pointwise, through the
//   dispatcher) and scale_rows_, with no Python between them (a Python custom op's call
//   costs more than a small product's arithmetic).
//
// - quantize_kv_int8(x) -> packed: the int8 KV cache's rows (meshserve/layers/kv_quant.py),
//   x (..., head_dim) -> (..., head_dim + 4) int8, each row's codes round(x / scale) with
//   scale = absmax / 127, followed by the scale's four float32 bytes.
//
// In torch ops the first is four passes over a float32 copy, which cost more than the int8
// product saves. Built with cpu_decode_attention.cpp
// by meshserve/layers/kernels/cpu_library.py.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace {

// One row's 8-bit codes round(x / scale) + kOffset, scale = absmax / 127; returns the scale.
template <typename scalar_t, typename code_t, int32_t kOffset>
inline float quantize_row(const scalar_t* row, int64_t cols, code_t* out) {
  float top = 0.f;
#pragma omp simd reduction(max : top)
  for (int64_t c = 0; c < cols; ++c) top = std::max(top, std::abs(static_cast<float>(row[c])));
  const float scale = std::max(top, std::numeric_limits<float>::min()) / 127.f;
  const float inv = 1.f / scale;
#pragma omp simd
  for (int64_t c = 0; c < cols; ++c)
    out[c] = static_cast<code_t>(static_cast<int32_t>(std::nearbyint(static_cast<float>(row[c]) * inv)) + kOffset);
  return scale;
}

template <typename scalar_t>
void quantize(const scalar_t* x, int64_t rows, int64_t cols, int64_t stride, uint8_t* codes, float* scales) {
  at::parallel_for(0, rows, meshserve_cpu::rows_per_task(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      scales[r] = quantize_row<scalar_t, uint8_t, 128>(x + r * stride, cols, codes + r * cols);
  });
}

template <typename scalar_t>
void scale(scalar_t* y, int64_t rows, int64_t cols, const float* scales) {
  at::parallel_for(0, rows, meshserve_cpu::rows_per_task(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* row = y + r * cols;
      const float by = scales[r];
      int64_t c = 0;
#if defined(__AVX512F__)
      // c10's float -> bf16 conversion has a NaN branch that keeps the compiler from
      // vectorizing a plain loop (an order of magnitude slower): cpu_vec.h's store16 rounds in vector
      if constexpr (meshserve_cpu::kHasVec16<scalar_t>) {
        const __m512 factor = _mm512_set1_ps(by);
        for (; c + 16 <= cols; c += 16)
          meshserve_cpu::store16(row + c, _mm512_mul_ps(meshserve_cpu::load16(row + c), factor));
      }
#endif
      for (; c < cols; ++c) row[c] = static_cast<scalar_t>(static_cast<float>(row[c]) * by);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_rows_u8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "quantize_rows_u8 takes (rows, cols) with contiguous rows, got ",
              x.sizes(), " strides ", x.strides());
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor codes = at::empty({rows, cols}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  if (cols == 0) return {codes, scales.fill_(1.f)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows_u8", [&] {
    quantize<scalar_t>(x.data_ptr<scalar_t>(), rows, cols, x.stride(0), codes.data_ptr<uint8_t>(),
                       scales.data_ptr<float>());
  });
  return {codes, scales};
}

at::Tensor scale_rows_(at::Tensor y, const at::Tensor& scales) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), "scale_rows_ takes a contiguous (rows, cols) tensor");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == y.size(0) && scales.is_contiguous(),
              "one float32 scale per row: ", y.size(0), " rows, ", scales.numel(), " scales");
  const int64_t rows = y.size(0), cols = y.size(1);
  if (cols == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "scale_rows_", [&] {
    scale(y.data_ptr<scalar_t>(), rows, cols, scales.data_ptr<float>());
  });
  return y;
}

template <typename scalar_t>
void quantize_kv(const scalar_t* x, int64_t rows, int64_t cols, int8_t* packed) {
  const int64_t row_bytes = cols + static_cast<int64_t>(sizeof(float));
  at::parallel_for(0, rows, meshserve_cpu::rows_per_task(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int8_t* out = packed + r * row_bytes;
      const float scale = quantize_row<scalar_t, int8_t, 0>(x + r * cols, cols, out);
      std::memcpy(out + cols, &scale, sizeof(float));
    }
  });
}

at::Tensor quantize_kv_int8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "quantize_kv_int8 takes rows (..., head_dim)");
  const at::Tensor rows = x.contiguous();
  const int64_t cols = x.size(-1), n = cols ? x.numel() / cols : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = cols + static_cast<int64_t>(sizeof(float));
  at::Tensor packed = at::empty(shape, x.options().dtype(at::kChar));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_kv_int8", [&] {
    quantize_kv<scalar_t>(rows.data_ptr<scalar_t>(), n, cols, packed.data_ptr<int8_t>());
  });
  return packed;
}

constexpr int64_t kZeroPoint = 128;

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                       const at::Tensor& w_zero) {
  const int64_t k = x.size(-1), n = w_scale.size(0);
  at::Tensor rows = x.reshape({-1, k});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  auto [codes, scales] = quantize_rows_u8(rows);
  static const c10::OperatorHandle qlinear =
      c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "");
  torch::jit::Stack stack{codes,          1.0,
                          kZeroPoint,     packed,
                          w_scale,        w_zero,
                          c10::IValue(),  1.0,
                          int64_t{0},     static_cast<int64_t>(x.scalar_type()),
                          std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::string("")};
  qlinear.callBoxed(stack);
  at::Tensor y = stack.back().toTensor();
  scale_rows_(y, scales);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MESHSERVE_NS, m) {
  m.def("quantize_rows_u8(Tensor x) -> (Tensor, Tensor)");
  m.def("scale_rows_(Tensor(a!) y, Tensor scales) -> Tensor(a!)");
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor w_scale, Tensor w_zero) -> Tensor");
  m.def("quantize_kv_int8(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(MESHSERVE_NS, CPU, m) {
  m.impl("quantize_rows_u8", &quantize_rows_u8);
  m.impl("scale_rows_", &scale_rows_);
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("quantize_kv_int8", &quantize_kv_int8);
}

// The packed weight is a oneDNN (MkldnnCPU) tensor, whose dispatch key wins over x's CPU one.
TORCH_LIBRARY_IMPL(MESHSERVE_NS, MkldnnCPU, m) { m.impl("w8a8_linear", &w8a8_linear); }
