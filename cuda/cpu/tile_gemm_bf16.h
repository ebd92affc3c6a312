// The tile product on bfloat16 operands with float32 accumulation, for CPUs with
// AVX512-BF16 (`vdpbf16ps`): C (+)= A · B where
//   A is row-major bf16 [M][lda], its reduction index k contiguous, so that the pair
//     (A[m][2p], A[m][2p+1]) is one 32-bit word (broadcast to every lane);
//   B is in pair-interleaved ("VNNI") layout [K/2][ldb][2]: element (k, n) at
//     b[(k/2)·2·ldb + 2n + k%2], so one 64-byte load holds the pairs of 16 columns;
//   C is row-major float32 [M][ldc].
// One vdpbf16ps adds A[m][2p]·B[2p][n] + A[m][2p+1]·B[2p+1][n] to 16 float lanes of C.
// The same layouts are what AMX tiles take (A rows, B pairs), see tile_gemm_amx.h.
//
// Also here: rounding float32 tiles (P, dS) to bf16 rows or to pair layout, with
// round-to-nearest-even (vcvtneps2bf16, which treats float32 subnormals as zero).
#pragma once

#include "cpu/tile_gemm.h"  // Accumulate, kGemmRows
#include "cpu/vec.h"

#if !defined(JAX_FLASH_CPU_BF16_PRODUCTS)
#error "include tile_gemm_bf16.h only from a translation unit compiled for AVX512-BF16"
#endif

namespace jax_flash {
namespace cpu {
namespace JAX_FLASH_CPU_ISA {

static_assert(kLanes == 16, "the bf16 products use 512-bit vectors");

constexpr int kGemmVecsBF16 = 4;  // 4 rows × 4 vectors: 16 zmm accumulators of the 32

JAX_FLASH_INLINE __m512 DotPairs(__m512 acc, __m512i a_pairs, __m512i b_pairs) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a_pairs, (__m512bh)b_pairs);
}

// C micro-tile (kGemmRows × kVecs vectors) over `pairs` reduction pairs.
template <Accumulate kMode, int kVecs>
JAX_FLASH_INLINE void GemmMicroTileBF16(int64_t pairs, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                                        float* c, int64_t ldc, const float* row_scale, float out_scale) {
  __m512 acc[kGemmRows][kVecs];
  for (int r = 0; r < kGemmRows; ++r) {
    for (int v = 0; v < kVecs; ++v) {
      if (kMode == Accumulate::kOverwrite || kMode == Accumulate::kScores) {
        acc[r][v] = _mm512_setzero_ps();
      } else if (kMode == Accumulate::kAdd) {
        acc[r][v] = _mm512_loadu_ps(c + r * ldc + v * kLanes);
      } else {
        acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(c + r * ldc + v * kLanes), _mm512_set1_ps(row_scale[r]));
      }
    }
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i bp[kVecs];
    for (int v = 0; v < kVecs; ++v) bp[v] = _mm512_loadu_si512(b + p * 2 * ldb + v * 2 * kLanes);
    for (int r = 0; r < kGemmRows; ++r) {
      uint32_t word;
      __builtin_memcpy(&word, a + r * lda + 2 * p, 4);
      const __m512i ar = _mm512_set1_epi32(static_cast<int>(word));
      for (int v = 0; v < kVecs; ++v) acc[r][v] = DotPairs(acc[r][v], ar, bp[v]);
    }
  }
  for (int r = 0; r < kGemmRows; ++r) {
    for (int v = 0; v < kVecs; ++v) {
      __m512 x = acc[r][v];
      if (kMode == Accumulate::kOverwrite || kMode == Accumulate::kScores)
        x = _mm512_mul_ps(x, _mm512_set1_ps(out_scale));
      if (kMode == Accumulate::kScores) x = (__m512)PoisonInfinite((VecF)x);
      _mm512_storeu_ps(c + r * ldc + v * kLanes, x);
    }
  }
}

// C[m][n] (+)= out_scale · Σ_{k < 2·pairs} A[m][k] · B(k, n) for m < M, n < N (layouts
// above; out_scale only with kOverwrite and kScores). M must be a multiple of kGemmRows, N of 16;
// A's and B's elements past the real reduction length must be zero (finite) pairs.
template <Accumulate kMode>
JAX_FLASH_INLINE void GemmBF16(int64_t m_dim, int64_t n_dim, int64_t pairs, const uint16_t* a, int64_t lda,
                               const uint16_t* b, int64_t ldb, float* c, int64_t ldc, const float* row_scale = nullptr,
                               float out_scale = 1.0f) {
  auto scale_of = [&](int64_t m) { return row_scale == nullptr ? nullptr : row_scale + m; };
  int64_t n = 0;
  for (; n + kGemmVecsBF16 * kLanes <= n_dim; n += kGemmVecsBF16 * kLanes)
    for (int64_t m = 0; m < m_dim; m += kGemmRows)
      GemmMicroTileBF16<kMode, kGemmVecsBF16>(pairs, a + m * lda, lda, b + 2 * n, ldb, c + m * ldc + n, ldc,
                                              scale_of(m), out_scale);
  for (; n + 2 * kLanes <= n_dim; n += 2 * kLanes)
    for (int64_t m = 0; m < m_dim; m += kGemmRows)
      GemmMicroTileBF16<kMode, 2>(pairs, a + m * lda, lda, b + 2 * n, ldb, c + m * ldc + n, ldc, scale_of(m),
                                  out_scale);
  for (; n < n_dim; n += kLanes)
    for (int64_t m = 0; m < m_dim; m += kGemmRows)
      GemmMicroTileBF16<kMode, 1>(pairs, a + m * lda, lda, b + 2 * n, ldb, c + m * ldc + n, ldc, scale_of(m),
                                  out_scale);
}

// 16 floats -> 16 bf16, round to nearest even.
JAX_FLASH_INLINE __m256i RoundToBF16(const float* x) { return (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x)); }

// dst[i][j] = bf16(src[i][j]) for i < rows, j < cols (cols a multiple of 16).
JAX_FLASH_INLINE void RoundRowsToBF16(const float* src, int64_t ld_src, int64_t rows, int64_t cols, uint16_t* dst,
                                      int64_t ld_dst) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; j += kLanes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i * ld_dst + j), RoundToBF16(src + i * ld_src + j));
}

// Interleaves two rows of 16 bf16 (x0..x15, y0..y15) into pairs (x0 y0 x1 y1 ...).
JAX_FLASH_INLINE __m512i InterleavePairs(__m256i x, __m256i y) {
  const __m512i index = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                         5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  return _mm512_permutex2var_epi16(_mm512_castsi256_si512(x), index, _mm512_castsi256_si512(y));
}

// dst = src [rows][cols] f32 rounded to bf16 in pair layout over rows:
// dst[(i/2)·2·ld_dst + 2j + i%2] = bf16(src[i][j]); rows in [rows, rows rounded up to
// 2) are zero. cols a multiple of 16.
JAX_FLASH_INLINE void RoundRowsToPairs(const float* src, int64_t ld_src, int64_t rows, int64_t cols, uint16_t* dst,
                                       int64_t ld_dst) {
  for (int64_t i = 0; i < rows; i += 2) {
    uint16_t* out = dst + i * ld_dst;  // (i/2)·2·ld_dst
    for (int64_t j = 0; j < cols; j += kLanes) {
      const __m256i x = RoundToBF16(src + i * ld_src + j);
      const __m256i y = i + 1 < rows ? RoundToBF16(src + (i + 1) * ld_src + j) : _mm256_setzero_si256();
      _mm512_storeu_si512(out + 2 * j, InterleavePairs(x, y));
    }
  }
}

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
