// Packing bfloat16 operands for the bf16 products (tile_gemm_bf16.h) without widening:
// the elements are copied bit for bit into the row or pair layouts, zero-filled past
// the real rows and columns. The packed buffers are the float32 ones of tiling.h seen
// as bf16 (every bf16 layout here needs at most half of their bytes, see the sizes).
//
// Per key block (b, kv head, keys [s0, s0 + kBlockK)):
//   k_t, v_t  Kᵀ, Vᵀ as B over h:    [Hp/2][kKeyStride][2]  (S = Q·Kᵀ, dP = dO·Vᵀ)
//   k, v      K, V as B over keys:   [kBlockK/2][RowStride][2]  (dQ = dS·K, O = P·V)
// Per query block (backward; b, head, rows [t0, t0 + kBlockQ)):
//   q, dout   rows as A:             [kBlockQ][RowStride]  (S = Q·Kᵀ, dP = dO·Vᵀ)
//             followed by Qᵀ, dOᵀ as A over rows: [Hp][kBlockQ]  (dKᵀ = Qᵀ·dS, dVᵀ = dOᵀ·P)
#pragma once

#include "cpu/convert.h"
#include "cpu/problem.h"
#include "cpu/tile_pack.h"
#include "cpu/tiling.h"
#include "cpu/vec.h"

namespace jax_flash {
namespace cpu {
namespace JAX_FLASH_CPU_ISA {

JAX_FLASH_INLINE const uint16_t* Bits16(const RowBlock& src, int64_t i) {
  return static_cast<const uint16_t*>(src.base) + src.first + i * src.stride;
}

// dst[i][h] = src(i, h), zero for i in [src.rows, padded_rows) or h in [src.cols, ld).
JAX_FLASH_INLINE void PackRowsBF16(const RowBlock& src, int64_t padded_rows, int64_t ld, uint16_t* dst) {
  for (int64_t i = 0; i < padded_rows; ++i) {
    uint16_t* row = dst + i * ld;
    int64_t h = 0;
    if (i < src.rows) {
      __builtin_memcpy(row, Bits16(src, i), src.cols * sizeof(uint16_t));
      h = src.cols;
    }
    for (; h < ld; ++h) row[h] = 0;
  }
}

// dst[h][i] = src(i, h) for h < padded_cols, i < padded_rows (zero outside src).
JAX_FLASH_INLINE void PackTransposedBF16(const RowBlock& src, int64_t padded_rows, int64_t padded_cols, int64_t ld,
                                         uint16_t* dst) {
  for (int64_t h = 0; h < padded_cols; ++h)
    for (int64_t i = 0; i < padded_rows; ++i) dst[h * ld + i] = 0;
  for (int64_t i = 0; i < src.rows; ++i) {
    const uint16_t* row = Bits16(src, i);
    for (int64_t h = 0; h < src.cols; ++h) dst[h * ld + i] = row[h];
  }
}

// B over h (the reduction runs along a row of src): element (h, j) = src(j, h) at
// dst[(h/2)·2·ld + 2j + h%2], for h < padded_cols (even), j < ld; zero outside src.
JAX_FLASH_INLINE void PackPairsAlongRows(const RowBlock& src, int64_t padded_cols, int64_t ld, uint16_t* dst) {
  for (int64_t e = 0; e < padded_cols * ld; ++e) dst[e] = 0;
  for (int64_t j = 0; j < src.rows; ++j) {
    const uint16_t* row = Bits16(src, j);
    for (int64_t h = 0; h < src.cols; ++h) dst[(h / 2) * 2 * ld + 2 * j + h % 2] = row[h];
  }
}

// B over rows (the reduction runs down the rows of src): element (j, h) = src(j, h)
// at dst[(j/2)·2·ld + 2h + j%2], for j < padded_rows (even), h < ld; zero outside src.
JAX_FLASH_INLINE void PackPairsAcrossRows(const RowBlock& src, int64_t padded_rows, int64_t ld, uint16_t* dst) {
  for (int64_t e = 0; e < padded_rows * ld; ++e) dst[e] = 0;
  for (int64_t j = 0; j < src.rows; ++j) {
    const uint16_t* row = Bits16(src, j);
    uint16_t* out = dst + (j / 2) * 2 * ld + j % 2;
    for (int64_t h = 0; h < src.cols; ++h) out[2 * h] = row[h];
  }
}

// NaN/±inf -> 0 in packed operands that meet masked (zero) weights in a product (V in
// O += P·V, K in dQ += dS·K, Q in dK += dSᵀ·Q and the scores): 0·NaN would carry a
// masked-out poisoned key or query into rows that do not see it. The poison reaches the
// rows that see it through the scores (Kᵀ is not zeroed), lse and D instead.
JAX_FLASH_INLINE void ZeroNonFiniteBF16(uint16_t* tile, int64_t n) {
  for (int64_t i = 0; i < n; ++i) tile[i] = (tile[i] & 0x7f80u) == 0x7f80u ? 0 : tile[i];
}

inline uint16_t* AsBF16(float* p) { return reinterpret_cast<uint16_t*>(p); }
inline const uint16_t* AsBF16(const float* p) { return reinterpret_cast<const uint16_t*>(p); }

// Offset (in bf16 elements) of the transposed copy behind a packed query block's rows.
inline int64_t TransposedQueryOffset(const Problem& p) { return kBlockQ * RowStride(p); }

// PackKeyBlock (tile_pack.h) with the bf16 layouts.
inline void PackKeyBlockBF16(const Problem& p, const KeyBlockItem& block, const KeyBlockLayouts& dst) {
  const auto [b, g, s0, keys] = block;
  const int64_t hp = PaddedHeadDim(p);
  const int64_t ld = RowStride(p);
  const RowBlock k = KeyRows(p, b, g, s0, keys, false, nullptr);
  const RowBlock v = KeyRows(p, b, g, s0, keys, true, nullptr);
  if (dst.k_t != nullptr) PackPairsAlongRows(k, hp, kKeyStride, AsBF16(dst.k_t));
  if (dst.v_t != nullptr) PackPairsAlongRows(v, hp, kKeyStride, AsBF16(dst.v_t));
  if (dst.k != nullptr) {
    PackPairsAcrossRows(k, kBlockK, ld, AsBF16(dst.k));
    ZeroNonFiniteBF16(AsBF16(dst.k), kBlockK * ld);
  }
  if (dst.v != nullptr) {
    PackPairsAcrossRows(v, kBlockK, ld, AsBF16(dst.v));
    ZeroNonFiniteBF16(AsBF16(dst.v), kBlockK * ld);
  }
}

// PackQueryBlock (tile_pack.h) with the bf16 layouts: Q and dO rows and their transposes;
// D = rowsum(dO ∘ O) − dlse in float32 from the widened rows. `row_buffer` holds 2·Hv floats.
inline void PackQueryBlockBF16(const Problem& p, const QueryBlockItem& block, float* q_dst, float* dout_dst,
                               float* row_buffer) {
  const auto [b, n, t0, rows] = block;
  const int64_t hp = PaddedHeadDim(p);
  const int64_t ld = RowStride(p);
  const int64_t hv = p.value_dim();
  const RowBlock q{p.q, p.dtype, p.q_row(b, t0, n), p.q_heads * p.head_dim, rows, p.head_dim};
  const RowBlock dout{p.dout, p.dtype, p.o_row(b, t0, n), p.q_heads * hv, rows, hv};
  uint16_t* q_rows = AsBF16(q_dst);
  uint16_t* dout_rows = AsBF16(dout_dst);
  PackRowsBF16(q, kBlockQ, ld, q_rows);
  PackRowsBF16(dout, kBlockQ, ld, dout_rows);
  PackTransposedBF16(q, kBlockQ, hp, kBlockQ, q_rows + TransposedQueryOffset(p));
  PackTransposedBF16(dout, kBlockQ, hp, kBlockQ, dout_rows + TransposedQueryOffset(p));
  // Finite: the scores need no poisoned q, a poisoned row's lse is NaN.
  ZeroNonFiniteBF16(q_rows, 2 * QueryBlockFloats(p));
  float* o_row = row_buffer;
  float* do_row = row_buffer + hv;
  for (int64_t i = 0; i < rows; ++i) {
    LoadRow(p.out, p.dtype, p.o_row(b, t0 + i, n), hv, o_row);
    LoadRow(p.dout, p.dtype, p.o_row(b, t0 + i, n), hv, do_row);
    float sum = 0.0f;
    for (int64_t h = 0; h < hv; ++h) sum += o_row[h] * do_row[h];
    p.delta[p.stat(b, n, t0 + i)] = sum - p.dlse[p.stat(b, n, t0 + i)];
  }
}

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
