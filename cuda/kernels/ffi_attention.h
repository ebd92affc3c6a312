// The CUDA kernels' side of the FFI boundary, shared by the platform "CUDA" handlers
// (kernels/handlers.cu) and the emulated platform "cpu" handlers (emu/targets_{fwd,bwd}.cc): the shared
// operands, results and attributes are bound and validated by ffi/boundary.h (the one
// signature and validator of every target); here the CUDA targets' own operand (route),
// workspaces and attributes (partial_out, partial_lse, pack_gqa, layout, plain_kernel, decode_tile; dk_accum, dv_accum,
// dbias_accum),
// their checks, the conversion into AttentionParams and the handler bodies. Only how the
// stream is obtained differs between the two.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

// The XLA headers come first: the emulation's simt.h redefines CUDA keywords as macros.
#include "xla/ffi/api/ffi.h"

#include "ffi/boundary.h"

#include "common/nonfinite.h"
#include "kernels/dispatch.h"
#include "kernels/params.h"
#include "kernels/platform.h"

namespace jax_flash {
namespace kernels {

namespace ffi = xla::ffi;
using boundary::Checker;
using boundary::Describe;

// ---- signatures -----------------------------------------------------------------------------

// jax_flash_fwd / jax_flash_emu_fwd (and, with the page table bound first, the paged targets):
// the boundary's forward, then the split-KV workspaces and the CUDA targets' attributes.
template <class Binding>
auto ForwardSignature(Binding&& binding) {
  return boundary::BindForward(std::move(binding))
      .template Arg<ffi::AnyBuffer>()  // route: [0] s32 (not routed) or [1] s32 (AttentionParams::route)
      .template Ret<ffi::AnyBuffer>()  // partial_out [C, B, T, N, Hv] f32 workspace (split-KV into C >= 2 chunks), or
                                       // [0] f32
      .template Ret<ffi::AnyBuffer>()  // partial_lse [C, B, N, T] f32 workspace, or [0] f32
      .template Attr<bool>("pack_gqa")  // T = 1: the G query heads of a kv head in one tile
      .template Attr<std::string_view>("layout")  // "warp16" or "warp32" (kernels/tile.h)
      .template Attr<bool>("plain_kernel")  // the plain forward kernel (kernels/fwd.h, params.h)
      .template Attr<bool>("decode_tile");  // the general kernel on the decoding tile (kernels/tile.h)
}

// jax_flash_paged_fwd / jax_flash_emu_paged_fwd: the forward over a paged KV cache, the page
// table first, then the forward's operands with k, v as pages [num_pages, page_size, K, H|Hv].
template <class Binding>
auto PagedForwardSignature(Binding&& binding) {
  return ForwardSignature(std::move(binding).template Arg<ffi::AnyBuffer>());  // page_table [B, max_pages] s32
}

// jax_flash_bwd / jax_flash_emu_bwd: the boundary's backward, then the route, the workspaces,
// dbias, the layout and the plain kernel.
template <class Binding>
auto BackwardSignature(Binding&& binding) {
  return boundary::BindBackward(std::move(binding))
      .template Arg<ffi::AnyBuffer>()  // route: [0] s32 (not routed) or [1] s32 (AttentionParams::route)
      .template Ret<ffi::AnyBuffer>()  // dk_accum [B, S, N, H] f32 workspace (q_heads grid), or [0] f32
      .template Ret<ffi::AnyBuffer>()  // dv_accum [B, S, N, Hv] f32 (q_heads grid), or [0] f32
      .template Ret<ffi::AnyBuffer>()  // dbias_accum [B, N, Tb, S] f32 workspace (deterministic, a bias broadcast over
                                       // B, N or S), or [0] f32
      .template Ret<ffi::AnyBuffer>()  // dbias: the bias operand's shape f32, or [0] f32: no bias
      .template Attr<std::string_view>("layout")
      .template Attr<bool>("plain_kernel");  // the plain backward kernel (kernels/bwd.h, params.h)
}

// ---- validation -----------------------------------------------------------------------------

// What the CUDA kernels serve: f16 and bf16, the instantiated (H, Hv) pairs, int sizes.
inline const boundary::Limits& CudaLimits() {
  static const boundary::Limits limits = [] {
    boundary::Limits l;
    l.float32 = false;
    l.head_dims = [](int64_t h, int64_t hv) {
      return h < (int64_t{1} << 30) && hv < (int64_t{1} << 30) &&
             HasHeadDims(static_cast<int>(h), static_cast<int>(hv));
    };
    l.head_dims_text = HeadDimPairsText;
    l.int32_sizes = true;
    return l;
  }();
  return limits;
}

inline ffi::Error ToError(const char* target, const LaunchError& err) {
  return err.empty() ? ffi::Error::Success() : ffi::Error::Internal(std::string(target) + ": " + err);
}

inline DenseType DenseTypeOf(boundary::Dtype t) {
  return t == boundary::Dtype::kF16    ? DenseType::kF16
         : t == boundary::Dtype::kBF16 ? DenseType::kBf16
                                       : DenseType::kF32;
}

// The validated call (ffi/boundary.h) as the kernels see it.
inline void ToParams(const boundary::Problem& b, AttentionParams* p, ElementType* dtype) {
  // A window wider than 2^32 reaches past any int32 offset: the same as 2^32, which keeps
  // offset ± window exact in 64 bits.
  auto window = [](int64_t w) { return w < 0 ? int64_t{-1} : (w < (int64_t{1} << 32) ? w : (int64_t{1} << 32)); };
  p->batch = static_cast<int>(b.batch);
  p->q_len = static_cast<int>(b.q_len);
  p->kv_len = static_cast<int>(b.kv_len);
  p->q_heads = static_cast<int>(b.q_heads);
  p->kv_heads = static_cast<int>(b.kv_heads);
  p->head_dim = static_cast<int>(b.head_dim);
  p->v_head_dim = static_cast<int>(b.v_head_dim);
  p->scale = b.attributes.scale;
  p->softcap = b.attributes.softcap;
  p->window_left = window(b.attributes.window_left);
  p->window_right = window(b.attributes.window_right);
  p->use_segment_ids = b.attributes.use_segment_ids;
  p->q_lengths = b.q_lengths;
  p->kv_lengths = b.kv_lengths;
  p->q_segment_ids = b.q_segment_ids;
  p->kv_segment_ids = b.kv_segment_ids;
  p->q_offsets = b.q_offsets;
  p->q = static_cast<const uint16_t*>(b.q);
  p->k = static_cast<const uint16_t*>(b.k);
  p->v = static_cast<const uint16_t*>(b.v);
  p->dropout_rate = b.attributes.dropout_rate;
  p->dropout_seed = b.dropout_seed;
  if (b.bias.present) p->bias = DenseOperand::of(b.bias.data, DenseTypeOf(b.bias.dtype), b.bias.dims);
  if (b.mask.present) p->mask = DenseOperand::of(b.mask.data, DenseType::kBool, b.mask.dims);
  if (b.block_mask.present()) {
    const boundary::BlockMask& m = b.block_mask;
    p->blocks.states = reinterpret_cast<const uint8_t*>(m.states);
    p->blocks.slots = m.slots;
    p->blocks.bits = m.bits;
    p->blocks.block_q = static_cast<int>(m.block_q);
    p->blocks.block_k = static_cast<int>(m.block_k);
    p->blocks.batch = static_cast<int>(m.batch);
    p->blocks.heads = static_cast<int>(m.heads);
    p->blocks.q_blocks = static_cast<int>(m.q_blocks);
    p->blocks.kv_blocks = static_cast<int>(m.kv_blocks);
    p->blocks.words = static_cast<int>(m.words);
    // Slots past 2^31 - 1 cannot occur (they index [P, block_q, words] u32 in memory).
    p->blocks.capacity =
        static_cast<int>(m.partial_capacity < (int64_t{1} << 31) ? m.partial_capacity : (int64_t{1} << 31) - 1);
  }
  p->sinks = b.sinks;
  if (b.page_table != nullptr) {
    p->page_table = b.page_table;
    p->page_size = static_cast<int>(b.page_size);
    p->max_pages = static_cast<int>(b.max_pages);
    p->num_pages = static_cast<int>(b.num_pages);
  }
  *dtype = b.dtype == boundary::Dtype::kF16 ? ElementType::kF16 : ElementType::kBf16;
}

inline LaunchError Poison(const ffi::AnyBuffer& buffer, Stream stream) {
  return FillAsync(buffer.untyped_data(), nonfinite::kNanFillByte, buffer.size_bytes(), stream);
}

// The backward's dbias result (the bias' shape, f32) and dbias_accum workspace, and where the
// main kernel writes dbias (kernels/bias.h): straight into dbias when each of its elements
// belongs to one (b, n, key) (the bias is full over B, N and S: by store, or by owned add over
// the query blocks when it is broadcast over T); else, with atomics, or in deterministic mode
// into dbias_accum [B, N, Tb, S], summed into dbias after. Both are zeroed first.
// (dbias itself is checked by the boundary, boundary::CheckDbias.)
inline void CheckDbiasWorkspace(Checker& check, const boundary::Problem& b, bool deterministic,
                                ffi::Result<ffi::AnyBuffer>& dbias_accum) {
  if (!b.bias.present) return check.Expect("dbias_accum", *dbias_accum, {0}, ffi::DataType::F32);
  const int64_t (&bias_dims)[4] = b.bias.dims;
  const int64_t B = b.batch, N = b.q_heads, S = b.kv_len;
  const bool owned = bias_dims[0] == B && bias_dims[1] == N && bias_dims[3] == S;
  if (deterministic && !owned) {
    check.Expect("dbias_accum", *dbias_accum, {B, N, bias_dims[2], S}, ffi::DataType::F32);
  } else {
    check.Expect("dbias_accum", *dbias_accum, {0}, ffi::DataType::F32);
  }
}

// Where the main kernel writes dbias, after the checks; zeroes dbias (and the workspace).
inline ffi::Error PrepareDbias(const char* target, const boundary::Problem& b, bool deterministic,
                               ffi::Result<ffi::AnyBuffer>& dbias, ffi::Result<ffi::AnyBuffer>& dbias_accum,
                               AttentionParams* p, Stream stream) {
  if (!b.bias.present) return ffi::Error::Success();
  const int64_t (&bias_dims)[4] = b.bias.dims;
  const int64_t B = p->batch, N = p->q_heads, T = p->q_len, S = p->kv_len;
  const bool owned = bias_dims[0] == B && bias_dims[1] == N && bias_dims[3] == S;
  const DbiasWrite write = bias_dims[2] == T ? DbiasWrite::kStore : DbiasWrite::kOwnedAdd;
  const bool workspace = deterministic && !owned;
  ffi::Result<ffi::AnyBuffer>& into = workspace ? dbias_accum : dbias;
  const int64_t dims[4] = {workspace ? B : bias_dims[0], workspace ? N : bias_dims[1], bias_dims[2],
                           workspace ? S : bias_dims[3]};
  const DenseOperand strides = DenseOperand::of(nullptr, DenseType::kF32, dims);
  p->dbias.data = static_cast<float*>(into->untyped_data());
  p->dbias.stride_b = strides.stride_b;
  p->dbias.stride_n = strides.stride_n;
  p->dbias.stride_t = strides.stride_t;
  p->dbias.stride_s = strides.stride_s;
  p->dbias.write = owned || workspace ? write : DbiasWrite::kAtomic;
  if (workspace) {
    p->dbias_out = static_cast<float*>(dbias->untyped_data());
    for (int i = 0; i < 4; ++i) p->dbias_dims[i] = bias_dims[i];
  }
  if (into->size_bytes() == 0) {  // nothing to accumulate (B, N or S is 0): dbias is 0
    p->dbias = DbiasTarget{};
    p->dbias_out = nullptr;
    return ToError(target, FillAsync(dbias->untyped_data(), 0, dbias->size_bytes(), stream));
  }
  return ToError(target, FillAsync(into->untyped_data(), 0, into->size_bytes(), stream));
}

// The forward's decoding settings (kernels/fwd.h): GQA packing (the boundary's rule, at most the
// rows of the forward's tile: the decoding tile's with decode_tile, else the layout's); and split-KV, whose chunk count
// C is the partial workspaces' leading dim ([0] for both: no split), never with dropout (its keep-mask is drawn per
// whole row).
inline void CheckDecoding(Checker& check, const boundary::Problem& b, bool pack_gqa, Layout layout, bool decode_tile,
                          ffi::Result<ffi::AnyBuffer>& partial_out, ffi::Result<ffi::AnyBuffer>& partial_lse,
                          AttentionParams* p) {
  if (!check.ok()) return;
  const int rows = decode_tile ? kDecodeRows : TileShapeFor(Pass::kForward, b.head_dim, b.v_head_dim, layout).block_q;
  boundary::CheckGqaPacking(check, pack_gqa, rows, b);
  if (!check.ok()) return;
  p->pack_gqa = pack_gqa;
  const int64_t B = b.batch, T = b.q_len, N = b.q_heads, Hv = b.v_head_dim;
  auto dims = partial_out->dimensions();
  if (dims.size() == 1) {
    check.Expect("partial_out", *partial_out, {0}, ffi::DataType::F32);
    return check.Expect("partial_lse", *partial_lse, {0}, ffi::DataType::F32);
  }
  const int64_t C = dims.size() == 5 ? dims[0] : 0;
  if (C < 2 || C > 1024)
    return check.Fail(
        "partial_out must be [0] f32 (no split) or [C, B, T, N, Hv] f32 with 2 <= C <= 1024 key "
        "chunks, got " +
        Describe(*partial_out));
  check.Expect("partial_out", *partial_out, {C, B, T, N, Hv}, ffi::DataType::F32);
  check.Expect("partial_lse", *partial_lse, {C, B, N, T}, ffi::DataType::F32);
  if (!check.ok()) return;
  if (b.attributes.dropout_rate > 0.0f)
    return check.Fail("split-KV (partial_out " + Describe(*partial_out) + ") is not used with dropout");
  p->kv_splits = static_cast<int>(C);
  p->partial_out = static_cast<float*>(partial_out->untyped_data());
  p->partial_lse = static_cast<float*>(partial_lse->untyped_data());
}

// The forward's route operand: [0] s32, no route (the plain_kernel attribute picks the one
// kernel launched), or [1] s32, a routed call: the general kernel is launched and, with
// plain_kernel, the plain kernel beside it, each running where the route says
// (AttentionParams::route). A routed call has no dense bias (a route may ask the general kernel
// to scan V itself, kernels/nonfinite.h, which takes a −inf logit for a masked key) and no
// split-KV (the combine kernel would merge the partials of a kernel that did not run).
inline void CheckRoute(Checker& check, const ffi::AnyBuffer& route, AttentionParams* p) {
  if (!check.ok()) return;
  auto dims = route.dimensions();
  if (route.element_type() != ffi::DataType::S32 || dims.size() != 1 || dims[0] > 1)
    return check.Fail("route must be [0] s32 (no route) or [1] s32, got " + Describe(route));
  if (dims[0] == 0) return;
  if (p->bias.data != nullptr) return check.Fail("a routed call (route [1] s32) has no dense bias");
  if (p->kv_splits > 1) return check.Fail("a routed call (route [1] s32) does not split the keys (split-KV)");
  p->route = static_cast<const int32_t*>(route.untyped_data());
}

// The backward's route operand: [0] s32, no route (plain_kernel alone picks the kernel), or
// [1] s32, a routed call: the general main kernel is launched and, with plain_kernel, the plain
// one beside it, each running where the route says (kRoutePlain: the plain kernel).
inline void CheckBackwardRoute(Checker& check, const ffi::AnyBuffer& route, AttentionParams* p) {
  if (!check.ok()) return;
  auto dims = route.dimensions();
  if (route.element_type() != ffi::DataType::S32 || dims.size() != 1 || dims[0] > 1)
    return check.Fail("route must be [0] s32 (no route) or [1] s32, got " + Describe(route));
  if (dims[0] == 1) p->route = static_cast<const int32_t*>(route.untyped_data());
}

// The layout attribute (kernels/dispatch.h).
inline void CheckLayout(Checker& check, std::string_view name, Layout* layout) {
  if (!check.ok()) return;
  if (auto e = LayoutFromName(name, layout); !e.empty()) check.Fail(e);
}

// ---- handler bodies -------------------------------------------------------------------------

inline ffi::Error Forward(const char* target, Stream stream, const boundary::ForwardCall& call, ffi::AnyBuffer route,
                          ffi::Result<ffi::AnyBuffer> partial_out, ffi::Result<ffi::AnyBuffer> partial_lse,
                          bool pack_gqa, std::string_view layout_name, bool plain_kernel, bool decode_tile) {
  Checker check(target);
  boundary::Problem described;
  boundary::DescribeForward(check, CudaLimits(), call, &described);
  AttentionParams p;
  ElementType dtype = ElementType::kBf16;
  if (check.ok()) ToParams(described, &p, &dtype);
  Layout layout = Layout::kWarp16;
  CheckLayout(check, layout_name, &layout);
  CheckDecoding(check, described, pack_gqa, layout, decode_tile, partial_out, partial_lse, &p);
  CheckRoute(check, route, &p);
  if (check.ok() && plain_kernel) {
    if (const char* why = PlainForwardRefusal(p))
      check.Fail(std::string("plain_kernel=true needs a call without optional features; this one has ") + why);
    p.plain = true;
  }
  if (check.ok() && decode_tile) {
    if (const char* why = DecodeTileRefusal(p))
      check.Fail(std::string("decode_tile=true needs at most 16 query rows per tile (T, or G with pack_gqa) and no "
                             "plain_kernel; this call has ") +
                 why);
    p.decode_tile = true;
  }
  if (!check.ok()) return check.error();
  p.out = static_cast<uint16_t*>(call.out.untyped_data());
  p.lse = static_cast<float*>(call.lse.untyped_data());
  // poison_outputs (the test suite's setting): results filled with NaN bytes before the kernels
  // run, so an element a kernel forgets to write shows up.
  if (described.attributes.poison_outputs) {
    for (const ffi::AnyBuffer& r : {call.out, call.lse, *partial_out, *partial_lse}) {
      if (auto e = ToError(target, Poison(r, stream)); e.failure()) return e;
    }
  }
  if (p.route == nullptr) return ToError(target, DispatchForward(dtype, layout, p, stream));
  AttentionParams general = p;
  general.plain = false;
  general.plain_beside = p.plain;
  if (auto e = ToError(target, DispatchForward(dtype, layout, general, stream)); e.failure() || !p.plain) return e;
  return ToError(target, DispatchForward(dtype, layout, p, stream));
}

inline ffi::Error Backward(const char* target, Stream stream, const boundary::BackwardCall& call, ffi::AnyBuffer route,
                           ffi::Result<ffi::AnyBuffer> dk_accum, ffi::Result<ffi::AnyBuffer> dv_accum,
                           ffi::Result<ffi::AnyBuffer> dbias_accum, ffi::Result<ffi::AnyBuffer> dbias,
                           std::string_view layout_name, bool plain_kernel) {
  Checker check(target);
  boundary::Problem described;
  boundary::DescribeBackward(check, CudaLimits(), call, &described);
  AttentionParams p;
  ElementType dtype = ElementType::kBf16;
  if (check.ok()) ToParams(described, &p, &dtype);
  const int64_t B = described.batch, T = described.q_len, S = described.kv_len, N = described.q_heads,
                H = described.head_dim, Hv = described.v_head_dim;
  check.Expect("dq_accum", call.dq_accum, {B, T, N, H}, ffi::DataType::F32);
  // The dK, dV workspaces choose the main kernel's grid: [B, S, N, H] and [B, S, N, Hv] f32 the
  // q_heads grid (one CTA per query head, the group summed after), [0] f32 the kv_heads grid.
  const bool q_heads_grid = dk_accum->dimensions().size() == 4;
  if (check.ok()) {
    Checker grid(target);
    for (auto [name, r, width] : {std::tuple{"dk_accum", &dk_accum, H}, std::tuple{"dv_accum", &dv_accum, Hv}}) {
      if (q_heads_grid) {
        grid.Expect(name, **r, {B, S, N, width}, ffi::DataType::F32);
      } else {
        grid.Expect(name, **r, {0}, ffi::DataType::F32);
      }
    }
    if (!grid.ok())
      check.Fail("dk_accum and dv_accum must both be f32, " + boundary::ShapeText({B, S, N, H}) + " and " +
                 boundary::ShapeText({B, S, N, Hv}) + " (the q_heads grid) or [0] (the kv_heads grid), got dk_accum " +
                 Describe(*dk_accum) + ", dv_accum " + Describe(*dv_accum));
  }
  CheckDbiasWorkspace(check, described, call.deterministic, dbias_accum);
  boundary::CheckDbias(check, *dbias, described);
  Layout layout = Layout::kWarp16;
  CheckLayout(check, layout_name, &layout);
  CheckBackwardRoute(check, route, &p);
  if (check.ok() && plain_kernel) {
    if (const char* why = PlainBackwardRefusal(p, call.deterministic))
      check.Fail(std::string("plain_kernel=true needs a backward without per-score features; this one has ") + why);
    p.plain = true;
  }
  if (!check.ok()) return check.error();
  p.out = static_cast<uint16_t*>(const_cast<void*>(described.out));
  p.dout = static_cast<const uint16_t*>(described.dout);
  p.lse_in = described.lse;
  p.dlse = described.dlse;
  p.dq = static_cast<uint16_t*>(call.dq.untyped_data());
  p.dk = static_cast<uint16_t*>(call.dk.untyped_data());
  p.dv = static_cast<uint16_t*>(call.dv.untyped_data());
  p.dq_accum = static_cast<float*>(call.dq_accum.untyped_data());
  p.delta = static_cast<float*>(call.delta.untyped_data());
  if (q_heads_grid && B * S * N * H > 0) {
    p.dk_accum = static_cast<float*>(dk_accum->untyped_data());
    p.dv_accum = static_cast<float*>(dv_accum->untyped_data());
  }
  if (described.attributes.poison_outputs) {
    for (const ffi::AnyBuffer& r : {call.dq, call.dk, call.dv, call.delta, *dk_accum, *dv_accum}) {
      if (auto e = ToError(target, Poison(r, stream)); e.failure()) return e;
    }
  }
  if (auto e = PrepareDbias(target, described, call.deterministic, dbias, dbias_accum, &p, stream); e.failure())
    return e;
  return ToError(target, DispatchBackward(dtype, layout, p, call.deterministic, stream));
}

}  // namespace kernels
}  // namespace jax_flash
