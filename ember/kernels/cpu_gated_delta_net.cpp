// Gated DeltaNet decode / verify on CPU, fused: the causal conv update with its SiLU, and the gated
// delta rule step (gate, beta, L2 norms, decay, delta, rank-1 update, output) over the fp32 state in
// its slot of the state pool. See cpu_gated_delta_net.py for why and the layouts.
//
// One build per machine (-march=native): the AVX-512 build works on 16 float lanes, the AVX2 + FMA
// build on 8, with the same loops; the state is float32 in both, so no bf16 instruction is needed
// (q / k / v are widened to float32 once per token, a few hundred values against dk x dv state).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_simd.h"

namespace {

// ---- float32 vectors: loads and stores of the first n lanes (n <= kLanes), for head dims that are
// not a multiple of the vector width
#if defined(__AVX512F__)
using namespace ember_simd::avx512;  // the rest of the lane ops: cpu_simd.h
inline vec vload(const float* p, int n) {
  return n == kLanes ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(first_lanes(n), p);
}
inline void vstore(float* p, vec x, int n) {
  if (n == kLanes)
    _mm512_storeu_ps(p, x);
  else
    _mm512_mask_storeu_ps(p, first_lanes(n), x);
}
#elif defined(__AVX2__) && defined(__FMA__)
using namespace ember_simd::avx2;
inline vec vload(const float* p, int n) {
  return n == kLanes ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first_lanes(n));
}
inline void vstore(float* p, vec x, int n) {
  if (n == kLanes)
    _mm256_storeu_ps(p, x);
  else
    _mm256_maskstore_ps(p, first_lanes(n), x);
}
#else
#error "the Gated DeltaNet kernels need AVX-512F or AVX2 + FMA (cpp_build.KERNELS says where they are built)"
#endif

// A stripe is the columns of the state one task keeps in registers and L1 across the tokens of a
// step: two vectors wide (dk x 32 floats = 16 KiB for dk = 128 on AVX-512), so two independent
// vector chains run per pass, each split again by row parity (the sums over dk are FMA chains;
// four of them hide the FMA latency).
constexpr int kStripe = 2 * kLanes;

template <typename T>
inline float to_f(T x) {
  return static_cast<float>(x);
}

// x rounded to T and back: what a torch op in the model's dtype would have stored.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

// torch's F.softplus (beta 1, threshold 20): linear above the threshold, where log1p(exp(x)) == x
// in float32 anyway and exp could overflow.
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// dst[i] = x[i] * rsqrt(sum x^2 + 1e-6) * scale, in float32: gated_delta_rule.l2norm (the eps of the
// reference kernels), then the scale (1 for k, dk^-0.5 for q) as a second rounding, as prepare_qk.
template <typename T>
void l2norm_into(const T* x, int64_t n, float scale, float* dst) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f(x[i]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) dst[i] = (to_f(x[i]) * inv) * scale;
}

// One (sequence, value head) task's inputs for its T tokens, prepared once in float32.
struct TokenInputs {
  std::vector<float> q, k, v, decay, beta;  // [T, dk], [T, dk], [T, dv], [T], [T]
};

struct GdnShape {
  int64_t N, T, Hk, Hv, dk, dv;
  int64_t qkv_stride, a_stride, b_stride;  // row strides (the last dim is contiguous)
};

template <typename T>
void prepare_tokens(const GdnShape& s, int64_t n, int64_t h, const T* qkv, const T* a, const T* b, float A, float dt,
                    TokenInputs& in) {
  const int64_t hk = h / (s.Hv / s.Hk);  // grouped heads: value head h reads key head h / r (HF, FLA)
  const float q_scale = (float)(1.0 / std::sqrt((double)s.dk));
  in.q.resize(s.T * s.dk);
  in.k.resize(s.T * s.dk);
  in.v.resize(s.T * s.dv);
  in.decay.resize(s.T);
  in.beta.resize(s.T);
  for (int64_t t = 0; t < s.T; ++t) {
    const int64_t row = n * s.T + t;
    const T* r = qkv + row * s.qkv_stride;
    l2norm_into(r + hk * s.dk, s.dk, q_scale, in.q.data() + t * s.dk);
    l2norm_into(r + (s.Hk + hk) * s.dk, s.dk, 1.f, in.k.data() + t * s.dk);
    const T* v = r + 2 * s.Hk * s.dk + h * s.dv;
    for (int64_t j = 0; j < s.dv; ++j) in.v[t * s.dv + j] = to_f(v[j]);
    // g = -exp(A_log) softplus(a + dt_bias) in float32; beta = sigmoid(b) rounded to the model's dtype,
    // as the layer's b.sigmoid() is (and HF's)
    const float g = -std::exp(A) * softplus(to_f(a[row * s.a_stride + h]) + dt);
    in.decay[t] = std::exp(g);
    in.beta[t] = round_to<T>(1.f / (1.f + std::exp(-to_f(b[row * s.b_stride + h]))));
  }
}

// Where a task's state goes: after token t to out[t] (verify; null: not kept), after the last token
// also to last (the slot, in place; null: not written).
struct StateSinks {
  float* const* out;
  float* last;
};

// Columns [j0, j0 + w) of one head's state S [dk, dv] through T tokens; each token does
//   kv = S^T k;  delta = beta (v - decay kv);  S = decay S + k delta^T;  o = S^T q
// (the decay applied to the sum instead of to S first: one multiply per column, not per element).
// The first token reads the stripe from its slot (src: rows dv apart; null: a zero state, held in
// buf) and its second pass re-reads it from L1; later tokens work on buf, the stripe's copy (rows
// kStripe apart), which a decode (T = 1) never needs. So the state is read once per step and
// written once per sink.
void run_stripe(const GdnShape& s, const TokenInputs& in, int64_t j0, int w, const float* src, float* buf,
                const StateSinks& sinks, float* o) {
  const int n0 = std::min(w, kLanes), n1 = w - n0;
  const int64_t dk = s.dk, dv = s.dv;
  const float* cur = src != nullptr ? src + j0 : buf;
  int64_t stride = src != nullptr ? dv : kStripe;
  int m0 = src != nullptr ? n0 : kLanes, m1 = src != nullptr ? n1 : kLanes;  // a slot's row ends at w
  for (int64_t t = 0; t < s.T; ++t) {
    const float* q = in.q.data() + t * dk;
    const float* k = in.k.data() + t * dk;
    vec a0 = vzero(), a1 = vzero(), b0 = vzero(), b1 = vzero();
    int64_t i = 0;
    for (; i + 1 < dk; i += 2) {
      const float* r = cur + i * stride;
      const vec ka = vset(k[i]), kb = vset(k[i + 1]);
      a0 = vfma(vload(r, m0), ka, a0);
      a1 = vfma(vload(r + kLanes, m1), ka, a1);
      b0 = vfma(vload(r + stride, m0), kb, b0);
      b1 = vfma(vload(r + stride + kLanes, m1), kb, b1);
    }
    if (i < dk) {
      const vec ka = vset(k[i]);
      a0 = vfma(vload(cur + i * stride, m0), ka, a0);
      a1 = vfma(vload(cur + i * stride + kLanes, m1), ka, a1);
    }
    const vec decay = vset(in.decay[t]), beta = vset(in.beta[t]);
    const float* v = in.v.data() + t * dv + j0;
    const vec d0 = vmul(beta, vsub(vload(v, n0), vmul(decay, vadd(a0, b0))));
    const vec d1 = vmul(beta, vsub(vload(v + n0, n1), vmul(decay, vadd(a1, b1))));
    float* out = sinks.out != nullptr ? sinks.out[t] : nullptr;
    float* last = t == s.T - 1 ? sinks.last : nullptr;
    const bool keep = t + 1 < s.T;  // another token reads buf
    vec o0 = vzero(), o1 = vzero(), p0 = vzero(), p1 = vzero();
    for (i = 0; i < dk; ++i) {
      const float* r = cur + i * stride;
      const vec ki = vset(k[i]), qi = vset(q[i]);
      const vec s0 = vfma(ki, d0, vmul(vload(r, m0), decay));
      const vec s1 = vfma(ki, d1, vmul(vload(r + kLanes, m1), decay));
      if (keep) {
        vstore(buf + i * kStripe, s0, kLanes);
        vstore(buf + i * kStripe + kLanes, s1, kLanes);
      }
      if (out != nullptr) {
        vstore(out + i * dv + j0, s0, n0);
        vstore(out + i * dv + j0 + n0, s1, n1);
      }
      if (last != nullptr) {
        vstore(last + i * dv + j0, s0, n0);
        vstore(last + i * dv + j0 + n0, s1, n1);
      }
      if (i & 1) {
        p0 = vfma(s0, qi, p0);
        p1 = vfma(s1, qi, p1);
      } else {
        o0 = vfma(s0, qi, o0);
        o1 = vfma(s1, qi, o1);
      }
    }
    vstore(o + t * dv + j0, vadd(o0, p0), n0);
    vstore(o + t * dv + j0 + n0, vadd(o1, p1), n1);
    cur = buf, stride = kStripe, m0 = m1 = kLanes;
  }
}

// Everything one (sequence n, value head h) task does: its inputs, then its state stripe by stripe.
template <typename T>
void gdn_task(const GdnShape& s, int64_t n, int64_t h, const T* qkv, const T* a, const T* b, const float* A_log,
              const float* dt_bias, const float* src, float* dst, float* const* outs, T* o_rows, TokenInputs& in,
              std::vector<float>& buf, std::vector<float>& o) {
  prepare_tokens(s, n, h, qkv, a, b, A_log[h], dt_bias[h], in);
  const int64_t dk = s.dk, dv = s.dv;
  buf.resize(dk * kStripe);
  o.resize(s.T * dv);
  for (int64_t j0 = 0; j0 < dv; j0 += kStripe) {
    if (src == nullptr) std::fill(buf.begin(), buf.end(), 0.f);  // a sequence without a state: zeros
    run_stripe(s, in, j0, (int)std::min<int64_t>(kStripe, dv - j0), src, buf.data(), StateSinks{outs, dst}, o.data());
  }
  for (int64_t t = 0; t < s.T; ++t)
    for (int64_t j = 0; j < dv; ++j) o_rows[(n * s.T + t) * s.Hv * dv + h * dv + j] = static_cast<T>(o[t * dv + j]);
}

// Slot indices [N] int64: each -1 or a slot of the pool.
void check_slots(const at::Tensor& idx, int64_t N, int64_t slots, const char* what) {
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 1 && idx.size(0) == N && idx.is_contiguous(), what,
              " must be a contiguous int64 [N] tensor");
  const int64_t* p = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(p[i] >= -1 && p[i] < slots, what, "[", i, "] = ", p[i], " is not -1 or a slot of the pool");
}

template <typename T>
void gdn_run(const GdnShape& s, const at::Tensor& qkv, const at::Tensor& a, const at::Tensor& b,
             const std::vector<float>& A_log, const std::vector<float>& dt_bias, at::Tensor& state,
             const int64_t* src, const int64_t* dst, float* states_out, at::Tensor& out) {
  const T* qp = qkv.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  float* pool = state.data_ptr<float>();
  T* op = out.data_ptr<T>();
  const int64_t head = s.dk * s.dv;
  at::parallel_for(0, s.N * s.Hv, 1, [&](int64_t begin, int64_t end) {
    TokenInputs in;
    std::vector<float> buf, o;
    std::vector<float*> outs(s.T);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / s.Hv, h = task % s.Hv;
      const float* from = src[n] >= 0 ? pool + (src[n] * s.Hv + h) * head : nullptr;
      float* to = dst[n] >= 0 ? pool + (dst[n] * s.Hv + h) * head : nullptr;
      if (states_out != nullptr)
        for (int64_t t = 0; t < s.T; ++t) outs[t] = states_out + ((n * s.T + t) * s.Hv + h) * head;
      gdn_task<T>(s, n, h, qp, ap, bp, A_log.data(), dt_bias.data(), from, to,
                  states_out != nullptr ? outs.data() : nullptr, op, in, buf, o);
    }
  });
}

std::vector<float> as_floats(const at::Tensor& x, int64_t n, const char* what) {
  TORCH_CHECK(x.dim() == 1 && x.size(0) == n && x.is_contiguous(), what, " must be a contiguous [H_v] tensor");
  std::vector<float> v(n);
  switch (x.scalar_type()) {
    case at::kFloat: for (int64_t i = 0; i < n; ++i) v[i] = x.data_ptr<float>()[i]; break;
    case at::kBFloat16: for (int64_t i = 0; i < n; ++i) v[i] = to_f(x.data_ptr<c10::BFloat16>()[i]); break;
    case at::kHalf: for (int64_t i = 0; i < n; ++i) v[i] = to_f(x.data_ptr<c10::Half>()[i]); break;
    default: TORCH_CHECK(false, what, ": float32, bf16 or fp16");
  }
  return v;
}

}  // namespace

// The gated delta rule for N sequences of T tokens each (decode: T = 1; a verify: 1 + drafts).
// qkv [N*T, 2 Hk dk + Hv dv] (the conv output, channels [q | k | v]; any row stride), a, b [N*T, Hv]
// (any row stride), in the model's dtype (float32, bf16 or fp16); A_log, dt_bias [Hv]; state
// [slots, Hv, dk, dv] float32, the pool; src_idx [N]: the slot each sequence starts from (-1: zeros);
// dst_idx [N]: the slot its state after the last token is written to, in place (-1: none); states_out
// [N, T, Hv, dk, dv] float32 or None: the state after every token (a verify's, for commit to pick).
// Returns o [N*T, Hv dv] in the model's dtype. A dst slot may be its own sequence's src, not
// another sequence's src or dst (the tasks run in parallel).
at::Tensor gated_delta_net(const at::Tensor& qkv, const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                           const at::Tensor& dt_bias, at::Tensor& state, const at::Tensor& src_idx,
                           const at::Tensor& dst_idx, const c10::optional<at::Tensor>& states_out) {
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.dim() == 4 && state.is_contiguous(),
              "state must be a contiguous float32 [slots, Hv, dk, dv] pool");
  const int64_t N = src_idx.numel(), Hv = state.size(1), dk = state.size(2), dv = state.size(3);
  TORCH_CHECK(N > 0 && qkv.dim() == 2 && qkv.size(0) % N == 0, "qkv must be [N*T, channels] for N = len(src_idx)");
  const int64_t T = qkv.size(0) / N, C = qkv.size(1);
  TORCH_CHECK((C - Hv * dv) > 0 && (C - Hv * dv) % (2 * dk) == 0, "qkv has ", C, " channels: not 2 Hk dk + Hv dv");
  const int64_t Hk = (C - Hv * dv) / (2 * dk);
  TORCH_CHECK(Hv % Hk == 0, "Hv = ", Hv, " is not a multiple of Hk = ", Hk);
  for (const at::Tensor* x : {&qkv, &a, &b})
    TORCH_CHECK(x->scalar_type() == qkv.scalar_type() && x->dim() == 2 && x->stride(1) == 1 && x->size(0) == N * T,
                "qkv, a and b must share a dtype and be [N*T, .] with contiguous rows");
  TORCH_CHECK(a.size(1) == Hv && b.size(1) == Hv, "a and b must be [N*T, Hv]");
  check_slots(src_idx, N, state.size(0), "src_idx");
  check_slots(dst_idx, N, state.size(0), "dst_idx");
  float* kept = nullptr;
  if (states_out.has_value() && states_out->defined()) {
    const at::Tensor& so = *states_out;
    TORCH_CHECK(so.scalar_type() == at::kFloat && so.is_contiguous() && so.dim() == 5 && so.size(0) == N &&
                    so.size(1) == T && so.size(2) == Hv && so.size(3) == dk && so.size(4) == dv,
                "states_out must be a contiguous float32 [N, T, Hv, dk, dv]");
    kept = so.data_ptr<float>();
  }
  const GdnShape s{N, T, Hk, Hv, dk, dv, qkv.stride(0), a.stride(0), b.stride(0)};
  const auto A = as_floats(A_log, Hv, "A_log"), dt = as_floats(dt_bias, Hv, "dt_bias");
  auto out = at::empty({N * T, Hv * dv}, qkv.options());
  const int64_t* src = src_idx.data_ptr<int64_t>();
  const int64_t* dst = dst_idx.data_ptr<int64_t>();
  switch (qkv.scalar_type()) {
    case at::kFloat: gdn_run<float>(s, qkv, a, b, A, dt, state, src, dst, kept, out); break;
    case at::kBFloat16: gdn_run<c10::BFloat16>(s, qkv, a, b, A, dt, state, src, dst, kept, out); break;
    case at::kHalf: gdn_run<c10::Half>(s, qkv, a, b, A, dt, state, src, dst, kept, out); break;
    default: TORCH_CHECK(false, "qkv must be float32, bf16 or fp16");
  }
  return out;
}

namespace {

constexpr int64_t kMaxConvKernel = 16;
constexpr int64_t kConvChannels = 256;  // channels a conv task runs (the weight rows it reads stay in L1)

struct ConvShape {
  int64_t N, T, C, K, x_stride;
};

// x <- silu(x) = x / (1 + exp(-x)) over n floats, vectorized (a scalar exp per channel was most of the
// conv's time). exp's argument is clamped to [-87, 88]: past either end silu is x or 0 in float32.
void silu_inplace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const int m = (int)std::min<int64_t>(kLanes, n - i);
    const vec v = vload(x + i, m);
    const vec e = ember_simd::exp_in_range(vclamp(vsub(vzero(), v), -87.f, 88.f));
    vstore(x + i, vdiv(v, vadd(vset(1.f), e)), m);
  }
}

// Channels [c0, c1) (at most kConvChannels) of sequence n through its T tokens: out = silu(sum_j
// w[j] window[t + j]) over the K - 1 inputs before the token and the token's own. The sum is float32
// and rounded to the model's dtype before the SiLU, as the layer's conv output is. KK: K known at
// compile time (4, every Qwen3.5 / Qwen3-Next), so the per-channel loops unroll and channels overlap
// (with K read at run time, loop overhead and the window's shift made it ~60 cycles a channel); 0: any K.
template <typename T, int64_t KK>
void conv_task(const ConvShape& s, int64_t n, int64_t c0, int64_t c1, const T* x, const T* w, const T* src, T* dst,
               T* window_out, T* out) {
  const int64_t K = KK > 0 ? KK : s.K, H = K - 1, nc = c1 - c0, W = H + s.T;
  float hist[kConvChannels * kMaxConvKernel], pre[kConvChannels];
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t j = 0; j < H; ++j) {
      hist[(c - c0) * H + j] = src != nullptr ? to_f(src[c * H + j]) : 0.f;
      if (window_out != nullptr) window_out[c * W + j] = src != nullptr ? src[c * H + j] : static_cast<T>(0.f);
    }
  for (int64_t t = 0; t < s.T; ++t) {
    const T* xt = x + (n * s.T + t) * s.x_stride;
    for (int64_t c = c0; c < c1; ++c) {
      float* h = hist + (c - c0) * H;
      const T* wc = w + c * K;
      const float xc = to_f(xt[c]);
      float acc = 0.f;
      for (int64_t j = 0; j < H; ++j) acc += to_f(wc[j]) * h[j];
      pre[c - c0] = round_to<T>(acc + to_f(wc[H]) * xc);
      for (int64_t j = 0; j + 1 < H; ++j) h[j] = h[j + 1];
      if (H > 0) h[H - 1] = xc;
      if (window_out != nullptr) window_out[c * W + H + t] = xt[c];
    }
    silu_inplace(pre, nc);
    T* o = out + (n * s.T + t) * s.C;
    for (int64_t c = c0; c < c1; ++c) o[c] = static_cast<T>(pre[c - c0]);
  }
  if (dst != nullptr)
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t j = 0; j < H; ++j) dst[c * H + j] = static_cast<T>(hist[(c - c0) * H + j]);
}

template <typename T>
void conv_run(const ConvShape& s, const at::Tensor& x, const at::Tensor& weight, at::Tensor& conv_state,
              const int64_t* src, const int64_t* dst, T* windows, at::Tensor& out) {
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* pool = conv_state.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t blocks = (s.C + kConvChannels - 1) / kConvChannels, slot = s.C * (s.K - 1);
  at::parallel_for(0, s.N * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / blocks, c0 = (task % blocks) * kConvChannels;
      const T* from = src[n] >= 0 ? pool + src[n] * slot : nullptr;
      T* to = dst[n] >= 0 ? pool + dst[n] * slot : nullptr;
      T* win = windows != nullptr ? windows + n * s.C * (s.K - 1 + s.T) : nullptr;
      const int64_t c1 = std::min(c0 + kConvChannels, s.C);
      if (s.K == 4)
        conv_task<T, 4>(s, n, c0, c1, xp, wp, from, to, win, op);
      else
        conv_task<T, 0>(s, n, c0, c1, xp, wp, from, to, win, op);
    }
  });
}

}  // namespace

// The depthwise causal conv + SiLU of N sequences of T tokens each. x [N*T, C] (any row stride),
// weight [C, K], conv_state [slots, C, K - 1] (the pool: each slot the K - 1 inputs before its next
// token), all in the model's dtype; src_idx / dst_idx [N] as gated_delta_net's (-1: zeros / not
// written); windows_out [N, C, K - 1 + T] or None: each sequence's whole window (the state before
// the step, then its T inputs; the state after token t is window[:, t + 1 : t + K]). Returns
// silu(conv) [N*T, C] in the model's dtype.
at::Tensor causal_conv1d_silu(const at::Tensor& x, const at::Tensor& weight, at::Tensor& conv_state,
                              const at::Tensor& src_idx, const at::Tensor& dst_idx,
                              const c10::optional<at::Tensor>& windows_out) {
  const int64_t N = src_idx.numel();
  TORCH_CHECK(N > 0 && x.dim() == 2 && x.stride(1) == 1 && x.size(0) % N == 0,
              "x must be [N*T, C] with contiguous rows, N = len(src_idx)");
  const int64_t T = x.size(0) / N, C = x.size(1), K = weight.size(-1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == C && weight.is_contiguous() && K >= 1 && K <= kMaxConvKernel,
              "weight must be a contiguous [C, K], K <= ", kMaxConvKernel);
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(1) == C && conv_state.size(2) == K - 1 &&
                  conv_state.is_contiguous(),
              "conv_state must be a contiguous [slots, C, K - 1]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && conv_state.scalar_type() == x.scalar_type(),
              "x, weight and conv_state must share a dtype");
  check_slots(src_idx, N, conv_state.size(0), "src_idx");
  check_slots(dst_idx, N, conv_state.size(0), "dst_idx");
  const bool keep = windows_out.has_value() && windows_out->defined();
  if (keep)
    TORCH_CHECK(windows_out->scalar_type() == x.scalar_type() && windows_out->is_contiguous() &&
                    windows_out->dim() == 3 && windows_out->size(0) == N && windows_out->size(1) == C &&
                    windows_out->size(2) == K - 1 + T,
                "windows_out must be a contiguous [N, C, K - 1 + T] in x's dtype");
  const ConvShape s{N, T, C, K, x.stride(0)};
  auto out = at::empty({N * T, C}, x.options());
  const int64_t* src = src_idx.data_ptr<int64_t>();
  const int64_t* dst = dst_idx.data_ptr<int64_t>();
  switch (x.scalar_type()) {
    case at::kFloat:
      conv_run<float>(s, x, weight, conv_state, src, dst, keep ? windows_out->data_ptr<float>() : nullptr, out);
      break;
    case at::kBFloat16:
      conv_run<c10::BFloat16>(s, x, weight, conv_state, src, dst,
                              keep ? windows_out->data_ptr<c10::BFloat16>() : nullptr, out);
      break;
    case at::kHalf:
      conv_run<c10::Half>(s, x, weight, conv_state, src, dst, keep ? windows_out->data_ptr<c10::Half>() : nullptr,
                          out);
      break;
    default: TORCH_CHECK(false, "x must be float32, bf16 or fp16");
  }
  return out;
}

// float32 lanes of this build's vectors: 16 (AVX-512) or 8 (AVX2), for the tests to tell them apart.
int64_t gated_delta_net_lanes() { return kLanes; }

// Ops of the dispatcher (not pybind functions), so compiled decode graphs call them too; the pools
// and the kept states are annotated as written (a!), so functionalization keeps the writes.
TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def(
      "gated_delta_net(Tensor qkv, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, Tensor(a!) state, "
      "Tensor src_idx, Tensor dst_idx, Tensor(b!)? states_out) -> Tensor");
  m.def(
      "causal_conv1d_silu(Tensor x, Tensor weight, Tensor(a!) conv_state, Tensor src_idx, Tensor dst_idx, "
      "Tensor(b!)? windows_out) -> Tensor");
  m.def("gated_delta_net_lanes() -> int", &gated_delta_net_lanes);  // no tensor to dispatch on: for every key
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) {
  m.impl("gated_delta_net", &gated_delta_net);
  m.impl("causal_conv1d_silu", &causal_conv1d_silu);
}
