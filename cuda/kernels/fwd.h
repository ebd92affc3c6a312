// FlashAttention-2 forward (Dao, 2023, Alg. 1): one CTA per (query block, head, batch), each
// warp owns 16 or 32 query rows (the layout's rows_per_warp: one or two m16 row blocks, which
// share every K and V fragment). Q is loaded once; K and V tiles stream through a multi-stage
// cp.async ring; S = Q·Kᵀ, the online softmax and O += P·V all stay in registers. Q and K have
// HEAD_DIM (H) columns, V and O V_HEAD_DIM (Hv), which may be narrower.
//
// Decoding (few queries, many keys) has three settings of the same kernel: split-KV
// (flash-decoding), where each CTA runs one chunk of a query block's key tiles and leaves a
// partial (O, lse) that attention_forward_combine_kernel merges; GQA packing, where at T = 1
// the rows of a CTA's tile are the G query heads of one kv head (K and V read once per kv head
// instead of G times, and G live rows of 16·ceil(G/16) per MMA instead of 1); and the decoding
// tile (ForwardVariant::kDecode, kernels/tile.h DecodeForwardShape), one warp of 16 rows for a
// call of at most 16 (T, or the packed G), several CTAs per SM, sized for bytes in flight.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/dropout.h"
#include "kernels/grid.h"
#include "kernels/mask.h"
#include "kernels/nonfinite.h"
#include "kernels/params.h"
#include "kernels/platform.h"
#include "kernels/ptx.h"
#include "kernels/softmax.h"
#include "kernels/tile.h"

namespace jax_flash {
namespace kernels {

// The general kernel's tiles and shared memory: the layout's (kGeneral) or the decoding
// tile (kDecode, kernels/tile.h DecodeForwardShape).
template <class Elem, int HEAD_DIM, int V_HEAD_DIM = HEAD_DIM, Layout LAYOUT = Layout::kWarp16,
          ForwardVariant VARIANT = ForwardVariant::kGeneral>
struct ForwardKernel {
  static_assert(VARIANT != ForwardVariant::kPlain, "the plain forward has its own tiles (PlainForwardKernel)");
  static constexpr TileShape kShape = VARIANT == ForwardVariant::kDecode
                                          ? DecodeForwardShape(HEAD_DIM, V_HEAD_DIM)
                                          : TileShapeFor(Pass::kForward, HEAD_DIM, V_HEAD_DIM, LAYOUT);
  static constexpr int BLOCK_Q = kShape.block_q;
  static constexpr int BLOCK_KV = kShape.block_kv;
  static constexpr int WARPS = kShape.warps;
  static constexpr int STAGES = kShape.stages;
  static constexpr int THREADS = WARPS * WARP_SIZE;
  static constexpr int WARP_Q = kShape.rows_per_warp;  // query rows per warp
  static constexpr int ROW_BLOCKS = WARP_Q / MMA_M;     // its m16 row blocks
  // k-steps of S = Q·Kᵀ unrolled at once: a warp of 32 rows holds O (HEAD_DIM registers per
  // thread) and S (BLOCK_KV) throughout; at H = 96 one k-step at a time leaves registers for
  // the block mask's gather (kernels/block_mask.h), at H > 128 with 16 rows two (O alone takes
  // HEAD_DIM / 2).
  static constexpr int K_UNROLL = ROW_BLOCKS > 1 && HEAD_DIM > 64 ? 1 : HEAD_DIM > 128 ? 2 : HEAD_DIM / MMA_K;

  using QTile = SmemTile<BLOCK_Q, HEAD_DIM>;
  using KVTile = SmemTile<BLOCK_KV, HEAD_DIM>;   // K
  using VTile = SmemTile<BLOCK_KV, V_HEAD_DIM>;  // V (KVTile when Hv = H)
  // O, staged for its store over the Q tile (QTile when Hv = H).
  using OTile = SmemTile<BLOCK_Q, V_HEAD_DIM>;
  static constexpr bool kHvIsH = V_HEAD_DIM == HEAD_DIM;
  static constexpr bool kDecode = VARIANT == ForwardVariant::kDecode;
  // Shared memory: [Q][K_0][V_0][K_1][V_1]...[scan]: one Q tile, a ring of STAGES (K, V) tiles,
  // and the flags of the decoding settings' scan of V (kernels/nonfinite.h).
  static constexpr int kStageBytes = KVTile::kBytes + VTile::kBytes;
  using Scan = ValueScanSmem<BLOCK_KV, THREADS, ROW_BLOCKS>;
  static constexpr int kScanOffset = QTile::kBytes + STAGES * kStageBytes;
  static constexpr int kSmemBytes = kScanOffset + Scan::kBytes;

  // One CTA per (query block and key chunk, head, batch), the chunk fastest; with GQA packing
  // the heads are the kv heads (and T = 1: one query block).
  __host__ __device__ static FoldedGrid grid(const AttentionParams& p) {
    return {CeilDiv(p.q_len, BLOCK_Q) * p.kv_splits, p.pack_gqa ? p.kv_heads : p.q_heads, p.batch};
  }

  static_assert(BLOCK_Q == WARPS * WARP_Q && WARP_Q % MMA_M == 0, "each warp owns whole m16 row blocks");
  static_assert(HEAD_DIM % 32 == 0 && V_HEAD_DIM % 32 == 0 && BLOCK_KV % 16 == 0, "fragments come in 16x16 blocks");
  static_assert(OTile::kBytes <= QTile::kBytes, "O is staged over the Q tile");
  static_assert(STAGES >= 2, "the ring overlaps the next tile's copy with this tile's math");
  static_assert(kSmemBytes <= kMaxSmemBytes, "forward tile does not fit 99 KB of shared memory");
};

// S = Q·Kᵀ for the warp's rows: s[rb][16 x BLOCK_KV] (ROW_BLOCKS x (MMA_M rows, MMA_N cols,
// 4 regs)), each K fragment loaded once for every row block.
template <class Elem, int HEAD_DIM, class K>
__device__ __forceinline__ void compute_qk(float (&s)[K::ROW_BLOCKS][K::BLOCK_KV / MMA_N][4], const char* q_tile,
                                           const char* k_tile, int warp, int lane) {
  clear(s);
  mma_row_blocks_a_smem_b_rows<Elem, typename K::QTile, typename K::KVTile, HEAD_DIM / MMA_K, K::ROW_BLOCKS,
                               K::BLOCK_KV / MMA_N, K::K_UNROLL>(s, q_tile, warp * K::WARP_Q, k_tile, 0, lane);
}

// O += P·V with P repacked from the S accumulator (no shared-memory round trip) and V read
// with ldmatrix.trans, each V fragment once for every row block.
template <class Elem, int V_HEAD_DIM, class K>
__device__ __forceinline__ void accumulate_pv(float (&o)[K::ROW_BLOCKS][V_HEAD_DIM / MMA_N][4],
                                              const float (&p)[K::ROW_BLOCKS][K::BLOCK_KV / MMA_N][4],
                                              const char* v_tile, int lane) {
  JAX_FLASH_UNROLL
  for (int kk = 0; kk < K::BLOCK_KV / MMA_K; ++kk) {
    uint32_t a[K::ROW_BLOCKS][4];  // P (16 x 16) of keys kk·16.. of each row block
    JAX_FLASH_UNROLL
    for (int rb = 0; rb < K::ROW_BLOCKS; ++rb) accumulator_as_a<Elem>(a[rb], p[rb], kk);
    mma_row_blocks_a_regs_b_trans<Elem, typename K::VTile>(o, a, v_tile, kk * MMA_K, lane);
  }
}

// Where the rows of a CTA's tile live in global memory: positions t0.. of query head n, or
// with GQA packing the query heads n.. of one kv head at position 0, which lie next to each
// other in q, out and lse (T = 1). Offsets in elements; lse rows are 1 apart either way.
struct ForwardRows {
  int valid;               // tile rows with a query; the others are never stored
  int64_t q0, q_stride;    // q
  int64_t o0, o_stride;    // out, and each chunk of partial_out
  int64_t stat0;           // lse, and each chunk of partial_lse

  template <bool HV_IS_H>
  __device__ __forceinline__ static ForwardRows of(const AttentionParams& p, int b, int n, int t0) {
    ForwardRows r;
    r.valid = p.pack_gqa ? p.q_heads / p.kv_heads : p.q_len - t0;
    r.q0 = p.q_offset(b, t0, n);
    r.q_stride = p.pack_gqa ? p.head_dim : p.q_row_stride();
    r.o0 = p.o_offset<HV_IS_H>(b, t0, n);
    r.o_stride = p.pack_gqa ? p.v_width<HV_IS_H>() : p.o_row_stride<HV_IS_H>();
    r.stat0 = p.stat_offset(b, n, t0);
    return r;
  }
};

// out (16-bit) and lse (natural log) of one m16 row block of the warp (tile rows row0..),
// written once.
template <class Elem, class K, int O_BLOCKS>
__device__ __forceinline__ void store_output(const AttentionParams& p, const ForwardRows& rows,
                                             const float (&o)[O_BLOCKS][4], const float lse[2], char* smem, int row0,
                                             int lane) {
  JAX_FLASH_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + (lane >> 2) + 8 * r;
    if ((lane & 3) == 0 && row < rows.valid) ptx::st_global_f32(p.lse + rows.stat0 + row, lse[r]);
  }
  store_warp_rows<Elem, typename K::OTile>(p.out + rows.o0, rows.o_stride, rows.valid, o, smem, row0, lane);
}

// Split-KV: the same rows' O (normalised, float32) and lse into chunk `split`'s partials.
template <int O_BLOCKS>
__device__ __forceinline__ void store_partial(const AttentionParams& p, const ForwardRows& rows,
                                              const float (&o)[O_BLOCKS][4], const float lse[2], int split, int row0,
                                              int lane) {
  const int64_t stats = static_cast<int64_t>(p.batch) * p.q_heads * p.q_len;
  float* const out = p.partial_out + split * stats * (O_BLOCKS * MMA_N) + rows.o0;
  JAX_FLASH_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + (lane >> 2) + 8 * r;
    if (row >= rows.valid) continue;
    if ((lane & 3) == 0) ptx::st_global_f32(p.partial_lse + split * stats + rows.stat0 + row, lse[r]);
    JAX_FLASH_UNROLL
    for (int j = 0; j < O_BLOCKS; ++j) {
      float* dst = out + row * rows.o_stride + 8 * j + 2 * (lane & 3);
      ptx::st_global_f32(dst, o[j][2 * r]);
      ptx::st_global_f32(dst + 1, o[j][2 * r + 1]);
    }
  }
}

// The decoding tile's paged copies (one warp): lane l holds in lane_rows[g] the pool row of
// the tile's key row l + 32·g (p.key_row: a page-table read and a division, once per tile), and
// each copy takes its row's from the lane that holds it (two shuffles), instead of a table read
// and a division per copy. Rows >= rows_valid are zero-filled, never read; every lane runs every
// shuffle (the copies are the same count on each).
template <class Tile, int GROUPS>
__device__ __forceinline__ void load_rows_held_by_lanes_async(char* tile, const uint16_t* pool, int64_t row_stride,
                                                              int rows_valid, const int64_t (&lane_rows)[GROUPS],
                                                              int lane) {
  constexpr int kCopies = Tile::kRows * Tile::kChunks;
  static_assert(kCopies % WARP_SIZE == 0 && Tile::kRows <= GROUPS * WARP_SIZE, "one warp, a row per lane and group");
  JAX_FLASH_UNROLL_N(2)
  for (int i = 0; i < kCopies / WARP_SIZE; ++i) {
    const int copy = i * WARP_SIZE + lane;
    const int row = copy / Tile::kChunks, chunk = copy % Tile::kChunks;
    int64_t at = 0;
    JAX_FLASH_UNROLL
    for (int g = 0; g < GROUPS; ++g) {
      const uint32_t lo = __shfl_sync(0xffffffffu, static_cast<uint32_t>(lane_rows[g]), row % WARP_SIZE);
      const uint32_t hi = __shfl_sync(0xffffffffu, static_cast<uint32_t>(lane_rows[g] >> 32), row % WARP_SIZE);
      if (row / WARP_SIZE == g) at = static_cast<int64_t>((static_cast<uint64_t>(hi) << 32) | lo);
    }
    const bool inside = row < rows_valid;
    ptx::cp_async_16(tile + Tile::chunk_offset(row, chunk), pool + (inside ? at * row_stride + chunk * 8 : 0),
                     inside ? 16 : 0);
  }
}

template <class Elem, int HEAD_DIM, int V_HEAD_DIM, Layout LAYOUT, ForwardVariant VARIANT>
__global__ void __launch_bounds__(ForwardKernel<Elem, HEAD_DIM, V_HEAD_DIM, LAYOUT, VARIANT>::THREADS, 1)
    attention_forward_kernel(const AttentionParams p) {
  using K = ForwardKernel<Elem, HEAD_DIM, V_HEAD_DIM, LAYOUT, VARIANT>;
  JAX_FLASH_DYNAMIC_SMEM(smem);
  const FoldedGrid grid = K::grid(p);
  const GridIndex at = grid.index();
  if (!grid.contains(at)) return;  // past the last head (more than 65535 heads span grid.z)
  // A routed call (AttentionParams::route) may launch the plain kernel beside this one: one of
  // them runs, this one wherever the route is not the plain kernel's.
  const int route = p.read_route();
  if (route == kRoutePlain && p.plain_beside) return;
  const int q_block = at.block / p.kv_splits, split = at.block % p.kv_splits, batch = at.batch;
  const int warp = static_cast<int>(threadIdx.x) / WARP_SIZE, lane = static_cast<int>(threadIdx.x) % WARP_SIZE;
  const int group = p.q_heads / p.kv_heads;
  // The first query head of the tile's rows, and its kv head (GQA packing: grid heads are kv heads).
  const int head = p.pack_gqa ? at.head * group : at.head;
  const int kv_head = head / group;
  const int t0 = q_block * K::BLOCK_Q;
  const int warp_t0 = t0 + warp * K::WARP_Q;
  // The positions the mask sees: a block of rows, or (GQA packing) the one position 0.
  const int positions = p.pack_gqa ? 1 : K::BLOCK_Q;

  const Mask mask = Mask::of(p, batch);
  const LogitScaling scaling = LogitScaling::of(p);
  const dropout::Setting drop = p.dropout_setting();
  const Range keys = mask.keys_of_rows(t0, t0 + positions);

  // ROW_BLOCKS x (MMA_M rows, MMA_N cols, 4 regs): the warp's WARP_Q x V_HEAD_DIM output, and
  // one online softmax per m16 row block. The sink of a split belongs to its first chunk.
  float o[K::ROW_BLOCKS][V_HEAD_DIM / MMA_N][4];
  clear(o);
  OnlineSoftmax softmax[K::ROW_BLOCKS];
  JAX_FLASH_UNROLL
  for (int rb = 0; rb < K::ROW_BLOCKS; ++rb) {
    float sinks[2];
    JAX_FLASH_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int row = warp * K::WARP_Q + MMA_M * rb + (lane >> 2) + 8 * r;
      const bool has_sink = split == 0 && (!p.pack_gqa || row < group);
      sinks[r] = has_sink ? p.sink(p.pack_gqa ? head + row : head) : -INFINITY;
    }
    softmax[rb].init(sinks, lane);
  }
  const bool scans_values = p.scans_values() || route == kRouteScanValues;
  char* const scan = smem + K::kScanOffset;
  if (scans_values) clear_notes<K::ROW_BLOCKS>(K::Scan::notes(scan));

  // This CTA's chunk of the key tiles the block sees (all of them without a split); of them
  // run all but those a block mask leaves empty (kernels/block_mask.h).
  int tile_begin = 0, tile_end = 0;
  if (!keys.empty()) {
    const int first_tile = keys.lo / K::BLOCK_KV;
    const int tiles = CeilDiv(keys.hi, K::BLOCK_KV) - first_tile;
    tile_begin = first_tile + tiles * split / p.kv_splits;
    tile_end = first_tile + tiles * (split + 1) / p.kv_splits;
  }
  auto runs = [&](int tile) {
    return !p.blocks_present() || p.block_rows(batch, head).any_visible(t0, positions, tile * K::BLOCK_KV, K::BLOCK_KV);
  };
  const int first_running = next_running(tile_begin, tile_end, runs);

  if (first_running < tile_end) {
    char* const q_tile = smem;
    char* const kv_ring = smem + K::QTile::kBytes;
    // K and V rows of this (batch, kv head): a contiguous cache's, or the pool's of a paged one.
    const bool paged = p.page_table != nullptr;
    const uint16_t* const k_base = p.k + (paged ? int64_t{kv_head} * HEAD_DIM : p.kv_offset(batch, 0, kv_head));
    const uint16_t* const v_base =
        p.v + (paged ? int64_t{kv_head} * V_HEAD_DIM : p.v_offset<K::kHvIsH>(batch, 0, kv_head));
    // A row stride as the copies of one tile see it: on the decoding tile read again per tile
    // (ptx::mov_b32_volatile; it fits 32 bits there, DecodeTileRefusal), since its one warp
    // issues 16 to 32 copies per tile, whose addresses, held across the loop, would take two
    // registers each.
    auto per_tile = [](int64_t stride) -> int64_t {
      return K::kDecode ? ptx::mov_b32_volatile(static_cast<int>(stride)) : stride;
    };
    auto load_kv = [&](int tile, int slot) {
      const int64_t kv_stride = per_tile(p.kv_row_stride());
      const int64_t v_stride = per_tile(p.v_row_stride<K::kHvIsH>());
      const int s0 = tile * K::BLOCK_KV;
      char* stage = kv_ring + slot * K::kStageBytes;
      if (paged) {  // each row from its page's slot (cp.async from the page's own address)
        // (At H = 256 the held rows would take registers its MMAs need: 8 bytes spill on sm_80.)
        if constexpr (K::kDecode && HEAD_DIM <= 192) {
          constexpr int kGroups = CeilDiv(K::BLOCK_KV, WARP_SIZE);
          int64_t lane_rows[kGroups];
          JAX_FLASH_UNROLL
          for (int g = 0; g < kGroups; ++g) {
            const int row = lane + WARP_SIZE * g;
            lane_rows[g] = row < p.kv_len - s0 ? p.key_row(batch, s0 + row) : 0;
          }
          load_rows_held_by_lanes_async<typename K::KVTile>(stage, k_base, kv_stride, p.kv_len - s0, lane_rows, lane);
          load_rows_held_by_lanes_async<typename K::VTile>(stage + K::KVTile::kBytes, v_base, v_stride, p.kv_len - s0,
                                                           lane_rows, lane);
          return;
        }
        auto row_of = [&](int row) { return p.key_row(batch, s0 + row); };
        load_tile_rows_async<typename K::KVTile, K::THREADS>(stage, k_base, kv_stride, p.kv_len - s0, row_of);
        load_tile_rows_async<typename K::VTile, K::THREADS>(stage + K::KVTile::kBytes, v_base, v_stride, p.kv_len - s0,
                                                            row_of);
        return;
      }
      load_tile_async<typename K::KVTile, K::THREADS>(stage, k_base + s0 * kv_stride, kv_stride, p.kv_len - s0);
      load_tile_async<typename K::VTile, K::THREADS>(stage + K::KVTile::kBytes, v_base + s0 * v_stride, v_stride,
                                                     p.kv_len - s0);
    };

    const int warp_positions = p.pack_gqa ? 1 : K::WARP_Q;
    const int warp_p0 = p.pack_gqa ? 0 : warp_t0;
    const SegmentRange warp_ids = mask.q_segments != nullptr
                                      ? warp_segment_range(mask.q_segments, warp_p0, warp_positions, mask.q_valid, lane)
                                      : SegmentRange{0, 0};

    // The next running tile to copy: STAGES - 1 ahead of the math.
    int fetch = first_running;

    // Prologue: the Q tile, then the first STAGES - 1 key tiles, one commit group each.
    const ForwardRows q_rows = ForwardRows::of<K::kHvIsH>(p, batch, head, t0);
    load_tile_async<typename K::QTile, K::THREADS>(q_tile, p.q + q_rows.q0, q_rows.q_stride, q_rows.valid);
    ptx::cp_async_commit_group();
    JAX_FLASH_UNROLL
    for (int stage = 0; stage < K::STAGES - 1; ++stage) {
      if (fetch < tile_end) {
        load_kv(fetch, stage);
        fetch = next_running(fetch + 1, tile_end, runs);
      }
      ptx::cp_async_commit_group();  // possibly empty: keeps one group per ring slot
    }

    for (int tile = first_running, count = 0; tile < tile_end; tile = next_running(tile + 1, tile_end, runs), ++count) {
      const int slot = count % K::STAGES;
      // This tile (and Q) have landed; every warp is done with the slot the next copy reuses.
      ptx::cp_async_wait_group<K::STAGES - 2>();
      __syncthreads();
      if (fetch < tile_end) {
        load_kv(fetch, (count + K::STAGES - 1) % K::STAGES);
        fetch = next_running(fetch + 1, tile_end, runs);
      }
      ptx::cp_async_commit_group();
      count_tile(TilePass::kForward);

      const char* k_tile = kv_ring + slot * K::kStageBytes;
      const char* v_tile = k_tile + K::KVTile::kBytes;
      const int s0 = tile * K::BLOCK_KV;
      // The decoding settings read V once: its non-finite elements are zeroed here, their keys flagged.
      if (scans_values) {
        zero_nonfinite_rows<Elem, typename K::VTile, K::THREADS>(kv_ring + slot * K::kStageBytes + K::KVTile::kBytes,
                                                                 K::Scan::key_flags(scan));
        __syncthreads();
      }
      // Segment ids: a warp whose rows share no id with the tile skips it (warp-uniform).
      bool segments_allow_all = true;
      if (mask.q_segments != nullptr) {
        const SegmentRange tile_ids = warp_segment_range(mask.kv_segments, s0, K::BLOCK_KV, mask.kv_valid, lane);
        if (warp_ids.disjoint(tile_ids)) continue;
        segments_allow_all = warp_ids.same_single(tile_ids);
      }
      float s[K::ROW_BLOCKS][K::BLOCK_KV / MMA_N][4];  // ROW_BLOCKS x (MMA_M, MMA_N, 4 regs): S, then P
      compute_qk<Elem, HEAD_DIM, K>(s, q_tile, k_tile, warp, lane);
      JAX_FLASH_UNROLL
      for (int rb = 0; rb < K::ROW_BLOCKS; ++rb) {
        const int rows_t0 = warp_t0 + MMA_M * rb;
        if (p.pack_gqa) {
          // Every row at position 0, no dense bias or mask (the host packs only without them).
          const bool interior = mask.is_interior(0, 1, s0, K::BLOCK_KV, segments_allow_all);
          scaling.prepare<false>(s[rb], mask, DenseRows{}, DenseRows{}, BlockRows{}, true, 0, s0, lane);
          if (!interior) mask_columns(s[rb], mask, 0, s0, lane);
        } else {
          const bool interior = mask.is_interior(rows_t0, MMA_M, s0, K::BLOCK_KV, segments_allow_all);
          // The bias and mask rows, derived per tile (ptx::mov_b32_volatile): held across the loop they spill.
          const int b_tile = ptx::mov_b32_volatile(batch);
          scaling.prepare<false>(s[rb], mask, p.bias_rows(b_tile, head), p.mask_rows(b_tile, head),
                                 p.block_rows(b_tile, head), interior, rows_t0, s0, lane);
        }
        if (scans_values) note_rows_that_see(s[rb], K::Scan::key_flags(scan), K::Scan::notes(scan), rb, lane);
        softmax[rb].update(s[rb], o[rb], scaling.exp_scale);
        // Dropout after the statistics: P·V of the kept weights (scaled at the end).
        if (drop.on)
          drop_fragment(s[rb], keep_bits_of_fragment<false, K::BLOCK_KV / MMA_N>(drop, batch, head, rows_t0, s0, lane),
                        1.0f);
      }
      accumulate_pv<Elem, V_HEAD_DIM, K>(o, s, v_tile, lane);
    }
    ptx::cp_async_wait_group<0>();
  }
  // With Hv < H, O's rows are narrower than Q's: a warp's O rows overlap another warp's Q rows,
  // which that warp may still be reading.
  if constexpr (!K::kHvIsH) __syncthreads();

  // The rows' addresses, derived here (ptx::mov_b32_volatile): held across the loop they spill.
  const ForwardRows rows = ForwardRows::of<K::kHvIsH>(p, ptx::mov_b32_volatile(batch), head, t0);
  JAX_FLASH_UNROLL
  for (int rb = 0; rb < K::ROW_BLOCKS; ++rb) {
    float lse[2];
    softmax[rb].finish(o[rb], scaling.exp_scale, lse);
    if (scans_values) poison_rows(o[rb], K::Scan::notes(scan), rb);
    if (drop.on) scale_fragment(o[rb], drop.keep_scale);
    const int row0 = warp * K::WARP_Q + MMA_M * rb;
    if (p.kv_splits > 1) {
      store_partial(p, rows, o[rb], lse, split, row0, lane);
    } else {
      store_output<Elem, K>(p, rows, o[rb], lse, smem, row0, lane);
    }
  }
}

// The plain forward's tiles (PlainForwardShape, kernels/tile.h) and shared memory: Q, one K and
// one V tile (FlashAttention-2's split waits instead of a ring: V's copy overlaps S = Q·Kᵀ, the
// next K's the softmax and O += P·V). One instantiation per (element, H, Hv), whatever the
// layout attribute says.
template <class Elem, int HEAD_DIM, int V_HEAD_DIM = HEAD_DIM>
struct PlainForwardKernel {
  static constexpr TileShape kShape = PlainForwardShape(HEAD_DIM, V_HEAD_DIM);
  static constexpr int BLOCK_Q = kShape.block_q;
  static constexpr int BLOCK_KV = kShape.block_kv;
  static constexpr int WARPS = kShape.warps;
  static constexpr int THREADS = WARPS * WARP_SIZE;
  // CTAs per SM asked of the register allocator: 2 of 4 warps (at most 255 registers each),
  // else 1 (left alone, ptxas for sm_120 caps 8 warps at 128 registers and spills).
  static constexpr int MIN_CTAS = WARPS == 4 ? 2 : 1;
  static constexpr int WARP_Q = kShape.rows_per_warp;
  static constexpr int ROW_BLOCKS = WARP_Q / MMA_M;
  // k-steps of S = Q·Kᵀ unrolled at once: all of them, but at H > 128 (O alone takes HEAD_DIM / 2
  // registers) two.
  static constexpr int K_UNROLL = HEAD_DIM > 128 ? 2 : HEAD_DIM / MMA_K;

  using QTile = SmemTile<BLOCK_Q, HEAD_DIM>;
  using KVTile = SmemTile<BLOCK_KV, HEAD_DIM>;
  using VTile = SmemTile<BLOCK_KV, V_HEAD_DIM>;
  using OTile = SmemTile<BLOCK_Q, V_HEAD_DIM>;
  static constexpr bool kHvIsH = V_HEAD_DIM == HEAD_DIM;
  // Shared memory: [Q][K][V].
  static constexpr int kKOffset = QTile::kBytes;
  static constexpr int kVOffset = kKOffset + KVTile::kBytes;
  static constexpr int kSmemBytes = kVOffset + VTile::kBytes;

  __host__ __device__ static FoldedGrid grid(const AttentionParams& p) {
    return {CeilDiv(p.q_len, BLOCK_Q), p.q_heads, p.batch};
  }
  // The query block of a CTA: the last first. Under a causal mask the last blocks see the most
  // keys; launched first, they leave the short ones to fill the last wave (FlashAttention-2's
  // order). The same work either way otherwise.
  __device__ __forceinline__ static int query_block(const FoldedGrid& grid, const GridIndex& at) {
    return grid.blocks - 1 - at.block;
  }

  static_assert(BLOCK_Q == ForwardKernel<Elem, HEAD_DIM, V_HEAD_DIM>::BLOCK_Q,
                "one query block size (the host's rules)");
  static_assert(BLOCK_Q == WARPS * WARP_Q && WARP_Q % MMA_M == 0, "each warp owns whole m16 row blocks");
  static_assert(OTile::kBytes <= QTile::kBytes, "O is staged over the Q tile");
  static_assert(kSmemBytes <= kMaxSmemBytes, "plain forward tile does not fit 99 KB of shared memory");
};

// The plain forward (AttentionParams::plain; PlainForwardRefusal says which calls it serves): a
// call without any optional feature, whose raw scores the caller has checked finite. Its hot
// loop does only the attention. The key tiles a query block sees are cut once into the
// interior ones, where every row of the block sees every key (no mask arithmetic, no test of
// anything), and those before and after them, which apply the structured mask (lengths, the
// window placed by the query offset): three loops in key order over one tile step whose
// masking is a compile-time setting. Copy addresses are computed once per thread
// (TileCopier). Per tile it computes what the general kernel computes, in the same order:
// with the same key tile size the two give the same bits.
template <class Elem, int HEAD_DIM, int V_HEAD_DIM>
__global__ void __launch_bounds__(PlainForwardKernel<Elem, HEAD_DIM, V_HEAD_DIM>::THREADS,
                                  PlainForwardKernel<Elem, HEAD_DIM, V_HEAD_DIM>::MIN_CTAS)
    attention_forward_plain_kernel(const AttentionParams p) {
  using K = PlainForwardKernel<Elem, HEAD_DIM, V_HEAD_DIM>;
  JAX_FLASH_DYNAMIC_SMEM(smem);
  const FoldedGrid grid = K::grid(p);
  const GridIndex at = grid.index();
  if (!grid.contains(at)) return;
  if (p.route != nullptr && p.read_route() != kRoutePlain) return;  // a routed call's other kernel runs
  const int q_block = K::query_block(grid, at), batch = at.batch, head = at.head;
  const int warp = static_cast<int>(threadIdx.x) / WARP_SIZE, lane = static_cast<int>(threadIdx.x) % WARP_SIZE;
  const int kv_head = head / (p.q_heads / p.kv_heads);
  const int t0 = q_block * K::BLOCK_Q;
  const Mask mask = Mask::of(p, batch);  // lengths and the window (no segment ids)
  // The softmax in base 2 on the raw scores s: p = exp2((s − m)·exp_scale), the difference of
  // two float32 scores rounded once and multiplied by scale·log2 e (scale is positive and
  // normal, PlainForwardRefusal): the row max gets exp2(0) = 1, and no logit x = scale·s is
  // formed per score. The sink joins at the end (finish_scores), in logits.
  const float exp_scale = __fmul_rn(p.scale, kLog2e);

  float o[K::ROW_BLOCKS][V_HEAD_DIM / MMA_N][4];  // ROW_BLOCKS x (MMA_M, MMA_N, 4 regs)
  clear(o);
  OnlineSoftmax softmax[K::ROW_BLOCKS];
  JAX_FLASH_UNROLL
  for (int rb = 0; rb < K::ROW_BLOCKS; ++rb) softmax[rb].init_empty();

  // The key tiles the block sees, and the interior ones among them: every (t, s) of the
  // block's rows that exist (t < T; padding rows are never stored) is visible.
  const Range keys = mask.keys_of_rows(t0, t0 + K::BLOCK_Q);
  const int tile_begin = keys.empty() ? 0 : keys.lo / K::BLOCK_KV;
  const int tile_end = keys.empty() ? 0 : CeilDiv(keys.hi, K::BLOCK_KV);
  const int t_last = min(t0 + K::BLOCK_Q, p.q_len) - 1;
  int interior_begin = tile_end, interior_end = tile_end;
  if (t_last < mask.q_valid) {
    interior_begin = max(tile_begin, CeilDiv(mask.key_lo(t_last), K::BLOCK_KV));
    interior_end = max(interior_begin, min(tile_end, mask.key_hi(t0) / K::BLOCK_KV));
  }

  if (tile_begin < tile_end) {
    char* const q_tile = smem;
    char* const k_tile = smem + K::kKOffset;
    char* const v_tile = smem + K::kVOffset;
    using KCopier = TileCopier<typename K::KVTile, K::THREADS>;
    using VCopier = TileCopier<typename K::VTile, K::THREADS>;
    // The tiles are copied in key order, K one tile ahead of V: each copier runs from the first
    // tile on.
    const int s_begin = tile_begin * K::BLOCK_KV;
    KCopier k_copier =
        KCopier::of(p.k + p.kv_offset(batch, s_begin, kv_head), p.kv_row_stride(), static_cast<int>(threadIdx.x));
    VCopier v_copier = VCopier::of(p.v + p.v_offset<K::kHvIsH>(batch, s_begin, kv_head), p.v_row_stride<K::kHvIsH>(),
                                   static_cast<int>(threadIdx.x));
    // Key tile `tile` (the copier's next) of K or V: CHECKED, it may be the last one of the keys
    // (its rows past S zero-filled); else every row is inside the array (a tile before an
    // interior one's end).
    auto load = [&](auto& copier, char* dst, int tile, auto checked) {
      if constexpr (decltype(checked)::value) {
        copier.copy_checked(dst, p.kv_len - tile * K::BLOCK_KV);
      } else {
        copier.copy_full(dst);
      }
    };
    auto load_k = [&](int tile, auto checked) { load(k_copier, k_tile, tile, checked); };
    auto load_v = [&](int tile, auto checked) { load(v_copier, v_tile, tile, checked); };
    using Checked = std::true_type;
    using Full = std::false_type;

    // Prologue: the Q tile and the first K tile.
    const ForwardRows q_rows = ForwardRows::of<K::kHvIsH>(p, batch, head, t0);
    load_tile_async<typename K::QTile, K::THREADS>(q_tile, p.q + q_rows.q0, q_rows.q_stride, q_rows.valid);
    load_k(tile_begin, Checked{});
    ptx::cp_async_commit_group();

    // One key tile: S = Q·Kᵀ while V's copy lands, the logits x = scale·s (masked where
    // MASKED), then the online softmax and O += P·V while the next K's copy lands. Interior
    // tiles (not MASKED) are whole; the next K tile is too unless NEXT_CHECKED.
    auto step = [&](int tile, auto masked, auto next_checked) {
      ptx::cp_async_wait_group<0>();
      __syncthreads();  // K (and Q) have landed; every warp is done reading the last V
      load_v(tile, masked);
      ptx::cp_async_commit_group();
      count_tile(TilePass::kForward);
      count_tile(TilePass::kForwardPlain);
      if constexpr (decltype(masked)::value) count_tile(TilePass::kForwardPlainMasked);
      float s[K::ROW_BLOCKS][K::BLOCK_KV / MMA_N][4];  // ROW_BLOCKS x (MMA_M, MMA_N, 4 regs): S, then P
      compute_qk<Elem, HEAD_DIM, K>(s, q_tile, k_tile, warp, lane);
      JAX_FLASH_UNROLL
      for (int rb = 0; rb < K::ROW_BLOCKS; ++rb) {
#ifdef JAX_FLASH_PLANT_SCORE_TEST
        // Never in a build: tests/tooling/test_cuda_static.py plants a per-score test here to
        // see the key loop's static budget (build/check_static.py) fail.
        plant_score_test(s[rb]);
#endif
        if constexpr (decltype(masked)::value) {
          // The mask and the rows' positions derived again per masked tile (from the grid
          // index read again): held across the interior loop they would take registers that
          // loop needs.
          const GridIndex here = K::grid(p).index_again();
          const Mask edge = Mask::of(p, here.batch);
          const int rows_t0 = K::query_block(K::grid(p), here) * K::BLOCK_Q + warp * K::WARP_Q + MMA_M * rb;
          if (!edge.is_interior(rows_t0, MMA_M, tile * K::BLOCK_KV, K::BLOCK_KV, true))
            mask_fragment_band(s[rb], edge, rows_t0, tile * K::BLOCK_KV, lane);
        }
      }
      ptx::cp_async_wait_group<0>();
      __syncthreads();  // V has landed; every warp is done reading K
      if constexpr (decltype(next_checked)::value) {
        if (tile + 1 < tile_end) load_k(tile + 1, Checked{});
      } else {
        load_k(tile + 1, Full{});
      }
      ptx::cp_async_commit_group();
      JAX_FLASH_UNROLL
      for (int rb = 0; rb < K::ROW_BLOCKS; ++rb) softmax[rb].update(s[rb], o[rb], exp_scale);
      accumulate_pv<Elem, V_HEAD_DIM, K>(o, s, v_tile, lane);
    };
    using Masked = std::true_type;
    using Interior = std::false_type;
    // The masked tiles before the interior ones, the interior ones (the last of which may be
    // followed by the last, partly filled key tile), the masked ones after.
    int tile = tile_begin;
    for (; tile < interior_begin; ++tile) step(tile, Masked{}, Checked{});
    if (tile < interior_end) {
      for (; tile + 1 < interior_end; ++tile) step(tile, Interior{}, Full{});
      step(tile++, Interior{}, Checked{});
    }
    for (; tile < tile_end; ++tile) step(tile, Masked{}, Checked{});
    ptx::cp_async_wait_group<0>();
  }
  // O is staged over Q (with Hv < H a warp's O rows overlap another warp's Q rows): every warp
  // has read Q for the last time before the last tile's second barrier, so none is needed here.

  // The rows' addresses from the grid index read again (held across the loops they would take
  // registers the key loop needs).
  const GridIndex here = grid.index_again();
  const ForwardRows rows =
      ForwardRows::of<K::kHvIsH>(p, here.batch, here.head, K::query_block(grid, here) * K::BLOCK_Q);
  JAX_FLASH_UNROLL
  for (int rb = 0; rb < K::ROW_BLOCKS; ++rb) {
    float lse[2];
    softmax[rb].finish_scores(o[rb], p.scale, p.sink(here.head), lse);
    store_output<Elem, K>(p, rows, o[rb], lse, smem, warp * K::WARP_Q + MMA_M * rb, lane);
  }
}

// Split-KV's merge (flash-decoding): for each row, lse = log Σ_c e^{lse_c} and out = Σ_c
// e^{lse_c − lse} · O_c over the chunks in order (deterministic, no atomics), one thread per
// 4 features. A chunk that saw no key (lse_c = −inf, O_c = 0) adds nothing; a row no chunk
// saw gets out 0 and lse −inf; a NaN lse_c (a poisoned row) makes the row NaN.
template <class Elem>
__global__ void __launch_bounds__(128) attention_forward_combine_kernel(const AttentionParams p) {
  const int64_t quads = p.v_head_dim / 4;
  const int64_t stats = static_cast<int64_t>(p.batch) * p.q_heads * p.q_len;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= stats * quads) return;
  const int64_t row = i / quads, quad = i % quads;  // row (b, t, n) of out [B, T, N, Hv]
  const int n = static_cast<int>(row % p.q_heads), t = static_cast<int>(row / p.q_heads % p.q_len);
  const int b = static_cast<int>(row / p.q_heads / p.q_len);
  const int64_t stat = p.stat_offset(b, n, t);
  float m = -INFINITY;
  for (int c = 0; c < p.kv_splits; ++c) {
    const float x = ptx::ld_global_f32(p.partial_lse + c * stats + stat);
    m = x != x || m != m ? __uint_as_float(0x7fc00000u) : fmaxf(m, x);
  }
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float lse = -INFINITY;
  if (m != -INFINITY) {
    float sum = 0.0f;
    for (int c = 0; c < p.kv_splits; ++c) sum += expf(ptx::ld_global_f32(p.partial_lse + c * stats + stat) - m);
    lse = m + logf(sum);
    for (int c = 0; c < p.kv_splits; ++c) {
      const float w = expf(ptx::ld_global_f32(p.partial_lse + c * stats + stat) - lse);
      uint32_t part[4];
      ptx::ld_global_v4_b32(part, p.partial_out + (c * stats + row) * p.v_head_dim + 4 * quad);
      JAX_FLASH_UNROLL
      for (int e = 0; e < 4; ++e) acc[e] += w * __uint_as_float(part[e]);
    }
  }
  uint16_t* dst = p.out + row * p.v_head_dim + 4 * quad;
  ptx::st_global_b32(dst, Elem::pack(acc[0], acc[1]));
  ptx::st_global_b32(dst + 2, Elem::pack(acc[2], acc[3]));
  if (quad == 0) ptx::st_global_f32(p.lse + stat, lse);
}

// Host side: one launch per call (two with split-KV), of the kernel of the variant dispatch.h chose.
template <class Elem, int HEAD_DIM, int V_HEAD_DIM, Layout LAYOUT, ForwardVariant VARIANT>
LaunchError LaunchForward(const AttentionParams& p, Stream stream) {
  dim3 grid;
  if constexpr (VARIANT == ForwardVariant::kPlain) {
    using P = PlainForwardKernel<Elem, HEAD_DIM, V_HEAD_DIM>;
    if (LaunchError err = P::grid(p).dims(&grid); !err.empty()) return err;
    return Launch("attention_forward_plain_kernel", attention_forward_plain_kernel<Elem, HEAD_DIM, V_HEAD_DIM>, grid,
                  dim3(P::THREADS), P::kSmemBytes, stream, p);
  } else {
    using K = ForwardKernel<Elem, HEAD_DIM, V_HEAD_DIM, LAYOUT, VARIANT>;
    if (LaunchError err = K::grid(p).dims(&grid); !err.empty()) return err;
    LaunchError err =
        Launch("attention_forward_kernel", attention_forward_kernel<Elem, HEAD_DIM, V_HEAD_DIM, LAYOUT, VARIANT>, grid,
               dim3(K::THREADS), K::kSmemBytes, stream, p);
    if (!err.empty() || p.kv_splits == 1) return err;
    constexpr int kCombineThreads = 128;
    const int64_t threads = static_cast<int64_t>(p.batch) * p.q_heads * p.q_len * (p.v_head_dim / 4);
    if (LaunchError e = LinearGrid((threads + kCombineThreads - 1) / kCombineThreads, &grid); !e.empty()) return e;
    return Launch("attention_forward_combine_kernel", attention_forward_combine_kernel<Elem>, grid,
                  dim3(kCombineThreads), 0, stream, p);
  }
}

}  // namespace kernels
}  // namespace jax_flash
