// The kernel of cpu_paged_attention.cpp: its templates, instantiated per KV cache dtype by the two
// translation units that include this (cpu_paged_attention.cpp: bf16 and fp16 caches;
// cpu_paged_attention_fp32_fp8.cpp: float32 and fp8), which ninja compiles side by side -- the
// head size x group size x dtype specializations are most of the first build's wait.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#include "cpu_simd.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include "cpu_simd.h"
#define EMBER_ATTEND_AVX2 1
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kTile = 16;  // keys scored per online-softmax update
constexpr int kMaxG = 16;  // query heads per kv head
constexpr int64_t kMinSplit = 64;  // keys per part, at least, when a context is split over threads

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

// A sequence's keys from `start` on, a tile at a time: each key's element offset in the cache (K
// and V alike), one table lookup per block and no division by the run-time block size per key.
struct SlotWalk {
  const int32_t* table;
  int64_t bs, row_stride, blk, off;
  SlotWalk(const int32_t* t, int64_t block_size, int64_t stride, int64_t start)
      : table(t), bs(block_size), row_stride(stride), blk(start / block_size), off(start % block_size) {}
  void next(int64_t n, int64_t* __restrict slot) {
    for (int64_t j = 0; j < n; ++j) {
      slot[j] = ((int64_t)table[blk] * bs + off) * row_stride;
      if (++off == bs) {
        off = 0;
        ++blk;
      }
    }
  }
};


// One tile of a head's online softmax: s[0..n) <- exp(s - m') with m' the running max *m folded with
// the tile's; *l <- *l * exp(*m - m') + sum of the new s; *m <- m'. Returns exp(*m - m'), the factor
// the head's accumulators must be scaled by (0 on the first tile: exp(-inf)).
inline float softmax_tile(float* __restrict s, int64_t n, float* m, float* l) {
  const float m_old = *m;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_set1_ps(m_old);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
    vmax = _mm512_mask_max_ps(vmax, k, vmax, _mm512_maskz_loadu_ps(k, s + j));
  }
  const float mx = _mm512_reduce_max_ps(vmax);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
    const __m512 p = _mm512_maskz_mov_ps(k, ember_simd::exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), vmx)));
    _mm512_mask_storeu_ps(s + j, k, p);
    vsum = _mm512_add_ps(vsum, p);
  }
  const float sum = _mm512_reduce_add_ps(vsum);
#elif defined(EMBER_ATTEND_AVX2)
  float mx = m_old;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  const __m256 vmx = _mm256_set1_ps(mx);
  float sum = 0.f;
  int64_t j = 0;
  __m256 vsum = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 p = ember_simd::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
    _mm256_storeu_ps(s + j, p);
    vsum = _mm256_add_ps(vsum, p);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vsum);
  for (float v : lanes) sum += v;
  for (; j < n; ++j) {  // the tail of a short tile
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
#else
  float mx = m_old;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
#endif
  const float rescale = std::exp(m_old - mx);
  *l = *l * rescale + sum;
  *m = mx;
  return rescale;
}

#if defined(__AVX512F__)
// 16 cache elements -> float32 lanes (the types the vector path takes; fp8 stays on the scalar one).
template <typename T>
struct Vec16 : std::false_type {};
template <>
struct Vec16<c10::BFloat16> : std::true_type {
  static __m512 load(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};
template <>
struct Vec16<c10::Half> : std::true_type {
  static __m512 load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};
template <>
struct Vec16<float> : std::true_type {
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
};

// Rows of D cache elements as D/16 float32 vectors. bf16 with D % 32 == 0 loads 32 elements per
// 512-bit read and splits them by one op each: even elements (shifted up) and odd ones (masked),
// so lane i of vector 2r + p holds element 32r + 2i + p. Queries are laid out in that same order
// (dot products do not care) and outputs are put back in order at the end (lane_of).
// load_part(p, r, out): part r of the row, kPart vectors (vectors r * kPart .. of load()).
template <typename T, int D>
struct RowLoad {
  static constexpr bool kPaired = false;
  static constexpr int kPart = 1;
  static constexpr int lane_of(int e) { return e; }
  static void load(const T* p, __m512* out) {
    for (int v = 0; v < D / 16; ++v) out[v] = Vec16<T>::load(p + 16 * v);
  }
  static void load_part(const T* p, int r, __m512* out) { out[0] = Vec16<T>::load(p + 16 * r); }
};
template <int D>
struct RowLoad<c10::BFloat16, D> {
  static constexpr bool kPaired = D % 32 == 0;
  static constexpr int kPart = kPaired ? 2 : 1;
  static void load_part(const c10::BFloat16* p, int r, __m512* out) {
    if constexpr (kPaired) {
      const __m512i x = _mm512_loadu_si512(reinterpret_cast<const void*>(p + 32 * r));
      out[0] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      out[1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
    } else {
      out[0] = Vec16<c10::BFloat16>::load(p + 16 * r);
    }
  }
  static constexpr int lane_of(int e) {
    return kPaired ? (2 * (e / 32) + (e % 2)) * 16 + (e % 32) / 2 : e;
  }
  static void load(const c10::BFloat16* p, __m512* out) {
    if constexpr (kPaired) {
      const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
      for (int r = 0; r < D / 32; ++r) {
        const __m512i x = _mm512_loadu_si512(reinterpret_cast<const void*>(p + 32 * r));
        out[2 * r] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        out[2 * r + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
      }
    } else {
      for (int v = 0; v < D / 16; ++v) out[v] = Vec16<c10::BFloat16>::load(p + 16 * v);
    }
  }
};

// x[j] = 16 partial sums of key j's score -> lane j = key j's score: pairs of vectors halve their
// width per level (lanes of a and b side by side, then each pair of neighbours added).
inline __m512 sum_lanes_of_16(const float (*x)[16]) {
  __m512 v[16];
  for (int j = 0; j < 16; ++j) v[j] = _mm512_load_ps(x[j]);
  alignas(64) static const int32_t lo[4][16] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                                               {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                                               {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
                                               {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
  static const int width[4] = {8, 4, 2, 1};
  for (int level = 0, n = 16; level < 4; ++level, n /= 2) {
    const __m512i il = _mm512_load_si512(lo[level]);
    const __m512i ih = _mm512_add_epi32(il, _mm512_set1_epi32(width[level]));
    for (int i = 0; i < n / 2; ++i)
      v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], il, v[2 * i + 1]),
                           _mm512_permutex2var_ps(v[2 * i], ih, v[2 * i + 1]));
  }
  return v[0];
}

// Into L2 (T1), not L1: a T0 prefetch that misses holds one of L1's few miss buffers until DRAM
// answers, so a tile's 192 lines queued behind them and stalled the loads; L2 has more.
// benchmarks/micro_paged_attention.py, 2 Zen4 threads: 1.55-1.87 -> 0.96-1.08 ms a layer.
template <typename T, int D>
inline void prefetch_row(const T* p) {
  for (int b = 0; b < D * (int)sizeof(T); b += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T1);
}

// One query against keys k_begin .. k_end - 1 of its sequence, every kv head in one task: a tile's
// K/V slots hold all heads side by side (Hkv * D elements), so walking heads inside a tile reads
// the cache front to back while the next tile's rows are prefetched. (A task per kv head, which read
// 128 of every 384 bytes of a slot for the default model, ran at a third of the memory bandwidth.)
// Each head's group of kG query heads keeps its query and accumulator rows in registers while it
// scores a tile; between tiles they live in acc (the output rows, [Hkv * kG, D] in lane order).
//
// m_out == nullptr: acc ends as the normalized attention. Else a split of the context (see run):
// acc = the unnormalized accumulators, m_out / l_out = running max and sum per query head, merged
// by merge_splits. Either way acc is still in lane order (RowLoad::lane_of).
//
// kDot (bf16 cache and bf16 queries, D % 32 == 0): scores from vdpbf16ps on the raw K rows and the
// unscaled bf16 query rows qb (exact products, float32 sums), the 16 keys' partial-sum vectors of a
// tile folded into one score vector by a transpose-and-add tree (15 two-source permutes and adds
// instead of 16 horizontal sums), then times scale. Else float32 query rows qs, already scaled and
// in lane order.
template <typename T, int D, int kG, bool kDot>
void attend_vec(const float* __restrict qs, const uint16_t* __restrict qb, float scale, const T* __restrict kc,
                const T* __restrict vc, const int32_t* __restrict table, int64_t k_begin, int64_t k_end, int64_t bs,
                int64_t Hkv, float* __restrict acc, float* __restrict m_out = nullptr, float* __restrict l_out = nullptr) {
  static_assert(!kDot || (std::is_same<T, c10::BFloat16>::value && D % 32 == 0 && kTile == 16), "dot path: bf16 rows");
  constexpr int V = D / 16;
  using Row = RowLoad<T, D>;
  const int64_t Hq = Hkv * kG, row_stride = Hkv * D;
  std::vector<float> ml(2 * Hq);  // running max and sum per query head
  float* m = ml.data();
  float* l = m + Hq;
  for (int64_t g = 0; g < Hq; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
    for (int d = 0; d < D; ++d) acc[g * D + d] = 0.f;
  }
  alignas(64) float s[kG][kTile];
  alignas(64) int64_t slot[kTile], next_slot[kTile];
  SlotWalk walk(table, bs, row_stride, k_begin);
  int64_t n = std::min<int64_t>(kTile, k_end - k_begin);
  if (n > 0) walk.next(n, slot);
  for (int64_t t0 = k_begin; t0 < k_end; t0 += kTile) {
    // The next tile's K/V rows are requested while this tile is scored, a head's rows in the loop
    // over that head's keys, so their memory loads overlap the math: blocks are scattered over the
    // pool, which the hardware prefetcher cannot follow, and one burst of every row stalled on the
    // core's few outstanding misses.
    const int64_t n_next = std::min<int64_t>(kTile, k_end - t0 - kTile);
    if (n_next > 0) walk.next(n_next, next_slot);
    // past the next tile's keys, "prefetch" this tile's own rows (in cache already): the key loops
    // below then prefetch unconditionally, and with no branch in them GCC keeps a head's
    // accumulators in registers (with `if (j < n_next)` it stored all 12 to the stack every key and
    // kept one in memory, a store-to-load chain per key)
    for (int64_t j = std::max<int64_t>(n_next, 0); j < n; ++j) next_slot[j] = slot[j];
    for (int64_t h = 0; h < Hkv; ++h) {
      const T* __restrict kh = kc + h * D;
      const T* __restrict vh = vc + h * D;
      float* __restrict ah = acc + h * kG * D;
      if constexpr (kDot) {
        constexpr int W = D / 32;  // 512-bit words of bf16 per row
        __m512i q[kG][W];
        for (int g = 0; g < kG; ++g)
          for (int w = 0; w < W; ++w) q[g][w] = _mm512_loadu_si512(qb + (h * kG + g) * D + 32 * w);
        alignas(64) float part[kG][kTile][16];  // per key, 16 partial sums of its score
        for (int64_t j = 0; j < n; ++j) {
          prefetch_row<T, D>(kh + next_slot[j]);
          __m512i k[W];
          for (int w = 0; w < W; ++w) k[w] = _mm512_loadu_si512(reinterpret_cast<const void*>(kh + slot[j] + 32 * w));
          for (int g = 0; g < kG; ++g) {
            __m512 t = _mm512_setzero_ps();
            for (int w = 0; w < W; ++w) t = _mm512_dpbf16_ps(t, (__m512bh)q[g][w], (__m512bh)k[w]);
            _mm512_store_ps(part[g][j], t);
          }
        }
        const __m512 vscale = _mm512_set1_ps(scale);
        for (int g = 0; g < kG; ++g) {
          for (int64_t j = n; j < kTile; ++j) _mm512_store_ps(part[g][j], _mm512_setzero_ps());
          _mm512_store_ps(s[g], _mm512_mul_ps(sum_lanes_of_16(part[g]), vscale));
        }
      } else {
        __m512 q[kG][V];
        for (int g = 0; g < kG; ++g)
          for (int v = 0; v < V; ++v) q[g][v] = _mm512_loadu_ps(qs + (h * kG + g) * D + 16 * v);
        for (int64_t j = 0; j < n; ++j) {
          prefetch_row<T, D>(kh + next_slot[j]);
          __m512 k[V];
          Row::load(kh + slot[j], k);
          for (int g = 0; g < kG; ++g) {
            __m512 t = _mm512_mul_ps(q[g][0], k[0]);
            for (int v = 1; v < V; ++v) t = _mm512_fmadd_ps(q[g][v], k[v], t);
            s[g][j] = _mm512_reduce_add_ps(t);
          }
        }
      }
      float rescale[kG];
      for (int g = 0; g < kG; ++g) rescale[g] = softmax_tile(s[g], n, &m[h * kG + g], &l[h * kG + g]);
      // P V one part of the rows at a time (Row::kPart vectors: one 512-bit read), the kG x kPart
      // accumulators in registers over the tile's keys, the first part prefetching the next tile's
      // V rows. (All D / 16 vectors at once, GCC kept a shadow copy of each accumulator and stored
      // all of them to the stack every key, one living in memory: a store-to-load chain per key.)
      // Each accumulator sees the same rescale and FMAs in the same order as before: same bits.
      constexpr int P = Row::kPart;
      auto pv_part = [&](int r, auto prefetch) {
        __m512 a[kG][P];
        for (int g = 0; g < kG; ++g)
          for (int i = 0; i < P; ++i) {
            a[g][i] = _mm512_loadu_ps(ah + g * D + 16 * (r * P + i));
            if (rescale[g] != 1.f) a[g][i] = _mm512_mul_ps(a[g][i], _mm512_set1_ps(rescale[g]));
          }
        for (int64_t j = 0; j < n; ++j) {
          if constexpr (decltype(prefetch)::value) prefetch_row<T, D>(vh + next_slot[j]);
          __m512 row[P];
          Row::load_part(vh + slot[j], r, row);
          for (int g = 0; g < kG; ++g) {
            const __m512 p = _mm512_set1_ps(s[g][j]);
            for (int i = 0; i < P; ++i) a[g][i] = _mm512_fmadd_ps(p, row[i], a[g][i]);
          }
        }
        for (int g = 0; g < kG; ++g)
          for (int i = 0; i < P; ++i) _mm512_storeu_ps(ah + g * D + 16 * (r * P + i), a[g][i]);
      };
      pv_part(0, std::true_type{});
      for (int r = 1; r < V / P; ++r) pv_part(r, std::false_type{});
    }
    std::memcpy(slot, next_slot, sizeof(slot));
    n = n_next;
  }
  for (int64_t g = 0; g < Hq; ++g) {
    if (m_out != nullptr) {
      m_out[g] = m[g];
      l_out[g] = l[g];
      continue;
    }
    const __m512 inv = _mm512_set1_ps(l[g] > 0.f ? 1.f / l[g] : 0.f);
    for (int v = 0; v < V; ++v)
      _mm512_storeu_ps(acc + g * D + 16 * v, _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * v), inv));
  }
}

// rows [n, D] between element order and RowLoad's lane order, in place
template <typename T, int D>
void to_lane_order(float* rows, int64_t n, bool forward) {
  using Row = RowLoad<T, D>;
  if constexpr (Row::kPaired) {
    alignas(64) float tmp[D];
    for (int64_t i = 0; i < n; ++i) {
      float* r = rows + i * D;
      for (int e = 0; e < D; ++e) {
        if (forward) tmp[Row::lane_of(e)] = r[e];
        else tmp[e] = r[Row::lane_of(e)];
      }
      std::memcpy(r, tmp, sizeof(tmp));
    }
  }
}
#endif

#if defined(EMBER_ATTEND_AVX2)
// attend()'s vector steps in the AVX2 build (Zen2/3, Haswell on: no AVX-512). 8 cache elements ->
// float32 lanes; fp8 stays on the portable loops.
template <typename T>
struct Vec8 : std::false_type {};
template <>
struct Vec8<float> : std::true_type {
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
};
template <>
struct Vec8<c10::Half> : std::true_type {
  static __m256 load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
};
template <>
struct Vec8<c10::BFloat16> : std::true_type {
  static __m256 load(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// attend()'s vector steps in the AVX2 build, rows read in place: a key's score for one head is
// two FMA chains over the row, summed across lanes once; P V keeps a head's output columns in
// registers, 64 at a time, while it walks the tile's keys. (The portable steps copied every row to
// a float buffer and reduced each dot product in one dependent chain: 33 us a layer at 200 keys,
// default model, 2 Zen3 threads, ~1 ms of a decode token.)
template <typename T, int D>
inline float dot_row(const float* __restrict q, const T* __restrict k) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
#pragma GCC unroll 32
  for (int d = 0; d < D; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), Vec8<T>::load(k + d), a0);
    if (d + 8 < D) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), Vec8<T>::load(k + d + 8), a1);
  }
  return hsum8(_mm256_add_ps(a0, a1));
}

// acc[0..D) += sum over the tile's n keys of p[j] * V row j
template <typename T, int D>
inline void accumulate_rows(const T* __restrict vc, const int64_t* __restrict slot, int64_t n,
                            const float* __restrict p, float* __restrict acc) {
#pragma GCC unroll 4
  for (int d0 = 0; d0 < D; d0 += 64) {
    constexpr int kMaxV = 8;
    const int nv = std::min(kMaxV, (D - d0) / 8);
    __m256 a[kMaxV];
    for (int v = 0; v < nv; ++v) a[v] = _mm256_loadu_ps(acc + d0 + 8 * v);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      const T* __restrict vp = vc + slot[j] + d0;
      for (int v = 0; v < nv; ++v) a[v] = _mm256_fmadd_ps(pj, Vec8<T>::load(vp + 8 * v), a[v]);
    }
    for (int v = 0; v < nv; ++v) _mm256_storeu_ps(acc + d0 + 8 * v, a[v]);
  }
}
#endif

// S partial results of one (query, kv head) task -> out [G, D]: rescale each split to the common max.
inline void merge_splits(const float* acc, const float* m, const float* l, int64_t S, int64_t G, int64_t D,
                         float* out) {
  for (int64_t g = 0; g < G; ++g) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < S; ++p) mx = std::max(mx, m[p * G + g]);
    float total = 0.f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = 0.f;
    for (int64_t p = 0; p < S; ++p) {
      if (l[p * G + g] == 0.f) continue;  // an empty split
      const float w = std::exp(m[p * G + g] - mx);
      total += w * l[p * G + g];
      const float* a = acc + (p * G + g) * D;
      for (int64_t d = 0; d < D; ++d) out[g * D + d] += w * a[d];
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] *= inv;
  }
}

template <typename T, int D, int kG>
void attend(const float* __restrict qs, const T* __restrict kc, const T* __restrict vc,
            const int32_t* __restrict table, int64_t k_begin, int64_t k_end, int64_t bs, int64_t row_stride,
            int64_t G_run, float* __restrict out, float* __restrict m_out = nullptr, float* __restrict l_out = nullptr) {
  // kG > 0: the group size as a constant, so the per-head loops unroll and their dot products
  // overlap (the common GQA ratios); 0: G_run at run time.
  const int64_t G = kG > 0 ? kG : G_run;
#if defined(EMBER_ATTEND_AVX2)
  constexpr bool kVec = Vec8<T>::value && D % 8 == 0;  // the vector steps above (fp8: these loops)
#endif
  // qs: G query heads [G, D], already scaled; kc/vc point at this kv head in block 0, slot 0;
  // row_stride = elements between consecutive slots (Hkv * D); out: [G, D] float32. Keys k_begin ..
  // k_end - 1; m_out != nullptr: a split of the context, out unnormalized and (m, l) per head out
  // for merge_splits, as attend_vec.
  alignas(64) float acc[kMaxG][D];
  alignas(64) float s[kMaxG][kTile];
  alignas(64) float row[D];
  float m[kMaxG], l[kMaxG];
  for (int64_t g = 0; g < G; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
    for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
  }
  alignas(64) int64_t slot[kTile];
  SlotWalk walk(table, bs, row_stride, k_begin);
  for (int64_t t0 = k_begin; t0 < k_end; t0 += kTile) {
    const int64_t n = std::min<int64_t>(kTile, k_end - t0);
    walk.next(n, slot);
    for (int64_t j = 0; j < n; ++j) {
      const T* __restrict kp = kc + slot[j];
#if defined(EMBER_ATTEND_AVX2)
      if constexpr (kVec) {
        for (int64_t g = 0; g < G; ++g) s[g][j] = dot_row<T, D>(qs + g * D, kp);
        continue;
      }
#endif
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
      const float rescale = softmax_tile(s[g], n, &m[g], &l[g]);
      if (rescale != 1.f)
        for (int d = 0; d < D; ++d) acc[g][d] *= rescale;
    }
#if defined(EMBER_ATTEND_AVX2)
    if constexpr (kVec) {
      for (int64_t g = 0; g < G; ++g) accumulate_rows<T, D>(vc, slot, n, s[g], acc[g]);
      continue;
    }
#endif
    for (int64_t j = 0; j < n; ++j) {
      const T* __restrict vp = vc + slot[j];
      for (int d = 0; d < D; ++d) row[d] = to_float(vp[d]);
      for (int64_t g = 0; g < G; ++g) {
        const float p = s[g][j];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[g][d] += p * row[d];
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

// Tasks of one query each, or, with fewer queries than twice the threads (batch-1 decode), each
// context split into S parts of at least kMinSplit keys: `one(i, k0, k1, acc, m, l)` runs query i
// over keys k0 .. k1 - 1 (m == nullptr: acc normalized, else a part), parts are merged after.
// Query i's [Hq, D] rows go to o + i * Hq * D; done(i) runs once they are final.
template <typename One, typename Done>
void split_tasks(int64_t Tq, int64_t Hq, int64_t D, const int32_t* lens, float* o, One&& one, Done&& done) {
  const int64_t threads = at::get_num_threads();
  int64_t longest = 0;
  for (int64_t i = 0; i < Tq; ++i) longest = std::max<int64_t>(longest, lens[i]);
  int64_t S = std::max<int64_t>(1, std::min<int64_t>((2 * threads + Tq - 1) / Tq, longest / kMinSplit));
  if (Tq == 1 && S > threads) S -= S % threads;  // whole rounds: 3 parts on 2 threads take 2 parts' time
  if (S == 1) {
    // Longest context first, each thread taking the next query when it is free: a thread's
    // contiguous half of the batch (parallel_for's split) can hold more keys than the other's
    // (the compare's 64 prompts of 128-512 tokens, seed 1000: 11,464 vs 9,365 keys).
    std::vector<int32_t> order(Tq);
    for (int64_t i = 0; i < Tq; ++i) order[i] = (int32_t)i;
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return lens[a] > lens[b]; });
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min<int64_t>(threads, Tq), 1, [&](int64_t, int64_t) {
      for (int64_t k; (k = next.fetch_add(1)) < Tq;) {
        const int64_t i = order[k];
        one(i, 0, lens[i], o + i * Hq * D, nullptr, nullptr);
        done(i);
      }
    });
    return;
  }
  std::vector<float> acc((size_t)Tq * S * Hq * D), ms((size_t)Tq * S * Hq), ls((size_t)Tq * S * Hq);
  at::parallel_for(0, Tq * S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t i = job / S, p = job % S;
      const int64_t chunk = (lens[i] + S - 1) / S;
      const int64_t k0 = std::min<int64_t>(lens[i], p * chunk), k1 = std::min<int64_t>(lens[i], k0 + chunk);
      one(i, k0, k1, acc.data() + job * Hq * D, ms.data() + job * Hq, ls.data() + job * Hq);
    }
  });
  for (int64_t i = 0; i < Tq; ++i) {
    merge_splits(acc.data() + i * S * Hq * D, ms.data() + i * S * Hq, ls.data() + i * S * Hq, S, Hq, D, o + i * Hq * D);
    done(i);
  }
}

template <typename T>
void run(const at::Tensor& q_in, double scale, const at::Tensor& kv_cache, const at::Tensor& block_tables,
         const at::Tensor& seq_idx, const at::Tensor& kv_lens, at::Tensor& out) {
  const int64_t Tq = q_in.size(0), Hq = q_in.size(1), D = q_in.size(2);
  const int64_t NB = kv_cache.size(1), bs = kv_cache.size(2), Hkv = kv_cache.size(3);
  const int64_t G = Hq / Hkv, W = block_tables.size(1);
  const T* kbase = kv_cache.data_ptr<T>();
  const T* vbase = kbase + NB * bs * Hkv * D;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* sidx = seq_idx.data_ptr<int32_t>();
  const int32_t* lens = kv_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  // bf16 queries over a bf16 cache score with bf16 dot products (attend_vec's kDot); every other
  // path takes float32 queries with the scale folded in (q.float() * scale, as torch computes it)
  const bool q_bf16 = q_in.scalar_type() == at::kBFloat16;
  const bool fixed_group = G == 1 || G == 2 || G == 3 || G == 4 || G == 8;  // the switch in body below
#if defined(__AVX512F__)
  constexpr bool kDotBuild = true;
#else
  constexpr bool kDotBuild = false;  // the scalar path takes float32 queries
#endif
  const bool bf16_dot = kDotBuild && q_bf16 && std::is_same<T, c10::BFloat16>::value && D % 32 == 0 && fixed_group;
  // float32 q * scale, as torch's q.float() * scale rounds it, without two ops and a tensor per call
  std::vector<float> qf;
  if (!bf16_dot) {
    const float fs = static_cast<float>(scale);
    qf.resize(Tq * Hq * D);
    if (q_bf16) {
      const auto* qp = q_in.data_ptr<at::BFloat16>();
      for (size_t e = 0; e < qf.size(); ++e) qf[e] = to_float(qp[e]) * fs;
    } else {
      const float* qp = q_in.data_ptr<float>();
      for (size_t e = 0; e < qf.size(); ++e) qf[e] = qp[e] * fs;
    }
  }
  const float* q = bf16_dot ? nullptr : qf.data();
  const uint16_t* qb = bf16_dot ? reinterpret_cast<const uint16_t*>(q_in.data_ptr<at::BFloat16>()) : nullptr;
  auto tasks = [&](auto d_const, auto g_const) {
    constexpr int Dc = decltype(d_const)::value;
    constexpr int Gc = decltype(g_const)::value;
#if defined(__AVX512F__)
    if constexpr (Gc > 0 && Dc % 16 == 0 && Vec16<T>::value) {
      constexpr bool kDot = std::is_same<T, c10::BFloat16>::value && Dc % 32 == 0;
      std::vector<float> ql;
      if (q != nullptr) {
        ql.assign(q, q + Tq * Hq * D);
        to_lane_order<T, Dc>(ql.data(), Tq * Hq, true);
      }
      auto one = [&](int64_t i, int64_t k0, int64_t k1, float* acc, float* m_out, float* l_out) {
        const int32_t* table = tables + (int64_t)sidx[i] * W;
        if (kDot && qb != nullptr)
          attend_vec<T, Dc, Gc, kDot>(nullptr, qb + i * Hq * D, (float)scale, kbase, vbase, table, k0, k1, bs, Hkv,
                                      acc, m_out, l_out);
        else
          attend_vec<T, Dc, Gc, false>(ql.data() + i * Hq * D, nullptr, 1.f, kbase, vbase, table, k0, k1, bs, Hkv,
                                       acc, m_out, l_out);
      };
      split_tasks(Tq, Hq, D, lens, o, one, [&](int64_t i) { to_lane_order<T, Dc>(o + i * Hq * D, Hq, false); });
      return;
    }
#endif
    TORCH_CHECK(q != nullptr, "internal: float32 queries expected");
    // a task is one query (or part of its context) over every kv head, as the vector path's
    split_tasks(Tq, Hq, D, lens, o, [&](int64_t i, int64_t k0, int64_t k1, float* acc, float* m_out, float* l_out) {
      const int32_t* table = tables + (int64_t)sidx[i] * W;
      for (int64_t h = 0; h < Hkv; ++h) {
        float* const mo = m_out ? m_out + h * G : nullptr;
        float* const lo = l_out ? l_out + h * G : nullptr;
        attend<T, Dc, Gc>(q + (i * Hq + h * G) * D, kbase + h * D, vbase + h * D, table, k0, k1, bs, Hkv * D, G,
                          acc + h * G * D, mo, lo);
      }
    }, [](int64_t) {});
  };
  auto body = [&](auto d_const) {
    switch (G) {
      case 1: tasks(d_const, std::integral_constant<int, 1>{}); break;
      case 2: tasks(d_const, std::integral_constant<int, 2>{}); break;
      case 3: tasks(d_const, std::integral_constant<int, 3>{}); break;
      case 4: tasks(d_const, std::integral_constant<int, 4>{}); break;
      case 8: tasks(d_const, std::integral_constant<int, 8>{}); break;
      default: tasks(d_const, std::integral_constant<int, 0>{}); break;
    }
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

// the float32 and fp8 caches (cpu_paged_attention_fp32_fp8.cpp)
void paged_attention_fp32_fp8(const at::Tensor& q, double scale, const at::Tensor& kv_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_idx, const at::Tensor& kv_lens,
                              at::Tensor& out);
