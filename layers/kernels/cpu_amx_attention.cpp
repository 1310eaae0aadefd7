// amx_prefill_attention(q, k, v, chunks, scale): prefill_attention's causal attention of the
// fresh chunks of a step (cpu_prefill_attention.cpp: same arguments, same result) for
// bfloat16 q/k/v on AMX tiles. The float32 FMAs of the vector kernel make the attention of
// a batch of prompts compute-bound; TDPBF16PS does the two products 16 x 16 x 32 at a time.
//
// Two passes. The first packs each (chunk, KV head)'s keys and values into the B-tile order
// the products read, keys padded with zeros to a multiple of 32:
//   keys, 16 a tile, per 32 dims: [dim pair i < 16][key j < 16][2], K's 32-bit words transposed;
//   values, 32 keys a block, per 16 dims: [key pair i < 16][dim j < 16][2].
// The second takes a task per (chunk, KV head, tile of 16 query tokens) and, for each query
// head of the KV head: the scores of the tile's queries against every key they can see as
// 16 x 16 float32 tiles (S = Q K^T, four key tiles at a time); the causal softmax
// of each row in float32, in two passes (its max is known before any exp, so no running
// rescale; the exps to the precision bf16 keeps of them), the weights rounded to bf16 as the
// A tiles of P V (as flash attention rounds P on GPUs), normalized by the sum of the rounded
// weights; P V summed in 4 float32 tiles per 64 dims.
//
// Registered as meshserve_cpu::amx_prefill_attention (built by cpu_library.py); called only
// where the CPU has AMX-BF16 (layers/kernels/cpu_attention.py). Other builds refuse the call.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_amx.h"
#include "cpu_prefill_chunks.h"
#include "cpu_vec.h"

namespace {

constexpr int64_t kTile = 16;   // query tokens a task; keys a score tile
constexpr int64_t kBlock = 32;  // keys a block of P V (one A tile row of bf16)
constexpr int64_t kDims = 64;   // dims a pass of P V: 4 float32 tiles of sums

using bf16 = c10::BFloat16;

struct Rows {
  int64_t token, head;  // strides of (tokens, heads, head_dim) with contiguous head_dim
};

#if defined(MESHSERVE_AMX)
using namespace meshserve_cpu;

// Keys [16 x D] of one tile (`valid` of them real, the rest zeros) into D / 32 B tiles.
void pack_keys(const bf16* k, int64_t stride, int64_t valid, int64_t D, bf16* out) {
  auto* dst = reinterpret_cast<uint32_t*>(out);
  const int64_t words = D / 2;
  for (int64_t j = 0; j < kTile; ++j) {
    const auto* src = reinterpret_cast<const uint32_t*>(k + j * stride);
    for (int64_t w = 0; w < words; ++w) dst[(w / 16) * 256 + (w % 16) * 16 + j] = j < valid ? src[w] : 0u;
  }
}

// Values [32 x D] of one block (`valid` of them real, the rest zeros) into D / 16 B tiles:
// rows 2i and 2i + 1 interleaved 16 dims at a time.
void pack_values(const bf16* v, int64_t stride, int64_t valid, int64_t D, bf16* out) {
  alignas(64) static const uint16_t lo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                              8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i idx_lo = _mm512_load_si512(lo);
  const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
  for (int64_t i = 0; i < kTile; ++i) {
    const int64_t r0 = 2 * i, r1 = 2 * i + 1;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = r0 < valid ? _mm512_loadu_si512(v + r0 * stride + d) : _mm512_setzero_si512();
      const __m512i b = r1 < valid ? _mm512_loadu_si512(v + r1 * stride + d) : _mm512_setzero_si512();
      // dims d..d+15 go to tile d / 16, dims d+16..d+31 to the next
      _mm512_storeu_si512(out + ((d / 16) * kTile + i) * 32, _mm512_permutex2var_epi16(a, idx_lo, b));
      _mm512_storeu_si512(out + ((d / 16 + 1) * kTile + i) * 32, _mm512_permutex2var_epi16(a, idx_hi, b));
    }
  }
}

__attribute__((target("amx-tile,amx-bf16"))) void configure_all() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  load_tile_config(cfg);
}

// What the tile code and the softmax it calls are compiled for: the tiles, and AVX512-BF16's
// rounding (every CPU with AMX-BF16 has it), so that the softmax inlines into it.
#define MESHSERVE_AMX_CODE __attribute__((target("amx-tile,amx-bf16,avx512bf16")))

// exp(x) for x <= 0 to the precision of a bf16 weight: 2^n * e^r, |r| <= ln 2 / 2, e^r by its
// Taylor series to r^4 (relative error below 6e-5, a thirtieth of bf16's half step; exp16
// goes to r^7 for float32's). The softmax's exps were most of the kernel's time.
inline __m512 exp16_bf16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.f / 24), r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Row r's causal softmax over its first `visible` scores (scaled by `scale`), rounded to bf16
// into p (zeros up to `width`); returns the sum of the rounded weights. The rounding is
// AVX512-BF16's (to nearest even, as store16's integer rounding, in one instruction).
MESHSERVE_AMX_CODE inline float softmax_row(const float* s, int64_t visible, int64_t width, float scale, bf16* p) {
  __m512 top = _mm512_set1_ps(-1e30f);  // finite: -ffast-math assumes no infinities
  for (int64_t j = 0; j < visible; j += 16) {
    const __mmask16 m = static_cast<__mmask16>(visible - j >= 16 ? 0xffff : (1u << (visible - j)) - 1);
    top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, s + j));
  }
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top) * scale), by = _mm512_set1_ps(scale);
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {
    const int64_t left = visible - j;
    if (left <= 0) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), _mm256_setzero_si256());
      continue;
    }
    const __mmask16 m = static_cast<__mmask16>(left >= 16 ? 0xffff : (1u << left) - 1);
    const __m512 e = _mm512_maskz_mov_ps(m, exp16_bf16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, s + j), by, shift)));
    const __m256bh rounded = _mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), reinterpret_cast<__m256i>(rounded));
    total = _mm512_add_ps(total, _mm512_cvtpbh_ps(rounded));
  }
  return _mm512_reduce_add_ps(total);
}

struct Task {
  const bf16* q;   // the tile's first query token, the KV head's first query head
  bf16* out;       // likewise in the output
  const bf16* kp;  // the (chunk, KV head)'s packed keys and values
  const bf16* vp;
  int64_t first, rows;  // the tile's first query of the chunk, and how many (<= 16)
};

// tiles 0-3: scores of 4 key tiles (then P V sums), 5: Q (then P), 6-7: keys (then values)
MESHSERVE_AMX_CODE void attend(const Task& t, Rows qs, Rows os, int64_t group, int64_t D,
                                                            float scale, std::vector<float>& scores,
                                                            std::vector<bf16>& weights) {
  const int64_t keys = t.first + t.rows, score_tiles = (keys + kTile - 1) / kTile;
  const int64_t blocks = (keys + kBlock - 1) / kBlock, width = blocks * kBlock;
  scores.resize(kTile * width);
  weights.resize(kTile * width);
  alignas(64) bf16 query[kTile * 256];
  alignas(64) float sums[kTile * kDims];
  float total[kTile];
  for (int64_t g = 0; g < group; ++g) {
    // the tile's queries; rows past the chunk zero (their results are not written)
    for (int64_t r = 0; r < kTile; ++r) {
      if (r < t.rows)
        std::memcpy(query + r * D, t.q + r * qs.token + g * qs.head, D * sizeof(bf16));
      else
        std::memset(query + r * D, 0, D * sizeof(bf16));
    }
    // 4 key tiles at a time, in 4 tiles of sums: 4 independent chains of TDPs (one chain
    // waited on each TDP before the next)
    const int64_t key_tile = (D / 32) * 512;  // elements of a key tile's packed keys
    for (int64_t kt = 0; kt < score_tiles; kt += 4) {
      const int64_t n = std::min<int64_t>(4, score_tiles - kt);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < D / 32; ++s) {
        const bf16* kb = t.kp + kt * key_tile + s * 512;
        _tile_loadd(5, query + 32 * s, D * sizeof(bf16));
        _tile_loadd(6, kb, 64);
        _tile_dpbf16ps(0, 5, 6);
        if (n > 1) {
          _tile_loadd(7, kb + key_tile, 64);
          _tile_dpbf16ps(1, 5, 7);
        }
        if (n > 2) {
          _tile_loadd(6, kb + 2 * key_tile, 64);
          _tile_dpbf16ps(2, 5, 6);
        }
        if (n > 3) {
          _tile_loadd(7, kb + 3 * key_tile, 64);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      float* out = scores.data() + kt * kTile;
      const int64_t ld = width * sizeof(float);
      _tile_stored(0, out, ld);
      if (n > 1) _tile_stored(1, out + kTile, ld);
      if (n > 2) _tile_stored(2, out + 2 * kTile, ld);
      if (n > 3) _tile_stored(3, out + 3 * kTile, ld);
    }
    for (int64_t r = 0; r < kTile; ++r)
      total[r] = softmax_row(scores.data() + r * width, std::min(keys, t.first + r + 1), width, scale,
                             weights.data() + r * width);
    for (int64_t d0 = 0; d0 < D; d0 += kDims) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t b = 0; b < blocks; ++b) {
        _tile_loadd(5, weights.data() + b * kBlock, width * sizeof(bf16));
        const bf16* vb = t.vp + b * kBlock * D + (d0 / 16) * 512;
        _tile_loadd(6, vb, 64);
        _tile_dpbf16ps(0, 5, 6);
        _tile_loadd(6, vb + 512, 64);
        _tile_dpbf16ps(1, 5, 6);
        _tile_loadd(6, vb + 1024, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(6, vb + 1536, 64);
        _tile_dpbf16ps(3, 5, 6);
      }
      _tile_stored(0, sums, kDims * sizeof(float));
      _tile_stored(1, sums + 16, kDims * sizeof(float));
      _tile_stored(2, sums + 32, kDims * sizeof(float));
      _tile_stored(3, sums + 48, kDims * sizeof(float));
      for (int64_t r = 0; r < t.rows; ++r) {
        const __m512 inv = _mm512_set1_ps(1.f / total[r]);
        bf16* o = t.out + r * os.token + g * os.head + d0;
        for (int c = 0; c < 4; ++c) store16(o + 16 * c, _mm512_mul_ps(_mm512_load_ps(sums + r * kDims + 16 * c), inv));
      }
    }
  }
}
#endif

at::Tensor amx_prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& chunks, double scale) {
  const at::Tensor spans = meshserve_cpu::checked_prefill_chunks(q, k, v, chunks);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "amx_prefill_attention: q, k and v in bfloat16");
  TORCH_CHECK(q.size(2) % kDims == 0 && q.size(2) <= 256, "amx_prefill_attention: head_dim ", q.size(2),
              " is not a multiple of ", kDims, " up to 256");
  const int64_t* span = spans.data_ptr<int64_t>();
  const int64_t n = spans.size(0), tokens = q.size(0), heads = q.size(1), kv_heads = k.size(1), D = q.size(2);
  const int64_t group = heads / kv_heads;
  std::vector<int64_t> padded_start(n + 1, 0);  // each chunk's first key in the packed buffers
  for (int64_t c = 0; c < n; ++c) {
    padded_start[c + 1] = padded_start[c] + (span[2 * c + 1] + kBlock - 1) / kBlock * kBlock;
  }
  at::Tensor out = at::empty({tokens, heads, D}, q.options());
#if defined(MESHSERVE_AMX)
  TORCH_CHECK(amx_permitted(), "amx_prefill_attention: Linux refused this process AMX's tile state");
  const int64_t padded = padded_start[n];
  at::Tensor kpack = at::empty({kv_heads, padded, D}, q.options()), vpack = at::empty({kv_heads, padded, D}, q.options());
  const bf16* qp = q.data_ptr<bf16>();
  const bf16* kp = k.data_ptr<bf16>();
  const bf16* vp = v.data_ptr<bf16>();
  bf16* kpk = kpack.data_ptr<bf16>();
  bf16* vpk = vpack.data_ptr<bf16>();
  const Rows qs{q.stride(0), q.stride(1)}, ks{k.stride(0), k.stride(1)}, vs{v.stride(0), v.stride(1)};
  const Rows os{out.stride(0), out.stride(1)};
  // pass 1: a task per (KV head, 32-key block of the packed buffers)
  std::vector<int64_t> block_chunk(padded / kBlock);
  for (int64_t c = 0; c < n; ++c)
    for (int64_t b = padded_start[c] / kBlock; b < padded_start[c + 1] / kBlock; ++b) block_chunk[b] = c;
  const int64_t pack_blocks = padded / kBlock;
  at::parallel_for(0, kv_heads * pack_blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / pack_blocks, b = task % pack_blocks, c = block_chunk[b];
      const int64_t key0 = b * kBlock - padded_start[c], valid = span[2 * c + 1] - key0;  // may exceed 32
      const int64_t row = span[2 * c] + key0;
      const int64_t offset = (h * padded + b * kBlock) * D;
      pack_keys(kp + row * ks.token + h * ks.head, ks.token, std::min(valid, kTile), D, kpk + offset);
      pack_keys(kp + (row + kTile) * ks.token + h * ks.head, ks.token, std::max<int64_t>(0, valid - kTile), D,
                kpk + offset + kTile * D);
      pack_values(vp + row * vs.token + h * vs.head, vs.token, std::min(valid, kBlock), D, vpk + offset);
    }
  });
  // pass 2: a task per (chunk, 16-query tile, KV head)
  std::vector<int64_t> tile_chunk, tile_first;
  for (int64_t c = 0; c < n; ++c)
    for (int64_t first = 0; first < span[2 * c + 1]; first += kTile) {
      tile_chunk.push_back(c);
      tile_first.push_back(first);
    }
  const int64_t tasks = static_cast<int64_t>(tile_chunk.size()) * kv_heads;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<bf16> weights;
    configure_all();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / kv_heads, h = task % kv_heads, c = tile_chunk[i];
      const int64_t start = span[2 * c], first = tile_first[i];
      const Task t{qp + (start + first) * qs.token + h * group * qs.head,
                   out.data_ptr<bf16>() + (start + first) * os.token + h * group * os.head,
                   kpk + (h * padded + padded_start[c]) * D, vpk + (h * padded + padded_start[c]) * D, first,
                   std::min(kTile, span[2 * c + 1] - first)};
      attend(t, qs, os, group, D, static_cast<float>(scale), scores, weights);
    }
    release_tiles();
  });
#else
  TORCH_CHECK(false, "amx_prefill_attention runs in the avx512 build on Linux only");
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MESHSERVE_NS, m) {
  m.def("amx_prefill_attention(Tensor q, Tensor k, Tensor v, Tensor chunks, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(MESHSERVE_NS, CPU, m) { m.impl("amx_prefill_attention", &amx_prefill_attention); }
