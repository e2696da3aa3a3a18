// Argmax and small top-k of float32 rows (CPU): the LM head's logits [n, V], each row read from cache
// in one or two vector passes; and a grammar's token bitmask applied to chosen rows. torch's CPU argmax
// and topk walk a row one element at a time (~1.2 GB/s: 2.6 ms each for a [64, 49152] batch on 2 Zen4
// threads). See cpu_row_top.py.
//
// One build per machine (-march=native): the AVX-512 build works on 16 float lanes, the AVX2 build
// (Zen2/3, Haswell on) on 8, with the same loops over the few lane operations defined first.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_simd.h"

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

// ---- float32 lanes. Comparisons give one bit per lane (low bit: lane 0), as AVX-512's masks do.
#if defined(__AVX512F__)
using namespace ember_simd::avx512;  // the lane ops but the masks: cpu_simd.h
inline unsigned first_lanes(int64_t n) { return n >= 16 ? 0xFFFFu : (1u << n) - 1; }
// the first n lanes from p (n <= kLanes), `fill` in the others; nothing past them is read
inline vec vload_first(const float* p, int64_t n, float fill) {
  return _mm512_mask_loadu_ps(vset(fill), (__mmask16)first_lanes(n), p);
}
inline unsigned lanes_unordered(vec a, vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); }
inline unsigned lanes_eq(vec a, vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline unsigned lanes_gt(vec a, vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
// p[i] = x for each lane i whose bit is set (the others are not written)
inline void store_where(float* p, unsigned bits, float x) { _mm512_mask_storeu_ps(p, (__mmask16)bits, vset(x)); }
#elif defined(__AVX2__)
using namespace ember_simd::avx2;
inline unsigned first_lanes(int64_t n) { return n >= 8 ? 0xFFu : (1u << n) - 1; }
inline __m256i lane_mask(unsigned bits) {  // all ones in each lane whose bit is set
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), bit), bit);
}
inline vec vload_first(const float* p, int64_t n, float fill) {
  const __m256i m = lane_mask(first_lanes(n));
  return _mm256_blendv_ps(vset(fill), _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}
inline unsigned lanes_unordered(vec a, vec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q)); }
inline unsigned lanes_eq(vec a, vec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
inline unsigned lanes_gt(vec a, vec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
inline void store_where(float* p, unsigned bits, float x) { _mm256_maskstore_ps(p, lane_mask(bits), vset(x)); }
#else
#error "the row kernels need AVX-512F or AVX2 (cpp_build.KERNELS says where they are built)"
#endif

// torch.argmax of one row: the first index of its largest value, or of its first NaN (torch ranks
// NaN above everything). Pass 1 finds the max (and whether a NaN exists), pass 2 its first index.
int64_t argmax_row(const float* __restrict x, int64_t V) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  vec m0 = vset(neg_inf), m1 = m0;  // two chains: max's latency does not bound the loop
  unsigned nan_seen = 0;
  int64_t j = 0;
  for (; j + 2 * kLanes <= V; j += 2 * kLanes) {
    const vec a = vload(x + j), b = vload(x + j + kLanes);
    nan_seen |= lanes_unordered(a, b);  // true where either is NaN
    m0 = vmax(m0, a);
    m1 = vmax(m1, b);
  }
  for (; j < V; j += kLanes) {
    const vec a = vload_first(x + j, V - j, neg_inf);
    nan_seen |= lanes_unordered(a, a);
    m0 = vmax(m0, a);
  }
  if (nan_seen) {
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(x[i])) return i;
  }
  const vec vmx = vset(hmax(vmax(m0, m1)));
  for (j = 0; j < V; j += kLanes) {
    const unsigned live = first_lanes(V - j);
    const unsigned hit = lanes_eq(vload_first(x + j, V - j, 0.f), vmx) & live;
    if (hit) return j + __builtin_ctz(hit);
  }
  return 0;  // unreachable: the max is one of the row's values
}

// The k largest of one row, largest first, into vals / idx (k <= V). A sorted list of the best k so
// far; a vector is only looked at lane by lane when one of them beats the list's last, which after
// the first few hundred elements is rare. Equal values keep the earlier index. NaNs are never picked
// (torch would rank them first; logits with NaN are garbage either way).
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
  vec thr = vset(vals[k - 1]);
  for (; j < V; j += kLanes) {
    unsigned hit = lanes_gt(vload_first(x + j, V - j, neg_inf), thr);  // -inf past the row: never a hit
    if (!hit) continue;
    while (hit) {
      const int b = __builtin_ctz(hit);
      hit &= hit - 1;
      if (x[j + b] > vals[k - 1]) insert(x[j + b], j + b);
    }
    thr = vset(vals[k - 1]);
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
// layout: 32 tokens per int32 word, low bit first). One masked store per vector of logits, whatever
// the word: a fully allowed word stores nothing, a forbidden one 32 -infs. xgrammar's own CPU loop
// writes element by element (~200 us per 49k-token row here); this runs at memory speed.
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
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float* row = xp + rp[i] * V;
      const uint32_t* bits = bp + i * W;
      for (int64_t j = 0; j < V; j += kLanes) {  // kLanes divides 32: a vector's bits lie in one word
        const unsigned forbidden = ~(bits[j / 32] >> (j % 32)) & first_lanes(V - j);
        if (forbidden) store_where(row + j, forbidden, neg_inf);
      }
    }
  });
}

// float32 lanes of this build's vectors: 16 (AVX-512) or 8 (AVX2), for the tests to tell them apart.
int64_t row_top_lanes() { return kLanes; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("topk_rows(Tensor x, int k) -> (Tensor, Tensor)");
  m.def("mask_rows(Tensor(a!) x, Tensor bitmask, Tensor rows) -> ()");
  m.def("row_top_lanes() -> int", &row_top_lanes);  // no tensor to dispatch on: for every key
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("topk_rows", &topk_rows);
  m.impl("mask_rows", &mask_rows);
}
