// Chooses the kernels for this CPU at run time, so the wheel needs no -march flags.
#include <chrono>
#include <string>
#include <string_view>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
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

#if defined(__x86_64__) || defined(_M_X64)
// Instructions per second of 12 independent chains of `step` (more than latency × ports on any
// core, so the ports bound it): the best of 5 bursts of ~0.3 ms.
template <typename Step>
double ChainRate(Step step) {
  double best = 0.0;
  for (int burst = 0; burst < 5; ++burst) {
    constexpr int64_t kSteps = 20000;
    const auto start = std::chrono::steady_clock::now();
    step(kSteps);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (seconds > 0 && 12.0 * kSteps / seconds > best) best = 12.0 * kSteps / seconds;
  }
  return best;
}

#define JAX_FLASH_TIMES12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define JAX_FLASH_DECLARE(i) __m512 c##i = _mm512_set1_ps(static_cast<float>(i));
#define JAX_FLASH_KEEP(i) asm volatile("" : "+v"(c##i));

__attribute__((target("avx512f,avx512bf16"))) void DotChains(int64_t steps) {
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3a80);  // bf16 ~0.001
  JAX_FLASH_TIMES12(JAX_FLASH_DECLARE)
  for (int64_t k = 0; k < steps; ++k) {
#define JAX_FLASH_DOT(i) c##i = _mm512_dpbf16_ps(c##i, a, b);
    JAX_FLASH_TIMES12(JAX_FLASH_DOT)
#undef JAX_FLASH_DOT
  }
  JAX_FLASH_TIMES12(JAX_FLASH_KEEP)
}

__attribute__((target("avx512f"))) void FmaChains(int64_t steps) {
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-4f);
  JAX_FLASH_TIMES12(JAX_FLASH_DECLARE)
  for (int64_t k = 0; k < steps; ++k) {
#define JAX_FLASH_FMA(i) c##i = _mm512_fmadd_ps(c##i, a, b);
    JAX_FLASH_TIMES12(JAX_FLASH_FMA)
#undef JAX_FLASH_FMA
  }
  JAX_FLASH_TIMES12(JAX_FLASH_KEEP)
}
#undef JAX_FLASH_KEEP
#undef JAX_FLASH_DECLARE
#undef JAX_FLASH_TIMES12
#endif

}  // namespace

std::string DefaultIsa(bool amx, bool avx512bf16, bool avx512, bool avx2, double bf16_dot_over_fma) {
  if (amx) return "amx";
  if (avx512bf16 && bf16_dot_over_fma >= 1.0) return "avx512bf16";
  if (avx512 || avx512bf16) return "avx512";
  if (avx2) return "avx2";
  return "generic";
}

double Bf16DotOverFma() {
#if defined(__x86_64__) || defined(_M_X64)
  static const double ratio = [] {
    if (!CpuHasAvx512Bf16()) return 0.0;
    DotChains(1000);  // warm the 512-bit units before either is timed
    FmaChains(1000);
    const double dots = ChainRate(DotChains), fmas = ChainRate(FmaChains);
    return fmas > 0 ? 64.0 * dots / (32.0 * fmas) : 0.0;
  }();
  return ratio;
#else
  return 0.0;
#endif
}

namespace {

// DefaultIsa on this CPU, decided once per process: the rate is measured only where it
// decides something (AVX-512 BF16 without AMX); off x86-64 every feature is absent: generic.
const std::string& DefaultIsaOfThisCpu() {
  static const std::string isa = [] {
    const bool amx = CpuHasAmx(), bf16 = CpuHasAvx512Bf16();
    return DefaultIsa(amx, bf16, CpuHasAvx512(), CpuHasAvx2(), !amx && bf16 ? Bf16DotOverFma() : 0.0);
  }();
  return isa;
}

// The named ISA's kernels where this CPU runs them, else null and `named` + `lacks` in *error.
[[maybe_unused]] const KernelTable* IfRuns(bool runs, const KernelTable& (*kernels)(), const std::string& named,
                                           const char* lacks, std::string* error) {
  if (runs) return &kernels();
  *error = named + lacks;
  return nullptr;
}

}  // namespace

const KernelTable* SelectKernels(std::string_view requested, std::string_view setting, std::string* error) {
  if (requested.empty()) requested = DefaultIsaOfThisCpu();
  const std::string named = std::string(setting) + "=" + std::string(requested);
#if defined(__x86_64__) || defined(_M_X64)
  constexpr const char* kLacksBf16 = " but this CPU lacks AVX-512 (F, VL, BW, DQ) with BF16";
  if (requested == "amx")
    return IfRuns(CpuHasAmx(), amx::Kernels, named,
                  " but this CPU lacks AMX-BF16 with AVX-512 BF16, or the operating system refused it the tile state",
                  error);
  if (requested == "amx_emulated") return IfRuns(CpuHasAvx512Bf16(), amx_emulated::Kernels, named, kLacksBf16, error);
  if (requested == "avx512bf16") return IfRuns(CpuHasAvx512Bf16(), avx512bf16::Kernels, named, kLacksBf16, error);
  if (requested == "avx512")
    return IfRuns(CpuHasAvx512(), avx512::Kernels, named, " but this CPU lacks AVX-512 (F, VL, BW, DQ)", error);
  if (requested == "avx2") return IfRuns(CpuHasAvx2(), avx2::Kernels, named, " but this CPU lacks AVX2 and FMA", error);
#endif
  if (requested == "generic") return &generic::Kernels();
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
