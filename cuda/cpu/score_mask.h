// Turning raw scores into the logits the softmax sees: the dense bias, the soft cap, then
// the mask (the structured masks and the dense mask). The raw scores come from the products
// with a ±inf already made NaN (Accumulate::kScores, tile_gemm.h).
// One implementation serves the forward and both backward passes (FlashAttention's
// mask.h idea), so they cannot disagree about which elements are visible.
#pragma once

#include "cpu/convert.h"
#include "cpu/problem.h"
#include "cpu/vec.h"

namespace jax_flash {
namespace cpu {
namespace JAX_FLASH_CPU_ISA {

// A (query rows × keys) tile of scores: rows [t0, t0 + rows) and keys [s0, s0 + cols)
// of one sequence, stored row-major in `rows_padded × cols_padded` floats. With GQA packing
// (tiling.h ForwardBlock) consecutive rows are the heads of one query position: row i sits at
// t0 + i / rows_per_position.
struct ScoreTile {
  float* data;
  int64_t ld;  // = cols_padded, a multiple of kLanes
  int64_t t0;
  int64_t rows;
  int64_t rows_padded;
  int64_t s0;
  int64_t cols;
  int64_t cols_padded;
  int64_t rows_per_position = 1;
  int64_t position(int64_t i) const { return t0 + i / rows_per_position; }
};

// logits += bias over rows [0, s.rows) (the rows of one (b, n), read through their broadcast
// strides and widened to float32 in `buffer`, [cols_padded]); after the scale and before the
// soft cap. Padding columns get 0 (the mask then writes −inf there); padding rows are left.
JAX_FLASH_INLINE void AddBias(const ScoreTile& s, const DenseRows& bias, float* buffer) {
  for (int64_t i = 0; i < s.rows; ++i) {
    if (i == 0 || bias.stride_t != 0) LoadBiasRow(bias, s.t0 + i, s.s0, s.cols, s.cols_padded, buffer);
    float* row = s.data + i * s.ld;
    for (int64_t j = 0; j < s.cols_padded; j += kLanes) Store(row + j, Load(row + j) + Load(buffer + j));
  }
}

// logits -> softcap · tanh(logits / softcap) (Gemma 2's logit soft-capping). When
// `derivative` is given it receives d capped / d logits = 1 − tanh², which the
// backward needs and which is finite even where the mask later writes -inf.
JAX_FLASH_INLINE void ApplySoftCap(const ScoreTile& s, float softcap, float* derivative) {
  const float inverse = 1.0f / softcap;
  for (int64_t i = 0; i < s.rows_padded; ++i) {
    float* row = s.data + i * s.ld;
    for (int64_t j = 0; j < s.cols_padded; j += kLanes) {
      const VecF t = Tanh(Load(row + j) * inverse);
      Store(row + j, t * softcap);
      if (derivative != nullptr) Store(derivative + i * s.ld + j, 1.0f - t * t);
    }
  }
}

// The element-wise part of a tile's mask besides the geometry: the dense mask's rows of one
// (b, n) (data null: none) with a [kBlockK] buffer for one row of it, and `visible` (null:
// not wanted), which receives every element's lane mask (−1 visible, 0 masked; padding rows
// 0), [rows_padded][ld]. With a bias a visible logit may be −inf, so the softmax asks
// `visible` instead of testing for −inf.
struct DenseMasking {
  DenseRows mask;
  int32_t* mask_row = nullptr;
  int32_t* visible = nullptr;
  // The block mask of the (b, n) (absent: none) with a [kBlockK] buffer for one row of it.
  BlockRows blocks;
  int32_t* block_row = nullptr;
};

// One row of the block mask over keys [s0, s0 + n) of query t, as lane masks into dst
// [n_padded] (−1 visible, 0 masked; padding 0): a full block's keys are visible, an empty
// one's masked, a partly visible one's read from its bit row. A partly visible block without
// bits (more of them than the bits' capacity) reads visible here and is poisoned after
// (PoisonBlocksWithoutBits); returns whether the row meets one.
JAX_FLASH_INLINE bool LoadBlockRow(const BlockRows& blocks, int64_t t, int64_t s0, int64_t n, int64_t n_padded,
                                   int32_t* dst) {
  const int64_t i = t / blocks.block_q, r = t % blocks.block_q;
  bool poisoned = false;
  for (int64_t c = 0; c < n;) {
    const int64_t j = (s0 + c) / blocks.block_k, first_key = j * blocks.block_k;
    const int64_t end = std::min(n, first_key + blocks.block_k - s0);  // this block's keys: [c, end)
    const int state = blocks.state(i, j);
    const uint32_t* bits = state == kPartialBlock ? blocks.bit_row(i, j, r) : nullptr;
    if (state != kPartialBlock || bits == nullptr) {
      const int32_t lane = state == kEmptyBlock ? 0 : -1;
      poisoned = poisoned || state == kPartialBlock;
      for (; c < end; ++c) dst[c] = lane;
    } else {
      while (c < end) {  // one 32-bit word of keys at a time: a vector shift per lane
        const int64_t key = s0 + c - first_key;  // within the block
        const uint32_t word = bits[key >> 5];
        const int64_t shift = (key & 31) - c;  // key c's bit: word >> (c + shift)
        const int64_t word_end = std::min(end, c + 32 - (key & 31));
        for (; c < word_end; ++c) dst[c] = -static_cast<int32_t>((word >> (c + shift)) & 1u);
      }
    }
  }
  for (int64_t c = n; c < n_padded; ++c) dst[c] = 0;
  return poisoned;
}

// The visible scores of query t's row (keys [s0, s0 + n)) that lie in a partly visible block
// without bits become NaN: a block mask with more partly visible blocks than its capacity makes
// the rows of those blocks NaN (out and lse, docs/flex.md), never silently wrong.
JAX_FLASH_INLINE void PoisonBlocksWithoutBits(const BlockRows& blocks, int64_t t, int64_t s0, int64_t n, float* row) {
  const int64_t i = t / blocks.block_q, r = t % blocks.block_q;
  for (int64_t c = 0; c < n; ++c) {
    const int64_t j = (s0 + c) / blocks.block_k;
    const bool poisoned = blocks.state(i, j) == kPartialBlock && blocks.bit_row(i, j, r) == nullptr;
    if (poisoned && row[c] != -__builtin_inff()) row[c] = __builtin_nanf("");
  }
}

// Writes -inf over every score the row may not see: keys outside the row's
// interval, padding columns, keys of another segment, and pairs the dense mask or the block
// mask forbids. Padding rows are left as they are (their results are never used).
JAX_FLASH_INLINE void MaskScores(const ScoreTile& s, const MaskGeometry& g, int32_t* segment_buffer,
                                 const DenseMasking& dense = {}) {
  const VecF minus_inf = Splat(-__builtin_inff());
  const bool segments = g.q_segments != nullptr;
  const bool masked = dense.mask.data != nullptr;
  const bool blocked = dense.blocks.present();
  if (segments) {
    for (int64_t j = 0; j < s.cols_padded; ++j) segment_buffer[j] = j < s.cols ? g.kv_segments[s.s0 + j] : 0;
  }
  if (dense.visible != nullptr) {
    for (int64_t i = s.rows * s.ld; i < s.rows_padded * s.ld; ++i) dense.visible[i] = 0;
  }
  for (int64_t i = 0; i < s.rows; ++i) {
    if (masked && (i == 0 || dense.mask.stride_t != 0))
      LoadMaskRow(dense.mask, s.t0 + i, s.s0, s.cols, s.cols_padded, dense.mask_row);
    const bool poisoned =
        blocked && LoadBlockRow(dense.blocks, s.position(i), s.s0, s.cols, s.cols_padded, dense.block_row);
    const KeyInterval keys = g.keys_of_row(s.position(i));
    // The visible columns of this row, relative to s0 and clipped to the tile.
    const int64_t lo = keys.lo - s.s0 < 0 ? 0 : keys.lo - s.s0;
    int64_t hi = keys.hi - s.s0 > s.cols ? s.cols : keys.hi - s.s0;
    if (hi < lo) hi = lo;
    const VecI lo_v = SplatI(static_cast<int32_t>(lo));
    const VecI hi_v = SplatI(static_cast<int32_t>(hi));
    const VecI segment = SplatI(segments ? g.q_segments[s.position(i)] : 0);
    float* row = s.data + i * s.ld;
    for (int64_t j = 0; j < s.cols_padded; j += kLanes) {
      const VecI column = LaneIndex() + static_cast<int32_t>(j);
      VecI visible = (column >= lo_v) & (column < hi_v);
      if (segments) visible &= LoadI(segment_buffer + j) == segment;
      if (masked) visible &= LoadI(dense.mask_row + j);
      if (blocked) visible &= LoadI(dense.block_row + j);
      Store(row + j, visible != 0 ? Load(row + j) : minus_inf);
      if (dense.visible != nullptr) *reinterpret_cast<VecIU*>(dense.visible + i * s.ld + j) = visible;
    }
    if (poisoned) PoisonBlocksWithoutBits(dense.blocks, s.position(i), s.s0, s.cols, row);
  }
}

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
