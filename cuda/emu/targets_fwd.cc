// Platform "cpu" targets jax_flash_emu_fwd and jax_flash_emu_paged_fwd: the CUDA forward kernels
// of cuda/kernels/fwd.h, this very source, compiled for the host with JAX_FLASH_EMULATE (set for
// this file, in CMakeLists.txt) and run on the emulation of the SIMT model and of each PTX
// instruction (emu/simt.h, emu/ptx_emu.h). Slow, strict, and GPU-free: it is how the kernels are
// tested on machines without one. The backward is emu/targets_bwd.cc, a translation unit of its own
// (the two compile side by side, and a change to one pass's kernels rebuilds that pass only).
#ifndef JAX_FLASH_EMULATE
#error "emu/targets_fwd.cc must be compiled with -DJAX_FLASH_EMULATE"
#endif

#include "kernels/ffi_attention.h"  // first: it includes the XLA headers before emu/simt.h

#include "kernels/fwd.h"

#include "emu/buffers.h"
#include "emu/kernel_arguments.h"  // before the launches are instantiated: tags their pointers

namespace jax_flash {
namespace kernels {
namespace {

// The handlers: every buffer of the call declared (emu/buffers.h), then the boundary's decoding
// (ffi/boundary.h) and the shared handler bodies (kernels/ffi_attention.h), on the host "stream" (null).
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

}  // namespace
}  // namespace kernels
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashForwardEmulated, jax_flash::kernels::kForward,
                              jax_flash::kernels::ForwardSignature(xla::ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashPagedForwardEmulated, jax_flash::kernels::kPagedForward,
                              jax_flash::kernels::PagedForwardSignature(xla::ffi::Ffi::Bind()));
