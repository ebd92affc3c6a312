// Packing: copies a block of rows of a BTNH/BSKH operand into a contiguous float32
// tile, widening 16-bit inputs once per call (not once per use) and zero-filling the
// padding so that padded lanes contribute nothing to any product. The backward's
// D = rowsum(dO ∘ O) − dlse is computed while dO is packed.
#pragma once

#include <cmath>

#include "cpu/convert.h"
#include "cpu/problem.h"
#include "cpu/tiling.h"
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
JAX_FLASH_INLINE void PackRows(const RowBlock& src, float factor, int64_t padded_rows, int64_t ld, float* tile) {
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
JAX_FLASH_INLINE void PackTransposed(const RowBlock& src, int64_t padded_cols, int64_t ld, float* row_buffer,
                                     float* tile) {
  for (int64_t j = 0; j < src.rows; ++j) {
    LoadRow(src.base, src.type, src.first + j * src.stride, src.cols, row_buffer);
    for (int64_t h = 0; h < src.cols; ++h) tile[h * ld + j] = row_buffer[h];
  }
  for (int64_t h = 0; h < src.cols; ++h)
    for (int64_t j = src.rows; j < padded_cols; ++j) tile[h * ld + j] = 0.0f;
}

// NaN/±inf -> 0 in a packed operand that meets masked (zero) weights in a product (V in
// O += P·V, K in dQ += dS·K, Q in dK += dSᵀ·Q): 0·NaN would carry a masked-out poisoned
// key or query into rows that do not see it. The poison travels through the scores, lse
// and D instead (softmax.h).
JAX_FLASH_INLINE void ZeroNonFinite(float* tile, int64_t n) {
  for (int64_t i = 0; i < n; ++i) tile[i] = std::isfinite(tile[i]) ? tile[i] : 0.0f;
}

// The `keys` rows of key block (b, kv head g, first key s0) of k, or of v (`values`): in
// place in a contiguous cache. A paged cache's rows lie on several pages, so they are copied,
// still in the input dtype, into `staging` (kBlockK x max(H, Hv) elements) first.
inline RowBlock KeyRows(const Problem& p, int64_t b, int64_t g, int64_t s0, int64_t keys, bool values, float* staging) {
  const int64_t width = values ? p.value_dim() : p.head_dim;
  const void* src = values ? p.v : p.k;
  if (p.page_table == nullptr)
    return {src, p.dtype, (p.key_row(b, s0) * p.kv_heads + g) * width, p.kv_heads * width, keys, width};
  const int64_t bytes = width * (p.dtype == ElementType::kF32 ? 4 : 2);
  char* dst = reinterpret_cast<char*>(staging);
  for (int64_t j = 0; j < keys; ++j)
    std::memcpy(dst + j * bytes, static_cast<const char*>(src) + (p.key_row(b, s0 + j) * p.kv_heads + g) * bytes,
                bytes);
  return {staging, p.dtype, 0, width, keys, width};
}

// bad[j] = 1 where value row j of `v` holds a NaN/±inf (which the packed V has as zeros), 0
// elsewhere and past its rows, for j < kBlockK; bad[kBlockK]: whether any does.
// `row_buffer` holds v.cols floats.
inline void FindNonFiniteRows(const RowBlock& v, int32_t* bad, float* row_buffer) {
  bool any = false;
  for (int64_t j = 0; j < kBlockK; ++j) {
    bool finite = true;
    if (j < v.rows) {
      LoadRow(v.base, v.type, v.first + j * v.stride, v.cols, row_buffer);
      for (int64_t h = 0; h < v.cols; ++h) finite &= std::isfinite(row_buffer[h]);
    }
    bad[j] = finite ? 0 : 1;
    any |= !finite;
  }
  bad[kBlockK] = any ? 1 : 0;
}

// The forward's record of key block `item`'s bad value rows: p.packed.bad_values, once per
// call and key block, so that no tile widens V again.
inline void FindNonFiniteValues(const Problem& p, int64_t item, float* row_buffer) {
  const auto [b, g, s0, keys] = KeyBlockOf(p, item);
  FindNonFiniteRows(KeyRows(p, b, g, s0, keys, true, nullptr), p.packed.bad_values + item * (kBlockK + 1), row_buffer);
}

// The flags of the key block at (b, g, s0) for UpdateOnlineSoftmax: null when none of
// its value rows is bad.
inline const int32_t* NonFiniteValues(const Problem& p, int64_t b, int64_t g, int64_t s0) {
  const int32_t* bad = p.packed.bad_values + KeyBlockIndex(p, b, g, s0) * (kBlockK + 1);
  return bad[kBlockK] != 0 ? bad : nullptr;
}

// Where one key block's packed layouts go (the null ones are skipped): a block of the
// forward's prepass (Problem::Packed), or a backward worker's own buffers.
struct KeyBlockLayouts {
  float* k_t;  // Kᵀ
  float* v_t;  // Vᵀ
  float* k;    // K rows
  float* v;    // V rows
};
// The forward's prepass buffers of key block `item`: Kᵀ and V rows.
inline KeyBlockLayouts PackedKeyBlock(const Problem& p, int64_t item) {
  const int64_t offset = item * KeyBlockFloats(p);
  return {p.packed.k_t + offset, nullptr, nullptr, p.packed.v + offset};
}

// Packs the key block `block` of every layout `dst` asks for, in float32.
// `row_buffer` holds max(H, Hv) floats.
inline void PackKeyBlock(const Problem& p, const KeyBlockItem& block, const KeyBlockLayouts& dst, float* row_buffer) {
  const auto [b, g, s0, keys] = block;
  const int64_t ld = RowStride(p);
  const RowBlock k = KeyRows(p, b, g, s0, keys, false, nullptr);
  const RowBlock v = KeyRows(p, b, g, s0, keys, true, nullptr);
  if (dst.k_t != nullptr) PackTransposed(k, kBlockK, kKeyStride, row_buffer, dst.k_t);
  if (dst.v_t != nullptr) PackTransposed(v, kBlockK, kKeyStride, row_buffer, dst.v_t);
  if (dst.k != nullptr) {
    PackRows(k, 1.0f, kBlockK, ld, dst.k);
    ZeroNonFinite(dst.k, kBlockK * ld);
  }
  if (dst.v != nullptr) {
    PackRows(v, 1.0f, kBlockK, ld, dst.v);
    ZeroNonFinite(dst.v, kBlockK * ld);
  }
}

// Backward: packs query block `block` = (b, head n, rows from t0): scale · Q rows into
// q_dst and dO rows into dout_dst (QueryBlockFloats each), and computes D = rowsum(dO ∘ O)
// − dlse (FlashAttention-2 Alg. 2, line 4) for its rows. `row_buffer` holds Hv floats.
inline void PackQueryBlock(const Problem& p, const QueryBlockItem& block, float* q_dst, float* dout_dst,
                           float* row_buffer) {
  const auto [b, n, t0, rows] = block;
  const int64_t ld = RowStride(p);
  const int64_t hv = p.value_dim();
  // Finite: the backward's scores need no poisoned q, a poisoned row's lse is NaN.
  PackRows({p.q, p.dtype, p.q_row(b, t0, n), p.q_heads * p.head_dim, rows, p.head_dim}, p.scale, kBlockQ, ld, q_dst);
  ZeroNonFinite(q_dst, kBlockQ * ld);
  PackRows({p.dout, p.dtype, p.o_row(b, t0, n), p.q_heads * hv, rows, hv}, 1.0f, kBlockQ, ld, dout_dst);
  const float* dout = dout_dst;
  for (int64_t i = 0; i < rows; ++i) {
    LoadRow(p.out, p.dtype, p.o_row(b, t0 + i, n), hv, row_buffer);
    float sum = 0.0f;
    for (int64_t h = 0; h < hv; ++h) sum += row_buffer[h] * dout[i * ld + h];
    p.delta[p.stat(b, n, t0 + i)] = sum - p.dlse[p.stat(b, n, t0 + i)];
  }
}

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
