// The one runtime -> template layer: (element type, head dims (H, Hv), layout) of a call to the
// compiled instantiation. The instantiations themselves are generated, one file per
// dtype x (H, Hv) x pass x layout (build/generate_kernels.py), so the build compiles them in
// parallel; keep kHeadDims and kNarrowValuePairs in step with that script (it checks). A layout
// that gives a pass and head dims no tile shape of its own (HasOwnShape, kernels/tile.h) runs
// the kWarp16 instantiation.
#pragma once

#include <cfloat>

#include <string>
#include <string_view>

#include "kernels/params.h"
#include "kernels/platform.h"
#include "kernels/tile.h"

namespace jax_flash {
namespace kernels {

// Defined in fwd.h / bwd.h, instantiated in the generated .cu files (or, in the emulated
// build, implicitly in the one translation unit that includes everything).
template <class Elem, int HEAD_DIM, int V_HEAD_DIM, Layout LAYOUT, ForwardVariant VARIANT>
LaunchError LaunchForward(const AttentionParams& p, Stream stream);
template <class Elem, int HEAD_DIM, int V_HEAD_DIM, Layout LAYOUT>
LaunchError LaunchBackward(const AttentionParams& p, bool deterministic, Stream stream);

// Head dims H with kernels for Hv = H, and the (H, Hv) pairs with a narrower value head dim
// (MLA: DeepSeek's 192-wide queries and keys with 128-wide values; 128 with 64).
constexpr int kHeadDims[] = {32, 64, 96, 128, 192, 256};
struct HeadDimPair {
  int head_dim, v_head_dim;
};
constexpr HeadDimPair kNarrowValuePairs[] = {{192, 128}, {128, 64}};

inline bool HasHeadDim(int head_dim) {
  for (int h : kHeadDims)
    if (h == head_dim) return true;
  return false;
}

inline bool HasHeadDims(int head_dim, int v_head_dim) {
  if (head_dim == v_head_dim) return HasHeadDim(head_dim);
  for (HeadDimPair pair : kNarrowValuePairs)
    if (pair.head_dim == head_dim && pair.v_head_dim == v_head_dim) return true;
  return false;
}

// "(32, 32), (64, 64), ..., (192, 128)": the pairs of HasHeadDims, for messages.
inline std::string HeadDimPairsText() {
  std::string text;
  for (int h : kHeadDims) text += (text.empty() ? "(" : ", (") + std::to_string(h) + ", " + std::to_string(h) + ")";
  for (HeadDimPair pair : kNarrowValuePairs)
    text += ", (" + std::to_string(pair.head_dim) + ", " + std::to_string(pair.v_head_dim) + ")";
  return text;
}

inline const char* LayoutName(Layout layout) { return layout == Layout::kWarp32 ? "warp32" : "warp16"; }

// The layout attribute of the handlers: "warp16" or "warp32" (decided by the caller,
// jax_flash/cuda.py); anything else is an error (returned, naming the attribute).
inline LaunchError LayoutFromName(std::string_view name, Layout* layout) {
  if (name == "warp16") {
    *layout = Layout::kWarp16;
    return {};
  }
  if (name == "warp32") {
    *layout = Layout::kWarp32;
    return {};
  }
  return "layout=" + std::string(name) + " is not a layout of the CUDA kernels (warp16 or warp32)";
}

// The forward: the plain kernel when the call asks for it (AttentionParams::plain; one shape
// per head dims, PlainForwardShape, instantiated in the kWarp16 file), the general kernel on
// the decoding tile when it asks for that (AttentionParams::decode_tile, DecodeForwardShape,
// likewise), else the general kernel of the layout.
template <class Elem, int HEAD_DIM, int V_HEAD_DIM = HEAD_DIM>
LaunchError ForwardFor(Layout layout, const AttentionParams& p, Stream stream) {
  if (p.plain) return LaunchForward<Elem, HEAD_DIM, V_HEAD_DIM, Layout::kWarp16, ForwardVariant::kPlain>(p, stream);
  if (p.decode_tile)
    return LaunchForward<Elem, HEAD_DIM, V_HEAD_DIM, Layout::kWarp16, ForwardVariant::kDecode>(p, stream);
  if constexpr (HasOwnShape(Pass::kForward, HEAD_DIM, V_HEAD_DIM, Layout::kWarp32)) {
    if (layout == Layout::kWarp32)
      return LaunchForward<Elem, HEAD_DIM, V_HEAD_DIM, Layout::kWarp32, ForwardVariant::kGeneral>(p, stream);
  }
  return LaunchForward<Elem, HEAD_DIM, V_HEAD_DIM, Layout::kWarp16, ForwardVariant::kGeneral>(p, stream);
}

// The backward: a routed call with the plain kernel (AttentionParams::plain) runs the kWarp16
// instantiation, which holds the plain kernel (its tiles are that layout's) and launches the
// general kernel beside it; every other call the layout's.
template <class Elem, int HEAD_DIM, int V_HEAD_DIM = HEAD_DIM>
LaunchError BackwardFor(Layout layout, const AttentionParams& p, bool deterministic, Stream stream) {
  if (p.plain) return LaunchBackward<Elem, HEAD_DIM, V_HEAD_DIM, Layout::kWarp16>(p, deterministic, stream);
  if constexpr (HasOwnShape(Pass::kBackward, HEAD_DIM, V_HEAD_DIM, Layout::kWarp32)) {
    if (layout == Layout::kWarp32)
      return LaunchBackward<Elem, HEAD_DIM, V_HEAD_DIM, Layout::kWarp32>(p, deterministic, stream);
  }
  return LaunchBackward<Elem, HEAD_DIM, V_HEAD_DIM, Layout::kWarp16>(p, deterministic, stream);
}

// The first per-score feature a call has, or null: what neither plain kernel computes (a soft
// cap, segment ids, dropout, a dense bias or mask, a block mask).
inline const char* PerScoreFeature(const AttentionParams& p) {
  if (p.softcap != 0.0f) return "a soft cap";
  if (p.use_segment_ids) return "segment ids";
  if (p.dropout_rate != 0.0f) return "dropout";
  if (p.bias.data != nullptr) return "a dense bias";
  if (p.mask.data != nullptr) return "a dense mask";
  if (p.blocks.states != nullptr) return "a block mask";
  return nullptr;
}

// max(H, Hv): the widest row of q, k, v, out, in elements.
inline int64_t WidestRow(const AttentionParams& p) { return p.head_dim > p.v_head_dim ? p.head_dim : p.v_head_dim; }

// What keeps a call from the plain forward (kernels/fwd.h), or null: it serves none of the
// optional features (soft cap, segment ids, dropout, dense bias or mask, block mask, paging,
// split-KV, GQA packing), its scale is a positive normal float32 below 2^127 (its softmax
// works on raw scores with exp_scale = scale·log2 e, which must be finite and nonzero: a masked
// score's −inf times it must stay −inf), and its copies address a key tile's rows in 32 bits
// (K·max(H, Hv) below 2^23: a 256-key tile below 2^32 bytes). jax_flash/cuda.py decides with
// the same rule (_heuristics.cuda_plain_forward_blocker); the handlers refuse a plain_kernel
// call it breaks.
inline const char* PlainForwardRefusal(const AttentionParams& p) {
  if (!(p.scale >= FLT_MIN && p.scale < 0x1p127f)) return "a scale outside [2^-126, 2^127)";
  if (const char* feature = PerScoreFeature(p)) return feature;
  if (p.page_table != nullptr) return "a paged cache";
  if (p.kv_splits > 1) return "split-KV";
  if (p.pack_gqa) return "GQA packing";
  if (int64_t{p.kv_heads} * WidestRow(p) >= (int64_t{1} << 23)) return "K·max(H, Hv) >= 2^23";
  return nullptr;
}

// What keeps a backward call from the plain kernel (kernels/bwd.h), or null: it serves none of
// the per-score features (soft cap, segment ids, dropout, dense bias or mask, block mask;
// lengths, windows, query offsets, sinks, GQA and both grids it serves), and it adds dQ with
// atomics (deterministic mode's dQ kernel is the general one), and its copies address a query
// block's rows in 32 bits (N·max(H, Hv) below 2^23). Every scale: its arithmetic is the general
// kernel's. jax_flash/cuda.py decides with the same rule
// (_heuristics.cuda_plain_backward_blocker); the handlers refuse a plain_kernel call it breaks.
inline const char* PlainBackwardRefusal(const AttentionParams& p, bool deterministic) {
  if (deterministic) return "deterministic mode";
  if (const char* feature = PerScoreFeature(p)) return feature;
  if (int64_t{p.q_heads} * WidestRow(p) >= (int64_t{1} << 23)) return "N·max(H, Hv) >= 2^23";
  return nullptr;
}

// What keeps a call from the decoding tile (AttentionParams::decode_tile), or null: its tiles
// must hold at most kDecodeRows query rows (T, or G = N / K with GQA packing), its K and V row
// strides must fit 32 bits (K·max(H, Hv) < 2^31: the kernel reads them per tile as 32-bit
// words), and it is not a plain-kernel call (the plain kernel has tiles of its own).
// jax_flash/_heuristics.py decides with the same rule (cuda_decode_tile); the handlers refuse a
// decode_tile call it breaks.
inline const char* DecodeTileRefusal(const AttentionParams& p) {
  static_assert(kDecodeRows == 16, "the messages below name the decoding tile's rows");
  const int rows = p.pack_gqa ? p.q_heads / p.kv_heads : p.q_len;
  if (rows > kDecodeRows) return p.pack_gqa ? "G = N / K > 16 packed query heads" : "T > 16 queries";
  if (int64_t{p.kv_heads} * WidestRow(p) >= (int64_t{1} << 31)) return "K·max(H, Hv) >= 2^31";
  if (p.plain) return "plain_kernel=true";
  return nullptr;
}

inline std::string NoKernelFor(const AttentionParams& p) {
  return "no kernel for head dims (H, Hv) = (" + std::to_string(p.head_dim) + ", " + std::to_string(p.v_head_dim) + ")";
}

template <class Elem>
LaunchError DispatchForwardHeadDim(Layout layout, const AttentionParams& p, Stream stream) {
  if (p.v_head_dim != p.head_dim) {
    if (p.head_dim == 192 && p.v_head_dim == 128) return ForwardFor<Elem, 192, 128>(layout, p, stream);
    if (p.head_dim == 128 && p.v_head_dim == 64) return ForwardFor<Elem, 128, 64>(layout, p, stream);
    return NoKernelFor(p);
  }
  switch (p.head_dim) {
    case 32: return ForwardFor<Elem, 32>(layout, p, stream);
    case 64: return ForwardFor<Elem, 64>(layout, p, stream);
    case 96: return ForwardFor<Elem, 96>(layout, p, stream);
    case 128: return ForwardFor<Elem, 128>(layout, p, stream);
    case 192: return ForwardFor<Elem, 192>(layout, p, stream);
    case 256: return ForwardFor<Elem, 256>(layout, p, stream);
    default: return NoKernelFor(p);
  }
}

template <class Elem>
LaunchError DispatchBackwardHeadDim(Layout layout, const AttentionParams& p, bool deterministic, Stream stream) {
  if (p.v_head_dim != p.head_dim) {
    if (p.head_dim == 192 && p.v_head_dim == 128) return BackwardFor<Elem, 192, 128>(layout, p, deterministic, stream);
    if (p.head_dim == 128 && p.v_head_dim == 64) return BackwardFor<Elem, 128, 64>(layout, p, deterministic, stream);
    return NoKernelFor(p);
  }
  switch (p.head_dim) {
    case 32: return BackwardFor<Elem, 32>(layout, p, deterministic, stream);
    case 64: return BackwardFor<Elem, 64>(layout, p, deterministic, stream);
    case 96: return BackwardFor<Elem, 96>(layout, p, deterministic, stream);
    case 128: return BackwardFor<Elem, 128>(layout, p, deterministic, stream);
    case 192: return BackwardFor<Elem, 192>(layout, p, deterministic, stream);
    case 256: return BackwardFor<Elem, 256>(layout, p, deterministic, stream);
    default: return NoKernelFor(p);
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
