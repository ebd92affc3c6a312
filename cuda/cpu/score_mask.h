// Turning raw scores into the logits the softmax sees: the soft cap, then the mask.
// One implementation serves the forward and both backward passes (FlashAttention's
// mask.h idea), so they cannot disagree about which elements are visible.
#pragma once

#include "cpu/problem.h"
#include "cpu/vec.h"

namespace jax_flash {
namespace cpu {
namespace JAX_FLASH_CPU_ISA {

// A (query rows × keys) tile of scores: rows [t0, t0 + rows) and keys [s0, s0 + cols)
// of one sequence, stored row-major in `rows_padded × cols_padded` floats.
struct ScoreTile {
  float* data;
  int64_t ld;  // = cols_padded, a multiple of kLanes
  int64_t t0;
  int64_t rows;
  int64_t rows_padded;
  int64_t s0;
  int64_t cols;
  int64_t cols_padded;
};

// A raw score q·k that is ±inf comes from a non-finite q or k: it becomes NaN (as a NaN
// input gives), so that it poisons its row whatever its sign, the scale or the soft cap.
// Runs before the soft cap and the mask, so that afterwards −inf means "masked" only.
JAX_FLASH_INLINE void PoisonInfiniteScores(const ScoreTile& s) {
  const VecF inf = Splat(__builtin_inff());
  const VecF nan = Splat(__builtin_nanf(""));
  for (int64_t i = 0; i < s.rows_padded; ++i) {
    float* row = s.data + i * s.ld;
    for (int64_t j = 0; j < s.cols_padded; j += kLanes) {
      const VecF x = Load(row + j);
      Store(row + j, Abs(x) == inf ? nan : x);
    }
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

// Writes -inf over every score the row may not see: keys outside the row's
// interval, padding columns, and keys of another segment. Padding rows are left as
// they are (their results are never used).
JAX_FLASH_INLINE void MaskScores(const ScoreTile& s, const MaskGeometry& g, int32_t* segment_buffer) {
  const VecF minus_inf = Splat(-__builtin_inff());
  const bool segments = g.q_segments != nullptr;
  if (segments) {
    for (int64_t j = 0; j < s.cols_padded; ++j)
      segment_buffer[j] = j < s.cols ? g.kv_segments[s.s0 + j] : 0;
  }
  for (int64_t i = 0; i < s.rows; ++i) {
    const KeyInterval keys = g.keys_of_row(s.t0 + i);
    // The visible columns of this row, relative to s0 and clipped to the tile.
    const int64_t lo = keys.lo - s.s0 < 0 ? 0 : keys.lo - s.s0;
    int64_t hi = keys.hi - s.s0 > s.cols ? s.cols : keys.hi - s.s0;
    if (hi < lo) hi = lo;
    const VecI lo_v = SplatI(static_cast<int32_t>(lo));
    const VecI hi_v = SplatI(static_cast<int32_t>(hi));
    const VecI segment = SplatI(segments ? g.q_segments[s.t0 + i] : 0);
    float* row = s.data + i * s.ld;
    for (int64_t j = 0; j < s.cols_padded; j += kLanes) {
      const VecI column = LaneIndex() + static_cast<int32_t>(j);
      VecI visible = (column >= lo_v) & (column < hi_v);
      if (segments) visible &= LoadI(segment_buffer + j) == segment;
      Store(row + j, visible != 0 ? Load(row + j) : minus_inf);
    }
  }
}

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
