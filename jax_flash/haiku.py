"""Haiku integration: `MultiHeadAttention`, a drop-in for `haiku.MultiHeadAttention`.

Same constructor, same call signature and the same parameter tree (the default module name
is haiku's, "multi_head_attention", and the projections are haiku's own), so parameters
trained with one load into the other. The attention itself runs in `jax_flash.attention`:

    mha = jax_flash.haiku.MultiHeadAttention(num_heads=8, key_size=64,
                                             w_init=hk.initializers.VarianceScaling(1.0),
                                             is_causal=True)

haiku is imported when this module is imported, never by `import jax_flash`.

Differences from haiku's module: a query row whose mask hides every key gets 0 (haiku gives
the mean of the values). `value_size != key_size` runs as it is: jax_flash takes a value
head dim Hv different from the query/key head dim H (the logits scale is 1/sqrt(key_size),
as in haiku).
"""

from __future__ import annotations

import math

import haiku as hk
import jax
import jax.numpy as jnp

from jax_flash._api import attention

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(hk.MultiHeadAttention):
    """`haiku.MultiHeadAttention` computed with `jax_flash.attention`.

    Extra keyword arguments (beyond haiku's):

    * `implementation`: None (best available), "cuda", "pallas", "cpu" or "xla".
    * `is_causal`: query t sees keys s <= t (in addition to any mask).
    * `logits_soft_cap`: float c: logits -> c·tanh(logits / c).
    * `with_sinks`: learn attention sinks (one logit per head, `jax_flash.attention`'s `sinks`):
      a parameter "sinks" `[num_heads]` (float32, initialised by `sinks_init`, default zeros).
    """

    def __init__(
        self,
        num_heads: int,
        key_size: int,
        w_init_scale: float | None = None,
        *,
        w_init: hk.initializers.Initializer | None = None,
        with_bias: bool = True,
        b_init: hk.initializers.Initializer | None = None,
        value_size: int | None = None,
        model_size: int | None = None,
        name: str | None = "multi_head_attention",
        implementation: str | None = None,
        is_causal: bool = False,
        logits_soft_cap: float | None = None,
        with_sinks: bool = False,
        sinks_init: hk.initializers.Initializer | None = None,
    ) -> None:
        super().__init__(
            num_heads,
            key_size,
            w_init_scale,
            w_init=w_init,
            with_bias=with_bias,
            b_init=b_init,
            value_size=value_size,
            model_size=model_size,
            name=name,
        )
        self.implementation = implementation
        self.is_causal = is_causal
        self.logits_soft_cap = logits_soft_cap
        self.with_sinks = with_sinks
        self.sinks_init = sinks_init if sinks_init is not None else jnp.zeros

    def __call__(self, query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """Same as haiku's: query [..., T', D_q], key/value [..., T, D], mask
        [..., H|1, T', T] (True / nonzero = may attend) -> [..., T', model_size]."""
        *leading_dims, sequence_length, _ = query.shape
        projection = self._linear_projection
        query_heads = projection(query, self.key_size, "query")  # [..., T', H, K]
        key_heads = projection(key, self.key_size, "key")  # [..., T, H, K]
        value_heads = projection(value, self.value_size, "value")  # [..., T, H, V]

        if mask is not None:
            mask = jnp.asarray(mask)
            if mask.ndim != query_heads.ndim:
                raise ValueError(
                    f"mask must have rank {query_heads.ndim} ([..., H|1, T', T]) like "
                    f"haiku's attention logits, got shape {tuple(mask.shape)}"
                )
            if mask.dtype != jnp.bool_:
                mask = mask != 0

        # q, k [..., H, K] and v [..., H, V]: the value head dim may differ (Hv = V).
        dtype = jnp.result_type(query_heads, key_heads, value_heads)
        sinks = None
        if self.with_sinks:
            sinks = hk.get_parameter("sinks", [self.num_heads], jnp.float32, init=self.sinks_init)
        out = attention(
            query_heads.astype(dtype),
            key_heads.astype(dtype),
            value_heads.astype(dtype),
            mask=mask,
            scale=1.0 / math.sqrt(self.key_size),
            is_causal=self.is_causal,
            logits_soft_cap=self.logits_soft_cap,
            sinks=sinks,
            implementation=self.implementation,
        )  # [..., T', H, V]
        attn = jnp.reshape(out, (*leading_dims, sequence_length, -1))  # [..., T', H*V]

        final_projection = hk.Linear(self.model_size, w_init=self.w_init, with_bias=self.with_bias, b_init=self.b_init)
        return final_projection(attn)  # [..., T', D']
