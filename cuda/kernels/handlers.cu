// Platform "CUDA" handlers of jax_flash_fwd / jax_flash_paged_fwd / jax_flash_bwd: the stream from
// XLA, a compute capability check, then the shared handler bodies (kernels/ffi_attention.h) of
// the call the one FFI boundary decoded (ffi/boundary.h). Exported as
// plain XLA_FFI_Handler symbols; kernels/targets.cc (a host file, nanobind does not go
// through nvcc) wraps them in capsules.
#include <string>

#include "kernels/ffi_attention.h"

namespace jax_flash {
namespace kernels {
namespace {

// The kernels use mma.sync bf16, ldmatrix and cp.async: sm_80 and newer.
ffi::Error CheckDevice(const char* target) {
  int device = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(target) + ": " + cudaGetErrorString(err));
  if (major < 8)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string(target) + ": the CUDA kernels need compute capability 8.0 or newer (mma.sync " +
                          "bf16, cp.async), this GPU has " + std::to_string(major) + "." + std::to_string(minor));
  return ffi::Error::Success();
}

constexpr auto kForward =
    boundary::ForwardHandler<1>([](cudaStream_t stream, const boundary::ForwardCall& call, auto... own) {
      if (auto e = CheckDevice("jax_flash_fwd"); e.failure()) return e;
      return Forward("jax_flash_fwd", stream, call, own...);
    });
constexpr auto kPagedForward = boundary::ForwardHandler<2>(
    [](cudaStream_t stream, ffi::AnyBuffer page_table, boundary::ForwardCall call, auto... own) {
      if (auto e = CheckDevice("jax_flash_paged_fwd"); e.failure()) return e;
      call.page_table = &page_table;
      return Forward("jax_flash_paged_fwd", stream, call, own...);
    });
constexpr auto kBackward =
    boundary::BackwardHandler<1>([](cudaStream_t stream, const boundary::BackwardCall& call, auto... own) {
      if (auto e = CheckDevice("jax_flash_bwd"); e.failure()) return e;
      return Backward("jax_flash_bwd", stream, call, own...);
    });

}  // namespace
}  // namespace kernels
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashForwardCuda, jax_flash::kernels::kForward,
    jax_flash::kernels::ForwardSignature(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashPagedForwardCuda, jax_flash::kernels::kPagedForward,
    jax_flash::kernels::PagedForwardSignature(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashBackwardCuda, jax_flash::kernels::kBackward,
    jax_flash::kernels::BackwardSignature(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()));
