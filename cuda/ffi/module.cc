// The nanobind module jax_flash._jax_flash_ext: exposes every FFI handler as a PyCapsule for
// jax.ffi.register_ffi_target. Handlers live beside their implementations. The emulation of
// the CUDA kernels is a module of its own (emu/module.cc), built for tests only.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "cpu/kernel_table.h"

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
  m.def(
      "build_info",
      []() {
        nb::dict info;
#ifdef JAX_FLASH_WITH_CUDA
        info["cuda_runtime_version"] = jax_flash::CudaRuntimeVersion();
        info["cuda_architectures"] = std::string(JAX_FLASH_CUDA_ARCHS_TEXT);
#else
        info["cuda_runtime_version"] = 0;
        info["cuda_architectures"] = std::string();
#endif
        info["cuda_selection"] = std::string(JAX_FLASH_CUDA_REASON_TEXT);
        info["cpu_isas"] = jax_flash::cpu::CompiledIsas();
#if defined(__clang__)
        info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
        info["compiler"] = std::string("gcc ") + __VERSION__;
#else
        info["compiler"] = std::string("unknown");
#endif
        return info;
      },
      "How this module was built: cuda_runtime_version (CUDART_VERSION of the static runtime the "
      "kernels link, 0 without them), cuda_architectures, cuda_selection (why those), cpu_isas "
      "(the ISAs with cpu kernels), compiler.");
  m.def(
      "cuda_driver_version",
      []() {
#ifdef JAX_FLASH_WITH_CUDA
        return jax_flash::CudaDriverVersion();
#else
        return 0;
#endif
      },
      "The installed driver's CUDA version (12080 for 12.8), 0 without a driver or without CUDA kernels.");
}
