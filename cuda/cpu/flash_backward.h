// The pieces of the FlashAttention-2 backward (Alg. 2) every backward tile shares: the
// worker's buffers, the packed operands of a (query block, key block) tile, the saved row
// statistics, and the recomputation of P and dS. The pass itself, single and
// deterministic, is in flash_backward_pass.h. S and P = exp(S − lse) are recomputed from
// Q, K and the saved lse instead of storing probabilities.
#pragma once

#include "cpu/convert.h"
#include "cpu/problem.h"
#include "cpu/score_mask.h"
#include "cpu/softmax.h"
#include "cpu/tile_gemm.h"
#include "cpu/tile_pack.h"
#include "cpu/tile_products.h"
#include "cpu/tiling.h"
#include "cpu/vec.h"

namespace jax_flash {
namespace cpu {
namespace JAX_FLASH_CPU_ISA {

// Buffers of one backward worker. The worker packs the key block it works on (Kᵀ, Vᵀ, K)
// into its own buffers; Q and dO come packed, or (GradientTileOwnsQueries) the worker packs
// those of its item's query heads into its own buffers too, where it also holds their dQ.
struct BackwardTiles {
  int64_t head_dim_padded;  // Hp
  int64_t row_stride;       // leading dimension of packed rows
  float* s;          // [kBlockQ][kBlockK]  scores, then P
  float* ds;         // [kBlockQ][kBlockK]  dP, then dS
  float* softcap_derivative;  // [kBlockQ][kBlockK]
  float* dk;         // KeyGradientFloats: the key block's Σ dSᵀ·Q (format: tile_products.h)
  float* dv;         // KeyGradientFloats: Σ Pᵀ·dO
  float* scratch;    // [kProductScratchFloats] the products' own (bf16 P, dS)
  float* key_t;      // KeyBlockFloats: the key block's Kᵀ
  float* value_t;    // KeyBlockFloats: Vᵀ
  float* key_rows;   // KeyBlockFloats: K rows
  float* row;        // [2·RowStride] one gradient row on its way out; rows being packed
  float* group_q;     // GroupQueryFloats (an item owning its query heads, else empty)
  float* group_dout;  // GroupQueryFloats
  float* group_dq;    // GroupQueryFloats: float32 dQ
  float* lse;        // [kBlockQ] (+inf for rows that saw nothing)
  float* delta;      // [kBlockQ]
  int32_t* segments; // [kBlockK]
  float* bias_row;    // [kBlockK] one row of the dense bias (with one)
  int32_t* mask_row;  // [kBlockK] one row of the dense mask (with one)
  int32_t* block_row; // [kBlockK] one row of the block mask (with one)
  int32_t* visible;   // [kBlockQ][kBlockK] the mask's lane masks (a bias with a -inf)
  float* bias_sum;    // [kBlockK] dS summed over a tile's rows (a bias broadcast over T)
  int64_t floats;

  BackwardTiles(const Problem& p, float* base) {
    WorkspaceCarver w(base);
    head_dim_padded = PaddedHeadDim(p);
    row_stride = RowStride(p);
    s = w.Take(kBlockQ * kBlockK);
    ds = w.Take(kBlockQ * kBlockK);
    softcap_derivative = w.Take(kBlockQ * kBlockK);
    dk = w.Take(KeyGradientFloats(p));
    dv = w.Take(KeyGradientFloats(p));
    scratch = w.Take(kProductScratchFloats);
    key_t = w.Take(KeyBlockFloats(p));
    value_t = w.Take(KeyBlockFloats(p));
    key_rows = w.Take(KeyBlockFloats(p));
    row = w.Take(2 * row_stride);
    const int64_t group = GradientTileOwnsQueries(p) ? GroupQueryFloats(p) : 0;
    group_q = w.Take(group);
    group_dout = w.Take(group);
    group_dq = w.Take(group);
    lse = w.Take(kBlockQ);
    delta = w.Take(kBlockQ);
    segments = reinterpret_cast<int32_t*>(w.Take(kBlockK));
    bias_row = w.Take(p.bias.present() ? kBlockK : 0);
    mask_row = reinterpret_cast<int32_t*>(w.Take(p.mask.present() ? kBlockK : 0));
    block_row = reinterpret_cast<int32_t*>(w.Take(p.block_mask.present() ? kBlockK : 0));
    visible = reinterpret_cast<int32_t*>(w.Take(p.bias_hides_pairs() ? kBlockQ * kBlockK : 0));
    bias_sum = w.Take(p.bias.present() ? kBlockK : 0);
    floats = w.used();
  }

  // The dense mask's and the block mask's part of masking head n of batch row b (MaskScores).
  DenseMasking dense(const Problem& p, int64_t b, int64_t n) const {
    return {p.mask.rows(b, n), mask_row, p.bias_hides_pairs() ? visible : nullptr, p.block_mask.rows(b, n), block_row};
  }
};

// The packed operands of one (query block, key block) tile.
struct TileOperands {
  const float* q;     // [kBlockQ][RowStride]  scale · Q
  const float* dout;  // [kBlockQ][RowStride]
  const float* k_t;   // [H][kKeyStride]
  const float* v_t;   // [H][kKeyStride]
  const float* k;     // [kBlockK][RowStride]
};

// Loads lse and D of query rows [t0, t0 + rows) of head n, padded to rows_padded.
inline void LoadRowStatistics(const Problem& p, BackwardTiles& w, int64_t b, int64_t n, int64_t t0, int64_t rows,
                              int64_t rows_padded) {
  for (int64_t i = 0; i < rows_padded; ++i) {
    const float lse = i < rows ? p.lse_in[p.stat(b, n, t0 + i)] : -__builtin_inff();
    // A row that saw no key has lse = -inf; +inf makes its recomputed P exactly 0.
    w.lse[i] = lse == -__builtin_inff() ? __builtin_inff() : lse;
    w.delta[i] = i < rows ? p.delta[p.stat(b, n, t0 + i)] : 0.0f;
  }
}

// Dropout (out = Z V with Z = keep ∘ P / (1 − rate)) on a [rows_padded][ld] tile of head n
// of batch row b:
// kept elements times 1 / (1 − rate), dropped ones 0.
inline void DropTile(const Problem& p, const ScoreTile& s, float* tile, int64_t b, int64_t n) {
  for (int64_t i = 0; i < s.rows_padded; ++i)
    DropRow(tile + i * s.ld, s.cols_padded, p.dropout, b, n, s.t0 + i, s.s0, p.dropout.keep_scale);
}

// The part of a backward tile every pass shares: recompute P from the scores and the
// saved lse, dP = dO Vᵀ, and dS = P ∘ (dP − D) (∘ the soft cap's derivative); with dropout
// dP is the cotangent of P (keep ∘ dO Vᵀ / (1 − rate)) and P leaves as Z for dV; D =
// rowsum(dO ∘ O) is unchanged.
// Products: F32Products or BF16Products (tile_products.h).
template <class Products = F32Products>
void RecomputeTileGradient(const Problem& p, BackwardTiles& w, const MaskGeometry& mask, const TileOperands& in,
                           const ScoreTile& s, TileVisibility visibility, int64_t b, int64_t n) {
  Products::Scores(p, s.rows_padded, s.cols_padded, in.q, in.k_t, w.s);
  if (p.bias.present()) AddBias(s, p.bias.rows(b, n), w.bias_row);
  const bool capped = p.softcap > 0.0f;
  if (capped) ApplySoftCap(s, p.softcap, w.softcap_derivative);
  const DenseMasking dense = w.dense(p, b, n);
  if (visibility == TileVisibility::kPartial) MaskScores(s, mask, w.segments, dense);
  RecomputeProbabilities(s, w.lse, dense.visible);
  Products::ProbabilityGradient(p, s.rows_padded, s.cols_padded, in.dout, in.v_t, w.ds);
  if (p.dropout.on) DropTile(p, s, w.ds, b, n);  // dZ -> dP = keep ∘ dZ / (1 − rate)
  ComputeScoreGradient(s, w.ds, w.delta, capped ? w.softcap_derivative : nullptr);
  if (p.dropout.on) DropTile(p, s, s.data, b, n);  // P -> Z = keep ∘ P / (1 − rate), for dV = Zᵀ dO
}

// dbias += dS of a tile (`ds`, [rows_padded][ld]) through the bias' broadcast strides:
// `target` is the float32 dbias (or a chunk's partial of it) seen as the rows of one (b, n).
// Along a broadcast dim the tile's elements are summed first, in a fixed order (rows in
// order, a row's keys in order), then added once.
// dS is exactly 0 in the padding columns (masked), which the vector sums may therefore read.
inline void AccumulateBiasGradient(const ScoreTile& s, const float* ds, const DenseRows& target, float* column_sum) {
  float* dbias = static_cast<float*>(const_cast<void*>(target.data));
  if (target.stride_t == 0) {  // one dbias row for the whole tile: sum its rows first
    for (int64_t j = 0; j < s.cols_padded; j += kLanes) {
      VecF sum = Load(ds + j);
      for (int64_t i = 1; i < s.rows; ++i) sum += Load(ds + i * s.ld + j);
      Store(column_sum + j, sum);
    }
    ds = column_sum;
  }
  const int64_t rows = target.stride_t == 0 ? 1 : s.rows;
  const int64_t whole = s.cols / kLanes * kLanes;  // dbias itself is written only below cols
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = ds + i * s.ld;
    float* out = dbias + target.at(s.t0 + i, s.s0);
    if (target.stride_s == 0) {
      VecF sum = Load(row);
      for (int64_t j = kLanes; j < s.cols_padded; j += kLanes) sum += Load(row + j);
      out[0] += ReduceSum(sum);
    } else {
      for (int64_t j = 0; j < whole; j += kLanes) Store(out + j, Load(out + j) + Load(row + j));
      for (int64_t j = whole; j < s.cols; ++j) out[j] += row[j];
    }
  }
}

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
