// The single-pass backward of FlashAttention-2 (Alg. 2 order), deterministic and
// without atomics, five tile products per (query block, key block):
//   S = Q·Kᵀ, dP = dO·Vᵀ (RecomputeTileGradient: P = exp(S − lse), dS = P ∘ (dP − D)),
//   dV += Pᵀ·dO, dK += dSᵀ·Q (in the work item's accumulators), dQ += dS·K.
// One work item per (b, kv head, chunk c) visits key blocks c, c + C, c + 2C, ... (C =
// GradientChunks, interleaved so that a causal mask gives every chunk the same work; with a
// dense bias broadcast over B or N, one item runs every batch row or kv head of its chunk,
// so that items own disjoint parts of dbias);
// per key block it holds dK, dV and sums them over every visible query block of every
// head of the GQA group, in a fixed order. dQ goes to the chunk's own float32 partial
// (zeroed when Q is packed); ReduceQueryGradient then adds the C partials of each query
// block in chunk order. Nothing depends on which thread ran what: the same bits for
// every JAX_FLASH_CPU_THREADS.
#pragma once

#include "cpu/convert.h"
#include "cpu/flash_backward.h"
#include "cpu/problem.h"
#include "cpu/score_mask.h"
#include "cpu/softmax.h"
#include "cpu/tile_pack.h"
#include "cpu/tile_products.h"
#include "cpu/tiling.h"
#include "cpu/vec.h"

namespace jax_flash {
namespace cpu {
namespace JAX_FLASH_CPU_ISA {

// Packs query block `block` in the products' format into q_dst and dout_dst, and its D.
inline void PackQueryBlockFor(const Problem& p, const QueryBlockItem& block, float* q_dst, float* dout_dst,
                              float* row_buffer) {
#if defined(JAX_FLASH_CPU_BF16_PRODUCTS)
  if (p.dtype == ElementType::kBF16) return PackQueryBlockBF16(p, block, q_dst, dout_dst, row_buffer);
#endif
  PackQueryBlock(p, block, q_dst, dout_dst, row_buffer);
}

// Where the packed Q, dO and the float32 dQ partial of chunk `chunk` of query block (b, n,
// t0) lie: in the call's packed operands, or, when the work item owns its query heads
// (GradientTileOwnsQueries), in the worker's own buffers (BackwardTiles::group_*).
struct QueryBlockOperands {
  float* q;
  float* dout;
  float* dq;
};
inline QueryBlockOperands QueryOperands(const Problem& p, const BackwardTiles& w, int64_t chunk, int64_t b, int64_t n,
                                        int64_t t0) {
  if (GradientTileOwnsQueries(p)) {
    const int64_t offset = ((n % p.group_size()) * QueryBlocks(p) + t0 / kBlockQ) * QueryBlockFloats(p);
    return {w.group_q + offset, w.group_dout + offset, w.group_dq + offset};
  }
  const int64_t block = QueryBlockIndex(p, b, n, t0);
  return {p.packed.q + block * QueryBlockFloats(p), p.packed.dout + block * QueryBlockFloats(p),
          p.packed.dq_partial + (chunk * QueryItems(p) + block) * QueryBlockFloats(p)};
}

// Pack step of the backward (when the items do not own their query heads): Q, dO (and D)
// of query block `item` in the products' format, and the block's dQ partials zeroed.
inline void PrepareQueryBlock(const Problem& p, int64_t item, float* row_buffer) {
  const int64_t offset = item * QueryBlockFloats(p);
  PackQueryBlockFor(p, QueryBlockOf(p, item), p.packed.q + offset, p.packed.dout + offset, row_buffer);
  for (int64_t c = 0; c < GradientChunks(p); ++c) {
    float* partial = p.packed.dq_partial + (c * QueryItems(p) + item) * QueryBlockFloats(p);
    for (int64_t i = 0; i < QueryBlockFloats(p); ++i) partial[i] = 0.0f;
  }
}

// Packs key block `block` in the products' format into `dst`.
inline void PackKeyBlockFor(const Problem& p, const KeyBlockItem& block, const KeyBlockLayouts& dst,
                            float* row_buffer) {
#if defined(JAX_FLASH_CPU_BF16_PRODUCTS)
  if (p.dtype == ElementType::kBF16) return PackKeyBlockBF16(p, block, dst);
#endif
  PackKeyBlock(p, block, dst, row_buffer);
}

// The forward's prepass (Problem::Packed): key block `item` packed, and its bad value rows
// found, once per call before the tiles.
inline void PrepareKeyBlock(const Problem& p, int64_t item, float* row_buffer) {
  if (p.packed.bad_values != nullptr) FindNonFiniteValues(p, item, row_buffer);
  PackKeyBlockFor(p, KeyBlockOf(p, item), PackedKeyBlock(p, item), row_buffer);
}

// f(block) for every query block of the heads of kv head g in batch row b, in order.
template <class F>
void ForEachGroupQueryBlock(const Problem& p, int64_t b, int64_t g, F f) {
  for (int64_t n = g * p.group_size(); n < (g + 1) * p.group_size(); ++n)
    for (int64_t t0 = 0; t0 < p.q_len; t0 += kBlockQ) f(QueryBlockItem{b, n, t0, std::min(kBlockQ, p.q_len - t0)});
}

// An item that owns its query heads (GradientTileOwnsQueries) packs the Q and dO of every
// query block of the heads of kv head g (computing their D) into its own buffers, and
// zeroes its dQ, before its first key block.
inline void PackGroupQueries(const Problem& p, BackwardTiles& w, int64_t b, int64_t g) {
  ForEachGroupQueryBlock(p, b, g, [&](const QueryBlockItem& block) {
    const QueryBlockOperands query = QueryOperands(p, w, 0, b, block.n, block.t0);
    PackQueryBlockFor(p, block, query.q, query.dout, w.row);
  });
  for (int64_t i = 0; i < GroupQueryFloats(p); ++i) w.group_dq[i] = 0.0f;
}

// dK = factor · accumulator and dV rows of keys [s0, s0 + cols) of kv head g.
template <class Products>
void StoreKeyValueGradients(const Problem& p, const BackwardTiles& w, int64_t b, int64_t g, int64_t s0, int64_t cols) {
  const float factor = Products::KeyGradientFactor(p);
  for (int64_t j = 0; j < cols; ++j) {
    for (int64_t h = 0; h < p.head_dim; ++h) w.row[h] = w.dk[Products::KeyGradientIndex(p, j, h)];
    StoreRow(w.row, factor, p.dtype, p.kv_row(b, s0 + j, g), p.head_dim, p.dk);
    for (int64_t h = 0; h < p.value_dim(); ++h) w.row[h] = w.dv[Products::KeyGradientIndex(p, j, h)];
    StoreRow(w.row, 1.0f, p.dtype, p.v_row(b, s0 + j, g), p.value_dim(), p.dv);
  }
}

// Where the dS of head n of batch row b goes in dbias: its rows of the float32 dbias, or of
// the chunk's partial of it (BiasGradientPartials).
inline DenseRows BiasGradientRows(const Problem& p, int64_t chunk, int64_t b, int64_t n) {
  DenseRows rows = p.bias.rows(b, n);
  rows.dtype = ElementType::kF32;
  rows.data = p.dbias_partial != nullptr ? p.dbias_partial + chunk * p.bias.elements() : p.dbias;
  return rows;
}

// Key block `block` (of chunk `chunk`) of (batch row b, kv head g): its dK, dV, its part of
// the chunk's dQ partials and of dbias.
template <class Products>
void GradientKeyBlock(const Problem& p, BackwardTiles& w, const MaskGeometry& mask, int64_t b, int64_t g, int64_t chunk,
                      int64_t block) {
  TileOperands in;
  const int64_t s0 = block * kBlockK;
  const int64_t keys = std::min(kBlockK, p.kv_len - s0);
  const int64_t cols = std::clamp<int64_t>(mask.kv_valid - s0, 0, keys);  // visible at all
  for (int64_t j = cols; j < keys; ++j) {  // keys past the length get no gradient
    StoreZeros(p.dtype, p.kv_row(b, s0 + j, g), p.head_dim, p.dk);
    StoreZeros(p.dtype, p.v_row(b, s0 + j, g), p.value_dim(), p.dv);
  }
  if (cols == 0) return;
  const int64_t cols_padded = RoundUp(cols, kLanes);
  for (int64_t i = 0; i < KeyGradientFloats(p); ++i) w.dk[i] = w.dv[i] = 0.0f;
  // One item visits each key block: it packs the block's Kᵀ, Vᵀ and K itself, when it
  // starts on it (no copy of the whole K and V in the packed layouts).
  PackKeyBlockFor(p, {b, g, s0, keys}, {w.key_t, w.value_t, w.key_rows, nullptr}, w.row);
  in.k_t = w.key_t;
  in.v_t = w.value_t;
  in.k = w.key_rows;

  // The query rows that can see any of these keys form one interval.
  const KeyInterval rows_seen = mask.rows_of_keys(s0, s0 + cols);
  for (int64_t n = g * p.group_size(); n < (g + 1) * p.group_size(); ++n) {
    const BlockRows blocks = p.block_mask.rows(b, n);
    for (int64_t t0 = rows_seen.lo / kBlockQ * kBlockQ; t0 < rows_seen.hi; t0 += kBlockQ) {
      const int64_t rows = std::min(kBlockQ, rows_seen.hi - t0);
      const TileVisibility visibility = ClassifyTile(mask, t0, rows, s0, cols, cols_padded != cols, blocks);
      if (visibility == TileVisibility::kSkip) continue;
      CountTile(tile_counts.backward);
      const int64_t rows_padded = RoundUp(rows, kGemmRows);
      const QueryBlockOperands query = QueryOperands(p, w, chunk, b, n, t0);
      in.q = query.q;
      in.dout = query.dout;
      LoadRowStatistics(p, w, b, n, t0, rows, rows_padded);
      const ScoreTile s{w.s, kBlockK, t0, rows, rows_padded, s0, cols, cols_padded};
      RecomputeTileGradient<Products>(p, w, mask, in, s, visibility, b, n);
      if (p.dbias != nullptr) AccumulateBiasGradient(s, w.ds, BiasGradientRows(p, chunk, b, n), w.bias_sum);
      Products::AccumulateKeyValueGradients(p, rows, cols_padded, w.s, w.ds, in.q, in.dout, w.scratch, w.dk, w.dv);
      Products::AccumulateQueryGradient(p, rows_padded, cols, w.ds, in.k, w.scratch, query.dq);
    }
  }
  StoreKeyValueGradients<Products>(p, w, b, g, s0, cols);
}

// One item: a chunk of the key blocks of (b, g), or of every batch row / kv head where the
// bias broadcasts over them (tiling.h GradientBatchItems), those in order per key block, so
// that the key block's part of dbias stays in cache while they add to it.
template <class Products>
void GradientTileWith(const Problem& p, int64_t item, float* workspace) {
  const int64_t chunks = GradientChunks(p);
  const int64_t chunk = item % chunks;
  const int64_t owner = item / chunks;
  const bool every_row = GradientBatchItems(p) == 1, every_head = GradientKvHeadItems(p) == 1;
  const int64_t b_begin = every_row ? 0 : owner / GradientKvHeadItems(p);
  const int64_t b_end = every_row ? p.batch : b_begin + 1;
  const int64_t g_begin = every_head ? 0 : owner % GradientKvHeadItems(p);
  const int64_t g_end = every_head ? p.kv_heads : g_begin + 1;
  BackwardTiles w(p, workspace);
  const bool owns_queries = GradientTileOwnsQueries(p);
  if (owns_queries) PackGroupQueries(p, w, b_begin, g_begin);
  for (int64_t block = chunk; block < KeyBlocks(p); block += chunks) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      const MaskGeometry mask(p, b);
      for (int64_t g = g_begin; g < g_end; ++g) GradientKeyBlock<Products>(p, w, mask, b, g, chunk, block);
    }
  }
  if (owns_queries) {
    ForEachGroupQueryBlock(p, b_begin, g_begin, [&](const QueryBlockItem& block) {
      StoreQueryGradient(p, block, w.row,
                         [&](int64_t c) { return QueryOperands(p, w, c, block.b, block.n, block.t0).dq; });
    });
  }
}

inline void GradientTile(const Problem& p, int64_t item, float* workspace) {
#if defined(JAX_FLASH_CPU_BF16_PRODUCTS)
  if (p.dtype == ElementType::kBF16) return GradientTileWith<BF16Products>(p, item, workspace);
#endif
  GradientTileWith<F32Products>(p, item, workspace);
}

// dQ of query block `block` = scale · Σ_c partial(c), c = 0, 1, ... in order; into dq,
// and dq_accum (float32) when the call has one. Rows at or past the query length get
// zeros. `row_buffer` holds H floats.
template <class Partial>
void StoreQueryGradient(const Problem& p, const QueryBlockItem& block, float* row_buffer, Partial partial) {
  const auto [b, n, t0, rows] = block;
  const MaskGeometry mask(p, b);
  const int64_t live_rows = std::clamp<int64_t>(mask.q_valid - t0, 0, rows);
  const int64_t ld = RowStride(p);
  for (int64_t i = 0; i < live_rows; ++i) {
    const float* first = partial(0) + i * ld;
    for (int64_t h = 0; h < p.head_dim; ++h) row_buffer[h] = first[h];
    for (int64_t c = 1; c < GradientChunks(p); ++c) {
      const float* next = partial(c) + i * ld;
      for (int64_t h = 0; h < p.head_dim; ++h) row_buffer[h] += next[h];
    }
    if (p.dq_accum != nullptr)
      StoreRow(row_buffer, p.scale, ElementType::kF32, p.q_row(b, t0 + i, n), p.head_dim, p.dq_accum);
    StoreRow(row_buffer, p.scale, p.dtype, p.q_row(b, t0 + i, n), p.head_dim, p.dq);
  }
  for (int64_t t = t0 + live_rows; t < t0 + rows; ++t) {
    StoreZeros(p.dtype, p.q_row(b, t, n), p.head_dim, p.dq);
    if (p.dq_accum != nullptr) StoreZeros(ElementType::kF32, p.q_row(b, t, n), p.head_dim, p.dq_accum);
  }
}

// The reduction step (when the items do not own their query heads), per query block.
inline void ReduceQueryGradient(const Problem& p, int64_t item, float* row_buffer) {
  const QueryBlockItem block = QueryBlockOf(p, item);
  const int64_t index = QueryBlockIndex(p, block.b, block.n, block.t0);
  StoreQueryGradient(p, block, row_buffer, [&](int64_t c) {
    return p.packed.dq_partial + (c * QueryItems(p) + index) * QueryBlockFloats(p);
  });
}

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
