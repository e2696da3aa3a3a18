// Argmax and small top-k of float32 rows (CPU, AVX-512): the LM head's logits [n, V], each row read
// from cache in one or two vector passes; and a grammar's token bitmask applied to chosen rows. torch's CPU argmax and topk walk a row one element at a
// time (~1.2 GB/s: 2.6 ms each for a [64, 49152] batch on 2 Zen4 threads). See cpu_row_top.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// torch.argmax of one row: the first index of its largest value, or of its first NaN (torch ranks
// NaN above everything). Pass 1 finds the max (and whether a NaN exists), pass 2 its first index.
int64_t argmax_row(const float* __restrict x, int64_t V) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = neg_inf, m1 = neg_inf;  // two chains: max's latency does not bound the loop
  __mmask16 nan_seen = 0;
  int64_t j = 0;
  for (; j + 32 <= V; j += 32) {
    const __m512 a = _mm512_loadu_ps(x + j), b = _mm512_loadu_ps(x + j + 16);
    nan_seen |= _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);  // true where either is NaN
    m0 = _mm512_max_ps(m0, a);
    m1 = _mm512_max_ps(m1, b);
  }
  for (; j < V; j += 16) {
    const __mmask16 k = tail_mask(V - j);
    const __m512 a = _mm512_mask_loadu_ps(neg_inf, k, x + j);
    nan_seen |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    m0 = _mm512_max_ps(m0, a);
  }
  if (nan_seen) {
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(x[i])) return i;
  }
  const float mx = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
  const __m512 vmx = _mm512_set1_ps(mx);
  for (j = 0; j < V; j += 16) {
    const __mmask16 k = tail_mask(V - j);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(k, _mm512_maskz_loadu_ps(k, x + j), vmx, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
  return 0;  // unreachable: mx is one of the row's values
}

// The k largest of one row, largest first, into vals / idx (k <= V). A sorted list of the best k so
// far; a vector of 16 is only looked at lane by lane when one of them beats the list's last, which
// after the first few hundred elements is rare. Equal values keep the earlier index. NaNs are never
// picked (torch would rank them first; logits with NaN are garbage either way).
void topk_row(const float* __restrict x, int64_t V, int64_t k, float* __restrict vals, int64_t* __restrict idx) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  int64_t filled = 0;
  auto insert = [&](float v, int64_t i) {
    int64_t p = filled < k ? filled++ : k - 1;  // the slot that frees up: the end, or the last one
    while (p > 0 && vals[p - 1] < v) {
      vals[p] = vals[p - 1];
      idx[p] = idx[p - 1];
      --p;
    }
    vals[p] = v;
    idx[p] = i;
  };
  int64_t j = 0;
  for (; j < V && filled < k; ++j)
    if (!std::isnan(x[j])) insert(x[j], j);
  if (filled < k) {  // fewer than k non-NaN values: the rest are -inf at index 0, as padding
    for (int64_t p = filled; p < k; ++p) {
      vals[p] = neg_inf;
      idx[p] = 0;
    }
    return;
  }
  __m512 thr = _mm512_set1_ps(vals[k - 1]);
  for (; j < V; j += 16) {
    const __mmask16 live = tail_mask(V - j);
    const __m512 v = _mm512_maskz_loadu_ps(live, x + j);
    __mmask16 hit = _mm512_mask_cmp_ps_mask(live, v, thr, _CMP_GT_OQ);
    if (!hit) continue;
    while (hit) {
      const int b = __builtin_ctz(hit);
      hit &= hit - 1;
      if (x[j + b] > vals[k - 1]) insert(x[j + b], j + b);
    }
    thr = _mm512_set1_ps(vals[k - 1]);
  }
}

void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "row ops take contiguous float32 CPU rows [n, V]");
  TORCH_CHECK(x.size(1) > 0, "row ops need at least one column");
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x);
  const int64_t n = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({n}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& x, int64_t k) {
  check_rows(x);
  const int64_t n = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "topk_rows: k must be in 1..", V, ", got ", k);
  at::Tensor vals = at::empty({n, k}, x.options());
  at::Tensor idx = at::empty({n, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = vals.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) topk_row(xp + r * V, V, k, vp + r * k, ip + r * k);
  });
  return {vals, idx};
}

// Row rows[i] of x gets -inf wherever bit j of bitmask row i is 0 (token j not allowed; xgrammar's
// layout: 32 tokens per int32 word, low bit first). One masked store per 16 logits, whatever the
// word: a fully allowed word stores nothing, a forbidden one 32 -infs. xgrammar's own CPU loop writes
// element by element (~200 us per 49k-token row here); this runs at memory speed.
void mask_rows(at::Tensor& x, const at::Tensor& bitmask, const at::Tensor& rows) {
  check_rows(x);
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() &&
                  bitmask.device().is_cpu(), "mask_rows: bitmask must be contiguous int32 CPU [n, words]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "mask_rows: rows must be int64 [n], one per bitmask row");
  const int64_t V = x.size(1), W = bitmask.size(1), n = rows.size(0);
  TORCH_CHECK(W * 32 >= V, "mask_rows: a bitmask of ", W, " words does not cover ", V, " tokens");
  float* xp = x.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < x.size(0), "mask_rows: row ", rp[i], " is outside the logits");
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float* row = xp + rp[i] * V;
      const uint32_t* bits = bp + i * W;
      for (int64_t j = 0; j < V; j += 16) {
        const uint32_t word = bits[j / 32] >> (j % 32);
        const __mmask16 forbidden = (__mmask16)~word & tail_mask(V - j);
        if (forbidden) _mm512_mask_storeu_ps(row + j, forbidden, neg_inf);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("topk_rows(Tensor x, int k) -> (Tensor, Tensor)");
  m.def("mask_rows(Tensor(a!) x, Tensor bitmask, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("topk_rows", &topk_rows);
  m.impl("mask_rows", &mask_rows);
}
