// Tile geometry: the tile sizes per head dim (one constexpr function), the mma shape, and
// 16-bit tiles in shared memory with an XOR swizzle of their 16-byte chunks, filled by
// 16-byte cp.async copies.
#pragma once

#include <cstdint>

#include "kernels/platform.h"
#include "kernels/ptx.h"

#if defined(__CUDACC__) && !defined(JAX_FLASH_EMULATE)
#define JAX_FLASH_PRAGMA(x) _Pragma(#x)
#define JAX_FLASH_UNROLL _Pragma("unroll")
#define JAX_FLASH_UNROLL_N(n) JAX_FLASH_PRAGMA(unroll n)
#else
#define JAX_FLASH_UNROLL
#define JAX_FLASH_UNROLL_N(n)
#endif

namespace jax_flash {
namespace kernels {

// mma.sync.m16n8k16: every fragment below is in units of this shape.
constexpr int MMA_M = 16;
constexpr int MMA_N = 8;
constexpr int MMA_K = 16;
constexpr int WARP_SIZE = 32;

// The (query t, key s) of accumulator element (j, i) of a 16 x (8·N) fragment whose first row is
// row0 and first column col0 (C layout, PTX ISA §9.7.14.5.8: row lane/4 + 8·(i/2), column 8j +
// 2·(lane%4) + i%2); rows are queries in the forward, keys in the backward (TRANSPOSED).
template <bool TRANSPOSED>
__device__ __forceinline__ void fragment_position(int j, int i, int row0, int col0, int lane, int& t, int& s) {
  const int row = row0 + (lane >> 2) + 8 * (i >> 1);
  const int col = col0 + 8 * j + 2 * (lane & 3) + (i & 1);
  t = TRANSPOSED ? col : row;
  s = TRANSPOSED ? row : col;
}

// The opt-in dynamic shared memory limit per block on sm_120 (99 KB, the smallest of the
// archs we build for after sm_86/89); every instantiation must fit it.
constexpr int kMaxSmemBytes = 101376;

enum class Pass { kForward, kBackward, kBackwardDq };

// How a CTA's work is split over its warps, chosen at dispatch (JAX_FLASH_CUDA_LAYOUT, read by
// the handlers; cuda/README.md). Both are compiled; kWarp16 is the default (on an H200 kWarp32
// took 0.98-1.13x its time: docs/gpu-results.md, "Runs").
//   kWarp16: every warp owns one m16 block of rows: the forward runs 8 warps x 16 query rows,
//            the backward 64 keys per CTA.
//   kWarp32: FlashAttention-2's partition: the forward runs 4 warps x 32 query rows (two m16
//            row blocks per warp, so each K and V fragment read by ldmatrix feeds two mma.sync:
//            half the shared-memory reads per MMA), the backward 128 keys per CTA (8 warps of
//            16 keys) where shared memory allows it (H <= 64): half the CTAs reading each Q and
//            dO tile and adding into dQ.
enum class Layout { kWarp16, kWarp32 };

// The forward's two kernels (kernels/fwd.h), chosen per call at dispatch (kernels/dispatch.h):
//   kGeneral: every feature a runtime setting of the one kernel;
//   kPlain:   none of the optional features, scores checked finite by the caller
//             (AttentionParams::plain, PlainForwardRefusal): a hot loop that does only the
//             attention.
//   kDecode:  the general kernel on the decoding tile (DecodeForwardShape; AttentionParams::
//             decode_tile): a call whose tiles hold at most 16 query rows (T <= 16, or with GQA
//             packing G <= 16), which reads K and V at the memory's speed rather than computing.
enum class ForwardVariant { kGeneral, kPlain, kDecode };

// Tile sizes of one kernel. Forward and backward dQ: block_q query rows per CTA
// (rows_per_warp per warp), block_kv keys per pipeline stage. Backward: block_kv keys per CTA
// (rows_per_warp = 16 per warp), block_q query rows per pipeline stage; col_splits warps share
// each 16 keys, each holding dK and dV of head_dim / col_splits columns (at H >= 192 the full
// width alone would take 192-256 registers per thread), all of them computing the 16 keys' Sᵀ
// and dPᵀ.
struct TileShape {
  int block_q;
  int block_kv;
  int warps;
  int stages;
  int rows_per_warp;   // 16 or 32: m16 row blocks of a warp's accumulators, times 16
  int col_splits = 1;  // backward: warps per 16 keys, splitting dK and dV by columns

  __host__ __device__ constexpr bool operator==(const TileShape& o) const {
    return block_q == o.block_q && block_kv == o.block_kv && warps == o.warps && stages == o.stages &&
           rows_per_warp == o.rows_per_warp && col_splits == o.col_splits;
  }
};

// The byte counts below are those of the stored rows: H = 96 padded to 128 columns, H = 192
// unpadded (SmemTile). head_dim is H (Q, K, dQ, dK), v_head_dim Hv (V, O, dO, dV).
__host__ __device__ constexpr TileShape TileShapeFor(Pass pass, int head_dim, int v_head_dim,
                                                     Layout layout = Layout::kWarp16) {
  // Hv < H (MLA's (192, 128); (128, 64)): the shape of (H, H). Its V, O, dO and dV tiles and
  // accumulators are only narrower, so it fits shared memory and registers wherever (H, H)
  // does, and no larger tile fits or stays out of local memory: (192, 128) takes 88 KB forward
  // (64-key tiles would take 48 KB of Q + 2 x 40 KB), 41.3 KB backward (32-row query blocks,
  // 62.5 KB, spill 24-32 bytes at 255 registers on sm_80 and sm_90: dK's 48 and dV's 32
  // registers with S and dP of 32 queries), 80 KB in the dQ kernel (64-key tiles: 120 KB);
  // (128, 64) 80 KB forward (3 stages: 104 KB), 52.5 KB backward, 72 KB dQ.
  if (v_head_dim < head_dim) return TileShapeFor(pass, head_dim, head_dim, layout);
  const bool wide = layout == Layout::kWarp32;
  if (pass == Pass::kForward) {
    // Q (block_q x H) + stages x (K, V) (block_kv x H): 64 KB at H=64, 96 KB at H=128 (and at
    // H=96, whose rows are padded to 128 columns).
    // kWarp32: 4 warps of 32 rows hold O (H f32 registers per thread) and S (block_kv) at
    // once: 64-key tiles at H=32; 32-key tiles in a 3-stage ring at H=64 and 96 (40 and 80 KB),
    // since 64 keys spill there on some architecture (H=64: 12-32 bytes at 255 registers).
    // H=128 spills with either (28-40 bytes on sm_90), so it keeps the kWarp16 shape
    // (docs/gpu-results.md); so do H=192 and 256 (O alone would take 96 and 128 registers
    // per thread with 16 rows, 192 and 256 with 32).
    // H=192: 32-key tiles (48 KB of Q + 2 x 24 KB of K, V: 96 KB). H=256: 16-key tiles
    // (64 KB of Q + 2 x 16 KB: 96 KB); 32-key tiles with 64 query rows fit too, but spill
    // (8-20 bytes at 255 registers on sm_90: S and its K fragments in flight on top of O's
    // 128), where 16 keys take ~210.
    if (wide && head_dim <= 32) return TileShape{128, 64, 4, 3, 32};
    if (wide && head_dim <= 96) return TileShape{128, 32, 4, 3, 32};
    if (head_dim > 192) return TileShape{128, 16, 8, 2, 16};
    if (head_dim > 128) return TileShape{128, 32, 8, 2, 16};
    return head_dim <= 64 ? TileShape{128, 64, 8, 3, 16} : TileShape{128, 64, 8, 2, 16};
  }
  if (pass == Pass::kBackwardDq) {
    // Q, dO (block_q x H) + stages x (K, V) (block_kv x H): 48 KB at H=64, 96 KB at H=128.
    // H=192: 32-key tiles (48 KB + 2 x 24 KB: 96 KB). H=256: 16-key tiles, so that the CTA
    // keeps 4 warps (64 KB of Q, dO + 2 x 16 KB: 96 KB; 32 query rows of 2 warps would take
    // 32-key tiles at the same size, with half the warps to hide latency).
    if (head_dim > 192) return TileShape{64, 16, 4, 2, 16};
    if (head_dim > 128) return TileShape{64, 32, 4, 2, 16};
    return TileShape{64, 64, 4, 2, 16};
  }
  // K, V (block_kv x H) + 2 x (Q, dO) (block_q x H) + dS (block_kv x block_q):
  // H=128 halves block_q so that dK, dV (64 + 64 registers) and the S, dP tiles fit in 255.
  // kWarp32: 128 keys (8 warps, the same registers per thread) at H <= 64: 82 KB at H=64; at
  // H=96/128 the K, V tiles alone would take 64 KB, with the ring over 99 KB.
  // H=192 and 256: dK and dV of the full width would take 192 and 256 registers, so two warps
  // share each 16 keys (col_splits 2: 96 and 128 registers), both computing their Sᵀ and dPᵀ
  // (a third more MMAs than one warp per 16 keys; exchanging P through shared memory would
  // save them, for another tile of smem). Both take 16 queries per stage: 32 spill (at H=256
  // 16-52 bytes on sm_90, the S and dP tiles' 32 registers on top of dK and dV; at H=192 an
  // 8-byte stack frame on sm_90 once dropout's keep bits are live). H=256: 64 keys, 64 + 2
  // (dSᵀ) + 2 x 16.1 KB = 98.25 KB. H=192: 32 keys (4 warps: 8 would split dQ's 192 columns
  // into 24-column shares, not whole 16-column blocks), 24 + 1 + 2 x 12.1 KB = 49.3 KB.
  if (wide && head_dim <= 64) return TileShape{64, 128, 8, 2, 16};
  if (head_dim > 192) return TileShape{16, 64, 8, 2, 16, 2};
  if (head_dim > 128) return TileShape{16, 32, 4, 2, 16, 2};
  return head_dim <= 64 ? TileShape{64, 64, 4, 2, 16} : TileShape{32, 64, 4, 2, 16};
}

// The plain forward's tiles (kernels/fwd.h attention_forward_plain_kernel): FlashAttention-2's
// shapes, one per head dim whatever the layout attribute, with one K and one V tile (stages = 1;
// split waits instead of a ring): Q + K + V bytes. 4 warps of 32 rows (two m16 row blocks, each
// K and V fragment feeding four mma.sync) and 64-key tiles at H <= 128: 24, 32, 64 (H = 96
// padded to 128 columns) and 64 KB, so that 2 CTAs fit an SM on sm_80 / sm_90 / sm_100 (128
// threads, at most 255 registers each). At H = 192 and 256 a warp of 32 rows would hold O in
// 192 and 256 registers: 8 warps of 16 rows and 32-key tiles (72 and 96 KB; one CTA per SM),
// as FlashAttention-2 does. The key tile is the general kernel's warp16 one (below) at
// H <= 192, so the two kernels give the same bits there; at H = 256 it is twice as wide (16-key
// tiles cost a barrier per 16 keys). A (H, Hv) pair with Hv < H takes the shape of (H, H).
__host__ __device__ constexpr TileShape PlainForwardShape(int head_dim, int v_head_dim) {
  if (v_head_dim < head_dim) return PlainForwardShape(head_dim, head_dim);
  if (head_dim > 128) return TileShape{128, 32, 8, 1, 16};
  if (head_dim > 64) return TileShape{128, 64, 8, 1, 16};
  return TileShape{128, 64, 4, 1, 32};
}

// The decoding tile (ForwardVariant::kDecode): one warp of 16 query rows, for a call whose
// tiles hold at most 16 rows (a decode step: T <= 16, or its G <= 16 query heads packed). Such
// a call reads every key and value once per tile for 16 rows of work: it is bound by the
// memory's bandwidth, not the tensor cores, so the tile is sized for bytes in flight. The
// 128-row tile would run 8 warps of MMAs on padding rows and fit one CTA per SM; this one
// runs no padding warp, and at 52 KB (H = 128: Q 4 KB + 3 stages of 32-key K and V tiles)
// 4 CTAs fit an SM of sm_90 / sm_100 (228 KB; 3 of sm_80's 164 KB, 1 of sm_86/89/120's
// 100 KB), each with two tiles in flight while it computes on the third. Key tiles of 12-16 KB
// per stage: 64 keys at H <= 64, 32 at H = 96 (padded to 128 columns) and 128, 16 at H = 192
// and 256 (56.3 KB at H = 256: 3 CTAs per SM of sm_90, 320 bytes over a fourth; two stages
// would fit 5, but ptxas gives that loop an 88-byte stack frame on sm_80). A (H, Hv) pair with
// Hv < H takes the shape of (H, H).
__host__ __device__ constexpr TileShape DecodeForwardShape(int head_dim, int v_head_dim) {
  if (v_head_dim < head_dim) return DecodeForwardShape(head_dim, head_dim);
  if (head_dim > 128) return TileShape{16, 16, 1, 3, 16};
  if (head_dim > 64) return TileShape{16, 32, 1, 3, 16};
  return TileShape{16, 64, 1, 3, 16};
}

// The rows of the decoding tile: the most query rows (T, or G with packing) a call that asks
// for it may have (the host's rule, _heuristics.CUDA_DECODE_BLOCK_Q).
constexpr int kDecodeRows = DecodeForwardShape(128, 128).block_q;

// Whether `layout` gives (pass, head_dim, v_head_dim) a tile shape of its own; where it does
// not, the kWarp16 instantiation serves both layouts (no second copy of the same kernel is
// compiled).
__host__ __device__ constexpr bool HasOwnShape(Pass pass, int head_dim, int v_head_dim, Layout layout) {
  return layout == Layout::kWarp16 ||
         !(TileShapeFor(pass, head_dim, v_head_dim, layout) == TileShapeFor(pass, head_dim, v_head_dim));
}

__host__ __device__ constexpr int CeilDiv(int a, int b) { return (a + b - 1) / b; }

// One 16-byte chunk: eight 16-bit elements or four floats, moved as a unit.
struct alignas(16) Chunk16 {
  uint32_t w[4];
};

__host__ __device__ constexpr int NextPowerOfTwo(int x) { return x <= 1 ? 1 : 2 * NextPowerOfTwo((x + 1) / 2); }

// A ROWS x COLS tile of 16-bit elements in shared memory, row-major in 16-byte chunks, chunk c
// of row r stored at chunk c ^ swizzle(r). ldmatrix reads 8 rows at one logical chunk and
// cp.async writes 8 consecutive chunks; with the swizzle each 8 land in 8 different 16-byte
// bank groups (of the 128-byte bank window), so neither has bank conflicts. The XOR changes
// the low three bits of the chunk index, so it stays inside a row of a multiple of 8 chunks
// (H = 128, 192, 256: 16, 24, 32 chunks); rows of another count are padded to a power of two
// (H = 96: 12 chunks in a 16-chunk row).
template <int ROWS, int COLS>
struct SmemTile {
  static_assert(COLS % 16 == 0, "tile rows must hold whole 16x16 fragments");
  static constexpr int kRows = ROWS;
  static constexpr int kCols = COLS;
  static constexpr int kChunks = COLS / 8;                          // 16-byte chunks per row
  static constexpr int kStrideChunks = kChunks % 8 == 0 ? kChunks : NextPowerOfTwo(kChunks);  // ... stored
  static constexpr int kRowBytes = kStrideChunks * 16;
  static constexpr int kBytes = ROWS * kRowBytes;
  // Rows of 4 chunks (64 bytes) share a 128-byte window two by two, rows of 2 chunks (the
  // backward's 16-query dSᵀ tile at H=256) four by four.
  __device__ __forceinline__ static int swizzle(int row) {
    return kStrideChunks >= 8 ? (row & 7) : kStrideChunks == 4 ? ((row >> 1) & 3) : ((row >> 2) & 1);
  }
  // Byte offset of logical chunk `chunk` of row `row`.
  __device__ __forceinline__ static int chunk_offset(int row, int chunk) {
    return row * kRowBytes + ((chunk ^ swizzle(row)) << 4);
  }
  // Byte offset of element (row, col).
  __device__ __forceinline__ static int element_offset(int row, int col) {
    return chunk_offset(row, col >> 3) + ((col & 7) << 1);
  }
};

// Copies rows [0, ROWS) of a row-major global tile into `tile`, asynchronously: tile row r is
// global row row_of(r) (row stride `row_stride` elements from gmem: the slots of a paged cache
// come from its table); rows >= rows_valid are zero-filled (src-size 0), never read.
template <class Tile, int THREADS, class RowOf>
__device__ __forceinline__ void load_tile_rows_async(char* tile, const uint16_t* gmem, int64_t row_stride,
                                                     int rows_valid, const RowOf& row_of) {
  constexpr int kCopies = Tile::kRows * Tile::kChunks;
  static_assert(kCopies % THREADS == 0, "every thread issues the same number of copies");
  auto copy = [&](int i) {
    const int copy = i * THREADS + static_cast<int>(threadIdx.x);
    const int row = copy / Tile::kChunks;
    const int chunk = copy % Tile::kChunks;
    const bool inside = row < rows_valid;
    const uint16_t* src = gmem + (inside ? row_of(row) * row_stride + chunk * 8 : 0);
    ptx::cp_async_16(tile + Tile::chunk_offset(row, chunk), src, inside ? 16 : 0);
  };
  if constexpr (kCopies / THREADS > 8) {
    // Many copies per thread (the decoding tile's one warp: 16 to 32 per tile), two at a time:
    // unrolled whole, their addresses take the registers the MMAs need (H = 256 spilled).
    JAX_FLASH_UNROLL_N(2)
    for (int i = 0; i < kCopies / THREADS; ++i) copy(i);
  } else {
    JAX_FLASH_UNROLL
    for (int i = 0; i < kCopies / THREADS; ++i) copy(i);
  }
}

// The same for rows one row_stride apart.
template <class Tile, int THREADS>
__device__ __forceinline__ void load_tile_async(char* tile, const uint16_t* gmem, int64_t row_stride, int rows_valid) {
  load_tile_rows_async<Tile, THREADS>(tile, gmem, row_stride, rows_valid, [](int row) { return row; });
}

// One thread's share of the cp.async copies of consecutive tiles of one array, held as a
// running source pointer: with THREADS a multiple of 8 rows' worth of chunks, copy i of a
// thread moves the same chunk of row row0 + i·kRowStep, whose swizzle is row0's (it repeats
// every 8 rows), so each copy is one immediate shared offset and one 32-bit step away from the
// last, and the next tile one 32-bit step away from this one. Held across the key loop: the
// pointer, the two steps and a shared offset, nothing per copy. Where the tile's chunks do not
// divide the threads (H = 96, 192), the general per-copy addressing (load_tile_async) from the
// tile's first row.
template <class Tile, int THREADS>
struct TileCopier {
  static constexpr bool kRegular = THREADS % Tile::kChunks == 0 && (THREADS / Tile::kChunks) % 8 == 0 &&
                                   (Tile::kRows * Tile::kChunks) % THREADS == 0;
  static constexpr int kRowStep = kRegular ? THREADS / Tile::kChunks : 1;
  static constexpr int kCopies = Tile::kRows * Tile::kChunks / THREADS;
  const char* src;     // the thread's first copy of the next tile (irregular: the tile's first row)
  uint32_t step;       // bytes from one copy's source to the next (irregular: a row, in elements)
  uint32_t tile_step;  // bytes from one tile's first row to the next's
  int smem;            // byte offset of the thread's first copy in the tile
  int row0;            // the tile row of its first copy

  // Thread `t`'s copies of the tiles from `first_row` on; row_stride · Tile::kRows · 2 < 2^32
  // (PlainForwardRefusal): the steps fit 32 bits.
  __device__ __forceinline__ static TileCopier of(const uint16_t* first_row, int64_t row_stride, int t) {
    TileCopier c;
    const uint32_t stride = static_cast<uint32_t>(row_stride);
    c.tile_step = Tile::kRows * stride * 2u;
    if constexpr (kRegular) {
      c.row0 = t / Tile::kChunks;
      c.smem = Tile::chunk_offset(c.row0, t % Tile::kChunks);
      c.src = reinterpret_cast<const char*>(first_row + (c.row0 * stride + (t % Tile::kChunks) * 8));
      c.step = kRowStep * stride * 2u;
    } else {
      c.row0 = 0;
      c.smem = 0;
      c.src = reinterpret_cast<const char*>(first_row);
      c.step = stride;
    }
    return c;
  }

  // The next tile, every row inside the array: the hot loop's copies, with nothing to test.
  __device__ __forceinline__ void copy_full(char* tile) {
    if constexpr (kRegular) {
      const char* from = src;
      JAX_FLASH_UNROLL
      for (int i = 0; i < kCopies; ++i, from += step)
        ptx::cp_async_16(tile + smem + i * kRowStep * Tile::kRowBytes, from, 16);
    } else {
      load_tile_async<Tile, THREADS>(tile, reinterpret_cast<const uint16_t*>(src), step, Tile::kRows);
    }
    src += tile_step;
  }

  // The same where rows >= rows_valid may lie past the array's end (the last key tile): those
  // are zero-filled, never read (their source is the tile's first copy, inside the array).
  __device__ __forceinline__ void copy_checked(char* tile, int rows_valid) {
    if constexpr (kRegular) {
      const char* from = src;
      JAX_FLASH_UNROLL
      for (int i = 0; i < kCopies; ++i, from += step) {
        const bool inside = row0 + i * kRowStep < rows_valid;
        ptx::cp_async_16(tile + smem + i * kRowStep * Tile::kRowBytes, inside ? from : src, inside ? 16 : 0);
      }
    } else {
      load_tile_async<Tile, THREADS>(tile, reinterpret_cast<const uint16_t*>(src), step, rows_valid);
    }
    src += tile_step;
  }
};

// One tile's copies from a thread's share recomputed per call (no state held across a loop):
// a regular tile (TileCopier::kRegular) takes the thread's row, chunk and swizzle from its index
// and each next copy one 32-bit step from the last (row_stride · Tile::kRows · 2 < 2^32); others
// load_tile_async's per-copy addressing. Rows >= rows_valid are zero-filled, their source the
// tile's first row (inside the array).
template <class Tile, int THREADS>
__device__ __forceinline__ void load_tile_stepped_async(char* tile, const uint16_t* first_row, int64_t row_stride,
                                                        int rows_valid) {
  using C = TileCopier<Tile, THREADS>;
  if constexpr (C::kRegular) {
    const int t = static_cast<int>(threadIdx.x);
    const int row0 = t / Tile::kChunks, chunk = t % Tile::kChunks;
    const uint32_t stride = static_cast<uint32_t>(row_stride);
    const char* const base = reinterpret_cast<const char*>(first_row);
    const char* from = base + 2u * (static_cast<uint32_t>(row0) * stride + static_cast<uint32_t>(chunk) * 8u);
    char* const to = tile + Tile::chunk_offset(row0, chunk);
    const int rows_left = rows_valid - row0;  // copy i is inside while i·kRowStep < rows_left
    JAX_FLASH_UNROLL
    for (int i = 0; i < C::kCopies; ++i, from += C::kRowStep * stride * 2u) {
      const bool inside = i * C::kRowStep < rows_left;
      ptx::cp_async_16(to + i * C::kRowStep * Tile::kRowBytes, inside ? from : base, inside ? 16 : 0);
    }
  } else {
    load_tile_async<Tile, THREADS>(tile, first_row, row_stride, rows_valid);
  }
}

// ldmatrix addressing of the fragments (PTX ISA §9.7.14.5.8 layouts, §9.7.14.5.15 ldmatrix):
// the lane's row pointer for an x4 load of the 16x16 block at (row0, chunk0 = col0 / 8), with
// row0 % 8 == 0 and chunk0 even. Lane l addresses row row0 + r(l), chunk chunk0 + c(l), c in
// {0, 1}. Then the swizzled chunk is (c ^ swizzle(r)) ^ (chunk0 % 8) + 8·(chunk0 / 8): one
// lane offset per pattern, and every block is an XOR and an immediate away from it (fewer
// live address registers than one per block).
template <class Tile>
__device__ __forceinline__ const char* fragment_row(const char* tile, int row0, int chunk0, int lane_row,
                                                    int lane_chunk) {
  const int lane_offset = lane_row * Tile::kRowBytes + ((lane_chunk ^ Tile::swizzle(lane_row)) << 4);
  return tile + row0 * Tile::kRowBytes + ((chunk0 & ~7) << 4) + (lane_offset ^ ((chunk0 & 7) << 4));
}

// A operand, row-major 16x16 (rows = M, cols = K): matrices (rows 0-7, k 0-7), (8-15, 0-7),
// (0-7, 8-15), (8-15, 8-15) are a0..a3.
template <class Tile>
__device__ __forceinline__ const char* a_fragment_row(const char* tile, int row0, int chunk0, int lane) {
  return fragment_row<Tile>(tile, row0, chunk0, lane & 15, lane >> 4);
}
// B operand of two n-blocks from a tile stored [n][k] (rows = N, cols = K), non-transposed:
// matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15) are b0, b1 of
// n-block 0 and b0, b1 of n-block 1.
template <class Tile>
__device__ __forceinline__ const char* b_fragment_row(const char* tile, int row0, int chunk0, int lane) {
  return fragment_row<Tile>(tile, row0, chunk0, ((lane >> 4) << 3) + (lane & 7), (lane >> 3) & 1);
}
// B operand of two n-blocks from a tile stored [k][n] (rows = K, cols = N), with .trans:
// matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
template <class Tile>
__device__ __forceinline__ const char* bt_fragment_row(const char* tile, int row0, int chunk0, int lane) {
  return fragment_row<Tile>(tile, row0, chunk0, (((lane >> 3) & 1) << 3) + (lane & 7), lane >> 4);
}
// A operand from a tile stored [k][m] (rows = K, cols = M), with .trans: matrices
// (k 0-7, m 0-7) -> a0, (k 0-7, m 8-15) -> a1, (k 8-15, m 0-7) -> a2, (k 8-15, m 8-15) -> a3.
template <class Tile>
__device__ __forceinline__ const char* at_fragment_row(const char* tile, int row0, int chunk0, int lane) {
  return fragment_row<Tile>(tile, row0, chunk0, ((lane >> 4) << 3) + (lane & 7), (lane >> 3) & 1);
}

// The accumulator of a 16 x (8·N) product (C layout, §9.7.14.5.8: c0,c1 row lane/4, c2,c3
// row lane/4 + 8, columns 2·(lane%4) + {0,1}) repacked as the A operand of the next product:
// k-step kk takes n-blocks 2kk and 2kk+1 — FlashAttention-2 keeps P in registers this way.
template <class Elem, int N_BLOCKS>
__device__ __forceinline__ void accumulator_as_a(uint32_t a[4], const float (&acc)[N_BLOCKS][4], int kk) {
  a[0] = Elem::pack(acc[2 * kk][0], acc[2 * kk][1]);
  a[1] = Elem::pack(acc[2 * kk][2], acc[2 * kk][3]);
  a[2] = Elem::pack(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
  a[3] = Elem::pack(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

template <int N_BLOCKS>
__device__ __forceinline__ void clear(float (&acc)[N_BLOCKS][4]) {
  JAX_FLASH_UNROLL
  for (int j = 0; j < N_BLOCKS; ++j) {
    JAX_FLASH_UNROLL
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;
  }
}

template <int ROW_BLOCKS, int N_BLOCKS>
__device__ __forceinline__ void clear(float (&acc)[ROW_BLOCKS][N_BLOCKS][4]) {
  JAX_FLASH_UNROLL
  for (int rb = 0; rb < ROW_BLOCKS; ++rb) clear(acc[rb]);
}

// acc[16 x 8·N_BLOCKS] += A[16 x 16·K_STEPS] · B, A rows a_row0.. of a_tile (row-major), B from
// b_tile stored [n][k] (non-transposed, e.g. K for S = Q·Kᵀ). K_UNROLL k-steps are unrolled
// (fewer where registers are tight: the backward holds dK and dV throughout).
template <class Elem, class ATile, class BTile, int K_STEPS, int N_BLOCKS, int K_UNROLL = K_STEPS>
__device__ __forceinline__ void mma_a_smem_b_rows(float (&acc)[N_BLOCKS][4], const char* a_tile, int a_row0,
                                                  const char* b_tile, int b_row0, int lane) {
  static_assert(N_BLOCKS % 2 == 0, "B is loaded two n-blocks at a time");
  JAX_FLASH_UNROLL_N(K_UNROLL)
  for (int kk = 0; kk < K_STEPS; ++kk) {
    uint32_t a[4];
    ptx::ldmatrix_x4(a, a_fragment_row<ATile>(a_tile, a_row0, 2 * kk, lane));
    JAX_FLASH_UNROLL
    for (int jj = 0; jj < N_BLOCKS / 2; ++jj) {
      uint32_t b[4];
      ptx::ldmatrix_x4(b, b_fragment_row<BTile>(b_tile, b_row0 + 16 * jj, 2 * kk, lane));
      Elem::mma(acc[2 * jj], a, b, acc[2 * jj]);
      Elem::mma(acc[2 * jj + 1], a, b + 2, acc[2 * jj + 1]);
    }
  }
}

// acc[16 x 8·N_BLOCKS] += A · B for one k-step, B from b_tile stored [k][n] (rows b_row0..+15,
// columns from chunk b_chunk0), loaded with .trans (e.g. V for O += P·V).
template <class Elem, class BTile, int N_BLOCKS>
__device__ __forceinline__ void mma_a_regs_b_trans(float (&acc)[N_BLOCKS][4], const uint32_t a[4], const char* b_tile,
                                                   int b_row0, int b_chunk0, int lane) {
  static_assert(N_BLOCKS % 2 == 0, "B is loaded two n-blocks at a time");
  JAX_FLASH_UNROLL
  for (int jj = 0; jj < N_BLOCKS / 2; ++jj) {
    uint32_t b[4];
    ptx::ldmatrix_x4_trans(b, bt_fragment_row<BTile>(b_tile, b_row0, b_chunk0 + 2 * jj, lane));
    Elem::mma(acc[2 * jj], a, b, acc[2 * jj]);
    Elem::mma(acc[2 * jj + 1], a, b + 2, acc[2 * jj + 1]);
  }
}

// The same two products for ROW_BLOCKS m16 blocks of rows at once (a warp of 16·ROW_BLOCKS
// rows): every B fragment is loaded once and feeds 2·ROW_BLOCKS mma.sync, so a warp of 32
// rows reads half as many shared-memory bytes per MMA as one of 16.
// acc[rb][16 x 8·N_BLOCKS] += A[rows a_row0 + 16·rb .., 16 x 16·K_STEPS] · B, B stored [n][k].
// K_UNROLL k-steps are unrolled (fewer where registers are tight).
template <class Elem, class ATile, class BTile, int K_STEPS, int ROW_BLOCKS, int N_BLOCKS, int K_UNROLL = K_STEPS>
__device__ __forceinline__ void mma_row_blocks_a_smem_b_rows(float (&acc)[ROW_BLOCKS][N_BLOCKS][4], const char* a_tile,
                                                             int a_row0, const char* b_tile, int b_row0, int lane) {
  static_assert(N_BLOCKS % 2 == 0, "B is loaded two n-blocks at a time");
  JAX_FLASH_UNROLL_N(K_UNROLL)
  for (int kk = 0; kk < K_STEPS; ++kk) {
    uint32_t a[ROW_BLOCKS][4];  // A fragment (16 x 16) of each row block
    JAX_FLASH_UNROLL
    for (int rb = 0; rb < ROW_BLOCKS; ++rb)
      ptx::ldmatrix_x4(a[rb], a_fragment_row<ATile>(a_tile, a_row0 + MMA_M * rb, 2 * kk, lane));
    JAX_FLASH_UNROLL
    for (int jj = 0; jj < N_BLOCKS / 2; ++jj) {
      uint32_t b[4];  // B fragments (16 x 8) of n-blocks 2jj, 2jj + 1
      ptx::ldmatrix_x4(b, b_fragment_row<BTile>(b_tile, b_row0 + 16 * jj, 2 * kk, lane));
      JAX_FLASH_UNROLL
      for (int rb = 0; rb < ROW_BLOCKS; ++rb) {
        Elem::mma(acc[rb][2 * jj], a[rb], b, acc[rb][2 * jj]);
        Elem::mma(acc[rb][2 * jj + 1], a[rb], b + 2, acc[rb][2 * jj + 1]);
      }
    }
  }
}

// acc[rb] += A[rb] · B for one k-step of every row block, A from registers, B stored [k][n]
// (rows b_row0..+15) and loaded with .trans once for all row blocks (O += P·V).
template <class Elem, class BTile, int ROW_BLOCKS, int N_BLOCKS>
__device__ __forceinline__ void mma_row_blocks_a_regs_b_trans(float (&acc)[ROW_BLOCKS][N_BLOCKS][4],
                                                              const uint32_t (&a)[ROW_BLOCKS][4], const char* b_tile,
                                                              int b_row0, int lane) {
  static_assert(N_BLOCKS % 2 == 0, "B is loaded two n-blocks at a time");
  JAX_FLASH_UNROLL
  for (int jj = 0; jj < N_BLOCKS / 2; ++jj) {
    uint32_t b[4];
    ptx::ldmatrix_x4_trans(b, bt_fragment_row<BTile>(b_tile, b_row0, 2 * jj, lane));
    JAX_FLASH_UNROLL
    for (int rb = 0; rb < ROW_BLOCKS; ++rb) {
      Elem::mma(acc[rb][2 * jj], a[rb], b, acc[rb][2 * jj]);
      Elem::mma(acc[rb][2 * jj + 1], a[rb], b + 2, acc[rb][2 * jj + 1]);
    }
  }
}

// Writes a warp's 16 x Tile::kCols accumulator, tile rows row0.., as 16-bit elements: tile row
// r goes to dst + r · row_stride when r < rows_valid (dst: tile row 0's global row). It passes
// through the warp's own rows of `tile`, which no other warp reads (the forward at Hv < H
// stages O over its wider Q tile after a barrier): the global stores are then whole 16-byte
// chunks, coalesced along each row.
template <class Elem, class Tile, int O_BLOCKS>
__device__ __forceinline__ void store_warp_rows(uint16_t* dst, int64_t row_stride, int rows_valid,
                                                const float (&o)[O_BLOCKS][4], char* tile, int row0, int lane) {
  static_assert(O_BLOCKS * MMA_N == Tile::kCols, "the accumulator spans a tile row");
  __syncwarp();  // every lane is done reading the warp's rows
  JAX_FLASH_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + (lane >> 2) + 8 * r;
    JAX_FLASH_UNROLL
    for (int j = 0; j < O_BLOCKS; ++j) {
      ptx::st_shared_b32(tile + Tile::element_offset(row, 8 * j + 2 * (lane & 3)),
                         Elem::pack(o[j][2 * r], o[j][2 * r + 1]));
    }
  }
  __syncwarp();
  JAX_FLASH_UNROLL
  for (int i = lane; i < MMA_M * Tile::kChunks; i += WARP_SIZE) {
    const int row = row0 + i / Tile::kChunks, chunk = i % Tile::kChunks;
    if (row < rows_valid) {
      Chunk16 c;
      ptx::ld_shared_v4_b32(c.w, tile + Tile::chunk_offset(row, chunk));
      ptx::st_global_v4_b32(dst + row * row_stride + chunk * 8, c.w);
    }
  }
}

// The same for rows t0.. of query head n of a [B, T, N, width] array (width = Tile::kCols: H
// for dQ), t0 being the position of tile row row0.
template <class Elem, class Tile, int O_BLOCKS, class Params>
__device__ __forceinline__ void store_warp_rows(uint16_t* dst, int width, const Params& p,
                                                const float (&o)[O_BLOCKS][4], char* tile, int b, int n, int row0,
                                                int t0, int lane) {
  const int tile_t0 = t0 - row0;  // the position of tile row 0
  store_warp_rows<Elem, Tile>(dst + p.q_row_offset(b, tile_t0, n, width), static_cast<int64_t>(p.q_heads) * width,
                              p.q_len - tile_t0, o, tile, row0, lane);
}

}  // namespace kernels
}  // namespace jax_flash
