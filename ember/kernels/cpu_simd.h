// SIMD helpers shared by ember's C++ CPU kernels (included by the .cpp files beside it;
// cpp_build hashes this file into every kernel's build name, so a change here rebuilds them).
//
// The lane layer: ember_simd::avx512 (16 float lanes) and ember_simd::avx2 (8) hold the same few
// operations on float32 vectors (vec, kLanes, loads of float32 and bf16 rows, stores, arithmetic,
// horizontal sums and maxima), so a kernel's loops are written once over them. A kernel picks one per
// build after its own test of the macros (a kernel may need more than AVX-512F for its 16-lane build):
//   #if defined(__AVX512F__)
//   using namespace ember_simd::avx512;
//   #elif defined(__AVX2__) && defined(__FMA__)
//   using namespace ember_simd::avx2;
//   #endif
// A kernel's own overload of one of these names (a masked tail load, say) hides the shared ones.
#pragma once
#include <immintrin.h>

#include <c10/util/BFloat16.h>

namespace ember_simd {

// The ops whose 16- and 8-lane forms differ only in the width in the intrinsics' names (W: 512 or 256).
#define EMBER_SIMD_LANE_OPS(W)                                                                                 \
  using vec = __m##W;                                                                                          \
  inline vec vzero() { return _mm##W##_setzero_ps(); }                                                        \
  inline vec vset(float x) { return _mm##W##_set1_ps(x); }                                                    \
  inline vec vload(const float* p) { return _mm##W##_loadu_ps(p); }                                          \
  inline void vstore(float* p, vec a) { _mm##W##_storeu_ps(p, a); }                                           \
  inline vec vadd(vec a, vec b) { return _mm##W##_add_ps(a, b); }                                             \
  inline vec vsub(vec a, vec b) { return _mm##W##_sub_ps(a, b); }                                             \
  inline vec vmul(vec a, vec b) { return _mm##W##_mul_ps(a, b); }                                             \
  inline vec vdiv(vec a, vec b) { return _mm##W##_div_ps(a, b); }                                             \
  inline vec vmin(vec a, vec b) { return _mm##W##_min_ps(a, b); }                                             \
  inline vec vmax(vec a, vec b) { return _mm##W##_max_ps(a, b); }                                             \
  inline vec vclamp(vec x, float lo, float hi) { return _mm##W##_min_ps(_mm##W##_max_ps(x, vset(lo)), vset(hi)); } \
  /* the float bits with bf16's rounding (to nearest even, c10::BFloat16's for finite values) carried into  */ \
  /* the top half; round_bf16: x rounded to bf16 and back                                                   */ \
  inline __m##W##i bf16_rounded_bits(vec x) {                                                                  \
    const __m##W##i bits = _mm##W##_castps_si##W(x);                                                           \
    const __m##W##i lsb = _mm##W##_and_si##W(_mm##W##_srli_epi32(bits, 16), _mm##W##_set1_epi32(1));          \
    return _mm##W##_add_epi32(bits, _mm##W##_add_epi32(lsb, _mm##W##_set1_epi32(0x7FFF)));                     \
  }                                                                                                            \
  inline vec round_bf16(vec x) {                                                                               \
    return _mm##W##_castsi##W##_ps(_mm##W##_and_si##W(bf16_rounded_bits(x), _mm##W##_set1_epi32((int)0xFFFF0000u))); \
  }

#if defined(__AVX512F__)
namespace avx512 {
constexpr int kLanes = 16;
EMBER_SIMD_LANE_OPS(512)
inline vec vload(const c10::BFloat16* p) {  // bf16 is float32's top half: widen, shift
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float hsum(vec a) { return _mm512_reduce_add_ps(a); }
inline float hmax(vec a) { return _mm512_reduce_max_ps(a); }
// the first n lanes (n <= kLanes) of a masked load or store
inline __mmask16 first_lanes(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
}  // namespace avx512
#endif  // __AVX512F__

#if defined(__AVX2__)
namespace avx2 {  // the FMA-less ops only need AVX2 (the row kernels); vfma needs FMA too
constexpr int kLanes = 8;
EMBER_SIMD_LANE_OPS(256)
inline vec vload(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#if defined(__FMA__)
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
#endif
inline float hsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax(vec a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
// all ones in the first n lanes (n <= kLanes): the mask of _mm256_maskload_ps / _mm256_maskstore_ps
inline __m256i first_lanes(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
}  // namespace avx2
#endif  // __AVX2__
#undef EMBER_SIMD_LANE_OPS

#if defined(__AVX512F__)

// exp(x) of 16 lanes for x in [-87, 88]: x = n ln2 + r (Cody-Waite), Cephes' degree-6 polynomial
// for exp(r) on |r| <= ln2 / 2, times 2^n built in the exponent bits. Within 2 ulp of std::exp
// (GCC does not vectorize std::exp). Callers clamp x and handle the ends of float32's range.
inline __m512 exp_in_range(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// exp(x) of 16 lanes for x <= 0 (a score minus its running max), 0 below -87 (float32 underflow):
// the softmax exp of the attention kernels.
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(live, exp_in_range(_mm512_max_ps(x, _mm512_set1_ps(-87.f))));
}

#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
// The same exp on 8 lanes for the AVX2 builds (Zen2/3, Haswell on): the polynomial and range
// reduction of exp_in_range above, so both builds round alike.
inline __m256 exp_in_range(__m256 x) {
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// exp(x) of 8 lanes for x <= 0, 0 below -87 (float32 underflow).
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
  return _mm256_and_ps(live, exp_in_range(_mm256_max_ps(x, _mm256_set1_ps(-87.f))));
}
#endif  // __AVX2__ && __FMA__

}  // namespace ember_simd
