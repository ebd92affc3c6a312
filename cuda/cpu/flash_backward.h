// The backward pass of FlashAttention-2 (Alg. 2), deterministic and without atomics:
//  1. ComputeDelta: D = rowsum(dO ∘ O) − dlse per (b, n, t).
//  2. KeyValueGradientTile: one work item per (b, kv head, key block) holds dK, dV of
//     its keys in float32 and visits every query block of every head of the GQA group
//     that can see them — the group sum happens in a fixed order, in registers/L2.
//  3. QueryGradientTile: one work item per (b, head, query block) holds dQ and visits
//     the visible key blocks.
// Both passes recompute S and P = exp(S − lse) from Q, K and the saved lse instead of
// storing probabilities; pass 3 recomputes what pass 2 already did once, the price of
// owning every output element by exactly one work item.
#pragma once

#include "cpu/convert.h"
#include "cpu/problem.h"
#include "cpu/score_mask.h"
#include "cpu/softmax.h"
#include "cpu/tile_gemm.h"
#include "cpu/tile_pack.h"
#include "cpu/tiling.h"
#include "cpu/vec.h"

namespace jax_flash {
namespace cpu {
namespace JAX_FLASH_CPU_ISA {

// Buffers of one backward worker (both passes).
struct BackwardTiles {
  int64_t head_dim_padded;  // Hp
  float* q;          // [kBlockQ][Hp]  scale · Q
  float* dout;       // [kBlockQ][Hp]  dO
  float* k_t;        // [H][kBlockK]   Kᵀ
  float* v_t;        // [H][kBlockK]   Vᵀ
  float* k;          // [kBlockK][Hp]  K (pass 3)
  float* s;          // [kBlockQ][kBlockK]  scores, then P
  float* ds;         // [kBlockQ][kBlockK]  dP, then dS
  float* softcap_derivative;  // [kBlockQ][kBlockK]
  float* dk;         // [kBlockK][Hp]  scale · Σ dSᵀ Q (pass 2)
  float* dv;         // [kBlockK][Hp]  Σ Pᵀ dO (pass 2)
  float* dq;         // [kBlockQ][Hp]  Σ dS K (pass 3)
  float* lse;        // [kBlockQ] (+inf for rows that saw nothing)
  float* delta;      // [kBlockQ]
  float* row;        // [H]
  int32_t* segments; // [kBlockK]
  int64_t floats;

  BackwardTiles(const Problem& p, float* base) {
    WorkspaceCarver w(base);
    head_dim_padded = RoundUp(p.head_dim, kLanes);
    const int64_t hp = head_dim_padded;
    q = w.Take(kBlockQ * hp);
    dout = w.Take(kBlockQ * hp);
    k_t = w.Take(p.head_dim * kBlockK);
    v_t = w.Take(p.head_dim * kBlockK);
    k = w.Take(kBlockK * hp);
    s = w.Take(kBlockQ * kBlockK);
    ds = w.Take(kBlockQ * kBlockK);
    softcap_derivative = w.Take(kBlockQ * kBlockK);
    dk = w.Take(kBlockK * hp);
    dv = w.Take(kBlockK * hp);
    dq = w.Take(kBlockQ * hp);
    lse = w.Take(kBlockQ);
    delta = w.Take(kBlockQ);
    row = w.Take(p.head_dim);
    segments = reinterpret_cast<int32_t*>(w.Take(kBlockK));
    floats = w.used();
  }
};

// D = rowsum(dO ∘ O) − dlse for the rows of one (b, n, query block) item.
inline void ComputeDelta(const Problem& p, int64_t item, float* workspace) {
  const int64_t blocks = QueryBlocks(p);
  const int64_t b = item / (p.q_heads * blocks);
  const int64_t n = item / blocks % p.q_heads;
  const int64_t t0 = item % blocks * kBlockQ;
  const int64_t rows = std::min(kBlockQ, p.q_len - t0);
  float* out_row = workspace;
  float* dout_row = workspace + RoundUp(p.head_dim, kAlignFloats);
  for (int64_t t = t0; t < t0 + rows; ++t) {
    LoadRow(p.out, p.dtype, p.q_row(b, t, n), p.head_dim, out_row);
    LoadRow(p.dout, p.dtype, p.q_row(b, t, n), p.head_dim, dout_row);
    float sum = 0.0f;
    for (int64_t h = 0; h < p.head_dim; ++h) sum += out_row[h] * dout_row[h];
    p.delta[p.stat(b, n, t)] = sum - p.dlse[p.stat(b, n, t)];
  }
}

// Loads Q (scaled), dO, lse and D of query rows [t0, t0 + rows) of head n.
inline void PackQueryRows(const Problem& p, BackwardTiles& w, int64_t b, int64_t n, int64_t t0,
                          int64_t rows, int64_t rows_padded) {
  const int64_t stride = p.q_heads * p.head_dim;
  PackRows({p.q, p.dtype, p.q_row(b, t0, n), stride, rows, p.head_dim}, p.scale, rows_padded,
           w.head_dim_padded, w.q);
  PackRows({p.dout, p.dtype, p.q_row(b, t0, n), stride, rows, p.head_dim}, 1.0f, rows_padded,
           w.head_dim_padded, w.dout);
  for (int64_t i = 0; i < rows_padded; ++i) {
    const float lse = i < rows ? p.lse_in[p.stat(b, n, t0 + i)] : -__builtin_inff();
    // A row that saw no key has lse = -inf; +inf makes its recomputed P exactly 0.
    w.lse[i] = lse == -__builtin_inff() ? __builtin_inff() : lse;
    w.delta[i] = i < rows ? p.delta[p.stat(b, n, t0 + i)] : 0.0f;
  }
}

// The part of a backward tile both passes share: recompute P from the scores and the
// saved lse, dP = dO Vᵀ, and dS = P ∘ (dP − D) (∘ the soft cap's derivative).
// Expects w.q, w.dout, w.lse, w.delta (query rows) and w.k_t, w.v_t (keys) packed.
inline void RecomputeTileGradient(const Problem& p, BackwardTiles& w, const MaskGeometry& mask,
                                  const ScoreTile& s, TileVisibility visibility) {
  const int64_t hp = w.head_dim_padded;
  Gemm<false, Accumulate::kOverwrite>(s.rows_padded, s.cols_padded, p.head_dim, w.q, hp, w.k_t,
                                      kBlockK, w.s, kBlockK);
  const bool capped = p.softcap > 0.0f;
  if (capped) ApplySoftCap(s, p.softcap, w.softcap_derivative);
  if (visibility == TileVisibility::kPartial) MaskScores(s, mask, w.segments);
  RecomputeProbabilities(s, w.lse);
  Gemm<false, Accumulate::kOverwrite>(s.rows_padded, s.cols_padded, p.head_dim, w.dout, hp, w.v_t,
                                      kBlockK, w.ds, kBlockK);
  ComputeScoreGradient(s, w.ds, w.delta, capped ? w.softcap_derivative : nullptr);
}

// Packs Kᵀ and Vᵀ of keys [s0, s0 + cols) of kv head g (and K itself when `rows_too`).
inline void PackKeyColumns(const Problem& p, BackwardTiles& w, int64_t b, int64_t g, int64_t s0,
                           int64_t cols, int64_t cols_padded, bool rows_too) {
  const int64_t stride = p.kv_heads * p.head_dim;
  const RowBlock k{p.k, p.dtype, p.kv_row(b, s0, g), stride, cols, p.head_dim};
  const RowBlock v{p.v, p.dtype, p.kv_row(b, s0, g), stride, cols, p.head_dim};
  PackTransposed(k, cols_padded, kBlockK, w.row, w.k_t);
  PackTransposed(v, cols_padded, kBlockK, w.row, w.v_t);
  if (rows_too) PackRows(k, 1.0f, cols_padded, w.head_dim_padded, w.k);
}

// Pass 2: dK and dV of one (b, kv head, key block).
inline void KeyValueGradientTile(const Problem& p, int64_t item, float* workspace) {
  const int64_t blocks = KeyBlocks(p);
  const int64_t b = item / (p.kv_heads * blocks);
  const int64_t g = item / blocks % p.kv_heads;
  const int64_t s0 = item % blocks * kBlockK;
  const int64_t keys = std::min(kBlockK, p.kv_len - s0);
  const MaskGeometry mask(p, b);
  const int64_t cols = std::clamp<int64_t>(mask.kv_valid - s0, 0, keys);  // visible at all
  for (int64_t j = cols; j < keys; ++j) {  // keys past the length get no gradient
    StoreZeros(p.dtype, p.kv_row(b, s0 + j, g), p.head_dim, p.dk);
    StoreZeros(p.dtype, p.kv_row(b, s0 + j, g), p.head_dim, p.dv);
  }
  if (cols == 0) return;

  BackwardTiles w(p, workspace);
  const int64_t hp = w.head_dim_padded;
  const int64_t cols_padded = RoundUp(cols, kLanes);
  PackKeyColumns(p, w, b, g, s0, cols, cols_padded, false);
  for (int64_t i = 0; i < cols_padded * hp; ++i) w.dk[i] = w.dv[i] = 0.0f;

  // The query rows that can see any of these keys form one interval.
  const KeyInterval rows_seen = mask.rows_of_keys(s0, s0 + cols);
  for (int64_t n = g * p.group_size(); n < (g + 1) * p.group_size(); ++n) {
    for (int64_t t0 = rows_seen.lo; t0 < rows_seen.hi; t0 += kBlockQ) {
      const int64_t rows = std::min(kBlockQ, rows_seen.hi - t0);
      const TileVisibility visibility = ClassifyTile(mask, t0, rows, s0, cols, cols_padded != cols);
      if (visibility == TileVisibility::kSkip) continue;
      const int64_t rows_padded = RoundUp(rows, kGemmRows);
      PackQueryRows(p, w, b, n, t0, rows, rows_padded);
      const ScoreTile s{w.s, kBlockK, t0, rows, rows_padded, s0, cols, cols_padded};
      RecomputeTileGradient(p, w, mask, s, visibility);
      // dV += Pᵀ dO;  dK += dSᵀ (scale · Q). Only the tile's real rows are summed.
      Gemm<true, Accumulate::kAdd>(cols_padded, hp, rows, w.s, kBlockK, w.dout, hp, w.dv, hp);
      Gemm<true, Accumulate::kAdd>(cols_padded, hp, rows, w.ds, kBlockK, w.q, hp, w.dk, hp);
    }
  }
  for (int64_t j = 0; j < cols; ++j) {
    StoreRow(w.dk + j * hp, 1.0f, p.dtype, p.kv_row(b, s0 + j, g), p.head_dim, p.dk);
    StoreRow(w.dv + j * hp, 1.0f, p.dtype, p.kv_row(b, s0 + j, g), p.head_dim, p.dv);
  }
}

// Pass 3: dQ of one (b, head, query block); dq_accum receives it in float32.
inline void QueryGradientTile(const Problem& p, int64_t item, float* workspace) {
  const int64_t blocks = QueryBlocks(p);
  const int64_t b = item / (p.q_heads * blocks);
  const int64_t n = item / blocks % p.q_heads;
  const int64_t g = n / p.group_size();
  const int64_t t0 = item % blocks * kBlockQ;
  const int64_t rows = std::min(kBlockQ, p.q_len - t0);
  const MaskGeometry mask(p, b);
  const int64_t live_rows = std::clamp<int64_t>(mask.q_valid - t0, 0, rows);
  for (int64_t t = t0 + live_rows; t < t0 + rows; ++t) {  // padding rows get no gradient
    StoreZeros(p.dtype, p.q_row(b, t, n), p.head_dim, p.dq);
    StoreZeros(ElementType::kF32, p.q_row(b, t, n), p.head_dim, p.dq_accum);
  }
  if (live_rows == 0) return;

  BackwardTiles w(p, workspace);
  const int64_t hp = w.head_dim_padded;
  const int64_t rows_padded = RoundUp(live_rows, kGemmRows);
  PackQueryRows(p, w, b, n, t0, live_rows, rows_padded);
  for (int64_t i = 0; i < rows_padded * hp; ++i) w.dq[i] = 0.0f;

  const KeyInterval first = mask.keys_of_row(t0);
  const KeyInterval last = mask.keys_of_row(t0 + live_rows - 1);
  for (int64_t s0 = first.lo / kBlockK * kBlockK; s0 < last.hi; s0 += kBlockK) {
    const int64_t cols = std::min(kBlockK, last.hi - s0);
    const int64_t cols_padded = RoundUp(cols, kLanes);
    const TileVisibility visibility =
        ClassifyTile(mask, t0, live_rows, s0, cols, cols_padded != cols);
    if (visibility == TileVisibility::kSkip) continue;
    PackKeyColumns(p, w, b, g, s0, cols, cols_padded, true);
    const ScoreTile s{w.s, kBlockK, t0, live_rows, rows_padded, s0, cols, cols_padded};
    RecomputeTileGradient(p, w, mask, s, visibility);
    // dQ += dS K  (the factor scale is applied once, when dQ is written)
    Gemm<false, Accumulate::kAdd>(rows_padded, hp, cols, w.ds, kBlockK, w.k, hp, w.dq, hp);
  }
  for (int64_t i = 0; i < live_rows; ++i) {
    const float* dq_row = w.dq + i * hp;
    StoreRow(dq_row, p.scale, ElementType::kF32, p.q_row(b, t0 + i, n), p.head_dim, p.dq_accum);
    StoreRow(dq_row, p.scale, p.dtype, p.q_row(b, t0 + i, n), p.head_dim, p.dq);
  }
}

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
