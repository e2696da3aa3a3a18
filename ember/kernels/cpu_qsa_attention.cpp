// QSA selected-block attention on CPU (qwen4_exp's sparse attention layers): each query row attends to
// the tokens of its chosen blocks plus its tail, K/V read straight from the paged cache. See
// cpu_qsa_attention.py for the contract and ember/layers/qsa.py for the selection.
//
// A task is one (query row, kv head): the row's token list is turned into cache slots once, then walked
// 16 keys at a time; each tile's K and V rows are widened to float32 once (so the G query heads of the kv
// head share them: a row is read once per kv head) and folded into a running max / sum / accumulator per
// query head (online softmax, float32). Tasks go to threads one at a time from a shared counter, longest
// first (a prefill chunk's early rows have fewer keys). When there are fewer tasks than threads (a batch-1
// decode), each task's token list is cut into parts that are merged after (as the paged kernel's splits).
//
// One build per machine (-march=native): the AVX-512 build works on 16 float lanes, the AVX2 + FMA build
// (Zen2/3, Haswell on) on 8, the same loops over the few lane operations defined first.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "cpu_simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

constexpr int kTile = 16;  // keys per online-softmax update
constexpr int kMaxG = 16;  // query heads per kv head
constexpr int64_t kMinPart = 256;  // keys per part, at least, when a task's keys are split over threads

// ---- float32 lanes (cpu_simd.h)
#if defined(__AVX512F__)
using namespace ember_simd::avx512;
#elif defined(__AVX2__) && defined(__FMA__)
using namespace ember_simd::avx2;
#else
#error "the QSA attention kernel needs AVX-512F or AVX2 + FMA (cpp_build.KERNELS says where it is built)"
#endif

// A cache row of D elements -> float32 (D is a multiple of kLanes: the .py's HEAD_SIZES)
template <typename T, int D>
inline void widen_row(const T* __restrict src, float* __restrict dst) {
  for (int d = 0; d < D; d += kLanes) vstore(dst + d, vload(src + d));
}

template <typename T, int D>
inline void prefetch_row(const T* p) {
  for (int b = 0; b < D * (int)sizeof(T); b += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T1);
}

// q . k over D float32 elements, two FMA chains
template <int D>
inline float dot(const float* __restrict q, const float* __restrict k) {
  vec a0 = vzero(), a1 = vzero();
  int d = 0;
  for (; d + 2 * kLanes <= D; d += 2 * kLanes) {
    a0 = vfma(vload(q + d), vload(k + d), a0);
    a1 = vfma(vload(q + d + kLanes), vload(k + d + kLanes), a1);
  }
  if (d < D) a0 = vfma(vload(q + d), vload(k + d), a0);
  return hsum(vadd(a0, a1));
}

// One tile of a head's online softmax over s[0..kTile) (entries past the tile's keys are -inf): s <- exp(s -
// m'), m' the running max *m folded with the tile's; *l <- *l * exp(*m - m') + sum(s); *m <- m'. Returns
// exp(*m - m'), the factor the head's accumulator is scaled by (0 on the first tile).
inline float softmax_tile(float* __restrict s, float* m, float* l) {
  vec mx = vset(*m);
  for (int j = 0; j < kTile; j += kLanes) mx = vmax(mx, vload(s + j));
  const float m_new = hmax(mx);  // finite: every tile has a key
  const vec vm = vset(m_new);
  vec sum = vzero();
  for (int j = 0; j < kTile; j += kLanes) {
    const vec p = ember_simd::exp_nonpositive(vsub(vload(s + j), vm));
    vstore(s + j, p);
    sum = vadd(sum, p);
  }
  const float rescale = std::exp(*m - m_new);
  *l = *l * rescale + hsum(sum);
  *m = m_new;
  return rescale;
}

// Query heads q [G, D] (float32, the scale folded in) over the n keys whose rows start at element offsets
// slots[0..n) from kc / vc (this kv head's K and V in cache block 0). m_out == nullptr: out [G, D] is the
// normalized attention; else a part of a split list: out the unnormalized accumulators, (m, l) per head out
// for merge_parts.
template <typename T, int D>
void attend(const float* __restrict q, int64_t G, const T* __restrict kc, const T* __restrict vc,
            const int64_t* __restrict slots, int64_t n, float* __restrict out, float* m_out, float* l_out) {
  constexpr bool kWiden = !std::is_same<T, float>::value;  // float32 rows are read in place
  alignas(64) float acc[kMaxG][D];
  alignas(64) float rows[kTile][kWiden ? D : 1];
  alignas(64) float s[kMaxG][kTile];
  const float* row[kTile];
  float m[kMaxG], l[kMaxG];
  for (int64_t g = 0; g < G; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
    std::fill(acc[g], acc[g] + D, 0.f);
  }
  auto load_rows = [&](const T* base, const int64_t* sl, int64_t nt) {
    for (int64_t j = 0; j < nt; ++j) {
      if constexpr (kWiden) {
        widen_row<T, D>(base + sl[j], rows[j]);
        row[j] = rows[j];
      } else {
        row[j] = reinterpret_cast<const float*>(base + sl[j]);
      }
    }
  };
  for (int64_t t0 = 0; t0 < n; t0 += kTile) {
    const int64_t nt = std::min<int64_t>(kTile, n - t0);
    const int64_t* sl = slots + t0;
    for (int64_t j = t0 + kTile; j < std::min<int64_t>(n, t0 + 2 * kTile); ++j) {  // the next tile's rows
      prefetch_row<T, D>(kc + slots[j]);
      prefetch_row<T, D>(vc + slots[j]);
    }
    load_rows(kc, sl, nt);
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t j = 0; j < nt; ++j) s[g][j] = dot<D>(q + g * D, row[j]);
      for (int64_t j = nt; j < kTile; ++j) s[g][j] = -std::numeric_limits<float>::infinity();
      const float rescale = softmax_tile(s[g], &m[g], &l[g]);
      if (rescale != 1.f) {
        const vec f = vset(rescale);
        for (int d = 0; d < D; d += kLanes) vstore(acc[g] + d, vmul(vload(acc[g] + d), f));
      }
    }
    load_rows(vc, sl, nt);
    for (int64_t g = 0; g < G; ++g) {  // acc[g] += sum_j s[g][j] * V row j, up to 8 vectors of it in registers
      for (int d0 = 0; d0 < D; d0 += 8 * kLanes) {
        const int nv = std::min(8, (D - d0) / kLanes);
        vec a[8];
        for (int v = 0; v < nv; ++v) a[v] = vload(acc[g] + d0 + v * kLanes);
        for (int64_t j = 0; j < nt; ++j) {
          const vec p = vset(s[g][j]);
          for (int v = 0; v < nv; ++v) a[v] = vfma(p, vload(row[j] + d0 + v * kLanes), a[v]);
        }
        for (int v = 0; v < nv; ++v) vstore(acc[g] + d0 + v * kLanes, a[v]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = m_out != nullptr ? 1.f : l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int d = 0; d < D; ++d) out[g * D + d] = acc[g][d] * inv;
    if (m_out != nullptr) {
      m_out[g] = m[g];
      l_out[g] = l[g];
    }
  }
}

// S parts of one (row, kv head) -> out [G, D]: each part rescaled to the common max.
void merge_parts(const float* acc, const float* m, const float* l, int64_t S, int64_t G, int64_t D, float* out) {
  for (int64_t g = 0; g < G; ++g) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < S; ++p) mx = std::max(mx, m[p * G + g]);
    float total = 0.f;
    std::fill(out + g * D, out + (g + 1) * D, 0.f);
    for (int64_t p = 0; p < S; ++p) {
      if (l[p * G + g] == 0.f) continue;  // an empty part
      const float w = std::exp(m[p * G + g] - mx);
      total += w * l[p * G + g];
      for (int64_t d = 0; d < D; ++d) out[g * D + d] += w * acc[(p * G + g) * D + d];
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] *= inv;
  }
}

// The step's rows and what they select (the op's arguments, checked), and each row's key count.
struct Rows {
  int64_t T, K, B, W, bs, r;
  const int32_t *seq, *blocks, *tail, *lens, *tables;
  std::vector<int64_t> keys;  // per row: chosen blocks * r + tail length

  // Row i's keys as element offsets of their cache rows (slot * stride), the chosen blocks' then the tail's.
  void slots(int64_t i, int64_t stride, int64_t* out) const {
    const int32_t* table = tables + (int64_t)seq[i] * W;
    int64_t n = 0;
    auto put = [&](int64_t t) { out[n++] = ((int64_t)table[t / bs] * bs + t % bs) * stride; };
    for (int64_t c = 0; c < K; ++c)
      if (blocks[i * K + c] >= 0)
        for (int64_t u = 0; u < r; ++u) put((int64_t)blocks[i * K + c] * r + u);
    for (int64_t t = tail[i]; t < lens[i]; ++t) put(t);
  }
};

Rows check_rows(const at::Tensor& block_tables, const at::Tensor& seq_idx, const at::Tensor& blocks,
                const at::Tensor& tail_start, const at::Tensor& kv_lens, int64_t ratio, int64_t T) {
  for (const at::Tensor* t : {&block_tables, &seq_idx, &blocks, &tail_start, &kv_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(),
                "qsa_attention: the index tensors must be contiguous int32 CPU tensors");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(0) == T && seq_idx.numel() == T && tail_start.numel() == T &&
                  kv_lens.numel() == T && block_tables.dim() == 2 && ratio >= 1,
              "qsa_attention: blocks [T, K], seq_idx / tail_start / kv_lens [T] for q's T rows, ratio >= 1");
  Rows rows{T, blocks.size(1), block_tables.size(0), block_tables.size(1), 0, ratio,
            seq_idx.data_ptr<int32_t>(), blocks.data_ptr<int32_t>(), tail_start.data_ptr<int32_t>(),
            kv_lens.data_ptr<int32_t>(), block_tables.data_ptr<int32_t>(), std::vector<int64_t>(T)};
  return rows;
}

void count_keys(Rows& rows) {
  for (int64_t i = 0; i < rows.T; ++i) {
    const int64_t len = rows.lens[i], tail = rows.tail[i];
    TORCH_CHECK(rows.seq[i] >= 0 && rows.seq[i] < rows.B, "qsa_attention: row ", i, " names sequence ", rows.seq[i]);
    TORCH_CHECK(0 <= tail && tail <= len && len <= rows.W * rows.bs, "qsa_attention: row ", i, "'s tail [", tail,
                ", ", len, ") is outside its block table");
    int64_t n = len - tail;
    for (int64_t c = 0; c < rows.K; ++c) {
      const int64_t b = rows.blocks[i * rows.K + c];
      TORCH_CHECK(b < 0 || (b + 1) * rows.r <= tail, "qsa_attention: row ", i, " chose block ", b,
                  ", which does not end before its tail (token ", tail, ")");
      n += b >= 0 ? rows.r : 0;
    }
    rows.keys[i] = n;
  }
}

template <typename T, int D>
void run(const at::Tensor& q_in, const at::Tensor& kv_cache, const Rows& rows, double scale, at::Tensor& out) {
  const int64_t Tq = q_in.size(0), Hq = q_in.size(1);
  const int64_t NB = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3), G = Hq / Hkv;
  const T* kbase = kv_cache.data_ptr<T>();
  const T* vbase = kbase + NB * bs * Hkv * D;
  const float* q = q_in.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t tasks = Tq * Hkv, threads = at::get_num_threads();
  const int64_t longest = Tq ? *std::max_element(rows.keys.begin(), rows.keys.end()) : 0;
  // parts per task: 1, or with fewer tasks than threads (a batch-1 decode) enough to give each thread work
  const int64_t S = tasks >= threads ? 1 : std::max<int64_t>(1, std::min((threads + tasks - 1) / tasks, longest / kMinPart));
  std::vector<int32_t> order(Tq);  // rows with the most keys first
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return rows.keys[a] > rows.keys[b]; });
  std::vector<float> part_acc(S > 1 ? tasks * S * G * D : 0), part_m(S > 1 ? tasks * S * G : 0), part_l(part_m.size());
  std::atomic<int64_t> next{0};
  const int64_t jobs = tasks * S;
  at::parallel_for(0, std::min(threads, jobs), 1, [&](int64_t, int64_t) {
    std::vector<int64_t> slots;
    alignas(64) float qs[kMaxG * D];
    for (int64_t job; (job = next.fetch_add(1)) < jobs;) {
      const int64_t i = order[job / (Hkv * S)], h = job / S % Hkv, p = job % S;
      const int64_t n = rows.keys[i];
      slots.resize(std::max<int64_t>(n, 1));
      rows.slots(i, Hkv * D, slots.data());
      const int64_t chunk = (n + S - 1) / S, k0 = std::min(n, p * chunk), k1 = std::min(n, k0 + chunk);
      for (int64_t e = 0; e < G * D; ++e) qs[e] = q[(i * Hq + h * G) * D + e] * (float)scale;
      if (S == 1) {
        attend<T, D>(qs, G, kbase + h * D, vbase + h * D, slots.data(), n, o + (i * Hq + h * G) * D, nullptr, nullptr);
      } else {
        const int64_t at = (i * Hkv + h) * S + p;
        attend<T, D>(qs, G, kbase + h * D, vbase + h * D, slots.data() + k0, k1 - k0, part_acc.data() + at * G * D,
                     part_m.data() + at * G, part_l.data() + at * G);
      }
    }
  });
  if (S > 1)
    at::parallel_for(0, tasks, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)  // t = i * Hkv + h: its G heads' rows are o's (i, h * G ..)
        merge_parts(part_acc.data() + t * S * G * D, part_m.data() + t * S * G, part_l.data() + t * S * G, S, G, D,
                    o + t * G * D);
    });
}

at::Tensor qsa_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_idx, const at::Tensor& blocks, const at::Tensor& tail_start,
                         const at::Tensor& kv_lens, int64_t ratio, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous() && q.device().is_cpu(),
              "qsa_attention: q must be contiguous float32 [T, Hq, D] on CPU");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() && kv_cache.size(4) == q.size(2),
              "qsa_attention: kv_cache must be contiguous [2, num_blocks, block_size, Hkv, D] with q's D");
  const int64_t Hq = q.size(1), Hkv = kv_cache.size(3), D = q.size(2);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= kMaxG, "qsa_attention: ", Hq, " query heads over ", Hkv,
              " kv heads (at most ", kMaxG, " a group)");
  Rows rows = check_rows(block_tables, seq_idx, blocks, tail_start, kv_lens, ratio, q.size(0));
  rows.bs = kv_cache.size(2);
  count_keys(rows);
  at::Tensor out = at::empty({q.size(0), Hq, D}, q.options());
  auto by_dtype = [&](auto d_const) {
    constexpr int Dc = decltype(d_const)::value;
    if (kv_cache.scalar_type() == at::kBFloat16)
      run<c10::BFloat16, Dc>(q, kv_cache, rows, scale, out);
    else if (kv_cache.scalar_type() == at::kFloat)
      run<float, Dc>(q, kv_cache, rows, scale, out);
    else
      TORCH_CHECK(false, "qsa_attention: a bf16 or float32 KV cache (got ", kv_cache.scalar_type(), ")");
  };
  switch (D) {  // keep in step with HEAD_SIZES in cpu_qsa_attention.py
    case 16: by_dtype(std::integral_constant<int, 16>{}); break;
    case 32: by_dtype(std::integral_constant<int, 32>{}); break;
    case 64: by_dtype(std::integral_constant<int, 64>{}); break;
    case 80: by_dtype(std::integral_constant<int, 80>{}); break;
    case 96: by_dtype(std::integral_constant<int, 96>{}); break;
    case 128: by_dtype(std::integral_constant<int, 128>{}); break;
    case 256: by_dtype(std::integral_constant<int, 256>{}); break;
    default: TORCH_CHECK(false, "qsa_attention: head size ", D, " not compiled");
  }
  return out;
}

// float32 lanes of this build: 16 (AVX-512) or 8 (AVX2), for the tests to tell the builds apart.
int64_t qsa_attention_lanes() { return kLanes; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def(
      "qsa_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_idx, Tensor blocks, "
      "Tensor tail_start, Tensor kv_lens, int ratio, float scale) -> Tensor");
  m.def("qsa_attention_lanes() -> int", &qsa_attention_lanes);  // no tensor to dispatch on: for every key
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) { m.impl("qsa_attention", &qsa_attention); }
