"""The one custom_vjp shared by every implementation.

Forward saves q, k, v, out and lse (FlashAttention-2 §3.1: the log-sum-exp replaces the
probabilities, which are never stored). Backward recomputes score tiles from q, k and lse.
Implementations only provide forward/backward on canonical inputs (see `_registry`).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from jax_flash import _registry
from jax_flash._spec import AttentionSpec, MaskInputs


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def flash_attention(impl_name: str, spec: AttentionSpec, q, k, v, masks: MaskInputs):
    """(out [B, T, N, Hv], lse [B, N, T]) for canonical inputs, differentiable in q, k, v, bias
    and sinks."""
    return _forward(impl_name, spec, q, k, v, masks)[0]


def _forward(impl_name, spec, q, k, v, masks):
    out, lse = _first_order_forward(impl_name, spec, q, k, v, masks)
    # Inside shard_map the results vary over every mesh axis any input varies over; a
    # compiled call's results are typed invariant, so say it (check_vma).
    axes = _vma(q, k, v, *jax.tree.leaves(masks))
    out, lse = _vary(out, axes), _vary(lse, axes)
    return (out, lse), (q, k, v, masks, out, lse)


def _backward(impl_name, spec, residuals, cotangents):
    q, k, v, masks, out, lse = residuals
    dout, dlse = cotangents
    dout, dlse = dout.astype(out.dtype), dlse.astype(lse.dtype)
    # The kernels' backward needs no sinks: P = exp(x - lse) already holds the sink's share.
    grads = _first_order_backward(impl_name, spec, q, k, v, masks._replace(sinks=None), out, lse, dout, dlse)
    dq, dk, dv, dbias = grads[:4]
    # flex_attention: the cotangents of the arrays its score_mod closes over (floating ones;
    # None for the others), as a fifth result.
    dscore = grads[4] if len(grads) > 4 else None
    # Inside shard_map an input that is the same on every device of a mesh axis (K/V
    # gathered, queries sharded) gets the sum of the devices' cotangents over that axis.
    axes = _vma(q, k, v, *jax.tree.leaves(masks), dout, dlse)
    dq, dk, dv = (_cotangent(d, x, axes) for d, x in ((dq, q), (dk, k), (dv, v)))
    if dbias is not None:
        dbias = _cotangent(dbias, masks.bias, axes)
    dsinks = None
    if masks.sinks is not None:
        dsinks = _cotangent(sinks_cotangent(masks.sinks, out, lse, dout, dlse), masks.sinks, axes)
    if dscore is not None:
        assert masks.score_consts is not None  # a flex backward returns them for its score_mod
        dscore = tuple(None if d is None else _cotangent(d, x, axes) for d, x in zip(dscore, masks.score_consts))
    # Masks, lengths, segment ids and what a mask_mod closes over are not differentiable
    # (None = zero cotangent).
    dmasks = MaskInputs(bias=dbias, sinks=dsinks, score_consts=dscore)
    return dq, dk, dv, dmasks


def sinks_cotangent(sinks, out, lse, dout, dlse):
    """dsinks [N], once for every implementation: the sink is one more logit of every row with
    value 0, so d lse / d sink = p_sink = exp(sink - lse) and d out / d sink = -p_sink · out,

        dsinks[n] = -Σ_{b,t} p_sink[b, n, t] · (rowsum(dO ∘ O)[b, n, t] - dlse[b, n, t]),

    summed in the statistics' dtype (float32, float64 for float64 inputs) by one reduction
    (deterministic). A -inf sink sends nothing (p_sink = 0, also in a row whose lse is -inf);
    a NaN lse or sink (a poisoned row) gives NaN."""
    acc = lse.dtype
    sink = sinks.astype(acc)[None, :, None]
    p_sink = jnp.where(sink == -jnp.inf, 0, jnp.exp(sink - lse))
    delta = jnp.einsum("btnh,btnh->bnt", dout.astype(acc), out.astype(acc)) - dlse
    return -jnp.sum(p_sink * delta, axis=(0, 2)).astype(sinks.dtype)


def is_empty(spec: AttentionSpec) -> bool:
    """Nothing to compute: an empty output (B, T or N is 0) or no key at all (S = 0)."""
    return 0 in (spec.batch, spec.q_len, spec.num_heads, spec.kv_len)


def _empty_forward(spec: AttentionSpec, q, sinks=None):
    """Every implementation's result for an empty call, computed here once so that all of
    them agree: out 0 and lse -inf (each row sees no key, S = 0), or empty arrays. With
    sinks, lse = sinks[n], and a NaN or +inf sink makes its head's out and lse NaN."""
    b, t, n = spec.batch, spec.q_len, spec.num_heads
    stat_dt = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    out = jnp.zeros_like(q, shape=(b, t, n, spec.v_head_dim))  # [B, T, N, Hv]
    if sinks is None:
        return out, jnp.full((b, n, t), -jnp.inf, stat_dt)
    bad = ~(sinks < jnp.inf)  # NaN or +inf
    out = jnp.where(bad[None, None, :, None], jnp.nan, out)
    lse = jnp.where(bad, jnp.nan, sinks).astype(stat_dt)
    return out, jnp.broadcast_to(lse[None, :, None], (b, n, t))


# Second derivatives: differentiating a gradient differentiates both rules of the
# custom_vjp (the forward rule runs under the outer derivative's trace too). Each rule's
# call of an implementation is a custom_jvp that refuses, so grad-of-grad, jax.hessian and
# jacfwd-of-grad raise this at trace time, the same for every implementation, instead of
# failing inside an FFI call, a custom_partitioning or a dynamic-bounds loop.
SECOND_ORDER_MESSAGE = (
    "jax_flash.attention is differentiable once (reverse mode: jax.grad, jax.vjp); its "
    "backward pass is not differentiable, so second derivatives (grad of grad, jax.hessian, "
    "jax.jacfwd of a gradient) are not supported. For higher-order derivatives use "
    "jax_flash.reference (same arguments, dense) or jax.nn.dot_product_attention."
)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _first_order_forward(impl_name, spec, q, k, v, masks):
    if is_empty(spec):
        return _empty_forward(spec, q, masks.sinks)
    return _registry.get(impl_name).forward(spec, q, k, v, masks)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _first_order_backward(impl_name, spec, q, k, v, masks, out, lse, dout, dlse):
    if is_empty(spec):
        return _empty_backward(spec, q, k, v, masks)
    return _registry.get(impl_name).backward(spec, q, k, v, masks, out, lse, dout, dlse)


def _second_order(impl_name, spec, primals, tangents):
    raise NotImplementedError(SECOND_ORDER_MESSAGE)


_first_order_forward.defjvp(_second_order)
_first_order_backward.defjvp(_second_order)


def _empty_backward(spec: AttentionSpec, q, k, v, masks: MaskInputs):
    """Zero gradients: nothing depends on q (no key) or there is nothing to differentiate."""
    dbias = None if masks.bias is None else jnp.zeros_like(masks.bias)
    grads = jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), dbias
    if masks.score_consts is None:
        return grads
    return (
        *grads,
        tuple(jnp.zeros_like(c) if jnp.issubdtype(c.dtype, jnp.floating) else None for c in masks.score_consts),
    )


def _vma(*xs) -> frozenset[Hashable]:
    """The mesh axes (inside shard_map) over which any of `xs` varies; empty elsewhere."""
    axes: set[Hashable] = set()
    for x in xs:
        aval = jax.typeof(x)
        vma = getattr(aval, "vma", None)  # named manual_axis_type.varying in jax 0.10
        if vma is None:
            vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
        axes.update(vma or ())
    return frozenset(axes)


def _vary(x, axes):
    """`x` typed as varying over `axes` (it already does in value)."""
    missing = tuple(sorted(a for a in axes if a not in _vma(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _cotangent(d, primal, axes):
    """The cotangent of `primal`, typed like it: summed over the axes it does not vary on."""
    d = _vary(d, axes)
    extra = tuple(sorted(a for a in axes if a not in _vma(primal)))
    return lax.psum(d, extra) if extra else d


flash_attention.defvjp(_forward, _backward)
