// Launch grids of the kernels with one CTA per (block, head, batch). grid.y and grid.z hold at
// most 65535 blocks, grid.x 2^31 − 1, so the batch is folded into grid.x with the blocks
// (block fastest: the CTAs of one (head, batch) stay neighbours and share its K and V in L2),
// and the heads span grid.y, continued in grid.z past 65535. Any B·N launches, and B, N beyond
// 65535 too. Only the batch is decoded by division: head and block come from special registers
// the compiler can re-read instead of keeping them live (the backward has no register to spare).
#pragma once

#include <cstdint>
#include <string>

#include "kernels/platform.h"

namespace jax_flash {
namespace kernels {

constexpr int64_t kMaxGridX = 2147483647;  // 2^31 − 1 blocks in grid.x
constexpr int64_t kMaxGridYZ = 65535;      // ... and in grid.y, grid.z

struct GridIndex {
  int block;
  int head;
  int batch;
};

// A (blocks x heads x batch) grid of CTAs.
struct FoldedGrid {
  int blocks;
  int heads;
  int batch;

  // grid.x = (block, batch), grid.y·grid.z >= heads; an error when even that does not fit.
  LaunchError dims(dim3* grid) const {
    const int64_t x = static_cast<int64_t>(blocks) * batch;
    const int64_t y = heads < kMaxGridYZ ? heads : kMaxGridYZ;
    const int64_t z = (heads + kMaxGridYZ - 1) / kMaxGridYZ;
    if (x > kMaxGridX || z > kMaxGridYZ)
      return "a grid of " + std::to_string(blocks) + " blocks x " + std::to_string(batch) + " batch x " +
             std::to_string(heads) + " heads does not fit the launch limits (grid.x 2^31 - 1, grid.y and z 65535)";
    *grid = dim3(static_cast<unsigned>(x), static_cast<unsigned>(y), static_cast<unsigned>(z));
    return {};
  }

  __host__ __device__ __forceinline__ GridIndex of(unsigned x, unsigned y, unsigned z, unsigned grid_y) const {
    const int i = static_cast<int>(x);
    return {i % blocks, static_cast<int>(y + grid_y * z), i / blocks};
  }
  // This CTA's (block, head, batch).
  __device__ __forceinline__ GridIndex index() const { return of(blockIdx.x, blockIdx.y, blockIdx.z, gridDim.y); }
  // The same, read afresh from the special registers (volatile: never merged with an earlier
  // read), for code after a long loop: the index held across it would take registers.
  __device__ __forceinline__ GridIndex index_again() const {
#ifdef JAX_FLASH_EMULATE
    return index();
#else
    unsigned x, y, z;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(x));
    asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(y));
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
    return of(x, y, z, gridDim.y);
#endif
  }
  // False for the CTAs past the last head (the last grid.z slice of more than 65535 heads).
  __host__ __device__ __forceinline__ bool contains(const GridIndex& at) const { return at.head < heads; }
};

// The thread's index in its CTA, %tid.x, read afresh in a volatile asm (never merged with an
// earlier read): for code after a long loop, where the index held across it would take a
// register (a special register read costs less than a spill).
__device__ __forceinline__ int tid_x_again() {
#ifndef JAX_FLASH_EMULATE
  unsigned x;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(x));
  return static_cast<int>(x);
#else
  return static_cast<int>(threadIdx.x);
#endif
}

// The 1-D grid of `blocks` CTAs, or an error when there are more than grid.x holds.
inline LaunchError LinearGrid(int64_t blocks, dim3* grid) {
  if (blocks > kMaxGridX) return "a grid of " + std::to_string(blocks) + " blocks exceeds the 2^31 - 1 of grid.x";
  *grid = dim3(static_cast<unsigned>(blocks));
  return {};
}

}  // namespace kernels
}  // namespace jax_flash
