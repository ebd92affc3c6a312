// The one runtime -> template layer: (element type, head dim) of a call to the compiled
// instantiation. The instantiations themselves are generated, one file per
// dtype x head dim x pass (build/generate_kernels.py), so the build compiles them in parallel;
// keep kHeadDims in step with that script (it checks).
#pragma once

#include "kernels/params.h"
#include "kernels/platform.h"

namespace jax_flash {
namespace kernels {

// Defined in fwd.h / bwd.h, instantiated in the generated .cu files (or, in the emulated
// build, implicitly in the one translation unit that includes everything).
template <class Elem, int HEAD_DIM>
LaunchError LaunchForward(const AttentionParams& p, Stream stream);
template <class Elem, int HEAD_DIM>
LaunchError LaunchBackward(const AttentionParams& p, bool deterministic, Stream stream);

constexpr int kHeadDims[] = {32, 64, 96, 128};

inline bool HasHeadDim(int head_dim) {
  for (int h : kHeadDims)
    if (h == head_dim) return true;
  return false;
}

template <class Elem>
LaunchError DispatchForwardHeadDim(const AttentionParams& p, Stream stream) {
  switch (p.head_dim) {
    case 32: return LaunchForward<Elem, 32>(p, stream);
    case 64: return LaunchForward<Elem, 64>(p, stream);
    case 96: return LaunchForward<Elem, 96>(p, stream);
    case 128: return LaunchForward<Elem, 128>(p, stream);
    default: return "no kernel for head dim " + std::to_string(p.head_dim);
  }
}

template <class Elem>
LaunchError DispatchBackwardHeadDim(const AttentionParams& p, bool deterministic, Stream stream) {
  switch (p.head_dim) {
    case 32: return LaunchBackward<Elem, 32>(p, deterministic, stream);
    case 64: return LaunchBackward<Elem, 64>(p, deterministic, stream);
    case 96: return LaunchBackward<Elem, 96>(p, deterministic, stream);
    case 128: return LaunchBackward<Elem, 128>(p, deterministic, stream);
    default: return "no kernel for head dim " + std::to_string(p.head_dim);
  }
}

inline LaunchError DispatchForward(ElementType dtype, const AttentionParams& p, Stream stream) {
  return dtype == ElementType::kF16 ? DispatchForwardHeadDim<F16>(p, stream) : DispatchForwardHeadDim<Bf16>(p, stream);
}

inline LaunchError DispatchBackward(ElementType dtype, const AttentionParams& p, bool deterministic, Stream stream) {
  return dtype == ElementType::kF16 ? DispatchBackwardHeadDim<F16>(p, deterministic, stream)
                                    : DispatchBackwardHeadDim<Bf16>(p, deterministic, stream);
}

}  // namespace kernels
}  // namespace jax_flash
