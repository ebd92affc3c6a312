// The one matrix product every step of the algorithm is made of, on packed float32
// tiles: C (+)= A · B with B and C row-major and vectorised along their rows, A read
// one scalar at a time and broadcast (optionally transposed, for Pᵀ·dO and dSᵀ·Q).
//
// Register blocking: a micro-tile of kGemmRows rows of C × up to kGemmVecs vectors
// stays in registers for the whole reduction; each step loads kGemmVecs vectors of B
// and broadcasts kGemmRows scalars of A into kGemmRows·kGemmVecs fused multiply-adds.
#pragma once

#include "cpu/vec.h"

namespace jax_flash {
namespace cpu {
namespace JAX_FLASH_CPU_ISA {

constexpr int kGemmRows = 4;  // rows of C per micro-tile; M must be a multiple
#if JAX_FLASH_CPU_VECTOR_WIDTH >= 16
constexpr int kGemmVecs = 4;  // 16 zmm accumulators of the 32
#else
constexpr int kGemmVecs = 3;  // 12 accumulators of the 16 ymm/xmm registers
#endif

enum class Accumulate {
  kOverwrite,  // C = A·B
  kScores,     // C = A·B with ±inf as NaN (PoisonInfinite): the raw scores of a tile
  kAdd,        // C += A·B
  kRescale,    // C = row_scale ∘ C + A·B (the online-softmax correction of O)
};

// A raw score q·k that is ±inf comes from a non-finite q or k: it becomes NaN (as a NaN
// input gives), so that it poisons its row whatever its sign, the scale or the soft cap.
// Applied as the scores leave the product (Accumulate::kScores), before the soft cap and the
// mask, so that afterwards −inf means "masked" only.
JAX_FLASH_INLINE VecF PoisonInfinite(VecF x) {
  return Abs(x) == Splat(__builtin_inff()) ? Splat(__builtin_nanf("")) : x;
}

template <bool kTransposeA, Accumulate kMode, int kVecs>
JAX_FLASH_INLINE void GemmMicroTile(int64_t k_dim, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                                    int64_t ldc, const float* row_scale) {
  VecF acc[kGemmRows][kVecs];  // (rows of C, vectors along a row of C)
  for (int r = 0; r < kGemmRows; ++r) {
    for (int v = 0; v < kVecs; ++v) {
      if (kMode == Accumulate::kOverwrite || kMode == Accumulate::kScores) {
        acc[r][v] = Splat(0.0f);
      } else if (kMode == Accumulate::kAdd) {
        acc[r][v] = Load(c + r * ldc + v * kLanes);
      } else {
        acc[r][v] = Load(c + r * ldc + v * kLanes) * row_scale[r];
      }
    }
  }
  for (int64_t k = 0; k < k_dim; ++k) {
    VecF bk[kVecs];
    for (int v = 0; v < kVecs; ++v) bk[v] = Load(b + k * ldb + v * kLanes);
    for (int r = 0; r < kGemmRows; ++r) {
      const VecF ar = Splat(kTransposeA ? a[k * lda + r] : a[r * lda + k]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] += ar * bk[v];
    }
  }
  for (int r = 0; r < kGemmRows; ++r)
    for (int v = 0; v < kVecs; ++v)
      Store(c + r * ldc + v * kLanes, kMode == Accumulate::kScores ? PoisonInfinite(acc[r][v]) : acc[r][v]);
}

// C[m][n] (+)= Σ_k A(m, k) · B[k][n] for m < M, n < N, k < K, where
// A(m, k) = a[m·lda + k], or a[k·lda + m] when kTransposeA.
// M must be a multiple of kGemmRows and N of kLanes.
template <bool kTransposeA, Accumulate kMode>
JAX_FLASH_INLINE void Gemm(int64_t m_dim, int64_t n_dim, int64_t k_dim, const float* a, int64_t lda, const float* b,
                           int64_t ldb, float* c, int64_t ldc, const float* row_scale = nullptr) {
  // Column strips outside, rows inside: one strip of B (k_dim × kGemmVecs vectors,
  // 32 KB at k_dim = 128) stays in L1 while the rows of A stream past it.
  auto rows_of = [&](int64_t m) { return kTransposeA ? a + m : a + m * lda; };
  auto scale_of = [&](int64_t m) { return row_scale == nullptr ? nullptr : row_scale + m; };
  int64_t n = 0;
  for (; n + kGemmVecs * kLanes <= n_dim; n += kGemmVecs * kLanes)
    for (int64_t m = 0; m < m_dim; m += kGemmRows)
      GemmMicroTile<kTransposeA, kMode, kGemmVecs>(k_dim, rows_of(m), lda, b + n, ldb, c + m * ldc + n, ldc,
                                                   scale_of(m));
  // The remaining vectors: two at a time, then one.
  for (; n + 2 * kLanes <= n_dim; n += 2 * kLanes)
    for (int64_t m = 0; m < m_dim; m += kGemmRows)
      GemmMicroTile<kTransposeA, kMode, 2>(k_dim, rows_of(m), lda, b + n, ldb, c + m * ldc + n, ldc, scale_of(m));
  for (; n < n_dim; n += kLanes)
    for (int64_t m = 0; m < m_dim; m += kGemmRows)
      GemmMicroTile<kTransposeA, kMode, 1>(k_dim, rows_of(m), lda, b + n, ldb, c + m * ldc + n, ldc, scale_of(m));
}

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
