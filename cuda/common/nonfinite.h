// The bit patterns of the NaN rules that host and device code share (docs/numerical-contract.md):
// what the handlers fill their results with when asked to poison them, and the -inf
// of each element type (a -inf bias element gives its pair weight 0 but is not a masked pair).
#pragma once

#include <cstdint>

namespace jax_flash {
namespace nonfinite {

// All-ones bytes are a NaN in f32, bf16 and f16 alike: the poison_outputs fill.
constexpr unsigned char kNanFillByte = 0xff;

// -inf in f32, bf16 and f16.
constexpr uint32_t kMinusInfF32 = 0xff800000u;
constexpr uint16_t kMinusInfBf16 = 0xff80u;
constexpr uint16_t kMinusInfF16 = 0xfc00u;

}  // namespace nonfinite
}  // namespace jax_flash
