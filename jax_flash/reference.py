"""The specification: naive attention that materialises the T×S score matrix.

Used by the tests as ground truth (in float64, or at the input precision to measure how
much error that precision itself makes). Never used by `jax_flash.attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash import _masking
from jax_flash._normalize import canonicalize, restore
from jax_flash._spec import AttentionSpec, MaskInputs


def attention_reference(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    segment_ids=None,
    logits_soft_cap=None,
    query_offset=None,
    return_residual=False,
    compute_dtype=None,
):
    """Same arguments and semantics as `jax_flash.attention`, computed densely.

    compute_dtype: dtype of the logits and of the P·V product (None: the input dtype, as a
    kernel at that precision would see it). Softmax statistics are float32, or float64 when
    compute_dtype is float64. A row that sees no key gives out = 0 and lse = -inf.
    """
    c = canonicalize(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap,
        query_offset=query_offset,
    )
    out, lse = reference_canonical(c.spec, c.q, c.k, c.v, c.masks, compute_dtype)
    out, lse = restore(c, out.astype(query.dtype if compute_dtype is None else compute_dtype), lse)
    return (out, lse) if return_residual else out


def reference_canonical(
    spec: AttentionSpec, q, k, v, masks: MaskInputs, compute_dtype=None
) -> tuple[jax.Array, jax.Array]:
    """Dense attention on canonical inputs: out [B, T, N, H], lse [B, N, T]."""
    dt = jnp.dtype(q.dtype if compute_dtype is None else compute_dtype)
    stat_dt = jnp.float64 if dt == jnp.float64 else jnp.float32
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    q = q.astype(dt)
    # GQA by index, never by copying: query head n reads kv head n // g.
    kk = jnp.take(k.astype(dt), jnp.arange(n) // g, axis=2)
    vv = jnp.take(v.astype(dt), jnp.arange(n) // g, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, kk) * jnp.asarray(spec.scale, dt)
    logits = _masking.transform_logits(spec, logits.astype(stat_dt), masks.bias)
    logits = logits.astype(dt).astype(stat_dt)
    rows = jnp.arange(t, dtype=jnp.int32)[:, None]
    cols = jnp.arange(s, dtype=jnp.int32)[None, :]
    # Query t of row b sits at key position q_offset[b] + t for the causal/window band.
    q_offset = 0 if masks.q_offset is None else masks.q_offset[:, None, None, None]
    vis = _masking.visible(
        spec,
        rows,
        cols,
        band=spec.band(q_offset),
        q_lengths=None if masks.q_lengths is None else masks.q_lengths[:, None, None, None],
        kv_lengths=None if masks.kv_lengths is None else masks.kv_lengths[:, None, None, None],
        q_segment_ids=None
        if masks.q_segment_ids is None
        else masks.q_segment_ids[:, None, :, None],
        kv_segment_ids=None
        if masks.kv_segment_ids is None
        else masks.kv_segment_ids[:, None, None, :],
    )
    if masks.mask is not None:
        vis = masks.mask if vis is None else vis & masks.mask
    if vis is not None:
        vis = jnp.broadcast_to(vis, logits.shape)
        logits = jnp.where(vis, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)  # S = 0: no key
    m_safe = jnp.where(jnp.isfinite(m), m, 0)
    e = jnp.exp(logits - m_safe)
    l = jnp.sum(e, axis=-1, keepdims=True)
    p = jnp.where(l > 0, e / jnp.where(l > 0, l, 1), 0)
    out = jnp.einsum("bnts,bsnh->btnh", p.astype(dt), vv)
    lse = jnp.where(l[..., 0] > 0, (m_safe + jnp.log(jnp.where(l > 0, l, 1)))[..., 0], -jnp.inf)
    return out, lse.astype(stat_dt)
