// The runtime→ISA layer: each ISA translation unit (kernels_*.cc) compiles the same
// algorithm for its vector width and exports it as one table; the handlers pick a
// table once per call with SelectKernels. This is the only place where the ISA is a
// runtime value.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cpu/problem.h"

namespace jax_flash {
namespace cpu {

struct KernelTable {
  const char* isa;
  bool bf16_products;  // bf16 inputs are packed and multiplied as bf16 (Problem::bf16_packing)
  // Floats of workspace one worker needs (64-byte aligned by the caller).
  int64_t (*forward_workspace)(const Problem&);
  // One work item each; see tiling.h for how items map to blocks.
  void (*forward_tile)(const Problem&, int64_t item, float* workspace);
  // Split-KV (Problem::forward_chunks > 1): one item per query block, after forward_tile.
  void (*merge_forward_chunks)(const Problem&, int64_t query_item, float* workspace);
  // prepare_key_block: the forward's prepass (Problem::Packed k_t, v and bad_values) of one
  // key block. The backward (flash_backward_pass.h): prepare_query_block packs Q and dO in
  // the format the products of this ISA take for the problem's dtype (workspace
  // 2·PaddedHeadDim floats), backward_workspace floats per worker for gradient_tile
  // (GradientItems, which packs its key blocks), reduce_query_gradient per query block
  // (workspace 2·PaddedHeadDim).
  int64_t (*backward_workspace)(const Problem&);
  void (*prepare_query_block)(const Problem&, int64_t item, float* workspace);
  void (*prepare_key_block)(const Problem&, int64_t item, float* workspace);
  void (*gradient_tile)(const Problem&, int64_t item, float* workspace);
  void (*reduce_query_gradient)(const Problem&, int64_t item, float* workspace);
};

namespace generic {
const KernelTable& Kernels();
}
#if defined(__x86_64__) || defined(_M_X64)
namespace avx2 {
const KernelTable& Kernels();
}
namespace avx512 {
const KernelTable& Kernels();
}
namespace avx512bf16 {
const KernelTable& Kernels();
}
namespace amx {
const KernelTable& Kernels();
}
namespace amx_emulated {
const KernelTable& Kernels();
}
#endif

// The default ISA (`requested` empty: DefaultIsa on this CPU), or the one named ("amx",
// "avx512bf16", "avx512", "avx2", "generic", or "amx_emulated", which is never chosen otherwise);
// null and an error message naming `setting`=`requested` when the name is unknown or this CPU
// lacks it. The handlers take the name from their isa attribute; it is never read from the
// environment.
const KernelTable* SelectKernels(std::string_view requested, std::string_view setting, std::string* error);

// The default rule, from what the CPU runs: amx where granted; else avx512bf16 where its bf16
// dot products give at least the FLOP rate of float32 FMAs (`bf16_dot_over_fma`, measured by
// Bf16DotOverFma), else avx512 (the same kernels with float32 products); else avx2; else generic.
// The two AVX-512 kernels differ only in bf16 products, so the rate decides nothing else.
std::string DefaultIsa(bool amx, bool avx512bf16, bool avx512, bool avx2, double bf16_dot_over_fma);

// FLOP per second of vdpbf16ps (64 per zmm instruction) over those of vfmadd231ps (32), on one
// thread with independent chains: about 2 where the core runs both at one per cycle, 0.5 on a
// Xeon that ran vdpbf16ps at a quarter of the FMAs' rate. Measured once (about 1 ms), then cached;
// 0 on a CPU without AVX-512 BF16.
double Bf16DotOverFma();

// The ISAs this build holds kernels for (SelectKernels can return), widest first; on x86-64
// every one, elsewhere "generic" alone. Which of them this CPU runs is SelectKernels' answer.
std::vector<std::string> CompiledIsas();

}  // namespace cpu
}  // namespace jax_flash
