// Attention dropout's keep bits: the one counter-based generator of jax_flash/_dropout.py
// (its docstring is the specification), bit for bit. Plain C++ usable by the CUDA kernels
// (host and device), their host emulation and the CPU kernels (cuda/cpu/), so every
// implementation draws the same mask from the same key.
//
//   counter of element (b, n, t, s) = (s >> 2, t, n, b), key = the dropout_rng key's two
//   uint32 words; Philox-4x32-10 of it gives the words of columns 4·(s >> 2) + 0..3;
//   element kept iff its word >= threshold = floor(rate · 2^32).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JAX_FLASH_DROPOUT_FN __host__ __device__ __forceinline__
#else
#define JAX_FLASH_DROPOUT_FN inline
#endif

namespace jax_flash {
namespace dropout {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;
constexpr int kColumnsPerCall = 4;

// What a kernel needs: the key and the threshold (rate 0 = off: every kernel then skips
// dropout, which makes rate 0 exactly the call without dropout).
struct Setting {
  uint32_t key0 = 0;
  uint32_t key1 = 0;
  uint32_t threshold = 0;  // floor(rate · 2^32)
  float keep_scale = 1.0f;  // 1 / (1 − rate)
  bool on = false;
};

// The setting for a float32 rate in [0, 1) and the key's words.
JAX_FLASH_DROPOUT_FN Setting MakeSetting(float rate, uint32_t key0, uint32_t key1) {
  Setting d;
  d.key0 = key0;
  d.key1 = key1;
  // rate · 2^32 is exact in double (a float scaled by a power of two); truncation = floor.
  d.threshold = static_cast<uint32_t>(static_cast<double>(rate) * 4294967296.0);
  d.keep_scale = 1.0f / (1.0f - rate);
  d.on = rate > 0.0f;
  return d;
}

struct Words {
  uint32_t w[4];
};

// The high and low words of the 64-bit product a · b.
JAX_FLASH_DROPOUT_FN void MultiplyWide(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t product = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(product >> 32);
  *lo = static_cast<uint32_t>(product);
}

// Philox-4x32-10 of counter (c0, c1, c2, c3) under key (k0, k1).
JAX_FLASH_DROPOUT_FN Words Philox(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  for (int r = 0; r < kPhiloxRounds; ++r) {
    if (r > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    MultiplyWide(kPhiloxM0, c0, &hi0, &lo0);
    MultiplyWide(kPhiloxM1, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return {{c0, c1, c2, c3}};
}

// The four keep bits (bit i: column 4·group + i) of row t of head n of batch row b.
JAX_FLASH_DROPOUT_FN unsigned KeepBitsOfGroup(const Setting& d, uint32_t b, uint32_t n, uint32_t t, uint32_t group) {
  const Words x = Philox(group, t, n, b, d.key0, d.key1);
  unsigned bits = 0;
  for (int i = 0; i < kColumnsPerCall; ++i) bits |= (x.w[i] >= d.threshold ? 1u : 0u) << i;
  return bits;
}

// Whether element (b, n, t, s) is kept.
JAX_FLASH_DROPOUT_FN bool IsKept(const Setting& d, uint32_t b, uint32_t n, uint32_t t, uint32_t s) {
  return (KeepBitsOfGroup(d, b, n, t, s >> 2) >> (s & 3u)) & 1u;
}

}  // namespace dropout
}  // namespace jax_flash

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
__device__ __forceinline__ uint64_t keep_bits_of_fragment(const dropout::Setting& d, int b, int n, int row0,
                                                          int col0, int lane) {
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
