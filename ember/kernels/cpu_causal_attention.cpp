// Causal attention for a prompt (or prefill chunk) on CPU, flash-style: scores, online softmax and
// P V in one pass per key tile; nothing of size queries x keys is ever written to memory. Two kernels
// of one structure (tasks of a kv head x 16 queries, costliest first; K / V repacked once per call;
// GQA's query heads share each K / V tile). See cpu_causal_attention.py for when each runs.
//
// bf16 queries (builds with AVX512-BF16): vdpbf16ps dot products (32 bf16 products summed into 16
// float32 lanes per instruction) for both GEMMs. K and V of each kv head are repacked so that a
// 512-bit register holds what one vdpbf16ps needs: K as 32-bit words (K[key][2p], K[key][2p+1]) for
// 16 keys side by side, V as words (V[2j][d], V[2j+1][d]) for 16 d side by side. Query rows are
// broadcast a word (2 bf16) at a time; probabilities are rounded to bf16 pairs (keys 2j, 2j+1) the
// same way.
//
// float32 queries over float32 or bf16 K / V (every build: 16 lanes with AVX-512, 8 with AVX2 + FMA,
// the machines where --dtype auto is float32): FMA dot products, all in float32. See the fp32
// namespace below.
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

#if defined(__AVX512F__) && defined(__AVX512BF16__)
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

#endif  // __AVX512F__ && __AVX512BF16__

namespace {
namespace fp32 {

// ---- 8 or 16 float32 lanes: the vector ops the kernel uses, one definition per build
#if defined(__AVX512F__)
// rows (query, head) a pass takes through a tile, and V vectors of a row it keeps in registers through
// P V: 8 score and 16 P V accumulators of 32 zmm (4 x 4, 8 x 2 and 12 x 2 measured alike on a Xeon)
constexpr int kRows = 4, kMaxChunk = 4;
using namespace ember_simd::avx512;  // the lane ops: cpu_simd.h
// x in its first n lanes (n may be <= 0 or >= kLanes), -inf in the others: the causal edge
inline vec first_live(vec x, int64_t n) {
  const __mmask16 live = n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
  return _mm512_mask_mov_ps(vset(-std::numeric_limits<float>::infinity()), live, x);
}
#elif defined(__AVX2__) && defined(__FMA__)
// 6 rows: 12 accumulators + 2 K (or V) vectors + a broadcast of 16 ymm. Twelve independent FMA chains
// cover Haswell's and Zen2's 5-cycle FMA latency at 2 a cycle (8 do not); 3-20% faster than 4 rows x 2
// on a Xeon with -march=haswell (CPU time of 1 thread, 512-1,000 tokens, heads 64 and 256 wide)
constexpr int kRows = 6, kMaxChunk = 2;
using namespace ember_simd::avx2;
inline vec first_live(vec x, int64_t n) {
  const float live = (float)std::clamp<int64_t>(n, 0, kLanes);
  const vec keep = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), vset(live), _CMP_LT_OQ);
  return _mm256_blendv_ps(vset(-std::numeric_limits<float>::infinity()), x, keep);
}
#else
#error "the causal attention kernel needs AVX-512F or AVX2 + FMA (cpp_build.KERNELS says where it is built)"
#endif

constexpr int kTile = 2 * kLanes;  // keys per tile: two score vectors per row
constexpr int kQueries = 16;       // queries per task: they share each K / V tile while it is in L1

// V vectors of a row one P V pass holds: the most, up to kMaxChunk, that divides D / kLanes
template <int D>
constexpr int chunk() {
  int c = kMaxChunk;
  while ((D / kLanes) % c != 0) c /= 2;
  return c;
}

inline float widen(float x) { return x; }
inline float widen(uint16_t x) {  // bf16 -> float32: exact, its 16 bits are float32's top half
  const uint32_t w = (uint32_t)x << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

// K of one kv head -> float32 [tiles of kTile keys][D][kTile keys] (a tile's keys side by side for
// each d: a query's scores are D broadcast-FMAs), V -> float32 [key][D]; keys past S are zero (their
// scores are masked, their probabilities 0: zero, not garbage, so that 0 * V is 0).
template <int D, typename T>
void pack_head(const T* k, const T* v, int64_t S, int64_t k_row, int64_t v_row, float* kp, float* vp, int64_t S_pad) {
  for (int64_t key = 0; key < S_pad; ++key) {
    float* kt = kp + key / kTile * D * kTile + key % kTile;
    float* vt = vp + key * D;
    for (int d = 0; d < D; ++d) {
      kt[d * kTile] = key < S ? widen(k[key * k_row + d]) : 0.f;
      vt[d] = key < S ? widen(v[key * v_row + d]) : 0.f;
    }
  }
}

// Scores of R rows against the kTile keys of tile kt_ (scaled) into x [R][kTile]. The 2R accumulators
// stay in registers through the D FMAs only where every loop over them is unrolled (else GCC keeps
// the array in memory and stores all of it every step of d), so they go to memory once, here.
template <int D, int R>
inline void scores(const float* const* __restrict q, const float* __restrict kt_, float scale, float* __restrict x) {
  vec s[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = vzero();
  for (int d = 0; d < D; ++d) {
    const vec a = vload(kt_ + d * kTile), b = vload(kt_ + d * kTile + kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vec qd = vset(q[r][d]);
      s[r][0] = vfma(qd, a, s[r][0]);
      s[r][1] = vfma(qd, b, s[r][1]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    vstore(x + r * kTile, vmul(s[r][0], vset(scale)));
    vstore(x + r * kTile + kLanes, vmul(s[r][1], vset(scale)));
  }
}

// o [R][D] = o * alpha + P V over the first `keys` keys of the tile (V rows vt, D apart), C vectors of
// a row at a time: R x C accumulators in registers (unrolled, as in scores).
template <int D, int R>
inline void p_times_v(const float* __restrict p, const float* __restrict alpha, const float* __restrict vt,
                      int64_t keys, float* __restrict o) {
  constexpr int C = chunk<D>();
  for (int c = 0; c < D; c += C * kLanes) {
    vec acc[R][C];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < C; ++j) acc[r][j] = vmul(vload(o + r * D + c + j * kLanes), vset(alpha[r]));
    for (int64_t key = 0; key < keys; ++key) {
      vec row[C];
#pragma GCC unroll 16
      for (int j = 0; j < C; ++j) row[j] = vload(vt + key * D + c + j * kLanes);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const vec pb = vset(p[r * kTile + key]);
#pragma GCC unroll 16
        for (int j = 0; j < C; ++j) acc[r][j] = vfma(pb, row[j], acc[r][j]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int j = 0; j < C; ++j) vstore(o + r * D + c + j * kLanes, acc[r][j]);
  }
}

// R rows of a task (consecutive (query, head in group) pairs of one kv head) against key tile kt:
// scores, the online-softmax update of (m, l) and the float32 accumulators o [R][D] (in memory
// between tiles: a task's rows take turns on the tile). Row r's query sees keys < L[r], at least
// one of them in this tile.
template <int D, int R>
inline void tile_step(const float* const* __restrict q, const int64_t* L, const float* __restrict kp,
                      const float* __restrict vp, int64_t kt, float scale, float* __restrict o, float* __restrict m,
                      float* __restrict l) {
  alignas(64) float x[R][kTile];  // scores, then probabilities
  scores<D, R>(q, kp + kt * D * kTile, scale, &x[0][0]);
  alignas(64) float shift[kLanes] = {};  // m_old - m_new per row: one vector exp for the R rescales
  float sum[R];
  int64_t keys = 0;  // keys of the tile any row sees
  for (int r = 0; r < R; ++r) {
    const int64_t live = L[r] - kt * kTile;
    keys = std::max<int64_t>(keys, std::min<int64_t>(live, kTile));
    const vec x0 = first_live(vload(x[r]), live), x1 = first_live(vload(x[r] + kLanes), live - kLanes);
    const float mx = std::max(m[r], hmax(vmax(x0, x1)));
    const vec p0 = ember_simd::exp_nonpositive(vsub(x0, vset(mx)));
    const vec p1 = ember_simd::exp_nonpositive(vsub(x1, vset(mx)));
    shift[r] = m[r] - mx;  // -inf on the first tile: alpha 0
    m[r] = mx;
    sum[r] = hsum(vadd(p0, p1));
    vstore(x[r], p0);
    vstore(x[r] + kLanes, p1);
  }
  alignas(64) float alpha[kLanes];
  vstore(alpha, ember_simd::exp_nonpositive(vload(shift)));
  for (int r = 0; r < R; ++r) l[r] = l[r] * alpha[r] + sum[r];
  p_times_v<D, R>(&x[0][0], alpha, vp + kt * kTile * D, keys, o);
}

// The last rows - r0 < kRows rows of a pass (R of them), one tile_step of that many.
template <int D, int R>
inline void tail_rows(const float* const* q, const int64_t* L, const float* kp, const float* vp, int64_t kt,
                      float scale, float* o, float* m, float* l, int64_t rest) {
  if constexpr (R > 0) {
    if (rest == R) return tile_step<D, R>(q, L, kp, vp, kt, scale, o, m, l);
    tail_rows<D, R - 1>(q, L, kp, vp, kt, scale, o, m, l, rest);
  }
}

// Rows [r0, rows) of a task against tile kt, kRows at a time (m, l: the rows' running max and sum).
template <int D>
void tile_rows(const float* const* q, const int64_t* L, const float* kp, const float* vp, int64_t kt, float scale,
               float* o, float* m, float* l, int64_t r0, int64_t rows) {
  int64_t r = r0;
  for (; r + kRows <= rows; r += kRows) tile_step<D, kRows>(q + r, L + r, kp, vp, kt, scale, o + r * D, m + r, l + r);
  tail_rows<D, kRows - 1>(q + r, L + r, kp, vp, kt, scale, o + r * D, m + r, l + r, rows - r);
}

// The shapes of one call: q [n, Hq, D] (rows q_row apart) over S keys of Hkv heads; out [n, Hq, D].
struct Shape {
  int64_t n, Hq, S, Hkv, q_row;
};

// Tasks (kv head, block of kQueries queries) over the packed K / V, the costliest (last) blocks first,
// taken one at a time by whichever thread is free: causal blocks differ in cost up to S / kQueries
// times. A task's rows are (query, head in group) pairs in that order, so a pass of kRows rows
// serves any group size; the rows that see no key of a tile (the causal edge) are skipped.
template <int D>
void attend(const Shape& s, const float* qb, const float* kp, const float* vp, int64_t S_pad, float scale, float* ob) {
  const int64_t G = s.Hq / s.Hkv, ctx = s.S - s.n;
  const int64_t blocks = (s.n + kQueries - 1) / kQueries, tasks = s.Hkv * blocks;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const int64_t most = kQueries * G;
    std::vector<float> o((size_t)most * D), ml((size_t)most * 2);
    std::vector<const float*> q(most);
    std::vector<int64_t> L(most);
    for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
      const int64_t blk = blocks - 1 - t / s.Hkv, h = t % s.Hkv;
      const int64_t i0 = blk * kQueries, i1 = std::min<int64_t>(s.n, i0 + kQueries), rows = (i1 - i0) * G;
      std::fill(o.begin(), o.begin() + rows * D, 0.f);
      std::fill(ml.begin(), ml.begin() + most, -std::numeric_limits<float>::infinity());
      std::fill(ml.begin() + most, ml.end(), 0.f);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r / G;
        q[r] = qb + i * s.q_row + (h * G + r % G) * D;
        L[r] = ctx + i + 1;
      }
      const float* kh = kp + h * S_pad * D;
      const float* vh = vp + h * S_pad * D;
      const int64_t last_tile = (ctx + i1 - 1) / kTile;  // the block's last query sees keys < ctx + i1
      for (int64_t kt = 0; kt <= last_tile; ++kt) {
        const int64_t first = std::max<int64_t>(i0, kt * kTile - ctx);  // the first query that sees the tile
        tile_rows<D>(q.data(), L.data(), kh, vh, kt, scale, o.data(), ml.data(), ml.data() + most, (first - i0) * G,
                     rows);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const vec inv = vset(1.f / ml[most + r]);
        float* dst = ob + ((i0 + r / G) * s.Hq + h * G + r % G) * D;
        for (int d = 0; d < D; d += kLanes) vstore(dst + d, vmul(vload(o.data() + r * D + d), inv));
      }
    }
  });
}

template <int D, typename T>
void run(const Shape& s, const float* qb, const T* kb, const T* vb, int64_t k_row, int64_t v_row, float scale,
         float* ob) {
  const int64_t S_pad = (s.S + kTile - 1) / kTile * kTile;
  std::vector<float> kp((size_t)s.Hkv * S_pad * D), vp((size_t)s.Hkv * S_pad * D);
  at::parallel_for(0, s.Hkv, 1, [&](int64_t b, int64_t e) {
    for (int64_t h = b; h < e; ++h)
      pack_head<D, T>(kb + h * D, vb + h * D, s.S, k_row, v_row, kp.data() + h * S_pad * D,
                      vp.data() + h * S_pad * D, S_pad);
  });
  attend<D>(s, qb, kp.data(), vp.data(), S_pad, scale, ob);
}

template <int D>
void run_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& out) {
  const Shape s{q.size(0), q.size(1), k.size(0), k.size(1), q.stride(0)};
  const float* qb = q.data_ptr<float>();
  float* ob = out.data_ptr<float>();
  if (k.scalar_type() == at::kBFloat16)
    run<D, uint16_t>(s, qb, reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
                     reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()), k.stride(0), v.stride(0),
                     (float)scale, ob);
  else
    run<D, float>(s, qb, k.data_ptr<float>(), v.data_ptr<float>(), k.stride(0), v.stride(0), (float)scale, ob);
}

}  // namespace fp32
}  // namespace

// q [n, Hq, D] float32 at positions S-n .. S-1 over k / v [S, Hkv, D] float32 or bf16 (one dtype;
// positions 0 .. S-1): query i sees keys <= S - n + i. Rows may be strided (the fused qkv
// projection's views); each row's heads contiguous. Returns [n, Hq, D] float32, the softmax scale
// applied to the float32 scores.
at::Tensor causal_attention_f32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "q must be float32, k and v both float32 or both bf16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes(), "q [n, Hq, D], k / v [S, Hkv, D]");
  const int64_t D = q.size(2);
  TORCH_CHECK(k.size(2) == D && q.size(1) % k.size(1) == 0 && k.size(0) >= q.size(0), "head shapes do not match");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "q: rows of [Hq, D]");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D, "k / v: rows of [Hkv, D]");
  auto out = at::empty({q.size(0), q.size(1), D}, q.options());
  if (q.size(0) == 0) return out;
  switch (D) {  // keep in step with HEAD_SIZES in cpu_causal_attention.py
    case 16: fp32::run_kv<16>(q, k, v, scale, out); break;
    case 32: fp32::run_kv<32>(q, k, v, scale, out); break;
    case 64: fp32::run_kv<64>(q, k, v, scale, out); break;
    case 80: fp32::run_kv<80>(q, k, v, scale, out); break;
    case 96: fp32::run_kv<96>(q, k, v, scale, out); break;
    case 128: fp32::run_kv<128>(q, k, v, scale, out); break;
    case 256: fp32::run_kv<256>(q, k, v, scale, out); break;
    default: TORCH_CHECK(false, "head size ", D, " not compiled");
  }
  return out;
}

// float32 lanes of this build's float32 kernel: 16 (AVX-512) or 8 (AVX2), for the tests to tell them apart.
int64_t causal_attention_lanes() { return fp32::kLanes; }

// Every build defines both ops (so that their fake kernels register anywhere); the bf16 one has a
// CPU kernel only in builds with AVX512-BF16 (cpu_causal_attention.py asks the CPU's flags first).
TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("causal_attention_bf16(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("causal_attention_f32(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("causal_attention_lanes() -> int", &causal_attention_lanes);  // no tensor to dispatch on: for every key
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  m.impl("causal_attention_bf16", &causal_attention_bf16);
#endif
  m.impl("causal_attention_f32", &causal_attention_f32);
}
