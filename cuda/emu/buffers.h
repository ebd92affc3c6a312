// The global memory an emulated FFI call may touch: every operand and result of the call,
// declared to the emulation (operands read-only, results writable), so that each access of the
// kernels outside them, or a write into an operand, is an error (emu::GlobalBufferScope). Shared
// by the emulated targets (emu/targets_fwd.cc, emu/targets_bwd.cc).
#pragma once

#include <string>
#include <vector>

#include "kernels/ffi_attention.h"  // first: it includes the XLA headers before emu/simt.h

#include "emu/simt.h"

namespace jax_flash {
namespace kernels {

inline void Declare(std::vector<emu::GlobalBuffer>& out, const ffi::AnyBuffer& b) {
  out.push_back({b.untyped_data(), b.size_bytes(), "operand " + std::to_string(out.size()) + " " + Describe(b), false});
}
inline void Declare(std::vector<emu::GlobalBuffer>& out, ffi::Result<ffi::AnyBuffer> b) {
  out.push_back(
      {b->untyped_data(), b->size_bytes(), "result " + std::to_string(out.size()) + " " + Describe(*b), true});
}
template <class T>
void Declare(std::vector<emu::GlobalBuffer>&, const T&) {}  // attributes

template <class... Args>
std::vector<emu::GlobalBuffer> BuffersOf(Args... args) {
  std::vector<emu::GlobalBuffer> buffers;
  (Declare(buffers, args), ...);
  return buffers;
}

}  // namespace kernels
}  // namespace jax_flash
