// flex_attention's block mask (docs/flex.md) as the kernels read it: the positions cut into
// block_q x block_k blocks, each empty, partly visible or fully visible, per (b, n) of its
// [Bm, Nm] rows (Bm ∈ {1, B}, Nm ∈ {1, N}: broadcast where 1); a partly visible block's slot
// points at its bit rows, one bit per position, evaluated by XLA from mask_mod before the call.
//
// It is one more setting of the one mask, not a kernel of its own:
//   - which tiles run: a CTA's tile (rows x keys) runs unless every block under it is empty
//     (`any_visible`, `next_running`): the loops of the forward, the backward and the dQ kernel
//     visit the same tiles as without a block mask, less the empty ones, and prefetch only those;
//   - which elements are masked: a fragment within one full block needs nothing; elsewhere
//     each element reads its block's state and, in a partly visible block, its bit
//     (`mask_fragment_blocks`, after the structured and the dense masks).
// The mask's blocks need not be the kernels' tiles: a tile reads every block it overlaps.
// A partly visible block whose slot is not in [0, capacity) (more of them than the bits hold)
// is poisoned: its visible scores become NaN, so the rows of its query block come out NaN,
// never silently wrong. All reads go through the PTX wrappers (ld.global.u8, ld.global.b32).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/platform.h"
#include "kernels/ptx.h"
#include "kernels/tile.h"

namespace jax_flash {
namespace kernels {

enum BlockState : int { kEmptyBlock = 0, kPartialBlock = 1, kFullBlock = 2 };

// What the block mask does to one pair.
enum class BlockVerdict : int { kShown = 0, kHidden = 1, kPoisoned = 2 };

// The block mask of one (b, n).
struct BlockRows {
  const uint8_t* states = nullptr;  // [nq, nk] (null: no block mask)
  const int32_t* slots = nullptr;   // [nq, nk]
  const uint32_t* bits = nullptr;   // [P, block_q, words]
  int block_q = 0, block_k = 0;
  int kv_blocks = 0;  // nk
  int words = 0;      // ceil(block_k / 32)
  int capacity = 0;   // P
  int rows = 0, cols = 0;  // T, S: positions past them are never read

  __device__ __forceinline__ bool present() const { return states != nullptr; }

  // 0, 1 or 2 (any state but 0 and 2 reads as partly visible).
  __device__ __forceinline__ int state(int i, int j) const {
    const int x = ptx::ld_global_u8(states + static_cast<int64_t>(i) * kv_blocks + j);
    return x == kEmptyBlock || x == kFullBlock ? x : int{kPartialBlock};
  }

  // Whether some block under rows [t0, t0 + n_rows) x keys [s0, s0 + n_cols), clipped to
  // [0, T) x [0, S), is not empty: a tile there runs.
  __device__ __forceinline__ bool any_visible(int t0, int n_rows, int s0, int n_cols) const {
    if (!present()) return true;
    const int t1 = min(t0 + n_rows, rows), s1 = min(s0 + n_cols, cols);
    bool visible = false;
    if (t1 <= t0 || s1 <= s0) return visible;
    for (int i = t0 / block_q; i <= (t1 - 1) / block_q; ++i) {
      for (int j = s0 / block_k; j <= (s1 - 1) / block_k; ++j) visible = visible || state(i, j) != kEmptyBlock;
    }
    return visible;
  }

  // Whether the block mask leaves all of [t0, t1) x [s0, s1) alone: none of it within
  // [0, T) x [0, S), or all of that within one full block.
  __device__ __forceinline__ bool within_full_block(int t0, int t1, int s0, int s1) const {
    t1 = min(t1, rows);
    s1 = min(s1, cols);
    if (t1 <= t0 || s1 <= s0) return true;
    const int i = t0 / block_q, j = s0 / block_k;
    return (t1 - 1) / block_q == i && (s1 - 1) / block_k == j && state(i, j) == kFullBlock;
  }

  // What the block mask does to the pair (t, s), t < T and s < S: shows it, hides it, or (its
  // block poisoned) makes its logit NaN unless another mask already hides it.
  __device__ __forceinline__ BlockVerdict verdict(int t, int s) const {
    const int i = t / block_q, j = s / block_k;
    const int st = state(i, j);
    if (st == kFullBlock) return BlockVerdict::kShown;
    if (st == kEmptyBlock) return BlockVerdict::kHidden;
    const int32_t slot = static_cast<int32_t>(
        ptx::ld_global_b32(reinterpret_cast<const uint32_t*>(slots) + static_cast<int64_t>(i) * kv_blocks + j));
    if (slot < 0 || slot >= capacity) return BlockVerdict::kPoisoned;
    const int r = t - i * block_q, c = s - j * block_k;
    const uint32_t word = ptx::ld_global_b32(bits + (static_cast<int64_t>(slot) * block_q + r) * words + (c >> 5));
    return (word >> (c & 31)) & 1u ? BlockVerdict::kShown : BlockVerdict::kHidden;
  }
};

// The block mask of the whole call: [Bm, Nm, nq, nk] states and slots, [P, block_q, words] bits.
struct BlockMaskOperand {
  const uint8_t* states = nullptr;  // null: no block mask
  const int32_t* slots = nullptr;
  const uint32_t* bits = nullptr;
  int block_q = 0, block_k = 0;
  int batch = 0, heads = 0;  // Bm, Nm
  int q_blocks = 0, kv_blocks = 0;
  int words = 0, capacity = 0;

  __device__ __forceinline__ BlockRows rows_of(int b, int n, int q_len, int kv_len) const {
    BlockRows r;
    if (states == nullptr) return r;
    const int64_t offset =
        ((static_cast<int64_t>(batch == 1 ? 0 : b) * heads + (heads == 1 ? 0 : n)) * q_blocks) * kv_blocks;
    r.states = states + offset;
    r.slots = slots + offset;
    r.bits = bits;
    r.block_q = block_q;
    r.block_k = block_k;
    r.kv_blocks = kv_blocks;
    r.words = words;
    r.capacity = capacity;
    r.rows = q_len;
    r.cols = kv_len;
    return r;
  }
};

// The first tile of [tile, end) that `runs` (a tile's index -> bool, uniform over the CTA), or
// end: how a loop steps over the tiles a block mask leaves empty.
template <class Runs>
__device__ __forceinline__ int next_running(int tile, int end, const Runs& runs) {
  while (tile < end && !runs(tile)) ++tile;
  return tile;
}

// The block mask of a fragment (C layout; rows are queries, or keys when TRANSPOSED): nothing
// when the fragment lies within one full block (every fragment of a full block when the
// blocks are multiples of the fragments, as the default 128 x 128 is); otherwise the verdicts
// of its 4·N_BLOCKS elements (bit 4j + i of two words; elements past T or S are left alone)
// are gathered in a rolled loop, which holds a few registers while the tile's scores and O are
// live, then applied with selects.
template <bool TRANSPOSED, int N_BLOCKS>
__device__ __forceinline__ void mask_fragment_blocks(float (&acc)[N_BLOCKS][4], const BlockRows& blocks, int row0,
                                                     int col0, int lane) {
  static_assert(4 * N_BLOCKS <= 64, "one bit per accumulator element in a 64-bit word");
  const int t0 = TRANSPOSED ? col0 : row0, s0 = TRANSPOSED ? row0 : col0;
  const int t1 = t0 + (TRANSPOSED ? 8 * N_BLOCKS : MMA_M), s1 = s0 + (TRANSPOSED ? MMA_M : 8 * N_BLOCKS);
  if (blocks.within_full_block(t0, t1, s0, s1)) return;
  using Word = std::conditional_t<4 * N_BLOCKS <= 32, uint32_t, uint64_t>;
  Word hidden = 0, poisoned = 0;
#pragma unroll 1
  for (int e = 0; e < 4 * N_BLOCKS; ++e) {  // e = 4j + i: element i of n-block j
    int t, s;
    fragment_position<TRANSPOSED>(e >> 2, e & 3, row0, col0, lane, t, s);
    if (t >= blocks.rows || s >= blocks.cols) continue;
    const BlockVerdict v = blocks.verdict(t, s);
    hidden |= static_cast<Word>(v == BlockVerdict::kHidden) << e;
    poisoned |= static_cast<Word>(v == BlockVerdict::kPoisoned) << e;
  }
  JAX_FLASH_UNROLL
  for (int j = 0; j < N_BLOCKS; ++j) {
    JAX_FLASH_UNROLL
    for (int i = 0; i < 4; ++i) {
      const int e = 4 * j + i;
      const float x = acc[j][i];
      if ((hidden >> e) & 1u)
        acc[j][i] = -INFINITY;
      else if ((poisoned >> e) & 1u && x != -INFINITY)
        acc[j][i] = __uint_as_float(0x7fc00000u);
    }
  }
}

// A debug count of the tiles (Q·Kᵀ products of a CTA's tile) the kernels compute, kept by the
// host emulation only (jax_flash.cuda.count_tiles: tests that the work follows a block mask and
// which forward kernel ran); nothing on a GPU. One count per tile, by the CTA's thread 0. The
// plain forward (kernels/fwd.h) counts each tile as kForward and kForwardPlain, and those it
// masks also as kForwardPlainMasked.
enum class TilePass : int {
  kForward = 0,
  kBackward = 1,
  kBackwardDq = 2,
  kForwardPlain = 3,
  kForwardPlainMasked = 4,
  kBackwardPlain = 5,
  kBackwardPlainMasked = 6,
};
__device__ __forceinline__ void count_tile(TilePass pass) {
#ifdef JAX_FLASH_EMULATE
  if (threadIdx.x == 0) emu::count_tile(static_cast<int>(pass));
#else
  (void)pass;
#endif
}

}  // namespace kernels
}  // namespace jax_flash
