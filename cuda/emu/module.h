// The emulated FFI targets (emu/targets.cc: their capsules), for the module of the emulator (emu/module.cc).
#pragma once
#include <nanobind/nanobind.h>

namespace jax_flash {
// Platform "cpu": jax_flash_emu_fwd, jax_flash_emu_bwd, jax_flash_emu_paged_fwd.
void AddEmulatedTargets(nanobind::dict& targets);
}  // namespace jax_flash
