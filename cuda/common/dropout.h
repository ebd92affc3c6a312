// Attention dropout's keep bits: the one counter-based generator of jax_flash/_dropout.py
// (its docstring is the specification), bit for bit. Plain C++ shared by the CUDA kernels
// (host and device), their host emulation and the CPU kernels (cuda/cpu/), so every
// implementation draws the same mask from the same key. (The kernels' dropout of an mma
// fragment is kernels/dropout.h.)
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
