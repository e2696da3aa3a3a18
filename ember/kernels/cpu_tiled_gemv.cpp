// x @ W^T for a few rows of x against 4- or 8-bit affine weights. W[n, k] = c[n, k] * scale[n, g]
// + offset[n, g], g = k / 32, codes c unsigned (4-bit 0..15, 8-bit 0..255). Two builds of one
// tile layout (cpu_tiled_gemv.py says why it is shaped so):
// - AVX-512 BF16 (Zen4, Sapphire Rapids): bf16 x, vdpbf16ps;
// - AVX2 + FMA + F16C (Zen2/3, Haswell on): float32 x (the engine's dtype where bf16 has no
//   instructions), held as int16 steps of each 32-input group's largest |x| (2^-16 of it, finer than
//   bf16), times the codes with vpmaddwd: exact int32 sums per group, scaled in float32.
//
// A tile is 16 output rows x 32 inputs. One vector lane per output row (16 lanes, or 2 x 8), so no
// horizontal sums, and the group's scale and offset apply once per tile: y += scale * sum(c x) +
// offset * sum(x).
//
// Tile bytes, row i (0..15), byte index b:
//   4-bit (256 B): b = 32 p + 2 i + e holds c[i][2p + e] (low nibble) and c[i][2p + 16 + e]
//                  (high nibble), p = 0..7.
//   8-bit (512 B): b = 32 p + 2 i + e holds c[i][2p + e], p = 0..15.
// AVX-512: widened to 16 bits, word 2i + e of a 32-byte run is row i's code for input 2p + e,
// the pair layout vdpbf16ps multiplies against (x[2p], x[2p + 1]); a 4-bit code c becomes the
// bf16 of 128 + c by (w & 15) | 0x4300, so the tile sums (128 + c) x and the offset absorbs -128.
// AVX2: each 128-bit half of a run (8 rows x 2 inputs) widened to words in-lane: dword i is row i's
// code pair for inputs (2p, 2p + 1), the pair layout vpmaddwd multiplies against int16 (x[2p], x[2p + 1]).
//
// Q6_K (both builds; the "Q6_K tiles" layout below): a 384-byte tile, the 4-bit tile of the 6-bit
// codes' low nibbles followed by a 2-bit plane of their high bits, with a scale per 16 inputs.
//
// Scales and offsets come from one of two stores (the FlatScales / KScales structs below): flat,
// float16 or float32 [N/16, K/32, 16] each; or, for Q4_K / Q5_K, their two levels as the file holds them.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kRows = 16;   // output rows per tile: one float32 lane each
constexpr int kGroup = 32;  // inputs per tile: one scale and offset per row
constexpr int kMaxM = 4;    // x rows per pass over a tile (accumulators: 2 per row)

// A few-row GEMV reads each weight byte once, so it runs at the speed memory delivers the tiles.
// The hardware prefetchers alone kept too few lines in flight for a core: the default model's
// 3072x576 Q4 GEMV read 14 GB/s from memory where a plain read reaches 23 (2 cores of an AMX
// Xeon); asking for the tile kPrefetchTiles ahead (2 KiB of 4-bit codes, 4 KiB of 8-bit) made it
// 19 GB/s, and batch-1 decode of the default model 90 -> 126 tok/s (docs/tuning.md). A prefetch
// past the end of the weights is harmless: it never faults.
constexpr int kPrefetchTiles = 8;

template <int kTileBytes>
inline void prefetch_codes(const uint8_t* codes, int64_t tg) {
  const char* c = reinterpret_cast<const char*>(codes + tg * kTileBytes);
  for (int line = 0; line < kTileBytes; line += 64) _mm_prefetch(c + line, _MM_HINT_T0);
}

// Flat scales and offsets: float16 or float32 [N/16, K/32, 16] each.
template <typename S>
struct FlatScales {
  const S* scale;
  const S* offset;
};

// Q4_K / Q5_K's two levels as the file holds them: 6-bit sub-scale sc and sub-min m per 32 inputs
// (uint8 [N/16, K/32, 2, 16]: sc then m) and float16 d, dmin per 256 ([N/16, K/256, 2, 16]), so that
// scale = d sc and offset = -dmin m, each exact in float32 (11 x 6 significant bits): the very values a
// flat float32 store holds (float16 cannot: up to 17 bits), in 2 B + 4 B / 8 per 32 weights, not 8 B.
// Both builds form them per group (load_scales).
struct KScales {
  const uint8_t* sm;
  const at::Half* dd;
};

template <typename S>
inline void prefetch_scales(const FlatScales<S>& sc, int64_t tg) {
  _mm_prefetch(reinterpret_cast<const char*>(sc.scale + tg * kRows), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(sc.offset + tg * kRows), _MM_HINT_T0);
}

inline void prefetch_scales(const KScales& sc, int64_t tg) {  // d and dmin: one line per 8 tiles, cached
  _mm_prefetch(reinterpret_cast<const char*>(sc.sm + tg * 2 * kRows), _MM_HINT_T0);
}

// ---- Q6_K tiles --------------------------------------------------------------------------------
// Q6_K: w = d * S * (q6 - 32), q6 0..63, S int8 per 16 inputs (a sub-block), d float16 per 256 (a
// superblock), kept in the file's bits: 6 bits a weight plus 8 per 16 plus 16 per 256, 0.82 B.
// A tile (384 B) is the 4-bit tile of the codes' low nibbles (bytes 0..255, laid out as above: the
// low nibble is input 2p + e, the high one 2p + 16 + e) and then a 2-bit plane of their high bits
// (bytes 256..383): 4 runs of 32 bytes, run r serving the 4-bit runs p = 2r and 2r + 1, its byte
// 2i + e holding row i's high bits of
//   input 2p + e       in bits 0-1 (p = 2r) or 4-5 (p = 2r + 1),
//   input 2p + 16 + e  in bits 2-3 (p = 2r) or 6-7 (p = 2r + 1),
// so one widening of a 32-byte run lines up word for word with both 4-bit runs it serves, and a
// shift puts each one's bits at 4-5, next to its low nibble: (lo & 15) | (hi2 & 0x30) is q6 (the
// AVX-512 build ORs in 0x4300 for the bf16 of 128 + q6; the AVX2 build keeps the bytes, whose 128-bit
// halves are 8 rows x 2 inputs, as in its 4-bit tiles). A tile's halves (inputs 0..15: low nibbles,
// 16..31: high nibbles) are two sub-blocks with scales of their own, so they accumulate apart.
// Scales: S int8 [N/16, K/32, 2, 16] (half, row) and d float16 [N/16, K/256, 16]; d * S is exact in
// float32 (11 x 8 significant bits).
constexpr int kQ6TileBytes = 384;
constexpr int kQ6Low = 256;  // the low-nibble tile; the 2-bit plane follows
constexpr int kSuper = 256;  // inputs per d: a Q6_K superblock, 8 tiles along K

inline void prefetch_q6(const uint8_t* codes, const int8_t* sub, int64_t tg) {
  prefetch_codes<kQ6TileBytes>(codes, tg);
  _mm_prefetch(reinterpret_cast<const char*>(sub + tg * 2 * kRows), _MM_HINT_T0);
}

#if defined(__AVX512BF16__)
using XT = at::BFloat16;  // this build's x

// x as it is (bf16: exact in the products) and its sum per group of 32 (Q6_K: per 16, its
// sub-blocks), in float32.
struct XIn {
  const at::BFloat16* x;  // [M, K]
  const float* sum;       // [M, K / kSumOf]
};

template <int kSumOf = kGroup>
inline XIn prepare_x(const at::Tensor& x) {
  const int64_t n = x.numel() / kSumOf;  // groups, all rows
  thread_local std::vector<float> sums;  // the calling thread's: read by the parallel region after
  sums.resize(n);
  const auto* xp = x.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < n; ++i) {
    float acc = 0.f;
    for (int j = 0; j < kSumOf; ++j) acc += static_cast<float>(xp[i * kSumOf + j]);
    sums[i] = acc;
  }
  return {xp, sums.data()};
}

// 16 rows' outputs of one row of x, at y[at ..] in float32 or bf16.
inline void store_rows(void* y, int64_t at, __m512 v, bool float_out) {
  if (float_out) _mm512_storeu_ps(static_cast<float*>(y) + at, v);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<at::BFloat16*>(y) + at), (__m256i)_mm512_cvtneps_pbh(v));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// The pair (x[k], x[k + 1]) in every 32-bit lane.
inline __m512bh pair(const at::BFloat16* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

inline __m512 u8_to_ps(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))); }

// Row tile t's scale and offset of group g (G groups a row of tiles).
template <typename S>
inline void load_scales(const FlatScales<S>& sc, int64_t t, int64_t G, int64_t g, __m512& s, __m512& o) {
  const int64_t at = (t * G + g) * kRows;
  s = load16(sc.scale + at);
  o = load16(sc.offset + at);
}

inline void load_scales(const KScales& sc, int64_t t, int64_t G, int64_t g, __m512& s, __m512& o) {
  const uint8_t* sm = sc.sm + (t * G + g) * 2 * kRows;
  const at::Half* d = sc.dd + (t * (G / 8) + g / 8) * 2 * kRows;  // 8 groups a superblock of 256
  s = _mm512_mul_ps(load16(d), u8_to_ps(sm));
  o = _mm512_mul_ps(load16(d + kRows), _mm512_sub_ps(_mm512_setzero_ps(), u8_to_ps(sm + kRows)));  // -m: exact
}

// One tile for M rows of x (pointers at the tile's first input); adds into out[M].
template <int BITS, int M>
inline void tile_dot(const uint8_t* __restrict c, const at::BFloat16* const* xs, __m512 (&acc)[kMaxM]) {
  __m512 a0[M], a1[M];
  for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  if constexpr (BITS == 4) {
    const __m512i mask = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * p)));
      const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(w, mask, bias, 0xEA);  // (w & mask) | bias
      const __m512bh hi = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), mask, bias, 0xEA);
      for (int m = 0; m < M; ++m) {
        a0[m] = _mm512_dpbf16_ps(a0[m], lo, pair(xs[m] + 2 * p));
        a1[m] = _mm512_dpbf16_ps(a1[m], hi, pair(xs[m] + 2 * p + 16));
      }
    }
  } else {
#pragma GCC unroll 4
    for (int p = 0; p < 16; ++p) {
      const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 32 * p))));
      const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 32 * p + 16))));
      const __m512bh w = _mm512_cvtne2ps_pbh(f1, f0);  // words 0..15 from f0
      for (int m = 0; m < M; ++m) {
        if (p & 1) a1[m] = _mm512_dpbf16_ps(a1[m], w, pair(xs[m] + 2 * p));
        else a0[m] = _mm512_dpbf16_ps(a0[m], w, pair(xs[m] + 2 * p));
      }
    }
  }
  for (int m = 0; m < M; ++m) acc[m] = _mm512_add_ps(a0[m], a1[m]);
}

// Row tile t (16 outputs) over all of K, for x rows [m0, m0 + M).
template <int BITS, typename Scales, int M>
void tile_row(const uint8_t* __restrict codes, const Scales& sc, const XIn& xin, void* y, bool float_out, int64_t K,
              int64_t N, int64_t m0, int64_t t) {
  constexpr int kTileBytes = BITS == 4 ? 256 : 512;
  const int64_t G = K / kGroup;
  const __m512 shift = _mm512_set1_ps(BITS == 4 ? 128.f : 0.f);
  __m512 out[kMaxM];
  for (int m = 0; m < M; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t tg = t * G + g;
    const at::BFloat16* xs[kMaxM];
    for (int m = 0; m < M; ++m) xs[m] = xin.x + (m0 + m) * K + g * kGroup;
    prefetch_codes<kTileBytes>(codes, tg + kPrefetchTiles);
    prefetch_scales(sc, tg + kPrefetchTiles);
    __m512 acc[kMaxM];
    tile_dot<BITS, M>(codes + tg * kTileBytes, xs, acc);
    __m512 s, o;
    load_scales(sc, t, G, g, s, o);
    o = _mm512_fnmadd_ps(shift, s, o);  // offset - 128 s for 4-bit
    for (int m = 0; m < M; ++m)
      out[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(xin.sum[(m0 + m) * G + g]), _mm512_fmadd_ps(s, acc[m], out[m]));
  }
  for (int m = 0; m < M; ++m) store_rows(y, (m0 + m) * N + t * kRows, out[m], float_out);
}

// Few rows of x: the tiles split across threads; every thread runs all x rows over its tiles, a few
// rows at a time, so a tile's codes are widened once per chunk of kMaxM rows while still in L1.
template <int BITS, typename Scales>
void run(const at::Tensor& x, const at::Tensor& codes, const Scales& sc, const XIn& xin, const at::Tensor& y,
         bool float_out) {
  const int64_t Mtot = x.size(0), K = x.size(1), T = codes.size(0), N = T * kRows;
  const auto* c = codes.data_ptr<uint8_t>();
  void* yp = y.data_ptr();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t m0 = 0; m0 < Mtot; m0 += kMaxM) {
        switch (std::min<int64_t>(kMaxM, Mtot - m0)) {
          case 1: tile_row<BITS, Scales, 1>(c, sc, xin, yp, float_out, K, N, m0, t); break;
          case 2: tile_row<BITS, Scales, 2>(c, sc, xin, yp, float_out, K, N, m0, t); break;
          case 3: tile_row<BITS, Scales, 3>(c, sc, xin, yp, float_out, K, N, m0, t); break;
          default: tile_row<BITS, Scales, 4>(c, sc, xin, yp, float_out, K, N, m0, t); break;
        }
      }
    }
  });
}

// ---- Q6_K tiles (the layout: above, beside the flat and K-quant scales) -----------------------
// The two halves' scales d * S of tile group tg (d16: the 16 rows' d of its superblock).
inline void q6_scales(const int8_t* sub, int64_t tg, __m512 d16, __m512& s0, __m512& s1) {
  const __m128i* p = reinterpret_cast<const __m128i*>(sub + tg * 2 * kRows);
  s0 = _mm512_mul_ps(d16, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p))));
  s1 = _mm512_mul_ps(d16, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1))));
}

// One Q6_K tile for M rows of x: adds sum((128 + q6) x) of inputs 0..15 into a0, of 16..31 into a1.
template <int M>
inline void q6_tile_dot(const uint8_t* __restrict c, const at::BFloat16* const* xs, __m512 (&a0)[kMaxM],
                        __m512 (&a1)[kMaxM]) {
  const __m512i low4 = _mm512_set1_epi16(0x000F), high2 = _mm512_set1_epi16(0x0030), bias = _mm512_set1_epi16(0x4300);
  // w: a low nibble in bits 0-3 (higher bits ignored); h: its high bits at 4-5 (others ignored)
  const auto code = [&](__m512i w, __m512i h) {
    return (__m512bh)_mm512_ternarylogic_epi32(w, low4, _mm512_ternarylogic_epi32(h, high2, bias, 0xEA), 0xEA);
  };
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + kQ6Low + 32 * r)));
    for (int u = 0; u < 2; ++u) {
      const int p = 2 * r + u;
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * p)));
      const __m512i hlo = u ? h : _mm512_slli_epi16(h, 4);                        // bits 4-5 or 0-1 -> 4-5
      const __m512i hhi = u ? _mm512_srli_epi16(h, 2) : _mm512_slli_epi16(h, 2);  // bits 6-7 or 2-3 -> 4-5
      const __m512bh lo = code(w, hlo), hi = code(_mm512_srli_epi16(w, 4), hhi);
      for (int m = 0; m < M; ++m) {
        a0[m] = _mm512_dpbf16_ps(a0[m], lo, pair(xs[m] + 2 * p));
        a1[m] = _mm512_dpbf16_ps(a1[m], hi, pair(xs[m] + 2 * p + 16));
      }
    }
  }
}

// Row tile t of a Q6_K matrix over all of K, for x rows [m0, m0 + M): per sub-block of 16 inputs,
// y += d S (sum((128 + q6) x) - 160 sum(x)), the accumulators starting at -160 sum(x).
template <int M>
void q6_tile_row(const uint8_t* __restrict codes, const int8_t* __restrict sub, const at::Half* __restrict d,
                 const XIn& xin, void* y, bool float_out, int64_t K, int64_t N, int64_t m0, int64_t t) {
  const int64_t G = K / kGroup, B = K / kSuper;
  __m512 out[kMaxM], d16 = _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t tg = t * G + g;
    if (g % (kSuper / kGroup) == 0) d16 = load16(d + (t * B + g / (kSuper / kGroup)) * kRows);
    prefetch_q6(codes, sub, tg + kPrefetchTiles);
    const at::BFloat16* xs[kMaxM];
    __m512 a0[kMaxM], a1[kMaxM];
    for (int m = 0; m < M; ++m) {
      xs[m] = xin.x + (m0 + m) * K + g * kGroup;
      const float* sum16 = xin.sum + (m0 + m) * 2 * G + 2 * g;
      a0[m] = _mm512_set1_ps(-160.f * sum16[0]);
      a1[m] = _mm512_set1_ps(-160.f * sum16[1]);
    }
    q6_tile_dot<M>(codes + tg * kQ6TileBytes, xs, a0, a1);
    __m512 s0, s1;
    q6_scales(sub, tg, d16, s0, s1);
    for (int m = 0; m < M; ++m) out[m] = _mm512_fmadd_ps(s1, a1[m], _mm512_fmadd_ps(s0, a0[m], out[m]));
  }
  for (int m = 0; m < M; ++m) store_rows(y, (m0 + m) * N + t * kRows, out[m], float_out);
}

void run_q6(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sub, const at::Tensor& d,
            const at::Tensor& y, bool float_out) {
  const XIn xin = prepare_x<kGroup / 2>(x);  // sums per sub-block of 16
  const int64_t Mtot = x.size(0), K = x.size(1), T = codes.size(0), N = T * kRows;
  const auto* c = codes.data_ptr<uint8_t>();
  const auto* s = sub.data_ptr<int8_t>();
  const auto* dp = d.data_ptr<at::Half>();
  void* yp = y.data_ptr();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {  // as run(): tiles split, all rows each
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t m0 = 0; m0 < Mtot; m0 += kMaxM) {
        switch (std::min<int64_t>(kMaxM, Mtot - m0)) {
          case 1: q6_tile_row<1>(c, s, dp, xin, yp, float_out, K, N, m0, t); break;
          case 2: q6_tile_row<2>(c, s, dp, xin, yp, float_out, K, N, m0, t); break;
          case 3: q6_tile_row<3>(c, s, dp, xin, yp, float_out, K, N, m0, t); break;
          default: q6_tile_row<4>(c, s, dp, xin, yp, float_out, K, N, m0, t); break;
        }
      }
    }
  });
}


#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define EMBER_TILED_Q8 1
// Many rows of x (prefill, batched decode) with int8 x: each group of 32 inputs of a row of x is
// quantized to int8 steps of the group's largest |x| (d = max|x| / 127, q = round(x / d): llama.cpp's
// Q8 activation blocks), and codes times q are summed exactly in int32 by vpdpbusd (unsigned codes x
// signed q, 64 products an instruction: twice vdpbf16ps's 32). Per group, y += scale * d * sum(c q)
// + offset * d * sum(q), in float32. The codes are rearranged per tile by one byte permute (vpermb)
// so that a 32-bit lane holds one row's 4 consecutive codes, the quad vpdpbusd multiplies.
struct Q8In {
  const int8_t* q;         // [M, K]
  const float* d;          // [M, G] step
  const float* s;          // [M, G] d * sum(q): the group's sum of the x the codes multiply
  const int32_t* qsum16;   // [M, 2G] sum(q) per 16 inputs (Q6_K's sub-blocks), where asked for
};

inline __m512 bf16_to_ps(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

inline Q8In prepare_q8(const at::Tensor& x, bool halves = false) {
  const int64_t n = x.numel() / kGroup;  // groups, all rows
  thread_local std::vector<int8_t> qbuf;  // the calling thread's: read by the parallel region after
  thread_local std::vector<float> fbuf;
  thread_local std::vector<int32_t> hbuf;
  qbuf.resize(n * kGroup);
  fbuf.resize(2 * n);
  if (halves) hbuf.resize(2 * n);
  int32_t* h = halves ? hbuf.data() : nullptr;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  int8_t* q = qbuf.data();
  float* d = fbuf.data();
  float* s = d + n;
  at::parallel_for(0, n, 512, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const __m512i raw = _mm512_loadu_si512(xp + i * kGroup);
      const __m512 lo = bf16_to_ps(_mm512_castsi512_si256(raw)), hi = bf16_to_ps(_mm512_extracti64x4_epi64(raw, 1));
      const __mmask16 nan = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const bool finite = amax <= std::numeric_limits<float>::max();
      const __m512 inv = _mm512_set1_ps(amax > 0.f && finite ? 127.f / amax : 0.f);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * kGroup), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * kGroup + 16), _mm512_cvtsepi32_epi8(qhi));
      // a NaN or inf x: a NaN or inf step, so every output it reaches is NaN, as in a float GEMM
      d[i] = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
      s[i] = d[i] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
      if (h) {  // qlo holds inputs 0..15, qhi 16..31, as stored (|x| / amax * 127 rounds to at most 127)
        h[2 * i] = _mm512_reduce_add_epi32(qlo);
        h[2 * i + 1] = _mm512_reduce_add_epi32(qhi);
      }
    }
  });
  return {q, d, s, h};
}

constexpr int kQ8M = 8;        // x rows per pass: 8 int32 sums + 8 float outputs live
constexpr int kQ8Chunk = 256;  // x rows per work item (256 x K int8 stays in L2 while tiles pass)

// Tile t's G groups as quads: w[8 g + u], lane i = row i's codes for inputs 4u .. 4u + 3 of group g.
// A 64-byte run of the tile holds pairs p = 2j, 2j + 1 of all 16 rows (byte 32 (p - 2j) + 2 i + e);
// lane i gathers bytes 2i, 2i + 1, 32 + 2i, 33 + 2i: inputs 4j .. 4j + 3 (4-bit: the low nibbles,
// the high ones are inputs 16 + 4j ..; 8-bit: the codes of inputs 4j .., j = 0..7).
template <int BITS>
inline void quad_tile(const uint8_t* __restrict c, __m512i* __restrict w, int64_t G) {
  alignas(64) static const uint8_t kIdx[64] = {
      0, 1, 32, 33, 2, 3, 34, 35, 4, 5, 36, 37, 6, 7, 38, 39, 8, 9, 40, 41, 10, 11, 42, 43,
      12, 13, 44, 45, 14, 15, 46, 47, 16, 17, 48, 49, 18, 19, 50, 51, 20, 21, 52, 53, 22, 23, 54, 55,
      24, 25, 56, 57, 26, 27, 58, 59, 28, 29, 60, 61, 30, 31, 62, 63};
  const __m512i idx = _mm512_load_si512(kIdx);
  constexpr int kTileBytes = BITS == 4 ? 256 : 512;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* cg = c + g * kTileBytes;
    __m512i* wg = w + 8 * g;
    if constexpr (BITS == 4) {
      const __m512i low4 = _mm512_set1_epi8(0x0F);
      for (int j = 0; j < 4; ++j) {
        const __m512i r = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(cg + 64 * j));
        wg[j] = _mm512_and_si512(r, low4);
        wg[4 + j] = _mm512_and_si512(_mm512_srli_epi16(r, 4), low4);
      }
    } else {
      for (int j = 0; j < 8; ++j) wg[j] = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(cg + 64 * j));
    }
  }
}

// x rows [m0, m0 + M) against tile t (its quads in w).
template <typename Scales, int M>
void q8_rows(const __m512i* __restrict w, int64_t t, const Scales& scales, const Q8In& xin, void* y, bool float_out,
             int64_t K, int64_t N, int64_t m0) {
  const int64_t G = K / kGroup;
  __m512 out[M];
  for (int m = 0; m < M; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_si512();
    const int8_t* xq = xin.q + m0 * K + g * kGroup;
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      const __m512i wu = _mm512_load_si512(w + 8 * g + u);
      for (int m = 0; m < M; ++m) {
        int32_t quad;
        std::memcpy(&quad, xq + m * K + 4 * u, 4);
        acc[m] = _mm512_dpbusd_epi32(acc[m], wu, _mm512_set1_epi32(quad));
      }
    }
    __m512 sc, of;
    load_scales(scales, t, G, g, sc, of);
    for (int m = 0; m < M; ++m) {
      const int64_t i = (m0 + m) * G + g;
      out[m] = _mm512_fmadd_ps(of, _mm512_set1_ps(xin.s[i]),
                               _mm512_fmadd_ps(_mm512_mul_ps(sc, _mm512_set1_ps(xin.d[i])), _mm512_cvtepi32_ps(acc[m]), out[m]));
    }
  }
  for (int m = 0; m < M; ++m) store_rows(y, (m0 + m) * N + t * kRows, out[m], float_out);
}

template <int BITS, typename Scales>
void run_q8(const at::Tensor& x, const at::Tensor& codes, const Scales& sc, const at::Tensor& y, bool float_out) {
  constexpr int kTileBytes = BITS == 4 ? 256 : 512;
  const Q8In xin = prepare_q8(x);
  const int64_t Mtot = x.size(0), K = x.size(1), G = K / kGroup, T = codes.size(0), N = T * kRows;
  const int64_t chunks = (Mtot + kQ8Chunk - 1) / kQ8Chunk;
  const auto* c = codes.data_ptr<uint8_t>();
  void* yp = y.data_ptr();
  // items chunk-major: a thread takes whole row chunks where there are several (its x rows stay in
  // L2 while the tiles pass), else a share of the tiles of the one chunk
  at::parallel_for(0, chunks * T, 1, [&](int64_t i0, int64_t i1) {
    std::vector<__m512i> w(G * 8);  // one tile as quads: 512 B a group
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i % T, r0 = (i / T) * kQ8Chunk, r1 = std::min(Mtot, r0 + kQ8Chunk);
      quad_tile<BITS>(c + t * G * kTileBytes, w.data(), G);
      int64_t m0 = r0;
      for (; m0 + kQ8M <= r1; m0 += kQ8M) q8_rows<Scales, kQ8M>(w.data(), t, sc, xin, yp, float_out, K, N, m0);
      switch (r1 - m0) {
        case 0: break;
        case 1: q8_rows<Scales, 1>(w.data(), t, sc, xin, yp, float_out, K, N, m0); break;
        case 2: q8_rows<Scales, 2>(w.data(), t, sc, xin, yp, float_out, K, N, m0); break;
        case 3: q8_rows<Scales, 3>(w.data(), t, sc, xin, yp, float_out, K, N, m0); break;
        case 4: q8_rows<Scales, 4>(w.data(), t, sc, xin, yp, float_out, K, N, m0); break;
        case 5: q8_rows<Scales, 5>(w.data(), t, sc, xin, yp, float_out, K, N, m0); break;
        case 6: q8_rows<Scales, 6>(w.data(), t, sc, xin, yp, float_out, K, N, m0); break;
        default: q8_rows<Scales, 7>(w.data(), t, sc, xin, yp, float_out, K, N, m0); break;
      }
    }
  });
}

// Q6_K tile t's G groups as quads (quad_tile's order: w[8 g + u], u = 0..3 inputs 4u .. 4u + 3,
// u = 4..7 inputs 16 + 4(u - 4) ..), full 6-bit codes: the low nibbles as quad_tile gathers them,
// plus the 2-bit plane's run j (it serves the 4-bit runs 2j, 2j + 1: the same 64 bytes quad j
// reads) gathered to lane i = bytes (2i, 2i + 1, 2i, 2i + 1), each word shifted to its run's bits.
inline void quad_tile_q6(const uint8_t* __restrict c, __m512i* __restrict w, int64_t G) {
  alignas(64) static const uint8_t kIdx[64] = {
      0, 1, 32, 33, 2, 3, 34, 35, 4, 5, 36, 37, 6, 7, 38, 39, 8, 9, 40, 41, 10, 11, 42, 43,
      12, 13, 44, 45, 14, 15, 46, 47, 16, 17, 48, 49, 18, 19, 50, 51, 20, 21, 52, 53, 22, 23, 54, 55,
      24, 25, 56, 57, 26, 27, 58, 59, 28, 29, 60, 61, 30, 31, 62, 63};
  alignas(64) static const uint8_t kHighIdx[64] = {
      0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7, 8, 9, 8, 9, 10, 11, 10, 11, 12, 13, 12, 13, 14, 15, 14, 15,
      16, 17, 16, 17, 18, 19, 18, 19, 20, 21, 20, 21, 22, 23, 22, 23, 24, 25, 24, 25, 26, 27, 26, 27, 28, 29, 28, 29, 30, 31, 30, 31};
  const __m512i idx = _mm512_load_si512(kIdx), hidx = _mm512_load_si512(kHighIdx);
  const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(0x03);
  // word 0 of a lane: run 2j's bits (0-1 for inputs 0..15, 2-3 for 16..31); word 1: run 2j + 1's (4-5, 6-7)
  const __m512i shift_lo = _mm512_set1_epi32(0x00040000), shift_hi = _mm512_set1_epi32(0x00060002);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* cg = c + g * kQ6TileBytes;
    __m512i* wg = w + 8 * g;
    for (int j = 0; j < 4; ++j) {
      const __m512i r = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(cg + 64 * j));
      const __m512i h = _mm512_permutexvar_epi8(
          hidx, _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(cg + kQ6Low + 32 * j))));
      const __m512i hlo = _mm512_and_si512(_mm512_srlv_epi16(h, shift_lo), low2);
      const __m512i hhi = _mm512_and_si512(_mm512_srlv_epi16(h, shift_hi), low2);
      wg[j] = _mm512_or_si512(_mm512_and_si512(r, low4), _mm512_slli_epi16(hlo, 4));
      wg[4 + j] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(r, 4), low4), _mm512_slli_epi16(hhi, 4));
    }
  }
}

// x rows [m0, m0 + M) against Q6_K tile t (its quads in w): per sub-block of 16, y += d S step
// (sum(q6 q) - 32 sum(q)), the int32 sums starting at -32 sum(q); one half after the other, so M
// accumulators are live, not 2M.
template <int M>
void q8_rows_q6(const __m512i* __restrict w, int64_t t, const int8_t* __restrict sub, const at::Half* __restrict d,
                const Q8In& xin, void* y, bool float_out, int64_t K, int64_t N, int64_t m0) {
  const int64_t G = K / kGroup, B = K / kSuper;
  __m512 out[M], d16 = _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    if (g % (kSuper / kGroup) == 0) d16 = load16(d + (t * B + g / (kSuper / kGroup)) * kRows);
    __m512 sc[2];
    q6_scales(sub, t * G + g, d16, sc[0], sc[1]);
    const int8_t* xq = xin.q + m0 * K + g * kGroup;
    for (int half = 0; half < 2; ++half) {
      __m512i acc[M];
      for (int m = 0; m < M; ++m) acc[m] = _mm512_set1_epi32(-32 * xin.qsum16[(m0 + m) * 2 * G + 2 * g + half]);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        const __m512i wu = _mm512_load_si512(w + 8 * g + 4 * half + u);
        for (int m = 0; m < M; ++m) {
          int32_t quad;
          std::memcpy(&quad, xq + m * K + 16 * half + 4 * u, 4);
          acc[m] = _mm512_dpbusd_epi32(acc[m], wu, _mm512_set1_epi32(quad));
        }
      }
      for (int m = 0; m < M; ++m) {
        const __m512 step = _mm512_set1_ps(xin.d[(m0 + m) * G + g]);
        out[m] = _mm512_fmadd_ps(_mm512_mul_ps(sc[half], step), _mm512_cvtepi32_ps(acc[m]), out[m]);
      }
    }
  }
  for (int m = 0; m < M; ++m) store_rows(y, (m0 + m) * N + t * kRows, out[m], float_out);
}

void run_q8_q6(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sub, const at::Tensor& d,
               const at::Tensor& y, bool float_out) {
  const Q8In xin = prepare_q8(x, /*halves=*/true);
  const int64_t Mtot = x.size(0), K = x.size(1), G = K / kGroup, T = codes.size(0), N = T * kRows;
  const int64_t chunks = (Mtot + kQ8Chunk - 1) / kQ8Chunk;
  const auto* c = codes.data_ptr<uint8_t>();
  const auto* s = sub.data_ptr<int8_t>();
  const auto* dp = d.data_ptr<at::Half>();
  void* yp = y.data_ptr();
  at::parallel_for(0, chunks * T, 1, [&](int64_t i0, int64_t i1) {  // as run_q8's
    std::vector<__m512i> w(G * 8);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i % T, r0 = (i / T) * kQ8Chunk, r1 = std::min(Mtot, r0 + kQ8Chunk);
      quad_tile_q6(c + t * G * kQ6TileBytes, w.data(), G);
      int64_t m0 = r0;
      for (; m0 + kQ8M <= r1; m0 += kQ8M) q8_rows_q6<kQ8M>(w.data(), t, s, dp, xin, yp, float_out, K, N, m0);
      switch (r1 - m0) {
        case 0: break;
        case 1: q8_rows_q6<1>(w.data(), t, s, dp, xin, yp, float_out, K, N, m0); break;
        case 2: q8_rows_q6<2>(w.data(), t, s, dp, xin, yp, float_out, K, N, m0); break;
        case 3: q8_rows_q6<3>(w.data(), t, s, dp, xin, yp, float_out, K, N, m0); break;
        case 4: q8_rows_q6<4>(w.data(), t, s, dp, xin, yp, float_out, K, N, m0); break;
        case 5: q8_rows_q6<5>(w.data(), t, s, dp, xin, yp, float_out, K, N, m0); break;
        case 6: q8_rows_q6<6>(w.data(), t, s, dp, xin, yp, float_out, K, N, m0); break;
        default: q8_rows_q6<7>(w.data(), t, s, dp, xin, yp, float_out, K, N, m0); break;
      }
    }
  });
}
#endif  // VNNI + VBMI

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
using XT = float;  // this build's x

inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m128i load_8b(const void* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline __m256 u8_to_ps(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load_8b(p))); }
inline __m256 s8_to_ps(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load_8b(p))); }

// x as int16 steps of each group's largest |x| (32 inputs, the tile's group): q = round(x / step),
// step = max|x| / 32767, so each x moves by at most step / 2 (2^-16 of the group's largest, ~128x
// finer than the bf16 x of the AVX-512 build) and code * q products are summed exactly in int32.
// sum[i] is the group's sum of q * step (the x the codes multiply). A NaN or inf x makes its
// group's step NaN / inf, so the outputs it reaches are NaN, as with float32 x.
struct XIn {
  const int16_t* q;       // [M, K]
  const float* step;      // [M, G]
  const float* sum;       // [M, G]
  const int32_t* qsum16;  // [M, 2G] sum(q) per 16 inputs: Q6_K's sub-blocks (its GEMV starts at -32 of it)
};

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return std::max(_mm_cvtss_f32(m), _mm_cvtss_f32(_mm_movehdup_ps(m)));
}

inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

inline XIn prepare_x(const at::Tensor& x) {
  const int64_t n = x.numel() / kGroup;  // groups, all rows
  // the calling thread's buffers, read by the parallel region after: no allocation per call
  thread_local std::vector<int16_t> qbuf;
  thread_local std::vector<float> fbuf;
  thread_local std::vector<int32_t> hbuf;
  qbuf.resize(n * kGroup);
  fbuf.resize(2 * n);
  hbuf.resize(2 * n);
  const float* xp = x.data_ptr<float>();
  int16_t* q = qbuf.data();
  float* step = fbuf.data();
  float* sum = step + n;
  int32_t* half = hbuf.data();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t i = 0; i < n; ++i) {
    __m256 v[4], mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xp + i * kGroup + 8 * j);
      mx = _mm256_max_ps(mx, _mm256_and_ps(v[j], abs_mask));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q));
    }
    const float amax = hmax8(mx);
    const bool finite = amax <= std::numeric_limits<float>::max();
    const __m256 inv = _mm256_set1_ps(amax > 0.f && finite ? 32767.f / amax : 0.f);
    __m256i qi[4];
    for (int j = 0; j < 4; ++j) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // |x| / amax * 32767 <= 32767
    // packs interleaves 128-bit lanes (0-3, 8-11 | 4-7, 12-15); the qword permute restores the order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * kGroup),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[0], qi[1]), 0xD8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * kGroup + 16),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2], qi[3]), 0xD8));
    half[2 * i] = hsum8(_mm256_add_epi32(qi[0], qi[1]));  // inputs 0..15
    half[2 * i + 1] = hsum8(_mm256_add_epi32(qi[2], qi[3]));
    step[i] = _mm256_movemask_ps(nan) ? std::numeric_limits<float>::quiet_NaN() : amax / 32767.f;
    sum[i] = step[i] * static_cast<float>(half[2 * i] + half[2 * i + 1]);
  }
  return {q, step, sum, half};
}

// Rows 8h .. 8h + 7 of row tile t's scale and offset of group g (the AVX-512 build's load_scales in
// 8 lanes): a flat store's as held, or the K-quants' d sc and -dmin m, formed as that build does, so
// both stores give the same bits.
template <typename S>
inline void load_scales(const FlatScales<S>& sc, int64_t t, int64_t G, int64_t g, int h, __m256& s, __m256& o) {
  const int64_t at = (t * G + g) * kRows + 8 * h;
  s = load8(sc.scale + at);
  o = load8(sc.offset + at);
}

inline void load_scales(const KScales& sc, int64_t t, int64_t G, int64_t g, int h, __m256& s, __m256& o) {
  const uint8_t* sm = sc.sm + (t * G + g) * 2 * kRows + 8 * h;
  const at::Half* d = sc.dd + (t * (G / 8) + g / 8) * 2 * kRows + 8 * h;  // 8 groups a superblock of 256
  s = _mm256_mul_ps(load8(d), u8_to_ps(sm));
  o = _mm256_mul_ps(load8(d + kRows), _mm256_sub_ps(_mm256_setzero_ps(), u8_to_ps(sm + kRows)));  // -m: exact
}

// f(std::integral_constant<int, m>{}) with m = min(n, kMax) >= 1: a count of x rows as a template argument.
template <int kMax, typename F>
inline void with_rows(int64_t n, F&& f) {
  if constexpr (kMax == 1) f(std::integral_constant<int, 1>{});
  else if (n >= kMax) f(std::integral_constant<int, kMax>{});
  else with_rows<kMax - 1>(n, f);
}

// Few rows of x, as the AVX-512 build's run(): the tiles split across threads; every thread runs all
// x rows over its tiles, kMaxM at a time (row(t, m0, m): tile t for x rows [m0, m0 + m)).
template <typename Row>
void few_rows(int64_t Mtot, int64_t T, Row&& row) {
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m0 = 0; m0 < Mtot; m0 += kMaxM) with_rows<kMaxM>(Mtot - m0, [&](auto m) { row(t, m0, m); });
  });
}

// acc + the int16 products of w and x summed in pairs per dword: exact here (|q| <= 32767, codes < 256).
// With AVX-VNNI (Intel 12th gen on) one instruction, vpdpwssd, does what vpmaddwd + vpaddd do: the same
// integers, half the vector uops (measured: docs/tuning.md).
inline __m256i madd_acc(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, w, x);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}

// One 32-byte run r of codes (byte 2i + e: row i's code for input k0 + e) for M rows of x (int16
// pointers at the tile's first input), added into acc[m][0] = rows 0-3 | 8-11, acc[m][1] = rows 4-7 |
// 12-15. A run holds 8 rows x 2 inputs per 128-bit half; widened to words in-lane, dword i is row i's
// pair for inputs (k0, k0 + 1), which vpmaddwd multiplies by the broadcast int16 pair of x and sums:
// per 32 codes and row of x, 2 unpacks (shared by the rows), 2 multiply-adds and 2 adds.
template <int M>
inline void madd_run(__m256i r, const int16_t* const* xs, int k0, __m256i (&acc)[kMaxM][2]) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i lo = _mm256_unpacklo_epi8(r, zero), hi = _mm256_unpackhi_epi8(r, zero);
  for (int m = 0; m < M; ++m) {
    int32_t pair;
    std::memcpy(&pair, xs[m] + k0, 4);
    const __m256i xp = _mm256_set1_epi32(pair);
    acc[m][0] = madd_acc(acc[m][0], lo, xp);
    acc[m][1] = madd_acc(acc[m][1], hi, xp);
  }
}

// One tile for M rows of x: sum(c q) per row in int32, in madd_run's accumulators.
template <int BITS, int M>
inline void tile_dot(const uint8_t* __restrict c, const int16_t* const* xs, __m256i (&acc)[kMaxM][2]) {
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
  if constexpr (BITS == 4) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 2
    for (int p = 0; p < 8; ++p) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * p));
      madd_run<M>(_mm256_and_si256(w, low4), xs, 2 * p, acc);
      madd_run<M>(_mm256_and_si256(_mm256_srli_epi16(w, 4), low4), xs, 2 * p + 16, acc);
    }
  } else {
#pragma GCC unroll 4
    for (int p = 0; p < 16; ++p)
      madd_run<M>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * p)), xs, 2 * p, acc);
  }
}

// Row tile t (16 outputs) over all of K, for x rows [m0, m0 + M): per group, scale * step * sum(c q)
// + offset * sum(x).
template <int BITS, typename Scales, int M>
void tile_row(const uint8_t* __restrict codes, const Scales& sc, const XIn& xin, float* y, int64_t K, int64_t N,
              int64_t m0, int64_t t) {
  constexpr int kTileBytes = BITS == 4 ? 256 : 512;
  const int64_t G = K / kGroup;
  __m256 out[kMaxM][2];
  for (int m = 0; m < M; ++m) out[m][0] = out[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t tg = t * G + g;
    const int16_t* xs[kMaxM];
    for (int m = 0; m < M; ++m) xs[m] = xin.q + (m0 + m) * K + g * kGroup;
    prefetch_codes<kTileBytes>(codes, tg + kPrefetchTiles);
    prefetch_scales(sc, tg + kPrefetchTiles);
    __m256i acc[kMaxM][2];
    tile_dot<BITS, M>(codes + tg * kTileBytes, xs, acc);
    for (int h = 0; h < 2; ++h) {
      __m256 s, o;
      load_scales(sc, t, G, g, h, s, o);
      for (int m = 0; m < M; ++m) {
        const int64_t i = (m0 + m) * G + g;
        // rows 8h .. 8h + 7: the low (h = 0) or high (h = 1) 128-bit halves of the two accumulators
        const __m256i rows = _mm256_permute2x128_si256(acc[m][0], acc[m][1], h ? 0x31 : 0x20);
        const __m256 dot = _mm256_cvtepi32_ps(rows);
        out[m][h] = _mm256_fmadd_ps(o, _mm256_set1_ps(xin.sum[i]),
                                    _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(xin.step[i])), dot, out[m][h]));
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (m0 + m) * N + t * kRows + 8 * h, out[m][h]);
}

// Many rows of x (prefill, batched decode): the GEMV above widens each tile's codes again for every
// kMaxM rows and keeps 16 accumulators and 8 outputs live, so it spills and runs ~1 vpmaddwd a
// cycle. Here a tile is widened to int16 once into a buffer (1 KiB a group: pair q, half h holds
// rows 8h..8h+7 as dword i = row's codes at inputs 2q, 2q + 1), then each block of kGemmM rows of x
// runs over it with 2 kGemmM int32 accumulators, 2 weight and 1 x register: per pair, 2 loads,
// kGemmM broadcasts, 2 kGemmM multiply-adds (vpmaddwd issues 2 a cycle on Zen3; 4 rows a pass
// spilled an accumulator; widening 2 or 4 tiles together to share each block of x rows was no
// faster). Sums and the per-group float32 epilogue are the GEMV's, in the same order, so both paths
// give the same bits.
constexpr int kGemmMinRows = 16;  // from here on the widened path (measured: see cpu_tiled_gemv.py)
constexpr int kGemmM = 3;         // x rows per pass
constexpr int kGemmChunk = 256;   // x rows per work item

// widen(t, w) widens tile t into w (32 registers a group), rows(w, t, m0, m) runs x rows [m0, m0 + m)
// against it: work items are (tile, 256-row chunk), a thread's items a tile's chunks in turn, so one
// widening serves them.
template <typename Widen, typename Rows>
void many_rows(int64_t Mtot, int64_t T, int64_t G, Widen&& widen, Rows&& rows) {
  const int64_t chunks = (Mtot + kGemmChunk - 1) / kGemmChunk;
  at::parallel_for(0, T * chunks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<__m256i> wbuf(G * 32);  // 1 KiB a group
    int64_t widened = -1;               // the tile wbuf holds
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / chunks;
      if (t != widened) {
        widen(t, wbuf.data());
        widened = t;
      }
      const int64_t r0 = (i % chunks) * kGemmChunk, r1 = std::min(Mtot, r0 + kGemmChunk);
      for (int64_t m0 = r0; m0 < r1; m0 += kGemmM)
        with_rows<kGemmM>(r1 - m0, [&](auto m) { rows(wbuf.data(), t, m0, m); });
    }
  });
}

template <int BITS>
inline void widen_tile(const uint8_t* __restrict c, __m256i* __restrict w) {
  if constexpr (BITS == 4) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int p = 0; p < 8; ++p) {
      const __m256i r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * p));
      const __m256i lo = _mm256_and_si256(r, low4), hi = _mm256_and_si256(_mm256_srli_epi16(r, 4), low4);
      w[2 * p] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo));  // inputs 2p, 2p + 1: pair p
      w[2 * p + 1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1));
      w[2 * p + 16] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi));  // inputs 2p + 16, 2p + 17: pair p + 8
      w[2 * p + 17] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1));
    }
  } else {
    for (int p = 0; p < 32; ++p) w[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * p)));
  }
}

// Pairs 0 .. kPairs - 1 of a widened group (w at its first) for M rows of x: acc[m][h], rows 8h .. 8h + 7.
template <int M, int kPairs = 16>
inline void gemm_group(const __m256i* __restrict w, const int16_t* const* xs, __m256i (&acc)[kGemmM][2]) {
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int q = 0; q < kPairs; ++q) {
    const __m256i w0 = _mm256_load_si256(w + 2 * q), w1 = _mm256_load_si256(w + 2 * q + 1);
    for (int m = 0; m < M; ++m) {
      int32_t pair;
      std::memcpy(&pair, xs[m] + 2 * q, 4);
      const __m256i xp = _mm256_set1_epi32(pair);
      acc[m][0] = madd_acc(acc[m][0], w0, xp);
      acc[m][1] = madd_acc(acc[m][1], w1, xp);
    }
  }
}

// x rows [m0, m0 + M) against tile t, widened in wbuf.
template <typename Scales, int M>
void gemm_rows(const __m256i* wbuf, int64_t t, const Scales& sc, const XIn& xin, float* y, int64_t K, int64_t N,
               int64_t m0) {
  const int64_t G = K / kGroup;
  __m256 out[kGemmM][2];
  for (int m = 0; m < M; ++m) out[m][0] = out[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int16_t* xs[kGemmM];
    for (int m = 0; m < M; ++m) xs[m] = xin.q + (m0 + m) * K + g * kGroup;
    __m256i acc[kGemmM][2];
    gemm_group<M>(wbuf + g * 32, xs, acc);
    for (int h = 0; h < 2; ++h) {
      __m256 s, o;
      load_scales(sc, t, G, g, h, s, o);
      for (int m = 0; m < M; ++m) {
        const int64_t i = (m0 + m) * G + g;
        out[m][h] = _mm256_fmadd_ps(o, _mm256_set1_ps(xin.sum[i]),
                                    _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(xin.step[i])),
                                                    _mm256_cvtepi32_ps(acc[m][h]), out[m][h]));
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (m0 + m) * N + t * kRows + 8 * h, out[m][h]);
}

// Few rows: the GEMV (tile_row); many: the widened path. Float32 out either way (x is float32).
template <int BITS, typename Scales>
void run(const at::Tensor& x, const at::Tensor& codes, const Scales& sc, const XIn& xin, const at::Tensor& y, bool) {
  constexpr int kTileBytes = BITS == 4 ? 256 : 512;
  const int64_t Mtot = x.size(0), K = x.size(1), G = K / kGroup, T = codes.size(0), N = T * kRows;
  const auto* c = codes.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (Mtot >= kGemmMinRows) {
    const auto widen = [&](int64_t t, __m256i* w) {
      for (int64_t g = 0; g < G; ++g) widen_tile<BITS>(c + (t * G + g) * kTileBytes, w + g * 32);
    };
    const auto rows = [&](const __m256i* w, int64_t t, int64_t m0, auto m) {
      gemm_rows<Scales, decltype(m)::value>(w, t, sc, xin, yp, K, N, m0);
    };
    return many_rows(Mtot, T, G, widen, rows);
  }
  few_rows(Mtot, T, [&](int64_t t, int64_t m0, auto m) {
    tile_row<BITS, Scales, decltype(m)::value>(c, sc, xin, yp, K, N, m0, t);
  });
}

// ---- Q6_K tiles (AVX2) ---------------------------------------------------------------------------
// The same 384-byte tiles as the AVX-512 build (one packing serves both): the codes q6 (0..63) widen to
// int16 exactly, and vpmaddwd multiplies them by x's int16 steps as the 4-bit codes. Each half of a
// tile (a sub-block of 16 inputs, scale d S) sums apart in int32: exactly sum((q6 - 32) q), in the
// GEMV from -32 sum(q) (XIn::qsum16), in the widened many-row path from codes widened as q6 - 32; the
// same integers, and the same float32 epilogue per half (d S, times the step, FMA'd into the output),
// so both paths give the same bits. |sum| <= 63 x 32767 x 16 + 32 x 32767 x 16 < 2^31.

// Run p of half H of a Q6_K tile as its 6-bit codes (bytes in the 4-bit runs' order: byte 2i + e is
// row i's code for input 2p + 16H + e), from the low nibbles w (run p) and the plane run pl (p / 2),
// which holds their high bits at 4U + 2H (U = p % 2), shifted to bits 4-5 beside the nibble.
template <int U, int H>
inline __m256i q6_codes(__m256i w, __m256i pl) {
  constexpr int at = 4 * U + 2 * H;
  __m256i hi = pl;
  if constexpr (at < 4) hi = _mm256_slli_epi16(pl, 4 - at);  // bits crossing a byte land outside 4-5
  if constexpr (at > 4) hi = _mm256_srli_epi16(pl, at - 4);
  const __m256i lo = H ? _mm256_srli_epi16(w, 4) : w;
  return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi8(0x0F)), _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
}

// f(p, codes) for the 8 runs p of half H of the Q6_K tile at c.
template <int H, typename F>
inline void q6_runs(const uint8_t* __restrict c, F&& f) {
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    const __m256i pl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + kQ6Low + 32 * r));
    f(2 * r, q6_codes<0, H>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * r)), pl));
    f(2 * r + 1, q6_codes<1, H>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * r + 32)), pl));
  }
}

// Row tile t of a Q6_K matrix over all of K, for x rows [m0, m0 + M) (few rows). The accumulators' row
// order is tile_dot's (rows 0-3 | 8-11, 4-7 | 12-15); the scales are put in it once per group (d per
// superblock) and the outputs kept in it, put back in row order at the store.
template <int M>
void q6_tile_row(const uint8_t* __restrict codes, const int8_t* __restrict sub, const at::Half* __restrict d,
                 const XIn& xin, float* y, int64_t K, int64_t N, int64_t m0, int64_t t) {
  const int64_t G = K / kGroup, B = K / kSuper;
  const __m128i order = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
  __m256 out[kMaxM][2], d2[2];
  for (int m = 0; m < M; ++m) out[m][0] = out[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t tg = t * G + g;
    if (g % (kSuper / kGroup) == 0) {
      const at::Half* dp = d + (t * B + g / (kSuper / kGroup)) * kRows;
      const __m256 lo = load8(dp), hi = load8(dp + 8);
      d2[0] = _mm256_permute2f128_ps(lo, hi, 0x20);
      d2[1] = _mm256_permute2f128_ps(lo, hi, 0x31);
    }
    prefetch_q6(codes, sub, tg + kPrefetchTiles);
    const int16_t* xs[kMaxM];
    for (int m = 0; m < M; ++m) xs[m] = xin.q + (m0 + m) * K + g * kGroup;
    const auto half = [&](auto h) {
      constexpr int H = decltype(h)::value;
      __m256i acc[kMaxM][2];
      for (int m = 0; m < M; ++m)
        acc[m][0] = acc[m][1] = _mm256_set1_epi32(-32 * xin.qsum16[(m0 + m) * 2 * G + 2 * g + H]);
      q6_runs<H>(codes + tg * kQ6TileBytes, [&](int p, __m256i r) { madd_run<M>(r, xs, 2 * p + 16 * H, acc); });
      const __m128i* sp = reinterpret_cast<const __m128i*>(sub + (2 * tg + H) * kRows);
      const __m128i s = _mm_shuffle_epi8(_mm_loadu_si128(sp), order);  // S in the accumulators' row order
      const __m256 sc0 = _mm256_mul_ps(d2[0], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s)));
      const __m256 sc1 = _mm256_mul_ps(d2[1], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s, 8))));
      for (int m = 0; m < M; ++m) {
        const __m256 step = _mm256_set1_ps(xin.step[(m0 + m) * G + g]);
        out[m][0] = _mm256_fmadd_ps(_mm256_mul_ps(sc0, step), _mm256_cvtepi32_ps(acc[m][0]), out[m][0]);
        out[m][1] = _mm256_fmadd_ps(_mm256_mul_ps(sc1, step), _mm256_cvtepi32_ps(acc[m][1]), out[m][1]);
      }
    };
    half(std::integral_constant<int, 0>{});
    half(std::integral_constant<int, 1>{});
  }
  for (int m = 0; m < M; ++m) {
    float* ym = y + (m0 + m) * N + t * kRows;
    _mm256_storeu_ps(ym, _mm256_permute2f128_ps(out[m][0], out[m][1], 0x20));  // rows 0-3, 4-7
    _mm256_storeu_ps(ym + 8, _mm256_permute2f128_ps(out[m][0], out[m][1], 0x31));
  }
}

// A Q6_K tile widened for the many-row path, in widen_tile's order (pair q = inputs 2q, 2q + 1; pairs
// 0..7 half 0, 8..15 half 1), codes q6 - 32: signed, so the products need no offset term.
inline void widen_q6_tile(const uint8_t* __restrict c, __m256i* __restrict w) {
  const auto put = [&](auto h) {
    constexpr int H = decltype(h)::value;
    q6_runs<H>(c, [&](int p, __m256i r) {
      const __m256i s = _mm256_sub_epi8(r, _mm256_set1_epi8(32));
      w[2 * (p + 8 * H)] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(s));  // rows 0-7
      w[2 * (p + 8 * H) + 1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(s, 1));
    });
  };
  put(std::integral_constant<int, 0>{});
  put(std::integral_constant<int, 1>{});
}

// x rows [m0, m0 + M) against Q6_K tile t, widened in wbuf: per half, 8 pairs, then its scales.
template <int M>
void gemm_rows_q6(const __m256i* wbuf, int64_t t, const int8_t* __restrict sub, const at::Half* __restrict d,
                  const XIn& xin, float* y, int64_t K, int64_t N, int64_t m0) {
  const int64_t G = K / kGroup, B = K / kSuper;
  __m256 out[kGemmM][2], d2[2];
  for (int m = 0; m < M; ++m) out[m][0] = out[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t tg = t * G + g;
    if (g % (kSuper / kGroup) == 0) {
      const at::Half* dp = d + (t * B + g / (kSuper / kGroup)) * kRows;
      d2[0] = load8(dp);
      d2[1] = load8(dp + 8);
    }
    for (int H = 0; H < 2; ++H) {
      const int16_t* xs[kGemmM];
      for (int m = 0; m < M; ++m) xs[m] = xin.q + (m0 + m) * K + g * kGroup + 16 * H;
      __m256i acc[kGemmM][2];
      gemm_group<M, 8>(wbuf + g * 32 + 16 * H, xs, acc);
      const int8_t* s = sub + (2 * tg + H) * kRows;
      const __m256 sc0 = _mm256_mul_ps(d2[0], s8_to_ps(s)), sc1 = _mm256_mul_ps(d2[1], s8_to_ps(s + 8));
      for (int m = 0; m < M; ++m) {
        const __m256 step = _mm256_set1_ps(xin.step[(m0 + m) * G + g]);
        out[m][0] = _mm256_fmadd_ps(_mm256_mul_ps(sc0, step), _mm256_cvtepi32_ps(acc[m][0]), out[m][0]);
        out[m][1] = _mm256_fmadd_ps(_mm256_mul_ps(sc1, step), _mm256_cvtepi32_ps(acc[m][1]), out[m][1]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (m0 + m) * N + t * kRows + 8 * h, out[m][h]);
}

void run_q6(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& sub, const at::Tensor& d,
            const at::Tensor& y) {
  const XIn xin = prepare_x(x);
  const int64_t Mtot = x.size(0), K = x.size(1), G = K / kGroup, T = codes.size(0), N = T * kRows;
  const auto* c = codes.data_ptr<uint8_t>();
  const auto* s = sub.data_ptr<int8_t>();
  const auto* dp = d.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  if (Mtot >= kGemmMinRows) {
    const auto widen = [&](int64_t t, __m256i* w) {
      for (int64_t g = 0; g < G; ++g) widen_q6_tile(c + (t * G + g) * kQ6TileBytes, w + g * 32);
    };
    const auto rows = [&](const __m256i* w, int64_t t, int64_t m0, auto m) {
      gemm_rows_q6<decltype(m)::value>(w, t, s, dp, xin, yp, K, N, m0);
    };
    return many_rows(Mtot, T, G, widen, rows);
  }
  few_rows(Mtot, T, [&](int64_t t, int64_t m0, auto m) {
    q6_tile_row<decltype(m)::value>(c, s, dp, xin, yp, K, N, m0, t);
  });
}
#else
#error "cpu_tiled_gemv.cpp needs AVX-512 BF16, or AVX2 with FMA and F16C (cpu_tiled_gemv.available() checks first)"
#endif

// The argument checks both ops share.
void check_args(const at::Tensor& x, at::ScalarType x_type, const char* x_name, const at::Tensor& codes,
                const at::Tensor& scale, const at::Tensor& offset, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == x_type && x.is_contiguous(), "x: contiguous ", x_name,
              " [M, K] (this build's dtype)");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t K = x.size(1), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && codes.dim() == 3 && codes.size(1) == G && codes.size(2) == (bits == 4 ? 256 : 512)
              && codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes: uint8 [N/16, K/32, tile bytes]");
  TORCH_CHECK(scale.is_contiguous() && offset.is_contiguous(), "scale/offset must be contiguous");
  if (scale.scalar_type() == at::kByte) {  // K-quants' two levels (KScales)
    TORCH_CHECK(K % 256 == 0 && scale.dim() == 4 && scale.size(0) == codes.size(0) && scale.size(1) == G
                && scale.size(2) == 2 && scale.size(3) == kRows && offset.scalar_type() == at::kHalf
                && offset.dim() == 4 && offset.size(0) == codes.size(0) && offset.size(1) == K / 256
                && offset.size(2) == 2 && offset.size(3) == kRows,
                "K-quant scales: uint8 (sc, m) [N/16, K/32, 2, 16] and float16 (d, dmin) [N/16, K/256, 2, 16]");
    return;
  }
  TORCH_CHECK(scale.sizes() == offset.sizes() && scale.scalar_type() == offset.scalar_type() && scale.dim() == 3
              && scale.size(0) == codes.size(0) && scale.size(1) == G && scale.size(2) == kRows,
              "scale/offset: [N/16, K/32, 16], same dtype");
  TORCH_CHECK(scale.scalar_type() == at::kHalf || scale.scalar_type() == at::kFloat,
              "scale/offset must be float16 or float32 (or uint8 + float16: K-quant scales)");
}

// f(scales) with the store scale and offset hold (check_args has checked them).
template <typename F>
void with_scales(const at::Tensor& scale, const at::Tensor& offset, F&& f) {
  if (scale.scalar_type() == at::kByte) {
    f(KScales{scale.data_ptr<uint8_t>(), offset.data_ptr<at::Half>()});
  } else if (scale.scalar_type() == at::kHalf) {
    f(FlatScales<at::Half>{scale.data_ptr<at::Half>(), offset.data_ptr<at::Half>()});
  } else {
    f(FlatScales<float>{scale.data_ptr<float>(), offset.data_ptr<float>()});
  }
}

at::Tensor tiled_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                      int64_t bits, bool float_out) {
  constexpr auto kX = std::is_same<XT, float>::value ? at::kFloat : at::kBFloat16;  // this build's x
  check_args(x, kX, std::is_same<XT, float>::value ? "float32" : "bf16", codes, scale, offset, bits);
  const XIn xin = prepare_x(x);  // this build's x and its sums per group
  at::Tensor y = at::empty({x.size(0), codes.size(0) * kRows}, x.options().dtype(float_out ? at::kFloat : kX));
  with_scales(scale, offset, [&](const auto& sc) {
    if (bits == 4) run<4>(x, codes, sc, xin, y, float_out);
    else run<8>(x, codes, sc, xin, y, float_out);
  });
  return y;
}

// x @ W^T with x quantized to int8 per group of 32 (run_q8); bf16 x, AVX-512 VNNI + VBMI builds only.
at::Tensor tiled_gemm_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                         const at::Tensor& offset, int64_t bits, bool float_out) {
#if defined(EMBER_TILED_Q8)
  check_args(x, at::kBFloat16, "bf16", codes, scale, offset, bits);
  at::Tensor y = at::empty({x.size(0), codes.size(0) * kRows}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  with_scales(scale, offset, [&](const auto& sc) {
    if (bits == 4) run_q8<4>(x, codes, sc, y, float_out);
    else run_q8<8>(x, codes, sc, y, float_out);
  });
  return y;
#else
  TORCH_CHECK(false, "tiled_gemm_q8 needs a CPU with AVX-512 BF16, VNNI and VBMI (cpu_tiled_gemv.has_q8() says)");
#endif
}

// Q6_K's arguments: x [M, K] in this build's dtype, tiles uint8 [N/16, K/32, 384], sub_scale int8
// [N/16, K/32, 2, 16], d float16 [N/16, K/256, 16].
void check_q6k_args(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& sub, const at::Tensor& d) {
  constexpr bool f32 = std::is_same<XT, float>::value;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == (f32 ? at::kFloat : at::kBFloat16) && x.is_contiguous(), "x: contiguous ",
              f32 ? "float32" : "bf16", " [M, K] (this build's dtype)");
  const int64_t K = x.size(1), G = K / kGroup;
  TORCH_CHECK(K % 256 == 0 && tiles.dim() == 3 && tiles.size(1) == G && tiles.size(2) == 384
              && tiles.scalar_type() == at::kByte && tiles.is_contiguous(), "tiles: uint8 [N/16, K/32, 384], K % 256 == 0");
  TORCH_CHECK(sub.dim() == 4 && sub.size(0) == tiles.size(0) && sub.size(1) == G && sub.size(2) == 2
              && sub.size(3) == kRows && sub.scalar_type() == at::kChar && sub.is_contiguous(),
              "sub_scale: int8 [N/16, K/32, 2, 16]");
  TORCH_CHECK(d.dim() == 3 && d.size(0) == tiles.size(0) && d.size(1) == K / 256 && d.size(2) == kRows
              && d.scalar_type() == at::kHalf && d.is_contiguous(), "d: float16 [N/16, K/256, 16]");
}

// x @ W^T for Q6_K tiles: the GEMV (q8 false: bf16 x, or the AVX2 build's float32 x at any row count) or
// the int8-x path (q8 true, VNNI + VBMI builds).
at::Tensor q6k(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& sub, const at::Tensor& d,
               bool float_out, bool q8) {
  check_q6k_args(x, tiles, sub, d);
#if defined(__AVX512BF16__)
  at::Tensor y = at::empty({x.size(0), tiles.size(0) * kRows}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (!q8) {
    run_q6(x, tiles, sub, d, y, float_out);
    return y;
  }
#if defined(EMBER_TILED_Q8)
  run_q8_q6(x, tiles, sub, d, y, float_out);
  return y;
#else
  TORCH_CHECK(false, "tiled_q6k_gemm_q8 needs a CPU with AVX-512 BF16, VNNI and VBMI (cpu_tiled_gemv.has_q8() says)");
#endif
#else
  TORCH_CHECK(!q8, "tiled_q6k_gemm_q8 needs a CPU with AVX-512 BF16, VNNI and VBMI (cpu_tiled_gemv.has_q8() says)");
  at::Tensor y = at::empty({x.size(0), tiles.size(0) * kRows}, x.options().dtype(at::kFloat));  // float32 either way
  run_q6(x, tiles, sub, d, y);
  return y;
#endif
}

at::Tensor tiled_q6k_gemv(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& sub, const at::Tensor& d,
                          bool float_out) {
  return q6k(x, tiles, sub, d, float_out, false);
}

at::Tensor tiled_q6k_gemm_q8(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& sub, const at::Tensor& d,
                             bool float_out) {
  return q6k(x, tiles, sub, d, float_out, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("tiled_gemv(Tensor x, Tensor codes, Tensor scale, Tensor offset, int bits, bool float_out) -> Tensor");
  m.def("tiled_gemm_q8(Tensor x, Tensor codes, Tensor scale, Tensor offset, int bits, bool float_out) -> Tensor");
  m.def("tiled_q6k_gemv(Tensor x, Tensor tiles, Tensor sub_scale, Tensor d, bool float_out) -> Tensor");
  m.def("tiled_q6k_gemm_q8(Tensor x, Tensor tiles, Tensor sub_scale, Tensor d, bool float_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) {
  m.impl("tiled_gemv", &tiled_gemv);
  m.impl("tiled_gemm_q8", &tiled_gemm_q8);
  m.impl("tiled_q6k_gemv", &tiled_q6k_gemv);
  m.impl("tiled_q6k_gemm_q8", &tiled_q6k_gemm_q8);
}
