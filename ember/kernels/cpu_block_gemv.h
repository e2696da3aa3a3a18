// GEMV / GEMM over a GGUF file's own blocks (the bytes as the file holds them: a row of N weights is
// N / block_elems blocks, rows back to back), so a weight can stay a view of the file's mapping and
// be read only where a step touches it (MoE experts, cold layers), and every ggml type runs packed.
//
// Activations are quantized once per row of x, as llama.cpp does, to the type each weight type dots
// against: Q8K (256 int8 + float scale + 16 partial sums) for the K-quants and the IQ types, Q8_0x
// (32 int8 + float scale) for the 32-element types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL). A row's dot
// is then integer sums inside blocks, one float multiply-add per block (or sub-block).
//
// The files that implement it: cpu_block_gemv.cpp (the registry by ggml type id, activation
// quantization, the GEMV / GEMM / MoE entry points, the K-quants and 32-element types, IQ4_NL /
// IQ4_XS) and cpu_block_gemv_iq.cpp (the grid-coded IQ types: IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS,
// IQ2_S, IQ1_S, IQ1_M). Each type gives a row dot and an exact row dequantizer (the values gguf-py's
// reference dequantizer gives, bit for bit in float32).
#pragma once
#include <cstdint>

namespace ember_blocks {

constexpr int QK_K = 256;  // elements in a K-quant / IQ super-block
constexpr int QK8 = 32;    // elements in a 32-element block

struct BlockQ8K {
  float d;              // x ~= d * qs
  int8_t qs[QK_K];
  int16_t bsums[QK_K / 16];  // sums of qs over each 16 consecutive elements (the K-quants' mins need them)
};

struct BlockQ8x {
  float d;
  int8_t qs[QK8];
  float s;  // d * sum(qs): the offset types (Q4_1, Q5_1) need it
};

// x [k] (k a multiple of QK_K / QK8) -> k / QK_K (or k / QK8) blocks.
void quantize_row_q8K(const float* x, BlockQ8K* y, int64_t k);
void quantize_row_q8x(const float* x, BlockQ8x* y, int64_t k);

// Which activation blocks a weight type dots against.
enum class ActFormat : int { Q8K = 0, Q8x = 1 };

// One weight row (nb blocks of the type, as in the file) . one quantized activation row (nb blocks).
using RowDot = float (*)(const uint8_t* row, const void* x, int64_t nb);
// One weight row's nb blocks -> nb * block_elems float32 values.
using RowDequant = void (*)(const uint8_t* row, float* out, int64_t nb);

struct BlockType {
  int ggml_type;       // GGMLQuantizationType's value
  int block_elems;     // 32 or 256
  int block_bytes;     // bytes per block in the file
  ActFormat act;
  RowDot dot;
  RowDequant dequant;
};

// The type's entry, or nullptr where this build has none.
const BlockType* block_type(int ggml_type);

// The grid-coded IQ types (cpu_block_gemv_iq.cpp), each dotting against BlockQ8K: X(t) for each, so that a
// declaration or definition per type is written once (dot_##t, dequant_##t, ...).
#define EMBER_IQ_TYPES(X) X(iq3_xxs) X(iq3_s) X(iq2_xxs) X(iq2_xs) X(iq2_s) X(iq1_s) X(iq1_m)
#define EMBER_IQ_DECLARE(t)                                   \
  float dot_##t(const uint8_t* row, const void* x, int64_t nb); \
  void dequant_##t(const uint8_t* row, float* out, int64_t nb);
EMBER_IQ_TYPES(EMBER_IQ_DECLARE)
#undef EMBER_IQ_DECLARE

// The IQ grids (lookup tables of the IQ formats) are data, handed in once from gguf-py's own tables
// (ember/kernels/cpu_block_gemv.py reads them from gguf.quants) before any IQ type runs: name -> bytes.
// Returns false for a name it does not know or a size that does not match.
bool set_iq_table(const char* name, const uint8_t* data, int64_t bytes);

}  // namespace ember_blocks
