// qwen4_exp's PLE after its projections, fused: the grouped norms of the keys and of the streams, the
// per-stream gate, the value it scales, the conv's norm, the causal depthwise conv (dilation N) over the
// carried window and its SiLU, and the sum the layer adds. See cpu_ple.py for the math and the layouts.
//
// One build per machine (-march=native): the AVX-512 build's vectors are 16 float lanes, the AVX2 + FMA
// build's 8; the loops over a stream's H values are the same in both (float32 math, the rows widened
// once), the exp of the sigmoid / SiLU is ember_simd's polynomial.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "cpu_simd.h"

namespace {

// ---- float32 lanes (cpu_simd.h)
#if defined(__AVX512F__)
using namespace ember_simd::avx512;
#elif defined(__AVX2__) && defined(__FMA__)
using namespace ember_simd::avx2;
#else
#error "the PLE kernel needs AVX-512F or AVX2 + FMA (cpp_build.KERNELS says where it is built)"
#endif

// x rounded to T and back: what a torch op in the model's dtype would have stored.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

template <typename T>
void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
void narrow(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// x[i] / (1 + exp(-x[i])) in place, vectors then a scalar tail (-x clamped to exp's range: the ends
// give 0 and x, as float32 would).
void silu_inplace(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const vec v = vload(x + i);
    const vec e = ember_simd::exp_in_range(vclamp(vmul(v, vset(-1.f)), -87.f, 88.f));
    vstore(x + i, vdiv(v, vadd(vset(1.f), e)));
  }
  for (; i < n; ++i) x[i] = x[i] / (1.f + std::exp(-x[i]));
}

// The zero-centred RMS norm of one group (ember.layers.hyper_connection.GroupedZeroCenteredRMSNorm):
// x * rsqrt(mean x^2 + eps) * (1 + w) in float32, rounded to T as the module's output is.
template <typename T>
void group_norm(const float* x, const T* w, int64_t H, float eps, float* out) {
  float ss = 0.f;
  for (int64_t h = 0; h < H; ++h) ss += x[h] * x[h];
  const float r = 1.f / std::sqrt(ss / (float)H + eps);
  for (int64_t h = 0; h < H; ++h) out[h] = round_to<T>((x[h] * r) * (1.f + static_cast<float>(w[h])));
}

struct Shape {
  int64_t B, n, S, H, K, N, window;  // sequences, tokens each, streams, hidden, conv taps, dilation, carried columns
  float eps;
  int64_t width() const { return S * H; }
  int64_t columns() const { return window + n; }
};

// Phase 1, one (token, stream) task: the stream's gate and value u (into out) and the conv's normed input
// (into the sequence's column of `cols`).
template <typename T>
void gate_task(const Shape& s, int64_t t, int64_t st, const T* x, const T* kp, const T* v, const T* gk, const T* gq,
               const T* gc, T* out, T* cols, std::vector<float>& buf) {
  const int64_t H = s.H, W = s.width(), off = st * H;
  buf.resize(4 * H);
  float *q = buf.data(), *k = q + H, *u = k + H, *tmp = u + H;
  widen(x + t * W + off, tmp, H);
  group_norm(tmp, gq + off, H, s.eps, q);
  widen(kp + t * W + off, tmp, H);
  group_norm(tmp, gk + off, H, s.eps, k);
  float dot = 0.f;  // (k * q).sum(-1) in T: each product rounded, the sum in float32
  for (int64_t h = 0; h < H; ++h) dot += round_to<T>(k[h] * q[h]);
  float g = round_to<T>(round_to<T>(dot) / std::sqrt((float)H));
  const float mag = round_to<T>(std::sqrt(std::max(std::fabs(g), 1e-6f)));
  g = g > 0.f ? mag : g < 0.f ? -mag : 0.f;
  const float gate = round_to<T>(1.f / (1.f + std::exp(-g)));
  widen(v + t * H, tmp, H);
  for (int64_t h = 0; h < H; ++h) u[h] = round_to<T>(gate * tmp[h]);
  narrow(u, out + t * W + off, H);
  group_norm(u, gc + off, H, s.eps, tmp);
  const int64_t b = t / s.n, j = t % s.n;
  narrow(tmp, cols + (b * s.columns() + s.window + j) * W + off, H);
}

// Phase 2, one (token, stream) task: the conv's taps at columns window + j - N (K - 1 - i), its SiLU, and
// out = u + that.
template <typename T>
void conv_task(const Shape& s, int64_t t, int64_t st, const T* weight, const T* cols, T* out,
               std::vector<float>& buf) {
  const int64_t H = s.H, W = s.width(), off = st * H;
  const int64_t b = t / s.n, j = t % s.n;
  buf.resize(2 * H);
  float *y = buf.data(), *col = y + H;
  for (int64_t h = 0; h < H; ++h) y[h] = 0.f;
  for (int64_t i = 0; i < s.K; ++i) {
    const int64_t c = s.window + j - s.N * (s.K - 1 - i);
    widen(cols + (b * s.columns() + c) * W + off, col, H);
    const T* w = weight + off * s.K + i;  // weight [W, K]: channel off + h, tap i
    for (int64_t h = 0; h < H; ++h) y[h] += static_cast<float>(w[h * s.K]) * col[h];
  }
  for (int64_t h = 0; h < H; ++h) y[h] = round_to<T>(y[h]);
  silu_inplace(y, H);
  T* o = out + t * W + off;
  for (int64_t h = 0; h < H; ++h) o[h] = static_cast<T>(static_cast<float>(o[h]) + round_to<T>(y[h]));
}

template <typename T>
void mix_run(const Shape& s, const at::Tensor& x, const at::Tensor& kp, const at::Tensor& v, const at::Tensor& gk,
             const at::Tensor& gq, const at::Tensor& gc, const at::Tensor& weight, const at::Tensor& window0,
             at::Tensor& out, at::Tensor& cols) {
  const int64_t W = s.width(), tasks = s.B * s.n * s.S;
  T* c = cols.data_ptr<T>();
  const T* w0 = window0.data_ptr<T>();
  for (int64_t b = 0; b < s.B; ++b)  // the carried columns first
    std::memcpy(c + b * s.columns() * W, w0 + b * s.window * W, s.window * W * sizeof(T));
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t i = begin; i < end; ++i)
      gate_task<T>(s, i / s.S, i % s.S, x.data_ptr<T>(), kp.data_ptr<T>(), v.data_ptr<T>(), gk.data_ptr<T>(),
                   gq.data_ptr<T>(), gc.data_ptr<T>(), out.data_ptr<T>(), c, buf);
  });
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t i = begin; i < end; ++i)
      conv_task<T>(s, i / s.S, i % s.S, weight.data_ptr<T>(), c, out.data_ptr<T>(), buf);
  });
}

void check_rows(const at::Tensor& t, int64_t rows, int64_t cols, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols && t.is_contiguous() &&
                  t.scalar_type() == dtype,
              what, " must be a contiguous [", rows, ", ", cols, "] in x's dtype");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> ple_mix(const at::Tensor& x, const at::Tensor& kp, const at::Tensor& v,
                                           const at::Tensor& gk, const at::Tensor& gq, const at::Tensor& gc,
                                           const at::Tensor& weight, const at::Tensor& window0, double eps,
                                           int64_t dilation) {
  TORCH_CHECK(window0.dim() == 3 && window0.is_contiguous() && window0.size(0) > 0,
              "window0 must be a contiguous [B, window, S*H]");
  TORCH_CHECK(v.dim() == 2 && x.dim() == 2 && v.size(1) > 0 && x.size(1) % v.size(1) == 0, "v must be [T, H]");
  const auto dtype = x.scalar_type();
  Shape s{};
  s.B = window0.size(0);
  TORCH_CHECK(x.size(0) % s.B == 0, "x's rows must be B sequences of n tokens");
  s.n = x.size(0) / s.B;
  s.H = v.size(1);
  s.S = x.size(1) / s.H;
  s.K = weight.size(-1);
  s.N = dilation;
  s.window = window0.size(1);
  s.eps = (float)eps;
  const int64_t T = x.size(0), W = s.width();
  TORCH_CHECK(s.window == (s.K - 1) * s.N, "window0 must carry (K - 1) * dilation columns");
  check_rows(x, T, W, dtype, "x");
  check_rows(kp, T, W, dtype, "kp");
  check_rows(v, T, s.H, dtype, "v");
  check_rows(weight, W, s.K, dtype, "weight");
  TORCH_CHECK(window0.size(2) == W && window0.scalar_type() == dtype, "window0 must be [B, window, S*H] in x's dtype");
  for (const at::Tensor* g : {&gk, &gq, &gc})
    TORCH_CHECK(g->dim() == 1 && g->numel() == W && g->is_contiguous() && g->scalar_type() == dtype,
                "the norms' weights must be contiguous [S*H] in x's dtype");
  auto out = at::empty({T, W}, x.options());
  auto cols = at::empty({s.B, s.columns(), W}, x.options());
  switch (dtype) {
    case at::kFloat: mix_run<float>(s, x, kp, v, gk, gq, gc, weight, window0, out, cols); break;
    case at::kBFloat16: mix_run<c10::BFloat16>(s, x, kp, v, gk, gq, gc, weight, window0, out, cols); break;
    default: TORCH_CHECK(false, "x must be float32 or bf16");
  }
  return {out, cols};
}

// float32 lanes of this build's vectors: 16 (AVX-512) or 8 (AVX2), for the tests to tell them apart.
int64_t ple_lanes() { return kLanes; }

// An op of the dispatcher (not a pybind function), so compiled decode graphs call it too.
TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def(
      "ple_mix(Tensor x, Tensor kp, Tensor v, Tensor gk, Tensor gq, Tensor gc, Tensor weight, Tensor window0, "
      "float eps, int dilation) -> (Tensor, Tensor)");
  m.def("ple_lanes() -> int", &ple_lanes);
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) { m.impl("ple_mix", &ple_mix); }
