// Placeholder until the host implementation lands: registers nothing.
#include "ffi/targets.h"
namespace jax_flash {
void AddCpuTargets(nanobind::dict&) {}
}  // namespace jax_flash
