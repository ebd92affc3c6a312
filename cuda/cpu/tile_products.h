// The matrix products of one attention tile, in one of two operand formats; the
// forward and backward tiles are written once against this interface:
//   F32Products   operands widened to float32 when packed (tile_pack.h), FMA products
//                 (tile_gemm.h); scale·Q is packed, so S = (scale·Q)·Kᵀ and dK = dSᵀ(scale·Q).
//   BF16Products  bf16 operands packed bit for bit (tile_pack_bf16.h), vdpbf16ps or AMX
//                 products with float32 accumulation (tile_gemm_bf16.h, tile_gemm_amx.h); Q is packed as it is and
//                 scale applied in float32: S = scale·(Q·Kᵀ), dK = scale·(dSᵀ·Q). P and dS
//                 are rounded to bf16 (nearest even) for the products they feed, as the
//                 GPU kernels do; accumulators and the softmax statistics stay float32.
// Score tiles are [kBlockQ][kBlockK] float32 in both; the key-block gradient
// accumulators are [keys][RowStride] (F32) or transposed [Hp][kKeyStride] (BF16).
#pragma once

#include "cpu/problem.h"
#include "cpu/tile_gemm.h"
#include "cpu/tile_pack.h"
#include "cpu/tiling.h"
#include "cpu/vec.h"
#if defined(JAX_FLASH_CPU_BF16_PRODUCTS)
#include "cpu/tile_gemm_bf16.h"
#include "cpu/tile_pack_bf16.h"
#endif
#if defined(JAX_FLASH_CPU_AMX_TILES)
#include "cpu/tile_gemm_amx.h"
#endif

namespace jax_flash {
namespace cpu {
namespace JAX_FLASH_CPU_ISA {

// Floats of per-worker scratch the products need beyond the score tiles.
constexpr int64_t kProductScratchFloats = 3 * kBlockQ * kBlockK / 2;

// Floats of one key-block gradient accumulator (dK or dV), either format.
inline int64_t KeyGradientFloats(const Problem& p) {
  const int64_t rows = kBlockK * RowStride(p);
  const int64_t transposed = PaddedHeadDim(p) * kKeyStride;
  return rows > transposed ? rows : transposed;
}

struct F32Products {
  // The forward's query tile: scale·Q, rows padded to rows_padded.
  static void PackQuery(const Problem& p, const RowBlock& q, int64_t rows_padded, float* dst) {
    PackRows(q, p.scale, rows_padded, RowStride(p), dst);
  }
  // A streamed key block (Problem::stream_keys) in the layouts of PackKeyBlock: Kᵀ
  // [H][kKeyStride], and V rows [kBlockK][RowStride] with NaN/±inf as 0.
  static void PackKeys(const Problem& p, const RowBlock& k, float* row_buffer, float* k_t) {
    PackTransposed(k, kBlockK, kKeyStride, row_buffer, k_t);
  }
  static void PackValues(const Problem& p, const RowBlock& v, float* v_rows) {
    PackRows(v, 1.0f, kBlockK, RowStride(p), v_rows);
    ZeroNonFinite(v_rows, kBlockK * RowStride(p));
  }
  // s = logits before the bias and the soft cap: (scale·Q)·Kᵀ (over H), a ±inf product as NaN
  // (PoisonInfinite).  [rows_padded][cols_padded]
  static void Scores(const Problem& p, int64_t rows_padded, int64_t cols_padded, const float* q, const float* k_t,
                     float* s) {
    Gemm<false, Accumulate::kScores>(rows_padded, cols_padded, p.head_dim, q, RowStride(p), k_t, kKeyStride, s,
                                     kBlockK);
  }
  // dp = dO·Vᵀ (over Hv).
  static void ProbabilityGradient(const Problem& p, int64_t rows_padded, int64_t cols_padded, const float* dout,
                                  const float* v_t, float* dp) {
    Gemm<false, Accumulate::kOverwrite>(rows_padded, cols_padded, p.value_dim(), dout, RowStride(p), v_t, kKeyStride,
                                        dp, kBlockK);
  }
  // o = diag(correction)·o + P·V over the tile's `cols` keys.
  static void AccumulateValues(const Problem& p, int64_t rows_padded, int64_t cols, const float* probabilities,
                               float* scratch, const float* v, float* o, const float* correction) {
    const int64_t ld = RowStride(p);
    Gemm<false, Accumulate::kRescale>(rows_padded, PaddedValueDim(p), cols, probabilities, kBlockK, v, ld, o, ld,
                                      correction);
  }
  // dv += Pᵀ·dO, dk += dSᵀ·(scale·Q) over the tile's real `rows`.
  static void AccumulateKeyValueGradients(const Problem& p, int64_t rows, int64_t cols_padded,
                                          const float* probabilities, const float* ds, const float* q,
                                          const float* dout, float* scratch, float* dk, float* dv) {
    const int64_t ld = RowStride(p);
    Gemm<true, Accumulate::kAdd>(cols_padded, PaddedValueDim(p), rows, probabilities, kBlockK, dout, ld, dv, ld);
    Gemm<true, Accumulate::kAdd>(cols_padded, PaddedKeyDim(p), rows, ds, kBlockK, q, ld, dk, ld);
  }
  // dq += dS·K over the tile's `cols` keys (scale is applied when dQ is written).
  static void AccumulateQueryGradient(const Problem& p, int64_t rows_padded, int64_t cols, const float* ds,
                                      const float* k, float* scratch, float* dq) {
    const int64_t ld = RowStride(p);
    Gemm<false, Accumulate::kAdd>(rows_padded, PaddedKeyDim(p), cols, ds, kBlockK, k, ld, dq, ld);
  }
  // Element (key j, h) of a key-gradient accumulator.
  static int64_t KeyGradientIndex(const Problem& p, int64_t j, int64_t h) { return j * RowStride(p) + h; }
  // dK = factor · accumulator.
  static float KeyGradientFactor(const Problem& p) { return 1.0f; }
};

#if defined(JAX_FLASH_CPU_BF16_PRODUCTS)
// The bf16 tile product of this ISA: AMX tiles where the translation unit names them
// (tile_gemm_amx.h), vdpbf16ps otherwise; the same layouts and contract.
template <Accumulate kMode>
JAX_FLASH_INLINE void ProductBF16(int64_t m_dim, int64_t n_dim, int64_t pairs, const uint16_t* a, int64_t lda,
                                  const uint16_t* b, int64_t ldb, float* c, int64_t ldc,
                                  const float* row_scale = nullptr, float out_scale = 1.0f) {
#if defined(JAX_FLASH_CPU_AMX_TILES)
  GemmAMX<JAX_FLASH_CPU_AMX_TILES, kMode>(m_dim, n_dim, pairs, a, lda, b, ldb, c, ldc, row_scale, out_scale);
#else
  GemmBF16<kMode>(m_dim, n_dim, pairs, a, lda, b, ldb, c, ldc, row_scale, out_scale);
#endif
}

struct BF16Products {
  static void PackQuery(const Problem& p, const RowBlock& q, int64_t rows_padded, float* dst) {
    PackRowsBF16(q, RoundUp(rows_padded, 2), RowStride(p), AsBF16(dst));
  }
  // A streamed key block in the layouts of PackKeyBlockBF16.
  static void PackKeys(const Problem& p, const RowBlock& k, float* row_buffer, float* k_t) {
    PackPairsAlongRows(k, PaddedHeadDim(p), kKeyStride, AsBF16(k_t));
  }
  static void PackValues(const Problem& p, const RowBlock& v, float* v_rows) {
    PackPairsAcrossRows(v, kBlockK, RowStride(p), AsBF16(v_rows));
    ZeroNonFiniteBF16(AsBF16(v_rows), kBlockK * RowStride(p));
  }
  static void Scores(const Problem& p, int64_t rows_padded, int64_t cols_padded, const float* q, const float* k_t,
                     float* s) {
    ProductBF16<Accumulate::kScores>(rows_padded, cols_padded, PaddedKeyDim(p) / 2, AsBF16(q), RowStride(p),
                                     AsBF16(k_t), kKeyStride, s, kBlockK, nullptr, p.scale);
  }
  static void ProbabilityGradient(const Problem& p, int64_t rows_padded, int64_t cols_padded, const float* dout,
                                  const float* v_t, float* dp) {
    ProductBF16<Accumulate::kOverwrite>(rows_padded, cols_padded, PaddedValueDim(p) / 2, AsBF16(dout), RowStride(p),
                                        AsBF16(v_t), kKeyStride, dp, kBlockK);
  }
  static void AccumulateValues(const Problem& p, int64_t rows_padded, int64_t cols, const float* probabilities,
                               float* scratch, const float* v, float* o, const float* correction) {
    // P rounded to bf16 rows [rows_padded][kBlockK]; its padding columns are P = 0.
    const int64_t cols_even = RoundUp(cols, 2);
    uint16_t* p16 = AsBF16(scratch);
    RoundRowsToBF16(probabilities, kBlockK, rows_padded, RoundUp(cols, kLanes), p16, kBlockK);
    const int64_t ld = RowStride(p);
    ProductBF16<Accumulate::kRescale>(rows_padded, PaddedValueDim(p), cols_even / 2, p16, kBlockK, AsBF16(v), ld, o, ld,
                                      correction);
  }
  // Transposed accumulators: dvᵀ += dOᵀ·P, dkᵀ += Qᵀ·dS over the tile's real rows
  // (P and dS in pair layout over rows; the row past an odd count is zero).
  static void AccumulateKeyValueGradients(const Problem& p, int64_t rows, int64_t cols_padded,
                                          const float* probabilities, const float* ds, const float* q,
                                          const float* dout, float* scratch, float* dk, float* dv) {
    const int64_t offset = TransposedQueryOffset(p);
    uint16_t* pairs = AsBF16(scratch);
    RoundRowsToPairs(probabilities, kBlockK, rows, cols_padded, pairs, kBlockK);
    ProductBF16<Accumulate::kAdd>(PaddedValueDim(p), cols_padded, RoundUp(rows, 2) / 2, AsBF16(dout) + offset, kBlockQ,
                                  pairs, kBlockK, dv, kKeyStride);
    RoundRowsToPairs(ds, kBlockK, rows, cols_padded, pairs, kBlockK);
    ProductBF16<Accumulate::kAdd>(PaddedKeyDim(p), cols_padded, RoundUp(rows, 2) / 2, AsBF16(q) + offset, kBlockQ,
                                  pairs, kBlockK, dk, kKeyStride);
  }
  static void AccumulateQueryGradient(const Problem& p, int64_t rows_padded, int64_t cols, const float* ds,
                                      const float* k, float* scratch, float* dq) {
    uint16_t* ds16 = AsBF16(scratch);
    RoundRowsToBF16(ds, kBlockK, rows_padded, RoundUp(cols, kLanes), ds16, kBlockK);
    const int64_t ld = RowStride(p);
    ProductBF16<Accumulate::kAdd>(rows_padded, PaddedKeyDim(p), RoundUp(cols, 2) / 2, ds16, kBlockK, AsBF16(k), ld, dq,
                                  ld);
  }
  static int64_t KeyGradientIndex(const Problem& p, int64_t j, int64_t h) { return h * kKeyStride + j; }
  static float KeyGradientFactor(const Problem& p) { return p.scale; }
};
#endif

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
