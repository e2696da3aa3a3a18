// Causal attention for a prompt (or prefill chunk) of bf16 queries on CPU, flash-style: scores,
// online softmax and P V in one pass per key tile, with AVX512-BF16 dot products (vdpbf16ps:
// 32 bf16 products summed into 16 float32 lanes per instruction) for both GEMMs. Nothing of
// size queries x keys is ever written to memory. See cpu_causal_attention.py for when it runs.
//
// Layout: K and V of each kv head are repacked once per call so that a 512-bit register holds
// what one vdpbf16ps needs: K as 32-bit words (K[key][2p], K[key][2p+1]) for 16 keys side by
// side, V as words (V[2j][d], V[2j+1][d]) for 16 d side by side. Query rows are broadcast a word
// (2 bf16) at a time; probabilities are rounded to bf16 pairs (keys 2j, 2j+1) the same way.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_simd.h"

namespace {

constexpr int kKeys = 32;     // keys per tile: two 16-lane score vectors per row
constexpr int kQueries = 16;  // queries per task: they share each K/V tile while it is in L1

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// K of one kv head -> [tiles of 16 keys][D/2 words][16 keys], V -> [key pairs][D words]; keys past
// S are zero (their scores are masked, their probabilities 0).
template <int D>
void pack_head(const uint16_t* k, const uint16_t* v, int64_t S, int64_t row_stride, uint32_t* kp, uint32_t* vp,
               int64_t S_pad) {
  for (int64_t t = 0; t < S_pad / 16; ++t)
    for (int p = 0; p < D / 2; ++p)
      for (int j = 0; j < 16; ++j) {
        const int64_t key = t * 16 + j;
        uint32_t w = 0;
        if (key < S) std::memcpy(&w, k + key * row_stride + 2 * p, 4);
        kp[(t * (D / 2) + p) * 16 + j] = w;
      }
  for (int64_t jp = 0; jp < S_pad / 2; ++jp)
    for (int d = 0; d < D; ++d) {
      const int64_t a = 2 * jp, b = 2 * jp + 1;
      const uint32_t lo = a < S ? v[a * row_stride + d] : 0, hi = b < S ? v[b * row_stride + d] : 0;
      vp[jp * D + d] = lo | (hi << 16);
    }
}

// One row group (R query heads of one query, all seeing keys 0 .. L-1) against key tile kt:
// scores, online-softmax update of (m, l) and the float32 accumulators o [R][D] (in memory between
// tiles: a task's queries take turns on the tile).
template <int D, int R>
inline void tile_step(const uint32_t* __restrict qw, int64_t q_stride_w, const uint32_t* __restrict kp,
                      const uint32_t* __restrict vp, int64_t kt, int64_t L, float scale, float* __restrict o,
                      float* __restrict m, float* __restrict l) {
  constexpr int V = D / 16;
  __m512 s[R][2];
  for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
  const uint32_t* k0 = kp + (2 * kt) * (D / 2) * 16;
  const uint32_t* k1 = k0 + (D / 2) * 16;
  for (int p = 0; p < D / 2; ++p) {
    const __m512i a = _mm512_loadu_si512(k0 + p * 16), b = _mm512_loadu_si512(k1 + p * 16);
    for (int r = 0; r < R; ++r) {
      const __m512i qb = _mm512_set1_epi32((int)qw[r * q_stride_w + p]);
      s[r][0] = _mm512_dpbf16_ps(s[r][0], as_bh(qb), as_bh(a));
      s[r][1] = _mm512_dpbf16_ps(s[r][1], as_bh(qb), as_bh(b));
    }
  }
  // keys >= L masked (the causal edge and the zero padding after S)
  const int64_t live = L - kt * kKeys;
  const __mmask16 m0 = live >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << std::max<int64_t>(live, 0)) - 1);
  const __mmask16 m1 = live >= 32 ? (__mmask16)0xFFFF : live <= 16 ? (__mmask16)0 : (__mmask16)((1u << (live - 16)) - 1);
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) uint32_t pw[R][16];
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    const __m512 x0 = _mm512_mask_mul_ps(ninf, m0, s[r][0], vscale);
    const __m512 x1 = _mm512_mask_mul_ps(ninf, m1, s[r][1], vscale);
    const float mx = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(x0, x1)));
    const __m512 vmx = _mm512_set1_ps(mx);
    const __m512 p0 = ember_simd::exp_nonpositive(_mm512_sub_ps(x0, vmx));
    const __m512 p1 = ember_simd::exp_nonpositive(_mm512_sub_ps(x1, vmx));
    alpha[r] = std::exp(m[r] - mx);  // 0 on the first tile (m = -inf)
    m[r] = mx;
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
    _mm512_store_si512(pw[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));  // word j = keys (2j, 2j + 1)
  }
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * v), a);
  }
  const uint32_t* vt = vp + kt * (kKeys / 2) * D;
  const int64_t pairs = std::min<int64_t>(kKeys / 2, (live + 1) / 2);
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512i row[V];
    for (int v = 0; v < V; ++v) row[v] = _mm512_loadu_si512(vt + jp * D + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512i pb = _mm512_set1_epi32((int)pw[r][jp]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], as_bh(pb), as_bh(row[v]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(o + r * D + 16 * v, acc[r][v]);
}

template <int D, int R>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& out) {
  const int64_t n = q.size(0), Hq = q.size(1), S = k.size(0), Hkv = k.size(1), G = Hq / Hkv, ctx = S - n;
  const int64_t S_pad = (S + kKeys - 1) / kKeys * kKeys;
  const auto* qb = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* kb = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vb = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto* ob = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t q_row = q.stride(0), k_row = k.stride(0), v_row = v.stride(0);
  TORCH_CHECK(k.stride(0) == v.stride(0) && k.stride(1) == D && v.stride(1) == D, "k / v: rows of [Hkv, D]");
  std::vector<uint32_t> kp((size_t)Hkv * S_pad * D / 2), vp((size_t)Hkv * S_pad * D / 2);
  at::parallel_for(0, Hkv, 1, [&](int64_t b, int64_t e) {
    for (int64_t h = b; h < e; ++h)
      pack_head<D>(kb + h * D, vb + h * D, S, k_row, kp.data() + h * S_pad * D / 2, vp.data() + h * S_pad * D / 2,
                   S_pad);
  });
  // Tasks (kv head, block of kQueries queries), the costliest (last) blocks first, taken one at a
  // time by whichever thread is free: causal blocks differ in cost up to S / kQueries times.
  const int64_t blocks = (n + kQueries - 1) / kQueries, tasks = Hkv * blocks;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> o((size_t)kQueries * G * D), ml((size_t)kQueries * G * 2);
    for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
      const int64_t blk = blocks - 1 - t / Hkv, h = t % Hkv;
      const int64_t i0 = blk * kQueries, i1 = std::min<int64_t>(n, i0 + kQueries);
      std::fill(o.begin(), o.end(), 0.f);
      float* m = ml.data();
      float* l = m + kQueries * G;
      std::fill(m, l, -std::numeric_limits<float>::infinity());
      std::fill(l, l + kQueries * G, 0.f);
      const uint32_t* kh = kp.data() + h * S_pad * D / 2;
      const uint32_t* vh = vp.data() + h * S_pad * D / 2;
      const int64_t last_tile = (ctx + i1 - 1) / kKeys;  // the block's last query sees keys < ctx + i1
      for (int64_t kt = 0; kt <= last_tile; ++kt)
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t L = ctx + i + 1;
          if (L <= kt * kKeys) continue;
          for (int64_t g = 0; g < G; g += R) {
            const int64_t row = (i - i0) * G + g;
            const auto* qw = reinterpret_cast<const uint32_t*>(qb + i * q_row + (h * G + g) * D);
            tile_step<D, R>(qw, D / 2, kh, vh, kt, L, (float)scale, o.data() + row * D, m + row, l + row);
          }
        }
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t row = (i - i0) * G + g;
          const __m512 inv = _mm512_set1_ps(1.f / l[row]);
          uint16_t* dst = ob + (i * Hq + h * G + g) * D;
          for (int d = 0; d < D; d += 16) {
            const __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o.data() + row * D + d), inv));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)y);
          }
        }
    }
  });
}

template <int D>
void dispatch_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                   at::Tensor& out) {
  // R query heads of a group at a time, R | G: their accumulators (R * D / 16 vectors) and scores
  // (2 R) stay in registers through a tile. At most 16 accumulator vectors.
  const int64_t G = q.size(1) / k.size(1);
  constexpr int max_r = std::min(4, 256 / D);
  for (int r = max_r; r >= 1; --r) {
    if (G % r != 0) continue;
    switch (r) {
      case 4: if constexpr (max_r >= 4) return run<D, 4>(q, k, v, scale, out); break;
      case 3: if constexpr (max_r >= 3) return run<D, 3>(q, k, v, scale, out); break;
      case 2: if constexpr (max_r >= 2) return run<D, 2>(q, k, v, scale, out); break;
      default: return run<D, 1>(q, k, v, scale, out);
    }
  }
}

}  // namespace

// q [n, Hq, D] bf16 at positions S-n .. S-1 over k / v [S, Hkv, D] bf16 (positions 0 .. S-1): query
// i sees keys <= S - n + i. Rows may be strided (the fused qkv projection's views); each row's heads
// contiguous. Returns [n, Hq, D] bf16, the softmax scale applied to the float32 scores.
at::Tensor causal_attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "q, k, v must be bf16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes(), "q [n, Hq, D], k / v [S, Hkv, D]");
  const int64_t D = q.size(2);
  TORCH_CHECK(k.size(2) == D && q.size(1) % k.size(1) == 0 && k.size(0) >= q.size(0), "head shapes do not match");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "q: rows of [Hq, D]");
  auto out = at::empty({q.size(0), q.size(1), D}, q.options());
  if (q.size(0) == 0) return out;
  switch (D) {  // keep in step with HEAD_SIZES in cpu_causal_attention.py
    case 16: dispatch_rows<16>(q, k, v, scale, out); break;
    case 32: dispatch_rows<32>(q, k, v, scale, out); break;
    case 64: dispatch_rows<64>(q, k, v, scale, out); break;
    case 80: dispatch_rows<80>(q, k, v, scale, out); break;
    case 96: dispatch_rows<96>(q, k, v, scale, out); break;
    case 128: dispatch_rows<128>(q, k, v, scale, out); break;
    case 256: dispatch_rows<256>(q, k, v, scale, out); break;
    default: TORCH_CHECK(false, "head size ", D, " not compiled");
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("causal_attention_bf16(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) { m.impl("causal_attention_bf16", &causal_attention_bf16); }
