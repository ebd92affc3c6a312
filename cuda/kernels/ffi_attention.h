// The FFI boundary of the CUDA kernels, shared by the platform "CUDA" handlers
// (kernels/handlers.cu) and the emulated platform "cpu" handlers (emu/targets.cc): the
// signature of each target (cuda/README.md, exactly), the one validation of operands against
// each other, and the handler bodies. Only how the stream is obtained differs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

// The XLA headers come first: the emulation's simt.h redefines CUDA keywords as macros.
#include "xla/ffi/api/ffi.h"

#include "kernels/dispatch.h"
#include "kernels/params.h"
#include "kernels/platform.h"
#include "ffi/softcap.h"

namespace jax_flash {
namespace kernels {

namespace ffi = xla::ffi;

// ---- signatures -----------------------------------------------------------------------------

template <class Binding>
auto WithMaskOperandsAndAttributes(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // q_lengths [B] s32
      .template Arg<ffi::AnyBuffer>()  // kv_lengths [B] s32
      .template Arg<ffi::AnyBuffer>()  // q_segment_ids [B, T] s32
      .template Arg<ffi::AnyBuffer>()  // kv_segment_ids [B, S] s32
      .template Arg<ffi::AnyBuffer>()  // q_offset [B] s32
      .template Arg<ffi::AnyBuffer>()  // bias [B|1, N|1, T|1, S|1] f16/bf16/f32, or [0] f32: none
      .template Arg<ffi::AnyBuffer>()  // mask [B|1, N|1, T|1, S|1] pred (true: may attend), or [0] pred: none
      .template Attr<float>("scale")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right")
      .template Attr<float>("softcap")
      .template Attr<bool>("use_segment_ids")
      .template Attr<float>("dropout_rate")
      .template Attr<std::string_view>("layout")  // "warp16" or "warp32" (kernels/tile.h)
      .template Attr<bool>("poison_outputs");     // fill the results with NaN first (tests)
}

// jax_flash_fwd / jax_flash_emu_fwd.
template <class Binding>
auto ForwardSignature(Binding binding) {
  return WithMaskOperandsAndAttributes(std::move(binding)
                                           .template Arg<ffi::AnyBuffer>()   // q [B, T, N, H]
                                           .template Arg<ffi::AnyBuffer>()   // k [B, S, K, H]
                                           .template Arg<ffi::AnyBuffer>())  // v [B, S, K, Hv]
      .template Arg<ffi::AnyBuffer>()                                        // sinks [N] f32 (-inf: none)
      .template Arg<ffi::AnyBuffer>()                                        // dropout_seed [2] u32
      .template Attr<bool>("pack_gqa")  // T = 1: the G query heads of a kv head in one tile
      .template Ret<ffi::AnyBuffer>()   // out [B, T, N, Hv]
      .template Ret<ffi::AnyBuffer>()   // lse [B, N, T] f32
      .template Ret<ffi::AnyBuffer>()   // partial_out [C, B, T, N, Hv] f32 workspace (split-KV into C >= 2 chunks), or [0] f32
      .template Ret<ffi::AnyBuffer>();  // partial_lse [C, B, N, T] f32 workspace, or [0] f32
}

// jax_flash_paged_fwd / jax_flash_emu_paged_fwd: the forward over a paged KV cache, the page
// table first, then the forward's operands with k, v as pages [num_pages, page_size, K, H|Hv].
template <class Binding>
auto PagedForwardSignature(Binding binding) {
  return ForwardSignature(std::move(binding).template Arg<ffi::AnyBuffer>());  // page_table [B, max_pages] s32
}

// jax_flash_bwd / jax_flash_emu_bwd.
template <class Binding>
auto BackwardSignature(Binding binding) {
  return WithMaskOperandsAndAttributes(std::move(binding)
                                           .template Arg<ffi::AnyBuffer>()   // q
                                           .template Arg<ffi::AnyBuffer>()   // k
                                           .template Arg<ffi::AnyBuffer>()   // v
                                           .template Arg<ffi::AnyBuffer>()   // out [B, T, N, Hv]
                                           .template Arg<ffi::AnyBuffer>()   // dout [B, T, N, Hv]
                                           .template Arg<ffi::AnyBuffer>()   // lse [B, N, T] f32
                                           .template Arg<ffi::AnyBuffer>())  // dlse [B, N, T] f32
      .template Arg<ffi::AnyBuffer>()   // dropout_seed [2] u32
      .template Attr<bool>("deterministic")
      .template Ret<ffi::AnyBuffer>()   // dq [B, T, N, H]
      .template Ret<ffi::AnyBuffer>()   // dk [B, S, K, H]
      .template Ret<ffi::AnyBuffer>()   // dv [B, S, K, Hv]
      .template Ret<ffi::AnyBuffer>()   // dq_accum [B, T, N, H] f32 workspace
      .template Ret<ffi::AnyBuffer>()   // delta [B, N, T] f32 workspace
      .template Ret<ffi::AnyBuffer>()   // dk_accum [B, S, N, H] f32 workspace (q_heads grid), or [0] f32
      .template Ret<ffi::AnyBuffer>()   // dv_accum [B, S, N, Hv] f32 (q_heads grid), or [0] f32
      .template Ret<ffi::AnyBuffer>()   // dbias_accum [B, N, Tb, S] f32 workspace (deterministic, a bias broadcast over B, N or S), or [0] f32
      .template Ret<ffi::AnyBuffer>();  // dbias: the bias operand's shape f32, or [0] f32: no bias
}

// ---- validation -----------------------------------------------------------------------------

inline const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::PRED: return "bool";
    default: return "another dtype";
  }
}

inline std::string Describe(const ffi::AnyBuffer& buffer) {
  std::string s = "[";
  auto dims = buffer.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "] " + DtypeName(buffer.element_type());
}

// Checks that `buffer` has exactly `shape` and `dtype`.
inline ffi::Error Expect(const char* target, const char* name, const ffi::AnyBuffer& buffer,
                         std::initializer_list<int64_t> shape, ffi::DataType dtype) {
  auto dims = buffer.dimensions();
  bool ok = buffer.element_type() == dtype && dims.size() == shape.size();
  size_t i = 0;
  for (int64_t d : shape) ok = ok && dims[i++] == d;
  if (ok) return ffi::Error::Success();
  std::string want = "[";
  i = 0;
  for (int64_t d : shape) want += (i++ ? ", " : "") + std::to_string(d);
  return ffi::Error::InvalidArgument(std::string(target) + ": " + name + " must be " + want + "] " +
                                     DtypeName(dtype) + ", got " + Describe(buffer));
}

// The operands every target shares, checked against each other; fills the shapes, masks and
// attributes of `p` and the element type.
inline ffi::Error CheckOperands(const char* target, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                const ffi::AnyBuffer& v, const ffi::AnyBuffer& q_lengths,
                                const ffi::AnyBuffer& kv_lengths, const ffi::AnyBuffer& q_segment_ids,
                                const ffi::AnyBuffer& kv_segment_ids, const ffi::AnyBuffer& q_offsets,
                                float scale, int64_t window_left,
                                int64_t window_right, float softcap, bool use_segment_ids, AttentionParams* p,
                                ElementType* dtype, const ffi::AnyBuffer* page_table = nullptr) {
  const std::string where = target;
  const char* k_layout = page_table != nullptr ? "[num_pages, page_size, K, H]" : "[B, S, K, H]";
  if (q.dimensions().size() != 4 || k.dimensions().size() != 4)
    return ffi::Error::InvalidArgument(where + ": q and k must be [B, T, N, H] and " + k_layout + ", got q " +
                                       Describe(q) + ", k " + Describe(k));
  const ffi::DataType t = q.element_type();
  if (t != ffi::DataType::F16 && t != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument(where + ": q must be float16 or bfloat16 (the CUDA kernels), got " +
                                       Describe(q));
  auto qd = q.dimensions(), kd = k.dimensions();
  const int64_t B = qd[0], T = qd[1], N = qd[2], H = qd[3], K = kd[2];
  // The value head dim Hv may differ from H where an (H, Hv) pair is instantiated (below).
  const int64_t Hv = v.dimensions().size() == 4 ? v.dimensions()[3] : H;
  int64_t S = kd[1];
  if (page_table != nullptr) {
    // A paged cache: S is the table's capacity, max_pages · page_size.
    const int64_t P = kd[0], page_size = kd[1];
    auto td = page_table->dimensions();
    if (td.size() != 2 || page_table->element_type() != ffi::DataType::S32 || td[0] != B)
      return ffi::Error::InvalidArgument(where + ": page_table must be [B, max_pages] int32 with B = " +
                                         std::to_string(B) + ", got " + Describe(*page_table));
    if (P < 1 || page_size < 1 || td[1] < 1 || td[1] * page_size >= (int64_t{1} << 30) || P >= (int64_t{1} << 31))
      return ffi::Error::InvalidArgument(where + ": the paged cache needs num_pages >= 1, page_size >= 1, max_pages "
                                         ">= 1 and max_pages · page_size < 2^30, got k " + Describe(k) +
                                         ", page_table " + Describe(*page_table));
    S = td[1] * page_size;
    if (auto e = Expect(target, "k", k, {P, page_size, K, H}, t); e.failure()) return e;
    if (auto e = Expect(target, "v", v, {P, page_size, K, Hv}, t); e.failure()) return e;
    p->page_table = static_cast<const int32_t*>(page_table->untyped_data());
    p->page_size = static_cast<int>(page_size);
    p->max_pages = static_cast<int>(td[1]);
    p->num_pages = static_cast<int>(P);
  } else {
    if (auto e = Expect(target, "k", k, {B, S, K, H}, t); e.failure()) return e;
    if (auto e = Expect(target, "v", v, {B, S, K, Hv}, t); e.failure()) return e;
  }
  if (auto e = Expect(target, "q_lengths", q_lengths, {B}, ffi::DataType::S32); e.failure()) return e;
  if (auto e = Expect(target, "kv_lengths", kv_lengths, {B}, ffi::DataType::S32); e.failure()) return e;
  if (auto e = Expect(target, "q_segment_ids", q_segment_ids, {B, T}, ffi::DataType::S32); e.failure()) return e;
  if (auto e = Expect(target, "kv_segment_ids", kv_segment_ids, {B, S}, ffi::DataType::S32); e.failure()) return e;
  if (auto e = Expect(target, "q_offset", q_offsets, {B}, ffi::DataType::S32); e.failure()) return e;
  if (!HasHeadDims(static_cast<int>(H), static_cast<int>(Hv)))
    return ffi::Error::InvalidArgument(where + ": no compiled kernel for the query/key head dim H = " +
                                       std::to_string(H) + " with the value head dim Hv = " + std::to_string(Hv) +
                                       " (the (H, Hv) pairs with kernels: " + HeadDimPairsText() + "); got q " +
                                       Describe(q) + ", v " + Describe(v));
  if (K <= 0 || N % K != 0)
    return ffi::Error::InvalidArgument(where + ": query heads N=" + std::to_string(N) +
                                       " must be a multiple of kv heads K=" + std::to_string(K));
  // Batch and heads fold into grid.x (kernels/grid.h): only the kernels' int arithmetic bounds them.
  if (B >= (int64_t{1} << 31) || N >= (int64_t{1} << 31) || T >= (int64_t{1} << 30) || S >= (int64_t{1} << 30))
    return ffi::Error::InvalidArgument(where + ": batch and heads must be < 2^31 and T, S < 2^30, got q " +
                                       Describe(q) + ", k " + Describe(k));
  if (!std::isfinite(scale))
    return ffi::Error::InvalidArgument(where + ": scale must be finite, got " + std::to_string(scale));
  // 0 is "off"; a cap below float32's smallest normal has no finite 1 / softcap.
  if (!SoftcapIsOffOrNormal(softcap))
    return ffi::Error::InvalidArgument(where + ": softcap must be 0 (off) or a finite float32 normal > 0, got " +
                                       SoftcapString(softcap));
  if (window_left < -1 || window_right < -1)
    return ffi::Error::InvalidArgument(where + ": window_left and window_right must be >= 0 or -1 (unbounded), got (" +
                                       std::to_string(window_left) + ", " + std::to_string(window_right) + ")");
  // A window wider than 2^32 reaches past any int32 offset: the same as 2^32, which keeps
  // offset ± window exact in 64 bits.
  auto window = [](int64_t w) { return w < 0 ? int64_t{-1} : (w < (int64_t{1} << 32) ? w : (int64_t{1} << 32)); };
  p->batch = static_cast<int>(B);
  p->q_len = static_cast<int>(T);
  p->kv_len = static_cast<int>(S);
  p->q_heads = static_cast<int>(N);
  p->kv_heads = static_cast<int>(K);
  p->head_dim = static_cast<int>(H);
  p->v_head_dim = static_cast<int>(Hv);
  p->scale = scale;
  p->softcap = softcap;
  p->window_left = window(window_left);
  p->window_right = window(window_right);
  p->use_segment_ids = use_segment_ids;
  p->q_lengths = static_cast<const int32_t*>(q_lengths.untyped_data());
  p->kv_lengths = static_cast<const int32_t*>(kv_lengths.untyped_data());
  p->q_segment_ids = static_cast<const int32_t*>(q_segment_ids.untyped_data());
  p->kv_segment_ids = static_cast<const int32_t*>(kv_segment_ids.untyped_data());
  p->q_offsets = static_cast<const int32_t*>(q_offsets.untyped_data());
  p->q = static_cast<const uint16_t*>(q.untyped_data());
  p->k = static_cast<const uint16_t*>(k.untyped_data());
  p->v = static_cast<const uint16_t*>(v.untyped_data());
  *dtype = t == ffi::DataType::F16 ? ElementType::kF16 : ElementType::kBf16;
  return ffi::Error::Success();
}

// The dropout operand and attribute: seed [2] u32 (the key's words) and rate in [0, 1).
inline ffi::Error CheckDropout(const char* target, const ffi::AnyBuffer& seed, float rate, AttentionParams* p) {
  if (auto e = Expect(target, "dropout_seed", seed, {2}, ffi::DataType::U32); e.failure()) return e;
  if (!(rate >= 0.0f && rate < 1.0f))
    return ffi::Error::InvalidArgument(std::string(target) + ": dropout_rate must be in [0, 1), got " +
                                       std::to_string(rate));
  p->dropout_rate = rate;
  p->dropout_seed = static_cast<const uint32_t*>(seed.untyped_data());
  return ffi::Error::Success();
}

inline ffi::Error ToError(const char* target, const LaunchError& err) {
  return err.empty() ? ffi::Error::Success() : ffi::Error::Internal(std::string(target) + ": " + err);
}

// One dense operand (cuda/README.md): [0] (of `none_type`) when the call has none, else
// [B|1, N|1, T|1, S|1] of one of `types`; fills `dims` and returns whether it is present.
inline ffi::Error CheckDenseOperand(const char* target, const char* name, const ffi::AnyBuffer& x,
                                    ffi::DataType none_type, std::initializer_list<ffi::DataType> types,
                                    const AttentionParams& p, int64_t (&dims)[4], bool* present) {
  auto d = x.dimensions();
  *present = !(d.size() == 1 && d[0] == 0);
  if (!*present) return Expect(target, name, x, {0}, none_type);
  const int64_t full[4] = {p.batch, p.q_heads, p.q_len, p.kv_len};
  bool ok = d.size() == 4;
  for (size_t i = 0; ok && i < 4; ++i) {
    dims[i] = d[i];
    ok = d[i] == 1 || d[i] == full[i];
  }
  bool typed = false;
  for (ffi::DataType t : types) typed = typed || x.element_type() == t;
  if (ok && typed) return ffi::Error::Success();
  std::string allowed;
  for (ffi::DataType t : types) allowed += (allowed.empty() ? "" : " / ") + std::string(DtypeName(t));
  return ffi::Error::InvalidArgument(std::string(target) + ": " + name + " must be [0] " + DtypeName(none_type) +
                                     " (none) or [B|1, N|1, T|1, S|1] " + allowed + " with [B, N, T, S] = [" +
                                     std::to_string(full[0]) + ", " + std::to_string(full[1]) + ", " +
                                     std::to_string(full[2]) + ", " + std::to_string(full[3]) + "], got " +
                                     Describe(x));
}

// The dense bias (f32 / f16 / bf16) and mask (pred) operands: fills p->bias and p->mask (data
// null when absent) and, when present, the bias' dims.
inline ffi::Error CheckDenseOperands(const char* target, const ffi::AnyBuffer& bias, const ffi::AnyBuffer& mask,
                                     AttentionParams* p, int64_t (&bias_dims)[4]) {
  bool present = false;
  if (auto e = CheckDenseOperand(target, "bias", bias, ffi::DataType::F32,
                                 {ffi::DataType::F32, ffi::DataType::F16, ffi::DataType::BF16}, *p, bias_dims,
                                 &present);
      e.failure())
    return e;
  if (present) {
    const ffi::DataType t = bias.element_type();
    const DenseType type = t == ffi::DataType::F16 ? DenseType::kF16
                           : t == ffi::DataType::BF16 ? DenseType::kBf16 : DenseType::kF32;
    p->bias = DenseOperand::of(bias.untyped_data(), type, bias_dims);
  }
  int64_t mask_dims[4];
  if (auto e = CheckDenseOperand(target, "mask", mask, ffi::DataType::PRED, {ffi::DataType::PRED}, *p, mask_dims,
                                 &present);
      e.failure())
    return e;
  if (present) p->mask = DenseOperand::of(mask.untyped_data(), DenseType::kBool, mask_dims);
  return ffi::Error::Success();
}

// The backward's dbias result (the bias' shape, f32) and dbias_accum workspace, and where the
// main kernel writes dbias (kernels/bias.h): straight into dbias when each of its elements
// belongs to one (b, n, key) (the bias is full over B, N and S: by store, or by owned add over
// the query blocks when it is broadcast over T); else, with atomics, or in deterministic mode
// into dbias_accum [B, N, Tb, S], summed into dbias after. Both are zeroed first.
inline ffi::Error CheckDbias(const char* target, const int64_t (&bias_dims)[4], bool deterministic,
                             ffi::Result<ffi::AnyBuffer>& dbias, ffi::Result<ffi::AnyBuffer>& dbias_accum,
                             AttentionParams* p, Stream stream) {
  if (p->bias.data == nullptr) {
    if (auto e = Expect(target, "dbias", *dbias, {0}, ffi::DataType::F32); e.failure()) return e;
    return Expect(target, "dbias_accum", *dbias_accum, {0}, ffi::DataType::F32);
  }
  const int64_t B = p->batch, N = p->q_heads, T = p->q_len, S = p->kv_len;
  if (auto e = Expect(target, "dbias", *dbias, {bias_dims[0], bias_dims[1], bias_dims[2], bias_dims[3]},
                      ffi::DataType::F32);
      e.failure())
    return e;
  const bool owned = bias_dims[0] == B && bias_dims[1] == N && bias_dims[3] == S;
  const DbiasWrite write = bias_dims[2] == T ? DbiasWrite::kStore : DbiasWrite::kOwnedAdd;
  const bool workspace = deterministic && !owned;
  if (auto e = workspace ? Expect(target, "dbias_accum", *dbias_accum, {B, N, bias_dims[2], S}, ffi::DataType::F32)
                         : Expect(target, "dbias_accum", *dbias_accum, {0}, ffi::DataType::F32);
      e.failure())
    return e;
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

// The forward's decoding settings (kernels/fwd.h): GQA packing, which needs T = 1, G <= the
// forward's 128-row tile and no per-head operand (dense bias or mask, dropout); and split-KV,
// whose chunk count C is the partial workspaces' leading dim ([0] for both: no split), never
// with dropout (its keep-mask is drawn per whole row).
inline ffi::Error CheckDecoding(const char* target, bool pack_gqa, ffi::Result<ffi::AnyBuffer>& partial_out,
                                ffi::Result<ffi::AnyBuffer>& partial_lse, AttentionParams* p) {
  const std::string where = target;
  const int64_t B = p->batch, T = p->q_len, N = p->q_heads, Hv = p->v_head_dim, G = N / p->kv_heads;
  if (pack_gqa && (T != 1 || G > 128 || p->bias.data != nullptr || p->mask.data != nullptr || p->dropout_rate > 0.0f))
    return ffi::Error::InvalidArgument(where + ": pack_gqa needs T = 1, G = N / K <= 128, no dense bias or mask and "
                                       "no dropout; got T = " + std::to_string(T) + ", G = " + std::to_string(G) +
                                       (p->bias.data != nullptr ? ", a bias" : "") +
                                       (p->mask.data != nullptr ? ", a mask" : "") +
                                       (p->dropout_rate > 0.0f ? ", dropout" : ""));
  p->pack_gqa = pack_gqa;
  auto dims = partial_out->dimensions();
  if (dims.size() == 1) {
    if (auto e = Expect(target, "partial_out", *partial_out, {0}, ffi::DataType::F32); e.failure()) return e;
    return Expect(target, "partial_lse", *partial_lse, {0}, ffi::DataType::F32);
  }
  const int64_t C = dims.size() == 5 ? dims[0] : 0;
  if (C < 2 || C > 1024)
    return ffi::Error::InvalidArgument(where + ": partial_out must be [0] f32 (no split) or [C, B, T, N, Hv] f32 with " +
                                       "2 <= C <= 1024 key chunks, got " + Describe(*partial_out));
  if (auto e = Expect(target, "partial_out", *partial_out, {C, B, T, N, Hv}, ffi::DataType::F32); e.failure()) return e;
  if (auto e = Expect(target, "partial_lse", *partial_lse, {C, B, N, T}, ffi::DataType::F32); e.failure()) return e;
  if (p->dropout_rate > 0.0f)
    return ffi::Error::InvalidArgument(where + ": split-KV (partial_out " + Describe(*partial_out) +
                                       ") is not used with dropout");
  p->kv_splits = static_cast<int>(C);
  p->partial_out = static_cast<float*>(partial_out->untyped_data());
  p->partial_lse = static_cast<float*>(partial_lse->untyped_data());
  return ffi::Error::Success();
}

// ---- handler bodies -------------------------------------------------------------------------

inline ffi::Error Forward(const char* target, Stream stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths, ffi::AnyBuffer q_segment_ids,
                          ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer q_offsets, ffi::AnyBuffer bias,
                          ffi::AnyBuffer mask, float scale, int64_t window_left, int64_t window_right, float softcap,
                          bool use_segment_ids, float dropout_rate, std::string_view layout_name, bool poison_outputs,
                          ffi::AnyBuffer sinks, ffi::AnyBuffer dropout_seed,
                          bool pack_gqa, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                          ffi::Result<ffi::AnyBuffer> partial_out, ffi::Result<ffi::AnyBuffer> partial_lse,
                          const ffi::AnyBuffer* page_table = nullptr) {
  AttentionParams p;
  ElementType dtype;
  if (auto e = CheckOperands(target, q, k, v, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, q_offsets,
                             scale, window_left, window_right, softcap, use_segment_ids, &p, &dtype, page_table);
      e.failure())
    return e;
  if (auto e = CheckDropout(target, dropout_seed, dropout_rate, &p); e.failure()) return e;
  int64_t bias_dims[4];
  if (auto e = CheckDenseOperands(target, bias, mask, &p, bias_dims); e.failure()) return e;
  const int64_t B = p.batch, T = p.q_len, N = p.q_heads, Hv = p.v_head_dim;
  if (auto e = Expect(target, "out", *out, {B, T, N, Hv}, q.element_type()); e.failure()) return e;
  if (auto e = Expect(target, "lse", *lse, {B, N, T}, ffi::DataType::F32); e.failure()) return e;
  // Always passed (-inf when the call has none).
  if (auto e = Expect(target, "sinks", sinks, {N}, ffi::DataType::F32); e.failure()) return e;
  p.sinks = static_cast<const float*>(sinks.untyped_data());
  p.out = static_cast<uint16_t*>(out->untyped_data());
  p.lse = static_cast<float*>(lse->untyped_data());
  if (auto e = CheckDecoding(target, pack_gqa, partial_out, partial_lse, &p); e.failure()) return e;
  // poison_outputs (the test suite's setting): results filled with NaN bytes before the kernels
  // run, so an element a kernel forgets to write shows up.
  if (poison_outputs) {
    for (auto* r : {&out, &lse, &partial_out, &partial_lse}) {
      if (auto e = ToError(target, FillAsync((**r).untyped_data(), 0xFF, (**r).size_bytes(), stream)); e.failure())
        return e;
    }
  }
  Layout layout;
  if (auto e = LayoutFromName(layout_name, &layout); !e.empty()) return ffi::Error::InvalidArgument(target + (": " + e));
  return ToError(target, DispatchForward(dtype, layout, p, stream));
}

inline ffi::Error Backward(const char* target, Stream stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::AnyBuffer lse, ffi::AnyBuffer dlse,
                           ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths, ffi::AnyBuffer q_segment_ids,
                           ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer q_offsets, ffi::AnyBuffer bias,
                           ffi::AnyBuffer mask, float scale, int64_t window_left, int64_t window_right, float softcap,
                           bool use_segment_ids, float dropout_rate, std::string_view layout_name, bool poison_outputs,
                           ffi::AnyBuffer dropout_seed, bool deterministic,
                           ffi::Result<ffi::AnyBuffer> dq,
                           ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                           ffi::Result<ffi::AnyBuffer> dq_accum, ffi::Result<ffi::AnyBuffer> delta,
                           ffi::Result<ffi::AnyBuffer> dk_accum, ffi::Result<ffi::AnyBuffer> dv_accum,
                           ffi::Result<ffi::AnyBuffer> dbias_accum, ffi::Result<ffi::AnyBuffer> dbias) {
  AttentionParams p;
  ElementType dtype;
  if (auto e = CheckOperands(target, q, k, v, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, q_offsets,
                             scale, window_left, window_right, softcap, use_segment_ids, &p, &dtype);
      e.failure())
    return e;
  if (auto e = CheckDropout(target, dropout_seed, dropout_rate, &p); e.failure()) return e;
  int64_t bias_dims[4];
  if (auto e = CheckDenseOperands(target, bias, mask, &p, bias_dims); e.failure()) return e;
  const int64_t B = p.batch, T = p.q_len, S = p.kv_len, N = p.q_heads, K = p.kv_heads, H = p.head_dim,
                Hv = p.v_head_dim;
  const ffi::DataType t = q.element_type();
  if (auto e = Expect(target, "out", out, {B, T, N, Hv}, t); e.failure()) return e;
  if (auto e = Expect(target, "dout", dout, {B, T, N, Hv}, t); e.failure()) return e;
  if (auto e = Expect(target, "lse", lse, {B, N, T}, ffi::DataType::F32); e.failure()) return e;
  if (auto e = Expect(target, "dlse", dlse, {B, N, T}, ffi::DataType::F32); e.failure()) return e;
  if (auto e = Expect(target, "dq", *dq, {B, T, N, H}, t); e.failure()) return e;
  if (auto e = Expect(target, "dk", *dk, {B, S, K, H}, t); e.failure()) return e;
  if (auto e = Expect(target, "dv", *dv, {B, S, K, Hv}, t); e.failure()) return e;
  if (auto e = Expect(target, "dq_accum", *dq_accum, {B, T, N, H}, ffi::DataType::F32); e.failure()) return e;
  if (auto e = Expect(target, "delta", *delta, {B, N, T}, ffi::DataType::F32); e.failure()) return e;
  // The dK, dV workspaces choose the main kernel's grid: [B, S, N, H] and [B, S, N, Hv] f32 the
  // q_heads grid (one CTA per query head, the group summed after), [0] f32 the kv_heads grid.
  const bool q_heads_grid = dk_accum->dimensions().size() == 4;
  for (auto [name, r, width] : {std::tuple{"dk_accum", &dk_accum, H}, std::tuple{"dv_accum", &dv_accum, Hv}}) {
    auto e = q_heads_grid ? Expect(target, name, **r, {B, S, N, width}, ffi::DataType::F32)
                          : Expect(target, name, **r, {0}, ffi::DataType::F32);
    if (e.failure())
      return ffi::Error::InvalidArgument(std::string(target) + ": dk_accum and dv_accum must both be float32, [" +
                                         std::to_string(B) + ", " + std::to_string(S) + ", " + std::to_string(N) +
                                         ", " + std::to_string(H) + "] and [" + std::to_string(B) + ", " +
                                         std::to_string(S) + ", " + std::to_string(N) + ", " + std::to_string(Hv) +
                                         "] (the q_heads grid) or [0] (the kv_heads grid), got dk_accum " +
                                         Describe(*dk_accum) + ", dv_accum " + Describe(*dv_accum));
  }
  p.out = static_cast<uint16_t*>(out.untyped_data());
  p.dout = static_cast<const uint16_t*>(dout.untyped_data());
  p.lse_in = static_cast<const float*>(lse.untyped_data());
  p.dlse = static_cast<const float*>(dlse.untyped_data());
  p.dq = static_cast<uint16_t*>(dq->untyped_data());
  p.dk = static_cast<uint16_t*>(dk->untyped_data());
  p.dv = static_cast<uint16_t*>(dv->untyped_data());
  p.dq_accum = static_cast<float*>(dq_accum->untyped_data());
  p.delta = static_cast<float*>(delta->untyped_data());
  if (q_heads_grid && B * S * N * H > 0) {
    p.dk_accum = static_cast<float*>(dk_accum->untyped_data());
    p.dv_accum = static_cast<float*>(dv_accum->untyped_data());
  }
  // poison_outputs (the test suite's setting): results filled with NaN bytes before the kernels
  // run, so an element a kernel forgets to write shows up.
  if (poison_outputs) {
    for (auto* r : {&dq, &dk, &dv, &delta, &dk_accum, &dv_accum}) {
      if (auto e = ToError(target, FillAsync((**r).untyped_data(), 0xFF, (**r).size_bytes(), stream)); e.failure())
        return e;
    }
  }
  Layout layout;
  if (auto e = LayoutFromName(layout_name, &layout); !e.empty()) return ffi::Error::InvalidArgument(target + (": " + e));
  if (auto e = CheckDbias(target, bias_dims, deterministic, dbias, dbias_accum, &p, stream); e.failure()) return e;
  return ToError(target, DispatchBackward(dtype, layout, p, deterministic, stream));
}

}  // namespace kernels
}  // namespace jax_flash
