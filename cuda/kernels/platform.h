// What the kernels need from the platform, in one place: the CUDA runtime when compiled by
// nvcc, or the host emulation of the SIMT model when JAX_FLASH_EMULATE is defined (the same
// kernel source then runs on the CPU, see cuda/emu/). Also the one way kernels are launched
// and buffers zeroed, so the host code above the kernels is the same on both platforms.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#ifdef JAX_FLASH_EMULATE
#include "emu/simt.h"
#else
#include <cuda_runtime.h>
// Kernels use dynamic shared memory only (the emulation poisons it at block start).
#define JAX_FLASH_DYNAMIC_SMEM(name) extern __shared__ __align__(128) char name[]
#endif

namespace jax_flash {
namespace kernels {

#ifdef JAX_FLASH_EMULATE
using Stream = void*;  // the emulation runs every launch to completion on the calling thread
#else
using Stream = cudaStream_t;
#endif

// Empty on success, else what went wrong (the FFI handlers turn it into ffi::Error).
using LaunchError = std::string;

#ifdef JAX_FLASH_EMULATE
// Each kernel argument on its way into an emulated launch; AttentionParams overloads it to tag
// its global pointers (emu/kernel_arguments.h).
template <class T>
T EmuArgument(T x) {
  return x;
}
#endif

// Launches kernel<<<grid, block, smem_bytes, stream>>>(args...); `name` names the kernel in the
// emulation's error reports. Kernels that use more than the default 48 KB of dynamic shared
// memory opt in first (sm_80+: up to 99 KB on sm_120).
template <class... Params, class... Args>
LaunchError Launch(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, Stream stream,
                   Args... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return {};
#ifdef JAX_FLASH_EMULATE
  (void)stream;
  emu::LaunchOptions options = emu::LaunchOptions::FromEnvironment();
  options.kernel = name;
  emu::Status st =
      emu::launch_with(options, grid, block, smem_bytes, kernel, EmuArgument(static_cast<Params>(args))...);
  return st.error;
#else
  (void)name;
  if (smem_bytes > 48 * 1024) {
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
    if (err != cudaSuccess) return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(err);
  }
  // clang-format would split the launch's >>> into > > >.
  // clang-format off
  kernel<<<grid, block, smem_bytes, stream>>>(static_cast<Params>(args)...);
  // clang-format on
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return std::string("kernel launch: ") + cudaGetErrorString(err);
  return {};
#endif
}
template <class... Params, class... Args>
LaunchError Launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, Stream stream, Args... args) {
  return Launch("kernel", kernel, grid, block, smem_bytes, stream, args...);
}

// Fills `bytes` bytes at device address `ptr` with `byte`, ordered on `stream` (no host sync).
inline LaunchError FillAsync(void* ptr, int byte, size_t bytes, Stream stream) {
  if (bytes == 0) return {};
#ifdef JAX_FLASH_EMULATE
  (void)stream;
  std::memset(ptr, byte, bytes);
  return {};
#else
  cudaError_t err = cudaMemsetAsync(ptr, byte, bytes, stream);
  if (err != cudaSuccess) return std::string("cudaMemsetAsync: ") + cudaGetErrorString(err);
  return {};
#endif
}

}  // namespace kernels
}  // namespace jax_flash
