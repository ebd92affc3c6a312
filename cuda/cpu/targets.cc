// Exposes the host handlers as PyCapsules for jax.ffi.register_ffi_target(..., platform="cpu").
#include <nanobind/nanobind.h>

#include <type_traits>

#include "cpu/handlers.h"
#include "ffi/targets.h"

namespace nb = nanobind;

namespace jax_flash {
namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

void AddCpuTargets(nb::dict& targets) {
  targets["jax_flash_fwd"] = Capsule(cpu::JaxFlashCpuForward);
  targets["jax_flash_bwd"] = Capsule(cpu::JaxFlashCpuBackward);
}

}  // namespace jax_flash
