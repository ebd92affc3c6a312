#!/usr/bin/env python3
"""Mutation check of the kernels (CUDA, and the pallas ones): do the tests notice a one-line bug?

Each mutation below changes one line of the kernel source (cuda/kernels/) the way a real bug
would: a fragment row, a barrier, a cp.async wait count, a tile bound, the interior test, a
ragged-tail guard, a sign, the dQ atomic, the deterministic dQ kernel. For each one the check
  1. applies it to a scratch copy of the tree (never this tree: the tracked and untracked,
     not ignored files are copied to a temporary directory),
  2. rebuilds the extension there (emulation only: CUDA off, JAX_FLASH_EMULATOR on; cmake -S
     cuda, the extension and the emulator's module are copied into the copy's jax_flash/),
  3. runs the tests that should notice it (a pytest -k selection, `implementation="cuda"` on
     the emulation), and reports it caught (some test failed or the run hung) or survived.
A mutation that only changes speed (kind "speed", e.g. the swizzle disabled) must survive; a
mutation whose original text is no longer found exactly `count` times is "stale". The check
fails (exit 1) on any survivor, stale mutation, unexpected catch of a speed-only mutation,
build error or empty selection; before the mutations the unmutated copy must pass every
selection (baseline).

  python build/mutation_check.py            # every mutation (about 20-40 min on 2 cores)
  python build/mutation_check.py --fast     # a few, for CI (tests/tooling/test_mutation_check.py)
  python build/mutation_check.py --only is_interior_cols --list --markdown
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository root
    original: str  # exact text, found `count` times in the file
    replacement: str
    tests: str  # pytest -k selection over TEST_FILES
    kind: str = "bug"  # "bug": must be caught; "speed": changes speed only, must survive
    count: int = 1  # occurrences of `original` expected in the file
    nth: int = 1  # which occurrence is mutated (1-based)
    what: str = ""


TEST_FILES = (
    "tests/contract/test_attention.py",
    "tests/internals/test_grid.py",
    "tests/contract/test_nonfinite.py",
    "tests/features/test_decode.py",
    "tests/features/test_dense.py",
    "tests/features/test_dense_bias.py",
    "tests/features/test_flex.py",
    "tests/internals/test_cuda_plain.py",
    "tests/internals/test_cuda_plain_backward.py",
    "tests/internals/test_cuda_decode_tile.py",
    "tests/internals/test_pallas_plain.py",
    "tests/internals/test_pallas_mosaic.py",
    "tests/tooling/test_pallas_static.py",
)

# Test selections (implementation "cuda" runs on the emulation here).
FWD = "cuda and test_forward_backward"
# The suite's calls without a per-score feature run the plain backward kernel (kernels/bwd.h):
# the general one's own code is held to the plain one's bits as well
# (test_plain_backward_agrees_with_general, every mask kind, both grids, H up to 256).
AGREES = "plain_backward_agrees"
BWD = f"(cuda and (test_forward_backward or test_backward) and not deterministic) or {AGREES}"
NONFINITE = "cuda and nonfinite"
DET = "cuda and test_backward_deterministic"
DECODE = "test_cuda_split_kv_and_gqa_packing"
PAGED = "paged and cuda"
# The forward's own handling of a non-finite V in its decoding settings (kernels/nonfinite.h).
SCAN = "test_cuda_decode_handles_nonfinite or (test_decode_poison and cuda)"
ALL = "cuda"
EDGES = "cuda and (tile_plus or tile_minus)"
# The dense bias and mask on cuda: every dbias write (test_dense.py) and the shared cases.
DENSE = "(test_dense and not test_dense_bias) or (test_dense_bias and cuda)"
# The backward at H = 192 and 256 (two warps per 16 keys, each with half the columns).
BIG_H = f"(cuda and test_forward_backward and (small_h192 or small_h256)) or {AGREES}"
# The kWarp32 layout (JAX_FLASH_CUDA_LAYOUT=warp32, set by these tests themselves).
# (Every case of the shared suite checks its forward and its backward in one test.)
FWD32 = BWD32 = "cuda and test_forward_backward_warp32"
# The backward's grids: GQA/MQA cases, which JAX_FLASH_CUDA_BWD_GRID=auto runs on the q_heads
# grid at these sizes, and the tests that set the kv_heads grid.
BWD_GQA = (
    "(cuda and test_forward_backward and (small_mqa or small_gqa or tile_plus) and not deterministic "
    f"and not warp32 and not kv_heads) or {AGREES}"
)
KV_GRID = f"(cuda and kv_heads_grid) or {AGREES}"
# The value head dim Hv != H ((192, 128), (128, 64)): the suite's MLA case and the cuda tests of
# both backward grids and deterministic mode.
HV = f"(cuda and (small_mla or value_head_dim_cuda) and not sweep) or {AGREES}"
# flex_attention's block masks on cuda (kernels/block_mask.h): the built-in masks as mask_mods
# (bitwise), the recipes against float64, the contract, capacity overflow, the tile counts.
FLEX = (
    "cuda and (test_builtin_masks_bitwise_cuda or test_mask_recipes_against_reference or test_contract_mask_mod "
    "or test_kernels_partial_capacity_overflow or test_cuda_tiles_follow_block_mask "
    "or test_cuda_ring_prefetches_across_gaps)"
)
# The plain forward (kernels/fwd.h): its own tests (bitwise against the general kernel, tile
# counts, routing) and the shared suite's forward cases, which run it.
PLAIN = "test_cuda_plain or (cuda and test_forward_backward and not warp32)"
# Routed forward calls (kernels/params.h route): the routing tests, and the contract's cuda
# cases, whose poisoned values take route 0.
ROUTE = "test_routed_call or test_calls_route or (cuda and nonfinite)"
# The decoding tile (kernels/tile.h DecodeForwardShape) and the split rule: its own tests (bitwise
# against the 128-row tile at H <= 64, tile counts, routing), the decode cases and the rule.
DECODE_TILE = "test_cuda_decode_tile or test_cuda_split_kv"
# The plain backward (kernels/bwd.h): its own tests (bitwise against the general kernel over
# every mask kind, both grids and H up to 256; the masked and interior query blocks counted;
# routing through jax_flash.attention against float64; extreme scales). The shared suite's
# backward cases run it too (BWD), at several times the cost.
PLAIN_BWD = "test_cuda_plain_backward"

# The pallas plain kernels (jax_flash/pallas/_triton_kernels.py, interpreted): their own tests (agreement
# with the general kernels, routing), the shared suite's pallas cases that hold a poison or a
# sink, and the key-loop budget read from the Triton IR (tests/tooling/test_pallas_static.py).
PALLAS_PLAIN = "test_pallas_plain or (pallas and (nonfinite or sinks))"
PALLAS_STATIC = "test_pallas_static"
P = "jax_flash/pallas/_triton_kernels.py"
# The Mosaic GPU forward (jax_flash/pallas/_mosaic.py): its lowering (the module's ops counted)
# and its interpretation against float64 (tests/internals/test_pallas_mosaic.py).
MOSAIC = "test_pallas_mosaic"
MG = "jax_flash/pallas/_mosaic.py"
MOSAIC_BWD = "test_pallas_mosaic and backward"
MGB = "jax_flash/pallas/_mosaic_backward.py"

K = "cuda/kernels/"
MUTATIONS = [
    # ---- tile.h: fragments, copies, swizzle -------------------------------------------------
    Mutation(
        "a_fragment_rows",
        K + "tile.h",
        "return fragment_row<Tile>(tile, row0, chunk0, lane & 15, lane >> 4);",
        "return fragment_row<Tile>(tile, row0, chunk0, lane & 7, lane >> 4);",
        FWD,
        what="ldmatrix A operand: lanes 8-15 address rows 0-7",
    ),
    Mutation(
        "bt_fragment_chunk",
        K + "tile.h",
        "return fragment_row<Tile>(tile, row0, chunk0, (((lane >> 3) & 1) << 3) + (lane & 7), lane >> 4);",
        "return fragment_row<Tile>(tile, row0, chunk0, (((lane >> 3) & 1) << 3) + (lane & 7), (lane >> 3) & 1);",
        FWD,
        what="ldmatrix.trans B operand: wrong column chunk",
    ),
    Mutation(
        "accumulator_as_a_order",
        K + "tile.h",
        "a[1] = Elem::pack(acc[2 * kk][2], acc[2 * kk][3]);",
        "a[1] = Elem::pack(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);",
        FWD,
        what="P repacked as an A operand: a1/a2 swapped",
    ),
    Mutation(
        "tail_zero_fill",
        K + "tile.h",
        "const bool inside = row < rows_valid;",
        "const bool inside = row <= rows_valid;",
        EDGES,
        what="ragged-tail guard of every tile copy: one row past the end is read",
    ),
    Mutation(
        "store_rows_guard",
        K + "tile.h",
        "if (row < rows_valid) {",
        "if (row <= rows_valid) {",
        FWD,
        what="output tail guard: one row past the end of the block's rows is written",
    ),
    Mutation(
        "swizzle_off",
        K + "tile.h",
        "return kStrideChunks >= 8 ? (row & 7) : kStrideChunks == 4 ? ((row >> 1) & 3) : ((row >> 2) & 1);",
        "return 0;",
        FWD,
        kind="speed",
        what="no XOR swizzle: bank conflicts only (the same function places and finds chunks)",
    ),
    Mutation(
        "grid_decode",
        K + "grid.h",
        "return {i % blocks, static_cast<int>(y + grid_y * z), i / blocks};",
        "return {i / batch, static_cast<int>(y + grid_y * z), i % batch};",
        "grid",
        what="grid.x decoded batch-fastest while the launch numbers it block-fastest",
    ),
    Mutation(
        "grid_heads_z",
        K + "grid.h",
        "static_cast<int>(y + grid_y * z)",
        "static_cast<int>(y)",
        "grid_folds",
        what="heads past 65535 (grid.z) decoded as the first 65535 again",
    ),
    # ---- bias.h, the dense bias and mask -------------------------------------------------------
    Mutation(
        "bias_stride_t",
        K + "bias.h",
        "return t * stride_t + s * stride_s;",
        "return s * stride_s;",
        DENSE,
        what="a dense operand's query stride ignored: row 0 of the bias and mask read for every row",
    ),
    Mutation(
        "dense_mask_backward",
        K + "softmax.h",
        "if (dense_mask.present()) mask_fragment_dense",
        "if (dense_mask.present() && !TRANSPOSED) mask_fragment_dense",
        DENSE,
        what="the dense mask not applied in the main backward kernel",
    ),
    Mutation(
        "dbias_quad_sum",
        K + "bias.h",
        "sum += __shfl_xor_sync(0xffffffffu, sum, 2);\n",
        "",
        DENSE,
        what="dbias broadcast over T: the quad's sum misses two of its four lanes",
    ),
    Mutation(
        "dbias_atomic_as_store",
        K + "ffi_attention.h",
        "owned || workspace ? write : DbiasWrite::kAtomic",
        "owned || workspace ? write : DbiasWrite::kStore",
        DENSE,
        what="a broadcast bias' dbias stored instead of added: CTAs overwrite each other",
    ),
    Mutation(
        "dbias_dead_warps",
        K + "bias.h",
        "if (key0 >= kv_len) return;",
        "",
        DENSE,
        what="warps past the last key write dbias too (at S = 1 their zeros race the real column)",
    ),
    Mutation(
        "minus_inf_bias_masked",
        K + "softmax.h",
        "acc[j][i] = GRADIENT && x == -INFINITY ? -FLT_MAX : x;",
        "acc[j][i] = x;",
        DENSE,
        what="the backward takes a -inf bias for a masked pair (a NaN lse or D is dropped)",
    ),
    Mutation(
        "reduce_dbias_keys",
        K + "bwd.h",
        "s_end = d[3] == 1 ? p.kv_len : ss + 1;",
        "s_end = ss + 1;",
        DENSE,
        what="deterministic dbias: the workspace not summed over the keys of a bias broadcast over S",
    ),
    # ---- mask.h -----------------------------------------------------------------------------
    Mutation(
        "is_interior_cols",
        K + "mask.h",
        "key_hi(t0) >= s0 + cols;",
        "key_hi(t0) >= s0 + cols - 1;",
        ALL,
        what="Mask::is_interior off by one at the keys' end",
    ),
    Mutation(
        "is_interior_rows",
        K + "mask.h",
        "t_last < q_valid &&",
        "t_last <= q_valid &&",
        ALL,
        what="Mask::is_interior off by one at the valid rows' end",
    ),
    Mutation(
        "is_interior_lo",
        K + "mask.h",
        "key_lo(t_last) <= s0 &&",
        "key_lo(t_last) <= s0 + 1 &&",
        ALL,
        what="Mask::is_interior off by one at the window's left edge",
    ),
    Mutation(
        "key_hi_window",
        K + "mask.h",
        "return min(kv_valid, t + band_hi + 1);",
        "return min(kv_valid, t + band_hi);",
        FWD,
        what="right edge of the visible interval (causal diagonal) one key short",
    ),
    Mutation(
        "keys_of_rows_hi",
        K + "mask.h",
        "return {key_lo(t0), key_hi(t1 - 1)};",
        "return {key_lo(t0), key_hi(t0)};",
        FWD,
        what="tile skipping: the block's keys taken from its first row",
    ),
    Mutation(
        "rows_of_keys_hi",
        K + "mask.h",
        "min(q_valid, s1 - band_lo)",
        "min(q_valid, s1 - band_lo - 1)",
        BWD,
        what="backward tile skipping: the last row that sees a key block dropped",
    ),
    Mutation(
        "segments_same_single",
        K + "mask.h",
        "return lo == hi && o.lo == o.hi && lo == o.lo;",
        "return lo == hi && lo == o.lo;",
        ALL,
        what="a tile whose keys span several segments treated as one segment",
    ),
    Mutation(
        "mask_fragment_row",
        K + "mask.h",
        "const int row = row0 + (lane >> 2) + 8 * (i >> 1);",
        "const int row = row0 + (lane >> 2) + 8 * (i & 1);",
        FWD,
        what="mask of the C fragment: wrong row",
    ),
    # ---- softmax.h --------------------------------------------------------------------------
    Mutation(
        "rescale_o",
        K + "softmax.h",
        "o[j][2 * r] *= alpha;",
        "o[j][2 * r] *= 1.0f;",
        FWD,
        what="online softmax: O not rescaled when the max grows",
    ),
    Mutation(
        "dead_row_guard",
        K + "softmax.h",
        "const float m_ref = m == -INFINITY ? 0.0f : m;",
        "const float m_ref = m;",
        FWD,
        what="rows that saw nothing yet: exp2(-inf + inf) = NaN",
    ),
    Mutation(
        "quad_sum_lanes",
        K + "softmax.h",
        "x += __shfl_xor_sync(0xffffffffu, x, 1);",
        "x += __shfl_xor_sync(0xffffffffu, x, 4);",
        FWD,
        what="row sum over the wrong lanes",
    ),
    Mutation(
        "lse_sign",
        K + "softmax.h",
        "row_max[r] + log2f(l) / exp_scale",
        "row_max[r] - log2f(l) / exp_scale",
        FWD,
        what="sign of log l in lse",
    ),
    Mutation(
        "empty_row_nan",
        K + "softmax.h",
        "const bool empty = l == 0.0f;",
        "const bool empty = !(l > 0.0f);",
        NONFINITE,
        what="a NaN row sum (a poisoned row) taken for an empty row: out 0, lse -inf",
    ),
    Mutation(
        "poison_infinite",
        K + "softmax.h",
        "return fabsf(s) == INFINITY ? __uint_as_float(0x7fc00000u) : s;",
        "return s;",
        NONFINITE,
        what="a -inf score from a poisoned q or k read as masked",
    ),
    Mutation(
        "dead_pair_ds",
        K + "softmax.h",
        "dp_to_ds = live ? ds : 0.0f;",
        "dp_to_ds = ds;",
        NONFINITE,
        what="backward: masked pairs send dS = 0·NaN when D or dP is NaN",
    ),
    Mutation(
        "cap_derivative_sign",
        K + "softmax.h",
        "return 1.0f - th * th;",
        "return 1.0f + th * th;",
        BWD,
        what="soft cap derivative sign",
    ),
    Mutation(
        "lse_offset_dead",
        K + "softmax.h",
        "return lse == -INFINITY ? INFINITY : lse;",
        "return lse;",
        BWD,
        what="backward: rows that saw nothing recompute P = NaN",
    ),
    # ---- fwd.h ------------------------------------------------------------------------------
    Mutation(
        "fwd_wait_count",
        K + "fwd.h",
        "ptx::cp_async_wait_group<K::STAGES - 2>();",
        "ptx::cp_async_wait_group<K::STAGES - 1>();",
        FWD,
        what="forward: one cp.async group too few awaited",
    ),
    Mutation(
        "fwd_ring_barrier",
        K + "fwd.h",
        "ptx::cp_async_wait_group<K::STAGES - 2>();\n      __syncthreads();\n",
        "ptx::cp_async_wait_group<K::STAGES - 2>();\n",
        FWD,
        what="forward: no barrier between the ring slot's readers and the next copy into it",
    ),
    Mutation(
        "fwd_commit",
        K + "fwd.h",
        "      ptx::cp_async_commit_group();\n",
        "      \n",
        FWD,
        count=3,  # the general kernel's; the plain forward has two more (its own mutations below)
        what="forward: the loop's copy not committed (the wait then covers the wrong groups)",
    ),
    Mutation(
        "fwd_tile_end",
        K + "fwd.h",
        "const int tiles = CeilDiv(keys.hi, K::BLOCK_KV) - first_tile;",
        "const int tiles = keys.hi / K::BLOCK_KV - first_tile;",
        FWD,
        what="forward: ragged last key tile dropped",
    ),
    Mutation(
        "fwd_grid_rows",
        K + "fwd.h",
        "return {CeilDiv(p.q_len, BLOCK_Q) * p.kv_splits,",
        "return {p.q_len / BLOCK_Q * p.kv_splits,",
        FWD,
        what="forward grid: the ragged last query block not launched",
    ),
    # ---- fwd.h: decoding (split-KV, GQA packing) --------------------------------------------
    Mutation(
        "split_chunk_end",
        K + "fwd.h",
        "tile_end = first_tile + tiles * (split + 1) / p.kv_splits;",
        "tile_end = first_tile + tiles * (split + 1) / p.kv_splits - 1;",
        DECODE,
        what="split-KV: each chunk's last key tile dropped",
    ),
    Mutation(
        "split_sink_every_chunk",
        K + "fwd.h",
        "const bool has_sink = split == 0 && (",
        "const bool has_sink = (",
        DECODE,
        what="split-KV: the sink joins every chunk, not only the first",
    ),
    Mutation(
        "combine_weight",
        K + "fwd.h",
        "const float w = expf(ptx::ld_global_f32(p.partial_lse + c * stats + stat) - lse);",
        "const float w = expf(ptx::ld_global_f32(p.partial_lse + c * stats + stat) - m);",
        DECODE,
        what="split-KV combine: the chunks weighted by e^{lse_c - max}, not normalised",
    ),
    Mutation(
        "packed_q_stride",
        K + "fwd.h",
        "r.q_stride = p.pack_gqa ? p.head_dim : p.q_row_stride();",
        "r.q_stride = p.q_row_stride();",
        DECODE,
        what="GQA packing: the packed heads' q rows read N·H apart",
    ),
    Mutation(
        "paged_slot",
        K + "params.h",
        "return static_cast<int64_t>(page) * page_size + s % page_size;",
        "return static_cast<int64_t>(page) * page_size + s / max_pages % page_size;",
        PAGED,
        what="paged cache: a key read from the wrong slot of its page",
    ),
    Mutation(
        "paged_id_clamp",
        K + "params.h",
        "page = page >= 0 && page < num_pages ? page : 0;",
        "",
        PAGED,
        what="paged cache: an out-of-range page id read out of bounds",
    ),
    Mutation(
        "scan_zeroing",
        K + "nonfinite.h",
        "ptx::st_shared_b32(at + 4 * e, w[e] & ~halves);",
        "",
        SCAN,
        what="decoding's V scan: a non-finite value flagged but left in the tile (0·NaN reaches every row)",
    ),
    Mutation(
        "scan_visibility",
        K + "nonfinite.h",
        "if (s[j][i] != -INFINITY && ptx::ld_shared_f32(",
        "if (ptx::ld_shared_f32(",
        SCAN,
        what="decoding's V scan: rows poisoned by keys they do not see",
    ),
    Mutation(
        "scan_quad_notes",
        K + "nonfinite.h",
        "seen = fmaxf(seen, __shfl_xor_sync(0xffffffffu, seen, 2));\n",
        "",
        SCAN,
        what="decoding's V scan: a row's notes not combined over its quad (half its O columns poisoned)",
    ),
    Mutation(
        "packed_key_mask",
        K + "fwd.h",
        "if (!interior) mask_columns(s[rb], mask, 0, s0, lane);",
        "",
        DECODE,
        what="GQA packing: the edge tiles' keys not masked (lengths, window)",
    ),
    Mutation(
        "fwd_kv_tail",
        K + "fwd.h",
        "load_tile_async<typename K::KVTile, K::THREADS>(stage, k_base + s0 * kv_stride, kv_stride, p.kv_len - s0);",
        "load_tile_async<typename K::KVTile, K::THREADS>(stage, k_base + s0 * kv_stride, kv_stride, K::BLOCK_KV);",
        FWD,
        what="forward: K tile read past the end of the keys (no ragged-tail guard)",
    ),
    # ---- bwd.h: main kernel -----------------------------------------------------------------
    Mutation(
        "bwd_wait_count",
        K + "bwd.h",
        "ptx::cp_async_wait_group<K::STAGES - 2>();",
        "ptx::cp_async_wait_group<K::STAGES - 1>();",
        BWD,
        count=2,
        nth=1,
        what="backward: one cp.async group too few awaited",
    ),
    Mutation(
        "bwd_grid_keys",
        K + "bwd.h",
        "return {CeilDiv(p.kv_len, BLOCK_KV), p.dkv_per_query_head()",
        "return {p.kv_len / BLOCK_KV, p.dkv_per_query_head()",
        BWD,
        what="backward grid: the ragged last key block not launched",
    ),
    Mutation(
        "bwd_ds_barrier",
        K + "bwd.h",
        "__syncthreads();  // dSᵀ of every warp is in shared memory",
        "// (barrier removed)",
        BWD,
        count=2,
        nth=1,
        what="backward: dQ ldmatrix of dSᵀ before every warp stored it",
    ),
    Mutation(
        "bwd_ring_barrier",
        K + "bwd.h",
        "__syncthreads();  // this block's tiles landed; the slot and dSᵀ tile reused next are free",
        "// (barrier removed)",
        BWD,
        what="backward: next query block's copy and dSᵀ overwrite unsynchronised",
    ),
    Mutation(
        "dq_atomic",
        K + "bwd.h",
        "ptx::red_global_add_v2_f32(row + 8 * j, dq[j][2 * r], dq[j][2 * r + 1]);",
        "ptx::st_global_f32(row + 8 * j, ptx::ld_global_f32(row + 8 * j) + dq[j][2 * r]); "
        "ptx::red_global_add_f32(row + 8 * j + 1, dq[j][2 * r + 1]);",
        BWD,
        what="dQ accumulated with a plain read-modify-write instead of an atomic",
    ),
    Mutation(
        "dq_red_v2_halves",
        K + "bwd.h",
        "ptx::red_global_add_v2_f32(row + 8 * j, dq[j][2 * r], dq[j][2 * r + 1]);",
        "ptx::red_global_add_v2_f32(row + 8 * j, dq[j][2 * r + 1], dq[j][2 * r]);",
        BWD,
        what="vector red of dQ: the two columns of the pair swapped",
    ),
    Mutation(
        "dq_red_v2_misaligned",
        K + "bwd.h",
        "ptx::red_global_add_v2_f32(row + 8 * j, dq[j][2 * r], dq[j][2 * r + 1]);",
        "ptx::red_global_add_v2_f32(row + 8 * j + 1, dq[j][2 * r], dq[j][2 * r + 1]);",
        BWD,
        what="vector red of dQ one column off (an odd, 4-byte aligned address)",
    ),
    Mutation(
        "dq_keys_of_block",
        K + "bwd.h",
        "for (int kk = 0; kk < K::BLOCK_KV / MMA_K; ++kk) {",
        "for (int kk = 0; kk < 64 / MMA_K; ++kk) {",
        BWD32,
        count=2,
        nth=1,
        what="dQ = dS·K over the first 64 keys of the block (equivalent in 64-key CTAs)",
    ),
    Mutation(
        "dq_rows_guard",
        K + "bwd.h",
        "if (t >= p.q_len) continue;",
        "if (t > p.q_len) continue;",
        BWD,
        what="dQ atomics one row past the end of the query rows",
    ),
    Mutation(
        "ds_store_row",
        K + "bwd.h",
        "const int row = key_row0 + (lane >> 2) + 8 * r;",
        "const int row = key_row0 + (lane >> 2) + 4 * r;",
        BWD,
        what="dSᵀ stored to the wrong rows",
    ),
    Mutation(
        "ds_store_split",
        K + "bwd.h",
        "if (j % K::COL_SPLITS != split) continue;",
        "if (j % K::COL_SPLITS != 0) continue;",
        BIG_H,
        what="H >= 192: both warps of a key block store the same half of dSᵀ, the other half never",
    ),
    Mutation(
        "dkv_split_cols",
        K + "bwd.h",
        "const int dk_col0 = split * K::DK_COLS, dv_col0 = split * K::DV_COLS;",
        "const int dk_col0 = 0, dv_col0 = 0;",
        BIG_H,
        count=2,
        nth=1,
        what="H >= 192: both warps of a key block accumulate and store the first half of dK, dV's columns",
    ),
    Mutation(
        "ds_sign",
        K + "softmax.h",
        "const float ds = prob * (dp_to_ds - delta) * cap_derivative(x);",
        "const float ds = prob * (delta - dp_to_ds) * cap_derivative(x);",
        BWD,
        what="backward: sign of dS = P (dP - D)",
    ),
    Mutation(
        "delta_dlse_sign",
        K + "bwd.h",
        "dot - ptx::ld_global_f32(p.dlse + stat)",
        "dot + ptx::ld_global_f32(p.dlse + stat)",
        BWD,
        what="D = rowsum(dO O) - dlse: sign of the lse cotangent",
    ),
    Mutation(
        "delta_chunks",
        K + "bwd.h",
        "if (row < rows && sub < K::CHUNKS) {",
        "if (row < rows && sub <= K::CHUNKS) {",
        BWD,
        what="delta kernel: one chunk past the row (H = 96)",
    ),
    Mutation(
        "dk_scale",
        K + "bwd.h",
        "Elem::pack(p.scale * dk[j][2 * r], p.scale * dk[j][2 * r + 1])",
        "Elem::pack(dk[j][2 * r], p.scale * dk[j][2 * r + 1])",
        BWD,
        what="dK: scale missing on even columns",
    ),
    Mutation(
        "dkdv_rows_guard",
        K + "bwd.h",
        "if (s >= p.kv_len) continue;",
        "if (s > p.kv_len) continue;",
        BWD,
        count=2,
        nth=2,
        what="dK, dV stores one key past the end",
    ),
    Mutation(
        "bwd_q_block_begin",
        K + "bwd.h",
        "const int q_block_begin = rows.lo / K::BLOCK_Q;",
        "const int q_block_begin = CeilDiv(rows.lo, K::BLOCK_Q);",
        BWD,
        count=2,
        nth=1,
        what="backward tile skipping: the partly visible first query block dropped",
    ),
    Mutation(
        "bwd_q_tail",
        K + "bwd.h",
        "load_tile_async<typename K::QTile, K::THREADS>(stage, p.q + p.q_offset(batch, t0, n), q_stride, p.q_len - t0);",
        "load_tile_async<typename K::QTile, K::THREADS>(stage, p.q + p.q_offset(batch, t0, n), q_stride, K::BLOCK_Q);",
        BWD,
        what="backward: Q tile read past the end of the queries (no ragged-tail guard)",
    ),
    Mutation(
        "bwd_interior_rows",
        K + "bwd.h",
        "mask.is_interior(t0, K::BLOCK_Q, warp_s0, K::WARP_KV, segments_allow_all)",
        "mask.is_interior(t0, K::BLOCK_Q - 1, warp_s0, K::WARP_KV, segments_allow_all)",
        BWD,
        what="backward interior test over one row too few",
    ),
    Mutation(
        "convert_bound",
        K + "bwd.h",
        "if (i >= chunks) return;",
        "if (i > chunks) return;",
        BWD,
        count=2,
        nth=1,
        what="dQ conversion one chunk past the end",
    ),
    # ---- the q_heads grid of the backward (MQA/GQA: dK, dV per query head, summed after) -------
    Mutation(
        "q_heads_first_head",
        K + "bwd.h",
        "const int first_head = one_head ? at.head : at.head * group;",
        "const int first_head = one_head ? at.head / group * group : at.head * group;",
        BWD_GQA,
        count=2,
        nth=1,
        what="q_heads grid: every CTA of a group computes the group's first query head",
    ),
    Mutation(
        "q_heads_grid_heads",
        K + "bwd.h",
        "p.dkv_per_query_head() ? p.q_heads : p.kv_heads",
        "p.kv_heads",
        BWD_GQA,
        what="q_heads grid launched over the kv heads only",
    ),
    Mutation(
        "dkv_accum_rows_guard",
        K + "bwd.h",
        "if (s >= p.kv_len) continue;",
        "if (s > p.kv_len) continue;",
        BWD_GQA,
        count=2,
        nth=1,
        what="q_heads grid: per-query-head dK, dV stored one key past the end",
    ),
    Mutation(
        "reduce_group_sum",
        K + "bwd.h",
        "for (int j = 0; j < group; ++j) {",
        "for (int j = 1; j < group; ++j) {",
        BWD_GQA,
        what="group sum of the q_heads grid without the group's first query head",
    ),
    Mutation(
        "reduce_bound",
        K + "bwd.h",
        "if (i >= chunks) return;",
        "if (i > chunks) return;",
        BWD_GQA,
        count=2,
        nth=2,
        what="group sum of the q_heads grid one chunk past the end",
    ),
    Mutation(
        "kv_grid_group_heads",
        K + "bwd.h",
        "const int heads = one_head ? 1 : group;",
        "const int heads = 1;",
        KV_GRID,
        count=2,
        nth=1,
        what="kv_heads grid: only the group's first query head added into dK, dV",
    ),
    # ---- the value head dim Hv != H ----------------------------------------------------------
    Mutation(
        "hv_fwd_v_stride",
        K + "fwd.h",
        "v_stride = per_tile(p.v_row_stride<K::kHvIsH>());",
        "v_stride = per_tile(p.kv_row_stride());",
        HV,
        what="forward: V's rows strided by K's row (H) instead of Hv",
    ),
    Mutation(
        "hv_fwd_o_staging_barrier",
        K + "fwd.h",
        "if constexpr (!K::kHvIsH) __syncthreads();",
        "",
        HV,
        what="forward, Hv < H: O staged over Q rows another warp may still be reading",
    ),
    Mutation(
        "hv_dp_k_steps",
        K + "bwd.h",
        "mma_a_smem_b_rows<Elem, typename K::VTile, typename K::DoTile, V_HEAD_DIM / MMA_K, K::BLOCK_Q / MMA_N,",
        "mma_a_smem_b_rows<Elem, typename K::VTile, typename K::DoTile, HEAD_DIM / MMA_K, K::BLOCK_Q / MMA_N,",
        HV,
        count=2,
        nth=1,
        what="backward: dPᵀ = V·dOᵀ over H k-steps instead of Hv (reads past V's and dO's rows)",
    ),
    Mutation(
        "hv_det_dp_k_steps",
        K + "bwd.h",
        "mma_a_smem_b_rows<Elem, typename K::DoTile, typename K::VTile, V_HEAD_DIM / MMA_K, K::BLOCK_KV / MMA_N,",
        "mma_a_smem_b_rows<Elem, typename K::DoTile, typename K::VTile, HEAD_DIM / MMA_K, K::BLOCK_KV / MMA_N,",
        HV,
        what="deterministic dQ kernel: dP = dO·Vᵀ over H k-steps instead of Hv",
    ),
    Mutation(
        "hv_reduce_dv_width",
        K + "bwd.h",
        "const int width = is_dk ? p.head_dim : p.v_head_dim;",
        "const int width = p.head_dim;",
        HV,
        what="q_heads grid's group sum: dv_accum read and dv written at H's row width",
    ),
    # ---- the kWarp32 layout: two m16 row blocks per warp, 128-key backward CTAs --------------
    Mutation(
        "rows32_a_row_block",
        K + "tile.h",
        "a_fragment_row<ATile>(a_tile, a_row0 + MMA_M * rb, 2 * kk, lane)",
        "a_fragment_row<ATile>(a_tile, a_row0, 2 * kk, lane)",
        FWD32,
        what="second row block's A fragment (Q) read from the first block's rows",
    ),
    Mutation(
        "rows32_pv_a",
        K + "tile.h",
        "Elem::mma(acc[rb][2 * jj + 1], a[rb], b + 2, acc[rb][2 * jj + 1]);",
        "Elem::mma(acc[rb][2 * jj + 1], a[0], b + 2, acc[rb][2 * jj + 1]);",
        FWD32,
        count=2,
        nth=2,
        what="O += P·V: odd n-blocks of every row block multiplied by the first block's P",
    ),
    Mutation(
        "rows32_qk_b_shared",
        K + "tile.h",
        "Elem::mma(acc[rb][2 * jj + 1], a[rb], b + 2, acc[rb][2 * jj + 1]);",
        "Elem::mma(acc[rb][2 * jj + 1], a[rb], b, acc[rb][2 * jj + 1]);",
        FWD32,
        count=2,
        nth=1,
        what="S = Q·Kᵀ: the shared K fragment's second n-block replaced by the first",
    ),
    Mutation(
        "rows32_mask_rows",
        K + "fwd.h",
        "const int rows_t0 = warp_t0 + MMA_M * rb;",
        "const int rows_t0 = warp_t0;",
        FWD32,
        what="mask and interior test of the second row block at the first's rows",
    ),
    Mutation(
        "rows32_softmax_per_block",
        K + "fwd.h",
        "softmax[rb].update(s[rb], o[rb], scaling.exp_scale);",
        "softmax[0].update(s[rb], o[rb], scaling.exp_scale);",
        FWD32,
        what="one online softmax state for both row blocks",
    ),
    Mutation(
        "rows32_store_rows",
        K + "fwd.h",
        "const int row0 = warp * K::WARP_Q + MMA_M * rb;",
        "const int row0 = warp * K::WARP_Q;",
        FWD32,
        what="second row block's out and lse written over the first's rows",
    ),
    # ---- bwd.h: deterministic dQ kernel -----------------------------------------------------
    Mutation(
        "det_ds_sign",
        K + "bwd.h",
        "scaling.probability_and_ds(s[j][i], lse2[i >> 1], delta[i >> 1],",
        "scaling.probability_and_ds(s[j][i], lse2[i >> 1], -delta[i >> 1],",
        DET,
        what="deterministic dQ kernel: sign of D in dS",
    ),
    Mutation(
        "det_dq_scale_sign",
        K + "bwd.h",
        "for (int i = 0; i < 4; ++i) dq[j][i] *= p.scale;",
        "for (int i = 0; i < 4; ++i) dq[j][i] *= -p.scale;",
        DET,
        what="deterministic dQ kernel: sign of scale",
    ),
    Mutation(
        "det_stat_rows",
        K + "bwd.h",
        "(s[j][i], lse2[i >> 1]",
        "(s[j][i], lse2[i & 1]",
        DET,
        what="deterministic dQ kernel: statistics of the wrong fragment row",
    ),
    Mutation(
        "det_wait_count",
        K + "bwd.h",
        "ptx::cp_async_wait_group<K::STAGES - 2>();",
        "ptx::cp_async_wait_group<K::STAGES - 1>();",
        DET,
        count=2,
        nth=2,
        what="deterministic dQ kernel: one cp.async group too few awaited",
    ),
    Mutation(
        "det_tile_end",
        K + "bwd.h",
        "const int tile_end = keys.empty() ? 0 : CeilDiv(keys.hi, K::BLOCK_KV);",
        "const int tile_end = keys.empty() ? 0 : keys.hi / K::BLOCK_KV;",
        DET,
        what="deterministic dQ kernel: ragged last key tile dropped",
    ),
    # ---- block_mask.h: flex_attention's block masks ---------------------------------------
    Mutation(
        "block_bits_ignored",
        K + "block_mask.h",
        "return (word >> (c & 31)) & 1u ? BlockVerdict::kShown : BlockVerdict::kHidden;",
        "return (word >> (c & 31)) | 1u ? BlockVerdict::kShown : BlockVerdict::kHidden;",
        FLEX,
        what="block mask: a partly visible block's bits ignored (all of it shown)",
    ),
    Mutation(
        "block_full_one_column",
        K + "block_mask.h",
        "return (t1 - 1) / block_q == i && (s1 - 1) / block_k == j && state(i, j) == kFullBlock;",
        "return (t1 - 1) / block_q == i && state(i, j) == kFullBlock;",
        FLEX,
        what="block mask: a fragment over several key blocks taken as within its first block",
    ),
    Mutation(
        "block_skip_partial",
        K + "block_mask.h",
        "visible = visible || state(i, j) != kEmptyBlock;",
        "visible = visible || state(i, j) == kFullBlock;",
        FLEX,
        what="block mask: tiles under partly visible blocks only skipped",
    ),
    Mutation(
        "block_slot_capacity",
        K + "block_mask.h",
        "if (slot < 0 || slot >= capacity) return BlockVerdict::kPoisoned;",
        "if (slot >= capacity) return BlockVerdict::kPoisoned;",
        FLEX,
        what="block mask: a partly visible block without a slot (past the capacity) read at slot -1",
    ),
    Mutation(
        "block_fetch_cursor",
        K + "fwd.h",
        "fetch = next_running(fetch + 1, tile_end, runs);",
        "fetch = fetch + 1;",
        FLEX,
        count=2,
        nth=2,
        what="forward: the copy cursor steps over empty tiles too (the ring's slots hold the wrong tiles)",
    ),
    Mutation(
        "block_fetch_cursor_bwd",
        K + "bwd.h",
        "fetch = next_running(fetch + 1, items, runs);",
        "fetch = fetch + 1;",
        FLEX,
        count=2,
        nth=2,
        what="backward: the copy cursor steps over empty items too",
    ),
    Mutation(
        "block_fetch_cursor_dq",
        K + "bwd.h",
        "fetch = next_running(fetch + 1, tile_end, runs);",
        "fetch = fetch + 1;",
        FLEX,
        count=2,
        nth=2,
        what="deterministic dQ kernel: the copy cursor steps over empty tiles too",
    ),
    # ---- the Mosaic GPU forward (pallas/_mosaic.py) -------------------------------------------
    Mutation(
        "mosaic_ready_wait_dropped",
        MG,
        "                plgpu.barrier_wait(k_ready.at[slot])\n\n                def scores(acc):",
        "\n                def scores(acc):",
        MOSAIC,
        what="mosaic forward: a consumer reads a key tile without waiting for its copy",
    ),
    Mutation(
        "mosaic_slot_reused_early",
        MG,
        "        wait_free(slot)\n        fetch(i, slot)",
        "        fetch(i, slot)",
        MOSAIC,
        what="mosaic kernels: the producer refills a ring slot before both consumers are done with it",
    ),
    Mutation(
        "mosaic_copy_synchronous",
        MG,
        "plgpu.copy_gmem_to_smem(k_ref.at[at], k_smem.at[slot], k_ready.at[slot])",
        "k_smem.at[slot][...] = k_ref.at[at][...]",
        MOSAIC,
        what="mosaic forward: the key tile copied by the producer's threads instead of TMA",
    ),
    Mutation(
        "mosaic_diagonal_unmasked",
        MG,
        "                if masked:  # the band's edges, the keys past S (or the batch row's length)\n"
        "                    x = mask_band(x, lo, hi, t0, i * block_kv, kv_valid)",
        "                if False:  # the band's edges, the keys past S (or the batch row's length)\n"
        "                    x = mask_band(x, lo, hi, t0, i * block_kv, kv_valid)",
        MOSAIC,
        what="mosaic forward: the band's edges (the causal diagonal, a window's sides, the keys past S) left visible",
    ),
    Mutation(
        "mosaic_key_tail_unmasked",
        MG,
        "    conditions = [col < limit] if limit is not None else []",
        "    conditions = [col >= 0]",
        MOSAIC,
        what="mosaic forward: the zero keys padding a ragged S left visible",
    ),
    Mutation(
        "mosaic_rescale_dropped",
        MG,
        "                o = o * lax.broadcast_in_dim(alpha, o.shape, [0])\n",
        "",
        MOSAIC,
        what="mosaic forward: O not rescaled when the row max grows",
    ),
    Mutation(
        "mosaic_bwd_stats_wait_dropped",
        MGB,
        "                plgpu.barrier_wait(stats_ready.at[slot])\n",
        "",
        MOSAIC_BWD,
        what="mosaic backward: the dK/dV kernel reads lse and delta without waiting for their copy",
    ),
    Mutation(
        "mosaic_bwd_slot_freed_early",
        MGB,
        "                dk = _accumulate(dk, dst.astype(dtype), q_smem.at[slot])\n"
        "                plgpu.barrier_arrive(free.at[slot])",
        "                plgpu.barrier_arrive(free.at[slot])\n"
        "                dk = _accumulate(dk, dst.astype(dtype), q_smem.at[slot])",
        MOSAIC_BWD,
        what="mosaic backward: a dK/dV consumer frees its Q slot before its last product reads it",
    ),
    Mutation(
        "mosaic_bwd_diagonal_unmasked",
        MGB,
        "                    if masked:\n                        x = mask_band(x, *seen_from_keys, k0, query_block(i)[1])",
        "                    if False:\n                        x = mask_band(x, *seen_from_keys, k0, query_block(i)[1])",
        MOSAIC_BWD,
        what="mosaic backward: the dK/dV kernel's causal diagonal left unmasked",
    ),
    Mutation(
        "mosaic_bwd_delta_dropped",
        MGB,
        "ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))",
        "ds = p * dp",
        MOSAIC_BWD,
        what="mosaic backward: dS without the rowsum(dO o O) term in the dQ kernel",
    ),
    Mutation(
        "mosaic_window_left_unmasked",
        MG,
        "        conditions.append(col - row >= lo)",
        "        conditions.append(col - row >= lo - 1)",
        MOSAIC,
        what="mosaic kernels: a sliding window's left side one key too wide in its masked steps",
    ),
    Mutation(
        "mosaic_empty_row_shift_dropped",
        MG,
        "shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked or segments else m_new",
        "shift = m_new",
        MOSAIC,
        what="mosaic forward: a row that has seen no key yet shifted by its -inf max (NaN)",
    ),
    Mutation(
        "mosaic_sink_not_joined",
        MG,
        "            if sinks_ref is not None:  # one more logit of every row",
        "            if False:  # one more logit of every row",
        MOSAIC,
        what="mosaic forward: the attention sinks left out",
    ),
    Mutation(
        "mosaic_band_unclipped",
        MG,
        "    return lo, (None if hi is None else min(hi, kv_len))",
        "    return lo, hi",
        MOSAIC,
        what="mosaic kernels: a window's right side not clipped to S (r0 + rows + hi wraps around in int32)",
    ),
    Mutation(
        "mosaic_offset_ignored",
        MG,
        "offset = jnp.zeros((rows,), jnp.int32) if q_offset is None else jnp.asarray(q_offset, jnp.int32)",
        "offset = jnp.zeros((rows,), jnp.int32)",
        MOSAIC,
        what="mosaic kernels: the per-batch query offset left out of the band",
    ),
    Mutation(
        "mosaic_kv_lengths_ignored",
        MG,
        "length(kv_lengths, kv_len))",
        "length(None, kv_len))",
        MOSAIC,
        what="mosaic kernels: the per-batch key lengths left out (the keys past them seen)",
    ),
    Mutation(
        "mosaic_q_length_rows_kept",
        MG,
        "exists = jnp.where(row < q_valid, 1.0, 0.0).max(axis=1)",
        "exists = jnp.where(row < q_valid, 1.0, 1.0).max(axis=1)",
        MOSAIC,
        what="mosaic forward: the rows past a query length keep their output and lse",
    ),
    Mutation(
        "mosaic_soft_cap_skipped",
        MG,
        "                    x = soft_capped(x, scale, soft_cap)\n",
        "                    x = x * scale\n",
        MOSAIC,
        what="mosaic forward: the soft cap's tanh left out (the scaled scores as logits)",
    ),
    Mutation(
        "mosaic_bwd_soft_cap_slope_dropped",
        MGB,
        "                    ds = ds * slope\n",
        "                    ds = ds\n",
        MOSAIC_BWD,
        what="mosaic backward: dS in the dQ kernel without the soft cap's slope 1 - tanh^2",
    ),
    Mutation(
        "mosaic_bwd_key_length_grads_kept",
        MGB,
        "dk, dv = (jnp.where(key < kv_valid, x, 0.0) for x in (dk, dv))",
        "dk, dv = (jnp.where(key < kv_valid, x, x) for x in (dk, dv))",
        MOSAIC_BWD,
        what="mosaic backward: the keys past a key length keep the dK, dV their rows computed",
    ),
    Mutation(
        "mosaic_bwd_q_length_rows_sent",
        MGB,
        "        no_key = no_key | (jnp.arange(t)[None, None, :] >= jnp.asarray(q_lengths)[:, None, None])\n",
        "        no_key = no_key\n",
        MOSAIC,
        what="mosaic backward: the rows past a query length (lse = a sink's) send gradients",
    ),
    Mutation(
        "mosaic_segments_unmasked",
        MG,
        "                    x = mask_segments(x, q_ids, segment_ids(ids_smem[1].at[slot], of_rows=False))\n",
        "                    segment_ids(ids_smem[1].at[slot], of_rows=False)\n",
        MOSAIC,
        what="mosaic forward: the segment ids read but not applied (a row sees the other segments' keys)",
    ),
    Mutation(
        "mosaic_ids_wait_dropped",
        MG,
        "                    plgpu.barrier_wait(ids_ready[1].at[slot])\n                    x = mask_segments(",
        "                    x = mask_segments(",
        MOSAIC,
        what="mosaic forward: a consumer reads a slot's key segment ids without waiting for their copy",
    ),
    Mutation(
        "mosaic_bwd_segments_unmasked",
        MGB,
        "                        x = mask_segments(x, k_ids, segment_ids(ids_smem[1].at[slot], of_rows=False))\n",
        "                        segment_ids(ids_smem[1].at[slot], of_rows=False)\n",
        MOSAIC_BWD,
        what="mosaic backward: the dK/dV kernel reads the queries' segment ids but does not apply them",
    ),
    Mutation(
        "mosaic_segment_steps_short",
        MG,
        "last = (steps - jnp.argmax(meets[:, :, ::-1], axis=2)).astype(i32)",
        "last = (steps - 1 - jnp.argmax(meets[:, :, ::-1], axis=2)).astype(i32)",
        MOSAIC,
        what="mosaic: a tile's segment step range one step short (its last needed key step skipped)",
    ),
    Mutation(
        "mosaic_segment_steps_unused",
        MG,
        "            cta_first, cta_last = narrowed(cta_first, cta_last, ids_refs[2], batch, q_tile)\n",
        "            pass\n",
        MOSAIC,
        kind="speed",
        what="mosaic forward: no key step skipped by segment (every step masked instead: the same results)",
    ),
    Mutation(
        "mosaic_wired_masks_dropped",
        "jax_flash/pallas/_backend.py",
        "        q_lengths=masks.q_lengths,\n        kv_lengths=masks.kv_lengths,\n",
        "        q_lengths=None,\n        kv_lengths=None,\n",
        MOSAIC,
        what="pallas on Mosaic GPU: the call's query offset and lengths not passed to the kernels",
    ),
    Mutation(
        "mosaic_general_backward_ungated",
        "jax_flash/pallas/_triton.py",
        "launches=((False, 1 - run),),\n        outs=grads,",
        "launches=((False, None),),\n        outs=grads,",
        MOSAIC,
        what="pallas on Mosaic GPU: the Triton general backward runs on every call, over the Mosaic GPU gradients",
    ),
    Mutation(
        "mosaic_general_gate_flipped",
        "jax_flash/pallas/_triton.py",
        "launches=((False, 1 - run),), outs=(out, lse)",
        "launches=((False, run),), outs=(out, lse)",
        MOSAIC,
        what="pallas on Mosaic GPU: the Triton general forward gated on the plain flag, not its negation",
    ),
    Mutation(
        "mosaic_general_ungated",
        "jax_flash/pallas/_triton.py",
        "launches=((False, 1 - run),), outs=(out, lse)",
        "launches=((False, None),), outs=(out, lse)",
        MOSAIC,
        what="pallas on Mosaic GPU: the Triton general forward runs on every call, over the Mosaic GPU results",
    ),
    # ---- routed forward calls: the route operand (params.h, fwd.h, cuda.py) ------------------
    Mutation(
        "route_general_kernel_runs_always",
        K + "fwd.h",
        "  if (route == kRoutePlain && p.plain_beside) return;",
        "",
        ROUTE,
        what="routed call: the general kernel runs on the plain kernel's route too",
    ),
    Mutation(
        "route_plain_kernel_runs_always",
        K + "fwd.h",
        "  if (p.route != nullptr && p.read_route() != kRoutePlain) return;",
        "",
        ROUTE,
        what="routed call: the plain kernel runs on every route (after the general one)",
    ),
    Mutation(
        "route_scan_not_taken",
        K + "fwd.h",
        "const bool scans_values = p.scans_values() || route == kRouteScanValues;",
        "const bool scans_values = p.scans_values();",
        ROUTE,
        what="routed call: route 0 runs the general kernel without its scan of V",
    ),
    Mutation(
        "route_values_unchecked",
        "jax_flash/cuda.py",
        "route = jnp.where(jnp.any(bad_v), ROUTE_SCAN_VALUES,",
        "route = jnp.where(False, ROUTE_SCAN_VALUES,",
        ROUTE,
        what="routed call: a non-finite v does not route to the scanning kernel",
    ),
    # ---- fwd.h: the plain forward -----------------------------------------------------------
    Mutation(
        "plain_masked_after_unpeeled",
        K + "fwd.h",
        "for (; tile < tile_end; ++tile) step(tile, Masked{}, Checked{});",
        "for (; tile < tile_end; ++tile) step(tile, Interior{}, Checked{});",
        PLAIN,
        what="plain forward: the tiles after the interior ones (the diagonal, the lengths) run unmasked",
    ),
    Mutation(
        "plain_masked_before_unpeeled",
        K + "fwd.h",
        "for (; tile < interior_begin; ++tile) step(tile, Masked{}, Checked{});",
        "for (; tile < interior_begin; ++tile) step(tile, Interior{}, Checked{});",
        PLAIN,
        what="plain forward: the tiles before the interior ones (a window's left edge) run unmasked",
    ),
    Mutation(
        "plain_interior_end",
        K + "fwd.h",
        "interior_end = max(interior_begin, min(tile_end, mask.key_hi(t0) / K::BLOCK_KV));",
        "interior_end = max(interior_begin, min(tile_end, CeilDiv(mask.key_hi(t0), K::BLOCK_KV)));",
        PLAIN,
        what="plain forward: a partly visible tile counted as interior (its end rounded up)",
    ),
    Mutation(
        "plain_interior_begin",
        K + "fwd.h",
        "interior_begin = max(tile_begin, CeilDiv(mask.key_lo(t_last), K::BLOCK_KV));",
        "interior_begin = max(tile_begin, mask.key_lo(t_last) / K::BLOCK_KV);",
        PLAIN,
        what="plain forward: a partly visible tile counted as interior (its start rounded down)",
    ),
    Mutation(
        "plain_check_skipped",
        "jax_flash/cuda.py",
        "finite_scores = scores_are_finite(q, k) if plain else jnp.bool_(False)",
        "finite_scores = jnp.bool_(True) if plain else jnp.bool_(False)",
        PLAIN + " or (cuda and nonfinite)",
        what="plain forward: run without the per-call check that every score is finite",
    ),
    Mutation(
        "plain_tail_guard",
        K + "tile.h",
        "const bool inside = row0 + i * kRowStep < rows_valid;",
        "const bool inside = row0 + i * kRowStep <= rows_valid;",
        PLAIN,
        what="plain forward: the last key tile's copies read one row past the keys",
    ),
    # ---- the plain backward (kernels/bwd.h attention_backward_plain_kernel) --------------------
    Mutation(
        "plain_bwd_interior_first",
        K + "mask.h",
        "const int first = CeilDiv(max(0, s0 + cols - 1 - band_hi), block_q);",
        "const int first = CeilDiv(max(0, s0 + cols - 1 - band_hi - block_q), block_q);",
        PLAIN_BWD,
        what="plain backward: the last masked block before the interior ones run unpeeled (unmasked)",
    ),
    Mutation(
        "plain_bwd_interior_sees_back",
        K + "mask.h",
        "const int sees_back = s0 - band_lo + 1;",
        "const int sees_back = s0 - band_lo + 1 + block_q;",
        PLAIN_BWD,
        what="plain backward: the first masked block after the interior ones (a window's left edge) run unmasked",
    ),
    Mutation(
        "plain_bwd_interior_q_valid",
        K + "mask.h",
        "const int last = min(q_valid / block_q, sees_back <= 0 ? 0 : sees_back / block_q);",
        "const int last = min(CeilDiv(q_valid, block_q), sees_back <= 0 ? 0 : sees_back / block_q);",
        PLAIN_BWD,
        what="plain backward: the block holding the last valid query row run unmasked (rows past a length seen)",
    ),
    Mutation(
        "plain_bwd_band_rows",
        K + "mask.h",
        "const int s = row0 + (lane >> 2) + 8 * r;",
        "const int s = row0 + (lane >> 2);",
        PLAIN_BWD,
        what="plain backward: the band mask of a key row applied to the row 8 above it too",
    ),
    Mutation(
        "plain_bwd_route_ignored",
        K + "bwd.h",
        "if (p.route != nullptr && p.read_route() != kRoutePlain) return;  // a routed call's other kernel runs",
        "// (the route not read)",
        PLAIN_BWD,
        what="plain backward runs whatever the route (beside the general kernel on a poisoned call)",
    ),
    Mutation(
        "general_bwd_route_ignored",
        K + "bwd.h",
        "if (p.plain_beside && p.read_route() == kRoutePlain) return;",
        "// (the route not read)",
        PLAIN_BWD,
        what="the general backward runs beside the plain one on a plain route (both add into dQ)",
    ),
    Mutation(
        "plain_bwd_slot_swapped",
        K + "bwd.h",
        "load_item(next, 1 - slot);",
        "load_item(next, slot);",
        PLAIN_BWD,
        what="plain backward: the next query block copied into the ring slot in use",
    ),
    Mutation(
        "plain_bwd_stepped_copy",
        K + "tile.h",
        "for (int i = 0; i < C::kCopies; ++i, from += C::kRowStep * stride * 2u) {",
        "for (int i = 0; i < C::kCopies; ++i, from += C::kRowStep * stride) {",
        PLAIN_BWD,
        what="plain backward: Q and dO copies a half step apart (rows read twice, others never)",
    ),
    Mutation(
        "plain_bwd_ds_barrier",
        K + "bwd.h",
        "__syncthreads();  // dSᵀ of every warp is in shared memory",
        "// (barrier removed)",
        PLAIN_BWD,
        count=2,
        nth=2,
        what="plain backward: dQ ldmatrix of dSᵀ before every warp stored it",
    ),
    Mutation(
        "plain_bwd_q_block_begin",
        K + "bwd.h",
        "const int q_block_begin = rows.lo / K::BLOCK_Q;",
        "const int q_block_begin = CeilDiv(rows.lo, K::BLOCK_Q);",
        PLAIN_BWD,
        count=2,
        nth=2,
        what="plain backward: the partly visible first query block dropped",
    ),
    Mutation(
        "plain_bwd_gqa_heads",
        K + "bwd.h",
        "const int heads = one_head ? 1 : group;",
        "const int heads = 1;",
        PLAIN_BWD,
        count=2,
        nth=2,
        what="plain backward, kv_heads grid: only the group's first query head added into dK, dV",
    ),
    Mutation(
        "plain_bwd_route_out_unchecked",
        "jax_flash/cuda.py",
        "finite = jnp.all(lse < jnp.inf) & jnp.all(jnp.isfinite(out))",
        "finite = jnp.all(lse < jnp.inf)",
        PLAIN_BWD,
        what="backward route: a row that saw a non-finite value (NaN out, finite lse) sent to the plain kernel",
    ),
    Mutation(
        "plain_heaviest_first_off",
        K + "fwd.h",
        "return grid.blocks - 1 - at.block;",
        "return at.block;",
        PLAIN,
        kind="speed",
        what="plain forward: query blocks launched first to last (the order only: the same results)",
    ),
    Mutation(
        "plain_v_commit",
        K + "fwd.h",
        "      ptx::cp_async_commit_group();\n",
        "      \n",
        PLAIN,
        count=3,
        nth=2,
        what="plain forward: V's copy not committed (the wait before O += P·V then covers nothing)",
    ),
    Mutation(
        "plain_sink_dropped",
        K + "fwd.h",
        "softmax[rb].finish_scores(o[rb], p.scale, p.sink(here.head), lse);",
        "softmax[rb].finish_scores(o[rb], p.scale, -INFINITY, lse);",
        PLAIN,
        what="plain forward: the sink never joins the row's statistics",
    ),
    Mutation(
        "plain_exp_scale_unscaled",
        K + "fwd.h",
        "const float exp_scale = __fmul_rn(p.scale, kLog2e);",
        "const float exp_scale = kLog2e;",
        PLAIN,
        what="plain forward: the raw-score softmax without the scale in its exponent",
    ),
    Mutation(
        "plain_empty_sum_one",
        K + "softmax.h",
        "      row_sum[r] = 0.0f;\n    }\n  }",
        "      row_sum[r] = 1.0f;\n    }\n  }",
        PLAIN,
        what="plain forward: l starts at 1 (a query block that sees no key tile gets NaN rows)",
    ),
    Mutation(
        "plain_copy_not_advanced",
        K + "tile.h",
        "      const char* from = src;\n      JAX_FLASH_UNROLL\n      for (int i = 0; i < kCopies; ++i, from += step)\n        ptx::cp_async_16(tile + smem + i * kRowStep * Tile::kRowBytes, from, 16);\n    } else {\n      load_tile_async<Tile, THREADS>(tile, reinterpret_cast<const uint16_t*>(src), step, Tile::kRows);\n    }\n    src += tile_step;",
        "      const char* from = src;\n      JAX_FLASH_UNROLL\n      for (int i = 0; i < kCopies; ++i, from += step)\n        ptx::cp_async_16(tile + smem + i * kRowStep * Tile::kRowBytes, from, 16);\n    } else {\n      load_tile_async<Tile, THREADS>(tile, reinterpret_cast<const uint16_t*>(src), step, Tile::kRows);\n    }",
        PLAIN,
        what="plain forward: an interior tile's copies leave the source where it was (the next tile reads this one's keys)",
    ),
    Mutation(
        "plain_v_wait",
        K + "fwd.h",
        "      ptx::cp_async_wait_group<0>();\n      __syncthreads();  // V has landed; every warp is done reading K",
        "      __syncthreads();  // V has landed; every warp is done reading K",
        PLAIN,
        what="plain forward: O += P·V without waiting for V's copy",
    ),
    Mutation(
        "decode_copies_skip_odd",
        K + "tile.h",
        "    JAX_FLASH_UNROLL_N(2)\n    for (int i = 0; i < kCopies / THREADS; ++i) copy(i);",
        "    JAX_FLASH_UNROLL_N(2)\n    for (int i = 0; i < kCopies / THREADS; ++i) copy(i & ~1);",
        DECODE_TILE,
        what="decoding tile: of a thread's many copies (two at a time) the odd ones never made",
    ),
    Mutation(
        "decode_paged_row_of_next_lane",
        K + "fwd.h",
        "const uint32_t lo = __shfl_sync(0xffffffffu, static_cast<uint32_t>(lane_rows[g]), row % WARP_SIZE);",
        "const uint32_t lo = __shfl_sync(0xffffffffu, static_cast<uint32_t>(lane_rows[g]), (row + 1) % WARP_SIZE);",
        PAGED,
        what="decoding tile, paged: a copy takes the pool row held for the next key row (its low word)",
    ),
    Mutation(
        "decode_tile_rows_16_excluded",
        "jax_flash/_heuristics.py",
        "    return rows <= CUDA_DECODE_BLOCK_Q",
        "    return rows < CUDA_DECODE_BLOCK_Q",
        DECODE_TILE,
        what="decoding tile: a call of exactly 16 rows per tile left on the 128-row tile",
    ),
    Mutation(
        "split_fullest_wave_only",
        "jax_flash/_heuristics.py",
        "if fill[c] >= CUDA_SPLIT_WAVE_EFFICIENCY * best)",
        "if fill[c] >= best)",
        DECODE_TILE,
        what="cuda split-KV: the chunk count that fills the waves best, however many chunks it takes",
    ),
    Mutation(
        "pallas_plain_scores_unchecked",
        "jax_flash/pallas/_triton.py",
        "return scores_are_finite(q, k) & jnp.all(jnp.isfinite(v))",
        "return jnp.all(jnp.isfinite(v))",
        PALLAS_PLAIN,
        what="pallas: the plain kernels run on a non-finite q or k (a -inf score would mask its pair)",
    ),
    Mutation(
        "pallas_plain_values_unchecked",
        "jax_flash/pallas/_triton.py",
        "return scores_are_finite(q, k) & jnp.all(jnp.isfinite(v))",
        "return scores_are_finite(q, k)",
        PALLAS_PLAIN,
        what="pallas: the plain kernels run on a non-finite v (P = 0 behind a mask times NaN)",
    ),
    Mutation(
        "pallas_plain_sink_dropped",
        P,
        "m, l, acc = _join_sink(inp, m * spec.scale, l, acc, chunk == 0)",
        "m, l, acc = m * spec.scale, l, acc",
        PALLAS_PLAIN,
        what="pallas plain forward: the sink never joined",
    ),
    Mutation(
        "pallas_plain_exp2_factor",
        P,
        "return float(np.float32(self.spec.scale * LOG2E))",
        "return float(np.float32(self.spec.scale))",
        PALLAS_PLAIN,
        what="pallas plain forward: the raw scores' exponent without log2(e)",
    ),
    Mutation(
        "pallas_ragged_tail_unmasked",
        P,
        "band_segments(lo, hi, full_lo, full_hi, band_lo is not None, band_hi is not None or layout.ragged_keys)",
        "band_segments(lo, hi, full_lo, full_hi, band_lo is not None, band_hi is not None)",
        "pallas and test_forward_backward and (tile_plus or tile_minus)",
        what="pallas forward, dQ: the ragged key tail's masked segment left out",
    ),
    Mutation(
        "pallas_empty_loop_emitted",
        P,
        "band_segments(lo, hi, full_lo, full_hi, band_lo is not None, band_hi is not None or layout.ragged_keys)",
        "band_segments(lo, hi, full_lo, full_hi, True, True)",
        PALLAS_STATIC,
        what="pallas forward: a causal call's empty masked loop emitted (speed only, caught by the IR budget)",
    ),
    Mutation(
        "pallas_plain_poison_kept",
        P,
        "s = _dot(q, inp.k[pl.ds(k0, bk), :], trans_b=True)  # raw scores [bq, bk]",
        "s = poison_infinite(_dot(q, inp.k[pl.ds(k0, bk), :], trans_b=True))",
        PALLAS_STATIC,
        what="pallas plain forward: a select per score (speed only, caught by the key-loop budget)",
    ),
    Mutation(
        "pallas_plain_bwd_unclamped",
        P,
        "p = jnp.exp2(jnp.minimum(x - lse[:, None], 0.0) * LOG2E)",
        "p = jnp.exp2((x - lse[:, None]) * LOG2E)",
        PALLAS_PLAIN + " or " + PALLAS_STATIC,
        what="pallas plain backward: the exponent unclamped (an FMA contraction of scale·s - lse may make it positive)",
    ),
]

# CI (--fast): so that the check itself cannot rot, two quick ones: a caught fault (the
# deterministic dQ kernel's sign) and the speed-only one that must survive (each costs an
# emulation rebuild; the full table is docs/verification.md).
FAST = ("det_ds_sign", "swizzle_off")
FAST_TESTS = {  # narrower selections for --fast (the full check uses each mutation's own)
    "det_ds_sign": "cuda and test_backward_deterministic and tile_plus-causal",
    "swizzle_off": "cuda and test_forward_backward and tile_minus-causal",
}


@dataclasses.dataclass
class Result:
    mutation: Mutation
    status: str  # caught, survived, stale, build error, selection error
    seconds: float = 0.0
    detail: str = ""

    @property
    def ok(self) -> bool:
        if self.mutation.kind == "speed":
            return self.status == "survived"
        return self.status == "caught"


def copy_tree(dst: pathlib.Path) -> None:
    """The tracked and untracked, not ignored files of this tree (the working state)."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in files:
        src = ROOT / rel
        if not rel or not src.is_file():  # deleted but still in the index, or a submodule
            continue
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, out)


class Scratch:
    def __init__(self, base: pathlib.Path, jobs: int):
        self.tree = base / "tree"
        self.build_dir = base / "build"
        self.jobs = jobs
        self.tree.mkdir(parents=True)
        copy_tree(self.tree)

    def build(self, configure: bool = False) -> str:
        """Empty on success, else the compiler's complaint."""
        if configure:
            r = subprocess.run(
                [
                    "cmake",
                    "-S",
                    str(self.tree / "cuda"),
                    "-B",
                    str(self.build_dir),
                    "-G",
                    "Ninja",
                    "-DCMAKE_BUILD_TYPE=Release",
                    "-DJAX_FLASH_CUDA=OFF",
                    "-DJAX_FLASH_EMULATOR=ON",
                    f"-DPython_EXECUTABLE={sys.executable}",
                ],
                capture_output=True,
                text=True,
            )
            if r.returncode != 0:
                return r.stdout + r.stderr
        r = subprocess.run(["cmake", "--build", str(self.build_dir), f"-j{self.jobs}"], capture_output=True, text=True)
        if r.returncode != 0:
            return (r.stdout + r.stderr)[-3000:]
        # The extension and the emulator's module (the mutated kernels run there).
        for name in ("_jax_flash_ext", "_jax_flash_emu"):
            modules = sorted(self.build_dir.glob(f"{name}*.so"))
            if not modules:
                return f"the build produced no {name} module"
            for old in (self.tree / "jax_flash").glob(f"{name}*.so"):
                old.unlink()
            shutil.copy2(modules[0], self.tree / "jax_flash" / modules[0].name)
        return ""

    def run_tests(self, selection: str, timeout: float) -> tuple[str, str]:
        """(outcome, detail): outcome is 'pass', 'fail', 'timeout' or 'error'."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("JAX_FLASH_", "PYTEST_XDIST_"))  # run from a pytest-xdist worker too
            and k not in ("PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST")
        }
        env["JAX_FLASH_REQUIRE"] = "cuda"  # the emulated kernels must load: no pass by skipping
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        # `-o addopts=`: one process (not pyproject's pytest-xdist workers), in order, so -x stops early.
        cmd = [
            sys.executable,
            "-c",
            _PYTEST_IN_TREE,
            "-o",
            "addopts=",
            "-q",
            "-x",
            "-rf",
            "-p",
            "no:cacheprovider",
            *TEST_FILES,
            "-k",
            selection,
        ]
        try:
            r = subprocess.run(cmd, cwd=self.tree, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout", f"no result within {timeout:.0f} s"
        out = r.stdout + r.stderr
        failed = re.findall(r"^FAILED (\S+)", out, re.M)
        # pytest's last summary line ("N passed, ..."), not a plugin's warning after it.
        counts = re.findall(r"^=*\s*(\d+ (?:passed|failed|error|deselected|skipped).*)$", out, re.M)
        summary = counts[-1] if counts else (out.strip().splitlines()[-1] if out.strip() else "")
        if r.returncode == 0:
            if not re.search(r"\d+ passed", summary):
                return "error", f"the selection ran no test: {summary}"
            return "pass", summary
        if r.returncode == 1:
            first = failed[0].split("::")[-1] if failed else summary
            reason = re.findall(r"^E\s+(.*)$", out, re.M)
            return "fail", first + (f": {reason[0][:120]}" if reason else "")
        if r.returncode < 0 or r.returncode >= 128:  # killed by a signal: a crash is a catch too
            return "fail", f"the test run crashed (exit {r.returncode})"
        return "error", f"pytest exit {r.returncode}: {out[-1500:]}"


# pytest on the scratch copy's own jax_flash: an editable install of the real tree (its import
# finder sits in front of sys.path) would otherwise serve every mutated run the unmutated code.
_PYTEST_IN_TREE = """
import importlib.util, os, sys
sys.meta_path[:] = [f for f in sys.meta_path
                    if "jax_flash" not in getattr(f, "known_source_files", {})
                    and "jax_flash" not in getattr(f, "known_packages", ())]
origin = importlib.util.find_spec("jax_flash").origin
if not os.path.realpath(origin).startswith(os.path.realpath(os.getcwd()) + os.sep):
    sys.exit(f"jax_flash would be imported from {origin}, not from the scratch copy")
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def locate(m: Mutation, text: str) -> int | None:
    """Offset of the occurrence to mutate, or None when the text is stale."""
    if text.count(m.original) != m.count:
        return None
    at = -1
    for _ in range(m.nth):
        at = text.index(m.original, at + 1)
    return at


def check(mutations, scratch: Scratch, timeout: float, selections: dict, log) -> list[Result]:
    results = []
    for m in mutations:
        path = scratch.tree / m.file
        t0 = time.monotonic()
        original = path.read_text() if path.exists() else ""
        at = locate(m, original)
        if at is None:
            found = original.count(m.original)
            results.append(Result(m, "stale", 0.0, f"original text found {found} times, expected {m.count}"))
            log(f"{m.name:24s} STALE ({results[-1].detail})")
            continue
        mutated = original[:at] + m.replacement + original[at + len(m.original) :]
        try:
            path.write_text(mutated)
            err = scratch.build()
            if err:
                results.append(Result(m, "build error", time.monotonic() - t0, err.strip().splitlines()[-1][:200]))
            else:
                outcome, detail = scratch.run_tests(selections.get(m.name, m.tests), timeout)
                status = {"fail": "caught", "timeout": "caught", "pass": "survived"}.get(outcome, "selection error")
                results.append(Result(m, status, time.monotonic() - t0, detail))
        finally:
            path.write_text(original)
        r = results[-1]
        mark = "ok" if r.ok else "FAIL"
        speed = " (speed-only)" if m.kind == "speed" else ""
        log(f"{m.name:24s} {r.status}{speed} in {r.seconds:.0f} s [{mark}] {r.detail[:160]}")
    return results


def markdown(results, header: str) -> str:
    lines = [header, "", "| mutation | file | what | tests (-k) | result |", "|---|---|---|---|---|"]
    for r in results:
        m = r.mutation
        status = r.status + (" (speed-only)" if m.kind == "speed" else "")
        lines.append(f"| `{m.name}` | {pathlib.Path(m.file).name} | {m.what} | `{m.tests}` | {status} |")
    caught = sum(r.status == "caught" for r in results if r.mutation.kind == "bug")
    bugs = sum(r.mutation.kind == "bug" for r in results)
    lines += [
        "",
        (
            f"{caught} of {bugs} bug mutations caught; "
            f"{sum(r.ok for r in results if r.mutation.kind == 'speed')} of "
            f"{sum(r.mutation.kind == 'speed' for r in results)} speed-only mutations survive as they should."
        ),
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help=f"only {', '.join(FAST)} (CI)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these mutations only")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--markdown", action="store_true", help="print the result table as markdown")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("JOBS", "2")))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per test run (a hang counts as caught)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args()

    names = [m.name for m in MUTATIONS]
    assert len(set(names)) == len(names), "mutation names must be unique"
    chosen = MUTATIONS
    selections = {}
    if args.fast:
        chosen = [m for m in MUTATIONS if m.name in FAST]
        selections = FAST_TESTS
    if args.only:
        unknown = set(args.only) - set(names)
        if unknown:
            parser.error(f"unknown mutations: {', '.join(sorted(unknown))}")
        chosen = [m for m in chosen if m.name in args.only]
    if args.list:  # also checks, without building, that every mutation still applies
        stale = 0
        for m in chosen:
            path = ROOT / m.file
            applies = path.exists() and locate(m, path.read_text()) is not None
            stale += not applies
            print(
                f"{m.name:24s} {m.kind:5s} {'' if applies else 'STALE '}{m.file}: {m.what}  "
                f"[-k {selections.get(m.name, m.tests)!r}]"
            )
        return 1 if stale else 0

    def log(msg):
        print(msg, flush=True)

    # The tree as copied (taken now: HEAD may move while the check runs).
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    # A terminated check still removes its scratch copy.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    start = time.monotonic()
    base = pathlib.Path(tempfile.mkdtemp(prefix="jax_flash_mutation_"))
    try:
        scratch = Scratch(base, args.jobs)
        log(f"scratch copy: {scratch.tree}")
        err = scratch.build(configure=True)
        if err:
            log(f"the unmutated copy does not build:\n{err}")
            return 1
        log(f"built in {time.monotonic() - start:.0f} s")
        # Baseline: every selection passes before anything is mutated (else "caught" means
        # nothing); one run of their union.
        union = " or ".join(f"({sel})" for sel in sorted({selections.get(m.name, m.tests) for m in chosen}))
        t0 = time.monotonic()
        outcome, detail = scratch.run_tests(union, 4 * args.timeout)
        log(f"baseline: {outcome} in {time.monotonic() - t0:.0f} s ({detail})")
        if outcome != "pass":
            log("the unmutated tree fails its own tests: fix that first")
            return 1
        results = check(chosen, scratch, args.timeout, selections, log)
    finally:
        if args.keep:
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)

    header = (
        f"Mutation check, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, commit "
        f"{commit.strip()}{' + local changes' if dirty else ''}, {time.monotonic() - start:.0f} s"
    )
    if args.markdown:
        print()
        print(markdown(results, header))
    bad = [r for r in results if not r.ok]
    print(
        f"\n{header}: {len(results) - len(bad)} of {len(results)} as expected"
        + (f"; not: {', '.join(f'{r.mutation.name} ({r.status})' for r in bad)}" if bad else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
