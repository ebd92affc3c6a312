// Half-precision storage types for the host emulation: the subset of cuda_fp16.h / cuda_bf16.h
// the kernels may name (__half, __nv_bfloat16 and their scalar conversions), plus the bit-level
// conversions the emulated PTX uses. Conversions from float round to nearest even, like
// cvt.rn; a NaN becomes the canonical NaN 0x7fff (what cvt.rn.{f16,bf16}x2.f32 produces).
#pragma once

#include <cstdint>
#include <cstring>

namespace jax_flash {
namespace emu {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float -> bfloat16 bits, round to nearest even; NaN -> 0x7fff. Overflow rounds to +-inf.
inline uint16_t float_to_bf16_rn(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;  // ties to even: add half minus one, plus the kept lsb
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// float -> IEEE binary16 bits, round to nearest even (subnormal results kept); NaN -> 0x7fff.
inline uint16_t float_to_f16_rn(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fff;
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  int exp = static_cast<int>(a >> 23) - 127;
  uint32_t mant = (a & 0x7fffffu) | 0x800000u;  // 24 significant bits (implicit one)
  if (a < 0x00800000u) return sign;             // float subnormal: far below the f16 range
  int shift;                                    // bits to drop from the 24-bit significand
  uint32_t base;
  if (exp >= -14) {  // normal f16: keep 11 bits
    shift = 13;
    base = static_cast<uint32_t>(exp + 15) << 10;
    mant &= 0x7fffffu;  // the implicit one is carried by the exponent
  } else {              // subnormal f16: value = m * 2^-24
    shift = 13 + (-14 - exp);
    if (shift > 24) return sign;  // below half the smallest subnormal
    base = 0;
  }
  uint32_t kept = mant >> shift;
  uint32_t rem = mant & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (kept & 1u))) kept += 1;
  return static_cast<uint16_t>(sign | (base + kept));  // a mantissa carry bumps the exponent
}
inline float f16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return bits_float(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    float v = static_cast<float>(m) * (1.0f / 16777216.0f);  // m * 2^-24, exact
    return sign ? -v : v;
  }
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

}  // namespace emu
}  // namespace jax_flash

struct __half {
  uint16_t __x;
};
struct __nv_bfloat16 {
  uint16_t __x;
};
struct __half2 {
  __half x, y;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
using half = __half;
using half2 = __half2;

inline __half __float2half_rn(float f) { return __half{::jax_flash::emu::float_to_f16_rn(f)}; }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline float __half2float(__half h) { return ::jax_flash::emu::f16_to_float(h.__x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{::jax_flash::emu::float_to_bf16_rn(f)}; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return ::jax_flash::emu::bf16_to_float(h.__x); }
inline __half2 __floats2half2_rn(float lo, float hi) { return __half2{__float2half_rn(lo), __float2half_rn(hi)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return __nv_bfloat162{__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16{u}; }
