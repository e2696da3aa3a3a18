// cpu_paged_attention.cpp's kernel over float32 and fp8 KV caches, compiled beside it (see
// cpu_paged_attention.h).
#include "cpu_paged_attention.h"

void paged_attention_fp32_fp8(const at::Tensor& q, double scale, const at::Tensor& kv_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_idx, const at::Tensor& kv_lens,
                              at::Tensor& out) {
  switch (kv_cache.scalar_type()) {
    case at::kFloat: run<float>(q, scale, kv_cache, block_tables, seq_idx, kv_lens, out); break;
    case at::kFloat8_e4m3fn: run<c10::Float8_e4m3fn>(q, scale, kv_cache, block_tables, seq_idx, kv_lens, out); break;
    case at::kFloat8_e5m2: run<c10::Float8_e5m2>(q, scale, kv_cache, block_tables, seq_idx, kv_lens, out); break;
    default: TORCH_CHECK(false, "unsupported kv cache dtype ", kv_cache.scalar_type());
  }
}
