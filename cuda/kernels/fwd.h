// FlashAttention-2 forward (Dao, 2023, Alg. 1): one CTA per (query block, head, batch), each
// warp owns 16 or 32 query rows (the layout's rows_per_warp: one or two m16 row blocks, which
// share every K and V fragment). Q is loaded once; K and V tiles stream through a multi-stage
// cp.async ring; S = Q·Kᵀ, the online softmax and O += P·V all stay in registers. Q and K have
// HEAD_DIM (H) columns, V and O V_HEAD_DIM (Hv), which may be narrower.
#pragma once

#include <cstdint>

#include "kernels/dropout.h"
#include "kernels/grid.h"
#include "kernels/mask.h"
#include "kernels/params.h"
#include "kernels/platform.h"
#include "kernels/ptx.h"
#include "kernels/softmax.h"
#include "kernels/tile.h"

namespace jax_flash {
namespace kernels {

template <class Elem, int HEAD_DIM, int V_HEAD_DIM = HEAD_DIM, Layout LAYOUT = Layout::kWarp16>
struct ForwardKernel {
  static constexpr TileShape kShape = TileShapeFor(Pass::kForward, HEAD_DIM, V_HEAD_DIM, LAYOUT);
  static constexpr int BLOCK_Q = kShape.block_q;
  static constexpr int BLOCK_KV = kShape.block_kv;
  static constexpr int WARPS = kShape.warps;
  static constexpr int STAGES = kShape.stages;
  static constexpr int THREADS = WARPS * WARP_SIZE;
  static constexpr int WARP_Q = kShape.rows_per_warp;  // query rows per warp
  static constexpr int ROW_BLOCKS = WARP_Q / MMA_M;     // its m16 row blocks
  // k-steps of S = Q·Kᵀ unrolled at once: a warp of 32 rows holds O (HEAD_DIM registers per
  // thread) and S (BLOCK_KV) throughout; at H=96 full unrolling leaves no register to spare,
  // nor at H > 128 with 16 rows (O alone takes HEAD_DIM / 2).
  static constexpr int K_UNROLL = (ROW_BLOCKS > 1 && HEAD_DIM > 64) || HEAD_DIM > 128 ? 2 : HEAD_DIM / MMA_K;

  using QTile = SmemTile<BLOCK_Q, HEAD_DIM>;
  using KVTile = SmemTile<BLOCK_KV, HEAD_DIM>;   // K
  using VTile = SmemTile<BLOCK_KV, V_HEAD_DIM>;  // V (KVTile when Hv = H)
  // O, staged for its store over the Q tile (QTile when Hv = H).
  using OTile = SmemTile<BLOCK_Q, V_HEAD_DIM>;
  static constexpr bool kHvIsH = V_HEAD_DIM == HEAD_DIM;
  // Shared memory: [Q][K_0][V_0][K_1][V_1]...: one Q tile and a ring of STAGES (K, V) tiles.
  static constexpr int kStageBytes = KVTile::kBytes + VTile::kBytes;
  static constexpr int kSmemBytes = QTile::kBytes + STAGES * kStageBytes;

  // One CTA per (query block, head, batch).
  __host__ __device__ static FoldedGrid grid(const AttentionParams& p) {
    return {CeilDiv(p.q_len, BLOCK_Q), p.q_heads, p.batch};
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

// out (16-bit) and lse (natural log) of one m16 row block of the warp (rows t0.., tile rows
// row0..), written once.
template <class Elem, int V_HEAD_DIM, class K>
__device__ __forceinline__ void store_output(const AttentionParams& p, const float (&o)[V_HEAD_DIM / MMA_N][4],
                                             const float lse[2], char* q_tile, int b, int n, int row0, int t0,
                                             int lane) {
  JAX_FLASH_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int t = t0 + (lane >> 2) + 8 * r;
    if ((lane & 3) == 0 && t < p.q_len) ptx::st_global_f32(p.lse + p.stat_offset(b, n, t), lse[r]);
  }
  store_warp_rows<Elem, typename K::OTile>(p.out, p.v_width<K::kHvIsH>(), p, o, q_tile, b, n, row0, t0, lane);
}

template <class Elem, int HEAD_DIM, int V_HEAD_DIM, Layout LAYOUT>
__global__ void __launch_bounds__(ForwardKernel<Elem, HEAD_DIM, V_HEAD_DIM, LAYOUT>::THREADS, 1)
    attention_forward_kernel(const AttentionParams p) {
  using K = ForwardKernel<Elem, HEAD_DIM, V_HEAD_DIM, LAYOUT>;
  JAX_FLASH_DYNAMIC_SMEM(smem);
  const FoldedGrid grid = K::grid(p);
  const GridIndex at = grid.index();
  if (!grid.contains(at)) return;  // past the last head (more than 65535 heads span grid.z)
  const int q_block = at.block, head = at.head, batch = at.batch;
  const int warp = static_cast<int>(threadIdx.x) / WARP_SIZE, lane = static_cast<int>(threadIdx.x) % WARP_SIZE;
  const int kv_head = head / (p.q_heads / p.kv_heads);
  const int t0 = q_block * K::BLOCK_Q;
  const int warp_t0 = t0 + warp * K::WARP_Q;

  const Mask mask = Mask::of(p, batch);
  const LogitScaling scaling = LogitScaling::of(p);
  const dropout::Setting drop = p.dropout_setting();
  const Range keys = mask.keys_of_rows(t0, t0 + K::BLOCK_Q);

  // ROW_BLOCKS x (MMA_M rows, MMA_N cols, 4 regs): the warp's WARP_Q x V_HEAD_DIM output, and
  // one online softmax per m16 row block.
  float o[K::ROW_BLOCKS][V_HEAD_DIM / MMA_N][4];
  clear(o);
  OnlineSoftmax softmax[K::ROW_BLOCKS];
  JAX_FLASH_UNROLL
  for (int rb = 0; rb < K::ROW_BLOCKS; ++rb) softmax[rb].init(p.sink(head), lane);

  if (!keys.empty()) {
    const int tile_begin = keys.lo / K::BLOCK_KV;
    const int tile_end = CeilDiv(keys.hi, K::BLOCK_KV);
    char* const q_tile = smem;
    char* const kv_ring = smem + K::QTile::kBytes;
    const uint16_t* const q_base = p.q + p.q_offset(batch, t0, head);
    const uint16_t* const k_base = p.k + p.kv_offset(batch, 0, kv_head);
    const uint16_t* const v_base = p.v + p.v_offset<K::kHvIsH>(batch, 0, kv_head);
    const int64_t kv_stride = p.kv_row_stride(), v_stride = p.v_row_stride<K::kHvIsH>();
    auto load_kv = [&](int tile, int slot) {
      const int s0 = tile * K::BLOCK_KV;
      char* stage = kv_ring + slot * K::kStageBytes;
      load_tile_async<typename K::KVTile, K::THREADS>(stage, k_base + s0 * kv_stride, kv_stride, p.kv_len - s0);
      load_tile_async<typename K::VTile, K::THREADS>(stage + K::KVTile::kBytes, v_base + s0 * v_stride, v_stride,
                                                     p.kv_len - s0);
    };

    const SegmentRange warp_ids = mask.q_segments != nullptr
                                      ? warp_segment_range(mask.q_segments, warp_t0, K::WARP_Q, mask.q_valid, lane)
                                      : SegmentRange{0, 0};

    // Prologue: the Q tile, then the first STAGES - 1 key tiles, one commit group each.
    load_tile_async<typename K::QTile, K::THREADS>(q_tile, q_base, p.q_row_stride(), p.q_len - t0);
    ptx::cp_async_commit_group();
    JAX_FLASH_UNROLL
    for (int stage = 0; stage < K::STAGES - 1; ++stage) {
      if (tile_begin + stage < tile_end) load_kv(tile_begin + stage, stage);
      ptx::cp_async_commit_group();  // possibly empty: keeps one group per ring slot
    }

    for (int tile = tile_begin; tile < tile_end; ++tile) {
      const int slot = (tile - tile_begin) % K::STAGES;
      // This tile (and Q) have landed; every warp is done with the slot the next copy reuses.
      ptx::cp_async_wait_group<K::STAGES - 2>();
      __syncthreads();
      const int next = tile + K::STAGES - 1;
      if (next < tile_end) load_kv(next, (next - tile_begin) % K::STAGES);
      ptx::cp_async_commit_group();

      const char* k_tile = kv_ring + slot * K::kStageBytes;
      const char* v_tile = k_tile + K::KVTile::kBytes;
      const int s0 = tile * K::BLOCK_KV;
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
        const bool interior = mask.is_interior(rows_t0, MMA_M, s0, K::BLOCK_KV, segments_allow_all);
        // The bias and mask rows, derived per tile (ptx::mov_b32_volatile): held across the loop they spill.
        const int b_tile = ptx::mov_b32_volatile(batch);
        scaling.prepare<false>(s[rb], mask, p.bias_rows(b_tile, head), p.mask_rows(b_tile, head), interior, rows_t0,
                               s0, lane);
        softmax[rb].update(s[rb], o[rb], scaling.exp_scale);
        // Dropout after the statistics: P·V of the kept weights (scaled at the end).
        if (drop.on) drop_fragment(s[rb], keep_bits_of_fragment<false, K::BLOCK_KV / MMA_N>(drop, batch, head, rows_t0, s0, lane), 1.0f);
      }
      accumulate_pv<Elem, V_HEAD_DIM, K>(o, s, v_tile, lane);
    }
    ptx::cp_async_wait_group<0>();
  }
  // With Hv < H, O's rows are narrower than Q's: a warp's O rows overlap another warp's Q rows,
  // which that warp may still be reading.
  if constexpr (!K::kHvIsH) __syncthreads();

  JAX_FLASH_UNROLL
  for (int rb = 0; rb < K::ROW_BLOCKS; ++rb) {
    float lse[2];
    softmax[rb].finish(o[rb], scaling.exp_scale, lse);
    if (drop.on) scale_fragment(o[rb], drop.keep_scale);
    store_output<Elem, V_HEAD_DIM, K>(p, o[rb], lse, smem, batch, head, warp * K::WARP_Q + MMA_M * rb,
                                      warp_t0 + MMA_M * rb, lane);
  }
}

// Host side: one launch per call.
template <class Elem, int HEAD_DIM, int V_HEAD_DIM, Layout LAYOUT>
LaunchError LaunchForward(const AttentionParams& p, Stream stream) {
  using K = ForwardKernel<Elem, HEAD_DIM, V_HEAD_DIM, LAYOUT>;
  dim3 grid;
  if (LaunchError err = K::grid(p).dims(&grid); !err.empty()) return err;
  return Launch("attention_forward_kernel", attention_forward_kernel<Elem, HEAD_DIM, V_HEAD_DIM, LAYOUT>, grid,
                dim3(K::THREADS), K::kSmemBytes, stream, p);
}

}  // namespace kernels
}  // namespace jax_flash
