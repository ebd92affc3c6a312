// The XLA FFI handlers of the host implementation (platform "cpu").
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jax_flash {
namespace cpu {

// jax_flash_fwd: (q, k, v, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, q_offset)
//   -> (out, lse); attributes scale, window_left, window_right, softcap, use_segment_ids.
extern "C" XLA_FFI_Error* JaxFlashCpuForward(XLA_FFI_CallFrame* call_frame);
// jax_flash_bwd: (q, k, v, out, dout, lse, dlse, q_lengths, kv_lengths, q_segment_ids,
//   kv_segment_ids, q_offset) -> (dq, dk, dv, dq_accum, delta); the same attributes + deterministic.
extern "C" XLA_FFI_Error* JaxFlashCpuBackward(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxFlashCpuPagedForward(XLA_FFI_CallFrame* call_frame);

}  // namespace cpu
}  // namespace jax_flash
