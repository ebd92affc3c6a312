// The emulated targets' capsules (emu/targets_fwd.cc, emu/targets_bwd.cc export the handlers).
#include <nanobind/nanobind.h>

#include "emu/module.h"
#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* JaxFlashForwardEmulated(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxFlashPagedForwardEmulated(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxFlashBackwardEmulated(XLA_FFI_CallFrame* call_frame);

namespace jax_flash {

void AddEmulatedTargets(nanobind::dict& targets) {
  targets["jax_flash_emu_fwd"] = nanobind::capsule(reinterpret_cast<void*>(&JaxFlashForwardEmulated));
  targets["jax_flash_emu_bwd"] = nanobind::capsule(reinterpret_cast<void*>(&JaxFlashBackwardEmulated));
  targets["jax_flash_emu_paged_fwd"] = nanobind::capsule(reinterpret_cast<void*>(&JaxFlashPagedForwardEmulated));
}

}  // namespace jax_flash
