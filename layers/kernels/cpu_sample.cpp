// Sampling a batch of float32 logit rows, each with its own temperature, top-k and top-p, in
// a few passes per row and no full sort (meshserve/layers/sampler.py):
//
//   sample_rows(logits (n, V) float32, temperature (n,) float32, top_k (n,) int64,
//               top_p (n,) float32, uniform (n,) float64 in [0, 1)) -> tokens (n,) int64
//
// A row with temperature 0 takes its argmax. Otherwise its weights are e_j = exp((x_j -
// max) / T) (a banned logit, -inf, weighs 0). top-k keeps the k largest weights (and any
// tied with the k-th); top-p then keeps the largest weights, in order, while the mass
// ranked above a token is at most top_p of the kept mass (the top-k set's, or the whole
// row's), as the torch reference does. The token is drawn by the inverse CDF: the first
// kept token, in a fixed order (index order, or weight order within the last bucket),
// whose running weight passes uniform x the kept mass (sums in float64), so a row's draw
// depends only on its logits and its own uniform.
//
// The k largest, or the nucleus, are found without sorting the row: a histogram of the
// weights by their float32 exponent and 3 mantissa bits (8 buckets per octave), scanned from
// the top until the count reaches k or the mass passes top_p, keeps every bucket above the
// one where that happens; only that bucket's tokens are sorted. Two passes over the row for
// the weights and one or two for the histogram, where torch ops draw exponential noise over
// the whole vocabulary and sort it all for top-p (scripts/bench_sampler.py).
//
// Built with the other kernels by meshserve/layers/kernels/cpu_library.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// NOTE: the library is built with -ffast-math, under which a comparison with an infinity or
// a NaN may be folded away: banned logits are told by their bits.
inline bool is_finite_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x7f800000u) != 0x7f800000u;
}

// Bucket of a weight in (0, 1]: its exponent and top 3 mantissa bits, larger for larger.
inline uint32_t bucket_of(float e) {
  uint32_t bits;
  std::memcpy(&bits, &e, sizeof(bits));
  return bits >> 20;
}
constexpr uint32_t kBuckets = (0x3f800000u >> 20) + 1;  // up to the bucket of 1.0

struct RowWork {
  std::vector<float> weight;
  std::vector<int64_t> candidates, boundary;
  std::vector<double> mass;
  std::vector<int64_t> count;
};

// The first index of the largest finite logit (0 if none is finite). Two branch-free passes
// the compiler vectorizes: the largest, then where it first is.
int64_t argmax_finite(const float* x, int64_t n) {
  constexpr float kLowest = -std::numeric_limits<float>::max();
  float top = kLowest;
  for (int64_t j = 0; j < n; ++j) top = std::max(top, is_finite_bits(x[j]) ? x[j] : kLowest);
  for (int64_t j = 0; j < n; ++j)
    if (x[j] == top && is_finite_bits(x[j])) return j;
  return 0;
}

// Weights of at least this (the largest is 1) form the `near` set, where the top k or the
// nucleus almost always lie; the weights' own pass counts it.
constexpr float kNear = 1.f / 256;
// At most this many near tokens are sorted as they are; a flatter row takes the histogram.
constexpr int64_t kMaxNear = 4096;

// Below this exp's result is not a normal float: 0 under -ffast-math's flush to zero.
constexpr float kExpFloor = -87.f;

// e_j = exp((x_j - top) / T), 0 for banned logits; returns their sum. Branch-free, so the
// compiler vectorizes it (exp from libmvec under -ffast-math; counting the near set in the
// same loop kept it from vectorizing, several times slower).
// NOTE: the argument is clamped at kExpFloor and those weights set to 0, as they were: libmvec
// leaves its fast path for arguments below it, and a row a grammar mask or min_p filled with
// -inf (or a logit_bias of -100) took several times as long.
double weights(const float* x, int64_t n, float top, float inv, float* e) {
  double total = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const float a = (x[j] - top) * inv;
    const float v = is_finite_bits(x[j]) && a > kExpFloor ? std::exp(std::max(a, kExpFloor)) : 0.f;
    e[j] = v;
    total += v;
  }
  return total;
}

struct Near {
  double mass = 0.0;
  int32_t count = 0;
};

// The count and mass of the weights >= kNear.
Near near_set(const float* e, int64_t n) {
  double mass = 0.0;
  int32_t count = 0;
  for (int64_t j = 0; j < n; ++j) {
    const bool near = e[j] >= kNear;
    mass += near ? e[j] : 0.f;
    count += near;
  }
  return {mass, count};
}

inline void sort_by_weight(const float* e, std::vector<int64_t>& tokens) {
  std::sort(tokens.begin(), tokens.end(), [e](int64_t a, int64_t b) { return e[a] > e[b] || (e[a] == e[b] && a < b); });
}

// Every token of the histogram's buckets, scanned from the top until the count reaches `k`
// (k > 0) or the mass passes `mass_target` (k == 0): `kept` gets the tokens of the buckets
// above the one where that happens, in index order, `edge` that bucket's tokens, sorted
// largest first. Returns the mass of the buckets above.
double cut_buckets(const float* e, int64_t n, int64_t k, double mass_target, RowWork& w, std::vector<int64_t>& kept,
                   std::vector<int64_t>& edge) {
  w.mass.assign(kBuckets, 0.0);
  w.count.assign(kBuckets, 0);
  for (int64_t j = 0; j < n; ++j)
    if (e[j] > 0.f) {
      const uint32_t b = bucket_of(e[j]);
      w.mass[b] += e[j];
      w.count[b] += 1;
    }
  int64_t boundary = 0;
  double above = 0.0, mass = 0.0;
  int64_t count = 0;
  for (int64_t b = kBuckets - 1; b >= 0; --b) {
    mass += w.mass[b];
    count += w.count[b];
    if ((k > 0 && count >= k) || (k == 0 && mass > mass_target)) {
      boundary = b;
      break;
    }
    above = mass;
  }
  for (int64_t j = 0; j < n; ++j)
    if (e[j] > 0.f) {
      const int64_t b = bucket_of(e[j]);
      if (b > boundary)
        kept.push_back(j);
      else if (b == boundary)
        edge.push_back(j);
    }
  sort_by_weight(e, edge);
  return above;
}

// `kept`, sorted largest first, cut to the top k (and any tied with the k-th), then to the
// tokens whose mass ranked above is at most top_p of what is left (`total`, the row's mass,
// without a top-k cut).
void cut_sorted(const float* e, std::vector<int64_t>& kept, int64_t top_k, float top_p, double total) {
  if (top_k > 0 && static_cast<size_t>(top_k) < kept.size()) {
    size_t take = static_cast<size_t>(top_k);
    while (take < kept.size() && e[kept[take]] == e[kept[take - 1]]) ++take;
    kept.resize(take);
    total = 0.0;
    for (int64_t j : kept) total += e[j];
  }
  if (top_p < 1.f) {
    const double limit = static_cast<double>(top_p) * total;
    double ranked = 0.0;
    size_t end = 0;
    while (end < kept.size() && ranked <= limit) ranked += e[kept[end++]];
    kept.resize(std::max<size_t>(end, 1));
  }
}

// The first token of `tokens` (in their order) whose running weight passes u x their mass.
int64_t draw(const float* e, const std::vector<int64_t>& tokens, double u) {
  double mass = 0.0;
  for (int64_t j : tokens) mass += e[j];
  const double target = u * mass;
  double run = 0.0;
  for (int64_t j : tokens) {
    run += e[j];
    if (run > target) return j;
  }
  return tokens.back();
}

int64_t sample_row(const float* x, int64_t n, float temperature, int64_t top_k, float top_p, double u,
                   RowWork& w) {
  const int64_t first = argmax_finite(x, n);
  if (temperature <= 0.f) return first;
  w.weight.resize(n);
  float* e = w.weight.data();
  const double total = weights(x, n, x[first], 1.f / temperature, e);
  if (!(total > 0.0)) return first;  // nothing finite to draw from (a row all -inf)
  const bool by_k = top_k > 0 && top_k < n, by_p = top_p < 1.f;
  if (!by_k && !by_p) {  // the whole row
    const double target = u * total;
    double run = 0.0;
    int64_t last = first;
    for (int64_t j = 0; j < n; ++j)
      if (e[j] > 0.f) {
        run += e[j];
        last = j;
        if (run > target) return j;
      }
    return last;
  }
  std::vector<int64_t>& kept = w.candidates;
  std::vector<int64_t>& edge = w.boundary;
  kept.clear();
  edge.clear();
  // The near set holds the k largest when it has k tokens, and the nucleus when (with no
  // top-k cut) its mass passes top_p of the row's: then only it is sorted.
  const Near near = near_set(e, n);
  const bool near_holds = by_k ? near.count >= top_k : near.mass > static_cast<double>(top_p) * total;
  if (near_holds && near.count <= kMaxNear) {
    for (int64_t j = 0; j < n; ++j)
      if (e[j] >= kNear) kept.push_back(j);
    sort_by_weight(e, kept);
    cut_sorted(e, kept, by_k ? top_k : 0, top_p, total);
    return draw(e, kept, u);
  }
  double above = cut_buckets(e, n, by_k ? top_k : 0, by_p ? static_cast<double>(top_p) * total : 0.0, w, kept,
                             edge);
  if (by_k) {  // fewer than k above the edge bucket: with it, sorted, the k largest and their ties
    kept.insert(kept.end(), edge.begin(), edge.end());
    sort_by_weight(e, kept);
    cut_sorted(e, kept, top_k, top_p, total);
    return draw(e, kept, u);
  }
  // top-p alone: every token above the edge bucket is in the nucleus (the mass ranked above
  // any of them is within the limit); the edge bucket's tokens, largest first, while the mass
  // ranked above them stays within it
  const double limit = static_cast<double>(top_p) * total;
  size_t end = 0;
  while (end < edge.size() && above <= limit) above += e[edge[end++]];
  kept.insert(kept.end(), edge.begin(), edge.begin() + end);
  if (kept.empty()) kept.push_back(first);
  return draw(e, kept, u);
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "sample_rows takes contiguous float32 (rows, vocab > 0) logits, got ", logits.sizes(), " ",
              logits.scalar_type());
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && top_k.scalar_type() == at::kLong &&
                  top_p.scalar_type() == at::kFloat && uniform.scalar_type() == at::kDouble,
              "sample_rows: temperature and top_p float32, top_k int64, uniform float64");
  TORCH_CHECK(temperature.numel() == rows && top_k.numel() == rows && top_p.numel() == rows && uniform.numel() == rows,
              "sample_rows: one temperature, top_k, top_p and uniform per row (", rows, " rows)");
  const at::Tensor t = temperature.contiguous(), k = top_k.contiguous(), p = top_p.contiguous(),
                   u = uniform.contiguous();
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* xs = logits.data_ptr<float>();
  const float* ts = t.data_ptr<float>();
  const int64_t* ks = k.data_ptr<int64_t>();
  const float* ps = p.data_ptr<float>();
  const double* us = u.data_ptr<double>();
  int64_t* os = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    RowWork work;
    for (int64_t r = begin; r < end; ++r) os[r] = sample_row(xs + r * n, n, ts[r], ks[r], ps[r], us[r], work);
  });
  return out;
}

// Grammar masks (engine/structured.py): on each row rows[i] of `logits`, the tokens whose bit
// in bitmask[i] is clear become -inf, in place (bit j of word w: token 32 w + j, xgrammar's
// layout; tokens past the mask's words are disallowed). Returns, per masked row, whether a
// finite logit is left. One branch-free pass per row, where the torch ops unpack the bits
// and run where and index_copy over every row.
at::Tensor mask_rows(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "mask_rows: logits must be a contiguous (n, V) float32 tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && rows.scalar_type() == at::kLong &&
                  rows.numel() == bitmask.size(0),
              "mask_rows: bitmask (k, words) int32 and rows (k,) int64");
  const int64_t n = logits.size(1), words = bitmask.size(1), k = rows.numel();
  const at::Tensor bm = bitmask.contiguous(), rs = rows.contiguous();
  at::Tensor alive = at::empty({k}, logits.options().dtype(at::kBool));
  float* xs = logits.data_ptr<float>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bm.data_ptr<int32_t>());
  const int64_t* ri = rs.data_ptr<int64_t>();
  bool* out = alive.data_ptr<bool>();
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < k; ++i) {
    TORCH_CHECK(ri[i] >= 0 && ri[i] < logits.size(0), "mask_rows: row ", ri[i], " out of range");
    float* x = xs + ri[i] * n;
    const uint32_t* b = bits + i * words;
    bool any = false;
    for (int64_t w = 0; w * 32 < n; ++w) {
      const uint32_t word = w < words ? b[w] : 0u;
      float* xw = x + w * 32;
      const int64_t len = std::min<int64_t>(32, n - w * 32);
      if (word == 0u) {  // most words of a narrow grammar: nothing allowed
        std::fill(xw, xw + len, ninf);
        continue;
      }
      for (int64_t j = 0; j < len; ++j) {
        const bool keep = (word >> j) & 1u;
        any |= keep && is_finite_bits(xw[j]);
        xw[j] = keep ? xw[j] : ninf;
      }
    }
    out[i] = any;
  }
  return alive;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MESHSERVE_NS, m) {
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor uniform) -> Tensor");
  m.def("mask_rows(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(MESHSERVE_NS, CPU, m) {
  m.impl("sample_rows", &sample_rows);
  m.impl("mask_rows", &mask_rows);
}
