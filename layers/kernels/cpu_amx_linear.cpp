// amx_linear(x, packed, out_features): y = x W^T for bfloat16 x [..., K] and W [N, K] packed by
// amx_pack into AMX tile order, summed in float32 by the tiles; y in bfloat16.
// amx_linear_f32: the same, y the float32 sums themselves (the LM head's logits: rounded to
// bf16, near logits become equal and greedy decoding picks between ties).
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
// The tile registers are configured per row count (ldtilecfg) and released when a thread is
// done (the next user, oneDNN's kernels included, configures its own). Linux hands AMX's
// state to a process only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM), done here once.
// The functions that use AMX are compiled for it by attribute: the rest of the avx512 build
// stays runnable on AVX-512 CPUs without AMX, and meshserve calls this op only where the CPU
// has AMX-BF16 (layers/matmul_plan.py). Other builds register the op and refuse the call.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define MESHSERVE_AMX 1
#endif

namespace {

constexpr int64_t kBlockN = 32;  // outputs a block: two 16-column tiles
constexpr int64_t kStepK = 32;   // inputs a k step: one tile row of bf16
constexpr int64_t kBlockM = 32;  // x rows a pass: two 16-row tiles
constexpr int64_t kTileElems = 16 * 32;
constexpr int64_t kChunkBytes = 512 * 1024;  // weights a chunk: kept in L2 while x's row blocks pass

#if defined(MESHSERVE_AMX)

using namespace meshserve_cpu;

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  return ok;
}

// tiles 0-3: sums (rows0 x 16 for A tile 4, rows1 x 16 for A tile 5), 4-5: x, 6-7: weights
__attribute__((target("amx-tile,amx-bf16"))) void configure(int rows0, int rows1) {
  TileConfig cfg;
  const int rows[8] = {rows0, rows0, rows1, rows1, rows0, rows1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t]);
    cfg.colsb[t] = rows[t] ? 64 : 0;
  }
  // NOTE: ldtilecfg reads the struct from memory; without the barrier GCC drops the stores
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// sums [32][32] = x rows (rows0 + rows1 of them, ldx apart) times one block of the weight
__attribute__((target("amx-tile,amx-bf16"))) void block(const c10::BFloat16* x, int64_t K, const c10::BFloat16* w,
                                                           bool two, float* sums) {
  const int64_t ldx = K * static_cast<int64_t>(sizeof(c10::BFloat16));
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += kStepK, w += 2 * kTileElems) {
    _tile_loadd(6, w, 64);
    _tile_loadd(7, w + kTileElems, 64);
    _tile_loadd(4, x + k, ldx);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, x + 16 * K + k, ldx);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, kBlockN * sizeof(float));
  _tile_stored(1, sums + 16, kBlockN * sizeof(float));
  if (two) {
    _tile_stored(2, sums + 16 * kBlockN, kBlockN * sizeof(float));
    _tile_stored(3, sums + 16 * kBlockN + 16, kBlockN * sizeof(float));
  }
}

__attribute__((target("amx-tile"))) void release() { _tile_release(); }

// y's `cols` (<= 32) columns from n0 of `rows` rows, rounded to bf16
void store_block(const float* sums, int rows, int64_t cols, c10::BFloat16* y, int64_t ldy) {
  for (int m = 0; m < rows; ++m) {
    const float* s = sums + m * kBlockN;
    c10::BFloat16* out = y + m * ldy;
    if (cols == kBlockN) {
      store16(out, _mm512_loadu_ps(s));
      store16(out + 16, _mm512_loadu_ps(s + 16));
    } else {
      for (int64_t j = 0; j < cols; ++j) out[j] = c10::BFloat16(s[j]);
    }
  }
}

// the same, in float32
void store_block(const float* sums, int rows, int64_t cols, float* y, int64_t ldy) {
  for (int m = 0; m < rows; ++m) std::copy(sums + m * kBlockN, sums + m * kBlockN + cols, y + m * ldy);
}

#endif

#if defined(MESHSERVE_AMX)
// y [M, out_features] = x2 [M, K] times the packed weight's `blocks` blocks, in out_t.
template <typename out_t>
void multiply(const at::Tensor& x2, const at::Tensor& packed, int64_t out_features, at::Tensor& y) {
  const int64_t M = x2.size(0), K = x2.size(1), blocks = packed.size(0);
  const auto* xp = x2.data_ptr<c10::BFloat16>();
  const auto* wp = packed.data_ptr<c10::BFloat16>();
  auto* yp = y.data_ptr<out_t>();
  // the blocks a chunk of weights that stays in L2 while every row block of x passes
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (K * kBlockN * static_cast<int64_t>(sizeof(c10::BFloat16))));
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kBlockM * kBlockN];
    int configured = 0;
    for (int64_t first = begin; first < end; first += chunk) {
      const int64_t last = std::min(end, first + chunk);
      for (int64_t m0 = 0; m0 < M; m0 += kBlockM) {
        const int rows = static_cast<int>(std::min(kBlockM, M - m0));
        if (rows != configured) {
          configure(std::min(16, rows), std::max(0, rows - 16));
          configured = rows;
        }
        for (int64_t b = first; b < last; ++b) {
          const int64_t n0 = b * kBlockN, cols = std::min(kBlockN, out_features - n0);
          if (cols > 0) {
            block(xp + m0 * K, K, wp + b * K * kBlockN, rows > 16, sums);
            store_block(sums, rows, cols, yp + m0 * out_features + n0, out_features);
          }
        }
      }
    }
    if (configured) release();
  });
}
#endif

at::Tensor product(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, bool float_out) {
  const int64_t K = x.size(-1);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "amx_linear: x and the packed weight must be bfloat16");
  TORCH_CHECK(K % kStepK == 0 && packed.dim() == 2 && packed.size(1) == K * kBlockN && packed.is_contiguous(),
              "amx_linear: the weight must come from amx_pack, for inputs of ", K, " features");
  TORCH_CHECK(out_features > 0 && out_features <= packed.size(0) * kBlockN, "amx_linear: ", out_features,
              " outputs for a weight of ", packed.size(0), " blocks");
#if defined(MESHSERVE_AMX)
  TORCH_CHECK(amx_permitted(), "amx_linear: Linux refused this process AMX's tile state");
  const auto x2 = x.reshape({-1, K}).contiguous();
  auto y = at::empty({x2.size(0), out_features}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (x2.size(0) > 0) {
    if (float_out)
      multiply<float>(x2, packed, out_features, y);
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
  return product(x, packed, out_features, false);
}

at::Tensor amx_linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  return product(x, packed, out_features, true);
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
  m.def("amx_pack(Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(MESHSERVE_NS, CPU, m) {
  m.impl("amx_linear", &amx_linear);
  m.impl("amx_linear_f32", &amx_linear_f32);
  m.impl("amx_pack", &amx_pack);
}
