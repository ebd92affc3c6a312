// Platform "cpu" targets jax_flash_emu_fwd / jax_flash_emu_bwd: the CUDA kernels of
// cuda/kernels/, this very source, compiled for the host with JAX_FLASH_EMULATE (set for this
// file only, in CMakeLists.txt) and run on the emulation of the SIMT model and of each PTX
// instruction (emu/simt.h, emu/ptx_emu.h). Slow, strict, and GPU-free: it is how the kernels
// are tested on machines without one.
#ifndef JAX_FLASH_EMULATE
#error "emu/targets.cc must be compiled with -DJAX_FLASH_EMULATE"
#endif

#include <nanobind/nanobind.h>

#include "emu/module.h"
#include "kernels/ffi_attention.h"  // first: it includes the XLA headers before emu/simt.h

#include "kernels/bwd.h"
#include "kernels/fwd.h"

#include "emu/kernel_arguments.h"  // before the launches are instantiated: tags their pointers

namespace jax_flash {
namespace kernels {
namespace {

// Every operand and result of the call, declared to the emulation as the only global memory
// its kernels may touch (operands read-only, results writable): each access of the kernels
// outside them, or a write into an operand, is an error (emu::GlobalBufferScope).
void Declare(std::vector<emu::GlobalBuffer>& out, const ffi::AnyBuffer& b) {
  out.push_back({b.untyped_data(), b.size_bytes(), "operand " + std::to_string(out.size()) + " " + Describe(b), false});
}
void Declare(std::vector<emu::GlobalBuffer>& out, ffi::Result<ffi::AnyBuffer> b) {
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

// The handlers: every buffer of the call declared, then the boundary's decoding (ffi/boundary.h)
// and the shared handler bodies (kernels/ffi_attention.h), on the host "stream" (null).
constexpr auto kForward = [](auto... args) {
  emu::GlobalBufferScope scope(BuffersOf(args...));
  return boundary::ForwardHandler<0>([](const boundary::ForwardCall& call, auto... own) {
    return Forward("jax_flash_emu_fwd", nullptr, call, own...);
  })(args...);
};
constexpr auto kPagedForward = [](auto... args) {
  emu::GlobalBufferScope scope(BuffersOf(args...));
  return boundary::ForwardHandler<1>([](ffi::AnyBuffer page_table, boundary::ForwardCall call, auto... own) {
    call.page_table = &page_table;
    return Forward("jax_flash_emu_paged_fwd", nullptr, call, own...);
  })(args...);
};
constexpr auto kBackward = [](auto... args) {
  emu::GlobalBufferScope scope(BuffersOf(args...));
  return boundary::BackwardHandler<0>([](const boundary::BackwardCall& call, auto... own) {
    return Backward("jax_flash_emu_bwd", nullptr, call, own...);
  })(args...);
};

}  // namespace
}  // namespace kernels
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashForwardEmulated, jax_flash::kernels::kForward,
                              jax_flash::kernels::ForwardSignature(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashPagedForwardEmulated, jax_flash::kernels::kPagedForward,
                              jax_flash::kernels::PagedForwardSignature(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBackwardEmulated, jax_flash::kernels::kBackward,
                              jax_flash::kernels::BackwardSignature(xla::ffi::Ffi::Bind()));

namespace jax_flash {

void AddEmulatedTargets(nanobind::dict& targets) {
  targets["jax_flash_emu_fwd"] = nanobind::capsule(reinterpret_cast<void*>(&JaxFlashForwardEmulated));
  targets["jax_flash_emu_bwd"] = nanobind::capsule(reinterpret_cast<void*>(&JaxFlashBackwardEmulated));
  targets["jax_flash_emu_paged_fwd"] = nanobind::capsule(reinterpret_cast<void*>(&JaxFlashPagedForwardEmulated));
}

}  // namespace jax_flash
