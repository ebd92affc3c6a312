"""Flax integration: `attention_fn` for `flax.linen.MultiHeadDotProductAttention` and
`flax.nnx.MultiHeadAttention`::

    import functools, flax.linen as nn, jax_flash.flax

    nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=jax_flash.flax.attention_fn)
    nn.MultiHeadDotProductAttention(
        num_heads=8,
        attention_fn=functools.partial(jax_flash.flax.attention_fn, is_causal=True,
                                       implementation="xla"))

This module does not import flax: flax calls the function, and the function only needs JAX.

Flax's conventions, and how they map onto `jax_flash.attention`:

* q, k are [batch..., T, N, H] and v [batch..., S, N, Hv] (the same BTNH layout; flax's
  modules project all three to one head dim, a custom module may give v its own Hv).
* `mask` is broadcastable to [batch..., N|1, T, S] and is float 0/1 (`make_causal_mask`,
  `make_attention_mask`) or bool; nonzero / True means "may attend", as in flax.
* Flax gives a row that sees no key the mean of V; jax_flash gives it 0.
* Attention dropout: `dropout_rate > 0` with `deterministic=False` drops attention weights
  inside the kernels (`jax_flash.attention(..., dropout_rate=, dropout_rng=)`, the
  FlashAttention-2 semantics: the mask is regenerated in the backward, never stored) with
  the module's `dropout_rng` (linen: `self.make_rng('dropout')`). Each (batch, head, query,
  key) weight draws its own bit, flax's `broadcast_dropout=False`; flax's default
  `broadcast_dropout=True` (one [T, S] mask shared by every batch row and head) raises
  ValueError: construct the module with `broadcast_dropout=False`.
* `module` is only passed when attention weights are to be sown (`sow_weights=True`);
  they are never materialised, so that raises NotImplementedError too.
* `precision` is accepted and ignored: softmax statistics and accumulators are float32.

Context parallelism: with `axis_name=` the module runs inside `jax.shard_map` on this
device's chunk of a sequence sharded over that mesh axis, and attention is
`jax_flash.ring_attention` (no dense `mask`/`bias`: use is_causal, windows, segment ids).
With `layout="zigzag"` the activations are expected already in the zigzag order
(`jax_flash.zigzag` applied to the tokens, positions and targets before sharding)::

    attn = jax_flash.flax.make_attention_fn(is_causal=True, axis_name="seq", layout="zigzag")
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike, DTypeLike

from jax_flash._api import attention
from jax_flash._types import SegmentIds, Window
from jax_flash.parallel.ring import ring_attention

__all__ = ["attention_fn", "make_attention_fn"]


def _as_bool_mask(mask: ArrayLike | None) -> jax.Array | None:
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    # Flax: attention weights are kept where the mask is nonzero (True / 1.0).
    return mask if mask.dtype == jnp.bool_ else mask != 0


def attention_fn(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: ArrayLike | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: DTypeLike | None = None,
    precision: Any = None,
    module: Any = None,
    is_causal: bool = False,
    *,
    implementation: str | None = None,
    logits_soft_cap: float | None = None,
    scale: float | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    sinks: ArrayLike | None = None,
    axis_name: str | None = None,
    layout: str = "contiguous",
    **kwargs: Any,
) -> jax.Array:
    """`flax.linen.dot_product_attention`-compatible attention computed by jax_flash.

    Every argument flax passes is named (linen drops keyword arguments that are not in the
    signature); `**kwargs` takes the extras newer flax versions may pass and ignores them.
    Options of `jax_flash.attention` (implementation, logits_soft_cap, is_causal, scale,
    local_window_size, segment_ids, sinks) are chosen with `functools.partial` or
    `make_attention_fn`; `sinks` ([N], e.g. a parameter of the caller's own module: flax's
    attention modules have none) is passed to `jax_flash.attention`. `axis_name` / `layout`: the sequence is sharded over that mesh
    axis (inside `jax.shard_map`) and attention runs as `jax_flash.ring_attention`.

    Returns [batch..., T, N, H] in the dtype of query (after promotion to `dtype`).
    """
    del precision, kwargs
    dropping = bool(dropout_rate) and not deterministic
    if dropping and broadcast_dropout:
        raise ValueError(
            "jax_flash.flax.attention_fn draws one dropout bit per (batch, head, query, key) "
            "weight (broadcast_dropout=False); got broadcast_dropout=True, flax's default "
            "(one [T, S] mask shared by every batch row and head). Construct the module "
            "with broadcast_dropout=False, or use deterministic=True / dropout_rate=0."
        )
    if module is not None:
        raise NotImplementedError(
            "jax_flash.flax.attention_fn cannot sow attention weights (sow_weights=True): the "
            "attention probabilities are never materialised."
        )
    if dtype is None:
        dtype = jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    common: dict[str, Any] = dict(
        scale=scale,
        is_causal=bool(is_causal),
        local_window_size=local_window_size,
        segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap,
        implementation=implementation,
    )
    if axis_name is not None:
        if dropping:
            raise ValueError(
                f"jax_flash.flax.attention_fn with axis_name={axis_name!r} (ring attention) "
                f"does not take attention dropout; got dropout_rate={dropout_rate} with "
                "deterministic=False"
            )
        if bias is not None or mask is not None or sinks is not None:
            raise ValueError(
                f"jax_flash.flax.attention_fn with axis_name={axis_name!r} (ring attention) "
                "takes no dense mask, bias or sinks: express the mask with is_causal, "
                "local_window_size or segment_ids"
            )
        return ring_attention(query, key, value, axis_name=axis_name, layout=layout, **common)
    if dropping:
        common.update(dropout_rate=float(dropout_rate), dropout_rng=dropout_rng)
    return attention(query, key, value, bias=bias, mask=_as_bool_mask(mask), sinks=sinks, **common)


def make_attention_fn(
    *,
    implementation: str | None = None,
    is_causal: bool = False,
    logits_soft_cap: float | None = None,
    scale: float | None = None,
    local_window_size: Window | None = None,
    axis_name: str | None = None,
    layout: str = "contiguous",
) -> Callable[..., jax.Array]:
    """An `attention_fn` with jax_flash options bound (`axis_name`, `layout`: ring
    attention over a sequence sharded over that mesh axis, see the module docstring).

    Unlike `functools.partial(attention_fn, is_causal=True)`, a causal function made here
    stays causal when `flax.nnx.MultiHeadAttention` passes its own `is_causal=False`
    (the two are OR-ed).
    """
    bound_causal = bool(is_causal)

    @functools.wraps(attention_fn)
    def fn(
        query: ArrayLike,
        key: ArrayLike,
        value: ArrayLike,
        bias: ArrayLike | None = None,
        mask: ArrayLike | None = None,
        broadcast_dropout: bool = True,
        dropout_rng: ArrayLike | None = None,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype: DTypeLike | None = None,
        precision: Any = None,
        module: Any = None,
        is_causal: bool = False,
        **kwargs: Any,
    ) -> jax.Array:
        return attention_fn(
            query,
            key,
            value,
            bias,
            mask,
            broadcast_dropout,
            dropout_rng,
            dropout_rate,
            deterministic,
            dtype,
            precision,
            module,
            bound_causal or bool(is_causal),
            implementation=implementation,
            logits_soft_cap=logits_soft_cap,
            scale=scale,
            local_window_size=local_window_size,
            axis_name=axis_name,
            layout=layout,
            **kwargs,
        )

    # functools.wraps sets __wrapped__, which inspect.signature would follow to
    # attention_fn; flax filters keyword arguments by this function's own signature.
    del fn.__wrapped__
    return fn
