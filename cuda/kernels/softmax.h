// Scores to probabilities, one definition for the forward and the backward: the logit
// transform (scale, soft cap) in the log2 domain, and the FlashAttention-2 online softmax.
//
// Units: the kernels work with x = log2(e) · logit, so that p = exp2(x − m) is one FFMA and
// one ex2.approx. Without a soft cap the raw score s = q·k is kept and x = s · exp_scale with
// exp_scale = scale · log2(e) folded into that FFMA. That needs scale > 0: with a soft cap, or
// a scale that is not positive (negative: max(s) would not give max(x); zero or −0: a masked
// s = −inf times exp_scale = 0 is NaN), the tile is transformed first and exp_scale is 1.
// lse leaves the kernels in natural-log units: lse = ln 2 · (m + log2(l)).
//
// Approximate math only where it is per score and its error is documented: ex2.approx (2 ulp);
// once-per-row operations (1/l, log2f) and the soft cap's derivative stay IEEE (the kernels
// are built without --use_fast_math). The soft cap's tanh is built from ex2.approx and an
// IEEE division (`tanh_of`), not tanh.approx: a relative 2^-11 moves a capped logit by up to
// cap · 2^-11 (0.024 at cap = 50), more than a float16 reference's own error.
#pragma once

#include <cmath>

#include "kernels/mask.h"
#include "kernels/params.h"
#include "kernels/tile.h"

namespace jax_flash {
namespace kernels {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// tanh(x) = sign(x) · (1 − 2 / (e^{2|x|} + 1)): one ex2.approx and one IEEE division, an
// absolute error of a few 2^-24 over the whole range (e^{2|x|} = inf gives ±1; NaN stays NaN).
__device__ __forceinline__ float tanh_of(float x) {
  const float e = ptx::ex2_approx(2.0f * kLog2e * fabsf(x));
  return copysignf(1.0f - 2.0f / (e + 1.0f), x);
}

struct LogitScaling {
  float exp_scale;  // p = exp2(x · exp_scale − m)
  float pre_scale;  // transformed: x = cap_log2 · tanh(s · pre_scale), or x = s · pre_scale
  float cap_log2;   // softcap · log2(e); 0 when the soft cap is off
  float inv_cap_log2;  // 1 / cap_log2 (0 when the soft cap is off)
  bool transformed;

  __device__ __forceinline__ static LogitScaling of(const AttentionParams& p) {
    LogitScaling l;
    l.cap_log2 = p.softcap > 0.0f ? p.softcap * kLog2e : 0.0f;
    l.inv_cap_log2 = p.softcap > 0.0f ? 1.0f / l.cap_log2 : 0.0f;
    l.transformed = p.softcap > 0.0f || !(p.scale > 0.0f);
    l.pre_scale = p.softcap > 0.0f ? p.scale / p.softcap : p.scale * kLog2e;
    l.exp_scale = l.transformed ? 1.0f : p.scale * kLog2e;
    return l;
  }

  __device__ __forceinline__ float transform(float s) const {
    return cap_log2 > 0.0f ? cap_log2 * tanh_of(s * pre_scale) : s * pre_scale;
  }

  // d(capped logit)/d(logit) = 1 − tanh², at transformed x; 1 when the soft cap is off.
  // tanh is clamped so that a masked x = −inf gives 0, not NaN.
  __device__ __forceinline__ float cap_derivative(float x) const {
    if (cap_log2 == 0.0f) return 1.0f;
    const float th = fminf(fmaxf(x * inv_cap_log2, -1.0f), 1.0f);
    return 1.0f - th * th;
  }

  // Raw scores of a tile to exponent arguments: transform when needed and, unless the tile
  // is interior, set invisible elements to −inf. The common case (interior, no soft cap)
  // does nothing here.
  template <bool TRANSPOSED, int N_BLOCKS>
  __device__ __forceinline__ void prepare(float (&acc)[N_BLOCKS][4], const Mask& mask, bool interior, int row0,
                                          int col0, int lane) const {
    if (transformed) {
      JAX_FLASH_UNROLL
      for (int j = 0; j < N_BLOCKS; ++j) {
        JAX_FLASH_UNROLL
        for (int i = 0; i < 4; ++i) acc[j][i] = transform(acc[j][i]);
      }
    }
    if (!interior) mask_fragment<TRANSPOSED>(acc, mask, row0, col0, lane);
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
  float row_max[2];  // running max of x (before exp_scale); −inf while nothing is visible
  float row_sum[2];  // this thread's part of the running sum l (the quad's parts add up at the end)

  __device__ __forceinline__ void init() {
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.0f;
  }

  // s (exponent arguments) -> p = exp2(x·exp_scale − m_new), in place; o rescaled by
  // exp2(m_old − m_new) (FlashAttention-2 §3.1.1: O stays unnormalised until the last tile).
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
      const float m_scaled = m == -INFINITY ? 0.0f : m * exp_scale;
      const float alpha = ptx::ex2_approx(fmaf(row_max[r], exp_scale, -m_scaled));
      row_max[r] = m;
      float sum = row_sum[r] * alpha;
      JAX_FLASH_UNROLL
      for (int j = 0; j < O_BLOCKS; ++j) {
        o[j][2 * r] *= alpha;
        o[j][2 * r + 1] *= alpha;
      }
      JAX_FLASH_UNROLL
      for (int j = 0; j < N_BLOCKS; ++j) {
        s[j][2 * r] = ptx::ex2_approx(fmaf(s[j][2 * r], exp_scale, -m_scaled));
        s[j][2 * r + 1] = ptx::ex2_approx(fmaf(s[j][2 * r + 1], exp_scale, -m_scaled));
        sum += s[j][2 * r] + s[j][2 * r + 1];
      }
      row_sum[r] = sum;
    }
  }

  // o /= l, and lse (natural log) per row; rows that saw nothing get o = 0, lse = −inf.
  template <int O_BLOCKS>
  __device__ __forceinline__ void finish(float (&o)[O_BLOCKS][4], float exp_scale, float lse[2]) {
    JAX_FLASH_UNROLL
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(row_sum[r]);
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      JAX_FLASH_UNROLL
      for (int j = 0; j < O_BLOCKS; ++j) {
        o[j][2 * r] *= inv;
        o[j][2 * r + 1] *= inv;
      }
      lse[r] = l > 0.0f ? (row_max[r] * exp_scale + log2f(l)) * kLn2 : -INFINITY;
    }
  }
};

// The exponent offset the backward uses to recompute p = exp2(x·exp_scale − lse2) from the
// forward's natural-log lse; rows that saw nothing (lse = −inf) get +inf, so p = 0.
__device__ __forceinline__ float lse_to_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * kLog2e; }

}  // namespace kernels
}  // namespace jax_flash
