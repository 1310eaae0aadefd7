// amx_linear(x, packed, out_features): y = x W^T for bfloat16 x [..., K] and W [N, K] packed by
// amx_pack into AMX tile order, summed in float32 by the tiles; y in bfloat16.
// amx_linear_f32: the same, y the float32 sums themselves (the LM head's logits: rounded to
// bf16, near logits become equal and greedy decoding picks between ties).
// amx_linear_silu(x, packed, out_features): silu(gate) * up of the MLP for a gate/up weight
// whose rows were interleaved 16 by 16 (gate 0-15, up 0-15, gate 16-31, ...) before amx_pack:
// each block's sums are 16 gates and their 16 ups, combined as they leave the tiles. The same
// numbers as amx_linear then silu_and_mul, without writing and reading the product between.
// amx_pack(weight): W [N, K] (K a multiple of 32) in tile order, N padded with zero rows to a
// multiple of 32.
//
// Intel AMX multiplies 16 x 32 bf16 tiles into 16 x 16 float32 tiles (TDPBF16PS). A block of
// 32 outputs is two B tiles per 32 k: tile t of block b, k step k, holds output columns
// 32 b + 16 t + j for j < 16 and inputs 32 k + 2 i, 32 k + 2 i + 1 for i < 16, stored as
// [i][j][pair] (the VNNI pairs a tile row reads), so one block of the weight is one sequential
// stream of 2 KB a k step. Up to 32 x rows go through two A tiles at once: 4 float32 tiles of
// sums + 2 A + 2 B, the 8 tile registers. Threads split the blocks; each block's weights stay
// in L1/L2 while all row blocks of x pass, so prefill reads the weight once too.
//
// amx_w8a8_linear(x, packed, w_scale, w_sums, out_features): the w8a8 product (meshserve/
// layers/quant.py W8A8Matmul) on AMX's int8 tiles (TDPBUSD): x's rows quantized to uint8 codes
// around 128 with a scale each (quantize_rows_u8), times int8 weight codes packed by
// amx_pack_s8 as amx_pack packs bf16 ones, with 64 inputs (4 bytes a column) a tile row; the
// int32 sums less 128 times each column's code sum (`w_sums`, exact in int32), times the row's
// and the column's scales, in x's dtype.
//
// The tile registers are configured per row count (ldtilecfg) and released when a thread is
// done; cpu_amx.h says how AMX is asked for. Other builds register the ops and refuse the call.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "cpu_amx.h"
#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>

#define MESHSERVE_STR2(x) #x
#define MESHSERVE_STR(x) MESHSERVE_STR2(x)

namespace {

constexpr int64_t kBlockN = 32;  // outputs a block: two 16-column tiles
constexpr int64_t kStepK = 32;   // inputs a k step: one tile row of bf16
constexpr int64_t kBlockM = 32;  // x rows a pass: two 16-row tiles
constexpr int64_t kStepK8 = 64;      // int8 inputs a k step: one tile row of 64 bytes
constexpr int64_t kTileBytes = 16 * 64;
constexpr int32_t kZeroPoint = 128;  // of the uint8 codes of x
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the tile loads the weight is asked for
constexpr int64_t kChunkBytes = 512 * 1024;  // weights a chunk: kept in L2 while x's row blocks pass
constexpr int64_t kStreamBytes = 1 << 20;  // a bf16 y this large is written past the caches (stream32)

#if defined(MESHSERVE_AMX)

using namespace meshserve_cpu;

// What the tile loop and the epilogues it runs between its TDPs are compiled for: the tiles,
// and AVX512-BF16's rounding (every CPU with AMX-BF16 has it). On the lambdas too, so that the
// epilogues inline into the loop (GCC inlines only into a function compiled for as much).
#define MESHSERVE_AMX_CODE __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512bf16")))

// Asks for the `bytes` of the weight kPrefetchBytes past `w` (a later k step's tiles): the
// tile loads wait on memory in turn, the TDPs between them keep few misses in flight, and a
// block's stream runs on into the thread's next block.
inline void prefetch_ahead(const void* w, int64_t bytes) {
  const char* ahead = static_cast<const char*>(w) + kPrefetchBytes;
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
}

// tiles 0-3: sums (rows0 x 16 for A tile 4, rows1 x 16 for A tile 5), 4-5: x, 6-7: weights
__attribute__((target("amx-tile,amx-bf16"))) void configure(int rows0, int rows1) {
  TileConfig cfg;
  const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t]);
    cfg.colsb[t] = rows[t] ? 64 : 0;
  }
  load_tile_config(cfg);
}

// sums [32][32] = x rows (rows0 + rows1 of them, a row of K elements apart) times one block of
// the weight: bf16 x and weights into float32 sums (TDPBF16PS, 32 inputs a k step), or uint8
// codes of x and int8 weight codes into int32 sums (TDPBUSD, 64 inputs a k step). Both tile rows
// are 64 bytes, so the loop, the tiles and the block's stream are the same. `between(s)` runs
// after the TDPs of k step s are issued: the previous block's epilogue, a few rows a step, on
// the vector units while the tiles work.
template <typename x_t, typename w_t, typename sum_t, typename Between>
MESHSERVE_AMX_CODE void block(const x_t* x, int64_t K, const w_t* w, bool two, bool prefetch, sum_t* sums,
                              const Between& between) {
  constexpr bool kInt8 = std::is_same_v<w_t, int8_t>;
  constexpr int64_t step = kInt8 ? kStepK8 : kStepK;  // inputs a 64-byte tile row holds
  constexpr int64_t tile = kTileBytes / sizeof(w_t);  // elements of a 16 x 64-byte tile
  const int64_t ldx = K * static_cast<int64_t>(sizeof(x_t));
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0, s = 0; k < K; k += step, w += 2 * tile, ++s) {
    if (prefetch) prefetch_ahead(w, 2 * kTileBytes);
    _tile_loadd(6, w, 64);
    _tile_loadd(7, w + tile, 64);
    _tile_loadd(4, x + k, ldx);
    if constexpr (kInt8) {
      _tile_dpbusd(0, 4, 6);
      _tile_dpbusd(1, 4, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (two) {
      _tile_loadd(5, x + 16 * K + k, ldx);
      if constexpr (kInt8) {
        _tile_dpbusd(2, 5, 6);
        _tile_dpbusd(3, 5, 7);
      } else {
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    between(s);
  }
  _tile_stored(0, sums, kBlockN * sizeof(sum_t));
  _tile_stored(1, sums + 16, kBlockN * sizeof(sum_t));
  if (two) {
    _tile_stored(2, sums + 16 * kBlockN, kBlockN * sizeof(sum_t));
    _tile_stored(3, sums + 16 * kBlockN + 16, kBlockN * sizeof(sum_t));
  }
}

// 32 floats rounded to bf16 (to nearest even, as store16 rounds them, in one AVX512-BF16
// instruction: store16's integer rounding, a dozen vector ops, slows the tiles' TDPs it runs
// between), written past the caches as one 64-byte line (`out` 64-byte aligned): a prefill's
// output is megabytes that would first be read in, line by line, before each write.
MESHSERVE_AMX_CODE inline void stream32(c10::BFloat16* out, __m512 lo, __m512 hi) {
  _mm512_stream_si512(reinterpret_cast<__m512i*>(out), reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
}

// rows [r0, r1) of y's `cols` (<= 32) columns of a block, rounded to bf16; `stream`: full
// 64-byte-aligned rows go past the caches (stream32)
MESHSERVE_AMX_CODE inline __attribute__((always_inline)) void store_block(const float* sums, int r0, int r1, int64_t cols, c10::BFloat16* y, int64_t ldy,
                                    bool stream) {
  for (int m = r0; m < r1; ++m) {
    const float* s = sums + m * kBlockN;
    c10::BFloat16* out = y + m * ldy;
    if (cols == kBlockN && stream && reinterpret_cast<uintptr_t>(out) % 64 == 0) {
      stream32(out, _mm512_loadu_ps(s), _mm512_loadu_ps(s + 16));
    } else if (cols == kBlockN) {
      store16(out, _mm512_loadu_ps(s));
      store16(out + 16, _mm512_loadu_ps(s + 16));
    } else {
      for (int64_t j = 0; j < cols; ++j) out[j] = c10::BFloat16(s[j]);
    }
  }
}

// silu(gate) * up of a block packed from gate/up rows interleaved 16 by 16 (amx_linear_silu):
// rows [r0, r1) of y's 16 columns from n0, each half rounded to bf16 first, as amx_linear then
// silu_and_mul round them
MESHSERVE_AMX_CODE inline __attribute__((always_inline)) void store_silu_block(const float* sums, int r0, int r1, c10::BFloat16* y, int64_t ldy) {
  for (int m = r0; m < r1; ++m) {
    const float* s = sums + m * kBlockN;
    store16(y + m * ldy, silu_mul16(round16<c10::BFloat16>(_mm512_loadu_ps(s)),
                                    round16<c10::BFloat16>(_mm512_loadu_ps(s + 16))));
  }
}

// the same as store_block, in float32
MESHSERVE_AMX_CODE inline __attribute__((always_inline)) void store_block(const float* sums, int r0, int r1, int64_t cols, float* y, int64_t ldy, bool) {
  for (int m = r0; m < r1; ++m) std::copy(sums + m * kBlockN, sums + m * kBlockN + cols, y + m * ldy);
}

#endif

#if defined(MESHSERVE_AMX)
// visit(m0, b, sums, r0, r1) for every pair of a block of up to 32 rows of x from m0 and a block
// b of the weight, once `block` has put their sums in `sums`: rows [r0, r1) of the pair at a
// time, during the next pair's k steps (the tiles keep multiplying while the vector units
// write the previous pair out; the last pair's rows after the loop). Threads split the
// weight's blocks; a thread's blocks go in chunks of `chunk_bytes` of weights, each kept in
// L1/L2 while every row block passes, so a prefill reads the weight once. The tiles are
// configured per row count.
template <typename x_t, typename w_t, typename Visit>
void for_each_block(const x_t* x, int64_t M, int64_t K, const w_t* w, int64_t blocks, int64_t chunk_bytes,
                    const Visit& visit) {
  using sum_t = std::conditional_t<std::is_same_v<w_t, int8_t>, int32_t, float>;
  const int64_t block_elems = K * kBlockN;
  const int64_t chunk = std::max<int64_t>(1, chunk_bytes / (block_elems * static_cast<int64_t>(sizeof(w_t))));
  const int64_t steps = K * static_cast<int64_t>(sizeof(x_t)) / 64;  // k steps of a block
  const int per_step = static_cast<int>((kBlockM + steps - 1) / steps);  // rows written out a k step
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) sum_t sums[2][kBlockM * kBlockN];
    struct Pending {
      int64_t m0 = 0, b = -1;
      int rows = 0;
    } pending;  // the pair whose sums wait in sums[1 - current]
    int configured = 0, current = 0;
    for (int64_t first = begin; first < end; first += chunk) {
      const int64_t last = std::min(end, first + chunk);
      for (int64_t m0 = 0; m0 < M; m0 += kBlockM) {
        const int rows = static_cast<int>(std::min(kBlockM, M - m0));
        if (rows != configured) {
          configure(std::min(16, rows), std::max(0, rows - 16));
          configured = rows;
        }
        for (int64_t b = first; b < last; ++b) {
          const sum_t* waiting = sums[1 - current];
          const auto between = [&](int64_t step) MESHSERVE_AMX_CODE {
            const int r0 = static_cast<int>(std::min<int64_t>(pending.rows, step * per_step));
            const int r1 = std::min(pending.rows, r0 + per_step);
            if (r0 < r1) visit(pending.m0, pending.b, waiting, r0, r1);
          };
          block(x + m0 * K, K, w + b * block_elems, rows > 16, m0 == 0, sums[current], between);
          pending = {m0, b, rows};
          current = 1 - current;
        }
      }
    }
    if (pending.rows) visit(pending.m0, pending.b, static_cast<const sum_t*>(sums[1 - current]), 0, pending.rows);
    if (configured) release_tiles();
    _mm_sfence();  // the streamed stores, before the caller reads y
  });
}

// y [M, out_features] = x2 [M, K] times the packed weight's `blocks` blocks, in out_t; with
// kSilu, silu(gate) * up of each block's two halves (out_features = 16 a block).
template <typename out_t, bool kSilu = false>
void multiply(const at::Tensor& x2, const at::Tensor& packed, int64_t out_features, at::Tensor& y) {
  auto* yp = y.data_ptr<out_t>();
  constexpr int64_t outputs = kSilu ? kBlockN / 2 : kBlockN;  // of y, a block
  // (every CPU with AMX-BF16 has AVX512-BF16; asked all the same)
  static const bool bf16_rounding = __builtin_cpu_supports("avx512bf16");
  const bool stream = bf16_rounding && y.numel() * static_cast<int64_t>(sizeof(out_t)) >= kStreamBytes;
  for_each_block(x2.data_ptr<c10::BFloat16>(), x2.size(0), x2.size(1), packed.data_ptr<c10::BFloat16>(),
                 packed.size(0), kChunkBytes, [&](int64_t m0, int64_t b, const float* sums, int r0, int r1) MESHSERVE_AMX_CODE {
                   const int64_t n0 = b * outputs, cols = std::min(outputs, out_features - n0);
                   if (cols <= 0) return;
                   if constexpr (kSilu)
                     store_silu_block(sums, r0, r1, yp + m0 * out_features + n0, out_features);
                   else
                     store_block(sums, r0, r1, cols, yp + m0 * out_features + n0, out_features, stream);
                 });
}

// y [M, out_features] = ((codes [M, K] times the packed int8 weight) - 128 w_sums) x_scale
// w_scale, in scalar_t.
template <typename scalar_t>
void multiply_s8(const at::Tensor& codes, const at::Tensor& x_scale, const at::Tensor& packed,
                 const at::Tensor& w_scale, const at::Tensor& w_sums, int64_t out_features, at::Tensor& y) {
  const float* xs = x_scale.data_ptr<float>();
  const float* ws = w_scale.data_ptr<float>();
  const int32_t* sums_w = w_sums.data_ptr<int32_t>();
  auto* yp = y.data_ptr<scalar_t>();
  for_each_block(codes.data_ptr<uint8_t>(), codes.size(0), codes.size(1), packed.data_ptr<int8_t>(), packed.size(0),
                 kChunkBytes, [&](int64_t m0, int64_t b, const int32_t* sums, int r0, int r1) MESHSERVE_AMX_CODE {
    const int64_t n0 = b * kBlockN, cols = std::min(kBlockN, out_features - n0);
    if (cols <= 0) return;
    if (cols == kBlockN) {
      // the zero point's share and the weights' scales of the block's 32 columns, once
      const __m512i zero = _mm512_set1_epi32(kZeroPoint);
      const __m512i off0 = _mm512_mullo_epi32(_mm512_loadu_si512(sums_w + n0), zero);
      const __m512i off1 = _mm512_mullo_epi32(_mm512_loadu_si512(sums_w + n0 + 16), zero);
      const __m512 ws0 = _mm512_loadu_ps(ws + n0), ws1 = _mm512_loadu_ps(ws + n0 + 16);
      for (int m = r0; m < r1; ++m) {
        const int32_t* s = sums + m * kBlockN;
        scalar_t* out = yp + (m0 + m) * out_features + n0;
        const __m512 by = _mm512_set1_ps(xs[m0 + m]);
        const __m512 y0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(s), off0));
        const __m512 y1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(s + 16), off1));
        store16(out, _mm512_mul_ps(_mm512_mul_ps(y0, by), ws0));
        store16(out + 16, _mm512_mul_ps(_mm512_mul_ps(y1, by), ws1));
      }
      return;
    }
    for (int m = r0; m < r1; ++m) {
      const int32_t* s = sums + m * kBlockN;
      scalar_t* out = yp + (m0 + m) * out_features + n0;
      const float by = xs[m0 + m];
      for (int64_t j = 0; j < cols; ++j)
        out[j] = static_cast<scalar_t>(static_cast<float>(s[j] - kZeroPoint * sums_w[n0 + j]) * by * ws[n0 + j]);
    }
  });
}
#endif

enum class Epilogue { kBf16, kFloat, kSiluMul };

at::Tensor product(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, Epilogue epilogue) {
  const int64_t K = x.size(-1);
  const bool float_out = epilogue == Epilogue::kFloat;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "amx_linear: x and the packed weight must be bfloat16");
  TORCH_CHECK(K % kStepK == 0 && packed.dim() == 2 && packed.size(1) == K * kBlockN && packed.is_contiguous(),
              "amx_linear: the weight must come from amx_pack, for inputs of ", K, " features");
  TORCH_CHECK(out_features > 0 && out_features <= packed.size(0) * kBlockN, "amx_linear: ", out_features,
              " outputs for a weight of ", packed.size(0), " blocks");
  TORCH_CHECK(epilogue != Epilogue::kSiluMul || 2 * out_features == packed.size(0) * kBlockN,
              "amx_linear_silu: ", out_features, " outputs are half the ", packed.size(0) * kBlockN,
              " rows of the packed gate/up weight");
#if defined(MESHSERVE_AMX)
  TORCH_CHECK(amx_permitted(), "amx_linear: Linux refused this process AMX's tile state");
  const auto x2 = x.reshape({-1, K}).contiguous();
  auto y = at::empty({x2.size(0), out_features}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (x2.size(0) > 0) {
    if (epilogue == Epilogue::kFloat)
      multiply<float>(x2, packed, out_features, y);
    else if (epilogue == Epilogue::kSiluMul)
      multiply<c10::BFloat16, true>(x2, packed, out_features, y);
    else
      multiply<c10::BFloat16>(x2, packed, out_features, y);
  }
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  return y.view(shape);
#else
  TORCH_CHECK(false, "amx_linear runs in the avx512 build on Linux only");
#endif
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  return product(x, packed, out_features, Epilogue::kBf16);
}

at::Tensor amx_linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  return product(x, packed, out_features, Epilogue::kFloat);
}

at::Tensor amx_linear_silu(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  return product(x, packed, out_features, Epilogue::kSiluMul);
}

at::Tensor amx_w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w_scale,
                           const at::Tensor& w_sums, int64_t out_features) {
  const int64_t K = x.size(-1);
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 2 && packed.size(1) == K * kBlockN &&
                  packed.is_contiguous() && K % kStepK8 == 0,
              "amx_w8a8_linear: the weight must come from amx_pack_s8, for inputs of ", K, " features");
  TORCH_CHECK(out_features > 0 && out_features <= packed.size(0) * kBlockN, "amx_w8a8_linear: ", out_features,
              " outputs for a weight of ", packed.size(0), " blocks");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() &&
                  w_scale.numel() == packed.size(0) * kBlockN && w_sums.scalar_type() == at::kInt &&
                  w_sums.is_contiguous() && w_sums.numel() == w_scale.numel(),
              "amx_w8a8_linear: float32 scales and int32 code sums, one per packed output (", packed.size(0) * kBlockN,
              ")");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "amx_w8a8_linear: x in bfloat16 or float32");
#if defined(MESHSERVE_AMX)
  TORCH_CHECK(amx_permitted(), "amx_w8a8_linear: Linux refused this process AMX's tile state");
  static const auto quantize =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow((std::string(MESHSERVE_STR(MESHSERVE_NS)) + "::quantize_rows_u8").c_str(), "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&)>();
  at::Tensor rows = x.reshape({-1, K});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  const auto [codes, scales] = quantize.call(rows);
  auto y = at::empty({rows.size(0), out_features}, x.options());
  if (rows.size(0) > 0) {
    if (x.scalar_type() == at::kFloat)
      multiply_s8<float>(codes, scales, packed, w_scale, w_sums, out_features, y);
    else
      multiply_s8<c10::BFloat16>(codes, scales, packed, w_scale, w_sums, out_features, y);
  }
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  return y.view(shape);
#else
  TORCH_CHECK(false, "amx_w8a8_linear runs in the avx512 build on Linux only");
#endif
}

at::Tensor amx_pack_s8(const at::Tensor& codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.size(1) % kStepK8 == 0,
              "amx_pack_s8: 2-D int8 codes with a multiple of ", kStepK8, " inputs");
  const int64_t N = codes.size(0), K = codes.size(1), blocks = (N + kBlockN - 1) / kBlockN;
  auto padded = at::zeros({blocks * kBlockN, K}, codes.options());
  padded.narrow(0, 0, N).copy_(codes);
  // [block, tile, j, step, i, quad] -> [block, step, tile, i, j, quad]
  return padded.view({blocks, 2, 16, K / kStepK8, 16, 4}).permute({0, 3, 1, 4, 2, 5}).contiguous().view(
      {blocks, K * kBlockN});
}

at::Tensor amx_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) % kStepK == 0, "amx_pack: a 2-D weight with a multiple of ",
              kStepK, " inputs");
  const int64_t N = weight.size(0), K = weight.size(1), blocks = (N + kBlockN - 1) / kBlockN;
  auto padded = at::zeros({blocks * kBlockN, K}, weight.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, N).copy_(weight);
  // [block, tile, j, step, i, pair] -> [block, step, tile, i, j, pair]
  return padded.view({blocks, 2, 16, K / kStepK, 16, 2}).permute({0, 3, 1, 4, 2, 5}).contiguous().view(
      {blocks, K * kBlockN});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MESHSERVE_NS, m) {
  m.def("amx_linear(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("amx_linear_f32(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("amx_linear_silu(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("amx_pack(Tensor weight) -> Tensor");
  m.def("amx_w8a8_linear(Tensor x, Tensor packed, Tensor w_scale, Tensor w_sums, int out_features) -> Tensor");
  m.def("amx_pack_s8(Tensor codes) -> Tensor");
}

TORCH_LIBRARY_IMPL(MESHSERVE_NS, CPU, m) {
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_linear_f32", &amx_linear_f32);
  m.impl("amx_linear_silu", &amx_linear_silu);
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_w8a8_linear", &amx_w8a8_linear);
  m.impl("amx_pack_s8", &amx_pack_s8);
}
