"""The pallas forward on Mosaic GPU (sm_90a): FlashAttention-3's schedule in Pallas.

One CTA computes `CONSUMERS x block_q` query rows of one (batch, head) and runs three
warpgroups: two *consumers* of `block_q = 64` rows each (one wgmma M) and one *producer*,
which only issues TMA copies of the key and value tiles into a ring of `stages` slots in
shared memory. Per slot two barriers say a tile has landed (`k_ready`, `v_ready`: the
producer's copy arrives on them) and two say both consumers are done with it (`k_free`,
`v_free`: each consumer arrives once), so the producer refills a slot as soon as it is free
and the copies of step i + stages overlap the math of step i.

A consumer's key step:

    S    = Q Kᵀ                      wgmma, Q and K from shared memory, S [64, block_kv] f32
    m'   = max(m, rowmax S)          raw scores: the scale is folded into the exponent
    p    = exp2((S - m')·c)          c = scale·log2 e, rounded once per call
    α    = exp2((m - m')·c)
    l    = α·l + rowsum p
    O    = α·O + p V                wgmma, p from registers (16-bit), V from shared memory

and at the end O / l, lse = m·scale + log l (natural units, the unit the backward takes).
The subtraction S − m' is one rounding (exact by Sterbenz where S ≥ m'/2) and the row max
gets exp2(0) = 1 at any magnitude: the form of the other plain kernels
(docs/numerical-contract.md). The two consumers take turns on the tensor cores (the
`schedule` barrier): while one runs its softmax the other's wgmma runs.

This is the plain kernel only: finite inputs (the caller tests them, as for the Triton plain
kernels), no bias or dense mask; a soft cap turns the raw scores into logits first
(`soft_capped`, then log2 e alone in the exponent); segment ids mask every step a CTA runs (the
rows' ids copied once per consumer, the keys' ids through the ring beside K: `mask_segments`),
and a CTA runs only the key steps whose ids' range meets its rows' (`segment_steps`, computed
by XLA per batch row and query tile: packed sequences skip the other sequences' keys); attention
sinks joined after the key loop as the Triton plain forward joins them; Hv != H stages O in a
buffer of its own. Causal masks and sliding windows are one *band* (`band`: row r sees key j
iff lo <= j - r <= hi; top-left as jax.nn, for T != S too): a consumer runs only the key steps
that hold a key its rows see (`visible_steps`), the steps on the band's two edges masked in
loops of their own and the ones inside it not; the steps its CTA's other consumer sees and it
does not are observed and released (`skip`). A query offset per batch row moves the band
and query and key lengths cut it (`Bounds`: one int32 [B, 4] operand, read once per CTA, the
steps chosen from it as from the static band). A row that has seen no key yet in a masked step
keeps m = -inf and is shifted by 0, so p = 0 instead of NaN; a row that sees no key at all (past
its query length, or outside the band) ends with out 0 and lse -inf (the sink's with a sink).
Ragged T and S are padded with zeros to whole tiles here (the rows past T are computed and
dropped, the keys past S masked in the last key step, peeled off the loop like the band's
edges); `unsupported` says why a call falls outside. `jax_flash.pallas._backend`
routes the calls it serves here (`Config.pallas_backend`); tests/internals/test_pallas_mosaic.py
holds its lowering and its interpretation, build/mosaic_check.py its run on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_flash._spec import offset_clip

LOG2E = math.log2(math.e)
CONSUMERS = 2  # consumer warpgroups per CTA, one wgmma M = 64 rows each
HEAD_DIMS = (64, 128, 256)
DTYPES = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ForwardTiles:
    """The forward's tiles: rows per consumer warpgroup, keys per step, ring slots."""

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2

    @property
    def rows(self) -> int:
        """Query rows per CTA."""
        return CONSUMERS * self.block_q


def default_tiles(head_dim: int, v_head_dim: int | None = None) -> ForwardTiles:
    """FlashAttention-3's forward tiles for sm_90 by head dim (its 228 KB of shared memory):
    128 x 128 at H, Hv <= 128 (two 64-row consumers), 128 x 64 where either is 256."""
    return ForwardTiles(block_kv=64 if max(head_dim, v_head_dim or head_dim) > 128 else 128, stages=2)


# Shared memory per CTA on sm_90 (227 KB), less what the kernel's barriers and alignment take.
SMEM_BYTES = 227 * 1024 - 1024


def smem_bytes(head_dim: int, v_head_dim: int, tiles: ForwardTiles, itemsize: int = 2) -> int:
    """The forward's shared memory: Q (O staged there when Hv = H, else a buffer of its own), the
    K and V ring, the rows' lse."""
    rows, ring = tiles.rows, tiles.stages * tiles.block_kv
    o = 0 if v_head_dim == head_dim else rows * v_head_dim
    return itemsize * (rows * head_dim + ring * (head_dim + v_head_dim) + o) + 4 * rows


def band(causal: bool, window_left: int | None, window_right: int | None, q_len: int, kv_len: int):
    """(lo, hi): row r sees key j iff lo <= j - r <= hi (None: that side unbounded), as
    `AttentionSpec.band()` at query offset 0 (top-left, as jax.nn, for T != S too); causal is
    hi = 0. Clipped to [-T, S] of the padded lengths `q_len`, `kv_len` (the rows and keys the
    kernel computes): that changes nothing (-T < j - r < S) and keeps the kernels' int32 step
    arithmetic (r + hi, r + lo) from wrapping around for any window size."""
    hi = 0 if causal else window_right
    lo = None if window_left is None else max(-window_left, -q_len)
    return lo, (None if hi is None else min(hi, kv_len))


def visible_steps(lo, hi, limit, r0, rows: int, block: int, row_limit=None):
    """For rows [r0, r0 + rows) of a band (lo, hi) over `limit` real keys, in key steps of `block`
    keys: (first, full_lo, full_hi, last), int32: the steps [first, last) hold a key some row
    sees, and of them [full_lo, full_hi) only keys every row sees (the others are masked).
    `row_limit`: the rows from it on do not exist (a query length: they see nothing and do not
    count for the masking). Bounds are Python ints or int32 scalars (a batch row's, `Bounds`).
    The same function gives the query steps that see keys [r0, r0 + rows) with (-hi, -lo)."""
    i32 = jnp.int32
    steps = pl.cdiv(jnp.asarray(limit, i32), i32(block))
    n = i32(rows) if row_limit is None else jnp.clip(row_limit - r0, 0, rows).astype(i32)
    first = i32(0) if lo is None else lax.div(jnp.maximum(r0 + lo, 0), i32(block))
    last = steps if hi is None else jnp.minimum(pl.cdiv(jnp.maximum(r0 + n + hi, 0), i32(block)), steps)
    if row_limit is not None:
        last = jnp.where(n == 0, 0, last)
    first = jnp.minimum(first, last)
    full_lo = first if lo is None else pl.cdiv(jnp.maximum(r0 + n - 1 + lo, 0), i32(block))
    full_hi = lax.div(jnp.asarray(limit, i32), i32(block))
    if hi is not None:
        full_hi = jnp.minimum(lax.div(jnp.maximum(r0 + hi + 1, 0), i32(block)), full_hi)
    full_lo = jnp.clip(full_lo, first, last)
    return first, full_lo, jnp.clip(full_hi, full_lo, last), last


class Bounds(NamedTuple):
    """What one batch row's rows see: the band (lo, hi; None: that side unbounded) and the query
    and key lengths (q_valid, kv_valid). Python ints where the call's are static; where it has a
    query offset or lengths, int32 scalars read from the kernel's `bounds` operand (`read`)."""

    lo: object
    hi: object
    q_valid: object
    kv_valid: object

    @staticmethod
    def of(
        causal, window, q_len: int, kv_len: int, padded: tuple[int, int], q_offset=None, q_lengths=None, kv_lengths=None
    ):
        """(the static bounds, and None or the int32 [B, 4] operand of the runtime ones): the band
        of `band` moved by the [B] `q_offset` (clipped to the padded lengths as `band`, exactly for
        any int32 offset), lengths clipped to [0, T], [0, S]."""
        lo, hi = band(causal, window[0], window[1], padded[0], padded[1])
        static = Bounds(lo, hi, q_len, kv_len)
        if q_offset is None and q_lengths is None and kv_lengths is None:
            return static, None
        rows = next(x for x in (q_offset, q_lengths, kv_lengths) if x is not None).shape[0]
        offset = jnp.zeros((rows,), jnp.int32) if q_offset is None else jnp.asarray(q_offset, jnp.int32)

        def moved(side):  # offset + side (the window's, unclipped), clipped as `band` clips it
            return jnp.zeros((rows,), jnp.int32) if side is None else offset_clip(offset, side, -padded[0], padded[1])

        def length(x, full):
            return jnp.full((rows,), full, jnp.int32) if x is None else jnp.clip(x, 0, full).astype(jnp.int32)

        window_lo = None if window[0] is None else -window[0]
        window_hi = 0 if causal else window[1]
        columns = (moved(window_lo), moved(window_hi), length(q_lengths, q_len), length(kv_lengths, kv_len))
        return static, jnp.stack(columns, axis=1)

    def read(self, bounds_ref, batch) -> Bounds:
        """The bounds of batch row `batch` in a kernel: the static ones, or read from `bounds_ref`."""
        if bounds_ref is None:
            return self
        return Bounds(*(None if x is None else bounds_ref[batch, i] for i, x in enumerate(self)))


def over_band(step, skip, carry, bounds, lo, hi, ragged_keys: bool, cut_rows: bool = False):
    """A consumer's key loop over its CTA's steps `bounds` = (cta_first, first, full_lo, full_hi,
    last, cta_last) (`visible_steps`): the steps its rows do not see skipped (`skip(start, stop)`),
    the band's edges and the keys past S as `step(i, carry, True)` (masked), the steps inside it as
    `step(i, carry, False)`, each range a loop of its own; the final carry. `cut_rows`: the
    consumer's steps may reach outside its CTA's: a query length may leave it fewer rows (so
    fewer steps) than its CTA's other consumer, segment ids may narrow the CTA's steps
    (`narrowed`); its own are clipped into the CTA's."""
    cta_first, first, full_lo, full_hi, last, cta_last = bounds
    if cut_rows:  # a consumer without rows sees no step: none before its CTA's first one
        first, full_lo, full_hi, last = (jnp.clip(x, cta_first, cta_last) for x in (first, full_lo, full_hi, last))
    if lo is not None:  # the band's left edge
        skip(cta_first, first)
        carry = lax.fori_loop(first, full_lo, lambda i, c: step(i, c, True), carry)
    carry = lax.fori_loop(full_lo, full_hi, lambda i, c: step(i, c, False), carry)
    if hi is not None or ragged_keys:  # its right edge, the keys past S
        carry = lax.fori_loop(full_hi, last, lambda i, c: step(i, c, True), carry)
    if hi is not None or cut_rows:  # the CTA's other consumer may see more steps
        skip(last, cta_last)
    return carry


def ring_slot(i, stages: int):
    """The ring slot of step i."""
    return lax.rem(i, jnp.asarray(stages, i.dtype))


def produce(start, stop, stages: int, fetch, wait_free):
    """A producer warpgroup's loop over the steps [start, stop): the ring's first fill, each later
    step once its slot is free (`wait_free(slot)`), and the last steps' releases observed (every
    phase of a barrier is waited for before the barrier goes). `fetch(i, slot)` issues step i's
    TMA copies into `slot`."""
    for r in range(stages):

        @pl.when(start + r < stop)
        def _(r=r):
            fetch(start + r, ring_slot(start + r, stages))

    @pl.loop(start + stages, stop)
    def _(i):
        slot = ring_slot(i, stages)
        wait_free(slot)
        fetch(i, slot)

    @pl.loop(jnp.maximum(stop - stages, start), stop)
    def _(i):
        wait_free(ring_slot(i, stages))


def soft_capped(x, scale: float, cap: float):
    """The logits cap·tanh(scale·x/cap) of raw scores x (a soft-capped call's), as
    cap - 2·cap / (exp2(x·2·scale/cap·log2 e) + 1): one ex2 and one division per score, within a
    few float32 roundings of cap in absolute terms (tanh.approx's 2^-11 relative error would move
    a logit near the cap by cap·2^-11, a weight by as much). Saturates to ±cap, never NaN."""
    e = jnp.exp2(x * float(np.float32(2.0 * scale / cap * LOG2E)))
    return cap - (2.0 * cap) / (e + 1.0)


def segment_ids(ref, of_rows: bool):
    """The int32 segment ids in shared memory `ref` of a score tile's rows (a row vector,
    WGMMA.reduce(1)) or of its columns (WGMMA.reduce(0))."""
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1 if of_rows else 0))


def mask_segments(x, row_ids, col_ids):
    """Scores x [rows, cols] (WGMMA layout) with -inf where a row's segment id differs from the
    column's (`segment_ids`)."""
    same = lax.broadcast_in_dim(row_ids, x.shape, [0]) == lax.broadcast_in_dim(col_ids, x.shape, [1])
    return jnp.where(same, x, -jnp.inf)


def segment_steps(row_ids, col_ids, rows: int, block: int, row_len: int, col_len: int):
    """The steps a tile of `rows` rows need under segment ids: int32 [B, tiles, 2], per batch row
    and tile the first and past-the-last step of `block` columns whose ids' range meets the
    tile's, (0, 0) where none does. A step outside holds no column of a row's segment, whatever
    the order of the ids, so its columns are all masked: the kernels neither copy nor compute it.
    `row_ids` [B, tiles·rows] and `col_ids` [B, steps·block] are padded; only the first `row_len`
    rows and `col_len` columns count (the padding sees nothing)."""
    i32 = jnp.int32
    big = jnp.iinfo(jnp.int32).max

    def ranges(ids, length, width):  # each group's smallest and largest real id
        real = jnp.arange(ids.shape[1]) < length
        low = jnp.where(real, ids, big).reshape(ids.shape[0], -1, width).min(axis=2)
        high = jnp.where(real, ids, -big).reshape(ids.shape[0], -1, width).max(axis=2)
        return low, high

    row_lo, row_hi = ranges(row_ids, row_len, rows)  # [B, tiles]
    col_lo, col_hi = ranges(col_ids, col_len, block)  # [B, steps]
    meets = (col_hi[:, None, :] >= row_lo[:, :, None]) & (col_lo[:, None, :] <= row_hi[:, :, None])
    steps = meets.shape[2]
    first = jnp.argmax(meets, axis=2).astype(i32)
    last = (steps - jnp.argmax(meets[:, :, ::-1], axis=2)).astype(i32)
    any_step = meets.any(axis=2)
    return jnp.stack([jnp.where(any_step, first, 0), jnp.where(any_step, last, 0)], axis=2)


def narrowed(first, last, steps_ref, batch, tile):
    """A tile's step range [first, last) cut to the steps its segment ids need (`segment_steps`'
    row (batch, tile) in a kernel's `steps_ref`); an empty range stays empty."""
    last = jnp.minimum(last, steps_ref[batch, tile, 1])
    return jnp.minimum(jnp.maximum(first, steps_ref[batch, tile, 0]), last), last


def mask_band(x, lo, hi, r0, c0, limit=None):
    """Scores x [rows, cols] (WGMMA layout) with -inf where column c0 + j is not visible from row
    r0 + i: outside lo <= col - row <= hi (None: unbounded), or col >= limit."""
    row = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=plgpu.Layout.WGMMA) + r0
    col = plgpu.broadcasted_iota(jnp.int32, x.shape, 1, layout=plgpu.Layout.WGMMA) + c0
    conditions = [col < limit] if limit is not None else []
    if lo is not None:
        conditions.append(col - row >= lo)
    if hi is not None:
        conditions.append(col - row <= hi)
    visible = functools.reduce(jnp.logical_and, conditions)
    return jnp.where(visible, x, -jnp.inf)


def unsupported(shape_q, shape_k, shape_v, dtype, *, causal: bool, window=(None, None), soft_cap=None) -> str | None:
    """Why the Mosaic GPU forward cannot serve these shapes, or None. `window`: (left, right) keys
    of a sliding window (None: unbounded)."""
    _, t, n, h = shape_q
    _, s, kh, hk = shape_k
    hv = shape_v[-1]
    if jnp.dtype(dtype).name not in DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (it serves {', '.join(DTYPES)})"
    if h not in HEAD_DIMS or hk != h:
        return f"head dim {h} (it serves {HEAD_DIMS})"
    if hv not in HEAD_DIMS:
        return f"a value head dim {hv} (it serves {HEAD_DIMS})"
    if smem_bytes(h, hv, default_tiles(h, hv)) > SMEM_BYTES:
        return f"head dims ({h}, {hv}) (their tiles take more than {SMEM_BYTES} bytes of shared memory)"
    if n % kh:
        return f"{n} query heads over {kh} kv heads"
    if t == 0 or s == 0:
        return "an empty sequence"
    if any(w is not None and w < 0 for w in window):
        return f"a window {window} with a negative side"
    if soft_cap is not None and not 0.0 < soft_cap < math.inf:
        return f"a soft cap {soft_cap} (it serves 0 < cap < inf)"
    return None


def forward(
    q,
    k,
    v,
    *,
    scale: float,
    causal: bool = False,
    window: tuple[int | None, int | None] = (None, None),
    tiles: ForwardTiles | None = None,
    soft_cap: float | None = None,
    sinks=None,
    q_offset=None,
    q_lengths=None,
    kv_lengths=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    run=None,
    interpret=None,
):
    """(out [B, T, N, H], lse [B, N, T] f32, natural log) of the plain attention of canonical
    q [B, T, N, H], k, v [B, S, K, H]; see the module docstring for what it serves. `window`:
    (left, right) keys a row sees around its own (None: unbounded; causal sets right = 0).

    `soft_cap`: None, or the cap c > 0 of the logits c·tanh(scale·s/c) (the softmax then runs on
    logits, not raw scores: `soft_capped`).

    `q_offset`, `q_lengths`, `kv_lengths`: None, or [B] int32 (`AttentionSpec`'s meaning): query
    t of batch row b at key position q_offset[b] + t for the band; rows t >= q_lengths[b] see no
    key (out 0, lse -inf or the sink); keys s >= kv_lengths[b] are seen by none.
    `q_segment_ids` [B, T], `kv_segment_ids` [B, S]: None, or int32 ids (both or neither): query t
    sees key s only where their ids are equal (every step then masked; the steps are the band's).

    `sinks`: None, or [N] float32 logits joined as one more logit of every row after the key loop,
    as the Triton plain forward joins them: a -inf sink gives the call without it bit for bit,
    a NaN or +inf one makes the head's rows NaN.

    `run`: None, or an int32 [1] array: where it holds 0 every CTA returns after one load and
    the results are left unwritten (the launch that does not apply, beside another kernel that
    writes them: `jax_flash.pallas._route`)."""
    b, t, n, h = q.shape
    s, kv_heads, hv = k.shape[1], k.shape[2], v.shape[3]
    tiles = tiles or default_tiles(h, hv)
    why = unsupported(q.shape, k.shape, v.shape, q.dtype, causal=causal, window=window, soft_cap=soft_cap)
    if why is not None:
        raise ValueError(f"the Mosaic GPU forward does not serve {why}")
    block_q, block_kv = tiles.block_q, tiles.block_kv
    # Ragged T and S: padded with zeros to whole tiles (the rows past T are computed and dropped,
    # the keys past S masked in the last key step).
    t_pad, key_steps = -(-t // tiles.rows) * tiles.rows, -(-s // block_kv)
    ragged_keys = s % block_kv != 0 or kv_lengths is not None  # a key step may be cut short
    static, bounds = Bounds.of(causal, window, t, s, (t_pad, key_steps * block_kv), q_offset, q_lengths, kv_lengths)
    if t_pad != t:
        q = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
    if ragged_keys:
        k, v = (jnp.pad(x, ((0, 0), (0, key_steps * block_kv - s), (0, 0), (0, 0))) for x in (k, v))
    segments = q_segment_ids is not None
    steps = None
    if segments:  # padded as q, k and v (the padded rows dropped, the padded keys masked)
        q_segment_ids = jnp.pad(jnp.asarray(q_segment_ids, jnp.int32), ((0, 0), (0, t_pad - t)))
        kv_segment_ids = jnp.pad(jnp.asarray(kv_segment_ids, jnp.int32), ((0, 0), (0, key_steps * block_kv - s)))
        steps = segment_steps(q_segment_ids, kv_segment_ids, tiles.rows, block_kv, t, s)
    stages = min(tiles.stages, key_steps)
    group = n // kv_heads
    dtype = q.dtype
    # The exponent's factor: the scale folded in (raw scores), or log2 e alone (capped logits).
    exp2_factor = float(np.float32((1.0 if soft_cap is not None else scale) * LOG2E))

    slot_of = functools.partial(ring_slot, stages=stages)

    def body(q_ref, k_ref, v_ref, sinks_ref, bounds_ref, ids_refs, run_ref, out_ref, lse_ref, smem, barriers):
        qo_smem, k_smem, v_smem, lse_smem, o_smem, *ids_smem = smem  # segment ids: the rows', the ring's
        q_ready, k_ready, v_ready, k_free, v_free, schedule, *ids_ready = barriers
        batch, head, q_tile = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_tile")
        wg = lax.axis_index("wg")
        # The batch row's band and lengths; the key steps the CTA's rows see (the union of its
        # consumers'; loop bounds are int32 throughout, under jax_enable_x64 too).
        lo, hi, q_valid, kv_valid = static.read(bounds_ref, batch)
        row_limit = None if q_lengths is None else q_valid
        cta_first, _, _, cta_last = visible_steps(
            lo, hi, kv_valid, q_tile * tiles.rows, tiles.rows, block_kv, row_limit
        )
        if segments:  # and of them those whose key ids can meet the CTA's rows'
            cta_first, cta_last = narrowed(cta_first, cta_last, ids_refs[2], batch, q_tile)

        def take_turn():
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

        runs = True if run_ref is None else run_ref[0] != 0

        @pl.when((wg < CONSUMERS) & runs)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            q_smem, lse_rows = qo_smem.at[wg], lse_smem.at[wg]
            t0 = q_tile * tiles.rows + wg * block_q
            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(t0, block_q), head], q_smem, q_ready.at[wg])
            if segments:
                rows_ids = ids_smem[0].at[wg]
                plgpu.copy_gmem_to_smem(ids_refs[0].at[batch, pl.ds(t0, block_q)], rows_ids, ids_ready[0].at[wg])
                plgpu.barrier_wait(ids_ready[0].at[wg])
                q_ids = segment_ids(rows_ids, of_rows=True)
            plgpu.barrier_wait(q_ready.at[wg])
            # The steps this warpgroup's rows see, and of them those whose every key each row sees
            # (inside the band, short of a ragged key tail); the others are masked.
            first, full_lo, full_hi, last = visible_steps(lo, hi, kv_valid, t0, block_q, block_kv, row_limit)

            rows = plgpu.Layout.WGMMA.reduce(1)
            m = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), rows)
            l = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), rows)
            o = plgpu.layout_cast(jnp.full((block_q, hv), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            pl.when(wg == 1)(take_turn)  # the second consumer starts half a step behind

            def step(i, carry, masked: bool):
                o, m, l = carry
                slot = slot_of(i)
                plgpu.barrier_wait(k_ready.at[slot])

                def scores(acc):
                    plgpu.wgmma(acc, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    take_turn()
                    return acc[...]

                x = pl.run_scoped(scores, plgpu.ACC((block_q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if soft_cap is not None:
                    x = soft_capped(x, scale, soft_cap)
                if masked:  # the band's edges, the keys past S (or the batch row's length)
                    x = mask_band(x, lo, hi, t0, i * block_kv, kv_valid)
                if segments:  # every step: a row sees the keys of its segment
                    plgpu.barrier_wait(ids_ready[1].at[slot])
                    x = mask_segments(x, q_ids, segment_ids(ids_smem[1].at[slot], of_rows=False))
                m_new = jnp.maximum(m, x.max(axis=1))
                # A masked step may hold no key of a row that has seen none yet (the band's left
                # edge, or a row past the band's end): its max stays -inf and is shifted by 0
                # (p = 0; alpha = 0 on l = 0 and O = 0). Per row, in masked steps only.
                shift = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked or segments else m_new
                alpha = jnp.exp2((m - shift) * exp2_factor)
                p = jnp.exp2((x - lax.broadcast_in_dim(shift, x.shape, [0])) * exp2_factor)
                l = l * alpha + p.sum(axis=1)
                o = o * lax.broadcast_in_dim(alpha, o.shape, [0])
                plgpu.barrier_arrive(schedule)  # this softmax is done
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(schedule)  # the other consumer's wgmma is done

                def values(acc):
                    plgpu.wgmma(acc, p.astype(dtype), v_smem.at[slot])

                o = pl.run_state(values)(plgpu.ACC.init(o))
                plgpu.barrier_arrive(v_free.at[slot])
                return o, m_new, l

            def skip(start, stop):
                """The CTA's steps this consumer's rows do not see: their copies observed (each
                barrier's phases are waited for in order), its share freed, its turns taken."""

                @pl.loop(start, stop)
                def _(i):
                    slot = slot_of(i)
                    plgpu.barrier_wait(k_ready.at[slot])
                    if segments:
                        plgpu.barrier_wait(ids_ready[1].at[slot])
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.barrier_arrive(k_free.at[slot])
                    plgpu.barrier_arrive(v_free.at[slot])
                    take_turn()
                    take_turn()

            bounds = (cta_first, first, full_lo, full_hi, last, cta_last)
            cut = q_lengths is not None or segments  # the CTA's steps may be fewer than the rows'
            o, m, l = over_band(step, skip, (o, m, l), bounds, lo, hi, ragged_keys, cut)
            pl.when(wg == 0)(take_turn)
            if q_lengths is not None:  # the rows past the batch row's query length see no key
                row = plgpu.broadcasted_iota(jnp.int32, o.shape, 0, layout=plgpu.Layout.WGMMA) + t0
                exists = jnp.where(row < q_valid, 1.0, 0.0).max(axis=1)
                o, l = o * lax.broadcast_in_dim(exists, o.shape, [0]), l * exists
                m = jnp.where(exists > 0.0, m, -jnp.inf)
            top = m if soft_cap is not None else m * scale  # the rows' largest logit
            if sinks_ref is not None:  # one more logit of every row (-inf: none)
                sink = sinks_ref[head]
                new_top = jnp.maximum(top, sink)
                shift = jnp.where(new_top == -jnp.inf, 0.0, new_top)
                f = jnp.exp2((top - shift) * LOG2E)
                l = l * f + jnp.exp2((sink - shift) * LOG2E)
                o = o * lax.broadcast_in_dim(f, o.shape, [0])
                top = new_top
            # A row that sees no key (a window past the keys' end, T > S) has l = 0 and O = 0:
            # out 0 and lse -inf (the sink's logit with a sink), not 0/0.
            o = o / lax.broadcast_in_dim(jnp.where(l == 0.0, 1.0, l), o.shape, [0])
            o_rows = q_smem if o_smem is None else o_smem.at[wg]  # O is staged where Q was (Hv = H)
            o_rows[...] = o.astype(dtype)
            lse_rows[...] = top + jnp.log(l)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_rows, out_ref.at[batch, pl.ds(t0, block_q), head])
            plgpu.copy_smem_to_gmem(lse_rows, lse_ref.at[batch, head, pl.ds(t0, block_q)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when((wg == CONSUMERS) & runs)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(head, jnp.int32(group))

            def fetch(i, slot):
                at = (batch, pl.ds(i * block_kv, block_kv), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[at], k_smem.at[slot], k_ready.at[slot])
                if segments:  # read before the step's v_free, as V
                    ids = ids_refs[1].at[batch, pl.ds(i * block_kv, block_kv)]
                    plgpu.copy_gmem_to_smem(ids, ids_smem[1].at[slot], ids_ready[1].at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[at], v_smem.at[slot], v_ready.at[slot])

            def wait_free(slot):
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

            produce(cta_first, cta_last, stages, fetch, wait_free)

    def entry(q_ref, k_ref, v_ref, *refs):
        rest = list(refs)
        sinks_ref = None if sinks is None else rest.pop(0)
        bounds_ref = None if bounds is None else rest.pop(0)
        ids_refs = (rest.pop(0), rest.pop(0), rest.pop(0)) if segments else None  # rows', keys', steps
        run_ref = None if run is None else rest.pop(0)
        out_ref, lse_ref = rest
        layout = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem: tuple = (
            plgpu.SMEM((CONSUMERS, block_q, h), dtype, transforms=layout),  # Q, then O where Hv = H
            plgpu.SMEM((stages, block_kv, h), dtype, transforms=layout),
            plgpu.SMEM((stages, block_kv, hv), dtype, transforms=layout),
            plgpu.SMEM((CONSUMERS, block_q), jnp.float32),
            None if hv == h else plgpu.SMEM((CONSUMERS, block_q, hv), dtype, transforms=layout),  # O
        )
        if segments:  # the rows' ids, the ring's key ids
            smem += (plgpu.SMEM((CONSUMERS, block_q), jnp.int32), plgpu.SMEM((stages, block_kv), jnp.int32))
        barriers: tuple = (
            plgpu.Barrier(num_barriers=CONSUMERS),  # q_ready
            plgpu.Barrier(num_barriers=stages),  # k_ready
            plgpu.Barrier(num_barriers=stages),  # v_ready
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # k_free
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # v_free
            plgpu.Barrier(num_arrivals=CONSUMERS),  # schedule
        )
        if segments:  # the rows' ids, each slot's key ids
            barriers += (plgpu.Barrier(num_barriers=CONSUMERS), plgpu.Barrier(num_barriers=stages))
        pl.run_scoped(
            lambda smem, barriers: body(
                q_ref, k_ref, v_ref, sinks_ref, bounds_ref, ids_refs, run_ref, out_ref, lse_ref, smem, barriers
            ),
            smem,
            barriers,
            collective_axes="wg",
        )

    out, lse = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((b, t_pad, n, hv), dtype), jax.ShapeDtypeStruct((b, n, t_pad), jnp.float32)),
        grid=(n, t_pad // tiles.rows, b),
        grid_names=("heads", "q_tile", "batch"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(q, k, v, *(x for x in (sinks, bounds, q_segment_ids, kv_segment_ids, steps, run) if x is not None))
    return (out, lse) if t_pad == t else (out[:, :t], lse[:, :, :t])
