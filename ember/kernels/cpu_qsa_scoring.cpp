// QSA block scoring and top-k selection on CPU (qwen4_exp's indexer, ember/layers/qsa.py): for each query row,
// the scores of its visible pooled block keys, s_b = sum_h ReLU(q_h . K_b) / sqrt(d) in float32, and the ids of
// its `k` best, ascending. See cpu_qsa_scoring.py for the contract.
//
// Scores: a row's h query heads are widened to float32 once; block keys are walked a few at a time, each key
// vector loaded once for up to 4 heads (a tile of heads x keys dot products along d, in registers), so a key
// is read once per row. Rows go to threads one at a time from a shared counter, longest first (a prefill
// chunk's early rows see fewer blocks).
//
// Top-k: the selection must be the torch path's to the block, ties at the cut included (qsa.top_blocks asks
// torch.topk over the row's visible blocks). ATen's CPU topk fills a queue of (value, index) pairs in index
// order and runs std::partial_sort (k * 64 <= n) or std::nth_element on it with "greater, NaN first"; the
// same standard algorithms on the same queue keep the same tied blocks (the tests check this against
// torch.topk on tie-heavy rows in both regimes).
//
// One build per machine (-march=native): AVX-512 (16 float lanes) or AVX2 + FMA (8), the same loops.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include "cpu_simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

namespace {

// ---- float32 lanes (cpu_simd.h)
#if defined(__AVX512F__)
using namespace ember_simd::avx512;
#elif defined(__AVX2__) && defined(__FMA__)
using namespace ember_simd::avx2;
#else
#error "the QSA scoring kernel needs AVX-512F or AVX2 + FMA (cpp_build.KERNELS says where it is built)"
#endif

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Dot products of HG query vectors q[g] with JK keys k[j] over d floats (d's tail past the lanes in scalar
// code) -> out[g][j]. HG * JK <= 12 accumulators.
template <int HG, int JK>
inline void dot_tile(const float* const* q, const float* const* k, int64_t d, float (*out)[JK]) {
  vec acc[HG][JK];
  for (int g = 0; g < HG; ++g)
    for (int j = 0; j < JK; ++j) acc[g][j] = vzero();
  const int64_t dv = d - d % kLanes;
  for (int64_t e = 0; e < dv; e += kLanes) {
    vec kv[JK];
    for (int j = 0; j < JK; ++j) kv[j] = vload(k[j] + e);
    for (int g = 0; g < HG; ++g) {
      const vec qv = vload(q[g] + e);
      for (int j = 0; j < JK; ++j) acc[g][j] = vfma(qv, kv[j], acc[g][j]);
    }
  }
  for (int g = 0; g < HG; ++g)
    for (int j = 0; j < JK; ++j) {
      float s = hsum(acc[g][j]);
      for (int64_t e = dv; e < d; ++e) s += q[g][e] * k[j][e];
      out[g][j] = s;
    }
}

// score[b] += sum over the HG heads q[0..HG) of ReLU(q_g . key_b), b < n (keys rows of d floats from `keys`),
// heads added in order.
template <int HG>
void add_head_group(const float* const* q, const float* keys, int64_t n, int64_t d, float* score) {
  constexpr int JK = HG == 1 ? 8 : 12 / HG;
  int64_t b = 0;
  for (; b + JK <= n; b += JK) {
    const float* k[JK];
    for (int j = 0; j < JK; ++j) k[j] = keys + (b + j) * d;
    float out[HG][JK];
    dot_tile<HG, JK>(q, k, d, out);
    for (int g = 0; g < HG; ++g)
      for (int j = 0; j < JK; ++j) score[b + j] += std::max(out[g][j], 0.f);
  }
  for (; b < n; ++b) {
    const float* k[1] = {keys + b * d};
    float out[HG][1];
    dot_tile<HG, 1>(q, k, d, out);
    for (int g = 0; g < HG; ++g) score[b] += std::max(out[g][0], 0.f);
  }
}

// One row's scores over its n visible blocks: q [h, d] float32, keys [n, d] float32 -> score[0..n).
void score_row(const float* q, int64_t h, const float* keys, int64_t n, int64_t d, float scale_div, float* score) {
  std::fill(score, score + n, 0.f);
  for (int64_t g0 = 0; g0 < h; g0 += 4) {
    const float* qs[4];
    const int64_t hg = std::min<int64_t>(4, h - g0);
    for (int64_t g = 0; g < hg; ++g) qs[g] = q + (g0 + g) * d;
    switch (hg) {
      case 1: add_head_group<1>(qs, keys, n, d, score); break;
      case 2: add_head_group<2>(qs, keys, n, d, score); break;
      case 3: add_head_group<3>(qs, keys, n, d, score); break;
      default: add_head_group<4>(qs, keys, n, d, score); break;
    }
  }
  for (int64_t b = 0; b < n; ++b) score[b] = score[b] / scale_div;  // divided, as the torch path divides
}

// The k best of score[0..n) as torch.topk over those n values picks them (the file's comment), ascending ids
// into out[0..k); every id where n <= k, then -1 pads.
void top_ids(const float* score, int64_t n, int64_t k, std::vector<std::pair<double, int64_t>>& queue, int32_t* out) {
  if (n <= k) {
    for (int64_t b = 0; b < k; ++b) out[b] = b < n ? (int32_t)b : -1;
    return;
  }
  queue.resize(n);
  for (int64_t b = 0; b < n; ++b) queue[b] = {score[b], b};
  auto greater = [](const std::pair<double, int64_t>& x, const std::pair<double, int64_t>& y) {
    return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
  };
  if (k * 64 <= n)
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), greater);
  else
    std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), greater);
  for (int64_t c = 0; c < k; ++c) out[c] = (int32_t)queue[c].second;
  std::sort(out, out + k);
}

struct Step {
  int64_t T, h, d, B, nb, k;
  const int32_t *seq, *nc;
};

Step check(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& seq_idx, const at::Tensor& nc, int64_t k) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.device().is_cpu() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "qsa_scoring: q must be contiguous float32 or bf16 [T, heads, d] on CPU");
  TORCH_CHECK(keys.dim() == 3 && keys.is_contiguous() && keys.scalar_type() == at::kFloat && keys.size(2) == q.size(2),
              "qsa_scoring: keys must be contiguous float32 [B, nb, d] with q's d");
  for (const at::Tensor* t : {&seq_idx, &nc})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu() && t->numel() == q.size(0),
                "qsa_scoring: seq_idx and nc must be contiguous int32 [T] on CPU");
  TORCH_CHECK(k >= 0, "qsa_scoring: k must be >= 0");
  Step s{q.size(0), q.size(1), q.size(2), keys.size(0), keys.size(1), k, seq_idx.data_ptr<int32_t>(),
         nc.data_ptr<int32_t>()};
  for (int64_t i = 0; i < s.T; ++i) {
    TORCH_CHECK(s.seq[i] >= 0 && s.seq[i] < s.B, "qsa_scoring: row ", i, " names sequence ", s.seq[i]);
    TORCH_CHECK(s.nc[i] >= 0 && s.nc[i] <= s.nb, "qsa_scoring: row ", i, " sees ", s.nc[i], " blocks of ", s.nb);
  }
  return s;
}

// fn(row, q row widened to float32, its scores) for every row, longest first over the threads.
template <typename Q, typename Fn>
void for_rows(const Step& s, const Q* q, const float* keys, Fn fn) {
  std::vector<int32_t> order(s.T);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return s.nc[a] > s.nc[b]; });
  std::atomic<int64_t> next{0};
  const float scale_div = (float)std::sqrt((double)s.d);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), s.T));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> qf(s.h * s.d), score(s.nb);
    for (int64_t job; (job = next.fetch_add(1)) < s.T;) {
      const int64_t i = order[job];
      for (int64_t e = 0; e < s.h * s.d; ++e) qf[e] = to_float(q[i * s.h * s.d + e]);
      score_row(qf.data(), s.h, keys + (int64_t)s.seq[i] * s.nb * s.d, s.nc[i], s.d, scale_div, score.data());
      fn(i, score.data());
    }
  });
}

template <typename Q>
void select_rows(const Step& s, const Q* q, const float* keys, int32_t* out) {
  std::vector<std::vector<std::pair<double, int64_t>>> queues(at::get_num_threads());
  for_rows(s, q, keys, [&](int64_t i, const float* score) {
    top_ids(score, s.nc[i], s.k, queues[at::get_thread_num()], out + i * s.k);
  });
}

at::Tensor qsa_select_blocks(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& seq_idx,
                             const at::Tensor& nc, int64_t k) {
  const Step s = check(q, keys, seq_idx, nc, k);
  at::Tensor out = at::empty({s.T, k}, seq_idx.options());
  if (k == 0 || s.T == 0) return out;
  if (q.scalar_type() == at::kBFloat16)
    select_rows(s, q.data_ptr<c10::BFloat16>(), keys.data_ptr<float>(), out.data_ptr<int32_t>());
  else
    select_rows(s, q.data_ptr<float>(), keys.data_ptr<float>(), out.data_ptr<int32_t>());
  return out;
}

// The scores alone, [T, nb] float32, -inf past each row's visible blocks (what the torch path ranks).
at::Tensor qsa_block_scores(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& seq_idx,
                            const at::Tensor& nc) {
  const Step s = check(q, keys, seq_idx, nc, 0);
  at::Tensor out = at::empty({s.T, s.nb}, keys.options());
  float* o = out.data_ptr<float>();
  auto put = [&](int64_t i, const float* score) {
    std::copy(score, score + s.nc[i], o + i * s.nb);
    std::fill(o + i * s.nb + s.nc[i], o + (i + 1) * s.nb, -std::numeric_limits<float>::infinity());
  };
  if (q.scalar_type() == at::kBFloat16)
    for_rows(s, q.data_ptr<c10::BFloat16>(), keys.data_ptr<float>(), put);
  else
    for_rows(s, q.data_ptr<float>(), keys.data_ptr<float>(), put);
  return out;
}

// float32 lanes of this build: 16 (AVX-512) or 8 (AVX2), for the tests to tell the builds apart.
int64_t qsa_scoring_lanes() { return kLanes; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("qsa_select_blocks(Tensor q, Tensor keys, Tensor seq_idx, Tensor nc, int k) -> Tensor");
  m.def("qsa_block_scores(Tensor q, Tensor keys, Tensor seq_idx, Tensor nc) -> Tensor");
  m.def("qsa_scoring_lanes() -> int", &qsa_scoring_lanes);  // no tensor to dispatch on: for every key
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) {
  m.impl("qsa_select_blocks", &qsa_select_blocks);
  m.impl("qsa_block_scores", &qsa_block_scores);
}
