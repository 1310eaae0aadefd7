// decode_layers(hidden, residual, weights, k_caches, v_caches, cos, sin, slots, block_tables,
// seq_lens, eps, scale, heads, kv_heads, amx) -> (hidden, residual): a run of Llama decoder layers
// (RMSNorm, fused QKV, rotary, paged attention, o_proj, RMSNorm, fused gate/up, SiLU-and-mul,
// down) over a decode-only step of one rank, in one call.
//
// Each layer is what layers/llama.py computes with the cpu backend in an eager step, with the
// same kernels of this library in the same order: the results are those of the Python loop.
// What goes is the loop's cost around them: ~15 op calls a layer from Python (each through
// the dispatcher, plus the modules' calls, views and the KV stores' index_copy), a share of a
// small model's step at batch 1 that scripts/profile_step.py shows. The ops are called through
// the dispatcher from C++, far cheaper than from Python; the new K/V rows are copied into
// their cache slots here.
//
// `weights`: per layer, in order, the input norm's weight, the QKV weight [(heads + 2 *
// kv_heads) * head_dim, hidden], the o weight, the post-attention norm's weight, the gate/up
// weight [2 * intermediate, hidden] and the down weight, all as dense_linear takes them, or
// with `amx` all as amx_linear takes them (amx_pack's tile order; the outputs of each follow
// from the heads, the norm's width and the down weight's inputs), gate/up as amx_linear_silu
// takes it (rows interleaved 16 by 16: its product gives silu(gate) * up).
// `residual` none: the first layer's input is the embedding (the residual is the input).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <cstring>
#include <optional>
#include <string>
#include <tuple>

#define MESHSERVE_STR2(x) #x
#define MESHSERVE_STR(x) MESHSERVE_STR2(x)

namespace {

template <typename F>
c10::TypedOperatorHandle<F> library_op(const char* name) {
  const std::string qualified = std::string(MESHSERVE_STR(MESHSERVE_NS)) + "::" + name;
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified.c_str(), "").typed<F>();
}

using Pair = std::tuple<at::Tensor, at::Tensor>;

// rows (tokens, kv_heads, head_dim) with contiguous tokens' rows -> the cache's slots
void store_rows(const at::Tensor& rows, const at::Tensor& cache, const int64_t* slots) {
  const int64_t tokens = rows.size(0), bytes = rows.size(1) * rows.size(2) * rows.element_size();
  const char* src = static_cast<const char*>(rows.data_ptr());
  char* dst = static_cast<char*>(cache.data_ptr());
  const int64_t stride = rows.stride(0) * rows.element_size();
  for (int64_t t = 0; t < tokens; ++t) std::memcpy(dst + slots[t] * bytes, src + t * stride, bytes);
}

// k, v (tokens, kv_heads, head_dim), each token's heads contiguous -> their slots of the
// caches (blocks, block_size, kv_heads, head_dim) of their dtype: a row copy per token where
// index_copy_ takes far longer on a prefill's rows.
void store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const at::Tensor& slots) {
  for (const at::Tensor* rows : {&k, &v})
    TORCH_CHECK(rows->dim() == 3 && rows->stride(2) == 1 && rows->stride(1) == rows->size(2) &&
                    rows->size(1) == k_cache.size(2) && rows->size(2) == k_cache.size(3) &&
                    rows->scalar_type() == k_cache.scalar_type() && rows->size(0) == slots.numel(),
                "store_kv: rows (tokens, ", k_cache.size(2), ", ", k_cache.size(3), ") of the cache's dtype with ",
                "contiguous heads, one slot each, got ", rows->sizes(), " and ", slots.numel(), " slots");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "store_kv: contiguous K and V caches of one shape and dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "store_kv: int64 slots");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t slots_total = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < slots.numel(); ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots_total, "store_kv: slot ", slot[t], " outside the cache's ", slots_total);
  store_rows(k, k_cache, slot);
  store_rows(v, v_cache, slot);
}

Pair decode_layers(const at::Tensor& hidden, const std::optional<at::Tensor>& residual, at::TensorList weights,
                   at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin,
                   const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& seq_lens, double eps,
                   double scale, int64_t heads, int64_t kv_heads, bool amx) {
  static const auto dense = library_op<at::Tensor(const at::Tensor&, const at::Tensor&)>("dense_linear");
  static const auto amx_linear = library_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>("amx_linear");
  // x times a weight of `outputs` outputs
  const auto product = [&](const at::Tensor& x, const at::Tensor& weight, int64_t outputs) {
    return amx ? amx_linear.call(x, weight, outputs) : dense.call(x, weight);
  };
  constexpr int64_t kAmxBlock = 32;  // outputs an amx_pack block holds
  static const auto norm =
      library_op<Pair(const at::Tensor&, const at::Tensor&, double, const std::optional<at::Tensor>&)>("rms_norm");
  static const auto rotary =
      library_op<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>("rotary");
  static const auto attend =
      library_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, double)>("paged_decode_attention");
  static const auto silu_and_mul = library_op<at::Tensor(const at::Tensor&)>("silu_and_mul");
  static const auto amx_linear_silu =
      library_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>("amx_linear_silu");

  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 6 * layers && static_cast<int64_t>(v_caches.size()) == layers,
              "decode_layers: 6 weights and a K and V cache per layer, got ", weights.size(), " weights for ", layers,
              " K caches and ", v_caches.size(), " V caches");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decode_layers: hidden must be contiguous (tokens, hidden)");
  const int64_t tokens = hidden.size(0);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == tokens,
              "decode_layers: one int64 slot per token");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "decode_layers: ", heads, " heads over ", kv_heads,
              " KV heads");
  const int64_t* slot = slots.data_ptr<int64_t>();
  at::Tensor x = hidden, res = residual.value_or(at::Tensor());
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + 6 * l;
    const at::Tensor& k_cache = k_caches[l];
    const at::Tensor& v_cache = v_caches[l];
    const int64_t dim = k_cache.size(3), slots_total = k_cache.size(0) * k_cache.size(1), qkv_out = (heads + 2 * kv_heads) * dim;
    const int64_t width = w[0].size(0), intermediate = amx ? w[5].size(1) / kAmxBlock : 0;
    TORCH_CHECK((amx ? w[1].size(0) * kAmxBlock >= qkv_out : w[1].size(0) == qkv_out) && k_cache.size(2) == kv_heads &&
                    k_cache.scalar_type() == hidden.scalar_type() && k_cache.is_contiguous() &&
                    v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() &&
                    v_cache.scalar_type() == hidden.scalar_type(),
                "decode_layers: layer ", l, "'s QKV weight or caches do not match ", heads, " heads, ", kv_heads,
                " KV heads of ", dim, " in the hidden states' dtype");
    if (l == 0)
      for (int64_t t = 0; t < tokens; ++t)
        TORCH_CHECK(slot[t] >= 0 && slot[t] < slots_total, "decode_layers: slot ", slot[t], " outside the cache's ",
                    slots_total);
    if (res.defined()) {
      std::tie(x, res) = norm.call(x, w[0], eps, res);
    } else {
      res = x;
      x = std::get<0>(norm.call(x, w[0], eps, std::nullopt));
    }
    const at::Tensor qkv = product(x, w[1], qkv_out);
    at::Tensor q = qkv.narrow(1, 0, heads * dim).view({tokens, heads, dim});
    at::Tensor k = qkv.narrow(1, heads * dim, kv_heads * dim).view({tokens, kv_heads, dim});
    const at::Tensor v = qkv.narrow(1, (heads + kv_heads) * dim, kv_heads * dim).view({tokens, kv_heads, dim});
    std::tie(q, k) = rotary.call(q, k, cos, sin);
    store_rows(k, k_cache, slot);
    store_rows(v, v_cache, slot);
    const at::Tensor attended = attend.call(q, k_cache, v_cache, block_tables, seq_lens, scale);
    const at::Tensor o = product(attended.view({tokens, heads * dim}), w[2], width);
    std::tie(x, res) = norm.call(o, w[3], eps, res);
    x = amx ? amx_linear_silu.call(x, w[4], intermediate) : silu_and_mul.call(product(x, w[4], 2 * intermediate));
    x = product(x, w[5], width);
  }
  return {x, res};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MESHSERVE_NS, m) {
  m.def("decode_layers(Tensor hidden, Tensor? residual, Tensor[] weights, Tensor[] k_caches, Tensor[] v_caches, "
        "Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, Tensor seq_lens, float eps, float scale, "
        "int heads, int kv_heads, bool amx) -> (Tensor, Tensor)");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(MESHSERVE_NS, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("store_kv", &store_kv);
}
