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

}  // namespace

bool set_iq_table(const char* name, const uint8_t* data, int64_t bytes) {
  for (const TableSlot& slot : kTables) {
    if (std::strcmp(slot.name, name) == 0) {
      if (bytes != slot.bytes) return false;
      std::memcpy(slot.data, data, size_t(bytes));
      return true;
    }
  }
  return false;
}

// ---- exact dequantizers (gguf-py's operation order) ---------------------------------------------

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
        for (int j = 0; j < 8; ++j) out[32 * ib + 8 * l + j] = db * float(g[j]) * sign_of_bit(signs, j);
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
      for (int j = 0; j < 8; ++j) out[8 * i + j] = db * float(g[j]) * sign_of_bit(signs, j);
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
      for (int j = 0; j < 8; ++j) out[8 * i + j] = db * float(g[j]) * sign_of_bit(signs[i], j);
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
        float* o = out + 32 * ib + 8 * l;
        for (int j = 0; j < 4; ++j) {
          o[j] = db * float(g0[j]) * sign_of_bit(signs, j);
          o[j + 4] = db * float(g1[j]) * sign_of_bit(signs, j + 4);
        }
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
      for (int k = 0; k < 8; ++k) {  // 8 grid entries of 4 in the sub-block
        const int i = 8 * ib + k;
        const uint8_t* g = g_iq3s_grid + 4 * (qs[i] | (((qh[i / 8] >> (i % 8)) & 1) << 8));
        const uint32_t s = signs[i / 2];
        for (int j = 0; j < 4; ++j) out[4 * i + j] = db * float(g[j]) * sign_of_bit(s, 4 * (i & 1) + j);
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

namespace {

// sum_j g[j] * (+-1) * q8[j] over 8 values, the signs a bit mask.
template <typename G>
inline int32_t signed_dot8(const G* g, uint32_t signs, const int8_t* q8) {
  int32_t s = 0;
  for (int j = 0; j < 8; ++j) s += (signs >> j & 1) ? -int32_t(g[j]) * q8[j] : int32_t(g[j]) * q8[j];
  return s;
}

float dot_iq2_xxs_scalar(const uint8_t* row, const BlockQ8K* y, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kIq2xxsBytes;
    const int8_t* q8 = y[b].qs;
    int32_t bsum = 0;
    for (int ib = 0; ib < 8; ++ib, q8 += 32) {
      const uint32_t idx = rd32(blk + 2 + 8 * ib), aux = rd32(blk + 6 + 8 * ib);
      int32_t sumi = 0;
      for (int l = 0; l < 4; ++l)
        sumi += signed_dot8(g_iq2xxs_grid + 8 * ((idx >> (8 * l)) & 255), g_ksigns[(aux >> (7 * l)) & 127], q8 + 8 * l);
      bsum += int32_t(2 * (aux >> 28) + 1) * sumi;
    }
    sum += half_to_float(rd16(blk)) * y[b].d * float(bsum);
  }
  return 0.125f * sum;
}

float dot_iq2_xs_scalar(const uint8_t* row, const BlockQ8K* y, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kIq2xsBytes;
    const int8_t* q8 = y[b].qs;
    int32_t bsum = 0;
    for (int i = 0; i < 32; ++i) {
      const uint16_t q = rd16(blk + 2 + 2 * i);
      const int32_t ls = 2 * ((blk[66 + i / 4] >> (4 * ((i / 2) & 1))) & 15) + 1;
      bsum += ls * signed_dot8(g_iq2xs_grid + 8 * (q & 511), g_ksigns[q >> 9], q8 + 8 * i);
    }
    sum += half_to_float(rd16(blk)) * y[b].d * float(bsum);
  }
  return 0.125f * sum;
}

float dot_iq2_s_scalar(const uint8_t* row, const BlockQ8K* y, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kIq2sBytes;
    const uint8_t *qs = blk + 2, *signs = blk + 34, *qh = blk + 66, *scales = blk + 74;
    const int8_t* q8 = y[b].qs;
    int32_t bsum = 0;
    for (int i = 0; i < 32; ++i) {
      const int32_t ls = 2 * ((scales[i / 4] >> (4 * ((i / 2) & 1))) & 15) + 1;
      const uint8_t* g = g_iq2s_grid + 8 * (qs[i] | (((qh[i / 4] >> (2 * (i % 4))) & 3) << 8));
      bsum += ls * signed_dot8(g, signs[i], q8 + 8 * i);
    }
    sum += half_to_float(rd16(blk)) * y[b].d * float(bsum);
  }
  return 0.125f * sum;
}

float dot_iq3_xxs_scalar(const uint8_t* row, const BlockQ8K* y, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kIq3xxsBytes;
    const uint8_t* qs = blk + 2;
    const int8_t* q8 = y[b].qs;
    int32_t bsum = 0;
    for (int ib = 0; ib < 8; ++ib) {
      const uint32_t aux = rd32(blk + 66 + 4 * ib);
      int32_t sumi = 0;
      for (int l = 0; l < 4; ++l) {
        uint8_t g[8];
        std::memcpy(g, g_iq3xxs_grid + 4 * qs[8 * ib + 2 * l], 4);
        std::memcpy(g + 4, g_iq3xxs_grid + 4 * qs[8 * ib + 2 * l + 1], 4);
        sumi += signed_dot8(g, g_ksigns[(aux >> (7 * l)) & 127], q8 + 32 * ib + 8 * l);
      }
      bsum += int32_t(2 * (aux >> 28) + 1) * sumi;
    }
    sum += half_to_float(rd16(blk)) * y[b].d * float(bsum);
  }
  return 0.25f * sum;
}

float dot_iq3_s_scalar(const uint8_t* row, const BlockQ8K* y, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kIq3sBytes;
    const uint8_t *qs = blk + 2, *qh = blk + 66, *signs = blk + 74, *scales = blk + 106;
    const int8_t* q8 = y[b].qs;
    int32_t bsum = 0;
    for (int ib = 0; ib < 8; ++ib) {
      int32_t sumi = 0;
      for (int l = 0; l < 4; ++l) {  // 4 groups of 8 = two grid entries each
        const int i = 8 * ib + 2 * l;
        uint8_t g[8];
        std::memcpy(g, g_iq3s_grid + 4 * (qs[i] | (((qh[i / 8] >> (i % 8)) & 1) << 8)), 4);
        std::memcpy(g + 4, g_iq3s_grid + 4 * (qs[i + 1] | (((qh[i / 8] >> (i % 8 + 1)) & 1) << 8)), 4);
        sumi += signed_dot8(g, signs[4 * ib + l], q8 + 32 * ib + 8 * l);
      }
      bsum += (2 * ((scales[ib / 2] >> (4 * (ib & 1))) & 15) + 1) * sumi;
    }
    sum += half_to_float(rd16(blk)) * y[b].d * float(bsum);
  }
  return sum;
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

float dot_iq1_s_scalar(const uint8_t* row, const BlockQ8K* y, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kIq1sBytes;
    const uint8_t *qs = blk + 2, *qh = blk + 34;
    const int8_t* q8 = y[b].qs;
    int32_t sumi = 0, sumd = 0;  // grid part, delta part (in units of the delta)
    for (int ib = 0; ib < 8; ++ib) {
      const uint16_t h = rd16(qh + 2 * ib);
      const int32_t ls = 2 * ((h >> 12) & 7) + 1;
      int32_t s = 0;
      for (int l = 0; l < 4; ++l)
        s += plain_dot8(g_iq1s_grid + 8 * (qs[4 * ib + l] | (((h >> (3 * l)) & 7) << 8)), q8 + 32 * ib + 8 * l);
      const int32_t ysum = y[b].bsums[2 * ib] + y[b].bsums[2 * ib + 1];
      sumi += ls * s;
      sumd += ls * ((h & 0x8000) ? -ysum : ysum);
    }
    sum += half_to_float(rd16(blk)) * y[b].d * (float(sumi) + kIq1Delta * float(sumd));
  }
  return sum;
}

float dot_iq1_m_scalar(const uint8_t* row, const BlockQ8K* y, int64_t nb) {
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kIq1mBytes;
    const uint8_t *qs = blk, *qh = blk + 32, *scales = blk + 48;
    const int8_t* q8 = y[b].qs;
    int32_t sumi = 0, sumd = 0;
    for (int i = 0; i < 32; ++i) {
      const int s = i / 2;
      const int32_t ls = 2 * ((rd16(scales + 2 * (s / 4)) >> (3 * (s % 4))) & 7) + 1;
      const uint32_t nib = (qh[i / 2] >> (4 * (i & 1))) & 15;
      const int32_t ysum = sum8(q8 + 8 * i);
      sumi += ls * plain_dot8(g_iq1s_grid + 8 * (qs[i] | ((nib & 7) << 8)), q8 + 8 * i);
      sumd += ls * ((nib & 8) ? -ysum : ysum);
    }
    sum += iq1m_scale(scales) * y[b].d * (float(sumi) + kIq1Delta * float(sumd));
  }
  return sum;
}

}  // namespace

// ---- the entry points ---------------------------------------------------------------------------

float dot_iq2_xxs(const uint8_t* row, const void* x, int64_t nb) {
  return dot_iq2_xxs_scalar(row, static_cast<const BlockQ8K*>(x), nb);
}
float dot_iq2_xs(const uint8_t* row, const void* x, int64_t nb) {
  return dot_iq2_xs_scalar(row, static_cast<const BlockQ8K*>(x), nb);
}
float dot_iq2_s(const uint8_t* row, const void* x, int64_t nb) {
  return dot_iq2_s_scalar(row, static_cast<const BlockQ8K*>(x), nb);
}
float dot_iq3_xxs(const uint8_t* row, const void* x, int64_t nb) {
  return dot_iq3_xxs_scalar(row, static_cast<const BlockQ8K*>(x), nb);
}
float dot_iq3_s(const uint8_t* row, const void* x, int64_t nb) {
  return dot_iq3_s_scalar(row, static_cast<const BlockQ8K*>(x), nb);
}
float dot_iq1_s(const uint8_t* row, const void* x, int64_t nb) {
  return dot_iq1_s_scalar(row, static_cast<const BlockQ8K*>(x), nb);
}
float dot_iq1_m(const uint8_t* row, const void* x, int64_t nb) {
  return dot_iq1_m_scalar(row, static_cast<const BlockQ8K*>(x), nb);
}

}  // namespace ember_blocks
