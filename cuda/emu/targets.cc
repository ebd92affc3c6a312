// Placeholder until the emulated kernels land: registers nothing.
#include "ffi/targets.h"
namespace jax_flash {
void AddEmulatedTargets(nanobind::dict&) {}
}  // namespace jax_flash
