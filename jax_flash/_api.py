"""The public entry points: `attention` and `explain`."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jax_flash import _registry
from jax_flash._config import Config
from jax_flash._flex_api import FLEX_ARGUMENTS, explain_flex
from jax_flash._normalize import canonicalize, restore
from jax_flash._registry import Explanation
from jax_flash._types import OutAndLse, SegmentIds, Window
from jax_flash._vjp import flash_attention
from jax_flash.parallel import partitioning

__all__ = ["Explanation", "attention", "explain"]


@overload
def attention(
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
    implementation: str | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
    config: Config | None = None,
) -> jax.Array: ...


@overload
def attention(
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
    implementation: str | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
    config: Config | None = None,
) -> OutAndLse: ...


@overload
def attention(
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
    implementation: str | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
    config: Config | None = None,
) -> jax.Array | OutAndLse: ...


def attention(
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
    implementation: str | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
    config: Config | None = None,
) -> jax.Array | OutAndLse:
    """Exact softmax attention, computed tile by tile (FlashAttention); a drop-in for
    `jax.nn.dot_product_attention`.

    Args:
      query: `[*B, T, N, H]` (or [T, N, H]); float16, bfloat16, float32 or float64.
      key: `[*B, S, K, H]` with N % K == 0 (grouped-query attention: query head n uses kv
        head n // (N // K)); same dtype as query.
      value: `[*B, S, K, Hv]`: key's shape except the head dim Hv, which may differ from H
        (e.g. MLA's H = 192, Hv = 128); same dtype as query.
      bias: optional additive logits bias, broadcastable to `[*B, N, T, S]`. Differentiable.
      mask: optional boolean, broadcastable to `[*B, N, T, S]`; True = may attend.
      scale: logits scale; default 1 / sqrt(H).
      is_causal: query t sees keys s <= t (top-left aligned, also for T != S; see
        query_offset for other alignments).
      query_seq_lengths: `[*B]` int32; query rows t >= length are padding (output 0).
      key_value_seq_lengths: `[*B]` int32; keys s >= length are ignored.
      local_window_size: int w or (left, right): query t sees keys t - left <= s <= t + right;
        any Python ints >= 0 (sides wider than the sequence are exact: clamped).
      segment_ids: `[*B, T]` int32 (self-attention) or (q_ids `[*B, T]`, kv_ids `[*B, S]`): query t
        sees key s only when their ids are equal (packed sequences).
      logits_soft_cap: float c: logits -> c·tanh(logits / c), after bias, before masking;
        c from float32's smallest normal (1.1754944e-38) to 1e30, or None (off).
      query_offset: int o, or an integer array broadcastable to `[*B]` (one offset per batch
        row): query t sits at key position o + t for is_causal and local_window_size, so
        causal sees s <= o + t and the window o + t - left <= s <= o + t + right. Default 0
        (jax.nn's top-left alignment); o = S - T aligns the last query with the last key
        (FlashAttention's bottom-right alignment, a decode step over a cache). Negative and
        beyond-S offsets are allowed; lengths and segment ids are not shifted by it.
      sinks: optional floating array [N], one logit per query head (attention sinks, as in
        gpt-oss): every row's softmax gains a virtual key with logit sinks[n] and value 0,
        which no mask, scale or soft cap touches: out = Σ_s e^{l_s} v_s / (e^{sinks[n]} +
        Σ_s e^{l_s}), and lse includes it. A row that sees no key then gets out 0 and lse
        sinks[n]; a sink of -inf is no sink; a NaN or +inf sink makes its head's out and lse
        NaN. Differentiable (float32, or float64 for float64 inputs).
      return_residual: also return lse `[*B, T, N]`, float32 natural-log log-sum-exp of the
        visible logits (-inf for rows that see no key; with sinks, of the sink too).
      implementation: None (best available), "cuda", "pallas", "cpu" or "xla". A requested
        implementation that cannot serve the call raises ValueError saying why.
      dropout_rate: attention dropout in [0, 1) (FlashAttention-2): the softmax statistics
        and lse are those of the full probabilities P, then out = (keep ⊙ P / (1 - rate)) @ V
        where each (batch, head, query, key) weight is kept with probability 1 - rate.
        0 (default) is exactly the call without dropout.
      dropout_rng: a jax.random key (jax.random.key or a legacy uint32[2] PRNGKey), required
        when dropout_rate > 0. The keep-mask is a function of the key's bits and the global
        (batch, head, query, key) position (Philox-4x32-10, `jax_flash._dropout`): every
        implementation draws bitwise the same mask, and the backward regenerates it.
      config: a `jax_flash.Config` of call settings (cpu ISA, split-KV chunk counts, the cuda
        warp layout and backward grid, deterministic mode, ...). Its fields that are not None
        win over an enclosing `with jax_flash.config(...)`, which wins over the JAX_FLASH_*
        variables. All are resolved when the call is traced and compiled into it: a jitted
        or exported program keeps them whatever the environment it later runs in
        (docs/configuration.md).

    Masks combine by AND. A query row that sees no key gets output 0, lse -inf and zero
    gradients (jax.nn gives such rows the mean of V); so does every row when S = 0, and
    B, T or N = 0 give empty results. Differentiable once in query, key, value, bias and sinks by
    reverse mode (jax.grad/jax.vjp); forward mode (jax.jvp) and second derivatives are not
    supported (NotImplementedError: use jax_flash.reference for those).

    Returns:
      out `[*B, T, N, Hv]` in the dtype of query, or (out, lse) with return_residual=True.

    Example:

    >>> import jax.numpy as jnp
    >>> import jax_flash
    >>> q = jnp.ones((2, 128, 8, 64), jnp.float32)  # [B, T, N, H]
    >>> k = v = jnp.ones((2, 128, 2, 64), jnp.float32)  # [B, S, K, H]: GQA, 2 kv heads
    >>> jax_flash.attention(q, k, v, is_causal=True).shape
    (2, 128, 8, 64)
    >>> out, lse = jax_flash.attention(q, k, v, return_residual=True)
    >>> lse.shape  # [B, T, N], float32
    (2, 128, 8)
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
        implementation=implementation,
        sinks=sinks,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        config=config,
    )
    _check_return_residual(return_residual)
    name = _registry.select(c.spec, implementation)
    out, lse = flash_attention(name, c.spec, c.q, c.k, c.v, c.masks)
    out, lse = restore(c, out, lse)
    return (out, lse) if return_residual else out


def _check_return_residual(return_residual: object) -> None:
    if not isinstance(return_residual, (bool, np.bool_)):
        raise TypeError(f"return_residual must be a Python bool, got {return_residual!r}")


def explain(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    verbose: bool = False,
    **kwargs: Any,
) -> Explanation:
    """Same arguments as `attention` (or as `flex_attention`: score_mod, mask_mod,
    block_mask); says which implementation would run and why each other one would not.
    Raises the same argument errors the call would.

    Printed, the result has one plain line per implementation; with ``verbose=True`` each
    available one is followed by the rule that decides how it runs, with its formula.

    Example:

    >>> import jax.numpy as jnp
    >>> import jax_flash
    >>> q = jnp.ones((1, 16, 4, 64), jnp.float32)
    >>> e = jax_flash.explain(q, q, q, implementation="xla")
    >>> e.selected
    'xla'
    >>> print(str(e).splitlines()[0])
    jax_flash.attention would run: xla
    >>> e.reasons["xla"] is None  # None: it can run; else the reason it cannot
    True
    """
    if any(name in kwargs for name in FLEX_ARGUMENTS) and bias is None and mask is None:
        return explain_flex(query, key, value, verbose=verbose, **kwargs)
    _check_return_residual(kwargs.pop("return_residual", False))
    requested = kwargs.get("implementation")
    # Sharded 4-D arrays ([B, T, N, H]): how a sequence-sharded call runs under jax.jit.
    shardings = [getattr(x, "sharding", None) if jnp.ndim(x) == 4 else None for x in (query, key, value)]
    c = canonicalize(query, key, value, bias, mask, **kwargs)
    e = _registry.explanation(c.spec, requested, verbose=verbose)
    if e.selected is None:
        return e
    return dataclasses.replace(e, sequence_parallel=partitioning.explain_sequence(e.selected, c.spec, shardings))
