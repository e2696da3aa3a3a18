// qwen4_exp's hyper-connection mixer on CPU (ember/layers/hyper_connection.py): from the n-stream residual
// X [T, n*H], the grouped zero-centred norm Xn, a = SiLU(W_down Xn / n), the gates G = sigmoid(W_up a), the
// sublayer's input x = mean_s(G_s * Xn_s) and the inject weights w = 2 sigmoid(W_inject Xn / n). See
// cpu_hc_mixer.py for the contract.
//
// hc_mix: all of it for a tile of rows at a time, the matrices dense (bf16 or float32): the tile's rows are
// normed into a float32 scratch Xn (rounded to X's dtype, as the torch path casts), then the down and inject
// projections (rows of n*H: one dot product a weight row and a row of Xn, a 4 x 3 tile of them in registers,
// the weight read once per 3 rows) over the threads by weight rows, SiLU, and the up projection over the
// threads by channel: channel c's n weight rows (one per stream) give its n gates for each row, and the gated
// mean is taken there, so no [T, n*H] gate tensor is ever written.
// hc_norm / hc_gate: the same norm, and the same gated mean plus inject weights from gate logits computed
// outside (the layer's own projections: quantized GGUF parts, tensor parallel shards), for the mixers whose
// matrices this kernel cannot read.
//
// One build per machine (-march=native): AVX-512 (16 float lanes) or AVX2 + FMA (8), the same loops.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

// ---- float32 lanes (cpu_simd.h)
#if defined(__AVX512F__)
using namespace ember_simd::avx512;
#elif defined(__AVX2__) && defined(__FMA__)
using namespace ember_simd::avx2;
#else
#error "the hyper-connection mixer kernel needs AVX-512F or AVX2 + FMA (cpp_build.KERNELS says where it is built)"
#endif

constexpr int64_t kTileRows = 24;  // rows of X normed and mixed together (hc_mix): the weights are read once a tile
constexpr int64_t kChunk = 1024;  // inputs of the down projection a pass takes (hc_mix's tiles of rows)
constexpr int64_t kChannelBlock = 64;  // channels of the up projection a task takes (their gates stay in L1)

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }
// x rounded to T and back (the torch path's casts to the activation dtype)
template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

// sigmoid(z) = 1 / (1 + exp(-z)), float32; exp's argument clamped at 88 (the result ~0 there, as in torch)
inline vec vsigmoid(vec z) {
  const vec e = ember_simd::exp_in_range(vmin(vmul(z, vset(-1.f)), vset(88.f)));
  return vdiv(vset(1.f), vadd(vset(1.f), e));
}
inline float sigmoid(float z) { return 1.f / (1.f + std::exp(std::min(-z, 88.f))); }

// out[j][t] (+)= w[j] . x[t] over K floats (w rows in W's dtype, x rows float32; added to out where `add`): a
// JR x TR tile in registers, the tail past the lanes in scalar code.
template <int JR, int TR, typename W>
inline void dot_tile(const W* const* w, const float* const* x, int64_t K, float* out, int64_t out_stride, bool add) {
  vec acc[JR][TR];
  for (int j = 0; j < JR; ++j)
    for (int t = 0; t < TR; ++t) acc[j][t] = vzero();
  const int64_t kv = K - K % kLanes;
  for (int64_t k = 0; k < kv; k += kLanes) {
    vec xv[TR];
    for (int t = 0; t < TR; ++t) xv[t] = vload(x[t] + k);
    for (int j = 0; j < JR; ++j) {
      const vec wv = vload(w[j] + k);
      for (int t = 0; t < TR; ++t) acc[j][t] = vfma(wv, xv[t], acc[j][t]);
    }
  }
  for (int j = 0; j < JR; ++j)
    for (int t = 0; t < TR; ++t) {
      float s = hsum(acc[j][t]);
      for (int64_t k = kv; k < K; ++k) s += to_float(w[j][k]) * x[t][k];
      out[j * out_stride + t] = add ? out[j * out_stride + t] + s : s;
    }
}

// out[j * out_stride + t] (+)= w[j] . x[t] for j < nj, t < nt (any counts), tiles of up to 4 x 3.
template <typename W>
void dots(const W* const* w, int64_t nj, const float* const* x, int64_t nt, int64_t K, float* out, int64_t out_stride,
          bool add = false) {
  for (int64_t j = 0; j < nj; j += 4) {
    const int64_t jr = std::min<int64_t>(4, nj - j);
    for (int64_t t = 0; t < nt; t += 3) {
      const int64_t tr = std::min<int64_t>(3, nt - t);
      float* o = out + j * out_stride + t;
      const W* const* wj = w + j;
      const float* const* xt = x + t;
#define EMBER_HC_TILE(JR, TR) \
  if (jr == JR && tr == TR) dot_tile<JR, TR, W>(wj, xt, K, o, out_stride, add);
      EMBER_HC_TILE(4, 3) else EMBER_HC_TILE(4, 2) else EMBER_HC_TILE(4, 1) else EMBER_HC_TILE(3, 3)
      else EMBER_HC_TILE(3, 2) else EMBER_HC_TILE(3, 1) else EMBER_HC_TILE(2, 3) else EMBER_HC_TILE(2, 2)
      else EMBER_HC_TILE(2, 1) else EMBER_HC_TILE(1, 3) else EMBER_HC_TILE(1, 2) else EMBER_HC_TILE(1, 1)
#undef EMBER_HC_TILE
    }
  }
}

// One row of X [n*H] -> Xn [n*H] float32: each stream's RMS over its H values (float32), times 1 + gamma (float32,
// as the torch path adds it), rounded to T.
template <typename T>
void norm_row(const T* x, const float* gamma, int64_t n, int64_t H, double eps, float* out) {
  for (int64_t s = 0; s < n; ++s) {
    const T* xs = x + s * H;
    float* os = out + s * H;
    vec acc = vzero();
    int64_t c = 0;
    for (; c + kLanes <= H; c += kLanes) {
      const vec v = vload(xs + c);
      acc = vfma(v, v, acc);
    }
    float ss = hsum(acc);
    for (; c < H; ++c) ss += to_float(xs[c]) * to_float(xs[c]);
    const float rstd = 1.f / std::sqrt(ss / (float)H + (float)eps);
    const float* gs = gamma + s * H;
    for (c = 0; c + kLanes <= H; c += kLanes) {
      const vec v = vmul(vmul(vload(xs + c), vset(rstd)), vadd(vset(1.f), vload(gs + c)));
      vstore(os + c, std::is_same<T, bf16>::value ? round_bf16(v) : v);
    }
    for (; c < H; ++c) os[c] = round_to<T>(to_float(xs[c]) * rstd * (1.f + gs[c]));
  }
}

// One row's x over C channels from their gate logits z (stream s's at z + s * z_stride) and Xn (stream s's at
// xn + s * xn_stride): x_c = mean_s(sigmoid(z_s,c) * Xn_s,c), float32, rounded to T.
template <typename T>
void gated_mean(const float* z, int64_t z_stride, const float* xn, int64_t xn_stride, int64_t n, int64_t C, T* x) {
  const vec vn = vset((float)n);
  int64_t c = 0;
  for (; c + kLanes <= C; c += kLanes) {
    vec acc = vzero();
    for (int64_t s = 0; s < n; ++s) acc = vfma(vsigmoid(vload(z + s * z_stride + c)), vload(xn + s * xn_stride + c), acc);
    alignas(64) float tmp[kLanes];
    vstore(tmp, vdiv(acc, vn));
    for (int l = 0; l < kLanes; ++l) x[c + l] = static_cast<T>(tmp[l]);
  }
  for (; c < C; ++c) {
    float acc = 0.f;
    for (int64_t s = 0; s < n; ++s) acc += sigmoid(z[s * z_stride + c]) * xn[s * xn_stride + c];
    x[c] = static_cast<T>(acc / (float)n);
  }
}

struct Shape {
  int64_t T, n, H, L;
};

// The fused mixer over rows [t0, t0 + R) of X: Xn, a, x and w (w only with an inject matrix).
template <typename T, typename W>
void mix_tile(const T* X, const float* gamma, double eps, const Shape& sh, const W* w_down, const W* w_up,
              const W* w_inject, int64_t t0, int64_t R, std::vector<float>& xn, std::vector<float>& a, T* x, T* w) {
  const int64_t n = sh.n, H = sh.H, L = sh.L, nH = n * H, J = L + (w_inject ? n : 0);
  at::parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) norm_row<T>(X + (t0 + t) * nH, gamma, n, H, eps, xn.data() + t * nH);
  });
  std::vector<const float*> xrows(R), arows(R);
  for (int64_t t = 0; t < R; ++t) xrows[t] = xn.data() + t * nH, arows[t] = a.data() + t * J;
  // a[t][j] = W_j . Xn_t for the down rows then the inject rows (a is [R, J]: out_stride 1 row-major by t)
  std::vector<const W*> wrows(J);
  for (int64_t j = 0; j < J; ++j) wrows[j] = j < L ? w_down + j * nH : w_inject + (j - L) * nH;
  std::vector<float> dj(J * R);  // [J, R]: the dots' layout (by weight row)
  // by chunks of kChunk inputs: a chunk of the tile's Xn rows stays in L2 while the thread's weight rows pass, and a
  // chunk of 4 weight rows stays in L1 while the tile's rows pass
  at::parallel_for(0, (J + 3) / 4, 1, [&](int64_t b, int64_t e) {
    const int64_t j0 = 4 * b, nj = std::min(J, 4 * e) - j0;
    std::vector<const W*> wk(nj);
    std::vector<const float*> xk(R);
    for (int64_t k0 = 0; k0 < nH; k0 += kChunk) {
      for (int64_t j = 0; j < nj; ++j) wk[j] = wrows[j0 + j] + k0;
      for (int64_t t = 0; t < R; ++t) xk[t] = xrows[t] + k0;
      dots<W>(wk.data(), nj, xk.data(), R, std::min(kChunk, nH - k0), dj.data() + j0 * R, R, k0 > 0);
    }
  });
  for (int64_t t = 0; t < R; ++t) {
    for (int64_t j = 0; j < L; ++j) {
      const float v = dj[j * R + t] / (float)n;
      a[t * J + j] = v * sigmoid(v);  // SiLU
    }
    for (int64_t s = 0; s < J - L; ++s) w[(t0 + t) * n + s] = static_cast<T>(2.f * sigmoid(dj[(L + s) * R + t] / (float)n));
  }
  // the up projection by channel blocks: z[s][t][c] for the block's channels, then the gated mean
  at::parallel_for(0, (H + kChannelBlock - 1) / kChannelBlock, 1, [&](int64_t b, int64_t e) {
    std::vector<float> z(n * R * kChannelBlock);
    std::vector<const W*> up(n);
    std::vector<float> zc(n * R);
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t c0 = blk * kChannelBlock, c1 = std::min(H, c0 + kChannelBlock), C = c1 - c0;
      for (int64_t c = c0; c < c1; ++c) {
        for (int64_t s = 0; s < n; ++s) up[s] = w_up + (s * H + c) * L;
        dots<W>(up.data(), n, arows.data(), R, L, zc.data(), R);  // zc [n, R]
        for (int64_t s = 0; s < n; ++s)
          for (int64_t t = 0; t < R; ++t) z[(t * n + s) * kChannelBlock + (c - c0)] = zc[s * R + t];
      }
      for (int64_t t = 0; t < R; ++t)
        gated_mean<T>(z.data() + t * n * kChannelBlock, kChannelBlock, xn.data() + t * nH + c0, H, n, C,
                      x + (t0 + t) * H + c0);
    }
  });
}

template <typename T, typename W>
void mix(const at::Tensor& X, const at::Tensor& gamma, double eps, const Shape& sh, const at::Tensor& w_down,
         const at::Tensor& w_up, const at::Tensor& w_inject, at::Tensor& x, at::Tensor& w) {
  const int64_t R = std::min(kTileRows, sh.T), J = sh.L + (w_inject.defined() ? sh.n : 0);
  std::vector<float> xn(R * sh.n * sh.H), a(R * J);
  const W* inj = w_inject.defined() ? w_inject.data_ptr<W>() : nullptr;
  T* wp = w_inject.defined() ? w.data_ptr<T>() : nullptr;
  for (int64_t t0 = 0; t0 < sh.T; t0 += R)
    mix_tile<T, W>(X.data_ptr<T>(), gamma.data_ptr<float>(), eps, sh, w_down.data_ptr<W>(), w_up.data_ptr<W>(), inj,
                   t0, std::min(R, sh.T - t0), xn, a, x.data_ptr<T>(), wp);
}

void check_x(const at::Tensor& X, const at::Tensor& gamma, int64_t n) {
  TORCH_CHECK(X.dim() == 2 && X.is_contiguous() && X.device().is_cpu() &&
                  (X.scalar_type() == at::kFloat || X.scalar_type() == at::kBFloat16),
              "hc_mixer: X must be contiguous float32 or bf16 [T, n * H] on CPU");
  TORCH_CHECK(n >= 1 && X.size(1) % n == 0, "hc_mixer: X's width ", X.size(1), " is not ", n, " streams");
  TORCH_CHECK(gamma.scalar_type() == at::kFloat && gamma.is_contiguous() && gamma.numel() == X.size(1),
              "hc_mixer: gamma must be contiguous float32 [n * H]");
}

std::tuple<at::Tensor, at::Tensor> hc_mix(const at::Tensor& X, const at::Tensor& gamma, double eps, int64_t n,
                                          const at::Tensor& w_down, const at::Tensor& w_up,
                                          const c10::optional<at::Tensor>& w_inject_opt) {
  check_x(X, gamma, n);
  const at::Tensor w_inject = w_inject_opt.has_value() ? *w_inject_opt : at::Tensor();
  const Shape sh{X.size(0), n, X.size(1) / n, w_down.size(0)};
  const auto wt = w_down.scalar_type();
  TORCH_CHECK((wt == at::kFloat || wt == at::kBFloat16) && w_up.scalar_type() == wt &&
                  (!w_inject.defined() || w_inject.scalar_type() == wt),
              "hc_mixer: the weights must all be float32 or all bf16");
  TORCH_CHECK(w_down.dim() == 2 && w_down.size(1) == n * sh.H && w_down.is_contiguous(),
              "hc_mixer: w_down must be contiguous [lowrank, n * H]");
  TORCH_CHECK(w_up.dim() == 2 && w_up.size(0) == n * sh.H && w_up.size(1) == sh.L && w_up.is_contiguous(),
              "hc_mixer: w_up must be contiguous [n * H, lowrank]");
  TORCH_CHECK(!w_inject.defined() || (w_inject.dim() == 2 && w_inject.size(0) == n && w_inject.size(1) == n * sh.H &&
                                      w_inject.is_contiguous()),
              "hc_mixer: w_inject must be contiguous [n, n * H]");
  at::Tensor x = at::empty({sh.T, sh.H}, X.options());
  at::Tensor w = at::empty({sh.T, w_inject.defined() ? n : 0}, X.options());
  if (sh.T == 0) return {x, w};
  const bool xb = X.scalar_type() == at::kBFloat16, wb = wt == at::kBFloat16;
  if (xb && wb) mix<bf16, bf16>(X, gamma, eps, sh, w_down, w_up, w_inject, x, w);
  else if (xb) mix<bf16, float>(X, gamma, eps, sh, w_down, w_up, w_inject, x, w);
  else if (wb) mix<float, bf16>(X, gamma, eps, sh, w_down, w_up, w_inject, x, w);
  else mix<float, float>(X, gamma, eps, sh, w_down, w_up, w_inject, x, w);
  return {x, w};
}

// The grouped norm alone: Xn [T, n*H] in X's dtype.
at::Tensor hc_norm(const at::Tensor& X, const at::Tensor& gamma, double eps, int64_t n) {
  check_x(X, gamma, n);
  const int64_t T = X.size(0), nH = X.size(1), H = nH / n;
  at::Tensor out = at::empty({T, nH}, X.options());
  auto run = [&](auto* xp, auto* op) {
    using T_ = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    at::parallel_for(0, T, 1, [&](int64_t b, int64_t e) {
      std::vector<float> row(nH);
      for (int64_t t = b; t < e; ++t) {
        norm_row<T_>(xp + t * nH, gamma.data_ptr<float>(), n, H, eps, row.data());
        for (int64_t c = 0; c < nH; ++c) op[t * nH + c] = static_cast<T_>(row[c]);
      }
    });
  };
  if (X.scalar_type() == at::kBFloat16) run(X.data_ptr<bf16>(), out.data_ptr<bf16>());
  else run(X.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

// The gated mean and inject weights from logits computed outside: z [T, n*H] (the up projection's), Xn [T, n*H],
// inject logits [T, n] or none -> (x [T, H], w [T, n] or [T, 0]) in Xn's dtype.
template <typename T>
void gate_rows(const at::Tensor& z, const at::Tensor& xn, const at::Tensor& inj, int64_t n, at::Tensor& x, at::Tensor& w) {
  const int64_t T_ = xn.size(0), nH = xn.size(1), H = nH / n;
  const T* zp = z.data_ptr<T>();
  const T* xp = xn.data_ptr<T>();
  at::parallel_for(0, T_, 1, [&](int64_t b, int64_t e) {
    std::vector<float> row(nH), zrow(nH);
    for (int64_t t = b; t < e; ++t) {
      for (int64_t c = 0; c < nH; ++c) row[c] = to_float(xp[t * nH + c]), zrow[c] = to_float(zp[t * nH + c]);
      gated_mean<T>(zrow.data(), H, row.data(), H, n, H, x.data_ptr<T>() + t * H);
      if (inj.defined())
        for (int64_t s = 0; s < n; ++s)
          w.data_ptr<T>()[t * n + s] = static_cast<T>(2.f * sigmoid(to_float(inj.data_ptr<T>()[t * n + s]) / (float)n));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> hc_gate(const at::Tensor& z, const at::Tensor& xn,
                                           const c10::optional<at::Tensor>& inj_opt, int64_t n) {
  const at::Tensor inj = inj_opt.has_value() ? *inj_opt : at::Tensor();
  TORCH_CHECK(xn.dim() == 2 && xn.is_contiguous() && xn.device().is_cpu() && n >= 1 && xn.size(1) % n == 0 &&
                  (xn.scalar_type() == at::kFloat || xn.scalar_type() == at::kBFloat16),
              "hc_gate: Xn must be contiguous float32 or bf16 [T, n * H] on CPU");
  TORCH_CHECK(z.sizes() == xn.sizes() && z.scalar_type() == xn.scalar_type() && z.is_contiguous(),
              "hc_gate: the gate logits must be contiguous [T, n * H] in Xn's dtype");
  TORCH_CHECK(!inj.defined() || (inj.dim() == 2 && inj.size(0) == xn.size(0) && inj.size(1) == n &&
                                 inj.scalar_type() == xn.scalar_type() && inj.is_contiguous()),
              "hc_gate: the inject logits must be contiguous [T, n] in Xn's dtype");
  at::Tensor x = at::empty({xn.size(0), xn.size(1) / n}, xn.options());
  at::Tensor w = at::empty({xn.size(0), inj.defined() ? n : 0}, xn.options());
  if (xn.scalar_type() == at::kBFloat16) gate_rows<bf16>(z, xn, inj, n, x, w);
  else gate_rows<float>(z, xn, inj, n, x, w);
  return {x, w};
}

// float32 lanes of this build: 16 (AVX-512) or 8 (AVX2), for the tests to tell the builds apart.
int64_t hc_mixer_lanes() { return kLanes; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("hc_mix(Tensor X, Tensor gamma, float eps, int n, Tensor w_down, Tensor w_up, Tensor? w_inject) -> "
        "(Tensor, Tensor)");
  m.def("hc_norm(Tensor X, Tensor gamma, float eps, int n) -> Tensor");
  m.def("hc_gate(Tensor z, Tensor xn, Tensor? inject, int n) -> (Tensor, Tensor)");
  m.def("hc_mixer_lanes() -> int", &hc_mixer_lanes);  // no tensor to dispatch on: for every key
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) {
  m.impl("hc_mix", &hc_mix);
  m.impl("hc_norm", &hc_norm);
  m.impl("hc_gate", &hc_gate);
}
