// Exposes the host handlers as PyCapsules for jax.ffi.register_ffi_target(..., platform="cpu").
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <type_traits>

#include "cpu/handlers.h"
#include "cpu/kernel_table.h"
#include "cpu/parallel.h"
#include "cpu/problem.h"
#include "cpu/tiling.h"
#include "ffi/targets.h"

namespace nb = nanobind;

namespace jax_flash {
namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>, "an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

void AddCpuTargets(nb::dict& targets) {
  targets["jax_flash_fwd"] = Capsule(cpu::JaxFlashCpuForward);
  targets["jax_flash_bwd"] = Capsule(cpu::JaxFlashCpuBackward);
  targets["jax_flash_paged_fwd"] = Capsule(cpu::JaxFlashCpuPagedForward);
}

namespace {

// The core's clock now, in GHz, from a chain of dependent register-to-register integer adds
// (one cycle each on every x86-64 core of the last decade): the best of 200 bursts of
// ~0.5 ms, so that a burst the scheduler interrupted does not count. 0 off x86-64. The added
// value is a register, not an immediate: newer Intel cores fold chains of immediate adds in
// the renamer (a Xeon measured 19.7 "GHz" that way, 3.69 with register adds).
double MeasureClockGHz() {
#if defined(__x86_64__)
  constexpr int64_t kIterations = 250000;  // × 8 adds: ~0.5 ms
  double best = 0.0;
  for (int trial = 0; trial < 200; ++trial) {
    uint64_t x = static_cast<uint64_t>(trial);
    uint64_t one = 1;
    asm volatile("" : "+r"(one));  // a value the compiler (and the core's renamer) cannot fold
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < kIterations; ++i) {
      asm volatile(
          "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
          "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0"
          : "+r"(x)
          : "r"(one));
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // The loop's own increment and branch run beside the chain (other ports).
    const double ghz = 8.0 * kIterations / seconds / 1e9;
    if (ghz > best) best = ghz;
  }
  return best;
#else
  return 0.0;
#endif
}

#if defined(__x86_64__)
// Fused multiply-adds per second of this thread, 12 independent chains of 8-lane FMAs (more
// than an FMA unit's latency × width, so the units, not the chains, bound it): the best of
// 5 bursts of ~1 ms.
__attribute__((target("avx2,fma"))) double FmaRate(float seed) {
  constexpr int kChains = 12;
  constexpr int64_t kSteps = 100000;
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-4f);
  __m256 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(seed + c);
  double best = 0.0;
  for (int burst = 0; burst < 5; ++burst) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < kSteps; ++i) {
      for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
    }
    for (int c = 0; c < kChains; ++c) asm volatile("" : "+x"(acc[c]));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, kChains * 8.0 * kSteps / seconds);
  }
  return best;
}
#endif

// Each thread's FMA rate when `threads` threads run FMAs at once, over one thread's alone
// (the slowest thread's): about 1 when every thread has a core to itself, about 1/2 when two
// share one (SMT siblings, or a hypervisor's virtual CPUs placed on one core). 0 off x86-64
// or without FMA.
double MeasureCoreShare(int64_t threads) {
#if defined(__x86_64__)
  if (threads < 1 || !__builtin_cpu_supports("fma")) return 0.0;
  const double alone = FmaRate(1.0f);
  std::vector<double> rates(threads);
  std::atomic<int64_t> ready{0};
  std::vector<std::thread> workers;
  for (int64_t i = 0; i < threads; ++i) {
    workers.emplace_back([&, i] {
      ready.fetch_add(1);
      while (ready.load() < threads) {
      }
      rates[i] = FmaRate(2.0f + i);
    });
  }
  for (std::thread& t : workers) t.join();
  return *std::min_element(rates.begin(), rates.end()) / alone;
#else
  return 0.0;
#endif
}

}  // namespace

void AddCpuFunctions(nb::module_& m) {
  cpu::SetThreadLimitFromEnvironment();
  m.def(
      "cpu_thread_limit", []() { return cpu::ThreadLimit().load(); },
      "The process-wide cap on the cpu kernels' threads (0: every thread of XLA's pool), read from "
      "JAX_FLASH_CPU_THREADS once, when the extension is loaded.");
  m.def(
      "set_cpu_thread_limit", [](int64_t threads) { return cpu::ThreadLimit().exchange(threads > 0 ? threads : 0); },
      nb::arg("threads"),
      "Sets the process-wide cap on the cpu kernels' threads (0: none); returns the previous cap. "
      "Results are bitwise the same for every cap.");
  m.def("cpu_core_share", &MeasureCoreShare, nb::arg("threads"),
        "Each thread's FMA rate with `threads` threads running FMAs at once, over one thread's "
        "alone (the slowest's): ~1 with a core each, ~1/2 where two share a core; 0 off x86-64.");
  m.def("cpu_clock_ghz", &MeasureClockGHz,
        "One core's clock now (GHz), measured with a chain of dependent adds (0 off x86-64).");
  m.def(
      "cpu_isa",
      [](std::optional<std::string> requested) {
        // Not a handler: the handlers take the ISA from their isa attribute.
        if (!requested.has_value()) {
          const char* value = std::getenv("JAX_FLASH_CPU_ISA");
          requested = value == nullptr ? "" : value;
        }
        std::string error;
        const cpu::KernelTable* kernels = cpu::SelectKernels(*requested, "JAX_FLASH_CPU_ISA", &error);
        if (kernels == nullptr) throw std::invalid_argument(error);
        return std::string(kernels->isa);
      },
      nb::arg("requested") = nb::none(),
      "The ISA the cpu kernels run for `requested` (\"\": the default ISA of this CPU, cpu_default_isa; None: the "
      "value of "
      "JAX_FLASH_CPU_ISA); a ValueError naming JAX_FLASH_CPU_ISA when it is unknown or this CPU lacks it.");
  m.def("cpu_default_isa", &cpu::DefaultIsa, nb::arg("amx"), nb::arg("avx512bf16"), nb::arg("avx512"), nb::arg("avx2"),
        nb::arg("bf16_dot_over_fma"),
        "The default ISA's rule (cpu_isa(\"\") applies it to this CPU): amx where granted; else "
        "avx512bf16 where bf16_dot_over_fma >= 1, else avx512; else avx2; else generic.");
  m.def("cpu_bf16_dot_over_fma", &cpu::Bf16DotOverFma,
        "FLOP/s of vdpbf16ps over those of vfmadd231ps on this CPU, measured once (0 without "
        "AVX-512 BF16).");
  m.def(
      "cpu_blocking",
      [](int64_t h, const std::string& dtype, bool bf16_products) {
        cpu::ElementType type = cpu::ElementType::kF32;
        if (dtype == "bfloat16") {
          type = cpu::ElementType::kBF16;
        } else if (dtype == "float16") {
          type = cpu::ElementType::kF16;
        } else if (dtype != "float32") {
          throw std::invalid_argument("dtype must be float32, bfloat16 or float16, got " + dtype);
        }
        const cpu::Blocking b = cpu::BlockingFor(h, type, bf16_products);
        nb::dict d;
        d["block_q"] = b.block_q;
        d["block_k"] = b.block_k;
        d["key_block_bytes"] = b.key_block_bytes;
        d["forward_bytes"] = b.forward_bytes;
        d["backward_bytes"] = b.backward_bytes;
        return d;
      },
      "(H, dtype, bf16_products) -> the cpu kernels' tile blocking (tiling.h BlockingFor): "
      "block sizes and the bytes one worker's forward / backward tile step keeps hot.");
  m.def(
      "cpu_count_tiles",
      [](bool on) {
        cpu::tile_counts.forward = 0;
        cpu::tile_counts.backward = 0;
        cpu::tile_counts.on = on;
      },
      nb::arg("on"),
      "Starts (True) or stops counting the tiles the cpu kernels compute, from zero (a debug counter: "
      "jax_flash.cpu.count_tiles).");
  m.def(
      "cpu_tile_counts",
      []() { return nb::make_tuple(cpu::tile_counts.forward.load(), cpu::tile_counts.backward.load()); },
      "(forward, backward): the tiles (Q·Kᵀ products) the cpu kernels computed since cpu_count_tiles(True).");
  m.def(
      "cpu_gradient_chunks",
      [](int64_t b, int64_t n, int64_t k, int64_t t, int64_t s, int64_t h, int64_t threads) {
        cpu::Problem p;
        p.batch = b;
        p.q_heads = n;
        p.kv_heads = k;
        p.q_len = t;
        p.kv_len = s;
        p.head_dim = h;
        return cpu::GradientChunkRule(p, threads);
      },
      nb::arg("b"), nb::arg("n"), nb::arg("k"), nb::arg("t"), nb::arg("s"), nb::arg("h"), nb::arg("threads"),
      "(B, N, K, T, S, H, threads of XLA's pool) -> the number of key-block chunks (float32 dQ "
      "partials) of the single-pass backward; 1: each work item owns its query heads.");
}

}  // namespace jax_flash
