// decode_layers(hidden, residual, weights, k_caches, v_caches, cos, sin, slots, block_tables,
// seq_lens, eps, scale, heads, kv_heads, product, ..., skip) -> (hidden, residual): a run of Llama decoder
// layers (RMSNorm, fused QKV, rotary, paged attention, o_proj, RMSNorm, fused gate/up,
// SiLU-and-mul, down) over a decode-only step of one rank, in one call.
//
// Each layer is what layers/llama.py computes with the cpu backend in an eager step, with the
// same kernels of this library in the same order: the results are those of the Python loop.
// What goes is the loop's cost around them: ~15 op calls a layer from Python (each through
// the dispatcher, plus the modules' calls, views and the KV stores' index_copy), a share of a
// small model's step at batch 1 that scripts/profile_step.py shows. The ops are called through
// the dispatcher from C++, far cheaper than from Python; the new K/V rows are copied into
// their cache slots here (an int8 cache's rows quantized first by quantize_kv_int8, as the
// Python path stores them).
//
// `product` names the kind of every linear's product, and so what `weights` holds: per layer,
// in order, the input norm's weight, the QKV product [(heads + 2 * kv_heads) * head_dim
// outputs], the o product, the post-attention norm's weight, the gate/up product [2 *
// intermediate outputs] and the down product, each product as its kernel takes it:
// - "panels": one weight as dense_linear takes it;
// - "amx": one weight as amx_linear takes it (amx_pack's tile order), gate/up as
//   amx_linear_silu takes it (rows interleaved 16 by 16: its product gives silu(gate) * up);
// - "w8a8": three tensors as amx_w8a8_linear takes them (amx_pack_s8's codes, each output's
//   float32 scale and int32 code sum).
// The outputs of each product follow from the heads, the norm's width and the down weight's
// inputs. `residual` none: the first layer's input is the embedding (the residual is the input).
// `fused_silu` false: an "amx" gate/up is amx_linear's plain weight, its SiLU-and-mul after it.
//
// LoRA adapters (layers/lora.py): with `lora_slots` (each token's adapter slot, -1 for none),
// `lora` holds per layer the QKV's, o's, gate/up's and down's stacked A and B (eight tensors),
// and each product's output gets its rows' deltas from lora_add (cpu_lora.cpp) before what
// follows it (rotary, the norm, the activation), as the Python loop adds them.

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

constexpr int64_t kScaleBytes = 4;  // the float32 scale after an int8 cache row's codes

// The linears' product: dense_linear's panels, amx_linear's bf16 tiles, amx_w8a8_linear's int8 tiles.
enum class Product { kPanels, kAmx, kW8A8 };

Product product_kind(c10::string_view name) {
  if (name == "panels") return Product::kPanels;
  if (name == "amx") return Product::kAmx;
  TORCH_CHECK(name == "w8a8", "decode_layers: product \"", name, "\" is none of panels, amx, w8a8");
  return Product::kW8A8;
}

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
                   double scale, int64_t heads, int64_t kv_heads, c10::string_view product_name,
                   const std::optional<at::Tensor>& lora_slots, at::TensorList lora, bool fused_silu,
                   const std::optional<at::Tensor>& skip) {
  static const auto dense = library_op<at::Tensor(const at::Tensor&, const at::Tensor&)>("dense_linear");
  static const auto amx_linear = library_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>("amx_linear");
  static const auto amx_w8a8 =
      library_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>(
          "amx_w8a8_linear");
  const Product kind = product_kind(product_name);
  const int64_t per_product = kind == Product::kW8A8 ? 3 : 1, per_layer = 2 + 4 * per_product;
  // x times the product whose tensors start at `w`, of `outputs` outputs
  const auto product = [&](const at::Tensor& x, const at::Tensor* w, int64_t outputs) {
    switch (kind) {
      case Product::kAmx:
        return amx_linear.call(x, w[0], outputs);
      case Product::kW8A8:
        return amx_w8a8.call(x, w[0], w[1], w[2], outputs);
      default:
        return dense.call(x, w[0]);
    }
  };
  constexpr int64_t kAmxBlock = 32;  // outputs an amx_pack / amx_pack_s8 block holds
  static const auto norm =
      library_op<Pair(const at::Tensor&, const at::Tensor&, double, const std::optional<at::Tensor>&)>("rms_norm");
  static const auto rotary =
      library_op<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>("rotary");
  static const auto attend =
      library_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, double)>("paged_decode_attention");
  static const auto attend_tree =
      library_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, double, const at::Tensor&)>("paged_tree_decode_attention");
  static const auto silu_and_mul = library_op<at::Tensor(const at::Tensor&)>("silu_and_mul");
  static const auto amx_linear_silu =
      library_op<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>("amx_linear_silu");
  static const auto quantize_kv = library_op<at::Tensor(const at::Tensor&)>("quantize_kv_int8");
  static const auto lora_add =
      library_op<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>("lora_add");
  constexpr int64_t kLoraPerLayer = 8;  // A and B of QKV, o, gate/up, down

  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == per_layer * layers &&
                  static_cast<int64_t>(v_caches.size()) == layers,
              "decode_layers: ", per_layer, " weights (", product_name, " products) and a K and V cache per layer, got ",
              weights.size(), " weights for ", layers, " K caches and ", v_caches.size(), " V caches");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decode_layers: hidden must be contiguous (tokens, hidden)");
  const int64_t tokens = hidden.size(0);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == tokens,
              "decode_layers: one int64 slot per token");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "decode_layers: ", heads, " heads over ", kv_heads,
              " KV heads");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const bool adapters = lora_slots.has_value();
  TORCH_CHECK(!adapters || static_cast<int64_t>(lora.size()) == kLoraPerLayer * layers,
              "decode_layers: ", kLoraPerLayer, " LoRA tensors per layer, got ", lora.size(), " for ", layers, " layers");
  // y + the LoRA deltas of x's rows, for the product whose A and B are `ab`
  const auto with_lora = [&](at::Tensor y, const at::Tensor& x, const at::Tensor* ab) {
    if (adapters) lora_add.call(y, x.contiguous(), *lora_slots, ab[0], ab[1]);
    return y;
  };
  at::Tensor x = hidden, res = residual.value_or(at::Tensor());
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + per_layer * l;
    const at::Tensor* ab = adapters ? lora.data() + kLoraPerLayer * l : nullptr;
    const at::Tensor *qkv_w = w + 1, *o_w = w + 1 + per_product, *gate_up_w = w + 2 + 2 * per_product,
                     *down_w = w + 2 + 3 * per_product;
    const at::Tensor& k_cache = k_caches[l];
    const at::Tensor& v_cache = v_caches[l];
    const bool int8 = k_cache.scalar_type() == at::kChar;
    const int64_t dim = k_cache.size(3) - (int8 ? kScaleBytes : 0), slots_total = k_cache.size(0) * k_cache.size(1);
    const int64_t qkv_out = (heads + 2 * kv_heads) * dim, width = w[0].size(0);
    const int64_t intermediate = kind == Product::kPanels ? 0 : down_w->size(1) / kAmxBlock;
    TORCH_CHECK((kind == Product::kPanels ? qkv_w->size(0) == qkv_out : qkv_w->size(0) * kAmxBlock >= qkv_out) &&
                    k_cache.size(2) == kv_heads && (int8 || k_cache.scalar_type() == hidden.scalar_type()) &&
                    k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() &&
                    v_cache.scalar_type() == k_cache.scalar_type(),
                "decode_layers: layer ", l, "'s QKV weight or caches do not match ", heads, " heads, ", kv_heads,
                " KV heads of ", dim, " in the hidden states' dtype or int8");
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
    const at::Tensor qkv = with_lora(product(x, qkv_w, qkv_out), x, ab);
    at::Tensor q = qkv.narrow(1, 0, heads * dim).view({tokens, heads, dim});
    at::Tensor k = qkv.narrow(1, heads * dim, kv_heads * dim).view({tokens, kv_heads, dim});
    const at::Tensor v = qkv.narrow(1, (heads + kv_heads) * dim, kv_heads * dim).view({tokens, kv_heads, dim});
    std::tie(q, k) = rotary.call(q, k, cos, sin);
    store_rows(int8 ? quantize_kv.call(k) : k, k_cache, slot);
    store_rows(int8 ? quantize_kv.call(v) : v, v_cache, slot);
    const at::Tensor attended = skip.has_value()
                                    ? attend_tree.call(q, k_cache, v_cache, block_tables, seq_lens, scale, *skip)
                                    : attend.call(q, k_cache, v_cache, block_tables, seq_lens, scale);
    const at::Tensor flat = attended.view({tokens, heads * dim});
    const at::Tensor o = with_lora(product(flat, o_w, width), flat, ab + (adapters ? 2 : 0));
    std::tie(x, res) = norm.call(o, w[1 + 2 * per_product], eps, res);
    if (kind == Product::kAmx && fused_silu) {
      x = amx_linear_silu.call(x, gate_up_w[0], intermediate);
    } else {
      x = silu_and_mul.call(with_lora(product(x, gate_up_w, 2 * intermediate), x, ab + (adapters ? 4 : 0)));
    }
    x = with_lora(product(x, down_w, width), x, ab + (adapters ? 6 : 0));
  }
  return {x, res};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(MESHSERVE_NS, m) {
  m.def("decode_layers(Tensor hidden, Tensor? residual, Tensor[] weights, Tensor[] k_caches, Tensor[] v_caches, "
        "Tensor cos, Tensor sin, Tensor slots, Tensor block_tables, Tensor seq_lens, float eps, float scale, "
        "int heads, int kv_heads, str product, Tensor? lora_slots, Tensor[] lora, bool fused_silu, Tensor? skip) "
        "-> (Tensor, Tensor)");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(MESHSERVE_NS, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("store_kv", &store_kv);
}
