// Paged attention for a few queries per sequence on CPU (decode, speculative verify), fused:
// each (query, kv head) task walks its sequence's blocks in the cache directly, converts K/V
// rows to float32 as it reads them, and keeps a running max / sum (online softmax) per query
// head of the group, so K/V are read once per task and never gathered, padded or widened
// in memory. See cpu_paged_attention.py for why and how it is built.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

namespace {

constexpr int kTile = 32;  // keys scored per online-softmax update
constexpr int kMaxG = 16;  // query heads per kv head
constexpr int kMaxD = 256;

// Element -> float. bf16 is the top half of a float32: a shift, which the compiler vectorizes
// (c10::BFloat16's own conversion goes through a memcpy it does not).
template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }
template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T, int D>
void attend(const float* __restrict qs, const T* __restrict kc, const T* __restrict vc,
            const int32_t* __restrict table, int64_t kv_len, int64_t bs, int64_t row_stride, int64_t G,
            float* __restrict out) {
  // qs: G query heads [G, D], already scaled; kc/vc point at this kv head in block 0, slot 0;
  // row_stride = elements between consecutive slots (Hkv * D); out: [G, D] float32.
  alignas(64) float acc[kMaxG][D];
  alignas(64) float s[kMaxG][kTile];
  alignas(64) float row[D];
  float m[kMaxG], l[kMaxG];
  for (int64_t g = 0; g < G; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
    for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
  }
  for (int64_t t0 = 0; t0 < kv_len; t0 += kTile) {
    const int64_t n = std::min<int64_t>(kTile, kv_len - t0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = t0 + j;
      const T* __restrict kp = kc + ((int64_t)table[t / bs] * bs + t % bs) * row_stride;
      for (int d = 0; d < D; ++d) row[d] = to_float(kp[d]);
      for (int64_t g = 0; g < G; ++g) {
        const float* __restrict qg = qs + g * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += qg[d] * row[d];
        s[g][j] = dot;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float mx = m[g];
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[g][j]);
      const float rescale = std::exp(m[g] - mx);  // exp(-inf) = 0 on the first tile
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        const float p = std::exp(s[g][j] - mx);
        s[g][j] = p;
        sum += p;
      }
      l[g] = l[g] * rescale + sum;
      m[g] = mx;
      if (rescale != 1.f)
        for (int d = 0; d < D; ++d) acc[g][d] *= rescale;
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = t0 + j;
      const T* __restrict vp = vc + ((int64_t)table[t / bs] * bs + t % bs) * row_stride;
      for (int d = 0; d < D; ++d) row[d] = to_float(vp[d]);
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[g][j];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[g][d] += p * row[d];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int d = 0; d < D; ++d) out[g * D + d] = acc[g][d] * inv;
  }
}

template <typename T>
void run(const torch::Tensor& qf, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
         const torch::Tensor& seq_idx, const torch::Tensor& kv_lens, torch::Tensor& out) {
  const int64_t Tq = qf.size(0), Hq = qf.size(1), D = qf.size(2);
  const int64_t NB = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3);
  const int64_t G = Hq / Hkv, W = block_tables.size(1);
  const T* kbase = kv_cache.data_ptr<T>();
  const T* vbase = kbase + NB * bs * Hkv * D;
  const float* q = qf.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* sidx = seq_idx.data_ptr<int32_t>();
  const int32_t* lens = kv_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  auto body = [&](auto d_const) {
    constexpr int Dc = decltype(d_const)::value;
    at::parallel_for(0, Tq * Hkv, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task / Hkv, h = task % Hkv;
        attend<T, Dc>(q + (i * Hq + h * G) * D, kbase + h * D, vbase + h * D, tables + (int64_t)sidx[i] * W,
                      lens[i], bs, Hkv * D, G, o + (i * Hq + h * G) * D);
      }
    });
  };
  switch (D) {  // keep in step with HEAD_SIZES in cpu_paged_attention.py
    case 16: body(std::integral_constant<int, 16>{}); break;
    case 32: body(std::integral_constant<int, 32>{}); break;
    case 64: body(std::integral_constant<int, 64>{}); break;
    case 80: body(std::integral_constant<int, 80>{}); break;
    case 96: body(std::integral_constant<int, 96>{}); break;
    case 128: body(std::integral_constant<int, 128>{}); break;
    case 256: body(std::integral_constant<int, 256>{}); break;
    default: TORCH_CHECK(false, "head size ", D, " not compiled");
  }
}

}  // namespace

// q [T, Hq, D] float32 (scale folded in); kv_cache [2, NB, bs, Hkv, D] contiguous; block_tables
// [B, W] int32; seq_idx [T] int32 (query i reads block_tables[seq_idx[i]]); kv_lens [T] int32
// (query i sees keys 0 .. kv_lens[i]-1). Returns [T, Hq, D] float32.
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& seq_idx, const torch::Tensor& kv_lens) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be contiguous float32");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache must be contiguous [2, NB, bs, Hkv, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(), "block_tables: contiguous int32");
  TORCH_CHECK(seq_idx.scalar_type() == at::kInt && kv_lens.scalar_type() == at::kInt, "seq_idx / kv_lens: int32");
  TORCH_CHECK(q.size(1) % kv_cache.size(3) == 0 && q.size(2) == kv_cache.size(4), "head shapes do not match");
  TORCH_CHECK(q.size(1) / kv_cache.size(3) <= kMaxG, "more than ", kMaxG, " query heads per kv head");
  auto out = torch::empty_like(q);
  switch (kv_cache.scalar_type()) {
    case at::kBFloat16: run<c10::BFloat16>(q, kv_cache, block_tables, seq_idx, kv_lens, out); break;
    case at::kHalf: run<c10::Half>(q, kv_cache, block_tables, seq_idx, kv_lens, out); break;
    case at::kFloat: run<float>(q, kv_cache, block_tables, seq_idx, kv_lens, out); break;
    case at::kFloat8_e4m3fn: run<c10::Float8_e4m3fn>(q, kv_cache, block_tables, seq_idx, kv_lens, out); break;
    case at::kFloat8_e5m2: run<c10::Float8_e5m2>(q, kv_cache, block_tables, seq_idx, kv_lens, out); break;
    default: TORCH_CHECK(false, "unsupported kv cache dtype ", kv_cache.scalar_type());
  }
  return out;
}

// An op of the dispatcher (not a pybind function), so a compiled decode graph can call it too.
TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_idx, Tensor kv_lens) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
