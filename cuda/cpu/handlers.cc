// The host implementation's handlers of jax_flash_fwd, jax_flash_paged_fwd and jax_flash_bwd
// (cuda/README.md): the shared operands, results and attributes are bound and validated by the
// one FFI boundary (ffi/boundary.h); here the cpu targets' own attributes (isa, forward_chunks,
// pack_gqa, gradient_chunks), the conversion into a cpu::Problem, and the tiles of the chosen
// ISA on XLA's intra-op thread pool.
#include "cpu/handlers.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "common/nonfinite.h"
#include "cpu/kernel_table.h"
#include "cpu/parallel.h"
#include "cpu/problem.h"
#include "cpu/tiling.h"
#include "ffi/boundary.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_flash {
namespace cpu {
namespace {

using boundary::Checker;

// What the cpu kernels serve: f32 inputs too, any head dims H, Hv >= 1.
const boundary::Limits& CpuLimits() {
  static const boundary::Limits limits = [] {
    boundary::Limits l;
    l.float32 = true;
    return l;
  }();
  return limits;
}

ElementType ElementTypeOf(boundary::Dtype t) {
  switch (t) {
    case boundary::Dtype::kBF16: return ElementType::kBF16;
    case boundary::Dtype::kF16: return ElementType::kF16;
    default: return ElementType::kF32;
  }
}

// Whether a bias element is -inf (common/nonfinite.h's bit patterns).
bool HasMinusInfinity(const DenseOperand& bias) {
  const int64_t n = bias.elements();
  if (bias.dtype == ElementType::kF32) {
    const uint32_t* x = static_cast<const uint32_t*>(bias.data);
    bool found = false;
    for (int64_t i = 0; i < n; ++i) found |= x[i] == nonfinite::kMinusInfF32;
    return found;
  }
  const uint16_t minus_inf = bias.dtype == ElementType::kBF16 ? nonfinite::kMinusInfBf16 : nonfinite::kMinusInfF16;
  const uint16_t* x = static_cast<const uint16_t*>(bias.data);
  bool found = false;
  for (int64_t i = 0; i < n; ++i) found |= x[i] == minus_inf;
  return found;
}

// The validated call (ffi/boundary.h) as the tiles see it.
void ToProblem(const boundary::Problem& b, Problem* p) {
  p->batch = b.batch;
  p->q_len = b.q_len;
  p->kv_len = b.kv_len;
  p->q_heads = b.q_heads;
  p->kv_heads = b.kv_heads;
  p->head_dim = b.head_dim;
  p->value_head_dim = b.v_head_dim;  // Hv: may differ from H
  p->dtype = ElementTypeOf(b.dtype);
  p->scale = b.attributes.scale;
  p->softcap = b.attributes.softcap;
  p->window_left = b.attributes.window_left;
  p->window_right = b.attributes.window_right;
  p->use_segment_ids = b.attributes.use_segment_ids;
  p->dropout = dropout::MakeSetting(b.attributes.dropout_rate, b.dropout_seed[0], b.dropout_seed[1]);
  p->q = b.q;
  p->k = b.k;
  p->v = b.v;
  p->q_lengths = b.q_lengths;
  p->kv_lengths = b.kv_lengths;
  p->q_segment_ids = b.q_segment_ids;
  p->kv_segment_ids = b.kv_segment_ids;
  p->q_offsets = b.q_offsets;
  // The dense bias and mask, read in place through their broadcast strides.
  if (b.bias.present) {
    p->bias = DenseOperand(b.bias.data, ElementTypeOf(b.bias.dtype), b.bias.dims);
    p->bias_minus_inf = HasMinusInfinity(p->bias);
  }
  if (b.mask.present) p->mask = DenseOperand(b.mask.data, ElementType::kF32, b.mask.dims);
  if (b.block_mask.present()) {
    const boundary::BlockMask& m = b.block_mask;
    BlockRows& layout = p->block_mask.layout;
    layout.block_q = m.block_q;
    layout.block_k = m.block_k;
    layout.kv_blocks = m.kv_blocks;
    layout.partial_capacity = m.partial_capacity;
    layout.words = m.words;
    layout.states = m.states;
    layout.slots = m.slots;
    layout.bits = m.bits;
    p->block_mask.batch = m.batch;
    p->block_mask.heads = m.heads;
    p->block_mask.q_blocks = m.q_blocks;
  }
  p->sinks = b.sinks;
  if (b.page_table != nullptr) {
    p->page_table = b.page_table;
    p->page_size = b.page_size;
    p->max_pages = b.max_pages;
    p->num_pages = b.num_pages;
  }
}

void Poison(ffi::AnyBuffer buffer) { std::memset(buffer.untyped_data(), nonfinite::kNanFillByte, buffer.size_bytes()); }

// The ISA attribute: "" (the default ISA of this CPU) or a name of SelectKernels; an unknown name,
// or one this CPU lacks, is an error naming it.
const KernelTable* KernelsFor(Checker& check, std::string_view isa) {
  if (!check.ok()) return nullptr;
  std::string error;
  const KernelTable* kernels = SelectKernels(isa, "isa", &error);
  if (kernels == nullptr) check.Fail(error);
  return kernels;
}

// The forward's decisions, made by the caller (jax_flash/cpu.py): GQA packing (checked by the
// boundary's rule, at most kBlockQ heads: one tile's rows) and the split-KV chunk count C >= 1,
// capped here at one key block per chunk.
void DescribeForwardSchedule(Checker& check, bool pack_gqa, int64_t forward_chunks, const boundary::Problem& b,
                             Problem* p) {
  boundary::CheckGqaPacking(check, pack_gqa, kBlockQ, b);
  if (!check.ok()) return;
  if (forward_chunks < 1)
    return check.Fail("forward_chunks must be >= 1 (1: no split-KV), got " + std::to_string(forward_chunks));
  p->pack_heads = pack_gqa;
  p->forward_chunks = std::min<int64_t>(forward_chunks, std::max<int64_t>(1, KeyBlocks(*p)));
}

ffi::Error OutOfMemory(const char* target) {
  return ffi::Error::Internal(std::string(target) + " (cpu): out of memory for packed operands");
}

template <typename Tile>
ffi::Error RunTiles(ffi::ThreadPool& pool, const char* target, int64_t items, int64_t workspace, const Problem& p,
                    Tile tile) {
  const bool ok = ParallelFor(pool, items, workspace, [&](int64_t item, float* ws) { tile(p, item, ws); });
  if (!ok) return ffi::Error::Internal(std::string(target) + " (cpu): out of memory for tile workspace");
  return ffi::Error::Success();
}

// jax_flash_fwd, and with a page table jax_flash_paged_fwd (k and v are then pages).
ffi::Error Forward(const char* target, ffi::ThreadPool pool, const boundary::ForwardCall& call, std::string_view isa,
                   int64_t forward_chunks, bool pack_gqa) {
  Checker check(std::string(target) + " (cpu)");
  boundary::Problem described;
  boundary::DescribeForward(check, CpuLimits(), call, &described);
  Problem p;
  if (check.ok()) ToProblem(described, &p);
  if (check.ok()) DescribeForwardSchedule(check, pack_gqa, forward_chunks, described, &p);
  const KernelTable* kernels = KernelsFor(check, isa);
  if (!check.ok()) return check.error();
  p.bf16_packing = kernels->bf16_products && p.dtype == ElementType::kBF16;
  // poison_outputs (the test suite's setting): every result filled with NaN before the tiles
  // run, so an element the algorithm forgets to write shows up.
  if (described.attributes.poison_outputs) {
    Poison(call.out);
    Poison(call.lse);
  }
  p.out = call.out.untyped_data();
  p.lse = static_cast<float*>(call.lse.untyped_data());

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
  if (ffi::Error e =
          RunTiles(pool, "jax_flash_bwd", GradientItems(p), kernels.backward_workspace(p), p, kernels.gradient_tile);
      e.failure()) {
    return e;
  }
  if (p.dbias_partial != nullptr) SumBiasGradientPartials(p);
  if (!shared_queries) return ffi::Error::Success();
  return RunTiles(pool, "jax_flash_bwd", QueryItems(p), row_buffer, p, kernels.reduce_query_gradient);
}

ffi::Error Backward(ffi::ThreadPool pool, const boundary::BackwardCall& call, ffi::Result<ffi::AnyBuffer> dbias,
                    std::string_view isa, int64_t gradient_chunks) {
  // `deterministic` is accepted for the shared contract; this implementation is
  // always deterministic (no atomics).
  Checker check("jax_flash_bwd (cpu)");
  boundary::Problem described;
  boundary::DescribeBackward(check, CpuLimits(), call, &described);
  Problem p;
  if (check.ok()) ToProblem(described, &p);
  // dq_accum: [0] (the Python side's choice: nothing to write), or dQ in float32.
  const bool writes_dq_accum = call.dq_accum.dimensions().size() != 1 || call.dq_accum.element_count() != 0;
  if (writes_dq_accum) {
    check.Expect("dq_accum", call.dq_accum, {p.batch, p.q_len, p.q_heads, p.head_dim}, ffi::DataType::F32);
  } else {
    check.Expect("dq_accum", call.dq_accum, {0}, ffi::DataType::F32);
  }
  boundary::CheckDbias(check, *dbias, described);
  if (check.ok() && (gradient_chunks < 0 || gradient_chunks > kMaxGradientChunks)) {
    check.Fail("gradient_chunks must be 0 (the rule) or 1 to " + std::to_string(kMaxGradientChunks) + ", got " +
               std::to_string(gradient_chunks));
  }
  const KernelTable* kernels = KernelsFor(check, isa);
  if (!check.ok()) return check.error();
  p.bf16_packing = kernels->bf16_products && p.dtype == ElementType::kBF16;
  if (described.attributes.poison_outputs) {
    for (ffi::AnyBuffer result : {call.dq, call.dk, call.dv, call.dq_accum, call.delta}) Poison(result);
  }
  ffi::AnyBuffer out = call.out, dout = call.dout, lse = call.lse, dlse = call.dlse;
  auto* dq = &call.dq;
  auto* dk = &call.dk;
  auto* dv = &call.dv;
  auto* dq_accum = &call.dq_accum;
  auto* delta = &call.delta;
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

// The bindings: the boundary's shared operands, results and attributes (ffi/boundary.h) after
// XLA's thread pool (and the paged target's page table), then the cpu targets' own.
template <class Binding>
auto CpuForwardSignature(Binding&& binding) {
  return boundary::BindForward(std::move(binding))
      .template Attr<std::string_view>("isa")    // "" (the default ISA of this CPU) or an ISA's name
      .template Attr<int64_t>("forward_chunks")  // split-KV key chunks, >= 1 (1: no split)
      .template Attr<bool>("pack_gqa");          // T = 1: the G query heads of a kv head in one tile
}

constexpr auto kForward = boundary::ForwardHandler<1>(
    [](ffi::ThreadPool pool, const boundary::ForwardCall& call, std::string_view isa, int64_t forward_chunks,
       bool pack_gqa) { return Forward("jax_flash_fwd", pool, call, isa, forward_chunks, pack_gqa); });
constexpr auto kPagedForward =
    boundary::ForwardHandler<2>([](ffi::ThreadPool pool, ffi::AnyBuffer page_table, boundary::ForwardCall call,
                                   std::string_view isa, int64_t forward_chunks, bool pack_gqa) {
      call.page_table = &page_table;
      return Forward("jax_flash_paged_fwd", pool, call, isa, forward_chunks, pack_gqa);
    });
constexpr auto kBackward = boundary::BackwardHandler<1>(
    [](ffi::ThreadPool pool, const boundary::BackwardCall& call, ffi::Result<ffi::AnyBuffer> dbias,
       std::string_view isa, int64_t gradient_chunks) { return Backward(pool, call, dbias, isa, gradient_chunks); });

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashCpuForward, kForward,
                              CpuForwardSignature(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

// jax_flash_paged_fwd: the page table [B, max_pages] s32 first.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashCpuPagedForward, kPagedForward,
                              CpuForwardSignature(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashCpuBackward, kBackward,
                              boundary::BindBackward(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())
                                  .Ret<ffi::AnyBuffer>()  // dbias: bias' shape f32, or [0] f32
                                  .Attr<std::string_view>("isa")
                                  .Attr<int64_t>("gradient_chunks"));  // 0: the rule; 1..4 forced

}  // namespace cpu
}  // namespace jax_flash
