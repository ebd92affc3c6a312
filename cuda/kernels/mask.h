// The attention mask, one definition for the forward and the backward: sequence lengths, a
// local window (causal is the window (unbounded, 0)) placed by the query offset, and segment
// ids, combined by AND. The window is a band of diagonals: query t sees key s iff
// band_lo <= s - t <= band_hi, with band_lo = q_offset - window_left and band_hi = q_offset +
// window_right computed per batch element in 64 bits and clipped to [-T, S] (which changes
// nothing, as -T < s - t < S), so every index derived from them stays a small int.
//
// For a query t the visible keys before segment ids are one interval [key_lo(t), key_hi(t)),
// and both ends are non-decreasing in t. So the keys seen by a block of queries, and the
// queries that see a block of keys, are intervals too: whole tiles outside them are skipped,
// tiles inside every row's interval (interior) need no mask arithmetic, and only the edge
// tiles mask element by element (FlashAttention-2 §3.1, causal block skipping, for windows).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/params.h"
#include "kernels/tile.h"

namespace jax_flash {
namespace kernels {

struct Range {
  int lo = 0;
  int hi = 0;
  __device__ __forceinline__ bool empty() const { return hi <= lo; }
};

// x clipped to [lo, hi], as an int.
__device__ __forceinline__ int clip_to(int64_t x, int lo, int hi) {
  return x < lo ? lo : x > hi ? hi : static_cast<int>(x);
}

struct Mask {
  int q_valid;   // rows t >= q_valid see nothing
  int kv_valid;  // keys s >= kv_valid are invisible
  int band_lo;   // the window: band_lo <= s - t <= band_hi
  int band_hi;
  const int32_t* q_segments;   // [T] of this batch element, or null when segment ids are off
  const int32_t* kv_segments;  // [S]

  __device__ __forceinline__ static Mask of(const AttentionParams& p, int b) {
    Mask m;
    m.q_valid = min(max(p.q_lengths[b], 0), p.q_len);
    m.kv_valid = min(max(p.kv_lengths[b], 0), p.kv_len);
    const int64_t offset = p.q_offsets[b];
    m.band_lo = p.window_left < 0 ? -p.q_len : clip_to(offset - p.window_left, -p.q_len, p.kv_len);
    m.band_hi = p.window_right < 0 ? p.kv_len : clip_to(offset + p.window_right, -p.q_len, p.kv_len);
    m.q_segments = p.use_segment_ids ? p.q_segment_ids + static_cast<int64_t>(b) * p.q_len : nullptr;
    m.kv_segments = p.use_segment_ids ? p.kv_segment_ids + static_cast<int64_t>(b) * p.kv_len : nullptr;
    return m;
  }

  // Keys [key_lo(t), key_hi(t)) are visible from a valid query row t (before segment ids).
  __device__ __forceinline__ int key_lo(int t) const { return max(0, t + band_lo); }
  __device__ __forceinline__ int key_hi(int t) const { return min(kv_valid, t + band_hi + 1); }

  // The keys that some row of [t0, t1) may see.
  __device__ __forceinline__ Range keys_of_rows(int t0, int t1) const {
    t1 = min(t1, q_valid);
    if (t1 <= t0) return {};
    return {key_lo(t0), key_hi(t1 - 1)};
  }

  // The rows that may see some key of [s0, s1).
  __device__ __forceinline__ Range rows_of_keys(int s0, int s1) const {
    s1 = min(s1, kv_valid);
    if (s1 <= s0) return {};
    return {max(0, s0 - band_hi), min(q_valid, s1 - band_lo)};
  }

  // Whether every (t, s) of rows [t0, t0 + rows) x keys [s0, s0 + cols) is visible, given
  // whether segment ids allow every pair (true when they are off): the tile lies inside the
  // intersection of its rows' intervals.
  __device__ __forceinline__ bool is_interior(int t0, int rows, int s0, int cols, bool segments_allow_all) const {
    const int t_last = t0 + rows - 1;
    return segments_allow_all && t_last < q_valid && key_lo(t_last) <= s0 && key_hi(t0) >= s0 + cols;
  }

  // The blocks of block_q query rows (block qb: rows qb·block_q..) that are interior to the keys
  // [s0, s0 + cols) without segment ids (is_interior of each holds): one interval of blocks,
  // since a block's last row must see back to s0 (key_lo non-decreasing: an upper bound), its
  // rows must be valid (another), and its first row must see up to s0 + cols (key_hi
  // non-decreasing: a lower bound). Clipped to [lo, hi); empty (hi, hi) when none.
  __device__ __forceinline__ Range interior_row_blocks(int block_q, int s0, int cols, int lo, int hi) const {
    if (kv_valid < s0 + cols) return {hi, hi};
    const int first = CeilDiv(max(0, s0 + cols - 1 - band_hi), block_q);  // t0 + band_hi + 1 >= s0 + cols
    const int sees_back = s0 - band_lo + 1;                                  // t0 + block_q - 1 + band_lo <= s0
    const int last = min(q_valid / block_q, sees_back <= 0 ? 0 : sees_back / block_q);  // exclusive
    const int begin = min(max(lo, first), hi);
    return {begin, max(begin, min(hi, last))};
  }

  __device__ __forceinline__ bool visible(int t, int s) const {
    if (t >= q_valid || s >= kv_valid) return false;
    if (s - t < band_lo || s - t > band_hi) return false;
    return q_segments == nullptr || q_segments[t] == kv_segments[s];
  }
};

// The smallest and largest segment id of a run of positions; empty when lo > hi.
struct SegmentRange {
  int lo;
  int hi;
  // No id in common (or one side empty): no pair of the tile is visible.
  __device__ __forceinline__ bool disjoint(const SegmentRange& o) const {
    return lo > hi || o.lo > o.hi || hi < o.lo || o.hi < lo;
  }
  // Both sides are one and the same id: segment ids allow every pair of the tile.
  __device__ __forceinline__ bool same_single(const SegmentRange& o) const {
    return lo == hi && o.lo == o.hi && lo == o.lo;
  }
};

// The range of ids[begin, begin + count) restricted to positions below `valid`, reduced over
// the warp (every lane gets it, so decisions taken from it are warp-uniform). Ids need not be
// sorted. Used to skip the tiles a packed-document mask hides entirely.
__device__ __forceinline__ SegmentRange warp_segment_range(const int32_t* ids, int begin, int count, int valid,
                                                           int lane) {
  int lo = 0x7fffffff, hi = -0x7fffffff - 1;
  for (int i = lane; i < count; i += WARP_SIZE) {
    if (begin + i < valid) {
      const int id = ids[begin + i];
      lo = min(lo, id);
      hi = max(hi, id);
    }
  }
  JAX_FLASH_UNROLL
  for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, offset));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, offset));
  }
  return {lo, hi};
}

// The accumulator element (j, i) of a 16 x (8·N) fragment sits at row lane/4 + 8·(i/2) and
// column 8j + 2·(lane%4) + i%2 (C layout, PTX ISA §9.7.14.5.8). In the forward rows are
// queries and columns keys; the backward computes Sᵀ, so there rows are keys (TRANSPOSED).
template <bool TRANSPOSED, int N_BLOCKS>
__device__ __forceinline__ void mask_fragment(float (&acc)[N_BLOCKS][4], const Mask& mask, int row0, int col0,
                                              int lane) {
  JAX_FLASH_UNROLL
  for (int j = 0; j < N_BLOCKS; ++j) {
    JAX_FLASH_UNROLL
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + (lane >> 2) + 8 * (i >> 1);
      const int col = col0 + 8 * j + 2 * (lane & 3) + (i & 1);
      const bool seen = TRANSPOSED ? mask.visible(col, row) : mask.visible(row, col);
      if (!seen) acc[j][i] = -INFINITY;
    }
  }
}

// The same without segment ids (the plain forward), row by row: row t sees the keys
// [key_lo(t), key_hi(t)) when t < q_valid, none otherwise, so an element is visible iff
// s - key_lo(t), as unsigned, is below the interval's width: one compare per element.
template <int N_BLOCKS>
__device__ __forceinline__ void mask_fragment_band(float (&acc)[N_BLOCKS][4], const Mask& mask, int row0, int col0,
                                                   int lane) {
  JAX_FLASH_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int t = row0 + (lane >> 2) + 8 * r;
    const int lo = mask.key_lo(t), hi = mask.key_hi(t);
    const unsigned width = t < mask.q_valid && hi > lo ? static_cast<unsigned>(hi - lo) : 0u;
    const int c0 = col0 + 2 * (lane & 3) - lo;  // s - key_lo(t) of the row's first element
    JAX_FLASH_UNROLL
    for (int j = 0; j < N_BLOCKS; ++j) {
      JAX_FLASH_UNROLL
      for (int e = 0; e < 2; ++e) {
        if (static_cast<unsigned>(c0 + 8 * j + e) >= width) acc[j][2 * r + e] = -INFINITY;
      }
    }
  }
}

// The same for the backward's transposed tiles (rows = keys row0.., columns = queries col0..;
// the plain backward, no segment ids), row by row: key s is seen by the queries
// t in [s − band_hi, s − band_lo] below q_valid when s < kv_valid, by none otherwise, so an
// element is visible iff t − (s − band_hi), as unsigned, is below that interval's width: one
// compare per element, two intervals per thread.
template <int N_BLOCKS>
__device__ __forceinline__ void mask_fragment_band_transposed(float (&acc)[N_BLOCKS][4], const Mask& mask, int row0,
                                                              int col0, int lane) {
  JAX_FLASH_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int s = row0 + (lane >> 2) + 8 * r;
    const int lo = s - mask.band_hi, last = min(mask.q_valid - 1, s - mask.band_lo);
    const unsigned width = s < mask.kv_valid && last >= lo ? static_cast<unsigned>(last - lo + 1) : 0u;
    const int c0 = col0 + 2 * (lane & 3) - lo;  // t − lo of the row's first element
    JAX_FLASH_UNROLL
    for (int j = 0; j < N_BLOCKS; ++j) {
      JAX_FLASH_UNROLL
      for (int e = 0; e < 2; ++e) {
        if (static_cast<unsigned>(c0 + 8 * j + e) >= width) acc[j][2 * r + e] = -INFINITY;
      }
    }
  }
}

// The same for a tile whose rows all sit at one position t (the forward's GQA packing: the
// rows are query heads at T = 1): the mask is one of keys only, the same in every row.
template <int N_BLOCKS>
__device__ __forceinline__ void mask_columns(float (&acc)[N_BLOCKS][4], const Mask& mask, int t, int col0, int lane) {
  JAX_FLASH_UNROLL
  for (int j = 0; j < N_BLOCKS; ++j) {
    JAX_FLASH_UNROLL
    for (int i = 0; i < 4; ++i) {
      if (!mask.visible(t, col0 + 8 * j + 2 * (lane & 3) + (i & 1))) acc[j][i] = -INFINITY;
    }
  }
}

}  // namespace kernels
}  // namespace jax_flash
