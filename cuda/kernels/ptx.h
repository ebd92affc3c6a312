// One wrapper per PTX instruction the kernels use, and the only place with inline asm.
// Each wrapper cites the section of the PTX ISA ("Parallel Thread Execution ISA", 8.x/9.x,
// chapter 9.7 "Instructions") it implements. Under JAX_FLASH_EMULATE the body calls the host
// emulation of the same instruction (cuda/emu/ptx_emu.h, same name, same arguments), which is
// what lets the kernels run and be tested without a GPU.
//
// Pointers into shared memory are generic pointers; the wrappers convert them to the
// shared-state window (__cvta_generic_to_shared) that ldmatrix, cp.async and ld/st.shared address.
//
// Every access of the kernels to shared or global memory goes through a wrapper here (no plain
// C++ loads or stores), so that the emulation sees each one: it checks shared-memory accesses
// for races and global ones against the buffers of the call (cuda/emu/README.md). Under
// JAX_FLASH_EMULATE those wrappers take the caller's file and line as defaulted trailing
// arguments (JAX_FLASH_SITE), for the emulation's reports.
//
// Approximate instructions (ex2.approx, tanh.approx) are used only through their wrappers,
// where their error is acceptable; the kernels are compiled without --use_fast_math, so every
// other operator is IEEE (division, tanhf, log2f).
#pragma once

#include <cstdint>

#include "kernels/platform.h"
#ifdef JAX_FLASH_EMULATE
#include "emu/ptx_emu.h"
#endif

#ifdef JAX_FLASH_EMULATE
#define JAX_FLASH_SITE , const char *site_file = __builtin_FILE(), int site_line = __builtin_LINE()
#define JAX_FLASH_AT , site_file, site_line
#else
#define JAX_FLASH_SITE
#endif

namespace jax_flash {
namespace ptx {

#ifndef JAX_FLASH_EMULATE
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: d = a·b + c, fragments of §9.7.14.5.8.
__device__ __forceinline__ void mma_m16n8k16_f16(float d[4], const uint32_t a[4], const uint32_t b[2],
                                                 const float c[4]) {
#ifndef JAX_FLASH_EMULATE
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
  return emu::mma_m16n8k16_f16(d, a, b, c);
#endif
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: d = a·b + c, fragments of §9.7.14.5.8.
__device__ __forceinline__ void mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2],
                                                  const float c[4]) {
#ifndef JAX_FLASH_EMULATE
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
  return emu::mma_m16n8k16_bf16(d, a, b, c);
#endif
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: four 8x8 matrices, lanes 8i..8i+7 address the
// rows of matrix i, r[i] is this lane's pair of matrix i (§9.7.14.5.15).
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* smem_row_ptr JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem_row_ptr)));
#else
  return emu::ldmatrix_x4(r, smem_row_ptr JAX_FLASH_AT);
#endif
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: as ldmatrix_x4, each matrix transposed
// (§9.7.14.5.15).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* smem_row_ptr JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem_row_ptr)));
#else
  return emu::ldmatrix_x4_trans(r, smem_row_ptr JAX_FLASH_AT);
#endif
}

// ldmatrix.sync.aligned.m8n8.x2.shared.b16: two 8x8 matrices, lanes 0..15 address the rows
// (§9.7.14.5.15).
__device__ __forceinline__ void ldmatrix_x2(uint32_t r[2], const void* smem_row_ptr JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_address(smem_row_ptr)));
#else
  return emu::ldmatrix_x2(r, smem_row_ptr JAX_FLASH_AT);
#endif
}

// ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16: as ldmatrix_x2, transposed (§9.7.14.5.15).
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t r[2], const void* smem_row_ptr JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_address(smem_row_ptr)));
#else
  return emu::ldmatrix_x2_trans(r, smem_row_ptr JAX_FLASH_AT);
#endif
}

// cp.async.cg.shared.global [dst], [src], 16, src_bytes: asynchronous 16-byte copy that
// bypasses L1; src_bytes = 0 copies nothing and zero-fills the 16 bytes (§9.7.9.25.3.1).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, int src_bytes JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem_dst)), "l"(gmem_src),
               "r"(src_bytes));
#else
  return emu::cp_async_16(smem_dst, gmem_src, src_bytes JAX_FLASH_AT);
#endif
}

// cp.async.commit_group: closes this thread's pending cp.async copies into a group
// (§9.7.9.25.3.2).
__device__ __forceinline__ void cp_async_commit_group() {
#ifndef JAX_FLASH_EMULATE
  asm volatile("cp.async.commit_group;\n" ::);
#else
  return emu::cp_async_commit_group();
#endif
}

// cp.async.wait_group N: waits until at most the N most recent groups of this thread are
// still in flight (§9.7.9.25.3.3).
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
#ifndef JAX_FLASH_EMULATE
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#else
  return emu::cp_async_wait_group<N>();
#endif
}

// ld.shared.f32 d, [p]: one float from shared memory (§9.7.9.8 "Data Movement and Conversion
// Instructions: ld", PTX ISA 9.1 numbering).
__device__ __forceinline__ float ld_shared_f32(const float* p JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(smem_address(p)) : "memory");
  return v;
#else
  return emu::ld_shared_f32(p JAX_FLASH_AT);
#endif
}

// ld.shared.v4.b32 {r0..r3}, [p]: one 16-byte-aligned chunk from shared memory (§9.7.9.8).
__device__ __forceinline__ void ld_shared_v4_b32(uint32_t r[4], const void* p JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p))
               : "memory");
#else
  return emu::ld_shared_v4_b32(r, p JAX_FLASH_AT);
#endif
}

// st.shared.b32 [p], v: 4 bytes to shared memory (§9.7.9.11 "Data Movement and Conversion
// Instructions: st", PTX ISA 9.1 numbering).
__device__ __forceinline__ void st_shared_b32(void* p, uint32_t v JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(smem_address(p)), "r"(v) : "memory");
#else
  return emu::st_shared_b32(p, v JAX_FLASH_AT);
#endif
}

// st.shared.f32 [p], v: one float to shared memory (§9.7.9.11).
__device__ __forceinline__ void st_shared_f32(float* p, float v JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(smem_address(p)), "f"(v) : "memory");
#else
  return emu::st_shared_f32(p, v JAX_FLASH_AT);
#endif
}

// ld.global.f32 d, [p]: one float from global memory (§9.7.9.8). Global addresses are the
// generic ones (the global window is the identity).
__device__ __forceinline__ float ld_global_f32(const float* p JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  float v;
  asm volatile("ld.global.f32 %0, [%1];\n" : "=f"(v) : "l"(p) : "memory");
  return v;
#else
  return emu::ld_global_f32(p JAX_FLASH_AT);
#endif
}

// ld.global.b16 d, [p]: one 16-bit element from global memory (§9.7.9.8), e.g. of a bias.
__device__ __forceinline__ uint16_t ld_global_b16(const uint16_t* p JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  uint16_t v;
  asm volatile("ld.global.b16 %0, [%1];\n" : "=h"(v) : "l"(p) : "memory");
  return v;
#else
  return emu::ld_global_b16(p JAX_FLASH_AT);
#endif
}

// ld.global.u8 d, [p]: one byte from global memory (§9.7.9.8), e.g. of a pred mask.
__device__ __forceinline__ uint8_t ld_global_u8(const uint8_t* p JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  uint16_t v;
  asm volatile("ld.global.u8 %0, [%1];\n" : "=h"(v) : "l"(p) : "memory");
  return static_cast<uint8_t>(v);
#else
  return emu::ld_global_u8(p JAX_FLASH_AT);
#endif
}

// ld.global.b32 d, [p]: one 4-byte word from global memory (§9.7.9.8), e.g. of a block mask's
// slots and bits.
__device__ __forceinline__ uint32_t ld_global_b32(const uint32_t* p JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  uint32_t v;
  asm volatile("ld.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
#else
  return emu::ld_global_b32(p JAX_FLASH_AT);
#endif
}

// ld.global.v4.b32 {r0..r3}, [p]: one 16-byte-aligned chunk from global memory (§9.7.9.8).
__device__ __forceinline__ void ld_global_v4_b32(uint32_t r[4], const void* p JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  asm volatile("ld.global.v4.b32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "l"(p)
               : "memory");
#else
  return emu::ld_global_v4_b32(r, p JAX_FLASH_AT);
#endif
}

// st.global.f32 [p], v: one float to global memory (§9.7.9.11).
__device__ __forceinline__ void st_global_f32(float* p, float v JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  asm volatile("st.global.f32 [%0], %1;\n" ::"l"(p), "f"(v) : "memory");
#else
  return emu::st_global_f32(p, v JAX_FLASH_AT);
#endif
}

// st.global.b32 [p], v: 4 bytes to global memory (§9.7.9.11).
__device__ __forceinline__ void st_global_b32(void* p, uint32_t v JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  asm volatile("st.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
#else
  return emu::st_global_b32(p, v JAX_FLASH_AT);
#endif
}

// st.global.v4.b32 [p], {v0..v3}: one 16-byte-aligned chunk to global memory (§9.7.9.11).
__device__ __forceinline__ void st_global_v4_b32(void* p, const uint32_t v[4] JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  asm volatile("st.global.v4.b32 [%0], {%1,%2,%3,%4};\n" ::"l"(p), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
               : "memory");
#else
  return emu::st_global_v4_b32(p, v JAX_FLASH_AT);
#endif
}

// red.global.add.f32 [p], v: atomic *p += v, no result (§9.7.13.6 "Parallel Synchronization and
// Communication Instructions: red", PTX ISA 9.1 numbering).
__device__ __forceinline__ void red_global_add_f32(float* p, float v JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(v) : "memory");
#else
  return emu::red_global_add_f32(p, v JAX_FLASH_AT);
#endif
}

// red.global.add.v2.f32 [p], {lo, hi}: atomic p[0] += lo, p[1] += hi, no result, p 8-byte
// aligned (§9.7.13.6; the vector form needs PTX ISA 8.1 and sm_90). One instruction for the two
// adjacent columns an accumulator fragment holds; each element is its own atomic add, as with
// two scalar ones, which is what older architectures (and the compute_80 PTX) issue instead.
__device__ __forceinline__ void red_global_add_v2_f32(float* p, float lo, float hi JAX_FLASH_SITE) {
#ifndef JAX_FLASH_EMULATE
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(lo), "f"(hi) : "memory");
#else
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p), "f"(lo) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(p + 1), "f"(hi) : "memory");
#endif
#else
  return emu::red_global_add_v2_f32(p, lo, hi JAX_FLASH_AT);
#endif
}

// mov.b32 d, a in a volatile asm (§9.7.9.3 "mov"): the identity, which the compiler may neither
// fold nor hoist out of a loop. Values derived from it inside a loop body are recomputed there
// instead of living in registers across the loop: the dense bias and mask's row addresses
// (kernels/bias.h), which would otherwise push the dQ and forward kernels into spills.
__device__ __forceinline__ int mov_b32_volatile(int x) {
#ifndef JAX_FLASH_EMULATE
  int y;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
#else
  return emu::mov_b32_volatile(x);
#endif
}

// ex2.approx.ftz.f32: 2^x (§9.7.3.21 "Floating Point Instructions: ex2"), within 2 ulp of the
// correctly rounded result. The softmax exponent is one FFMA + this.
__device__ __forceinline__ float ex2_approx(float x) {
#ifndef JAX_FLASH_EMULATE
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#else
  return emu::ex2_approx(x);
#endif
}

// tanh.approx.f32: tanh(x) with a relative error of at most 2^-11 (§9.7.3.22 "Floating Point
// Instructions: tanh", sm_75+). Not used for the soft cap: 2^-11 relative is too coarse for
// capped logits (softmax.h builds tanh from ex2.approx instead); kept, and self-tested, as the
// fast alternative a benchmark can weigh.
__device__ __forceinline__ float tanh_approx(float x) {
#ifndef JAX_FLASH_EMULATE
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#else
  return emu::tanh_approx(x);
#endif
}

// cvt.rn.bf16x2.f32 d, hi, lo: two floats to packed bf16, lo in bits 15..0 (§9.7.9.21).
__device__ __forceinline__ uint32_t cvt_pack_bf16x2(float lo, float hi) {
#ifndef JAX_FLASH_EMULATE
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#else
  return emu::cvt_pack_bf16x2(lo, hi);
#endif
}

// cvt.rn.f16x2.f32 d, hi, lo: two floats to packed f16, lo in bits 15..0 (§9.7.9.21).
__device__ __forceinline__ uint32_t cvt_pack_f16x2(float lo, float hi) {
#ifndef JAX_FLASH_EMULATE
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#else
  return emu::cvt_pack_f16x2(lo, hi);
#endif
}

// cvt.f32.f16 d, a: one f16 (raw bits) to float, exact (§9.7.9.21).
// EMU-TODO: cvt_f32_f16
__device__ __forceinline__ float cvt_f32_f16(uint16_t a) {
#ifndef JAX_FLASH_EMULATE
  float d;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(d) : "h"(a));
  return d;
#else
  return emu::cvt_f32_f16(a);
#endif
}

}  // namespace ptx
}  // namespace jax_flash
