// Shared by meshserve's CPU row kernels: how many rows a parallel task takes, and (with
// AVX-512) 16 floats at a time: loads that widen bf16 / fp16 / int8 to float32, stores that narrow
// back (bf16 rounding to nearest even), exp, and a running softmax's step; (with AVX2 + FMA)
// 8 floats at a time: the widening loads, a horizontal sum and exp. Each kernel keeps a
// scalar loop for the tail and for builds without them.
#pragma once

// The op namespace of this build (cpu_library.py passes -DMESHSERVE_NS=meshserve_cpu_<isa>),
// so that builds for different instruction sets load side by side in one process.
#ifndef MESHSERVE_NS
#define MESHSERVE_NS meshserve_cpu
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace meshserve_cpu {

// Rows per at::parallel_for task for rows of `cols` elements: at least 16384 elements a
// task, so small inputs stay on one thread.
inline int64_t rows_per_task(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, cols)); }

}  // namespace meshserve_cpu

#if defined(__AVX512F__)
#include <immintrin.h>

namespace meshserve_cpu {

template <typename scalar_t>
constexpr bool kHasVec16 = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16> ||
                           std::is_same_v<scalar_t, c10::Half>;

template <typename scalar_t>
inline __m512 load16(const scalar_t* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
template <>
inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// int8 codes widen to float32 (the KV cache's int8 rows; their scale is applied by the caller)
template <>
inline __m512 load16<int8_t>(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <typename scalar_t>
inline void store16(scalar_t* p, __m512 v);
template <>
inline void store16<float>(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
template <>
inline void store16<c10::BFloat16>(c10::BFloat16* p, __m512 v) {
  // round to nearest even: add 0x7FFF plus the lowest kept bit, keep the high half (a NaN
  // may come out as an Inf)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16)));
}
template <>
inline void store16<c10::Half>(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// v rounded to scalar_t's precision and widened back: what store16 and load16 give, in registers
template <typename scalar_t>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else if constexpr (std::is_same_v<scalar_t, c10::Half>) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    return v;
  }
}

// exp(x) = 2^n * e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its Taylor series to
// r^7 (relative error ~1e-7 over float's range; below -87 it flushes to 0).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln 2 in two parts (Cephes' split), so n * ln 2 comes off x without rounding error
  const __m512 hi = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  const __m512 rr = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), hi);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, rr, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// silu(g) * u, as silu_and_mul computes it (and the AMX product's fused epilogue, which must
// give the same numbers)
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return _mm512_mul_ps(silu, u);
}

// One block of a running softmax over 16 scores, lanes outside `mask` ignored: returns
// exp(s - max) (0 outside the mask) and sets `rescale` = exp(old max - new max), by which the
// caller scales what it accumulated; `top` (the running max) and `total` (the running sum)
// move on.
inline __m512 softmax_block(__m512 s, __mmask16 mask, float& top, float& total, float& rescale) {
  const __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(-1e30f), mask, s);  // finite: -ffast-math
  const float new_top = std::max(top, _mm512_reduce_max_ps(sv));
  const __m512 p = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(new_top))));
  rescale = std::exp(top - new_top);
  total = total * rescale + _mm512_reduce_add_ps(p);
  top = new_top;
  return p;
}

}  // namespace meshserve_cpu
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace meshserve_cpu {

template <typename scalar_t>
constexpr bool kHasVec8 = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16> ||
                          std::is_same_v<scalar_t, c10::Half> || std::is_same_v<scalar_t, int8_t>;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// int8 codes widen to float32 (the KV cache's int8 rows; their scale is applied by the caller)
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp16's method 8 lanes wide, 2^n built in the exponent bits (n within float's normal range
// after the clamp)
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 hi = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  const __m256 rr = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), hi);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, rr, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

}  // namespace meshserve_cpu
#endif
