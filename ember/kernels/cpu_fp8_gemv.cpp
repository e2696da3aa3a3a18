// y = x @ W^T on CPU for fp8 e4m3 weights with float32 block scales (Qwen's / DeepSeek's block-wise FP8
// checkpoints), float32 activations, float32 out (cpu_fp8_gemv.py says where the engine uses it and why).
//
// W is [N, K] float8_e4m3fn bytes; the real weight is W[n, k] * scale[scale_row[n], k / block_k]. The scales
// stay as the checkpoint gives them (a [rows of blocks, K blocks] grid); scale_row maps each weight row to its
// row of the grid, so a fused layer whose parts do not start on a block boundary (q | k | v, gate | up) needs
// no copy of anything (ember.quant.fp8_blocks builds it).
//
// Decoding: an e4m3 byte s.eeee.mmm is moved into fp16's bit places (s at bit 15, eeee.mmm at bits 13..7),
// where it reads as the same value / 2^8 (fp16's exponent bias is 15, e4m3's 7; e4m3's subnormals land on
// fp16's subnormals), and F16C widens it to float32 exactly. The 2^8 is folded into the block's scale, so a
// decoded weight times (scale * 2^8) is the float32 product weight * scale, rounded once, as the torch
// reference (weight.float() * scale) computes it; only the order of the float32 sums differs.
//
// Few rows of x (decode, a short verify; up to the caller's gemv_max_rows): each thread takes groups of 4
// weight rows; a step decodes 16 (AVX2) or 32 (AVX-512) weights of each row, scales them by their block's
// scale, and FMAs them against up to 3 rows of x at once (12 accumulators); more rows of x re-read the 4
// weight rows from L1. The weight is read once at 1 byte an element: a quarter of float32's bytes.
// Many rows (prefill): the GEMM is compute-bound, so a panel of weight rows (4 MiB of float32) is decoded
// and scaled at a time and torch's float32 GEMM runs x against it, writing its columns of y in place.
//
// Needs AVX2 + FMA + F16C; an AVX-512 (F + BW) build takes 32 weights a step.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

constexpr int64_t kRows = 4;               // weight rows a GEMV group holds
constexpr int kXRows = 3;                  // rows of x a pass runs against them
constexpr int64_t kPanelFloats = 1 << 20;  // a prefill panel: 4 MiB of decoded weights
constexpr float kFp16Shift = 256.f;        // e4m3 bits read as fp16 are the value / 2^8
constexpr int64_t kTaskBytes = 1 << 15;    // weight bytes a thread's task holds at least: a small layer runs
                                           // on the calling thread (an OpenMP region costs more than it)

// The float32 value of every e4m3fn byte (0x7F / 0xFF are NaN), for the scalar tails and the panels.
const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float v = e == 0 ? std::ldexp(float(m) / 8.f, -6) : std::ldexp(1.f + float(m) / 8.f, e - 7);
      if (e == 15 && m == 7) v = std::numeric_limits<float>::quiet_NaN();
      t[b] = (b & 0x80) ? -v : v;
    }
    return t;
  }();
  return table;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kStep = 32;  // weights a step decodes
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset(float v) { return _mm512_set1_ps(v); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a); }
constexpr int64_t kLanes = 16;
// 32 e4m3 bytes -> two vectors of 16 floats (value / 2^8)
inline void decode(const uint8_t* p, Vec& lo, Vec& hi) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i h = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8),
                                    _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x7F)), 7));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}
#else
constexpr int64_t kStep = 16;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset(float v) { return _mm256_set1_ps(v); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline float vsum(Vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
constexpr int64_t kLanes = 8;
// 16 e4m3 bytes -> two vectors of 8 floats (value / 2^8)
inline void decode(const uint8_t* p, Vec& lo, Vec& hi) {
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7F)), 7));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
#endif

struct Problem {
  const float* x;        // [M, K]
  const uint8_t* w;      // [N, K]
  const float* scale;    // [B, KB]
  const int32_t* srow;   // [N]: row of the scale grid
  int64_t M, N, K, KB, block_k;
  float* y;              // [M, N]
};

// y[m, n0 + r] for R weight rows from n0 and MB rows of x from m0: block by block over K, each step's
// decoded weights scaled by their block's scale, the block's last < kStep weights through the table.
template <int R, int MB>
void dot_rows(const Problem& p, int64_t n0, int64_t m0) {
  const auto& table = e4m3_table();
  Vec acc[R][MB];
  float tail[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = vzero(), tail[r][m] = 0.f;
  const float* x = p.x + m0 * p.K;
  for (int64_t kb = 0; kb < p.KB; ++kb) {
    const int64_t k0 = kb * p.block_k, k1 = std::min(p.K, k0 + p.block_k);
    float s[R];
    Vec sv[R];
    for (int r = 0; r < R; ++r) {
      s[r] = p.scale[int64_t(p.srow[n0 + r]) * p.KB + kb];
      sv[r] = vset(s[r] * kFp16Shift);
    }
    int64_t k = k0;
    for (; k + kStep <= k1; k += kStep)
      for (int r = 0; r < R; ++r) {
        Vec lo, hi;
        decode(p.w + (n0 + r) * p.K + k, lo, hi);
        lo = vmul(lo, sv[r]);
        hi = vmul(hi, sv[r]);
        for (int m = 0; m < MB; ++m) {
          acc[r][m] = vfma(lo, vload(x + m * p.K + k), acc[r][m]);
          acc[r][m] = vfma(hi, vload(x + m * p.K + k + kLanes), acc[r][m]);
        }
      }
    for (; k < k1; ++k)
      for (int r = 0; r < R; ++r) {
        const float wv = table[p.w[(n0 + r) * p.K + k]] * s[r];
        for (int m = 0; m < MB; ++m) tail[r][m] += wv * x[m * p.K + k];
      }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) p.y[(m0 + m) * p.N + n0 + r] = vsum(acc[r][m]) + tail[r][m];
}

// R weight rows against every row of x, kXRows at a time.
template <int R>
void rows_against_x(const Problem& p, int64_t n0) {
  int64_t m = 0;
  for (; m + kXRows <= p.M; m += kXRows) dot_rows<R, kXRows>(p, n0, m);
  for (; m + 2 <= p.M; m += 2) dot_rows<R, 2>(p, n0, m);
  if (m < p.M) dot_rows<R, 1>(p, n0, m);
}

void gemv(const Problem& p) {
  const int64_t groups = (p.N + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / (kRows * p.K * std::max<int64_t>(p.M, 1)));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = g * kRows;
      if (n + kRows <= p.N) {
        rows_against_x<kRows>(p, n);
      } else {
        for (int64_t r = n; r < p.N; ++r) rows_against_x<1>(p, r);
      }
    }
  });
}

// Weight rows [n0, n0 + rows) decoded and scaled into out [rows, K] (float32 products weight * scale).
void decode_rows(const Problem& p, int64_t n0, int64_t rows, float* out) {
  const auto& table = e4m3_table();
  at::parallel_for(0, rows, std::max<int64_t>(1, kTaskBytes / p.K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* w = p.w + (n0 + r) * p.K;
      const float* s = p.scale + int64_t(p.srow[n0 + r]) * p.KB;
      float* o = out + r * p.K;
      for (int64_t kb = 0; kb < p.KB; ++kb) {
        const int64_t k0 = kb * p.block_k, k1 = std::min(p.K, k0 + p.block_k);
        int64_t k = k0;
        const Vec sv = vset(s[kb] * kFp16Shift);
        for (; k + kStep <= k1; k += kStep) {
          Vec lo, hi;
          decode(w + k, lo, hi);
#if defined(__AVX512F__) && defined(__AVX512BW__)
          _mm512_storeu_ps(o + k, vmul(lo, sv));
          _mm512_storeu_ps(o + k + kLanes, vmul(hi, sv));
#else
          _mm256_storeu_ps(o + k, vmul(lo, sv));
          _mm256_storeu_ps(o + k + kLanes, vmul(hi, sv));
#endif
        }
        for (; k < k1; ++k) o[k] = table[w[k]] * s[kb];
      }
    }
  });
}

void panels(const Problem& p, const at::Tensor& x, at::Tensor& y) {
  const int64_t rows = std::max<int64_t>(16, std::min<int64_t>(p.N, kPanelFloats / std::max<int64_t>(p.K, 1)));
  at::Tensor panel = at::empty({rows, p.K}, x.options());
  for (int64_t n = 0; n < p.N; n += rows) {
    const int64_t r = std::min(rows, p.N - n);
    decode_rows(p, n, r, panel.data_ptr<float>());
    at::Tensor out = y.narrow(1, n, r);  // row stride N: the GEMM writes it in place
    at::mm_out(out, x, panel.narrow(0, 0, r).t());
  }
}

// x float32 [M, K]; w float8_e4m3fn (or its bytes as uint8) [N, K]; scale float32 [B, ceil(K / block_k)];
// scale_row int32 [N] (values < B) -> float32 [M, N]. All contiguous.
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, const at::Tensor& scale_row,
                      int64_t block_k, int64_t gemv_max_rows) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && scale.device().is_cpu() && scale_row.device().is_cpu(),
              "fp8_linear: CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "fp8_linear: x must be contiguous float32 [M, K]");
  TORCH_CHECK((w.scalar_type() == at::kFloat8_e4m3fn || w.scalar_type() == at::kByte) && w.dim() == 2 &&
                  w.is_contiguous(),
              "fp8_linear: w must be contiguous float8_e4m3fn [N, K]");
  TORCH_CHECK(x.size(1) == w.size(1), "fp8_linear: x has ", x.size(1), " columns, w ", w.size(1));
  TORCH_CHECK(block_k > 0, "fp8_linear: block_k must be positive");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1), KB = (K + block_k - 1) / block_k;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 2 && scale.is_contiguous() && scale.size(1) == KB,
              "fp8_linear: scale must be contiguous float32 [rows, ", KB, "] for K ", K, " in blocks of ", block_k);
  TORCH_CHECK(scale_row.scalar_type() == at::kInt && scale_row.dim() == 1 && scale_row.size(0) == N &&
                  scale_row.is_contiguous(),
              "fp8_linear: scale_row must be contiguous int32 [", N, "]");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const int32_t* srow = scale_row.data_ptr<int32_t>();
  const int64_t B = scale.size(0);
  TORCH_CHECK(std::all_of(srow, srow + N, [B](int32_t r) { return r >= 0 && r < B; }),
              "fp8_linear: scale_row holds a row outside the scale's ", B);
  const Problem p{x.data_ptr<float>(), reinterpret_cast<const uint8_t*>(w.data_ptr()), scale.data_ptr<float>(),
                  srow, M, N, K, KB, block_k, y.data_ptr<float>()};
  if (M > gemv_max_rows) {
    panels(p, x, y);
  } else {
    gemv(p);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("fp8_linear(Tensor x, Tensor w, Tensor scale, Tensor scale_row, int block_k, int gemv_max_rows) -> Tensor");
  m.impl("fp8_linear", c10::DispatchKey::CPU, &fp8_linear);
}
