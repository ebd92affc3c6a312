// The SIMD vector every tile computes with, as a GCC vector extension so that one
// source serves every ISA: the including translation unit picks the ISA with
// `#pragma GCC target` and the width with JAX_FLASH_CPU_VECTOR_WIDTH (floats per
// register: 16 for AVX-512, 8 for AVX2, 4 for the baseline).
//
// Only plain operators and our own functions appear here: nothing from the standard
// library is instantiated after the target pragma, so no ISA-specific copy of a shared
// inline function can leak into code that runs on a CPU without that ISA.
#pragma once

#include <cstdint>

#ifndef JAX_FLASH_CPU_ISA
#error "include vec.h from an ISA translation unit that defines JAX_FLASH_CPU_ISA"
#endif

#define JAX_FLASH_INLINE inline __attribute__((always_inline))

namespace jax_flash {
namespace cpu {
namespace JAX_FLASH_CPU_ISA {

constexpr int kLanes = JAX_FLASH_CPU_VECTOR_WIDTH;

typedef float VecF __attribute__((vector_size(4 * kLanes)));
typedef int32_t VecI __attribute__((vector_size(4 * kLanes)));
// Unaligned, aliasing views for loads and stores.
typedef float VecFU __attribute__((vector_size(4 * kLanes), aligned(4), may_alias));
typedef int32_t VecIU __attribute__((vector_size(4 * kLanes), aligned(4), may_alias));

JAX_FLASH_INLINE VecF Load(const float* p) { return *reinterpret_cast<const VecFU*>(p); }
JAX_FLASH_INLINE VecI LoadI(const int32_t* p) { return *reinterpret_cast<const VecIU*>(p); }
JAX_FLASH_INLINE void Store(float* p, VecF v) { *reinterpret_cast<VecFU*>(p) = v; }
// x - 0 (not 0 + x, which is not x for x = -0) folds away: a plain broadcast.
JAX_FLASH_INLINE VecF Splat(float x) { return x - VecF{}; }
JAX_FLASH_INLINE VecI SplatI(int32_t x) { return x - VecI{}; }
JAX_FLASH_INLINE VecI LaneIndex() {
  VecI v;
  for (int i = 0; i < kLanes; ++i) v[i] = i;
  return v;
}
JAX_FLASH_INLINE VecF Max(VecF a, VecF b) { return a > b ? a : b; }
JAX_FLASH_INLINE VecF Min(VecF a, VecF b) { return a < b ? a : b; }
JAX_FLASH_INLINE VecF Abs(VecF a) { return reinterpret_cast<VecF>(reinterpret_cast<VecI>(a) & 0x7fffffff); }

// A vector of N floats (N a power of two, at least 4).
template <int N>
struct FloatsOf {
  typedef float type __attribute__((vector_size(4 * N)));
};

// The lower and upper halves of a vector of N = 16 or 8 floats, in registers.
template <int N>
JAX_FLASH_INLINE typename FloatsOf<N / 2>::type LowHalf(typename FloatsOf<N>::type v) {
  if constexpr (N == 16) return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  if constexpr (N == 8) return __builtin_shufflevector(v, v, 0, 1, 2, 3);
}
template <int N>
JAX_FLASH_INLINE typename FloatsOf<N / 2>::type HighHalf(typename FloatsOf<N>::type v) {
  if constexpr (N == 16) return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  if constexpr (N == 8) return __builtin_shufflevector(v, v, 4, 5, 6, 7);
}

// op(... op(op(lo, hi) of the halves ...)): the lanes folded in halves in registers, in a
// fixed order (lane i with lane i + width, width = N/2, N/4, ..., 1). The last two steps
// stay on 4-lane vectors (as vector operations, not scalar compares and branches).
template <int N, class Op>
JAX_FLASH_INLINE float FoldHalves(typename FloatsOf<N>::type v, Op op) {
  if constexpr (N == 4) {
    v = op(v, __builtin_shufflevector(v, v, 2, 3, 2, 3));
    return op(v, __builtin_shufflevector(v, v, 1, 1, 1, 1))[0];
  } else {
    return FoldHalves<N / 2>(op(LowHalf<N>(v), HighHalf<N>(v)), op);
  }
}

JAX_FLASH_INLINE float ReduceMax(VecF v) {
  return FoldHalves<kLanes>(v, [](auto a, auto b) { return a > b ? a : b; });
}
// Pairwise, in a fixed order: the same bits on every thread count.
JAX_FLASH_INLINE float ReduceSum(VecF v) {
  return FoldHalves<kLanes>(v, [](auto a, auto b) { return a + b; });
}

// exp(x) to about 2 ulp: x = k ln2 + r with |r| <= ln2/2, exp(r) by a degree-6
// polynomial (Cephes expf coefficients), 2^k put into the exponent bits. Inputs
// below -87.3 (including -inf, the mask value) give exactly 0; NaN gives NaN.
// With AVX-512 (16 lanes) the clamp is one vminps and 2^k one vscalefps, with the same bits.
JAX_FLASH_INLINE VecF Exp(VecF x) {
#if JAX_FLASH_CPU_VECTOR_WIDTH == 16
  // vminps returns its second operand when either is NaN: x > 88 ? 88 : x, NaN passing.
  const VecF clamped = (VecF)_mm512_min_ps(_mm512_set1_ps(88.0f), (__m512)x);
#else
  const VecF clamped = x > Splat(88.0f) ? Splat(88.0f) : x;  // 2^k stays normal; NaN passes
#endif
  const VecF magic = Splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const VecF shifted = clamped * 1.44269504088896341f + magic;
  const VecF k = shifted - magic;
  VecF r = clamped - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  VecF p = Splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
#if JAX_FLASH_CPU_VECTOR_WIDTH == 16
  // Not below (NLT_UQ: true for a NaN x, which then passes as p = NaN).
  const __mmask16 normal = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-87.33654475f), _CMP_NLT_UQ);
  return (VecF)_mm512_maskz_scalef_ps(normal, (__m512)p, (__m512)k);
#else
  const VecI exponent = (__builtin_convertvector(k, VecI) + 127) << 23;
  const VecF result = p * reinterpret_cast<VecF>(exponent);
  return x < Splat(-87.33654475f) ? Splat(0.0f) : result;
#endif
}

// tanh(x): odd Taylor series where it is accurate (|x| < 0.25, error < 1e-8) and
// (e^2a - 1) / (e^2a + 1) elsewhere, saturating to 1 beyond |x| = 9.
JAX_FLASH_INLINE VecF Tanh(VecF x) {
  const VecF a = Abs(x) > Splat(9.0f) ? Splat(9.0f) : Abs(x);  // NaN passes (tanh(NaN) = NaN)
  const VecF a2 = a * a;
  VecF series = Splat(62.0f / 2835.0f);
  series = series * a2 - 17.0f / 315.0f;
  series = series * a2 + 2.0f / 15.0f;
  series = series * a2 - 1.0f / 3.0f;
  series = series * a2 * a + a;
  const VecF e = Exp(a + a);
  const VecF ratio = (e - 1.0f) / (e + 1.0f);
  const VecF t = a < Splat(0.25f) ? series : ratio;
  const VecI sign = reinterpret_cast<VecI>(x) & static_cast<int32_t>(0x80000000u);
  return reinterpret_cast<VecF>(reinterpret_cast<VecI>(t) | sign);
}

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
