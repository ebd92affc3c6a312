"""The pallas backward on Mosaic GPU (sm_90a): two warp-specialised kernels in the forward's
schedule (`_mosaic`), each a TMA producer warpgroup feeding a ring and two consumer warpgroups
of 64 rows on wgmma, recomputing the probabilities from the forward's log-sum-exp:

    dQ kernel, per 64 query rows (K, V streamed):         dK/dV kernel, per 64 keys (Q, dO streamed,
                                                           every query head of the kv head's group):
    S   = Q Kᵀ                                             Sᵀ  = K Qᵀ
    P   = exp2(S·c − lse₂)                                 Pᵀ  = exp2(Sᵀ·c − lse₂)
    dP  = dO Vᵀ                                            dV += Pᵀ dO
    dS  = P ∘ (dP − δ)                                     dPᵀ = V dOᵀ
    dQ += dS K                                             dSᵀ = Pᵀ ∘ (dPᵀ − δ)
    dQ ·= scale at the end                                 dK += dSᵀ Q;  dK ·= scale at the end

with c = scale·log2 e, lse₂ = lse·log2 e and δ = rowsum(dO ∘ O) − dlse per query row (the lse
output's cotangent enters as dS = P ∘ (dP − rowsum(dO ∘ O) + dlse)), computed once by XLA
before the kernels. No atomics: dQ is its own pass, and a dK/dV CTA loops over the query heads of
its kv head's group (GQA without per-head copies). A causal mask or a sliding window (the band of
`_mosaic.band`, moved per batch row by a query offset, cut by lengths: `_mosaic.Bounds`) skips the
steps outside it: the dQ kernel's key steps as the forward's, the dK/dV kernel's query steps seen
from the keys (the band (-hi, -lo)); the steps on its edges are masked, peeled off the loops.
Ragged T and S are padded to whole tiles: padded query rows, and rows that see no key or lie past
their query length, get lse₂ = +inf (P = 0); padded keys are masked in the dQ kernel's last step
and their dK, dV rows dropped; keys past a key length are masked there and get dK, dV 0.

The plain kernel only, as the forward (finite inputs; sinks need nothing here: P = exp(x - lse)
holds the sink's share, and dsinks is one XLA reduction in `jax_flash._vjp`): `unsupported` says why a call
falls outside. tests/internals/test_pallas_mosaic.py holds its lowering and its interpretation
against float64 gradients.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_flash.pallas._mosaic import (
    CONSUMERS,
    LOG2E,
    Bounds,
    mask_band,
    mask_segments,
    narrowed,
    over_band,
    produce,
    ring_slot,
    segment_ids,
    segment_steps,
    soft_capped,
    unsupported as forward_unsupported,
    visible_steps,
)

HEAD_DIMS = (64, 128)  # H = 256 needs smaller tiles than the ones below (shared memory)
ROWS = 64  # rows of one consumer warpgroup: one wgmma M


@dataclasses.dataclass(frozen=True)
class BackwardTiles:
    """The streamed tile (keys per dQ step, queries per dK/dV step) and the ring's slots."""

    block: int = 64
    stages: int = 2


def unsupported(shape_q, shape_k, shape_v, dtype, *, causal: bool, window=(None, None), soft_cap=None) -> str | None:
    """Why the Mosaic GPU backward cannot serve these shapes, or None."""
    why = forward_unsupported(shape_q, shape_k, shape_v, dtype, causal=causal, window=window, soft_cap=soft_cap)
    if why is None and shape_q[-1] not in HEAD_DIMS:
        return f"head dim {shape_q[-1]} in the backward (it serves {HEAD_DIMS})"
    if why is None and shape_v[-1] not in HEAD_DIMS:
        return f"a value head dim {shape_v[-1]} in the backward (it serves {HEAD_DIMS})"
    return why


def _layout():
    return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _zeros(shape):
    return plgpu.layout_cast(jnp.full(shape, 0.0, jnp.float32), plgpu.Layout.WGMMA)


def _product(a, b, shape):
    """a @ b on the tensor cores (wgmma) into a fresh float32 accumulator."""

    def run(acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _accumulate(acc, a, b):
    """acc + a @ b (wgmma into the registers holding acc)."""

    def run(ref):
        plgpu.wgmma(ref, a, b)

    return pl.run_state(run)(plgpu.ACC.init(acc))


def backward(
    q,
    k,
    v,
    out,
    lse,
    dout,
    dlse=None,
    *,
    scale: float,
    causal: bool = False,
    window: tuple[int | None, int | None] = (None, None),
    soft_cap: float | None = None,
    q_offset=None,
    q_lengths=None,
    kv_lengths=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    tiles=None,
    run=None,
    interpret=None,
):
    """(dq, dk, dv) of the plain attention of canonical q [B, T, N, H], k, v [B, S, K, H] given the
    forward's out and lse [B, N, T] (natural log) and the cotangents dout (and dlse).
    `soft_cap`: as the forward's (dS then carries the cap's slope 1 - tanh², recomputed).
    `q_offset`, `q_lengths`, `kv_lengths`: as the forward's (the rows past a query length get
    dq 0 and send nothing; the keys past a key length get dk, dv 0). `q_segment_ids`,
    `kv_segment_ids`: as the forward's (the ids of each kernel's own rows copied once, the
    streamed tile's through the ring).

    `run`: None, or an int32 [1] array: where it holds 0 every CTA of both kernels returns after
    one load and the results are left unwritten (as the forward's `run`)."""
    b, t, n, h = q.shape
    s, kv_heads, hv = k.shape[1], k.shape[2], v.shape[3]
    tiles = tiles or BackwardTiles()
    why = unsupported(q.shape, k.shape, v.shape, q.dtype, causal=causal, window=window, soft_cap=soft_cap)
    if why is not None:
        raise ValueError(f"the Mosaic GPU backward does not serve {why}")
    dtype, group, block = q.dtype, n // kv_heads, tiles.block
    rows = CONSUMERS * ROWS
    c = float(np.float32((1.0 if soft_cap is not None else scale) * LOG2E))  # raw scores or capped logits

    def logits(x, mask):
        """(the exponent's operand, the cap's slope or None) of raw scores x: x itself, or the
        capped logits y and 1 - (y/cap)², taken before the mask (a masked y is -inf)."""
        slope = None
        if soft_cap is not None:
            x = soft_capped(x, scale, soft_cap)
            slope = 1.0 - (x * (1.0 / soft_cap)) ** 2
        return mask(x), slope

    # δ and lse₂ per query row, [B, N, 2, T_pad]: one TMA copy per dK/dV step. Padded rows: P = 0.
    delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), dout.astype(jnp.float32))
    if dlse is not None:
        delta = delta - dlse
    t_pad = -(-t // rows) * rows
    s_pad = -(-s // rows) * rows
    static, bounds = Bounds.of(causal, window, t, s, (t_pad, s_pad), q_offset, q_lengths, kv_lengths)
    pad_t = lambda x, value=0.0: jnp.pad(x, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)), constant_values=value)
    pad_s = lambda x: jnp.pad(x, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
    # A row that saw no key (lse = -inf), or past its batch row's query length (lse -inf, or a
    # sink's), gets P = 0 like a padded one (lse₂ = +inf), not exp2(-inf + inf).
    no_key = lse == -jnp.inf
    if q_lengths is not None:
        no_key = no_key | (jnp.arange(t)[None, None, :] >= jnp.asarray(q_lengths)[:, None, None])
    stats = jnp.stack([jnp.where(no_key, jnp.inf, lse) * LOG2E, delta], axis=2)
    stats = jnp.pad(stats, ((0, 0), (0, 0), (0, 0), (0, t_pad - t)))
    stats = stats.at[:, :, 0, t:].set(jnp.inf)
    qp, dop, kp, vp = pad_t(q), pad_t(dout), pad_s(k), pad_s(v)
    ragged_keys = s % block != 0 or kv_lengths is not None  # a key step may be cut short
    segments = q_segment_ids is not None
    if segments:  # padded as q and k (the padded rows and keys see nothing: lse₂ = +inf, masked)
        q_segment_ids = jnp.pad(jnp.asarray(q_segment_ids, jnp.int32), ((0, 0), (0, t_pad - t)))
        kv_segment_ids = jnp.pad(jnp.asarray(kv_segment_ids, jnp.int32), ((0, 0), (0, s_pad - s)))
    # The steps each kernel's tiles need under segment ids (`segment_steps`): the dQ kernel's
    # query tiles over key steps, the dK/dV kernel's key tiles over query steps.
    q_steps = segment_steps(q_segment_ids, kv_segment_ids, rows, block, t, s) if segments else None
    kv_steps = segment_steps(kv_segment_ids, q_segment_ids, rows, block, s, t) if segments else None
    stages = tiles.stages
    slot_of = functools.partial(ring_slot, stages=stages)

    def dq_kernel(q_ref, k_ref, v_ref, do_ref, stats_ref, bounds_ref, ids_refs, run_ref, dq_ref, smem, barriers):
        q_smem, do_smem, stats_smem, k_smem, v_smem, *ids_smem = smem  # segment ids: the rows', the ring's
        rows_ready, k_ready, v_ready, free, *ids_ready = barriers
        batch, head, tile = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_tile")
        wg = lax.axis_index("wg")
        lo, hi, q_valid, kv_valid = static.read(bounds_ref, batch)
        row_limit = None if q_lengths is None else q_valid
        cta_first, _, _, cta_last = visible_steps(lo, hi, kv_valid, tile * rows, rows, block, row_limit)
        if segments:  # and of them those whose key ids can meet the CTA's rows'
            cta_first, cta_last = narrowed(cta_first, cta_last, ids_refs[2], batch, tile)

        runs = True if run_ref is None else run_ref[0] != 0

        @pl.when((wg < CONSUMERS) & runs)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            t0 = tile * rows + wg * ROWS
            at = (batch, pl.ds(t0, ROWS), head)
            plgpu.copy_gmem_to_smem(q_ref.at[at], q_smem.at[wg], rows_ready.at[wg])
            plgpu.copy_gmem_to_smem(do_ref.at[at], do_smem.at[wg], rows_ready.at[wg + CONSUMERS])
            plgpu.copy_gmem_to_smem(
                stats_ref.at[batch, head, :, pl.ds(t0, ROWS)], stats_smem.at[wg], rows_ready.at[wg + 2 * CONSUMERS]
            )
            if segments:
                ids = ids_refs[0].at[batch, pl.ds(t0, ROWS)]
                plgpu.copy_gmem_to_smem(ids, ids_smem[0].at[wg], ids_ready[0].at[wg])
                plgpu.barrier_wait(ids_ready[0].at[wg])
                q_ids = segment_ids(ids_smem[0].at[wg], of_rows=True)
            for r in range(3):
                plgpu.barrier_wait(rows_ready.at[wg + r * CONSUMERS])
            lse2 = plgpu.load(stats_smem.at[wg, 0], (), layout=plgpu.Layout.WGMMA.reduce(1))
            delta = plgpu.load(stats_smem.at[wg, 1], (), layout=plgpu.Layout.WGMMA.reduce(1))
            first, full_lo, full_hi, last = visible_steps(lo, hi, kv_valid, t0, ROWS, block, row_limit)

            def step(i, dq, masked: bool):
                slot = slot_of(i)
                plgpu.barrier_wait(k_ready.at[slot])
                x = _product(q_smem.at[wg], plgpu.transpose_ref(k_smem.at[slot], (1, 0)), (ROWS, block))

                def mask(x):  # the band's edges, the keys past S (or the batch row's length); segments
                    if masked:
                        x = mask_band(x, lo, hi, t0, i * block, kv_valid)
                    if segments:
                        plgpu.barrier_wait(ids_ready[1].at[slot])
                        x = mask_segments(x, q_ids, segment_ids(ids_smem[1].at[slot], of_rows=False))
                    return x

                x, slope = logits(x, mask)
                p = jnp.exp2(x * c - lax.broadcast_in_dim(lse2, x.shape, [0]))
                plgpu.barrier_wait(v_ready.at[slot])
                dp = _product(do_smem.at[wg], plgpu.transpose_ref(v_smem.at[slot], (1, 0)), (ROWS, block))
                ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))
                if slope is not None:
                    ds = ds * slope
                dq = _accumulate(dq, ds.astype(dtype), k_smem.at[slot])
                plgpu.barrier_arrive(free.at[slot])
                return dq

            def skip(start, stop):
                """The CTA's steps this consumer's rows do not see: their copies observed (each
                barrier's phases are waited for in order), its share freed."""

                @pl.loop(start, stop)
                def _(i):
                    slot = slot_of(i)
                    plgpu.barrier_wait(k_ready.at[slot])
                    if segments:
                        plgpu.barrier_wait(ids_ready[1].at[slot])
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.barrier_arrive(free.at[slot])

            bounds = (cta_first, first, full_lo, full_hi, last, cta_last)
            cut = q_lengths is not None or segments  # the CTA's steps may be fewer than the rows'
            dq = over_band(step, skip, _zeros((ROWS, h)), bounds, lo, hi, ragged_keys, cut)

            q_smem.at[wg][...] = (dq * scale).astype(dtype)  # dQ is staged where Q was
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[at])
            plgpu.wait_smem_to_gmem(0)

        @pl.when((wg == CONSUMERS) & runs)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(head, jnp.int32(group))

            def fetch(i, slot):
                at = (batch, pl.ds(i * block, block), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[at], k_smem.at[slot], k_ready.at[slot])
                if segments:
                    ids = ids_refs[1].at[batch, pl.ds(i * block, block)]
                    plgpu.copy_gmem_to_smem(ids, ids_smem[1].at[slot], ids_ready[1].at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[at], v_smem.at[slot], v_ready.at[slot])

            produce(cta_first, cta_last, stages, fetch, lambda slot: plgpu.barrier_wait(free.at[slot]))

    def dkv_kernel(
        q_ref, k_ref, v_ref, do_ref, stats_ref, bounds_ref, ids_refs, run_ref, dk_ref, dv_ref, smem, barriers
    ):
        k_smem, v_smem, q_smem, do_smem, stats_smem, *ids_smem = smem  # segment ids: the keys', the ring's
        keys_ready, q_ready, do_ready, stats_ready, free, *ids_ready = barriers
        batch, kv_head, tile = lax.axis_index("batch"), lax.axis_index("kv_heads"), lax.axis_index("k_tile")
        wg = lax.axis_index("wg")
        lo, hi, q_valid, kv_valid = static.read(bounds_ref, batch)
        # The query steps of each head that see the CTA's keys (the band seen from the keys: -hi, -lo),
        # and of them those whose every query sees every key; the others are masked. The queries
        # past T or a query length need no mask (lse₂ = +inf: P = 0): the steps end at a whole
        # step past the last query; keys past a key length see none.
        queries = t_pad if q_lengths is None else pl.cdiv(q_valid, block) * block
        first, full_lo, full_hi, last = visible_steps(
            None if hi is None else -hi,
            None if lo is None else -lo,
            queries,
            tile * rows,
            rows,
            block,
            None if kv_lengths is None else kv_valid,
        )
        if segments:  # and of them those whose query ids can meet the CTA's keys'
            first, last = narrowed(first, last, ids_refs[2], batch, tile)
            full_lo, full_hi = jnp.clip(full_lo, first, last), jnp.clip(full_hi, first, last)
        per_head = last - first

        def query_block(i):
            """(query head, first row) of step i."""
            return kv_head * group + lax.div(i, per_head), (first + lax.rem(i, per_head)) * block

        runs = True if run_ref is None else run_ref[0] != 0

        @pl.when((wg < CONSUMERS) & runs)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            k0 = tile * rows + wg * ROWS
            at = (batch, pl.ds(k0, ROWS), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[at], k_smem.at[wg], keys_ready.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[at], v_smem.at[wg], keys_ready.at[wg + CONSUMERS])
            if segments:
                ids = ids_refs[1].at[batch, pl.ds(k0, ROWS)]
                plgpu.copy_gmem_to_smem(ids, ids_smem[0].at[wg], ids_ready[0].at[wg])
                plgpu.barrier_wait(ids_ready[0].at[wg])
                k_ids = segment_ids(ids_smem[0].at[wg], of_rows=True)
            plgpu.barrier_wait(keys_ready.at[wg])
            plgpu.barrier_wait(keys_ready.at[wg + CONSUMERS])

            def step(i, carry, masked: bool):
                dk, dv = carry
                slot = slot_of(i)
                plgpu.barrier_wait(q_ready.at[slot])
                xt = _product(k_smem.at[wg], plgpu.transpose_ref(q_smem.at[slot], (1, 0)), (ROWS, block))
                seen_from_keys = (None if hi is None else -hi, None if lo is None else -lo)

                def mask(x):  # the band's edges, seen from the keys; segments
                    if masked:
                        x = mask_band(x, *seen_from_keys, k0, query_block(i)[1])
                    if segments:
                        plgpu.barrier_wait(ids_ready[1].at[slot])
                        x = mask_segments(x, k_ids, segment_ids(ids_smem[1].at[slot], of_rows=False))
                    return x

                xt, slope = logits(xt, mask)
                plgpu.barrier_wait(stats_ready.at[slot])
                lse2 = plgpu.load(stats_smem.at[slot, 0], (), layout=plgpu.Layout.WGMMA.reduce(0))
                delta = plgpu.load(stats_smem.at[slot, 1], (), layout=plgpu.Layout.WGMMA.reduce(0))
                pt = jnp.exp2(xt * c - lax.broadcast_in_dim(lse2, xt.shape, [1]))
                plgpu.barrier_wait(do_ready.at[slot])
                dv = _accumulate(dv, pt.astype(dtype), do_smem.at[slot])
                dpt = _product(v_smem.at[wg], plgpu.transpose_ref(do_smem.at[slot], (1, 0)), (ROWS, block))
                dst = pt * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1]))
                if slope is not None:
                    dst = dst * slope
                dk = _accumulate(dk, dst.astype(dtype), q_smem.at[slot])
                plgpu.barrier_arrive(free.at[slot])
                return dk, dv

            def head_of_group(g, carry):
                """The steps of the group's g-th query head: [g, g + 1) * per_head."""
                base = g * per_head - first  # step i of this head reads query step i - base
                if hi is not None:  # the keys' left edge (the queries before the band's upper side)
                    carry = lax.fori_loop(base + first, base + full_lo, lambda i, a: step(i, a, True), carry)
                carry = lax.fori_loop(base + full_lo, base + full_hi, lambda i, a: step(i, a, False), carry)
                if lo is not None:  # their right edge
                    carry = lax.fori_loop(base + full_hi, base + last, lambda i, a: step(i, a, True), carry)
                return carry

            dk, dv = lax.fori_loop(
                jnp.int32(0), jnp.int32(group), head_of_group, (_zeros((ROWS, h)), _zeros((ROWS, hv)))
            )
            if kv_lengths is not None:  # the keys past the batch row's key length: dK, dV 0
                key = plgpu.broadcasted_iota(jnp.int32, dk.shape, 0, layout=plgpu.Layout.WGMMA) + k0
                dk, dv = (jnp.where(key < kv_valid, x, 0.0) for x in (dk, dv))
            k_smem.at[wg][...] = (dk * scale).astype(dtype)  # dK and dV are staged where K and V were
            v_smem.at[wg][...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[at])
            plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[at])
            plgpu.wait_smem_to_gmem(0)

        @pl.when((wg == CONSUMERS) & runs)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")

            def fetch(i, slot):
                head, j0 = query_block(i)
                at = (batch, pl.ds(j0, block), head)
                plgpu.copy_gmem_to_smem(q_ref.at[at], q_smem.at[slot], q_ready.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[at], do_smem.at[slot], do_ready.at[slot])
                plgpu.copy_gmem_to_smem(
                    stats_ref.at[batch, head, :, pl.ds(j0, block)], stats_smem.at[slot], stats_ready.at[slot]
                )
                if segments:
                    ids = ids_refs[0].at[batch, pl.ds(j0, block)]
                    plgpu.copy_gmem_to_smem(ids, ids_smem[1].at[slot], ids_ready[1].at[slot])

            produce(jnp.int32(0), per_head * group, stages, fetch, lambda slot: plgpu.barrier_wait(free.at[slot]))

    def launch(kernel, grid, grid_names, smem, barriers, out_type, steps, *args):
        if segments:  # each kernel's own rows' ids, the streamed tile's ids
            smem += (plgpu.SMEM((CONSUMERS, ROWS), jnp.int32), plgpu.SMEM((stages, block), jnp.int32))
            barriers += (plgpu.Barrier(num_barriers=CONSUMERS), plgpu.Barrier(num_barriers=stages))

        def entry(*refs):
            # The kernel's bounds_ref, ids_refs and run_ref are None where the call has no such operand.
            rest = list(refs[5:])
            bounds_ref = None if bounds is None else rest.pop(0)
            ids_refs = (rest.pop(0), rest.pop(0), rest.pop(0)) if segments else None  # q's, kv's, steps
            run_ref = None if run is None else rest.pop(0)
            operands = (*refs[:5], bounds_ref, ids_refs, run_ref, *rest)
            pl.run_scoped(
                lambda smem, barriers: kernel(*operands, smem, barriers), smem, barriers, collective_axes="wg"
            )

        return plgpu.kernel(
            entry,
            out_type=out_type,
            grid=grid,
            grid_names=grid_names,
            num_threads=CONSUMERS + 1,
            thread_name="wg",
            compiler_params=plgpu.CompilerParams(approx_math=True),
            interpret=interpret,
        )(*args, *(x for x in (bounds, q_segment_ids, kv_segment_ids, steps, run) if x is not None))

    per_wg = lambda width=h: plgpu.SMEM((CONSUMERS, ROWS, width), dtype, transforms=_layout())
    ring = lambda width=h: plgpu.SMEM((stages, block, width), dtype, transforms=_layout())
    dq = launch(
        dq_kernel,
        (n, t_pad // rows, b),
        ("heads", "q_tile", "batch"),
        (per_wg(), per_wg(hv), plgpu.SMEM((CONSUMERS, 2, ROWS), jnp.float32), ring(), ring(hv)),  # Q, dO; K, V
        (
            plgpu.Barrier(num_barriers=3 * CONSUMERS),  # Q, dO, (lse₂, δ) of each consumer
            plgpu.Barrier(num_barriers=stages),  # k_ready
            plgpu.Barrier(num_barriers=stages),  # v_ready
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # free
        ),
        jax.ShapeDtypeStruct(qp.shape, dtype),
        q_steps,
        qp,
        kp,
        vp,
        dop,
        stats,
    )
    dk, dv = launch(
        dkv_kernel,
        (kv_heads, s_pad // rows, b),
        ("kv_heads", "k_tile", "batch"),
        (per_wg(), per_wg(hv), ring(), ring(hv), plgpu.SMEM((stages, 2, block), jnp.float32)),  # K, V; Q, dO
        (
            plgpu.Barrier(num_barriers=2 * CONSUMERS),  # K, V of each consumer
            plgpu.Barrier(num_barriers=stages),  # q_ready
            plgpu.Barrier(num_barriers=stages),  # do_ready
            plgpu.Barrier(num_barriers=stages),  # stats_ready
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # free
        ),
        (jax.ShapeDtypeStruct(kp.shape, dtype), jax.ShapeDtypeStruct(vp.shape, dtype)),
        kv_steps,
        qp,
        kp,
        vp,
        dop,
        stats,
    )
    return dq[:, :t], dk[:, :s], dv[:, :s]
