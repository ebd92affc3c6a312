// Attention dropout in the CUDA kernels: the keep bits of an mma accumulator fragment, drawn
// from the one generator all implementations share (common/dropout.h).
#pragma once

#include "common/dropout.h"

#if defined(__CUDACC__) || defined(JAX_FLASH_EMULATE)
// ---- the CUDA kernels: dropout of an mma accumulator fragment --------------------------------
#include "kernels/tile.h"

namespace jax_flash {
namespace kernels {

// The accumulator element (j, i) of a 16 x (8·N) fragment sits at row row0 + lane/4 + 8·(i/2)
// and column col0 + 8j + 2·(lane%4) + i%2 (mask.h). Rows are queries and columns keys
// (TRANSPOSED = false: the forward, the dQ kernel), or rows keys and columns queries (the
// backward's Sᵀ). The keep bits of the thread's 4·N elements, bit 4j + i, are drawn once
// per tile by a loop that is not unrolled (one copy of Philox, few live registers) and then
// applied with selects (`drop_fragment`).
//  - not transposed: the element pair (i%2 = 0, 1) holds two adjacent keys 4q + {0,1} or
//    4q + {2,3} of one query: one Philox call serves both (the other two words belong to
//    the quad's neighbouring lane).
//  - transposed: the pair holds two queries of one key: one call per element.
template <bool TRANSPOSED, int N_BLOCKS>
__device__ __forceinline__ uint64_t keep_bits_of_fragment(const dropout::Setting& d, int b, int n, int row0, int col0,
                                                          int lane) {
  static_assert(4 * N_BLOCKS <= 64, "one bit per accumulator element in a 64-bit word");
  uint64_t bits = 0;
#pragma unroll 1
  for (int pair = 0; pair < 2 * N_BLOCKS; ++pair) {  // pair = 2j + r: elements (j, 2r), (j, 2r + 1)
    const int j = pair >> 1, r = pair & 1;
    const int row = row0 + (lane >> 2) + 8 * r;
    const int col = col0 + 8 * j + 2 * (lane & 3);  // even: the pair col, col + 1
    unsigned two;
    if (TRANSPOSED) {
      two = static_cast<unsigned>(dropout::IsKept(d, b, n, col, row)) |
            (static_cast<unsigned>(dropout::IsKept(d, b, n, col + 1, row)) << 1);
    } else {
      two = (dropout::KeepBitsOfGroup(d, b, n, row, static_cast<uint32_t>(col) >> 2) >> (col & 3)) & 3u;
    }
    bits |= static_cast<uint64_t>(two) << (2 * pair);
  }
  return bits;
}

// Kept elements (bit 4j + i of `bits`) times `factor`, dropped ones 0.
template <int N_BLOCKS>
__device__ __forceinline__ void drop_fragment(float (&acc)[N_BLOCKS][4], uint64_t bits, float factor) {
  JAX_FLASH_UNROLL
  for (int j = 0; j < N_BLOCKS; ++j) {
    JAX_FLASH_UNROLL
    for (int i = 0; i < 4; ++i) acc[j][i] = (bits >> (4 * j + i)) & 1u ? acc[j][i] * factor : 0.0f;
  }
}

// o *= factor (the forward's 1 / (1 − rate) of the kept weights, after 1 / l).
template <int O_BLOCKS>
__device__ __forceinline__ void scale_fragment(float (&o)[O_BLOCKS][4], float factor) {
  JAX_FLASH_UNROLL
  for (int j = 0; j < O_BLOCKS; ++j) {
    JAX_FLASH_UNROLL
    for (int i = 0; i < 4; ++i) o[j][i] *= factor;
  }
}

}  // namespace kernels
}  // namespace jax_flash
#endif
