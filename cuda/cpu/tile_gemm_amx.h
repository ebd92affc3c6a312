// The bf16 tile product on AMX tiles (`tdpbf16ps`), for CPUs with AMX-BF16: the contract
// and the layouts of GemmBF16 (tile_gemm_bf16.h), which AMX takes as they are:
//   A rows bf16 [M][lda]: a tile is 16 rows × 32 bf16 (16 reduction pairs), stride 2·lda bytes;
//   B pairs [K/2][ldb][2]: a tile is 16 pair rows × 16 columns (64 bytes), stride 4·ldb bytes;
//   C float32 [M][ldc]: a tile is 16 × 16 floats, stride 4·ldc bytes.
// One tdpbf16ps adds a 16 × 32 by 32 × 16 product to a 16 × 16 float32 tile (a row's pairs
// in order, each pair's two products added one after the other). The part of C that is
// whole 16 × 16 tiles over whole 16-pair steps runs on AMX; the rows past the last 16 and
// the pairs past the last 16 run on vdpbf16ps (GemmBF16), so every shape the products ask
// for is served.
//
// The tile instructions come from a Tiles class: AmxTiles (the hardware) or EmulatedTiles
// (the same instructions in C++, per the Intel SDM's pseudo-code, so that the suite runs
// this code on a CPU without AMX: JAX_FLASH_CPU_ISA=amx_emulated).
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu/tile_gemm.h"  // Accumulate
#include "cpu/tile_gemm_bf16.h"
#include "cpu/vec.h"

#if !defined(JAX_FLASH_CPU_AMX_TILES)
#error "include tile_gemm_amx.h only from a translation unit that names its Tiles (kernels_amx*.cc)"
#endif

namespace jax_flash {
namespace cpu {
namespace JAX_FLASH_CPU_ISA {

constexpr int kTileRows = 16;   // rows of every tile
constexpr int kTileCols = 16;   // floats of a C tile row, bf16 pairs of a B tile row
constexpr int kTileBytes = 64;  // bytes of a tile row: 16 floats, 32 bf16
constexpr int kTilePairs = 16;  // reduction pairs of one A tile / B tile

// Tile registers 0-3 hold C (2 × 2), 4-5 A, 6-7 B; all 16 rows × 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      bytes_per_row[t] = kTileBytes;
      rows[t] = kTileRows;
    }
  }
};

#if defined(JAX_FLASH_CPU_AMX_HARDWARE)
// The intrinsics name their tile register in the instruction text (a literal): one branch
// per register.
#define JAX_FLASH_AMX_EACH_TILE(kTile, STATEMENT) \
  if constexpr (kTile == 0) {                     \
    STATEMENT(0);                                 \
  } else if constexpr (kTile == 1) {              \
    STATEMENT(1);                                 \
  } else if constexpr (kTile == 2) {              \
    STATEMENT(2);                                 \
  } else if constexpr (kTile == 3) {              \
    STATEMENT(3);                                 \
  } else if constexpr (kTile == 4) {              \
    STATEMENT(4);                                 \
  } else if constexpr (kTile == 5) {              \
    STATEMENT(5);                                 \
  } else if constexpr (kTile == 6) {              \
    STATEMENT(6);                                 \
  } else {                                        \
    STATEMENT(7);                                 \
  }
struct AmxTiles {
  static void Configure() {
    static const TileConfig config;
    _tile_loadconfig(&config);
  }
  static void Release() { _tile_release(); }
  template <int kTile>
  static void Zero() {
#define JAX_FLASH_AMX_ZERO(t) _tile_zero(t)
    JAX_FLASH_AMX_EACH_TILE(kTile, JAX_FLASH_AMX_ZERO)
#undef JAX_FLASH_AMX_ZERO
  }
  template <int kTile>
  static void Load(const void* base, int64_t stride) {
#define JAX_FLASH_AMX_LOAD(t) _tile_loadd(t, base, stride)
    JAX_FLASH_AMX_EACH_TILE(kTile, JAX_FLASH_AMX_LOAD)
#undef JAX_FLASH_AMX_LOAD
  }
  template <int kTile>
  static void Store(void* base, int64_t stride) {
#define JAX_FLASH_AMX_STORE(t) _tile_stored(t, base, stride)
    JAX_FLASH_AMX_EACH_TILE(kTile, JAX_FLASH_AMX_STORE)
#undef JAX_FLASH_AMX_STORE
  }
  // C tile kC (0-3) += A tile kA (4-5) · B tile kB (6-7): the four pairings AmxBlock uses.
  template <int kC, int kA, int kB>
  static void DotBF16() {
    static_assert(kA == 4 + kC / 2 && kB == 6 + kC % 2, "AmxBlock's tile assignment");
    if constexpr (kC == 0) {
      _tile_dpbf16ps(0, 4, 6);
    } else if constexpr (kC == 1) {
      _tile_dpbf16ps(1, 4, 7);
    } else if constexpr (kC == 2) {
      _tile_dpbf16ps(2, 5, 6);
    } else {
      _tile_dpbf16ps(3, 5, 7);
    }
  }
};
#undef JAX_FLASH_AMX_EACH_TILE
#endif

// The tile registers and instructions in C++ (one set per thread, as the hardware's).
// tdpbf16ps per the SDM: C[m][n] += A[m][2k]·B[k][2n], then += A[m][2k+1]·B[k][2n+1], in
// float32 (a bf16 product is exact in float32), k in order; the hardware also treats
// subnormal inputs and results as zero, which this does not.
struct EmulatedTiles {
  static inline thread_local uint8_t tiles[8][kTileRows * kTileBytes];
  static void Configure() {}
  static void Release() {}
  template <int kTile>
  static void Zero() {
    std::memset(tiles[kTile], 0, sizeof(tiles[kTile]));
  }
  template <int kTile>
  static void Load(const void* base, int64_t stride) {
    for (int r = 0; r < kTileRows; ++r)
      std::memcpy(tiles[kTile] + r * kTileBytes, static_cast<const uint8_t*>(base) + r * stride, kTileBytes);
  }
  template <int kTile>
  static void Store(void* base, int64_t stride) {
    for (int r = 0; r < kTileRows; ++r)
      std::memcpy(static_cast<uint8_t*>(base) + r * stride, tiles[kTile] + r * kTileBytes, kTileBytes);
  }
  static float Widen(const uint8_t* bf16) {
    uint16_t bits;
    std::memcpy(&bits, bf16, 2);
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float x;
    std::memcpy(&x, &wide, 4);
    return x;
  }
  template <int kC, int kA, int kB>
  static void DotBF16() {
    float* c = reinterpret_cast<float*>(tiles[kC]);
    for (int m = 0; m < kTileRows; ++m) {
      for (int k = 0; k < kTilePairs; ++k) {
        const uint8_t* a = tiles[kA] + m * kTileBytes + 4 * k;
        for (int n = 0; n < kTileCols; ++n) {
          const uint8_t* b = tiles[kB] + k * kTileBytes + 4 * n;
          float sum = c[m * kTileCols + n];
          sum += Widen(a) * Widen(b);
          sum += Widen(a + 2) * Widen(b + 2);
          c[m * kTileCols + n] = sum;
        }
      }
    }
  }
};

// C tiles (kRowTiles × kColTiles, at most 2 × 2) at rows m, columns n of C: loaded (kAdd)
// or zeroed (kOverwrite), `pairs` (a multiple of 16) reduction pairs added, stored.
template <class Tiles, bool kLoadC, int kRowTiles, int kColTiles>
JAX_FLASH_INLINE void AmxBlock(int64_t pairs, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float* c,
                               int64_t ldc) {
  auto c_at = [&](int r, int col) { return c + r * kTileRows * ldc + col * kTileCols; };
  auto for_c = [&](auto f) {
    f(std::integral_constant<int, 0>{});
    if constexpr (kColTiles > 1) f(std::integral_constant<int, 1>{});
    if constexpr (kRowTiles > 1) f(std::integral_constant<int, 2>{});
    if constexpr (kRowTiles > 1 && kColTiles > 1) f(std::integral_constant<int, 3>{});
  };
  // C tile t = 2·r + col.
  for_c([&](auto t) {
    if constexpr (kLoadC) {
      Tiles::template Load<t>(c_at(t / 2, t % 2), 4 * ldc);
    } else {
      Tiles::template Zero<t>();
    }
  });
  for (int64_t p = 0; p < pairs; p += kTilePairs) {
    Tiles::template Load<4>(a + 2 * p, 2 * lda);
    if constexpr (kRowTiles > 1) Tiles::template Load<5>(a + kTileRows * lda + 2 * p, 2 * lda);
    Tiles::template Load<6>(b + p * 2 * ldb, 4 * ldb);
    if constexpr (kColTiles > 1) Tiles::template Load<7>(b + p * 2 * ldb + 2 * kTileCols, 4 * ldb);
    for_c([&](auto t) { Tiles::template DotBF16<t, 4 + t / 2, 6 + t % 2>(); });
  }
  for_c([&](auto t) { Tiles::template Store<t>(c_at(t / 2, t % 2), 4 * ldc); });
}

// C[i][·] = f(i, C[i][·]) vector by vector for the first `rows` rows of C (n_dim a multiple
// of 16): the products' scales and the scores' poisoning, applied around the tiles.
template <class F>
JAX_FLASH_INLINE void MapRows(float* c, int64_t ldc, int64_t rows, int64_t n_dim, F f) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < n_dim; j += kLanes) Store(c + i * ldc + j, f(i, Load(c + i * ldc + j)));
}

// GemmBF16's contract (M a multiple of kGemmRows, N of 16; A's and B's elements past the
// real reduction length zero pairs), on AMX where the shape has whole tiles.
template <class Tiles, Accumulate kMode>
void GemmAMX(int64_t m_dim, int64_t n_dim, int64_t pairs, const uint16_t* a, int64_t lda, const uint16_t* b,
             int64_t ldb, float* c, int64_t ldc, const float* row_scale = nullptr, float out_scale = 1.0f) {
  const int64_t m_tiles = m_dim / kTileRows * kTileRows;
  const int64_t tile_pairs = pairs / kTilePairs * kTilePairs;
  if (m_tiles == 0 || tile_pairs == 0) {
    GemmBF16<kMode>(m_dim, n_dim, pairs, a, lda, b, ldb, c, ldc, row_scale, out_scale);
    return;
  }
  // The online softmax's correction first, so that the tiles only add.
  if (kMode == Accumulate::kRescale)
    MapRows(c, ldc, m_tiles, n_dim, [&](int64_t i, VecF x) { return x * row_scale[i]; });
  constexpr bool kOverwrite = kMode == Accumulate::kOverwrite || kMode == Accumulate::kScores;
  constexpr bool kLoadC = !kOverwrite;
  Tiles::Configure();
  for (int64_t m = 0; m < m_tiles; m += 2 * kTileRows) {
    const bool two_rows = m + 2 * kTileRows <= m_tiles;
    for (int64_t n = 0; n < n_dim; n += 2 * kTileCols) {
      const uint16_t* a_m = a + m * lda;
      const uint16_t* b_n = b + 2 * n;
      float* c_mn = c + m * ldc + n;
      const bool two_cols = n + 2 * kTileCols <= n_dim;
      if (two_rows && two_cols) {
        AmxBlock<Tiles, kLoadC, 2, 2>(tile_pairs, a_m, lda, b_n, ldb, c_mn, ldc);
      } else if (two_rows) {
        AmxBlock<Tiles, kLoadC, 2, 1>(tile_pairs, a_m, lda, b_n, ldb, c_mn, ldc);
      } else if (two_cols) {
        AmxBlock<Tiles, kLoadC, 1, 2>(tile_pairs, a_m, lda, b_n, ldb, c_mn, ldc);
      } else {
        AmxBlock<Tiles, kLoadC, 1, 1>(tile_pairs, a_m, lda, b_n, ldb, c_mn, ldc);
      }
    }
  }
  Tiles::Release();
  // The pairs past the last whole step, then the overwrite's scale, on the tile rows.
  if (tile_pairs < pairs)
    GemmBF16<Accumulate::kAdd>(m_tiles, n_dim, pairs - tile_pairs, a + 2 * tile_pairs, lda, b + tile_pairs * 2 * ldb,
                               ldb, c, ldc);
  if (kMode == Accumulate::kScores) {
    MapRows(c, ldc, m_tiles, n_dim, [&](int64_t, VecF x) { return PoisonInfinite(x * out_scale); });
  } else if (kOverwrite && out_scale != 1.0f) {
    MapRows(c, ldc, m_tiles, n_dim, [&](int64_t, VecF x) { return x * out_scale; });
  }
  // The rows past the last whole tile.
  if (m_tiles < m_dim)
    GemmBF16<kMode>(m_dim - m_tiles, n_dim, pairs, a + m_tiles * lda, lda, b, ldb, c + m_tiles * ldc, ldc,
                    row_scale == nullptr ? nullptr : row_scale + m_tiles, out_scale);
}

}  // namespace JAX_FLASH_CPU_ISA
}  // namespace cpu
}  // namespace jax_flash
