// The soft cap (logits -> softcap · tanh(logits / softcap)) as every implementation takes it: the
// attribute's rule, +0 (off) or a positive finite float32 normal, checked by the one validator of
// the FFI boundary (ffi/boundary.h) for the cpu, CUDA and emulated targets alike, and printed.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

namespace jax_flash {

// softcap is +0 (off) or a positive finite float32 normal. Read from the bits: XLA's threads
// treat subnormals as zero (DAZ), so a comparison would take 1e-40 for "off".
inline bool SoftcapIsOffOrNormal(float softcap) {
  uint32_t bits;
  std::memcpy(&bits, &softcap, sizeof bits);
  const uint32_t exponent = (bits >> 23) & 0xffu;
  return bits == 0 || (bits >> 31 == 0 && exponent != 0 && exponent != 0xffu);
}

// The soft cap as it reads back (%.9g), also a subnormal one (std::to_string printed
// 0.000000). Widened from the bits: under DAZ the float-to-double conversion reads 0 too.
inline std::string SoftcapString(float softcap) {
  uint32_t bits;
  std::memcpy(&bits, &softcap, sizeof bits);
  const uint32_t exponent = (bits >> 23) & 0xffu, mantissa = bits & 0x7fffffu;
  const char* sign = bits >> 31 ? "-" : "";
  if (exponent == 0xffu) return mantissa ? std::string("nan") : std::string(sign) + "inf";
  const double magnitude = exponent ? std::ldexp(static_cast<double>(mantissa | 0x800000u), int(exponent) - 150)
                                    : std::ldexp(static_cast<double>(mantissa), -149);
  char text[40];
  std::snprintf(text, sizeof text, "%s%.9g", sign, magnitude);
  return text;
}

}  // namespace jax_flash
