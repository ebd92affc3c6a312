// The backward pass of FlashAttention-2 (Alg. 2), deterministic and without atomics:
//  1. PackQueryBlock / PackKeyBlock (tile_pack.h): the operands packed once, and
//     D = rowsum(dO ∘ O) − dlse per (b, n, t).
//  2. KeyValueGradientTile: one work item per (b, kv head, key block) holds dK, dV of
//     its keys in float32 and visits every query block of every head of the GQA group
//     that can see them — the group sum happens in a fixed order, in L2.
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

// Buffers of one backward worker (both passes). Q, dO, Kᵀ, Vᵀ and K come packed.
struct BackwardTiles {
  int64_t head_dim_padded;  // Hp
  int64_t row_stride;       // leading dimension of the dk, dv, dq accumulators and packed rows
  float* s;          // [kBlockQ][kBlockK]  scores, then P
  float* ds;         // [kBlockQ][kBlockK]  dP, then dS
  float* softcap_derivative;  // [kBlockQ][kBlockK]
  float* dk;         // [kBlockK][RowStride]  Σ dSᵀ (scale · Q)  (pass 2)
  float* dv;         // [kBlockK][RowStride]  Σ Pᵀ dO            (pass 2)
  float* dq;         // [kBlockQ][RowStride]  Σ dS K             (pass 3)
  float* lse;        // [kBlockQ] (+inf for rows that saw nothing)
  float* delta;      // [kBlockQ]
  int32_t* segments; // [kBlockK]
  int64_t floats;

  BackwardTiles(const Problem& p, float* base) {
    WorkspaceCarver w(base);
    head_dim_padded = PaddedHeadDim(p);
    row_stride = RowStride(p);
    const int64_t hp = row_stride;
    s = w.Take(kBlockQ * kBlockK);
    ds = w.Take(kBlockQ * kBlockK);
    softcap_derivative = w.Take(kBlockQ * kBlockK);
    dk = w.Take(kBlockK * hp);
    dv = w.Take(kBlockK * hp);
    dq = w.Take(kBlockQ * hp);
    lse = w.Take(kBlockQ);
    delta = w.Take(kBlockQ);
    segments = reinterpret_cast<int32_t*>(w.Take(kBlockK));
    floats = w.used();
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

inline const float* PackedQuery(const Problem& p, const float* packed, int64_t b, int64_t n,
                                int64_t t0) {
  return packed + QueryBlockIndex(p, b, n, t0) * QueryBlockFloats(p);
}
inline const float* PackedKey(const Problem& p, const float* packed, int64_t b, int64_t g,
                              int64_t s0) {
  return packed + KeyBlockIndex(p, b, g, s0) * KeyBlockFloats(p);
}

// Loads lse and D of query rows [t0, t0 + rows) of head n, padded to rows_padded.
inline void LoadRowStatistics(const Problem& p, BackwardTiles& w, int64_t b, int64_t n, int64_t t0,
                              int64_t rows, int64_t rows_padded) {
  for (int64_t i = 0; i < rows_padded; ++i) {
    const float lse = i < rows ? p.lse_in[p.stat(b, n, t0 + i)] : -__builtin_inff();
    // A row that saw no key has lse = -inf; +inf makes its recomputed P exactly 0.
    w.lse[i] = lse == -__builtin_inff() ? __builtin_inff() : lse;
    w.delta[i] = i < rows ? p.delta[p.stat(b, n, t0 + i)] : 0.0f;
  }
}

// The part of a backward tile both passes share: recompute P from the scores and the
// saved lse, dP = dO Vᵀ, and dS = P ∘ (dP − D) (∘ the soft cap's derivative).
inline void RecomputeTileGradient(const Problem& p, BackwardTiles& w, const MaskGeometry& mask,
                                  const TileOperands& in, const ScoreTile& s,
                                  TileVisibility visibility) {
  const int64_t ld = w.row_stride;
  Gemm<false, Accumulate::kOverwrite>(s.rows_padded, s.cols_padded, p.head_dim, in.q, ld, in.k_t,
                                      kKeyStride, w.s, kBlockK);
  PoisonInfiniteScores(s);
  const bool capped = p.softcap > 0.0f;
  if (capped) ApplySoftCap(s, p.softcap, w.softcap_derivative);
  if (visibility == TileVisibility::kPartial) MaskScores(s, mask, w.segments);
  RecomputeProbabilities(s, w.lse);
  Gemm<false, Accumulate::kOverwrite>(s.rows_padded, s.cols_padded, p.head_dim, in.dout, ld,
                                      in.v_t, kKeyStride, w.ds, kBlockK);
  ComputeScoreGradient(s, w.ds, w.delta, capped ? w.softcap_derivative : nullptr);
}

// Pass 2: dK and dV of one (b, kv head, key block).
inline void KeyValueGradientTile(const Problem& p, int64_t item, float* workspace) {
  const auto [b, g, s0, keys] = KeyBlockOf(p, item);
  const MaskGeometry mask(p, b);
  const int64_t cols = std::clamp<int64_t>(mask.kv_valid - s0, 0, keys);  // visible at all
  for (int64_t j = cols; j < keys; ++j) {  // keys past the length get no gradient
    StoreZeros(p.dtype, p.kv_row(b, s0 + j, g), p.head_dim, p.dk);
    StoreZeros(p.dtype, p.kv_row(b, s0 + j, g), p.head_dim, p.dv);
  }
  if (cols == 0) return;

  BackwardTiles w(p, workspace);
  const int64_t hp = w.head_dim_padded;
  const int64_t ld = w.row_stride;
  const int64_t cols_padded = RoundUp(cols, kLanes);
  for (int64_t i = 0; i < cols_padded * ld; ++i) w.dk[i] = w.dv[i] = 0.0f;
  TileOperands in;
  in.k_t = PackedKey(p, p.packed.k_t, b, g, s0);
  in.v_t = PackedKey(p, p.packed.v_t, b, g, s0);

  // The query rows that can see any of these keys form one interval.
  const KeyInterval rows_seen = mask.rows_of_keys(s0, s0 + cols);
  for (int64_t n = g * p.group_size(); n < (g + 1) * p.group_size(); ++n) {
    for (int64_t t0 = rows_seen.lo / kBlockQ * kBlockQ; t0 < rows_seen.hi; t0 += kBlockQ) {
      const int64_t rows = std::min(kBlockQ, rows_seen.hi - t0);
      const TileVisibility visibility = ClassifyTile(mask, t0, rows, s0, cols, cols_padded != cols);
      if (visibility == TileVisibility::kSkip) continue;
      const int64_t rows_padded = RoundUp(rows, kGemmRows);
      in.q = PackedQuery(p, p.packed.q, b, n, t0);
      in.dout = PackedQuery(p, p.packed.dout, b, n, t0);
      LoadRowStatistics(p, w, b, n, t0, rows, rows_padded);
      const ScoreTile s{w.s, kBlockK, t0, rows, rows_padded, s0, cols, cols_padded};
      RecomputeTileGradient(p, w, mask, in, s, visibility);
      // dV += Pᵀ dO;  dK += dSᵀ (scale · Q). Only the tile's real rows are summed.
      Gemm<true, Accumulate::kAdd>(cols_padded, hp, rows, w.s, kBlockK, in.dout, ld, w.dv, ld);
      Gemm<true, Accumulate::kAdd>(cols_padded, hp, rows, w.ds, kBlockK, in.q, ld, w.dk, ld);
    }
  }
  for (int64_t j = 0; j < cols; ++j) {
    StoreRow(w.dk + j * ld, 1.0f, p.dtype, p.kv_row(b, s0 + j, g), p.head_dim, p.dk);
    StoreRow(w.dv + j * ld, 1.0f, p.dtype, p.kv_row(b, s0 + j, g), p.head_dim, p.dv);
  }
}

// Pass 3: dQ of one (b, head, query block); dq_accum receives it in float32.
inline void QueryGradientTile(const Problem& p, int64_t item, float* workspace) {
  const auto [b, n, t0, rows] = QueryBlockOf(p, item, /*last_first=*/true);
  const int64_t g = n / p.group_size();
  const MaskGeometry mask(p, b);
  const int64_t live_rows = std::clamp<int64_t>(mask.q_valid - t0, 0, rows);
  for (int64_t t = t0 + live_rows; t < t0 + rows; ++t) {  // padding rows get no gradient
    StoreZeros(p.dtype, p.q_row(b, t, n), p.head_dim, p.dq);
    StoreZeros(ElementType::kF32, p.q_row(b, t, n), p.head_dim, p.dq_accum);
  }
  if (live_rows == 0) return;

  BackwardTiles w(p, workspace);
  const int64_t hp = w.head_dim_padded;
  const int64_t ld = w.row_stride;
  const int64_t rows_padded = RoundUp(live_rows, kGemmRows);
  LoadRowStatistics(p, w, b, n, t0, live_rows, rows_padded);
  for (int64_t i = 0; i < rows_padded * ld; ++i) w.dq[i] = 0.0f;
  TileOperands in;
  in.q = PackedQuery(p, p.packed.q, b, n, t0);
  in.dout = PackedQuery(p, p.packed.dout, b, n, t0);

  const KeyInterval first = mask.keys_of_row(t0);
  const KeyInterval last = mask.keys_of_row(t0 + live_rows - 1);
  for (int64_t s0 = first.lo / kBlockK * kBlockK; s0 < last.hi; s0 += kBlockK) {
    const int64_t cols = std::min(kBlockK, last.hi - s0);
    const int64_t cols_padded = RoundUp(cols, kLanes);
    const TileVisibility visibility =
        ClassifyTile(mask, t0, live_rows, s0, cols, cols_padded != cols);
    if (visibility == TileVisibility::kSkip) continue;
    in.k_t = PackedKey(p, p.packed.k_t, b, g, s0);
    in.v_t = PackedKey(p, p.packed.v_t, b, g, s0);
    in.k = PackedKey(p, p.packed.k, b, g, s0);
    const ScoreTile s{w.s, kBlockK, t0, live_rows, rows_padded, s0, cols, cols_padded};
    RecomputeTileGradient(p, w, mask, in, s, visibility);
    // dQ += dS K  (the factor scale is applied once, when dQ is written)
    Gemm<false, Accumulate::kAdd>(rows_padded, hp, cols, w.ds, kBlockK, in.k, ld, w.dq, ld);
  }
  for (int64_t i = 0; i < live_rows; ++i) {
    const float* dq_row = w.dq + i * ld;
    StoreRow(dq_row, p.scale, ElementType::kF32, p.q_row(b, t0 + i, n), p.head_dim, p.dq_accum);
    StoreRow(dq_row, p.scale, p.dtype, p.q_row(b, t0 + i, n), p.head_dim, p.dq);
  }
}

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
