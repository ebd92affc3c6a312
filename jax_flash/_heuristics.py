"""Every rule that chooses a schedule, each with the sentence `explain` prints for it.

One place for the decisions that the implementations and the compiled kernels used to make
each on their own: split-KV chunk counts (xla, cpu, cuda, pallas), GQA packing, the cuda
backward grid and warp layout, and the pallas tiles (the tuned table is data:
`pallas._table`; its lookup and shared-memory fit are called from here). The implementations
(`cpu`, `cuda`, `pallas`, `inference/split_kv`) call these functions when a call is traced
and hand the decision to the kernels (FFI attributes `forward_chunks`, `pack_gqa`,
`gradient_chunks`, `layout`, `isa`, the workspace shapes of the backward grid, the Pallas
grid), which no longer decide themselves: no rule and no rule's constant is written twice.

The rules are pure functions of the call's static description (`AttentionSpec`, including
its resolved settings `spec.settings`) and of device facts passed in (the SM count, whether
Pallas is interpreted), so that tests can ask them anything. A setting read here that its
variable gave no valid value for raises that variable's ValueError (`Config.get`).

The tile shapes the rules count in (the cpu kernels' 128-row blocks, the cuda kernels' tile
table, kernels/tile.h) are properties of the compiled kernels, stated here as the kernels
were compiled; the rules' own thresholds are here only.
"""

from __future__ import annotations

import struct

from jax_flash._spec import AttentionSpec

# ---- shared -------------------------------------------------------------------------------


def chunk_count(units: int, target: int, blocks: int, min_blocks: int, max_chunks: int) -> int:
    """The split-KV rule of the cpu and pallas kernels (each with its own figures; cuda's is
    wave_chunk_count): enough key chunks for `units` parallel work units to reach `target` (a
    thread count, the SMs), ceil(target / units), but each chunk at least `min_blocks` of the
    `blocks` key blocks and at most `max_chunks`; 1 (no split) when the units already reach the
    target."""
    return max(1, min(-(-target // max(1, units)), blocks // min_blocks, max_chunks))


def packs_query_heads(spec: AttentionSpec, max_group: int) -> bool:
    """GQA packing of a kernel's forward (cpu, cuda): at T = 1 the G = N / K query heads of a
    kv head are the rows of one tile (G <= `max_group`, the tile's rows), where no dense bias,
    dense mask, flex block mask or dropout varies per head."""
    return (
        spec.q_len == 1
        and 1 < spec.group_size <= max_group
        and spec.bias_shape is None
        and spec.mask_shape is None
        and not (spec.flex is not None and spec.flex.mask_mod is not None)
        and not spec.has_dropout
    )


def forced(spec: AttentionSpec, name: str) -> int | None:
    """A chunk-count setting (cpu_split_kv, cuda_split_kv, pallas_split_kv): None for 0 (the
    rule decides), else the forced count."""
    value = spec.settings.get(name)
    return value or None


def split_summary(chunks: int, packed: bool, why: str) -> str:
    """The plain words of `explain`'s one line for a forward's split-KV and GQA packing."""
    pack = "GQA heads packed, " if packed else ""
    if chunks > 1:
        return f"{pack}split-KV into {chunks} key chunks ({why})"
    return f"{pack}split-KV off ({why})"


def setting_words(spec: AttentionSpec, name: str) -> str:
    """How `explain` names a setting that decided: its variable and value."""
    from jax_flash._config import Config

    return f"{Config.variable(name)}={spec.settings.get(name)}"


# ---- xla: split-KV decoding (inference/split_kv.py) -----------------------------------------

# Split only few-query calls: T <= DECODE_MAX_QUERIES (one query block of every kernel).
DECODE_MAX_QUERIES = 64
# Each chunk holds at least MIN_CHUNK keys (one key block of the xla forward).
MIN_CHUNK = 512
# Enough independent (batch row, kv head, chunk) units to fill a GPU: ~2 per SM of an H200.
TARGET_UNITS = 256
XLA_MAX_SPLITS = 64


def xla_split_kv_rule() -> str:
    """The xla forward's split-KV rule in words (for `explain`)."""
    return (
        f"split-KV when T <= {DECODE_MAX_QUERIES} and S >= {2 * MIN_CHUNK} on a GPU/TPU: "
        f"C = min(ceil({TARGET_UNITS} / (B·K)), S // {MIN_CHUNK}, {XLA_MAX_SPLITS}) key chunks; "
        "never on a CPU, where XLA's blockwise loop is faster (jax_flash.bench --decode)"
    )


def xla_splits(spec: AttentionSpec, platform: str) -> int:
    """C >= 1 key chunks for the xla forward of `spec` on `platform` ('cpu', 'gpu', ...)."""
    if platform == "cpu":
        return 1
    return xla_max_splits(spec, min(XLA_MAX_SPLITS, -(-TARGET_UNITS // max(1, spec.batch * spec.num_kv_heads))))


def xla_max_splits(spec: AttentionSpec, wanted: int) -> int:
    """`wanted` clipped to what `spec` allows: 1 when T > DECODE_MAX_QUERIES, S < 2·MIN_CHUNK,
    with dropout (the chunks would renumber the batch rows' counters) or when the window's
    right side is so large (>= 2**31 - T) that shifting the offset by a chunk start could not
    be exact in int32."""
    if spec.q_len > DECODE_MAX_QUERIES or spec.kv_len < 2 * MIN_CHUNK:
        return 1
    if spec.has_dropout:
        return 1
    if spec.window_right is not None and spec.window_right >= 2**31 - spec.q_len:
        return 1
    return max(1, min(wanted, spec.kv_len // MIN_CHUNK))


def xla_summary(spec: AttentionSpec, platform: str) -> str:
    """`explain`'s one line for xla: whether it splits the keys, and the reason in words."""
    c = xla_splits(spec, platform)
    if c > 1:
        why = "few queries, many keys, too few batch rows and kv heads to fill the device"
    elif platform == "cpu":
        why = "on a CPU the blockwise loop is faster"
    elif spec.q_len > DECODE_MAX_QUERIES:
        why = f"more than {DECODE_MAX_QUERIES} queries"
    elif spec.kv_len < 2 * MIN_CHUNK:
        why = f"fewer than {2 * MIN_CHUNK} keys"
    elif spec.has_dropout:
        why = "never with dropout"
    elif spec.window_right is not None and spec.window_right >= 2**31 - spec.q_len:
        why = "a window too wide to shift exactly"
    else:
        why = "enough batch rows and kv heads to fill the device"
    return split_summary(c, False, why)


def xla_description(spec: AttentionSpec, platform: str) -> str:
    c = xla_splits(spec, platform)
    chosen = f"split-KV over {c} key chunks" if c > 1 else "no split-KV"
    return f"{chosen}; rule: {xla_split_kv_rule()}"


# ---- cpu (cuda/cpu/) ------------------------------------------------------------------------

# The cpu kernels' query and key blocks (cuda/cpu/tiling.h kBlockQ, kBlockK).
CPU_BLOCK = 128
# The forward's split-KV: with fewer than CPU_FORWARD_ITEMS work items (query blocks, or kv
# heads with GQA packing), each item's keys are cut into chunks of at least
# CPU_MIN_CHUNK_KEY_BLOCKS key blocks, at most CPU_MAX_FORWARD_CHUNKS, merged by lse in chunk
# order. The count depends on the problem only (not on the threads), so the results are the
# same bits for every JAX_FLASH_CPU_THREADS.
CPU_FORWARD_ITEMS = 16
CPU_MAX_FORWARD_CHUNKS = 16
CPU_MIN_CHUNK_KEY_BLOCKS = 4


def cpu_isa(spec: AttentionSpec) -> str:
    """The cpu kernels' instruction set: "" (the default ISA of this CPU) or one ISA's name."""
    return spec.settings.get("cpu_isa")


def cpu_packs_heads(spec: AttentionSpec) -> bool:
    """GQA packing of the cpu forward: at T = 1 the G query heads of a kv head share a tile."""
    return packs_query_heads(spec, CPU_BLOCK)


def cpu_forward_items(spec: AttentionSpec) -> int:
    """The cpu forward's work items: B·K with GQA packing, else B·N·ceil(T/128)."""
    if cpu_packs_heads(spec):
        return spec.batch * spec.num_kv_heads
    return spec.batch * spec.num_heads * -(-spec.q_len // CPU_BLOCK)


def cpu_forward_chunks_rule(spec: AttentionSpec) -> int:
    return chunk_count(
        cpu_forward_items(spec),
        CPU_FORWARD_ITEMS,
        -(-spec.kv_len // CPU_BLOCK),
        CPU_MIN_CHUNK_KEY_BLOCKS,
        CPU_MAX_FORWARD_CHUNKS,
    )


def cpu_forward_chunks(spec: AttentionSpec) -> int:
    """The cpu forward's split-KV chunk count (the FFI attribute forward_chunks): the forced
    count (Config.cpu_split_kv), else the rule; the kernel uses at most one chunk per key block."""
    return forced(spec, "cpu_split_kv") or cpu_forward_chunks_rule(spec)


def cpu_gradient_chunks(spec: AttentionSpec) -> int:
    """The cpu backward's key-block chunks (the FFI attribute gradient_chunks): 0 for the
    kernel's rule, which counts XLA's thread pool of the running process (so it stays in the
    kernel; the result is the same bits either way), else the forced count."""
    return spec.settings.get("cpu_gradient_chunks")


def cpu_forward_description(spec: AttentionSpec) -> str:
    """What `explain` says of the cpu forward's split-KV and GQA packing."""
    blocks = -(-spec.kv_len // CPU_BLOCK)
    chunks = max(1, min(cpu_forward_chunks(spec), blocks))
    packing = (
        f"GQA packing: the {spec.group_size} query heads of each kv head in one tile, " if cpu_packs_heads(spec) else ""
    )
    rule = (
        f"split-KV when the items (B·N·ceil(T/{CPU_BLOCK}), or B·K with GQA packing at T = 1) "
        f"are fewer than {CPU_FORWARD_ITEMS}: "
        f"min(ceil({CPU_FORWARD_ITEMS} / items), {CPU_MAX_FORWARD_CHUNKS}, ceil(S/{CPU_BLOCK}) // "
        f"{CPU_MIN_CHUNK_KEY_BLOCKS}) key chunks per query block, merged by lse in chunk order"
    )
    if forced(spec, "cpu_split_kv") is not None:
        rule = f"{setting_words(spec, 'cpu_split_kv')}, instead of the rule: {rule}"
    if chunks == 1:
        return f"forward: {packing}no split-KV ({rule})"
    return f"forward: {packing}split-KV into {chunks} key chunks ({rule})"


def cpu_forward_summary(spec: AttentionSpec) -> str:
    """`explain`'s one line for the cpu forward: split-KV and GQA packing, the reason in words."""
    blocks = -(-spec.kv_len // CPU_BLOCK)
    chunks = max(1, min(cpu_forward_chunks(spec), blocks))
    items = cpu_forward_items(spec)
    if forced(spec, "cpu_split_kv") is not None:
        why = setting_words(spec, "cpu_split_kv")
    elif chunks > 1:
        why = f"{items} work items, fewer than the {CPU_FORWARD_ITEMS} that keep the threads busy"
    elif items >= CPU_FORWARD_ITEMS:
        why = "enough work for the threads"
    else:
        why = "too few keys to split"
    return split_summary(chunks, cpu_packs_heads(spec), why)


# ---- cuda (cuda/kernels/) -------------------------------------------------------------------

# The head dims whose forward / backward has a warp32 kernel of its own (kernels/tile.h,
# build/generate_kernels.py); the others run the warp16 kernel under either setting.
WARP32_HEAD_DIMS = {"forward": (32, 64, 96), "backward": (32, 64)}
# The forward's query rows per CTA (kernels/tile.h, both layouts).
CUDA_FORWARD_BLOCK_Q = 128
# The decoding tile (kernels/tile.h DecodeForwardShape): one warp of 16 query rows, for a call
# whose tiles hold at most 16 rows (T <= 16, or its G <= 16 query heads packed): it reads K and
# V once per tile for 16 rows of work, bound by the memory's bandwidth, where the 128-row tile
# would run 8 warps of MMAs on padding rows at one CTA per SM. Its CTAs (52 KB at H = 128) fit
# CUDA_DECODE_CTAS_PER_SM to an SM of sm_90 and sm_100 (228 KB; 3 at H = 256; 3 on sm_80, 1 on
# sm_86/89/120, where the rule splits more than it needs), the residents the split-KV rule aims at.
CUDA_DECODE_BLOCK_Q = 16
CUDA_DECODE_CTAS_PER_SM = 4
# Split-KV (kernels/fwd.h; FlashAttention-2's num_splits_heuristic): the forward's grid,
# B·(K packed, else N)·ceil(T / rows) CTAs, against the resident slots of the GPU (SMs, times
# CUDA_DECODE_CTAS_PER_SM on the decoding tile): when it fills fewer than
# CUDA_SPLIT_FILLED of them, each query block's key tiles are cut into the fewest chunks C whose
# waves are at least CUDA_SPLIT_WAVE_EFFICIENCY as full as the best C's (a wave's fill: CTAs ·
# C / slots over its ceiling), with at most CUDA_MAX_SPLITS chunks of at least
# CUDA_SPLIT_MIN_TILES key tiles each; one CTA per chunk, merged by lse in chunk order
# (deterministic). Never with dropout.
CUDA_SPLIT_FILLED = 0.8
CUDA_SPLIT_WAVE_EFFICIENCY = 0.85
CUDA_SPLIT_MIN_TILES = 2
CUDA_MAX_SPLITS = 64
# The backward grid ("Grids and GQA", cuda/README.md). auto takes the q_heads grid when the
# kv_heads grid would launch fewer than BACKWARD_GRID_CTA_TARGET CTAs and G = N / K > 1: 528 =
# two waves of an H100/H200 (132 SMs) at the backward's 2 CTAs per SM (warp16,
# docs/gpu-results.md). Below that the kv_heads grid leaves SMs idle, while the q_heads grid has
# G times the CTAs for the same work, at the price of B·S·N·(H + Hv) float32 workspace and one
# more pass over it (the group sum).
BACKWARD_GRID_CTA_TARGET = 528


def cuda_layout(spec: AttentionSpec) -> str:
    """The cuda kernels' warp layout (the FFI attribute layout): "warp16" or "warp32"."""
    return spec.settings.get("cuda_layout")


def cuda_layout_description(spec: AttentionSpec) -> str:
    """Which kernels a call runs under its layout."""
    name, head_dim = cuda_layout(spec), spec.head_dim
    # The warp16 kernels (kernels/tile.h): at H >= 192 two warps share each 16 keys of the
    # backward (each with half of dK's and dV's columns), 32 keys per CTA at H = 192.
    bwd16 = {192: "32 keys per CTA, 2 warps per 16 keys", 256: "64 keys per CTA, 2 warps per 16 keys"}.get(
        head_dim, "64 keys per CTA"
    )
    if name == "warp16":
        return f"layout warp16: forward 8 warps x 16 rows, backward {bwd16}"
    fwd = (
        "4 warps x 32 rows"
        if head_dim in WARP32_HEAD_DIMS["forward"]
        else "8 warps x 16 rows (no warp32 kernel at this head dim)"
    )
    bwd = (
        "128 keys per CTA"
        if head_dim in WARP32_HEAD_DIMS["backward"]
        else f"{bwd16} (no warp32 kernel at this head dim)"
    )
    return f"layout warp32: forward {fwd}, backward {bwd}"


def _float32(x: float) -> float:
    """x rounded to float32, as the kernels receive the scale (±inf beyond its range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return x * float("inf")


def _cuda_per_score_features(spec: AttentionSpec) -> tuple:
    """(has it, its name) of each feature neither cuda plain kernel computes (PerScoreFeature,
    kernels/dispatch.h), in that function's order."""
    return (
        (spec.soft_cap is not None, "a soft cap"),
        (spec.has_segment_ids, "segment ids"),
        (spec.dropout_rate > 0, "dropout"),
        (spec.bias_shape is not None, "a dense bias"),
        (spec.mask_shape is not None, "a dense mask"),
        (spec.flex is not None and spec.flex.mask_mod is not None, "a block mask"),
    )


def cuda_plain_forward_blocker(spec: AttentionSpec, sms: int, paged: bool = False) -> str | None:
    """Why a forward call may not run the cuda plain kernel (kernels/fwd.h), or None when it may.
    It serves none of the optional features (soft cap, segment ids, dropout, dense bias or mask,
    a flex block mask, paging, split-KV, GQA packing; lengths, windows, query offsets and sinks
    it serves), has a scale in [2**-126, 2**127) (its softmax works on raw scores with the
    scale inside the exponent, which a zero, negative or subnormal scale would break), and
    addresses a key tile's rows in 32 bits (K·max(H, Hv) < 2**23). A call it
    serves runs it when its scores are finite (jax_flash/cuda.py tests that on every call) and
    passes `plain_kernel=True`; the handlers refuse that for a call this rule refuses
    (PlainForwardRefusal, kernels/dispatch.h), except one of at most 16 query rows per tile,
    which the plain kernel could serve but the decoding tile serves faster (cuda_decode_tile)."""
    blockers = (
        *_cuda_per_score_features(spec),
        (paged, "a paged cache"),
        (cuda_decode_tile(spec), f"at most {CUDA_DECODE_BLOCK_Q} query rows (the decoding tile)"),
        (cuda_split_kv_chunks(spec, sms) > 1, "split-KV"),
        (cuda_packs_heads(spec), "GQA packing"),
        (not 2.0**-126 <= _float32(spec.scale) < 2.0**127, "a scale outside [2**-126, 2**127)"),
        (spec.num_kv_heads * max(spec.head_dim, spec.v_head_dim) >= 2**23, "K·max(H, Hv) >= 2**23"),
    )
    return next((why for blocked, why in blockers if blocked), None)


def cuda_plain_backward_blocker(spec: AttentionSpec) -> str | None:
    """Why a backward call may not run the cuda plain kernel (kernels/bwd.h), or None when it may.
    It serves none of the per-score features (soft cap, segment ids, dropout, dense bias or mask,
    a flex block mask; lengths, windows, query offsets, sinks, GQA and both grids it serves),
    adds dQ with atomics (deterministic mode's dQ kernel is the general one) and addresses a
    query block's rows in 32 bits (N·max(H, Hv) < 2**23); any scale (its arithmetic is the
    general kernel's). A call it serves runs it when the forward's out and lse
    are finite (jax_flash/cuda.py tests that on every call) and passes `plain_kernel=True`; the
    handlers refuse that for a call this rule refuses (PlainBackwardRefusal, kernels/dispatch.h)."""
    blockers = (
        (bool(spec.settings.get("deterministic")), "deterministic mode"),
        *_cuda_per_score_features(spec),
        (spec.num_heads * max(spec.head_dim, spec.v_head_dim) >= 2**23, "N·max(H, Hv) >= 2**23"),
    )
    return next((why for blocked, why in blockers if blocked), None)


def cuda_backward_kernel_description(spec: AttentionSpec) -> str:
    """What `explain` says of the cuda backward's main kernel (kernels/bwd.h)."""
    why = cuda_plain_backward_blocker(spec)
    if why is not None:
        return f"backward: the general kernel (the call has {why})"
    return (
        "backward: the plain kernel (the warp16 tiles, whatever the layout) when the forward's out and lse are "
        "finite (tested on every call, on the device: both kernels are launched and the route says which runs), "
        "the general kernel otherwise"
    )


def cuda_forward_kernel_description(spec: AttentionSpec, sms: int) -> str:
    """What `explain` says of the cuda forward kernel a call runs (kernels/fwd.h)."""
    if cuda_decode_tile(spec):
        rows = "G packed query heads" if cuda_packs_heads(spec) else "T queries"
        return (
            f"forward: the general kernel on the decoding tile ({CUDA_DECODE_BLOCK_Q}x{cuda_decode_block_kv(spec)} "
            f"tiles, one warp of {CUDA_DECODE_BLOCK_Q} rows: the {rows} fit one m16 block)"
        )
    why = cuda_plain_forward_blocker(spec, sms)
    if why is not None:
        return f"forward: the general kernel (the call has {why})"
    warps = "4 warps x 32 rows" if spec.head_dim <= 64 else "8 warps x 16 rows"
    keys = 32 if spec.head_dim > 128 else 64
    return (
        f"forward: the plain kernel (128x{keys} tiles, {warps}, whatever the layout) when q and k are finite "
        "and no score can overflow (tested on every call, on the device: both kernels are launched and the "
        "route says which runs), the general kernel otherwise"
    )


def cuda_forward_block_kv(spec: AttentionSpec) -> int:
    """Keys per tile of the cuda forward under the call's layout (kernels/tile.h)."""
    h = spec.head_dim
    if cuda_layout(spec) == "warp32" and h in WARP32_HEAD_DIMS["forward"]:
        return 64 if h <= 32 else 32
    return 16 if h > 192 else 32 if h > 128 else 64


def cuda_decode_block_kv(spec: AttentionSpec) -> int:
    """Keys per tile of the cuda forward on the decoding tile (kernels/tile.h DecodeForwardShape)."""
    h = spec.head_dim
    return 16 if h > 128 else 32 if h > 64 else 64


def cuda_backward_block_kv(spec: AttentionSpec) -> int:
    """Keys per CTA of the main cuda backward kernel under the call's layout (kernels/tile.h;
    the value head dim does not change it)."""
    h = spec.head_dim
    if cuda_layout(spec) == "warp32" and h in WARP32_HEAD_DIMS["backward"]:
        return 128
    return 32 if h == 192 else 64


def cuda_backward_ctas(spec: AttentionSpec, grid: str) -> int:
    """CTAs of the main backward kernel: B·K·ceil(S/block_kv) (kv_heads) or B·N·ceil(S/block_kv)."""
    heads = spec.num_kv_heads if grid == "kv_heads" else spec.num_heads
    return spec.batch * heads * -(-spec.kv_len // cuda_backward_block_kv(spec))


def cuda_backward_grid(spec: AttentionSpec) -> str:
    """The main backward kernel's grid for a call of shape `spec`: "kv_heads" or "q_heads"."""
    setting = spec.settings.get("cuda_backward_grid")
    if setting != "auto":
        return setting
    few = cuda_backward_ctas(spec, "kv_heads") < BACKWARD_GRID_CTA_TARGET
    return "q_heads" if spec.group_size > 1 and few else "kv_heads"


def cuda_backward_grid_description(spec: AttentionSpec) -> str:
    """What `explain` says of the backward grid of `spec`."""
    grid, setting = cuda_backward_grid(spec), spec.settings.get("cuda_backward_grid")
    if setting == "auto":
        few = cuda_backward_ctas(spec, "kv_heads")
        relation = "<" if few < BACKWARD_GRID_CTA_TARGET else ">="
        why = (
            f"auto: G = {spec.group_size}, B·K·ceil(S/{cuda_backward_block_kv(spec)}) = {few} "
            f"{relation} {BACKWARD_GRID_CTA_TARGET}"
        )
    else:
        why = setting_words(spec, "cuda_backward_grid")
    ctas = cuda_backward_ctas(spec, grid)
    if grid == "kv_heads":
        return (
            f"backward grid kv_heads ({why}): {ctas} CTAs of (key block, kv head, batch), each looping "
            "over its group's query heads"
        )
    return (
        f"backward grid q_heads ({why}): {ctas} CTAs of (key block, query head, batch), dK and dV per "
        "query head in float32 workspaces, summed over the group after"
    )


def cuda_packs_heads(spec: AttentionSpec) -> bool:
    """GQA packing of the cuda forward (kernels/fwd.h, the FFI attribute pack_gqa)."""
    return packs_query_heads(spec, CUDA_FORWARD_BLOCK_Q)


def cuda_decode_tile(spec: AttentionSpec) -> bool:
    """Whether the cuda forward runs the general kernel on the decoding tile (the FFI attribute
    decode_tile; kernels/tile.h DecodeForwardShape): its tiles hold at most CUDA_DECODE_BLOCK_Q
    query rows, the G heads of a kv head with GQA packing, else T, and its K and V row strides
    fit 32 bits (K·max(H, Hv) < 2**31). The handlers refuse the attribute for a call this rule
    refuses (DecodeTileRefusal, kernels/dispatch.h)."""
    rows = spec.group_size if cuda_packs_heads(spec) else spec.q_len
    narrow = spec.num_kv_heads * max(spec.head_dim, spec.v_head_dim) < 2**31
    return rows <= CUDA_DECODE_BLOCK_Q and narrow


def cuda_forward_tile(spec: AttentionSpec) -> tuple[int, int]:
    """(query rows, keys) of the tile the cuda forward's general kernel runs for `spec`: the
    decoding tile's, else the layout's (kernels/tile.h)."""
    if cuda_decode_tile(spec):
        return CUDA_DECODE_BLOCK_Q, cuda_decode_block_kv(spec)
    return CUDA_FORWARD_BLOCK_Q, cuda_forward_block_kv(spec)


def cuda_forward_ctas(spec: AttentionSpec) -> int:
    """CTAs of the cuda forward before split-KV: B·(K packed, else N)·ceil(T / rows per tile)."""
    heads = spec.num_kv_heads if cuda_packs_heads(spec) else spec.num_heads
    return spec.batch * heads * -(-spec.q_len // cuda_forward_tile(spec)[0])


def cuda_resident_slots(spec: AttentionSpec, sms: int) -> int:
    """The CTAs of the call's forward tile that a GPU of `sms` SMs holds at once (the split
    rule's wave)."""
    return sms * (CUDA_DECODE_CTAS_PER_SM if cuda_decode_tile(spec) else 1)


def wave_chunk_count(units: int, slots: int, blocks: int, min_blocks: int, max_chunks: int) -> int:
    """The cuda split-KV rule (FlashAttention-2's num_splits_heuristic): 1 when `units` CTAs
    fill CUDA_SPLIT_FILLED of the `slots`; else the fewest chunks C (at most `max_chunks`, each of
    at least `min_blocks` of the `blocks` key tiles) whose last wave is at least
    CUDA_SPLIT_WAVE_EFFICIENCY as full as the best C's: a wave's fill is w / ceil(w), w = units ·
    C / slots, so C avoids a nearly empty last wave."""
    most = max(1, min(blocks // min_blocks, max_chunks))
    if units >= CUDA_SPLIT_FILLED * slots or most == 1:
        return 1
    fill = [0.0] + [units * c / slots / -(-units * c // slots) for c in range(1, most + 1)]
    best = max(fill)
    return next(c for c in range(1, most + 1) if fill[c] >= CUDA_SPLIT_WAVE_EFFICIENCY * best)


def cuda_split_kv_chunks(spec: AttentionSpec, sms: int) -> int:
    """The cuda forward's split-KV chunk count C for a call of shape `spec` on a GPU of `sms`
    SMs (1: no split)."""
    if spec.has_dropout or spec.batch * spec.num_heads * spec.q_len == 0:
        return 1
    count = forced(spec, "cuda_split_kv")
    if count is not None:
        return count
    tiles = -(-spec.kv_len // cuda_forward_tile(spec)[1])
    slots = cuda_resident_slots(spec, sms)
    return wave_chunk_count(cuda_forward_ctas(spec), slots, tiles, CUDA_SPLIT_MIN_TILES, CUDA_MAX_SPLITS)


def cuda_decoding_description(spec: AttentionSpec, sms: int, sms_words: str) -> str:
    """What `explain` says of the cuda forward's split-KV and GQA packing (`sms_words`: where
    the SM count comes from)."""
    pack = cuda_packs_heads(spec)
    packing = f"GQA packing: the {spec.group_size} query heads of each kv head in one tile, " if pack else ""
    chunks = cuda_split_kv_chunks(spec, sms)
    if spec.has_dropout:
        why = "never with dropout"
    elif forced(spec, "cuda_split_kv") is not None:
        why = setting_words(spec, "cuda_split_kv")
    else:
        rows = cuda_forward_tile(spec)[0]
        per_sm = (
            f"{CUDA_DECODE_CTAS_PER_SM} CTAs of the decoding tile per SM"
            if cuda_decode_tile(spec)
            else "one CTA per SM"
        )
        why = (
            f"{cuda_forward_ctas(spec)} CTAs (B·{'K' if pack else 'N'}·ceil(T/{rows})) against "
            f"{cuda_resident_slots(spec, sms)} resident ({sms_words}, {per_sm}): split when they fill fewer "
            f"than {CUDA_SPLIT_FILLED:.0%}, into the fewest chunks whose waves are {CUDA_SPLIT_WAVE_EFFICIENCY:.0%} "
            f"as full as the best count's, at most {CUDA_MAX_SPLITS} of at least {CUDA_SPLIT_MIN_TILES} key "
            "tiles each, merged by lse in chunk order"
        )
    # The decoding settings' own scan of V (scans_values, which also needs no dense bias).
    scan = "; non-finite values of V handled in the kernel (without a dense bias)" if packing or chunks > 1 else ""
    if chunks == 1:
        return f"forward: {packing}no split-KV ({why}){scan}"
    return f"forward: {packing}split-KV into {chunks} key chunks ({why}){scan}"


def cuda_decoding_summary(spec: AttentionSpec, sms: int) -> str:
    """`explain`'s one line for the cuda forward's split-KV and GQA packing, the reason in words."""
    chunks = cuda_split_kv_chunks(spec, sms)
    ctas = cuda_forward_ctas(spec)
    if spec.has_dropout:
        why = "never with dropout"
    elif forced(spec, "cuda_split_kv") is not None:
        why = setting_words(spec, "cuda_split_kv")
    elif chunks > 1:
        why = f"{ctas} CTAs would leave SMs idle ({cuda_resident_slots(spec, sms)} resident on {sms} SMs)"
    elif ctas >= CUDA_SPLIT_FILLED * cuda_resident_slots(spec, sms):
        why = f"{ctas} CTAs fill the {sms} SMs"
    else:
        why = "too few key tiles to split"
    return split_summary(chunks, cuda_packs_heads(spec), why)


def cuda_summary(spec: AttentionSpec, sms: int) -> str:
    """`explain`'s one line for cuda: the layout, the forward's decoding settings, the backward grid."""
    return f"{cuda_layout(spec)} layout, {cuda_decoding_summary(spec, sms)}, backward grid {cuda_backward_grid(spec)}"


# ---- pallas (jax_flash/pallas/_triton.py; tiles from the tuned table, pallas/_table) ------------

# Split-KV of the pallas forward (flash-decoding): when the grid, B·N·ceil(T/block_q) programs,
# is smaller than the target (the GPU's SMs; interpreted: PALLAS_INTERPRET_PROGRAMS) and the
# call is a decode step (T <= PALLAS_SPLIT_MAX_QUERIES, no dropout), each query block's key
# blocks are cut into C = min(ceil(target / programs), key blocks // PALLAS_SPLIT_MIN_BLOCKS,
# PALLAS_MAX_SPLITS) contiguous chunks, one program each, merged by lse in chunk order.
PALLAS_SPLIT_MAX_QUERIES = 64
PALLAS_SPLIT_MIN_BLOCKS = 2
PALLAS_MAX_SPLITS = 64
# The programs that stand for "the GPU" when the kernels are interpreted (on a CPU).
PALLAS_INTERPRET_PROGRAMS = 8


def pallas_target(interpret: bool, sms: int) -> int:
    """The programs the pallas grid should reach: the SMs, or 8 when interpreted."""
    return PALLAS_INTERPRET_PROGRAMS if interpret else sms


def pallas_tile(length: int, block: int) -> int:
    """A tile no larger than the (power-of-two rounded) length, at least 16 rows."""
    return max(16, min(block, 1 << max(0, (length - 1).bit_length())))


def pallas_tile_config(
    head_dim_padded: int, dtype: str, pass_: str, interpret: bool, smem_budget: int | None, dense_bytes: int
):
    """The tuned table's launch configuration for one pass (`pallas._table.TABLE`; small tiles
    when interpreted), shrunk to `smem_budget` bytes of shared memory where the GPU has less
    than the table's sm_90 (`pallas._table.fit`)."""
    from jax_flash.pallas import _table

    cfg = _table.lookup(head_dim_padded, dtype, pass_, interpret)
    if interpret:
        return cfg
    return _table.fit(cfg, head_dim_padded, dtype, pass_, smem_budget, dense_bytes)


def pallas_plain_blocker(spec: AttentionSpec) -> str | None:
    """Why a call may not run the pallas plain kernels (`jax_flash.pallas._triton_kernels`), or None
    when it may: then each pass runs them where the call's scores and values are finite
    (`jax_flash.pallas.plain_inputs`, tested on every call), the general kernels elsewhere.
    They keep raw scores (no soft cap, bias or flex function to transform them) with the scale
    inside the exponent, which a zero, negative, subnormal or huge scale would break."""
    blockers = (
        (spec.soft_cap is not None, "a soft cap"),
        (spec.bias_shape is not None, "a dense bias"),
        (spec.flex is not None, "flex_attention"),
        (not 2.0**-126 <= _float32(spec.scale) < 2.0**127, "a scale outside [2**-126, 2**127)"),
    )
    return next((why for blocked, why in blockers if blocked), None)


def pallas_kernels_description(spec: AttentionSpec) -> str:
    """What `explain` says of the pallas kernels a call runs."""
    why = pallas_plain_blocker(spec)
    if why is not None:
        return f"the general kernels (the call has {why})"
    return (
        "the plain kernels where q, k and v are finite and no score can overflow (tested on every call; "
        "the general kernels otherwise)"
    )


def pallas_split_kv_chunks(spec: AttentionSpec, block_q: int, block_k: int, target: int) -> int:
    """The pallas forward's split-KV chunk count for `spec` at tiles (block_q, block_k); 1: none."""
    if spec.has_dropout or spec.batch * spec.num_heads * spec.q_len == 0:
        return 1
    blocks = -(-spec.kv_len // block_k)
    count = forced(spec, "pallas_split_kv")
    if count is not None:
        return max(1, min(count, blocks))
    if spec.q_len > PALLAS_SPLIT_MAX_QUERIES:
        return 1
    programs = spec.batch * spec.num_heads * -(-spec.q_len // block_q)
    return chunk_count(programs, target, blocks, PALLAS_SPLIT_MIN_BLOCKS, PALLAS_MAX_SPLITS)


def pallas_split_kv_description(spec: AttentionSpec, block_q: int, block_k: int, interpret: bool, sms: int) -> str:
    """What `explain` says of the pallas forward's split-KV (at the tiles given)."""
    target = pallas_target(interpret, sms)
    chunks = pallas_split_kv_chunks(spec, block_q, block_k, target)
    words = f"{target} " + ("programs (interpreted)" if interpret else "SMs")
    why = (
        setting_words(spec, "pallas_split_kv")
        if forced(spec, "pallas_split_kv") is not None
        else f"split when T <= {PALLAS_SPLIT_MAX_QUERIES} and B·N·ceil(T/{block_q}) programs < {words}: "
        f"min(ceil(target / programs), ceil(S/{block_k}) // {PALLAS_SPLIT_MIN_BLOCKS}, {PALLAS_MAX_SPLITS}) "
        "key chunks merged by lse in chunk order; never with dropout"
    )
    return f"forward: {'no split-KV' if chunks == 1 else f'split-KV into {chunks} key chunks'} ({why})"


def pallas_split_kv_summary(spec: AttentionSpec, block_q: int, block_k: int, interpret: bool, sms: int) -> str:
    """`explain`'s one line for the pallas forward's split-KV (at the tiles given)."""
    target = pallas_target(interpret, sms)
    chunks = pallas_split_kv_chunks(spec, block_q, block_k, target)
    programs = spec.batch * spec.num_heads * -(-spec.q_len // block_q)
    if forced(spec, "pallas_split_kv") is not None:
        why = setting_words(spec, "pallas_split_kv")
    elif spec.has_dropout:
        why = "never with dropout"
    elif chunks > 1:
        why = f"{programs} programs, fewer than {target}"
    elif spec.q_len > PALLAS_SPLIT_MAX_QUERIES:
        why = f"more than {PALLAS_SPLIT_MAX_QUERIES} queries"
    elif programs >= target:
        why = f"{programs} programs, no fewer than the {target} {'SMs' if not interpret else 'it aims for when interpreted'}"
    else:
        why = "too few key blocks to split"
    return split_summary(chunks, False, why)


def pallas_group_splits(group: int, programs: int, interpret: bool, sms: int) -> int:
    """How many pallas dK/dV programs share one kv head's group: the smallest divisor of G
    that gives about two programs per SM (interpreted: 8 programs)."""
    target = PALLAS_INTERPRET_PROGRAMS if interpret else 2 * sms
    for d in range(1, group + 1):
        if group % d == 0 and programs * d >= target:
            return d
    return group


# ---- sequence parallelism under jax.jit ----------------------------------------------------

# Among schemes that move equally many bytes, the first of this order wins: the all-to-all
# runs one call of the local kernel with no per-step merges; the hybrid merges over fewer
# ring steps than the ring.
SEQUENCE_SCHEMES = ("all_to_all", "hybrid", "ring")


def sequence_parallel_bytes(
    scheme: str, spec: AttentionSpec, ring_size: int, a2a_size: int, acc_itemsize: int
) -> tuple[int, int]:
    """(forward, backward) bytes that one device sends for a sequence-sharded call: `spec`
    with the global T and S and this device's batch rows and heads (after any batch or head
    sharding), the sequence over ring_size x a2a_size devices (the ring over the first, the
    all-to-all over the second; the ring scheme has a2a_size 1, the all-to-all ring_size 1).

    all-to-all over Pa devices (each sends (Pa-1)/Pa of every array it re-shards): forward q,
      k, v (the kv heads repeated to K' = lcm(K, Pa)) to heads, out and lse back; backward
      q, k, v, out, dout, lse, dlse to heads, dq, dk, dv back. dtype bytes for arrays, the
      accumulator's for lse/dlse.
    ring over Pr devices: forward the K/V chunk moves Pr - 1 times; backward K/V Pr - 1 times
      and the dK/dV accumulators (accumulator dtype) Pr times (the last hop takes them home).
    hybrid: the all-to-all over Pa on the local chunks, then the ring over Pr on chunks of
      Pa times the length and K'/Pa kv heads.
    """
    import math

    import numpy as np

    e = np.dtype(spec.dtype).itemsize
    b, n, k, h, hv = spec.batch, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.v_head_dim
    p = ring_size * a2a_size
    tl, sl = spec.q_len // p, spec.kv_len // p  # this device's chunk
    fwd = bwd = 0
    if a2a_size > 1:
        kx = math.lcm(k, a2a_size)
        share = lambda elems: elems * (a2a_size - 1) // a2a_size
        q_el, o_el, kv_el, stat_el = b * tl * n * h, b * tl * n * hv, b * sl * kx * (h + hv), b * n * tl
        fwd += share(q_el + kv_el + o_el) * e + share(stat_el) * acc_itemsize
        bwd += share(2 * (q_el + kv_el) + 2 * o_el) * e + share(2 * stat_el) * acc_itemsize
        k = kx // a2a_size  # the ring (hybrid) then runs on the gathered chunk's heads
        sl *= a2a_size
    if ring_size > 1:
        kv = b * sl * k * (h + hv)
        fwd += (ring_size - 1) * kv * e
        bwd += (ring_size - 1) * kv * e + ring_size * kv * acc_itemsize
    return fwd, bwd


def sequence_parallel_choice(moved: dict[str, int]) -> str:
    """The rule: of the schemes that can run ({scheme: bytes one device sends, forward plus
    backward}), the one that moves the fewest bytes; ties go by SEQUENCE_SCHEMES."""
    return min(moved, key=lambda s: (moved[s], SEQUENCE_SCHEMES.index(s)))


# ---- implementation=None on a GPU: chosen by measurement ------------------------------------
#
# `measured_choices.json` (beside this module, package data) holds the results of device runs
# of `python -m jax_flash.bench` (`build/device_check.sh` writes it: `--write-choices`), one
# entry per (architecture, shape class, pass) with each implementation's time. On a GPU,
# `implementation=None` tries the implementations of the call's class, fastest first, before
# the default order; where no run measured the architecture and class, the default order
# stands, and `explain` says which of the two decided.

MEASURED_CHOICES_FILE = "measured_choices.json"
MEASURED_IMPLEMENTATIONS = ("cuda", "pallas", "xla")  # the bench's names that are ours
# The bench's name of `pallas` with its forward on Mosaic GPU (Config.pallas_backend="mosaic_gpu");
# plain "pallas" is measured on Triton. implementation=None counts the faster of the two as pallas.
MEASURED_PALLAS_MOSAIC = "pallas-mosaic"
MEASURED_DECODE_QUERIES = 16  # a call of at most this many queries is a decode step (its class)


def seq_bucket(length: int) -> str:
    """The sequence-length class of a key length: '<=2k', '<=8k', '<=32k' or '>32k'."""
    for limit, name in ((2048, "<=2k"), (8192, "<=8k"), (32768, "<=32k")):
        if length <= limit:
            return name
    return ">32k"


def shape_class(spec: AttentionSpec) -> dict | None:
    """The measured tables' class of a call: head dim, causal or not, key-length bucket,
    decode or not; None for a call no class describes (16-bit dtypes only; no window other
    than causal, no Hv != H, no flex function, bias or dense mask)."""
    if spec.dtype not in ("bfloat16", "float16") or spec.v_head_dim != spec.head_dim:
        return None
    if spec.flex is not None or spec.bias_shape is not None or spec.mask_shape is not None:
        return None
    causal = spec.window_right == 0 and spec.window_left is None
    if not causal and (spec.window_left is not None or spec.window_right is not None):
        return None
    return dict(
        head_dim=spec.head_dim,
        causal=causal,
        seq=seq_bucket(spec.kv_len),
        decode=spec.q_len <= MEASURED_DECODE_QUERIES,
    )


def load_measured_choices(path=None) -> list[dict]:
    """The entries of the measured table (the file shipped with the package by default): each
    {"arch": "sm_90", "device", "date", "jax", "source", "class": shape_class(...), "pass":
    "fwd" | "fwdbwd", "times_ms": {implementation: ms}}."""
    import json
    import pathlib

    path = pathlib.Path(__file__).with_name(MEASURED_CHOICES_FILE) if path is None else pathlib.Path(path)
    return list(json.loads(path.read_text())["entries"])


def measured_choice(spec: AttentionSpec, arch: str | None, entries: list[dict]) -> tuple[tuple[str, ...], str]:
    """(the implementations to try first, fastest first; the sentence `explain` prints) for a
    call on architecture `arch` ("sm_90"; None off a GPU). The class's forward+backward entry
    decides where there is one (training calls both passes on the implementation chosen),
    else its forward entry; no entry: () and what the default order rests on."""
    cls = shape_class(spec)
    if arch is None:
        return (), "not on a GPU: the platform's default order"
    if cls is None:
        return (), f"no measured class describes this call on {arch}: the default order"
    found = [e for e in entries if e["arch"] == arch and e["class"] == cls]
    found.sort(key=lambda e: e["pass"] != "fwdbwd")
    if not found:
        what = ", ".join(f"{k}={v}" for k, v in cls.items())
        return (), f"no measurement for {arch} at {what}: the default order"
    e = found[0]
    times = {k: v for k, v in e["times_ms"].items() if k in MEASURED_IMPLEMENTATIONS and v}
    mosaic = e["times_ms"].get(MEASURED_PALLAS_MOSAIC)
    if mosaic and mosaic < times.get("pallas", float("inf")):
        times["pallas"] = mosaic
    order = tuple(sorted(times, key=lambda name: times[name]))
    if len(order) > 1:
        ratio = f"{order[0]} {times[order[1]] / times[order[0]]:.2f}x faster than {order[1]}"
    else:
        ratio = f"{order[0]} alone measured"
    return order, (
        f"measured on {e['device']} ({arch}), {e['date']}, {e['pass']} H={cls['head_dim']} "
        f"{'causal' if cls['causal'] else 'full'} S {cls['seq']}{' decode' if cls['decode'] else ''}: {ratio}"
    )


def measured_pallas_backend(spec: AttentionSpec, arch: str | None, entries: list[dict]) -> tuple[str, str]:
    """(the compiler `pallas_backend="auto"` takes for the forward of `spec`, the sentence `explain`
    prints): "mosaic_gpu" where a device run on `arch` measured the call's class (its forward
    entry) with the Mosaic GPU forward faster than the Triton one, else "triton"."""
    cls = shape_class(spec)
    if arch is None or cls is None:
        return "triton", "Triton: no measured class describes this call" + ("" if arch else " off a GPU")
    for e in entries:
        if e["arch"] == arch and e["class"] == cls and e["pass"] == "fwd":
            triton, mosaic = e["times_ms"].get("pallas"), e["times_ms"].get(MEASURED_PALLAS_MOSAIC)
            if triton and mosaic:
                faster = "mosaic_gpu" if mosaic < triton else "triton"
                return faster, (
                    f"{'Mosaic GPU' if faster == 'mosaic_gpu' else 'Triton'}: measured on {e['device']} ({arch}), "
                    f"{e['date']}, Mosaic GPU {triton / mosaic:.2f}x Triton's speed"
                )
    return "triton", f"Triton: no device run on {arch} measured the Mosaic GPU forward for this class"
