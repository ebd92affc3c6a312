// Host emulation of every PTX wrapper in cuda/kernels/ptx.h: same names, same arguments, in
// namespace jax_flash::emu. Each wrapper in ptx.h has `return emu::<name>(...)` as its body
// when JAX_FLASH_EMULATE is defined. Section numbers are those of the PTX ISA 8.x ("Parallel
// Thread Execution ISA", chapter 9.7 "Instructions"); later versions renumber some chapters
// (ldmatrix is 9.7.14.5.15 in 8.x, 9.7.16.5.15 in 9.4), the section titles stay.
//
// Warp-wide instructions (mma, ldmatrix) are .sync.aligned: every lane of the warp must
// execute the same instruction, so each lane deposits its operands and the result is computed
// once from all 32 lanes' operands (see detail::warp_collective in simt.h). The fragment
// layouts are in ptx_emu.cc, with the ISA section each one comes from.
#pragma once

#include <cmath>
#include <cstdint>

#include "emu/fp16.h"
#include "emu/simt.h"

namespace jax_flash {
namespace emu {

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 d, a, b, c   (9.7.14.5.14 "Multiply-and-Accumulate
// Instruction: mma"; fragments: 9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with floating point type")
// a: A fragment (16x16 f16, row-major), b: B fragment (16x8, column-major), c/d: 16x8 f32.
void mma_m16n8k16_f16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]);
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 d, a, b, c
void mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]);

// ldmatrix.sync.aligned.m8n8.x4.shared.b16 {r0..r3}, [addr]   (9.7.14.5.15 "Warp-level matrix load
// instruction: ldmatrix")
// Lanes 8i..8i+7 give the addresses of rows 0..7 of matrix i; r[i] is the lane's share of matrix i.
void ldmatrix_x4(uint32_t r[4], const void* smem_row_ptr);
// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: as above, each matrix transposed.
void ldmatrix_x4_trans(uint32_t r[4], const void* smem_row_ptr);
// ldmatrix.sync.aligned.m8n8.x2{.trans}.shared.b16: lanes 0..15 give the row addresses.
void ldmatrix_x2(uint32_t r[2], const void* smem_row_ptr);
void ldmatrix_x2_trans(uint32_t r[2], const void* smem_row_ptr);

// cp.async.cg.shared.global [dst], [src], 16, src_bytes   (9.7.9.25.3.1 "Data Movement and Conversion
// Instructions: cp.async")
// Copies src_bytes (0..16) bytes and zero-fills the rest of the 16 destination bytes; nothing
// lands in shared memory until a cp.async.wait_group covering its group runs in this thread.
void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes);
// cp.async.commit_group   (9.7.9.25.3.2 "cp.async.commit_group")
void cp_async_commit_group();
// cp.async.wait_group N   (9.7.9.25.3.3 "cp.async.wait_group / cp.async.wait_all"): lands every
// copy of the committed groups except the N most recent ones. Copies not yet committed to a
// group are not covered.
void cp_async_wait_group_n(int n);
template <int N>
inline void cp_async_wait_group() {
  static_assert(N >= 0, "cp.async.wait_group takes a non-negative count");
  cp_async_wait_group_n(N);
}
// cp.async.wait_all = commit_group + wait_group 0.
inline void cp_async_wait_all() {
  cp_async_commit_group();
  cp_async_wait_group_n(0);
}

// ex2.approx.ftz.f32 d, x   (9.7.3.21 "Floating Point Instructions: ex2"): 2^x with subnormal
// inputs and results flushed to zero. The hardware's approximation is within 2 ulp of this.
// (cuda/kernels/ptx.h cites 9.7.3.22, which is tanh in the 8.x numbering.)
inline float ex2_approx(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = std::copysign(0.0f, x);
  float r = std::exp2(x);
  if (std::fpclassify(r) == FP_SUBNORMAL) r = 0.0f;
  return r;
}

// cvt.rn.bf16x2.f32 d, hi, lo   (9.7.9.21 "Data Movement and Conversion Instructions: cvt"):
// d = {hi in bits 31..16, lo in bits 15..0}, round to nearest even, NaN -> canonical NaN.
inline uint32_t cvt_pack_bf16x2(float lo, float hi) {
  return static_cast<uint32_t>(float_to_bf16_rn(lo)) | (static_cast<uint32_t>(float_to_bf16_rn(hi)) << 16);
}
// cvt.rn.f16x2.f32 d, hi, lo   (9.7.9.21)
inline uint32_t cvt_pack_f16x2(float lo, float hi) {
  return static_cast<uint32_t>(float_to_f16_rn(lo)) | (static_cast<uint32_t>(float_to_f16_rn(hi)) << 16);
}

// cvt.f32.f16 d, a   (9.7.9.21): one f16 (raw bits) to float, exact (subnormals kept; a NaN
// stays a NaN, its payload is not specified).
inline float cvt_f32_f16(uint16_t a) { return f16_to_float(a); }

}  // namespace emu
}  // namespace jax_flash
