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
//
// Every instruction that touches memory takes its call site last (defaulted to the caller's
// file and line; the wrappers of kernels/ptx.h pass theirs on): the race detector and the bounds
// checks (simt.h) name it in their reports. Shared-memory accesses are checked for races
// against other threads' accesses (simt.cc); global ones against the buffers the launch
// declared (GlobalBufferScope) and against other CTAs' accesses.
#pragma once

#include <cmath>
#include <cstdint>

#include "emu/fp16.h"
#include "emu/simt.h"

#define JAX_FLASH_EMU_SITE const char *file = __builtin_FILE(), int line = __builtin_LINE()

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
void ldmatrix_x4(uint32_t r[4], const void* smem_row_ptr, JAX_FLASH_EMU_SITE);
// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: as above, each matrix transposed.
void ldmatrix_x4_trans(uint32_t r[4], const void* smem_row_ptr, JAX_FLASH_EMU_SITE);
// ldmatrix.sync.aligned.m8n8.x2{.trans}.shared.b16: lanes 0..15 give the row addresses.
void ldmatrix_x2(uint32_t r[2], const void* smem_row_ptr, JAX_FLASH_EMU_SITE);
void ldmatrix_x2_trans(uint32_t r[2], const void* smem_row_ptr, JAX_FLASH_EMU_SITE);

// cp.async.cg.shared.global [dst], [src], 16, src_bytes   (9.7.9.25.3.1 "Data Movement and Conversion
// Instructions: cp.async")
// Copies src_bytes (0..16) bytes and zero-fills the rest of the 16 destination bytes; nothing
// lands in shared memory until a cp.async.wait_group covering its group runs in this thread.
void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes, JAX_FLASH_EMU_SITE);
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

// ld.shared / st.shared   (9.7.9.8 "Data Movement and Conversion Instructions: ld", 9.7.9.11 "st";
// PTX ISA 9.1 numbering): a naturally aligned access inside the dynamic shared memory, checked
// by the race detector.
float ld_shared_f32(const float* p, JAX_FLASH_EMU_SITE);
void ld_shared_v4_b32(uint32_t r[4], const void* p, JAX_FLASH_EMU_SITE);
void st_shared_b32(void* p, uint32_t v, JAX_FLASH_EMU_SITE);
void st_shared_f32(float* p, float v, JAX_FLASH_EMU_SITE);

// ld.global / st.global   (9.7.9.8 "ld", 9.7.9.11 "st"): a naturally aligned access inside a
// declared buffer, checked against the other CTAs' stores (simt.h, GlobalBufferScope).
float ld_global_f32(const float* p, JAX_FLASH_EMU_SITE);
uint16_t ld_global_b16(const uint16_t* p, JAX_FLASH_EMU_SITE);
uint8_t ld_global_u8(const uint8_t* p, JAX_FLASH_EMU_SITE);
uint32_t ld_global_b32(const uint32_t* p, JAX_FLASH_EMU_SITE);
void ld_global_v4_b32(uint32_t r[4], const void* p, JAX_FLASH_EMU_SITE);
void st_global_f32(float* p, float v, JAX_FLASH_EMU_SITE);
void st_global_b32(void* p, uint32_t v, JAX_FLASH_EMU_SITE);
void st_global_v4_b32(void* p, const uint32_t v[4], JAX_FLASH_EMU_SITE);

// red.global.add.f32 [p], v   (9.7.13.6 "Parallel Synchronization and Communication Instructions:
// red", PTX ISA 9.1 numbering): an atomic add, recorded as atomic (several CTAs may add to the
// same address; a plain access of another CTA to it is an error).
void red_global_add_f32(float* p, float v, JAX_FLASH_EMU_SITE);
// red.global.add.v2.f32 [p], {lo, hi} (sm_90+): two atomic adds of adjacent floats, recorded as
// atomic like the scalar one; p must be 8-byte aligned (misaligned: an error, as the hardware
// faults).
void red_global_add_v2_f32(float* p, float lo, float hi, JAX_FLASH_EMU_SITE);

// mov.b32 (9.7.9.3): the identity (what the volatile asm keeps the compiler from hoisting is
// a matter of registers only).
inline int mov_b32_volatile(int x) { return x; }

// ---- approximate instructions: the exact result moved by the documented worst-case error ----
// The direction of the error is a hash of the input (and JAX_FLASH_EMU_APPROX_SEED), so that a
// computation is reproducible run to run but the errors do not cancel: the tests' tolerances
// then hold for what the hardware may return, not only for the host's libm.
namespace detail {
uint32_t approx_seed();
inline bool approx_up(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  uint64_t z = (static_cast<uint64_t>(u) ^ approx_seed()) * 0x9e3779b97f4a7c15ull;
  z ^= z >> 29;
  z *= 0xbf58476d1ce4e5b9ull;
  return (z >> 40) & 1;
}
}  // namespace detail

// ex2.approx.ftz.f32 d, x   (9.7.3.21 "Floating Point Instructions: ex2"): 2^x with subnormal
// inputs and results flushed to zero; "the maximum ulp error is 2 ulp from correctly rounded
// result across the full range of inputs" (PTX ISA 9.1): exp2 rounded, then 2 ulp up or down.
inline float ex2_approx(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = std::copysign(0.0f, x);
  float r = std::exp2(x);
  if (std::isfinite(r) && r > 0.0f && r != 1.0f) {
    // 2^0 = 1 exactly is kept: the softmax's rescale factor of an unchanged row max is 1.
    const float toward = detail::approx_up(x) ? INFINITY : 0.0f;
    r = std::nextafter(std::nextafter(r, toward), toward);
  }
  if (std::fpclassify(r) == FP_SUBNORMAL) r = 0.0f;
  return r;
}

// tanh.approx.f32 d, x   (9.7.3.22 "Floating Point Instructions: tanh", sm_75+): "the maximum
// relative error over the entire floating point range is 2^-11" (PTX ISA 9.1); subnormal
// inputs pass through; tanh(±inf) = ±1. Emulated as tanh(x)·(1 ± 2^-11), kept within [-1, 1].
inline float tanh_approx(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL || x == 0.0f || std::isnan(x)) return x;
  if (std::isinf(x)) return std::copysign(1.0f, x);
  // 2^-11 less half an f32 ulp, so that the rounded result stays within the bound.
  const double e = 0x1p-11 - 0x1p-24;
  const double t = std::tanh(static_cast<double>(x)) * (detail::approx_up(x) ? 1.0 + e : 1.0 - e);
  return static_cast<float>(std::fmin(std::fmax(t, -1.0), 1.0));
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
