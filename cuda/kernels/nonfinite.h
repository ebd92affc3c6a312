// Non-finite values of V inside the forward (docs/numerical-contract.md: a row that sees a
// key whose value row holds a NaN or ±inf gets a NaN output, its lse stays; a row that does
// not see it is untouched). P·V multiplies every key's value by every row's weight, and a
// masked weight is 0, so a NaN in V must not reach the product: 0·NaN is NaN.
//
// In its decoding settings (AttentionParams::scans_values) the forward does it itself, so that
// a decode step reads V once: after a V tile has landed, one thread per key row zeroes the
// row's non-finite elements in shared memory and sets the row's flag (`zero_nonfinite_rows`);
// after the mask, each thread notes whether a visible element of its rows has a flagged key
// (`note_rows_that_see`, into its own words of shared memory: no other thread writes them);
// at the end the quad's notes are combined and such rows' O becomes NaN (`poison_rows`).
// Elsewhere the host passes a finite V and finds those rows itself (jax_flash/cuda.py).
#pragma once

#include <cstdint>

#include "kernels/platform.h"
#include "kernels/ptx.h"

namespace jax_flash {
namespace kernels {

// Per CTA: one flag per key row of the V tile, and per thread its rows' notes.
template <int BLOCK_KV, int THREADS, int ROW_BLOCKS>
struct ValueScanSmem {
  static constexpr int kKeyFlagBytes = BLOCK_KV * 4;        // float: 1 = the key's row is bad
  static constexpr int kNoteBytes = THREADS * ROW_BLOCKS * 2 * 4;  // float per (thread, row)
  static constexpr int kBytes = kKeyFlagBytes + kNoteBytes;
  __device__ __forceinline__ static float* key_flags(char* base) { return reinterpret_cast<float*>(base); }
  __device__ __forceinline__ static float* notes(char* base) {
    return reinterpret_cast<float*>(base + kKeyFlagBytes) + threadIdx.x * ROW_BLOCKS * 2;
  }
};

// A 32-bit word of two 16-bit elements: the mask of its non-finite halves.
template <class Elem>
__device__ __forceinline__ uint32_t nonfinite_halves(uint32_t w) {
  const uint32_t lo = (w & Elem::kExponentBits) == Elem::kExponentBits ? 0x0000ffffu : 0u;
  const uint32_t hi = ((w >> 16) & Elem::kExponentBits) == Elem::kExponentBits ? 0xffff0000u : 0u;
  return lo | hi;
}

// Zeroes the non-finite elements of every row of a landed V tile and writes each row's flag
// (1.0f: it had one); thread i takes rows i, i + THREADS, ... Rows past the keys were
// zero-filled by the load. The tile's other readers wait for the next barrier.
template <class Elem, class Tile, int THREADS>
__device__ __forceinline__ void zero_nonfinite_rows(char* tile, float* key_flags) {
  for (int row = static_cast<int>(threadIdx.x); row < Tile::kRows; row += THREADS) {
    bool bad = false;
    for (int chunk = 0; chunk < Tile::kChunks; ++chunk) {
      char* at = tile + Tile::chunk_offset(row, chunk);
      uint32_t w[4];
      ptx::ld_shared_v4_b32(w, at);
      JAX_FLASH_UNROLL
      for (int e = 0; e < 4; ++e) {
        const uint32_t halves = nonfinite_halves<Elem>(w[e]);
        if (halves != 0u) {
          ptx::st_shared_b32(at + 4 * e, w[e] & ~halves);
          bad = true;
        }
      }
    }
    ptx::st_shared_f32(key_flags + row, bad ? 1.0f : 0.0f);
  }
}

// Before the first tile: this thread's notes cleared.
template <int ROW_BLOCKS>
__device__ __forceinline__ void clear_notes(float* notes) {
  JAX_FLASH_UNROLL
  for (int i = 0; i < ROW_BLOCKS * 2; ++i) ptx::st_shared_f32(notes + i, 0.0f);
}

// After the mask, before the softmax: note (row block rb, rows lane/4 and lane/4 + 8) when a
// visible logit (not −inf: no dense bias here) of the fragment has a flagged key.
template <int N_BLOCKS>
__device__ __forceinline__ void note_rows_that_see(const float (&s)[N_BLOCKS][4], const float* key_flags, float* notes,
                                                   int rb, int lane) {
  bool sees[2] = {false, false};
  JAX_FLASH_UNROLL
  for (int j = 0; j < N_BLOCKS; ++j) {
    JAX_FLASH_UNROLL
    for (int i = 0; i < 4; ++i) {
      const int col = 8 * j + 2 * (lane & 3) + (i & 1);
      if (s[j][i] != -INFINITY && ptx::ld_shared_f32(key_flags + col) != 0.0f) sees[i >> 1] = true;
    }
  }
  JAX_FLASH_UNROLL
  for (int r = 0; r < 2; ++r)
    if (sees[r]) ptx::st_shared_f32(notes + 2 * rb + r, 1.0f);
}

// At the end: O of row block rb's rows that saw a bad key (any lane of the quad noted it) is NaN.
template <int O_BLOCKS>
__device__ __forceinline__ void poison_rows(float (&o)[O_BLOCKS][4], const float* notes, int rb) {
  JAX_FLASH_UNROLL
  for (int r = 0; r < 2; ++r) {
    float seen = ptx::ld_shared_f32(notes + 2 * rb + r);
    seen = fmaxf(seen, __shfl_xor_sync(0xffffffffu, seen, 1));
    seen = fmaxf(seen, __shfl_xor_sync(0xffffffffu, seen, 2));
    if (seen != 0.0f) {
      JAX_FLASH_UNROLL
      for (int j = 0; j < O_BLOCKS; ++j) o[j][2 * r] = o[j][2 * r + 1] = __uint_as_float(0x7fc00000u);
    }
  }
}

}  // namespace kernels
}  // namespace jax_flash
