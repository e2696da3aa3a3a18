// y = x @ W^T on CPU for 16-bit weights (bf16 or fp16) under float32 activations, in float32
// (cpu_half_gemv.py says where the engine uses it and why).
//
// One or two rows of x (decode, a short verify): each thread takes blocks of 8 weight rows; a step
// loads 32 bytes of a row (16 weights) and widens them to float32 in registers without a shuffle (bf16:
// the even weights by a 16-bit shift of their 32-bit lanes, the odd ones by masking the low half, x
// stored evens-then-odds once a call; fp16: vcvtph2ps), one FMA per weight and row of x, and asks for
// each row's line 1 KiB ahead (8 rows in flight outrun the hardware prefetcher). The weight is read
// once at half of float32's bytes. More rows (up to the caller's gemv_max_rows): 8 weight rows x 1024
// inputs are widened once into a float32 block in L1 and every row of x runs against it, 4 weight rows
// x 3 rows of x a pass.
// Many rows (prefill): the GEMM is compute-bound, and a dot-product loop cannot reuse registers as
// a GEMM's microkernel does, so the weight is widened a panel of rows at a time into a float32 buffer
// (4 MiB: the panel is a prefill step's transient, kept in the heap's high-water mark), and torch's float32 GEMM (MKL / oneDNN) runs x against the panel, writing its columns of y
// in place. Every path gives float32 products of the exact weights; they differ only in the order of
// the float32 sums. Figures: docs/tuning.md, "16-bit weights under float32 activations".
//
// Needs AVX2 + FMA + F16C (every x86 CPU since Haswell / Zen 1); the same code serves AVX-512 machines
// running float32.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRows = 8;              // weight rows a GEMV block holds
constexpr int64_t kPanelFloats = 1 << 20; // a panel: 4 MiB of widened weights
constexpr int64_t kStreamMaxRows = 2;     // rows of x the streaming GEMV takes; more: widened blocks
constexpr int64_t kChunk = 1024;          // inputs of a widened block: 8 rows x 1024 floats = 32 KiB
constexpr int64_t kStep = 16;             // inputs a step: 32 bytes of weights
constexpr int64_t kPrefetch = 1024;         // bytes ahead each row's line is asked for (512: 26 ms, none: 32 ms
                                           // for the 248K-row head that takes 24 here; docs/tuning.md)

// x in the order a step's weights widen to. bf16: the 16 weights of a step widen without a shuffle,
// the even-indexed ones by a 16-bit shift of their 32-bit lanes and the odd ones by masking off the
// low half, so x's 16 values are stored evens then odds. fp16 (vcvtph2ps keeps order): as they are.
template <bool BF16>
void order_x(const float* x, int64_t M, int64_t K, float* out) {
  const int64_t steps = K / kStep;
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * K;
    float* dst = out + m * K;
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t i = 0; i < kStep; ++i) {
        const int64_t from = BF16 ? (i < 8 ? 2 * i : 2 * (i - 8) + 1) : i;
        dst[s * kStep + i] = src[s * kStep + from];
      }
    for (int64_t k = steps * kStep; k < K; ++k) dst[k] = src[k];
  }
}

// a0 += weights [0, 8) of the step times x's first 8 (in order_x's order), a1 the other 8.
template <bool BF16>
inline void step_fma(const uint16_t* w, const float* x, __m256& a0, __m256& a1) {
  if constexpr (BF16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xFFFF0000u))));
    a0 = _mm256_fmadd_ps(even, _mm256_loadu_ps(x), a0);
    a1 = _mm256_fmadd_ps(odd, _mm256_loadu_ps(x + 8), a1);
  } else {
    a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))), _mm256_loadu_ps(x), a0);
    a1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8))),
                         _mm256_loadu_ps(x + 8), a1);
  }
}

template <bool BF16>
inline float widen1(uint16_t v) {
  if constexpr (BF16) {
    const uint32_t bits = uint32_t(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return _cvtsh_ss(v);
  }
}

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// y[m * ldy + r] = sum_k w[r * K + k] x[m * K + k] for R weight rows and MB rows of x (xo: x in
// order_x's order, for the whole steps; x as it is for the tail). With MB 1, each row's line
// kPrefetch bytes ahead is requested: R streams at once outrun the hardware prefetcher.
template <bool BF16, int R, int MB>
inline void dot_block(const float* __restrict xo, const float* __restrict x, const uint16_t* __restrict w, int64_t K,
                      float* __restrict y, int64_t ldy) {
  __m256 a0[R][MB], a1[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) a0[r][m] = a1[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + kStep <= K; k += kStep)
    for (int r = 0; r < R; ++r) {
      if (MB == 1 && kPrefetch && (k & 31) == 0)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k) + kPrefetch, _MM_HINT_T0);
      for (int m = 0; m < MB; ++m)  // MB > 1: one chain a pair, so R x MB x 2 sums do not spill
        step_fma<BF16>(w + r * K + k, xo + m * K + k, a0[r][m], MB == 1 ? a1[r][m] : a0[r][m]);
    }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) {
      float s = hsum(_mm256_add_ps(a0[r][m], a1[r][m]));
      for (int64_t t = k; t < K; ++t) s += widen1<BF16>(w[r * K + t]) * x[m * K + t];
      y[m * ldy + r] = s;
    }
}

// R weight rows against every row of x: two rows of x at a time over R / 2 weight rows (the pair
// re-reads its weights from L1), a last single row over all R.
template <bool BF16, int R>
inline void rows_against_x(const float* xo, const float* x, int64_t M, const uint16_t* w, int64_t K, float* y,
                           int64_t N) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) {
    if constexpr (R >= 2) {
      dot_block<BF16, R / 2, 2>(xo + m * K, x + m * K, w, K, y + m * N, N);
      dot_block<BF16, R / 2, 2>(xo + m * K, x + m * K, w + (R / 2) * K, K, y + m * N + R / 2, N);
    } else {
      dot_block<BF16, R, 2>(xo + m * K, x + m * K, w, K, y + m * N, N);
    }
  }
  if (m < M) dot_block<BF16, R, 1>(xo + m * K, x + m * K, w, K, y + m * N, N);
}

// y[m * ldy + r] (+)= sum_k w[r * ldw + k] x[m * ldx + k], k < len, for R rows of float32 weights
// (widened, in L1) and MB rows of x: each loaded weight vector serves MB rows, each x vector R.
template <int R, int MB>
inline void dot_block_f32(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t ldw, int64_t len,
                          float* __restrict y, int64_t ldy, bool accumulate) {
  __m256 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= len; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(w + r * ldw + k);
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) {
      float s = hsum(acc[r][m]);
      for (int64_t t = k; t < len; ++t) s += w[r * ldw + t] * x[m * ldx + t];
      y[m * ldy + r] = accumulate ? y[m * ldy + r] + s : s;
    }
}

template <bool BF16>
void widen_row(const uint16_t* src, int64_t K, float* dst) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
    _mm256_storeu_ps(dst + k, BF16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                   : _mm256_cvtph_ps(h));
  }
  for (; k < K; ++k) dst[k] = widen1<BF16>(src[k]);
}

// kRows weight rows widened once into a float32 block, kChunk inputs at a time (8 x 1024 floats: 32 KiB,
// L1), then every row of x against it, 4 weight rows x 3 rows of x a pass (12 sums, 4 weight vectors,
// an x vector); each chunk's sums add to the last's.
template <bool BF16>
void rows_widened(const float* x, int64_t M, const uint16_t* w, int64_t rows, int64_t K, float* y, int64_t N,
                  float* block) {
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t len = std::min(kChunk, K - k0);
    const bool acc = k0 > 0;
    for (int64_t r = 0; r < rows; ++r) widen_row<BF16>(w + r * K + k0, len, block + r * len);
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      int64_t m = 0;
      for (; m + 3 <= M; m += 3) dot_block_f32<4, 3>(x + m * K + k0, K, block + r * len, len, len, y + m * N + r, N, acc);
      for (; m < M; ++m) dot_block_f32<4, 1>(x + m * K + k0, K, block + r * len, len, len, y + m * N + r, N, acc);
    }
    for (; r < rows; ++r)
      for (int64_t m = 0; m < M; ++m)
        dot_block_f32<1, 1>(x + m * K + k0, K, block + r * len, len, len, y + m * N + r, N, acc);
  }
}

template <bool BF16>
void gemv(const float* x, int64_t M, const uint16_t* w, int64_t N, int64_t K, float* y) {
  const int64_t blocks = (N + kRows - 1) / kRows;
  if (M > kStreamMaxRows) {
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> block(kRows * std::min(K, kChunk));
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n = b * kRows;
        rows_widened<BF16>(x, M, w + n * K, std::min(kRows, N - n), K, y + n, N, block.data());
      }
    });
    return;
  }
  std::vector<float> ordered(BF16 ? M * K : 0);
  if (BF16) order_x<true>(x, M, K, ordered.data());
  const float* xo = BF16 ? ordered.data() : x;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * kRows;
      if (n + kRows <= N) {
        rows_against_x<BF16, kRows>(xo, x, M, w + n * K, K, y + n, N);
      } else {
        for (int64_t r = n; r < N; ++r) rows_against_x<BF16, 1>(xo, x, M, w + r * K, K, y + r, N);
      }
    }
  });
}

template <bool BF16>
void widen_rows(const uint16_t* w, int64_t rows, int64_t K, float* out) {
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) widen_row<BF16>(w + r * K, K, out + r * K);
  });
}

template <bool BF16>
void panels(const at::Tensor& x, const uint16_t* w, int64_t N, int64_t K, at::Tensor& y) {
  const int64_t rows = std::max<int64_t>(16, std::min<int64_t>(N, kPanelFloats / std::max<int64_t>(K, 1)));
  at::Tensor panel = at::empty({rows, K}, x.options());
  for (int64_t n = 0; n < N; n += rows) {
    const int64_t p = std::min(rows, N - n);
    widen_rows<BF16>(w + n * K, p, K, panel.data_ptr<float>());
    at::Tensor out = y.narrow(1, n, p);  // row stride N: the GEMM writes it in place
    at::mm_out(out, x, panel.narrow(0, 0, p).t());
  }
}

// x float32 [M, K], w bf16 / fp16 [N, K] (both contiguous) -> float32 [M, N]; the GEMV up to
// gemv_max_rows rows of x, the widened panels and torch's GEMM above.
at::Tensor half_linear(const at::Tensor& x, const at::Tensor& w, int64_t gemv_max_rows) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "half_linear: CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "half_linear: x must be contiguous float32 [M, K]");
  TORCH_CHECK((w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf) && w.dim() == 2 && w.is_contiguous(),
              "half_linear: w must be contiguous bf16 or fp16 [N, K]");
  TORCH_CHECK(x.size(1) == w.size(1), "half_linear: x has ", x.size(1), " columns, w ", w.size(1));
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  if (M > gemv_max_rows) {
    if (bf16) panels<true>(x, wp, N, K, y);
    else panels<false>(x, wp, N, K, y);
  } else if (bf16) {
    gemv<true>(x.data_ptr<float>(), M, wp, N, K, y.data_ptr<float>());
  } else {
    gemv<false>(x.data_ptr<float>(), M, wp, N, K, y.data_ptr<float>());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("half_linear(Tensor x, Tensor w, int gemv_max_rows) -> Tensor");
  m.impl("half_linear", c10::DispatchKey::CPU, &half_linear);
}
