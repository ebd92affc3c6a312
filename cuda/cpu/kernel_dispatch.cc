// Chooses the kernels for this CPU at run time, so the wheel needs no -march flags.
#include <string>
#include <string_view>
#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu/kernel_table.h"

namespace jax_flash {
namespace cpu {
namespace {

bool CpuHasAvx512() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool CpuHasAvx512Bf16() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return CpuHasAvx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// AMX-BF16 in the CPU, and the tile state granted by the operating system: Linux hands it
// to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), once;
// a refusal leaves the AMX kernels unused.
bool CpuHasAmx() {
#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
  static const bool granted = [] {
    __builtin_cpu_init();
    if (!CpuHasAvx512Bf16() || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

bool CpuHasAvx2() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

}  // namespace

const KernelTable* SelectKernels(std::string_view requested, std::string_view setting, std::string* error) {
  const bool any = requested.empty();
  const std::string named = std::string(setting) + "=" + std::string(requested);
#if defined(__x86_64__) || defined(_M_X64)
  if (any || requested == "amx") {
    if (CpuHasAmx()) return &amx::Kernels();
    if (!any) {
      *error = named +
               " but this CPU lacks AMX-BF16 with AVX-512 BF16, or the "
               "operating system refused it the tile state";
      return nullptr;
    }
  }
  if (!any && requested == "amx_emulated") {
    if (CpuHasAvx512Bf16()) return &amx_emulated::Kernels();
    *error = named + " but this CPU lacks AVX-512 (F, VL, BW, DQ) with BF16";
    return nullptr;
  }
  if (any || requested == "avx512bf16") {
    if (CpuHasAvx512Bf16()) return &avx512bf16::Kernels();
    if (!any) {
      *error = named + " but this CPU lacks AVX-512 (F, VL, BW, DQ) with BF16";
      return nullptr;
    }
  }
  if (any || requested == "avx512") {
    if (CpuHasAvx512()) return &avx512::Kernels();
    if (!any) {
      *error = named + " but this CPU lacks AVX-512 (F, VL, BW, DQ)";
      return nullptr;
    }
  }
  if (any || requested == "avx2") {
    if (CpuHasAvx2()) return &avx2::Kernels();
    if (!any) {
      *error = named + " but this CPU lacks AVX2 and FMA";
      return nullptr;
    }
  }
#endif
  if (any || requested == "generic") return &generic::Kernels();
  *error = named +
           " is not one of: amx, avx512bf16, avx512, avx2, generic, amx_emulated (or empty for the best "
           "this CPU runs)";
  return nullptr;
}

std::vector<std::string> CompiledIsas() {
#if defined(__x86_64__) || defined(_M_X64)
  return {"amx", "avx512bf16", "avx512", "avx2", "generic", "amx_emulated"};
#else
  return {"generic"};
#endif
}

}  // namespace cpu
}  // namespace jax_flash
