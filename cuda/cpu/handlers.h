// The XLA FFI handlers of the host implementation (platform "cpu"). Operands, results and
// attributes: cuda/README.md, "The FFI targets"; the shared ones are bound and validated by
// ffi/boundary.h, the cpu targets' own (isa, forward_chunks, pack_gqa; isa, gradient_chunks)
// in handlers.cc.
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jax_flash {
namespace cpu {

// jax_flash_fwd: (q, k, v, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, q_offset, bias,
//   mask, sinks, dropout_seed) -> (out, lse).
extern "C" XLA_FFI_Error* JaxFlashCpuForward(XLA_FFI_CallFrame* call_frame);
// jax_flash_bwd: (q, k, v, out, dout, lse, dlse, q_lengths, kv_lengths, q_segment_ids,
//   kv_segment_ids, q_offset, bias, mask, dropout_seed) -> (dq, dk, dv, dq_accum, delta, dbias).
extern "C" XLA_FFI_Error* JaxFlashCpuBackward(XLA_FFI_CallFrame* call_frame);
// jax_flash_paged_fwd: the page table [B, max_pages] s32, then jax_flash_fwd's operands with k and
//   v as pages.
extern "C" XLA_FFI_Error* JaxFlashCpuPagedForward(XLA_FFI_CallFrame* call_frame);

}  // namespace cpu
}  // namespace jax_flash
