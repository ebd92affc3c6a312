// Scores to probabilities, one definition for the forward and the backward: the logit
// transform (scale, soft cap) and the FlashAttention-2 online softmax.
//
// Units: logits x are natural (x = scale · s, or cap · tanh(scale · s / cap)), rounded to
// float32 once per score; exponents are differences of two such values, p = exp2((x − m) ·
// log2(e)), so that the max itself gives exactly exp2(0) = 1 at any magnitude. (Folding the
// scale into an FFMA, exp2(fma(s, scale·log2 e, −m)), leaves the rounding error of the
// row max's product, ulp(|m|)/2, in every exponent: NaN and ±inf lse for logits ~1e9.) The
// backward subtracts the forward's natural lse from the same rounded x.
//
// Non-finite values (docs/numerical-contract.md): a raw score s = q·k that is ±inf becomes
// NaN before the transform, so a poisoned q or k poisons its row whatever the signs and the
// scale. fmaxf drops a NaN from the row max, but the NaN score still reaches p = exp2(NaN),
// the row sum l and O, so a row is empty only when l == 0 (never when l is NaN). The
// backward gives P = dS = 0 exactly to pairs that send no gradient (masked: x = −inf; rows
// that saw nothing: lse = −inf), even where lse, dP or D are NaN.
//
// Approximate math only where it is per score and its error is documented: ex2.approx (2 ulp);
// once-per-row operations (1/l, log2f) and the soft cap's derivative stay IEEE (the kernels
// are built without --use_fast_math). The soft cap's tanh is built from ex2.approx and an
// IEEE division (`tanh_of`), not tanh.approx: a relative 2^-11 moves a capped logit by up to
// cap · 2^-11 (0.024 at cap = 50), more than a float16 reference's own error.
#pragma once

#include <cfloat>
#include <cmath>

#include "kernels/bias.h"
#include "kernels/mask.h"
#include "kernels/params.h"
#include "kernels/tile.h"

namespace jax_flash {
namespace kernels {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// tanh(x) = sign(x) · (1 − 2 / (e^{2|x|} + 1)): one ex2.approx and one IEEE division, an
// absolute error of a few 2^-24 over the whole range (e^{2|x|} = inf gives ±1; NaN stays NaN).
// Below |x| = 1/8 that form cancels (tanh(1e-30) would be 0, and a cap of 1e30 multiplies the
// error back up), so there the odd Taylor polynomial to x^7 is used: a relative error below
// 2^-24 (the next term is 62/2835 · x^9).
__device__ __forceinline__ float tanh_of(float x) {
  const float a = fabsf(x);
  if (a < 0.125f) {
    const float x2 = x * x;
    return x * fmaf(x2, fmaf(x2, fmaf(x2, -17.0f / 315.0f, 2.0f / 15.0f), -1.0f / 3.0f), 1.0f);
  }
  const float e = ptx::ex2_approx(2.0f * kLog2e * a);
  return copysignf(1.0f - 2.0f / (e + 1.0f), x);
}

// A raw score that is ±inf comes from a non-finite q or k: NaN, as a NaN input gives.
__device__ __forceinline__ float poison_infinite(float s) {
  return fabsf(s) == INFINITY ? __uint_as_float(0x7fc00000u) : s;
}

struct LogitScaling {
  float exp_scale;  // p = exp2((x − m) · exp_scale): log2(e), x being natural logits
  float pre_scale;  // x = cap · tanh(s · pre_scale), or x = s · pre_scale
  float scale;      // with a bias: x = cap · tanh((s · scale + bias) · inv_cap), or s · scale + bias
  float cap;        // the soft cap; 0 when it is off
  float inv_cap;    // 1 / cap (0 when the soft cap is off)

  __device__ __forceinline__ static LogitScaling of(const AttentionParams& p) {
    LogitScaling l;
    l.cap = p.softcap > 0.0f ? p.softcap : 0.0f;
    l.inv_cap = p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f;
    l.pre_scale = p.softcap > 0.0f ? p.scale / p.softcap : p.scale;
    l.scale = p.scale;
    l.exp_scale = kLog2e;
    return l;
  }

  __device__ __forceinline__ float transform(float s) const {
    s = poison_infinite(s);
    return cap > 0.0f ? cap * tanh_of(s * pre_scale) : s * pre_scale;
  }

  // The same with a dense bias, added in float32 after the scale and before the cap.
  __device__ __forceinline__ float transform_biased(float s, float bias) const {
    const float x = poison_infinite(s) * scale + bias;
    return cap > 0.0f ? cap * tanh_of(x * inv_cap) : x;
  }

  // d(capped logit)/d(logit) = 1 − tanh², at transformed x; 1 when the soft cap is off.
  // tanh is clamped so that a masked x = −inf gives 0, not NaN.
  __device__ __forceinline__ float cap_derivative(float x) const {
    if (cap == 0.0f) return 1.0f;
    const float th = fminf(fmaxf(x * inv_cap, -1.0f), 1.0f);
    return 1.0f - th * th;
  }

  // Raw scores of a tile to logits: transform (scale, the dense bias of the tile's (b, n) if
  // any, soft cap, ±inf -> NaN), then set invisible elements to −inf: unless the tile is
  // interior, those the structured mask hides, those the dense mask (if any) does not allow,
  // and those the block mask (if any) hides (NaN in its poisoned blocks, kernels/block_mask.h).
  // GRADIENT (the backward kernels): a −inf bias gives its visible pair the logit −FLT_MAX
  // instead, whose P = exp(x − lse) is still 0 for a finite lse, but which is not taken for a
  // masked pair (P = dS = 0 whatever lse and D are): a NaN lse or D reaches it, as in the
  // reference (a −inf bias is not a mask). The forward keeps −inf, so that a row of them is empty.
  template <bool TRANSPOSED, bool GRADIENT = false, int N_BLOCKS>
  __device__ __forceinline__ void prepare(float (&acc)[N_BLOCKS][4], const Mask& mask, const DenseRows& bias,
                                          const DenseRows& dense_mask, const BlockRows& blocks, bool interior, int row0,
                                          int col0, int lane) const {
    if (bias.present()) {
      JAX_FLASH_UNROLL
      for (int j = 0; j < N_BLOCKS; ++j) {
        JAX_FLASH_UNROLL
        for (int i = 0; i < 4; ++i) {
          int t, s;
          fragment_position<TRANSPOSED>(j, i, row0, col0, lane, t, s);
          const float x = transform_biased(acc[j][i], bias.inside(t, s) ? bias.bias_at(t, s) : 0.0f);
          acc[j][i] = GRADIENT && x == -INFINITY ? -FLT_MAX : x;
        }
      }
    } else {
      JAX_FLASH_UNROLL
      for (int j = 0; j < N_BLOCKS; ++j) {
        JAX_FLASH_UNROLL
        for (int i = 0; i < 4; ++i) acc[j][i] = transform(acc[j][i]);
      }
    }
    if (!interior) mask_fragment<TRANSPOSED>(acc, mask, row0, col0, lane);
    if (dense_mask.present()) mask_fragment_dense<TRANSPOSED>(acc, dense_mask, row0, col0, lane);
    if (blocks.present()) mask_fragment_blocks<TRANSPOSED>(acc, blocks, row0, col0, lane);
  }

  // The backward's P = exp2((x − lse) · exp_scale) and dS = P ∘ (dP − D) ∘ cap′(x) of one
  // score, given lse_off (the row's lse, +inf for a row that saw nothing). A masked pair
  // (x = −inf) or an empty row sends nothing: P = dS = 0, also when dP or D is NaN.
  __device__ __forceinline__ void probability_and_ds(float x, float lse_off, float delta, float& p,
                                                     float& dp_to_ds) const {
    const bool live = x != -INFINITY && lse_off != INFINITY;
    const float prob = ptx::ex2_approx((x - lse_off) * exp_scale);
    const float ds = prob * (dp_to_ds - delta) * cap_derivative(x);
    p = live ? prob : 0.0f;
    dp_to_ds = live ? ds : 0.0f;
  }
};

// Sum (or max) over the quad of lanes that hold one accumulator row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The online softmax of a warp's 16 query rows; each thread holds rows lane/4 and lane/4 + 8.
struct OnlineSoftmax {
  float row_max[2];  // running max of x; −inf while nothing is visible
  float row_sum[2];  // this thread's part of the running sum l (the quad's parts add up at the end)

  // The state before the first key tile: after the sink alone, m = sink and l = 1 (held by
  // the quad's first lane; the quad's parts add up in finish). No sink is sink = −inf: the
  // first visible key's exp2(m_old − m_new) = 0 turns l back into 0 (an empty row keeps
  // l = 1, o = 0 and lse = −inf + 0). A NaN or +inf sink gets l = NaN: its head's rows are NaN.
  // sinks[r]: the sink of row lane/4 + 8·r (the rows' heads differ under GQA packing).
  __device__ __forceinline__ void init(const float (&sinks)[2], int lane) {
    JAX_FLASH_UNROLL
    for (int r = 0; r < 2; ++r) {
      const float l0 = sinks[r] < INFINITY ? 1.0f : __uint_as_float(0x7fc00000u);
      row_max[r] = sinks[r];
      row_sum[r] = lane % 4 == 0 ? l0 : 0.0f;
    }
  }

  // The state before the first key tile of the plain forward, whose sink joins at the end
  // (finish_scores): nothing seen, m = −inf and l = 0.
  __device__ __forceinline__ void init_empty() {
    JAX_FLASH_UNROLL
    for (int r = 0; r < 2; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.0f;
    }
  }

  // s (logits x) -> p = exp2((x − m_new)·exp_scale), in place; o rescaled by
  // exp2((m_old − m_new)·exp_scale) (FlashAttention-2 §3.1.1: O stays unnormalised until the
  // last tile).
  template <int N_BLOCKS, int O_BLOCKS>
  __device__ __forceinline__ void update(float (&s)[N_BLOCKS][4], float (&o)[O_BLOCKS][4], float exp_scale) {
    JAX_FLASH_UNROLL
    for (int r = 0; r < 2; ++r) {
      float m = row_max[r];
      JAX_FLASH_UNROLL
      for (int j = 0; j < N_BLOCKS; ++j) m = fmaxf(m, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      m = quad_max(m);
      // A row that has seen nothing yet keeps m = −inf; exponents are then taken against 0 so
      // that masked scores give exp2(−inf) = 0 instead of NaN.
      const float m_ref = m == -INFINITY ? 0.0f : m;
      const float alpha = ptx::ex2_approx((row_max[r] - m_ref) * exp_scale);
      row_max[r] = m;
      float sum = row_sum[r] * alpha;
      JAX_FLASH_UNROLL
      for (int j = 0; j < O_BLOCKS; ++j) {
        o[j][2 * r] *= alpha;
        o[j][2 * r + 1] *= alpha;
      }
      JAX_FLASH_UNROLL
      for (int j = 0; j < N_BLOCKS; ++j) {
        s[j][2 * r] = ptx::ex2_approx((s[j][2 * r] - m_ref) * exp_scale);
        s[j][2 * r + 1] = ptx::ex2_approx((s[j][2 * r + 1] - m_ref) * exp_scale);
        sum += s[j][2 * r] + s[j][2 * r + 1];
      }
      row_sum[r] = sum;
    }
  }

  // The plain forward's end (its statistics kept in raw scores s, exp_scale = scale·log2 e, no
  // sink in the loop): x_max = scale·m rounded once, the sink joins as one more logit, then
  // o /= l and lse = M + log(l) with M = max(x_max, sink). Without a sink (−inf) this is finish's
  // arithmetic on x_max. A row that saw nothing has l = 0: with a sink o = 0 and lse = sink,
  // without one o = 0 and lse = −inf. A NaN or +inf sink makes l NaN: its head's rows are NaN.
  template <int O_BLOCKS>
  __device__ __forceinline__ void finish_scores(float (&o)[O_BLOCKS][4], float scale, float sink, float lse[2]) {
    JAX_FLASH_UNROLL
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(row_sum[r]);
      const float x_max = l == 0.0f ? -INFINITY : __fmul_rn(row_max[r], scale);
      const bool empty = l == 0.0f && sink == -INFINITY;
      const float m = l == 0.0f ? sink : fmaxf(x_max, sink);  // fmaxf drops a NaN sink; (sink − m) keeps it
      const float keep = empty ? 0.0f : ptx::ex2_approx((x_max - m) * kLog2e);
      const float l_all = empty ? 0.0f : l * keep + ptx::ex2_approx((sink - m) * kLog2e);
      const float inv = empty ? 0.0f : keep / l_all;
      JAX_FLASH_UNROLL
      for (int j = 0; j < O_BLOCKS; ++j) {
        o[j][2 * r] *= inv;
        o[j][2 * r + 1] *= inv;
      }
      lse[r] = empty ? -INFINITY : m + log2f(l_all) / kLog2e;
    }
  }

  // o /= l, and lse (natural log) per row; rows that saw nothing (l = 0) get o = 0, lse = −inf
  // (with a sink, l = 1: o = 0 and lse = sink).
  // A NaN l (a poisoned row) is not empty: its o and lse come out NaN.
  template <int O_BLOCKS>
  __device__ __forceinline__ void finish(float (&o)[O_BLOCKS][4], float exp_scale, float lse[2]) {
    JAX_FLASH_UNROLL
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(row_sum[r]);
      const bool empty = l == 0.0f;
      const float inv = empty ? 0.0f : 1.0f / l;
      JAX_FLASH_UNROLL
      for (int j = 0; j < O_BLOCKS; ++j) {
        o[j][2 * r] *= inv;
        o[j][2 * r + 1] *= inv;
      }
      lse[r] = empty ? -INFINITY : row_max[r] + log2f(l) / exp_scale;
    }
  }
};

// A compare and select per score, planted in a key loop only by the static budget's own test
// (tests/tooling/test_cuda_static.py defines JAX_FLASH_PLANT_SCORE_TEST; never in a build): the
// loop's budget (build/check_static.py) must fail with it.
#ifdef JAX_FLASH_PLANT_SCORE_TEST
template <int N_BLOCKS>
__device__ __forceinline__ void plant_score_test(float (&acc)[N_BLOCKS][4]) {
  const float planted = __int_as_float(ptx::mov_b32_volatile(0x7f7fffff));
  JAX_FLASH_UNROLL
  for (int j = 0; j < N_BLOCKS; ++j) {
    JAX_FLASH_UNROLL
    for (int i = 0; i < 4; ++i) acc[j][i] = acc[j][i] == planted ? 0.0f : acc[j][i];
  }
}
#endif

// The offset the backward subtracts from x to recompute p = exp2((x − lse_off)·exp_scale):
// the forward's lse, and +inf for rows that saw nothing (lse = −inf), so that p = 0. A NaN
// lse (a poisoned row) stays NaN.
__device__ __forceinline__ float lse_offset(float lse) { return lse == -INFINITY ? INFINITY : lse; }

}  // namespace kernels
}  // namespace jax_flash
