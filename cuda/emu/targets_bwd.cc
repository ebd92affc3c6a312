// Platform "cpu" target jax_flash_emu_bwd: the CUDA backward kernels of cuda/kernels/bwd.h
// compiled for the host against the emulation, as emu/targets_fwd.cc does for the forward.
#ifndef JAX_FLASH_EMULATE
#error "emu/targets_bwd.cc must be compiled with -DJAX_FLASH_EMULATE"
#endif

#include "kernels/ffi_attention.h"  // first: it includes the XLA headers before emu/simt.h

#include "kernels/bwd.h"

#include "emu/buffers.h"
#include "emu/kernel_arguments.h"  // before the launches are instantiated: tags their pointers

namespace jax_flash {
namespace kernels {
namespace {

// The handlers: every buffer of the call declared (emu/buffers.h), then the boundary's decoding
// (ffi/boundary.h) and the shared handler bodies (kernels/ffi_attention.h), on the host "stream" (null).
constexpr auto kBackward = [](auto... args) {
  emu::GlobalBufferScope scope(BuffersOf(args...));
  return boundary::BackwardHandler<0>([](const boundary::BackwardCall& call, auto... own) {
    return Backward("jax_flash_emu_bwd", nullptr, call, own...);
  })(args...);
};

}  // namespace
}  // namespace kernels
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBackwardEmulated, jax_flash::kernels::kBackward,
                              jax_flash::kernels::BackwardSignature(xla::ffi::Ffi::Bind()));
