// x @ W^T for a few rows of bf16 x against 4- or 8-bit affine weights, AVX-512 BF16 (Zen4,
// Sapphire Rapids). W[n, k] = c[n, k] * scale[n, g] + offset[n, g], g = k / 32, codes c
// unsigned (4-bit 0..15, 8-bit 0..255). See cpu_tiled_gemv.py for the layout's why.
//
// A tile is 16 output rows x 32 inputs. Every code is an integer below 256, exact in bf16, so
// one vdpbf16ps multiplies a 16-row column pair of codes by a broadcast pair of x and sums into
// one float32 lane per row: each lane is one output row, so no horizontal sums, and the group's
// scale and offset apply once per tile: y += scale * sum(c x) + offset * sum(x).
//
// Tile bytes, row i (0..15), byte index b:
//   4-bit (256 B): b = 32 p + 2 i + e holds c[i][2p + e] (low nibble) and c[i][2p + 16 + e]
//                  (high nibble), p = 0..7; widened to 16 bits, (w & 15) | 0x4300 is the bf16
//                  of 128 + c, so the tile sums (128 + c) x and the offset term absorbs -128.
//   8-bit (512 B): b = 32 p + 2 i + e holds c[i][2p + e], p = 0..15; widened through float32.
// In both, 16-bit word 2i + e of a widened 32-byte run is row i's code for input 2p + e, which
// is the pair layout vdpbf16ps multiplies against (x[2p], x[2p + 1]).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>

namespace {

constexpr int kRows = 16;   // output rows per tile: one float32 lane each
constexpr int kGroup = 32;  // inputs per tile: one scale and offset per row
constexpr int kMaxM = 4;    // x rows per pass over a tile (accumulators: 2 per row)

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// The pair (x[k], x[k + 1]) in every 32-bit lane.
inline __m512bh pair(const at::BFloat16* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return (__m512bh)_mm512_set1_epi32(v);
}

inline float bf16_to_float(at::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
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
              const at::BFloat16* __restrict x, const float* __restrict xsum, void* y, bool float_out,
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

template <int BITS, typename S>
void run(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
         const at::Tensor& xsum, const at::Tensor& y, bool float_out) {
  const int64_t Mtot = x.size(0), K = x.size(1), T = codes.size(0), N = T * kRows;
  const auto* c = codes.data_ptr<uint8_t>();
  const S* s = scale.data_ptr<S>();
  const S* o = offset.data_ptr<S>();
  const auto* xp = x.data_ptr<at::BFloat16>();
  const float* xsp = xsum.data_ptr<float>();
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
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && codes.dim() == 3 && codes.size(1) == G && codes.size(2) == (bits == 4 ? 256 : 512)
              && codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes: uint8 [N/16, K/32, tile bytes]");
  TORCH_CHECK(scale.sizes() == offset.sizes() && scale.scalar_type() == offset.scalar_type() && scale.dim() == 3
              && scale.size(0) == codes.size(0) && scale.size(1) == G && scale.size(2) == kRows
              && scale.is_contiguous() && offset.is_contiguous(), "scale/offset: [N/16, K/32, 16], same dtype");
  // sum(x) per group, in float32 from the same bf16 values the tiles multiply
  at::Tensor xsum = at::empty({M, G}, x.options().dtype(at::kFloat));
  const auto* xp = x.data_ptr<at::BFloat16>();
  float* xs = xsum.data_ptr<float>();
  for (int64_t i = 0; i < M * G; ++i) {
    float acc = 0.f;
    for (int j = 0; j < kGroup; ++j) acc += bf16_to_float(xp[i * kGroup + j]);
    xs[i] = acc;
  }
  at::Tensor y = at::empty({M, codes.size(0) * kRows}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  const bool half = scale.scalar_type() == at::kHalf;
  TORCH_CHECK(half || scale.scalar_type() == at::kFloat, "scale/offset must be float16 or float32");
  if (bits == 4) {
    if (half) run<4, at::Half>(x, codes, scale, offset, xsum, y, float_out);
    else run<4, float>(x, codes, scale, offset, xsum, y, float_out);
  } else {
    if (half) run<8, at::Half>(x, codes, scale, offset, xsum, y, float_out);
    else run<8, float>(x, codes, scale, offset, xsum, y, float_out);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("tiled_gemv(Tensor x, Tensor codes, Tensor scale, Tensor offset, int bits, bool float_out) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) { m.impl("tiled_gemv", &tiled_gemv); }
