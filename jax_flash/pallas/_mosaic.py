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
kernels), no soft cap, bias, mask, lengths or segments, causal (T = S) or not; attention sinks
joined after the key loop as the Triton plain forward joins them.
Ragged T and S are padded with zeros to whole tiles here (the rows past T are computed and
dropped, the keys past S masked in the last key step, which is peeled off the loop like the
causal diagonal); `unsupported` says why a call falls outside. `jax_flash.pallas._backend`
routes the calls it serves here (`Config.pallas_backend`); tests/internals/test_pallas_mosaic.py
holds its lowering and its interpretation, build/mosaic_check.py its run on a GPU.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

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


def default_tiles(head_dim: int) -> ForwardTiles:
    """FlashAttention-3's forward tiles for sm_90 by head dim (its 228 KB of shared memory):
    128 x 128 at H <= 128 (two 64-row consumers), 128 x 64 at H = 256."""
    return ForwardTiles(block_kv=64 if head_dim > 128 else 128, stages=2)


def unsupported(shape_q, shape_k, shape_v, dtype, *, causal: bool) -> str | None:
    """Why the Mosaic GPU forward cannot serve these shapes, or None."""
    _, t, n, h = shape_q
    _, s, kh, hk = shape_k
    hv = shape_v[-1]
    if jnp.dtype(dtype).name not in DTYPES:
        return f"dtype {jnp.dtype(dtype).name} (it serves {', '.join(DTYPES)})"
    if h not in HEAD_DIMS or hk != h:
        return f"head dim {h} (it serves {HEAD_DIMS})"
    if hv != h:
        return f"a value head dim {hv} != {h}"
    if n % kh:
        return f"{n} query heads over {kh} kv heads"
    if t == 0 or s == 0:
        return "an empty sequence"
    if causal and t != s:
        return "a causal call with T != S"
    return None


def forward(
    q,
    k,
    v,
    *,
    scale: float,
    causal: bool = False,
    tiles: ForwardTiles | None = None,
    sinks=None,
    run=None,
    interpret=None,
):
    """(out [B, T, N, H], lse [B, N, T] f32, natural log) of the plain attention of canonical
    q [B, T, N, H], k, v [B, S, K, H]; see the module docstring for what it serves.

    `sinks`: None, or [N] float32 logits joined as one more logit of every row after the key loop,
    as the Triton plain forward joins them: a -inf sink gives the call without it bit for bit,
    a NaN or +inf one makes the head's rows NaN.

    `run`: None, or an int32 [1] array: where it holds 0 every CTA returns after one load and
    the results are left unwritten (the launch that does not apply, beside another kernel that
    writes them: `jax_flash.pallas._route`)."""
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    tiles = tiles or default_tiles(h)
    why = unsupported(q.shape, k.shape, v.shape, q.dtype, causal=causal)
    if why is not None:
        raise ValueError(f"the Mosaic GPU forward does not serve {why}")
    block_q, block_kv = tiles.block_q, tiles.block_kv
    # Ragged T and S: padded with zeros to whole tiles (the rows past T are computed and dropped,
    # the keys past S masked in the last key step).
    t_pad, key_steps = -(-t // tiles.rows) * tiles.rows, -(-s // block_kv)
    ragged_keys = s % block_kv != 0
    if t_pad != t:
        q = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
    if ragged_keys:
        k, v = (jnp.pad(x, ((0, 0), (0, key_steps * block_kv - s), (0, 0), (0, 0))) for x in (k, v))
    stages = min(tiles.stages, key_steps)
    group = n // kv_heads
    dtype = q.dtype
    exp2_factor = float(np.float32(scale * LOG2E))

    def slot_of(i):
        """The ring slot of key step i."""
        return lax.rem(i, jnp.asarray(stages, i.dtype))

    def body(q_ref, k_ref, v_ref, sinks_ref, run_ref, out_ref, lse_ref, smem, barriers):
        qo_smem, k_smem, v_smem, lse_smem = smem
        q_ready, k_ready, v_ready, k_free, v_free, schedule = barriers
        batch, head, q_tile = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_tile")
        wg = lax.axis_index("wg")
        # The key steps the CTA's rows see: all of them, or (causal) up to its last row's diagonal.
        # (Loop bounds are int32 throughout, under jax_enable_x64 too.)
        all_steps = jnp.int32(key_steps)
        cta_steps = all_steps
        if causal:
            cta_steps = jnp.minimum(pl.cdiv((q_tile + 1) * tiles.rows, jnp.int32(block_kv)), all_steps)

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
            plgpu.barrier_wait(q_ready.at[wg])
            # The steps this warpgroup's rows see, and of them the first ones, whose every key each
            # row sees (before the diagonal, short of a ragged key tail); the others are masked.
            steps, full_steps = all_steps, all_steps - (1 if ragged_keys else 0)
            if causal:
                steps = jnp.minimum(pl.cdiv(t0 + block_q, jnp.int32(block_kv)), all_steps)
                full_steps = jnp.minimum(lax.div(t0, jnp.int32(block_kv)), jnp.int32(s // block_kv))

            rows = plgpu.Layout.WGMMA.reduce(1)
            m = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), rows)
            l = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), rows)
            o = plgpu.layout_cast(jnp.full((block_q, h), 0.0, jnp.float32), plgpu.Layout.WGMMA)
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
                if masked:  # the diagonal (key j visible from row r iff j <= r) and the keys past S
                    row = plgpu.broadcasted_iota(jnp.int32, x.shape, 0, layout=plgpu.Layout.WGMMA) + t0
                    col = plgpu.broadcasted_iota(jnp.int32, x.shape, 1, layout=plgpu.Layout.WGMMA) + i * block_kv
                    visible = col < s
                    if causal:
                        visible = visible & (col <= row)
                    x = jnp.where(visible, x, -jnp.inf)
                m_new = jnp.maximum(m, x.max(axis=1))
                alpha = jnp.exp2((m - m_new) * exp2_factor)
                p = jnp.exp2((x - lax.broadcast_in_dim(m_new, x.shape, [0])) * exp2_factor)
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

            carry = lax.fori_loop(jnp.int32(0), full_steps, lambda i, c: step(i, c, False), (o, m, l))
            if causal or ragged_keys:
                carry = lax.fori_loop(full_steps, steps, lambda i, c: step(i, c, True), carry)
            if causal:
                # The CTA's other consumer may see more steps: observe their copies and free this
                # one's share of them.
                @pl.loop(steps, cta_steps)
                def _(i):
                    slot = slot_of(i)
                    plgpu.barrier_wait(k_ready.at[slot])
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.barrier_arrive(k_free.at[slot])
                    plgpu.barrier_arrive(v_free.at[slot])
                    take_turn()
                    take_turn()

            o, m, l = carry
            pl.when(wg == 0)(take_turn)
            top = m * scale  # the rows' largest logit
            if sinks_ref is not None:  # one more logit of every row (-inf: none)
                sink = sinks_ref[head]
                new_top = jnp.maximum(top, sink)
                shift = jnp.where(new_top == -jnp.inf, 0.0, new_top)
                f = jnp.exp2((top - shift) * LOG2E)
                l = l * f + jnp.exp2((sink - shift) * LOG2E)
                o = o * lax.broadcast_in_dim(f, o.shape, [0])
                top = new_top
            o = o / lax.broadcast_in_dim(l, o.shape, [0])
            q_smem[...] = o.astype(dtype)  # O is staged where Q was
            lse_rows[...] = top + jnp.log(l)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, out_ref.at[batch, pl.ds(t0, block_q), head])
            plgpu.copy_smem_to_gmem(lse_rows, lse_ref.at[batch, head, pl.ds(t0, block_q)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when((wg == CONSUMERS) & runs)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(head, jnp.int32(group))

            def fetch(i, slot):
                at = (batch, pl.ds(i * block_kv, block_kv), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[at], k_smem.at[slot], k_ready.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[at], v_smem.at[slot], v_ready.at[slot])

            for first in range(stages):  # the ring's first fill

                @pl.when(first < cta_steps)
                def _(first=first):
                    fetch(first, first)

            def wait_free(slot):
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

            @pl.loop(jnp.int32(stages), cta_steps)
            def _(i):
                slot = slot_of(i)
                wait_free(slot)
                fetch(i, slot)

            # The last steps' releases: every phase of a barrier is observed before it goes.
            @pl.loop(jnp.maximum(cta_steps - stages, 0), cta_steps)
            def _(i):
                wait_free(slot_of(i))

    def entry(q_ref, k_ref, v_ref, *refs):
        rest = list(refs)
        sinks_ref = None if sinks is None else rest.pop(0)
        run_ref = None if run is None else rest.pop(0)
        out_ref, lse_ref = rest
        layout = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = (
            plgpu.SMEM((CONSUMERS, block_q, h), dtype, transforms=layout),  # Q, then O
            plgpu.SMEM((stages, block_kv, h), dtype, transforms=layout),
            plgpu.SMEM((stages, block_kv, h), dtype, transforms=layout),
            plgpu.SMEM((CONSUMERS, block_q), jnp.float32),
        )
        barriers = (
            plgpu.Barrier(num_barriers=CONSUMERS),  # q_ready
            plgpu.Barrier(num_barriers=stages),  # k_ready
            plgpu.Barrier(num_barriers=stages),  # v_ready
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # k_free
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # v_free
            plgpu.Barrier(num_arrivals=CONSUMERS),  # schedule
        )
        pl.run_scoped(
            lambda smem, barriers: body(q_ref, k_ref, v_ref, sinks_ref, run_ref, out_ref, lse_ref, smem, barriers),
            smem,
            barriers,
            collective_axes="wg",
        )

    out, lse = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, n, t_pad), jnp.float32)),
        grid=(n, t_pad // tiles.rows, b),
        grid_names=("heads", "q_tile", "batch"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(q, k, v, *(x for x in (sinks, run) if x is not None))
    return (out, lse) if t_pad == t else (out[:, :t], lse[:, :, :t])
