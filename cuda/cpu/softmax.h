// The softmax of FlashAttention-2, tile by tile, in float32:
//  - forward (Alg. 1): the online softmax. Each row keeps a running max m and a
//    running sum l of exp(logit − m); a new tile raises m to m_new, turns its logits
//    into P = exp(S − m_new) and rescales what came before by exp(m_old − m_new).
//    O stays unnormalised until the last tile (§3.1.1), then O / l and lse = m + log l.
//  - backward (Alg. 2): P is recomputed exactly from the saved lse, P = exp(S − lse),
//    and dS = P ∘ (dP − D) with D = rowsum(dO ∘ O) − dlse.
#pragma once

#include "cpu/vec.h"
#include "cpu/score_mask.h"

namespace jax_flash {
namespace cpu {
namespace JAX_FLASH_CPU_ISA {

// Online-softmax update of rows [0, s.rows_padded): logits in s become P in place,
// m and l are updated, and correction[i] = exp(m_old − m_new) is what the row's
// output accumulator must be multiplied by before P·V is added to it.
// A row that has seen only masked logits keeps m = -inf and l = 0 and gets P = 0.
JAX_FLASH_INLINE void UpdateOnlineSoftmax(const ScoreTile& s, float* m, float* l, float* correction) {
  for (int64_t i = 0; i < s.rows_padded; ++i) {
    float* row = s.data + i * s.ld;
    VecF row_max = Load(row);
    for (int64_t j = kLanes; j < s.cols_padded; j += kLanes) row_max = Max(row_max, Load(row + j));
    const float tile_max = ReduceMax(row_max);
    const float m_new = tile_max > m[i] ? tile_max : m[i];
    // exp(-inf - (-inf)) would be NaN: with nothing seen yet, subtract 0 instead,
    // which sends every (masked, -inf) logit to exactly 0.
    const float shift = m_new == -__builtin_inff() ? 0.0f : m_new;
    const VecF shift_v = Splat(shift);
    VecF sum = Splat(0.0f);
    for (int64_t j = 0; j < s.cols_padded; j += kLanes) {
      const VecF p = Exp(Load(row + j) - shift_v);
      Store(row + j, p);
      sum += p;
    }
    const float alpha = Exp(Splat(m[i] - shift))[0];  // m_old = -inf: alpha = 0, O and l are 0 anyway
    correction[i] = alpha;
    l[i] = l[i] * alpha + ReduceSum(sum);
    m[i] = m_new;
  }
}

// Backward: P = exp(S − lse) in place. `lse` holds +inf for rows that saw no key,
// which makes their P exactly 0 (and so every gradient they would send).
JAX_FLASH_INLINE void RecomputeProbabilities(const ScoreTile& s, const float* lse) {
  for (int64_t i = 0; i < s.rows_padded; ++i) {
    float* row = s.data + i * s.ld;
    const VecF lse_v = Splat(lse[i]);
    for (int64_t j = 0; j < s.cols_padded; j += kLanes) Store(row + j, Exp(Load(row + j) - lse_v));
  }
}

// Backward: dS = P ∘ (dP − D), times d capped / d logits with the soft cap, in place
// of dP. Masked elements have P = 0 and so dS = 0.
JAX_FLASH_INLINE void ComputeScoreGradient(const ScoreTile& p, float* dp, const float* delta,
                                           const float* softcap_derivative) {
  for (int64_t i = 0; i < p.rows_padded; ++i) {
    const float* p_row = p.data + i * p.ld;
    float* dp_row = dp + i * p.ld;
    const VecF delta_v = Splat(delta[i]);
    for (int64_t j = 0; j < p.cols_padded; j += kLanes) {
      VecF ds = Load(p_row + j) * (Load(dp_row + j) - delta_v);
      if (softcap_derivative != nullptr) ds *= Load(softcap_derivative + i * p.ld + j);
      Store(dp_row + j, ds);
    }
  }
}

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
