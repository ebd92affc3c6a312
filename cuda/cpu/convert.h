// Conversions between the operands' element types and the float32 the tiles compute
// in. 16-bit inputs are widened exactly; float32 results are narrowed with
// round-to-nearest-even, as XLA's own converts do.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/problem.h"

namespace jax_flash {
namespace cpu {

inline uint32_t BitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float FloatOf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// bfloat16 is the upper half of a float32.
inline float BF16ToFloat(uint16_t h) { return FloatOf(uint32_t{h} << 16); }

inline uint16_t FloatToBF16(float f) {
  uint32_t u = BitsOf(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(u >> 16);
}

// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
inline float F16ToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t magnitude = h & 0x7fffu;
  if (magnitude >= 0x7c00u) return FloatOf(sign | 0x7f800000u | ((magnitude & 0x3ffu) << 13));
  if (magnitude >= 0x0400u) return FloatOf(sign | ((magnitude << 13) + ((127u - 15u) << 23)));
  // Subnormal (or zero): magnitude * 2^-24 is exact in float32.
  return FloatOf(sign | BitsOf(static_cast<float>(magnitude) * 5.9604644775390625e-8f));
}

inline uint16_t FloatToF16(float f) {
  uint32_t u = BitsOf(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (u >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504: inf
  if (u < 0x38800000u) {
    // Below the smallest normal half (2^-14): adding 0.5 puts the half subnormal's
    // unit (2^-24) at the float's last mantissa bit, so the float adder rounds to
    // nearest even for us.
    const float shifted = FloatOf(u) + 0.5f;
    return static_cast<uint16_t>(sign | (BitsOf(shifted) - 0x3f000000u));
  }
  const uint32_t odd = (u >> 13) & 1u;
  u += ((15u - 127u) << 23) + 0xfffu + odd;  // rebias the exponent, round to nearest even
  return static_cast<uint16_t>(sign | (u >> 13));
}

// Widens n elements of `src` (element type `type`, starting at element `offset`) to float.
inline void LoadRow(const void* src, ElementType type, int64_t offset, int64_t n, float* dst) {
  switch (type) {
    case ElementType::kF32: std::memcpy(dst, static_cast<const float*>(src) + offset, n * sizeof(float)); return;
    case ElementType::kBF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = BF16ToFloat(s[i]);
      return;
    }
    case ElementType::kF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
      for (int64_t i = 0; i < n; ++i) dst[i] = F16ToFloat(s[i]);
      return;
    }
  }
}

// Widens keys [s0, s0 + n) of row t of a dense bias to float, zeros in [n, n_padded).
inline void LoadBiasRow(const DenseRows& bias, int64_t t, int64_t s0, int64_t n, int64_t n_padded, float* dst) {
  const int64_t first = bias.at(t, s0);
  if (bias.stride_s == 1) {
    LoadRow(bias.data, bias.dtype, first, n, dst);
  } else {  // one value for the whole row (stride 0)
    float value;
    LoadRow(bias.data, bias.dtype, first, 1, &value);
    for (int64_t j = 0; j < n; ++j) dst[j] = value;
  }
  for (int64_t j = n; j < n_padded; ++j) dst[j] = 0.0f;
}

// Keys [s0, s0 + n) of row t of a dense mask as lane masks (-1: may attend, 0: masked),
// 0 in [n, n_padded).
inline void LoadMaskRow(const DenseRows& mask, int64_t t, int64_t s0, int64_t n, int64_t n_padded, int32_t* dst) {
  const uint8_t* row = static_cast<const uint8_t*>(mask.data) + mask.at(t, s0);
  for (int64_t j = 0; j < n; ++j) dst[j] = row[j * mask.stride_s] != 0 ? -1 : 0;
  for (int64_t j = n; j < n_padded; ++j) dst[j] = 0;
}

// Narrows n floats, each multiplied by `factor`, into `dst` at element `offset`.
inline void StoreRow(const float* src, float factor, ElementType type, int64_t offset, int64_t n, void* dst) {
  switch (type) {
    case ElementType::kF32: {
      float* d = static_cast<float*>(dst) + offset;
      for (int64_t i = 0; i < n; ++i) d[i] = src[i] * factor;
      return;
    }
    case ElementType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(dst) + offset;
      for (int64_t i = 0; i < n; ++i) d[i] = FloatToBF16(src[i] * factor);
      return;
    }
    case ElementType::kF16: {
      uint16_t* d = static_cast<uint16_t*>(dst) + offset;
      for (int64_t i = 0; i < n; ++i) d[i] = FloatToF16(src[i] * factor);
      return;
    }
  }
}

// Writes n zeros of element type `type` at element `offset`.
inline void StoreZeros(ElementType type, int64_t offset, int64_t n, void* dst) {
  const int64_t width = type == ElementType::kF32 ? 4 : 2;
  std::memset(static_cast<char*>(dst) + offset * width, 0, n * width);
}

// Writes n NaNs of element type `type` at element `offset` (all-ones bytes are a NaN in
// f32, bf16 and f16 alike).
inline void StoreNaNs(ElementType type, int64_t offset, int64_t n, void* dst) {
  const int64_t width = type == ElementType::kF32 ? 4 : 2;
  std::memset(static_cast<char*>(dst) + offset * width, 0xff, n * width);
}

}  // namespace cpu
}  // namespace jax_flash
