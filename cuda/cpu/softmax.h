// The softmax of FlashAttention-2, tile by tile, in float32:
//  - forward (Alg. 1): the online softmax. Each row keeps a running max m and a
//    running sum l of exp(logit − m); a new tile raises m to m_new, turns its logits
//    into P = exp(S − m_new) and rescales what came before by exp(m_old − m_new).
//    O stays unnormalised until the last tile (§3.1.1), then O / l and lse = m + log l.
//  - backward (Alg. 2): P is recomputed exactly from the saved lse, P = exp(S − lse),
//    and dS = P ∘ (dP − D) with D = rowsum(dO ∘ O) − dlse.
// Non-finite inputs (docs/numerical-contract.md): the row max propagates NaN, a row is
// empty only when its max is −inf (never when it is NaN), Exp(NaN) is NaN, and P and dS are
// exactly 0 where masked even when lse or D is NaN, so a poison reaches only the rows and
// keys that see it.
#pragma once

#include "common/dropout.h"
#include "cpu/score_mask.h"
#include "cpu/vec.h"

namespace jax_flash {
namespace cpu {
namespace JAX_FLASH_CPU_ISA {

// max(a, b) that keeps a NaN of either side (a > b ? a : b drops a NaN a), for the split
// chunks' merge: a row that saw a NaN logit has m = NaN, so its out and lse stay NaN.
JAX_FLASH_INLINE float MaxKeepNaN(float a, float b) { return a > b || a != a ? a : b; }

// Dropout of one row of P (row t of head n of batch row b, keys s0 + j for j < cols_padded,
// s0 a multiple of 4): kept weights are multiplied by `factor`, dropped ones become 0. One
// Philox call gives the bits of 4 adjacent keys (common/dropout.h).
JAX_FLASH_INLINE void DropRow(float* row, int64_t cols_padded, const dropout::Setting& d, int64_t b, int64_t n,
                              int64_t t, int64_t s0, float factor) {
  for (int64_t j = 0; j < cols_padded; j += dropout::kColumnsPerCall) {
    const unsigned bits = dropout::KeepBitsOfGroup(d, static_cast<uint32_t>(b), static_cast<uint32_t>(n),
                                                   static_cast<uint32_t>(t), static_cast<uint32_t>((s0 + j) >> 2));
    for (int64_t c = 0; c < dropout::kColumnsPerCall && j + c < cols_padded; ++c)
      row[j + c] = (bits >> c) & 1u ? row[j + c] * factor : 0.0f;
  }
}

// Which P a tile drops: null when dropout is off.
struct TileDropout {
  const dropout::Setting* setting;
  int64_t b;
  int64_t n;
};

// Online-softmax update of rows [0, s.rows_padded): logits in s become P in place,
// m and l are updated, and correction[i] = exp(m_old − m_new) is what the row's
// output accumulator must be multiplied by before P·V is added to it.
// A row that has seen only masked logits keeps m = -inf and l = 0 and gets P = 0.
// bad_values (null when the tile has none): keys whose value row holds a NaN/±inf, and
// which the products read as zeros; a row that sees one gets a NaN weight (after l is
// summed), which makes its whole output row NaN while its lse stays finite.
// dropout (null: off): after l has summed every P, the dropped P become 0 before P·V (the
// 1 / (1 − rate) is applied with 1 / l at the end).
// visible (null: −inf marks the masked pairs): MaskScores' lane masks, given with a bias,
// under which a visible logit may be −inf and still sees its value row.
JAX_FLASH_INLINE void UpdateOnlineSoftmax(const ScoreTile& s, float* m, float* l, float* correction,
                                          const int32_t* bad_values, const TileDropout* dropout = nullptr,
                                          const int32_t* visible = nullptr) {
  // Every row's new max first (held in correction), then every row's exp and sum. A row's
  // reductions are chains of dependent steps (kept two vectors wide) and rows are
  // independent: apart, the core overlaps one row's chains with the next row's.
  // The max is a plain one (vmaxps), which may drop a NaN; a NaN logit then shows as a NaN
  // P and so a NaN sum, and the row takes m = NaN below, as a NaN-keeping max would give.
  for (int64_t i = 0; i < s.rows_padded; ++i) {
    const float* row = s.data + i * s.ld;
    VecF even = Load(row), odd = even;
    int64_t j = kLanes;
    for (; j + kLanes < s.cols_padded; j += 2 * kLanes) {
      even = Max(even, Load(row + j));
      odd = Max(odd, Load(row + j + kLanes));
    }
    if (j < s.cols_padded) even = Max(even, Load(row + j));
    correction[i] = ReduceMax(Max(Max(even, odd), Splat(m[i])));
  }
  for (int64_t i = 0; i < s.rows_padded; ++i) {
    float* row = s.data + i * s.ld;
    bool sees_bad_value = false;
    if (bad_values != nullptr) {
      for (int64_t j = 0; j < s.cols; ++j) {
        const bool seen = visible != nullptr ? visible[i * s.ld + j] != 0 : row[j] != -__builtin_inff();
        sees_bad_value |= bad_values[j] != 0 && seen;
      }
    }
    const float m_new = correction[i];
    // exp(-inf - (-inf)) would be NaN: with nothing seen yet, subtract 0 instead,
    // which sends every (masked, -inf) logit to exactly 0.
    const VecF shift = Splat(m_new == -__builtin_inff() ? 0.0f : m_new);
    VecF even = Splat(0.0f), odd = even;
    int64_t j = 0;
    for (; j + kLanes < s.cols_padded; j += 2 * kLanes) {
      const VecF p0 = Exp(Load(row + j) - shift), p1 = Exp(Load(row + j + kLanes) - shift);
      Store(row + j, p0);
      Store(row + j + kLanes, p1);
      even += p0;
      odd += p1;
    }
    if (j < s.cols_padded) {
      const VecF p0 = Exp(Load(row + j) - shift);
      Store(row + j, p0);
      even += p0;
    }
    const float sum = ReduceSum(even + odd);
    // A NaN logit (a NaN P): m, l and the correction are NaN, so that the row's out and lse
    // come out NaN (not an empty row's 0 / −inf). A row poisoned before keeps its NaN m (the
    // second operand of Max above), so its shift and sum are NaN too.
    const bool poisoned = sum != sum;
    const float alpha = Exp(Splat(m[i]) - shift)[0];  // m_old = -inf: alpha = 0, O and l are 0 anyway
    correction[i] = poisoned ? __builtin_nanf("") : alpha;
    l[i] = poisoned ? __builtin_nanf("") : l[i] * alpha + sum;
    m[i] = poisoned ? __builtin_nanf("") : m_new;
    if (dropout != nullptr)
      DropRow(row, s.cols_padded, *dropout->setting, dropout->b, dropout->n, s.t0 + i, s.s0, 1.0f);
    if (sees_bad_value) row[0] = __builtin_nanf("");  // any NaN weight: the whole row is NaN
  }
}

// The backward's P of a pair that sends no gradient (masked, or its row is empty) is
// −0.0, which no exp gives: ComputeScoreGradient tells it from a P that underflowed to +0,
// whose dS stays P·(dP − D) (NaN if D is).
constexpr int32_t kDeadBits = static_cast<int32_t>(0x80000000u);

// Backward: P = exp(S − lse) in place. `lse` holds +inf for rows that saw no key, NaN for
// poisoned rows (their visible P are NaN); masked pairs and empty rows get −0.0. Masked
// pairs are the −inf scores, or with `visible` (MaskScores' lane masks, given with a bias)
// its zeros: a visible −inf logit then gets P = +0 (NaN for a NaN lse), whose dS is
// 0 · (dP − D), as the reference's.
JAX_FLASH_INLINE void RecomputeProbabilities(const ScoreTile& s, const float* lse, const int32_t* visible = nullptr) {
  const VecF minus_inf = Splat(-__builtin_inff());
  const VecF dead = reinterpret_cast<VecF>(SplatI(kDeadBits));
  for (int64_t i = 0; i < s.rows_padded; ++i) {
    float* row = s.data + i * s.ld;
    const VecF lse_v = Splat(lse[i]);
    const bool empty = lse[i] == __builtin_inff();
    for (int64_t j = 0; j < s.cols_padded; j += kLanes) {
      const VecF x = Load(row + j);
      const VecI masked = visible != nullptr ? LoadI(visible + i * s.ld + j) == 0 : x == minus_inf;
      Store(row + j, empty ? dead : masked ? dead : Exp(x - lse_v));
    }
  }
}

// Backward: dS = P ∘ (dP − D), times d capped / d logits with the soft cap, in place
// of dP; exactly 0 where P is −0.0 (masked, empty row), also when dP or D is NaN.
JAX_FLASH_INLINE void ComputeScoreGradient(const ScoreTile& p, float* dp, const float* delta,
                                           const float* softcap_derivative) {
  const VecI dead = SplatI(kDeadBits);
  for (int64_t i = 0; i < p.rows_padded; ++i) {
    const float* p_row = p.data + i * p.ld;
    float* dp_row = dp + i * p.ld;
    const VecF delta_v = Splat(delta[i]);
    for (int64_t j = 0; j < p.cols_padded; j += kLanes) {
      const VecF pv = Load(p_row + j);
      VecF ds = pv * (Load(dp_row + j) - delta_v);
      if (softcap_derivative != nullptr) ds *= Load(softcap_derivative + i * p.ld + j);
      Store(dp_row + j, reinterpret_cast<VecI>(pv) == dead ? Splat(0.0f) : ds);
    }
  }
}

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
