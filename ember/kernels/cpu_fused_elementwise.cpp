// The decoder's elementwise ops on bf16 or float32 rows in one pass each (CPU): RMSNorm with the
// residual add folded in (plain or zero-centred), Gated DeltaNet's gated output norm, SiLU(gate) * up,
// and the rotary embedding of q / k. Eager torch runs each as 4-6 kernels over the whole step, every
// one a trip through memory (a 2048-token prefill chunk's rows are 2.4 MB per norm and 12.6 MB per
// gate_up output in bf16, twice that in float32: past L2). Here a row is read once, finished in
// registers and written once. Rounding is torch's, op for op (round_to<T> below after each op whose
// output torch stores in the rows' dtype), so outputs match the eager ops bit for bit but for the
// float32 sum order inside the norm and the exp polynomial (rare 1-ulp differences).
//
// One build per machine (-march=native): the AVX-512 build works on 16 float lanes, the AVX2 + FMA
// build (Zen2/3, Haswell on) on 8, with the same loops: every kernel body is a template over the
// rows' element type (c10::BFloat16: widened to float lanes by a shift, rounded back to nearest even;
// float) written against the few lane operations defined first. See cpu_fused_elementwise.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_simd.h"

namespace {

using bf16 = c10::BFloat16;

// ---- float lanes: arithmetic, and loads / stores of the first n lanes (n <= kLanes) of float or bf16
// memory (a row's tail), widened to / narrowed from float lanes. bf16 -> float is exact (a shift);
// float -> bf16 rounds to nearest even, as torch's casts (NaN is not produced here from finite input).
#if defined(__AVX512F__) && defined(__AVX512BW__)
using namespace ember_simd::avx512;  // the rest of the lane ops: cpu_simd.h
inline vec vload(const float* p, int n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }
inline vec vload(const bf16* p, int n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(first_lanes(n), p)), 16));
}
inline void vstore(float* p, vec x, int n) { _mm512_mask_storeu_ps(p, first_lanes(n), x); }
inline void vstore(bf16* p, vec x, int n) {
  _mm256_mask_storeu_epi16(p, first_lanes(n), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(x), 16)));
}
// exp(x) for any float x, within 2 ulp of std::exp: +inf past float32's range, as std::exp (so
// silu(-120) is -0.0, as in torch); below -87 exp(-87) (it only ever meets 1 + exp).
inline vec vexp(vec x) {
  const __mmask16 overflow = _mm512_cmp_ps_mask(x, vset(88.72283935546875f), _CMP_GT_OQ);
  const vec y = ember_simd::exp_in_range(_mm512_min_ps(_mm512_max_ps(x, vset(-87.f)), vset(88.f)));
  return _mm512_mask_mov_ps(y, overflow, vset(INFINITY));
}
#elif defined(__AVX2__) && defined(__FMA__)
using namespace ember_simd::avx2;
inline vec vload(const float* p, int n) { return n == kLanes ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first_lanes(n)); }
inline vec vload(const bf16* p, int n) {  // no 16-bit masked load in AVX2: a tail goes through a buffer
  __m128i h;
  if (n == kLanes) {
    h = _mm_loadu_si128((const __m128i*)p);
  } else {
    alignas(16) uint16_t buf[8] = {0};
    std::memcpy(buf, p, n * sizeof(bf16));
    h = _mm_load_si128((const __m128i*)buf);
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, vec x, int n) {
  if (n == kLanes)
    _mm256_storeu_ps(p, x);
  else
    _mm256_maskstore_ps(p, first_lanes(n), x);
}
inline void vstore(bf16* p, vec x, int n) {
  const __m256i top = _mm256_srli_epi32(bf16_rounded_bits(x), 16);  // each <= 0xFFFF: packus keeps it
  // packus packs within each 128-bit half: lanes 0-3 land in qword 0, lanes 4-7 in qword 2
  const __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0x08));
  if (n == kLanes) {
    _mm_storeu_si128((__m128i*)p, h);
  } else {
    alignas(16) uint16_t buf[8];
    _mm_store_si128((__m128i*)buf, h);
    std::memcpy(p, buf, n * sizeof(bf16));
  }
}
inline vec vexp(vec x) {  // as the AVX-512 one
  const vec overflow = _mm256_cmp_ps(x, vset(88.72283935546875f), _CMP_GT_OQ);
  const vec y = ember_simd::exp_in_range(_mm256_min_ps(_mm256_max_ps(x, vset(-87.f)), vset(88.f)));
  return _mm256_blendv_ps(y, vset(INFINITY), overflow);
}
#else
#error "the fused elementwise kernels need AVX-512F + BW or AVX2 + FMA (cpp_build.KERNELS says where they are built)"
#endif

inline int lanes_left(int64_t left) { return left >= kLanes ? kLanes : (int)left; }

// x as torch stores an op's output in T: bf16 rounds; float keeps it, and the empty asm makes the
// compiler hold it in a register, so GCC's default -ffp-contract=fast cannot fuse the multiply that
// made it into a following add (torch's float32 ops round every product; an FMA would not).
template <typename T>
inline vec round_to(vec x);
template <>
inline vec round_to<bf16>(vec x) {
  return round_bf16(x);
}
template <>
inline vec round_to<float>(vec x) {
  asm("" : "+v"(x));
  return x;
}

// silu(z) = z / (1 + exp(-z)) in float32
inline vec silu(vec z) { return vdiv(z, vadd(vset(1.f), vexp(vsub(vzero(), z)))); }

// One row: s = T(x + r) (when r), h = T(s * rsqrt(mean(s^2) + eps)), out = T(w * h) -- the roundings of
// RMSNorm.forward (the add, the cast after torch.rms_norm in float32, the weight multiply).
// ZC (zero-centred, Qwen3-Next / Qwen3.5): the weight is stored as w - 1 and out = T(s * inv * (1 + w)),
// all in float32 before the one rounding (ZeroCenteredRMSNorm's order).
template <typename T, bool ZC>
void norm_row(const T* x, const T* r, const T* w, int64_t H, float eps, T* out, T* sum_out) {
  vec ss = vzero();
  for (int64_t j = 0; j < H; j += kLanes) {
    const int n = lanes_left(H - j);
    vec v = vload(x + j, n);
    if (r != nullptr) {
      v = round_to<T>(vadd(v, vload(r + j, n)));
      vstore(sum_out + j, v, n);
    }
    ss = vfma(v, v, ss);
  }
  const vec vinv = vset(1.f / std::sqrt(hsum(ss) / (float)H + eps));
  const T* src = r != nullptr ? sum_out : x;  // the rounded sum, re-read from L1
  for (int64_t j = 0; j < H; j += kLanes) {
    const int n = lanes_left(H - j);
    const vec wv = vload(w + j, n);
    if (ZC) {
      vstore(out + j, vmul(vmul(vload(src + j, n), vinv), vadd(vset(1.f), wv)), n);
    } else {
      vstore(out + j, vmul(wv, round_to<T>(vmul(vload(src + j, n), vinv))), n);
    }
  }
}

// One head of the Gated DeltaNet output norm: out = T(T(w * T(o * inv)) * silu(z)), silu in float32 --
// GatedRMSNorm.forward's roundings (the cast after torch.rms_norm, the weight multiply in T, the
// float32 gate).
template <typename T>
void gated_norm_head(const T* o, const T* z, const T* w, int64_t D, float eps, T* out) {
  vec ss = vzero();
  for (int64_t j = 0; j < D; j += kLanes) {
    const vec v = vload(o + j, lanes_left(D - j));
    ss = vfma(v, v, ss);
  }
  const vec vinv = vset(1.f / std::sqrt(hsum(ss) / (float)D + eps));
  for (int64_t j = 0; j < D; j += kLanes) {
    const int n = lanes_left(D - j);
    const vec h = round_to<T>(vmul(vload(o + j, n), vinv));
    const vec wh = round_to<T>(vmul(vload(w + j, n), h));
    vstore(out + j, vmul(wh, silu(vload(z + j, n))), n);
  }
}

// One row of gate | up: out = T(T(silu(g)) * u), the roundings of F.silu(gate) * up in T.
template <typename T>
void silu_and_mul_row(const T* g, const T* u, int64_t I, T* out) {
  for (int64_t j = 0; j < I; j += kLanes) {
    const int n = lanes_left(I - j);
    vstore(out + j, vmul(round_to<T>(silu(vload(g + j, n))), vload(u + j, n)), n);
  }
}

// One head: the first 2 * half dims rotated (NEOX halves), the rest copied. apply_rotary's roundings:
// out1 = T(T(x1 * c) - T(x2 * s)), out2 = T(T(x2 * c) + T(x1 * s)).
template <typename T>
void rotary_head(const T* x, const T* c, const T* s, int64_t half, int64_t D, T* out) {
  const T* x2 = x + half;
  for (int64_t j = 0; j < half; j += kLanes) {
    const int n = lanes_left(half - j);
    const vec a = vload(x + j, n), b = vload(x2 + j, n), cv = vload(c + j, n), sv = vload(s + j, n);
    vstore(out + j, vsub(round_to<T>(vmul(a, cv)), round_to<T>(vmul(b, sv))), n);
    vstore(out + half + j, vadd(round_to<T>(vmul(b, cv)), round_to<T>(vmul(a, sv))), n);
  }
  if (2 * half < D) std::memcpy(out + 2 * half, x + 2 * half, (D - 2 * half) * sizeof(T));
}

// The element types the ops take; every tensor of a call shares x's.
void check_dtype(const at::Tensor& x, std::initializer_list<const at::Tensor*> others) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "bf16 or float32 CPU tensors only");
  for (const at::Tensor* t : others)
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->device().is_cpu(), "every tensor must have x's dtype");
}

template <typename T>
void rms_norm_rows(const at::Tensor& x, const at::Tensor* r, const at::Tensor& weight, float eps, bool zc,
                   at::Tensor& out, at::Tensor& sum) {
  const int64_t T_ = x.size(0), H = x.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* rp = r ? r->data_ptr<T>() : nullptr;
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* sp = r ? sum.data_ptr<T>() : nullptr;
  at::parallel_for(0, T_, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* rt = rp ? rp + t * H : nullptr;
      T* st = sp ? sp + t * H : nullptr;
      if (zc)
        norm_row<T, true>(xp + t * xs, rt, wp, H, eps, op + t * H, st);
      else
        norm_row<T, false>(xp + t * xs, rt, wp, H, eps, op + t * H, st);
    }
  });
}

template <typename T>
void gated_rms_norm_rows(const at::Tensor& o, const at::Tensor& z, const at::Tensor& weight, float eps, at::Tensor& out) {
  const int64_t T_ = o.size(0), H = o.size(1), D = o.size(2), zs = z.stride(0);
  const T* opp = o.data_ptr<T>();
  const T* zp = z.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* outp = out.data_ptr<T>();
  at::parallel_for(0, T_, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t h = 0; h < H; ++h)
        gated_norm_head(opp + (t * H + h) * D, zp + t * zs + h * D, wp, D, eps, outp + (t * H + h) * D);
  });
}

template <typename T>
void silu_and_mul_rows(const at::Tensor& x, at::Tensor& out) {
  const int64_t T_ = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, T_, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) silu_and_mul_row(xp + t * xs, xp + t * xs + I, I, op + t * I);
  });
}

template <typename T>
void rotary_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2), half = cos.size(1), xs = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, T_, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t h = 0; h < H; ++h)
        rotary_head(xp + t * xs + h * D, cp + t * half, sp + t * half, half, D, op + (t * H + h) * D);
  });
}

// x [T, H] (rows contiguous), residual [T, H] or undefined, weight [H], all bf16 or all float32 ->
// (norm [T, H], x + residual [T, H]; the second is empty without a residual).
// zero_centered: the weight is w - 1 (see norm_row).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps, bool zero_centered) {
  check_dtype(x, {&weight});
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() && weight.dim() == 1 &&
                  weight.size(0) == x.size(1),
              "x [T, H] rows contiguous, weight [H]");
  const bool has_res = residual.has_value() && residual->defined();
  at::Tensor r;
  if (has_res) {
    r = residual->contiguous();
    check_dtype(x, {&r});
    TORCH_CHECK(r.sizes() == x.sizes(), "residual must match x");
  }
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  auto sum = has_res ? at::empty({x.size(0), x.size(1)}, x.options()) : at::empty({0}, x.options());
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows<float>(x, has_res ? &r : nullptr, weight, (float)eps, zero_centered, out, sum);
  else
    rms_norm_rows<bf16>(x, has_res ? &r : nullptr, weight, (float)eps, zero_centered, out, sum);
  return {out, sum};
}

// o [T, H, D] (contiguous), z [T, H, D] (each row's heads contiguous, any row stride: a view of the qkvz
// projection), weight [D], all bf16 or all float32 -> [T, H * D], each head normed on its own.
at::Tensor gated_rms_norm(const at::Tensor& o, const at::Tensor& z, const at::Tensor& weight, double eps) {
  check_dtype(o, {&z, &weight});
  TORCH_CHECK(o.dim() == 3 && o.is_contiguous() && z.sizes() == o.sizes(), "o [T, H, D] contiguous, z the same shape");
  TORCH_CHECK(z.stride(2) == 1 && z.stride(1) == o.size(2), "z's heads must be contiguous within a row");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == o.size(2), "weight [D]");
  auto out = at::empty({o.size(0), o.size(1) * o.size(2)}, o.options());
  if (o.scalar_type() == at::kFloat)
    gated_rms_norm_rows<float>(o, z, weight, (float)eps, out);
  else
    gated_rms_norm_rows<bf16>(o, z, weight, (float)eps, out);
  return out;
}

// x [T, 2I] (gate | up, rows contiguous) bf16 or float32 -> silu(gate) * up [T, I].
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_dtype(x, {});
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x [T, 2I], rows contiguous");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  if (x.scalar_type() == at::kFloat)
    silu_and_mul_rows<float>(x, out);
  else
    silu_and_mul_rows<bf16>(x, out);
  return out;
}

// x [T, H, D] (each row's heads contiguous), cos / sin [T, R/2] contiguous, all bf16 or all float32 ->
// [T, H, D]: the first R dims rotated (NEOX halves), the rest copied (rotary_head).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_dtype(x, {&cos, &sin});
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x [T, H, D], each row's heads contiguous");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.size(0) == x.size(0) && 2 * cos.size(1) <= x.size(2),
              "cos / sin [T, R/2] contiguous, R <= D");
  auto out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  if (x.scalar_type() == at::kFloat)
    rotary_rows<float>(x, cos, sin, out);
  else
    rotary_rows<bf16>(x, cos, sin, out);
  return out;
}

// float32 lanes of this build's vectors: 16 (AVX-512) or 8 (AVX2), for the tests to tell them apart.
int64_t fused_elementwise_lanes() { return kLanes; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps, bool zero_centered) -> (Tensor, Tensor)");
  m.def("gated_rms_norm(Tensor o, Tensor z, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("fused_elementwise_lanes() -> int", &fused_elementwise_lanes);  // no tensor to dispatch on: every key
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("gated_rms_norm", &gated_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
}
