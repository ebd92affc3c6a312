// Exposes the host handlers as PyCapsules for jax.ffi.register_ffi_target(..., platform="cpu").
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include <type_traits>

#include "cpu/handlers.h"
#include "cpu/kernel_table.h"
#include "cpu/problem.h"
#include "cpu/tiling.h"
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

void AddCpuFunctions(nb::module_& m) {
  m.def(
      "cpu_isa",
      []() {
        std::string error;
        const cpu::KernelTable* kernels = cpu::SelectKernels(&error);
        if (kernels == nullptr) throw std::invalid_argument(error);
        return std::string(kernels->isa);
      },
      "The ISA the cpu kernels run on now (JAX_FLASH_CPU_ISA, or the widest this CPU has).");
  m.def(
      "cpu_gradient_chunks",
      [](int64_t b, int64_t n, int64_t k, int64_t t, int64_t s, int64_t h) {
        cpu::Problem p;
        p.batch = b;
        p.q_heads = n;
        p.kv_heads = k;
        p.q_len = t;
        p.kv_len = s;
        p.head_dim = h;
        return cpu::GradientChunks(p);
      },
      "(B, N, K, T, S, H) -> the number of key-block chunks (float32 dQ partials) of the "
      "single-pass backward.");
}

}  // namespace jax_flash
