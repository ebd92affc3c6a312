"""The one custom_vjp shared by every implementation.

Forward saves q, k, v, out and lse (FlashAttention-2 §3.1: the log-sum-exp replaces the
probabilities, which are never stored). Backward recomputes score tiles from q, k and lse.
Implementations only provide forward/backward on canonical inputs (see `_registry`).
"""

from __future__ import annotations

import functools

import jax

from jax_flash import _registry
from jax_flash._spec import AttentionSpec, MaskInputs


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def flash_attention(impl_name: str, spec: AttentionSpec, q, k, v, masks: MaskInputs):
    """(out [B, T, N, H], lse [B, N, T]) for canonical inputs, differentiable in q, k, v, bias."""
    return _registry.get(impl_name).forward(spec, q, k, v, masks)


def _forward(impl_name, spec, q, k, v, masks):
    out, lse = _registry.get(impl_name).forward(spec, q, k, v, masks)
    return (out, lse), (q, k, v, masks, out, lse)


def _backward(impl_name, spec, residuals, cotangents):
    q, k, v, masks, out, lse = residuals
    dout, dlse = cotangents
    dq, dk, dv, dbias = _registry.get(impl_name).backward(
        spec, q, k, v, masks, out, lse, dout.astype(out.dtype), dlse.astype(lse.dtype)
    )
    # Masks, lengths and segment ids are not differentiable (None = zero cotangent).
    dmasks = MaskInputs(bias=dbias)
    return dq, dk, dv, dmasks


flash_attention.defvjp(_forward, _backward)
