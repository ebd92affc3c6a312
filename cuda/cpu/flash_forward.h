// The forward pass of FlashAttention-2 (Alg. 1) for one work item: a block of kBlockQ
// query rows of one head, streamed over the key blocks that the mask leaves visible.
#pragma once

#include <cmath>

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

// Buffers of one forward worker. Kᵀ and V come packed per key block (tiling.h).
struct ForwardTiles {
  int64_t head_dim_padded;  // Hp: H rounded up to whole vectors
  int64_t row_stride;       // leading dimension of q and o (RowStride)
  float* q;        // [kBlockQ][RowStride]  scale · Q
  float* s;        // [kBlockQ][kBlockK]  scores, then P
  float* o;        // [kBlockQ][RowStride]  unnormalised output accumulator
  float* m;        // [kBlockQ] running max
  float* l;        // [kBlockQ] running sum
  float* correction;  // [kBlockQ] exp(m_old − m_new)
  int32_t* segments;  // [kBlockK]
  float* bias_row;    // [kBlockK] one row of the dense bias (with one)
  int32_t* mask_row;  // [kBlockK] one row of the dense mask (with one)
  int32_t* block_row; // [kBlockK] one row of the block mask (with one)
  int32_t* visible;   // [kBlockQ][kBlockK] the mask's lane masks (a bias with a -inf)
  float* scratch;       // [kProductScratchFloats] the products' own (bf16 P)
  // Streaming (Problem::stream_keys): the key block this worker visits, packed (Kᵀ, V rows),
  // its value rows' flags, a row buffer, and (paged) its rows in the input dtype.
  float* key_t;
  float* value_rows;
  int32_t* bad_values;  // [kBlockK + 1]
  float* row_buffer;    // [max(H, Hv)]
  float* staging;       // [kBlockK][max(H, Hv)] elements

  ForwardTiles(const Problem& p, float* base) {
    WorkspaceCarver w(base);
    head_dim_padded = PaddedHeadDim(p);
    row_stride = RowStride(p);
    q = w.Take(kBlockQ * row_stride);
    s = w.Take(kBlockQ * kBlockK);
    o = w.Take(kBlockQ * row_stride);
    m = w.Take(kBlockQ);
    l = w.Take(kBlockQ);
    correction = w.Take(kBlockQ);
    segments = reinterpret_cast<int32_t*>(w.Take(kBlockK));
    bias_row = w.Take(p.bias.present() ? kBlockK : 0);
    mask_row = reinterpret_cast<int32_t*>(w.Take(p.mask.present() ? kBlockK : 0));
    block_row = reinterpret_cast<int32_t*>(w.Take(p.block_mask.present() ? kBlockK : 0));
    visible = reinterpret_cast<int32_t*>(w.Take(p.bias_hides_pairs() ? kBlockQ * kBlockK : 0));
    scratch = w.Take(kProductScratchFloats);
    const bool stream = p.stream_keys;
    const int64_t width = std::max(p.head_dim, p.value_dim());
    key_t = w.Take(stream ? KeyBlockFloats(p) : 0);
    value_rows = w.Take(stream ? KeyBlockFloats(p) : 0);
    bad_values = reinterpret_cast<int32_t*>(w.Take(stream ? kBlockK + 1 : 0));
    row_buffer = w.Take(stream ? width : 0);
    staging = w.Take(stream && p.page_table != nullptr ? kBlockK * width : 0);
    floats = w.used();
  }
  int64_t floats;  // the size of the workspace

  // The dense mask's and the block mask's part of masking head n of batch row b (MaskScores).
  DenseMasking dense(const Problem& p, int64_t b, int64_t n) const {
    return {p.mask.rows(b, n), mask_row, p.bias_hides_pairs() ? visible : nullptr, p.block_mask.rows(b, n), block_row};
  }
};

// Writes rows [i_begin, i_end) of a block that see no key: out = 0, lse = -inf, or with a
// sink lse = sink (a NaN or +inf sink: out and lse NaN).
inline void WriteEmptyRows(const Problem& p, const ForwardBlock& block, int64_t i_begin, int64_t i_end) {
  for (int64_t i = i_begin; i < i_end; ++i) {
    const int64_t n = block.head(i), t = block.position(i);
    const float sink = p.sink(n);
    const bool poisoned = Problem::SinkSum(sink) != Problem::SinkSum(sink);
    if (poisoned) {
      StoreNaNs(p.dtype, p.o_row(block.b, t, n), p.value_dim(), p.out);
    } else {
      StoreZeros(p.dtype, p.o_row(block.b, t, n), p.value_dim(), p.out);
    }
    p.lse[p.stat(block.b, n, t)] = poisoned ? __builtin_nanf("") : sink;
  }
}

// The running state of a block's rows: O [rows][row_stride] (unnormalised), m and l [rows].
struct RowState {
  float* o;
  float* m;
  float* l;
  int64_t row_stride;
};

// out = O / l and lse = m + log l (natural log) for rows that saw a key (or a finite
// sink: out 0, lse = sink); zeros and -inf for empty rows (m = -inf: no key, or only -inf
// logits). A NaN m (a poisoned row, a NaN sink) is not empty: its out and lse come out NaN.
inline void WriteOutputRows(const Problem& p, const RowState& w, const ForwardBlock& block, int64_t rows) {
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t n = block.head(i), t = block.position(i);
    if (w.m[i] != -__builtin_inff()) {
      // Dropout scales the kept weights by 1 / (1 − rate) here, with 1 / l.
      const float factor = p.dropout.on ? p.dropout.keep_scale / w.l[i] : 1.0f / w.l[i];
      StoreRow(w.o + i * w.row_stride, factor, p.dtype, p.o_row(block.b, t, n), p.value_dim(), p.out);
      p.lse[p.stat(block.b, n, t)] = w.m[i] + std::log(w.l[i]);
    } else {
      WriteEmptyRows(p, block, i, i + 1);
    }
  }
}

// The rows of a block at or before the query length (the rest see nothing).
inline int64_t LiveRows(const ForwardBlock& block, const MaskGeometry& mask) {
  if (block.heads) return mask.q_valid > block.t0 ? block.rows : 0;
  return std::clamp<int64_t>(mask.q_valid - block.t0, 0, block.rows);
}

// Split-KV: the partial (m, l, O) that chunk c of query item `query_item` leaves.
inline RowState ChunkPartial(const Problem& p, int64_t query_item, int64_t c) {
  float* base = p.packed.forward_partial + (query_item * p.forward_chunks + c) * ForwardPartialFloats(p);
  return {base + 2 * kBlockQ, base, base + kBlockQ, RowStride(p)};
}

// The packed key block (Kᵀ, V rows) at (b, kv head g, first key s0) of which the tile uses
// `cols` keys, and its bad-value flags (null when none): packed once per call before the
// tiles, or (Problem::stream_keys) packed here by the one item that visits it.
struct KeyBlockView {
  const float* k_t;
  const float* v;
  const int32_t* bad_values;
};
template <class Products>
KeyBlockView KeyBlockAt(const Problem& p, const ForwardTiles& w, int64_t b, int64_t g, int64_t s0, int64_t cols) {
  if (!p.stream_keys) {
    const int64_t key_block = KeyBlockIndex(p, b, g, s0) * KeyBlockFloats(p);
    return {p.packed.k_t + key_block, p.packed.v + key_block, NonFiniteValues(p, b, g, s0)};
  }
  Products::PackKeys(p, KeyRows(p, b, g, s0, cols, false, w.staging), w.row_buffer, w.key_t);
  const RowBlock v = KeyRows(p, b, g, s0, cols, true, w.staging);
  FindNonFiniteRows(v, w.bad_values, w.row_buffer);
  Products::PackValues(p, v, w.value_rows);
  return {w.key_t, w.value_rows, w.bad_values[kBlockK] != 0 ? w.bad_values : nullptr};
}

// Products: F32Products or BF16Products (tile_products.h). One item per (query block, key
// chunk), the chunk fastest (Problem::forward_chunks; without a split, one chunk).
template <class Products>
void ForwardTileWith(const Problem& p, int64_t item, float* workspace) {
  const int64_t query_item = item / p.forward_chunks, chunk = item % p.forward_chunks;
  const ForwardBlock block = ForwardBlockOf(p, query_item);
  const int64_t b = block.b, n = block.n, t0 = block.t0;
  const int64_t g = n / p.group_size();
  const MaskGeometry mask(p, b);
  // Rows at or past the query length see nothing; the rest of the block is live.
  const int64_t live_rows = LiveRows(block, mask);
  if (chunk == 0) WriteEmptyRows(p, block, live_rows, block.rows);
  if (live_rows == 0) return;
  // The positions the live rows span (packed heads: one).
  const int64_t positions = block.heads ? 1 : live_rows;

  ForwardTiles w(p, workspace);
  const bool split = p.forward_chunks > 1;
  // A chunk keeps its running state in its partial, for MergeForwardChunks.
  const RowState state = split ? ChunkPartial(p, query_item, chunk) : RowState{w.o, w.m, w.l, w.row_stride};
  const int64_t ld = w.row_stride;
  const int64_t rows_padded = RoundUp(live_rows, kGemmRows);
  // Packed heads lie next to each other in q [B, T, N, H]; positions N·H apart.
  Products::PackQuery(
      p, {p.q, p.dtype, p.q_row(b, t0, n), block.heads ? p.head_dim : p.q_heads * p.head_dim, live_rows, p.head_dim},
      rows_padded, w.q);
  // The online softmax starts from the sink's state, m = sink and l = 1 (no sink: m =
  // -inf, which the first visible key's exp(m_old - m_new) = 0 turns into l = 0).
  // Split, the sink is the first chunk's (the others start empty).
  for (int64_t i = 0; i < rows_padded; ++i) {
    state.m[i] = chunk == 0 ? p.sink(block.head(std::min(i, live_rows - 1))) : -__builtin_inff();
    state.l[i] = Problem::SinkSum(state.m[i]);
  }
  for (int64_t i = 0; i < rows_padded * ld; ++i) state.o[i] = 0.0f;

  // Only key blocks that meet the union of the rows' visible intervals are visited (split:
  // this chunk's share of them).
  const KeyInterval first = mask.keys_of_row(t0);
  const KeyInterval last = mask.keys_of_row(t0 + positions - 1);
  const DenseMasking dense = w.dense(p, b, n);
  const int64_t s_begin = first.lo / kBlockK * kBlockK;
  const ChunkBlocks share =
      ChunkBlocksOf(last.hi > s_begin ? CeilDiv(last.hi - s_begin, kBlockK) : 0, chunk, p.forward_chunks);
  const int64_t s_end = std::min(last.hi, s_begin + share.last * kBlockK);
  for (int64_t s0 = s_begin + share.first * kBlockK; s0 < s_end; s0 += kBlockK) {
    const int64_t cols = std::min(kBlockK, last.hi - s0);
    const int64_t cols_padded = RoundUp(cols, kLanes);
    const TileVisibility visibility = ClassifyTile(mask, t0, positions, s0, cols, cols_padded != cols, dense.blocks);
    if (visibility == TileVisibility::kSkip) continue;
    CountTile(tile_counts.forward);

    const KeyBlockView keys = KeyBlockAt<Products>(p, w, b, g, s0, cols);
    const ScoreTile s{w.s, kBlockK, t0, live_rows, rows_padded, s0, cols, cols_padded, block.heads ? live_rows : 1};
    // S = scale · Q Kᵀ
    Products::Scores(p, rows_padded, cols_padded, w.q, keys.k_t, w.s);
    if (p.bias.present()) AddBias(s, p.bias.rows(b, n), w.bias_row);
    if (p.softcap > 0.0f) ApplySoftCap(s, p.softcap, nullptr);
    if (visibility == TileVisibility::kPartial) MaskScores(s, mask, w.segments, dense);
    const TileDropout drop{&p.dropout, b, n};
    UpdateOnlineSoftmax(s, state.m, state.l, w.correction, keys.bad_values, p.dropout.on ? &drop : nullptr,
                        dense.visible);
    // O = diag(exp(m_old − m_new)) O + P V
    Products::AccumulateValues(p, rows_padded, cols, w.s, w.scratch, keys.v, state.o, w.correction);
  }
  if (!split) WriteOutputRows(p, state, block, live_rows);
}

// Split-KV: merges the chunks' partials of one query block in chunk order, by their maxima
// (m = max_c m_c, keeping a NaN; l = Σ_c l_c·e^(m_c − m), O likewise), into the first
// chunk's partial, then writes out and lse as the unsplit forward does. A chunk that saw no
// key (m_c = -inf) adds nothing; a row no chunk saw stays empty.
inline void MergeForwardChunks(const Problem& p, int64_t query_item, float* /*workspace*/) {
  const ForwardBlock block = ForwardBlockOf(p, query_item);
  const MaskGeometry mask(p, block.b);
  const int64_t live_rows = LiveRows(block, mask);
  const RowState merged = ChunkPartial(p, query_item, 0);
  const int64_t width = p.value_dim();
  for (int64_t i = 0; i < live_rows; ++i) {
    float m = merged.m[i];
    for (int64_t c = 1; c < p.forward_chunks; ++c) m = MaxKeepNaN(m, ChunkPartial(p, query_item, c).m[i]);
    if (m == -__builtin_inff()) continue;  // empty: chunk 0's m is -inf too
    float* o = merged.o + i * merged.row_stride;
    const float f0 = std::exp(merged.m[i] - m);
    float l = merged.l[i] * f0;
    for (int64_t j = 0; j < width; ++j) o[j] *= f0;
    for (int64_t c = 1; c < p.forward_chunks; ++c) {
      const RowState part = ChunkPartial(p, query_item, c);
      const float f = std::exp(part.m[i] - m);
      l += part.l[i] * f;
      const float* oc = part.o + i * part.row_stride;
      for (int64_t j = 0; j < width; ++j) o[j] += oc[j] * f;
    }
    merged.m[i] = m;
    merged.l[i] = l;
  }
  WriteOutputRows(p, merged, block, live_rows);
}

inline void ForwardTile(const Problem& p, int64_t item, float* workspace) {
#if defined(JAX_FLASH_CPU_BF16_PRODUCTS)
  if (p.dtype == ElementType::kBF16) return ForwardTileWith<BF16Products>(p, item, workspace);
#endif
  ForwardTileWith<F32Products>(p, item, workspace);
}

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
