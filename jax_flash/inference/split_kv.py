"""Split-KV decoding (flash-decoding): few queries against many keys, in parallel over S.

A decode step has T from 1 to a few dozen queries and a cache of up to ~100k keys: one
query block, so the blockwise forward walks the keys one block after another with most of
a GPU idle. Split-KV cuts S into C chunks, computes each chunk's partial (out, lse) as an
independent row of one batched forward (the chunks are folded into the batch axis: chunk c
of batch row b is row b·C + c), then merges the C partials by lse (`_merge.merge_partials`,
the same merge ring attention uses): exact, and deterministic (a fixed split and a fixed
merge order, no atomics).

Every mask keeps its meaning in a chunk: key positions move by the chunk's start c·Sc, so
key lengths become clip(L - c·Sc, 0, Sc), the causal/window offset o becomes o - c·Sc and
dense bias/mask and key segment ids are cut like K/V; query-side inputs repeat per chunk.
Sinks are one more partial of the merge (out 0, lse = sink), so no chunk counts them twice.

The rule (`num_splits`, `_heuristics.xla_splits`) is static, from the spec and the platform,
and `explain` states it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from jax_flash import _heuristics
from jax_flash._merge import merge_partials
from jax_flash._numerics import acc_dtype, pad_axis, round_up
from jax_flash._spec import AttentionSpec, MaskInputs

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def rule() -> str:
    """The rule in words (for `explain`)."""
    return _heuristics.xla_split_kv_rule()


def num_splits(spec: AttentionSpec, platform: str) -> int:
    """C >= 1 key chunks for the xla forward of `spec` on `platform` ('cpu', 'gpu', ...)."""
    return _heuristics.xla_splits(spec, platform)


def max_splits(spec: AttentionSpec, wanted: int) -> int:
    """`wanted` clipped to what `spec` allows (`_heuristics.xla_max_splits`)."""
    return _heuristics.xla_max_splits(spec, wanted)


def forward(inner: Callable, spec: AttentionSpec, q, k, v, masks: MaskInputs, splits: int):
    """The forward `inner` of `spec` over `splits` key chunks, merged by lse: out [B, T, N, Hv]
    (dtype of q), lse [B, N, T]. splits = 1 is `inner` itself.

    inner(spec, q, k, v, masks, out_dtype=None) -> (out, lse): a blockwise forward of
    canonical inputs (`jax_flash.xla.forward`); each chunk is a batch row of one call of it,
    its out kept in the accumulator dtype for the merge."""
    if splits <= 1:
        return inner(spec, q, k, v, masks)
    b, c = spec.batch, splits
    s = spec.kv_len
    sc = round_up(-(-s // c), 8)  # keys per chunk
    s_pad = c * sc

    def per_chunk(x):  # [B, ...] -> [B·C, ...]: the same for every chunk of a batch row
        return jnp.broadcast_to(x[:, None], (b, c, *x.shape[1:])).reshape(b * c, *x.shape[1:])

    def cut(x, axis, value=0):  # [B|1, ..., S (axis), ...] -> [B·C, ..., Sc, ...]
        x = pad_axis(x, axis, s_pad, value)
        x = x.reshape(*x.shape[:axis], c, sc, *x.shape[axis + 1 :])
        x = jnp.moveaxis(x, axis, 1)  # [B|1, C, ...]
        x = jnp.broadcast_to(x, (b, *x.shape[1:]))
        return x.reshape(b * c, *x.shape[2:])

    def dense(x, value):  # bias / mask [B|1, N|1, T|1, S|1]
        if x is None:
            return None
        if x.shape[3] != 1:
            return cut(x, 3, value)
        return x if x.shape[0] == 1 else per_chunk(x)

    starts = jnp.arange(c, dtype=jnp.int32) * sc  # key position of each chunk's first key
    lengths = jnp.full((b,), s, jnp.int32) if masks.kv_lengths is None else jnp.clip(masks.kv_lengths, 0, s)
    kv_lengths = jnp.clip(lengths[:, None] - starts, 0, sc).reshape(b * c)
    q_offset = None
    if spec.is_windowed:
        o = jnp.zeros((b,), jnp.int32) if masks.q_offset is None else masks.q_offset
        # o - start, saturating at int32's minimum: exact for the band because the window's
        # right side is < 2**31 - T (`max_splits`), so a saturated row sees no key either way.
        o = o[:, None]
        q_offset = jnp.where(o < _INT32_MIN + starts, _INT32_MIN, o - starts).reshape(b * c)
    # Sinks join once, as one more partial of the merge: out 0 and lse = sink (no chunk has them).
    chunk_masks = MaskInputs(
        bias=dense(masks.bias, 0),
        mask=dense(masks.mask, False),
        q_lengths=None if masks.q_lengths is None else per_chunk(masks.q_lengths),
        kv_lengths=kv_lengths,
        q_segment_ids=None if masks.q_segment_ids is None else per_chunk(masks.q_segment_ids),
        kv_segment_ids=None if masks.kv_segment_ids is None else cut(masks.kv_segment_ids, 1),
        q_offset=q_offset,
    )
    chunk_spec = dataclasses.replace(
        spec,
        batch=b * c,
        kv_len=sc,
        bias_shape=None if chunk_masks.bias is None else tuple(chunk_masks.bias.shape),
        mask_shape=None if chunk_masks.mask is None else tuple(chunk_masks.mask.shape),
        has_kv_lengths=True,
        has_q_offset=q_offset is not None,
        has_sinks=False,
    )
    acc_dt = acc_dtype(q.dtype)
    out, lse = inner(chunk_spec, per_chunk(q), cut(k, 1), cut(v, 1), chunk_masks, out_dtype=acc_dt)
    t, n = q.shape[1:3]
    out = out.reshape(b, c, t, n, spec.v_head_dim)
    lse = lse.reshape(b, c, n, t)
    outs, lses = [out[:, i] for i in range(c)], [lse[:, i] for i in range(c)]
    if masks.sinks is not None:
        outs.append(jnp.zeros_like(outs[0]))
        lses.append(jnp.broadcast_to(masks.sinks.astype(lses[0].dtype)[None, :, None], lses[0].shape))
    out, lse = merge_partials(outs, lses)
    return out.astype(q.dtype), lse
