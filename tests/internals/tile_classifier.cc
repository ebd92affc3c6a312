// The tile classifiers against brute force: the CUDA kernels' Mask (kernels/mask.h: keys_of_rows,
// rows_of_keys, is_interior, interior_row_blocks, and the segment ranges' disjoint /
// same_single) and the cpu kernels' MaskGeometry (cpu/problem.h: keys_of_row, rows_of_keys,
// ClassifyTile), each compared with the per-element visibility computed from the attributes, on
// every tile shape the kernels use (kernels/tile.h TileShapeFor over every compiled (H, Hv) and layout;
// cpu/tiling.h kBlockQ x kBlockK), with lengths, window edges and query offsets within ±2 of
// every tile boundary. Built and run by tests/internals/test_tile_classifier.py:
//   g++ -std=c++17 -O1 -Icuda tests/internals/tile_classifier.cc
// `tile_classifier cuda` or `cpu` runs one part. Prints a summary; exits non-zero (after printing the first failures)
// when a check fails.
#define JAX_FLASH_EMULATE 1  // the kernel headers compiled for the host, as cuda/emu does

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/problem.h"
#include "cpu/tiling.h"
#include "kernels/dispatch.h"
#include "kernels/mask.h"
#include "kernels/tile.h"

namespace k = jax_flash::kernels;
namespace c = jax_flash::cpu;

namespace {

int64_t g_checks = 0, g_configs = 0, g_failures = 0;
struct Config;
std::string Describe(const Config& f);
const std::string* g_name = nullptr;  // the configuration being checked, for messages
const Config* g_config = nullptr;

void fail(const std::string& what) {
  if (g_failures < 12)
    std::printf("FAIL %s\n     at %s: %s\n", what.c_str(), g_name->c_str(), Describe(*g_config).c_str());
  ++g_failures;
}
#define CHECK(cond, msg)                                   \
  do {                                                     \
    ++g_checks;                                            \
    if (!(cond)) fail(std::string(msg) + "  [" #cond "]"); \
  } while (0)

std::string S(int64_t x) { return std::to_string(x); }

constexpr int64_t kUnbounded = -1;

// One batch row's mask as the attributes and operands state it.
struct Config {
  int64_t T, S;          // q_len, kv_len
  int64_t q_valid_in;    // q_lengths[b] as passed (clipped to [0, T] by the kernels)
  int64_t kv_valid_in;   // kv_lengths[b]
  int32_t offset;        // q_offsets[b]
  int64_t wl, wr;        // window_left / window_right attributes (-1: unbounded)
  int segments;          // segment pattern (0: off)
  int64_t split_q = 0, split_kv = 0;  // pattern parameters
};

std::string Describe(const Config& f) {
  return "T=" + S(f.T) + " S=" + S(f.S) + " q_length=" + S(f.q_valid_in) + " kv_length=" + S(f.kv_valid_in) +
         " q_offset=" + S(f.offset) + " window=(" + S(f.wl) + ", " + S(f.wr) + ") segments=" + S(f.segments) +
         " split=(" + S(f.split_q) + ", " + S(f.split_kv) + ")";
}

// Segment id patterns: 1 two documents, split at split_q / split_kv; 2 alternating ids 0, 1
// per position; 3 the queries one document (id 1), the keys documents of 7 positions.
std::vector<int32_t> Segments(const Config& f, bool queries) {
  const int64_t n = queries ? f.T : f.S, split = queries ? f.split_q : f.split_kv;
  std::vector<int32_t> ids(n, 0);
  for (int64_t i = 0; i < n; ++i) {
    switch (f.segments) {
      case 1: ids[i] = i < split ? 3 : 4; break;
      case 2: ids[i] = static_cast<int32_t>(i % 2); break;
      case 3: ids[i] = queries ? 1 : static_cast<int32_t>(i / 7); break;
      default: ids[i] = 0;
    }
  }
  return ids;
}

// The brute force: every (t, s) from the definition (cuda/README.md).
struct Truth {
  int64_t T, S;
  std::vector<uint8_t> geo;   // [T][S]: lengths and window
  std::vector<uint8_t> full;  // [T][S]: and segment ids
  std::vector<int32_t> geo_sum, full_sum;  // 2-D prefix sums [T+1][S+1]
  std::vector<int32_t> q_ids, kv_ids;
  int64_t q_valid, kv_valid;
  // Per row: the smallest and one past the largest visible key (before segment ids); per key,
  // the rows.
  std::vector<int64_t> row_lo, row_hi;
  std::vector<int32_t> col_lo, col_hi;

  explicit Truth(const Config& f) : T(f.T), S(f.S) {
    q_valid = std::clamp<int64_t>(f.q_valid_in, 0, T);
    kv_valid = std::clamp<int64_t>(f.kv_valid_in, 0, S);
    q_ids = Segments(f, true);
    kv_ids = Segments(f, false);
    geo.assign(T * S, 0);
    row_lo.assign(T, INT64_MAX), row_hi.assign(T, INT64_MIN);
    col_lo.assign(S, INT32_MAX), col_hi.assign(S, INT32_MIN);
    // The window's diagonals; int64 holds them (|offset| < 2^31, windows <= 2^62 in this sweep).
    const int64_t lo = f.wl == kUnbounded ? INT64_MIN : int64_t{f.offset} - f.wl;
    const int64_t hi = f.wr == kUnbounded ? INT64_MAX : int64_t{f.offset} + f.wr;
    for (int64_t t = 0; t < T; ++t) {
      uint8_t* row = geo.data() + t * S;
      for (int64_t s = 0; s < S; ++s) row[s] = (t < q_valid) & (s < kv_valid) & (s - t >= lo) & (s - t <= hi);
      const int32_t t32 = static_cast<int32_t>(t);
      for (int64_t s = 0; s < S; ++s) {
        col_lo[s] = row[s] ? std::min(col_lo[s], t32) : col_lo[s];
        col_hi[s] = row[s] ? std::max(col_hi[s], t32 + 1) : col_hi[s];
      }
      for (int64_t s = 0; s < S; ++s)
        if (row[s]) {
          row_lo[t] = s;
          break;
        }
      for (int64_t s = S - 1; s >= 0; --s)
        if (row[s]) {
          row_hi[t] = s + 1;
          break;
        }
    }
    geo_sum = Sum(geo);
    full = geo;
    if (f.segments == 0) {
      full_sum = geo_sum;
      return;
    }
    for (int64_t t = 0; t < T; ++t)
      for (int64_t s = 0; s < S; ++s) full[t * S + s] &= q_ids[t] == kv_ids[s];
    full_sum = Sum(full);
  }
  std::vector<int32_t> Sum(const std::vector<uint8_t>& x) const {
    std::vector<int32_t> sum((T + 1) * (S + 1), 0);
    for (int64_t t = 0; t < T; ++t) {
      int32_t run = 0;
      const int32_t* above = sum.data() + t * (S + 1);
      int32_t* out = sum.data() + (t + 1) * (S + 1);
      for (int64_t s = 0; s < S; ++s) {
        run += x[t * S + s];
        out[s + 1] = above[s + 1] + run;
      }
    }
    return sum;
  }
  // Visible elements of rows [t0, t1) x keys [s0, s1), clipped to the arrays.
  int64_t Count(const std::vector<int32_t>& sum, int64_t t0, int64_t t1, int64_t s0, int64_t s1) const {
    t0 = std::clamp<int64_t>(t0, 0, T), t1 = std::clamp<int64_t>(t1, 0, T);
    s0 = std::clamp<int64_t>(s0, 0, S), s1 = std::clamp<int64_t>(s1, 0, S);
    if (t1 <= t0 || s1 <= s0) return 0;
    return sum[t1 * (S + 1) + s1] - sum[t0 * (S + 1) + s1] - sum[t1 * (S + 1) + s0] + sum[t0 * (S + 1) + s0];
  }
  // Whether every element of the tile exists and is visible.
  bool All(const std::vector<int32_t>& sum, int64_t t0, int64_t rows, int64_t s0, int64_t cols) const {
    if (t0 < 0 || s0 < 0 || t0 + rows > T || s0 + cols > S) return false;
    return Count(sum, t0, t0 + rows, s0, s0 + cols) == rows * cols;
  }
  // The smallest interval [lo, hi) of keys holding every visible key of rows [t0, t1)
  // (lo >= hi: none), before segment ids.
  std::pair<int64_t, int64_t> KeysOfRows(int64_t t0, int64_t t1) const {
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int64_t t = std::max<int64_t>(t0, 0); t < std::min(t1, T); ++t)
      lo = std::min(lo, row_lo[t]), hi = std::max(hi, row_hi[t]);
    return {lo, hi};
  }
  std::pair<int64_t, int64_t> RowsOfKeys(int64_t s0, int64_t s1) const {
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int64_t s = std::max<int64_t>(s0, 0); s < std::min(s1, S); ++s)
      if (col_lo[s] != INT32_MAX) lo = std::min<int64_t>(lo, col_lo[s]), hi = std::max<int64_t>(hi, col_hi[s]);
    return {lo, hi};
  }
  // The segment ids of positions [begin, begin + count) below `valid`: {min, max}, or empty.
  static std::pair<int32_t, int32_t> IdRange(const std::vector<int32_t>& ids, int64_t begin, int64_t count,
                                             int64_t valid) {
    int32_t lo = INT32_MAX, hi = INT32_MIN;
    for (int64_t i = begin; i < begin + count && i < valid && i < static_cast<int64_t>(ids.size()); ++i)
      lo = std::min(lo, ids[i]), hi = std::max(hi, ids[i]);
    return {lo, hi};
  }
};

// An interval returned by a classifier against the brute force's: both empty, or the same.
template <class R>
void ExpectInterval(const char* what, const R& got_lo_hi, std::pair<int64_t, int64_t> want, int64_t a, int64_t b) {
  const int64_t lo = got_lo_hi.first, hi = got_lo_hi.second;
  auto call = [&] { return std::string(what) + "(" + S(a) + ", " + S(b) + ") = [" + S(lo) + ", " + S(hi) + ")"; };
  if (want.first >= want.second) {
    CHECK(hi <= lo, call() + ", expected empty");
  } else {
    CHECK(lo == want.first && hi == want.second, call() + ", expected [" + S(want.first) + ", " + S(want.second) + ")");
  }
}

// ---- the CUDA kernels' classifier ------------------------------------------------------------

// One kernel's tile geometry: query blocks of block_q rows and key tiles of block_kv keys
// (keys_of_rows, rows_of_keys), and the tiles whose interior is asked (is_interior):
// interior_rows x interior_cols, aligned to their size.
struct KernelTiles {
  std::string name;
  int block_q, block_kv, interior_rows, interior_cols;
  bool operator<(const KernelTiles& o) const {
    return std::tie(block_q, block_kv, interior_rows, interior_cols) <
           std::tie(o.block_q, o.block_kv, o.interior_rows, o.interior_cols);
  }
};

// Every tile shape of the kernels (fwd.h, bwd.h): per compiled (H, Hv) and layout, the
// forward (16-row m16 blocks of a block_q query block against block_kv keys; GQA packing: one
// position), the backward dK/dV (block_q queries against each warp's 16 keys) and dQ kernels.
std::vector<KernelTiles> CudaTileShapes() {
  std::vector<std::pair<int, int>> pairs;
  for (int h : k::kHeadDims) pairs.push_back({h, h});
  for (k::HeadDimPair p : k::kNarrowValuePairs) pairs.push_back({p.head_dim, p.v_head_dim});
  std::set<KernelTiles> shapes;
  for (auto [h, hv] : pairs) {
    for (k::Layout layout : {k::Layout::kWarp16, k::Layout::kWarp32}) {
      const std::string at = "(" + S(h) + ", " + S(hv) + ") " + k::LayoutName(layout);
      const k::TileShape f = k::TileShapeFor(k::Pass::kForward, h, hv, layout);
      const k::TileShape b = k::TileShapeFor(k::Pass::kBackward, h, hv, layout);
      const k::TileShape q = k::TileShapeFor(k::Pass::kBackwardDq, h, hv, layout);
      shapes.insert({"forward " + at, f.block_q, f.block_kv, k::MMA_M, f.block_kv});
      shapes.insert({"forward, GQA packing " + at, 1, f.block_kv, 1, f.block_kv});
      shapes.insert({"backward dK/dV " + at, b.block_q, b.block_kv, b.block_q, k::MMA_M});
      shapes.insert({"backward dQ " + at, q.block_q, q.block_kv, k::MMA_M, q.block_kv});
    }
  }
  return {shapes.begin(), shapes.end()};
}

void CheckCuda(const Config& f, const Truth& truth, const KernelTiles& tiles) {
  k::AttentionParams p;
  p.batch = 1;
  p.q_len = static_cast<int>(f.T);
  p.kv_len = static_cast<int>(f.S);
  // The handler's clamp (kernels/ffi_attention.h CheckOperands): windows wider than 2^32 are 2^32.
  auto window = [](int64_t w) { return w < 0 ? int64_t{-1} : std::min<int64_t>(w, int64_t{1} << 32); };
  p.window_left = window(f.wl);
  p.window_right = window(f.wr);
  const int32_t q_length = static_cast<int32_t>(f.q_valid_in), kv_length = static_cast<int32_t>(f.kv_valid_in);
  p.q_lengths = &q_length;
  p.kv_lengths = &kv_length;
  p.q_offsets = &f.offset;
  p.use_segment_ids = f.segments != 0;
  p.q_segment_ids = truth.q_ids.data();
  p.kv_segment_ids = truth.kv_ids.data();
  const k::Mask mask = k::Mask::of(p, 0);
  CHECK(mask.q_valid == truth.q_valid && mask.kv_valid == truth.kv_valid, "Mask::of lengths");
  for (int64_t t = 0; t < f.T; ++t)
    for (int64_t s = 0; s < f.S; ++s)
      if (mask.visible(static_cast<int>(t), static_cast<int>(s)) != static_cast<bool>(truth.full[t * f.S + s])) {
        CHECK(false, "Mask::visible(" + S(t) + ", " + S(s) + ")");
        return;
      }

  // keys_of_rows over each query block (the forward and dQ kernels' key range).
  for (int64_t t0 = 0; t0 < f.T; t0 += tiles.block_q) {
    const k::Range r = mask.keys_of_rows(static_cast<int>(t0), static_cast<int>(t0 + tiles.block_q));
    ExpectInterval("keys_of_rows", std::pair<int64_t, int64_t>{r.lo, r.hi}, truth.KeysOfRows(t0, t0 + tiles.block_q),
                   t0, t0 + tiles.block_q);
  }
  // rows_of_keys over each key block (the backward's query range).
  for (int64_t s0 = 0; s0 < f.S; s0 += tiles.block_kv) {
    const k::Range r = mask.rows_of_keys(static_cast<int>(s0), static_cast<int>(s0 + tiles.block_kv));
    ExpectInterval("rows_of_keys", std::pair<int64_t, int64_t>{r.lo, r.hi}, truth.RowsOfKeys(s0, s0 + tiles.block_kv),
                   s0, s0 + tiles.block_kv);
  }
  // interior_row_blocks over each key block (the plain backward's interior run, bwd.h): exactly
  // the query blocks among those that see the keys in which every row of the whole block sees
  // every key of the whole key block.
  for (int64_t s0 = 0; s0 < f.S; s0 += tiles.block_kv) {
    const k::Range seen = mask.rows_of_keys(static_cast<int>(s0), static_cast<int>(s0 + tiles.block_kv));
    const int begin = seen.lo / tiles.block_q, end = seen.empty() ? begin : k::CeilDiv(seen.hi, tiles.block_q);
    const k::Range r = mask.interior_row_blocks(tiles.block_q, static_cast<int>(s0), tiles.block_kv, begin, end);
    CHECK(begin <= r.lo && r.lo <= r.hi && r.hi <= end,
          "interior_row_blocks of keys [" + S(s0) + ", +" + S(tiles.block_kv) + ") outside [" + S(begin) + ", " +
              S(end) + ")");
    for (int qb = begin; qb < end; ++qb) {
      const bool want = truth.All(truth.geo_sum, int64_t{qb} * tiles.block_q, tiles.block_q, s0, tiles.block_kv);
      CHECK((r.lo <= qb && qb < r.hi) == want, "interior_row_blocks [" + S(r.lo) + ", " + S(r.hi) + ") of keys [" +
                                                  S(s0) + ", +" + S(tiles.block_kv) + "), query block " + S(qb) +
                                                  ", brute force: " + (want ? "all" : "not all") + " visible");
    }
  }
  // is_interior over each tile (also past T and S, as the kernels' last tiles are), with the
  // segment decision the kernels take from the warp's id ranges.
  const int rows = tiles.interior_rows, cols = tiles.interior_cols;
  for (int64_t t0 = 0; t0 < f.T; t0 += rows) {
    for (int64_t s0 = 0; s0 < f.S; s0 += cols) {
      auto tile = [&] {
        return "tile rows [" + S(t0) + ", " + S(t0 + rows) + ") keys [" + S(s0) + ", " + S(s0 + cols) + ")";
      };
      const bool geo_all = truth.All(truth.geo_sum, t0, rows, s0, cols);
      CHECK(mask.is_interior(static_cast<int>(t0), rows, static_cast<int>(s0), cols, true) == geo_all,
            "is_interior(segments allow all) of " + tile() + ", brute force: " + (geo_all ? "all" : "not all") +
                " visible");
      CHECK(!mask.is_interior(static_cast<int>(t0), rows, static_cast<int>(s0), cols, false),
            "is_interior(segments do not allow all) of " + tile());
      if (f.segments == 0) continue;
      // fwd.h / bwd.h: a warp skips a tile whose id ranges are disjoint, and treats it as
      // interior when both ranges are one and the same id (warp_segment_range: positions
      // below the valid lengths).
      const auto qr = Truth::IdRange(truth.q_ids, t0, rows, truth.q_valid);
      const auto kr = Truth::IdRange(truth.kv_ids, s0, cols, truth.kv_valid);
      const k::SegmentRange q_ids{qr.first, qr.second}, kv_ids{kr.first, kr.second};
      const int64_t visible = truth.Count(truth.full_sum, t0, t0 + rows, s0, s0 + cols);
      if (q_ids.disjoint(kv_ids))
        CHECK(visible == 0, "segment ranges disjoint but " + S(visible) + " visible in " + tile());
      const bool interior =
          mask.is_interior(static_cast<int>(t0), rows, static_cast<int>(s0), cols, q_ids.same_single(kv_ids));
      if (interior) CHECK(truth.All(truth.full_sum, t0, rows, s0, cols), "is_interior with segments of " + tile());
    }
  }
}

// ---- the cpu kernels' classifier -------------------------------------------------------------

void CheckCpu(const Config& f, const Truth& truth) {
  c::Problem p;
  p.batch = 1;
  p.q_len = f.T;
  p.kv_len = f.S;
  p.window_left = f.wl;
  p.window_right = f.wr;
  const int32_t q_length = static_cast<int32_t>(f.q_valid_in), kv_length = static_cast<int32_t>(f.kv_valid_in);
  p.q_lengths = &q_length;
  p.kv_lengths = &kv_length;
  p.q_offsets = &f.offset;
  p.use_segment_ids = f.segments != 0;
  p.q_segment_ids = truth.q_ids.data();
  p.kv_segment_ids = truth.kv_ids.data();
  c::MaskGeometry g(p, 0);
  CHECK(g.q_valid == truth.q_valid && g.kv_valid == truth.kv_valid, "MaskGeometry lengths");
  for (int64_t t = -1; t <= f.T; ++t) {
    const c::KeyInterval r = g.keys_of_row(t);
    ExpectInterval("keys_of_row", std::pair<int64_t, int64_t>{r.lo, r.hi}, truth.KeysOfRows(t, t + 1), t, t + 1);
  }
  // rows_of_keys over the backward's key blocks, clipped to kv_valid (flash_backward_pass.h).
  for (int64_t s0 = 0; s0 < f.S; s0 += c::kBlockK) {
    const int64_t cols = std::clamp<int64_t>(g.kv_valid - s0, 0, std::min(c::kBlockK, f.S - s0));
    const c::KeyInterval r = g.rows_of_keys(s0, s0 + cols);
    ExpectInterval("rows_of_keys", std::pair<int64_t, int64_t>{r.lo, r.hi}, truth.RowsOfKeys(s0, s0 + cols), s0,
                   s0 + cols);
  }
  // ClassifyTile over the tiles the kernels classify, padded or not, with and without a dense
  // operand: the forward's query blocks of live rows (below q_valid; the packed-heads forward's
  // one position is T = 1) against key blocks below kv_valid, and the backward's query blocks
  // clipped to rows_of_keys of each key block (flash_backward_pass.h).
  for (bool dense : {false, true}) {
    g.dense = dense;
    for (bool padded : {false, true}) {
      auto classify = [&](int64_t t0, int64_t rows, int64_t s0, int64_t cols) {
        auto tile = [&] {
          return "ClassifyTile(rows [" + S(t0) + ", " + S(t0 + rows) + ") keys [" + S(s0) + ", " + S(s0 + cols) +
                 ") padded=" + S(padded) + " dense=" + S(dense) + ")";
        };
        const c::TileVisibility v = c::ClassifyTile(g, t0, rows, s0, cols, padded);
        const int64_t visible = truth.Count(truth.full_sum, t0, t0 + rows, s0, s0 + cols);
        const int64_t geo_visible = truth.Count(truth.geo_sum, t0, t0 + rows, s0, s0 + cols);
        const bool all = visible == rows * cols;
        if (v == c::TileVisibility::kSkip) CHECK(visible == 0, tile() + " = kSkip with " + S(visible) + " visible");
        if (v == c::TileVisibility::kFull) CHECK(all && !padded && !dense, tile() + " = kFull, not all visible");
        if (f.segments == 0) {
          CHECK((v == c::TileVisibility::kSkip) == (geo_visible == 0), tile() + " skip exactly the empty tiles");
          CHECK((v == c::TileVisibility::kFull) == (all && !padded && !dense), tile() + " full exactly the full tiles");
        } else if (all && !padded && !dense) {
          // One id on both sides (the full tile's ids all agree): then it is kFull.
          const auto qr = Truth::IdRange(truth.q_ids, t0, rows, f.T);
          const auto kr = Truth::IdRange(truth.kv_ids, s0, cols, f.S);
          if (qr.first == qr.second && kr.first == kr.second)
            CHECK(v == c::TileVisibility::kFull, tile() + " of one segment, all visible, not kFull");
        }
      };
      for (int64_t s0 = 0; s0 < truth.kv_valid; s0 += c::kBlockK) {
        const int64_t cols = std::min(c::kBlockK, truth.kv_valid - s0);
        for (int64_t t0 = 0; t0 < truth.q_valid; t0 += c::kBlockQ)
          classify(t0, std::min(c::kBlockQ, truth.q_valid - t0), s0, cols);
        const c::KeyInterval rows_seen = g.rows_of_keys(s0, s0 + cols);
        for (int64_t t0 = rows_seen.lo / c::kBlockQ * c::kBlockQ; t0 < rows_seen.hi; t0 += c::kBlockQ)
          classify(t0, std::min(c::kBlockQ, rows_seen.hi - t0), s0, cols);
      }
    }
  }
  g.dense = false;
}

// ---- the sweep -------------------------------------------------------------------------------

std::vector<int64_t> Unique(std::vector<int64_t> v, int64_t lo, int64_t hi) {
  std::vector<int64_t> out;
  for (int64_t x : v)
    if (x >= lo && x <= hi) out.push_back(x);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// Positions within ±2 of every multiple of `step` in [lo, hi], and the ends.
std::vector<int64_t> NearBoundaries(int64_t step, int64_t lo, int64_t hi) {
  std::vector<int64_t> v = {lo, lo + 1, hi - 1, hi};
  for (int64_t m = (lo / step - 1) * step; m <= hi + step; m += step)
    for (int64_t e = -2; e <= 2; ++e) v.push_back(m + e);
  return Unique(v, lo, hi);
}

// Window and offset configurations of one (T, S) whose band edges (offset - window_left,
// offset + window_right: the diagonals s - t the window keeps) fall within ±2 of every tile
// boundary: the diagonals jC - iR through the tiles' corners (row tiles of R, key tiles of C).
std::vector<Config> Windows(int64_t T, int64_t S, int64_t R, int64_t C) {
  std::vector<int64_t> corners;
  for (int64_t i = 0; i * R <= T + R; ++i)
    for (int64_t j = 0; j * C <= S + C; ++j) corners.push_back(j * C - i * R);
  std::vector<int64_t> edges;
  for (int64_t x : corners)
    for (int64_t e = -2; e <= 2; ++e) edges.push_back(x + e);
  edges = Unique(edges, -T - 3, S + 3);
  std::vector<Config> out;
  auto add = [&](int64_t offset, int64_t wl, int64_t wr) {
    out.push_back(Config{T, S, T, S, static_cast<int32_t>(offset), wl, wr, 0});
  };
  const int64_t mid = (S - T) / 2;
  for (int64_t e : edges) {
    add(e, kUnbounded, 0);            // causal at offset e: band_hi = e
    add(e, 0, kUnbounded);            // band_lo = e
    add(e, 0, 0);                     // the one diagonal e
    // One edge at e, the other fixed (inside and at the far ends of the tiles).
    for (int64_t other : {mid, S + 2, -T - 2}) {
      if (other <= e) add(e, e - other, 0);  // band [other, e]
      if (other >= e) add(e, 0, other - e);  // band [e, other]
    }
  }
  // Offsets and windows at the ends of their ranges (clipping to [-T, S]).
  const int64_t big[] = {int64_t{1} << 31,       (int64_t{1} << 32) - 1, int64_t{1} << 32,
                         (int64_t{1} << 32) + 1, int64_t{1} << 40,       int64_t{1} << 62};
  for (int64_t offset : {int64_t{INT32_MIN}, int64_t{INT32_MIN} + 1, int64_t{INT32_MAX}, int64_t{-1}, int64_t{0}}) {
    add(offset, kUnbounded, kUnbounded);
    for (int64_t w : big) {
      add(offset, w, 0);
      add(offset, 0, w);
      add(offset, w, w);
      add(offset, w, kUnbounded);
      add(offset, kUnbounded, w);
    }
    add(offset, 0, 0);
    add(offset, kUnbounded, 0);
    add(offset, 0, kUnbounded);
  }
  return out;
}

// Lengths at the tile boundaries (and 0, 1, the full length), under a few windows, with
// segment id patterns split at the boundaries.
std::vector<Config> Lengths(int64_t T, int64_t S, int64_t R, int64_t C) {
  std::vector<Config> out;
  const std::vector<int64_t> qv = NearBoundaries(R, 0, T), kvv = NearBoundaries(C, 0, S);
  struct W {
    int64_t offset, wl, wr;
  };
  const std::vector<W> windows = {
      {0, kUnbounded, kUnbounded}, {0, kUnbounded, 0}, {S - T, kUnbounded, 0}, {C - 1, R, 0}, {-1, 2, 3}};
  for (int64_t q : qv)
    for (int64_t kv : kvv)
      for (size_t w = 0; w < windows.size(); ++w)
        if (w < 2 || q == T || kv == S || q == kv)
          out.push_back(Config{T, S, q, kv, static_cast<int32_t>(windows[w].offset), windows[w].wl, windows[w].wr, 0});
  // Lengths outside [0, T] (clipped).
  for (int64_t q : {int64_t{-5}, int64_t{-1}, T + 1, int64_t{INT32_MAX}})
    for (int64_t kv : {int64_t{-3}, S + 7, int64_t{INT32_MAX}, S})
      out.push_back(Config{T, S, q, kv, 0, kUnbounded, 0, 0});
  // Segment ids: two documents split within ±2 of every boundary; alternating ids; many
  // short key documents.
  for (int pattern : {1, 2, 3}) {
    for (int64_t sq : (pattern == 1 ? qv : std::vector<int64_t>{0})) {
      for (int64_t skv : (pattern == 1 ? kvv : std::vector<int64_t>{0})) {
        for (size_t w = 0; w < windows.size(); ++w) {
          if (pattern == 1 && w >= 2) continue;
          for (int64_t kv : {S, S - 1}) {
            if (pattern == 1 && kv != S) continue;
            out.push_back(Config{T, S, T, kv, static_cast<int32_t>(windows[w].offset), windows[w].wl, windows[w].wr,
                                 pattern, sq, skv});
          }
        }
      }
    }
  }
  return out;
}

// Every configuration of one tile geometry: row tiles of `rows` inside query blocks of
// `block_q`, key tiles of `cols` inside key blocks of `block_kv`. Lengths T, S: one tile,
// ragged tiles either side of the first boundaries, a block and one row past it.
template <class Check>
void Sweep(const std::string& name, int64_t rows, int64_t cols, int64_t block_q, int64_t block_kv, const Check& check) {
  const int64_t before = g_checks, configs_before = g_configs;
  const auto start = std::chrono::steady_clock::now();
  // (Two whole tiles and a ragged one where tiles are small.)
  const std::vector<int64_t> Ts =
      Unique({1, 3, rows - 1, rows + 1, rows <= 32 ? 2 * rows + 1 : 1, block_q - 1, block_q + 1}, 1, 1 << 20);
  const std::vector<int64_t> Ss =
      Unique({1, cols - 1, cols + 1, cols <= 32 ? 2 * cols + 1 : 1, block_kv - 1, block_kv + 1}, 1, 1 << 20);
  for (int64_t T : Ts) {
    for (int64_t S : Ss) {
      // Every T with the longest S and every S with the longest T; of the rest, the shortest.
      if (T != Ts.back() && S != Ss.back() && T != Ts.front() && S != Ss.front()) continue;
      std::vector<Config> configs = Windows(T, S, rows, cols);
      // The length and segment sweep where both lengths span more than one tile.
      if (T == Ts.back() && S >= Ss[Ss.size() - 2]) {
        std::vector<Config> more = Lengths(T, S, rows, cols);
        configs.insert(configs.end(), more.begin(), more.end());
      }
      for (const Config& f : configs) {
        g_name = &name;
        g_config = &f;
        const Truth truth(f);
        ++g_configs;
        check(f, truth);
        if (g_failures > 12) return;
      }
    }
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  std::printf("ok   %-72s %7lld configurations %9lld checks %7.0f ms\n", name.c_str(),
              static_cast<long long>(g_configs - configs_before), static_cast<long long>(g_checks - before), ms);
}

}  // namespace

// Usage: tile_classifier [cuda|cpu] (default: both).
int main(int argc, char** argv) {
  const std::string part = argc > 1 ? argv[1] : "";
  if (part.empty() || part == "cuda") {
    for (const KernelTiles& tiles : CudaTileShapes()) {
      const std::string name = "cuda " + S(tiles.block_q) + "x" + S(tiles.block_kv) + " interior " +
                               S(tiles.interior_rows) + "x" + S(tiles.interior_cols) + " (" + tiles.name + ", ...)";
      Sweep(name, tiles.interior_rows, tiles.interior_cols, tiles.block_q, tiles.block_kv,
            [&](const Config& f, const Truth& truth) { CheckCuda(f, truth, tiles); });
      if (g_failures) break;
    }
  }
  if (!g_failures && (part.empty() || part == "cpu"))
    Sweep("cpu " + S(c::kBlockQ) + "x" + S(c::kBlockK), c::kBlockQ, c::kBlockK, c::kBlockQ, c::kBlockK,
          [&](const Config& f, const Truth& truth) { CheckCpu(f, truth); });
  std::printf("%lld configurations, %lld checks, %lld failed\n", static_cast<long long>(g_configs),
              static_cast<long long>(g_checks), static_cast<long long>(g_failures));
  return g_failures == 0 ? 0 : 1;
}
