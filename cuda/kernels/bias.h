// The dense bias and mask (cuda/README.md): [B|1, N|1, T|1, S|1] operands read in place through
// their broadcast strides (stride 0 along a dim of size 1, so nothing is expanded), element by
// element at the positions a thread's accumulator fragment holds, and the bias' gradient dbias
// summed over the bias' broadcast dims as the backward produces dS.
//
// The bias and mask are read with plain ld.global at each thread's fragment elements, not as
// cp.async tiles: a 128 x 64 f32 bias tile would take 32 KB of shared memory per stage, and the
// forward at H >= 128 already holds 96 KB of the 99 KB. A full-size bias is read once per
// score, as the score is; a broadcast one mostly from L1/L2.
//
// dbias (the logit's cotangent dS summed over the broadcast dims) is written by the main
// backward kernel, three ways (DbiasWrite):
//   - store: every dbias element belongs to one (t, s) pair: a plain store;
//   - owned add: the bias is broadcast over T only: the one thread that holds key s of (b, n)
//     sums its query blocks into the element in order (load, add, store);
//   - atomic: the bias is broadcast over B, N or S: elements of several CTAs or warps meet,
//     after each warp has summed its fragment over the broadcast dims (red.global.add).
// Deterministic mode has no atomics: a bias broadcast over B, N or S gets a workspace with those
// dims at full size ([B, N, Tb, S] f32, the dbias_accum result), written by store or owned add,
// then summed over them in a fixed order (attention_backward_reduce_dbias_kernel).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/platform.h"
#include "kernels/ptx.h"
#include "kernels/tile.h"

namespace jax_flash {
namespace kernels {

enum class DenseType : int { kF32 = 0, kF16 = 1, kBf16 = 2, kBool = 3 };

// The rows of one (b, n) of a dense operand: element (t, s) at data + t·stride_t + s·stride_s
// (in elements), for t < rows and s < cols (positions past them are never read).
struct DenseRows {
  const void* data = nullptr;  // null: the call has none
  DenseType type = DenseType::kF32;
  int64_t stride_t = 0;
  int64_t stride_s = 0;
  int rows = 0;
  int cols = 0;

  __device__ __forceinline__ bool present() const { return data != nullptr; }
  __device__ __forceinline__ bool inside(int t, int s) const { return t < rows && s < cols; }
  __device__ __forceinline__ int64_t offset(int t, int s) const { return t * stride_t + s * stride_s; }

  // The bias at (t, s), widened to float32 (f16 through cvt, bf16 exactly).
  __device__ __forceinline__ float bias_at(int t, int s) const {
    const int64_t i = offset(t, s);
    switch (type) {
      case DenseType::kF16: return ptx::cvt_f32_f16(ptx::ld_global_b16(static_cast<const uint16_t*>(data) + i));
      case DenseType::kBf16:
        return __uint_as_float(static_cast<uint32_t>(ptx::ld_global_b16(static_cast<const uint16_t*>(data) + i)) << 16);
      default: return ptx::ld_global_f32(static_cast<const float*>(data) + i);
    }
  }
  // Whether the mask lets (t, s) attend (a pred byte: nonzero is true).
  __device__ __forceinline__ bool allows(int t, int s) const {
    return ptx::ld_global_u8(static_cast<const uint8_t*>(data) + offset(t, s)) != 0;
  }
};

// A dense operand of the whole call: [Bb, Nb, Tb, Sb], contiguous, strides 0 along broadcast dims.
struct DenseOperand {
  const void* data = nullptr;
  DenseType type = DenseType::kF32;
  int64_t stride_b = 0, stride_n = 0, stride_t = 0, stride_s = 0;

  // The strides of a contiguous [dims[0], dims[1], dims[2], dims[3]] array, 0 where a dim is 1.
  __host__ static DenseOperand of(const void* data, DenseType type, const int64_t (&dims)[4]) {
    DenseOperand d;
    d.data = data;
    d.type = type;
    int64_t stride = 1;
    int64_t* strides[4] = {&d.stride_b, &d.stride_n, &d.stride_t, &d.stride_s};
    for (int i = 3; i >= 0; --i) {
      *strides[i] = dims[i] == 1 ? 0 : stride;
      stride *= dims[i];
    }
    return d;
  }

  __device__ __forceinline__ DenseRows rows_of(int b, int n, int q_len, int kv_len) const {
    DenseRows r;
    if (data == nullptr) return r;
    const int64_t base = b * stride_b + n * stride_n;
    const int bytes = type == DenseType::kF32 ? 4 : type == DenseType::kBool ? 1 : 2;
    r.data = static_cast<const char*>(data) + base * bytes;
    r.type = type;
    r.stride_t = stride_t;
    r.stride_s = stride_s;
    r.rows = q_len;
    r.cols = kv_len;
    return r;
  }
};

// ---- fragments --------------------------------------------------------------------------------

// The dense mask of a fragment: elements it does not allow become −inf. Positions past T, S are
// left (the structured mask hides them).
template <bool TRANSPOSED, int N_BLOCKS>
__device__ __forceinline__ void mask_fragment_dense(float (&acc)[N_BLOCKS][4], const DenseRows& mask, int row0,
                                                    int col0, int lane) {
  JAX_FLASH_UNROLL
  for (int j = 0; j < N_BLOCKS; ++j) {
    JAX_FLASH_UNROLL
    for (int i = 0; i < 4; ++i) {
      int t, s;
      fragment_position<TRANSPOSED>(j, i, row0, col0, lane, t, s);
      if (mask.inside(t, s) && !mask.allows(t, s)) acc[j][i] = -INFINITY;
    }
  }
}

// ---- dbias ------------------------------------------------------------------------------------

enum class DbiasWrite : int { kStore = 0, kOwnedAdd = 1, kAtomic = 2 };

// Where dbias goes (the dbias result, or in deterministic mode the dbias_accum workspace):
// [Db, Dn, Dt, Ds] f32, strides 0 along the dims it sums over.
struct DbiasTarget {
  float* data = nullptr;  // null: no bias
  int64_t stride_b = 0, stride_n = 0, stride_t = 0, stride_s = 0;
  DbiasWrite write = DbiasWrite::kAtomic;

  __host__ __device__ __forceinline__ bool present() const { return data != nullptr; }
};

// Adds v to one dbias element, the way the target says.
__device__ __forceinline__ void write_dbias(float* p, float v, DbiasWrite how) {
  if (how == DbiasWrite::kStore) {
    ptx::st_global_f32(p, v);
  } else if (how == DbiasWrite::kOwnedAdd) {
    ptx::st_global_f32(p, ptx::ld_global_f32(p) + v);
  } else {
    ptx::red_global_add_f32(p, v);
  }
}

// dSᵀ of the warp's 16 keys (rows key0..) x 8·N query columns (from t0) into dbias of (b, n):
// summed first inside the fragment over the dims the target broadcasts (T: over the quad's
// columns; S: over the 8 lanes of a column; both: the warp), then one lane per target element
// writes it. Elements past T or S hold dS = 0 and are not written. Warp-uniform (shuffles).
template <int N_BLOCKS>
__device__ __forceinline__ void accumulate_dbias(const float (&ds)[N_BLOCKS][4], const DbiasTarget& target, int b,
                                                 int n, int q_len, int kv_len, int key0, int t0, int lane) {
  // A warp past the last key adds nothing; it must not write either: with S = 1 every warp of
  // the CTA maps to the one column of a stored dbias.
  if (key0 >= kv_len) return;
  float* const base = target.data + b * target.stride_b + n * target.stride_n;
  const bool sum_t = target.stride_t == 0, sum_s = target.stride_s == 0;
  if (!sum_t && !sum_s) {
    JAX_FLASH_UNROLL
    for (int j = 0; j < N_BLOCKS; ++j) {
      JAX_FLASH_UNROLL
      for (int i = 0; i < 4; ++i) {
        int t, s;
        fragment_position<true>(j, i, key0, t0, lane, t, s);
        if (t < q_len && s < kv_len) write_dbias(base + t * target.stride_t + s, ds[j][i], target.write);
      }
    }
    return;
  }
  if (sum_t && !sum_s) {  // one sum per key row, over the quad's columns
    JAX_FLASH_UNROLL
    for (int r = 0; r < 2; ++r) {
      float sum = 0.0f;
      JAX_FLASH_UNROLL
      for (int j = 0; j < N_BLOCKS; ++j) sum += ds[j][2 * r] + ds[j][2 * r + 1];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // the quad of lanes of the row
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int s = key0 + (lane >> 2) + 8 * r;
      if ((lane & 3) == 0 && s < kv_len) write_dbias(base + s, sum, target.write);
    }
    return;
  }
  if (!sum_t && sum_s) {  // one sum per query column, over the 8 lanes (and 2 rows) of the column
    JAX_FLASH_UNROLL
    for (int j = 0; j < N_BLOCKS; ++j) {
      JAX_FLASH_UNROLL
      for (int c = 0; c < 2; ++c) {
        float sum = ds[j][c] + ds[j][2 + c];
        JAX_FLASH_UNROLL
        for (int offset = 4; offset < WARP_SIZE; offset *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        const int t = t0 + 8 * j + 2 * (lane & 3) + c;
        if (lane < 4 && t < q_len) write_dbias(base + t * target.stride_t, sum, target.write);
      }
    }
    return;
  }
  float sum = 0.0f;  // the whole fragment
  JAX_FLASH_UNROLL
  for (int j = 0; j < N_BLOCKS; ++j) {
    JAX_FLASH_UNROLL
    for (int i = 0; i < 4; ++i) sum += ds[j][i];
  }
  JAX_FLASH_UNROLL
  for (int offset = 1; offset < WARP_SIZE; offset *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) write_dbias(base, sum, target.write);
}

}  // namespace kernels
}  // namespace jax_flash
