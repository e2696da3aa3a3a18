// The decoder's elementwise ops on bf16 rows in one pass each (CPU, AVX-512): RMSNorm with the
// residual add folded in (plain or zero-centred), Gated DeltaNet's gated output norm, SiLU(gate) * up,
// and the rotary embedding of q / k. Eager torch runs each as 4-6 kernels over the whole
// step, every one a trip through memory (a 2048-token prefill chunk's rows are 2.4 MB per norm
// and 12.6 MB per gate_up output: past L2). Here a row is read once, finished in registers and
// written once. Rounding is torch's, op for op, so outputs match the eager ops bit for bit but
// for the float32 sum order inside the norm and the exp polynomial (rare 1-ulp bf16 differences).
// See cpu_fused_elementwise.py for when they run.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_simd.h"

namespace {

inline __m512 load_bf16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

inline __m512 load_bf16_masked(const c10::BFloat16* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

// float32 -> bf16, round to nearest even (as torch's casts; NaN is not produced here from finite input).
inline __m256i to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// bf16 round trip in float lanes: what a torch bf16 op's output holds.
inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}

inline void store_bf16(c10::BFloat16* p, __m512 x) { _mm256_storeu_si256((__m256i*)p, to_bf16(x)); }
inline void store_bf16_masked(c10::BFloat16* p, __m512 x, __mmask16 k) { _mm256_mask_storeu_epi16(p, k, to_bf16(x)); }

// exp(x) for any float x, within 2 ulp of std::exp: +inf past float32's range, as std::exp (so
// silu(-120) is -0.0, as in torch); below -87 exp(-87) (it only ever meets 1 + exp).
inline __m512 exp_ps(__m512 x) {
  const __mmask16 overflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72283935546875f), _CMP_GT_OQ);
  const __m512 y = ember_simd::exp_in_range(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f)));
  return _mm512_mask_mov_ps(y, overflow, _mm512_set1_ps(INFINITY));
}

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

// One row: s = bf16(x + r) (when r), h = bf16(s * rsqrt(mean(s^2) + eps)), out = bf16(w * h) -- the
// roundings of RMSNorm.forward (the add, the cast after torch.rms_norm in float32, the weight multiply).
// ZC (zero-centred, Qwen3-Next / Qwen3.5): the weight is stored as w - 1 and out = bf16(s * inv * (1 + w)),
// all in float32 before the one rounding (ZeroCenteredRMSNorm's order).
template <bool ZC>
void norm_row(const c10::BFloat16* x, const c10::BFloat16* r, const c10::BFloat16* w, int64_t H, float eps,
              c10::BFloat16* out, c10::BFloat16* sum_out) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t j = 0; j < H; j += 16) {
    const __mmask16 k = tail_mask(H - j);
    __m512 v = load_bf16_masked(x + j, k);
    if (r != nullptr) {
      v = round_bf16(_mm512_add_ps(v, load_bf16_masked(r + j, k)));
      store_bf16_masked(sum_out + j, v, k);
    }
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / (float)H + eps);
  const __m512 vinv = _mm512_set1_ps(inv);
  const c10::BFloat16* src = r != nullptr ? sum_out : x;  // the rounded sum, re-read from L1
  for (int64_t j = 0; j < H; j += 16) {
    const __mmask16 k = tail_mask(H - j);
    const __m512 wv = load_bf16_masked(w + j, k);
    if (ZC) {
      const __m512 h = _mm512_mul_ps(load_bf16_masked(src + j, k), vinv);
      store_bf16_masked(out + j, _mm512_mul_ps(h, _mm512_add_ps(_mm512_set1_ps(1.f), wv)), k);
    } else {
      const __m512 h = round_bf16(_mm512_mul_ps(load_bf16_masked(src + j, k), vinv));
      store_bf16_masked(out + j, _mm512_mul_ps(wv, h), k);
    }
  }
}

// silu(z) = z / (1 + exp(-z)) in float32
inline __m512 silu_ps(__m512 z) {
  return _mm512_div_ps(z, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), z))));
}

// One head of the Gated DeltaNet output norm: out = bf16(bf16(w * bf16(o * inv)) * silu(z)), silu in
// float32 -- GatedRMSNorm.forward's roundings (the cast after torch.rms_norm, the bf16 weight multiply,
// the float32 gate).
void gated_norm_head(const c10::BFloat16* o, const c10::BFloat16* z, const c10::BFloat16* w, int64_t D, float eps,
                     c10::BFloat16* out) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t j = 0; j < D; j += 16) {
    const __m512 v = load_bf16_masked(o + j, tail_mask(D - j));
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 vinv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / (float)D + eps));
  for (int64_t j = 0; j < D; j += 16) {
    const __mmask16 k = tail_mask(D - j);
    const __m512 h = round_bf16(_mm512_mul_ps(load_bf16_masked(o + j, k), vinv));
    const __m512 wh = round_bf16(_mm512_mul_ps(load_bf16_masked(w + j, k), h));
    store_bf16_masked(out + j, _mm512_mul_ps(wh, silu_ps(load_bf16_masked(z + j, k))), k);
  }
}

}  // namespace

// x [T, H] bf16 (rows contiguous), residual [T, H] bf16 or undefined, weight [H] bf16 ->
// (norm [T, H], x + residual [T, H]; the second is empty without a residual).
// zero_centered: the weight is w - 1 (see norm_row).
std::tuple<at::Tensor, at::Tensor> rms_norm_bf16(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                 const at::Tensor& weight, double eps, bool zero_centered) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bf16 tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() && weight.size(0) == x.size(1), "x [T, H] rows contiguous, weight [H]");
  const bool has_res = residual.has_value() && residual->defined();
  at::Tensor r;
  if (has_res) {
    r = residual->contiguous();
    TORCH_CHECK(r.scalar_type() == at::kBFloat16 && r.sizes() == x.sizes(), "residual must match x");
  }
  const int64_t T = x.size(0), H = x.size(1), xs = x.stride(0);
  auto out = at::empty({T, H}, x.options());
  auto sum = has_res ? at::empty({T, H}, x.options()) : at::empty({0}, x.options());
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* rp = has_res ? r.data_ptr<c10::BFloat16>() : nullptr;
  const auto* wp = weight.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  auto* sp = has_res ? sum.data_ptr<c10::BFloat16>() : nullptr;
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const c10::BFloat16* rt = rp ? rp + t * H : nullptr;
      c10::BFloat16* st = sp ? sp + t * H : nullptr;
      if (zero_centered)
        norm_row<true>(xp + t * xs, rt, wp, H, (float)eps, op + t * H, st);
      else
        norm_row<false>(xp + t * xs, rt, wp, H, (float)eps, op + t * H, st);
    }
  });
  return {out, sum};
}

// o [T, H, D] bf16 (rows contiguous), z [T, H, D] bf16 (each row's heads contiguous, any row stride: a
// view of the qkvz projection), weight [D] bf16 -> [T, H * D] bf16, each head normed on its own.
at::Tensor gated_rms_norm_bf16(const at::Tensor& o, const at::Tensor& z, const at::Tensor& weight, double eps) {
  TORCH_CHECK(o.scalar_type() == at::kBFloat16 && z.scalar_type() == at::kBFloat16 &&
                  weight.scalar_type() == at::kBFloat16,
              "bf16 tensors only");
  TORCH_CHECK(o.dim() == 3 && o.is_contiguous() && z.sizes() == o.sizes(), "o [T, H, D] contiguous, z the same shape");
  const int64_t T = o.size(0), H = o.size(1), D = o.size(2);
  TORCH_CHECK(z.stride(2) == 1 && z.stride(1) == D, "z's heads must be contiguous within a row");
  TORCH_CHECK(weight.is_contiguous() && weight.size(0) == D, "weight [D]");
  auto out = at::empty({T, H * D}, o.options());
  const auto* opp = o.data_ptr<c10::BFloat16>();
  const auto* zp = z.data_ptr<c10::BFloat16>();
  const auto* wp = weight.data_ptr<c10::BFloat16>();
  auto* outp = out.data_ptr<c10::BFloat16>();
  const int64_t zs = z.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t h = 0; h < H; ++h)
        gated_norm_head(opp + (t * H + h) * D, zp + t * zs + h * D, wp, D, (float)eps, outp + (t * H + h) * D);
  });
  return out;
}

// x [T, 2I] bf16 (gate | up, rows contiguous) -> bf16(bf16(silu(gate)) * up) [T, I]: the roundings of
// F.silu(gate) * up in bf16.
at::Tensor silu_and_mul_bf16(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "x [T, 2I] bf16, rows contiguous");
  const int64_t T = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  auto out = at::empty({T, I}, x.options());
  const auto* xp = x.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const c10::BFloat16* g = xp + t * xs;
      const c10::BFloat16* u = g + I;
      c10::BFloat16* o = op + t * I;
      for (int64_t j = 0; j < I; j += 16) {
        const __mmask16 k = tail_mask(I - j);
        const __m512 gv = load_bf16_masked(g + j, k);
        const __m512 s = round_bf16(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv)))));
        store_bf16_masked(o + j, _mm512_mul_ps(s, load_bf16_masked(u + j, k)), k);
      }
    }
  });
  return out;
}

// x [T, H, D] bf16 (each row's heads contiguous), cos / sin [T, R/2] bf16 -> [T, H, D] bf16: the first
// R dims rotated (NEOX halves), the rest copied. The roundings of apply_rotary's bf16 ops:
// out1 = bf16(bf16(x1 * c) - bf16(x2 * s)), out2 = bf16(bf16(x2 * c) + bf16(x1 * s)).
at::Tensor rotary_bf16(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
              "bf16 tensors only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x [T, H, D], each row's heads contiguous");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.size(0) == x.size(0) && 2 * cos.size(1) <= x.size(2),
              "cos / sin [T, R/2] contiguous, R <= D");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = cos.size(1), xs = x.stride(0);
  auto out = at::empty({T, H, D}, x.options());
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* cp = cos.data_ptr<c10::BFloat16>();
  const auto* sp = sin.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const c10::BFloat16* x1 = xp + t * xs + h * D;
        const c10::BFloat16* x2 = x1 + half;
        c10::BFloat16* o = op + (t * H + h) * D;
        for (int64_t j = 0; j < half; j += 16) {
          const __mmask16 k = tail_mask(half - j);
          const __m512 a = load_bf16_masked(x1 + j, k), b = load_bf16_masked(x2 + j, k);
          const __m512 c = load_bf16_masked(cp + t * half + j, k), s = load_bf16_masked(sp + t * half + j, k);
          store_bf16_masked(o + j, _mm512_sub_ps(round_bf16(_mm512_mul_ps(a, c)), round_bf16(_mm512_mul_ps(b, s))), k);
          store_bf16_masked(o + half + j, _mm512_add_ps(round_bf16(_mm512_mul_ps(b, c)), round_bf16(_mm512_mul_ps(a, s))), k);
        }
        if (2 * half < D) std::memcpy(o + 2 * half, x1 + 2 * half, (D - 2 * half) * sizeof(c10::BFloat16));
      }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("rms_norm_bf16(Tensor x, Tensor? residual, Tensor weight, float eps, bool zero_centered) -> (Tensor, Tensor)");
  m.def("gated_rms_norm_bf16(Tensor o, Tensor z, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul_bf16(Tensor x) -> Tensor");
  m.def("rotary_bf16(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) {
  m.impl("rms_norm_bf16", &rms_norm_bf16);
  m.impl("gated_rms_norm_bf16", &gated_rms_norm_bf16);
  m.impl("silu_and_mul_bf16", &silu_and_mul_bf16);
  m.impl("rotary_bf16", &rotary_bf16);
}
