"""The specification: naive attention that materialises the T×S score matrix.

Used by the tests as ground truth (in float64, or at the input precision to measure how
much error that precision itself makes). Never used by `jax_flash.attention`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from jax_flash import _dropout, _flex, _masking
from jax_flash._flex import BlockMask, FlexSpec
from jax_flash._normalize import canonicalize, restore
from jax_flash._spec import AttentionSpec, MaskInputs
from jax_flash._types import OutAndLse, SegmentIds, Window


@overload
def attention_reference(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    logits_soft_cap: float | None = None,
    query_offset: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    return_residual: Literal[False] = False,
    compute_dtype: DTypeLike | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
) -> jax.Array: ...


@overload
def attention_reference(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    logits_soft_cap: float | None = None,
    query_offset: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    return_residual: Literal[True],
    compute_dtype: DTypeLike | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
) -> OutAndLse: ...


@overload
def attention_reference(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    logits_soft_cap: float | None = None,
    query_offset: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    return_residual: bool = False,
    compute_dtype: DTypeLike | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
) -> jax.Array | OutAndLse: ...


def attention_reference(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    logits_soft_cap: float | None = None,
    query_offset: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    return_residual: bool = False,
    compute_dtype: DTypeLike | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
) -> jax.Array | OutAndLse:
    """Same arguments and semantics as `jax_flash.attention`, computed densely.

    compute_dtype: dtype of the logits and of the P·V product (None: the input dtype, as a
    kernel at that precision would see it). Softmax statistics are float32, or float64 when
    compute_dtype is float64. A row that sees no key gives out = 0 and lse = -inf (with
    sinks: lse = sinks[n]).

    dropout_rate, dropout_rng: as for `jax_flash.attention`; the whole keep-mask
    (`dropout_keep`, the generator of `jax_flash._dropout`) applied to P after the
    statistics, so that the reference and every implementation drop the same weights and
    its autodiff gives the gradients given that mask (in float64 with compute_dtype).

    Example:

    >>> import jax.numpy as jnp
    >>> import jax_flash
    >>> q = jnp.ones((1, 8, 2, 16), jnp.float32)
    >>> bool(jnp.allclose(jax_flash.reference(q, q, q), jax_flash.attention(q, q, q), atol=1e-6))
    True
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
        sinks=sinks,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
    )
    out, lse = reference_canonical(c.spec, c.q, c.k, c.v, c.masks, compute_dtype)
    out, lse = restore(c, out.astype(c.q.dtype if compute_dtype is None else compute_dtype), lse)
    return (out, lse) if return_residual else out


def reference_canonical(
    spec: AttentionSpec, q, k, v, masks: MaskInputs, compute_dtype=None
) -> tuple[jax.Array, jax.Array]:
    """Dense attention on canonical inputs: out [B, T, N, Hv], lse [B, N, T].

    Non-finite inputs follow the numerical contract (docs/numerical-contract.md): a
    NaN/±inf element of q[t] or k[s] makes the logit (t, s) NaN; every row that sees a
    NaN or +inf logit gets NaN out and lse, every row that sees a non-finite v[s] gets NaN
    out (lse stays finite), and the gradients are NaN exactly where FlashAttention's
    backward propagates them. Only visible pairs (t, s) carry a poison: the products run
    over finite copies of q, k, v, so that a masked-out poisoned key never meets a zero
    weight (0·NaN = NaN). A row whose every visible logit is -inf (or that sees no key)
    is empty: out 0, lse -inf, no gradient.

    Sinks ([N]) join each row's max and sum as one more logit with value 0 (masks, scale
    and the soft cap do not touch it): a row that sees no key gets out 0 and lse = sink, and
    a NaN or +inf sink makes every row of its head NaN (out and lse).
    """
    dt = jnp.dtype(q.dtype if compute_dtype is None else compute_dtype)
    stat_dt = jnp.float64 if dt == jnp.float64 else jnp.float32
    _b, t, n, _h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    q = q.astype(dt)
    # GQA by index, never by copying: query head n reads kv head n // g.
    kk = jnp.take(k.astype(dt), jnp.arange(n) // g, axis=2)
    vv = jnp.take(v.astype(dt), jnp.arange(n) // g, axis=2)
    bad_q = _nonfinite_rows(q)  # [B, T, N]
    bad_k = _nonfinite_rows(kk)  # [B, S, N]
    bad_v = _nonfinite_rows(vv)
    logits = jnp.einsum("btnh,bsnh->bnts", _finite_part(q), _finite_part(kk))
    # A non-finite q[t] or k[s] reaches logit (t, s) as NaN (added, so that the logit's
    # cotangent still reaches the finite copies: dq, dk of what it touches become NaN).
    poison = jnp.swapaxes(bad_q, 1, 2)[..., :, None] | jnp.swapaxes(bad_k, 1, 2)[..., None, :]
    logits = logits + jnp.where(poison, jnp.nan, 0).astype(dt)
    logits = logits * jnp.asarray(spec.scale, dt)
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
        q_segment_ids=None if masks.q_segment_ids is None else masks.q_segment_ids[:, None, :, None],
        kv_segment_ids=None if masks.kv_segment_ids is None else masks.kv_segment_ids[:, None, None, :],
    )
    if masks.mask is not None:
        vis = masks.mask if vis is None else vis & masks.mask
    flex = spec.flex
    b_idx = jnp.arange(_b, dtype=jnp.int32)[:, None, None, None]
    h_idx = jnp.arange(n, dtype=jnp.int32)[None, :, None, None]
    if flex is not None and flex.mask_mod is not None:  # dense: mask_mod at every (b, h, t, s)
        flex_vis = _flex.apply_mask_mod(flex.mask_mod, masks.mask_consts or (), b_idx, h_idx, rows, cols)
        vis = flex_vis if vis is None else vis & flex_vis
    vis = jnp.broadcast_to(True if vis is None else vis, logits.shape)
    # Masked pairs leave the computation here, before the bias and the soft cap: the cap's
    # derivative 1 - tanh² at a masked NaN logit is NaN, and NaN times the zero cotangent of
    # a masked pair is NaN (the double-where: a masked-out poison then affects nothing).
    # (In the statistics' dtype first: the broadcast bias's cotangent is summed in it.)
    bias = None
    if masks.bias is not None:
        bias_dt = jnp.result_type(stat_dt, masks.bias.dtype)
        bias = jnp.where(vis, masks.bias.astype(bias_dt), jnp.zeros((), bias_dt))
    logits = jnp.where(vis, logits, jnp.zeros((), dt))
    logits = _masking.transform_logits(spec, logits.astype(stat_dt), bias)
    if flex is not None and flex.score_mod is not None:  # on the statistics' dtype, masked ones as 0
        logits = _flex.apply_score_mod(flex.score_mod, masks.score_consts or (), logits, b_idx, h_idx, rows, cols)
    logits = logits.astype(dt).astype(stat_dt)
    logits = jnp.where(vis, logits, -jnp.inf)
    # XLA's max may drop a NaN logit; exp(NaN) cannot, so l is NaN for a poisoned row.
    # The max only shifts the exponents: no gradient flows through it (jnp.max's VJP sends
    # the row's cotangent to the max's position, which XLA's NaN-dropping max under jit
    # finds among the finite logits of a poisoned row: a 0 instead of NaN there).
    m = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf))  # S = 0: no key
    sink = None
    if masks.sinks is not None:
        sink = masks.sinks.astype(stat_dt)[None, :, None, None]  # [1, N, 1, 1]
        m = jnp.maximum(m, sink)  # a NaN sink makes m NaN
    m_safe = jnp.where(m == -jnp.inf, 0, m)
    # The row max's exponent is exactly 0, chosen by comparison rather than computed as
    # logit - max: under jit XLA recomputes the scaled logit inside the exponent's fusion and
    # contracts the scale's multiply and this subtraction into an FMA, which skips the
    # product's rounding that the max saw; at |scale · q·k| ~ 1e31 the difference came out
    # ~ulp(1e31) above 0 (exp = inf, NaN out). A comparison reads the rounded product, so any
    # other logit's exponent is < 0 either way. (A +inf logit still gives inf - inf = NaN.)
    at_max = (logits >= m_safe) & (logits < jnp.inf)
    shifted = jnp.where(at_max, _zero_unit_slope(logits), logits - m_safe)
    e = jnp.where(vis, jnp.exp(shifted), 0)  # exactly 0 where masked, even for NaN m
    l = jnp.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        # The sink's share: 0 for a -inf sink, NaN for a NaN or +inf one (exp(inf - inf)).
        l = l + jnp.exp(sink - m_safe)
    empty = l == 0  # sees no key, or only -inf logits (a NaN l is a poisoned row)
    p = jnp.where(vis & ~empty, e / jnp.where(empty, 1, l), 0)
    lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1, l)))[..., 0]
    if spec.has_dropout:  # after the statistics: lse is that of the full P
        p = jnp.where(dropout_keep(spec, masks.dropout_seed), p * _dropout.keep_scale(spec.dropout_rate, stat_dt), 0)
    out = jnp.einsum("bnts,bsnh->btnh", p.astype(dt), _finite_part(vv))
    # A row that sees a non-finite v[s] is NaN; so are its gradients, as the kernels'
    # D = rowsum(dO ∘ O) makes them: NaN · (lse - stop_gradient(lse)) is NaN in value and
    # sends a NaN cotangent to every logit the row sees (its lse stays finite).
    sees_bad_v = jnp.einsum("bnts,bsn->bnt", vis.astype(stat_dt), bad_v.astype(stat_dt)) > 0
    sees_bad_v = sees_bad_v & ~empty[..., 0]
    lse_f = jnp.where(jnp.isfinite(lse), lse, 0)
    v_poison = jnp.where(sees_bad_v, jnp.nan, 0).astype(stat_dt) * (lse_f - lax.stop_gradient(lse_f))
    out = out + jnp.swapaxes(v_poison, 1, 2)[..., None].astype(out.dtype)
    if masks.sinks is not None:  # a NaN or +inf sink: every row of its head, the empty ones too
        bad_sink = ~(masks.sinks < jnp.inf)[None, None, :, None]  # [1, 1, N, 1]
        out = jnp.where(bad_sink, jnp.nan, out)
    return out, lse.astype(stat_dt)


def flex_attention_reference(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    sinks: ArrayLike | None = None,
    return_residual: bool = False,
    compute_dtype: DTypeLike | None = None,
) -> jax.Array | OutAndLse:
    """The specification of `jax_flash.flex_attention` (same arguments), computed densely:
    mask_mod at every (b, h, q_idx, kv_idx), score_mod on every visible scaled logit (the
    masked ones enter it as 0 and leave the softmax). block_mask only says where the work
    is, so it changes nothing here (it is checked against the shapes). compute_dtype as for
    `attention_reference`: score_mod then sees float64 scores for float64."""
    c = canonicalize(query, key, value, scale=scale, sinks=sinks)
    dt = jnp.dtype(c.q.dtype if compute_dtype is None else compute_dtype)
    score_dt = jnp.float64 if dt == jnp.float64 else jnp.float32
    score_fn = mask_fn = None
    score_consts = mask_consts = None
    if score_mod is not None:
        score_fn, score_consts = _flex.close(score_mod, "score_mod", (jnp.zeros((), score_dt), *_flex.index_args()))
    if mask_mod is not None:
        mask_fn, mask_consts = _flex.close(mask_mod, "mask_mod", _flex.index_args())
    if block_mask is not None:
        _flex.check_block_mask(block_mask, c.spec.batch, c.spec.num_heads, c.spec.q_len, c.spec.kv_len)
    spec = dataclasses.replace(c.spec, flex=FlexSpec(score_mod=score_fn, mask_mod=mask_fn))
    masks = c.masks._replace(score_consts=score_consts, mask_consts=mask_consts)
    out, lse = reference_canonical(spec, c.q, c.k, c.v, masks, compute_dtype)
    out, lse = restore(c, out.astype(c.q.dtype if compute_dtype is None else compute_dtype), lse)
    return (out, lse) if return_residual else out


@jax.custom_jvp
def _zero_unit_slope(x):
    """0 in value, derivative 1: the row max's exponent x - max, which the max (a constant
    shift, stop_gradient) leaves at exactly 0 without computing x - x (under jit an FMA
    could make that the product's rounding error)."""
    return jnp.zeros_like(x)


@_zero_unit_slope.defjvp
def _zero_unit_slope_jvp(primals, tangents):
    return jnp.zeros_like(primals[0]), tangents[0]


def dropout_keep(spec: AttentionSpec, seed) -> jax.Array:
    """The whole keep-mask, bool [B, N, T, S], of `_dropout`'s generator (for the reference
    and for tests: the implementations regenerate it tile by tile)."""
    b, n, t, s = spec.batch, spec.num_heads, spec.q_len, spec.kv_len
    width = -(-s // _dropout.COLUMNS_PER_CALL) * _dropout.COLUMNS_PER_CALL
    keep = _dropout.keep_mask_groups(
        seed,
        spec.dropout_rate,
        jnp.arange(b, dtype=jnp.uint32)[:, None, None],
        jnp.arange(n, dtype=jnp.uint32)[None, :, None],
        jnp.arange(t, dtype=jnp.uint32)[None, None, :],
        0,
        width,
    )
    return keep[..., :s]


def _nonfinite_rows(x):
    """[B, L, N, H] -> bool [B, L, N]: the row holds a NaN or ±inf."""
    return ~jnp.all(jnp.isfinite(x), axis=-1)


@jax.custom_jvp
def _finite_part(x):
    """x with NaN/±inf replaced by 0, for the products (the poison travels separately)."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


@_finite_part.defjvp
def _finite_part_jvp(primals, tangents):
    # The identity: a poisoned element's own gradient is the one its finite neighbours
    # get (dv[s] = Σ_t P[t, s] dO[t] does not depend on v[s]).
    (x,), (dx,) = primals, tangents
    return _finite_part(x), dx


def gather_pages(pages: ArrayLike, page_table: ArrayLike) -> jax.Array:
    """The contiguous cache [B, max_pages·page_size, K, H] of a paged one: pages
    [num_pages, page_size, K, H] read in page_table [B, max_pages] order. Ids out of range
    read page 0 (`paged_attention_reference` masks those keys). For tests and references
    only: the kernels never build this copy."""
    pages = jnp.asarray(pages)
    table = jnp.asarray(page_table, jnp.int32)
    ids = jnp.where((table >= 0) & (table < pages.shape[0]), table, 0)
    g = jnp.take(pages, ids, axis=0)  # [B, max_pages, page_size, K, H]
    return g.reshape(table.shape[0], -1, *pages.shape[2:])


@overload
def paged_attention_reference(
    query: ArrayLike,
    key_pages: ArrayLike,
    value_pages: ArrayLike,
    page_table: ArrayLike,
    kv_lengths: ArrayLike,
    *,
    scale: float | None = None,
    is_causal: bool = True,
    local_window_size: Window | None = None,
    logits_soft_cap: float | None = None,
    sinks: ArrayLike | None = None,
    return_residual: Literal[False] = False,
    compute_dtype: DTypeLike | None = None,
) -> jax.Array: ...


@overload
def paged_attention_reference(
    query: ArrayLike,
    key_pages: ArrayLike,
    value_pages: ArrayLike,
    page_table: ArrayLike,
    kv_lengths: ArrayLike,
    *,
    scale: float | None = None,
    is_causal: bool = True,
    local_window_size: Window | None = None,
    logits_soft_cap: float | None = None,
    sinks: ArrayLike | None = None,
    return_residual: Literal[True],
    compute_dtype: DTypeLike | None = None,
) -> OutAndLse: ...


@overload
def paged_attention_reference(
    query: ArrayLike,
    key_pages: ArrayLike,
    value_pages: ArrayLike,
    page_table: ArrayLike,
    kv_lengths: ArrayLike,
    *,
    scale: float | None = None,
    is_causal: bool = True,
    local_window_size: Window | None = None,
    logits_soft_cap: float | None = None,
    sinks: ArrayLike | None = None,
    return_residual: bool = False,
    compute_dtype: DTypeLike | None = None,
) -> jax.Array | OutAndLse: ...


def paged_attention_reference(
    query: ArrayLike,
    key_pages: ArrayLike,
    value_pages: ArrayLike,
    page_table: ArrayLike,
    kv_lengths: ArrayLike,
    *,
    scale: float | None = None,
    is_causal: bool = True,
    local_window_size: Window | None = None,
    logits_soft_cap: float | None = None,
    sinks: ArrayLike | None = None,
    return_residual: bool = False,
    compute_dtype: DTypeLike | None = None,
) -> jax.Array | OutAndLse:
    """The specification of `jax_flash.paged_attention`: `attention_reference` on the
    gathered cache, with key_value_seq_lengths = kv_lengths and query_offset = kv_lengths - T
    (the queries are the last T positions), keys of out-of-range page ids masked and a
    negative length counted as 0. compute_dtype as for `attention_reference`.

    Example:

    >>> import jax.numpy as jnp
    >>> import jax_flash
    >>> pages = jnp.ones((8, 16, 2, 64), jnp.float32)
    >>> table = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    >>> q = jnp.ones((2, 1, 4, 64), jnp.float32)
    >>> lengths = jnp.array([20, 64], jnp.int32)
    >>> out = jax_flash.paged_attention(q, pages, pages, table, lengths)
    >>> bool(jnp.allclose(out, jax_flash.paged_reference(q, pages, pages, table, lengths), atol=1e-5))
    True
    """
    q = jnp.asarray(query)
    table = jnp.asarray(page_table, jnp.int32)
    num_pages, page_size = jnp.shape(key_pages)[:2]
    valid = jnp.repeat((table >= 0) & (table < num_pages), page_size, axis=1)  # [B, S]
    lengths = jnp.maximum(jnp.asarray(kv_lengths, jnp.int32), 0)
    return attention_reference(
        q,
        gather_pages(key_pages, table),
        gather_pages(value_pages, table),
        mask=valid[:, None, None, :],
        scale=scale,
        is_causal=is_causal,
        key_value_seq_lengths=lengths,
        query_offset=lengths - q.shape[1],
        local_window_size=local_window_size,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
        return_residual=return_residual,
        compute_dtype=compute_dtype,
    )
