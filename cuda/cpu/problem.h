// One attention call as the CPU kernels see it: shapes, strides, operand pointers,
// attributes, and the mask geometry every tile of the forward and backward shares.
//
// Layout is BTNH (q, dq: head dim H; out, dout: Hv) and BSKH (k, dk: H; v, dv: Hv);
// statistics are [B, N, T]. The value head dim Hv may differ from the query/key head dim H.
// This header is included by every ISA-specific translation unit *before* their
// `#pragma GCC target`, so everything here is compiled for the baseline ISA.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "common/dropout.h"

namespace jax_flash {
namespace cpu {

enum class ElementType { kF32, kBF16, kF16 };

// The rows of a dense operand (the bias, the mask) that one (batch row, head) reads: element
// (t, s) at data + offset + t·stride_t + s·stride_s (in elements), a stride 0 on a broadcast dim.
struct DenseRows {
  const void* data = nullptr;
  ElementType dtype = ElementType::kF32;  // the bias' (the mask is one byte per element)
  int64_t offset = 0;
  int64_t stride_t = 0;
  int64_t stride_s = 0;
  int64_t at(int64_t t, int64_t s) const { return offset + t * stride_t + s * stride_s; }
};

// A dense [B|1, N|1, T|1, S|1] operand read through broadcast strides: element (b, n, t, s)
// at b·stride[0] + n·stride[1] + t·stride[2] + s·stride[3], the stride of a dim of size 1
// being 0, so that a broadcast operand is never expanded in memory.
struct DenseOperand {
  const void* data = nullptr;  // null: the call has none
  ElementType dtype = ElementType::kF32;
  int64_t dims[4] = {0, 0, 0, 0};     // Bb, Nb, Tb, Sb
  int64_t stride[4] = {0, 0, 0, 0};

  DenseOperand() = default;
  DenseOperand(const void* data, ElementType dtype, const int64_t (&shape)[4]) : data(data), dtype(dtype) {
    int64_t step = 1;
    for (int d = 3; d >= 0; --d) {
      dims[d] = shape[d];
      stride[d] = shape[d] == 1 ? 0 : step;
      step *= shape[d];
    }
  }
  bool present() const { return data != nullptr; }
  bool broadcasts(int d) const { return dims[d] == 1; }
  int64_t elements() const { return dims[0] * dims[1] * dims[2] * dims[3]; }
  DenseRows rows(int64_t b, int64_t n) const {
    return {data, dtype, b * stride[0] + n * stride[1], stride[2], stride[3]};
  }
};

// The states of a block mask's blocks (flex_attention, docs/flex.md).
enum BlockState : int8_t { kEmptyBlock = 0, kPartialBlock = 1, kFullBlock = 2 };

// The block mask of one (batch row, query head): its blocks' states, the slots of the partly
// visible ones, and their packed bits. The mask's blocks (block_q × block_k) need not be the
// kernel's tiles (kBlockQ × kBlockK): a tile reads every block it overlaps.
struct BlockRows {
  int64_t block_q = 0;  // 0: no block mask
  int64_t block_k = 0;
  int64_t kv_blocks = 0;           // nk
  int64_t partial_capacity = 0;    // P
  int64_t words = 0;               // ceil(block_k / 32)
  const int8_t* states = nullptr;  // [nq, nk]
  const int32_t* slots = nullptr;  // [nq, nk]
  const uint32_t* bits = nullptr;  // [P, block_q, words]

  bool present() const { return block_q > 0; }
  // 0, 1 or 2 (any state but 0 and 2 reads as partly visible).
  int state(int64_t i, int64_t j) const {
    const int x = states[i * kv_blocks + j];
    return x == kEmptyBlock || x == kFullBlock ? x : int{kPartialBlock};
  }
  // The bit row r of a partly visible block (i, j), or null when its slot is not in [0, P):
  // more partly visible blocks than the bits' capacity (the block is then poisoned).
  const uint32_t* bit_row(int64_t i, int64_t j, int64_t r) const {
    const int32_t slot = slots[i * kv_blocks + j];
    if (slot < 0 || slot >= partial_capacity) return nullptr;
    return bits + (slot * block_q + r) * words;
  }
};

// A block mask [Bm, Nm, nq, nk] (Bm ∈ {1, B}, Nm ∈ {1, N}), or none (block_q = 0).
struct BlockMaskOperand {
  BlockRows layout;  // states, slots at (0, 0)
  int64_t batch = 0, heads = 0, q_blocks = 0;
  bool present() const { return layout.present(); }
  BlockRows rows(int64_t b, int64_t n) const {
    BlockRows r = layout;
    if (!present()) return r;
    const int64_t offset = ((batch == 1 ? 0 : b) * heads + (heads == 1 ? 0 : n)) * q_blocks * layout.kv_blocks;
    r.states += offset;
    r.slots += offset;
    return r;
  }
};

// Everything a tile needs to know about the call. Pointers are untyped for the
// element type `dtype` of q, k, v, out, dout, dq, dk, dv; statistics are float.
struct Problem {
  int64_t batch = 0;      // B
  int64_t q_len = 0;      // T
  int64_t kv_len = 0;     // S
  int64_t q_heads = 0;    // N
  int64_t kv_heads = 0;   // K
  int64_t head_dim = 0;   // H: q, k, dq, dk (the reduction of Q·Kᵀ)
  int64_t value_head_dim = 0;  // Hv: v, out, dout, dv (P·V, dO·Vᵀ); 0 means Hv = H
  ElementType dtype = ElementType::kF32;

  float scale = 1.0f;     // logits = scale * q.k
  float softcap = 0.0f;   // > 0: logits -> softcap * tanh(logits / softcap)
  // Query t of row b sits at key position p = q_offset[b] + t; key s is visible iff
  // s >= p - window_left (-1: unbounded) and s <= p + window_right (-1: unbounded;
  // causal is 0).
  int64_t window_left = -1;
  int64_t window_right = -1;
  bool use_segment_ids = false;
  // Attention dropout (common/dropout.h): off, or the key and threshold of the keep bits of
  // element (b, n, t, s), applied to P after the softmax statistics.
  dropout::Setting dropout;

  const int32_t* q_lengths = nullptr;       // [B]
  const int32_t* kv_lengths = nullptr;      // [B]
  const int32_t* q_segment_ids = nullptr;   // [B, T]
  const int32_t* kv_segment_ids = nullptr;  // [B, S]
  const int32_t* q_offsets = nullptr;       // [B]
  // The dense bias (added to the scaled logits of visible pairs, before the soft cap) and the
  // dense mask (bytes, nonzero: the pair may attend), each absent or [B|1, N|1, T|1, S|1].
  DenseOperand bias;
  DenseOperand mask;
  // flex_attention's block mask (BlockRows), or none: which tiles run, and per element of
  // the tiles that overlap partly visible blocks, the mask_mod's bits.
  BlockMaskOperand block_mask;
  // The bias holds a -inf (handlers.cc scans it once per call): its logit is visible with
  // weight 0, which MaskScores' lane masks then tell from a masked pair (score_mask.h).
  bool bias_minus_inf = false;
  // [N] (forward): one logit per query head that joins every row's softmax with value 0
  // (attention sinks); -inf (or null) is no sink.
  const float* sinks = nullptr;

  // Forward operands and results.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // natural log; -inf where a row sees no key

  // Backward operands, results and workspaces.
  const void* dout = nullptr;
  const float* lse_in = nullptr;
  const float* dlse = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* dq_accum = nullptr;
  float* delta = nullptr;  // rowsum(dout * out) - dlse, [B, N, T]
  // dbias (float32, the bias' shape): dS summed over the bias' broadcast dims; null without
  // a bias. dbias_partial: [GradientChunks][bias elements] when the bias broadcasts over
  // the keys (the chunks of one row share its elements), null otherwise (tiling.h).
  float* dbias = nullptr;
  float* dbias_partial = nullptr;

  // Operands packed once per call into float32 tiles (see tiling.h for the layouts),
  // so that no tile re-reads, re-widens or re-transposes what another tile already did.
  // (The backward's key blocks are packed by the one item that visits each.)
  struct Packed {
    float* k_t = nullptr;   // Kᵀ per key block      (forward)
    float* v = nullptr;     // V rows per key block  (forward)
    float* q = nullptr;     // scale · Q rows per query block (backward)
    float* dout = nullptr;  // dO rows per query block        (backward)
    // [key items][kBlockK + 1] (forward): 1 where key j's value row holds a NaN/±inf
    // (the packed V has zeros there); the last entry: whether any of the block does.
    int32_t* bad_values = nullptr;
    float* dq_partial = nullptr;  // float32 dQ per chunk and query block (backward)
    // Split-KV (forward, forward_chunks > 1): each chunk's running state of each query block,
    // [query items][forward_chunks][ForwardPartialFloats] (tiling.h).
    float* forward_partial = nullptr;
  } packed;
  // The forward's key chunks per query block (the forward_chunks attribute; 1: no split).
  int64_t forward_chunks = 1;
  // GQA packing (the pack_gqa attribute; tiling.h ForwardBlock): the rows of a forward item
  // are the G query heads of one kv head at position 0.
  bool pack_heads = false;
  // The backward's key-block chunks per (b, kv head) (tiling.h GradientChunkRule, set by the
  // handler; 1: each work item owns its query heads' rows, GradientTileOwnsQueries).
  int64_t gradient_chunks = 1;

  // A paged KV cache (the paged forward), or null: k and v are then pages [num_pages,
  // page_size, K, H|Hv] shared by the batch, key s of batch row b is slot s % page_size of
  // page page_table[b · max_pages + s / page_size], and kv_len = max_pages · page_size (the
  // table's capacity). An id outside [0, num_pages) reads page 0: the caller masks those keys.
  const int32_t* page_table = nullptr;
  int64_t page_size = 0;
  int64_t max_pages = 0;
  int64_t num_pages = 0;
  // The forward packs each key block as it visits it (tile_pack.h StreamKeyRows), instead of
  // in a pass over the whole cache before (Packed::k_t, v): a paged cache, or a call in which
  // one work item visits each key block (tiling.h StreamsKeys: a decode step).
  bool stream_keys = false;

  // Operands packed as bf16 (the BF16Products of an ISA that has them, bf16 inputs):
  // a packed key block then takes half the floats (tiling.h KeyBlockFloats).
  bool bf16_packing = false;

  int64_t group_size() const { return q_heads / kv_heads; }
  // A visible pair may get a -inf logit (a -inf in the bias and no soft cap, which would make
  // it finite): the softmax then asks MaskScores' lane masks which pairs are masked.
  bool bias_hides_pairs() const { return bias_minus_inf && !(softcap > 0.0f); }
  int64_t value_dim() const { return value_head_dim > 0 ? value_head_dim : head_dim; }  // Hv
  // The sink of query head n (-inf: none).
  float sink(int64_t n) const { return sinks == nullptr ? -__builtin_inff() : sinks[n]; }
  // The online softmax's running sum after the sink alone (its running max is the sink):
  // 1, or NaN for a NaN or +inf sink, which poisons every row of its head.
  static float SinkSum(float sink) { return sink < __builtin_inff() ? 1.0f : __builtin_nanf(""); }
  // Element offset of row t of query head n (q, dq).
  int64_t q_row(int64_t b, int64_t t, int64_t n) const { return ((b * q_len + t) * q_heads + n) * head_dim; }
  // Element offset of row t of query head n (out, dout).
  int64_t o_row(int64_t b, int64_t t, int64_t n) const { return ((b * q_len + t) * q_heads + n) * value_dim(); }
  // The row of k and v that holds key s of batch row b: b·S + s, or in a paged cache its
  // page's slot in the pool.
  int64_t key_row(int64_t b, int64_t s) const {
    if (page_table == nullptr) return b * kv_len + s;
    int64_t page = page_table[b * max_pages + s / page_size];
    page = page >= 0 && page < num_pages ? page : 0;
    return page * page_size + s % page_size;
  }
  // Element offset of row s of kv head g (k, dk).
  int64_t kv_row(int64_t b, int64_t s, int64_t g) const { return (key_row(b, s) * kv_heads + g) * head_dim; }
  // Element offset of row s of kv head g (v, dv).
  int64_t v_row(int64_t b, int64_t s, int64_t g) const { return (key_row(b, s) * kv_heads + g) * value_dim(); }
  // Offset of (b, n, t) in the [B, N, T] statistics.
  int64_t stat(int64_t b, int64_t n, int64_t t) const { return (b * q_heads + n) * q_len + t; }
};

// The keys query row t may see, before segment ids: one interval [lo, hi), because
// sequence lengths and the local window (causal = window (-1, 0)) each bound it on
// one side. Both ends are non-decreasing in t, which is what lets whole tiles be
// skipped (FlashAttention-2 §3.1: causal block skipping, generalised to windows).
struct KeyInterval {
  int64_t lo = 0;
  int64_t hi = 0;
  bool empty() const { return hi <= lo; }
};

// The window of one batch row as a band of diagonals: query t sees key s iff
// lo <= s - t <= hi, where lo = q_offset - window_left and hi = q_offset + window_right.
// Both are clipped to [-T, S], which changes nothing (-T < s - t < S) and keeps every
// index computed from them small, whatever the window attributes and the offset.
struct Band {
  int64_t lo = 0;
  int64_t hi = 0;

  Band(const Problem& p, int64_t b) {
    // A window longer than 2^40 is as unbounded as -1 next to int32 offsets and lengths.
    constexpr int64_t kUnbounded = int64_t{1} << 40;
    const int64_t offset = p.q_offsets == nullptr ? 0 : p.q_offsets[b];
    const int64_t left = p.window_left < 0 ? kUnbounded : std::min(p.window_left, kUnbounded);
    const int64_t right = p.window_right < 0 ? kUnbounded : std::min(p.window_right, kUnbounded);
    lo = std::clamp<int64_t>(offset - left, -p.q_len, p.kv_len);
    hi = std::clamp<int64_t>(offset + right, -p.q_len, p.kv_len);
  }
};

// The per-batch view of the mask: valid lengths, the band and the segment ids of one
// sequence.
struct MaskGeometry {
  int64_t q_valid = 0;   // rows t >= q_valid see nothing
  int64_t kv_valid = 0;  // keys s >= kv_valid are invisible
  Band band;
  const int32_t* q_segments = nullptr;   // [T] or null when segment ids are off
  const int32_t* kv_segments = nullptr;  // [S] or null when segment ids are off
  // A dense mask, or a bias that may give a visible pair a -inf logit: no tile is kFull,
  // every visited tile is masked element by element (the dense mask's elements; with such a
  // bias, to tell a -inf logit from a masked pair).
  bool dense = false;

  MaskGeometry(const Problem& p, int64_t b)
      : q_valid(std::clamp<int64_t>(p.q_lengths[b], 0, p.q_len)),
        kv_valid(std::clamp<int64_t>(p.kv_lengths[b], 0, p.kv_len)),
        band(p, b),
        dense(p.mask.present() || p.bias_hides_pairs()) {
    if (p.use_segment_ids) {
      q_segments = p.q_segment_ids + b * p.q_len;
      kv_segments = p.kv_segment_ids + b * p.kv_len;
    }
  }

  KeyInterval keys_of_row(int64_t t) const {
    if (t < 0 || t >= q_valid) return {0, 0};
    return {std::max<int64_t>(0, t + band.lo), std::min<int64_t>(kv_valid, t + band.hi + 1)};
  }

  // Rows that see at least one key in [s0, s1) (ignoring segment ids): the inverse of
  // keys_of_row, an interval too.
  KeyInterval rows_of_keys(int64_t s0, int64_t s1) const {
    s1 = std::min(s1, kv_valid);
    if (s1 <= s0) return {0, 0};
    return {std::max<int64_t>(0, s0 - band.hi), std::min<int64_t>(q_valid, s1 - band.lo)};
  }
};

// A debug count of the tiles the kernels compute (their Q·Kᵀ products), forward and backward,
// kept while `on` (jax_flash.cpu.count_tiles: tests that the work follows a block mask);
// otherwise one relaxed load per tile.
struct TileCounts {
  std::atomic<bool> on{false};
  std::atomic<int64_t> forward{0};
  std::atomic<int64_t> backward{0};
};
inline TileCounts tile_counts;

inline void CountTile(std::atomic<int64_t>& count) {
  if (tile_counts.on.load(std::memory_order_relaxed)) count.fetch_add(1, std::memory_order_relaxed);
}

// How a (query rows × keys) tile meets the mask.
enum class TileVisibility {
  kSkip,     // no element visible: the tile is not computed at all
  kPartial,  // some elements masked: mask element by element
  kFull,     // every element visible: no mask arithmetic
};

// Smallest and largest segment id in ids[0, n); used to skip tiles whose query and
// key segments cannot meet, without assuming the ids are sorted.
struct SegmentRange {
  int32_t min = 0;
  int32_t max = -1;
  bool uniform() const { return min == max; }
  bool disjoint(const SegmentRange& o) const { return max < o.min || o.max < min; }
};

inline SegmentRange RangeOfSegments(const int32_t* ids, int64_t n) {
  SegmentRange r;
  if (n <= 0) return r;
  r.min = r.max = ids[0];
  for (int64_t i = 1; i < n; ++i) {
    r.min = std::min(r.min, ids[i]);
    r.max = std::max(r.max, ids[i]);
  }
  return r;
}

// How the block mask meets the tile of rows [t0, t0 + rows) and keys [s0, s0 + cols): skipped
// when every block it overlaps is empty, full when every one is full, else partial.
inline TileVisibility ClassifyBlocks(const BlockRows& blocks, int64_t t0, int64_t rows, int64_t s0, int64_t cols) {
  bool any_visible = false, all_full = true;
  for (int64_t i = t0 / blocks.block_q; i <= (t0 + rows - 1) / blocks.block_q; ++i) {
    for (int64_t j = s0 / blocks.block_k; j <= (s0 + cols - 1) / blocks.block_k; ++j) {
      const int state = blocks.state(i, j);
      any_visible = any_visible || state != kEmptyBlock;
      all_full = all_full && state == kFullBlock;
    }
  }
  if (!any_visible) return TileVisibility::kSkip;
  return all_full ? TileVisibility::kFull : TileVisibility::kPartial;
}

// Classifies the tile of query rows [t0, t0 + rows) (all below q_valid) and keys
// [s0, s0 + cols) (all below kv_valid), `padded` true when the tile's storage has
// columns beyond `cols` that must be masked too; with a block mask (that of the tile's
// (b, n)), the blocks it overlaps decide too.
inline TileVisibility ClassifyTile(const MaskGeometry& g, int64_t t0, int64_t rows, int64_t s0, int64_t cols,
                                   bool padded, const BlockRows& blocks = {}) {
  if (rows <= 0 || cols <= 0) return TileVisibility::kSkip;
  if (blocks.present()) {
    const TileVisibility by_blocks = ClassifyBlocks(blocks, t0, rows, s0, cols);
    if (by_blocks == TileVisibility::kSkip) return TileVisibility::kSkip;
    const TileVisibility by_geometry = ClassifyTile(g, t0, rows, s0, cols, padded);
    return by_blocks == TileVisibility::kPartial && by_geometry == TileVisibility::kFull ? TileVisibility::kPartial
                                                                                         : by_geometry;
  }
  const KeyInterval first = g.keys_of_row(t0);
  const KeyInterval last = g.keys_of_row(t0 + rows - 1);
  // lo and hi are non-decreasing in t: the union of the rows' intervals is
  // [first.lo, last.hi) and their intersection [last.lo, first.hi).
  if (last.hi <= s0 || first.lo >= s0 + cols) return TileVisibility::kSkip;
  bool full = !padded && !g.dense && last.lo <= s0 && first.hi >= s0 + cols;
  if (g.q_segments != nullptr) {
    const SegmentRange qs = RangeOfSegments(g.q_segments + t0, rows);
    const SegmentRange ks = RangeOfSegments(g.kv_segments + s0, cols);
    if (qs.disjoint(ks)) return TileVisibility::kSkip;
    full = full && qs.uniform() && ks.uniform() && qs.min == ks.min;
  }
  return full ? TileVisibility::kFull : TileVisibility::kPartial;
}

}  // namespace cpu
}  // namespace jax_flash
