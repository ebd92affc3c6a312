// The FFI boundary of the host implementation: decodes and validates the operands,
// attributes and results of jax_flash_fwd / jax_flash_bwd (see cuda/README.md), then
// runs the tiles of the chosen ISA on XLA's intra-op thread pool.
#include "cpu/handlers.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "cpu/kernel_table.h"
#include "cpu/parallel.h"
#include "cpu/problem.h"
#include "cpu/tiling.h"
#include "ffi/softcap.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flash {
namespace cpu {
namespace {

std::string ShapeString(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

std::string TypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "f32";
    case ffi::DataType::BF16: return "bf16";
    case ffi::DataType::F16: return "f16";
    case ffi::DataType::S32: return "s32";
    case ffi::DataType::F64: return "f64";
    case ffi::DataType::U32: return "u32";
    case ffi::DataType::PRED: return "pred";
    default: return "dtype #" + std::to_string(static_cast<int>(t));
  }
}

// Checks one buffer's shape and element type; appends to `error` when wrong.
class Checker {
 public:
  explicit Checker(const char* target) : target_(target) {}

  void Expect(const char* name, const ffi::AnyBuffer& buffer, std::initializer_list<int64_t> shape,
              ffi::DataType type) {
    if (!error_.empty()) return;
    const auto dims = buffer.dimensions();
    bool same = dims.size() == shape.size();
    size_t i = 0;
    for (int64_t d : shape) same = same && dims[i++] == d;
    std::string want = "[";
    i = 0;
    for (int64_t d : shape) want += (i++ ? ", " : "") + std::to_string(d);
    want += "]";
    if (!same) {
      Fail(std::string(name) + " has shape " + ShapeString(dims) + ", expected " + want);
    } else if (buffer.element_type() != type) {
      Fail(std::string(name) + " has dtype " + TypeName(buffer.element_type()) + ", expected " +
           TypeName(type));
    }
  }

  void Fail(const std::string& message) {
    if (error_.empty()) error_ = std::string(target_) + " (cpu): " + message;
  }
  bool ok() const { return error_.empty(); }
  ffi::Error error() const { return ffi::Error::InvalidArgument(error_); }

 private:
  const char* target_;
  std::string error_;
};

// Reads the shapes from q and k, checks the operands every target shares (q, k, v,
// lengths, segment ids, query offsets) and the attributes, and fills the problem description.
void DescribeProblem(Checker& check, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                     ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                     ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                     ffi::AnyBuffer q_offsets, float scale, int64_t window_left,
                     int64_t window_right, float softcap, bool use_segment_ids, Problem* p,
                     const ffi::AnyBuffer* page_table = nullptr) {
  const auto qd = q.dimensions();
  const auto kd = k.dimensions();
  const auto vd = v.dimensions();
  const std::string kv = page_table != nullptr ? "[num_pages, page_size, K, " : "[B, S, K, ";
  if (qd.size() != 4) return check.Fail("q must have rank 4 [B, T, N, H], got shape " + ShapeString(qd));
  if (kd.size() != 4) return check.Fail("k must have rank 4 " + kv + "H], got shape " + ShapeString(kd));
  if (vd.size() != 4) return check.Fail("v must have rank 4 " + kv + "Hv], got shape " + ShapeString(vd));
  switch (q.element_type()) {
    case ffi::DataType::F32: p->dtype = ElementType::kF32; break;
    case ffi::DataType::BF16: p->dtype = ElementType::kBF16; break;
    case ffi::DataType::F16: p->dtype = ElementType::kF16; break;
    default:
      return check.Fail("q has dtype " + TypeName(q.element_type()) + ", expected f32, bf16 or f16");
  }
  p->batch = qd[0];
  p->q_len = qd[1];
  p->q_heads = qd[2];
  p->head_dim = qd[3];
  p->kv_len = kd[1];
  p->kv_heads = kd[2];
  p->value_head_dim = vd[3];  // Hv: may differ from H
  const ffi::DataType dtype = q.element_type();
  if (page_table != nullptr) {
    // A paged cache: S is the table's capacity, max_pages · page_size.
    const auto td = page_table->dimensions();
    if (td.size() != 2 || td[0] != p->batch || page_table->element_type() != ffi::DataType::S32)
      return check.Fail("page_table must be [B, max_pages] s32 with B = " + std::to_string(p->batch) +
                        ", got shape " + ShapeString(td) + " " + TypeName(page_table->element_type()));
    if (kd[0] < 1 || kd[1] < 1 || td[1] < 1)
      return check.Fail("the paged cache needs num_pages, page_size and max_pages >= 1, got k shape " +
                        ShapeString(kd) + ", page_table shape " + ShapeString(td));
    p->num_pages = kd[0];
    p->page_size = kd[1];
    p->max_pages = td[1];
    p->kv_len = p->max_pages * p->page_size;
    check.Expect("k", k, {p->num_pages, p->page_size, p->kv_heads, p->head_dim}, dtype);
    check.Expect("v", v, {p->num_pages, p->page_size, p->kv_heads, p->value_head_dim}, dtype);
    p->page_table = static_cast<const int32_t*>(page_table->untyped_data());
  } else {
    check.Expect("k", k, {p->batch, p->kv_len, p->kv_heads, p->head_dim}, dtype);
    check.Expect("v", v, {p->batch, p->kv_len, p->kv_heads, p->value_head_dim}, dtype);
  }
  if (!check.ok()) return;
  if (p->kv_heads < 1 || p->q_heads % p->kv_heads != 0) {
    return check.Fail("the number of query heads N = " + std::to_string(p->q_heads) +
                      " must be a multiple of the number of kv heads K = " +
                      std::to_string(p->kv_heads));
  }
  check.Expect("q_lengths", q_lengths, {p->batch}, ffi::DataType::S32);
  check.Expect("kv_lengths", kv_lengths, {p->batch}, ffi::DataType::S32);
  // Always passed (zeros when unused), so always checked.
  check.Expect("q_segment_ids", q_segment_ids, {p->batch, p->q_len}, ffi::DataType::S32);
  check.Expect("kv_segment_ids", kv_segment_ids, {p->batch, p->kv_len}, ffi::DataType::S32);
  check.Expect("q_offset", q_offsets, {p->batch}, ffi::DataType::S32);
  if (p->head_dim < 1) check.Fail("the head dim H must be >= 1, got q shape " + ShapeString(qd));
  if (p->value_head_dim < 1)
    check.Fail("the value head dim Hv must be >= 1, got v shape " + ShapeString(vd));
  if (!std::isfinite(scale)) check.Fail("scale must be finite, got " + std::to_string(scale));
  // 0 is "off"; a cap below float32's smallest normal has no finite 1 / softcap.
  if (!SoftcapIsOffOrNormal(softcap))
    check.Fail("softcap must be 0 (off) or a finite float32 normal > 0, got " + SoftcapString(softcap));
  if (window_left < -1 || window_right < -1) {
    check.Fail("window_left and window_right must be >= 0 or -1 (unbounded), got (" +
               std::to_string(window_left) + ", " + std::to_string(window_right) + ")");
  }
  p->scale = scale;
  p->softcap = softcap;
  p->window_left = window_left;
  p->window_right = window_right;
  p->use_segment_ids = use_segment_ids;
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->q_lengths = static_cast<const int32_t*>(q_lengths.untyped_data());
  p->kv_lengths = static_cast<const int32_t*>(kv_lengths.untyped_data());
  p->q_segment_ids = static_cast<const int32_t*>(q_segment_ids.untyped_data());
  p->kv_segment_ids = static_cast<const int32_t*>(kv_segment_ids.untyped_data());
  p->q_offsets = static_cast<const int32_t*>(q_offsets.untyped_data());
}

// The dropout operand and attribute: seed u32 [2] (the key's words), rate in [0, 1).
void DescribeDropout(Checker& check, ffi::AnyBuffer seed, float rate, Problem* p) {
  check.Expect("dropout_seed", seed, {2}, ffi::DataType::U32);
  if (!(rate >= 0.0f && rate < 1.0f))
    check.Fail("dropout_rate must be in [0, 1), got " + std::to_string(rate));
  if (!check.ok()) return;
  const uint32_t* key = static_cast<const uint32_t*>(seed.untyped_data());
  p->dropout = dropout::MakeSetting(rate, key[0], key[1]);
}

// Whether a bias element is -inf (bit patterns: f32 0xff800000, bf16 0xff80, f16 0xfc00).
bool HasMinusInfinity(const DenseOperand& bias) {
  const int64_t n = bias.elements();
  if (bias.dtype == ElementType::kF32) {
    const uint32_t* x = static_cast<const uint32_t*>(bias.data);
    bool found = false;
    for (int64_t i = 0; i < n; ++i) found |= x[i] == 0xff800000u;
    return found;
  }
  const uint16_t minus_inf = bias.dtype == ElementType::kBF16 ? 0xff80u : 0xfc00u;
  const uint16_t* x = static_cast<const uint16_t*>(bias.data);
  bool found = false;
  for (int64_t i = 0; i < n; ++i) found |= x[i] == minus_inf;
  return found;
}

// One dense operand: [0] (of `none_type`) when the call has none, else [B|1, N|1, T|1, S|1],
// each dim 1 (broadcast, read with stride 0) or the full size. Returns whether it is present.
bool DescribeDenseOperand(Checker& check, const char* name, ffi::AnyBuffer x, ffi::DataType none_type,
                          const Problem& p, int64_t (&shape)[4]) {
  const auto dims = x.dimensions();
  if (dims.size() == 1 && dims[0] == 0) {
    check.Expect(name, x, {0}, none_type);
    return false;
  }
  const int64_t full[4] = {p.batch, p.q_heads, p.q_len, p.kv_len};
  bool ok = dims.size() == 4;
  for (size_t d = 0; ok && d < 4; ++d) {
    shape[d] = dims[d];
    ok = dims[d] == 1 || dims[d] == full[d];
  }
  if (!ok) {
    check.Fail(std::string(name) + " has shape " + ShapeString(dims) +
               ", expected [0] (none) or [B|1, N|1, T|1, S|1] with [B, N, T, S] = " +
               ShapeString(ffi::AnyBuffer::Dimensions(full, 4)));
  }
  return ok;
}

// The dense bias (f32, bf16 or f16) and mask (pred): [0] f32 / [0] pred when the call has
// none (cuda/README.md). Read in place through their broadcast strides.
void DescribeDense(Checker& check, ffi::AnyBuffer bias, ffi::AnyBuffer mask, Problem* p) {
  if (!check.ok()) return;
  int64_t shape[4];
  if (DescribeDenseOperand(check, "bias", bias, ffi::DataType::F32, *p, shape)) {
    ElementType dtype = ElementType::kF32;
    switch (bias.element_type()) {
      case ffi::DataType::F32: dtype = ElementType::kF32; break;
      case ffi::DataType::BF16: dtype = ElementType::kBF16; break;
      case ffi::DataType::F16: dtype = ElementType::kF16; break;
      default:
        return check.Fail("bias has dtype " + TypeName(bias.element_type()) + ", expected f32, bf16 or f16");
    }
    p->bias = DenseOperand(bias.untyped_data(), dtype, shape);
    p->bias_minus_inf = HasMinusInfinity(p->bias);
  }
  if (DescribeDenseOperand(check, "mask", mask, ffi::DataType::PRED, *p, shape)) {
    if (mask.element_type() != ffi::DataType::PRED)
      return check.Fail("mask has dtype " + TypeName(mask.element_type()) + ", expected pred");
    p->mask = DenseOperand(mask.untyped_data(), ElementType::kF32, shape);
  }
}

void Poison(ffi::AnyBuffer buffer) {
  // All-ones bytes are a NaN in f32, bf16 and f16 alike.
  std::memset(buffer.untyped_data(), 0xff, buffer.size_bytes());
}

// The ISA attribute: "" (the widest this CPU runs) or a name of SelectKernels; an unknown name,
// or one this CPU lacks, is an error naming it.
const KernelTable* KernelsFor(Checker& check, std::string_view isa) {
  std::string error;
  const KernelTable* kernels = SelectKernels(isa, "isa", &error);
  if (kernels == nullptr) check.Fail(error);
  return kernels;
}

// The forward's decisions, made by the caller (jax_flash/cpu.py): GQA packing, which needs one
// query position, G = N / K <= kBlockQ rows and nothing that varies per head (a dense bias or
// mask, dropout); and the split-KV chunk count C >= 1, capped here at one key block per chunk.
void DescribeForwardSchedule(Checker& check, bool pack_gqa, int64_t forward_chunks, Problem* p) {
  if (!check.ok()) return;
  if (pack_gqa && !CanPackHeads(*p)) {
    return check.Fail("pack_gqa needs T = 1, G = N / K <= " + std::to_string(kBlockQ) +
                      ", no dense bias or mask and no dropout; got T = " + std::to_string(p->q_len) + ", G = " +
                      std::to_string(p->group_size()) + (p->bias.present() ? ", a bias" : "") +
                      (p->mask.present() ? ", a mask" : "") + (p->dropout.on ? ", dropout" : ""));
  }
  if (forward_chunks < 1)
    return check.Fail("forward_chunks must be >= 1 (1: no split-KV), got " + std::to_string(forward_chunks));
  p->pack_heads = pack_gqa;
  p->forward_chunks = std::min<int64_t>(forward_chunks, std::max<int64_t>(1, KeyBlocks(*p)));
}

ffi::Error OutOfMemory(const char* target) {
  return ffi::Error::Internal(std::string(target) + " (cpu): out of memory for packed operands");
}

template <typename Tile>
ffi::Error RunTiles(ffi::ThreadPool& pool, const char* target, int64_t items, int64_t workspace,
                    const Problem& p, Tile tile) {
  const bool ok = ParallelFor(pool, items, workspace,
                              [&](int64_t item, float* ws) { tile(p, item, ws); });
  if (!ok) return ffi::Error::Internal(std::string(target) + " (cpu): out of memory for tile workspace");
  return ffi::Error::Success();
}

// jax_flash_fwd, and with a page table jax_flash_paged_fwd (k and v are then pages).
ffi::Error ForwardWith(const char* target, const ffi::AnyBuffer* page_table, ffi::ThreadPool pool,
                       ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                       ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                       ffi::AnyBuffer q_offsets, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                       ffi::AnyBuffer sinks, ffi::AnyBuffer dropout_seed,
                       ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::AnyBuffer> lse, float scale, int64_t window_left,
                       int64_t window_right, float softcap, bool use_segment_ids, float dropout_rate,
                       std::string_view isa, int64_t forward_chunks, bool pack_gqa, bool poison_outputs) {
  Checker check(target);
  Problem p;
  DescribeProblem(check, q, k, v, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
                  q_offsets, scale, window_left, window_right, softcap, use_segment_ids, &p, page_table);
  DescribeDropout(check, dropout_seed, dropout_rate, &p);
  DescribeDense(check, bias, mask, &p);
  if (!check.ok()) return check.error();
  // Always passed (-inf when the call has none).
  check.Expect("sinks", sinks, {p.q_heads}, ffi::DataType::F32);
  if (!check.ok()) return check.error();
  p.sinks = static_cast<const float*>(sinks.untyped_data());
  check.Expect("out", *out, {p.batch, p.q_len, p.q_heads, p.value_dim()}, q.element_type());
  check.Expect("lse", *lse, {p.batch, p.q_heads, p.q_len}, ffi::DataType::F32);
  DescribeForwardSchedule(check, pack_gqa, forward_chunks, &p);
  const KernelTable* kernels = KernelsFor(check, isa);
  if (!check.ok()) return check.error();
  p.bf16_packing = kernels->bf16_products && p.dtype == ElementType::kBF16;
  // poison_outputs (the test suite's setting): every result filled with NaN before the tiles
  // run, so an element the algorithm forgets to write shows up.
  if (poison_outputs) {
    Poison(*out);
    Poison(*lse);
  }
  p.out = out->untyped_data();
  p.lse = static_cast<float*>(lse->untyped_data());

  // Kᵀ and V packed once per key block, then the query tiles; or (a decode step, a paged
  // cache) each key block packed by the one tile that visits it.
  p.stream_keys = StreamsKeys(p);
  const bool prepack = !p.stream_keys;
  Workspace k_t(prepack ? PackedKeyFloats(p) : 0), v_rows(prepack ? PackedKeyFloats(p) : 0);
  Workspace bad_values(prepack ? KeyItems(p) * (kBlockK + 1) : 0);  // int32 flags, float-sized
  if (prepack && (k_t.get() == nullptr || v_rows.get() == nullptr || bad_values.get() == nullptr))
    return OutOfMemory(target);
  if (prepack) {
    p.packed.k_t = k_t.get();
    p.packed.v = v_rows.get();
    p.packed.bad_values = reinterpret_cast<int32_t*>(bad_values.get());
    if (ffi::Error e = RunTiles(pool, target, KeyItems(p), 2 * PaddedHeadDim(p), p, kernels->prepare_key_block);
        e.failure()) {
      return e;
    }
  }
  Workspace partials(p.forward_chunks > 1 ? ForwardQueryItems(p) * p.forward_chunks * ForwardPartialFloats(p) : 0);
  if (p.forward_chunks > 1 && partials.get() == nullptr) return OutOfMemory(target);
  p.packed.forward_partial = partials.get();
  if (ffi::Error e = RunTiles(pool, target, ForwardItems(p), kernels->forward_workspace(p), p, kernels->forward_tile);
      e.failure() || p.forward_chunks == 1) {
    return e;
  }
  return RunTiles(pool, target, ForwardQueryItems(p), 0, p, kernels->merge_forward_chunks);
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths, ffi::AnyBuffer q_segment_ids,
                   ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer q_offsets, ffi::AnyBuffer bias,
                   ffi::AnyBuffer mask, ffi::AnyBuffer sinks, ffi::AnyBuffer dropout_seed,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse, float scale,
                   int64_t window_left, int64_t window_right, float softcap, bool use_segment_ids,
                   float dropout_rate, std::string_view isa, int64_t forward_chunks, bool pack_gqa,
                   bool poison_outputs) {
  return ForwardWith("jax_flash_fwd", nullptr, pool, q, k, v, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
                     q_offsets, bias, mask, sinks, dropout_seed, out, lse, scale, window_left, window_right, softcap,
                     use_segment_ids, dropout_rate, isa, forward_chunks, pack_gqa, poison_outputs);
}

ffi::Error PagedForward(ffi::ThreadPool pool, ffi::AnyBuffer page_table, ffi::AnyBuffer q, ffi::AnyBuffer k,
                        ffi::AnyBuffer v, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                        ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer q_offsets,
                        ffi::AnyBuffer bias, ffi::AnyBuffer mask, ffi::AnyBuffer sinks,
                        ffi::AnyBuffer dropout_seed, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> lse, float scale, int64_t window_left, int64_t window_right,
                        float softcap, bool use_segment_ids, float dropout_rate, std::string_view isa,
                        int64_t forward_chunks, bool pack_gqa, bool poison_outputs) {
  return ForwardWith("jax_flash_paged_fwd", &page_table, pool, q, k, v, q_lengths, kv_lengths, q_segment_ids,
                     kv_segment_ids, q_offsets, bias, mask, sinks, dropout_seed, out, lse, scale, window_left,
                     window_right, softcap, use_segment_ids, dropout_rate, isa, forward_chunks, pack_gqa,
                     poison_outputs);
}

// dbias = Σ_c partial_c, in chunk order (the same bits whatever ran which chunk).
void SumBiasGradientPartials(const Problem& p) {
  const int64_t elements = p.bias.elements();
  for (int64_t e = 0; e < elements; ++e) {
    float sum = p.dbias_partial[e];
    for (int64_t c = 1; c < GradientChunks(p); ++c) sum += p.dbias_partial[c * elements + e];
    p.dbias[e] = sum;
  }
}

// The backward's key-block chunks: the gradient_chunks attribute, 0 for tiling.h's rule for
// XLA's pool (a property of the running process), else 1 to kMaxGradientChunks forced (capped
// at one key block per chunk), which tests use to run both the chunked and the query-owning
// backward on any machine.
int64_t GradientChunksFor(const Problem& p, int64_t forced, ffi::ThreadPool& pool) {
  if (forced == 0) return GradientChunkRule(p, pool.num_threads());
  return std::clamp<int64_t>(forced, 1, std::max<int64_t>(1, std::min(kMaxGradientChunks, KeyBlocks(p))));
}

// The single-pass backward (flash_backward_pass.h). With key-block chunks: pack Q and dO
// (with D) once, in the products' format, zeroing the dQ partials; one pass of key-block
// items, each packing the key blocks it visits; then dQ = scale · Σ partials per query
// block. With one chunk the items own their query heads and do all of it in the pass.
ffi::Error RunBackward(ffi::ThreadPool& pool, const KernelTable& kernels, Problem& p) {
  const bool shared_queries = !GradientTileOwnsQueries(p);
  Workspace q_rows(shared_queries ? PackedQueryFloats(p) : 0), dout_rows(shared_queries ? PackedQueryFloats(p) : 0);
  Workspace dq_partial(shared_queries ? GradientChunks(p) * PackedQueryFloats(p) : 0);
  for (const Workspace* w : {&q_rows, &dout_rows, &dq_partial})
    if (w->get() == nullptr) return OutOfMemory("jax_flash_bwd");
  p.packed.q = q_rows.get();
  p.packed.dout = dout_rows.get();
  p.packed.dq_partial = dq_partial.get();
  const int64_t row_buffer = 2 * PaddedHeadDim(p);
  if (shared_queries) {
    if (ffi::Error e = RunTiles(pool, "jax_flash_bwd", QueryItems(p), row_buffer, p, kernels.prepare_query_block);
        e.failure()) {
      return e;
    }
  }
  // A bias broadcast over the keys: each chunk adds into its own partial of dbias.
  Workspace dbias_partial(BiasGradientPartials(p) ? GradientChunks(p) * p.bias.elements() : 0);
  if (dbias_partial.get() == nullptr) return OutOfMemory("jax_flash_bwd");
  if (BiasGradientPartials(p)) {
    p.dbias_partial = dbias_partial.get();
    std::memset(p.dbias_partial, 0, GradientChunks(p) * p.bias.elements() * sizeof(float));
  }
  if (ffi::Error e = RunTiles(pool, "jax_flash_bwd", GradientItems(p),
                              kernels.backward_workspace(p), p, kernels.gradient_tile);
      e.failure()) {
    return e;
  }
  if (p.dbias_partial != nullptr) SumBiasGradientPartials(p);
  if (!shared_queries) return ffi::Error::Success();
  return RunTiles(pool, "jax_flash_bwd", QueryItems(p), row_buffer, p, kernels.reduce_query_gradient);
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::AnyBuffer out, ffi::AnyBuffer dout, ffi::AnyBuffer lse,
                    ffi::AnyBuffer dlse, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                    ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                    ffi::AnyBuffer q_offsets, ffi::AnyBuffer bias, ffi::AnyBuffer mask,
                    ffi::AnyBuffer dropout_seed, ffi::Result<ffi::AnyBuffer> dq,
                    ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                    ffi::Result<ffi::AnyBuffer> dq_accum,
                    ffi::Result<ffi::AnyBuffer> delta, ffi::Result<ffi::AnyBuffer> dbias, float scale, int64_t window_left,
                    int64_t window_right, float softcap, bool use_segment_ids,
                    float dropout_rate, bool deterministic, std::string_view isa, int64_t gradient_chunks,
                    bool poison_outputs) {
  // `deterministic` is accepted for the shared contract; this implementation is
  // always deterministic (no atomics).
  Checker check("jax_flash_bwd");
  Problem p;
  DescribeProblem(check, q, k, v, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
                  q_offsets, scale, window_left, window_right, softcap, use_segment_ids, &p);
  DescribeDropout(check, dropout_seed, dropout_rate, &p);
  DescribeDense(check, bias, mask, &p);
  if (!check.ok()) return check.error();
  const ffi::DataType dtype = q.element_type();
  const std::initializer_list<int64_t> q_shape = {p.batch, p.q_len, p.q_heads, p.head_dim};
  const std::initializer_list<int64_t> out_shape = {p.batch, p.q_len, p.q_heads, p.value_dim()};
  const std::initializer_list<int64_t> kv_shape = {p.batch, p.kv_len, p.kv_heads, p.head_dim};
  const std::initializer_list<int64_t> v_shape = {p.batch, p.kv_len, p.kv_heads, p.value_dim()};
  const std::initializer_list<int64_t> stat_shape = {p.batch, p.q_heads, p.q_len};
  check.Expect("out", out, out_shape, dtype);
  check.Expect("dout", dout, out_shape, dtype);
  check.Expect("lse", lse, stat_shape, ffi::DataType::F32);
  check.Expect("dlse", dlse, stat_shape, ffi::DataType::F32);
  check.Expect("dq", *dq, q_shape, dtype);
  check.Expect("dk", *dk, kv_shape, dtype);
  check.Expect("dv", *dv, v_shape, dtype);
  // dq_accum: [0] (the Python side's choice: nothing to write), or dQ in float32.
  const bool writes_dq_accum = dq_accum->dimensions().size() != 1 || dq_accum->element_count() != 0;
  if (writes_dq_accum) {
    check.Expect("dq_accum", *dq_accum, q_shape, ffi::DataType::F32);
  } else {
    check.Expect("dq_accum", *dq_accum, {0}, ffi::DataType::F32);
  }
  check.Expect("delta", *delta, stat_shape, ffi::DataType::F32);
  if (p.bias.present()) {
    const int64_t* d = p.bias.dims;
    check.Expect("dbias", *dbias, {d[0], d[1], d[2], d[3]}, ffi::DataType::F32);
  } else {
    check.Expect("dbias", *dbias, {0}, ffi::DataType::F32);
  }
  if (gradient_chunks < 0 || gradient_chunks > kMaxGradientChunks) {
    check.Fail("gradient_chunks must be 0 (the rule) or 1 to " + std::to_string(kMaxGradientChunks) + ", got " +
               std::to_string(gradient_chunks));
  }
  const KernelTable* kernels = KernelsFor(check, isa);
  if (!check.ok()) return check.error();
  p.bf16_packing = kernels->bf16_products && p.dtype == ElementType::kBF16;
  if (poison_outputs) {
    for (ffi::AnyBuffer result : {*dq, *dk, *dv, *dq_accum, *delta}) Poison(result);
  }
  p.out = out.untyped_data();
  p.dout = dout.untyped_data();
  p.lse_in = static_cast<const float*>(lse.untyped_data());
  p.dlse = static_cast<const float*>(dlse.untyped_data());
  p.dq = dq->untyped_data();
  p.dk = dk->untyped_data();
  p.dv = dv->untyped_data();
  p.dq_accum = writes_dq_accum ? static_cast<float*>(dq_accum->untyped_data()) : nullptr;
  p.delta = static_cast<float*>(delta->untyped_data());
  if (p.bias.present()) {
    p.dbias = static_cast<float*>(dbias->untyped_data());
    std::memset(p.dbias, 0, dbias->size_bytes());  // tiles add dS; what no tile sees is 0
  }

  p.gradient_chunks = GradientChunksFor(p, gradient_chunks, pool);
  return RunBackward(pool, *kernels, p);
}

}  // namespace

// The forward's operands, results and attributes after the thread pool (and, for the paged
// target, the page table): q, k, v (pages for the paged target), the mask operands, sinks, the
// dropout seed; out, lse.
template <class Binding>
auto ForwardSignature(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // q [B, T, N, H]
      .template Arg<ffi::AnyBuffer>()  // k [B, S, K, H], or pages [num_pages, page_size, K, H]
      .template Arg<ffi::AnyBuffer>()  // v [B, S, K, Hv], or pages [num_pages, page_size, K, Hv]
      .template Arg<ffi::AnyBuffer>()  // q_lengths [B] s32
      .template Arg<ffi::AnyBuffer>()  // kv_lengths [B] s32
      .template Arg<ffi::AnyBuffer>()  // q_segment_ids [B, T] s32
      .template Arg<ffi::AnyBuffer>()  // kv_segment_ids [B, S] s32
      .template Arg<ffi::AnyBuffer>()  // q_offset [B] s32
      .template Arg<ffi::AnyBuffer>()  // bias [B|1, N|1, T|1, S|1] or [0] f32
      .template Arg<ffi::AnyBuffer>()  // mask [B|1, N|1, T|1, S|1] pred or [0]
      .template Arg<ffi::AnyBuffer>()  // sinks [N] f32 (-inf: none)
      .template Arg<ffi::AnyBuffer>()  // dropout_seed [2] u32
      .template Ret<ffi::AnyBuffer>()  // out [B, T, N, Hv]
      .template Ret<ffi::AnyBuffer>()  // lse [B, N, T] f32
      .template Attr<float>("scale")
      .template Attr<int64_t>("window_left")
      .template Attr<int64_t>("window_right")
      .template Attr<float>("softcap")
      .template Attr<bool>("use_segment_ids")
      .template Attr<float>("dropout_rate")
      .template Attr<std::string_view>("isa")        // "" (the widest this CPU runs) or an ISA's name
      .template Attr<int64_t>("forward_chunks")      // split-KV key chunks, >= 1 (1: no split)
      .template Attr<bool>("pack_gqa")               // T = 1: the G query heads of a kv head in one tile
      .template Attr<bool>("poison_outputs");        // fill the results with NaN first (tests)
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashCpuForward, Forward, ForwardSignature(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

// jax_flash_paged_fwd: the page table [B, max_pages] s32 first.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashCpuPagedForward, PagedForward,
                              ForwardSignature(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashCpuBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // q [B, T, N, H]
                                  .Arg<ffi::AnyBuffer>()  // k [B, S, K, H]
                                  .Arg<ffi::AnyBuffer>()  // v [B, S, K, Hv]
                                  .Arg<ffi::AnyBuffer>()  // out [B, T, N, Hv]
                                  .Arg<ffi::AnyBuffer>()  // dout [B, T, N, Hv]
                                  .Arg<ffi::AnyBuffer>()  // lse [B, N, T] f32
                                  .Arg<ffi::AnyBuffer>()  // dlse [B, N, T] f32
                                  .Arg<ffi::AnyBuffer>()  // q_lengths [B] s32
                                  .Arg<ffi::AnyBuffer>()  // kv_lengths [B] s32
                                  .Arg<ffi::AnyBuffer>()  // q_segment_ids [B, T] s32
                                  .Arg<ffi::AnyBuffer>()  // kv_segment_ids [B, S] s32
                                  .Arg<ffi::AnyBuffer>()  // q_offset [B] s32
                                  .Arg<ffi::AnyBuffer>()  // bias [B|1, N|1, T|1, S|1] or [0] f32
                                  .Arg<ffi::AnyBuffer>()  // mask [B|1, N|1, T|1, S|1] pred or [0]
                                  .Arg<ffi::AnyBuffer>()  // dropout_seed [2] u32
                                  .Ret<ffi::AnyBuffer>()  // dq [B, T, N, H]
                                  .Ret<ffi::AnyBuffer>()  // dk [B, S, K, H]
                                  .Ret<ffi::AnyBuffer>()  // dv [B, S, K, Hv]
                                  .Ret<ffi::AnyBuffer>()  // dq_accum [B, T, N, H] f32, or [0]
                                  .Ret<ffi::AnyBuffer>()  // delta [B, N, T] f32 workspace
                                  .Ret<ffi::AnyBuffer>()  // dbias: bias' shape f32, or [0] f32
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window_left")
                                  .Attr<int64_t>("window_right")
                                  .Attr<float>("softcap")
                                  .Attr<bool>("use_segment_ids")
                                  .Attr<float>("dropout_rate")
                                  .Attr<bool>("deterministic")
                                  .Attr<std::string_view>("isa")
                                  .Attr<int64_t>("gradient_chunks")  // 0: the rule; 1..4 forced
                                  .Attr<bool>("poison_outputs"));

}  // namespace cpu
}  // namespace jax_flash
