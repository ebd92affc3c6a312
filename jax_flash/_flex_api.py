"""`flex_attention`: attention whose logits and mask are two small user functions (as in
PyTorch's FlexAttention), through the same implementations and the one custom_vjp as
`attention`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jax_flash import _flex, _registry
from jax_flash._flex import BlockMask, FlexSpec
from jax_flash._normalize import Canonical, canonicalize, restore
from jax_flash._registry import Explanation
from jax_flash._types import OutAndLse
from jax_flash._vjp import flash_attention

__all__ = ["FLEX_ARGUMENTS", "canonicalize_flex", "explain_flex", "flex_attention"]

ScoreMod = Callable[..., Any]
MaskMod = Callable[..., Any]

# The keywords that make an `explain` call one of flex_attention.
FLEX_ARGUMENTS = ("score_mod", "mask_mod", "block_mask")


def canonicalize_flex(
    query,
    key,
    value,
    *,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    scale=None,
    sinks=None,
    implementation=None,
    config=None,
) -> Canonical:
    """`canonicalize` of the plain call, then the user functions closed (checked on
    scalars) and the block mask checked against the shapes."""
    c = canonicalize(query, key, value, scale=scale, sinks=sinks, implementation=implementation, config=config)
    spec = c.spec
    if block_mask is not None and mask_mod is None:
        raise ValueError(
            "block_mask needs the mask_mod it was made from (mask_mod=...): its partly visible "
            "blocks are masked by evaluating mask_mod"
        )
    score_dt = jnp.float64 if c.q.dtype == jnp.float64 else jnp.float32
    score_fn = mask_fn = None
    score_consts = mask_consts = None
    if score_mod is not None:
        score_fn, score_consts = _flex.close(score_mod, "score_mod", (jnp.zeros((), score_dt), *_flex.index_args()))
    if mask_mod is not None:
        mask_fn, mask_consts = _flex.close(mask_mod, "mask_mod", _flex.index_args())
    flex = FlexSpec(score_mod=score_fn, mask_mod=mask_fn)
    if block_mask is not None:
        bm = _flex.check_block_mask(block_mask, spec.batch, spec.num_heads, spec.q_len, spec.kv_len)
        (bq, bk), (mb, mn) = bm.block_size, bm.kv_num_blocks.shape[:2]
        flex = dataclasses.replace(
            flex, block_size=(int(bq), int(bk)), block_batch_heads=(int(mb), int(mn)), partial_capacity=bm.capacity
        )
        block_mask = jax.tree.map(lambda x: jnp.asarray(x, jnp.int32), bm)
    spec = dataclasses.replace(spec, flex=flex)
    masks = c.masks._replace(score_consts=score_consts, mask_consts=mask_consts, block_mask=block_mask)
    return c._replace(spec=spec, masks=masks)


@overload
def flex_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    sinks: ArrayLike | None = None,
    return_residual: Literal[False] = False,
    implementation: str | None = None,
) -> jax.Array: ...


@overload
def flex_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    sinks: ArrayLike | None = None,
    return_residual: Literal[True],
    implementation: str | None = None,
) -> OutAndLse: ...


@overload
def flex_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    sinks: ArrayLike | None = None,
    return_residual: bool = False,
    implementation: str | None = None,
) -> jax.Array | OutAndLse: ...


def flex_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    sinks: ArrayLike | None = None,
    return_residual: bool = False,
    implementation: str | None = None,
) -> jax.Array | OutAndLse:
    """Exact softmax attention whose logits and mask are user functions (FlexAttention),
    computed tile by tile; docs/flex.md.

    Args:
      query, key, value: as for `jax_flash.attention` (`[*B, T, N, H]`, `[*B, S, K, H]`,
        `[*B, S, K, Hv]`; grouped-query attention when K < N). The batch index `b` the user
        functions receive counts the leading batch axes flattened (row-major).
      score_mod: optional `score_mod(score, b, h, q_idx, kv_idx) -> score`, written with
        jax.numpy on scalars: score is the scaled logit q·k·scale (float32; float64 for
        float64 inputs), b, h (query head), q_idx, kv_idx are int32. It may close over
        arrays; closed-over floating arrays are differentiable (their gradients come back
        as those of any input). Applied only where mask_mod allows.
      mask_mod: optional `mask_mod(b, h, q_idx, kv_idx) -> bool` (True = may attend), on
        scalars, closing over arrays as it likes (not differentiated).
      block_mask: optional `BlockMask` of this mask_mod (`create_block_mask`, for these T
        and S; its batch and head axes B|1, N|1): empty blocks are skipped and fully
        visible ones skip mask_mod. Without it every block evaluates mask_mod (correct,
        no skipping). It must have been made from the same mask_mod: a block it calls full
        is not masked.
      scale, sinks, return_residual, implementation: as for `jax_flash.attention`.

    A row that sees no key gives out 0 and lse -inf (with sinks: lse = sinks[n]), NaN/±inf
    reach only the rows that see them (docs/numerical-contract.md). Differentiable once
    in query, key, value, sinks and the floating arrays score_mod closes over (reverse mode).

    Returns:
      out `[*B, T, N, Hv]` in the dtype of query, or (out, lse `[*B, T, N]`) with
      return_residual=True.
    """
    if not isinstance(return_residual, bool):
        raise TypeError(f"return_residual must be a Python bool, got {return_residual!r}")
    c = canonicalize_flex(
        query,
        key,
        value,
        score_mod=score_mod,
        mask_mod=mask_mod,
        block_mask=block_mask,
        scale=scale,
        sinks=sinks,
        implementation=implementation,
    )
    name = _registry.select(c.spec, implementation)
    out, lse = flash_attention(name, c.spec, c.q, c.k, c.v, c.masks)
    out, lse = restore(c, out, lse)
    return (out, lse) if return_residual else out


def explain_flex(query, key, value, *, verbose: bool = False, **kwargs: Any) -> Explanation:
    """`explain` of a flex_attention call (its arguments)."""
    kwargs.pop("return_residual", None)
    requested = kwargs.get("implementation")
    c = canonicalize_flex(query, key, value, **kwargs)
    return _registry.explanation(c.spec, requested, verbose=verbose, op="jax_flash.flex_attention")
