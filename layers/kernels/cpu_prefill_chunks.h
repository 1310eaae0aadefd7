// What both prefill attention kernels (cpu_prefill_attention.cpp, cpu_amx_attention.cpp) check
// of their arguments: q (tokens, heads, head_dim), k and v (tokens, kv_heads, head_dim) with a
// contiguous head_dim, and chunks (n, 2) int64 of rows inside the batch.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace meshserve_cpu {

// The chunks, contiguous: row 2c is chunk c's first row, 2c + 1 its length.
inline at::Tensor checked_prefill_chunks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                         const at::Tensor& chunks) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(),
              "q (tokens, heads, head_dim), k and v (tokens, kv_heads, head_dim)");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(1) % k.size(1) == 0,
              "q and k must have the same tokens and head_dim, and q's heads be a multiple of k's");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "q, k, v need a contiguous head_dim");
  TORCH_CHECK(chunks.dim() == 2 && chunks.size(1) == 2 && chunks.scalar_type() == at::kLong,
              "chunks is (n, 2) int64: each chunk's first row and length");
  at::Tensor spans = chunks.contiguous();
  const int64_t* span = spans.data_ptr<int64_t>();
  for (int64_t c = 0, tokens = q.size(0); c < spans.size(0); ++c) {
    const int64_t start = span[2 * c], len = span[2 * c + 1];
    TORCH_CHECK(start >= 0 && len >= 1 && start + len <= tokens, "chunk ", c, " covers rows ", start, "..",
                start + len, " of ", tokens);
  }
  return spans;
}

}  // namespace meshserve_cpu
