// The FFI boundary of every attention target (cuda/README.md, "The FFI targets"), written once:
// the operands, results and attributes that the cpu targets (cpu/handlers.cc), the CUDA targets
// (kernels/ffi_attention.h, kernels/handlers.cu) and the emulated ones (emu/targets_{fwd,bwd}.cc) share,
// bound here (BindForward, BindBackward), and the one validation of them against each other,
// which yields a typed description of the call (Problem). Each side then adds its own
// attributes and workspace results to the binding, checks those, and converts the Problem into
// its own parameters (cpu::Problem, kernels::AttentionParams).
//
// Host code only (it includes the XLA FFI headers); no CUDA, no kernels.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "common/softcap.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash {
namespace boundary {

namespace ffi = xla::ffi;
using Buffer = ffi::AnyBuffer;
using Result = ffi::Result<ffi::AnyBuffer>;

// ---- the signatures -------------------------------------------------------------------------

// The attributes of every target.
struct SharedAttributes {
  float scale;             // logits = scale · q·k; finite
  int64_t window_left;     // -1: unbounded
  int64_t window_right;    // -1: unbounded (causal: 0)
  float softcap;           // +0: off
  bool use_segment_ids;
  float dropout_rate;      // [0, 1); 0: off
  bool poison_outputs;     // fill the results with NaN bytes before computing (tests)
  int64_t block_q;         // a block mask's (block_q, block_k); 0, 0: no block mask
  int64_t block_k;
};
constexpr size_t kSharedAttributes = 9;

template <class Binding>
auto BindSharedAttributes(Binding&& binding) {
  return std::move(binding)
      .template Attr<float>("scale")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right")
      .template Attr<float>("softcap")
      .template Attr<bool>("use_segment_ids")
      .template Attr<float>("dropout_rate")
      .template Attr<bool>("poison_outputs")
      .template Attr<int64_t>("block_q")
      .template Attr<int64_t>("block_k");
}

// The operands of the structured and dense masks, after q, k, v (and out, dout, lse, dlse).
struct MaskOperands {
  Buffer q_lengths;       // [B] s32
  Buffer kv_lengths;      // [B] s32
  Buffer q_segment_ids;   // [B, T] s32
  Buffer kv_segment_ids;  // [B, S] s32
  Buffer q_offset;        // [B] s32
  Buffer bias;            // [B|1, N|1, T|1, S|1] f16/bf16/f32, or [0] f32: none
  Buffer mask;            // [B|1, N|1, T|1, S|1] pred (true: may attend), or [0] pred: none
  // A block mask (flex_attention's mask_mod, docs/flex.md), or [0] each: none. Blocks are
  // block_q × block_k positions (the attributes), nq = ceil(T / block_q), nk = ceil(S / block_k).
  Buffer block_states;  // [Bm, Nm, nq, nk] s8: 0 empty, 1 partly visible, 2 fully visible; Bm ∈ {1, B}, Nm ∈ {1, N}
  Buffer block_slots;  // [Bm, Nm, nq, nk] s32: a partly visible block's index into block_bits, else -1
  Buffer block_bits;  // [P, block_q, ceil(block_k / 32)] u32: bit c % 32 of word c / 32 of row r set:
                      // position (i·block_q + r, j·block_k + c) of the block in that slot may attend
};
constexpr size_t kMaskOperands = 10;

template <class Binding>
auto BindMaskOperands(Binding&& binding) {
  return std::move(binding)
      .template Arg<Buffer>()  // q_lengths
      .template Arg<Buffer>()  // kv_lengths
      .template Arg<Buffer>()  // q_segment_ids
      .template Arg<Buffer>()  // kv_segment_ids
      .template Arg<Buffer>()  // q_offset
      .template Arg<Buffer>()  // bias
      .template Arg<Buffer>()  // mask
      .template Arg<Buffer>()  // block_states
      .template Arg<Buffer>()  // block_slots
      .template Arg<Buffer>();  // block_bits
}

// The forward (jax_flash_fwd, jax_flash_paged_fwd and their emulated twins): operands q, k, v,
// the masks, sinks, dropout_seed; results out, lse; the shared attributes. The paged targets
// bind their page table [B, max_pages] s32 before (the first operand); the CUDA targets add the
// split-KV workspaces partial_out, partial_lse and their attributes after.
struct ForwardCall {
  const Buffer* page_table;  // null but for the paged targets (k, v are then pages)
  Buffer q;  // [B, T, N, H]
  Buffer k;  // [B, S, K, H], or pages [num_pages, page_size, K, H]
  Buffer v;  // [B, S, K, Hv], or pages [num_pages, page_size, K, Hv]
  MaskOperands masks;
  Buffer sinks;  // [N] f32 (-inf: no sink)
  Buffer dropout_seed;  // [2] u32
  Buffer out;  // result [B, T, N, Hv]
  Buffer lse;  // result [B, N, T] f32
  SharedAttributes attributes;
};
constexpr size_t kForwardArity = 3 + kMaskOperands + 2 + 2 + kSharedAttributes;

template <class Binding>
auto BindForward(Binding&& binding) {
  return BindSharedAttributes(BindMaskOperands(std::move(binding)
                                                   .template Arg<Buffer>()  // q
                                                   .template Arg<Buffer>()  // k
                                                   .template Arg<Buffer>())  // v
                                  .template Arg<Buffer>()  // sinks
                                  .template Arg<Buffer>()  // dropout_seed
                                  .template Ret<Buffer>()  // out
                                  .template Ret<Buffer>());  // lse
}

// The backward (jax_flash_bwd, jax_flash_emu_bwd): operands q, k, v, out, dout, lse, dlse, the
// masks, dropout_seed; results dq, dk, dv, dq_accum, delta; the shared attributes and
// deterministic. Each side binds its workspaces and dbias (always the last result) after.
struct BackwardCall {
  Buffer q, k, v;
  Buffer out, dout;  // [B, T, N, Hv]
  Buffer lse, dlse;  // [B, N, T] f32
  MaskOperands masks;
  Buffer dropout_seed;
  // Results (written through their data):
  Buffer dq;  // [B, T, N, H]
  Buffer dk;  // [B, S, K, H]
  Buffer dv;  // [B, S, K, Hv]
  Buffer dq_accum;  // f32 workspace (its shape is each side's)
  Buffer delta;  // [B, N, T] f32 workspace
  SharedAttributes attributes;
  bool deterministic;
};
constexpr size_t kBackwardArity = 7 + kMaskOperands + 1 + 5 + kSharedAttributes + 1;

template <class Binding>
auto BindBackward(Binding&& binding) {
  return BindSharedAttributes(BindMaskOperands(std::move(binding)
                                                   .template Arg<Buffer>()  // q
                                                   .template Arg<Buffer>()  // k
                                                   .template Arg<Buffer>()  // v
                                                   .template Arg<Buffer>()  // out
                                                   .template Arg<Buffer>()  // dout
                                                   .template Arg<Buffer>()  // lse
                                                   .template Arg<Buffer>())  // dlse
                                  .template Arg<Buffer>()  // dropout_seed
                                  .template Ret<Buffer>()  // dq
                                  .template Ret<Buffer>()  // dk
                                  .template Ret<Buffer>()  // dv
                                  .template Ret<Buffer>()  // dq_accum
                                  .template Ret<Buffer>())  // delta
      .template Attr<bool>("deterministic");
}

// The handler arguments, in binding order, gathered into the calls above: a handler made with
// ForwardHandler<P>(fn) of a binding with P leading arguments (execution contexts, the page
// table), BindForward, then the target's own arguments, calls fn(leading..., ForwardCall,
// own...).
namespace internal {

template <size_t P, class T>
MaskOperands MasksAt(T& t) {
  return {std::get<P>(t),     std::get<P + 1>(t), std::get<P + 2>(t), std::get<P + 3>(t), std::get<P + 4>(t),
          std::get<P + 5>(t), std::get<P + 6>(t), std::get<P + 7>(t), std::get<P + 8>(t), std::get<P + 9>(t)};
}

template <size_t P, class T>
SharedAttributes AttributesAt(T& t) {
  return {std::get<P>(t),     std::get<P + 1>(t), std::get<P + 2>(t), std::get<P + 3>(t), std::get<P + 4>(t),
          std::get<P + 5>(t), std::get<P + 6>(t), std::get<P + 7>(t), std::get<P + 8>(t)};
}

template <size_t P, class T>
ForwardCall ForwardAt(T& t) {
  return {nullptr,
          std::get<P>(t),
          std::get<P + 1>(t),
          std::get<P + 2>(t),
          MasksAt<P + 3>(t),
          std::get<P + 3 + kMaskOperands>(t),
          std::get<P + 4 + kMaskOperands>(t),
          *std::get<P + 5 + kMaskOperands>(t),
          *std::get<P + 6 + kMaskOperands>(t),
          AttributesAt<P + 7 + kMaskOperands>(t)};
}

template <size_t P, class T>
BackwardCall BackwardAt(T& t) {
  constexpr size_t R = P + 7 + kMaskOperands + 1;  // the first result
  return {std::get<P>(t),
          std::get<P + 1>(t),
          std::get<P + 2>(t),
          std::get<P + 3>(t),
          std::get<P + 4>(t),
          std::get<P + 5>(t),
          std::get<P + 6>(t),
          MasksAt<P + 7>(t),
          std::get<P + 7 + kMaskOperands>(t),
          *std::get<R>(t),
          *std::get<R + 1>(t),
          *std::get<R + 2>(t),
          *std::get<R + 3>(t),
          *std::get<R + 4>(t),
          AttributesAt<R + 5>(t),
          std::get<R + 5 + kSharedAttributes>(t)};
}

template <size_t kOwn, class Fn, class T, class Call, size_t... Lead, size_t... Own>
auto Apply(const Fn& fn, T& t, Call& call, std::index_sequence<Lead...>, std::index_sequence<Own...>) {
  return fn(std::get<Lead>(t)..., call, std::get<kOwn + Own>(t)...);
}

}  // namespace internal

template <size_t kLeading, class Fn>
constexpr auto ForwardHandler(Fn fn) {
  return [fn](auto... args) {
    static_assert(sizeof...(args) >= kLeading + kForwardArity, "a binding made with BindForward");
    auto t = std::make_tuple(args...);
    ForwardCall call = internal::ForwardAt<kLeading>(t);
    return internal::Apply<kLeading + kForwardArity>(
        fn, t, call, std::make_index_sequence<kLeading>{},
        std::make_index_sequence<sizeof...(args) - kLeading - kForwardArity>{});
  };
}

template <size_t kLeading, class Fn>
constexpr auto BackwardHandler(Fn fn) {
  return [fn](auto... args) {
    static_assert(sizeof...(args) >= kLeading + kBackwardArity, "a binding made with BindBackward");
    auto t = std::make_tuple(args...);
    BackwardCall call = internal::BackwardAt<kLeading>(t);
    return internal::Apply<kLeading + kBackwardArity>(
        fn, t, call, std::make_index_sequence<kLeading>{},
        std::make_index_sequence<sizeof...(args) - kLeading - kBackwardArity>{});
  };
}

// ---- messages -------------------------------------------------------------------------------

inline std::string DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "f32";
    case ffi::DataType::BF16: return "bf16";
    case ffi::DataType::F16: return "f16";
    case ffi::DataType::S32: return "s32";
    case ffi::DataType::S64: return "s64";
    case ffi::DataType::F64: return "f64";
    case ffi::DataType::U32: return "u32";
    case ffi::DataType::S8: return "s8";
    case ffi::DataType::PRED: return "pred";
    default: return "dtype #" + std::to_string(static_cast<int>(t));
  }
}

inline std::string ShapeText(const int64_t* dims, size_t rank) {
  std::string s = "[";
  for (size_t i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}
inline std::string ShapeText(ffi::AnyBuffer::Dimensions dims) { return ShapeText(dims.begin(), dims.size()); }
inline std::string ShapeText(std::initializer_list<int64_t> dims) { return ShapeText(dims.begin(), dims.size()); }

// "[1, 8, 2, 32] bf16": a buffer as the messages name it.
inline std::string Describe(const Buffer& buffer) {
  return ShapeText(buffer.dimensions()) + " " + DtypeName(buffer.element_type());
}

// Collects the first error of a call's checks: "<where>: <what>", returned as InvalidArgument.
class Checker {
 public:
  explicit Checker(std::string where) : where_(std::move(where)) {}

  // `buffer` has exactly `shape` and `dtype`.
  void Expect(const char* name, const Buffer& buffer, std::initializer_list<int64_t> shape, ffi::DataType dtype) {
    if (!ok()) return;
    const auto dims = buffer.dimensions();
    bool same = dims.size() == shape.size();
    size_t i = 0;
    for (int64_t d : shape) same = same && dims[i++] == d;
    if (!same) {
      Fail(std::string(name) + " has shape " + ShapeText(dims) + ", expected " + ShapeText(shape));
    } else if (buffer.element_type() != dtype) {
      Fail(std::string(name) + " has dtype " + DtypeName(buffer.element_type()) + ", expected " + DtypeName(dtype));
    }
  }

  void Fail(const std::string& message) {
    if (ok()) error_ = where_ + ": " + message;
  }
  bool ok() const { return error_.empty(); }
  ffi::Error error() const { return ok() ? ffi::Error::Success() : ffi::Error::InvalidArgument(error_); }
  const std::string& where() const { return where_; }

 private:
  std::string where_;
  std::string error_;
};

// ---- the problem ----------------------------------------------------------------------------

enum class Dtype { kF32, kBF16, kF16 };

// A dense operand (bias or mask): absent ([0]), or [B|1, N|1, T|1, S|1].
struct Dense {
  bool present = false;
  const void* data = nullptr;
  Dtype dtype = Dtype::kF32;  // the bias' element type (the mask is pred)
  int64_t dims[4] = {0, 0, 0, 0};
};

// A block mask (MaskOperands' block_*): absent (block_q = 0), or its validated shapes and data.
// Its values are data, read by the kernels as they go: a state other than 0 and 2 is partly
// visible, and a partly visible block whose slot is not in [0, partial_capacity) is poisoned
// (its visible scores NaN: the rows of its query block come out NaN, never silently wrong).
struct BlockMask {
  int64_t block_q = 0, block_k = 0;  // 0: none
  int64_t batch = 0, heads = 0;  // Bm ∈ {1, B}, Nm ∈ {1, N}
  int64_t q_blocks = 0, kv_blocks = 0;  // nq, nk
  int64_t partial_capacity = 0;  // P
  int64_t words = 0;  // ceil(block_k / 32): u32 words per bit row
  const int8_t* states = nullptr;  // [Bm, Nm, nq, nk]
  const int32_t* slots = nullptr;  // [Bm, Nm, nq, nk]
  const uint32_t* bits = nullptr;  // [P, block_q, words]
  bool present() const { return block_q > 0; }
};

// One validated call: the shapes, the element type, the operands and the shared attributes.
struct Problem {
  int64_t batch = 0, q_len = 0, kv_len = 0, q_heads = 0, kv_heads = 0, head_dim = 0, v_head_dim = 0;
  Dtype dtype = Dtype::kF32;
  ffi::DataType element_type = ffi::DataType::F32;
  SharedAttributes attributes{};
  // A paged cache (page_table non-null): kv_len = max_pages · page_size.
  const int32_t* page_table = nullptr;
  int64_t page_size = 0, max_pages = 0, num_pages = 0;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* q_lengths = nullptr;
  const int32_t* kv_lengths = nullptr;
  const int32_t* q_segment_ids = nullptr;
  const int32_t* kv_segment_ids = nullptr;
  const int32_t* q_offsets = nullptr;
  const uint32_t* dropout_seed = nullptr;  // [2]
  Dense bias, mask;
  BlockMask block_mask;
  const float* sinks = nullptr;  // forward
  // backward
  const void* out = nullptr;
  const void* dout = nullptr;
  const float* lse = nullptr;
  const float* dlse = nullptr;

  int64_t group_size() const { return kv_heads > 0 ? q_heads / kv_heads : 0; }
};

// What an implementation serves, where the targets differ.
struct Limits {
  bool float32 = false;  // f32 inputs (the cpu kernels); f16 and bf16 always
  // The (H, Hv) pairs with kernels (null: any H, Hv >= 1) and their text for messages.
  bool (*head_dims)(int64_t head_dim, int64_t v_head_dim) = nullptr;
  std::string (*head_dims_text)() = nullptr;
  // The CUDA kernels' int arithmetic: B, N < 2^31, T, S < 2^30 (and num_pages < 2^31).
  bool int32_sizes = false;
};

namespace internal {

inline const int32_t* Int32s(const Buffer& b) { return static_cast<const int32_t*>(b.untyped_data()); }

// q, k, v, the mask operands, the dropout seed and the shared attributes.
inline void DescribeShared(Checker& check, const Limits& limits, const Buffer* page_table, const Buffer& q,
                           const Buffer& k, const Buffer& v, const MaskOperands& masks, const Buffer& dropout_seed,
                           const SharedAttributes& a, Problem* p) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const std::string kv = page_table != nullptr ? "[num_pages, page_size, K, " : "[B, S, K, ";
  if (qd.size() != 4) return check.Fail("q must have rank 4 [B, T, N, H], got shape " + ShapeText(qd));
  if (kd.size() != 4) return check.Fail("k must have rank 4 " + kv + "H], got shape " + ShapeText(kd));
  if (vd.size() != 4) return check.Fail("v must have rank 4 " + kv + "Hv], got shape " + ShapeText(vd));
  const ffi::DataType t = q.element_type();
  switch (t) {
    case ffi::DataType::BF16: p->dtype = Dtype::kBF16; break;
    case ffi::DataType::F16: p->dtype = Dtype::kF16; break;
    case ffi::DataType::F32:
      if (limits.float32) {
        p->dtype = Dtype::kF32;
        break;
      }
      [[fallthrough]];
    default:
      return check.Fail("q has dtype " + DtypeName(t) + ", expected " +
                        (limits.float32 ? "f32, bf16 or f16" : "bf16 or f16 (the CUDA kernels)"));
  }
  p->element_type = t;
  p->batch = qd[0];
  p->q_len = qd[1];
  p->q_heads = qd[2];
  p->head_dim = qd[3];
  p->kv_len = kd[1];
  p->kv_heads = kd[2];
  p->v_head_dim = vd[3];  // Hv: may differ from H
  if (page_table != nullptr) {
    // A paged cache: S is the table's capacity, max_pages · page_size.
    const auto td = page_table->dimensions();
    if (td.size() != 2 || td[0] != p->batch || page_table->element_type() != ffi::DataType::S32)
      return check.Fail("page_table must be [B, max_pages] s32 with B = " + std::to_string(p->batch) + ", got " +
                        Describe(*page_table));
    if (kd[0] < 1 || kd[1] < 1 || td[1] < 1)
      return check.Fail("the paged cache needs num_pages, page_size and max_pages >= 1, got k shape " + ShapeText(kd) +
                        ", page_table shape " + ShapeText(td));
    if (limits.int32_sizes && (td[1] * kd[1] >= (int64_t{1} << 30) || kd[0] >= (int64_t{1} << 31)))
      return check.Fail("the paged cache needs max_pages · page_size < 2^30 and num_pages < 2^31, got k shape " +
                        ShapeText(kd) + ", page_table shape " + ShapeText(td));
    p->num_pages = kd[0];
    p->page_size = kd[1];
    p->max_pages = td[1];
    p->kv_len = p->max_pages * p->page_size;
    p->page_table = Int32s(*page_table);
    check.Expect("k", k, {p->num_pages, p->page_size, p->kv_heads, p->head_dim}, t);
    check.Expect("v", v, {p->num_pages, p->page_size, p->kv_heads, p->v_head_dim}, t);
  } else {
    check.Expect("k", k, {p->batch, p->kv_len, p->kv_heads, p->head_dim}, t);
    check.Expect("v", v, {p->batch, p->kv_len, p->kv_heads, p->v_head_dim}, t);
  }
  if (!check.ok()) return;
  if (p->kv_heads < 1 || p->q_heads % p->kv_heads != 0) {
    return check.Fail("the number of query heads N = " + std::to_string(p->q_heads) +
                      " must be a multiple of the number of kv heads K = " + std::to_string(p->kv_heads));
  }
  // Always passed (full lengths, zeros when unused), so always checked.
  check.Expect("q_lengths", masks.q_lengths, {p->batch}, ffi::DataType::S32);
  check.Expect("kv_lengths", masks.kv_lengths, {p->batch}, ffi::DataType::S32);
  check.Expect("q_segment_ids", masks.q_segment_ids, {p->batch, p->q_len}, ffi::DataType::S32);
  check.Expect("kv_segment_ids", masks.kv_segment_ids, {p->batch, p->kv_len}, ffi::DataType::S32);
  check.Expect("q_offset", masks.q_offset, {p->batch}, ffi::DataType::S32);
  if (!check.ok()) return;
  if (p->head_dim < 1) return check.Fail("the head dim H must be >= 1, got q shape " + ShapeText(qd));
  if (p->v_head_dim < 1) return check.Fail("the value head dim Hv must be >= 1, got v shape " + ShapeText(vd));
  if (limits.head_dims != nullptr && !limits.head_dims(p->head_dim, p->v_head_dim)) {
    return check.Fail("no compiled kernel for the query/key head dim H = " + std::to_string(p->head_dim) +
                      " with the value head dim Hv = " + std::to_string(p->v_head_dim) +
                      " (the (H, Hv) pairs with kernels: " + limits.head_dims_text() + "); got q " + Describe(q) +
                      ", v " + Describe(v));
  }
  if (limits.int32_sizes && (p->batch >= (int64_t{1} << 31) || p->q_heads >= (int64_t{1} << 31) ||
                             p->q_len >= (int64_t{1} << 30) || p->kv_len >= (int64_t{1} << 30))) {
    // Batch and heads fold into grid.x (kernels/grid.h): only the kernels' int arithmetic bounds them.
    return check.Fail("batch and heads must be < 2^31 and T, S < 2^30, got q " + Describe(q) + ", k " + Describe(k));
  }
  if (!std::isfinite(a.scale)) return check.Fail("scale must be finite, got " + std::to_string(a.scale));
  // 0 is "off"; a cap below float32's smallest normal has no finite 1 / softcap.
  if (!SoftcapIsOffOrNormal(a.softcap))
    return check.Fail("softcap must be 0 (off) or a finite float32 normal > 0, got " + SoftcapString(a.softcap));
  if (a.window_left < -1 || a.window_right < -1) {
    return check.Fail("window_left and window_right must be >= 0 or -1 (unbounded), got (" +
                      std::to_string(a.window_left) + ", " + std::to_string(a.window_right) + ")");
  }
  // The dropout key's words [2] u32 and the rate in [0, 1).
  check.Expect("dropout_seed", dropout_seed, {2}, ffi::DataType::U32);
  if (!(a.dropout_rate >= 0.0f && a.dropout_rate < 1.0f))
    check.Fail("dropout_rate must be in [0, 1), got " + std::to_string(a.dropout_rate));
  if (!check.ok()) return;
  p->attributes = a;
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->q_lengths = Int32s(masks.q_lengths);
  p->kv_lengths = Int32s(masks.kv_lengths);
  p->q_segment_ids = Int32s(masks.q_segment_ids);
  p->kv_segment_ids = Int32s(masks.kv_segment_ids);
  p->q_offsets = Int32s(masks.q_offset);
  p->dropout_seed = static_cast<const uint32_t*>(dropout_seed.untyped_data());
}

// One dense operand: [0] of `none_type` when the call has none, else [B|1, N|1, T|1, S|1] of one
// of `types`, each dim 1 (broadcast, read with stride 0) or the full size.
inline void DescribeDense(Checker& check, const char* name, const Buffer& x, ffi::DataType none_type,
                          std::initializer_list<ffi::DataType> types, const Problem& p, Dense* out) {
  if (!check.ok()) return;
  const auto dims = x.dimensions();
  if (dims.size() == 1 && dims[0] == 0) return check.Expect(name, x, {0}, none_type);
  const int64_t full[4] = {p.batch, p.q_heads, p.q_len, p.kv_len};
  bool ok = dims.size() == 4;
  for (size_t d = 0; ok && d < 4; ++d) {
    out->dims[d] = dims[d];
    ok = dims[d] == 1 || dims[d] == full[d];
  }
  if (!ok) {
    return check.Fail(std::string(name) + " has shape " + ShapeText(dims) +
                      ", expected [0] (none) or [B|1, N|1, T|1, S|1] with [B, N, T, S] = " + ShapeText(full, 4));
  }
  bool typed = false;
  std::string allowed;
  for (ffi::DataType t : types) {
    typed = typed || x.element_type() == t;
    allowed += (allowed.empty() ? "" : ", ") + DtypeName(t);
  }
  if (!typed)
    return check.Fail(std::string(name) + " has dtype " + DtypeName(x.element_type()) + ", expected " + allowed);
  out->present = true;
  out->data = x.untyped_data();
  out->dtype = x.element_type() == ffi::DataType::BF16  ? Dtype::kBF16
               : x.element_type() == ffi::DataType::F16 ? Dtype::kF16
                                                        : Dtype::kF32;
}

// The block mask: with block_q = block_k = 0 each operand is [0] (s8, s32, u32); else
// block_states [Bm, Nm, nq, nk] s8 (Bm ∈ {1, B}, Nm ∈ {1, N}), block_slots the same in s32 and
// block_bits [P, block_q, ceil(block_k / 32)] u32 (P >= 0).
inline void DescribeBlockMask(Checker& check, const MaskOperands& masks, int64_t block_q, int64_t block_k, Problem* p) {
  if (!check.ok()) return;
  if (block_q == 0 && block_k == 0) {
    check.Expect("block_states", masks.block_states, {0}, ffi::DataType::S8);
    check.Expect("block_slots", masks.block_slots, {0}, ffi::DataType::S32);
    check.Expect("block_bits", masks.block_bits, {0}, ffi::DataType::U32);
    return;
  }
  if (block_q < 1 || block_k < 1 || block_q > (int64_t{1} << 30) || block_k > (int64_t{1} << 30))
    return check.Fail("block_q and block_k must both be 0 (no block mask) or in [1, 2^30], got (" +
                      std::to_string(block_q) + ", " + std::to_string(block_k) + ")");
  BlockMask& m = p->block_mask;
  const auto sd = masks.block_states.dimensions();
  const int64_t nq = (p->q_len + block_q - 1) / block_q, nk = (p->kv_len + block_k - 1) / block_k;
  if (sd.size() != 4 || (sd[0] != 1 && sd[0] != p->batch) || (sd[1] != 1 && sd[1] != p->q_heads) || sd[2] != nq ||
      sd[3] != nk) {
    return check.Fail("with block_q, block_k = " + std::to_string(block_q) + ", " + std::to_string(block_k) +
                      ", block_states has shape " + ShapeText(sd) + ", expected [B|1, N|1, nq, nk] = [" +
                      std::to_string(p->batch) + "|1, " + std::to_string(p->q_heads) + "|1, " + std::to_string(nq) +
                      ", " + std::to_string(nk) + "] (blocks of " + std::to_string(block_q) + "x" +
                      std::to_string(block_k) + " over T = " + std::to_string(p->q_len) +
                      ", S = " + std::to_string(p->kv_len) + ")");
  }
  check.Expect("block_states", masks.block_states, {sd[0], sd[1], nq, nk}, ffi::DataType::S8);
  check.Expect("block_slots", masks.block_slots, {sd[0], sd[1], nq, nk}, ffi::DataType::S32);
  const auto bd = masks.block_bits.dimensions();
  const int64_t words = (block_k + 31) / 32;
  if (bd.size() != 3) {
    return check.Fail("block_bits has shape " + ShapeText(bd) + ", expected [P, block_q, ceil(block_k / 32)] = [P, " +
                      std::to_string(block_q) + ", " + std::to_string(words) + "]");
  }
  check.Expect("block_bits", masks.block_bits, {bd[0], block_q, words}, ffi::DataType::U32);
  if (!check.ok()) return;
  m.block_q = block_q;
  m.block_k = block_k;
  m.batch = sd[0];
  m.heads = sd[1];
  m.q_blocks = nq;
  m.kv_blocks = nk;
  m.partial_capacity = bd[0];
  m.words = words;
  m.states = static_cast<const int8_t*>(masks.block_states.untyped_data());
  m.slots = Int32s(masks.block_slots);
  m.bits = static_cast<const uint32_t*>(masks.block_bits.untyped_data());
}

inline void DescribeDenseOperands(Checker& check, const MaskOperands& masks, const SharedAttributes& a, Problem* p) {
  DescribeDense(check, "bias", masks.bias, ffi::DataType::F32,
                {ffi::DataType::F32, ffi::DataType::BF16, ffi::DataType::F16}, *p, &p->bias);
  DescribeDense(check, "mask", masks.mask, ffi::DataType::PRED, {ffi::DataType::PRED}, *p, &p->mask);
  DescribeBlockMask(check, masks, a.block_q, a.block_k, p);
}

}  // namespace internal

// The forward's operands, results and shared attributes, checked against each other; fills `p`.
inline void DescribeForward(Checker& check, const Limits& limits, const ForwardCall& c, Problem* p) {
  internal::DescribeShared(check, limits, c.page_table, c.q, c.k, c.v, c.masks, c.dropout_seed, c.attributes, p);
  internal::DescribeDenseOperands(check, c.masks, c.attributes, p);
  if (!check.ok()) return;
  // Always passed (-inf when the call has none).
  check.Expect("sinks", c.sinks, {p->q_heads}, ffi::DataType::F32);
  check.Expect("out", c.out, {p->batch, p->q_len, p->q_heads, p->v_head_dim}, p->element_type);
  check.Expect("lse", c.lse, {p->batch, p->q_heads, p->q_len}, ffi::DataType::F32);
  if (!check.ok()) return;
  p->sinks = static_cast<const float*>(c.sinks.untyped_data());
}

// The backward's operands, its results dq, dk, dv, delta and the shared attributes (dq_accum,
// the workspaces and dbias are each side's: CheckDbias below); fills `p`.
inline void DescribeBackward(Checker& check, const Limits& limits, const BackwardCall& c, Problem* p) {
  internal::DescribeShared(check, limits, nullptr, c.q, c.k, c.v, c.masks, c.dropout_seed, c.attributes, p);
  internal::DescribeDenseOperands(check, c.masks, c.attributes, p);
  if (!check.ok()) return;
  const ffi::DataType t = p->element_type;
  const int64_t B = p->batch, T = p->q_len, S = p->kv_len, N = p->q_heads, K = p->kv_heads, H = p->head_dim,
                Hv = p->v_head_dim;
  check.Expect("out", c.out, {B, T, N, Hv}, t);
  check.Expect("dout", c.dout, {B, T, N, Hv}, t);
  check.Expect("lse", c.lse, {B, N, T}, ffi::DataType::F32);
  check.Expect("dlse", c.dlse, {B, N, T}, ffi::DataType::F32);
  check.Expect("dq", c.dq, {B, T, N, H}, t);
  check.Expect("dk", c.dk, {B, S, K, H}, t);
  check.Expect("dv", c.dv, {B, S, K, Hv}, t);
  check.Expect("delta", c.delta, {B, N, T}, ffi::DataType::F32);
  if (!check.ok()) return;
  p->out = c.out.untyped_data();
  p->dout = c.dout.untyped_data();
  p->lse = static_cast<const float*>(c.lse.untyped_data());
  p->dlse = static_cast<const float*>(c.dlse.untyped_data());
}

// dbias (every backward's last result): the bias operand's shape in f32, or [0] f32 without one.
inline void CheckDbias(Checker& check, const Buffer& dbias, const Problem& p) {
  if (p.bias.present) {
    const int64_t* d = p.bias.dims;
    check.Expect("dbias", dbias, {d[0], d[1], d[2], d[3]}, ffi::DataType::F32);
  } else {
    check.Expect("dbias", dbias, {0}, ffi::DataType::F32);
  }
}

// GQA packing (the forward's pack_gqa attribute): the G = N / K query heads of a kv head as the
// rows of one tile, at one query position (T = 1), at most `max_group` of them, and nothing that
// varies per head (a dense bias or mask, a block mask, dropout).
inline void CheckGqaPacking(Checker& check, bool pack_gqa, int64_t max_group, const Problem& p) {
  if (!check.ok() || !pack_gqa) return;
  const bool dropout = p.attributes.dropout_rate > 0.0f;
  const bool blocks = p.block_mask.present();
  if (p.q_len != 1 || p.group_size() > max_group || p.bias.present || p.mask.present || blocks || dropout) {
    check.Fail("pack_gqa needs T = 1, G = N / K <= " + std::to_string(max_group) +
               ", no dense bias or mask, no block mask and no dropout; got T = " + std::to_string(p.q_len) +
               ", G = " + std::to_string(p.group_size()) + (p.bias.present ? ", a bias" : "") +
               (p.mask.present ? ", a mask" : "") + (blocks ? ", a block mask" : "") + (dropout ? ", dropout" : ""));
  }
}

}  // namespace boundary
}  // namespace jax_flash
