// SIMD helpers shared by ember's C++ CPU kernels (included by the .cpp files beside it;
// cpp_build hashes this file into every kernel's build name, so a change here rebuilds them).
#pragma once
#include <immintrin.h>

namespace ember_simd {

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
