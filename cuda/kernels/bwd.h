// FlashAttention-2 backward (Dao, 2023, Alg. 2), three kernels on one stream:
//   1. delta:  D = rowsum(dO ∘ O) − dlse per query row (the `delta` workspace result);
//   2. main:   one CTA per (key block, kv head, batch) (64 keys, or 128 in the kWarp32 layout
//              at H <= 64, 32 at H = 192), each warp owns 16 keys (at H >= 192 two warps
//              share them, each with half of dK's and dV's columns); it loops over
//              the query heads of its GQA group and the query blocks that see its keys,
//              recomputes P from lse, keeps dK and dV in registers for the whole loop, and
//              adds dQ = dS·K into the f32 `dq_accum` workspace with atomics (red.global.add,
//              two floats at a time on sm_90+);
//   3. convert: dq = scale · dq_accum in the input dtype.
// The q_heads grid (MQA/GQA at small batch: p.dkv_per_query_head()) runs the main kernel over
// one CTA per (key block, query head, batch) instead, each CTA looping over its one head's
// query blocks and writing that head's dK, dV in f32 into the dk_accum / dv_accum workspaces
// ([B, S, N, H] and [B, S, N, Hv]); the group sum (4. below) then adds each group's G heads in a
// fixed order into dk, dv. G times as many CTAs share the same work, with no atomics on dK, dV
// in either grid.
// The value head dim Hv (V, dO, dV: V_HEAD_DIM) may be narrower than H (Q, K, dQ, dK): dPᵀ =
// V·dOᵀ runs over Hv, dV holds Hv columns, every other product is over H.
// Deterministic mode replaces the atomics and the conversion by a fourth kernel that computes dQ
// per query block (2b below), at the price of recomputing S and dP once more.
// The main kernel computes the transposed tiles Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (rows = keys), so
// Pᵀ and dSᵀ are already the A operands of dV += Pᵀ·dO and dK += dSᵀ·Q, straight from
// registers; dSᵀ goes through shared memory once, for dQ.
#pragma once

#include <cstdint>
#include <type_traits>

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
struct BackwardKernel {
  static constexpr TileShape kShape = TileShapeFor(Pass::kBackward, HEAD_DIM, V_HEAD_DIM, LAYOUT);
  static constexpr int BLOCK_Q = kShape.block_q;
  static constexpr int BLOCK_KV = kShape.block_kv;
  static constexpr int WARPS = kShape.warps;
  static constexpr int STAGES = kShape.stages;
  static constexpr int THREADS = WARPS * WARP_SIZE;
  static constexpr int WARP_KV = kShape.rows_per_warp;  // keys per warp
  // Warps per 16 keys (TileShape::col_splits): each holds dK of DK_COLS and dV of DV_COLS columns.
  static constexpr int COL_SPLITS = kShape.col_splits;
  static constexpr int DK_COLS = HEAD_DIM / COL_SPLITS;
  static constexpr int DV_COLS = V_HEAD_DIM / COL_SPLITS;
  static constexpr int DKV_BLOCKS = (DK_COLS > DV_COLS ? DK_COLS : DV_COLS) / MMA_N;  // n-blocks of the wider
  // k-steps of Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ unrolled at once: dK and dV hold (H + Hv)/2
  // registers per thread (over col_splits) for the whole kernel, so full unrolling would spill
  // at H = 128.
  static constexpr int K_UNROLL = HEAD_DIM <= 64 ? HEAD_DIM / MMA_K : 2;

  using KVTile = SmemTile<BLOCK_KV, HEAD_DIM>;   // K
  using VTile = SmemTile<BLOCK_KV, V_HEAD_DIM>;  // V (KVTile when Hv = H)
  using QTile = SmemTile<BLOCK_Q, HEAD_DIM>;     // Q
  using DoTile = SmemTile<BLOCK_Q, V_HEAD_DIM>;  // dO (QTile when Hv = H)
  using DsTile = SmemTile<BLOCK_KV, BLOCK_Q>;    // dSᵀ, rows = keys
  static constexpr bool kHvIsH = V_HEAD_DIM == HEAD_DIM;
  // Shared memory: [K][V][dSᵀ] then a ring of STAGES x [Q][dO][lse2][delta].
  static constexpr int kStatBytes = BLOCK_Q * 4;
  static constexpr int kStageBytes = QTile::kBytes + DoTile::kBytes + 2 * kStatBytes;
  static constexpr int kRingOffset = KVTile::kBytes + VTile::kBytes + DsTile::kBytes;
  static constexpr int kSmemBytes = kRingOffset + STAGES * kStageBytes;

  // dQ = dS·K of a query block is split over the warps: 16-row groups x DQ_COLS columns.
  static constexpr int DQ_ROW_GROUPS = BLOCK_Q / MMA_M;
  static constexpr int DQ_WARPS_PER_GROUP = WARPS / DQ_ROW_GROUPS;
  static constexpr int DQ_COLS = HEAD_DIM / DQ_WARPS_PER_GROUP;

  // One CTA per (key block, kv head, batch), or per (key block, query head, batch) in the
  // q_heads grid.
  __host__ __device__ static FoldedGrid grid(const AttentionParams& p) {
    return {CeilDiv(p.kv_len, BLOCK_KV), p.dkv_per_query_head() ? p.q_heads : p.kv_heads, p.batch};
  }

  static_assert(BLOCK_KV * COL_SPLITS == WARPS * WARP_KV && WARP_KV == MMA_M, "each warp owns 16 keys");
  static_assert(DK_COLS % 16 == 0 && DK_COLS * COL_SPLITS == HEAD_DIM && DV_COLS % 16 == 0 &&
                    DV_COLS * COL_SPLITS == V_HEAD_DIM,
                "dK, dV split in 16-column blocks");
  static_assert(WARPS % DQ_ROW_GROUPS == 0 && DQ_COLS % 16 == 0, "dQ work splits evenly over the warps");
  static_assert(STAGES >= 2, "the ring overlaps the next query block's copy with this one's math");
  static_assert(kSmemBytes <= kMaxSmemBytes, "backward tile does not fit 99 KB of shared memory");
};

// ---- 1. delta ---------------------------------------------------------------------------------

// Rows of V_HEAD_DIM (Hv) elements: out and dout.
template <int V_HEAD_DIM>
struct DeltaKernel {
  static constexpr int THREADS = 128;
  static constexpr int CHUNKS = V_HEAD_DIM / 8;                      // one 16-byte chunk per lane
  static constexpr int LANES_PER_ROW = NextPowerOfTwo(CHUNKS);  // lanes >= CHUNKS add 0
  static constexpr int ROWS_PER_BLOCK = THREADS / LANES_PER_ROW;
  static_assert(LANES_PER_ROW <= WARP_SIZE, "a row stays inside a warp");
};

template <class Elem, int V_HEAD_DIM>
__global__ void __launch_bounds__(DeltaKernel<V_HEAD_DIM>::THREADS)
    attention_backward_delta_kernel(const AttentionParams p) {
  using K = DeltaKernel<V_HEAD_DIM>;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.q_len * p.q_heads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * K::ROWS_PER_BLOCK + threadIdx.x / K::LANES_PER_ROW;
  const int sub = static_cast<int>(threadIdx.x) % K::LANES_PER_ROW;
  float dot = 0.0f;
  if (row < rows && sub < K::CHUNKS) {
    const int64_t offset = row * V_HEAD_DIM + sub * 8;
    Chunk16 o, d;
    ptx::ld_global_v4_b32(o.w, p.out + offset);
    ptx::ld_global_v4_b32(d.w, p.dout + offset);
    JAX_FLASH_UNROLL
    for (int i = 0; i < 4; ++i) {
      dot += Elem::to_float(static_cast<uint16_t>(o.w[i])) * Elem::to_float(static_cast<uint16_t>(d.w[i]));
      dot += Elem::to_float(static_cast<uint16_t>(o.w[i] >> 16)) * Elem::to_float(static_cast<uint16_t>(d.w[i] >> 16));
    }
  }
  // Every lane takes part in the shuffles (rows past the end contribute nothing).
  JAX_FLASH_UNROLL
  for (int width = K::LANES_PER_ROW / 2; width > 0; width /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, width);
  if (row < rows && sub == 0) {
    const int n = static_cast<int>(row % p.q_heads);
    const int t = static_cast<int>((row / p.q_heads) % p.q_len);
    const int b = static_cast<int>(row / (static_cast<int64_t>(p.q_heads) * p.q_len));
    const int64_t stat = p.stat_offset(b, n, t);
    ptx::st_global_f32(p.delta + stat, dot - ptx::ld_global_f32(p.dlse + stat));
  }
}

// ---- 2. main ----------------------------------------------------------------------------------

// Statistics of the query block [t0, t0 + BLOCK_Q) of head n into the ring slot, with plain
// loads: a 16-byte copy of 4-byte rows could run past the end of [B, N, T].
// One thread per row.
template <class K>
__device__ __forceinline__ void load_statistics(float* lse2, float* delta, const AttentionParams& p, int b, int n,
                                                int t0) {
  static_assert(K::BLOCK_Q <= K::THREADS, "one thread per row of the query block");
  const int i = static_cast<int>(threadIdx.x);
  if (i < K::BLOCK_Q) {
    const int t = t0 + i;
    const bool inside = t < p.q_len;
    const int64_t stat = p.stat_offset(b, n, inside ? t : 0);
    ptx::st_shared_f32(lse2 + i, inside ? lse_offset(ptx::ld_global_f32(p.lse_in + stat)) : INFINITY);
    ptx::st_shared_f32(delta + i, inside ? ptx::ld_global_f32(p.delta + stat) : 0.0f);
  }
}

// P = exp2((x − lse)·exp_scale) and dS = P ∘ (dP − D) ∘ cap′(x), in place (s becomes P, dp
// becomes dS; LogitScaling::probability_and_ds). Columns are query rows of the block.
template <int N_BLOCKS>
__device__ __forceinline__ void probabilities_and_ds(float (&s)[N_BLOCKS][4], float (&dp)[N_BLOCKS][4],
                                                     const float* lse2, const float* delta, const LogitScaling& scaling,
                                                     int lane) {
  JAX_FLASH_UNROLL
  for (int j = 0; j < N_BLOCKS; ++j) {
    JAX_FLASH_UNROLL
    for (int i = 0; i < 4; ++i) {
      const int col = 8 * j + 2 * (lane & 3) + (i & 1);
      scaling.probability_and_ds(s[j][i], ptx::ld_shared_f32(lse2 + col), ptx::ld_shared_f32(delta + col), s[j][i],
                                 dp[j][i]);
    }
  }
}

// dSᵀ (16-bit) of the warp's 16 keys (rows key_row0..) into the shared dSᵀ tile. The
// COL_SPLITS warps of the same keys hold the same dSᵀ: each stores every COL_SPLITS-th n-block.
template <class Elem, class K>
__device__ __forceinline__ void store_ds(char* ds_tile, const float (&ds)[K::BLOCK_Q / MMA_N][4], int key_row0,
                                         int split, int lane) {
  // n-block j of a row is chunk j of it, stored at chunk j ^ swizzle(row): the offset of chunk 0
  // with j XORed into the chunk bits (they are the swizzle's there, zero elsewhere). The row's
  // offset is taken per call (ptx::mov_b32_volatile), so that its n-blocks' offsets are not
  // held across the caller's loop (one register per store).
  static_assert(K::BLOCK_Q / MMA_N <= K::DsTile::kStrideChunks, "an n-block is one chunk of a dSᵀ row");
  JAX_FLASH_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = key_row0 + (lane >> 2) + 8 * r;
    const int first = ptx::mov_b32_volatile(K::DsTile::element_offset(row, 2 * (lane & 3)));
    JAX_FLASH_UNROLL
    for (int j = 0; j < K::BLOCK_Q / MMA_N; ++j) {
      if (j % K::COL_SPLITS != split) continue;
      ptx::st_shared_b32(ds_tile + (first ^ (j << 4)), Elem::pack(ds[j][2 * r], ds[j][2 * r + 1]));
    }
  }
}

// dQ[block rows] += dS·K for this warp's share, added into dq_accum with atomics (the only
// result several CTAs write).
template <class Elem, int HEAD_DIM, class K>
__device__ __forceinline__ void accumulate_dq(const AttentionParams& p, const char* ds_tile, const char* k_tile, int b,
                                              int n, int t0, int warp, int lane) {
  const int row_group = warp / K::DQ_WARPS_PER_GROUP;
  const int col0 = (warp % K::DQ_WARPS_PER_GROUP) * K::DQ_COLS;
  float dq[K::DQ_COLS / MMA_N][4];  // (MMA_M rows, MMA_N cols, 4 regs): 16 query rows x DQ_COLS
  clear(dq);
  JAX_FLASH_UNROLL
  for (int kk = 0; kk < K::BLOCK_KV / MMA_K; ++kk) {
    uint32_t a[4];
    ptx::ldmatrix_x4_trans(a, at_fragment_row<typename K::DsTile>(ds_tile, kk * MMA_K, row_group * 2, lane));
    mma_a_regs_b_trans<Elem, typename K::KVTile>(dq, a, k_tile, kk * MMA_K, col0 / 8, lane);
  }
  JAX_FLASH_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int t = t0 + row_group * MMA_M + (lane >> 2) + 8 * r;
    if (t >= p.q_len) continue;
    // The thread's first pair of the row (columns 2·(lane % 4).., even: 8-byte aligned); the
    // others are immediate offsets from it. Its column derived per item (ptx::mov_b32_volatile):
    // held across the loop as a 64-bit offset, it spills.
    const int col = col0 + 2 * (ptx::mov_b32_volatile(lane) & 3);
    float* const row = p.dq_accum + p.q_offset(b, t, n) + col;
    JAX_FLASH_UNROLL
    for (int j = 0; j < K::DQ_COLS / MMA_N; ++j) {
      ptx::red_global_add_v2_f32(row + 8 * j, dq[j][2 * r], dq[j][2 * r + 1]);
    }
  }
}

// dK (unscaled) of the warp's 16 keys and DK_COLS columns (from dk_col0) and dV of DV_COLS
// columns (from dv_col0) for query head n, in f32 into the workspaces (the q_heads grid: one
// CTA per query head writes each row once).
template <class K>
__device__ __forceinline__ void store_dk_dv_accum(const AttentionParams& p, const float (&dk)[K::DK_COLS / MMA_N][4],
                                                  const float (&dv)[K::DV_COLS / MMA_N][4], int b, int n, int row0,
                                                  int dk_col0, int dv_col0, int lane) {
  JAX_FLASH_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int s = row0 + (lane >> 2) + 8 * r;
    if (s >= p.kv_len) continue;
    const int64_t dk_offset = p.dkv_accum_offset(b, s, n) + dk_col0;
    const int64_t dv_offset = p.dv_accum_offset<K::kHvIsH>(b, s, n) + dv_col0;
    JAX_FLASH_UNROLL
    for (int j = 0; j < K::DKV_BLOCKS; ++j) {  // dK's n-blocks and dV's, side by side
      JAX_FLASH_UNROLL
      for (int i = 0; i < 2; ++i) {
        const int col = 8 * j + 2 * (lane & 3) + i;
        if (j < K::DK_COLS / MMA_N) ptx::st_global_f32(p.dk_accum + dk_offset + col, dk[j][2 * r + i]);
        if (j < K::DV_COLS / MMA_N) ptx::st_global_f32(p.dv_accum + dv_offset + col, dv[j][2 * r + i]);
      }
    }
  }
}

// dK (times scale) of the warp's 16 keys and DK_COLS columns (from dk_col0) and dV of DV_COLS
// columns (from dv_col0), written once.
template <class Elem, class K>
__device__ __forceinline__ void store_dk_dv(const AttentionParams& p, const float (&dk)[K::DK_COLS / MMA_N][4],
                                            const float (&dv)[K::DV_COLS / MMA_N][4], int b, int g, int row0,
                                            int dk_col0, int dv_col0, int lane) {
  JAX_FLASH_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int s = row0 + (lane >> 2) + 8 * r;
    if (s >= p.kv_len) continue;
    const int64_t dk_offset = p.kv_offset(b, s, g) + dk_col0, dv_offset = p.v_offset<K::kHvIsH>(b, s, g) + dv_col0;
    JAX_FLASH_UNROLL
    for (int j = 0; j < K::DKV_BLOCKS; ++j) {  // dK's n-blocks and dV's, side by side
      const int col = 8 * j + 2 * (lane & 3);
      if (j < K::DK_COLS / MMA_N)
        ptx::st_global_b32(p.dk + dk_offset + col, Elem::pack(p.scale * dk[j][2 * r], p.scale * dk[j][2 * r + 1]));
      if (j < K::DV_COLS / MMA_N)
        ptx::st_global_b32(p.dv + dv_offset + col, Elem::pack(dv[j][2 * r], dv[j][2 * r + 1]));
    }
  }
}

template <class Elem, int HEAD_DIM, int V_HEAD_DIM, Layout LAYOUT>
__global__ void __launch_bounds__(BackwardKernel<Elem, HEAD_DIM, V_HEAD_DIM, LAYOUT>::THREADS, 1)
    attention_backward_kernel(const AttentionParams p) {
  using K = BackwardKernel<Elem, HEAD_DIM, V_HEAD_DIM, LAYOUT>;
  JAX_FLASH_DYNAMIC_SMEM(smem);
  const FoldedGrid grid = K::grid(p);
  const GridIndex at = grid.index();
  if (!grid.contains(at)) return;  // past the last head (more than 65535 heads span grid.z)
  // A routed call (AttentionParams::route) launches the plain kernel beside this one: one of
  // them runs, this one wherever the route is not the plain kernel's.
  if (p.plain_beside && p.read_route() == kRoutePlain) return;
  const int kv_block = at.block, batch = at.batch;
  const int warp = static_cast<int>(threadIdx.x) / WARP_SIZE, lane = static_cast<int>(threadIdx.x) % WARP_SIZE;
  // The warp's 16 keys (rows key_row0.. of the K, V tiles) and its dK, dV columns.
  const int key_row0 = (warp / K::COL_SPLITS) * K::WARP_KV, split = warp % K::COL_SPLITS;
  const int dk_col0 = split * K::DK_COLS, dv_col0 = split * K::DV_COLS;
  const int s0 = kv_block * K::BLOCK_KV;
  const int warp_s0 = s0 + key_row0;
  const int group = p.q_heads / p.kv_heads;
  // The query heads this CTA loops over: its kv head's whole group, or (q_heads grid) the one
  // query head of the CTA.
  const bool one_head = p.dkv_per_query_head();
  const int kv_head = one_head ? at.head / group : at.head;
  const int first_head = one_head ? at.head : at.head * group;
  const int heads = one_head ? 1 : group;

  const Mask mask = Mask::of(p, batch);
  const LogitScaling scaling = LogitScaling::of(p);
  const dropout::Setting drop = p.dropout_setting();
  // Work items: (query head of the CTA's heads, query block that sees this key block).
  const Range rows = mask.rows_of_keys(s0, s0 + K::BLOCK_KV);
  const int q_block_begin = rows.lo / K::BLOCK_Q;
  const int q_blocks = rows.empty() ? 0 : CeilDiv(rows.hi, K::BLOCK_Q) - q_block_begin;
  const int items = heads * q_blocks;
  auto item_head = [&](int item) { return first_head + item / q_blocks; };
  auto item_t0 = [&](int item) { return (q_block_begin + item % q_blocks) * K::BLOCK_Q; };
  // Of them run all but those a block mask leaves empty (kernels/block_mask.h).
  auto runs = [&](int item) {
    return !p.blocks_present() ||
           p.block_rows(batch, item_head(item)).any_visible(item_t0(item), K::BLOCK_Q, s0, K::BLOCK_KV);
  };
  const int first_running = next_running(0, items, runs);

  float dk[K::DK_COLS / MMA_N][4];  // (MMA_M rows, MMA_N cols, 4 regs): the warp's 16 keys x DK_COLS
  float dv[K::DV_COLS / MMA_N][4];  // ... x DV_COLS
  clear(dk);
  clear(dv);

  if (first_running < items) {
    char* const k_tile = smem;
    char* const v_tile = smem + K::KVTile::kBytes;
    char* const ds_tile = v_tile + K::VTile::kBytes;
    char* const ring = smem + K::kRingOffset;
    const int64_t kv_stride = p.kv_row_stride();
    auto load_item = [&](int item, int slot) {
      const int n = item_head(item), t0 = item_t0(item);
      // The Q and dO row strides, derived per copy (ptx::mov_b32_volatile): held across the
      // loop, the copies' row addresses spill.
      const int64_t heads_volatile = ptx::mov_b32_volatile(p.q_heads);
      const int64_t q_stride = heads_volatile * p.head_dim, o_stride = heads_volatile * p.template v_width<K::kHvIsH>();
      char* stage = ring + slot * K::kStageBytes;
      load_tile_async<typename K::QTile, K::THREADS>(stage, p.q + p.q_offset(batch, t0, n), q_stride, p.q_len - t0);
      load_tile_async<typename K::DoTile, K::THREADS>(
          stage + K::QTile::kBytes, p.dout + p.o_offset<K::kHvIsH>(batch, t0, n), o_stride, p.q_len - t0);
      float* lse2 = reinterpret_cast<float*>(stage + K::QTile::kBytes + K::DoTile::kBytes);
      load_statistics<K>(lse2, lse2 + K::BLOCK_Q, p, batch, n, t0);
    };

    const SegmentRange warp_ids = mask.q_segments != nullptr
                                      ? warp_segment_range(mask.kv_segments, warp_s0, K::WARP_KV, mask.kv_valid, lane)
                                      : SegmentRange{0, 0};

    int fetch = first_running;  // the next running item to copy: STAGES - 1 ahead of the math

    // Prologue: K and V with the first query block, then the rest of the ring.
    load_tile_async<typename K::KVTile, K::THREADS>(k_tile, p.k + p.kv_offset(batch, s0, kv_head), kv_stride,
                                                    p.kv_len - s0);
    load_tile_async<typename K::VTile, K::THREADS>(v_tile, p.v + p.v_offset<K::kHvIsH>(batch, s0, kv_head),
                                                   p.v_row_stride<K::kHvIsH>(), p.kv_len - s0);
    JAX_FLASH_UNROLL
    for (int stage = 0; stage < K::STAGES - 1; ++stage) {
      if (fetch < items) {
        load_item(fetch, stage);
        fetch = next_running(fetch + 1, items, runs);
      }
      ptx::cp_async_commit_group();
    }

    for (int item = first_running, count = 0; item < items; item = next_running(item + 1, items, runs), ++count) {
      const int slot = count % K::STAGES;
      ptx::cp_async_wait_group<K::STAGES - 2>();
      __syncthreads();  // this block's tiles landed; the slot and dSᵀ tile reused next are free
      if (fetch < items) {
        load_item(fetch, (count + K::STAGES - 1) % K::STAGES);
        fetch = next_running(fetch + 1, items, runs);
      }
      ptx::cp_async_commit_group();
      count_tile(TilePass::kBackward);

      const int n = item_head(item), t0 = item_t0(item);
      const char* q_tile = ring + slot * K::kStageBytes;
      const char* do_tile = q_tile + K::QTile::kBytes;
      const float* lse2 = reinterpret_cast<const float*>(do_tile + K::DoTile::kBytes);
      const float* delta = lse2 + K::BLOCK_Q;

      float s[K::BLOCK_Q / MMA_N][4];   // (MMA_M rows = keys, MMA_N cols = queries, 4 regs): Sᵀ, then Pᵀ
      float dp[K::BLOCK_Q / MMA_N][4];  // dPᵀ, then dSᵀ
      clear(s);
      clear(dp);
      // Segment ids: a warp whose keys share no id with the block skips it (its dSᵀ rows are 0).
      bool visible = true, segments_allow_all = true;
      if (mask.q_segments != nullptr) {
        const SegmentRange block_ids = warp_segment_range(mask.q_segments, t0, K::BLOCK_Q, mask.q_valid, lane);
        visible = !warp_ids.disjoint(block_ids);
        segments_allow_all = warp_ids.same_single(block_ids);
      }
      if (visible) {
        mma_a_smem_b_rows<Elem, typename K::KVTile, typename K::QTile, HEAD_DIM / MMA_K, K::BLOCK_Q / MMA_N,
                          K::K_UNROLL>(s, k_tile, key_row0, q_tile, 0, lane);
        mma_a_smem_b_rows<Elem, typename K::VTile, typename K::DoTile, V_HEAD_DIM / MMA_K, K::BLOCK_Q / MMA_N,
                          K::K_UNROLL>(dp, v_tile, key_row0, do_tile, 0, lane);
        const bool interior = mask.is_interior(t0, K::BLOCK_Q, warp_s0, K::WARP_KV, segments_allow_all);
        // The bias and mask rows of (b, n), derived per item (ptx::mov_b32_volatile): held across the loop they spill.
        const int b_item = ptx::mov_b32_volatile(batch);
        scaling.prepare<true, true>(s, mask, p.bias_rows(b_item, n), p.mask_rows(b_item, n), p.block_rows(b_item, n),
                                    interior, warp_s0, t0, lane);
        // Dropout: out = Z·V with Z = keep ∘ P / (1 − rate); dPᵀ becomes the cotangent of P
        // and Pᵀ becomes Zᵀ for dV (D = rowsum(dO ∘ O) is unchanged).
        const uint64_t keep =
            drop.on ? keep_bits_of_fragment<true, K::BLOCK_Q / MMA_N>(drop, batch, n, warp_s0, t0, lane) : 0;
        if (drop.on) drop_fragment(dp, keep, drop.keep_scale);
        probabilities_and_ds(s, dp, lse2, delta, scaling, lane);
        // dbias = dS summed over the bias' broadcast dims (one of the warps sharing these keys).
        if (p.dbias.present() && split == 0)
          accumulate_dbias(dp, p.dbias, b_item, n, p.q_len, p.kv_len, warp_s0, t0, lane);
        if (drop.on) drop_fragment(s, keep, drop.keep_scale);

        // dV += Pᵀ·dO and dK += dSᵀ·Q (the warp's columns), A operands straight from the
        // accumulators.
        JAX_FLASH_UNROLL
        for (int kk = 0; kk < K::BLOCK_Q / MMA_K; ++kk) {
          uint32_t a[4];
          accumulator_as_a<Elem>(a, s, kk);
          mma_a_regs_b_trans<Elem, typename K::DoTile>(dv, a, do_tile, kk * MMA_K, dv_col0 / 8, lane);
          accumulator_as_a<Elem>(a, dp, kk);
          mma_a_regs_b_trans<Elem, typename K::QTile>(dk, a, q_tile, kk * MMA_K, dk_col0 / 8, lane);
        }
      }

      if (p.accumulate_dq) {  // uniform over the block
        store_ds<Elem, K>(ds_tile, dp, key_row0, split, lane);
        __syncthreads();  // dSᵀ of every warp is in shared memory
        accumulate_dq<Elem, HEAD_DIM, K>(p, ds_tile, k_tile, batch, n, t0, warp, lane);
      }
    }
    ptx::cp_async_wait_group<0>();
  }

  if (one_head) {
    store_dk_dv_accum<K>(p, dk, dv, batch, first_head, warp_s0, dk_col0, dv_col0, lane);
  } else {
    store_dk_dv<Elem, K>(p, dk, dv, batch, kv_head, warp_s0, dk_col0, dv_col0, lane);
  }
}

// ---- 2'. the plain main kernel -----------------------------------------------------------------

// The plain backward's P = exp2((x − lse)·log2 e) of a tile of logits x, in place, and then
// dS = P ∘ (dP − D) of its dPᵀ, in place: the general kernel's arithmetic without its per-score
// tests. Its caller guarantees that every term is finite or a masked −inf (the forward's lse
// below +inf, its out finite), so a masked pair's P = exp2(−inf) = 0 and dS = 0·(dP − D) = 0,
// and a row that saw nothing (lse offset +inf) gets P = 0 as well. lse2 and delta are the ring
// slot's statistics, one per column (query row of the block).
template <int N_BLOCKS>
__device__ __forceinline__ void plain_probabilities(float (&s)[N_BLOCKS][4], const float* lse2, int lane) {
  JAX_FLASH_UNROLL
  for (int j = 0; j < N_BLOCKS; ++j) {
    JAX_FLASH_UNROLL
    for (int i = 0; i < 4; ++i)
      s[j][i] = ptx::ex2_approx((s[j][i] - ptx::ld_shared_f32(lse2 + 8 * j + 2 * (lane & 3) + (i & 1))) * kLog2e);
  }
}
template <int N_BLOCKS>
__device__ __forceinline__ void plain_ds(float (&dp)[N_BLOCKS][4], const float (&prob)[N_BLOCKS][4], const float* delta,
                                         int lane) {
  JAX_FLASH_UNROLL
  for (int j = 0; j < N_BLOCKS; ++j) {
    JAX_FLASH_UNROLL
    for (int i = 0; i < 4; ++i)
      dp[j][i] = prob[j][i] * (dp[j][i] - ptx::ld_shared_f32(delta + 8 * j + 2 * (lane & 3) + (i & 1)));
  }
}

// The logits x = scale·s of a tile, rounded once (LogitScaling::transform without a soft cap
// or the ±inf test).
template <int N_BLOCKS>
__device__ __forceinline__ void scale_scores(float (&s)[N_BLOCKS][4], float scale) {
  JAX_FLASH_UNROLL
  for (int j = 0; j < N_BLOCKS; ++j) {
    JAX_FLASH_UNROLL
    for (int i = 0; i < 4; ++i) s[j][i] = __fmul_rn(s[j][i], scale);  // never contracted into the next FADD
  }
}

// The plain backward (AttentionParams::plain; PlainBackwardRefusal says which calls it serves):
// the main kernel for a call without a per-score feature (soft cap, segment ids, dropout, dense
// bias or mask, block mask) that accumulates dQ with atomics, where the forward's results are
// finite (jax_flash/cuda.py tests lse < +inf and out finite on every call: no poisoned row, no
// NaN or +inf sink). Its loop does only the attention: no ±inf test, no select per score, no
// test of a feature. The query blocks that see the CTA's keys are cut once into the interior
// ones, in which every row sees every key of the CTA (no mask arithmetic), and those before and
// after them, which apply the band mask (lengths, the window placed by the query offset): three
// loops over one step whose masking is a compile-time setting. Per query block it computes what
// the general kernel computes, on the same tiles: the same bits where a CTA has one query head
// (MHA, the q_heads grid); with a GQA group per CTA it takes the heads of a block before the next
// block (one interior loop for all of them), so dK and dV are summed in another order.
template <class Elem, int HEAD_DIM, int V_HEAD_DIM>
__global__ void __launch_bounds__(BackwardKernel<Elem, HEAD_DIM, V_HEAD_DIM>::THREADS, 1)
    attention_backward_plain_kernel(const AttentionParams p) {
  using K = BackwardKernel<Elem, HEAD_DIM, V_HEAD_DIM>;
  JAX_FLASH_DYNAMIC_SMEM(smem);
  const FoldedGrid grid = K::grid(p);
  const GridIndex at = grid.index();
  if (!grid.contains(at)) return;
  if (p.route != nullptr && p.read_route() != kRoutePlain) return;  // a routed call's other kernel runs
  const int kv_block = at.block, batch = at.batch;
  const int warp = static_cast<int>(threadIdx.x) / WARP_SIZE, lane = static_cast<int>(threadIdx.x) % WARP_SIZE;
  const int key_row0 = (warp / K::COL_SPLITS) * K::WARP_KV, split = warp % K::COL_SPLITS;
  const int dk_col0 = split * K::DK_COLS, dv_col0 = split * K::DV_COLS;
  const int s0 = kv_block * K::BLOCK_KV;
  const int group = p.q_heads / p.kv_heads;
  const bool one_head = p.dkv_per_query_head();
  const int kv_head = one_head ? at.head / group : at.head;
  const int first_head = one_head ? at.head : at.head * group;
  const int heads = one_head ? 1 : group;

  const Mask mask = Mask::of(p, batch);  // lengths and the window (no segment ids)
  // The query blocks that see this key block, and the interior ones among them.
  const Range rows = mask.rows_of_keys(s0, s0 + K::BLOCK_KV);
  const int q_block_begin = rows.lo / K::BLOCK_Q;
  const int q_block_end = rows.empty() ? q_block_begin : CeilDiv(rows.hi, K::BLOCK_Q);
  const int q_blocks = q_block_end - q_block_begin;
  const Range interior = mask.interior_row_blocks(K::BLOCK_Q, s0, K::BLOCK_KV, q_block_begin, q_block_end);
  // Work items: (query block, query head of the CTA's heads), the head fastest, so that the
  // items of the interior blocks are one run (one loop, not one per head).
  const int items = heads * q_blocks;

  float dk[K::DK_COLS / MMA_N][4];  // (MMA_M rows, MMA_N cols, 4 regs): the warp's 16 keys x DK_COLS
  float dv[K::DV_COLS / MMA_N][4];  // ... x DV_COLS
  clear(dk);
  clear(dv);

  if (items > 0) {
    char* const k_tile = smem;
    char* const v_tile = smem + K::KVTile::kBytes;
    char* const ds_tile = v_tile + K::VTile::kBytes;
    char* const ring = smem + K::kRingOffset;
    // An item's query head and first row, advanced item by item (no division per item).
    struct Cursor {
      int head, t0;
    };
    const int head_end = first_head + heads;
    auto advance = [&](Cursor& c) {
      if (++c.head == head_end) {
        c.head = first_head;
        c.t0 += K::BLOCK_Q;
      }
    };
    // Q and dO of an item, each copy one 32-bit step from the last (PlainBackwardRefusal:
    // N·max(H, Hv) < 2^23), nothing per copy held across the loop.
    auto load_item = [&](const Cursor& c, int slot) {
      char* stage = ring + slot * K::kStageBytes;
      load_tile_stepped_async<typename K::QTile, K::THREADS>(stage, p.q + p.q_offset(batch, c.t0, c.head),
                                                             p.q_row_stride(), p.q_len - c.t0);
      load_tile_stepped_async<typename K::DoTile, K::THREADS>(stage + K::QTile::kBytes,
                                                              p.dout + p.o_offset<K::kHvIsH>(batch, c.t0, c.head),
                                                              p.o_row_stride<K::kHvIsH>(), p.q_len - c.t0);
      float* lse2 = reinterpret_cast<float*>(stage + K::QTile::kBytes + K::DoTile::kBytes);
      load_statistics<K>(lse2, lse2 + K::BLOCK_Q, p, batch, c.head, c.t0);
    };

    // Prologue: K and V with the first query block, then the rest of the ring.
    load_tile_async<typename K::KVTile, K::THREADS>(k_tile, p.k + p.kv_offset(batch, s0, kv_head), p.kv_row_stride(),
                                                    p.kv_len - s0);
    load_tile_async<typename K::VTile, K::THREADS>(v_tile, p.v + p.v_offset<K::kHvIsH>(batch, s0, kv_head),
                                                   p.v_row_stride<K::kHvIsH>(), p.kv_len - s0);
    // Two stages: the next item's tiles are copied while this one's are used.
    static_assert(K::STAGES == 2, "the plain backward's ring holds this item and the next");
    Cursor here{first_head, q_block_begin * K::BLOCK_Q};
    load_item(here, 0);
    ptx::cp_async_commit_group();

    // One item: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, the logits (masked where MASKED), P and dS,
    // dV += Pᵀ·dO and dK += dSᵀ·Q, then dQ += dS·K through shared memory.
    auto step = [&](int item, auto masked) {
      const int slot = item % 2;
      ptx::cp_async_wait_group<0>();
      __syncthreads();  // this item's tiles landed; the slot and dSᵀ tile reused next are free
      if (item + 1 < items) {
        Cursor next = here;
        advance(next);
        load_item(next, 1 - slot);
      }
      ptx::cp_async_commit_group();
      count_tile(TilePass::kBackward);
      count_tile(TilePass::kBackwardPlain);
      if constexpr (decltype(masked)::value) count_tile(TilePass::kBackwardPlainMasked);
      const char* q_tile = ring + slot * K::kStageBytes;
      const char* do_tile = q_tile + K::QTile::kBytes;
      const float* lse2 = reinterpret_cast<const float*>(do_tile + K::DoTile::kBytes);
      const float* delta = lse2 + K::BLOCK_Q;
      // The fragments' lane offsets taken per item (ptx::mov_b32_volatile): each of their chunks
      // is then one XOR away, instead of more registers held across the loop.
      const int lane_now = ptx::mov_b32_volatile(lane);

      // Pᵀ first, then dPᵀ: the two products' fragments are not in flight at once.
      float s[K::BLOCK_Q / MMA_N][4];  // (MMA_M rows = keys, MMA_N cols = queries, 4 regs): Sᵀ, then Pᵀ
      clear(s);
      mma_a_smem_b_rows<Elem, typename K::KVTile, typename K::QTile, HEAD_DIM / MMA_K, K::BLOCK_Q / MMA_N,
                        HEAD_DIM / MMA_K>(s, k_tile, key_row0, q_tile, 0, lane_now);
      scale_scores(s, p.scale);
#ifdef JAX_FLASH_PLANT_SCORE_TEST
      // Never in a build: tests/tooling/test_cuda_static.py plants a per-score test here to
      // see the key loop's static budget (build/check_static.py) fail.
      plant_score_test(s);
#endif
      if constexpr (decltype(masked)::value) mask_fragment_band_transposed(s, mask, s0 + key_row0, here.t0, lane_now);
      plain_probabilities(s, lse2, lane);
      float dp[K::BLOCK_Q / MMA_N][4];  // dPᵀ, then dSᵀ
      clear(dp);
      mma_a_smem_b_rows<Elem, typename K::VTile, typename K::DoTile, V_HEAD_DIM / MMA_K, K::BLOCK_Q / MMA_N,
                        V_HEAD_DIM / MMA_K>(dp, v_tile, key_row0, do_tile, 0, lane_now);
      plain_ds(dp, s, delta, lane);

      // dV += Pᵀ·dO and dK += dSᵀ·Q (the warp's columns), A operands straight from the
      // accumulators.
      JAX_FLASH_UNROLL
      for (int kk = 0; kk < K::BLOCK_Q / MMA_K; ++kk) {
        uint32_t a[4];
        accumulator_as_a<Elem>(a, s, kk);
        mma_a_regs_b_trans<Elem, typename K::DoTile>(dv, a, do_tile, kk * MMA_K, dv_col0 / 8, lane_now);
        accumulator_as_a<Elem>(a, dp, kk);
        mma_a_regs_b_trans<Elem, typename K::QTile>(dk, a, q_tile, kk * MMA_K, dk_col0 / 8, lane_now);
      }
      store_ds<Elem, K>(ds_tile, dp, key_row0, split, lane);
      __syncthreads();  // dSᵀ of every warp is in shared memory
      accumulate_dq<Elem, HEAD_DIM, K>(p, ds_tile, k_tile, batch, here.head, here.t0, warp, lane_now);
      advance(here);
    };
    using Masked = std::true_type;
    using Interior = std::false_type;
    // The items of the masked blocks before the interior ones, of the interior ones, of the
    // masked ones after.
    const int interior_first = (interior.lo - q_block_begin) * heads;
    const int interior_end = (interior.hi - q_block_begin) * heads;
    int item = 0;
    for (; item < interior_first; ++item) step(item, Masked{});
    for (; item < interior_end; ++item) step(item, Interior{});
    for (; item < items; ++item) step(item, Masked{});
    ptx::cp_async_wait_group<0>();
  }

  // The results' rows from the grid and thread index read again (held across the loops, they
  // spill; so would the grid's block count).
  const GridIndex again = K::grid(p).index_again();
  const int warp_again = tid_x_again() / WARP_SIZE, cols = warp_again % K::COL_SPLITS;
  const int keys0 = again.block * K::BLOCK_KV + (warp_again / K::COL_SPLITS) * K::WARP_KV;
  if (p.dkv_per_query_head()) {
    store_dk_dv_accum<K>(p, dk, dv, again.batch, again.head, keys0, cols * K::DK_COLS, cols * K::DV_COLS, lane);
  } else {
    store_dk_dv<Elem, K>(p, dk, dv, again.batch, again.head, keys0, cols * K::DK_COLS, cols * K::DV_COLS, lane);
  }
}

// ---- 3. convert -------------------------------------------------------------------------------

constexpr int kConvertThreads = 256;

template <class Elem>
__global__ void __launch_bounds__(kConvertThreads)
    attention_backward_convert_dq_kernel(const AttentionParams p, int64_t chunks) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kConvertThreads + threadIdx.x;
  if (i >= chunks) return;
  Chunk16 lo, hi;
  ptx::ld_global_v4_b32(lo.w, p.dq_accum + 8 * i);
  ptx::ld_global_v4_b32(hi.w, p.dq_accum + 8 * i + 4);
  Chunk16 out;
  JAX_FLASH_UNROLL
  for (int j = 0; j < 2; ++j) {
    out.w[j] = Elem::pack(p.scale * __uint_as_float(lo.w[2 * j]), p.scale * __uint_as_float(lo.w[2 * j + 1]));
    out.w[2 + j] = Elem::pack(p.scale * __uint_as_float(hi.w[2 * j]), p.scale * __uint_as_float(hi.w[2 * j + 1]));
  }
  ptx::st_global_v4_b32(p.dq + 8 * i, out.w);
}

// ---- 4. the group sum of the q_heads grid ----------------------------------------------------

// dk = scale · Σ_j dk_accum[query head g·G + j] and dv = Σ_j dv_accum[...] for j = 0 .. G−1 in
// this order (f32 sums, one rounding to 16 bits, like the kv_heads grid's epilogue): one thread
// per 8 elements of a row of dk ([B, S, K, H]: threads 0 .. dk_chunks − 1) or of dv
// ([B, S, K, Hv]: the threads after), H and Hv multiples of 8.
template <class Elem>
__global__ void __launch_bounds__(kConvertThreads)
    attention_backward_reduce_dkv_kernel(const AttentionParams p, int64_t dk_chunks, int64_t chunks) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kConvertThreads + threadIdx.x;
  if (i >= chunks) return;
  const bool is_dk = i < dk_chunks;
  const int width = is_dk ? p.head_dim : p.v_head_dim;
  const float* const accum = is_dk ? p.dk_accum : p.dv_accum;
  const float scale = is_dk ? p.scale : 1.0f;
  const int group = p.q_heads / p.kv_heads;
  const int64_t element = 8 * (is_dk ? i : i - dk_chunks);  // of [B, S, K, width]
  const int64_t row = element / width;                        // (b, s) · K + g
  const int col = static_cast<int>(element % width);
  const int64_t bs = row / p.kv_heads;
  const int g = static_cast<int>(row % p.kv_heads);
  float sum[8] = {};
  for (int j = 0; j < group; ++j) {
    const int64_t offset = (bs * p.q_heads + g * group + j) * width + col;
    JAX_FLASH_UNROLL
    for (int half = 0; half < 2; ++half) {
      Chunk16 c;
      ptx::ld_global_v4_b32(c.w, accum + offset + 4 * half);
      JAX_FLASH_UNROLL
      for (int k = 0; k < 4; ++k) sum[4 * half + k] += __uint_as_float(c.w[k]);
    }
  }
  Chunk16 out;
  JAX_FLASH_UNROLL
  for (int k = 0; k < 4; ++k) out.w[k] = Elem::pack(scale * sum[2 * k], scale * sum[2 * k + 1]);
  ptx::st_global_v4_b32((is_dk ? p.dk : p.dv) + element, out.w);
}

// ---- 5. the dbias sum of deterministic mode ----------------------------------------------------

// dbias[bb, nn, tt, ss] = Σ W[b, n, tt, s] over b (all B where the bias has Bb = 1, else bb), n
// (likewise) and s, in this order: one thread per element of the dbias result [Bb, Nb, Tb, Sb];
// W is the dbias_accum workspace [B, N, Tb, S] (p.dbias, written by the main kernel). A
// template like the other kernels of this header (which every instantiation file includes).
template <class Elem>
__global__ void __launch_bounds__(kConvertThreads)
    attention_backward_reduce_dbias_kernel(const AttentionParams p, int64_t elements) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kConvertThreads + threadIdx.x;
  if (i >= elements) return;
  const int64_t* d = p.dbias_dims;  // Bb, Nb, Tb, Sb
  const int64_t ss = i % d[3], tt = (i / d[3]) % d[2], nn = (i / (d[3] * d[2])) % d[1], bb = i / (d[3] * d[2] * d[1]);
  const int64_t b_end = d[0] == 1 ? p.batch : bb + 1, n_end = d[1] == 1 ? p.q_heads : nn + 1,
                s_end = d[3] == 1 ? p.kv_len : ss + 1;
  const DbiasTarget& w = p.dbias;
  float sum = 0.0f;
  for (int64_t b = d[0] == 1 ? 0 : bb; b < b_end; ++b) {
    for (int64_t n = d[1] == 1 ? 0 : nn; n < n_end; ++n) {
      const float* row = w.data + b * w.stride_b + n * w.stride_n + tt * w.stride_t;
      for (int64_t s = d[3] == 1 ? 0 : ss; s < s_end; ++s) sum += ptx::ld_global_f32(row + s * w.stride_s);
    }
  }
  ptx::st_global_f32(p.dbias_out + i, sum);
}

// ---- 2b. dQ without atomics (deterministic mode) ---------------------------------------------

// One CTA per (query block, head, batch), each warp owns 16 query rows and loops over the key
// tiles its rows see, like the forward: S = Q·Kᵀ and dP = dO·Vᵀ, P from lse, dS, and
// dQ += dS·K with dS repacked from registers; dQ is written once, in a fixed order.
template <class Elem, int HEAD_DIM, int V_HEAD_DIM = HEAD_DIM>
struct BackwardDqKernel {
  static constexpr TileShape kShape = TileShapeFor(Pass::kBackwardDq, HEAD_DIM, V_HEAD_DIM);
  static constexpr int BLOCK_Q = kShape.block_q;
  static constexpr int BLOCK_KV = kShape.block_kv;
  static constexpr int WARPS = kShape.warps;
  static constexpr int STAGES = kShape.stages;
  static constexpr int THREADS = WARPS * WARP_SIZE;
  static constexpr int WARP_Q = MMA_M;
  // k-steps of S and dP unrolled at once (dQ holds HEAD_DIM/2 registers throughout). On sm_100
  // the fully unrolled H = 64 loop needs 255 registers and spills (a stack frame), two steps fit
  // in 246: the unroll is a code-generation choice, the k-steps run in the same order either way.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000 && __CUDA_ARCH__ < 1100
  static constexpr int K_UNROLL = HEAD_DIM < 64 ? HEAD_DIM / MMA_K : 2;
#else
  static constexpr int K_UNROLL = HEAD_DIM <= 64 ? HEAD_DIM / MMA_K : 2;
#endif

  using QTile = SmemTile<BLOCK_Q, HEAD_DIM>;      // Q
  using DoTile = SmemTile<BLOCK_Q, V_HEAD_DIM>;   // dO (QTile when Hv = H)
  using KVTile = SmemTile<BLOCK_KV, HEAD_DIM>;    // K
  using VTile = SmemTile<BLOCK_KV, V_HEAD_DIM>;   // V (KVTile when Hv = H)
  static constexpr bool kHvIsH = V_HEAD_DIM == HEAD_DIM;
  // Shared memory: [Q][dO] then a ring of STAGES x [K][V].
  static constexpr int kStageBytes = KVTile::kBytes + VTile::kBytes;
  static constexpr int kSmemBytes = QTile::kBytes + DoTile::kBytes + STAGES * kStageBytes;

  // One CTA per (query block, head, batch).
  __host__ __device__ static FoldedGrid grid(const AttentionParams& p) {
    return {CeilDiv(p.q_len, BLOCK_Q), p.q_heads, p.batch};
  }

  static_assert(BLOCK_Q == WARPS * WARP_Q, "each warp owns 16 query rows");
  static_assert(STAGES >= 2, "the ring overlaps the next tile's copy with this tile's math");
  static_assert(kSmemBytes <= kMaxSmemBytes, "dQ tile does not fit 99 KB of shared memory");
};

template <class Elem, int HEAD_DIM, int V_HEAD_DIM>
__global__ void __launch_bounds__(BackwardDqKernel<Elem, HEAD_DIM, V_HEAD_DIM>::THREADS, 1)
    attention_backward_dq_kernel(const AttentionParams p) {
  using K = BackwardDqKernel<Elem, HEAD_DIM, V_HEAD_DIM>;
  JAX_FLASH_DYNAMIC_SMEM(smem);
  const FoldedGrid grid = K::grid(p);
  const GridIndex at = grid.index();
  if (!grid.contains(at)) return;  // past the last head (more than 65535 heads span grid.z)
  const int head = at.head, batch = at.batch;
  const int warp = static_cast<int>(threadIdx.x) / WARP_SIZE, lane = static_cast<int>(threadIdx.x) % WARP_SIZE;
  const int kv_head = head / (p.q_heads / p.kv_heads);
  const int t0 = at.block * K::BLOCK_Q;
  const int warp_t0 = t0 + warp * K::WARP_Q;

  const Mask mask = Mask::of(p, batch);
  const LogitScaling scaling = LogitScaling::of(p);
  const dropout::Setting drop = p.dropout_setting();
  const Range keys = mask.keys_of_rows(t0, t0 + K::BLOCK_Q);
  char* const q_tile = smem;
  char* const do_tile = smem + K::QTile::kBytes;

  float dq[HEAD_DIM / MMA_N][4];  // (MMA_M rows, MMA_N cols, 4 regs): the warp's 16 x HEAD_DIM dQ
  clear(dq);

  // The key tiles the block sees, of them all but those a block mask leaves empty, as in the
  // forward (kernels/block_mask.h).
  const int tile_begin = keys.empty() ? 0 : keys.lo / K::BLOCK_KV;
  const int tile_end = keys.empty() ? 0 : CeilDiv(keys.hi, K::BLOCK_KV);
  auto runs = [&](int tile) {
    return !p.blocks_present() ||
           p.block_rows(batch, head).any_visible(t0, K::BLOCK_Q, tile * K::BLOCK_KV, K::BLOCK_KV);
  };
  const int first_running = next_running(tile_begin, tile_end, runs);

  if (first_running < tile_end) {
    char* const ring = do_tile + K::DoTile::kBytes;
    const int64_t kv_stride = p.kv_row_stride(), v_stride = p.v_row_stride<K::kHvIsH>();
    const uint16_t* const k_base = p.k + p.kv_offset(batch, 0, kv_head);
    const uint16_t* const v_base = p.v + p.v_offset<K::kHvIsH>(batch, 0, kv_head);
    auto load_kv = [&](int tile, int slot) {
      const int s0 = tile * K::BLOCK_KV;
      char* stage = ring + slot * K::kStageBytes;
      load_tile_async<typename K::KVTile, K::THREADS>(stage, k_base + s0 * kv_stride, kv_stride, p.kv_len - s0);
      load_tile_async<typename K::VTile, K::THREADS>(stage + K::KVTile::kBytes, v_base + s0 * v_stride, v_stride,
                                                     p.kv_len - s0);
    };

    // The statistics of the thread's two rows, in registers for the whole loop.
    float lse2[2], delta[2];
    JAX_FLASH_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int t = warp_t0 + (lane >> 2) + 8 * r;
      lse2[r] = t < p.q_len ? lse_offset(ptx::ld_global_f32(p.lse_in + p.stat_offset(batch, head, t))) : INFINITY;
      delta[r] = t < p.q_len ? ptx::ld_global_f32(p.delta + p.stat_offset(batch, head, t)) : 0.0f;
    }
    const SegmentRange warp_ids = mask.q_segments != nullptr
                                      ? warp_segment_range(mask.q_segments, warp_t0, K::WARP_Q, mask.q_valid, lane)
                                      : SegmentRange{0, 0};

    int fetch = first_running;  // the next running tile to copy: STAGES - 1 ahead of the math

    load_tile_async<typename K::QTile, K::THREADS>(q_tile, p.q + p.q_offset(batch, t0, head), p.q_row_stride(),
                                                   p.q_len - t0);
    load_tile_async<typename K::DoTile, K::THREADS>(do_tile, p.dout + p.o_offset<K::kHvIsH>(batch, t0, head),
                                                    p.o_row_stride<K::kHvIsH>(), p.q_len - t0);
    ptx::cp_async_commit_group();
    JAX_FLASH_UNROLL
    for (int stage = 0; stage < K::STAGES - 1; ++stage) {
      if (fetch < tile_end) {
        load_kv(fetch, stage);
        fetch = next_running(fetch + 1, tile_end, runs);
      }
      ptx::cp_async_commit_group();
    }

    for (int tile = first_running, count = 0; tile < tile_end; tile = next_running(tile + 1, tile_end, runs), ++count) {
      const int slot = count % K::STAGES;
      ptx::cp_async_wait_group<K::STAGES - 2>();
      __syncthreads();
      if (fetch < tile_end) {
        load_kv(fetch, (count + K::STAGES - 1) % K::STAGES);
        fetch = next_running(fetch + 1, tile_end, runs);
      }
      ptx::cp_async_commit_group();
      count_tile(TilePass::kBackwardDq);

      const char* k_tile = ring + slot * K::kStageBytes;
      const char* v_tile = k_tile + K::KVTile::kBytes;
      const int s0 = tile * K::BLOCK_KV;
      bool segments_allow_all = true;
      if (mask.q_segments != nullptr) {
        const SegmentRange tile_ids = warp_segment_range(mask.kv_segments, s0, K::BLOCK_KV, mask.kv_valid, lane);
        if (warp_ids.disjoint(tile_ids)) continue;
        segments_allow_all = warp_ids.same_single(tile_ids);
      }
      float s[K::BLOCK_KV / MMA_N][4];   // (MMA_M rows, MMA_N cols, 4 regs): S, then P
      float dp[K::BLOCK_KV / MMA_N][4];  // dP, then dS
      clear(s);
      clear(dp);
      mma_a_smem_b_rows<Elem, typename K::QTile, typename K::KVTile, HEAD_DIM / MMA_K, K::BLOCK_KV / MMA_N,
                        K::K_UNROLL>(s, q_tile, warp * K::WARP_Q, k_tile, 0, lane);
      mma_a_smem_b_rows<Elem, typename K::DoTile, typename K::VTile, V_HEAD_DIM / MMA_K, K::BLOCK_KV / MMA_N,
                        K::K_UNROLL>(dp, do_tile, warp * K::WARP_Q, v_tile, 0, lane);
      const bool interior = mask.is_interior(warp_t0, K::WARP_Q, s0, K::BLOCK_KV, segments_allow_all);
      // The bias and mask rows, derived per tile (ptx::mov_b32_volatile): held across the loop they spill.
      const int b_tile = ptx::mov_b32_volatile(batch);
      scaling.prepare<false, true>(s, mask, p.bias_rows(b_tile, head), p.mask_rows(b_tile, head),
                                   p.block_rows(b_tile, head), interior, warp_t0, s0, lane);
      if (drop.on)  // dZ -> dP, the cotangent of P
        drop_fragment(dp, keep_bits_of_fragment<false, K::BLOCK_KV / MMA_N>(drop, batch, head, warp_t0, s0, lane),
                      drop.keep_scale);
      JAX_FLASH_UNROLL
      for (int j = 0; j < K::BLOCK_KV / MMA_N; ++j) {
        JAX_FLASH_UNROLL
        for (int i = 0; i < 4; ++i) scaling.probability_and_ds(s[j][i], lse2[i >> 1], delta[i >> 1], s[j][i], dp[j][i]);
      }
      // dQ += dS·K, dS repacked as the A operand, K read with ldmatrix.trans.
      JAX_FLASH_UNROLL
      for (int kk = 0; kk < K::BLOCK_KV / MMA_K; ++kk) {
        uint32_t a[4];
        accumulator_as_a<Elem>(a, dp, kk);
        mma_a_regs_b_trans<Elem, typename K::KVTile>(dq, a, k_tile, kk * MMA_K, 0, lane);
      }
    }
    ptx::cp_async_wait_group<0>();
  }

  JAX_FLASH_UNROLL
  for (int j = 0; j < HEAD_DIM / MMA_N; ++j) {
    JAX_FLASH_UNROLL
    for (int i = 0; i < 4; ++i) dq[j][i] *= p.scale;
  }
  store_warp_rows<Elem, typename K::QTile>(p.dq, p.head_dim, p, dq, q_tile, batch, head, warp * K::WARP_Q, warp_t0,
                                           lane);
}

// Host side: zero dq_accum, the delta kernel, then the main kernel, the group sum of dK and dV
// (q_heads grid only) and the dQ conversion, in order on one stream. Deterministic mode adds no
// atomics: the main kernel computes dK and dV only, and the dQ kernel computes dQ per query
// block.
template <class Elem, int HEAD_DIM, int V_HEAD_DIM, Layout LAYOUT>
LaunchError LaunchBackward(const AttentionParams& p_in, bool deterministic, Stream stream) {
  using K = BackwardKernel<Elem, HEAD_DIM, V_HEAD_DIM, LAYOUT>;
  using D = DeltaKernel<V_HEAD_DIM>;
  using Q = BackwardDqKernel<Elem, HEAD_DIM, V_HEAD_DIM>;
  AttentionParams p = p_in;
  p.accumulate_dq = !deterministic;
  const int64_t q_elements = static_cast<int64_t>(p.batch) * p.q_len * p.q_heads * HEAD_DIM;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.q_len * p.q_heads;
  const int64_t chunks = q_elements / 8;
  const int64_t kv_rows = static_cast<int64_t>(p.batch) * p.kv_len * p.kv_heads;
  const int64_t dk_chunks = kv_rows * HEAD_DIM / 8, dkv_chunks = dk_chunks + kv_rows * V_HEAD_DIM / 8;
  dim3 delta_grid, main_grid, dq_grid, convert_grid, reduce_grid;
  for (const LaunchError& e :
       {LinearGrid((rows + D::ROWS_PER_BLOCK - 1) / D::ROWS_PER_BLOCK, &delta_grid), K::grid(p).dims(&main_grid),
        Q::grid(p).dims(&dq_grid), LinearGrid((chunks + kConvertThreads - 1) / kConvertThreads, &convert_grid),
        LinearGrid((dkv_chunks + kConvertThreads - 1) / kConvertThreads, &reduce_grid)}) {
    if (!e.empty()) return e;
  }
  LaunchError err = FillAsync(p.dq_accum, 0, q_elements * sizeof(float), stream);
  if (!err.empty()) return err;
  err = Launch("attention_backward_delta_kernel", attention_backward_delta_kernel<Elem, V_HEAD_DIM>, delta_grid,
               dim3(D::THREADS), 0, stream, p);
  if (!err.empty()) return err;
  // The main kernel: with p.plain (the handler checked PlainBackwardRefusal) the plain kernel,
  // alone, or in a routed call beside the general one (each reads the route and returns unless
  // it is its own); else the general kernel.
  if (!p.plain || p.route != nullptr) {
    AttentionParams general = p;
    general.plain = false;
    general.plain_beside = p.plain;
    err = Launch("attention_backward_kernel", attention_backward_kernel<Elem, HEAD_DIM, V_HEAD_DIM, LAYOUT>, main_grid,
                 dim3(K::THREADS), K::kSmemBytes, stream, general);
    if (!err.empty()) return err;
  }
  if (p.plain) {
    if constexpr (LAYOUT == Layout::kWarp16) {
      err = Launch("attention_backward_plain_kernel", attention_backward_plain_kernel<Elem, HEAD_DIM, V_HEAD_DIM>,
                   main_grid, dim3(K::THREADS), K::kSmemBytes, stream, p);
      if (!err.empty()) return err;
    } else {
      return "the plain backward runs in the warp16 instantiation (kernels/dispatch.h)";
    }
  }
  if (p.dkv_per_query_head()) {
    err = Launch("attention_backward_reduce_dkv_kernel", attention_backward_reduce_dkv_kernel<Elem>, reduce_grid,
                 dim3(kConvertThreads), 0, stream, p, dk_chunks, dkv_chunks);
    if (!err.empty()) return err;
  }
  if (p.dbias_out != nullptr) {  // deterministic mode, a bias broadcast over B, N or S
    const int64_t elements = p.dbias_dims[0] * p.dbias_dims[1] * p.dbias_dims[2] * p.dbias_dims[3];
    dim3 dbias_grid;
    err = LinearGrid((elements + kConvertThreads - 1) / kConvertThreads, &dbias_grid);
    if (err.empty())
      err = Launch("attention_backward_reduce_dbias_kernel", attention_backward_reduce_dbias_kernel<Elem>, dbias_grid,
                   dim3(kConvertThreads), 0, stream, p, elements);
    if (!err.empty()) return err;
  }
  if (deterministic) {
    return Launch("attention_backward_dq_kernel", attention_backward_dq_kernel<Elem, HEAD_DIM, V_HEAD_DIM>, dq_grid,
                  dim3(Q::THREADS), Q::kSmemBytes, stream, p);
  }
  return Launch("attention_backward_convert_dq_kernel", attention_backward_convert_dq_kernel<Elem>, convert_grid,
                dim3(kConvertThreads), 0, stream, p, chunks);
}

}  // namespace kernels
}  // namespace jax_flash
