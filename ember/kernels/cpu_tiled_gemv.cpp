// x @ W^T for a few rows of x against 4- or 8-bit affine weights. W[n, k] = c[n, k] * scale[n, g]
// + offset[n, g], g = k / 32, codes c unsigned (4-bit 0..15, 8-bit 0..255). Two builds of one
// tile layout (cpu_tiled_gemv.py says why it is shaped so):
// - AVX-512 BF16 (Zen4, Sapphire Rapids): bf16 x, vdpbf16ps;
// - AVX2 + FMA + F16C (Zen2/3, Haswell on): float32 x (the engine's dtype where bf16 has no
//   instructions), codes spread to float32 and multiplied by a broadcast x with FMA: exact
//   products, float32 sums, as a float32 GEMV over the dequantized weight.
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
// AVX2: in-lane byte shuffles spread each 128-bit half of a run (8 rows x 2 inputs) into dwords,
// 4 rows of one input at a time, which become float32 codes (vcvtdq2ps).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int kRows = 16;   // output rows per tile: one float32 lane each
constexpr int kGroup = 32;  // inputs per tile: one scale and offset per row
constexpr int kMaxM = 4;    // x rows per pass over a tile (accumulators: 2 per row)

#if defined(__AVX512BF16__)
using XT = at::BFloat16;  // this build's x

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// The pair (x[k], x[k + 1]) in every 32-bit lane.
inline __m512bh pair(const at::BFloat16* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return (__m512bh)_mm512_set1_epi32(v);
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
template <int BITS, typename S, int M>
void tile_row(const uint8_t* __restrict codes, const S* __restrict scale, const S* __restrict offset,
              const XT* __restrict x, const float* __restrict xsum, void* y, bool float_out,
              int64_t K, int64_t N, int64_t m0, int64_t t) {
  constexpr int kTileBytes = BITS == 4 ? 256 : 512;
  const int64_t G = K / kGroup;
  const __m512 shift = _mm512_set1_ps(BITS == 4 ? 128.f : 0.f);
  __m512 out[kMaxM];
  for (int m = 0; m < M; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t tg = t * G + g;
    const at::BFloat16* xs[kMaxM];
    for (int m = 0; m < M; ++m) xs[m] = x + (m0 + m) * K + g * kGroup;
    __m512 acc[kMaxM];
    tile_dot<BITS, M>(codes + tg * kTileBytes, xs, acc);
    const __m512 s = load16(scale + tg * kRows);
    const __m512 o = _mm512_fnmadd_ps(shift, s, load16(offset + tg * kRows));  // offset - 128 s for 4-bit
    for (int m = 0; m < M; ++m)
      out[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(xsum[(m0 + m) * G + g]), _mm512_fmadd_ps(s, acc[m], out[m]));
  }
  for (int m = 0; m < M; ++m) {
    const int64_t at = (m0 + m) * N + t * kRows;
    if (float_out) _mm512_storeu_ps(static_cast<float*>(y) + at, out[m]);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<at::BFloat16*>(y) + at), (__m256i)_mm512_cvtneps_pbh(out[m]));
  }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
using XT = float;  // this build's x

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// Byte shuffles that spread a 32-byte run's codes into float32-ready dwords. Each 128-bit half of a
// run holds 8 rows x 2 inputs (byte 2i + e); kSpread[e][q] puts rows 4q..4q+3 of input e into the
// low bytes of the half's 4 dwords (the rest zero). In-lane shuffles: Zen3 runs two a cycle, where
// the lane-crossing byte-to-dword widening (vpmovzxbd) of the first AVX2 build ran at 1.8x the cost.
struct SpreadMasks {
  alignas(32) int8_t b[2][2][32];
};
constexpr SpreadMasks make_spread() {
  SpreadMasks m{};
  for (int e = 0; e < 2; ++e)
    for (int q = 0; q < 2; ++q)
      for (int half = 0; half < 2; ++half)
        for (int r = 0; r < 4; ++r)
          for (int j = 0; j < 4; ++j)
            m.b[e][q][16 * half + 4 * r + j] = j == 0 ? static_cast<int8_t>(2 * (4 * q + r) + e) : int8_t(-128);
  return m;
}
constexpr SpreadMasks kSpread = make_spread();

// Independent FMA chains per x row: Zen3's FMA has 4 cycles latency and 2 a cycle, so one row of x
// needs 8 chains (4 slots x 2 row quads) to keep both units busy; more rows share them.
template <int M>
constexpr int kSlots = M == 1 ? 4 : M == 2 ? 2 : 1;

// The 32 codes of one run (bytes, already one code each) times inputs x[k0] (e = 0) and x[k0 + 1]
// (e = 1) for M rows of x, into chains a[m][slot][q]; q = 0 holds rows 0-3 | 8-11, q = 1 rows
// 4-7 | 12-15 (the two 128-bit halves).
template <int M>
inline void run_dot(__m256i r, const float* const* xs, int k0, int slot, __m256 (&a)[kMaxM][4][2]) {
  for (int e = 0; e < 2; ++e)
    for (int q = 0; q < 2; ++q) {
      const __m256i mask = _mm256_load_si256(reinterpret_cast<const __m256i*>(kSpread.b[e][q]));
      const __m256 c = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(r, mask));
      for (int m = 0; m < M; ++m) {
        __m256& acc = a[m][(2 * slot + e) % kSlots<M>][q];
        acc = _mm256_fmadd_ps(c, _mm256_broadcast_ss(xs[m] + k0 + e), acc);
      }
    }
}

// One tile for M rows of x (pointers at the tile's first input): sum(c x) per row, as rows 0-7
// and 8-15, into acc[m][h].
template <int BITS, int M>
inline void tile_dot(const uint8_t* __restrict c, const float* const* xs, __m256 (&acc)[kMaxM][2]) {
  __m256 a[kMaxM][4][2];
  for (int m = 0; m < M; ++m)
    for (int s = 0; s < kSlots<M>; ++s) a[m][s][0] = a[m][s][1] = _mm256_setzero_ps();
  if constexpr (BITS == 4) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * p));
      run_dot<M>(_mm256_and_si256(w, low4), xs, 2 * p, 0, a);
      run_dot<M>(_mm256_and_si256(_mm256_srli_epi16(w, 4), low4), xs, 2 * p + 16, 1, a);
    }
  } else {
#pragma GCC unroll 4
    for (int p = 0; p < 16; ++p)
      run_dot<M>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * p)), xs, 2 * p, p & 1, a);
  }
  for (int m = 0; m < M; ++m) {
    __m256 q[2];
    for (int i = 0; i < 2; ++i) {
      q[i] = a[m][0][i];
      for (int s = 1; s < kSlots<M>; ++s) q[i] = _mm256_add_ps(q[i], a[m][s][i]);
    }
    acc[m][0] = _mm256_permute2f128_ps(q[0], q[1], 0x20);  // rows 0-3 | 4-7
    acc[m][1] = _mm256_permute2f128_ps(q[0], q[1], 0x31);  // rows 8-11 | 12-15
  }
}

// Row tile t (16 outputs) over all of K, for x rows [m0, m0 + M).
template <int BITS, typename S, int M>
void tile_row(const uint8_t* __restrict codes, const S* __restrict scale, const S* __restrict offset,
              const XT* __restrict x, const float* __restrict xsum, void* y, bool float_out,
              int64_t K, int64_t N, int64_t m0, int64_t t) {
  constexpr int kTileBytes = BITS == 4 ? 256 : 512;
  const int64_t G = K / kGroup;
  __m256 out[kMaxM][2];
  for (int m = 0; m < M; ++m) out[m][0] = out[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t tg = t * G + g;
    const float* xs[kMaxM];
    for (int m = 0; m < M; ++m) xs[m] = x + (m0 + m) * K + g * kGroup;
    __m256 acc[kMaxM][2];
    tile_dot<BITS, M>(codes + tg * kTileBytes, xs, acc);
    for (int h = 0; h < 2; ++h) {
      const __m256 s = load8(scale + tg * kRows + 8 * h), o = load8(offset + tg * kRows + 8 * h);
      for (int m = 0; m < M; ++m)
        out[m][h] = _mm256_fmadd_ps(o, _mm256_set1_ps(xsum[(m0 + m) * G + g]), _mm256_fmadd_ps(s, acc[m][h], out[m][h]));
    }
  }
  for (int m = 0; m < M; ++m)  // float32 out either way: x is float32
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(static_cast<float*>(y) + (m0 + m) * N + t * kRows + 8 * h, out[m][h]);
}
#else
#error "cpu_tiled_gemv.cpp needs AVX-512 BF16, or AVX2 with FMA and F16C (cpu_tiled_gemv.available() checks first)"
#endif

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <int BITS, typename S>
void run(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
         const float* xsp, const at::Tensor& y, bool float_out) {
  const int64_t Mtot = x.size(0), K = x.size(1), T = codes.size(0), N = T * kRows;
  const auto* c = codes.data_ptr<uint8_t>();
  const S* s = scale.data_ptr<S>();
  const S* o = offset.data_ptr<S>();
  const auto* xp = x.data_ptr<XT>();
  void* yp = y.data_ptr();
  // Split the tiles across threads; every thread runs all x rows over its tiles, a few rows at
  // a time, so a tile's codes are widened once per chunk of kMaxM rows while still in L1.
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t m0 = 0; m0 < Mtot; m0 += kMaxM) {
        switch (std::min<int64_t>(kMaxM, Mtot - m0)) {
          case 1: tile_row<BITS, S, 1>(c, s, o, xp, xsp, yp, float_out, K, N, m0, t); break;
          case 2: tile_row<BITS, S, 2>(c, s, o, xp, xsp, yp, float_out, K, N, m0, t); break;
          case 3: tile_row<BITS, S, 3>(c, s, o, xp, xsp, yp, float_out, K, N, m0, t); break;
          default: tile_row<BITS, S, 4>(c, s, o, xp, xsp, yp, float_out, K, N, m0, t); break;
        }
      }
    }
  });
}

at::Tensor tiled_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                      int64_t bits, bool float_out) {
  constexpr auto kX = std::is_same<XT, float>::value ? at::kFloat : at::kBFloat16;  // this build's x
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == kX && x.is_contiguous(),
              "x: contiguous ", std::is_same<XT, float>::value ? "float32" : "bf16", " [M, K] (this build's dtype)");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && codes.dim() == 3 && codes.size(1) == G && codes.size(2) == (bits == 4 ? 256 : 512)
              && codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes: uint8 [N/16, K/32, tile bytes]");
  TORCH_CHECK(scale.sizes() == offset.sizes() && scale.scalar_type() == offset.scalar_type() && scale.dim() == 3
              && scale.size(0) == codes.size(0) && scale.size(1) == G && scale.size(2) == kRows
              && scale.is_contiguous() && offset.is_contiguous(), "scale/offset: [N/16, K/32, 16], same dtype");
  // sum(x) per group, in float32 from the same values the tiles multiply
  // (the calling thread's buffer, read by the parallel region below: no allocation per call)
  thread_local std::vector<float> xsum;
  xsum.resize(M * G);
  const auto* xp = x.data_ptr<XT>();
  float* xs = xsum.data();
  for (int64_t i = 0; i < M * G; ++i) {
    float acc = 0.f;
    for (int j = 0; j < kGroup; ++j) acc += to_float(xp[i * kGroup + j]);
    xs[i] = acc;
  }
  at::Tensor y = at::empty({M, codes.size(0) * kRows}, x.options().dtype(float_out ? at::kFloat : kX));
  const bool half = scale.scalar_type() == at::kHalf;
  TORCH_CHECK(half || scale.scalar_type() == at::kFloat, "scale/offset must be float16 or float32");
  if (bits == 4) {
    if (half) run<4, at::Half>(x, codes, scale, offset, xs, y, float_out);
    else run<4, float>(x, codes, scale, offset, xs, y, float_out);
  } else {
    if (half) run<8, at::Half>(x, codes, scale, offset, xs, y, float_out);
    else run<8, float>(x, codes, scale, offset, xs, y, float_out);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("tiled_gemv(Tensor x, Tensor codes, Tensor scale, Tensor offset, int bits, bool float_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) { m.impl("tiled_gemv", &tiled_gemv); }
