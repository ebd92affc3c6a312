// The one runtime -> template layer: (element type, head dim, layout) of a call to the compiled
// instantiation. The instantiations themselves are generated, one file per
// dtype x head dim x pass x layout (build/generate_kernels.py), so the build compiles them in
// parallel; keep kHeadDims in step with that script (it checks). A layout that gives a pass and
// head dim no tile shape of its own (HasOwnShape, kernels/tile.h) runs the kWarp16 instantiation.
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/params.h"
#include "kernels/platform.h"
#include "kernels/tile.h"

namespace jax_flash {
namespace kernels {

// Defined in fwd.h / bwd.h, instantiated in the generated .cu files (or, in the emulated
// build, implicitly in the one translation unit that includes everything).
template <class Elem, int HEAD_DIM, Layout LAYOUT>
LaunchError LaunchForward(const AttentionParams& p, Stream stream);
template <class Elem, int HEAD_DIM, Layout LAYOUT>
LaunchError LaunchBackward(const AttentionParams& p, bool deterministic, Stream stream);

constexpr int kHeadDims[] = {32, 64, 96, 128, 192, 256};

inline bool HasHeadDim(int head_dim) {
  for (int h : kHeadDims)
    if (h == head_dim) return true;
  return false;
}

// The environment variable that chooses the layout, read by the handlers at every call.
constexpr const char* kLayoutVariable = "JAX_FLASH_CUDA_LAYOUT";

inline const char* LayoutName(Layout layout) { return layout == Layout::kWarp32 ? "warp32" : "warp16"; }

// JAX_FLASH_CUDA_LAYOUT: unset or empty -> kWarp16 (the default), "warp16", "warp32"; anything
// else is an error (returned, naming the variable).
inline LaunchError LayoutFromEnvironment(Layout* layout) {
  const char* env = std::getenv(kLayoutVariable);
  if (env == nullptr || env[0] == '\0' || std::strcmp(env, "warp16") == 0) {
    *layout = Layout::kWarp16;
    return {};
  }
  if (std::strcmp(env, "warp32") == 0) {
    *layout = Layout::kWarp32;
    return {};
  }
  return std::string(kLayoutVariable) + "=" + env + " is not a layout of the CUDA kernels (warp16 or warp32)";
}

template <class Elem, int HEAD_DIM>
LaunchError ForwardFor(Layout layout, const AttentionParams& p, Stream stream) {
  if constexpr (HasOwnShape(Pass::kForward, HEAD_DIM, Layout::kWarp32)) {
    if (layout == Layout::kWarp32) return LaunchForward<Elem, HEAD_DIM, Layout::kWarp32>(p, stream);
  }
  return LaunchForward<Elem, HEAD_DIM, Layout::kWarp16>(p, stream);
}

template <class Elem, int HEAD_DIM>
LaunchError BackwardFor(Layout layout, const AttentionParams& p, bool deterministic, Stream stream) {
  if constexpr (HasOwnShape(Pass::kBackward, HEAD_DIM, Layout::kWarp32)) {
    if (layout == Layout::kWarp32) return LaunchBackward<Elem, HEAD_DIM, Layout::kWarp32>(p, deterministic, stream);
  }
  return LaunchBackward<Elem, HEAD_DIM, Layout::kWarp16>(p, deterministic, stream);
}

template <class Elem>
LaunchError DispatchForwardHeadDim(Layout layout, const AttentionParams& p, Stream stream) {
  switch (p.head_dim) {
    case 32: return ForwardFor<Elem, 32>(layout, p, stream);
    case 64: return ForwardFor<Elem, 64>(layout, p, stream);
    case 96: return ForwardFor<Elem, 96>(layout, p, stream);
    case 128: return ForwardFor<Elem, 128>(layout, p, stream);
    case 192: return ForwardFor<Elem, 192>(layout, p, stream);
    case 256: return ForwardFor<Elem, 256>(layout, p, stream);
    default: return "no kernel for head dim " + std::to_string(p.head_dim);
  }
}

template <class Elem>
LaunchError DispatchBackwardHeadDim(Layout layout, const AttentionParams& p, bool deterministic, Stream stream) {
  switch (p.head_dim) {
    case 32: return BackwardFor<Elem, 32>(layout, p, deterministic, stream);
    case 64: return BackwardFor<Elem, 64>(layout, p, deterministic, stream);
    case 96: return BackwardFor<Elem, 96>(layout, p, deterministic, stream);
    case 128: return BackwardFor<Elem, 128>(layout, p, deterministic, stream);
    case 192: return BackwardFor<Elem, 192>(layout, p, deterministic, stream);
    case 256: return BackwardFor<Elem, 256>(layout, p, deterministic, stream);
    default: return "no kernel for head dim " + std::to_string(p.head_dim);
  }
}

inline LaunchError DispatchForward(ElementType dtype, Layout layout, const AttentionParams& p, Stream stream) {
  return dtype == ElementType::kF16 ? DispatchForwardHeadDim<F16>(layout, p, stream)
                                    : DispatchForwardHeadDim<Bf16>(layout, p, stream);
}

inline LaunchError DispatchBackward(ElementType dtype, Layout layout, const AttentionParams& p, bool deterministic,
                                    Stream stream) {
  return dtype == ElementType::kF16 ? DispatchBackwardHeadDim<F16>(layout, p, deterministic, stream)
                                    : DispatchBackwardHeadDim<Bf16>(layout, p, deterministic, stream);
}

}  // namespace kernels
}  // namespace jax_flash
