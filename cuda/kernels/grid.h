// Launch grids. grid.y and grid.z hold at most 65535 blocks, grid.x 2^31 − 1: a kernel with a
// CTA per (block, head, batch) folds all three into grid.x, so any batch size and head count
// launches (B·N beyond 65535 included). Blocks are numbered as the 3-D grid would number
// them — block fastest, then head, then batch — so CTAs that run together still share their
// head's K and V in L2.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/platform.h"

namespace jax_flash {
namespace kernels {

constexpr int64_t kMaxGridX = 2147483647;  // 2^31 − 1 blocks in grid.x

struct GridIndex {
  int block;
  int head;
  int batch;
};

// A (blocks x heads x batch) grid of CTAs, folded into grid.x.
struct FoldedGrid {
  int blocks;
  int heads;
  int batch;

  __host__ __device__ __forceinline__ GridIndex of(int i) const {
    return {i % blocks, (i / blocks) % heads, i / blocks / heads};
  }
  // This CTA's (block, head, batch).
  __device__ __forceinline__ GridIndex index() const { return of(static_cast<int>(blockIdx.x)); }
};

// The grid of `blocks` CTAs in grid.x, or an error when there are more than grid.x holds.
inline LaunchError LinearGrid(int64_t blocks, dim3* grid) {
  if (blocks > kMaxGridX)
    return "a grid of " + std::to_string(blocks) + " blocks exceeds the 2^31 - 1 of grid.x";
  *grid = dim3(static_cast<unsigned>(blocks));
  return {};
}

inline LaunchError LinearGrid(const FoldedGrid& g, dim3* grid) {
  return LinearGrid(static_cast<int64_t>(g.blocks) * g.heads * g.batch, grid);
}

}  // namespace kernels
}  // namespace jax_flash
