// Paged attention for a few queries per sequence on CPU (decode, speculative verify), fused:
// each (query, kv head) task walks its sequence's blocks in the cache directly, converts K/V
// rows to float32 as it reads them, and keeps a running max / sum (online softmax) per query
// head of the group, so K/V are read once per task and never gathered, padded or widened
// in memory. See cpu_paged_attention.py for why and how it is built.
#include "cpu_paged_attention.h"

// q [T, Hq, D] float32 or bf16 (unscaled); kv_cache [2, NB, bs, Hkv, D] contiguous; block_tables
// [B, W] int32; seq_idx [T] int32 (query i reads block_tables[seq_idx[i]]); kv_lens [T] int32
// (query i sees keys 0 .. kv_lens[i]-1); scale multiplies the scores. Returns [T, Hq, D] float32.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_idx, const at::Tensor& kv_lens, double scale) {
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) && q.is_contiguous(),
              "q must be contiguous float32 or bf16");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache must be contiguous [2, NB, bs, Hkv, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: contiguous int32");
  TORCH_CHECK(seq_idx.scalar_type() == at::kInt && kv_lens.scalar_type() == at::kInt, "seq_idx / kv_lens: int32");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0 && q.size(2) == kv_cache.size(4), "head shapes do not match");
  TORCH_CHECK(q.size(1) / kv_cache.size(3) <= kMaxG, "more than ", kMaxG, " query heads per kv head");
  auto out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  switch (kv_cache.scalar_type()) {
    case at::kBFloat16: run<c10::BFloat16>(q, scale, kv_cache, block_tables, seq_idx, kv_lens, out); break;
    case at::kHalf: run<c10::Half>(q, scale, kv_cache, block_tables, seq_idx, kv_lens, out); break;
    case at::kFloat:
    case at::kFloat8_e4m3fn:
    case at::kFloat8_e5m2: paged_attention_fp32_fp8(q, scale, kv_cache, block_tables, seq_idx, kv_lens, out); break;
    default: TORCH_CHECK(false, "unsupported kv cache dtype ", kv_cache.scalar_type());
  }
  return out;
}

// An op of the dispatcher (not a pybind function), so a compiled decode graph can call it too.
TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_idx, Tensor kv_lens, float scale) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
