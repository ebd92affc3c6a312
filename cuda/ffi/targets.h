// Each part of the extension adds its FFI handler capsules to a dict keyed by target name.
#pragma once
#include <nanobind/nanobind.h>

namespace jax_flash {
// Platform "cpu": the host implementation (cpu/).
void AddCpuTargets(nanobind::dict& targets);
// The host implementation's introspection functions (cpu_isa, cpu_gradient_chunks, ...).
void AddCpuFunctions(nanobind::module_& m);
#ifdef JAX_FLASH_WITH_CUDA
// Platform "CUDA": the mma.sync kernels (kernels/). Plain C++ so nvcc-free code can call it.
void AddCudaTargets(nanobind::dict& targets);
// CUDART_VERSION of the runtime the kernels are linked against (13000 for 13.0).
int CudaRuntimeVersion();
// The installed driver's CUDA version (cudaDriverGetVersion: 12080 for 12.8; 0 without a driver).
int CudaDriverVersion();
#endif
}  // namespace jax_flash
