// Tile sizes and the per-worker workspace they imply. Sizes are chosen so that one
// tile step's operands (Q, K, V, dO tiles, scores, accumulators: ~0.8 MB in the
// backward at H = 128) stay in L2 and a micro-tile's working set streams from L1;
// 128 × 128 measured a few percent faster than 64 × 128 and 64 × 64 on AVX-512.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/problem.h"

namespace jax_flash {
namespace cpu {

constexpr int64_t kBlockQ = 128;  // query rows per tile (Br in FlashAttention-2)
constexpr int64_t kBlockK = 128;  // keys per tile (Bc)
constexpr int64_t kAlignFloats = 16;  // 64-byte alignment of every buffer

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline int64_t CeilDiv(int64_t x, int64_t m) { return (x + m - 1) / m; }

// Work items: the forward and the dQ pass run one item per (b, n, query block); the
// dK/dV pass one per (b, kv head, key block).
inline int64_t QueryBlocks(const Problem& p) { return CeilDiv(p.q_len, kBlockQ); }
inline int64_t KeyBlocks(const Problem& p) { return CeilDiv(p.kv_len, kBlockK); }
inline int64_t QueryItems(const Problem& p) { return p.batch * p.q_heads * QueryBlocks(p); }
inline int64_t KeyItems(const Problem& p) { return p.batch * p.kv_heads * KeyBlocks(p); }

// The block a work item owns. Items enumerate (b, head, block), the block fastest.
struct QueryBlockItem {
  int64_t b, n, t0, rows;  // batch, query head, first row, rows in the block (ragged tail)
};
struct KeyBlockItem {
  int64_t b, g, s0, keys;  // batch, kv head, first key, keys in the block (ragged tail)
};
// last_first: under a causal mask the last query blocks see the most keys, and the
// dynamic schedule balances best when the longest items start earliest.
inline QueryBlockItem QueryBlockOf(const Problem& p, int64_t item, bool last_first = false) {
  const int64_t blocks = QueryBlocks(p);
  const int64_t block = last_first ? blocks - 1 - item % blocks : item % blocks;
  const int64_t t0 = block * kBlockQ;
  return {item / (p.q_heads * blocks), item / blocks % p.q_heads, t0, std::min(kBlockQ, p.q_len - t0)};
}
inline KeyBlockItem KeyBlockOf(const Problem& p, int64_t item) {
  const int64_t blocks = KeyBlocks(p);
  const int64_t s0 = item % blocks * kBlockK;
  return {item / (p.kv_heads * blocks), item / blocks % p.kv_heads, s0, std::min(kBlockK, p.kv_len - s0)};
}

// The query rows of one forward item. Normally a block of up to kBlockQ positions of one head;
// with GQA packing (Problem::pack_heads, decided by the caller: a decode step, T = 1, of a
// GQA/MQA call with no dense bias, dense mask or dropout, which vary per head) the G query
// heads that share kv head g, at position 0, so that K and V are read once per kv head and the
// products run on G live rows, not 1.
struct ForwardBlock {
  int64_t b, n, t0, rows;  // batch, first head, first position, rows
  bool heads;              // rows are heads n, n + 1, … at t0 (else positions t0, … of head n)
  int64_t head(int64_t i) const { return heads ? n + i : n; }
  int64_t position(int64_t i) const { return heads ? t0 : t0 + i; }
};
// Whether GQA packing can serve the call (the handler refuses pack_gqa otherwise).
inline bool CanPackHeads(const Problem& p) {
  return p.q_len == 1 && p.group_size() <= kBlockQ && !p.bias.present() && !p.mask.present() && !p.dropout.on;
}
inline bool PacksHeads(const Problem& p) { return p.pack_heads; }
inline int64_t ForwardQueryItems(const Problem& p) { return PacksHeads(p) ? p.batch * p.kv_heads : QueryItems(p); }
inline ForwardBlock ForwardBlockOf(const Problem& p, int64_t item) {
  if (PacksHeads(p)) return {item / p.kv_heads, item % p.kv_heads * p.group_size(), 0, p.group_size(), true};
  const auto [b, n, t0, rows] = QueryBlockOf(p, item, /*last_first=*/true);
  return {b, n, t0, rows, false};
}

// Split-KV (flash-decoding) in the forward: each item's visited key blocks cut into
// Problem::forward_chunks contiguous chunks, run as items of their own; each leaves its
// running state (m, l, unnormalised O) in a partial (Packed::forward_partial), and one merge
// per query block combines them in chunk order (flash_forward.h MergeForwardChunks). The count
// is the forward_chunks attribute, decided by the caller (jax_flash/cpu.py: a call with too few
// ForwardQueryItems for the threads, a decode step with a long S), capped at one key block per
// chunk by the handler; it depends on the problem only, so the results are the same bits
// whatever the number of threads.
inline int64_t ForwardItems(const Problem& p) { return ForwardQueryItems(p) * p.forward_chunks; }
// Whether the forward packs each key block itself as it visits it (Problem::stream_keys): in
// a paged cache (whose blocks are no rows of one stride), and where one work item visits each
// key block (one query block, and one query head per kv head or GQA packing: a decode step),
// so that packing them all in a pass first would read K and V, write them packed and read them
// again, instead of once.
inline bool StreamsKeys(const Problem& p) {
  return p.page_table != nullptr || (QueryBlocks(p) == 1 && (p.group_size() == 1 || PacksHeads(p)));
}
// The key blocks [first, last) that chunk c of a query block visits, out of the blocks
// [0, blocks) its rows' visible keys span.
struct ChunkBlocks {
  int64_t first, last;
};
inline ChunkBlocks ChunkBlocksOf(int64_t blocks, int64_t c, int64_t chunks) {
  return {blocks * c / chunks, blocks * (c + 1) / chunks};
}

// The backward's work items: one per (b, kv head, chunk of key blocks), chunk
// fastest. The number of chunks C depends on the problem and the size of XLA's thread
// pool only (never on JAX_FLASH_CPU_THREADS, which keeps the dQ sum's order fixed): enough
// items for the pool's threads to share when B·K alone is too few, at most
// kMaxGradientChunks float32 dQ partials, and no chunk without a key block. With one chunk
// an item owns its query heads' rows: it packs their Q and dO and holds their dQ itself
// (GradientTileOwnsQueries), so nothing of the size of Q exists outside the workers.
//
// With a dense bias the items own disjoint parts of dbias: along B or N, where the bias
// broadcasts, every batch row or head adds into the same elements, so one item then runs
// all of them, in order (GradientBatchItems / GradientKvHeadItems = 1): deterministic, and
// no copy of a bias that may be [1, N, T, S]. Along S, where a bias broadcasts over the keys,
// the chunks share its elements and add into their own partials (BiasGradientPartials),
// summed in chunk order after the pass, like dQ.
constexpr int64_t kMaxGradientChunks = 4;
inline int64_t GradientBatchItems(const Problem& p) { return p.bias.present() && p.bias.broadcasts(0) ? 1 : p.batch; }
inline int64_t GradientKvHeadItems(const Problem& p) {
  return p.bias.present() && p.bias.broadcasts(1) ? 1 : p.kv_heads;
}
inline int64_t GradientChunkRule(const Problem& p, int64_t pool_threads) {
  const int64_t owners = GradientBatchItems(p) * GradientKvHeadItems(p);
  const int64_t wanted = CeilDiv(std::max<int64_t>(1, pool_threads), std::max<int64_t>(1, owners));
  return std::max<int64_t>(1, std::min({wanted, kMaxGradientChunks, CeilDiv(p.kv_len, kBlockK)}));
}
inline int64_t GradientChunks(const Problem& p) { return p.gradient_chunks; }
inline bool GradientTileOwnsQueries(const Problem& p) {
  return p.gradient_chunks == 1 && GradientBatchItems(p) == p.batch && GradientKvHeadItems(p) == p.kv_heads;
}
inline int64_t GradientItems(const Problem& p) {
  return GradientBatchItems(p) * GradientKvHeadItems(p) * GradientChunks(p);
}
inline bool BiasGradientPartials(const Problem& p) {
  return p.bias.present() && p.bias.broadcasts(3) && GradientChunks(p) > 1;
}

// Packed operand layouts. Rows are padded to a whole number of the widest vector
// (16 floats) whatever the ISA, so one layout serves every kernel table. Q, K rows hold H
// elements and V, dO rows Hv; every packed row and accumulator has the width of the wider
// (PaddedHeadDim), zero past its own, and each product runs over its own dim only.
inline int64_t PaddedKeyDim(const Problem& p) { return RoundUp(p.head_dim, kAlignFloats); }
inline int64_t PaddedValueDim(const Problem& p) { return RoundUp(p.value_dim(), kAlignFloats); }
inline int64_t PaddedHeadDim(const Problem& p) {
  return PaddedKeyDim(p) > PaddedValueDim(p) ? PaddedKeyDim(p) : PaddedValueDim(p);
}
// Tile rows lie an odd number of cache lines apart. At a power-of-two stride (512 B
// for H = 128) the column strip a GEMM micro-tile walks down would use only some of
// L1's sets and evict itself; an odd stride spreads it over all of them.
inline int64_t OddLineStride(int64_t floats) {
  return (floats / kAlignFloats) % 2 == 1 ? floats : floats + kAlignFloats;
}
// Leading dimension of Q, dO, K, V row tiles and of the O, dQ, dK, dV accumulators.
inline int64_t RowStride(const Problem& p) { return OddLineStride(PaddedHeadDim(p)); }
// One split-KV partial: m and l [kBlockQ], then O [kBlockQ][RowStride] (64-byte aligned).
inline int64_t ForwardPartialFloats(const Problem& p) {
  return RoundUp(2 * kBlockQ + kBlockQ * RowStride(p), kAlignFloats);
}
// Leading dimension of the Kᵀ, Vᵀ tiles ([H][kKeyStride], the first kBlockK used).
constexpr int64_t kKeyStride = kBlockK + (kBlockK / kAlignFloats % 2 == 1 ? 0 : kAlignFloats);
// Kᵀ, Vᵀ: [B][K][key block][H][kKeyStride]; K, V rows: [B][K][key block][kBlockK][RowStride].
// As bf16 (bf16_packing): Kᵀ, Vᵀ [Hp/2][kKeyStride][2], K, V [kBlockK/2][RowStride][2].
inline int64_t KeyBlockFloats(const Problem& p) {
  if (p.bf16_packing) {
    const int64_t transposed = PaddedHeadDim(p) * kKeyStride;
    const int64_t rows = kBlockK * RowStride(p);
    return RoundUp((transposed > rows ? transposed : rows) / 2, kAlignFloats);
  }
  const int64_t transposed = std::max(p.head_dim, p.value_dim()) * kKeyStride;
  const int64_t rows = kBlockK * RowStride(p);
  return RoundUp(transposed > rows ? transposed : rows, kAlignFloats);
}
inline int64_t KeyBlockIndex(const Problem& p, int64_t b, int64_t g, int64_t s0) {
  return (b * p.kv_heads + g) * KeyBlocks(p) + s0 / kBlockK;
}
inline int64_t PackedKeyFloats(const Problem& p) { return KeyItems(p) * KeyBlockFloats(p); }
// Q, dO rows: [B][N][query block][kBlockQ][RowStride].
inline int64_t QueryBlockFloats(const Problem& p) { return kBlockQ * RowStride(p); }
inline int64_t QueryBlockIndex(const Problem& p, int64_t b, int64_t n, int64_t t0) {
  return (b * p.q_heads + n) * QueryBlocks(p) + t0 / kBlockQ;
}
inline int64_t PackedQueryFloats(const Problem& p) { return QueryItems(p) * QueryBlockFloats(p); }
// The query blocks of one GQA group (the heads of kv head g): [G][query block][QueryBlockFloats].
inline int64_t GroupQueryFloats(const Problem& p) { return p.group_size() * QueryBlocks(p) * QueryBlockFloats(p); }

// The cache blocking of one (H, dtype, products) combination: the one place that states
// the block sizes and what one worker's tile step keeps hot, so that a choice can be
// checked against the caches. Every combination runs 128 × 128 (the layouts above are
// compile-time): the forward's step stays in a 1 MB L2 up to H = 256 (0.6 MB float32),
// the backward's up to H = 128 (0.77 MB float32, 0.66 MB bf16; at H = 256 it is 1.3 / 1.1
// MB and spills to L3, where a smaller block would not), and 128 × 128 measured faster
// than 64 × 128 and 64 × 64 at H = 64 and 128 (fewer softmax row passes per product; the
// 4-row micro-tiles reuse each B strip over 128 rows).
struct Blocking {
  int64_t block_q;        // query rows per tile (Br)
  int64_t block_k;        // keys per tile (Bc)
  int64_t key_block_bytes;    // one packed key block (Kᵀ and V: forward)
  int64_t forward_bytes;      // forward tile step: Q, S, O tiles and a key block
  int64_t backward_bytes;     // backward tile step: Q, dO, S, dS, soft cap tiles, Kᵀ, Vᵀ, K,
                              // dK, dV accumulators, the dQ partial tile
};
inline Blocking BlockingFor(int64_t head_dim, ElementType dtype, bool bf16_products) {
  Problem p;
  p.head_dim = head_dim;
  p.bf16_packing = bf16_products && dtype == ElementType::kBF16;
  const int64_t element = p.bf16_packing ? 2 : 4;
  const int64_t rows = kBlockQ * RowStride(p) * 4;      // a float32 row tile
  const int64_t scores = kBlockQ * kBlockK * 4;
  const int64_t key_operand = KeyBlockFloats(p) * 4;
  const int64_t key_gradient = std::max(kBlockK * RowStride(p), PaddedHeadDim(p) * kKeyStride) * 4;
  Blocking b{kBlockQ, kBlockK, 2 * key_operand, 0, 0};
  b.forward_bytes = rows * element / 4 + scores + rows + 2 * key_operand;
  // bf16 query blocks hold rows and their transposes.
  b.backward_bytes =
      2 * rows * element / 4 * (element == 2 ? 2 : 1) + 3 * scores + 3 * key_operand + 2 * key_gradient + rows;
  return b;
}

// Hands out 64-byte-aligned float buffers from one (64-byte-aligned) workspace
// allocation. With a null base it only counts, which is how the workspace is sized:
// one layout function serves both.
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(float* base) : base_(base) {}
  float* Take(int64_t floats) {
    float* p = base_ == nullptr ? nullptr : base_ + used_;
    used_ += RoundUp(floats, kAlignFloats);
    return p;
  }
  int64_t used() const { return used_; }

 private:
  float* base_;
  int64_t used_ = 0;
};

}  // namespace cpu
}  // namespace jax_flash
