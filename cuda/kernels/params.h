// One attention call as the kernels see it (forward and backward), and the 16-bit element
// types. Layout is BTNH for q, out, dout, dq (and dq_accum), BSKH for k, v, dk, dv, BSNH for
// the q_heads grid's dk_accum, dv_accum (the last dim is Hv for v, out, dout, dv, dv_accum);
// the statistics lse, dlse, delta are [B, N, T]. 16-bit elements travel as raw bits
// (uint16_t); they are converted only through the PTX wrappers.
#pragma once

#include <cstdint>

#include "kernels/bias.h"
#include "kernels/block_mask.h"
#include "kernels/dropout.h"
#include "kernels/platform.h"
#include "kernels/ptx.h"

namespace jax_flash {
namespace kernels {

// The values of a routed forward call's route operand (AttentionParams::route), which kernel
// of the call runs: the general kernel zeroing V's non-finite elements itself (V holds one),
// the plain kernel (every raw score is finite), the general kernel (the rest). Kept in step
// with jax_flash/cuda.py (ROUTE_*).
enum Route : int { kRouteScanValues = 0, kRoutePlain = 1, kRouteGeneral = 2 };

struct AttentionParams {
  int batch = 0;     // B
  int q_len = 0;     // T
  int kv_len = 0;    // S
  int q_heads = 0;   // N
  int kv_heads = 0;  // K (N % K == 0; query head n reads kv head n / (N / K))
  int head_dim = 0;  // H: q, k (and dq, dk, dq_accum, dk_accum)
  int v_head_dim = 0;  // Hv: v, out, dout (and dv, dv_accum); may differ from H

  float scale = 1.0f;      // logits = scale * q.k
  float softcap = 0.0f;    // > 0: logits -> softcap * tanh(logits / softcap), before masking
  // Query t of batch b sits at key position p = q_offsets[b] + t; key s is visible iff
  // s >= p - window_left (-1: unbounded) and s <= p + window_right (-1: unbounded; causal
  // is 0). Windows are at most 2^32: wider ones are unbounded next to int32 offsets.
  int64_t window_left = -1;
  int64_t window_right = -1;
  bool use_segment_ids = false;

  const int32_t* q_lengths = nullptr;       // [B]: rows t >= q_lengths[b] see nothing
  const int32_t* kv_lengths = nullptr;      // [B]: keys s >= kv_lengths[b] are invisible
  const int32_t* q_segment_ids = nullptr;   // [B, T]
  const int32_t* kv_segment_ids = nullptr;  // [B, S]
  const int32_t* q_offsets = nullptr;       // [B]
  // [N] (forward): one logit per query head that joins every row's softmax with value 0
  // (attention sinks), the online softmax's initial state; -inf (or null) is no sink.
  const float* sinks = nullptr;
  // Attention dropout (kernels/dropout.h): rate 0 = off; else the Philox key, the two uint32
  // words at dropout_seed (device memory, read directly like the lengths).
  float dropout_rate = 0.0f;
  const uint32_t* dropout_seed = nullptr;  // [2]

  // The dense bias (f32 / f16 / bf16) and mask (pred), [B|1, N|1, T|1, S|1] read through their
  // strides (kernels/bias.h); data null when the call has none.
  DenseOperand bias;
  DenseOperand mask;
  // flex_attention's block mask (kernels/block_mask.h): states null when the call has none.
  BlockMaskOperand blocks;
  // Backward: where the main kernel puts dbias (the dbias result, or in deterministic mode the
  // dbias_accum workspace when the bias is broadcast over B, N or S); data null without a bias.
  DbiasTarget dbias;
  // With the workspace: the dbias result [Bb, Nb, Tb, Sb] f32 that the reduce kernel writes.
  float* dbias_out = nullptr;
  int64_t dbias_dims[4] = {0, 0, 0, 0};

  const uint16_t* q = nullptr;
  const uint16_t* k = nullptr;
  const uint16_t* v = nullptr;
  uint16_t* out = nullptr;
  float* lse = nullptr;  // forward result, natural log, -inf for rows that see no key

  const uint16_t* dout = nullptr;
  const float* lse_in = nullptr;  // the forward's lse (natural log)
  const float* dlse = nullptr;    // cotangent of lse
  uint16_t* dq = nullptr;
  uint16_t* dk = nullptr;
  uint16_t* dv = nullptr;
  float* dq_accum = nullptr;  // [B, T, N, H] f32, zeroed before the main backward kernel
  float* delta = nullptr;     // [B, N, T] rowsum(dout * out) - dlse
  // [B, S, N, H] and [B, S, N, Hv] f32: dK (unscaled) and dV of each query head, or null. When set, the main
  // backward kernel runs one CTA per (key block, query head, batch) and writes its head's
  // share here; a reduction kernel then sums each group into dk, dv (the q_heads grid).
  float* dk_accum = nullptr;
  float* dv_accum = nullptr;

  // Decoding, forward only (cuda/README.md, "Split-KV and GQA packing"); both chosen on the host.
  // kv_splits > 1, split-KV (flash-decoding): the key tiles a query block sees are cut into
  // kv_splits contiguous chunks, one CTA each, which leaves its O (normalised, float32) and lse
  // in partial_out [C, B, T, N, Hv] and partial_lse [C, B, N, T]; the combine kernel merges
  // them in chunk order into out and lse. pack_gqa (T = 1): the G = N / K query heads of a kv
  // head are the rows of one CTA's tile, so K and V are read once per kv head.
  int kv_splits = 1;
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
  bool pack_gqa = false;
  // Whether the forward itself handles non-finite values of V (kernels/nonfinite.h): in its
  // decoding settings (split-KV or GQA packing) without a dense bias, and in a routed call whose
  // route is Route::kScanValues. Elsewhere the caller passes a finite V and finds the rows that
  // see a non-finite value itself.
  __host__ __device__ __forceinline__ bool scans_values() const {
    return (kv_splits > 1 || pack_gqa) && bias.data == nullptr;
  }
  // The forward's plain_kernel attribute (decided by the caller, jax_flash/cuda.py): run the
  // plain kernel (kernels/fwd.h), which does not make ±inf scores NaN (docs/numerical-contract.md):
  // the caller found every raw score q·k finite (q and k finite, H·max|q|·max|k| below float32's
  // range, tested on every call). The handlers refuse it for a call PlainForwardRefusal names.
  bool plain = false;
  // The forward's decode_tile attribute (decided by the caller, _heuristics.cuda_decode_tile):
  // run the general kernel on the decoding tile (kernels/tile.h DecodeForwardShape: one warp
  // of kDecodeRows rows), for a call whose tiles hold at most kDecodeRows query rows (T, or G
  // with pack_gqa). Never with plain.
  bool decode_tile = false;
  // The forward's route operand (a routed call, decided by the caller, jax_flash/cuda.py), or
  // null: an int32 in device memory that says which of the kernels launched for the call runs
  // (kernels/fwd.h); the others return after reading it. The caller computes it on the device,
  // so that choosing a kernel by what the inputs hold needs no conditional on the host (XLA's
  // conditional copies its predicate to the host and waits for the device).
  const int32_t* route = nullptr;
  // A routed call's general kernel: the plain kernel was launched beside it and serves
  // kRoutePlain. (Without it, the general kernel serves every route: some kernel always runs.)
  bool plain_beside = false;
  __device__ __forceinline__ int read_route() const {
    return route != nullptr ? static_cast<int>(ptx::ld_global_b32(reinterpret_cast<const uint32_t*>(route))) : -1;
  }
  // A paged KV cache (the paged forward target), or null: k and v are then pages
  // [num_pages, page_size, K, H|Hv] shared by the batch, key s of batch row b is slot
  // s % page_size of page page_table[b · max_pages + s / page_size], and kv_len = max_pages ·
  // page_size (the table's capacity). A page id outside [0, num_pages) reads page 0: the host
  // masks those keys (kv segment ids).
  const int32_t* page_table = nullptr;
  int page_size = 0;
  int max_pages = 0;
  int num_pages = 0;

  // Backward: whether the main kernel adds dQ into dq_accum with atomics (false in
  // deterministic mode, where a separate kernel computes dQ per query block).
  bool accumulate_dq = true;

  // The bias and mask rows of (b, n).
  __device__ __forceinline__ DenseRows bias_rows(int b, int n) const { return bias.rows_of(b, n, q_len, kv_len); }
  __device__ __forceinline__ DenseRows mask_rows(int b, int n) const { return mask.rows_of(b, n, q_len, kv_len); }
  __device__ __forceinline__ bool blocks_present() const { return blocks.states != nullptr; }
  __device__ __forceinline__ BlockRows block_rows(int b, int n) const { return blocks.rows_of(b, n, q_len, kv_len); }

  __device__ __forceinline__ float sink(int n) const { return sinks != nullptr ? sinks[n] : -INFINITY; }

  // Element offsets of row t of query head n, row s of kv head g, statistic (b, n, t).
  __device__ __forceinline__ int64_t q_offset(int b, int t, int n) const {
    return ((static_cast<int64_t>(b) * q_len + t) * q_heads + n) * head_dim;
  }
  __device__ __forceinline__ int64_t kv_offset(int b, int s, int g) const {
    return ((static_cast<int64_t>(b) * kv_len + s) * kv_heads + g) * head_dim;
  }
  // Row t of query head n in a [B, T, N, width] array (width H: q, dq; Hv: out, dout).
  __device__ __forceinline__ int64_t q_row_offset(int b, int t, int n, int width) const {
    return ((static_cast<int64_t>(b) * q_len + t) * q_heads + n) * width;
  }
  // Row s of query head n in dk_accum, dv_accum.
  __device__ __forceinline__ int64_t dkv_accum_offset(int b, int s, int n) const {
    return ((static_cast<int64_t>(b) * kv_len + s) * q_heads + n) * head_dim;
  }
  // The rows at the value head dim: row t of out, dout (query head n), row s of v, dv (kv head
  // g), of dv_accum (query head n), and their strides. HV_IS_H: the kernel is compiled for
  // Hv = H (which the handler checked), and these read head_dim, so that the compiler shares
  // V's offsets with K's (O's with Q's) instead of computing both.
  template <bool HV_IS_H>
  __device__ __forceinline__ int v_width() const {
    return HV_IS_H ? head_dim : v_head_dim;
  }
  template <bool HV_IS_H>
  __device__ __forceinline__ int64_t o_offset(int b, int t, int n) const {
    return q_row_offset(b, t, n, v_width<HV_IS_H>());
  }
  template <bool HV_IS_H>
  __device__ __forceinline__ int64_t v_offset(int b, int s, int g) const {
    return ((static_cast<int64_t>(b) * kv_len + s) * kv_heads + g) * v_width<HV_IS_H>();
  }
  template <bool HV_IS_H>
  __device__ __forceinline__ int64_t dv_accum_offset(int b, int s, int n) const {
    return ((static_cast<int64_t>(b) * kv_len + s) * q_heads + n) * v_width<HV_IS_H>();
  }
  template <bool HV_IS_H>
  __device__ __forceinline__ int64_t o_row_stride() const {
    return static_cast<int64_t>(q_heads) * v_width<HV_IS_H>();
  }
  template <bool HV_IS_H>
  __device__ __forceinline__ int64_t v_row_stride() const {
    return static_cast<int64_t>(kv_heads) * v_width<HV_IS_H>();
  }
  __host__ __device__ __forceinline__ bool dkv_per_query_head() const { return dk_accum != nullptr; }
  __device__ __forceinline__ int64_t stat_offset(int b, int n, int t) const {
    return (static_cast<int64_t>(b) * q_heads + n) * q_len + t;
  }
  // The keep-mask's setting (off when dropout_rate is 0).
  __device__ __forceinline__ dropout::Setting dropout_setting() const {
    if (dropout_rate == 0.0f) return dropout::Setting{};
    return dropout::MakeSetting(dropout_rate, dropout_seed[0], dropout_seed[1]);
  }
  // The row of the key/value pool that holds key s of batch row b: s itself in a contiguous
  // [B, S, ...] cache (relative to the row's base), the page's slot in a paged one (relative to
  // the pool).
  __device__ __forceinline__ int64_t key_row(int b, int s) const {
    if (page_table == nullptr) return s;
    int page = page_table[static_cast<int64_t>(b) * max_pages + s / page_size];
    page = page >= 0 && page < num_pages ? page : 0;
    return static_cast<int64_t>(page) * page_size + s % page_size;
  }
  __device__ __forceinline__ int64_t q_row_stride() const { return static_cast<int64_t>(q_heads) * head_dim; }
  __device__ __forceinline__ int64_t kv_row_stride() const { return static_cast<int64_t>(kv_heads) * head_dim; }
};

// The 16-bit input types: which mma to issue and how to convert.
struct F16 {
  static constexpr const char* kName = "f16";
  static constexpr uint32_t kExponentBits = 0x7c00u;  // all set: ±inf or NaN
  __device__ __forceinline__ static void mma(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
    ptx::mma_m16n8k16_f16(d, a, b, c);
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) { return ptx::cvt_pack_f16x2(lo, hi); }
  __device__ __forceinline__ static float to_float(uint16_t x) { return ptx::cvt_f32_f16(x); }
};

struct Bf16 {
  static constexpr const char* kName = "bf16";
  static constexpr uint32_t kExponentBits = 0x7f80u;  // all set: ±inf or NaN
  __device__ __forceinline__ static void mma(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
    ptx::mma_m16n8k16_bf16(d, a, b, c);
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) { return ptx::cvt_pack_bf16x2(lo, hi); }
  // bf16 is the upper half of an f32: widening is exact and needs no instruction.
  __device__ __forceinline__ static float to_float(uint16_t x) {
    return __uint_as_float(static_cast<uint32_t>(x) << 16);
  }
};

enum class ElementType { kF16, kBf16 };

}  // namespace kernels
}  // namespace jax_flash
