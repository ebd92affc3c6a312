// The nanobind module jax_flash._jax_flash_ext: exposes every FFI handler as a PyCapsule for
// jax.ffi.register_ffi_target. Handlers live beside their implementations. The emulation of
// the CUDA kernels is a module of its own (emu/module.cc), built for tests only.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "ffi/targets.h"

namespace nb = nanobind;

NB_MODULE(_jax_flash_ext, m) {
  m.def(
      "registrations",
      []() {
        nb::dict cpu;
        jax_flash::AddCpuTargets(cpu);
        nb::dict cuda;
#ifdef JAX_FLASH_WITH_CUDA
        jax_flash::AddCudaTargets(cuda);
#endif
        nb::dict out;
        out["cpu"] = cpu;
        out["CUDA"] = cuda;
        return out;
      },
      "FFI handler capsules by platform: {'cpu': {name: capsule}, 'CUDA': {name: capsule}}.");
  jax_flash::AddCpuFunctions(m);
  m.def(
      "has_cuda",
      []() {
#ifdef JAX_FLASH_WITH_CUDA
        return true;
#else
        return false;
#endif
      },
      "Whether the CUDA kernels were compiled into this module.");
  m.def(
      "cuda_architectures",
      []() {
#ifdef JAX_FLASH_CUDA_ARCHS_TEXT
        return std::string(JAX_FLASH_CUDA_ARCHS_TEXT);
#else
        return std::string();
#endif
      },
      "The CUDA architectures of the kernels' images, comma-separated as CMake spells them "
      "(\"80-real,80-virtual,...\"); empty without CUDA kernels.");
}
