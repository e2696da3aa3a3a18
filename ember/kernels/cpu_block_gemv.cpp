// GEMV / GEMM / routed MoE over a GGUF file's own blocks (cpu_block_gemv.h has the interface; cpu_block_gemv.py
// says where the engine uses it and why). This file: the activation quantizers, the registry by ggml type, the
// row dots and exact row dequantizers of the K-quants (Q2_K..Q6_K), the 32-element types (Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0, IQ4_NL) and IQ4_XS, and the torch ops (block_gemm, block_dequant_rows, block_moe, ...).
//
// Numerics. A row's dot is an integer sum of weight codes times the activation's int8 codes inside each
// (sub-)block, scaled once per block in float32: llama.cpp's scheme, so a file runs as its quantizer meant.
// x is rounded per 256 (Q8K: scale = -max / 127 with max the element of largest |x|, codes round half to
// even, as llama.cpp's Q8_K) or per 32 (Q8x: scale = max|x| / 127, as its Q8_0 / Q8_1 but with a float32
// scale). The dequantizers compute each weight with the float32 operations of gguf-py's reference in the same
// order, so they give its values bit for bit (every product there but Q6_K's and IQ4_XS's last is exact, and
// those two keep gguf-py's order: (d * scale) * code).
//
// SIMD. AVX2 (an AVX-512 build runs the same code; a CPU without AVX2 runs the scalar dots): weight codes widened
// to bytes in registers and multiplied by the int8 activations with vpmaddubsw (unsigned codes x signed x, pairs
// summed to int16; signed codes go through their absolute value and x's sign flipped), then vpmaddwd by the
// sub-block scales to int32. Where the build has VNNI (AVX512-VNNI + VL, or AVX-VNNI), the one-scale-per-block
// types (Q8_0, IQ4_NL) use vpdpbusd. Each SIMD dot also comes in a 4-row form (a weight block unpacked once for
// 4 rows of x: the GEMM core's), and unpacks packed scales in registers (scalars stored and read back as a
// vector stall store forwarding). The scalar dots of every type stay compiled (the op block_gemm_scalar runs
// them), so tests check the SIMD paths against them on any machine.
//
// Work split (block_gemm): x is quantized once; the weight's rows go in tiles of kTileRows, and a tile's rows
// are dotted against up to kMBlock rows of x at a time, a K chunk at a time (kChunkBytes of each weight row),
// so that the tile's chunk stays in L1 while the rows of x pass over it: each weight byte is read from memory
// once per kMBlock rows of x. Tasks are (M block, tile) pairs in M-block-major order, so a thread's x block
// stays in its L2 while it streams tiles. block_moe: slots grouped by expert (a counting sort), gate / up tasks
// per (expert, tile), h quantized once per slot, then down tasks per tile of H over every chosen expert in
// ascending order (each output element summed in one order whatever the threads).
// Many rows of bf16 x on CPUs with AMX (the caller's dense_rows): block_gemm dequantizes the weight to bf16 once
// and runs one oneDNN GEMM; block_moe does the same per expert with at least dense_rows slots (the section
// "experts with many slots" below).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_block_gemv.h"


namespace ember_blocks {
namespace {

constexpr int64_t kTileRows = 8;        // weight rows a task's tile holds
constexpr int64_t kMBlock = 64;         // rows of x dotted against a tile per pass
constexpr int64_t kChunkBytes = 4096;   // bytes of each weight row a pass keeps in L1 (M > 1)
constexpr int64_t kTaskBytes = 1 << 15; // weight bytes a task holds at least: a small layer stays on one thread

// ---- scalars -------------------------------------------------------------------------------------------

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 31, mant = h & 1023;
  if (exp == 0) {
    const float v = std::ldexp(float(mant), -24);  // zero or subnormal: exact in float32
    return sign ? -v : v;
  }
  uint32_t bits = sign | (exp == 31 ? 0x7F800000u | (mant << 13) : ((exp + 112) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// IQ4_NL / IQ4_XS's 16 code values (the format's definition; gguf-py's IQ4_NL.kvalues, which the tests compare).
alignas(16) const int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Q4_K / Q5_K's 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32 -> sc[8], m[8].
inline void k4_scales(const uint8_t* s, uint8_t sc[8], uint8_t m[8]) {
  const uint32_t a = u32(s), b = u32(s + 4), c = u32(s + 8);
  const uint32_t w[4] = {a & 0x3F3F3F3Fu, (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u), b & 0x3F3F3F3Fu,
                         ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u)};
  std::memcpy(sc, w, 8);
  std::memcpy(m, w + 2, 8);
}

// Q3_K's 12 bytes -> 16 signed 6-bit scales (stored + 32): low nibbles of bytes 0..7 then their high
// nibbles, the top 2 bits from bytes 8..11 (scale i: byte 8 + i % 4, bits 2 (i / 4)).
inline void k3_scales(const uint8_t* s, int8_t out[16]) {
  const uint32_t a = u32(s), b = u32(s + 4), c = u32(s + 8);
  const uint32_t w[4] = {(a & 0x0F0F0F0Fu) | ((c & 0x03030303u) << 4),
                         (b & 0x0F0F0F0Fu) | (((c >> 2) & 0x03030303u) << 4),
                         ((a >> 4) & 0x0F0F0F0Fu) | (((c >> 4) & 0x03030303u) << 4),
                         ((b >> 4) & 0x0F0F0F0Fu) | (((c >> 6) & 0x03030303u) << 4)};
  uint8_t u[16];
  std::memcpy(u, w, 16);
  for (int i = 0; i < 16; ++i) out[i] = int8_t(int(u[i]) - 32);
}

// IQ4_XS's 6-bit scale of sub-block ib (stored + 32).
inline int iq4xs_scale(const uint8_t* b, int ib) {
  uint16_t h;
  std::memcpy(&h, b + 2, 2);
  return (((b[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((h >> (2 * ib)) & 3) << 4)) - 32;
}

// ---- exact row dequantizers (gguf-py's float32 operations, in its order) --------------------------------

void dequant_q4_0(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, row += 18, out += 32) {
    const float d = f16(row);
    for (int j = 0; j < 16; ++j) {
      out[j] = d * float(int(row[2 + j] & 15) - 8);
      out[j + 16] = d * float(int(row[2 + j] >> 4) - 8);
    }
  }
}

void dequant_q4_1(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, row += 20, out += 32) {
    const float d = f16(row), m = f16(row + 2);
    for (int j = 0; j < 16; ++j) {
      out[j] = d * float(row[4 + j] & 15) + m;
      out[j + 16] = d * float(row[4 + j] >> 4) + m;
    }
  }
}

// Q5_0 / Q5_1: element j < 16 is the low nibble of qs[j], j >= 16 the high nibble of qs[j - 16]; bit j of qh
// is its fifth bit.
inline int q5_code(const uint8_t* qs, uint32_t qh, int j) {
  const int lo = j < 16 ? qs[j] & 15 : qs[j - 16] >> 4;
  return lo | int((qh >> j) & 1) << 4;
}

void dequant_q5_0(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, row += 22, out += 32) {
    const float d = f16(row);
    const uint32_t qh = u32(row + 2);
    for (int j = 0; j < 32; ++j) out[j] = d * float(q5_code(row + 6, qh, j) - 16);
  }
}

void dequant_q5_1(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, row += 24, out += 32) {
    const float d = f16(row), m = f16(row + 2);
    const uint32_t qh = u32(row + 4);
    for (int j = 0; j < 32; ++j) out[j] = d * float(q5_code(row + 8, qh, j)) + m;
  }
}

void dequant_q8_0(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, row += 34, out += 32) {
    const float d = f16(row);
    for (int j = 0; j < 32; ++j) out[j] = float(int8_t(row[2 + j])) * d;
  }
}

// Q2_K (84 bytes): scales[16] (low nibble scale, high nibble min, per 16), qs[64], d, dmin. Element
// e = 128 c + 32 s + l is bits 2s of qs[32 c + l].
void dequant_q2_k(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, row += 84, out += 256) {
    const float d = f16(row + 80), dmin = f16(row + 82);
    for (int g = 0; g < 16; ++g) {  // 16 elements a scale: e = 16 g + l, g = 8 c + 2 s + half (a loop that vectorizes)
      const int c = g / 8, s = (g % 8) / 2, half = g % 2;
      const uint8_t sc = row[g];
      const float dl = d * float(sc & 15), ml = dmin * float(sc >> 4);
      const uint8_t* qs = row + 16 + 32 * c + 16 * half;
      for (int l = 0; l < 16; ++l) out[16 * g + l] = dl * float((qs[l] >> (2 * s)) & 3) - ml;
    }
  }
}

// Q3_K (110 bytes): hmask[32], qs[64], scales[12], d. Element e: low 2 bits as Q2_K's, bit e / 32 of
// hmask[e % 32] set means + 0, clear means - 4.
inline int q3_code(const uint8_t* b, int e) {
  const int lo = (b[32 + 32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
  const int hi = (b[e % 32] >> (e / 32)) & 1;
  return lo - (hi ? 0 : 4);
}

void dequant_q3_k(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, row += 110, out += 256) {
    const float d = f16(row + 108);
    int8_t sc[16];
    k3_scales(row + 96, sc);
    for (int g = 0; g < 16; ++g) {  // 16 elements a scale, as Q2_K's (a loop that vectorizes)
      const int c = g / 8, s = (g % 8) / 2, half = g % 2;
      const float ds = d * float(sc[g]);
      const uint8_t *qs = row + 32 + 32 * c + 16 * half, *hm = row + 16 * half;
      for (int l = 0; l < 16; ++l)
        out[16 * g + l] = ds * float(((qs[l] >> (2 * s)) & 3) - (((hm[l] >> (4 * c + s)) & 1) ? 0 : 4));
    }
  }
}

// Q4_K (144 bytes): d, dmin, scales[12], qs[128]; sub-block 2j is the low nibbles of qs[32j .. 32j + 32],
// 2j + 1 their high nibbles.
void dequant_q4_k(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, row += 144, out += 256) {
    const float d = f16(row), dmin = f16(row + 2);
    uint8_t sc[8], m[8];
    k4_scales(row + 4, sc, m);
    for (int s = 0; s < 8; ++s) {
      const float ds = d * float(sc[s]), dm = dmin * float(m[s]);
      const uint8_t* qs = row + 16 + 32 * (s / 2);
      for (int l = 0; l < 32; ++l) out[32 * s + l] = ds * float((qs[l] >> (4 * (s % 2))) & 15) - dm;
    }
  }
}

// Q5_K (176 bytes): d, dmin, scales[12], qh[32], qs[128]; Q4_K's nibbles plus bit s of qh[l] as the fifth
// bit of sub-block s's element l.
void dequant_q5_k(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, row += 176, out += 256) {
    const float d = f16(row), dmin = f16(row + 2);
    uint8_t sc[8], m[8];
    k4_scales(row + 4, sc, m);
    for (int s = 0; s < 8; ++s) {
      const float ds = d * float(sc[s]), dm = dmin * float(m[s]);
      const uint8_t* qs = row + 48 + 32 * (s / 2);
      for (int l = 0; l < 32; ++l) {
        const int q = ((qs[l] >> (4 * (s % 2))) & 15) | (((row[16 + l] >> s) & 1) << 4);
        out[32 * s + l] = ds * float(q) - dm;
      }
    }
  }
}

// Q6_K (210 bytes): ql[128], qh[64], scales[16] (int8, per 16), d. In half h (128 elements) element
// 32 c + l (c = 0..3) has low nibble (c odd: ql[64h + 32 + l], else ql[64h + l]; c >= 2: the high nibble)
// and high bits 2c of qh[32h + l]; w = (d * S) * (q - 32).
inline int q6_code(const uint8_t* b, int e) {
  const int h = e / 128, c = (e % 128) / 32, l = e % 32;
  const int lo = (b[64 * h + 32 * (c % 2) + l] >> (4 * (c / 2))) & 15;
  const int hi = (b[128 + 32 * h + l] >> (2 * c)) & 3;
  return (lo | hi << 4) - 32;
}

void dequant_q6_k(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, row += 210, out += 256) {
    const float d = f16(row + 208);
    for (int e = 0; e < 256; ++e) out[e] = (d * float(int8_t(row[192 + e / 16]))) * float(q6_code(row, e));
  }
}

void dequant_iq4_nl(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, row += 18, out += 32) {
    const float d = f16(row);
    for (int j = 0; j < 16; ++j) {
      out[j] = d * float(kIQ4Values[row[2 + j] & 15]);
      out[j + 16] = d * float(kIQ4Values[row[2 + j] >> 4]);
    }
  }
}

// IQ4_XS (136 bytes): d, scales_h (u16), scales_l[4], qs[128]; sub-block ib's 16 bytes at qs + 16 ib hold its
// elements 0..15 (low nibbles) and 16..31 (high).
void dequant_iq4_xs(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, row += 136, out += 256) {
    const float d = f16(row);
    for (int ib = 0; ib < 8; ++ib) {
      const float dl = d * float(iq4xs_scale(row, ib));
      const uint8_t* qs = row + 8 + 16 * ib;
      for (int j = 0; j < 16; ++j) {
        out[32 * ib + j] = dl * float(kIQ4Values[qs[j] & 15]);
        out[32 * ib + j + 16] = dl * float(kIQ4Values[qs[j] >> 4]);
      }
    }
  }
}

// ---- scalar dots (the reference; and the dots of the types with no SIMD path) ----------------------------

const BlockQ8x* q8x(const void* x) { return static_cast<const BlockQ8x*>(x); }
const BlockQ8K* q8k(const void* x) { return static_cast<const BlockQ8K*>(x); }

// The 32-element types' scalar dots: per block d x.d isum (isum(row, qs): the block's codes . x's, in
// integers), plus m x.s for the types with a min (Q4_1, Q5_1: m the f16 after d).
template <int kBytes, bool kMin, typename ISum>
inline float dot_q8x_scalar(const uint8_t* row, const void* vx, int64_t nb, ISum isum) {
  const BlockQ8x* x = q8x(vx);
  float sum = 0.f;
  for (int64_t i = 0; i < nb; ++i, row += kBytes) {
    if (kMin)
      sum += f16(row) * x[i].d * float(isum(row, x[i].qs)) + f16(row + 2) * x[i].s;
    else
      sum += f16(row) * x[i].d * float(isum(row, x[i].qs));
  }
  return sum;
}

float dot_q4_0(const uint8_t* row, const void* vx, int64_t nb) {
  return dot_q8x_scalar<18, false>(row, vx, nb, [](const uint8_t* b, const int8_t* qs) {
    int isum = 0;
    for (int j = 0; j < 16; ++j) isum += (int(b[2 + j] & 15) - 8) * qs[j] + (int(b[2 + j] >> 4) - 8) * qs[j + 16];
    return isum;
  });
}

float dot_q4_1(const uint8_t* row, const void* vx, int64_t nb) {
  return dot_q8x_scalar<20, true>(row, vx, nb, [](const uint8_t* b, const int8_t* qs) {
    int isum = 0;
    for (int j = 0; j < 16; ++j) isum += int(b[4 + j] & 15) * qs[j] + int(b[4 + j] >> 4) * qs[j + 16];
    return isum;
  });
}

float dot_q5_0(const uint8_t* row, const void* vx, int64_t nb) {
  return dot_q8x_scalar<22, false>(row, vx, nb, [](const uint8_t* b, const int8_t* qs) {
    const uint32_t qh = u32(b + 2);
    int isum = 0;
    for (int j = 0; j < 32; ++j) isum += (q5_code(b + 6, qh, j) - 16) * qs[j];
    return isum;
  });
}

float dot_q5_1(const uint8_t* row, const void* vx, int64_t nb) {
  return dot_q8x_scalar<24, true>(row, vx, nb, [](const uint8_t* b, const int8_t* qs) {
    const uint32_t qh = u32(b + 4);
    int isum = 0;
    for (int j = 0; j < 32; ++j) isum += q5_code(b + 8, qh, j) * qs[j];
    return isum;
  });
}

float dot_q8_0_scalar(const uint8_t* row, const void* vx, int64_t nb) {
  // As unsigned codes (w + 128) . x - 128 sum(x): GCC 12.2 (Debian 12's) at an -march with AVX512-VNNI vectorizes
  // the plain signed int8 x int8 loop with vpdpbusd, which reads one side as unsigned, and got it wrong (sums
  // thousands off: test_gemm_and_scalar_dots_give_the_products_of_the_rounded_x on a Xeon); unsigned x signed
  // is what vpdpbusd computes, and -march=haswell and -O0 agree with this form.
  return dot_q8x_scalar<34, false>(row, vx, nb, [](const uint8_t* b, const int8_t* qs) {
    int isum = 0, xsum = 0;
    for (int j = 0; j < 32; ++j) {
      isum += int(uint8_t(b[2 + j] ^ 0x80)) * qs[j];
      xsum += qs[j];
    }
    return isum - 128 * xsum;
  });
}

float dot_iq4_nl_scalar(const uint8_t* row, const void* vx, int64_t nb) {
  return dot_q8x_scalar<18, false>(row, vx, nb, [](const uint8_t* b, const int8_t* qs) {
    int isum = 0;
    for (int j = 0; j < 16; ++j) isum += kIQ4Values[b[2 + j] & 15] * qs[j] + kIQ4Values[b[2 + j] >> 4] * qs[j + 16];
    return isum;
  });
}

float dot_q2_k_scalar(const uint8_t* row, const void* vx, int64_t nb) {
  const BlockQ8K* x = q8k(vx);
  float sum = 0.f;
  for (int64_t i = 0; i < nb; ++i, row += 84) {
    int isum = 0, msum = 0;
    for (int e = 0; e < 256; ++e) {
      const int q = (row[16 + 32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
      isum += (row[e / 16] & 15) * q * x[i].qs[e];
    }
    for (int s = 0; s < 16; ++s) msum += (row[s] >> 4) * x[i].bsums[s];
    sum += x[i].d * (f16(row + 80) * float(isum) - f16(row + 82) * float(msum));
  }
  return sum;
}

float dot_q3_k_scalar(const uint8_t* row, const void* vx, int64_t nb) {
  const BlockQ8K* x = q8k(vx);
  float sum = 0.f;
  for (int64_t i = 0; i < nb; ++i, row += 110) {
    int8_t sc[16];
    k3_scales(row + 96, sc);
    int isum = 0;
    for (int e = 0; e < 256; ++e) isum += sc[e / 16] * q3_code(row, e) * x[i].qs[e];
    sum += x[i].d * f16(row + 108) * float(isum);
  }
  return sum;
}

// Q4_K and Q5_K: d sum_s sc_s sum(q x) - dmin sum_s m_s sum(x), sum(x) over a sub-block from the bsums.
template <bool kFive>
float dot_q45_k_scalar(const uint8_t* row, const void* vx, int64_t nb) {
  const BlockQ8K* x = q8k(vx);
  float sum = 0.f;
  constexpr int kBytes = kFive ? 176 : 144, kQs = kFive ? 48 : 16;
  for (int64_t i = 0; i < nb; ++i, row += kBytes) {
    uint8_t sc[8], m[8];
    k4_scales(row + 4, sc, m);
    int isum = 0, msum = 0;
    for (int s = 0; s < 8; ++s) {
      int qsum = 0;
      for (int l = 0; l < 32; ++l) {
        int q = (row[kQs + 32 * (s / 2) + l] >> (4 * (s % 2))) & 15;
        if (kFive) q |= ((row[16 + l] >> s) & 1) << 4;
        qsum += q * x[i].qs[32 * s + l];
      }
      isum += sc[s] * qsum;
      msum += m[s] * (x[i].bsums[2 * s] + x[i].bsums[2 * s + 1]);
    }
    sum += x[i].d * (f16(row) * float(isum) - f16(row + 2) * float(msum));
  }
  return sum;
}

float dot_q6_k_scalar(const uint8_t* row, const void* vx, int64_t nb) {
  const BlockQ8K* x = q8k(vx);
  float sum = 0.f;
  for (int64_t i = 0; i < nb; ++i, row += 210) {
    int isum = 0;
    for (int e = 0; e < 256; ++e) isum += int8_t(row[192 + e / 16]) * q6_code(row, e) * x[i].qs[e];
    sum += x[i].d * f16(row + 208) * float(isum);
  }
  return sum;
}

float dot_iq4_xs_scalar(const uint8_t* row, const void* vx, int64_t nb) {
  const BlockQ8K* x = q8k(vx);
  float sum = 0.f;
  for (int64_t i = 0; i < nb; ++i, row += 136) {
    int isum = 0;
    for (int ib = 0; ib < 8; ++ib) {
      const uint8_t* qs = row + 8 + 16 * ib;
      const int8_t* xq = x[i].qs + 32 * ib;
      int s = 0;
      for (int j = 0; j < 16; ++j) s += kIQ4Values[qs[j] & 15] * xq[j] + kIQ4Values[qs[j] >> 4] * xq[j + 16];
      isum += iq4xs_scale(row, ib) * s;
    }
    sum += x[i].d * f16(row) * float(isum);
  }
  return sum;
}

}  // namespace
}  // namespace ember_blocks

// ---- AVX2 dots --------------------------------------------------------------------------------------------
#if defined(__AVX2__)
namespace ember_blocks {
namespace {

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m128i load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Scales unpacked in registers: a store of scalars read back as a vector stalls (store forwarding fails).

// Q4_K / Q5_K: the 12 scale bytes at p -> 16 bytes sc[0..7], m[0..7] (reads 16 bytes: 4 of the block's codes).
inline __m128i k4_scales_v(const uint8_t* p) {
  const __m128i v = load128(p);  // 32-bit lanes a, b, c, (codes)
  const __m128i t1 = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), t2 = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));
  const __m128i lo = _mm_and_si128(_mm_srlv_epi32(t1, _mm_set_epi32(4, 0, 0, 0)),
                                   _mm_set_epi32(0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F));
  return _mm_or_si128(lo, _mm_and_si128(_mm_srli_epi32(t2, 2), _mm_set_epi32(0x30303030, 0, 0x30303030, 0)));
}

// Q3_K: the 12 scale bytes at b + 96 (a 110-byte block) -> 16 signed scales (reads bytes 94..109).
inline __m128i k3_scales_v(const uint8_t* b) {
  const __m128i v = _mm_srli_si128(load128(b + 94), 2);  // 32-bit lanes a, b, c, -
  const __m128i lo = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 1, 0)), _mm_set_epi32(4, 4, 0, 0)),
                                   _mm_set1_epi8(15));
  const __m128i c = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 2, 2, 2)), _mm_set_epi32(6, 4, 2, 0));
  const __m128i hi = _mm_slli_epi32(_mm_and_si128(c, _mm_set1_epi8(3)), 4);
  return _mm_sub_epi8(_mm_or_si128(lo, hi), _mm_set1_epi8(32));
}

// IQ4_XS: its 8 sub-block scales (scales_l nibbles, scales_h 2-bit pairs, - 32) as int16 in both 128-bit lanes.
inline __m256i iq4xs_scales_v(const uint8_t* b) {
  uint16_t h;
  std::memcpy(&h, b + 2, 2);
  const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(u32(b + 4))), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                      _mm256_set1_epi32(15));
  const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(h), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                      _mm256_set1_epi32(3));
  const __m256i s32 = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
  const __m128i s16 = _mm_packs_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
  return _mm256_broadcastsi128_si256(s16);
}

// int16 lane s of v (each 128-bit lane holding 8 int16) broadcast to all 16 lanes.
inline __m256i bcast16(__m256i v, int s) { return _mm256_shuffle_epi8(v, _mm256_set1_epi16(short(0x0100 + 0x0202 * s))); }

// Each byte's bit `from` moved to bit `to`, the other bits cleared (16-bit shifts: a bit that crosses into
// the neighbouring byte lands outside the mask).
inline __m256i bit_to(__m256i v, int from, int to) {
  const __m256i mask = _mm256_set1_epi8(char(1 << to));
  if (from < to) return _mm256_and_si256(_mm256_sll_epi16(v, _mm_cvtsi32_si128(to - from)), mask);
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(from - to)), mask);
}

// 16 int16: the bytes a and a + 1 of s8 (a 16-byte vector of per-16 scales) each repeated 8 times, so that
// lanes 0..7 (elements 0..15 of a 32-element run) take scale a and lanes 8..15 scale a + 1.
inline __m256i pair_scales_u8(__m128i s8, int a) {
  const __m128i idx = _mm_add_epi8(_mm_set_epi8(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), _mm_set1_epi8(char(a)));
  return _mm256_cvtepu8_epi16(_mm_shuffle_epi8(s8, idx));
}
inline __m256i pair_scales_s8(__m128i s8, int a) {
  const __m128i idx = _mm_add_epi8(_mm_set_epi8(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), _mm_set1_epi8(char(a)));
  return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, idx));
}

// Signed bytes w . signed bytes x as 8 int32 sums of 4 products, given aw = |w| (vpsignb(w, w); |-128| reads
// as the unsigned 128): x's signs flipped where w < 0, then unsigned x signed products (|x| <= 127: the int16
// pairs of vpmaddubsw cannot saturate).
inline __m256i dot_s8(__m256i aw, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, _mm256_sign_epi8(x, w));
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), aw, _mm256_sign_epi8(x, w));
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
#endif
}

// Each dot below takes NX rows of x at once (xs[n]: row n's blocks) and writes out[n]: a weight block is
// unpacked once for all of them (NX = 1 is the registry's RowDot; tile_dots takes NX = 4 for many rows).
using MultiDot = void (*)(const uint8_t* row, const void* const* xs, int64_t nb, float* out);

template <int NX>
inline void finish(const __m256 (&acc)[NX], float* out) {
  for (int n = 0; n < NX; ++n) out[n] = hsum(acc[n]);
}

// The frame of the dots that keep int32 sums a block (the K-quants, IQ4_XS): acc zeroed, then for each block
// i (at row) block(row, i, isum, acc) fills isum (zeroed) and folds it into acc; the rows' dots to out.
template <int NX, int kBytes, typename Block>
inline void k_dots(const uint8_t* row, const void* const* xs, int64_t nb, float* out, Block block) {
  __m256 acc[NX];
  for (int n = 0; n < NX; ++n) acc[n] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i, row += kBytes) {
    __m256i isum[NX];
    for (int n = 0; n < NX; ++n) isum[n] = _mm256_setzero_si256();
    block(row, i, isum, acc);
  }
  finish<NX>(acc, out);
}

// The K-quant dots' shared steps. add_runs: isum[n] += the 32 unsigned codes q times x row n's 32 codes at
// `at` of block i, summed in int16 pairs, times `scale` (int16 lanes). add_with_mins: the block into acc,
// d x.d isum - dmin x.d (bsums . m16) (Q2_K, Q4_K, Q5_K); add_with_offset: d x.d (isum - 2^kShift (bsums .
// s16)), the codes' offset (Q3_K: 4, Q6_K: 32) taken out through the bsums.
template <int NX>
inline void add_runs(__m256i (&isum)[NX], __m256i q, __m256i scale, const void* const* xs, int64_t i, int at) {
  for (int n = 0; n < NX; ++n) {
    const __m256i p = _mm256_maddubs_epi16(q, load256(q8k(xs[n])[i].qs + at));
    isum[n] = _mm256_add_epi32(isum[n], _mm256_madd_epi16(p, scale));
  }
}

template <int NX>
inline void add_with_mins(__m256 (&acc)[NX], const __m256i (&isum)[NX], const void* const* xs, int64_t i, float d,
                          float dmin, __m256i m16) {
  for (int n = 0; n < NX; ++n) {
    const BlockQ8K& x = q8k(xs[n])[i];
    const __m256 msum = _mm256_cvtepi32_ps(_mm256_madd_epi16(load256(x.bsums), m16));
    acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d), _mm256_cvtepi32_ps(isum[n]), acc[n]);
    acc[n] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin * x.d), msum, acc[n]);
  }
}

template <int kShift, int NX>
inline void add_with_offset(__m256 (&acc)[NX], const __m256i (&isum)[NX], const void* const* xs, int64_t i, float d,
                            __m256i s16) {
  for (int n = 0; n < NX; ++n) {
    const BlockQ8K& x = q8k(xs[n])[i];
    const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(load256(x.bsums), s16), kShift);
    acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d), _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[n], corr)), acc[n]);
  }
}

// Q8_0 and IQ4_NL: 32 signed weights and one float16 scale a block; Values(row) gives the 32 weights.
template <int NX, int kBytes, typename Values>
void dot_q8x_signed(const uint8_t* row, const void* const* xs, int64_t nb, float* out, Values values) {
  __m256 acc[NX];
  for (int n = 0; n < NX; ++n) acc[n] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i, row += kBytes) {
    const __m256i w = values(row), aw = _mm256_sign_epi8(w, w);
    const float dw = f16(row);
    for (int n = 0; n < NX; ++n) {
      const BlockQ8x& x = q8x(xs[n])[i];
      const __m256 p = _mm256_cvtepi32_ps(dot_s8(aw, w, load256(x.qs)));
      acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d), p, acc[n]);
    }
  }
  finish<NX>(acc, out);
}

// 16 bytes of nibbles -> their 32 IQ4 values (low nibbles first) by a table lookup in each 128-bit lane.
inline __m256i iq4_values(__m128i q, __m256i table) {
  const __m128i lo = _mm_and_si128(q, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15));
  return _mm256_shuffle_epi8(table, _mm256_set_m128i(hi, lo));
}

inline __m256i iq4_table() { return _mm256_broadcastsi128_si256(load128(kIQ4Values)); }

template <int NX>
void dot_q8_0_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  dot_q8x_signed<NX, 34>(row, xs, nb, out, [](const uint8_t* b) { return load256(b + 2); });
}

template <int NX>
void dot_iq4_nl_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  const __m256i table = iq4_table();
  dot_q8x_signed<NX, 18>(row, xs, nb, out, [table](const uint8_t* b) { return iq4_values(load128(b + 2), table); });
}

template <int NX>
void dot_iq4_xs_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  const __m256i table = iq4_table();
  k_dots<NX, 136>(row, xs, nb, out, [&](const uint8_t* row, int64_t i, __m256i(&isum)[NX], __m256(&acc)[NX]) {
    const __m256i scales = iq4xs_scales_v(row);
#pragma GCC unroll 8
    for (int ib = 0; ib < 8; ++ib) {
      const __m256i w = iq4_values(load128(row + 8 + 16 * ib), table), aw = _mm256_sign_epi8(w, w);
      const __m256i ls = bcast16(scales, ib);
      for (int n = 0; n < NX; ++n) {
        const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(load256(q8k(xs[n])[i].qs + 32 * ib), w));
        isum[n] = _mm256_add_epi32(isum[n], _mm256_madd_epi16(p, ls));
      }
    }
    const float dw = f16(row);
    for (int n = 0; n < NX; ++n)
      acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(dw * q8k(xs[n])[i].d), _mm256_cvtepi32_ps(isum[n]), acc[n]);
  });
}

// Q4_K / Q5_K: per 64 elements one 32-byte load of nibbles (low: sub-block 2j, high: 2j + 1), times the
// 6-bit scale of each sub-block; the mins through the bsums: m_s (bsums[2s] + bsums[2s + 1]).
template <int NX, bool kFive>
void dot_q45_k_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  constexpr int kBytes = kFive ? 176 : 144, kQs = kFive ? 48 : 16;
  const __m256i nib = _mm256_set1_epi8(15);
  k_dots<NX, kBytes>(row, xs, nb, out, [&](const uint8_t* row, int64_t i, __m256i(&isum)[NX], __m256(&acc)[NX]) {
    const __m128i scm = k4_scales_v(row + 4);  // sc[8] then m[8]
    const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scm));
    const __m256i qh = kFive ? load256(row + 16) : _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i q = load256(row + kQs + 32 * j);
      __m256i lo = _mm256_and_si256(q, nib), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), nib);
      if (kFive) {
        lo = _mm256_or_si256(lo, bit_to(qh, 2 * j, 4));
        hi = _mm256_or_si256(hi, bit_to(qh, 2 * j + 1, 4));
      }
      const __m256i slo = bcast16(sc16, 2 * j), shi = bcast16(sc16, 2 * j + 1);
      for (int n = 0; n < NX; ++n) {
        const int8_t* xq = q8k(xs[n])[i].qs + 64 * j;
        const __m256i plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load256(xq)), slo);
        const __m256i phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load256(xq + 32)), shi);
        isum[n] = _mm256_add_epi32(isum[n], _mm256_add_epi32(plo, phi));
      }
    }
    const __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(scm, scm));  // m0 m0 m1 m1 ... (per bsum)
    const float d = f16(row), dmin = f16(row + 2);
    add_with_mins<NX>(acc, isum, xs, i, d, dmin, m16);
  });
}

// Q6_K: per half (128 elements) 64 bytes of low nibbles and 32 of 2-bit high parts; each 32-element run
// spans two sub-blocks of 16 with int8 scales S; sum S (q6 - 32) x = sum S q6 x - 32 sum S bsum.
template <int NX>
void dot_q6_k_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  const __m256i nib = _mm256_set1_epi8(15);
  k_dots<NX, 210>(row, xs, nb, out, [&](const uint8_t* row, int64_t i, __m256i(&isum)[NX], __m256(&acc)[NX]) {
    const __m128i s8 = load128(row + 192);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load256(row + 64 * h), l1 = load256(row + 64 * h + 32), qh = load256(row + 128 + 32 * h);
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, nib), _mm256_or_si256(bit_to(qh, 0, 4), bit_to(qh, 1, 5))),
          _mm256_or_si256(_mm256_and_si256(l1, nib), _mm256_or_si256(bit_to(qh, 2, 4), bit_to(qh, 3, 5))),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), nib),
                          _mm256_or_si256(bit_to(qh, 4, 4), bit_to(qh, 5, 5))),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), nib),
                          _mm256_or_si256(bit_to(qh, 6, 4), bit_to(qh, 7, 5))),
      };
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m256i sc = pair_scales_s8(s8, 8 * h + 2 * c);
        add_runs<NX>(isum, q[c], sc, xs, i, 128 * h + 32 * c);
      }
    }
    const __m256i s16 = _mm256_cvtepi8_epi16(s8);
    const float d = f16(row + 208);
    add_with_offset<5, NX>(acc, isum, xs, i, d, s16);
  });
}

// Q2_K: 2-bit codes (bits 2s of a 32-byte run), a 4-bit scale and min per 16; mins through the bsums.
template <int NX>
void dot_q2_k_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  const __m256i three = _mm256_set1_epi8(3);
  k_dots<NX, 84>(row, xs, nb, out, [&](const uint8_t* row, int64_t i, __m256i(&isum)[NX], __m256(&acc)[NX]) {
    const __m128i sc = load128(row);
    const __m128i s8 = _mm_and_si128(sc, _mm_set1_epi8(15)), m8 = _mm_and_si128(_mm_srli_epi16(sc, 4), _mm_set1_epi8(15));
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
      const __m256i qs = load256(row + 16 + 32 * c);
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        const __m256i q = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * s)), three);
        const __m256i scale = pair_scales_u8(s8, 8 * c + 2 * s);
        add_runs<NX>(isum, q, scale, xs, i, 128 * c + 32 * s);
      }
    }
    const __m256i m16 = _mm256_cvtepu8_epi16(m8);
    const float d = f16(row + 80), dmin = f16(row + 82);
    add_with_mins<NX>(acc, isum, xs, i, d, dmin, m16);
  });
}

// Q3_K: codes lo + 4 hbit (0..7) times x, minus 4 sum(x) per sub-block: sum S (q3 - 4) x.
template <int NX>
void dot_q3_k_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  const __m256i three = _mm256_set1_epi8(3);
  k_dots<NX, 110>(row, xs, nb, out, [&](const uint8_t* row, int64_t i, __m256i(&isum)[NX], __m256(&acc)[NX]) {
    const __m128i s8 = k3_scales_v(row);
    const __m256i hm = load256(row);
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
      const __m256i qs = load256(row + 32 + 32 * c);
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * s)), three);
        const __m256i q = _mm256_or_si256(lo, bit_to(hm, 4 * c + s, 2));
        const __m256i scale = pair_scales_s8(s8, 8 * c + 2 * s);
        add_runs<NX>(isum, q, scale, xs, i, 128 * c + 32 * s);
      }
    }
    const __m256i s16 = _mm256_cvtepi8_epi16(s8);
    const float d = f16(row + 108);
    add_with_offset<2, NX>(acc, isum, xs, i, d, s16);
  });
}

// Q4_0, Q4_1, Q5_0, Q5_1: unsigned codes q (4 or 5 bits) a block, w = d q + m (Q4_1, Q5_1) or d (q - 8 | 16):
// d sum(q x) + m x.s, x.s = x.d sum(xq) (the offset through x's sum, as llama.cpp's Q8_1).
template <int kQs, int kQh>
inline __m256i legacy_codes(const uint8_t* b) {
  const __m128i qs = load128(b + kQs);
  __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), _mm_set1_epi8(15)), _mm_and_si128(qs, _mm_set1_epi8(15)));
  if (kQh >= 0) {  // bit j of the u32 at kQh is element j's fifth bit: byte j of the vector takes byte j / 8's bit j % 8
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(int(u32(b + kQh))),
                                              _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
    q = _mm256_or_si256(q, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(16)));
  }
  return q;
}

template <int NX, int kBytes, int kQs, int kQh, bool kMin, int kZero>
void dot_legacy_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  __m256 acc[NX];
  float off[NX] = {};
  for (int n = 0; n < NX; ++n) acc[n] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i, row += kBytes) {
    const __m256i q = legacy_codes<kQs, kQh>(row);
    const float d = f16(row), o = kMin ? f16(row + 2) : -float(kZero) * d;
    for (int n = 0; n < NX; ++n) {
      const BlockQ8x& x = q8x(xs[n])[i];
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, load256(x.qs)), _mm256_set1_epi16(1));
      acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(d * x.d), _mm256_cvtepi32_ps(p), acc[n]);
      off[n] += o * x.s;
    }
  }
  for (int n = 0; n < NX; ++n) out[n] = hsum(acc[n]) + off[n];
}

template <int NX>
void dot_q4_0_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  dot_legacy_n<NX, 18, 2, -1, false, 8>(row, xs, nb, out);
}
template <int NX>
void dot_q4_1_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  dot_legacy_n<NX, 20, 4, -1, true, 0>(row, xs, nb, out);
}
template <int NX>
void dot_q5_0_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  dot_legacy_n<NX, 22, 6, 2, false, 16>(row, xs, nb, out);
}
template <int NX>
void dot_q5_1_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  dot_legacy_n<NX, 24, 8, 4, true, 0>(row, xs, nb, out);
}

template <int NX>
void dot_q4_k_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  dot_q45_k_n<NX, false>(row, xs, nb, out);
}

template <int NX>
void dot_q5_k_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  dot_q45_k_n<NX, true>(row, xs, nb, out);
}

// The NX = 1 form as a RowDot (the registry's).
template <void (*Dot)(const uint8_t*, const void* const*, int64_t, float*)>
float one_row(const uint8_t* row, const void* x, int64_t nb) {
  float out;
  Dot(row, &x, nb, &out);
  return out;
}

}  // namespace
}  // namespace ember_blocks
#endif  // __AVX2__

namespace ember_blocks {
// cpu_block_gemv_iq.cpp's scalar reference dots (not in the shared header: only block_gemm_scalar runs them),
// and in an AVX2 build its 4-row dots (one weight row against 4 rows of x: the grid decoded once)
#define EMBER_IQ_DECLARE_SCALAR(t) float dot_##t##_scalar(const uint8_t* row, const void* x, int64_t nb);
EMBER_IQ_TYPES(EMBER_IQ_DECLARE_SCALAR)
#undef EMBER_IQ_DECLARE_SCALAR
#if defined(__AVX2__)
#define EMBER_IQ_DECLARE_X4(t) void dot_##t##_x4(const uint8_t* row, const void* const* xs, int64_t nb, float* out);
EMBER_IQ_TYPES(EMBER_IQ_DECLARE_X4)
#undef EMBER_IQ_DECLARE_X4
#define EMBER_IQ_DOT4(name) name##_x4
#else
#define EMBER_IQ_DOT4(name) nullptr
#endif

namespace {

// ---- the registry ----------------------------------------------------------------------------------------

using MultiDot4 = void (*)(const uint8_t* row, const void* const* xs, int64_t nb, float* out);

struct Entry {
  BlockType type;
  RowDot scalar_dot;  // the reference dot (block_gemm_scalar)
  MultiDot4 dot4;     // one row against 4 rows of x at once (nullptr: 4 calls of type.dot)
};

#if defined(__AVX2__)
#define EMBER_DOT(name, scalar) one_row<name<1>>
#define EMBER_DOT4(name) name<4>
#else
#define EMBER_DOT(name, scalar) scalar
#define EMBER_DOT4(name) nullptr
#endif
// A type of this file: its SIMD dot template `simd` in an AVX2 build (the 1-row form the type's dot, the 4-row
// form dot4), else the scalar dot, the reference either way.
#define EMBER_ENTRY(ggml, elems, bytes, act, simd, scalar, dequant) \
  {{ggml, elems, bytes, ActFormat::act, EMBER_DOT(simd, scalar), dequant}, scalar, EMBER_DOT4(simd)}
// A grid-coded IQ type (cpu_block_gemv_iq.cpp: its entry points pick AVX2 or scalar as it is built).
#define EMBER_IQ_ENTRY(ggml, bytes, t) \
  {{ggml, 256, bytes, ActFormat::Q8K, dot_##t, dequant_##t}, dot_##t##_scalar, EMBER_IQ_DOT4(dot_##t)}

const Entry kEntries[] = {
    EMBER_ENTRY(2, 32, 18, Q8x, dot_q4_0_n, dot_q4_0, dequant_q4_0),
    EMBER_ENTRY(3, 32, 20, Q8x, dot_q4_1_n, dot_q4_1, dequant_q4_1),
    EMBER_ENTRY(6, 32, 22, Q8x, dot_q5_0_n, dot_q5_0, dequant_q5_0),
    EMBER_ENTRY(7, 32, 24, Q8x, dot_q5_1_n, dot_q5_1, dequant_q5_1),
    EMBER_ENTRY(8, 32, 34, Q8x, dot_q8_0_n, dot_q8_0_scalar, dequant_q8_0),
    EMBER_ENTRY(10, 256, 84, Q8K, dot_q2_k_n, dot_q2_k_scalar, dequant_q2_k),
    EMBER_ENTRY(11, 256, 110, Q8K, dot_q3_k_n, dot_q3_k_scalar, dequant_q3_k),
    EMBER_ENTRY(12, 256, 144, Q8K, dot_q4_k_n, dot_q45_k_scalar<false>, dequant_q4_k),
    EMBER_ENTRY(13, 256, 176, Q8K, dot_q5_k_n, dot_q45_k_scalar<true>, dequant_q5_k),
    EMBER_ENTRY(14, 256, 210, Q8K, dot_q6_k_n, dot_q6_k_scalar, dequant_q6_k),
    EMBER_ENTRY(20, 32, 18, Q8x, dot_iq4_nl_n, dot_iq4_nl_scalar, dequant_iq4_nl),
    EMBER_ENTRY(23, 256, 136, Q8K, dot_iq4_xs_n, dot_iq4_xs_scalar, dequant_iq4_xs),
    EMBER_IQ_ENTRY(16, 66, iq2_xxs),
    EMBER_IQ_ENTRY(17, 74, iq2_xs),
    EMBER_IQ_ENTRY(18, 98, iq3_xxs),
    EMBER_IQ_ENTRY(19, 50, iq1_s),
    EMBER_IQ_ENTRY(21, 110, iq3_s),
    EMBER_IQ_ENTRY(22, 82, iq2_s),
    EMBER_IQ_ENTRY(29, 56, iq1_m),
};

const Entry* entry(int ggml_type) {
  for (const Entry& e : kEntries)
    if (e.type.ggml_type == ggml_type) return &e;
  return nullptr;
}

}  // namespace

const BlockType* block_type(int ggml_type) {
  const Entry* e = entry(ggml_type);
  return e ? &e->type : nullptr;
}

// ---- activation quantization -----------------------------------------------------------------------------

void quantize_row_q8K(const float* x, BlockQ8K* y, int64_t k) {
  for (int64_t i = 0; i < k / QK_K; ++i, x += QK_K) {
    float amax = 0.f, max = 0.f;  // the first element of largest |x|, with its sign
    for (int j = 0; j < QK_K; ++j) {
      const float a = std::fabs(x[j]);
      if (a > amax) amax = a, max = x[j];
    }
    if (amax == 0.f) {
      std::memset(&y[i], 0, sizeof(BlockQ8K));
      continue;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < QK_K; ++j) y[i].qs[j] = int8_t(std::min(127, int(std::nearbyint(iscale * x[j]))));
    for (int g = 0; g < QK_K / 16; ++g) {
      int s = 0;
      for (int j = 0; j < 16; ++j) s += y[i].qs[16 * g + j];
      y[i].bsums[g] = int16_t(s);
    }
    y[i].d = 1.f / iscale;
  }
}

void quantize_row_q8x(const float* x, BlockQ8x* y, int64_t k) {
  for (int64_t i = 0; i < k / QK8; ++i, x += QK8) {
    float amax = 0.f;
    for (int j = 0; j < QK8; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int j = 0; j < QK8; ++j) {
      y[i].qs[j] = int8_t(std::nearbyint(x[j] * id));
      sum += y[i].qs[j];
    }
    y[i].d = d;
    y[i].s = d * float(sum);
  }
}

namespace {

// ---- the GEMM core -----------------------------------------------------------------------------------------

int64_t act_bytes(const BlockType& bt) {
  return bt.act == ActFormat::Q8K ? int64_t(sizeof(BlockQ8K)) : int64_t(sizeof(BlockQ8x));
}

// x's quantized rows for weight type bt: one row of nb blocks per row of x.
struct ActRows {
  std::vector<uint8_t> data;
  int64_t row_bytes = 0;
  const uint8_t* row(int64_t m) const { return data.data() + m * row_bytes; }
};

// Quantize row m of a float32 row source `get(m, buf)` (a pointer to K floats, maybe written into buf).
template <typename Get>
void quantize_rows(const BlockType& bt, int64_t M, int64_t K, ActRows& out, Get get) {
  out.row_bytes = K / bt.block_elems * act_bytes(bt);
  out.data.resize(size_t(M * out.row_bytes));
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    std::vector<float> buf(static_cast<size_t>(K));
    for (int64_t m = m0; m < m1; ++m) {
      const float* src = get(m, buf.data());
      uint8_t* dst = out.data.data() + m * out.row_bytes;
      if (bt.act == ActFormat::Q8K) {
        quantize_row_q8K(src, reinterpret_cast<BlockQ8K*>(dst), K);
      } else {
        quantize_row_q8x(src, reinterpret_cast<BlockQ8x*>(dst), K);
      }
    }
  });
}

// The dots a GEMM runs for one weight type.
struct Dots {
  const BlockType& bt;
  RowDot dot;
  MultiDot4 dot4;  // nullptr: dot per row of x
  explicit Dots(const Entry& e, bool scalar = false)
      : bt(e.type), dot(scalar ? e.scalar_dot : e.type.dot), dot4(scalar ? nullptr : e.dot4) {}
};

// acc[m * rows + r] += row r of the tile (w + r * w_stride, nb blocks) . x row m (xs[m]), m < M, 4 rows of x
// a call where the type has a 4-row dot.
void add_dots(const Dots& k, const uint8_t* w, int64_t w_stride, int64_t rows, int64_t nb, const uint8_t* const* xs,
              int64_t M, float* acc) {
  int64_t m = 0;
  if (k.dot4 != nullptr) {
    // 4 rows a pass; 2 or 3 left take one more pass with the last row repeated (a 4-row dot costs ~1-1.8x one
    // row's, two rows alone 2x: a batched decode step's experts mostly hold 1-3 rows)
    for (; m + 2 <= M; m += 4) {
      const int64_t n = std::min<int64_t>(4, M - m);
      const void* x4[4] = {xs[m], xs[m + 1], xs[m + std::min<int64_t>(2, n - 1)], xs[m + n - 1]};
      for (int64_t r = 0; r < rows; ++r) {
        float out[4];
        k.dot4(w + r * w_stride, x4, nb, out);
        for (int64_t j = 0; j < n; ++j) acc[(m + j) * rows + r] += out[j];
      }
    }
    m = std::min(m, M);
  }
  for (; m < M; ++m)
    for (int64_t r = 0; r < rows; ++r) acc[m * rows + r] += k.dot(w + r * w_stride, xs[m], nb);
}

// acc[m * rows + r] = row r of the tile . x row m. M = 1 reads each row whole; more rows of x go a K chunk at a
// time, so that the tile's chunk stays in L1 while they pass.
void tile_dots(const Dots& k, const uint8_t* w, int64_t w_stride, int64_t rows, int64_t nb, const uint8_t* const* xs,
               int64_t M, float* acc) {
  std::fill(acc, acc + M * rows, 0.f);
  if (M == 1) return add_dots(k, w, w_stride, rows, nb, xs, M, acc);
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / k.bt.block_bytes), ab = act_bytes(k.bt);
  std::vector<const uint8_t*> xk(static_cast<size_t>(M));
  for (int64_t kb = 0; kb < nb; kb += chunk) {
    for (int64_t m = 0; m < M; ++m) xk[m] = xs[m] + kb * ab;
    add_dots(k, w + kb * k.bt.block_bytes, w_stride, rows, std::min(chunk, nb - kb), xk.data(), M, acc);
  }
}

template <typename T>
inline T from_float(float v) {
  return T(v);
}

// y [M, N] (row stride ldy) = x . w^T over the quantized rows xs, threads over (M block, tile) pairs.
template <typename T>
void gemm(const Dots& k, const uint8_t* w, int64_t w_stride, int64_t N, int64_t nb,
          const uint8_t* const* xs, int64_t M, T* y, int64_t ldy) {
  const int64_t tiles = (N + kTileRows - 1) / kTileRows, mblocks = (M + kMBlock - 1) / kMBlock;
  const int64_t tile_bytes = kTileRows * nb * k.bt.block_bytes * std::min(M, kMBlock);
  at::parallel_for(0, tiles * mblocks, std::max<int64_t>(1, kTaskBytes / tile_bytes), [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(static_cast<size_t>(kMBlock * kTileRows));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = (t / tiles) * kMBlock, n0 = (t % tiles) * kTileRows;
      const int64_t mb = std::min(kMBlock, M - m0), rows = std::min(kTileRows, N - n0);
      tile_dots(k, w + n0 * w_stride, w_stride, rows, nb, xs + m0, mb, acc.data());
      for (int64_t m = 0; m < mb; ++m)
        for (int64_t r = 0; r < rows; ++r) y[(m0 + m) * ldy + n0 + r] = from_float<T>(acc[m * rows + r]);
    }
  });
}

// ---- torch ops -----------------------------------------------------------------------------------------

const Entry& checked_entry(int64_t ggml_type, const char* op) {
  const Entry* e = entry(int(ggml_type));
  TORCH_CHECK(e != nullptr, op, ": ggml type ", ggml_type, " has no block kernel");
  return *e;
}

// A weight [rows, row_bytes] (uint8, bytes contiguous in a row, any row stride): its blocks per row.
int64_t check_weight(const at::Tensor& w, const BlockType& bt, const char* op) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2, op,
              ": w must be a CPU uint8 [rows, row_bytes] tensor of raw blocks");
  TORCH_CHECK(w.size(1) % bt.block_bytes == 0, op, ": a row of ", w.size(1), " bytes is not whole blocks of ",
              bt.block_bytes);
  TORCH_CHECK(w.stride(1) == 1 || w.size(1) <= 1, op, ": a row's bytes must be contiguous");
  return w.size(1) / bt.block_bytes;
}

// Row m of x (float32 or bf16, contiguous rows) as float32.
struct FloatRows {
  const at::Tensor& x;
  int64_t K;
  const float* operator()(int64_t m, float* buf) const {
    if (x.scalar_type() == at::kFloat) return x.data_ptr<float>() + m * x.stride(0);
    const c10::BFloat16* src = x.data_ptr<c10::BFloat16>() + m * x.stride(0);
    for (int64_t k = 0; k < K; ++k) buf[k] = float(src[k]);
    return buf;
  }
};

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be a CPU float32 or bfloat16 [M, K] tensor");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, op, ": x's rows must be contiguous");
}

// float32 -> bf16, round to nearest even (c10's conversion, 16 at a time where the CPU has AVX512-BF16).
void to_bf16(const float* in, c10::BFloat16* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in + i)));
#endif
  for (; i < n; ++i) out[i] = c10::BFloat16(in[i]);
}

// rows rows of raw blocks (row r at w + r * stride, nb blocks of bt) -> bf16 out [rows, nb * block_elems], the
// dequantizers' exact values rounded to bf16; threads over rows.
void dequant_rows_bf16(const BlockType& bt, const uint8_t* w, int64_t stride, int64_t rows, int64_t nb,
                       c10::BFloat16* out) {
  const int64_t elems = nb * bt.block_elems;
  at::parallel_for(0, rows, std::max<int64_t>(1, kTaskBytes / (nb * bt.block_bytes)), [&](int64_t r0, int64_t r1) {
    std::vector<float> row(static_cast<size_t>(elems));
    for (int64_t r = r0; r < r1; ++r) {
      bt.dequant(w + r * stride, row.data(), nb);
      to_bf16(row.data(), out + r * elems, elems);
    }
  });
}

// Many rows of bf16 x (a prefill chunk) on a CPU with AMX: the weight dequantized to bf16 once (a transient
// copy) and one oneDNN GEMM, 5-20x the integer dots from ~64 rows (docs/tuning.md, "Prefill on AMX: bf16 GEMMs
// from many rows"); bf16 out, as a bf16 model's linear. float32 x or logits keep the dots.
at::Tensor dense_gemm(const at::Tensor& x, const at::Tensor& w, const BlockType& bt, int64_t nb) {
  at::Tensor wd = at::empty({w.size(0), nb * bt.block_elems}, x.options());
  dequant_rows_bf16(bt, w.data_ptr<uint8_t>(), w.stride(0), w.size(0), nb, wd.data_ptr<c10::BFloat16>());
  return at::mm(x, wd.t());
}

at::Tensor gemm_op(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type, bool float_out, bool scalar,
                   int64_t dense_rows = 0) {
  const char* op = scalar ? "block_gemm_scalar" : "block_gemm";
  const Entry& e = checked_entry(ggml_type, op);
  const BlockType& bt = e.type;
  check_x(x, op);
  const int64_t nb = check_weight(w, bt, op), K = nb * bt.block_elems, M = x.size(0), N = w.size(0);
  TORCH_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " columns, the weight's rows ", K);
  at::Tensor y = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  if (M == 0 || N == 0) return y;
  if (dense_rows > 0 && M >= dense_rows && x.scalar_type() == at::kBFloat16 && !float_out)
    return dense_gemm(x, w, bt, nb);
  ActRows act;
  quantize_rows(bt, M, K, act, FloatRows{x, K});
  std::vector<const uint8_t*> xs(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) xs[m] = act.row(m);
  const Dots k(e, scalar);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (y.scalar_type() == at::kFloat) {
    gemm<float>(k, wp, w.stride(0), N, nb, xs.data(), M, y.data_ptr<float>(), N);
  } else {
    gemm<c10::BFloat16>(k, wp, w.stride(0), N, nb, xs.data(), M, y.data_ptr<c10::BFloat16>(), N);
  }
  return y;
}

// x [M, K] float32 | bf16 @ W^T, W the raw blocks [N, row_bytes] of ggml_type -> [M, N] in x's dtype, or
// float32 with float_out (the LM head's logits); from dense_rows rows of x (0: never), bf16 GEMMs (dense_gemm).
at::Tensor block_gemm(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type, bool float_out, int64_t dense_rows) {
  return gemm_op(x, w, ggml_type, float_out, false, dense_rows);
}

// The same through the scalar reference dots (the tests' check of the SIMD ones).
at::Tensor block_gemm_scalar(const at::Tensor& x, const at::Tensor& w, int64_t ggml_type, bool float_out) {
  return gemm_op(x, w, ggml_type, float_out, true);
}

// Raw blocks [R, row_bytes] -> float32 [R, K], gguf-py's values bit for bit.
at::Tensor block_dequant_rows(const at::Tensor& w, int64_t ggml_type) {
  const BlockType& bt = checked_entry(ggml_type, "block_dequant_rows").type;
  const int64_t nb = check_weight(w, bt, "block_dequant_rows"), R = w.size(0), K = nb * bt.block_elems;
  at::Tensor out = at::empty({R, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t stride = w.stride(0);
  at::parallel_for(0, R, std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(w.size(1), 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) bt.dequant(wp + r * stride, op + r * K, nb);
  });
  return out;
}

// x [M, K] as the kernel rounds it for ggml_type's activation format, float32 (the tests' reference input).
at::Tensor block_quantize_act(const at::Tensor& x, int64_t ggml_type) {
  const BlockType& bt = checked_entry(ggml_type, "block_quantize_act").type;
  check_x(x, "block_quantize_act");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % bt.block_elems == 0, "block_quantize_act: K must be a multiple of ", bt.block_elems);
  ActRows act;
  quantize_rows(bt, M, K, act, FloatRows{x, K});
  at::Tensor out = at::empty({M, K}, x.options().dtype(at::kFloat));
  for (int64_t m = 0; m < M; ++m) {
    float* o = out.data_ptr<float>() + m * K;
    if (bt.act == ActFormat::Q8K) {
      const BlockQ8K* b = reinterpret_cast<const BlockQ8K*>(act.row(m));
      for (int64_t k = 0; k < K; ++k) o[k] = b[k / QK_K].d * float(b[k / QK_K].qs[k % QK_K]);
    } else {
      const BlockQ8x* b = reinterpret_cast<const BlockQ8x*>(act.row(m));
      for (int64_t k = 0; k < K; ++k) o[k] = b[k / QK8].d * float(b[k / QK8].qs[k % QK8]);
    }
  }
  return out;
}

bool block_set_iq_table(const std::string& name, const at::Tensor& data) {
  TORCH_CHECK(data.device().is_cpu() && data.is_contiguous(), "block_set_iq_table: a contiguous CPU tensor");
  return set_iq_table(name.c_str(), static_cast<const uint8_t*>(data.data_ptr()), data.nbytes());
}

// The ggml types this build has a kernel for.
std::vector<int64_t> block_types() {
  std::vector<int64_t> out;
  for (const Entry& e : kEntries) out.push_back(e.type.ggml_type);
  return out;
}

}  // namespace
}  // namespace ember_blocks

// ---- routed MoE ----------------------------------------------------------------------------------------------
namespace ember_blocks {
namespace {

// One expert's weight: [E, rows, row_bytes] raw blocks of one type (a view of the file's map; any strides
// but contiguous bytes in a row).
struct ExpertWeight {
  const Entry* e;
  const uint8_t* data;
  int64_t expert_stride, row_stride, rows, nb;
  const uint8_t* row(int64_t expert, int64_t r) const { return data + expert * expert_stride + r * row_stride; }
};

ExpertWeight expert_weight(const at::Tensor& w, int64_t type, int64_t E, const char* what) {
  const Entry& e = checked_entry(type, "block_moe");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 3 && w.size(0) == E,
              "block_moe: ", what, " must be a CPU uint8 [", E, ", rows, row_bytes] tensor of raw blocks");
  TORCH_CHECK(w.size(2) % e.type.block_bytes == 0 && (w.stride(2) == 1 || w.size(2) <= 1), "block_moe: ", what,
              "'s rows must be contiguous whole blocks of ", e.type.block_bytes, " bytes");
  return {&e, w.data_ptr<uint8_t>(), w.stride(0), w.stride(1), w.size(1), w.size(2) / e.type.block_bytes};
}

// The token slots (t, j) grouped by expert: slot order[p] = t * k + j for p in [start[e], start[e + 1]).
struct Routing {
  std::vector<int64_t> order, start;
  std::vector<int64_t> active;  // experts with at least one slot, ascending
};

Routing route(const at::Tensor& ids, int64_t E) {
  const at::Tensor flat = ids.to(at::kLong).contiguous().view(-1);
  const int64_t* id = flat.data_ptr<int64_t>();
  const int64_t S = flat.numel();
  Routing r;
  r.start.assign(size_t(E + 1), 0);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(id[s] >= 0 && id[s] < E, "block_moe: expert id ", id[s], " is outside 0..", E - 1);
    ++r.start[id[s] + 1];
  }
  for (int64_t e = 0; e < E; ++e) {
    if (r.start[e + 1]) r.active.push_back(e);
    r.start[e + 1] += r.start[e];
  }
  r.order.resize(size_t(S));
  std::vector<int64_t> at(r.start.begin(), r.start.end() - 1);
  for (int64_t s = 0; s < S; ++s) r.order[at[id[s]]++] = s;  // stable: slots in token order within an expert
  return r;
}

// The routing of `experts` (ascending, each active in rt) alone: their slots, renumbered from 0.
Routing only(const Routing& rt, const std::vector<int64_t>& experts) {
  Routing r;
  r.start.assign(rt.start.size(), 0);
  r.active = experts;
  for (const int64_t e : experts) {
    r.start[e] = int64_t(r.order.size());
    r.order.insert(r.order.end(), rt.order.begin() + rt.start[e], rt.order.begin() + rt.start[e + 1]);
    r.start[e + 1] = int64_t(r.order.size());
  }
  return r;
}

// h[p] = silu(gate . x) * (up . x) for every slot p of the active experts: tasks are (expert, tile of I).
void gate_up(const Routing& rt, const ExpertWeight& g, const ExpertWeight& u, const ActRows& xg, const ActRows& xu,
             int64_t k, float* h) {
  const int64_t I = g.rows, tiles = (I + kTileRows - 1) / kTileRows;
  const int64_t items = int64_t(rt.active.size()) * tiles;
  const int64_t item_bytes = kTileRows * (g.nb * g.e->type.block_bytes + u.nb * u.e->type.block_bytes);
  at::parallel_for(0, items, std::max<int64_t>(1, kTaskBytes / item_bytes), [&](int64_t i0, int64_t i1) {
    std::vector<float> ag(static_cast<size_t>(kMBlock * kTileRows)), au(ag.size());
    std::vector<const uint8_t*> pg(static_cast<size_t>(kMBlock)), pu(static_cast<size_t>(kMBlock));
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t e = rt.active[it / tiles], n0 = (it % tiles) * kTileRows, rows = std::min(kTileRows, I - n0);
      for (int64_t p0 = rt.start[e]; p0 < rt.start[e + 1]; p0 += kMBlock) {
        const int64_t mb = std::min(kMBlock, rt.start[e + 1] - p0);
        for (int64_t m = 0; m < mb; ++m) {
          const int64_t token = rt.order[p0 + m] / k;
          pg[m] = xg.row(token);
          pu[m] = xu.row(token);
        }
        tile_dots(Dots(*g.e), g.row(e, n0), g.row_stride, rows, g.nb, pg.data(), mb, ag.data());
        tile_dots(Dots(*u.e), u.row(e, n0), u.row_stride, rows, u.nb, pu.data(), mb, au.data());
        for (int64_t m = 0; m < mb; ++m) {
          for (int64_t r = 0; r < rows; ++r) {
            const float a = ag[m * rows + r];
            h[(p0 + m) * I + n0 + r] = a / (1.f + std::exp(-a)) * au[m * rows + r];
          }
        }
      }
    }
  });
}

// out[t] += w(t, j) * (down . h[p]) over the active experts in ascending order (so the sums' order does not
// depend on the threads): tasks are tiles of H, each over every active expert. wts: the slots' weights.
void down_sum(const Routing& rt, const ExpertWeight& d, const ActRows& hq, const float* wts, int64_t k, float* out) {
  const int64_t H = d.rows, tiles = (H + kTileRows - 1) / kTileRows;
  const int64_t tile_bytes = kTileRows * d.nb * d.e->type.block_bytes * int64_t(rt.active.size());
  at::parallel_for(0, tiles, std::max<int64_t>(1, kTaskBytes / tile_bytes), [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(static_cast<size_t>(kMBlock * kTileRows));
    std::vector<const uint8_t*> ph(static_cast<size_t>(kMBlock));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileRows, rows = std::min(kTileRows, H - n0);
      for (const int64_t e : rt.active) {
        for (int64_t p0 = rt.start[e]; p0 < rt.start[e + 1]; p0 += kMBlock) {
          const int64_t mb = std::min(kMBlock, rt.start[e + 1] - p0);
          for (int64_t m = 0; m < mb; ++m) ph[m] = hq.row(p0 + m);
          tile_dots(Dots(*d.e), d.row(e, n0), d.row_stride, rows, d.nb, ph.data(), mb, acc.data());
          for (int64_t m = 0; m < mb; ++m) {
            const int64_t slot = rt.order[p0 + m];
            float* o = out + (slot / k) * H + n0;
            for (int64_t r = 0; r < rows; ++r) o[r] += wts[slot] * acc[m * rows + r];
          }
        }
      }
    }
  });
}

// ---- experts with many slots: bf16 GEMMs over their dequantized weights --------------------------------------
//
// Why: in a prefill chunk each expert gets ~T k / E slots (156 of a 2,000-token prompt's on 128 experts, top-10).
// The integer dots above unpack a weight block once per 4 rows of x (~60 GMAC/s on 2 cores); on a CPU with AMX,
// oneDNN's bf16 GEMM runs ~600 GMAC/s at those shapes (2 Xeon cores), so dequantizing the expert's weights once (exact: the
// dequantizers give gguf-py's values; bf16 keeps them exactly for codes x scales of <= 8 significant bits, else
// rounds them as a bf16 model's weights are) and running at::mm costs a few times less from ~32 slots up. The
// caller picks the threshold (dense_rows, 0: never) from the CPU: without AMX the integer dots stay ahead.
// It runs for bf16 x only (a bf16 model: x is not rounded further; the integer path rounds it to int8 per block).

// m rounded up to the row counts the dense GEMMs run (multiples of 32 to 512, then of 128): a few dozen shapes
// for oneDNN to build, ~10% more rows on average.
int64_t gemm_rows(int64_t m) {
  const int64_t b = m <= 512 ? 32 : 128;
  return (m + b - 1) / b * b;
}

// Expert e's rows of w, dequantized, as bf16 into out [rows, elems].
void dequant_bf16(const ExpertWeight& w, int64_t e, c10::BFloat16* out) {
  dequant_rows_bf16(w.e->type, w.row(e, 0), w.row_stride, w.rows, w.nb, out);
}

// out[t] += w(t, j) * down_e(silu(gate_e x_t) * up_e x_t) for each slot of each expert in `experts` (ascending):
// the experts' x rows gathered once, then per expert [gate; up] dequantized to bf16 and one at::mm into its rows
// of GU, SiLU and the product over all of GU at once (in bf16, as a bf16 model computes them), per expert down
// dequantized and one at::mm into its rows of Y, and Y's rows added into out in the experts' order (threads over
// columns), so that the sums' order does not depend on the threads.
void dense_experts(const Routing& rt, const std::vector<int64_t>& experts, const at::Tensor& x, const ExpertWeight& g,
                   const ExpertWeight& u, const ExpertWeight& d, const float* wts, int64_t k, float* out) {
  const int64_t H = x.size(1), I = g.rows;
  const auto bf16 = x.options().dtype(at::kBFloat16);
  std::vector<int64_t> offset, slots;  // expert i's rows of the gathered buffers: [offset[i], offset[i + 1])
  for (const int64_t e : experts) {
    offset.push_back(int64_t(slots.size()));
    slots.insert(slots.end(), rt.order.begin() + rt.start[e], rt.order.begin() + rt.start[e + 1]);
  }
  offset.push_back(int64_t(slots.size()));
  const int64_t S = int64_t(slots.size());
  at::Tensor tokens = at::empty({S}, x.options().dtype(at::kLong));
  for (int64_t p = 0; p < S; ++p) tokens.data_ptr<int64_t>()[p] = slots[p] / k;
  // Each GEMM runs over its expert's rows rounded up to a bucket (gemm_rows): oneDNN builds a kernel per shape
  // (~0.65 ms the first time), and a prefill's row counts per expert are all different. The rows past an
  // expert's own belong to the next expert, computed after it, or to the zero tail.
  const int64_t covered = offset[experts.size() - 1] + gemm_rows(offset[experts.size()] - offset[experts.size() - 1]);
  at::Tensor xs = at::empty({covered, H}, bf16);
  at::Tensor gathered = xs.narrow(0, 0, S);
  at::index_select_out(gathered, x, 0, tokens);
  xs.narrow(0, S, covered - S).zero_();
  at::Tensor w_gu = at::empty({2 * I, H}, bf16), w_d = at::empty({H, I}, bf16);
  at::Tensor gu = at::empty({covered, 2 * I}, bf16), y = at::empty({covered, H}, bf16);
  for (size_t i = 0; i < experts.size(); ++i) {
    dequant_bf16(g, experts[i], w_gu.data_ptr<c10::BFloat16>());
    dequant_bf16(u, experts[i], w_gu.data_ptr<c10::BFloat16>() + I * H);
    const int64_t m = gemm_rows(offset[i + 1] - offset[i]);
    at::Tensor rows = gu.narrow(0, offset[i], m);
    at::mm_out(rows, xs.narrow(0, offset[i], m), w_gu.t());
  }
  const at::Tensor h = at::silu(gu.narrow(1, 0, I)).mul_(gu.narrow(1, I, I));
  for (size_t i = 0; i < experts.size(); ++i) {
    dequant_bf16(d, experts[i], w_d.data_ptr<c10::BFloat16>());
    const int64_t m = gemm_rows(offset[i + 1] - offset[i]);
    at::Tensor rows = y.narrow(0, offset[i], m);
    at::mm_out(rows, h.narrow(0, offset[i], m), w_d.t());
  }
  const c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, H, 64, [&](int64_t c0, int64_t c1) {
    for (int64_t p = 0; p < S; ++p) {
      float* o = out + (slots[p] / k) * H;
      const float w = wts[slots[p]];
      for (int64_t c = c0; c < c1; ++c) o[c] += w * float(yp[p * H + c]);
    }
  });
}

// Slot buffers (h [S, I] float32 and its quantized rows) are bounded by taking this many tokens at a time.
constexpr int64_t kMoeChunkBytes = int64_t(64) << 20;

// The tokens of x (float32 / bf16 [T, H]) with their routing (ids [T, k], wts float32 [T, k]): gate / up and
// SiLU, h quantized once per slot, down and the weighted sum, added into out float32 [T, H].
void moe_tokens(const at::Tensor& x, const at::Tensor& ids, const float* wts, const ExpertWeight& g,
                const ExpertWeight& u, const ExpertWeight& d, int64_t E, int64_t dense_rows, float* out) {
  const int64_t T = x.size(0), k = ids.size(1), H = x.size(1), I = g.rows;
  Routing rt = route(ids, E);
  if (dense_rows > 0 && x.scalar_type() == at::kBFloat16) {
    std::vector<int64_t> dense, rest;
    for (const int64_t e : rt.active) (rt.start[e + 1] - rt.start[e] >= dense_rows ? dense : rest).push_back(e);
    if (!dense.empty()) dense_experts(rt, dense, x, g, u, d, wts, k, out);
    if (rest.empty()) return;
    rt = only(rt, rest);
  }
  ActRows xg, xu;
  quantize_rows(g.e->type, T, H, xg, FloatRows{x, H});
  const bool same_format = g.e->type.act == u.e->type.act;
  if (!same_format) quantize_rows(u.e->type, T, H, xu, FloatRows{x, H});
  const int64_t S = int64_t(rt.order.size());
  std::vector<float> h(static_cast<size_t>(S * I));
  gate_up(rt, g, u, xg, same_format ? xg : xu, k, h.data());
  ActRows hq;
  quantize_rows(d.e->type, S, I, hq, [&](int64_t p, float*) { return h.data() + p * I; });
  down_sum(rt, d, hq, wts, k, out);
}

// sum_j topk_weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = topk_ids[t, j]: one MoE layer's routed
// SwiGLU experts over their raw blocks, reading only the experts chosen. gate / up [E, I, row_bytes of H],
// down [E, H, row_bytes of I] (views of the file's map; any strides, bytes of a row contiguous). Slots are
// grouped by expert across the batch, x is quantized once per token. -> [T, H] in x's dtype.
at::Tensor block_moe(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                     const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down, int64_t type_gate,
                     int64_t type_up, int64_t type_down, int64_t dense_rows) {
  check_x(x, "block_moe");
  const int64_t T = x.size(0), H = x.size(1), E = gate.dim() == 3 ? gate.size(0) : 0;
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_weights.sizes() == topk_ids.sizes(),
              "block_moe: topk_ids and topk_weights must both be [T, k] for x's ", T, " rows");
  const ExpertWeight g = expert_weight(gate, type_gate, E, "gate"), u = expert_weight(up, type_up, E, "up");
  const ExpertWeight d = expert_weight(down, type_down, E, "down");
  const int64_t I = g.rows, k = topk_ids.size(1);
  TORCH_CHECK(u.rows == I && g.nb * g.e->type.block_elems == H && u.nb * u.e->type.block_elems == H,
              "block_moe: gate and up must be [E, I, row of ", H, "]");
  TORCH_CHECK(d.rows == H && d.nb * d.e->type.block_elems == I, "block_moe: down must be [E, ", H, ", row of ", I, "]");
  const at::Tensor wts = topk_weights.to(at::kFloat).contiguous();
  at::Tensor acc = at::zeros({T, H}, x.options().dtype(at::kFloat));
  if (T == 0 || k == 0) return acc.to(x.scalar_type());
  const int64_t per_token = k * I * int64_t(sizeof(float) + 2) + H;  // h, its int8 codes, x's codes
  const int64_t chunk = std::max<int64_t>(1, kMoeChunkBytes / per_token);
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t n = std::min(chunk, T - t0);
    moe_tokens(x.narrow(0, t0, n), topk_ids.narrow(0, t0, n), wts.data_ptr<float>() + t0 * k, g, u, d, E,
               dense_rows, acc.data_ptr<float>() + t0 * H);
  }
  return x.scalar_type() == at::kFloat ? acc : acc.to(x.scalar_type());
}

}  // namespace
}  // namespace ember_blocks

TORCH_LIBRARY_FRAGMENT(ember_cpu, m) {
  m.def("block_gemm(Tensor x, Tensor w, int ggml_type, bool float_out, int dense_rows=0) -> Tensor");
  m.def("block_gemm_scalar(Tensor x, Tensor w, int ggml_type, bool float_out) -> Tensor");
  m.def("block_dequant_rows(Tensor w, int ggml_type) -> Tensor");
  m.def("block_quantize_act(Tensor x, int ggml_type) -> Tensor");
  m.def("block_set_iq_table(str name, Tensor data) -> bool");
  m.def("block_types() -> int[]");
  m.def(
      "block_moe(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate, Tensor up, Tensor down, int type_gate, "
      "int type_up, int type_down, int dense_rows=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(ember_cpu, CPU, m) {
  m.impl("block_gemm", &ember_blocks::block_gemm);
  m.impl("block_gemm_scalar", &ember_blocks::block_gemm_scalar);
  m.impl("block_dequant_rows", &ember_blocks::block_dequant_rows);
  m.impl("block_quantize_act", &ember_blocks::block_quantize_act);
  m.impl("block_moe", &ember_blocks::block_moe);
}

TORCH_LIBRARY_IMPL(ember_cpu, CompositeExplicitAutograd, m) {
  m.impl("block_set_iq_table", &ember_blocks::block_set_iq_table);
  m.impl("block_types", &ember_blocks::block_types);
}
