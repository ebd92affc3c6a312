// Packing: copies a block of rows of a BTNH/BSKH operand into a contiguous float32
// tile, widening 16-bit inputs once per tile (not once per use) and zero-filling the
// padding so that padded lanes contribute nothing to any product.
#pragma once

#include "cpu/convert.h"
#include "cpu/problem.h"
#include "cpu/vec.h"

namespace jax_flash {
namespace cpu {
namespace JAX_FLASH_CPU_ISA {

// A block of `rows` consecutive rows of an operand: row i starts at element
// `first + i * stride` and holds `cols` elements.
struct RowBlock {
  const void* base;
  ElementType type;
  int64_t first;
  int64_t stride;
  int64_t rows;
  int64_t cols;
};

// tile[i][h] = factor * src(i, h), row-major with leading dimension ld; rows in
// [src.rows, padded_rows) and columns in [src.cols, ld) are zero.
JAX_FLASH_INLINE void PackRows(const RowBlock& src, float factor, int64_t padded_rows, int64_t ld,
                               float* tile) {
  for (int64_t i = 0; i < padded_rows; ++i) {
    float* row = tile + i * ld;
    int64_t h = 0;
    if (i < src.rows) {
      LoadRow(src.base, src.type, src.first + i * src.stride, src.cols, row);
      if (factor != 1.0f)
        for (; h < src.cols; ++h) row[h] *= factor;
      h = src.cols;
    }
    for (; h < ld; ++h) row[h] = 0.0f;
  }
}

// tile[h][j] = src(j, h): the operand transposed so that a product over h is
// vectorised along j (scores S = Q·Kᵀ and dP = dO·Vᵀ). Columns j in
// [src.rows, padded_cols) are zero. `row_buffer` holds src.cols floats.
JAX_FLASH_INLINE void PackTransposed(const RowBlock& src, int64_t padded_cols, int64_t ld,
                                     float* row_buffer, float* tile) {
  for (int64_t j = 0; j < src.rows; ++j) {
    LoadRow(src.base, src.type, src.first + j * src.stride, src.cols, row_buffer);
    for (int64_t h = 0; h < src.cols; ++h) tile[h * ld + j] = row_buffer[h];
  }
  for (int64_t h = 0; h < src.cols; ++h)
    for (int64_t j = src.rows; j < padded_cols; ++j) tile[h * ld + j] = 0.0f;
}

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
