// The grid-coded IQ types of GGUF (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) for the block
// GEMV of cpu_block_gemv.h: each type's row dot against BlockQ8K activations and its exact row
// dequantizer (the float32 values gguf-py's gguf.quants.dequantize gives, bit for bit: the same
// operations in the same order, so a test can compare with ==).
//
// These types code groups of 4 or 8 weights as an index into a fixed grid (a table of magnitudes, or
// of -1/0/+1 for IQ1), with per-group sign bits (IQ2_XXS / IQ2_XS / IQ3_XXS take 7 bits and a parity
// bit from the ksigns table) and one small odd scale per 16 or 32 weights. The grids are data: they
// arrive once from gguf-py's tables through set_iq_table (cpu_block_gemv.py reads them from
// gguf.quants), one byte per grid element, so nothing here copies them.
//
// A dot keeps everything inside a 32-weight sub-block in integers (grid value * sign * q8) and
// applies the sub-block's scale as an integer too; one float multiply per 256-weight block. The
// scalar loops are the reference every CPU can run; the AVX2 paths are the same sums, vectorized.
#include <cstdint>
#include <cstring>

#include "cpu_block_gemv.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ember_blocks {
namespace {

// ---- the tables (gguf-py's grids, one byte per element) -----------------------------------------

alignas(64) uint8_t g_iq2xxs_grid[256 * 8];   // values 8, 25, 43
alignas(64) uint8_t g_iq2xs_grid[512 * 8];    // values 8, 25, 43
alignas(64) uint8_t g_iq2s_grid[1024 * 8];    // values 8, 25, 43
alignas(64) uint8_t g_iq3xxs_grid[256 * 4];   // values 4 .. 62
alignas(64) uint8_t g_iq3s_grid[512 * 4];     // values 1 .. 15
alignas(64) int8_t g_iq1s_grid[2048 * 8];     // values -1, 0, 1
alignas(64) uint8_t g_ksigns[128];            // 7 sign bits + their parity as the 8th

// Derived at set_iq_table time for the SIMD dots: each ksigns entry as 8 bytes of +1 / -1 (a
// _mm256_sign_epi8 operand), and the IQ1 grid times 8 (so 8 * (grid +- 1/8) is the integer 8*g +- 1).
alignas(64) uint64_t g_ksigns_pm1[128];
alignas(64) int8_t g_iq1s_grid_x8[2048 * 8];

constexpr float kIq1Delta = 0.125f;  // IQ1_S / IQ1_M: every weight is shifted by +-1/8 of its scale

struct TableSlot {
  const char* name;
  void* data;
  int64_t bytes;
};

const TableSlot kTables[] = {
    {"iq2xxs_grid", g_iq2xxs_grid, sizeof(g_iq2xxs_grid)}, {"iq2xs_grid", g_iq2xs_grid, sizeof(g_iq2xs_grid)},
    {"iq2s_grid", g_iq2s_grid, sizeof(g_iq2s_grid)},       {"iq3xxs_grid", g_iq3xxs_grid, sizeof(g_iq3xxs_grid)},
    {"iq3s_grid", g_iq3s_grid, sizeof(g_iq3s_grid)},       {"iq1s_grid", g_iq1s_grid, sizeof(g_iq1s_grid)},
    {"ksigns", g_ksigns, sizeof(g_ksigns)},
};

// ---- helpers ----------------------------------------------------------------------------------

inline uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t rd32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// IEEE half -> float, exact for every half (subnormals, infinities, NaNs), as numpy's astype does.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: normalize
    int e = 113;
    while (!(mant & 0x400)) {
      mant <<= 1;
      --e;
    }
    bits = sign | (uint32_t(e) << 23) | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float sign_of_bit(uint32_t bits, int j) { return (bits >> j) & 1 ? -1.0f : 1.0f; }

// IQ1_M keeps its float16 scale in the top nibbles of its four 16-bit scale words.
inline float iq1m_scale(const uint8_t* scales) {
  const uint16_t s0 = rd16(scales), s1 = rd16(scales + 2), s2 = rd16(scales + 4), s3 = rd16(scales + 6);
  return half_to_float(uint16_t((s0 >> 12) | ((s1 >> 8) & 0x00f0) | ((s2 >> 4) & 0x0f00) | (s3 & 0xf000)));
}

// Block byte sizes (GGML_QUANT_SIZES).
constexpr int kIq2xxsBytes = 66, kIq2xsBytes = 74, kIq2sBytes = 82, kIq3xxsBytes = 98, kIq3sBytes = 110,
              kIq1sBytes = 50, kIq1mBytes = 56;

void derive_tables(const char* name) {
  if (std::strcmp(name, "ksigns") == 0) {
    for (int i = 0; i < 128; ++i) {
      uint64_t v = 0;
      for (int j = 0; j < 8; ++j) v |= uint64_t((g_ksigns[i] >> j) & 1 ? 0xff : 0x01) << (8 * j);
      g_ksigns_pm1[i] = v;
    }
  } else if (std::strcmp(name, "iq1s_grid") == 0) {
    for (int i = 0; i < 2048 * 8; ++i) g_iq1s_grid_x8[i] = int8_t(8 * g_iq1s_grid[i]);
  }
}

}  // namespace

bool set_iq_table(const char* name, const uint8_t* data, int64_t bytes) {
  for (const TableSlot& slot : kTables) {
    if (std::strcmp(slot.name, name) == 0) {
      if (bytes != slot.bytes) return false;
      std::memcpy(slot.data, data, size_t(bytes));
      derive_tables(name);
      return true;
    }
  }
  return false;
}

// ---- exact dequantizers (gguf-py's operation order) ---------------------------------------------

namespace {
// 8 weights of a grid row g, times db, negated where their bit of `signs` is set.
inline void put_signed8(float* out, float db, const uint8_t* g, uint32_t signs) {
#if defined(__AVX2__)
  // the same products; a sign applied as its bit (x -1 is exact): ~4x the scalar loop's rate (block_moe's dense
  // experts dequantize a whole expert per prefill chunk)
  const __m256 v = _mm256_mul_ps(_mm256_set1_ps(db), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                                           reinterpret_cast<const __m128i*>(g)))));
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(int(signs)), bit), bit);
  _mm256_storeu_ps(out, _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(set, 31))));
#else
  for (int j = 0; j < 8; ++j) out[j] = db * float(g[j]) * sign_of_bit(signs, j);
#endif
}

// The same for the 4-weight grids (IQ3): rows g0 and g1 as one 8-weight run.
inline void put_signed4x2(float* out, float db, const uint8_t* g0, const uint8_t* g1, uint32_t signs) {
  uint8_t g[8];
  std::memcpy(g, g0, 4);
  std::memcpy(g + 4, g1, 4);
  put_signed8(out, db, g, signs);
}
}  // namespace

void dequant_iq2_xxs(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, out += QK_K) {
    const uint8_t* blk = row + b * kIq2xxsBytes;
    const float d = half_to_float(rd16(blk));
    for (int ib = 0; ib < 8; ++ib) {
      const uint32_t idx = rd32(blk + 2 + 8 * ib), aux = rd32(blk + 6 + 8 * ib);
      const float db = d * (0.5f + float(aux >> 28)) * 0.25f;
      for (int l = 0; l < 4; ++l) {
        const uint8_t* g = g_iq2xxs_grid + 8 * ((idx >> (8 * l)) & 255);
        const uint32_t signs = g_ksigns[(aux >> (7 * l)) & 127];
        put_signed8(out + 32 * ib + 8 * l, db, g, signs);
      }
    }
  }
}

void dequant_iq2_xs(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, out += QK_K) {
    const uint8_t* blk = row + b * kIq2xsBytes;
    const float d = half_to_float(rd16(blk));
    const uint8_t* scales = blk + 66;
    for (int i = 0; i < 32; ++i) {  // 32 groups of 8, two per scale
      const float db = d * (0.5f + float((scales[i / 4] >> (4 * ((i / 2) & 1))) & 15)) * 0.25f;
      const uint16_t q = rd16(blk + 2 + 2 * i);
      const uint8_t* g = g_iq2xs_grid + 8 * (q & 511);
      const uint32_t signs = g_ksigns[q >> 9];
      put_signed8(out + 8 * i, db, g, signs);
    }
  }
}

void dequant_iq2_s(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, out += QK_K) {
    const uint8_t* blk = row + b * kIq2sBytes;
    const float d = half_to_float(rd16(blk));
    const uint8_t *qs = blk + 2, *signs = blk + 34, *qh = blk + 66, *scales = blk + 74;
    for (int i = 0; i < 32; ++i) {
      const float db = d * (0.5f + float((scales[i / 4] >> (4 * ((i / 2) & 1))) & 15)) * 0.25f;
      const uint8_t* g = g_iq2s_grid + 8 * (qs[i] | (((qh[i / 4] >> (2 * (i % 4))) & 3) << 8));
      put_signed8(out + 8 * i, db, g, signs[i]);
    }
  }
}

void dequant_iq3_xxs(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, out += QK_K) {
    const uint8_t* blk = row + b * kIq3xxsBytes;
    const float d = half_to_float(rd16(blk));
    const uint8_t* qs = blk + 2;
    for (int ib = 0; ib < 8; ++ib) {
      const uint32_t aux = rd32(blk + 66 + 4 * ib);
      const float db = d * (0.5f + float(aux >> 28)) * 0.5f;
      for (int l = 0; l < 4; ++l) {
        const uint32_t signs = g_ksigns[(aux >> (7 * l)) & 127];
        const uint8_t* g0 = g_iq3xxs_grid + 4 * qs[8 * ib + 2 * l];
        const uint8_t* g1 = g_iq3xxs_grid + 4 * qs[8 * ib + 2 * l + 1];
        put_signed4x2(out + 32 * ib + 8 * l, db, g0, g1, signs);
      }
    }
  }
}

void dequant_iq3_s(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, out += QK_K) {
    const uint8_t* blk = row + b * kIq3sBytes;
    const float d = half_to_float(rd16(blk));
    const uint8_t *qs = blk + 2, *qh = blk + 66, *signs = blk + 74, *scales = blk + 106;
    for (int ib = 0; ib < 8; ++ib) {
      const float db = d * float(1 + 2 * ((scales[ib / 2] >> (4 * (ib & 1))) & 15));
      for (int k = 0; k < 8; k += 2) {  // 8 grid entries of 4 in the sub-block, a byte of signs per two
        const int i = 8 * ib + k;
        const uint8_t* g0 = g_iq3s_grid + 4 * (qs[i] | (((qh[i / 8] >> (i % 8)) & 1) << 8));
        const uint8_t* g1 = g_iq3s_grid + 4 * (qs[i + 1] | (((qh[i / 8] >> (i % 8 + 1)) & 1) << 8));
        put_signed4x2(out + 4 * i, db, g0, g1, signs[i / 2]);
      }
    }
  }
}

void dequant_iq1_s(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, out += QK_K) {
    const uint8_t* blk = row + b * kIq1sBytes;
    const float d = half_to_float(rd16(blk));
    const uint8_t *qs = blk + 2, *qh = blk + 34;
    for (int ib = 0; ib < 8; ++ib) {
      const uint16_t h = rd16(qh + 2 * ib);
      const float dl = d * float(2 * ((h >> 12) & 7) + 1);
      const float delta = (h & 0x8000) ? -kIq1Delta : kIq1Delta;
      for (int l = 0; l < 4; ++l) {
        const int8_t* g = g_iq1s_grid + 8 * (qs[4 * ib + l] | (((h >> (3 * l)) & 7) << 8));
        for (int j = 0; j < 8; ++j) out[32 * ib + 8 * l + j] = dl * (float(g[j]) + delta);
      }
    }
  }
}

void dequant_iq1_m(const uint8_t* row, float* out, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, out += QK_K) {
    const uint8_t* blk = row + b * kIq1mBytes;
    const uint8_t *qs = blk, *qh = blk + 32, *scales = blk + 48;
    const float d = iq1m_scale(scales);
    for (int i = 0; i < 32; ++i) {  // 32 groups of 8; scale per 2 groups, qh nibble per group
      const int s = i / 2;
      const float dl = d * float(2 * ((rd16(scales + 2 * (s / 4)) >> (3 * (s % 4))) & 7) + 1);
      const uint32_t nib = (qh[i / 2] >> (4 * (i & 1))) & 15;
      const float delta = (nib & 8) ? -kIq1Delta : kIq1Delta;
      const int8_t* g = g_iq1s_grid + 8 * (qs[i] | ((nib & 7) << 8));
      for (int j = 0; j < 8; ++j) out[8 * i + j] = dl * (float(g[j]) + delta);
    }
  }
}

// ---- scalar dots (integer sums inside a block) --------------------------------------------------
// The reference dots, and the dots of a CPU without AVX2. External (RowDot's signature, not in the
// shared header): cpu_block_gemv.cpp's block_gemm_scalar declares and runs them, so a test checks the
// AVX2 dots against them on any machine.

namespace {

// sum_j g[j] * (+-1) * q8[j] over 8 values, the signs a bit mask.
template <typename G>
inline int32_t signed_dot8(const G* g, uint32_t signs, const int8_t* q8) {
  int32_t s = 0;
  for (int j = 0; j < 8; ++j) s += (signs >> j & 1) ? -int32_t(g[j]) * q8[j] : int32_t(g[j]) * q8[j];
  return s;
}

inline int32_t plain_dot8(const int8_t* g, const int8_t* q8) {
  int32_t s = 0;
  for (int j = 0; j < 8; ++j) s += int32_t(g[j]) * q8[j];
  return s;
}

inline int32_t sum8(const int8_t* q8) {
  int32_t s = 0;
  for (int j = 0; j < 8; ++j) s += q8[j];
  return s;
}

// The scalar dots' shared loop: per block, scale(blk) * x.d * block(blk, x) (block: the block's sum, in
// integers inside it, as a float), summed over the row's blocks.
template <int kBytes, typename Scale, typename Block>
inline float scalar_dot(const uint8_t* row, const void* x, int64_t nb, Scale scale, Block block) {
  const BlockQ8K* y = static_cast<const BlockQ8K*>(x);
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kBytes;
    sum += scale(blk) * y[b].d * block(blk, y[b]);
  }
  return sum;
}

inline float f16_at0(const uint8_t* blk) { return half_to_float(rd16(blk)); }

}  // namespace

float dot_iq2_xxs_scalar(const uint8_t* row, const void* x, int64_t nb) {
  return 0.125f * scalar_dot<kIq2xxsBytes>(row, x, nb, f16_at0, [](const uint8_t* blk, const BlockQ8K& y) {
    const int8_t* q8 = y.qs;
    int32_t bsum = 0;
    for (int ib = 0; ib < 8; ++ib, q8 += 32) {
      const uint32_t idx = rd32(blk + 2 + 8 * ib), aux = rd32(blk + 6 + 8 * ib);
      int32_t sumi = 0;
      for (int l = 0; l < 4; ++l)
        sumi += signed_dot8(g_iq2xxs_grid + 8 * ((idx >> (8 * l)) & 255), g_ksigns[(aux >> (7 * l)) & 127], q8 + 8 * l);
      bsum += int32_t(2 * (aux >> 28) + 1) * sumi;
    }
    return float(bsum);
  });
}

float dot_iq2_xs_scalar(const uint8_t* row, const void* x, int64_t nb) {
  return 0.125f * scalar_dot<kIq2xsBytes>(row, x, nb, f16_at0, [](const uint8_t* blk, const BlockQ8K& y) {
    int32_t bsum = 0;
    for (int i = 0; i < 32; ++i) {
      const uint16_t q = rd16(blk + 2 + 2 * i);
      const int32_t ls = 2 * ((blk[66 + i / 4] >> (4 * ((i / 2) & 1))) & 15) + 1;
      bsum += ls * signed_dot8(g_iq2xs_grid + 8 * (q & 511), g_ksigns[q >> 9], y.qs + 8 * i);
    }
    return float(bsum);
  });
}

float dot_iq2_s_scalar(const uint8_t* row, const void* x, int64_t nb) {
  return 0.125f * scalar_dot<kIq2sBytes>(row, x, nb, f16_at0, [](const uint8_t* blk, const BlockQ8K& y) {
    const uint8_t *qs = blk + 2, *signs = blk + 34, *qh = blk + 66, *scales = blk + 74;
    int32_t bsum = 0;
    for (int i = 0; i < 32; ++i) {
      const int32_t ls = 2 * ((scales[i / 4] >> (4 * ((i / 2) & 1))) & 15) + 1;
      const uint8_t* g = g_iq2s_grid + 8 * (qs[i] | (((qh[i / 4] >> (2 * (i % 4))) & 3) << 8));
      bsum += ls * signed_dot8(g, signs[i], y.qs + 8 * i);
    }
    return float(bsum);
  });
}

float dot_iq3_xxs_scalar(const uint8_t* row, const void* x, int64_t nb) {
  return 0.25f * scalar_dot<kIq3xxsBytes>(row, x, nb, f16_at0, [](const uint8_t* blk, const BlockQ8K& y) {
    const uint8_t* qs = blk + 2;
    int32_t bsum = 0;
    for (int ib = 0; ib < 8; ++ib) {
      const uint32_t aux = rd32(blk + 66 + 4 * ib);
      int32_t sumi = 0;
      for (int l = 0; l < 4; ++l) {
        uint8_t g[8];
        std::memcpy(g, g_iq3xxs_grid + 4 * qs[8 * ib + 2 * l], 4);
        std::memcpy(g + 4, g_iq3xxs_grid + 4 * qs[8 * ib + 2 * l + 1], 4);
        sumi += signed_dot8(g, g_ksigns[(aux >> (7 * l)) & 127], y.qs + 32 * ib + 8 * l);
      }
      bsum += int32_t(2 * (aux >> 28) + 1) * sumi;
    }
    return float(bsum);
  });
}

float dot_iq3_s_scalar(const uint8_t* row, const void* x, int64_t nb) {
  return scalar_dot<kIq3sBytes>(row, x, nb, f16_at0, [](const uint8_t* blk, const BlockQ8K& y) {
    const uint8_t *qs = blk + 2, *qh = blk + 66, *signs = blk + 74, *scales = blk + 106;
    int32_t bsum = 0;
    for (int ib = 0; ib < 8; ++ib) {
      int32_t sumi = 0;
      for (int l = 0; l < 4; ++l) {  // 4 groups of 8 = two grid entries each
        const int i = 8 * ib + 2 * l;
        uint8_t g[8];
        std::memcpy(g, g_iq3s_grid + 4 * (qs[i] | (((qh[i / 8] >> (i % 8)) & 1) << 8)), 4);
        std::memcpy(g + 4, g_iq3s_grid + 4 * (qs[i + 1] | (((qh[i / 8] >> (i % 8 + 1)) & 1) << 8)), 4);
        sumi += signed_dot8(g, signs[4 * ib + l], y.qs + 32 * ib + 8 * l);
      }
      bsum += (2 * ((scales[ib / 2] >> (4 * (ib & 1))) & 15) + 1) * sumi;
    }
    return float(bsum);
  });
}

float dot_iq1_s_scalar(const uint8_t* row, const void* x, int64_t nb) {
  return scalar_dot<kIq1sBytes>(row, x, nb, f16_at0, [](const uint8_t* blk, const BlockQ8K& y) {
    const uint8_t *qs = blk + 2, *qh = blk + 34;
    int32_t sumi = 0, sumd = 0;  // grid part, delta part (in units of the delta)
    for (int ib = 0; ib < 8; ++ib) {
      const uint16_t h = rd16(qh + 2 * ib);
      const int32_t ls = 2 * ((h >> 12) & 7) + 1;
      int32_t s = 0;
      for (int l = 0; l < 4; ++l)
        s += plain_dot8(g_iq1s_grid + 8 * (qs[4 * ib + l] | (((h >> (3 * l)) & 7) << 8)), y.qs + 32 * ib + 8 * l);
      const int32_t ysum = y.bsums[2 * ib] + y.bsums[2 * ib + 1];
      sumi += ls * s;
      sumd += ls * ((h & 0x8000) ? -ysum : ysum);
    }
    return float(sumi) + kIq1Delta * float(sumd);
  });
}

float dot_iq1_m_scalar(const uint8_t* row, const void* x, int64_t nb) {
  const auto scale = [](const uint8_t* blk) { return iq1m_scale(blk + 48); };
  return scalar_dot<kIq1mBytes>(row, x, nb, scale, [](const uint8_t* blk, const BlockQ8K& y) {
    const uint8_t *qs = blk, *qh = blk + 32, *scales = blk + 48;
    const int8_t* q8 = y.qs;
    int32_t sumi = 0, sumd = 0;
    for (int i = 0; i < 32; ++i) {
      const int s = i / 2;
      const int32_t ls = 2 * ((rd16(scales + 2 * (s / 4)) >> (3 * (s % 4))) & 7) + 1;
      const uint32_t nib = (qh[i / 2] >> (4 * (i & 1))) & 15;
      const int32_t ysum = sum8(q8 + 8 * i);
      sumi += ls * plain_dot8(g_iq1s_grid + 8 * (qs[i] | ((nib & 7) << 8)), q8 + 8 * i);
      sumd += ls * ((nib & 8) ? -ysum : ysum);
    }
    return float(sumi) + kIq1Delta * float(sumd);
  });
}

// ---- AVX2 dots ------------------------------------------------------------------------------------
// Per 32 weights (a sub-block): the grid magnitudes as 32 unsigned bytes (four 8-byte or eight 4-byte
// table rows), their signs as a byte vector whose sign moves onto the activations (_mm256_sign_epi8: Q8K's
// codes lie in [-127, 127], so negating never overflows), one maddubs (16 int16 pair sums; at most
// 62 * 127 * 2, no saturation) and one madd with the sub-block's odd scale (per 16 weights: the low / high
// 128-bit halves). A block's int32 lanes are scaled by d_w * d_x into a float accumulator.
//
// Each dot takes NX rows of x at once (xs[n]: row n's Q8K blocks; out[n]: its dot): the grid lookups, the
// most of a sub-block's work, are done once for all of them. NX = 1 is the registry's RowDot; NX = 4 the
// GEMM core's 4-row dot (dot_iq*_x4) for many rows of x (a prefill, a batch).
#if defined(__AVX2__)
namespace {

inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline uint64_t row8(const uint8_t* grid, uint32_t i) {
  uint64_t v;
  std::memcpy(&v, grid + 8 * size_t(i), 8);
  return v;
}

inline int32_t row4(const uint8_t* grid, uint32_t i) {
  int32_t v;
  std::memcpy(&v, grid + 4 * size_t(i), 4);
  return v;
}

// Four 8-byte grid rows (measured: faster than vpgatherdq on Zen 4).
inline __m256i rows8(const uint8_t* grid, uint32_t i0, uint32_t i1, uint32_t i2, uint32_t i3) {
  return _mm256_set_epi64x(int64_t(row8(grid, i3)), int64_t(row8(grid, i2)), int64_t(row8(grid, i1)),
                           int64_t(row8(grid, i0)));
}

// Eight 4-byte grid rows, the indices in q[0..7] (plus a ninth bit for IQ3_S: hi[k] = 256 or 0).
inline __m256i rows4(const uint8_t* grid, const uint32_t (&i)[8]) {
  return _mm256_set_epi32(row4(grid, i[7]), row4(grid, i[6]), row4(grid, i[5]), row4(grid, i[4]), row4(grid, i[3]),
                          row4(grid, i[2]), row4(grid, i[1]), row4(grid, i[0]));
}

// 32 sign bits -> 32 bytes of +1 (bit clear) / -1 (bit set).
inline __m256i signs_from_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int32_t(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i select = _mm256_set1_epi64x(int64_t(0x8040201008040201));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_or_si256(set, _mm256_set1_epi8(1));
}

// The ksigns entries (7-bit indices) of four groups of 8, as +1/-1 bytes.
inline __m256i ksigns4(uint32_t k0, uint32_t k1, uint32_t k2, uint32_t k3) {
  return _mm256_set_epi64x(int64_t(g_ksigns_pm1[k3]), int64_t(g_ksigns_pm1[k2]), int64_t(g_ksigns_pm1[k1]),
                           int64_t(g_ksigns_pm1[k0]));
}

// An IQ2_XXS / IQ3_XXS sub-block's 28 sign bits: four 7-bit ksigns indices.
inline __m256i ksigns_of(uint32_t aux) { return ksigns4(aux & 127, (aux >> 7) & 127, (aux >> 14) & 127, (aux >> 21) & 127); }

// A sub-block of 32 weights: w = mag * sign(sign) (sign's bytes +-1, or w itself for IQ1), scale16 the
// int16 scale of each 128-bit half (16 weights).
struct Sub {
  __m256i mag, sign, scale16;
};

// What a block's sub-blocks share, decoded once a block (its sub-block scales as int16 lanes, IQ1_S's delta
// signs), so that a sub-block takes its own with one byte shuffle: see the types' `prep`.
struct BlockCtx {
  __m256i scales, deltas;
};

// The int16 lane `lo` of v's low 128 bits into all of that half, lane `hi` of the high half likewise.
inline __m256i pick16(__m256i v, int lo, int hi) {
  const __m128i l = _mm_set1_epi16(short(0x0100 + 0x0202 * lo)), h = _mm_set1_epi16(short(0x0100 + 0x0202 * hi));
  return _mm256_shuffle_epi8(v, _mm256_set_m128i(h, l));
}

// 2 * s + 1 on int16 lanes: the odd scales all these types use.
inline __m256i odd16(__m256i s) { return _mm256_add_epi16(_mm256_slli_epi16(s, 1), _mm256_set1_epi16(1)); }

// Eight bytes of two 4-bit scales each (IQ2_XS / IQ2_S: low nibble the first 16 weights of a sub-block):
// 2s + 1 as int16, the low nibbles in the low half (lane ib), the high ones in the high half.
inline __m256i nibble_scales(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  const __m128i b = _mm_cvtsi64_si128(int64_t(v)), m4 = _mm_set1_epi8(15);
  return odd16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi64(_mm_and_si128(b, m4), _mm_and_si128(_mm_srli_epi16(b, 4), m4))));
}

inline BlockCtx no_ctx(const uint8_t*) { return BlockCtx{_mm256_setzero_si256(), _mm256_setzero_si256()}; }

// The shared loop: prep(blk) decodes what a block's sub-blocks share, sub(blk, ib, ctx) sub-block ib,
// block_scale(blk) the block's float scale, k the type's constant factor (1/8 for the IQ2 types' (2s+1)/8...).
template <int NX, int kBytes, typename PrepFn, typename SubFn, typename ScaleFn>
inline void iq_dots(const uint8_t* row, const void* const* xs, int64_t nb, float* out, float k, PrepFn prep,
                    SubFn sub, ScaleFn block_scale) {
  __m256 acc[NX];
  for (int n = 0; n < NX; ++n) acc[n] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kBytes;
    const BlockCtx ctx = prep(blk);
    __m256i isum[NX];
    for (int n = 0; n < NX; ++n) isum[n] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int ib = 0; ib < 8; ++ib) {
      const Sub s = sub(blk, ib, ctx);
      for (int n = 0; n < NX; ++n) {
        const __m256i q8 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const BlockQ8K*>(xs[n])[b].qs + 32 * ib));
        const __m256i p = _mm256_maddubs_epi16(s.mag, _mm256_sign_epi8(q8, s.sign));
        isum[n] = _mm256_add_epi32(isum[n], _mm256_madd_epi16(p, s.scale16));
      }
    }
    const float dw = block_scale(blk);
    for (int n = 0; n < NX; ++n) {
      const float d = dw * static_cast<const BlockQ8K*>(xs[n])[b].d;
      acc[n] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(isum[n]), acc[n]);
    }
  }
  for (int n = 0; n < NX; ++n) out[n] = k * hsum_ps(acc[n]);
}

template <int NX>
void dot_iq2_xxs_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  iq_dots<NX, kIq2xxsBytes>(row, xs, nb, out, 0.125f, no_ctx, [](const uint8_t* blk, int ib, const BlockCtx&) {
    const uint32_t idx = rd32(blk + 2 + 8 * ib), aux = rd32(blk + 6 + 8 * ib);
    return Sub{rows8(g_iq2xxs_grid, idx & 255, (idx >> 8) & 255, (idx >> 16) & 255, idx >> 24), ksigns_of(aux),
               _mm256_set1_epi16(short(2 * (aux >> 28) + 1))};
  }, f16_at0);
}

template <int NX>
void dot_iq2_xs_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  const auto prep = [](const uint8_t* blk) { return BlockCtx{nibble_scales(blk + 66), _mm256_setzero_si256()}; };
  iq_dots<NX, kIq2xsBytes>(row, xs, nb, out, 0.125f, prep, [](const uint8_t* blk, int ib, const BlockCtx& ctx) {
    uint16_t q[4];
    std::memcpy(q, blk + 2 + 8 * ib, 8);
    return Sub{rows8(g_iq2xs_grid, q[0] & 511, q[1] & 511, q[2] & 511, q[3] & 511),
               ksigns4(q[0] >> 9, q[1] >> 9, q[2] >> 9, q[3] >> 9), pick16(ctx.scales, ib, ib)};
  }, f16_at0);
}

template <int NX>
void dot_iq2_s_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  const auto prep = [](const uint8_t* blk) { return BlockCtx{nibble_scales(blk + 74), _mm256_setzero_si256()}; };
  iq_dots<NX, kIq2sBytes>(row, xs, nb, out, 0.125f, prep, [](const uint8_t* blk, int ib, const BlockCtx& ctx) {
    const uint8_t* qs = blk + 2 + 4 * ib;
    const uint32_t h = blk[66 + ib];
    return Sub{rows8(g_iq2s_grid, qs[0] | ((h << 8) & 0x300), qs[1] | ((h << 6) & 0x300), qs[2] | ((h << 4) & 0x300),
                     qs[3] | ((h << 2) & 0x300)),
               signs_from_bits(rd32(blk + 34 + 4 * ib)), pick16(ctx.scales, ib, ib)};
  }, f16_at0);
}

template <int NX>
void dot_iq3_xxs_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  iq_dots<NX, kIq3xxsBytes>(row, xs, nb, out, 0.25f, no_ctx, [](const uint8_t* blk, int ib, const BlockCtx&) {
    const uint8_t* qs = blk + 2 + 8 * ib;
    const uint32_t aux = rd32(blk + 66 + 4 * ib);
    const uint32_t i[8] = {qs[0], qs[1], qs[2], qs[3], qs[4], qs[5], qs[6], qs[7]};
    return Sub{rows4(g_iq3xxs_grid, i), ksigns_of(aux), _mm256_set1_epi16(short(2 * (aux >> 28) + 1))};
  }, f16_at0);
}

template <int NX>
void dot_iq3_s_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  const auto prep = [](const uint8_t* blk) {  // eight 4-bit scales, one a sub-block, in both halves
    const __m128i b = _mm_cvtsi32_si128(int32_t(rd32(blk + 106))), m4 = _mm_set1_epi8(15);
    const __m128i s = _mm_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_and_si128(b, m4), _mm_and_si128(_mm_srli_epi16(b, 4), m4)));
    return BlockCtx{odd16(_mm256_broadcastsi128_si256(s)), _mm256_setzero_si256()};
  };
  iq_dots<NX, kIq3sBytes>(row, xs, nb, out, 1.0f, prep, [](const uint8_t* blk, int ib, const BlockCtx& ctx) {
    const uint8_t* qs = blk + 2 + 8 * ib;
    const uint32_t h = blk[66 + ib];
    const uint32_t i[8] = {qs[0] | ((h << 8) & 256), qs[1] | ((h << 7) & 256), qs[2] | ((h << 6) & 256),
                           qs[3] | ((h << 5) & 256), qs[4] | ((h << 4) & 256), qs[5] | ((h << 3) & 256),
                           qs[6] | ((h << 2) & 256), qs[7] | ((h << 1) & 256)};
    return Sub{rows4(g_iq3s_grid, i), signs_from_bits(rd32(blk + 74 + 4 * ib)), pick16(ctx.scales, ib, ib)};
  }, f16_at0);
}

// IQ1: w = 8 * (grid + delta) = 8g +- 1 (odd, never 0) as a signed byte: |w| the magnitude, w the sign.
inline Sub iq1_sub(__m256i w, __m256i scale16) { return Sub{_mm256_sign_epi8(w, w), w, scale16}; }

template <int NX>
void dot_iq1_s_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  const auto prep = [](const uint8_t* blk) {  // the eight qh words: scale 2 * bits 12-14 + 1, delta sign bit 15
    const __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 34)));
    const __m256i scales = odd16(_mm256_and_si256(_mm256_srli_epi16(h, 12), _mm256_set1_epi16(7)));
    return BlockCtx{scales, _mm256_or_si256(_mm256_srai_epi16(h, 15), _mm256_set1_epi16(1))};  // +-1 a word
  };
  iq_dots<NX, kIq1sBytes>(row, xs, nb, out, 0.125f, prep, [](const uint8_t* blk, int ib, const BlockCtx& ctx) {
    const uint8_t* grid = reinterpret_cast<const uint8_t*>(g_iq1s_grid_x8);
    const uint8_t* qs = blk + 2 + 4 * ib;
    const uint32_t h = rd16(blk + 34 + 2 * ib);
    const __m256i g = rows8(grid, qs[0] | ((h << 8) & 0x700), qs[1] | ((h << 5) & 0x700), qs[2] | ((h << 2) & 0x700),
                            qs[3] | ((h >> 1) & 0x700));
    const __m256i delta = _mm256_shuffle_epi8(ctx.deltas, _mm256_set1_epi8(char(2 * ib)));  // word ib's low byte
    return iq1_sub(_mm256_add_epi8(g, delta), pick16(ctx.scales, ib, ib));
  }, f16_at0);
}

template <int NX>
void dot_iq1_m_n(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {
  // The 16 3-bit scales (4 a 16-bit word, bits 0-11) as int16 lanes: each 64-bit lane holds all four words,
  // shifted by 0 / 6 (low half: the scales of the first 16 weights of sub-blocks) and 3 / 9 (high half: of the
  // last 16), so that sub-block ib's two scales sit at the same lane, 4 * (ib & 1) + ib / 2, of each half.
  const auto prep = [](const uint8_t* blk) {
    uint64_t v;
    std::memcpy(&v, blk + 48, 8);
    const __m256i s = _mm256_srlv_epi64(_mm256_set1_epi64x(int64_t(v)), _mm256_set_epi64x(9, 3, 6, 0));
    return BlockCtx{odd16(_mm256_and_si256(s, _mm256_set1_epi16(7))), _mm256_setzero_si256()};
  };
  iq_dots<NX, kIq1mBytes>(row, xs, nb, out, 0.125f, prep, [](const uint8_t* blk, int ib, const BlockCtx& ctx) {
    const uint8_t* grid = reinterpret_cast<const uint8_t*>(g_iq1s_grid_x8);
    const uint8_t* qs = blk + 4 * ib;
    const uint32_t h = rd16(blk + 32 + 2 * ib);  // four nibbles: 3 index bits + a delta sign each
    const __m256i g = rows8(grid, qs[0] | ((h << 8) & 0x700), qs[1] | ((h << 4) & 0x700), qs[2] | (h & 0x700),
                            qs[3] | ((h >> 4) & 0x700));
    // the delta signs (bits 3, 7, 11, 15 of h) spread over their groups of 8 bytes: +1 clear, -1 set
    const __m256i spread = _mm256_set_epi64x(0x0101010101010101, 0x0101010101010101, 0, 0);
    const __m256i select = _mm256_set_epi64x(int64_t(0x8080808080808080), 0x0808080808080808,
                                             int64_t(0x8080808080808080), 0x0808080808080808);
    const __m256i bits = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(int32_t(h)), spread), select);
    const __m256i delta = _mm256_or_si256(_mm256_cmpeq_epi8(bits, select), _mm256_set1_epi8(1));
    const int at = 4 * (ib & 1) + ib / 2;
    return iq1_sub(_mm256_add_epi8(g, delta), pick16(ctx.scales, at, at));
  }, [](const uint8_t* blk) { return iq1m_scale(blk + 48); });
}

template <void (*Dots)(const uint8_t*, const void* const*, int64_t, float*)>
float one_row(const uint8_t* row, const void* x, int64_t nb) {
  float out;
  Dots(row, &x, nb, &out);
  return out;
}

}  // namespace
#endif  // __AVX2__

// ---- the entry points ---------------------------------------------------------------------------

// Each type's RowDot (the registry's), and in an AVX2 build its 4-row dot: one weight row against 4 rows of x
// (xs[n]: row n's Q8K blocks) -> out[0..3], the grid decoded once (cpu_block_gemv.cpp's registry takes them
// there; without AVX2 it calls the RowDot 4 times).
#if defined(__AVX2__)
#define EMBER_IQ_ENTRY_POINTS(t)                                                                               \
  float dot_##t(const uint8_t* row, const void* x, int64_t nb) { return one_row<dot_##t##_n<1>>(row, x, nb); } \
  void dot_##t##_x4(const uint8_t* row, const void* const* xs, int64_t nb, float* out) {                        \
    dot_##t##_n<4>(row, xs, nb, out);                                                                          \
  }
#else
#define EMBER_IQ_ENTRY_POINTS(t) \
  float dot_##t(const uint8_t* row, const void* x, int64_t nb) { return dot_##t##_scalar(row, x, nb); }
#endif
EMBER_IQ_TYPES(EMBER_IQ_ENTRY_POINTS)
#undef EMBER_IQ_ENTRY_POINTS

}  // namespace ember_blocks
