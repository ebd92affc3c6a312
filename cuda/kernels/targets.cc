// Platform "CUDA" registrations: capsules around the handlers exported by kernels/handlers.cu.
// A host file so that nanobind is compiled by the host compiler only.
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>

#include "ffi/targets.h"
#include "xla/ffi/api/c_api.h"

extern "C" XLA_FFI_Error* JaxFlashForwardCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxFlashPagedForwardCuda(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxFlashBackwardCuda(XLA_FFI_CallFrame* call_frame);

namespace jax_flash {

void AddCudaTargets(nanobind::dict& targets) {
  targets["jax_flash_fwd"] = nanobind::capsule(reinterpret_cast<void*>(&JaxFlashForwardCuda));
  targets["jax_flash_bwd"] = nanobind::capsule(reinterpret_cast<void*>(&JaxFlashBackwardCuda));
  targets["jax_flash_paged_fwd"] = nanobind::capsule(reinterpret_cast<void*>(&JaxFlashPagedForwardCuda));
}

int CudaRuntimeVersion() { return CUDART_VERSION; }

int CudaDriverVersion() {
  // The driver's own version: it answers without a GPU and whatever the driver's age (an older
  // driver than the runtime's fails every other call with cudaErrorInsufficientDriver).
  int version = 0;
  if (cudaDriverGetVersion(&version) != cudaSuccess) return 0;
  return version;
}

}  // namespace jax_flash
